#!/usr/bin/env bash
# One GPU, serially: kernel correctness, the plain reference, the head + loss and matmul micro-benchmarks, then
# our shipped config (bare step, full loop, profile), then further variants while time allows.
# REFERENCE=... DATA=... OUT=... MORE="a b" [MORE_LOOP=20] DEADLINE=s bash bench/device_final.sh
set -u
OUT=${OUT:-bench-out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD:$PWD/trainer${PYTHONPATH:+:$PYTHONPATH}"
[ -d .device/whl ] && python3 -m pip install -q --no-index --find-links .device/whl mlflow-skinny pydantic > /dev/null 2>&1
timeout 60 python3 -m pytest -q -p no:cacheprovider tests/test_kernels.py tests/test_losses.py > "$OUT/variants.txt" 2>&1
tail -2 "$OUT/variants.txt"
timeout 150 python3 "$REFERENCE" > "$OUT/reference.txt" 2>&1
PEAK=$(sed -n 's/.*ceilings: matmul \([0-9]*\) TFLOP.*/\1/p' "$OUT/reference.txt")
timeout 90 python3 bench/head_ce.py --json "$OUT/head.jsonl" > "$OUT/head.txt" 2>&1
timeout 60 python3 bench/matmul_shapes.py >> "$OUT/head.txt" 2>&1
timeout 120 python3 bench/train_throughput.py --variant shipped --data-dir "$DATA" --steps 10 --loop-steps 30 --profile \
    --peak-tflops "${PEAK:-790}" --json "$OUT/ours.jsonl" 2>&1 | grep -v "^preflight" >> "$OUT/variants.txt"
for v in ${MORE:-}; do
  [ "$SECONDS" -gt "${DEADLINE:-200}" ] && { echo "skipped $v: past the deadline" >> "$OUT/variants.txt"; continue; }
  timeout 120 python3 bench/train_throughput.py --variant "$v" --data-dir "$DATA" --steps 10 --loop-steps "${MORE_LOOP:-0}" \
      --peak-tflops "${PEAK:-790}" --json "$OUT/ours.jsonl" 2>&1 | grep -v "^preflight" >> "$OUT/variants.txt"
done
python3 bench/report.py --reference "$OUT/reference.txt" --ours "$OUT/ours.jsonl" | tee "$OUT/table.md"
echo "total $SECONDS s"
