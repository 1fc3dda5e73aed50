#!/usr/bin/env python3
"""Builds the Hopper FlashAttention forward with FP8=1 (e4m3 Q, K, V with block scales, bf16
output; crates/kernels/src/attention/hopper/forward.cu) with nvcc, and checks and times it from
PyTorch, without Rust. For an H100 or H200 with nvcc and PyTorch:

    python3 tools/attention-harness/fp8_forward.py [--no-bench]

1. Builds the FP8 variants (head_dim 64 / 128, full / causal, the consumer counts the launcher
   picks) and, for the timings, the 16-bit ones (harness.py's build).
2. Quantizes q, k, v as the kernel takes them (`quantize`: an f32 scale per 64 query rows or 128
   keys of each (batch, head), amax / 448; V transposed with its keys in the kernel's order) and
   checks the output against an f64 reference on the unquantized inputs, beside SDPA's bf16 error
   and beside what FP8 itself costs (`emulated`: f64 attention on the dequantized inputs with P
   rounded to e4m3 as the kernel rounds it). A case fails if the output's error exceeds 2x the
   emulation's (plus the bf16 output's rounding) or the log-sum-exp is off the dequantized
   inputs' by 2e-3 or more. The quantizer kernels (fp8_quantize.cu) must match `quantize` bit
   for bit.
3. Forward TFLOP/s at attention_bench's shapes: FP8 (the kernel alone, and with the quantizer
   kernels that the Rust side runs before it), our bf16 kernel, SDPA's cuDNN backend; with
   `--stages 2,3` the FP8 kernel also at other stage counts (the launcher takes FP8_STAGES).

Exits with 1 if a check fails.
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

import harness  # noqa: E402
from nvcc_build import build_variants  # noqa: E402

E4M3_MAX = 448.0
Q_ROWS, K_ROWS = 64, 128
# Key/value stages of the FP8 forward (FP8_STAGES in hopper/mod.rs).
FP8_STAGES = 4


def fp8_variants():
    return sorted({(hd, causal, cons) for hd, bf16, causal, cons in harness.variants()})


def lib_name(hd, causal, cons, stages):
    return f"fa8_{hd}_{causal}_{cons}_{stages}.so"


def build_quantizers(out_dir, nvcc, source=None):
    """The quantizer kernels (bf16 inputs) into out_dir as `Quantizer` loads them: this tree's
    fp8_quantize.cu, or `source`, another version of it. Returns whether every variant built."""
    os.makedirs(out_dir, exist_ok=True)
    extra = [f'-DQUANT_SOURCE="{os.path.abspath(source)}"'] if source else []
    jobs = {}
    for hd in (64, 128):
        for rows in (Q_ROWS, K_ROWS):
            jobs[f"quantizer hd {hd} rows {rows}"] = (os.path.join(out_dir, f"fq_{hd}_{rows}.so"),
                                                      [f"-DHD={hd}", "-DIS_BF16=1", f"-DROWS={rows}", *extra])
    return build_variants(nvcc, os.path.join(HERE, "host_quant.cu"), "attention_fp8_vt", jobs)


def build(out_dir, nvcc, stage_counts):
    if not build_quantizers(out_dir, nvcc):
        return False
    jobs = {}
    for hd, causal, cons in fp8_variants():
        for stages in stage_counts:
            jobs[f"fp8 hd {hd} {'causal' if causal else 'full'} {cons} consumers {stages} stages"] = (
                os.path.join(out_dir, lib_name(hd, causal, cons, stages)),
                [f"-DHD={hd}", "-DIS_BF16=1", "-DFP8=1", f"-DCAUSAL={causal}", f"-DCONSUMERS={cons}",
                 f"-DSTAGES={stages}"])
    return build_variants(nvcc, os.path.join(HERE, "host_fp8.cu"), "flash_forward_hopper", jobs)


def key_order(keys):
    """order[f] = the key vt's position f holds (keys a multiple of 32)."""
    f = torch.arange(keys)
    r = f % 32
    h, t, e = r // 16, (r % 16) // 4, r % 4
    return f - r + 16 * h + 8 * (e // 2) + 2 * t + e % 2


def block_scales(x, rows):
    """f32 [b, h, blocks]: amax / 448 of each block of `rows` rows (1 where the block is zero)."""
    b, h, s, d = x.shape
    n = -(-s // rows)
    amax = F.pad(x.float().abs(), (0, 0, 0, n * rows - s)).reshape(b, h, n, rows * d).amax(-1)
    # A true division, as the kernel's (PyTorch multiplies by the reciprocal of a Python scalar).
    return torch.where(amax > 0, amax / torch.full_like(amax, E4M3_MAX), torch.ones_like(amax))


def per_row(scale, rows, s):
    return scale.repeat_interleave(rows, dim=2)[:, :, :s, None]


def quantize(q, k, v):
    """(q8, k8, vt8, keys, q_scale, k_scale, v_scale, dequantized q, k, v)."""
    s_q, s_k, d = q.shape[2], k.shape[2], q.shape[3]
    qs, ks, vs = block_scales(q, Q_ROWS), block_scales(k, K_ROWS), block_scales(v, K_ROWS)
    # Times the scale's reciprocal, each rounded once, as the quantizer kernels.
    q8 = (q.float() * per_row(torch.reciprocal(qs), Q_ROWS, s_q)).to(torch.float8_e4m3fn)
    k8 = (k.float() * per_row(torch.reciprocal(ks), K_ROWS, s_k)).to(torch.float8_e4m3fn)
    v8 = (v.float() * per_row(torch.reciprocal(vs), K_ROWS, s_k)).to(torch.float8_e4m3fn)
    keys = -(-s_k // 32) * 32
    vt = F.pad(v8.float(), (0, 0, 0, keys - s_k)).transpose(-1, -2)
    vt8 = vt[..., key_order(keys).to(vt.device)].to(torch.float8_e4m3fn).contiguous()
    deq = (q8.double() * per_row(qs, Q_ROWS, s_q), k8.double() * per_row(ks, K_ROWS, s_k),
           v8.double() * per_row(vs, K_ROWS, s_k))
    return q8.contiguous(), k8.contiguous(), vt8, keys, qs, ks, vs, deq


class Quantizer:
    """fp8_quantize.cu's kernels: what the Rust side runs, checked against `quantize`."""

    def __init__(self, out_dir):
        self.out_dir, self.libs = out_dir, {}

    def launcher(self, x, rows, transposed):
        """(call, codes, scales): `call()` runs the kernel on x [b, h, s, d] (`transposed`: v's)
        into the codes and scales, allocated here once."""
        b, h, s, d = x.shape
        key = (d, rows)
        if key not in self.libs:
            self.libs[key] = ctypes.CDLL(os.path.join(self.out_dir, f"fq_{d}_{rows}.so"))
        lib = self.libs[key]
        keys = -(-s // 32) * 32
        out = torch.empty((b, h, d, keys) if transposed else (b, h, s, d), dtype=torch.uint8, device=x.device)
        scale = torch.empty(b, h, -(-s // rows), dtype=torch.float32, device=x.device)
        args = (ctypes.c_void_p(x.data_ptr()), ctypes.c_void_p(out.data_ptr()), ctypes.c_void_p(scale.data_ptr()),
                ctypes.c_uint64(b), ctypes.c_uint64(h), ctypes.c_uint64(s),
                (ctypes.c_uint64 * 3)(*x.stride()[:3]), ctypes.c_int(int(transposed)))

        def call():
            rc = lib.quantize(*args, ctypes.c_void_p(torch.cuda.current_stream().cuda_stream))
            if rc != 0:
                raise RuntimeError(f"quantizer launch failed with CUDA error {rc}")

        return call, out, scale

    def run(self, x, rows, transposed):
        call, out, scale = self.launcher(x, rows, transposed)
        call()
        return out.view(torch.float8_e4m3fn), scale

    def quantize(self, q, k, v):
        """`quantize`'s first seven, from the kernels."""
        q8, qs = self.run(q, Q_ROWS, False)
        k8, ks = self.run(k, K_ROWS, False)
        vt8, vs = self.run(v, K_ROWS, True)
        return q8, k8, vt8, vt8.shape[-1], qs, ks, vs


def bits(t):
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t


def check_quantizer(quantizer):
    """The kernels' codes and scales against `quantize`'s, bit for bit (strided inputs too)."""
    failures = 0
    for hd in (64, 128):
        for b, h, s in [(2, 3, 1000), (1, 1, 1), (1, 2, 77), (2, 2, 4096)]:
            x = torch.randn(b, s, h, hd, device="cuda", dtype=torch.bfloat16).transpose(1, 2) * 3
            x[0, 0, : min(s, 64)] = 0  # a block of zeros: scale 1
            ref = quantize(x, x, x)
            got = quantizer.quantize(x, x, x)
            for name, r, g in zip(("q", "k", "vt", "keys", "q scale", "k scale", "v scale"), ref[:7], got):
                if not (r == g if isinstance(r, int) else torch.equal(bits(r), bits(g))):
                    failures += 1
                    print(f"FAIL quantizer hd {hd} {b}x{h}x{s}: {name} differs")
    print(f"quantizer against PyTorch: {failures} failures")
    return failures


class Fp8Kernel(harness.Kernel):
    def __init__(self, out_dir, stages=FP8_STAGES):
        super().__init__(out_dir)
        self.stages = stages

    def lib(self, hd, causal, seq_q):
        key = (hd, int(causal), harness.consumers(hd, causal, seq_q), self.stages)
        if key not in self.libs:
            self.libs[key] = ctypes.CDLL(os.path.join(self.out_dir, lib_name(*key)))
        return self.libs[key]

    def forward8(self, quantized, shape, causal):
        """out [B, H, S, D] bf16 (laid out [B, S, H, D]) and lse [B, H, S] from `quantize`'s tensors."""
        q8, k8, vt8, keys, qs, ks, vs = quantized[:7]
        b, h, s, d = shape
        hkv, sk = k8.shape[1], k8.shape[2]
        section = self.section(b, h, hkv, s, sk, d, causal)
        out = torch.empty(b, s, h, d, dtype=torch.bfloat16, device=q8.device).permute(0, 2, 1, 3)
        lse = torch.empty(b, h, s, dtype=torch.float32, device=q8.device)
        scale_log2 = torch.tensor([math.log2(math.e) / math.sqrt(d)], dtype=torch.float32)
        dims = (ctypes.c_uint64 * 6)(b, h, hkv, s, sk, keys)
        strides = (ctypes.c_uint64 * 3)(*out.stride()[:3])
        rc = self.lib(d, causal, s).launch(
            *(ctypes.c_void_p(t.data_ptr()) for t in (q8, k8, vt8, out, lse, qs, ks, vs)), dims, strides,
            ctypes.c_uint64(scale_log2.view(torch.int32).item() & 0xFFFFFFFF), ctypes.c_uint64(section),
            ctypes.c_void_p(torch.cuda.current_stream().cuda_stream))
        if rc != 0:
            raise RuntimeError(f"launch failed with CUDA error {rc}")
        return out, lse


def emulated(deq, causal):
    """f64 attention on the dequantized inputs with P rounded to e4m3 as the kernel rounds it
    (exp2(. - row max + 8), the sum from the unrounded terms), and the log-sum-exp."""
    q, k, v = deq
    g = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    s = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    if causal:
        keep = torch.ones(s.shape[-2:], dtype=torch.bool, device=q.device).tril()
        s = s.masked_fill(~keep, float("-inf"))
    m = s.amax(-1, keepdim=True)
    p = torch.exp(s - m) * 256.0
    p8 = p.float().to(torch.float8_e4m3fn).double()
    return (p8 @ v) / p.sum(-1, keepdim=True), torch.logsumexp(s, -1)


def check(kernel):
    failures, worst = 0, []
    shapes = [(2, 4, 2, 1000), (1, 3, 3, 128), (1, 2, 1, 1), (3, 2, 2, 333), (1, 1, 1, 4096), (2, 8, 1, 77),
              (1, 2, 1, 2500), (4, 24, 6, 700), (4, 16, 16, 1000), (1, 24, 8, 2100)]
    print("| hd | mask | b x h / kv x s | FP8 error | FP8 emulated | SDPA bf16 error | lse error |")
    print("|---|---|---|---|---|---|---|")
    for hd in (64, 128):
        for causal in (False, True):
            for b, h, hkv, s in shapes:
                q = torch.randn(b, h, s, hd, device="cuda", dtype=torch.bfloat16)
                k, v = (torch.randn(b, hkv, s, hd, device="cuda", dtype=torch.bfloat16) for _ in range(2))
                quantized = quantize(q, k, v)
                out, lse = kernel.forward8(quantized, (b, h, s, hd), causal)
                ref, _ = harness.reference(q, k, v, causal)
                emu, emu_lse = emulated(quantized[7], causal)
                g = h // hkv
                sdpa = F.scaled_dot_product_attention(q, k.repeat_interleave(g, 1), v.repeat_interleave(g, 1),
                                                      is_causal=causal)
                err = (out.double() - ref).abs().max().item()
                err_emu = (emu - ref).abs().max().item()
                err_sdpa = (sdpa.double() - ref).abs().max().item()
                err_lse = (lse.double() - emu_lse).abs().max().item()
                # Half a bf16 ulp of the output's largest value: the output's own rounding.
                ok = err <= 2 * err_emu + ref.abs().max().item() * 2 ** -8 and err_lse < 2e-3
                failures += not ok
                print(f"| {hd} | {'causal' if causal else 'full'} | {b}x{h}/{hkv}x{s} | {err:.2e} | {err_emu:.2e} | "
                      f"{err_sdpa:.2e} | {err_lse:.1e} |{'' if ok else ' FAIL'}")
    print(f"FP8 forward: {failures} failures")
    return failures


def bench(kernels, quantizer, kernel16):
    """`kernels`: {stage count: Fp8Kernel}, the launcher's (FP8_STAGES) among them."""
    others = [n for n in sorted(kernels) if n != FP8_STAGES]
    print("| hd | mask | S | FP8 (ours) | FP8 with quantizing | " + "".join(f"FP8, {n} stages | " for n in others)
          + "bf16 (ours) | SDPA cuDNN bf16 | FP8 / our bf16 | FP8 with quantizing / our bf16 | FP8 / cuDNN |")
    print("|---" * (10 + len(others)) + "|")
    for hd in (64, 128):
        for causal in (False, True):
            for s in (1024, 4096):
                b, h = 16384 // s, 2048 // hd
                q, k, v = (torch.randn(b, h, s, hd, device="cuda", dtype=torch.bfloat16) for _ in range(3))
                quantized = quantize(q, k, v)
                flops = 4 * b * h * s * s * hd * (0.5 if causal else 1.0)
                tf = lambda t: flops / t / 1e12
                t8 = {n: timed(lambda: kern.forward8(quantized, (b, h, s, hd), causal), 20, 5)
                      for n, kern in kernels.items()}
                t8q = timed(lambda: kernels[FP8_STAGES].forward8(quantizer.quantize(q, k, v), (b, h, s, hd), causal),
                            20, 5)
                t16 = timed(lambda: kernel16.forward(q, k, v, causal), 20, 5)
                with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                    tc = timed(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal), 20, 5)
                t = t8[FP8_STAGES]
                print(f"| {hd} | {'causal' if causal else 'full'} | {s} | {tf(t):.1f} | {tf(t8q):.1f} | "
                      + "".join(f"{tf(t8[n]):.1f} | " for n in others)
                      + f"{tf(t16):.1f} | {tf(tc):.1f} | {t16 / t:.2f}x | {t16 / t8q:.2f}x | {tc / t:.2f}x |")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--build-dir", default="/tmp/attention-harness")
    ap.add_argument("--nvcc", default="nvcc")
    ap.add_argument("--no-bench", action="store_true")
    ap.add_argument("--stages", default=str(FP8_STAGES),
                    help="stage counts to time the FP8 kernel at, comma-separated (the checks use the launcher's)")
    a = ap.parse_args()
    stage_counts = sorted({FP8_STAGES, *(int(x) for x in a.stages.split(","))})
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}")
    if torch.cuda.get_device_capability() != (9, 0):
        sys.exit("the kernel needs a compute capability 9.0 GPU (H100, H200)")
    if not build(a.build_dir, a.nvcc, stage_counts) or (not a.no_bench and not harness.build(a.build_dir, a.nvcc)):
        sys.exit(1)
    torch.manual_seed(0)
    failures = check_quantizer(Quantizer(a.build_dir))
    failures += check(Fp8Kernel(a.build_dir))
    if not a.no_bench:
        bench({n: Fp8Kernel(a.build_dir, n) for n in stage_counts}, Quantizer(a.build_dir), harness.Kernel(a.build_dir))
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
