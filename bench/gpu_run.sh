#!/usr/bin/env bash
# One device call: warm the kernel cache, GPU tests, host-overhead bench, the GPT bench.
# Usage (device machine, repo root): bash bench/gpu_run.sh
#   parts: SKIP_TESTS / SKIP_HOST / SKIP_GPT=1, RUN_HF=1, RUN_OFFLOAD=1, RUN_JAX=1, RUN_SPLIT=1
#   (bench/step_split.py: host and GPU time of a step apart; SPLIT_ARGS); TESTS (pytest paths;
#   default: every gpu test), PYTEST_ARGS, GPT_ARGS (train_gpt.py flags), HF_ARGS (bench_hf.py
#   flags), OFFLOAD_ARGS, JAX_ARGS (bench_jax_ffn.py flags); logs and results go to $OUT (only 8 files come back from a device
#   call: point OUT elsewhere and tar it into the call's $OUT).
set -u
OUT=${OUT:-bench/results/session}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
# JAX must not take 75 % of the GPU up front: pytest-xdist workers share the device
export XLA_PYTHON_CLIENT_PREALLOCATE=false
t0=$(date +%s)
{ nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
  python3 -c "import cupy, torch; print('cupy', cupy.__version__, 'torch', torch.__version__)"
  python3 -c "from bitsparse_core.backends.cupy.kernels import warm_cache; print('kernels', warm_cache(16))"
  # the torch FFN op's C++ host path, built once here rather than by the first test worker
  python3 -c "from bitsparse_core.torch import native; print('native', native.cuda_module())"
} >"$OUT/setup.log" 2>&1
echo "setup $(( $(date +%s) - t0 )) s"; tail -n 3 "$OUT/setup.log"
if [ -z "${SKIP_TESTS:-}" ]; then
  # pytest-xdist (on the device image): the Numba tests compile for minutes on one core
  # SIGINT at the limit: pytest still prints its summary and the failures' names
  timeout -s INT -k 30 "${TEST_TIMEOUT:-300}" python3 -m pytest -m gpu -q -rfE -p no:cacheprovider \
      ${PYTEST_ARGS:--n 12 --maxfail=40} \
      ${TESTS:-tests} >"$OUT/pytest.log" 2>&1
  echo "pytest rc=$? at $(( $(date +%s) - t0 )) s"; tail -n 30 "$OUT/pytest.log" | cut -c1-400
fi
if [ -z "${SKIP_HOST:-}" ]; then
  timeout 150 python3 bench/host_overhead.py --backends cupy --time-limit 110 --out "$OUT" >"$OUT/host.log" 2>&1
  echo "host rc=$? at $(( $(date +%s) - t0 )) s"; tail -n 40 "$OUT/host.log" | cut -c1-300
fi
if [ -z "${SKIP_GPT:-}" ]; then
  timeout "${GPT_TIMEOUT:-260}" python3 bench/train_gpt.py ${GPT_ARGS:---preset gpt12 --steps 10 --interleave 30 --time-limit 230} --out "$OUT" >"$OUT/gpt.log" 2>&1
  echo "gpt rc=$? at $(( $(date +%s) - t0 )) s"; tail -n 40 "$OUT/gpt.log" | cut -c1-300
fi
if [ -n "${RUN_OFFLOAD:-}" ]; then   # opt-in: issue 17's variants, steps taken in turn
  mkdir -p "$OUT/offload"
  timeout "${OFFLOAD_TIMEOUT:-400}" python3 bench/train_gpt.py ${OFFLOAD_ARGS:---preset gpt12 --steps 10 --interleave 30 --variants dense,ours-nosign,ours-offload,save-on-cpu,checkpoint --trace ours-offload --time-limit 370} --out "$OUT/offload" >"$OUT/offload.log" 2>&1
  echo "offload rc=$? at $(( $(date +%s) - t0 )) s"; tail -n 12 "$OUT/offload.log" | cut -c1-300
fi
if [ -n "${RUN_HF:-}" ]; then   # opt-in: the transformers benchmark (needs transformers installed)
  timeout "${HF_TIMEOUT:-300}" python3 bench/bench_hf.py ${HF_ARGS:---steps 5 --interleave 30 --time-limit 270} --out "$OUT" >"$OUT/hf.log" 2>&1
  echo "hf rc=$? at $(( $(date +%s) - t0 )) s"; tail -n 40 "$OUT/hf.log" | cut -c1-300
fi
if [ -n "${RUN_SPLIT:-}" ]; then   # opt-in: which side paces each variant's step
  mkdir -p "$OUT/split"
  timeout "${SPLIT_TIMEOUT:-240}" python3 bench/step_split.py ${SPLIT_ARGS:---turns 10 --kernel-steps 0 --host-profile ours-compiled,ours-offload --time-limit 220} --out "$OUT/split" >"$OUT/split.log" 2>&1
  echo "split rc=$? at $(( $(date +%s) - t0 )) s"; head -12 "$OUT/split/step_split.md" 2>/dev/null | tail -8
fi
if [ -n "${RUN_JAX:-}" ]; then   # opt-in: the JAX FFN stack, jax.numpy codec and FFI path side by side
  mkdir -p "$OUT/jax"
  timeout "${JAX_TIMEOUT:-300}" python3 bench/bench_jax_ffn.py ${JAX_ARGS:---steps 5} --out "$OUT/jax" >"$OUT/jax.log" 2>&1
  echo "jax rc=$? at $(( $(date +%s) - t0 )) s"; tail -n 25 "$OUT/jax.log" | cut -c1-300
fi
