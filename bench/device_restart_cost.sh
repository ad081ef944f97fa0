#!/usr/bin/env bash
# One device call for the restart cost: the real trainer (the 50M config, compiled) under the
# watchdog in process mode, a SIGTERM at SIGTERM_AT, the relaunch and resume, the finish at STEPS;
# torch.compile's caches under CACHE as compose puts them on the workspace volume
# (TORCHINDUCTOR_CACHE_DIR, TRITON_CACHE_DIR; X1_CUBLASLT_CACHE, the matmul algorithms chosen). Reports each process's time to first step, the
# preemption downtime (exit 75 -> the relaunched process's first step), the floor warnings, and
# the log of both trainer processes (bench/restart_cost.py).
#   TEXT=.device/text OUT=$OUT [CONFIG=configs/x1-50m-h200.yaml] [STEPS=240] [SIGTERM_AT=150] [SPIKE_AT=100]
#       [CACHE=/tmp/x1-cache] [DEADLINE=560] bash bench/device_restart_cost.sh
# TEXT is `bash bench/device_text.sh`'s output. An empty CACHE makes the first start compile cold,
# as on a new instance; the relaunch then finds the cache, as after a preemption. At most 7 files
# under $OUT.
set -uo pipefail
OUT=${OUT:-bench-out}
mkdir -p "$OUT"
export PYTHONPATH="$PWD:$PWD/trainer:$PWD/watchdog:$PWD/budget-sidecar${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
# A host without the Python packages and without network: wheels carried in .device/whl
[ -d .device/whl ] && python3 -m pip install -q --no-index --find-links .device/whl mlflow-skinny pydantic > /dev/null 2>&1
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv | tee "$OUT/gpu.txt"
WORK=/tmp/x1-restart-cost
python3 bench/restart_cost.py --data-dir "$TEXT" --out "$WORK" --config "${CONFIG:-configs/x1-50m-h200.yaml}" \
    --steps "${STEPS:-240}" --sigterm-at "${SIGTERM_AT:-150}" ${SPIKE_AT:+--spike-at $SPIKE_AT} \
    --cache-dir "${CACHE:-/tmp/x1-cache}" --timeout "${DEADLINE:-560}" ${RESTART_ARGS:---set optim.warmup_steps=20} > "$OUT/report.txt" 2>&1
code=$?
head -20 "$OUT/report.txt"
cp "$WORK/restart-cost.json" "$WORK/logs/watchdog.log" "$OUT/" 2>/dev/null
cp "$WORK/run/manifest.json" "$WORK/run/throughput.png" "${CACHE:-/tmp/x1-cache}/cublaslt.json" "$OUT/" 2>/dev/null
echo "restart_cost.py exit $code"
exit $code
