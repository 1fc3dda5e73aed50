#!/usr/bin/env python3
"""Builds the Hopper FlashAttention backward (crates/kernels/src/attention/hopper/backward.cu) with
nvcc and checks and times it from PyTorch, without Rust: the quick loop for changing the kernel on a
GPU machine. For an H100 or H200 with nvcc and PyTorch:

    python3 tools/attention-harness/backward.py [--no-bench]

1. Builds every variant (head_dim 64 / 128, bf16 / f16, full / causal, dK/dV in the inputs' dtype
   or in f32 per query head) side by side into --build-dir and prints ptxas's register and spill
   report. backward_host.cu encodes the TMA tensor maps as the Rust launcher does and runs the
   kernel, then the dQ cast.
2. dQ, dK and dV against an f64 reference at awkward shapes (grouped-query layouts, fewer or more
   queries than keys, many blocks, scores all far below 0): each gradient's largest error must be within 2x SDPA's
   backward's (+1e-3). The forward's log-sum-exp and delta come from the f64 reference, rounded as
   the Rust side's f32 ones are.
3. Backward TFLOP/s beside SDPA's FlashAttention-2 and cuDNN backends at attention_bench's shapes
   (batch x seq = 16384, heads x head_dim = 2048; FLOPs 2.5 x 4 b h s^2 d, halved when causal). Ours
   counts the kernel and the dQ cast, not the delta pre-pass; SDPA's its whole backward.

Exits with 1 if a check fails. What the Rust side runs is tested by the CUDA suite
(tests/cuda/kernels.rs); this harness does not replace it.
"""
import argparse
import ctypes
import math
import os
import sys

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "peers"))
from sdpa_bench import timed  # noqa: E402

from nvcc_build import build_variants  # noqa: E402


def variants():
    return [(hd, bf16, causal, f32) for hd in (64, 128) for bf16 in (1, 0) for causal in (0, 1) for f32 in (0, 1)]


def lib_name(hd, bf16, causal, f32):
    return f"fa_bwd_{hd}_{bf16}_{causal}_{f32}.so"


def build(out_dir, nvcc, kernel_file=None):
    os.makedirs(out_dir, exist_ok=True)
    jobs = {}
    for hd, bf16, causal, f32 in variants():
        label = (f"hd {hd} {'bf16' if bf16 else 'f16'} {'causal' if causal else 'full'} "
                 f"{'f32 dK/dV' if f32 else '16-bit dK/dV'}")
        jobs[label] = (os.path.join(out_dir, lib_name(hd, bf16, causal, f32)),
                       [f"-DHD={hd}", f"-DIS_BF16={bf16}", f"-DCAUSAL={causal}", f"-DDKV_F32={f32}"])
    extra = [f'-DBACKWARD_SOURCE="{os.path.abspath(kernel_file)}"'] if kernel_file else []
    return build_variants(nvcc, os.path.join(HERE, "backward_host.cu"), "flash_backward_hopper", jobs, extra)


def bits(x):
    return torch.tensor([x], dtype=torch.float32).view(torch.int32).item() & 0xFFFFFFFF


class Kernel:
    def __init__(self, out_dir):
        self.out_dir, self.libs = out_dir, {}

    def lib(self, hd, bf16, causal, f32):
        key = (hd, int(bf16), int(causal), int(f32))
        if key not in self.libs:
            lib = ctypes.CDLL(os.path.join(self.out_dir, lib_name(*key)))
            lib.rows_pad.argtypes = [ctypes.c_uint64]
            lib.rows_pad.restype = ctypes.c_uint64
            self.libs[key] = lib
        return self.libs[key]

    def backward(self, q, k, v, dout, lse, delta, causal):
        """(dq, dk, dv) as the Rust side lays them out: [B, S, H, D] permuted; under grouping dK and
        dV in f32 per query head, summed over each group here."""
        b, h, s, d = q.shape
        hkv, sk = k.shape[1], k.shape[2]
        group = h // hkv
        lib = self.lib(d, q.dtype == torch.bfloat16, causal, group > 1)
        if group == 1:
            dk = torch.empty(b, sk, h, d, dtype=q.dtype, device=q.device).permute(0, 2, 1, 3)
            dv = torch.empty(b, sk, h, d, dtype=q.dtype, device=q.device).permute(0, 2, 1, 3)
        else:
            dk = torch.empty(b, h, sk, d, dtype=torch.float32, device=q.device)
            dv = torch.empty(b, h, sk, d, dtype=torch.float32, device=q.device)
        dq = torch.empty(b, s, h, d, dtype=q.dtype, device=q.device).permute(0, 2, 1, 3)
        dq_acc = torch.zeros(b * h * lib.rows_pad(s) * d, dtype=torch.float32, device=q.device)
        dims = (ctypes.c_uint64 * 5)(b, h, hkv, s, sk)
        st = [x for t in (q, k, v, dout, dk, dv, dq) for x in t.stride()[:3]]
        strides = (ctypes.c_uint64 * 21)(*st)
        scale = 1 / math.sqrt(d)
        rc = lib.launch(*(ctypes.c_void_p(t.data_ptr()) for t in (q, k, v, dout, lse, delta, dk, dv, dq_acc, dq)),
                        dims, strides, ctypes.c_uint32(bits(scale)), ctypes.c_uint32(bits(scale * math.log2(math.e))),
                        ctypes.c_void_p(torch.cuda.current_stream().cuda_stream))
        if rc != 0:
            raise RuntimeError(f"launch failed with CUDA error {rc}")
        if group > 1:
            dk = dk.view(b, hkv, group, sk, d).sum(2).to(q.dtype)
            dv = dv.view(b, hkv, group, sk, d).sum(2).to(q.dtype)
        return dq, dk, dv


def reference(q, k, v, dout, causal):
    """Output, log-sum-exp and (dq, dk, dv) in f64."""
    g = q.shape[1] // k.shape[1]
    q64, k64, v64 = (t.double().detach().requires_grad_() for t in (q, k, v))
    kk, vv = k64.repeat_interleave(g, 1), v64.repeat_interleave(g, 1)
    s = q64 @ kk.transpose(-1, -2) / math.sqrt(q.shape[-1])
    if causal:
        keep = torch.ones(s.shape[-2:], dtype=torch.bool, device=q.device).tril()
        s = s.masked_fill(~keep, float("-inf"))
    out = torch.softmax(s, -1) @ vv
    out.backward(dout.double())
    return out.detach(), torch.logsumexp(s, -1).detach(), (q64.grad, k64.grad, v64.grad)


def sdpa_grads(q, k, v, dout, causal):
    g = q.shape[1] // k.shape[1]
    q1, k1, v1 = (t.detach().requires_grad_() for t in (q, k, v))
    out = F.scaled_dot_product_attention(q1, k1.repeat_interleave(g, 1), v1.repeat_interleave(g, 1),
                                         is_causal=causal)
    out.backward(dout)
    return out.detach(), (q1.grad, k1.grad, v1.grad)


def check_backward(kernel):
    failures = 0
    # (batch, heads, kv heads, seq_q, seq_k); the causal mask is aligned at the first position.
    # `low`: every score far below 0 (q near +4, k near -4: scores near -16 sqrt(hd)), so the
    # log-sum-exp is far below 0 too, at key counts that leave a partial last block.
    shapes = [(2, 4, 2, 1000, 1000, False), (1, 3, 3, 128, 128, False), (1, 2, 1, 1, 1, False),
              (3, 2, 2, 333, 333, False), (1, 1, 1, 4096, 4096, False), (2, 8, 1, 77, 77, False),
              (1, 2, 2, 1000, 300, False), (1, 2, 2, 300, 1000, False), (4, 24, 6, 700, 700, False),
              (1, 24, 8, 2100, 2100, False), (1, 2, 2, 300, 300, True), (1, 4, 2, 1000, 700, True)]
    for hd in (64, 128):
        for dtype in (torch.bfloat16, torch.float16):
            for causal in (False, True):
                for b, h, hkv, sq, sk, low in shapes:
                    q = torch.randn(b, h, sq, hd, device="cuda", dtype=dtype)
                    k, v = (torch.randn(b, hkv, sk, hd, device="cuda", dtype=dtype) for _ in range(2))
                    if low:
                        q, k = (q * 0.1 + 4).to(dtype), (k * 0.1 - 4).to(dtype)
                    dout = torch.randn(b, h, sq, hd, device="cuda", dtype=dtype)
                    out, lse, ref = reference(q, k, v, dout, causal)
                    sdpa_out, sdpa = sdpa_grads(q, k, v, dout, causal)
                    # The delta pre-pass reads the forward's 16-bit output.
                    delta = (dout.float() * sdpa_out.float()).sum(-1)
                    got = kernel.backward(q, k, v, dout, lse.float().contiguous(), delta.contiguous(), causal)
                    bad = []
                    for name, x, y, r in zip(("dq", "dk", "dv"), got, sdpa, ref):
                        err = (x.double() - r).abs().max().item()
                        err_sdpa = (y.double() - r).abs().max().item()
                        if not (err <= 2 * err_sdpa + 1e-3):
                            bad.append(f"{name} {err:.2e} (SDPA {err_sdpa:.2e})")
                    failures += bool(bad)
                    if bad:
                        print(f"FAIL hd {hd} {dtype} causal {causal} {b}x{h}/{hkv}x{sq}/{sk}{' low' if low else ''}: "
                              + ", ".join(bad))
    print(f"backward against f64: {failures} failures")
    return failures


def bench(kernel):
    print("| hd | mask | S | ours bwd | SDPA FlashAttention-2 | SDPA cuDNN | ours / cuDNN |")
    print("|---|---|---|---|---|---|---|")
    for hd in (64, 128):
        for causal in (False, True):
            for s in (1024, 4096):
                b, h = 16384 // s, 2048 // hd
                q, k, v, dout = (torch.randn(b, h, s, hd, device="cuda", dtype=torch.bfloat16) for _ in range(4))
                lse = torch.randn(b, h, s, device="cuda").abs() + 5
                delta = torch.randn(b, h, s, device="cuda")
                flops = 2.5 * 4 * b * h * s * s * hd * (0.5 if causal else 1.0)
                ours = timed(lambda: kernel.backward(q, k, v, dout, lse, delta, causal), 10, 5)
                peers = []
                for backend in (SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION):
                    q1, k1, v1 = (t.detach().requires_grad_() for t in (q, k, v))
                    with sdpa_kernel(backend):
                        out = F.scaled_dot_product_attention(q1, k1, v1, is_causal=causal)
                        peers.append(timed(lambda: torch.autograd.grad(out, (q1, k1, v1), dout, retain_graph=True),
                                           10, 5))
                tf = lambda t: flops / t / 1e12
                print(f"| {hd} | {'causal' if causal else 'full'} | {s} | {tf(ours):.1f} | {tf(peers[0]):.1f} | "
                      f"{tf(peers[1]):.1f} | {peers[1] / ours:.2f}x |")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--build-dir", default="/tmp/attention-harness-bwd")
    ap.add_argument("--nvcc", default="nvcc")
    ap.add_argument("--no-bench", action="store_true")
    ap.add_argument("--no-check", action="store_true")
    ap.add_argument("--kernel", help="another version of backward.cu to build instead (to compare versions; "
                    "give each its own --build-dir). It is built after dq_cast.cu, so it must not "
                    "define the dQ cast itself, as versions before dq_cast.cu did")
    a = ap.parse_args()
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}")
    if torch.cuda.get_device_capability() != (9, 0):
        sys.exit("the kernel needs a compute capability 9.0 GPU (H100, H200)")
    if not build(a.build_dir, a.nvcc, a.kernel):
        sys.exit(1)
    kernel = Kernel(a.build_dir)
    torch.manual_seed(0)
    failures = 0 if a.no_check else check_backward(kernel)
    if not a.no_bench:
        bench(kernel)
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
