#!/usr/bin/env python3
"""`train` on a large token shard set beside a small one: resident memory and tokens/s.

Writes two sets of llm.c-format shards of random GPT-2-range token ids (u16, 100M tokens per
shard): --big-gb and --small-mb of tokens, each with a validation shard, then runs the given
`train` binary on each (gpt2_small by default, --steps steps, `data.source = "shards"`,
`model.vocab_size = 50304`) and prints one table: the set's size, the run's median tokens/s
(summary.json) and its peak resident memory (the child's max RSS, which counts the pages of the
memory-mapped shards it touched).

    python3 tools/shard_runs.py TRAIN_BINARY TOKENIZER_JSON [--big-gb 10] [--small-mb 100]
        [--steps 60] [--config configs/gpt2_small.toml] [--work /tmp/shard_runs]

Runs on a GPU machine with numpy; each run in its own directory with a CubeCL cache of its own.
"""
import argparse
import json
import os
import resource
import subprocess
import sys

import numpy as np

HEADER_INTS = 256
PER_SHARD = 100_000_000


def write_set(directory, tokens, seed):
    """llm.c shards (magic 20240520, version 1, u16) holding `tokens` training tokens and one
    validation shard of a tenth as many (at most one shard)."""
    os.makedirs(directory, exist_ok=True)
    rng = np.random.default_rng(seed)
    parts = [("train", i, min(PER_SHARD, tokens - i * PER_SHARD))
             for i in range((tokens + PER_SHARD - 1) // PER_SHARD)]
    parts.append(("val", 0, max(100_000, min(PER_SHARD, tokens // 10))))
    for split, i, n in parts:
        path = os.path.join(directory, f"random_{split}_{i:06d}.bin")
        if os.path.exists(path) and os.path.getsize(path) == HEADER_INTS * 4 + 2 * n:
            continue
        header = np.zeros(HEADER_INTS, dtype=np.int32)
        header[:3] = (20240520, 1, n)
        with open(path + ".partial", "wb") as f:
            f.write(header.tobytes())
            f.write(rng.integers(0, 50257, size=n, dtype=np.uint16).tobytes())
        os.rename(path + ".partial", path)


def run(train, config, tokenizer, shards, out, steps):
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "cubecl.toml"), "w") as f:
        f.write('[compilation]\ncache = "target"\n\n[autotune]\ncache = "target"\n')
    cmd = [train, config, "--out", os.path.join(out, "run"),
           "--set", "data.source=shards", "--set", f"data.path={shards}",
           "--set", "data.tokenizer=file", "--set", f"data.tokenizer_path={tokenizer}",
           "--set", "model.vocab_size=50304", "--set", f"training.steps={steps}",
           "--set", f"training.eval_interval={steps}", "--set", f"training.checkpoint_interval={steps}"]
    before = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    done = subprocess.run(cmd, cwd=out, capture_output=True, text=True)
    if done.returncode != 0:
        sys.exit(f"train failed on {shards}:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    rss_kb = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    if rss_kb <= before:
        print(f"note: the max RSS did not grow past an earlier run's ({before} kB)")
    with open(os.path.join(out, "run", "summary.json")) as f:
        summary = json.load(f)
    return summary["median_tokens_per_s"], rss_kb / 1024 / 1024


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("train")
    ap.add_argument("tokenizer")
    ap.add_argument("--big-gb", type=float, default=10.0)
    ap.add_argument("--small-mb", type=float, default=100.0)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--config", default=os.path.join(os.path.dirname(__file__), "..", "configs", "gpt2_small.toml"))
    ap.add_argument("--work", default="/tmp/shard_runs")
    args = ap.parse_args()
    train = os.path.realpath(args.train)
    config = os.path.realpath(args.config)
    tokenizer = os.path.realpath(args.tokenizer)
    rows = []
    # The small set first: the max RSS of the children only grows, so the big set's figure is
    # its own only if it is at least the small one's.
    for name, nbytes in [("small", args.small_mb * 1e6), ("big", args.big_gb * 1e9)]:
        shards = os.path.join(args.work, name)
        write_set(shards, int(nbytes // 2), seed=len(name))
        tps, rss_gib = run(train, config, tokenizer, shards, os.path.join(args.work, f"run_{name}"), args.steps)
        rows.append((name, nbytes, tps, rss_gib))
    print("| shard set | tokens | median tokens/s | peak RSS (GiB) |")
    print("|---|---|---|---|")
    for name, nbytes, tps, rss in rows:
        print(f"| {name} ({nbytes / 1e9:.1f} GB) | {nbytes / 2:.3g} | {tps:.0f} | {rss:.2f} |")
    print(f"big / small tokens/s: {rows[1][2] / rows[0][2]:.3f}")


if __name__ == "__main__":
    main()
