#!/usr/bin/env bash
set -u
export XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1
t0=$(date +%s)
PYTHONPATH=calls/old timeout 150 python3 calls/s34/fused_time.py numba,cupy bfloat16,float16 old $OUT/old.json > $OUT/fused_old.log 2>&1
echo "old rc=$? at $(( $(date +%s) - t0 )) s"
PYTHONPATH=. timeout 120 python3 calls/s34/fused_time.py numba bfloat16,float16 new $OUT/new.json > $OUT/fused_new.log 2>&1
echo "new rc=$? at $(( $(date +%s) - t0 )) s"
cat $OUT/fused_old.log $OUT/fused_new.log | grep -v Warn | tail -40
