#!/usr/bin/env python3
"""Builds the Hopper FlashAttention forward (crates/kernels/src/attention/hopper/forward.cu) with
nvcc and checks and times it from PyTorch, without Rust: the quick loop for changing the kernel on a
GPU machine. For an H100 or H200 with nvcc and PyTorch:

    python3 tools/attention-harness/harness.py [--no-bench] [--no-check] [--kernel OTHER_FORWARD.cu]
        [--hd64-consumers 2|3]

1. Builds every variant the launcher picks (head_dim 64 / 128, bf16 / f16, full / causal, two or
   three consumer warpgroups) side by side into --build-dir and prints ptxas's register and spill
   report for the kernel. host.cu encodes the TMA tensor maps as the Rust launcher does.
2. The forward against an f64 reference at awkward shapes, grouped-query layouts included: the
   output's largest error must be within 2x SDPA's (+1e-3), the log-sum-exp within 1e-3.
3. Forward TFLOP/s beside SDPA's FlashAttention-2 and cuDNN backends at attention_bench's shapes
   (batch x seq = 16384, heads x head_dim = 2048; FLOPs 4 b h s^2 d, halved when causal). Under the
   causal mask the tiles go by sections of the size the launcher picks (schedule.py); the table
   also times the largest sections that fit in L2 (the rule before), in the same run.

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
# The peer script's timing (CUDA events, the median of `reps` runs of `iters` calls), so that both
# sides are timed alike.
sys.path.insert(0, os.path.join(HERE, "..", "peers"))
from sdpa_bench import timed  # noqa: E402

from nvcc_build import build_variants  # noqa: E402
import schedule  # noqa: E402
STAGES = 2
# --hd64-consumers: the consumer warpgroups every head_dim 64 block takes instead of the rule's.
HD64_CONSUMERS = None


def consumers(hd, causal, seq_q):
    """Consumer warpgroups a block has: the rule of `Shape::at` in hopper/mod.rs."""
    if hd == 64 and HD64_CONSUMERS:
        return HD64_CONSUMERS
    return 3 if hd == 64 and not (causal and seq_q < 2048) else 2


def variants():
    """(hd, bf16, causal, consumers): every variant `consumers` picks."""
    out = []
    for hd in (64, 128):
        for bf16 in (1, 0):
            for causal in (0, 1):
                for cons in sorted({consumers(hd, causal, 1), consumers(hd, causal, 4096)}):
                    out.append((hd, bf16, causal, cons))
    return out


def lib_name(hd, bf16, causal, cons):
    return f"fa_{hd}_{bf16}_{causal}_{cons}.so"


def build(out_dir, nvcc, kernel_file=None):
    os.makedirs(out_dir, exist_ok=True)
    jobs = {}
    for hd, bf16, causal, cons in variants():
        label = f"hd {hd} {'bf16' if bf16 else 'f16'} {'causal' if causal else 'full'} {cons} consumers"
        jobs[label] = (os.path.join(out_dir, lib_name(hd, bf16, causal, cons)),
                       [f"-DHD={hd}", f"-DIS_BF16={bf16}", f"-DCAUSAL={causal}", f"-DCONSUMERS={cons}",
                        f"-DSTAGES={STAGES}"])
    extra = [f'-DFORWARD_SOURCE="{os.path.abspath(kernel_file)}"'] if kernel_file else []
    return build_variants(nvcc, os.path.join(HERE, "host.cu"), "flash_forward_hopper", jobs, extra)


class Kernel:
    """The built variants. `sections`: "model" (the launcher's choice, schedule.py), "fits" (the
    largest sections whose keys and values fit in half of L2) or a number of pairs (clamped to the
    pairs there are)."""

    def __init__(self, out_dir, sections="model"):
        self.out_dir, self.libs, self.sections, self.chosen = out_dir, {}, sections, {}
        props = torch.cuda.get_device_properties(torch.cuda.current_device())
        self.sms, self.l2 = props.multi_processor_count, props.L2_cache_size

    def lib(self, hd, bf16, causal, seq_q):
        key = (hd, int(bf16), int(causal), consumers(hd, causal, seq_q))
        if key not in self.libs:
            self.libs[key] = ctypes.CDLL(os.path.join(self.out_dir, lib_name(*key)))
        return self.libs[key]

    def section(self, b, h, hkv, s, sk, d, causal):
        """The (batch, head) pairs of a section, as the Rust launcher picks them."""
        pairs, block_q = b * h, 64 * consumers(d, causal, s)
        bound = schedule.fits(sk, d, h // hkv, pairs, self.l2)
        if not causal or self.sections == "fits":
            return bound
        if isinstance(self.sections, int):
            return max(1, min(self.sections, pairs))
        key = (s, sk, block_q, pairs, bound)
        if key not in self.chosen:
            grid = min(-(-s // block_q) * pairs, self.sms)
            self.chosen[key] = schedule.causal_section(s, sk, block_q, pairs, grid, bound)
        return self.chosen[key]

    def forward(self, q, k, v, causal):
        """out [B, H, S, D] (laid out [B, S, H, D], as the Rust side allocates it) and lse [B, H, S]."""
        b, h, s, d = q.shape
        section = self.section(b, h, k.shape[1], s, k.shape[2], d, causal)
        out = torch.empty(b, s, h, d, dtype=q.dtype, device=q.device).permute(0, 2, 1, 3)
        lse = torch.empty(b, h, s, dtype=torch.float32, device=q.device)
        scale_log2 = torch.tensor([math.log2(math.e) / math.sqrt(d)], dtype=torch.float32)
        dims = (ctypes.c_uint64 * 5)(b, h, k.shape[1], s, k.shape[2])
        strides = (ctypes.c_uint64 * 12)(*q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *out.stride()[:3])
        rc = self.lib(d, q.dtype == torch.bfloat16, causal, s).launch(
            *(ctypes.c_void_p(t.data_ptr()) for t in (q, k, v, out, lse)), dims, strides,
            ctypes.c_uint64(scale_log2.view(torch.int32).item() & 0xFFFFFFFF), ctypes.c_uint64(section),
            ctypes.c_void_p(torch.cuda.current_stream().cuda_stream))
        if rc != 0:
            raise RuntimeError(f"launch failed with CUDA error {rc}")
        return out, lse


def reference(q, k, v, causal):
    """Output and natural log-sum-exp in f64, k and v repeated over each query group."""
    g = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(g, 1).double(), v.repeat_interleave(g, 1).double()
    s = q.double() @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    if causal:
        keep = torch.ones(s.shape[-2:], dtype=torch.bool, device=q.device).tril()
        s = s.masked_fill(~keep, float("-inf"))
    return torch.softmax(s, -1) @ v, torch.logsumexp(s, -1)


def check_forward(kernel, fits_kernel):
    """Every case through `kernel`; the causal ones also with sections of 5 pairs (a short last
    section), and the ones with more tiles than SMs through `fits_kernel` (the other rule): any
    section size must give the same result."""
    failures = 0
    # The last three have more tiles than the GPU has SMs: each persistent block takes several.
    shapes = [(2, 4, 2, 1000), (1, 3, 3, 128), (1, 2, 1, 1), (3, 2, 2, 333), (1, 1, 1, 4096), (2, 8, 1, 77),
              (1, 2, 1, 2500), (4, 24, 6, 700), (4, 16, 16, 1000), (1, 24, 8, 2100)]
    cases = [(hd, dtype, causal, shape, kernel) for hd in (64, 128) for dtype in (torch.bfloat16, torch.float16)
             for causal in (False, True) for shape in shapes]
    fives = Kernel(kernel.out_dir, sections=5)
    cases += [(hd, dtype, True, shape, kern) for hd in (64, 128) for dtype in (torch.bfloat16, torch.float16)
              for shape, kern in [(x, fives) for x in shapes] + [(x, fits_kernel) for x in shapes[-3:]]]
    for hd, dtype, causal, (b, h, hkv, s), kern in cases:
        q = torch.randn(b, h, s, hd, device="cuda", dtype=dtype)
        k, v = (torch.randn(b, hkv, s, hd, device="cuda", dtype=dtype) for _ in range(2))
        out, lse = kern.forward(q, k, v, causal)
        ref, ref_lse = reference(q, k, v, causal)
        g = h // hkv
        sdpa = F.scaled_dot_product_attention(q, k.repeat_interleave(g, 1), v.repeat_interleave(g, 1),
                                              is_causal=causal)
        err = (out.double() - ref).abs().max().item()
        err_sdpa = (sdpa.double() - ref).abs().max().item()
        err_lse = (lse.double() - ref_lse).abs().max().item()
        ok = err <= 2 * err_sdpa + 1e-3 and err_lse < 1e-3
        failures += not ok
        if not ok:
            print(f"FAIL hd {hd} {dtype} causal {causal} {b}x{h}/{hkv}x{s} sections {kern.sections}: error {err:.2e} "
                  f"(SDPA {err_sdpa:.2e}), lse {err_lse:.2e}")
    print(f"forward against f64: {failures} failures")
    return failures


def bench(kernel, fits_kernel):
    """TFLOP/s; under the causal mask also with the largest sections that fit in L2 (`fits_kernel`),
    and the section sizes of both."""
    print("| hd | mask | S | ours fwd | ours, sections that fit | sections (chosen / fit) | "
          "SDPA FlashAttention-2 | SDPA cuDNN | ours / cuDNN |")
    print("|---|---|---|---|---|---|---|---|---|")
    for hd in (64, 128):
        for causal in (False, True):
            for s in (1024, 4096):
                b, h = 16384 // s, 2048 // hd
                q, k, v = (torch.randn(b, h, s, hd, device="cuda", dtype=torch.bfloat16) for _ in range(3))
                flops = 4 * b * h * s * s * hd * (0.5 if causal else 1.0)
                tf = lambda t: flops / t / 1e12
                ours = timed(lambda: kernel.forward(q, k, v, causal), 20, 5)
                fits, sections = "", ""
                if causal:
                    fits = f"{tf(timed(lambda: fits_kernel.forward(q, k, v, causal), 20, 5)):.1f}"
                    sections = (f"{kernel.section(b, h, h, s, s, hd, causal)} / "
                                f"{fits_kernel.section(b, h, h, s, s, hd, causal)}")
                peers = []
                for backend in (SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION):
                    with sdpa_kernel(backend):
                        peers.append(timed(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal), 20, 5))
                print(f"| {hd} | {'causal' if causal else 'full'} | {s} | {tf(ours):.1f} | {fits} | {sections} | "
                      f"{tf(peers[0]):.1f} | {tf(peers[1]):.1f} | {peers[1] / ours:.2f}x |")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--build-dir", default="/tmp/attention-harness")
    ap.add_argument("--nvcc", default="nvcc")
    ap.add_argument("--no-bench", action="store_true")
    ap.add_argument("--no-check", action="store_true")
    ap.add_argument("--kernel", help="another version of forward.cu to build instead (to compare versions; "
                    "give each its own --build-dir)")
    ap.add_argument("--hd64-consumers", type=int, choices=(2, 3),
                    help="the consumer warpgroups of every head_dim 64 block (64 query rows each), instead of "
                    "the launcher's rule (three, but two under the causal mask below 2048 queries)")
    a = ap.parse_args()
    global HD64_CONSUMERS
    HD64_CONSUMERS = a.hd64_consumers
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}")
    if torch.cuda.get_device_capability() != (9, 0):
        sys.exit("the kernel needs a compute capability 9.0 GPU (H100, H200)")
    if not build(a.build_dir, a.nvcc, a.kernel):
        sys.exit(1)
    kernel, fits_kernel = Kernel(a.build_dir), Kernel(a.build_dir, sections="fits")
    torch.manual_seed(0)
    failures = 0 if a.no_check else check_forward(kernel, fits_kernel)
    if not a.no_bench:
        bench(kernel, fits_kernel)
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
