#!/usr/bin/env python3
"""Where a training step's GPU time goes, ours beside a peer's: kernel time per kind of work, per
step, from `ncu` CSV logs of the same number of captured steps.

Capture the steps on the GPU machine (the same flags for both, so that both run at the GPU's own
clocks and with warm caches, as in training):

    BURNMIX_PROFILE_STEPS=11-12 ncu --profile-from-start off --clock-control none \\
        --cache-control none --metrics gpu__time_duration.sum --csv --print-units base \\
        train configs/gpt2_small.toml --set training.steps=12 ... > ours.csv
    ncu (same flags) python3 tools/peers/nanogpt_char.py --preset gpt2_small --warmup 10 \\
        --profile-steps 2 > peer.csv

then

    python3 tools/step_kernels.py ours.csv peer.csv --steps 2 [--top 15]

Prints a Markdown table of milliseconds per step by kind (matrix products, FP8 quantization,
attention forward and backward, norms, activations, loss, optimizer, embedding, the rest), each
side's total kernel time and the ratio, then each side's largest kernels. Kernel time only: the time
the GPU waits between kernels is not in an `ncu` log (each kernel runs alone).

A log may also be a `tools/cupti-trace` timeline (CSV, or gzipped) of the captured steps: its kernels
between the profiler's start and stop are counted (then kernels that overlap each count whole), and
the step's share of each kind is printed beside the milliseconds. The peer is optional:

    python3 tools/step_kernels.py fp8.csv --steps 3
"""
import argparse
import collections
import csv
import gzip
import re
import sys

# (kind, pattern over the lowercased kernel name), first match wins: attention before matrix
# products (cuDNN's attention kernels are named like GEMMs), the loss before norms.
KINDS = [
    ("attention backward", r"flash_bwd|flash_backward|flash_dq|flash_delta|dq_from|dkdv|bprop|fmha.*bwd|attention.*backward"),
    ("attention forward", r"flash_fwd|flash_forward|fprop|fmha|attention"),
    # cuBLASLt's Hopper kernels name FP8 operands `qq` (`nvjet_sm90_qqtst_..`) where bf16 ones
    # are `tst`/`tss`.
    ("matrix products, FP8 operands", r"nvjet_sm\d+_qq|e4m3|e5m2"),
    ("matrix products (GEMM)", r"nvjet|gemm|xmma|cutlass|cublas|matmul|sm90_|sm80_"),
    # The FP8 quantizers (with GELU's prologue where it is fused), per-tensor amaxes, the delayed
    # scaling's history updates and dequantization.
    ("FP8 quantization", r"quantiz|fp8_tensor_amax|amax"),
    ("optimizer and gradient norm", r"adam|multi_tensor|foreach|sum_squares|clip|grad_norm|norm_squared"),
    ("loss (cross-entropy)", r"ce_fwd|ce_bwd|cross_entropy|log_softmax|nll"),
    ("norms", r"rms_norm|layer_norm|_norm"),
    ("activations", r"gelu|swiglu|silu|tanh"),
    ("rotary embedding", r"rope|rotary"),
    ("token embedding", r"embedding|embed|scatter|index_put|gather"),
]
OTHER = "the rest (copies, casts, elementwise, random)"
UNITS = {"nsecond": 1e-6, "ns": 1e-6, "usecond": 1e-3, "us": 1e-3, "msecond": 1.0, "ms": 1.0,
         "second": 1e3, "s": 1e3}


def kind_of(name):
    low = name.lower()
    for kind, pattern in KINDS:
        if re.search(pattern, low):
            return kind
    return OTHER


def read_cupti(path):
    """{kernel name: (launches, milliseconds)} of the kernels a cupti-trace timeline records between
    the CUDA profiler's start and stop."""
    opener = gzip.open if path.endswith(".gz") else open
    kernels, marks = [], []
    with opener(path, "rt", newline="", errors="replace") as f:
        for row in csv.reader(f):
            if len(row) < 7:
                continue
            if row[0] == "kernel":
                kernels.append((int(row[1]), int(row[2]), row[6]))
            elif row[0] in ("driver", "runtime") and "Profiler" in row[6]:
                marks.append((int(row[1]), row[6]))
    starts = [t for t, n in marks if "Start" in n]
    stops = [t for t, n in marks if "Stop" in n]
    if not starts or not stops:
        sys.exit(f"{path}: no profiler start and stop (was BURNMIX_PROFILE_STEPS set?)")
    lo, hi = min(starts), max(stops)
    rows = collections.defaultdict(lambda: [0, 0.0])
    for s, e, name in kernels:
        if lo <= s <= hi:
            rows[name][0] += 1
            rows[name][1] += (e - s) * 1e-6
    if not rows:
        sys.exit(f"{path}: no kernel between the profiler's start and stop")
    return rows


def read(path):
    """{kernel name: (launches, milliseconds)} from an ncu --csv log (other lines skipped), or from
    a cupti-trace timeline."""
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt", errors="replace") as f:
        first = f.readline()
    if first.startswith("what,start_ns"):
        return read_cupti(path)
    rows = collections.defaultdict(lambda: [0, 0.0])
    with open(path, newline="", errors="replace") as f:
        lines = [l for l in f if l.startswith('"')]
    for r in csv.DictReader(lines):
        if r.get("Metric Name") != "gpu__time_duration.sum":
            continue
        unit = UNITS.get(r.get("Metric Unit", "nsecond"))
        if unit is None:
            sys.exit(f"{path}: unknown unit {r.get('Metric Unit')!r}")
        value = float(r["Metric Value"].replace(",", ""))
        name = r["Kernel Name"]
        rows[name][0] += 1
        rows[name][1] += value * unit
    if not rows:
        sys.exit(f"{path}: no gpu__time_duration.sum rows (was the capture range reached?)")
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("ours")
    ap.add_argument("peer", nargs="?")
    ap.add_argument("--steps", type=int, required=True, help="steps each log captured")
    ap.add_argument("--top", type=int, default=15)
    a = ap.parse_args()
    paths = [a.ours] + ([a.peer] if a.peer else [])
    sides = [read(p) for p in paths]
    by_kind = [collections.Counter() for _ in sides]
    for side, kinds in zip(sides, by_kind):
        for name, (_, ms) in side.items():
            kinds[kind_of(name)] += ms / a.steps
    totals = [sum(k.values()) for k in by_kind]
    if a.peer:
        print("| kind | ours, ms a step | share | peer, ms a step | share | ours / peer |")
        print("|---|---|---|---|---|---|")
    else:
        print("| kind | ms a step | share of the kernel time |")
        print("|---|---|---|")
    for kind in [k for k, _ in KINDS] + [OTHER]:
        ms = [k[kind] for k in by_kind]
        if not any(ms):
            continue
        cells = " | ".join(f"{m:.2f} | {100 * m / t:.1f}%" for m, t in zip(ms, totals))
        ratio = ""
        if a.peer:
            ratio = f" | {ms[0] / ms[1]:.2f}x" if ms[1] > 0 else " | -"
        print(f"| {kind} | {cells}{ratio} |")
    cells = " | ".join(f"**{t:.2f}** | 100%" for t in totals)
    ratio = f" | **{totals[0] / totals[1]:.2f}x**" if a.peer else ""
    print(f"| **all kernels** | {cells}{ratio} |")
    for label, side in zip(("ours", "peer"), sides):
        launches = sum(n for n, _ in side.values()) / a.steps
        print(f"\n{label}: {launches:.0f} launches a step; largest kernels (ms a step, launches a step):")
        top = sorted(side.items(), key=lambda kv: -kv[1][1])[: a.top]
        for name, (n, ms) in top:
            print(f"  {ms / a.steps:8.3f}  {n / a.steps:6.1f}  [{kind_of(name)}]  {name[:110]}")


if __name__ == "__main__":
    main()
