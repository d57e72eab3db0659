#!/usr/bin/env bash
# One device call: GPU tests, compute-sanitizer, and the codec benchmark.
# Usage (device machine, repo root): bash bench/gpu_session.sh
#   PYTEST_ARGS  extra pytest flags (default "-x"); TESTS: what to test (default tests/test_gpu_cupy.py)
#   BENCH_ARGS   extra bench flags  (e.g. "--reps 10 --backends cupy,numba")
#   SKIP_TESTS / SKIP_SANITIZER / SKIP_BENCH=1 to leave a part out
# Logs and results go to $OUT (or bench/results/session when unset).
set -u
OUT=${OUT:-bench/results/session}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
# nvCOMP wheels travel in .whl/ (see bench/NOTES.md); their absence is recorded, not fatal.
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target /tmp/site .whl/*.whl >"$OUT/setup.log" 2>&1 && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
{ nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,memory.used --format=csv;
  python3 -c "import cupy, torch; print('cupy', cupy.__version__, 'torch', torch.__version__)"; } >>"$OUT/setup.log" 2>&1
# Compile every kernel once, in parallel; later processes load CuPy's cached cubins.
t0=$(date +%s)
python3 -c "from bitsparse_core.backends.cupy.backend import warm_cache; print('kernels', warm_cache(16, sweep_rounds=(${SWEEP_ROUNDS:-})))" >>"$OUT/setup.log" 2>&1
echo "warm-up $(( $(date +%s) - t0 )) s" >>"$OUT/setup.log"
rc=0
if [ -z "${SKIP_TESTS:-}" ]; then
  timeout -s INT -k 30 "${TEST_TIMEOUT:-420}" python3 -m pytest -m gpu ${PYTEST_ARGS--x} -q -rfE \
      -p no:cacheprovider \
      ${TESTS:-tests/test_gpu_cupy.py} 2>&1 | tail -c 200000 >"$OUT/pytest.log"
  rc=${PIPESTATUS[0]}
  tail -n 25 "$OUT/pytest.log"
fi
if [ -z "${SKIP_SANITIZER:-}" ]; then
  { for tool in memcheck racecheck; do
      echo "=== compute-sanitizer --tool $tool"
      timeout "${SANITIZER_TIMEOUT:-200}" compute-sanitizer --tool "$tool" --error-exitcode 9 python3 bench/sanitize_small.py 2>&1 | tail -n 30
      echo "exit ${PIPESTATUS[0]}"
    done; } >"$OUT/sanitizer.log" 2>&1
  grep -E "^===|exit|ERROR SUMMARY|RACECHECK SUMMARY|mismatches" "$OUT/sanitizer.log"
fi
if [ -z "${SKIP_BENCH:-}" ]; then
  timeout "${BENCH_TIMEOUT:-400}" python3 bench/bench_codecs.py ${BENCH_ARGS:-} --out bench/results 2>&1 | tail -c 100000 >"$OUT/bench.log"
  cp bench/results/codecs.json bench/results/codecs.md bench/results/codecs.png "$OUT"/ 2>/dev/null
  tail -n 45 "$OUT/bench.log"
fi
exit $rc
