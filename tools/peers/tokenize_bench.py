#!/usr/bin/env python3
"""The Python peers of `prepare_bench`: Hugging Face `tokenizers`' batch encode and, where it is
installed, `tiktoken`'s `encode_ordinary_batch` (with the named encoding, or, where that cannot
be fetched offline, with the same byte-level BPE built from the tokenizer.json), on the same
documents (a text file's blank-line-separated paragraphs, as `prepare` cuts them) with the same
number of threads.

    python3 tools/peers/tokenize_bench.py --text corpus.txt --tokenizer tokenizer.json --threads 16
        [--tiktoken gpt2]

Prints one JSON object per peer: its name, MB of text per second and tokens per second (reading
and cutting the file is not timed; tokenizing every document is), or why it did not run.

The documents go to each library in batches of --batch documents and only the token counts are
kept, as a preparation script that writes shards would: one call over 1 GB of text holds every
`Encoding` at once (over 24 GiB of host memory for 250M tokens).
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
    ap.add_argument("--batch", type=int, default=8192, help="documents per batch call")
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
    batches = [docs[i:i + args.batch] for i in range(0, len(docs), args.batch)]
    t = time.perf_counter()
    tokens = 0
    for batch in batches:
        tokens += sum(len(e.ids) for e in tok.encode_batch(batch, add_special_tokens=False))
    secs = time.perf_counter() - t
    print(json.dumps({"peer": "tokenizers encode_batch", "threads": args.threads,
                      "mb_s": mb / secs, "tokens_s": tokens / secs, "tokens": tokens}))

    try:
        import tiktoken
    except ImportError as e:
        print(json.dumps({"peer": "tiktoken", "skipped": f"{type(e).__name__}: {e}"[:200]}))
        return
    try:
        enc, name = tiktoken.get_encoding(args.tiktoken), f"tiktoken {args.tiktoken} (its own vocabulary)"
    except Exception:  # its encoding cannot be fetched offline: the same BPE as ours instead
        enc, name = tiktoken_from(args.tokenizer), "tiktoken (the same byte-level BPE)"
    t = time.perf_counter()
    tokens = 0
    for batch in batches:
        tokens += sum(len(i) for i in enc.encode_ordinary_batch(batch, num_threads=args.threads))
    secs = time.perf_counter() - t
    print(json.dumps({"peer": name, "threads": args.threads, "mb_s": mb / secs,
                      "tokens_s": tokens / secs, "tokens": tokens}))


def tiktoken_from(tokenizer_json):
    """A tiktoken encoding of a byte-level BPE `tokenizer.json` (GPT-2's scheme, as `prepare
    --bpe-vocab` trains): each token's bytes ranked by its id (merged tokens' ids follow the
    merge order), GPT-2's pre-tokenization pattern."""
    import tiktoken

    model = json.load(open(tokenizer_json))["model"]
    # GPT-2's map from bytes to the printable characters byte-level tokens are spelled with.
    printable = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("\u00a1"), ord("\u00ac") + 1))
                 + list(range(ord("\u00ae"), ord("\u00ff") + 1)))
    chars, extra = dict(), 0
    for b in range(256):
        if b in printable:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    ranks = {}
    for token, i in model["vocab"].items():
        if all(c in chars for c in token):
            ranks[bytes(chars[c] for c in token)] = i
    pattern = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
    return tiktoken.Encoding(name="same-bpe", pat_str=pattern, mergeable_ranks=ranks, special_tokens={})


if __name__ == "__main__":
    main()
