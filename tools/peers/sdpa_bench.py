#!/usr/bin/env python3
"""PyTorch SDPA (its FlashAttention-2 and cuDNN backends, bf16) at attention_bench's shapes, with and
without dropout.

Same conventions as `attention_bench`: batch x seq = 16384 tokens, heads x head_dim = 2048; forward
FLOPs 4 * b * h * s^2 * d (halved when causal), backward 2.5x the forward. Prints a markdown table of
TFLOP/s (median of --reps timings of --iters calls each), for comparing with attention_bench's
fwd / bwd columns on the same GPU:

    python3 tools/peers/sdpa_bench.py --seqs 1024,4096 --head-dims 64,128 --dropout 0,0.1

`--backends flash,cudnn` (the default) times each backend in turn; on Hopper the cuDNN backend runs
cuDNN's FlashAttention-3-class kernels (warpgroup MMA, TMA). A backend that refuses a case (cuDNN
with dropout, on some versions) prints `-`.
"""
import argparse
import statistics

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel


def timed(fn, iters, reps):
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / iters / 1e3)
    return statistics.median(times)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--seqs", default="1024,4096")
    ap.add_argument("--head-dims", default="64,128")
    ap.add_argument("--dropout", default="0,0.1")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--backends", default="flash,cudnn")
    a = ap.parse_args()
    backends = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION}
    chosen = [x for x in a.backends.split(",") if x]
    for name in chosen:
        if name not in backends:
            raise SystemExit(f"--backends: `{name}` is not one of flash, cudnn")
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}")
    cols = " | ".join(f"{n} fwd | {n} bwd" for n in chosen)
    print(f"| hd | mask | S | B x H | dropout | {cols} |")
    print("|---|---|---|---|---|" + "---|---|" * len(chosen))
    for hd in [int(x) for x in a.head_dims.split(",")]:
        for causal in (False, True):
            for s in [int(x) for x in a.seqs.split(",")]:
                for p in [float(x) for x in a.dropout.split(",")]:
                    b, h = 16384 // s, 2048 // hd
                    q, k, v = (torch.randn(b, h, s, hd, device="cuda", dtype=torch.bfloat16,
                                           requires_grad=True) for _ in range(3))
                    do = torch.randn(b, h, s, hd, device="cuda", dtype=torch.bfloat16)
                    flops = 4 * b * h * s * s * hd * (0.5 if causal else 1.0)
                    cells = []
                    for name in chosen:
                        try:
                            with sdpa_kernel(backends[name]):
                                fwd = lambda: F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=causal)
                                t_fwd = timed(fwd, a.iters, a.reps)

                                def both():
                                    o = fwd()
                                    torch.autograd.grad(o, (q, k, v), do)
                                t_bwd = timed(both, a.iters, a.reps) - t_fwd
                            cells.append(f"{flops / t_fwd / 1e12:.1f} | {2.5 * flops / t_bwd / 1e12:.1f}")
                        except RuntimeError:
                            cells.append("- | -")
                    print(f"| {hd} | {'causal' if causal else 'full'} | {s} | {b} x {h} | {p} | "
                          + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
