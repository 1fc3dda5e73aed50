#!/usr/bin/env python3
"""cuBLASLt's heuristic results for the GELU MLP's GEMMs, each timed and named by its kernel.

For the GEMMs of `kernels::gelu_tanh_mlp` on a [M, C] input with an [C, FF] first and [FF, C]
second projection (GPT-2 small at 16 x 1024 tokens by default), with and without the epilogues the
engine gives them:

- `fc`: the first projection's forward `x w_fc` (plain, `GELU`, `GELU_AUX`);
- `proj dgrad`: the second projection's input gradient `dy w_proj^T` (plain, `DGELU`, and
  `DGELU_BGRAD`, which also writes a bias gradient),

asks cuBLASLt (the library the engine loads, `libcublasLt.so`, not PyTorch's copy) for up to
`--count` algorithms under the engine's preferences (32 MiB workspace, 256-byte alignments,
partial sums in f32 only), then for each: its configuration, the median time of `--reps` batches
of `--iters` calls (CUDA events), the kernels it launches (`torch.profiler`) and its largest
difference from PyTorch's result relative to the largest magnitude. Prints a markdown table.

    python3 tools/cublaslt_algos.py [--m 16384 --c 768 --ff 3072] [--dtypes bf16,f16] [--count 16]
"""
import argparse
import ctypes
import os
import sys

import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "peers"))
from sdpa_bench import timed  # noqa: E402

# cuBLASLt's enums (cublasLt.h, CUDA 13.0).
COMPUTE_32F = 68
R_32F, R_16F, R_16BF = 0, 2, 14
DESC_TRANSA, DESC_TRANSB, DESC_EPILOGUE = 3, 4, 7
DESC_BIAS_POINTER, DESC_AUX_POINTER, DESC_AUX_LD = 8, 11, 12
PREF_MAX_WORKSPACE, PREF_REDUCTION_MASK = 1, 3
PREF_ALIGN_A, PREF_ALIGN_B, PREF_ALIGN_C, PREF_ALIGN_D = 5, 6, 7, 8
REDUCTION_NONE, REDUCTION_COMPUTE_TYPE = 0, 2
CONFIG = [("id", 0), ("tile", 1), ("splitk", 2), ("swizzle", 4), ("custom", 5), ("stages", 6),
          ("cluster", 8)]
EPILOGUES = {"plain": 1, "GELU": 32, "GELU_AUX": 160, "DGELU": 192, "DGELU_BGRAD": 208}
WORKSPACE_BYTES = 32 << 20

P = ctypes.c_void_p


class Algo(ctypes.Structure):
    _fields_ = [("data", ctypes.c_uint64 * 8)]


class Result(ctypes.Structure):
    _fields_ = [("algo", Algo), ("workspace", ctypes.c_size_t), ("state", ctypes.c_int),
                ("waves", ctypes.c_float), ("reserved", ctypes.c_int * 4)]


def load():
    for name in ("libcublasLt.so", "libcublasLt.so.13"):
        try:
            lib = ctypes.CDLL(name)
            break
        except OSError:
            continue
    else:
        raise SystemExit("libcublasLt.so not found (set LD_LIBRARY_PATH to CUDA's lib64)")
    lib.cublasLtGetVersion.restype = ctypes.c_size_t
    lib.cublasLtMatrixLayoutCreate.argtypes = [ctypes.POINTER(P), ctypes.c_int, ctypes.c_uint64,
                                               ctypes.c_uint64, ctypes.c_int64]
    lib.cublasLtMatmulDescSetAttribute.argtypes = [P, ctypes.c_int, P, ctypes.c_size_t]
    lib.cublasLtMatmulPreferenceSetAttribute.argtypes = [P, ctypes.c_int, P, ctypes.c_size_t]
    lib.cublasLtMatmulAlgoGetHeuristic.argtypes = [P, P, P, P, P, P, P, ctypes.c_int,
                                                   ctypes.POINTER(Result),
                                                   ctypes.POINTER(ctypes.c_int)]
    lib.cublasLtMatmul.argtypes = [P, P, P, P, P, P, P, P, P, P, P, P, ctypes.POINTER(Algo), P,
                                   ctypes.c_size_t, P]
    lib.cublasLtMatmulAlgoConfigGetAttribute.argtypes = [ctypes.POINTER(Algo), ctypes.c_int, P,
                                                         ctypes.c_size_t,
                                                         ctypes.POINTER(ctypes.c_size_t)]
    return lib


def check(status, what):
    if status != 0:
        raise RuntimeError(f"{what}: cuBLAS status {status}")


def set_attr(fn, obj, attr, value):
    check(fn(obj, attr, ctypes.byref(value), ctypes.sizeof(value)), f"attribute {attr}")


class Gemm:
    """`out = a^ta b^tb` on row-major tensors, as the engine maps it: cuBLASLt's A is `b`, its B
    is `a`, the output column-major [n, m]."""

    def __init__(self, lib, handle, a, b, ta, tb, out, epilogue, aux=None, bias=None):
        self.lib, self.handle, self.keep = lib, handle, (a, b, out, aux, bias)
        dt = {torch.bfloat16: R_16BF, torch.float16: R_16F}[a.dtype]
        self.desc = P()
        check(lib.cublasLtMatmulDescCreate(ctypes.byref(self.desc), COMPUTE_32F, R_32F), "desc")
        set_attr(lib.cublasLtMatmulDescSetAttribute, self.desc, DESC_TRANSA, ctypes.c_int32(tb))
        set_attr(lib.cublasLtMatmulDescSetAttribute, self.desc, DESC_TRANSB, ctypes.c_int32(ta))
        set_attr(lib.cublasLtMatmulDescSetAttribute, self.desc, DESC_EPILOGUE,
                 ctypes.c_uint32(EPILOGUES[epilogue]))
        n, m = out.shape[1], out.shape[0]
        if aux is not None:
            set_attr(lib.cublasLtMatmulDescSetAttribute, self.desc, DESC_AUX_POINTER,
                     P(aux.data_ptr()))
            set_attr(lib.cublasLtMatmulDescSetAttribute, self.desc, DESC_AUX_LD, ctypes.c_int64(n))
        if bias is not None:
            set_attr(lib.cublasLtMatmulDescSetAttribute, self.desc, DESC_BIAS_POINTER,
                     P(bias.data_ptr()))
        self.layouts = []
        for rows, cols in [(b.shape[1], b.shape[0]), (a.shape[1], a.shape[0]), (n, m)]:
            layout = P()
            check(lib.cublasLtMatrixLayoutCreate(ctypes.byref(layout), dt, rows, cols, rows),
                  "layout")
            self.layouts.append(layout)
        self.ptrs = [P(b.data_ptr()), P(a.data_ptr()), P(out.data_ptr())]
        self.ws = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device="cuda")
        self.alpha, self.beta = ctypes.c_float(1.0), ctypes.c_float(0.0)

    def algorithms(self, count):
        lib, pref = self.lib, P()
        check(lib.cublasLtMatmulPreferenceCreate(ctypes.byref(pref)), "preference")
        set_attr(lib.cublasLtMatmulPreferenceSetAttribute, pref, PREF_MAX_WORKSPACE,
                 ctypes.c_uint64(WORKSPACE_BYTES))
        for attr in (PREF_ALIGN_A, PREF_ALIGN_B, PREF_ALIGN_C, PREF_ALIGN_D):
            set_attr(lib.cublasLtMatmulPreferenceSetAttribute, pref, attr, ctypes.c_uint32(256))
        set_attr(lib.cublasLtMatmulPreferenceSetAttribute, pref, PREF_REDUCTION_MASK,
                 ctypes.c_uint32(REDUCTION_NONE | REDUCTION_COMPUTE_TYPE))
        results, got = (Result * count)(), ctypes.c_int(0)
        fa, fb, fc = self.layouts
        status = lib.cublasLtMatmulAlgoGetHeuristic(self.handle, self.desc, fa, fb, fc, fc, pref,
                                                    count, results, ctypes.byref(got))
        lib.cublasLtMatmulPreferenceDestroy(pref)
        if status != 0:
            return []
        return [r for r in results[: got.value] if r.state == 0]

    def config(self, algo):
        out = []
        for name, attr in CONFIG:
            value, written = ctypes.c_uint32(0), ctypes.c_size_t(0)
            self.lib.cublasLtMatmulAlgoConfigGetAttribute(ctypes.byref(algo), attr,
                                                          ctypes.byref(value), 4,
                                                          ctypes.byref(written))
            out.append(f"{name} {value.value}")
        return ", ".join(out)

    def __call__(self, algo):
        fa, fb, fc = self.layouts
        pa, pb, pc = self.ptrs
        stream = P(torch.cuda.current_stream().cuda_stream)
        check(self.lib.cublasLtMatmul(self.handle, self.desc, ctypes.byref(self.alpha), pa, fa, pb,
                                      fb, ctypes.byref(self.beta), pc, fc, pc, fc,
                                      ctypes.byref(algo), P(self.ws.data_ptr()), WORKSPACE_BYTES,
                                      stream), "matmul")


def kernel_names(calls):
    """The CUDA kernels each call launches, in order (a marker kernel between calls)."""
    marker = torch.zeros(1, device="cuda")
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for call in calls:
            marker.add_(1)
            call()
        marker.add_(1)
        torch.cuda.synchronize()
    kernels = sorted((e for e in prof.events() if str(e.device_type).endswith("CUDA")),
                     key=lambda e: e.time_range.start)
    groups = []
    for e in kernels:
        if "elementwise" in e.name:
            groups.append([])
        elif groups:
            groups[-1].append(e.name[:90])
    return [", ".join(g) for g in groups[:-1]]


def cases(dt, m, c, ff):
    x = torch.randn(m, c, device="cuda", dtype=dt)
    w_fc = (torch.randn(c, ff, device="cuda") / c ** 0.5).to(dt)
    w_proj = (torch.randn(ff, c, device="cuda") / ff ** 0.5).to(dt)
    dy = torch.randn(m, c, device="cuda", dtype=dt)
    h = (x.float() @ w_fc.float()).to(dt)
    h32 = h.float()
    gelu_h = F.gelu(h32, approximate="tanh")
    dg_plain = dy.float() @ w_proj.float().t()
    hv = h32.detach().requires_grad_()
    (dgelu,) = torch.autograd.grad(F.gelu(hv, approximate="tanh"), hv, dg_plain)
    new = lambda: torch.empty(m, ff, device="cuda", dtype=dt)  # noqa: E731
    return [
        ("fc", "plain", (x, w_fc, False, False), None, None, [h32]),
        ("fc", "GELU", (x, w_fc, False, False), None, None, [gelu_h]),
        ("fc", "GELU_AUX", (x, w_fc, False, False), new(), None, [gelu_h, h32]),
        ("proj dgrad", "plain", (dy, w_proj, False, True), None, None, [dg_plain]),
        ("proj dgrad", "DGELU", (dy, w_proj, False, True), h, None, [dgelu]),
        ("proj dgrad", "DGELU_BGRAD", (dy, w_proj, False, True), h,
         torch.empty(ff, device="cuda", dtype=dt), [dgelu]),
    ], new


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--m", type=int, default=16384)
    ap.add_argument("--c", type=int, default=768)
    ap.add_argument("--ff", type=int, default=3072)
    ap.add_argument("--dtypes", default="bf16")
    ap.add_argument("--count", type=int, default=16)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--reps", type=int, default=7)
    args = ap.parse_args()
    lib = load()
    handle = P()
    check(lib.cublasLtCreate(ctypes.byref(handle)), "handle")
    print(f"# {torch.cuda.get_device_name()}, cuBLASLt {lib.cublasLtGetVersion()}, "
          f"M {args.m}, C {args.c}, FF {args.ff}")
    print("| dtype | GEMM | epilogue | rank | configuration | waves | ms | TFLOP/s | kernels "
          "| max diff / max |ref| |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    flop = 2.0 * args.m * args.c * args.ff
    for name in args.dtypes.split(","):
        dt = {"bf16": torch.bfloat16, "f16": torch.float16}[name]
        all_cases, new = cases(dt, args.m, args.c, args.ff)
        for gemm, epilogue, (a, b, ta, tb), aux, bias, refs in all_cases:
            out = new()
            call = Gemm(lib, handle, a, b, ta, tb, out, epilogue, aux, bias)
            algos = call.algorithms(args.count)
            if not algos:
                print(f"| {name} | {gemm} | {epilogue} | - | no algorithm | | | | | |")
                continue
            names = kernel_names([lambda r=r: call(r.algo) for r in algos])
            for rank, r in enumerate(algos):
                call(r.algo)
                torch.cuda.synchronize()
                diffs = [(out.float() - refs[0]).abs().max() / refs[0].abs().max()]
                if epilogue == "GELU_AUX":
                    diffs.append((aux.float() - refs[1]).abs().max() / refs[1].abs().max())
                diff = " / ".join(f"{d.item():.1e}" for d in diffs)
                ms = timed(lambda: call(r.algo), args.iters, args.reps) * 1e3
                kernels = names[rank] if rank < len(names) else "?"
                print(f"| {name} | {gemm} | {epilogue} | {rank} | {call.config(r.algo)} | "
                      f"{r.waves:.2f} | {ms * 1e3:.1f} us | {flop / ms / 1e9:.0f} | {kernels} | "
                      f"{diff} |")


if __name__ == "__main__":
    main()
