#!/usr/bin/env python3
"""Profiles the Hopper FlashAttention forward beside SDPA's cuDNN forward under Nsight Compute, on
a GPU machine with nvcc, ncu and PyTorch (no Rust):

    python3 tools/attention-harness/ncu_forward.py [--shapes 128:causal:1024,64:causal:1024] [--out DIR]
        [--build-dir DIR]

For each shape (head_dim:mask:seq, bf16, batch x seq = 16384, heads x head_dim = 2048, as the
harness's benchmark), it runs `ncu --set full` (ncu's default clock control: base clocks for both)
over one call of each kernel after two warm-up calls, keeps the report (DIR/fwd_HD_MASK_S.ncu-rep,
for `ncu -i`) and prints the metrics where the two differ most: duration, cycles, instructions
issued, issue slots, L2 and DRAM throughput, L2 write sectors, branches, shared memory, and how
busy the tensor and shared-memory pipes were (raw metrics). The kernel is built from
crates/kernels/src/attention/hopper/forward.cu by harness.py's build. The raw metrics' parsing was
checked against a report of 2026-12-06 (not yet run on a GPU as part of this script).
"""
import argparse
import csv
import io
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

# (section, metric) pairs to print, in this order.
METRICS = [
    ("GPU Speed Of Light Throughput", "Duration"),
    ("GPU Speed Of Light Throughput", "Elapsed Cycles"),
    ("GPU Speed Of Light Throughput", "SM Frequency"),
    ("Instruction Statistics", "Issued Instructions"),
    ("Compute Workload Analysis", "Issue Slots Busy"),
    ("Scheduler Statistics", "Eligible Warps Per Scheduler"),
    ("Warp State Statistics", "Warp Cycles Per Issued Instruction"),
    ("GPU Speed Of Light Throughput", "L2 Cache Throughput"),
    ("GPU Speed Of Light Throughput", "DRAM Throughput"),
    ("Memory Workload Analysis", "L2 Compression Input Sectors"),
    ("Source Counters", "Branch Instructions"),
    ("Launch Statistics", "Registers Per Thread"),
    ("Launch Statistics", "Dynamic Shared Memory Per Block"),
    ("Launch Statistics", "Grid Size"),
]


def inner(shape, build_dir):
    """One call of ours and of cuDNN's after two warm-up calls of each (run under ncu)."""
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel
    import harness
    hd, mask, s = shape.split(":")
    hd, causal, s = int(hd), mask == "causal", int(s)
    kernel = harness.Kernel(build_dir)
    b, h = 16384 // s, 2048 // hd
    q, k, v = (torch.randn(b, h, s, hd, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    for _ in range(3):
        kernel.forward(q, k, v, causal)
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    torch.cuda.synchronize()


# Raw metrics (`--page raw`) printed after the sections' ones, by the end of their names (ncu
# prefixes some with the section that collects them): how busy the tensor and shared-memory pipes
# were, of the elapsed cycles.
RAW = [
    ("tensor pipe active", "sm__pipe_tensor_cycles_active_realtime.avg.pct_of_peak_sustained_elapsed"),
    ("shared-memory pipe active", "sm__pipe_shared_cycles_active.avg.pct_of_peak_sustained_active"),
]


def raw_rows(raw_csv):
    """[(name, {"ours" / "cuDNN": value})] for RAW, from `ncu -i REP --page raw --csv` (a header
    row, a units row, then one row a launch; the last launch of each kernel)."""
    rows = list(csv.reader(io.StringIO(raw_csv)))
    if len(rows) < 3:
        return []
    header, last = rows[0], {}
    name_at = header.index("Kernel Name")
    for r in rows[2:]:
        last["ours" if r[name_at].startswith("flash_forward_hopper") else "cuDNN"] = r
    out = []
    for label, metric in RAW:
        at = next((i for i, h in enumerate(header) if h.endswith(metric)), None)
        if at is not None:
            out.append((label, {k: f"{r[at]} %" for k, r in last.items()}))
    return out


def table(details_csv, raw_csv=""):
    """Our last profiled launch and cuDNN's, side by side, from `ncu -i REP --page details --csv`
    (and the RAW metrics from `--page raw --csv`)."""
    kernels = {}
    for r in csv.DictReader(io.StringIO(details_csv)):
        name = "ours" if r["Kernel Name"].startswith("flash_forward_hopper") else "cuDNN"
        metrics = kernels.setdefault(name, {}).setdefault(r["ID"], {})
        metrics[(r["Section Name"], r["Metric Name"])] = (r["Metric Value"], r["Metric Unit"])
    last = {name: ids[max(ids, key=int)] for name, ids in kernels.items()}
    print("| metric | ours | cuDNN |")
    print("|---|---|---|")
    for key in METRICS:
        cells = []
        for name in ("ours", "cuDNN"):
            value, unit = last.get(name, {}).get(key, ("-", ""))
            cells.append(f"{value} {unit}".strip())
        print(f"| {key[1]} | {cells[0]} | {cells[1]} |")
    for label, values in raw_rows(raw_csv):
        print(f"| {label} | {values.get('ours', '-')} | {values.get('cuDNN', '-')} |")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default="128:causal:1024,64:causal:1024")
    ap.add_argument("--out", default="/tmp/attention-profile")
    ap.add_argument("--build-dir", default="/tmp/attention-harness")
    ap.add_argument("--nvcc", default="nvcc")
    ap.add_argument("--ncu", default="ncu")
    ap.add_argument("--inner", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.inner:
        inner(a.inner, a.build_dir)
        return
    import harness
    if not harness.build(a.build_dir, a.nvcc):
        sys.exit(1)
    os.makedirs(a.out, exist_ok=True)
    for shape in a.shapes.split(","):
        rep = os.path.join(a.out, "fwd_" + shape.replace(":", "_"))
        # Two warm-up calls of each kernel, then one of each profiled.
        cmd = [a.ncu, "--set", "full", "-f", "-o", rep, "-k", "regex:flash_forward_hopper|cudnn",
               "--launch-skip", "4", "--launch-count", "2", sys.executable, os.path.abspath(__file__),
               "--inner", shape, "--build-dir", a.build_dir]
        run = subprocess.run(cmd, capture_output=True, text=True)
        if run.returncode != 0:
            print(f"ncu failed for {shape}:\n{(run.stdout + run.stderr)[-3000:]}")
            sys.exit(1)
        print(f"\n{shape} (bf16, batch x seq = 16384, heads x head_dim = 2048): {rep}.ncu-rep")
        details = subprocess.run([a.ncu, "-i", rep + ".ncu-rep", "--page", "details", "--csv"],
                                 capture_output=True, text=True, check=True).stdout
        raw = subprocess.run([a.ncu, "-i", rep + ".ncu-rep", "--page", "raw", "--csv"],
                             capture_output=True, text=True, check=True).stdout
        table(details, raw)


if __name__ == "__main__":
    main()
