#!/usr/bin/env bash
# Per-instruction stall samples of one kernel (device machine, repo root):
#   bash bench/profile_stalls.sh KERNEL_REGEX [args for bench/profile_kernels.py]
# Writes $OUT/stalls.csv (ncu source page, SASS) and prints the 25 instructions
# with the most stall samples and the totals per barrier.
set -u
OUT=${OUT:-bench/results/session}; mkdir -p "$OUT"
k=$1; shift
python3 bench/profile_kernels.py "$@" >/dev/null 2>"$OUT/warm.log" || { tail -20 "$OUT/warm.log"; exit 1; }
ncu --clock-control none --profile-from-start off --kernel-name-base function -k "regex:$k" -c 1 \
    --section WarpStateStats --section SourceCounters --page source --print-source sass --csv \
    python3 bench/profile_kernels.py "$@" >"$OUT/stalls.csv" 2>&1
echo "ncu exit $?"
python3 - "$OUT/stalls.csv" <<'PY'
import csv, sys
rows = [r for r in csv.reader(open(sys.argv[1])) if len(r) > 5]
head = next((r for r in rows if "Source" in r), None)
if head is None:
    print(open(sys.argv[1]).read()[:3000]); sys.exit()
i_src = head.index("Source")
cols = [c for c in head if "Sampling" in c and "All" in c] or [c for c in head if "Sampl" in c]
i_s = head.index(cols[0])
data = []
for r in rows[rows.index(head) + 1:]:
    try:
        data.append((float(r[i_s] or 0), r[i_src], r[0]))
    except (ValueError, IndexError):
        pass
tot = sum(d[0] for d in data) or 1
print("column:", cols[0], "total samples", tot)
for s, src, addr in sorted(data, reverse=True)[:25]:
    print(f"{100 * s / tot:5.1f}%  {addr:>6}  {src[:90]}")
bars = [(addr, s) for s, src, addr in data if "BAR" in src]
print("barriers:", [(a, f"{100 * s / tot:.1f}%") for a, s in bars])
PY
