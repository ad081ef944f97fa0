#!/usr/bin/env bash
# One device call for float8 training:
#   parity:     the GPU tests of tests/test_float8.py, then bench/loss_parity.py on real text
#               (configs/x1-50m-h200.yaml as shipped vs float8, same seed and batches);
#   throughput: the plain reference, then bench/train_throughput.py for VARIANTS (default: the
#               step as shipped and with float8 tensorwise).
#   REFERENCE=path/to/reference_50m.py TEXT=.device/text OUT=$OUT [PARTS="parity throughput"] [DEADLINE=580] bash bench/device_float8.sh
# TEXT is `bash bench/device_text.sh`'s output. Each variant ends by DEADLINE seconds after the
# start, so the table is written inside the call's limit. At most 8 files under $OUT.
set -uo pipefail
OUT=${OUT:-bench-out}
DEADLINE=${DEADLINE:-580}
mkdir -p "$OUT"
export PYTHONPATH="$PWD:$PWD/trainer${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
# A host without the Python packages and without network: wheels carried in .device/whl
[ -d .device/whl ] && python3 -m pip install -q --no-index --find-links .device/whl mlflow-skinny pydantic torchao > /dev/null 2>&1
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv | tee -a "$OUT/log.txt"
python3 -c 'import torch, torchao; print("torch", torch.__version__, "torchao", torchao.__version__)' 2>&1 | tail -1 | tee -a "$OUT/log.txt"
PARTS=${PARTS:-"parity throughput"}
left() { echo $(( DEADLINE - SECONDS > 1 ? DEADLINE - SECONDS : 1 )); }

if [[ " $PARTS " == *" parity "* ]]; then
  timeout 120 python3 -m pytest -q -p no:cacheprovider --tb=line tests/test_float8.py -k gpu 2>&1 | tail -12 | tee -a "$OUT/log.txt"
  rm -rf /tmp/parity
  timeout "$(left)" python3 bench/loss_parity.py --data-dir "$TEXT" --out /tmp/parity \
      --steps "${PARITY_STEPS:-300}" --recipe "${RECIPE:-tensorwise}" ${PARITY_ARGS:-} 2>&1 | tee -a "$OUT/log.txt"
  cp /tmp/parity/parity.json /tmp/parity/parity.png "$OUT/" 2>/dev/null
  for r in /tmp/parity/*/train.log; do echo "== $r"; grep -v "^preflight" "$r"; done > "$OUT/train-logs.txt"
fi

if [[ " $PARTS " == *" throughput "* ]]; then
  python3 "$REFERENCE" 2>&1 | tee "$OUT/reference.txt"
  PEAK=$(sed -n 's/.*ceilings: matmul \([0-9]*\) TFLOP.*/\1/p' "$OUT/reference.txt")
  for v in ${VARIANTS:-shipped float8}; do
    timeout "$(left)" python3 bench/train_throughput.py --variant "$v" --data-dir "$TEXT" \
        --steps "${STEPS:-6}" --loop-steps 0 ${PEAK:+--peak-tflops $PEAK} --json "$OUT/ours.jsonl" \
        2>&1 | grep -v "^preflight" | tee -a "$OUT/variants.txt" | tail -3
  done
  python3 bench/report.py --reference "$OUT/reference.txt" --ours "$OUT/ours.jsonl" | tee "$OUT/table.md"
fi
