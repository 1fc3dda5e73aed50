#!/usr/bin/env python3
"""Where the GPU waits during a training step, ours beside a peer's: the idle time between GPU
work in the captured steps, split by what the host was doing, from two timelines recorded by
`tools/cupti-trace` (a CUPTI injection library; Nsight Systems cannot make a report on the GPU
machines used here).

Record the same number of steps on each side, inside the CUDA profiler's capture range:

    tools/cupti-trace/build.sh /tmp
    CUDA_INJECTION64_PATH=/tmp/libcupti_trace.so CUPTI_TRACE_OUT=ours.csv \\
        BURNMIX_PROFILE_STEPS=11-15 train configs/gpt2_small.toml --set training.steps=15 ...
    CUDA_INJECTION64_PATH=/tmp/libcupti_trace.so CUPTI_TRACE_OUT=peer.csv \\
        python3 tools/peers/nanogpt_char.py --preset gpt2_small --warmup 10 --profile-steps 5

then

    python3 tools/step_timeline.py ours.csv peer.csv --steps 5 [--top 15]

For each side, per step: the span from the first GPU operation in the range to the last, the time
the GPU was busy (kernels, copies, memsets; overlapping ones counted once) and idle. Each idle gap
ends when the next GPU operation starts. It is either
  - "issued late": the host called the API that queued that operation only after the GPU had gone
    idle, so the GPU waited for the host; the gap is split by what the launching thread was doing
    from the start of the gap until that call (inside which API call, or in its own code between
    calls: "host code"), then the call itself ("the launching call");
  - "queued": the call that queued the operation had returned when the GPU went idle; the gap is
    the GPU's own time between operations (launch latency, a wait on an event or another stream).
Then each side's longest gaps with their neighbours, and its API calls per step.

CUPTI's tracing of every API call costs the host a little time per call, on both sides alike, so
the idle times here are somewhat above those of an untraced run.
"""
import argparse
import bisect
import collections
import csv
import gzip
import itertools
import re
import sys

GPU = ("kernel", "copy", "memset")
API = ("driver", "runtime")


def read(path):
    """(gpu ops, api calls, capture window) from a cupti-trace CSV (gzipped if it ends in .gz)."""
    gpu, api = [], []
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt", newline="", errors="replace") as f:
        for row in csv.DictReader(f):
            rec = (int(row["start_ns"]), int(row["end_ns"]), int(row["correlation"]),
                   int(row["stream_or_thread"]), row["name"], row["what"], int(row["bytes"]))
            if row["what"] in GPU:
                gpu.append(rec)
            elif row["what"] in API:
                api.append(rec)
    starts = sorted(r for r in api if "ProfilerStart" in r[4])
    stops = sorted(r for r in api if "ProfilerStop" in r[4])
    if not starts:
        sys.exit(f"{path}: no cuProfilerStart / cudaProfilerStart call; record inside a capture "
                 "range (BURNMIX_PROFILE_STEPS, nanogpt_char.py --profile-steps)")
    begin = starts[0][1]
    after = [r for r in stops if r[0] >= begin]
    end = after[0][0] if after else max(r[1] for r in gpu)
    return sorted(gpu), sorted(api), (begin, end)


def short(name, width=48):
    """A kernel's name without template arguments and parameters, cut to `width`."""
    base = re.sub(r"<.*", "", name)
    base = re.sub(r"\(.*", "", base)
    base = re.sub(r"^_Z\d+", "", base)
    return base if len(base) <= width else base[: width - 1] + "~"


def analyse(path, steps):
    gpu, api, (begin, end) = read(path)
    ops = [g for g in gpu if g[0] >= begin and g[1] <= end]
    if not ops:
        sys.exit(f"{path}: no GPU work inside the capture range")
    launch = {}
    for a in api:  # the earliest API call of each correlation id: the one the host called
        if a[2] not in launch or a[0] < launch[a[2]][0]:
            launch[a[2]] = a
    by_thread = collections.defaultdict(list)
    for a in api:
        if begin <= a[0] <= end:
            by_thread[a[3]].append(a)
    for calls in by_thread.values():  # a runtime call before the driver calls nested in it
        calls.sort(key=lambda c: (c[0], -c[1]))
    thread_starts = {t: [a[0] for a in calls] for t, calls in by_thread.items()}
    # per thread, the latest end among its calls up to each one: calls[:i] reach past time x
    # exactly when reach[t][i - 1] > x
    reach = {t: list(itertools.accumulate((a[1] for a in calls), max))
             for t, calls in by_thread.items()}

    busy, idle_by = 0, collections.Counter()
    gaps = []
    cover_end = ops[0][1]
    busy_start = ops[0][0]
    prev = ops[0]
    for op in ops[1:]:
        if op[0] > cover_end:
            busy += cover_end - busy_start
            gap = (cover_end, op[0], prev, op)
            gaps.append(gap)
            busy_start = op[0]
        if op[1] > cover_end:
            cover_end, prev = op[1], op
    busy += cover_end - busy_start
    span = cover_end - ops[0][0]

    for a, b, before, op in gaps:
        call = launch.get(op[2])
        if call is None or call[1] <= a:
            idle_by["queued (GPU time between operations)"] += b - a
            continue
        thread = call[3]
        # A call that began before the gap and returned after its start was still queuing the
        # operation: the whole gap is the launching call's.
        host_until = max(a, min(call[0], b))
        # what the launching thread was doing from the gap's start until it called: step back
        # from the first call that starts after `a` over every call still running at `a`
        calls = by_thread.get(thread, [])
        lo = bisect.bisect_left(thread_starts.get(thread, []), a)
        while lo > 0 and reach[thread][lo - 1] > a:
            lo -= 1
        inside, covered = 0, a  # outermost calls only: a nested call's time is its caller's
        for c in calls[lo:]:
            if c[0] >= host_until:
                break
            overlap = min(c[1], host_until) - max(c[0], covered)
            if overlap > 0 and c is not call:
                idle_by[f"issued late: in {c[4]}"] += overlap
                inside += overlap
                covered = min(c[1], host_until)
        idle_by["issued late: host code between API calls"] += max(0, host_until - a - inside)
        if b > host_until:
            idle_by["issued late: the launching call and launch latency"] += b - host_until

    api_in = collections.defaultdict(lambda: [0, 0])
    threads = collections.Counter()
    for a in api:
        if begin <= a[0] <= end:
            api_in[(a[5], a[4])][0] += 1
            api_in[(a[5], a[4])][1] += a[1] - a[0]
    for op in ops:
        call = launch.get(op[2])
        if call:
            threads[call[3]] += 1
    return dict(path=path, steps=steps, ops=ops, span=span, busy=busy, idle_by=idle_by,
                gaps=gaps, api=api_in, threads=threads, launch=launch)


def ms(ns, steps):
    return ns / 1e6 / steps


def report(sides, top):
    steps = sides[0]["steps"]
    names = [s["label"] for s in sides]
    print(f"## Per step ({steps} captured steps each), milliseconds\n")
    print("| | " + " | ".join(names) + " |")
    print("|---|" + "---|" * len(sides))
    rows = [("span of GPU work", lambda s: f"{ms(s['span'], steps):.2f}"),
            ("GPU busy", lambda s: f"{ms(s['busy'], steps):.2f}"),
            ("GPU idle", lambda s: f"{ms(s['span'] - s['busy'], steps):.2f}"),
            ("GPU operations", lambda s: f"{len(s['ops']) / steps:.0f}"),
            ("idle gaps", lambda s: f"{len(s['gaps']) / steps:.0f}"),
            ("threads that queued GPU work", lambda s: f"{len(s['threads'])}")]
    for label, f in rows:
        print(f"| {label} | " + " | ".join(f(s) for s in sides) + " |")
    kinds = collections.Counter()
    for s in sides:
        kinds.update({k: v for k, v in s["idle_by"].items()})
    for kind, _ in kinds.most_common():
        cells = [s["idle_by"].get(kind, 0) for s in sides]
        if max(cells) / 1e6 / steps < 0.01:
            continue
        print(f"| idle: {kind} | " + " | ".join(f"{ms(c, steps):.3f}" for c in cells) + " |")
    for s in sides:
        print(f"\n## {s['label']}: the {top} longest gaps\n")
        print("| at ms | gap µs | after | before | queued by, µs after the gap began |")
        print("|---|---|---|---|---|")
        t0 = s["ops"][0][0]
        for a, b, before, op in sorted(s["gaps"], key=lambda g: g[0] - g[1])[:top]:
            call = s["launch"].get(op[2])
            late = f"{call[4]} +{(call[0] - a) / 1e3:.1f}" if call else "?"
            print(f"| {(a - t0) / 1e6:.3f} | {(b - a) / 1e3:.1f} | {short(before[4])} | "
                  f"{short(op[4])} | {late} |")
        print(f"\n## {s['label']}: API calls per step (top {top} by time)\n")
        print("| API | calls | ms |")
        print("|---|---|---|")
        for (what, name), (n, t) in sorted(s["api"].items(), key=lambda kv: -kv[1][1])[:top]:
            print(f"| {what} {name} | {n / steps:.1f} | {ms(t, steps):.3f} |")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("traces", nargs="+", help="cupti-trace CSV files, ours first")
    ap.add_argument("--steps", type=int, required=True, help="steps in each capture range")
    ap.add_argument("--labels", default=None, help="comma-separated names (default: file names)")
    ap.add_argument("--top", type=int, default=15)
    a = ap.parse_args()
    labels = a.labels.split(",") if a.labels else a.traces
    if len(labels) != len(a.traces):
        ap.error(f"--labels names {len(labels)} sides for {len(a.traces)} traces")
    sides = []
    for path, label in zip(a.traces, labels):
        s = analyse(path, a.steps)
        s["label"] = label
        sides.append(s)
    report(sides, a.top)


if __name__ == "__main__":
    main()
