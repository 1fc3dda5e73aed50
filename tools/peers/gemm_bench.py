#!/usr/bin/env python3
"""PyTorch's GEMMs (cuBLAS/cuBLASLt through torch.matmul) at gemm_bench's shapes, for same-GPU ratios.

Same conventions as `gemm_bench`: for each M, K, N the three GEMMs of a linear layer
y [M, N] = x [M, K] W [K, N] (fprop x W, dgrad dy W^T, wgrad x^T dy, each on transposed views, no
copies), TFLOP/s = 2MKN / time, the median of --reps timings of --iters calls each. Prints a markdown
table to set beside gemm_bench's "engine TFLOP/s" column:

    python3 tools/peers/gemm_bench.py --dtypes bf16,f16
"""
import argparse

import torch

from sdpa_bench import timed

SHAPES = [
    (8192, 8192, 8192),
    (4096, 4096, 4096),
    (16384, 768, 2304),
    (16384, 768, 768),
    (16384, 768, 3072),
    (16384, 3072, 768),
    (16384, 768, 50304),
    (768, 16384, 2304),
]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--dtypes", default="bf16")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--reps", type=int, default=7)
    args = ap.parse_args()
    dtypes = {"bf16": torch.bfloat16, "f16": torch.float16}
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}")
    print("| M, K, N | dtype | GEMM | PyTorch TFLOP/s |")
    print("|---|---|---|---|")
    for name in args.dtypes.split(","):
        dt = dtypes[name]
        for m, k, n in SHAPES:
            x = torch.randn(m, k, device="cuda", dtype=dt)
            w = torch.randn(k, n, device="cuda", dtype=dt)
            dy = torch.randn(m, n, device="cuda", dtype=dt)
            flop = 2.0 * m * k * n
            for gemm, fn in [
                ("fprop", lambda: x @ w),
                ("dgrad", lambda: dy @ w.t()),
                ("wgrad", lambda: x.t() @ dy),
            ]:
                t = timed(fn, args.iters, args.reps)
                print(f"| {m}, {k}, {n} | {name} | {gemm} | {flop / t / 1e12:.1f} |")
            del x, w, dy
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
