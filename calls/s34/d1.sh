#!/usr/bin/env bash
# Session 34, first call: every gpu test on the tree, then the fused-op A/B (ccdcb45's
# package in calls/old against the tree's Numba files).
set -u
export XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1
t0=$(date +%s)
nvidia-smi --query-gpu=name,clocks.sm,temperature.gpu --format=csv,noheader
PYTHONPATH=. python3 -c "from bitsparse_core.backends.cupy.kernels import warm_cache; print('kernels', warm_cache(16))" > $OUT/warm.log 2>&1
echo "warm at $(( $(date +%s) - t0 )) s"
PYTHONPATH=. timeout 330 python3 -m pytest -m gpu -q -p no:cacheprovider -n 12 --maxfail=40 tests > $OUT/pytest.log 2>&1
echo "pytest rc=$? at $(( $(date +%s) - t0 )) s"; tail -n 12 $OUT/pytest.log | cut -c1-300
PYTHONPATH=calls/old timeout 150 python3 calls/s34/fused_time.py numba,cupy bfloat16,float16 old $OUT/old.json > $OUT/fused_old.log 2>&1
echo "old rc=$? at $(( $(date +%s) - t0 )) s"
PYTHONPATH=. timeout 120 python3 calls/s34/fused_time.py numba bfloat16,float16 new $OUT/new.json > $OUT/fused_new.log 2>&1
echo "new rc=$? at $(( $(date +%s) - t0 )) s"
cat $OUT/fused_old.log $OUT/fused_new.log | grep -v Warn | tail -40
