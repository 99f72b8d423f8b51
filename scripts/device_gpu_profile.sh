#!/usr/bin/env bash
# The GPU tier on one GPU machine: what docs/gpu.md reports.
#   OUT=DIR bash scripts/device_gpu_profile.sh [STAGE ...]     (default: all stages)
# Stages: smoke (two tiny examples on CUDA at 4 ranks; stops the run when they fail); tests (the property
# suite on the tiny fixtures with the gpu profile, -n 4, while the production-size tier runs in one
# process and the tolerance study in another, all on the one GPU (on a GPU under 100 GB the tiny suite first,
# alone); then split-K GEMMs through cuBLAS);
# bench (the benchmark, alone on the GPU); ab (the benchmark of an older checkout at BEFORE=DIR and of this one,
# alternating AB_ROUNDS times (default 2) on the same GPU: the before / after tables of docs/gpu.md); mps (the
# benchmark under NVIDIA MPS, the oracle after and beside the ranks, MPS_UNITS; with MPS_TIER, the production-size
# tests -k MPS_TIER under it); thread (the oracle's worker thread, DPEP_ORACLE_THREAD: its bit-for-bit tests at
# production size, then the benchmark and the oracle alone with it off and on). `smoke tests`, `bench`, `ab` and
# `thread` each fit in one 10-minute call.
# Production-size weights are drawn from their seeds here, into DPEP_FIXTURE_CACHE (~5 GB).
# Every stage has a time limit (SIGINT first, so pytest still prints its summary). Files in OUT:
# summary.txt, tiny.log, tier.log, gemm.md, tolerance.md, tolerance.json, bench.md, bench.json,
# ab-{before,after}-{1,2}.{md,json}, thread-tier.log, thread-{bench,oracle}-{off,on}.{md,json}, mps-*.
set -u
STAGES="${*:-smoke tests bench}"
. "$(dirname "$0")/device_common.sh" runs/gpu
export DPEP_RANK_CACHE_GB="${DPEP_RANK_CACHE_GB:-4}"   # two suites share the GPU in `tests`
has() { [[ " $STAGES " == *" $1 "* ]]; }

stamp "start: stages [$STAGES]"
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  nproc; free -g | sed -n 2p
  $PY -c 'import torch, transformers, hypothesis; print("torch", torch.__version__, "cuda", torch.version.cuda, "devices", torch.cuda.device_count(), "| transformers", transformers.__version__, "| hypothesis", hypothesis.__version__); print("bf16 reduced-precision reduction", torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction, "| tf32", torch.backends.cuda.matmul.allow_tf32)'
} >> "$S" 2>&1

if has smoke; then
  stamp smoke
  ok=1
  for unit in moe decoder; do
    lim 240 $PY -m checks.tools.replay --device cuda --unit $unit --fixture qwen3-moe --layout tp4-dp2-ep2 \
      --dtype bfloat16 --layer 1 --batch 'dp0:2+3,4+1 dp1:idle seed=3' >> "$S" 2>&1 || ok=0
  done
  if [ $ok = 0 ]; then stamp "smoke FAILED: stopping"; exit 1; fi
fi

if has tests; then
  stamp "tests: tiny suite (background), production-size fixtures"
  lim 300 $PY -m pytest property_tests -m "not gpu" -n 4 --device cuda --hypothesis-profile gpu -q \
    -p no:cacheprovider > "$OUT/tiny.log" 2>&1 &
  tiny=$!; tiny_rc=
  lim 200 $PY -m fixtures build --large >> "$S" 2>&1
  # The three suites at once need the H200's 140 GiB: on a smaller GPU (an H100's 79 GiB ran out of memory,
  # docs/gpu.md) the tiny suite finishes first.
  mem=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits 2>/dev/null | head -n 1)
  if [ "${mem:-0}" -lt 100000 ]; then
    stamp "tests: ${mem:-unknown} MiB of GPU memory: the tiny suite first, alone"
    wait $tiny; tiny_rc=$?
  fi
  stamp "tier (property_tests/test_gpu.py) and tolerance study, in parallel"
  lim 330 $PY -m pytest property_tests/test_gpu.py -p no:xdist --device cuda --hypothesis-profile gpu \
    -q -s -p no:cacheprovider > "$OUT/tier.log" 2>&1 &
  tier=$!
  lim 330 $PY -m checks.tools.bench_gpu tolerance --json "$OUT/tolerance.json" > "$OUT/tolerance.md" 2>&1 &
  tol=$!
  if [ -z "$tiny_rc" ]; then wait $tiny; tiny_rc=$?; fi
  echo "tiny exit $tiny_rc" >> "$S"; tail -n 3 "$OUT/tiny.log" >> "$S"
  stamp gemm
  lim 120 $PY -m checks.tools.bench_gpu gemm > "$OUT/gemm.md" 2>&1; echo "gemm exit $?" >> "$S"
  wait $tol; echo "tolerance exit $?" >> "$S"; stamp "tolerance done"
  wait $tier; echo "tier exit $?" >> "$S"; tail -n 3 "$OUT/tier.log" >> "$S"
  stamp "tests done"
fi

if has bench; then   # alone on the GPU: its timings are the figures
  lim 200 $PY -m fixtures build --large >> "$S" 2>&1
  stamp bench
  lim 300 $PY -m checks.tools.bench_gpu bench --examples 16 --json "$OUT/bench.json" > "$OUT/bench.md" 2>&1
  echo "bench exit $?" >> "$S"
fi
if has ab; then      # BEFORE: an older checkout (git archive COMMIT | tar -x -C DIR), carried with the call
  [ -d "${BEFORE:-}/checks" ] || { stamp "ab: BEFORE=${BEFORE:-} is not a checkout"; exit 2; }
  lim 200 $PY -m fixtures build --large >> "$S" 2>&1
  out=$(cd "$OUT" && pwd)
  for i in $(seq "${AB_ROUNDS:-2}"); do
    for side in before after; do
      dir=.; [ $side = before ] && dir="$BEFORE"
      stamp "ab: $side, round $i"
      (cd "$dir" && lim 150 $PY -m checks.tools.bench_gpu bench --examples 16 --json "$out/ab-$side-$i.json") \
        > "$out/ab-$side-$i.md" 2>&1
      echo "ab $side $i exit $?" >> "$S"
    done
  done
fi
if has thread; then  # the oracle's worker thread (DPEP_ORACLE_THREAD): the bit-for-bit tests, then off against on
  stamp "thread: the oracle tests, then the benchmark and the oracle alone with its worker thread off / on"
  lim 150 $PY -m fixtures build --large >> "$S" 2>&1
  lim 100 $PY -m pytest property_tests/test_gpu.py -p no:xdist --device cuda -p no:cacheprovider -q \
    -k "settled or own_stream" > "$OUT/thread-tier.log" 2>&1
  echo "thread tier exit $?" >> "$S"; tail -n 3 "$OUT/thread-tier.log" >> "$S"
  for t in off on; do
    lim 100 $PY -m checks.tools.bench_gpu bench --units moe,decoder --sizes 1,4 --examples 16 --oracle-thread $t \
      --json "$OUT/thread-bench-$t.json" > "$OUT/thread-bench-$t.md" 2>&1
    echo "thread bench $t exit $?" >> "$S"
  done
  for t in off on; do   # the oracle alone: its wall and the host's time to queue it; torch.profiler once
    lim 60 $PY -m checks.tools.bench_gpu oracle --units moe,decoder --sizes 1,4 --examples 8 --oracle-thread $t \
      --trace "$([ $t = off ] && echo 1 || echo 0)" --json "$OUT/thread-oracle-$t.json" > "$OUT/thread-oracle-$t.md" 2>&1
    echo "thread oracle $t exit $?" >> "$S"
  done
fi

if has mps; then     # the oracle beside the ranks, their kernels run at once under MPS (the control daemon is
  # started here and quit on the way out; where it cannot start, the stage says so and is skipped)
  export CUDA_MPS_PIPE_DIRECTORY=/tmp/dpep-mps-pipe CUDA_MPS_LOG_DIRECTORY=/tmp/dpep-mps-log
  mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
  # a daemon a killed earlier call left running (its EXIT trap never ran) is quit first
  command -v nvidia-cuda-mps-control > /dev/null && { echo quit | timeout 10 nvidia-cuda-mps-control > /dev/null 2>&1; sleep 1; }
  if command -v nvidia-cuda-mps-control > /dev/null && lim 200 $PY -m fixtures build --large >> "$S" 2>&1 &&
     nvidia-cuda-mps-control -d >> "$S" 2>&1; then
    trap 'echo quit | nvidia-cuda-mps-control > /dev/null 2>&1' EXIT
    stamp "mps: daemon started"
    for ov in off auto; do       # auto: as the suite decides, beside the ranks where an MPS daemon listens
      lim 150 $PY -m checks.tools.bench_gpu bench --examples 16 --units "${MPS_UNITS:-moe,decoder}" --sizes 1,4 \
        --overlap $ov --json "$OUT/mps-$ov.json" > "$OUT/mps-$ov.md" 2>&1
      echo "mps overlap $ov exit $?" >> "$S"
    done
    if [ -n "${MPS_TIER:-}" ]; then   # production-size tests (-k MPS_TIER) with the oracle beside the ranks
      lim 200 $PY -m pytest property_tests/test_gpu.py -p no:xdist --device cuda -p no:cacheprovider \
        -k "$MPS_TIER" > "$OUT/mps-tier.log" 2>&1
      echo "mps tier exit $?" >> "$S"; head -n 20 "$OUT/mps-tier.log" | grep "^dpep" >> "$S"
      tail -n 3 "$OUT/mps-tier.log" >> "$S"
    fi
    cat "$CUDA_MPS_LOG_DIRECTORY/control.log" >> "$S" 2>/dev/null
  else
    stamp "mps: no MPS control daemon here (nvidia-cuda-mps-control missing or refused, or the fixtures failed): skipped"
  fi
fi
stamp done
