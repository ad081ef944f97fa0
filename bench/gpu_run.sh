#!/usr/bin/env bash
# One device call: the plain reference and our training step, side by side, on the same GPU.
#   REFERENCE=path/to/reference_50m.py DATA=path/to/tokenized VARIANTS="plain padded shipped" [PROFILE_VARIANTS="shipped"] [REFERENCE_AFTER=1] [PATCH=MODULE.ATTR=JSON] bash bench/gpu_run.sh
# A variant written NAME@MODULE.ATTR=JSON[@MODULE.ATTR=JSON...] runs the lever NAME with those module switches too
# (PATCH sets one for every variant).
# Writes reference.txt, ours.jsonl, variants.txt (each run's whole output), smi.csv (clock and power
# every second) and table.md under $OUT (default ./bench-out). REFERENCE_AFTER=1 runs the reference
# again after ours (reference-after.txt), to check that the reference, timed first, does not meet a
# cooler GPU than our runs (docs/PERFORMANCE.md, calls 31-32: it did not).
set -uo pipefail
OUT=${OUT:-bench-out}
mkdir -p "$OUT"
export PYTHONPATH="$PWD:$PWD/trainer${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
# A host without the Python packages and without network: wheels carried in .device/whl
[ -d .device/whl ] && python3 -m pip install -q --no-index --find-links .device/whl mlflow-skinny pydantic > /dev/null 2>&1
VARIANTS=${VARIANTS:-"plain padded shipped"}
LOOP_VARIANT=${LOOP_VARIANT:-shipped}   # the one also measured as the full loop
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv | tee "$OUT/gpu.txt"
# The clock and power through the call, every second: under its power cap the GPU runs the step
# below its maximum clock (docs/PERFORMANCE.md, call 28).
nvidia-smi --query-gpu=timestamp,clocks.sm,clocks.mem,power.draw,power.limit,temperature.gpu,clocks_event_reasons.active \
    --format=csv,noheader -lms 1000 > "$OUT/smi.csv" 2>&1 &
SMI=$!
python3 "$REFERENCE" 2>&1 | tee "$OUT/reference.txt"
PEAK=$(sed -n 's/.*ceilings: matmul \([0-9]*\) TFLOP.*/\1/p' "$OUT/reference.txt")
for v in $VARIANTS; do
  loop=0; [ "$v" = "$LOOP_VARIANT" ] && loop=${LOOP_STEPS:-30}
  # NAME@MODULE.ATTR=JSON[@...]: the lever NAME with more module switches, reported under the whole string
  own=(); IFS=@ read -ra parts <<< "$v"
  for p in "${parts[@]:1}"; do own+=(--patch "$p"); done
  [ ${#parts[@]} -gt 1 ] && own+=(--name "$v")
  timeout "${VARIANT_TIMEOUT:-300}" python3 bench/train_throughput.py --variant "${v%%@*}" "${own[@]}" --data-dir "$DATA" --steps "${STEPS:-8}" --loop-steps "$loop" \
      ${PEAK:+--peak-tflops $PEAK} ${PATCH:+--patch "$PATCH"} --json "$OUT/ours.jsonl" $([[ " ${PROFILE_VARIANTS:-} " == *" $v "* ]] && echo --profile) \
      2>&1 | grep -v "^preflight" | tee -a "$OUT/variants.txt" | tail -45
done
AFTER=()
if [ "${REFERENCE_AFTER:-0}" = 1 ]; then
  python3 "$REFERENCE" 2>&1 | tee "$OUT/reference-after.txt"
  AFTER=(--reference-after "$OUT/reference-after.txt")
fi
kill $SMI 2>/dev/null
python3 bench/report.py --reference "$OUT/reference.txt" "${AFTER[@]}" --ours "$OUT/ours.jsonl" --smi "$OUT/smi.csv" | tee "$OUT/table.md"
