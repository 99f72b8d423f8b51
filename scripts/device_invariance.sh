#!/usr/bin/env bash
# The invariance properties on one GPU machine (docs/gpu.md, "Invariance on CUDA"):
#   OUT=DIR bash scripts/device_invariance.sh
# spec (promises nothing: its drift table), the batch-invariant spec (promises batch, placement and, on its
# expert-parallel layouts, layout invariance) and each invariance mutant, on CUDA, gpu profile, world sizes
# 1, 2, 4, bfloat16 and float32. Every run has a time limit (SIGINT first, so pytest prints its summary).
set -u
. "$(dirname "$0")/device_common.sh" runs/invariance-gpu
ARGS=(property_tests/test_invariance.py --device cuda --hypothesis-profile gpu --world-sizes 1,2,4
      --dtypes bfloat16,float32 -q -p no:cacheprovider)
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader >> "$S" 2>&1
stamp "spec (drift) and the batch-invariant spec, in parallel"
lim 240 $PY -m pytest "${ARGS[@]}" -n 4 > "$OUT/spec.log" 2>&1 &
a=$!
lim 240 $PY -m pytest "${ARGS[@]}" -n 4 --target checks.catalog.variants:BATCH_INVARIANT > "$OUT/batch-invariant.log" 2>&1
echo "batch-invariant exit $?" >> "$S"; tail -n 2 "$OUT/batch-invariant.log" >> "$S"
wait $a; echo "spec exit $?" >> "$S"; tail -n 2 "$OUT/spec.log" >> "$S"
stamp "invariance mutants, in parallel (each stops at its first failure)"
pids=()
for m in I01 I02 I03 I04 I05; do
  lim 200 $PY -m pytest "${ARGS[@]}" -n 2 -x --target checks.catalog.invariance_mutants:$m > "$OUT/$m.log" 2>&1 &
  pids+=($!)
done
i=0
for m in I01 I02 I03 I04 I05; do
  wait "${pids[$i]}"; echo "$m exit $? $(grep -E 'passed|failed' "$OUT/$m.log" | tail -n 1)" >> "$S"; i=$((i + 1))
done
stamp done
