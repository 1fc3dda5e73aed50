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

Prints a Markdown table of milliseconds per step by kind (matrix products, attention forward and
backward, norms, activations, loss, optimizer, embedding, the rest), each side's total kernel
time and the ratio, then each side's largest kernels. Kernel time only: the time the GPU waits
between kernels is not in an `ncu` log (each kernel runs alone).
"""
import argparse
import collections
import csv
import re
import sys

# (kind, pattern over the lowercased kernel name), first match wins: attention before matrix
# products (cuDNN's attention kernels are named like GEMMs), the loss before norms.
KINDS = [
    ("attention backward", r"flash_bwd|flash_backward|flash_dq|flash_delta|dq_from|dkdv|bprop|fmha.*bwd|attention.*backward"),
    ("attention forward", r"flash_fwd|flash_forward|fprop|fmha|attention"),
    ("matrix products (GEMM)", r"nvjet|gemm|xmma|cutlass|cublas|matmul|sm90_|sm80_"),
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


def read(path):
    """{kernel name: (launches, milliseconds)} from an ncu --csv log (other lines skipped)."""
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
    ap.add_argument("peer")
    ap.add_argument("--steps", type=int, required=True, help="steps each log captured")
    ap.add_argument("--top", type=int, default=15)
    a = ap.parse_args()
    sides = [read(a.ours), read(a.peer)]
    by_kind = [collections.Counter(), collections.Counter()]
    for side, kinds in zip(sides, by_kind):
        for name, (_, ms) in side.items():
            kinds[kind_of(name)] += ms / a.steps
    print("| kind | ours, ms a step | peer, ms a step | ours / peer |")
    print("|---|---|---|---|")
    for kind in [k for k, _ in KINDS] + [OTHER]:
        o, p = by_kind[0][kind], by_kind[1][kind]
        if o == 0 and p == 0:
            continue
        ratio = f"{o / p:.2f}x" if p > 0 else "-"
        print(f"| {kind} | {o:.2f} | {p:.2f} | {ratio} |")
    to, tp = sum(by_kind[0].values()), sum(by_kind[1].values())
    print(f"| **all kernels** | **{to:.2f}** | **{tp:.2f}** | **{to / tp:.2f}x** |")
    for label, side in (("ours", sides[0]), ("peer", sides[1])):
        launches = sum(n for n, _ in side.values()) / a.steps
        print(f"\n{label}: {launches:.0f} launches a step; largest kernels (ms a step, launches a step):")
        top = sorted(side.items(), key=lambda kv: -kv[1][1])[: a.top]
        for name, (n, ms) in top:
            print(f"  {ms / a.steps:8.3f}  {n / a.steps:6.1f}  [{kind_of(name)}]  {name[:110]}")


if __name__ == "__main__":
    main()
