#!/usr/bin/env python3
"""Training throughput of nanoGPT's shakespeare_char baby GPT in PyTorch, the peer of
`configs/shakespeare_char.toml` (6 layers, 6 heads, width 384, context 256, batch 64, dropout 0.2,
bias-free, tied embedding; LayerNorm and learned positions as nanoGPT has them). bf16 autocast,
torch.compile, flash SDPA with dropout, fused AdamW (lr 1e-3, betas 0.9 / 0.99, weight decay 0.1),
gradient clipping at 1.0, as nanoGPT's train.py. Random character ids: the figure is speed only.

    python3 tools/peers/nanogpt_char.py [--steps 300] [--warmup 50] [--no-compile]

`--preset gpt2_small` trains the peer of `configs/gpt2_small.toml` instead: 12 layers, 12 heads,
width 768, context 1024, batch 16, vocabulary 50304, no dropout, lr 6e-4 with betas 0.9 / 0.95
(nanoGPT's GPT-2 124M; learned positions and LayerNorm where ours has RoPE and RMSNorm).
`--n-layer`, `--n-head` and `--d-model` change the preset's shape (as `--set model.n_layer=...`
does for ours). `--gelu tanh` takes GELU's tanh approximation (`F.gelu(approximate="tanh")`), the
peer of `--set model.mlp=gelu_tanh`; the default is the exact GELU, as ours (`"gelu"`).

`--fp8 tensorwise|rowwise` runs the blocks' four projections with FP8 E4M3 GEMMs (fprop, dgrad and
wgrad; embedding, head, norms and attention stay bf16, as in our FP8 recipe): through torchao's
float8 training when torchao is installed (`--fp8-impl torchao`), else `torch._scaled_mm` in an
autograd function that scales each operand per tensor or per row along its reduction axis
(`--fp8-impl scaled_mm`), compiled with the rest of the model. `--fp8 blockwise` runs them through
torchao's prototype `Float8BlockwiseLinear` (1 x 128 activation and gradient scales, 128 x 128
weight scales: the granularity of our `fp8.scaling = "tile"`), which has no `scaled_mm` fallback;
`--fp8-blockwise-gemm triton` selects its Triton GEMMs where the installed torchao offers the
choice (its default is `torch`'s block-scaled `scaled_mm`).

Prints the median tokens/s over the steps after --warmup: each step timed with CUDA events from
its start to the next step's start, the host never waiting for the GPU inside the loop; then the
run's peak memory (PyTorch's caching allocator: the most allocated and the most reserved).

`--profile-steps N` runs the N steps after --warmup inside the CUDA profiler's capture range
(`cudaProfilerStart` / `cudaProfilerStop`) and stops there, for a profiler told to wait for it
(`ncu --profile-from-start off`, `nsys profile --capture-range=cudaProfilerApi`): as
`BURNMIX_PROFILE_STEPS` does for ours.
"""
import argparse
import statistics
import time

import torch
import torch.nn as nn
import torch.nn.functional as F


E4M3_MAX = 448.0


def _quantize(t, dim, rowwise):
    """E4M3 codes of `t` and the dequantization scale: amax per row along `dim`, or per tensor."""
    t32 = t.float()
    amax = t32.abs().amax(dim=dim, keepdim=True) if rowwise else t32.abs().amax()
    scale = E4M3_MAX / amax.clamp(min=1e-12)
    q = (t32 * scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return q, scale.reciprocal()


def _fp8_mm(a, b, rowwise):
    """a [m, k] @ b [k, n] in bf16 from FP8 operands, each scaled along k."""
    qa, sa = _quantize(a, 1, rowwise)
    qb, sb = _quantize(b, 0, rowwise)
    return torch._scaled_mm(qa.contiguous(), qb.t().contiguous().t(), scale_a=sa, scale_b=sb,
                            out_dtype=torch.bfloat16)


class _Fp8Linear(torch.autograd.Function):
    @staticmethod
    @torch.amp.custom_fwd(device_type="cuda", cast_inputs=torch.bfloat16)
    def forward(ctx, x, w, rowwise):
        ctx.save_for_backward(x, w)
        ctx.rowwise = rowwise
        return _fp8_mm(x, w.t(), rowwise)

    @staticmethod
    @torch.amp.custom_bwd(device_type="cuda")
    def backward(ctx, dy):
        x, w = ctx.saved_tensors
        dy = dy.to(torch.bfloat16)
        return _fp8_mm(dy, w, ctx.rowwise), _fp8_mm(dy.t(), x, ctx.rowwise), None


class Fp8Linear(nn.Linear):
    """nn.Linear (no bias) with its three GEMMs in FP8 through torch._scaled_mm."""

    rowwise = False

    def forward(self, x):
        lead = x.shape[:-1]
        y = _Fp8Linear.apply(x.reshape(-1, x.shape[-1]), self.weight, self.rowwise)
        return y.view(*lead, -1)


PROJECTIONS = ("qkv", "proj", "fc", "out")


class _Bf16Input(nn.Module):
    """Runs `inner` on its input cast to bf16, as autocast casts a plain Linear's input (a
    LayerNorm's output is f32 under autocast; torchao's blockwise layer is not autocast-aware)."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, x):
        return self.inner(x.to(torch.bfloat16))


def to_fp8_blockwise(model, impl, gemm):
    """Swaps the blocks' projections for torchao's Float8BlockwiseLinear; returns its name."""
    if impl == "scaled_mm":
        raise SystemExit("--fp8 blockwise runs through torchao only; drop --fp8-impl scaled_mm")
    try:
        from torchao.prototype.blockwise_fp8_training.linear import Float8BlockwiseLinear
    except ImportError as e:
        raise SystemExit(f"--fp8 blockwise needs torchao's Float8BlockwiseLinear ({e})")
    for blk in model.blocks:
        for name in PROJECTIONS:
            lin = getattr(blk, name)
            if lin.in_features % 128 or lin.out_features % 128:
                raise SystemExit(f"--fp8 blockwise: blocks' {name} is {lin.in_features} x "
                                 f"{lin.out_features}; both must be multiples of 128")
            if hasattr(Float8BlockwiseLinear, "from_float"):
                new = Float8BlockwiseLinear.from_float(lin)
            else:
                new = Float8BlockwiseLinear(lin.in_features, lin.out_features, bias=False,
                                            device=lin.weight.device)
                new.weight = lin.weight
            if gemm == "triton":
                if not hasattr(new, "use_triton"):
                    raise SystemExit("--fp8-blockwise-gemm triton: this torchao's "
                                     "Float8BlockwiseLinear has no GEMM choice")
                new.use_triton = True
            setattr(blk, name, _Bf16Input(new))
    chosen = getattr(new, "use_triton", None)
    gemms = {None: "", True: ", Triton GEMMs", False: ", scaled_mm GEMMs"}[chosen]
    return f"torchao Float8BlockwiseLinear{gemms}"


def to_fp8(model, recipe, impl, blockwise_gemm="default"):
    """Swaps the blocks' projections for FP8 ones; returns the implementation used."""
    if recipe == "blockwise":
        return to_fp8_blockwise(model, impl, blockwise_gemm)
    if impl in ("auto", "torchao"):
        try:
            from torchao.float8 import Float8LinearConfig, convert_to_float8_training
        except ImportError:
            if impl == "torchao":
                raise SystemExit("--fp8-impl torchao: torchao is not installed")
        else:
            convert_to_float8_training(
                model, config=Float8LinearConfig.from_recipe_name(recipe),
                module_filter_fn=lambda m, name: name.startswith("blocks."))
            return "torchao"
    for blk in model.blocks:
        for name in PROJECTIONS:
            lin = getattr(blk, name)
            new = Fp8Linear(lin.in_features, lin.out_features, bias=False,
                            device=lin.weight.device)
            new.weight = lin.weight
            new.rowwise = recipe == "rowwise"
            setattr(blk, name, new)
    return "scaled_mm"


class Block(nn.Module):
    def __init__(self, d, h, p, gelu="none"):
        super().__init__()
        self.h, self.p, self.gelu = h, p, gelu
        self.ln1, self.ln2 = nn.LayerNorm(d, bias=False), nn.LayerNorm(d, bias=False)
        self.qkv, self.proj = nn.Linear(d, 3 * d, bias=False), nn.Linear(d, d, bias=False)
        self.fc, self.out = nn.Linear(d, 4 * d, bias=False), nn.Linear(4 * d, d, bias=False)
        self.drop = nn.Dropout(p)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=2)
        q, k, v = (z.view(b, t, self.h, d // self.h).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=self.p if self.training else 0.0,
                                           is_causal=True)
        x = x + self.drop(self.proj(y.transpose(1, 2).reshape(b, t, d)))
        return x + self.drop(self.out(F.gelu(self.fc(self.ln2(x)), approximate=self.gelu)))


class GPT(nn.Module):
    def __init__(self, vocab=65, n_layer=6, n_head=6, d=384, t=256, p=0.2, gelu="none"):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, d), nn.Embedding(t, d)
        self.drop = nn.Dropout(p)
        self.blocks = nn.ModuleList(Block(d, n_head, p, gelu) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(d, bias=False)
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.wte.weight
        self.apply(lambda m: nn.init.normal_(m.weight, std=0.02)
                   if isinstance(m, (nn.Linear, nn.Embedding)) else None)

    def forward(self, idx, targets):
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.drop(self.wte(idx) + self.wpe(pos))
        for blk in self.blocks:
            x = blk(x)
        logits = self.head(self.ln_f(x))
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--warmup", type=int, default=50)
    ap.add_argument("--batch", type=int, default=None)
    ap.add_argument("--preset", choices=["shakespeare_char", "gpt2_small"], default="shakespeare_char")
    ap.add_argument("--no-compile", action="store_true")
    ap.add_argument("--fp8", choices=["tensorwise", "rowwise", "blockwise"], default=None)
    ap.add_argument("--fp8-impl", choices=["auto", "torchao", "scaled_mm"], default="auto")
    ap.add_argument("--fp8-blockwise-gemm", choices=["default", "triton"], default="default",
                    help="--fp8 blockwise: torchao's default GEMM or its Triton ones")
    ap.add_argument("--n-layer", type=int, default=None, help="override the preset's layers")
    ap.add_argument("--n-head", type=int, default=None, help="override the preset's heads")
    ap.add_argument("--d-model", type=int, default=None, help="override the preset's width")
    ap.add_argument("--gelu", choices=["exact", "tanh"], default="exact",
                    help="GELU exact (the default, as ours) or its tanh approximation (model.mlp = gelu_tanh)")
    ap.add_argument("--profile-steps", type=int, default=0,
                    help="capture the N steps after --warmup for a CUDA profiler, then stop")
    a = ap.parse_args()
    if a.profile_steps and a.warmup + a.profile_steps > a.steps:
        ap.error(f"--profile-steps {a.profile_steps} after --warmup {a.warmup} needs --steps "
                 f"{a.warmup + a.profile_steps} or more")
    if a.fp8_blockwise_gemm != "default" and a.fp8 != "blockwise":
        ap.error("--fp8-blockwise-gemm applies to --fp8 blockwise only")
    if a.steps <= a.warmup:
        ap.error(f"--steps {a.steps} leaves no step after --warmup {a.warmup} to time")
    if a.preset == "gpt2_small":
        shape = dict(vocab=50304, n_layer=12, n_head=12, d=768, t=1024, p=0.0)
        batch, lr, betas = a.batch or 16, 6e-4, (0.9, 0.95)
    else:
        shape = dict(vocab=65, n_layer=6, n_head=6, d=384, t=256, p=0.2)
        batch, lr, betas = a.batch or 64, 1e-3, (0.9, 0.99)
    for key, value in (("n_layer", a.n_layer), ("n_head", a.n_head), ("d", a.d_model)):
        if value is not None:
            shape[key] = value
    if shape["d"] % shape["n_head"] != 0:
        ap.error(f"--d-model {shape['d']} is not a multiple of --n-head {shape['n_head']}")
    vocab, ctx = shape["vocab"], shape["t"]
    torch.manual_seed(1337)
    torch.backends.cuda.matmul.allow_tf32 = True
    model = GPT(**shape, gelu="tanh" if a.gelu == "tanh" else "none").cuda()
    if a.fp8:
        print(f"fp8 {a.fp8} through {to_fp8(model, a.fp8, a.fp8_impl, a.fp8_blockwise_gemm)}")
    decay = [p for p in model.parameters() if p.dim() >= 2]
    other = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                             {"params": other, "weight_decay": 0.0}],
                            lr=lr, betas=betas, fused=True)
    step_fn = model if a.no_compile else torch.compile(model)
    t0 = time.time()
    # One CUDA event at each step's start and one after the last: a step's time runs from its
    # start to the next step's, so time the GPU waits between steps counts. No synchronization
    # inside the loop after the first step, so the host runs ahead as in nanoGPT's train.py
    # (which reads the loss only every log_interval steps).
    starts, end = [], torch.cuda.Event(enable_timing=True)
    for step in range(a.steps):
        if a.profile_steps and step == a.warmup:
            torch.cuda.synchronize()
            torch.cuda.profiler.start()
        x = torch.randint(0, vocab, (batch, ctx), device="cuda")
        y = torch.randint(0, vocab, (batch, ctx), device="cuda")
        starts.append(torch.cuda.Event(enable_timing=True))
        starts[-1].record()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = step_fn(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if step == 0:
            torch.cuda.synchronize()
            print(f"first step (compile) {time.time() - t0:.1f} s")
        if a.profile_steps and step + 1 == a.warmup + a.profile_steps:
            end.record()
            torch.cuda.synchronize()
            torch.cuda.profiler.stop()
            print(f"captured steps {a.warmup + 1}-{step + 1} for the CUDA profiler")
            break
    else:
        end.record()
    torch.cuda.synchronize()
    marks = starts[a.warmup:] + [end]
    times = [b.elapsed_time(e) / 1e3 for b, e in zip(marks, marks[1:])]
    med = statistics.median(times)
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}")
    label = a.preset + f" ({shape['n_layer']} layers, width {shape['d']}, {shape['n_head']} heads)"
    label += f" fp8 {a.fp8}" if a.fp8 else ""
    print(f"{label}: median step {med * 1e3:.2f} ms, {batch * ctx / med:.0f} tokens/s "
          f"(steps {a.warmup + 1}-{a.warmup + len(times)}), final loss {loss.item():.4f}")
    gib = 1024 ** 3
    print(f"peak memory {torch.cuda.max_memory_allocated() / gib:.2f} GiB allocated, "
          f"{torch.cuda.max_memory_reserved() / gib:.2f} GiB reserved")


if __name__ == "__main__":
    main()
