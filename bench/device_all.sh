#!/usr/bin/env bash
# Everything GPU in one call on a 2-GPU host (device kind nvidia-h200-x2), within 10 minutes:
#   GPU 0: the plain reference, then the real trainer (SIGTERM + resume), then int8/int4 inference
#   GPU 1: our training step, one lever per process
#   both : the same step under torchrun on 2 GPUs (DDP), for the scaling ratio
# REFERENCE=path/to/reference_50m.py DATA=path/to/tokenized OUT=dir bash bench/device_all.sh
set -u
OUT=${OUT:-bench-out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD:$PWD/trainer${PYTHONPATH:+:$PYTHONPATH}"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
VARIANTS=${VARIANTS:-"fused-ce padded plain sdpa-cudnn cudagraphs"}
GPU1_DEADLINE=${GPU1_DEADLINE:-300}
{
  date -u
  # MLflow's client and pydantic are not in the GPU image: wheels travel with the call.
  [ -d .device/whl ] && python3 -m pip install -q --no-index --find-links .device/whl mlflow-skinny pydantic 2>&1 | tail -2
  nvidia-smi --query-gpu=index,name,driver_version,memory.total --format=csv
  python3 -c "import torch; print('torch', torch.__version__, 'gpus', torch.cuda.device_count())"
  CUDA_VISIBLE_DEVICES=0 python3 -m pytest -q -p no:cacheprovider tests/test_losses.py 2>&1 | tail -3
} > "$OUT/variants.txt" 2>&1
(
  CUDA_VISIBLE_DEVICES=0 timeout 220 python3 "$REFERENCE" > "$OUT/reference.txt" 2>&1
  CUDA_VISIBLE_DEVICES=0 DATA="$DATA" timeout 230 bash bench/trainer_check.sh > "$OUT/trainer.txt" 2>&1
  CUDA_VISIBLE_DEVICES=0 timeout 90 python3 bench/quant_inference.py --checkpoint /tmp/x1-check/ckpt/final.safetensors \
      --val-bin "$DATA/val.bin" --modes bf16,int8-dq,int4 > "$OUT/quant.txt" 2>&1
) &
gpu0=$!
PEAK=""
for v in $VARIANTS; do
  [ "$SECONDS" -gt "$GPU1_DEADLINE" ] && { echo "skipped $v: past the deadline" >> "$OUT/variants.txt"; continue; }
  extra=(--loop-steps 0); [ "$v" = fused-ce ] && extra=(--loop-steps 30 --profile)
  CUDA_VISIBLE_DEVICES=1 timeout 150 python3 bench/train_throughput.py --variant "$v" --data-dir "$DATA" --steps 8 \
      ${PEAK:+--peak-tflops $PEAK} "${extra[@]}" --json "$OUT/ours.jsonl" >> "$OUT/variants.txt" 2>&1
  PEAK=$(python3 -c "import json;print(json.loads(open('$OUT/ours.jsonl').readlines()[-1])['matmul_peak_tflops'])" 2>/dev/null)
done
wait "$gpu0"
echo "2-GPU DDP at $SECONDS s" >> "$OUT/variants.txt"
timeout 150 torchrun --standalone --nproc_per_node=2 bench/train_throughput.py --variant fused-ce --name ddp-2gpu \
    --data-dir "$DATA" --steps 8 --loop-steps 0 ${PEAK:+--peak-tflops $PEAK} --json "$OUT/ours.jsonl" >> "$OUT/variants.txt" 2>&1
python3 bench/report.py --reference "$OUT/reference.txt" --ours "$OUT/ours.jsonl" > "$OUT/table.md" 2>&1
cat "$OUT/table.md"; tail -5 "$OUT/trainer.txt"; tail -12 "$OUT/quant.txt"; echo "total $SECONDS s"
