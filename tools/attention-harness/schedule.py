"""The section size the Hopper forward's launcher picks under the causal mask: the model of
crates/kernels/src/attention/hopper/schedule.rs, line for line, so that harness.py launches the
kernel as the Rust side does. See that file for why.

    python3 tools/attention-harness/schedule.py [--sms 132] [--l2-mib 50]

prints the section sizes and the modeled loads at attention_bench's causal shapes (no GPU needed).
"""
import argparse
import math

BLOCK_K = 128
# (extra cost a tile, extra cost a masked key block), in key blocks.
COSTS = ((0.5, 0.0), (1.0, 0.3), (2.0, 0.0))
WORK = 1 << 23


def fits(seq_k, hd, group, pairs, l2_bytes):
    """The most (batch, head) pairs whose keys and values fit in half of L2."""
    kv_bytes = -(-(2 * seq_k * hd * 2) // max(group, 1))
    return min(max(l2_bytes // 2 // max(kv_bytes, 1), 1), max(pairs, 1))


def work(seq_k, block_q, qb):
    q0 = qb * block_q
    blocks = min(-(-seq_k // BLOCK_K), (q0 + block_q - 1) // BLOCK_K + 1)
    masked = sum(1 for j in range(blocks) if (j + 1) * BLOCK_K > seq_k or (j + 1) * BLOCK_K - 1 > q0)
    return blocks, masked


def works(seq_q, seq_k, block_q):
    return [work(seq_k, block_q, qb) for qb in range(-(-seq_q // block_q))]


def imbalance(seq_q, seq_k, block_q, pairs, grid, section, w=None):
    """The busiest block's load over the mean, for each guess of COSTS."""
    q_blocks = -(-seq_q // block_q)
    w = w or works(seq_q, seq_k, block_q)
    load = [[0, 0, 0] for _ in range(grid)]
    per_section = section * q_blocks
    for t in range(q_blocks * pairs):
        sec, r = divmod(t, per_section)
        length = min(pairs - sec * section, section)
        blocks, masked = w[q_blocks - 1 - r // length]
        n, i = divmod(t, grid)
        l = load[grid - 1 - i if n % 2 else i]
        l[0] += blocks
        l[1] += 1
        l[2] += masked
    out = []
    for tile, mask in COSTS:
        cost = [l[0] + tile * l[1] + mask * l[2] for l in load]
        mean = sum(cost) / grid
        out.append(max(cost) / mean if mean > 0 else 1.0)
    return out


def causal_section(seq_q, seq_k, block_q, pairs, grid, bound):
    bound = min(max(bound, 1), max(pairs, 1))
    tiles = -(-seq_q // block_q) * pairs
    if grid == 0 or tiles == 0 or tiles > WORK:
        return bound
    per_block = works(seq_q, seq_k, block_q)

    def worst(s):
        # Halves away from zero, as Rust's f64::round (Python's round() takes them to even).
        return math.floor(max(imbalance(seq_q, seq_k, block_q, pairs, grid, s, per_block)) * 1000.0 + 0.5)

    sizes = min(max(WORK // tiles, 1), bound)
    best = (worst(bound), bound)
    for s in range(bound - 1, bound - sizes, -1):
        w = worst(s)
        if w < best[0]:
            best = (w, s)
    return best[1]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sms", type=int, default=132)
    ap.add_argument("--l2-mib", type=int, default=50)
    a = ap.parse_args()
    print("| hd | S | pairs that fit | busiest / mean | chosen | busiest / mean |")
    print("|---|---|---|---|---|---|")
    for hd in (64, 128):
        for s in (512, 1024, 2048, 4096, 8192):
            block_q = 192 if hd == 64 and s >= 2048 else 128
            pairs = (16384 // s) * (2048 // hd)
            grid = min(-(-s // block_q) * pairs, a.sms)
            bound = fits(s, hd, 1, pairs, a.l2_mib << 20)
            chosen = causal_section(s, s, block_q, pairs, grid, bound)
            w = lambda x: max(imbalance(s, s, block_q, pairs, grid, x))
            print(f"| {hd} | {s} | {bound} | {w(bound):.3f} | {chosen} | {w(chosen):.3f} |")


if __name__ == "__main__":
    main()
