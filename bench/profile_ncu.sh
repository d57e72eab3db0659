#!/usr/bin/env bash
# ncu stall / throughput profile of the codec kernels (device machine, repo root).
#   bash bench/profile_ncu.sh [args for bench/profile_kernels.py]
# Writes $OUT/ncu.txt (details) and prints the headline metrics.
set -u
OUT=${OUT:-bench/results/session}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
python3 bench/profile_kernels.py "$@" >/dev/null 2>"$OUT/warm.log" || { tail -20 "$OUT/warm.log"; exit 1; }
ncu --clock-control none --profile-from-start off --kernel-name-base function \
    -k 'regex:bitsparse_pack|bitsparse_unpack|k_pack|k_unpack' \
    --section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats \
    --section SchedulerStats --section InstructionStats --section MemoryWorkloadAnalysis \
    --section SourceCounters \
    python3 bench/profile_kernels.py "$@" >"$OUT/ncu.txt" 2>&1
echo "ncu exit $?"
grep -E "^  [a-zA-Z_].*\(|Duration|DRAM Throughput|Compute \(SM\) Throughput|Issue Slots Busy|Executed Ipc Active|Achieved Occupancy|Registers Per|Warp Cycles Per Issued|No Eligible|Executed Instructions  |Block Limit Reg|Stall" "$OUT/ncu.txt" | head -150
