#!/usr/bin/env bash
# The 2-GPU scaling run, one call on a 2-GPU host (device kind nvidia-h200-x2), about 4 minutes,
# one thing at a time so that nothing shares the host with a measurement:
#   1. our shipped step on one GPU (micro-batch 32, accumulation 16)
#   2. the same step under torchrun on 2 GPUs with DDP (micro-batch 32 per GPU, accumulation 8)
#   3. the same with FSDP2
#   4. the plain reference on one GPU, for the ratio to it
# REFERENCE=path/to/reference_50m.py DATA=path/to/tokenized OUT=dir bash bench/device_scaling.sh
# CONFIG=configs/tiny-cpu.yaml rehearses the same commands on CPU processes (gloo).
set -u
OUT=${OUT:-bench-out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD:$PWD/trainer${PYTHONPATH:+:$PYTHONPATH}"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
CONFIG=${CONFIG:-configs/x1-50m-a100.yaml}
STEPS=${STEPS:-10}
[ -d .device/whl ] && python3 -m pip install -q --no-index --find-links .device/whl mlflow-skinny pydantic > /dev/null 2>&1
command -v nvidia-smi > /dev/null && nvidia-smi --query-gpu=index,name,driver_version --format=csv > "$OUT/gpus.txt"
bench=(bench/train_throughput.py --config "$CONFIG" --data-dir "$DATA" --steps "$STEPS" --loop-steps 0 --json "$OUT/ours.jsonl")

CUDA_VISIBLE_DEVICES=0 timeout 120 python3 "${bench[@]}" --name 1-gpu > "$OUT/run.txt" 2>&1
PEAK=$(python3 -c "import json; print(json.loads(open('$OUT/ours.jsonl').readlines()[-1])['matmul_peak_tflops'])" 2>/dev/null)
for mode in ${MODES:-ddp fsdp2}; do
  echo "== 2 processes, $mode, at $SECONDS s" >> "$OUT/run.txt"
  timeout 120 torchrun --standalone --nproc_per_node=2 "${bench[@]}" --name "$mode-2-gpus" \
      --set "train.distributed=$mode" ${PEAK:+--peak-tflops $PEAK} >> "$OUT/run.txt" 2>&1
done
[ -n "${REFERENCE:-}" ] && CUDA_VISIBLE_DEVICES=0 timeout 150 python3 "$REFERENCE" > "$OUT/reference.txt" 2>&1
python3 bench/report.py ${REFERENCE:+--reference "$OUT/reference.txt"} --ours "$OUT/ours.jsonl" | tee "$OUT/table.md"
python3 - "$OUT/ours.jsonl" <<'EOF' | tee -a "$OUT/table.md"
import json, sys
runs = {r["name"]: r["bare_tokens_per_sec"] for r in map(json.loads, open(sys.argv[1]))}
for mode in ("ddp", "fsdp2"):
    if f"{mode}-2-gpus" in runs and "1-gpu" in runs:
        print(f"{mode}: 2 GPUs / 1 GPU = {runs[f'{mode}-2-gpus'] / runs['1-gpu']:.3f}")
EOF
echo "total $SECONDS s"
