#!/usr/bin/env python3
"""`train` on a large token shard set beside a small one: resident memory and tokens/s.

Writes two sets of llm.c-format shards of random GPT-2-range token ids (u16, 100M tokens per
shard): --big-gb and --small-mb of tokens, each with a validation shard, then runs the given
`train` binary on each (gpt2_small by default, --steps steps, `data.source = "shards"`,
`model.vocab_size = 50304`) and prints one table: the set's size, the run's median tokens/s
(summary.json) and its peak resident memory (the child's max RSS, which counts the pages of the
memory-mapped shards it touched). For each run it also prints where the resident memory was at
its peak: anonymous, file-backed and shared pages (/proc/PID/status), the largest mappings
(/proc/PID/smaps, grouped by what they map) and the run's last log line at that moment.

    python3 tools/shard_runs.py TRAIN_BINARY TOKENIZER_JSON [--big-gb 10] [--small-mb 100]
        [--steps 60] [--config configs/gpt2_small.toml] [--work /tmp/shard_runs]

TOKENIZER_JSON is any tokenizer of at least 50,257 tokens (GPT-2's); `synthetic` writes one of
that size with the `tokenizers` library (byte-level BPE whose merges are byte pairs), for machines
that cannot download GPT-2's.

Runs on a GPU machine with numpy; each run in its own directory with a CubeCL cache of its own.
"""
import argparse
import json
import os
import resource
import subprocess
import sys
import threading
import time

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


def synthetic_tokenizer(path):
    """A byte-level BPE of GPT-2's size: the 256 bytes, 50,000 merges of byte pairs, and
    <|endoftext|> as id 50256."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {c: i for i, c in enumerate(alphabet)}
    merges = []
    for a in alphabet:
        for b in alphabet:
            if len(vocab) == 50256:
                break
            if a + b not in vocab:
                vocab[a + b] = len(vocab)
                merges.append((a, b))
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<|endoftext|>"])
    assert tok.get_vocab_size() == 50257, tok.get_vocab_size()
    tok.save(path)
    return path


def run(train, config, tokenizer, shards, out, steps):
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "cubecl.toml"), "w") as f:
        f.write('[compilation]\ncache = "target"\n\n[autotune]\ncache = "target"\n')
    cmd = [train, config, "--out", os.path.join(out, "run"),
           "--set", "data.source=shards", "--set", f"data.path={shards}",
           "--set", "data.tokenizer=file", "--set", f"data.tokenizer_path={tokenizer}",
           "--set", "model.vocab_size=50304", "--set", f"training.steps={steps}",
           "--set", f"training.eval_interval={steps}", "--set", f"training.checkpoint_interval={steps}"]
    log_path = os.path.join(out, "train.log")
    with open(log_path, "w") as log:
        child = subprocess.Popen(cmd, cwd=out, stdout=log, stderr=subprocess.STDOUT, text=True)
        peak = PeakWatcher(child.pid, log_path)
        peak.start()
        code = child.wait()
        peak.stop()
    if code != 0:
        with open(log_path) as f:
            sys.exit(f"train failed on {shards}:\n{f.read()[-6000:]}")
    peak.report(os.path.basename(out))
    rss_kb = peak.hwm_kb or resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    with open(os.path.join(out, "run", "summary.json")) as f:
        summary = json.load(f)
    return summary["median_tokens_per_s"], rss_kb / 1024 / 1024


class PeakWatcher(threading.Thread):
    """Polls a process's resident memory and keeps the breakdown of its highest reading."""

    def __init__(self, pid, log_path):
        super().__init__(daemon=True)
        self.pid, self.log_path, self.done = pid, log_path, threading.Event()
        self.best_kb, self.best, self.hwm_kb = 0, None, 0

    def run(self):
        while not self.done.is_set():
            try:
                status = self.read_status()
                self.hwm_kb = max(self.hwm_kb, status.get("VmHWM", 0))
                if status.get("VmRSS", 0) > self.best_kb:
                    self.best_kb = status["VmRSS"]
                    self.best = (status, self.read_smaps(), self.last_log_line(), time.time())
            except (OSError, ValueError):
                pass
            self.done.wait(0.2)

    def stop(self):
        self.done.set()
        self.join()

    def read_status(self):
        out = {}
        with open(f"/proc/{self.pid}/status") as f:
            for line in f:
                key, _, rest = line.partition(":")
                if key in ("VmRSS", "VmHWM", "RssAnon", "RssFile", "RssShmem", "VmLck", "VmPin", "Threads"):
                    out[key] = int(rest.split()[0])
        return out

    def read_smaps(self):
        """Resident kB by what a mapping maps (a file's name, or [heap], [anon] ...)."""
        by_name, name = {}, None
        with open(f"/proc/{self.pid}/smaps") as f:
            for line in f:
                parts = line.split()
                if "-" in parts[0] and len(parts) >= 5 and not parts[0].endswith(":"):
                    name = parts[5] if len(parts) > 5 else "[anon]"
                elif parts[0] == "Rss:":
                    by_name[name] = by_name.get(name, 0) + int(parts[1])
        return sorted(by_name.items(), key=lambda kv: -kv[1])[:12]

    def last_log_line(self):
        with open(self.log_path, errors="replace") as f:
            lines = [l for l in f.read().splitlines() if l.strip()]
        return lines[-1][:160] if lines else ""

    def report(self, name):
        if self.best is None:
            print(f"{name}: no resident memory reading")
            return
        status, maps, line, _ = self.best
        print(f"{name}: peak VmRSS {status.get('VmRSS', 0) / 2**20:.2f} GiB (VmHWM {status.get('VmHWM', 0) / 2**20:.2f}),"
              f" anon {status.get('RssAnon', 0) / 2**20:.2f}, file {status.get('RssFile', 0) / 2**20:.2f},"
              f" shmem {status.get('RssShmem', 0) / 2**20:.2f}, locked {status.get('VmLck', 0) / 2**20:.2f},"
              f" pinned {status.get('VmPin', 0) / 2**20:.2f} GiB, {status.get('Threads', 0)} threads")
        print(f"  last log line then: {line}")
        for what, kb in maps:
            print(f"  {kb / 2**20:8.3f} GiB  {what}")


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
    os.makedirs(args.work, exist_ok=True)
    if args.tokenizer == "synthetic":
        tokenizer = synthetic_tokenizer(os.path.join(os.path.realpath(args.work), "tokenizer.json"))
    else:
        tokenizer = os.path.realpath(args.tokenizer)
    rows = []
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
