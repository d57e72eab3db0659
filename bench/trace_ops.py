"""Host time per op from torch.profiler traces, and where two variants differ.

``train_gpt.py --trace dense,ours-offload`` writes each variant's profiled steps as a
Chrome / Perfetto trace. This reads them back and gives each op's *self* host time
(its duration less that of the events nested in it on the same thread: ATen ops,
CUDA runtime and driver calls, user annotations), per profiled step, and, for two
traces, the ops sorted by how much more (or less) host time the second spends::

    python3 bench/trace_ops.py bench/results/train_gpt_ours-nosign_trace.json.gz \\
        bench/results/train_gpt_ours-offload_trace.json.gz --steps 3

Self time is what a variant's host path costs op by op; the profiler's own overhead
is in every row alike, so differences between variants mean more than the absolute
values.
"""

from __future__ import annotations

import argparse
import collections
import gzip
import json
import sys

HOST_CATEGORIES = ("cpu_op", "cuda_runtime", "cuda_driver", "user_annotation")


def load(path: str) -> list:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as fh:
        data = json.load(fh)
    return data["traceEvents"] if isinstance(data, dict) else data


def self_times(events: list) -> dict:
    """``{name: (calls, self µs)}`` over the host events of a trace: each complete event
    less the events nested in it on its thread."""
    by_thread = collections.defaultdict(list)
    for e in events:
        if e.get("ph") == "X" and e.get("cat") in HOST_CATEGORIES:
            by_thread[(e.get("pid"), e.get("tid"))].append(e)
    totals = collections.defaultdict(lambda: [0, 0.0])
    for evs in by_thread.values():
        evs.sort(key=lambda e: (e["ts"], -e["dur"]))
        open_, own = [], {}
        for e in evs:
            while open_ and open_[-1]["ts"] + open_[-1]["dur"] <= e["ts"]:
                open_.pop()
            own[id(e)] = e["dur"]
            if open_:
                own[id(open_[-1])] -= e["dur"]
            open_.append(e)
        for e in evs:
            row = totals[e["name"]]
            row[0] += 1
            row[1] += own[id(e)]
    return {name: (calls, us) for name, (calls, us) in totals.items()}


def compare(a: dict, b: dict, steps: int, top: int) -> list:
    """Rows ``(name, calls/step a, µs/step a, calls/step b, µs/step b, difference)``,
    largest absolute difference first."""
    rows = []
    for name in set(a) | set(b):
        ca, ua = a.get(name, (0, 0.0))
        cb, ub = b.get(name, (0, 0.0))
        rows.append((name, ca / steps, ua / steps, cb / steps, ub / steps, (ub - ua) / steps))
    rows.sort(key=lambda r: -abs(r[5]))
    return rows[:top]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("traces", nargs="+", help="one trace (its ops) or two (their difference)")
    ap.add_argument("--steps", type=int, default=3, help="profiled steps in each trace")
    ap.add_argument("--top", type=int, default=30)
    args = ap.parse_args(argv)
    if len(args.traces) > 2:
        ap.error("one or two traces")
    tables = [self_times(load(p)) for p in args.traces]
    if len(tables) == 1:
        print("| op | calls/step | self µs/step |\n| --- | --- | --- |")
        for name, (calls, us) in sorted(tables[0].items(), key=lambda kv: -kv[1][1])[:args.top]:
            print(f"| `{name}` | {calls / args.steps:.0f} | {us / args.steps:.0f} |")
        return 0
    print("| op | calls/step A | self µs/step A | calls/step B | self µs/step B | B − A |\n"
          "| --- | --- | --- | --- | --- | --- |")
    for name, ca, ua, cb, ub, d in compare(*tables, args.steps, args.top):
        print(f"| `{name}` | {ca:.0f} | {ua:.0f} | {cb:.0f} | {ub:.0f} | {d:+.0f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
