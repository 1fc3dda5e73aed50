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
import ctypes
import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "peers"))
from sdpa_bench import timed  # noqa: E402

from nvcc_build import build_variants  # noqa: E402

KERNELS = (("q", 64, False), ("k", 128, False), ("v transposed", 128, True))


def build(out_dir, nvcc, tag, source):
    """{(hd, rows): library path}, or None if a build failed."""
    os.makedirs(out_dir, exist_ok=True)
    jobs, libs = {}, {}
    extra = [f'-DQUANT_SOURCE="{os.path.abspath(source)}"'] if source else []
    for hd in (64, 128):
        for rows in (64, 128):
            lib = os.path.join(out_dir, f"quant_{tag}_{hd}_{rows}.so")
            jobs[f"{tag} quantizer hd {hd} rows {rows}"] = (lib, [f"-DHD={hd}", "-DIS_BF16=1", f"-DROWS={rows}", *extra])
            libs[(hd, rows)] = lib
    if not build_variants(nvcc, os.path.join(HERE, "host_quant.cu"), "attention_fp8_vt", jobs):
        return None
    return {key: ctypes.CDLL(lib) for key, lib in libs.items()}


def launcher(lib, x, rows, transposed):
    """A call of the kernel on x [b, h, s, d] into fresh outputs."""
    b, h, s, d = x.shape
    keys = -(-s // 32) * 32
    out = torch.empty((b, h, d, keys) if transposed else (b, h, s, d), dtype=torch.uint8, device=x.device)
    scale = torch.empty(b, h, -(-s // rows), dtype=torch.float32, device=x.device)
    strides = (ctypes.c_uint64 * 3)(*x.stride()[:3])
    args = (ctypes.c_void_p(x.data_ptr()), ctypes.c_void_p(out.data_ptr()), ctypes.c_void_p(scale.data_ptr()),
            ctypes.c_uint64(b), ctypes.c_uint64(h), ctypes.c_uint64(s), strides, ctypes.c_int(int(transposed)))

    def call():
        rc = lib.quantize(*args, ctypes.c_void_p(torch.cuda.current_stream().cuda_stream))
        if rc != 0:
            raise RuntimeError(f"quantizer launch failed with CUDA error {rc}")

    return call


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--build-dir", default="/tmp/attention-harness")
    ap.add_argument("--nvcc", default="nvcc")
    ap.add_argument("--against", metavar="OLD.cu", help="another fp8_quantize.cu to time beside this tree's")
    a = ap.parse_args()
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}")
    if torch.cuda.get_device_capability() != (9, 0):
        sys.exit("the kernels need a compute capability 9.0 GPU (H100, H200)")
    new = build(a.build_dir, a.nvcc, "tree", None)
    old = build(a.build_dir, a.nvcc, "against", a.against) if a.against else None
    if new is None or (a.against and old is None):
        sys.exit(1)
    cols = "| hd | S | kernel | " + ("old µs | " if old else "") + "µs | GB/s |" + (" old / new |" if old else "")
    print(cols)
    print("|---" * cols.count(" |") + "|")
    for hd in (64, 128):
        for s in (1024, 4096):
            b, h = 16384 // s, 2048 // hd
            x = torch.randn(b, s, h, hd, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
            for name, rows, transposed in KERNELS:
                t = timed(launcher(new[(hd, rows)], x, rows, transposed), 20, 5)
                gbs = x.numel() * 3 / t / 1e9
                if old:
                    t_old = timed(launcher(old[(hd, rows)], x, rows, transposed), 20, 5)
                    print(f"| {hd} | {s} | {name} | {t_old * 1e6:.1f} | {t * 1e6:.1f} | {gbs:.0f} | {t_old / t:.2f}x |")
                else:
                    print(f"| {hd} | {s} | {name} | {t * 1e6:.1f} | {gbs:.0f} |")


if __name__ == "__main__":
    main()
