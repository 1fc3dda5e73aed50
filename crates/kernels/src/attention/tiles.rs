//! Which FlashAttention kernels run ([`FlashPath`]) and, on tensor cores, with which tile shapes
//! ([`MmaTiles`]: the defaults per head dim and mask, and the `BURNMIX_FLASH_TILES` overrides).

use burn::tensor::DType;
use burn_cubecl::tensor::CubeTensor;
use burn_cubecl::CubeRuntime;
use cubecl::ir::features::MmaConfig;

use crate::launch::plane_size;

/// Largest head dimension the kernels accept (the portable kernels keep a row in registers).
pub const MAX_HEAD_DIM: usize = 256;
/// Warps per cube of the tensor-core kernels unless [`MmaTiles`] says otherwise.
const PLANES: usize = 4;
/// Key/value buffers of the tensor-core forward unless [`MmaTiles`] says otherwise: each block is
/// copied one block ahead of its use. Three buffers (two ahead) measured the same on an H100 (see
/// docs/results/2026-11-27-day.md) and would cost hd 128 its second cube per SM next to the
/// output's staging rows.
const FWD_STAGES: usize = 2;

/// Tile shapes of the tensor-core kernels: row tiles of 16 per warp (`mt`, so a cube owns
/// `planes * mt * 16` rows), the depth of the blocks streamed past them, the warps per cube, and
/// where dQ is computed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct MmaTiles {
    /// Forward: query row tiles per warp, keys per block.
    pub fwd: (usize, usize),
    /// dQ: query row tiles per warp, keys per block.
    pub dq: (usize, usize),
    /// dK/dV: key row tiles per warp, queries per block.
    pub dkdv: (usize, usize),
    /// Warps per cube of the forward, dQ and dK/dV kernels (a cube owns `planes * mt * 16` rows).
    pub fwd_planes: usize,
    pub dq_planes: usize,
    pub dkdv_planes: usize,
    /// Key/value buffers of the forward's ring (2 or 3): blocks copied `fwd_stages - 1` ahead.
    pub fwd_stages: usize,
    /// The forward stages its output with `stmatrix` where the device has it (sm_90); off, a
    /// pair of elements per lane and tile (the path of devices without it).
    pub stmatrix: bool,
    /// dQ inside the dK/dV kernel (`dS k` from a shared-memory dS, added to an f32 buffer with
    /// atomics) instead of the separate dQ kernel, which recomputes `q k^T` and `dO v^T`.
    pub fused_dq: bool,
    /// The dK/dV kernel splits each query block's work over its warps in FlashAttention-2's
    /// layouts (`flash_backward_split_mma`: 32 keys a warp, P^T and dS^T through shared memory;
    /// dQ there where `fused_dq`) instead of giving each warp whole key rows.
    pub split_bwd: bool,
}

impl MmaTiles {
    /// Defaults per head_dim and mask, from `attention_bench` sweeps (see docs/results/:
    /// 2026-11-23-later.md, 2026-11-26-late.md, 2026-11-27.md, 2026-11-27-final.md). Two row
    /// tiles per warp halve the shared-memory reads per MMA (see `mma/fragments.rs`); 32-key
    /// forward blocks beat 16 (hd 128: 222 against 178 TFLOP/s on an H100) and matched 48 and 64
    /// within the run-to-run spread. Forward blocks: 128 keys at hd 64 (H100, three alternated
    /// runs, docs/results/2026-11-27-late.md): 7-10% over 32 without a mask at S = 1024 to 8192,
    /// 4-10% with the causal mask from S = 2048 on, equal at causal S = 1024; 64 and 96 fell
    /// between. At hd 128, 32 keys: 48 and 64 lost 15-25% there (the score tile next to 128
    /// output accumulators a lane).
    ///
    /// **Backward at hd 128** (and other multiples of 32 but 64): FlashAttention-2's split warp
    /// layouts with dQ fused, 8-warp cubes of 128 keys (32 a warp), 64-query blocks, with either
    /// mask. H100, docs/results/2026-11-27-final.md: causal S = 4096 217-219 TFLOP/s against
    /// 192-194 for the whole-row layout with the separate dQ kernel (the previous default),
    /// S = 1024 144-150 against 136-140; without the mask 248-251 against 217-218. The split
    /// layout's 4-warp causal cubes lost (121-123 and 170-171). Other multiples of 16 keep the
    /// whole-row layout with the separate dQ kernel (2 x 32) and dK/dV cubes of one row tile per
    /// warp.
    ///
    /// **At hd 64** the fused dQ in the whole-row layout wins (193 against 177): 8 warps x 2 row
    /// tiles = 256 keys per cube, 32-query blocks; the split layout lost (causal S = 4096 188
    /// against 227). **Causal masks** take its dK/dV cubes of 4 warps (half the keys per cube): a
    /// key block's work shrinks with its position (it meets only the queries at or after it),
    /// and smaller cubes even out the tail. H200, S = 1024: hd 64 backward 110.6-111.2 TFLOP/s
    /// with 8 warps against 121.7-121.8 with 4 (SDPA: 153.7); without the mask 4 warps lost 2-4%
    /// at S = 4096, so full attention keeps 8.
    fn for_head_dim(hd: usize, causal: bool) -> Self {
        let dkdv_planes = if causal { 4 } else { 8 };
        if hd == 64 {
            MmaTiles {
                fwd: (2, 128),
                dq: (2, 32),
                dkdv: (2, 32),
                fwd_planes: PLANES,
                dq_planes: PLANES,
                dkdv_planes,
                fwd_stages: FWD_STAGES,
                stmatrix: true,
                fused_dq: true,
                split_bwd: false,
            }
        } else {
            // The split layout halves head_dim between two warps of a key group.
            let split = hd.is_multiple_of(32);
            MmaTiles {
                fwd: (2, 32),
                dq: (2, 32),
                dkdv: (1, 64),
                fwd_planes: PLANES,
                dq_planes: PLANES,
                dkdv_planes: if split { 8 } else { dkdv_planes },
                fwd_stages: FWD_STAGES,
                stmatrix: true,
                fused_dq: split,
                split_bwd: split,
            }
        }
    }

    /// The defaults, with any override from [`crate::settings::Settings::flash_tiles`].
    pub(crate) fn get(hd: usize, causal: bool) -> Self {
        let mut tiles = Self::for_head_dim(hd, causal);
        crate::settings::read(|s| {
            if let Some(t) = &s.flash_tiles {
                // Checked when the setting was made (`check_tiles`).
                if let Err(e) = tiles.apply(t.spec()) {
                    panic!("flash tiles {:?}: {e}", t.spec());
                }
            }
        });
        tiles
    }

    /// Applies `fwd=2x64,dq=1x32,...`: row tiles 1, 2 or 4; block depth a multiple of 16 from 16
    /// to 128; `NAME=MTxBLOCKxWARPS` also sets the kernel's warps per cube (4 or 8); `dq=fused` or
    /// `dq=separate` chooses where dQ is computed; `stages=2` or `3` sets the forward's key/value
    /// buffers; `stmatrix=off` stages the forward's output without `stmatrix`; `bwd=split` runs
    /// the dK/dV kernel in FlashAttention-2's warp layouts (with the fused or the separate dQ),
    /// `bwd=rows` with whole key rows per warp.
    fn apply(&mut self, spec: &str) -> Result<(), String> {
        for item in spec.split(',').map(str::trim).filter(|s| !s.is_empty()) {
            let (name, value) = item
                .split_once('=')
                .ok_or_else(|| format!("`{item}` is not NAME=MTxBLOCK"))?;
            if name == "dq" && (value == "fused" || value == "separate") {
                self.fused_dq = value == "fused";
                continue;
            }
            if name == "bwd" {
                self.split_bwd = match value {
                    "split" => true,
                    "rows" => false,
                    _ => {
                        return Err(format!(
                            "`{item}`: the backward layout must be `split` or `rows`"
                        ))
                    }
                };
                continue;
            }
            if name == "stmatrix" && (value == "on" || value == "off") {
                self.stmatrix = value == "on";
                continue;
            }
            if name == "stages" {
                self.fwd_stages = match value {
                    "2" => 2,
                    "3" => 3,
                    _ => return Err(format!("`{item}`: the forward's stages must be 2 or 3")),
                };
                continue;
            }
            let parts: Vec<&str> = value.split('x').collect();
            if parts.len() != 2 && parts.len() != 3 {
                let fused = if name == "dq" {
                    ", `fused` or `separate`"
                } else {
                    ""
                };
                return Err(format!(
                    "`{value}` is not MTxBLOCK or MTxBLOCKxWARPS (e.g. 2x64 or 1x64x8){fused}"
                ));
            }
            let num = |what: &str, x: &str| {
                x.parse::<usize>()
                    .map_err(|_| format!("{what} `{x}` is not a number"))
            };
            let (mt, block) = (num("row tiles", parts[0])?, num("block", parts[1])?);
            if ![1, 2, 4].contains(&mt) || block % 16 != 0 || !(16..=128).contains(&block) {
                return Err(format!("`{item}`: row tiles must be 1, 2 or 4 and the block a multiple of 16 from 16 to 128"));
            }
            let warps = match parts.get(2) {
                Some(w) => {
                    let w = num("warps", w)?;
                    if w != 4 && w != 8 {
                        return Err(format!("`{item}`: warps must be 4 or 8"));
                    }
                    w
                }
                None => PLANES,
            };
            match name {
                "fwd" => (self.fwd, self.fwd_planes) = ((mt, block), warps),
                "dq" => (self.dq, self.dq_planes) = ((mt, block), warps),
                "dkdv" => (self.dkdv, self.dkdv_planes) = ((mt, block), warps),
                _ => {
                    return Err(format!(
                        "unknown setting `{name}`; expected fwd, dq, dkdv, stages, stmatrix or bwd"
                    ))
                }
            }
        }
        Ok(())
    }

    /// The forward's key/value buffers: `fwd_stages`, or 2 where a third would not fit the cube's
    /// `smem` bytes of shared memory (large overridden tiles) with `elem`-byte elements.
    pub(crate) fn forward_stages(&self, hd: usize, elem: usize, smem: usize) -> usize {
        let ((mt, block_k), pitch) = (self.fwd, hd + 8);
        let bytes = |stages: usize| {
            (2 * self.fwd_planes * mt * 16 + 2 * stages * block_k) * pitch * elem + 64
        };
        if self.fwd_stages > 2 && bytes(self.fwd_stages) > smem {
            2
        } else {
            self.fwd_stages
        }
    }

    /// Why the backward cannot run with these dK/dV tiles at `hd`, if it cannot: the split
    /// layout gives each warp 32 keys, and the fused dQ's warps split the query block's 16-row
    /// tiles and head_dim into column groups of a multiple of 16.
    pub(crate) fn backward_problem(&self, hd: usize) -> Option<String> {
        let (row_tiles, planes) = (self.dkdv.1 / 16, self.dkdv_planes);
        if self.split_bwd {
            // 32 keys a warp: `planes * mt / 2` key warps, `2 / mt` query (column) groups.
            let (mt, block_q) = self.dkdv;
            let groups = if mt <= 2 { 2 / mt } else { 0 };
            if groups == 0
                || !block_q.is_multiple_of(16 * groups)
                || !hd.is_multiple_of(16 * groups)
            {
                return Some(format!(
                    "bwd=split gives each warp 32 keys: dkdv's row tiles must be 1 or 2, and with 1 the query block \
                     ({block_q}) and head_dim ({hd}) must split into two groups of a multiple of 16"
                ));
            }
        }
        if !self.fused_dq {
            return None;
        }
        let ok = if row_tiles >= planes {
            row_tiles % planes == 0
        } else {
            planes.is_multiple_of(row_tiles) && (hd / (planes / row_tiles)).is_multiple_of(16)
        };
        (!ok).then(|| {
            format!(
                "dq=fused needs the dK/dV query block's {row_tiles} row tiles of 16 and its {planes} warps to divide one another, \
                 with head_dim {hd} split into column groups of a multiple of 16"
            )
        })
    }
}

/// Checks a tile override (see [`crate::settings::FlashTiles`]) without applying it.
pub(crate) fn check_tiles(spec: &str) -> Result<(), String> {
    MmaTiles::for_head_dim(128, false).apply(spec)
}

/// Which kernels run for a given input.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FlashPath {
    /// Warp-level `mma.sync` m16n8k16 (f16/bf16 on CUDA, head_dim a multiple of 16 up to 128).
    TensorCores,
    /// One unit per row, f32 FMA (every runtime and dtype).
    Portable,
}

impl std::fmt::Display for FlashPath {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            FlashPath::TensorCores => "tensor cores (mma.sync m16n8k16)",
            FlashPath::Portable => "portable (f32 FMA)",
        })
    }
}

/// The path [`forward`] and [`backward`] take for `q`.
pub(crate) fn path<R: CubeRuntime>(q: &CubeTensor<R>) -> FlashPath {
    let hd = q.meta.shape()[q.meta.num_dims() - 1];
    let props = q.client.properties();
    let low = matches!(q.dtype, DType::F16 | DType::BF16);
    let warp32 = plane_size(q) == 32;
    let mma = low
        && warp32
        && props.features.matmul.mma.contains(&MmaConfig {
            a_type: q.dtype.into(),
            b_type: q.dtype.into(),
            cd_type: DType::F32.into(),
            m: 16,
            n: 8,
            k: 16,
        });
    if mma && hd.is_multiple_of(16) && hd <= 128 {
        FlashPath::TensorCores
    } else {
        FlashPath::Portable
    }
}

#[cfg(test)]
mod tests {
    use super::MmaTiles;

    #[test]
    fn default_tiles_can_run_at_every_tensor_core_head_dim() {
        for hd in (16..=128).step_by(16) {
            for causal in [false, true] {
                let t = MmaTiles::for_head_dim(hd, causal);
                assert!(
                    t.backward_problem(hd).is_none(),
                    "hd {hd}, causal {causal}: {t:?}"
                );
            }
        }
    }

    #[test]
    fn tile_override_parses_and_rejects_bad_specs() {
        let mut t = MmaTiles::for_head_dim(128, false);
        t.apply("fwd=1x64, dkdv=2x16, bwd=rows, dq=separate")
            .unwrap();
        assert_eq!(
            t,
            MmaTiles {
                fwd: (1, 64),
                dkdv: (2, 16),
                dkdv_planes: 4,
                fused_dq: false,
                split_bwd: false,
                ..MmaTiles::for_head_dim(128, false)
            }
        );
        t.apply("dq=fused,dkdv=1x64x8").unwrap();
        assert!(t.fused_dq);
        assert_eq!((t.dkdv, t.dkdv_planes), ((1, 64), 8));
        assert_eq!(t.backward_problem(128), None);
        // 8 warps over one 16-row tile: column groups of 8 at head_dim 64.
        t.apply("dkdv=1x16x8").unwrap();
        assert!(t.backward_problem(64).is_some());
        assert_eq!(t.backward_problem(128), None);
        t.apply("dq=separate").unwrap();
        assert!(!t.fused_dq);
        t.apply("fwd=1x32x8").unwrap();
        assert_eq!((t.fwd, t.fwd_planes, t.dq_planes), ((1, 32), 8, 4));
        assert_eq!(t.fwd_stages, 2);
        t.apply("stages=3").unwrap();
        assert_eq!(t.fwd_stages, 3);
        // 8 warps x 16 query and output rows and 3 x 2 blocks of 32 key/value rows, 136 bf16
        // each: 119 KiB.
        assert_eq!(t.forward_stages(128, 2, 227 * 1024), 3);
        assert_eq!(t.forward_stages(128, 2, 100 * 1024), 2);
        t.apply("stages=2").unwrap();
        assert_eq!(t.fwd_stages, 2);
        assert!(t.stmatrix);
        t.apply("stmatrix=off").unwrap();
        assert!(!t.stmatrix);
        // The split backward with the fused dQ is hd 128's default (and that of multiples of 32
        // but 64), in 8-warp cubes with either mask; other head dims keep whole key rows.
        for causal in [false, true] {
            for hd in [96, 128] {
                let t = MmaTiles::for_head_dim(hd, causal);
                assert!(t.split_bwd && t.fused_dq && t.dkdv_planes == 8);
                assert_eq!(t.backward_problem(hd), None);
            }
            for hd in [16, 48, 64, 80] {
                let t = MmaTiles::for_head_dim(hd, causal);
                assert!(!t.split_bwd);
                assert_eq!(t.backward_problem(hd), None);
            }
        }
        // `bwd=split` keeps the default or chosen dQ.
        let mut t = MmaTiles::for_head_dim(128, false);
        t.apply("bwd=rows,dq=separate").unwrap();
        t.apply("bwd=split").unwrap();
        assert!(t.split_bwd && !t.fused_dq);
        assert_eq!(t.backward_problem(128), None);
        t.apply("dq=fused").unwrap();
        assert!(t.split_bwd && t.fused_dq);
        assert_eq!(t.backward_problem(128), None);
        assert_eq!(t.backward_problem(64), None);
        t.apply("dkdv=4x64x8").unwrap();
        assert!(t.backward_problem(128).is_some());
        t.apply("dq=separate").unwrap();
        assert!(t.backward_problem(128).is_some());
        t.apply("dkdv=1x48x8").unwrap();
        assert!(t.backward_problem(128).is_some());
        t.apply("bwd=rows,dq=separate").unwrap();
        assert!(!t.split_bwd && !t.fused_dq);
        assert_eq!(t.backward_problem(128), None);
        for bad in [
            "fwd=3x64",
            "fwd=2x24",
            "fwd=2x256",
            "fwd=2",
            "bwd=1x64",
            "bwd=fa2",
            "fwd",
            "fwd=1x64x6",
            "stages=4",
            "stages=",
            "stmatrix=no",
            "dkdv=1x64x8x2",
            "dq=atomic",
        ] {
            let err = MmaTiles::for_head_dim(64, false).apply(bad).unwrap_err();
            assert!(!err.is_empty(), "{bad}");
        }
    }
}
