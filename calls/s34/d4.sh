#!/usr/bin/env bash
# Session 34, last call: every gpu test on the final tree, then host_overhead (the
# results file) and the old package's Numba in the same call for the A/B.
set -u
export XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1
t0=$(date +%s)
PYTHONPATH=. python3 -c "from bitsparse_core.backends.cupy.kernels import warm_cache; print('kernels', warm_cache(16))" > $OUT/warm.log 2>&1
echo "warm at $(( $(date +%s) - t0 )) s"
PYTHONPATH=. timeout 320 python3 -m pytest -m gpu -q -p no:cacheprovider -n 12 --maxfail=40 tests > $OUT/pytest.log 2>&1
echo "pytest rc=$? at $(( $(date +%s) - t0 )) s"; grep -E "passed|failed|FAILED|^E " $OUT/pytest.log | tail -n 14 | cut -c1-300
timeout 100 python3 calls/old/bench/host_overhead.py --backends numba --modes torch --large '' --no-hook --no-plot --out $OUT/old > $OUT/host_old.log 2>&1
echo "old rc=$? at $(( $(date +%s) - t0 )) s"
timeout 150 python3 bench/host_overhead.py --out $OUT/new > $OUT/host_new.log 2>&1
echo "new rc=$? at $(( $(date +%s) - t0 )) s"
grep -E "^\| " $OUT/old/host_overhead.md | cut -d'|' -f2-6 | head -14
grep -E "^\| " $OUT/new/host_overhead.md | cut -d'|' -f2-6 | head -60
