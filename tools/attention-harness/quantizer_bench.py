#!/usr/bin/env python3
"""Times the FP8 attention forward's quantizer kernels (crates/kernels/src/attention/hopper/
fp8_quantize.cu: q in scale blocks of 64 rows, k of 128, v transposed), built with nvcc, at
attention_bench's shapes (bf16, batch x seq = 16384, heads x head_dim = 2048, laid out [b, s, h, d]
as a packed projection's views are). For an H100 or H200 with nvcc and PyTorch:

    python3 tools/attention-harness/quantizer_bench.py [--against OLD.cu]

GB/s counts the 2 bytes read and the 1 written of each value. `--against` builds another version
of fp8_quantize.cu beside the working tree's (e.g. `git show REV:crates/kernels/src/attention/
hopper/fp8_quantize.cu > /tmp/old.cu`, with this tree's common.cuh) and times both in turn on the
same inputs. fp8_forward.py checks the kernels' output bit for bit; this only times them.
"""
import argparse
import os
import sys

import torch

from fp8_forward import K_ROWS, Q_ROWS, Quantizer, build_quantizers
from sdpa_bench import timed  # on the path fp8_forward sets

KERNELS = (("q", Q_ROWS, False), ("k", K_ROWS, False), ("v transposed", K_ROWS, True))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--build-dir", default="/tmp/attention-harness")
    ap.add_argument("--nvcc", default="nvcc")
    ap.add_argument("--against", metavar="OLD.cu", help="another fp8_quantize.cu to time beside this tree's")
    a = ap.parse_args()
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}")
    if torch.cuda.get_device_capability() != (9, 0):
        sys.exit("the kernels need a compute capability 9.0 GPU (H100, H200)")
    tree_dir, old_dir = os.path.join(a.build_dir, "quantizer-tree"), os.path.join(a.build_dir, "quantizer-against")
    if not build_quantizers(tree_dir, a.nvcc) or (a.against and not build_quantizers(old_dir, a.nvcc, a.against)):
        sys.exit(1)
    new, old = Quantizer(tree_dir), Quantizer(old_dir) if a.against else None
    cols = "| hd | S | kernel | " + ("old µs | " if old else "") + "µs | GB/s |" + (" old / new |" if old else "")
    print(cols)
    print("|---" * cols.count(" |") + "|")
    for hd in (64, 128):
        for s in (1024, 4096):
            b, h = 16384 // s, 2048 // hd
            x = torch.randn(b, s, h, hd, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
            for name, rows, transposed in KERNELS:
                t = timed(new.launcher(x, rows, transposed)[0], 20, 5)
                gbs = x.numel() * 3 / t / 1e9
                if old:
                    t_old = timed(old.launcher(x, rows, transposed)[0], 20, 5)
                    print(f"| {hd} | {s} | {name} | {t_old * 1e6:.1f} | {t * 1e6:.1f} | {gbs:.0f} | {t_old / t:.2f}x |")
                else:
                    print(f"| {hd} | {s} | {name} | {t * 1e6:.1f} | {gbs:.0f} |")


if __name__ == "__main__":
    main()
