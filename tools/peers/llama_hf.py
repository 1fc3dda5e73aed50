#!/usr/bin/env python3
"""Training throughput and peak memory of Hugging Face `transformers`' LlamaForCausalLM, the peer of
`configs/llama_*.toml`: the same shape (width, layers, query and key/value heads, SwiGLU width,
vocabulary, tied or untied head, RoPE theta and Llama 3 scaling), SDPA attention, f32 weights with
bf16 autocast, torch.compile, fused AdamW (lr 3e-4, betas 0.9 / 0.95, weight decay 0.1), gradient
clipping at 1.0; `--recompute full` wraps every decoder layer in `torch.utils.checkpoint`
(`gradient_checkpointing_enable`), the counterpart of `model.recompute = "full"`. Random token
ids: the figures are speed and memory only.

    python3 tools/peers/llama_hf.py --preset llama_1b [--batch 4] [--context 2048]
        [--steps 30] [--warmup 10] [--recompute none|full] [--no-compile]

Prints one line of JSON: median tokens/s over the steps after --warmup (each step timed with CUDA
events), MFU against --peak-tflops (989.5, the H100/H200 SXM dense BF16 peak, by default; FLOPs
per token 6 x parameters + 12 x layers x width x context, as the trainer counts them), and the
peak memory PyTorch allocated and reserved.
"""
import argparse
import json
import statistics

import torch

PRESETS = {
    # width, layers, heads, kv heads, d_ff, vocab, tied, rope scaling
    "llama_125m": (768, 12, 12, 4, 2048, 32000, False, None),
    "llama_1b": (2048, 16, 32, 8, 8192, 128256, True, 32.0),
    "llama_3b": (3072, 28, 24, 8, 8192, 128256, True, 32.0),
    "llama_8b": (4096, 32, 32, 8, 14336, 128256, False, None),
}


def build(preset, context):
    from transformers import LlamaConfig, LlamaForCausalLM

    d, layers, heads, kv, ff, vocab, tied, factor = PRESETS[preset]
    scaling = None
    if factor is not None:
        scaling = {
            "rope_type": "llama3",
            "factor": factor,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        }
    cfg = LlamaConfig(
        vocab_size=vocab,
        hidden_size=d,
        intermediate_size=ff,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        max_position_embeddings=max(context, 8192),
        rms_norm_eps=1e-5,
        rope_theta=500000.0,
        rope_scaling=scaling,
        tie_word_embeddings=tied,
        attention_bias=False,
        mlp_bias=False,
        use_cache=False,
    )
    model = LlamaForCausalLM._from_config(cfg, attn_implementation="sdpa", torch_dtype=torch.float32)
    return model, cfg


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--preset", default="llama_1b", choices=sorted(PRESETS))
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--context", type=int, default=2048)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--recompute", default="none", choices=["none", "full"])
    p.add_argument("--no-compile", action="store_true")
    p.add_argument("--peak-tflops", type=float, default=989.5)
    a = p.parse_args()

    torch.manual_seed(0)
    torch.backends.cuda.matmul.allow_tf32 = True
    dev = torch.device("cuda")
    model, cfg = build(a.preset, a.context)
    model.to(dev).train()
    if a.recompute == "full":
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    params = sum(t.numel() for t in model.parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, betas=(0.9, 0.95), weight_decay=0.1,
                            fused=True)
    fwd = model if a.no_compile else torch.compile(model)

    def step(ids):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = fwd(input_ids=ids, labels=ids).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    gen = torch.Generator(device=dev).manual_seed(1)
    times = []
    torch.cuda.reset_peak_memory_stats()
    for i in range(a.steps):
        ids = torch.randint(0, cfg.vocab_size, (a.batch, a.context), device=dev, generator=gen)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        loss = step(ids)
        end.record()
        torch.cuda.synchronize()
        if i >= a.warmup:
            times.append(start.elapsed_time(end) / 1000.0)
    tokens = a.batch * a.context
    tok_s = tokens / statistics.median(times)
    flops_per_token = 6 * params + 12 * cfg.num_hidden_layers * cfg.hidden_size * a.context
    print(json.dumps({
        "preset": a.preset,
        "recompute": a.recompute,
        "batch": a.batch,
        "context": a.context,
        "params": params,
        "tokens_per_s": round(tok_s, 1),
        "step_s": round(statistics.median(times), 4),
        "mfu": round(tok_s * flops_per_token / (a.peak_tflops * 1e12), 4),
        "peak_allocated_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2),
        "peak_reserved_gib": round(torch.cuda.max_memory_reserved() / 2**30, 2),
        "final_loss": round(loss.item(), 4),
        "compiled": not a.no_compile,
    }))


if __name__ == "__main__":
    main()
