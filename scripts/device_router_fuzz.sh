#!/usr/bin/env bash
# The router-weights check over a 500-example fuzz run (docs/precision.md, "Router weights"), on the lent
# machine's CPU cores (16 there; the check's bound is for CPU and CUDA alike):
#   OUT=DIR bash scripts/device_router_fuzz.sh
# The spec and every legitimate variant must pass the parity searches of the units with a router (moe, decoder,
# model; TESTS narrows them, WORKERS sets -n per target) in bfloat16 and float32 with the `fuzz` profile (500 examples a test, random seeds); every example's
# [router] check is part of its verdict. Each run has a time limit (SIGINT first, so pytest prints its summary).
set -u
. "$(dirname "$0")/device_common.sh" runs/router-fuzz
export DPEP_PROFILE=fuzz
LIMIT="${LIMIT:-500}"
TESTS="${TESTS:-test_moe_parity or test_decoder_parity or test_model_parity}"   # the searches, not the pins
WORKERS="${WORKERS:-3}"
pids=()
TARGETS=(spec checks.catalog.variants:EXPERTS_REVERSED checks.catalog.variants:EXPERTS_FP32_ACCUMULATE
         checks.catalog.variants:ALL_REDUCE_BY_GATHER checks.catalog.variants:REDUCE_SCATTER_BY_ALL_REDUCE
         checks.catalog.variants:BATCH_INVARIANT)
$PY -c "from dpep_parity.fixtures.build import fixture_path; from dpep_parity.fixtures.specs import DEFAULT_SUITE; [fixture_path(f) for f in DEFAULT_SUITE]"
for t in "${TARGETS[@]}"; do
  lim "$LIMIT" $PY -m pytest property_tests/test_parity.py -k "$TESTS" \
      --target "$t" --device cpu --world-sizes 1,2,4 --dtypes bfloat16,float32 -n "$WORKERS" -q -p no:cacheprovider \
      --hypothesis-show-statistics > "$OUT/${t##*:}.log" 2>&1 &
  pids+=($!)
done
i=0
for t in "${TARGETS[@]}"; do
  wait "${pids[$i]}"; echo "$t exit $? $(grep -E 'passed|failed' "$OUT/${t##*:}.log" | tail -n 1)" >> "$S"
  i=$((i + 1))
done
grep -h "passing examples" "$OUT"/*.log | sort | uniq -c >> "$S"
echo "done +$(( $(date +%s) - T0 ))s" >> "$S"
cat "$S"
