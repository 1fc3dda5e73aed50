#!/usr/bin/env python3
"""PyTorch's exact (erf) GELU at kernel_bench's gelu shape, for the same GPU's comparison.

Times `F.gelu(x)` (forward) and `torch.ops.aten.gelu_backward(dy, x)` (the backward kernel
alone), eager and through `torch.compile`, in each dtype: median of --reps timings of --iters
calls, with the achieved bandwidth (forward: read x, write y; backward: read x and dy, write dx).

    python3 tools/peers/gelu_bench.py --rows 16384 --cols 4096 --dtypes bf16,f32
"""
import argparse

import torch
import torch.nn.functional as F

from sdpa_bench import timed


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=16384)
    ap.add_argument("--cols", type=int, default=4096)
    ap.add_argument("--dtypes", default="bf16,f32")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--reps", type=int, default=15)
    args = ap.parse_args()
    names = {"bf16": torch.bfloat16, "f16": torch.float16, "f32": torch.float32}
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}")
    print("| dtype | op | mode | us | GB/s |")
    print("|---|---|---|---|---|")
    for name in args.dtypes.split(","):
        dt = names[name]
        x = torch.randn(args.rows, args.cols, device="cuda", dtype=dt)
        dy = torch.randn_like(x)
        n = x.numel() * x.element_size()
        fwd = lambda: F.gelu(x)
        bwd = lambda: torch.ops.aten.gelu_backward(dy, x)
        cfwd = torch.compile(lambda t: F.gelu(t))
        cbwd = torch.compile(lambda g, t: torch.ops.aten.gelu_backward(g, t))
        for op, mode, fn, moved in [
            ("forward", "eager", fwd, 2 * n),
            ("backward", "eager", bwd, 3 * n),
            ("forward", "compile", lambda: cfwd(x), 2 * n),
            ("backward", "compile", lambda: cbwd(dy, x), 3 * n),
        ]:
            t = timed(fn, args.iters, args.reps)
            print(f"| {name} | {op} | {mode} | {t * 1e6:.1f} | {moved / t / 1e9:.0f} |")


if __name__ == "__main__":
    main()
