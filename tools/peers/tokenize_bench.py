#!/usr/bin/env python3
"""The Python peers of `prepare_bench`: Hugging Face `tokenizers`' batch encode and, where it is
installed with an encoding it can load offline, `tiktoken`'s `encode_ordinary_batch`, on the same
documents (a text file's blank-line-separated paragraphs, as `prepare` cuts them) with the same
number of threads.

    python3 tools/peers/tokenize_bench.py --text corpus.txt --tokenizer tokenizer.json --threads 16
        [--tiktoken gpt2]

Prints one JSON object per peer: its name, MB of text per second and tokens per second (reading
and cutting the file is not timed; tokenizing every document is), or why it did not run.
"""
import argparse
import json
import os
import time


def paragraphs(text):
    docs, current = [], []
    for line in text.splitlines(keepends=True):
        if line.strip():
            current.append(line)
        elif current:
            docs.append("".join(current))
            current = []
    if current:
        docs.append("".join(current))
    return docs


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--text", required=True)
    ap.add_argument("--tokenizer", required=True)
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--tiktoken", default="gpt2")
    args = ap.parse_args()
    # The Rust library under `tokenizers` sizes its pool from this variable.
    os.environ["RAYON_NUM_THREADS"] = str(args.threads)
    os.environ["TOKENIZERS_PARALLELISM"] = "true"
    with open(args.text, encoding="utf-8") as f:
        text = f.read()
    mb = len(text.encode("utf-8")) / 1e6
    docs = paragraphs(text)

    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(args.tokenizer)
    t = time.perf_counter()
    encoded = tok.encode_batch(docs, add_special_tokens=False)
    secs = time.perf_counter() - t
    tokens = sum(len(e.ids) for e in encoded)
    print(json.dumps({"peer": "tokenizers encode_batch", "threads": args.threads,
                      "mb_s": mb / secs, "tokens_s": tokens / secs, "tokens": tokens}))

    try:
        import tiktoken

        enc = tiktoken.get_encoding(args.tiktoken)
    except Exception as e:  # not installed, or its encoding cannot be fetched offline
        print(json.dumps({"peer": "tiktoken", "skipped": f"{type(e).__name__}: {e}"[:200]}))
        return
    t = time.perf_counter()
    ids = enc.encode_ordinary_batch(docs, num_threads=args.threads)
    secs = time.perf_counter() - t
    tokens = sum(len(i) for i in ids)
    print(json.dumps({"peer": f"tiktoken {args.tiktoken} (its own vocabulary)",
                      "threads": args.threads, "mb_s": mb / secs, "tokens_s": tokens / secs,
                      "tokens": tokens}))


if __name__ == "__main__":
    main()
