#!/usr/bin/env bash
# One device call of a session that brings kernel changes prepared without a device:
# the GPU tests and sanitizers on the tree as it is, the A/B runs of the prepared
# compile-time switches and Numba variants, and the codec / fused-op benches.
# Usage (device machine, repo root): PARTS="tests sanitizer codecs" bash bench/gpu_ab.sh
#   PARTS (in this order, any subset): tests sanitizer cupy_ab numba_ab driver host codecs
#   exact fused train compiled ffn hf hfprof pace byop (exact: profile_exact.py, the Python steps
#   after the count against the native ones; driver: driver_cost.py, the driver's calls and their
#   share of each op;
#   host: host_overhead.py on the small tensor and host_standin.py --micro on this host;
#   train: issue 15's gpt12 step, every variant its targets name, in interleaved turns;
#   compiled: gpt12 eager and compiled (no checkpointing) in 60 turns, with each variant's
#   compile count (a bucket move must not recompile ours-compiled);
#   ffn: issue 15's FFN stack (dense, checkpointing, ours raw and nosign);
#   hf: issue 16's OPT step, plain / converted / hooks, in interleaved turns;
#   hfprof: the hooks' host time on the device's host, under cProfile;
#   pace: step_pace.py, the OPT step's GPU busy time beside its wall time;
#   byop: host_by_op.py, the OPT step's host time op by op, hooks and converted vs plain;
#   trained: issue 15 from a gpt12 trained 1000 steps, under PyTorch's default settings:
#   gemm_host.py, step_split.py of the compiled pair, train_gpt.py in 60 turns with
#   checkpointing, then ours at initial_density=0.1 for the peak)
#   FUSED_VARIANTS  bench_fused.py --variants (default: its own)
#   TRAINED   which of part trained's steps run (default all: "gemm split defaults initial"),
#             so its ~15 minutes can be spread over calls
#   CUPY_AB   "label|options|kernel_variants flags;..." (default: the default build alone)
#   NUMBA_AB  numba_pack_variants.py arguments, one process each (default: "" and session
#             41's variants); every run also times the committed kernels for the same check
#   TESTS, PYTEST_ARGS as in gpu_run.sh; TEST_TIMEOUT, TRAIN_LIMIT, HF_LIMIT: seconds for
#             the suite and the two training benches' time limits (400: the whole suite
#             took 323-333 s at -n 14 in sessions 48-49; 280, 240)
# The tables print as they are made; logs, tables and results end up in one archive,
# $OUT/bundle.tgz (only 8 files come back from a device call).
set -u
OUT=${OUT:-bench/results/session}
mkdir -p "$OUT" /tmp/gpu_ab
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
PARTS=${PARTS:-tests sanitizer cupy_ab numba_ab driver host codecs exact fused train ffn hf}
CUPY_AB=${CUPY_AB:-"base||"}
NUMBA_AB=${NUMBA_AB:-"|warp_redux=1|unpack_prefetch=1"}
t0=$(date +%s)
say() { echo "$1 at $(( $(date +%s) - t0 )) s"; }
python3 -c "from bitsparse_core.backends.cupy.kernels import warm_cache; print('kernels', warm_cache(16))" \
    >"$OUT/setup.log" 2>&1
say "warm-up"
has() { case " $PARTS " in *" $1 "*) return 0;; esac; return 1; }

if has tests; then
  # SIGINT at the limit: pytest still prints its summary and the failures' names
  timeout -s INT -k 30 "${TEST_TIMEOUT:-400}" python3 -m pytest -m gpu -q -rfE -p no:cacheprovider \
      ${PYTEST_ARGS:--n 14 --maxfail=40} ${TESTS:-tests} 2>&1 | tail -c 60000 >"$OUT/pytest.log"
  say "pytest rc=${PIPESTATUS[0]}"; tail -n 3 "$OUT/pytest.log"; grep -E "^(FAILED|ERROR)" "$OUT/pytest.log" | head -20
fi
if has sanitizer; then
  for tool in memcheck racecheck; do
    timeout 150 compute-sanitizer --tool $tool --error-exitcode 9 python3 bench/sanitize_small.py \
        >/tmp/gpu_ab/san_$tool.log 2>&1
    echo "$tool exit $?"; grep -E "ERROR SUMMARY|RACECHECK SUMMARY|mismatches" /tmp/gpu_ab/san_$tool.log | tail -2
  done | tee "$OUT/sanitizer.log"
  say "sanitizer"
fi
if has cupy_ab; then
  # each option set twice, in the order a b ... b a, so drift shows as a spread
  IFS=';' read -ra sets <<<"$CUPY_AB"
  order=("${sets[@]}"); for ((i=${#sets[@]}-1; i>=0; i--)); do order+=("${sets[i]}"); done
  k=0
  for s in "${order[@]}"; do
    IFS='|' read -r label opts flags <<<"$s"
    k=$((k + 1))
    BITSPARSE_CUDA_OPTIONS="$opts" timeout 200 python3 bench/kernel_variants.py $flags \
        >"/tmp/gpu_ab/kv_${label}_$k.log" 2>&1 || tail -3 "/tmp/gpu_ab/kv_${label}_$k.log"
  done
  # one table per base: each base's variants are the labels that follow it in CUPY_AB
  base=""; args=()
  flush() { [ -n "$base" ] && python3 bench/variant_table.py --base "$base" "${args[@]}" \
                --out "$OUT" --stem "ab_cupy_$base" >/dev/null && cat "$OUT/ab_cupy_$base.md"; }
  for s in "${sets[@]}"; do
    IFS='|' read -r label opts flags <<<"$s"
    if [ -z "$opts" ]; then flush; base=$label; args=(); fi
    for f in /tmp/gpu_ab/kv_${label}_*.log; do args+=("$label=$f"); done
  done
  flush
  say "cupy A/B"
fi
if has numba_ab; then
  IFS='|' read -ra vs <<<"$NUMBA_AB"
  k=0
  order=("${vs[@]}"); for ((i=${#vs[@]}-1; i>=0; i--)); do order+=("${vs[i]}"); done
  for v in "${order[@]}"; do
    k=$((k + 1))
    label=${v:-committed}; label=${label//[=,]/-}
    log="/tmp/gpu_ab/nb_${label}_$k.log"
    timeout 300 python3 bench/numba_pack_variants.py "$v" >"$log" 2>&1 || tail -3 "$log"
    grep -h "same=False" "$log"
  done
  args=(); for f in /tmp/gpu_ab/nb_*.log; do l=$(basename "$f" .log); args+=("${l%_*}=$f"); done
  python3 bench/variant_table.py --base nb_committed "${args[@]}" --out "$OUT" --stem ab_numba \
      --title "Numba kernel variants (bench/numba_pack_variants.py)" >/dev/null && cat "$OUT/ab_numba.md"
  say "numba A/B"
fi
if has driver; then
  timeout 200 python3 bench/driver_cost.py --backends cupy,numba --out "$OUT/driver" \
      >/tmp/gpu_ab/driver.log 2>&1 || tail -5 /tmp/gpu_ab/driver.log
  grep -E "^\|" "$OUT"/driver/driver_cost.md | head -40
  say "driver"
fi
if has host; then
  # issue 14's host times (both modes, small tensor only: the loops in turns) and the
  # stand-in on this host, with its building blocks, to read them against
  timeout 200 python3 bench/host_overhead.py --backends cupy,numba --large '' \
      --out "$OUT/host" >/tmp/gpu_ab/host.log 2>&1 || tail -5 /tmp/gpu_ab/host.log
  grep -E "^\|" "$OUT"/host/host_overhead.md | head -40
  timeout 150 python3 bench/host_standin.py --micro --out "$OUT/standin" \
      >/tmp/gpu_ab/standin.log 2>&1 || tail -5 /tmp/gpu_ab/standin.log
  grep -E "^\|" "$OUT"/standin/host_standin.md | head -30
  say "host"
fi
if has codecs; then
  timeout 200 python3 bench/bench_codecs.py --backends cupy,numba --numel 117440512 --reps 10 --no-nvcomp \
      --out "$OUT/codecs" >/tmp/gpu_ab/codecs.log 2>&1 || tail -5 /tmp/gpu_ab/codecs.log
  grep -E "^\|" "$OUT"/codecs/*.md | head -24
  say "codecs"
fi
if has exact; then
  for be in cupy numba; do
    timeout 200 python3 bench/profile_exact.py --backend $be --turns 3 \
        >"$OUT/exact_$be.md" 2>&1 || tail -5 "$OUT/exact_$be.md"
    cat "$OUT/exact_$be.md"
  done
  say "exact"
fi
if has fused; then
  timeout 200 python3 bench/bench_fused.py --reps 20 ${FUSED_VARIANTS:+--variants "$FUSED_VARIANTS"} \
      --out "$OUT/fused" >/tmp/gpu_ab/fused.log 2>&1 \
      || tail -5 /tmp/gpu_ab/fused.log
  grep -E "^\|" "$OUT"/fused/*.md | head -20
  say "fused"
fi
if has train; then
  timeout $(( ${TRAIN_LIMIT:-280} + 20 )) python3 bench/train_gpt.py --preset gpt12 --interleave 12 \
      --time-limit "${TRAIN_LIMIT:-280}" \
      --variants dense,checkpoint,ours-nosign,dense-compiled,ours-compiled --out "$OUT/train" \
      >/tmp/gpu_ab/train.log 2>&1 || tail -5 /tmp/gpu_ab/train.log
  grep -A10 "^## Interleaved" "$OUT"/train/train_gpt.md | grep -E "^\|" | head -9
  say "train"
fi
if has compiled; then
  timeout $(( ${TRAIN_LIMIT:-280} + 20 )) python3 bench/train_gpt.py --preset gpt12 --steps 5 \
      --interleave 60 --time-limit "${TRAIN_LIMIT:-280}" \
      --variants dense,ours-nosign,dense-compiled,ours-compiled --out "$OUT/compiled" \
      >/tmp/gpu_ab/compiled.log 2>&1 || tail -5 /tmp/gpu_ab/compiled.log
  grep -A8 "^## Interleaved" "$OUT"/compiled/train_gpt.md | grep -E "^\|" | head -7
  python3 -c "import json, sys; d = json.load(open(sys.argv[1])); print('compiles', {k: v.get('compiles') for k, v in d['variants'].items()})" "$OUT/compiled/train_gpt.json"
  say "compiled"
fi
if has ffn; then
  timeout 200 python3 bench/bench_torch_ffn.py --variants dense,checkpoint,ours_raw,ours_nosign \
      --steps 9 --out "$OUT/ffn/torch_ffn" >/tmp/gpu_ab/ffn.log 2>&1 || tail -5 /tmp/gpu_ab/ffn.log
  grep -hE "^(\||## )" "$OUT"/ffn/*.md | head -20
  say "ffn"
fi
if has hf; then
  timeout $(( ${HF_LIMIT:-240} + 20 )) python3 bench/bench_hf.py --variants plain,converted,hooks \
      --interleave 40 --steps 10 --time-limit "${HF_LIMIT:-240}" --out "$OUT/hf" \
      >/tmp/gpu_ab/hf.log 2>&1 || tail -5 /tmp/gpu_ab/hf.log
  grep -A9 "^## Interleaved" "$OUT"/hf/bench_hf.md | grep -E "^\|" | head -8
  say "hf"
fi
if has hfprof; then
  # where the hooks' host time goes on the device's host: cProfile of plain's and the
  # hooks' steps (bench_hf_cprofile.txt), beside the hooks' per-call timing
  timeout 200 python3 bench/bench_hf.py --variants plain,hooks --steps 5 --cprofile-steps 5 \
      --time-limit 180 --out "$OUT/hfprof" >/tmp/gpu_ab/hfprof.log 2>&1 \
      || tail -5 /tmp/gpu_ab/hfprof.log
  grep -A8 "^| hook calls" "$OUT"/hfprof/bench_hf.md
  say "hfprof"
fi
if has pace; then
  # which side paces the OPT step: GPU busy per step beside the wall time, per variant
  # (converted too: what it adds on the GPU, beside what it adds on the host)
  timeout 260 python3 bench/step_pace.py --variants plain,hooks,noop-hooks,converted --turns 60 \
      --time-limit 200 --out "$OUT/pace" >/tmp/gpu_ab/pace.log 2>&1 || tail -5 /tmp/gpu_ab/pace.log
  grep -E "^\|" "$OUT"/pace/step_pace.md | head -7
  say "pace"
fi
if has byop; then
  # where the hooks' and converted's host time goes, op by op (forward / backward)
  timeout 200 python3 bench/host_by_op.py --variants plain,hooks,converted --steps 8 \
      --time-limit 170 --out "$OUT/byop" >/tmp/gpu_ab/byop.log 2>&1 || tail -5 /tmp/gpu_ab/byop.log
  grep -A5 "^| variant" "$OUT"/byop/host_by_op.md
  say "byop"
fi
TRAINED=${TRAINED:-gemm split defaults initial}
step() { case " $TRAINED " in *" $1 "*) return 0;; esac; return 1; }
if has trained && step gemm; then
  timeout 120 python3 bench/gemm_host.py --out "$OUT/gemm_host" >/tmp/gpu_ab/gemm_host.log 2>&1 \
      || tail -5 /tmp/gpu_ab/gemm_host.log
  grep -E "^\|" "$OUT"/gemm_host/gemm_host.md
fi
if has trained && step split; then
  timeout 200 python3 bench/step_split.py --preset gpt12 --pretrain-steps 1000 --torch-defaults \
      --turns 8 --warmup 3 --variants dense-compiled,ours-compiled --time-limit 180 \
      --out "$OUT/trained_split" >/tmp/gpu_ab/trained_split.log 2>&1 \
      || tail -5 /tmp/gpu_ab/trained_split.log
  grep -E "^\| (dense|ours)" "$OUT"/trained_split/step_split.md | head -2
fi
if has trained; then
  for run in "defaults|{}" "initial|{\"initial_density\": 0.1}"; do
    step "${run%%|*}" || continue
    timeout $(( ${TRAIN_LIMIT:-280} + 20 )) python3 bench/train_gpt.py --preset gpt12 --steps 5 \
        --pretrain-steps 1000 --torch-defaults --interleave 60 --time-limit "${TRAIN_LIMIT:-280}" \
        --ours-kwargs "${run#*|}" --variants dense,checkpoint,ours-nosign,dense-compiled,ours-compiled \
        --out "$OUT/trained_${run%%|*}" >/tmp/gpu_ab/trained_${run%%|*}.log 2>&1 \
        || tail -5 /tmp/gpu_ab/trained_${run%%|*}.log
    grep -A10 "^## Interleaved" "$OUT/trained_${run%%|*}/train_gpt.md" | grep -E "^\| (dense|ours|check)"
    grep -E "^\| (dense|ours|check)" "$OUT/trained_${run%%|*}/train_gpt.md" | head -5 | cut -d"|" -f2,7,8
  done
  say "trained"
fi
# one archive comes back whole however many files the parts wrote
cp -r /tmp/gpu_ab "$OUT/raw_logs"
tar -czf /tmp/gpu_ab_bundle.tgz -C "$OUT" . && rm -rf "${OUT:?}"/* && mv /tmp/gpu_ab_bundle.tgz "$OUT/bundle.tgz"
