//! The size of the sections the Hopper forward walks its tiles by under the causal mask.
//!
//! The forward's blocks are persistent and take their tiles in a fixed order (`Tile` in
//! `forward.cu`): block `i` takes tile `n * grid + i` in even rounds `n` and
//! `n * grid + grid - 1 - i` in odd ones. Under the causal mask a tile's work is its number of key
//! blocks, which grows with its query block, and the tiles go by sections of `section` (batch,
//! head) pairs: within a section by query block, the ones with the most keys first, then by pair.
//! A section's pairs' keys and values should fit in L2 together (that bounds `section`), but where
//! the rounds of `grid` tiles fall across the sections decides how even the blocks' loads come
//! out, and as the blocks never trade tiles, the kernel takes as long as its busiest block. With
//! the largest section that fits, the model below puts the busiest block of a 132-SM GPU at
//! 1.06-1.24x the mean load at `attention_bench`'s causal shapes; [`causal_section`] tries every
//! section size up to the bound and takes the most even (1.01x at those shapes).
//!
//! The model counts a tile's work in key blocks, plus a fixed cost a tile (its start, its first
//! scores without overlap, its output) and an extra cost a block that needs the mask; as neither
//! is known exactly, a size is judged by its worst result over three guesses of them.
//! `tools/attention-harness/schedule.py` is the same model for the harness.

use std::collections::HashMap;
use std::sync::Mutex;

/// Keys a block of the forward reads at a time (`BC` in forward.cu).
const BLOCK_K: usize = super::BLOCK_K;

/// (extra cost a tile, extra cost a masked key block), in key blocks: the guesses a section size
/// is judged by.
const COSTS: [(f64, f64); 3] = [(0.5, 0.0), (1.0, 0.3), (2.0, 0.0)];

/// At most this many tile visits (tiles x sizes tried) a call shape: a few milliseconds, once.
const WORK: usize = 1 << 23;

/// Call shapes remembered at once (a run with ever new sequence lengths starts over past this).
const SHAPES: usize = 1024;

/// A causal forward call's tiles: what the order and the loads depend on.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug)]
pub(super) struct CausalTiles {
    pub seq_q: usize,
    pub seq_k: usize,
    /// Query rows a tile (`BR` in forward.cu).
    pub block_q: usize,
    /// (batch, head) pairs.
    pub pairs: usize,
    /// Persistent blocks: the tiles or the SMs, whichever is fewer.
    pub grid: usize,
}

impl CausalTiles {
    fn q_blocks(&self) -> usize {
        self.seq_q.div_ceil(self.block_q)
    }

    fn tiles(&self) -> usize {
        self.q_blocks() * self.pairs
    }

    /// Key blocks a tile of query block `qb` reads, and how many of them need the mask (they
    /// reach past the end of the keys or past the tile's first query row), as forward.cu counts
    /// them.
    fn work(&self, qb: usize) -> (usize, usize) {
        let q0 = qb * self.block_q;
        let blocks = self
            .seq_k
            .div_ceil(BLOCK_K)
            .min((q0 + self.block_q - 1) / BLOCK_K + 1);
        let masked = (0..blocks)
            .filter(|&j| (j + 1) * BLOCK_K > self.seq_k || (j + 1) * BLOCK_K - 1 > q0)
            .count();
        (blocks, masked)
    }

    /// The query block of tile `t` with sections of `section` pairs (`Tile` in forward.cu).
    fn query_block(&self, t: usize, section: usize) -> usize {
        let q_blocks = self.q_blocks();
        let per_section = section * q_blocks;
        let (sec, r) = (t / per_section, t % per_section);
        let len = (self.pairs - sec * section).min(section);
        q_blocks - 1 - r / len
    }

    /// The block that takes tile `t` (`Tile::index` in forward.cu, inverted).
    fn block(&self, t: usize) -> usize {
        let (n, i) = (t / self.grid, t % self.grid);
        if n % 2 == 1 {
            self.grid - 1 - i
        } else {
            i
        }
    }

    /// (key blocks, masked key blocks) of each query block's tiles.
    fn works(&self) -> Vec<(usize, usize)> {
        (0..self.q_blocks()).map(|qb| self.work(qb)).collect()
    }

    /// The busiest block's load over the mean, at `section`, for each guess of [`COSTS`]; `work`
    /// from [`Self::works`].
    fn imbalance(&self, section: usize, work: &[(usize, usize)]) -> [f64; COSTS.len()] {
        // Per block: key blocks, tiles, masked key blocks.
        let mut load = vec![[0usize; 3]; self.grid];
        for t in 0..self.tiles() {
            let (blocks, masked) = work[self.query_block(t, section)];
            let l = &mut load[self.block(t)];
            l[0] += blocks;
            l[1] += 1;
            l[2] += masked;
        }
        COSTS.map(|(tile, mask)| {
            let cost = |l: &[usize; 3]| l[0] as f64 + tile * l[1] as f64 + mask * l[2] as f64;
            let max = load.iter().map(cost).fold(0.0, f64::max);
            let mean = load.iter().map(cost).sum::<f64>() / self.grid as f64;
            if mean > 0.0 {
                max / mean
            } else {
                1.0
            }
        })
    }
}

/// The section size, at most `bound` pairs (what fits in L2), that evens out the blocks' loads
/// best under every guess of the costs; between sizes that do equally well (to 0.1%), the
/// largest. Sizes are tried from `bound` down as far as [`WORK`] allows; a call of more tiles
/// than that keeps `bound`. Remembered per call shape (up to [`SHAPES`] of them): the model runs
/// once per shape and process.
pub(super) fn causal_section(tiles: CausalTiles, bound: usize) -> usize {
    static CHOSEN: Mutex<Option<HashMap<(CausalTiles, usize), usize>>> = Mutex::new(None);
    let bound = bound.clamp(1, tiles.pairs.max(1));
    if tiles.grid == 0 || tiles.tiles() == 0 || tiles.tiles() > WORK {
        return bound;
    }
    let key = (tiles, bound);
    if let Some(&s) = CHOSEN
        .lock()
        .unwrap()
        .get_or_insert_with(HashMap::new)
        .get(&key)
    {
        return s;
    }
    let sizes = (WORK / tiles.tiles()).clamp(1, bound);
    let work = tiles.works();
    let worst = |s: usize| {
        let w = tiles.imbalance(s, &work).into_iter().fold(0.0, f64::max);
        (w * 1000.0).round() as u64
    };
    let mut best = (worst(bound), bound);
    for s in (bound + 1 - sizes..bound).rev() {
        let w = worst(s);
        if w < best.0 {
            best = (w, s);
        }
    }
    let mut chosen = CHOSEN.lock().unwrap();
    let chosen = chosen.get_or_insert_with(HashMap::new);
    if chosen.len() >= SHAPES {
        chosen.clear();
    }
    chosen.insert(key, best.1);
    best.1
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `attention_bench`'s causal shapes (batch x seq = 16384, heads x head_dim = 2048) on a GPU
    /// of 132 SMs and 50 MB of L2, as the launcher describes them.
    fn bench_shape(hd: usize, seq: usize) -> (CausalTiles, usize) {
        let block_q = if hd == 64 && seq >= 2048 { 192 } else { 128 };
        let pairs = (16384 / seq) * (2048 / hd);
        let tiles = CausalTiles {
            seq_q: seq,
            seq_k: seq,
            block_q,
            pairs,
            grid: (seq.div_ceil(block_q) * pairs).min(132),
        };
        let bound = (50 * 1024 * 1024 / 2 / (2 * seq * hd * 2)).clamp(1, pairs);
        (tiles, bound)
    }

    fn worst(t: &CausalTiles, s: usize) -> f64 {
        t.imbalance(s, &t.works()).into_iter().fold(0.0, f64::max)
    }

    #[test]
    fn every_tile_goes_to_one_block_and_every_query_block_to_each_pair() {
        for (seq_q, block_q, pairs, grid, section) in [
            (1000, 128, 7, 5, 3),
            (4096, 192, 128, 132, 22),
            (300, 128, 3, 132, 2),
        ] {
            let t = CausalTiles {
                seq_q,
                seq_k: seq_q,
                block_q,
                pairs,
                grid: grid.min(seq_q.div_ceil(block_q) * pairs),
            };
            let mut count = vec![0usize; t.q_blocks()];
            for i in 0..t.tiles() {
                assert!(t.block(i) < t.grid);
                count[t.query_block(i, section)] += 1;
            }
            assert!(count.iter().all(|&c| c == pairs), "{count:?}");
        }
    }

    #[test]
    fn work_counts_the_keys_up_to_the_diagonal() {
        let t = CausalTiles {
            seq_q: 1000,
            seq_k: 1000,
            block_q: 192,
            pairs: 1,
            grid: 1,
        };
        // Rows 0..191 see keys 0..191: blocks 0 and 1, both crossing the diagonal.
        assert_eq!(t.work(0), (2, 2));
        // Rows 768..959 see keys up to 959: blocks 0..=7, the two from key 768 on masked.
        assert_eq!(t.work(4), (8, 2));
        // The last rows 960..999 (a partial tile): all 8 blocks, the last one past the end.
        assert_eq!(t.work(5), (8, 1));
    }

    #[test]
    fn the_chosen_sections_even_out_the_bench_shapes() {
        for (hd, seq) in [(64, 1024), (64, 4096), (128, 1024), (128, 4096)] {
            let (t, bound) = bench_shape(hd, seq);
            let s = causal_section(t, bound);
            assert!((1..=bound).contains(&s));
            let (before, after) = (worst(&t, bound), worst(&t, s));
            assert!(after <= before, "hd {hd} seq {seq}: {after} > {before}");
            assert!(
                after < 1.03,
                "hd {hd} seq {seq}: section {s} leaves {after}"
            );
        }
        // The uneven case that showed it: 192-row tiles at 4096 positions.
        let (t, bound) = bench_shape(64, 4096);
        assert!(worst(&t, bound) > 1.2);
    }

    #[test]
    fn small_and_odd_calls_keep_a_valid_section() {
        for (seq, pairs, grid, bound) in [(1, 1, 1, 1), (130, 3, 6, 7), (5000, 2, 80, 1)] {
            let t = CausalTiles {
                seq_q: seq,
                seq_k: seq + 3,
                block_q: 128,
                pairs,
                grid,
            };
            let s = causal_section(t, bound);
            assert!(s >= 1 && s <= bound.min(pairs), "{s}");
        }
    }
}
