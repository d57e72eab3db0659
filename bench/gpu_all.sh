#!/usr/bin/env bash
# One GPU session for the whole project: the GPT training comparison, the demo,
# then every gpu-marked test. Logs and results go to $OUT (default bench/results/session).
# Usage on a GPU machine, repo root: bash bench/gpu_all.sh
set -u
OUT=${OUT:-bench/results/session}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
# Compile the CuPy kernels once, in parallel; later processes load the cached cubins.
python3 -c "from bitsparse_core.backends.cupy.backend import warm_cache; warm_cache(16)" >"$OUT/warm.log" 2>&1
timeout "${GPT_TIMEOUT:-200}" python3 bench/train_gpt.py --steps "${GPT_STEPS:-200}" --out "$OUT" 2>&1 | tee "$OUT/train_gpt.log"
timeout "${DEMO_TIMEOUT:-90}" python3 -m bitsparse_core demo 2>"$OUT/demo.err" | tee "$OUT/demo.log" | tail -n 45
timeout "${TEST_TIMEOUT:-300}" python3 -m pytest -m gpu -q -p no:cacheprovider tests 2>&1 | tail -c 200000 >"$OUT/pytest_gpu.log"
tail -n 15 "$OUT/pytest_gpu.log"
