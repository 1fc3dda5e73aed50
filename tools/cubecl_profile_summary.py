#!/usr/bin/env python3
"""Summarise a CubeCL profiling log: total device time per kernel kind, largest first.

Produce the log with CUBECL_DEBUG_LOG=FILE (profiling level "medium" writes one line per kernel
launch, `| 21.1µs | KernelName | ... | CudaRuntime`), then:

    python3 tools/cubecl_profile_summary.py FILE [--top 25] [--steps N]

--steps divides the totals by the number of training steps the log covers.
"""
import argparse
import collections
import re

UNITS = {"ns": 1e-3, "µs": 1.0, "us": 1.0, "ms": 1e3, "s": 1e6}
LINE = re.compile(r"^\|\s*([0-9.]+)\s*(ns|µs|us|ms|s)\s*\|\s*(.+?)\s*$")


def kind(name: str) -> str:
    parts = [p.strip() for p in name.split("|") if p.strip()]
    head = parts[0] if parts else name
    if head == "MatmulEntry":
        return "MatmulEntry (" + ",".join(p for p in parts if p.endswith("Family"))[:60] + ")"
    return " | ".join(parts[:2]) if len(parts) > 2 else head


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("log")
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--steps", type=int, default=1)
    a = ap.parse_args()
    total = collections.Counter()
    count = collections.Counter()
    with open(a.log, encoding="utf-8", errors="replace") as f:
        for line in f:
            m = LINE.match(line)
            if not m:
                continue
            us = float(m.group(1)) * UNITS[m.group(2)]
            k = kind(m.group(3))
            total[k] += us
            count[k] += 1
    grand = sum(total.values())
    if not grand:
        print("no kernel timings found")
        return
    print(f"{'kernel':<70} {'launches/step':>13} {'ms/step':>9} {'share':>6}")
    for k, us in total.most_common(a.top):
        print(f"{k[:70]:<70} {count[k] / a.steps:>13.0f} {us / 1e3 / a.steps:>9.2f} {us / grand:>6.1%}")
    print(f"{'all kernels':<70} {sum(count.values()) / a.steps:>13.0f} {grand / 1e3 / a.steps:>9.2f}")


if __name__ == "__main__":
    main()
