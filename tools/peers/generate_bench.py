#!/usr/bin/env python3
"""`sample` beside Hugging Face `transformers`' `generate` on the same model and GPU.

    python3 tools/peers/generate_bench.py --export DIR --run RUN_DIR --sample BIN
        [--batches 1,32] [--new-tokens 256] [--prompt "The "] [--repeats 3]

DIR is `export RUN_DIR DIR --dtype bf16`'s output; `generate` runs it in bf16 on the GPU with
its default (dynamic) cache, eager. Ours is `BIN RUN_DIR` (the `sample` binary) in the run's
compute dtype. Both continue the same prompt text by exactly `--new-tokens` tokens per sequence
(`min_new_tokens` keeps `generate` from stopping at an end-of-text token), greedy and sampled
(temperature 0.8 among the 200 most likely), for every batch size. `generate` is timed after one
untimed call (CUDA synchronised around each call); ours reports its own tokens/s (from the
prompt's forward to the last token), the first of its runs in the call being whatever the kernel
cache held before (empty on a fresh machine). Prints one JSON object per measurement and a
Markdown table of tokens/s (new tokens over every sequence per second), median of the repeats.
"""
import argparse
import json
import re
import statistics
import subprocess
import time

import torch
from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

MODES = {"greedy": dict(temperature=0.0), "sampled": dict(temperature=0.8, top_k=200)}


def hf_tokens_per_s(model, ids, new_tokens, mode):
    kwargs = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, pad_token_id=0)
    if mode == "greedy":
        kwargs.update(do_sample=False)
    else:
        kwargs.update(do_sample=True, temperature=0.8, top_k=200, top_p=1.0)
    torch.cuda.synchronize()
    start = time.perf_counter()
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), **kwargs)
    torch.cuda.synchronize()
    secs = time.perf_counter() - start
    made = (out.shape[1] - ids.shape[1]) * out.shape[0]
    return made / secs


def ours(args, batch, mode):
    cmd = [args.sample, args.run, "--prompt", args.prompt, "--max-new-tokens", str(args.new_tokens),
           "--num-samples", str(batch), "--temperature", str(MODES[mode]["temperature"]),
           "--top-k", str(MODES[mode].get("top_k", 0))]
    p = subprocess.run(cmd, capture_output=True, text=True)
    if p.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{p.stderr[-3000:]}")
    m = re.search(r"(\d+) tokens in ([\d.]+) s \(([\d.]+) tokens/s, (\w+); first token after ([\d.]+) s\)",
                  p.stderr)
    if not m:
        raise SystemExit(f"no tokens/s line in sample's output:\n{p.stderr[-3000:]}")
    tokens, _, rate, dtype, first = m.groups()
    assert int(tokens) == batch * args.new_tokens, p.stderr
    return float(rate), float(first), dtype


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--export", required=True)
    ap.add_argument("--run", required=True)
    ap.add_argument("--sample", required=True)
    ap.add_argument("--batches", default="1,32")
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--prompt", default="The ")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    batches = [int(b) for b in args.batches.split(",")]

    rows = {}
    # Ours first, so that its first run meets the kernel cache as the call found it.
    for mode in MODES:
        for batch in batches:
            runs = [ours(args, batch, mode) for _ in range(args.repeats)]
            for i, (rate, first, dtype) in enumerate(runs):
                print(json.dumps({"engine": "burnmix sample", "mode": mode, "batch": batch, "run": i,
                                  "tokens_per_s": rate, "first_token_s": first, "dtype": dtype}), flush=True)
            rows[(mode, batch, "ours")] = statistics.median(r[0] for r in runs[1:] or runs)
            rows[(mode, batch, "ours_first")] = runs[0][0]

    tok = PreTrainedTokenizerFast(tokenizer_file=f"{args.export}/tokenizer.json")
    model = AutoModelForCausalLM.from_pretrained(args.export, dtype=torch.bfloat16).cuda().eval()
    prompt = tok(args.prompt, add_special_tokens=False, return_tensors="pt").input_ids.cuda()
    for mode in MODES:
        for batch in batches:
            ids = prompt.repeat(batch, 1)
            hf_tokens_per_s(model, ids, args.new_tokens, mode)
            rates = [hf_tokens_per_s(model, ids, args.new_tokens, mode) for _ in range(args.repeats)]
            print(json.dumps({"engine": "transformers generate", "mode": mode, "batch": batch,
                              "tokens_per_s": rates}), flush=True)
            rows[(mode, batch, "hf")] = statistics.median(rates)

    print(f"\n{torch.cuda.get_device_name()}, {args.new_tokens} new tokens a sequence, prompt {args.prompt!r}")
    print("| decoding | batch | `sample` (first run in the call) | `sample` (median of the others) "
          "| `transformers` `generate` | ours / theirs |")
    print("|---|---|---|---|---|---|")
    for mode in MODES:
        for batch in batches:
            a, first, b = rows[(mode, batch, "ours")], rows[(mode, batch, "ours_first")], rows[(mode, batch, "hf")]
            print(f"| {mode} | {batch} | {first:,.0f} | {a:,.0f} | {b:,.0f} | {a / b:.2f}x |")


if __name__ == "__main__":
    main()
