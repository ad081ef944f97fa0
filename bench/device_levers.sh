#!/usr/bin/env bash
# Levers, two GPUs in parallel, the plain reference on GPU 0 first (same call, same machine).
# REFERENCE=... DATA=... OUT=... GPU0="a b" GPU1="c d" LOOP_VARIANT=name bash bench/device_levers.sh
set -u
OUT=${OUT:-bench-out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD:$PWD/trainer${PYTHONPATH:+:$PYTHONPATH}"
DEADLINE=${DEADLINE:-260}
[ -d .device/whl ] && python3 -m pip install -q --no-index --find-links .device/whl mlflow-skinny pydantic > /dev/null 2>&1
lane() {  # lane GPU "variants..." logfile
  local gpu=$1 variants=$2 log=$3 v extra
  for v in $variants; do
    [ "$SECONDS" -gt "$DEADLINE" ] && { echo "skipped $v: past the deadline" >> "$log"; continue; }
    extra=(--loop-steps 0)
    [ "$v" = "${LOOP_VARIANT:-}" ] && [ "$gpu" = "${LOOP_GPU:-0}" ] && extra=(--loop-steps 30)
    [ "$v" = "${PROFILE_VARIANT:-}" ] && [ "$gpu" = "${PROFILE_GPU:-1}" ] && extra+=(--profile)
    CUDA_VISIBLE_DEVICES=$gpu timeout 150 python3 bench/train_throughput.py --variant "$v" --data-dir "$DATA" --steps 10 \
        --peak-tflops "${PEAK:-790}" "${extra[@]}" --name "$v@gpu$gpu" --json "$OUT/ours.jsonl" 2>&1 | grep -v "^preflight" >> "$log"
  done
}
( CUDA_VISIBLE_DEVICES=0 timeout 200 python3 "$REFERENCE" > "$OUT/reference.txt" 2>&1
  PEAK=$(sed -n 's/.*ceilings: matmul \([0-9]*\) TFLOP.*/\1/p' "$OUT/reference.txt") lane 0 "${GPU0:-}" "$OUT/variants0.txt" ) &
g0=$!
CUDA_VISIBLE_DEVICES=1 timeout 60 python3 -m pytest -q -p no:cacheprovider tests/test_kernels.py tests/test_losses.py \
    > "$OUT/variants1.txt" 2>&1
PEAK=790 lane 1 "${GPU1:-}" "$OUT/variants1.txt"
f=$(grep -rl "def triton_poi_fused__to_copy_add_cat_mul_neg_slice" /tmp/torchinductor_root 2>/dev/null | head -1)
[ -n "$f" ] && cp "$f" "$OUT/rope_bwd_kernel.py"
wait "$g0"
if [ -n "${DDP_VARIANT:-}" ] && [ "$SECONDS" -lt "${DDP_DEADLINE:-240}" ]; then
  timeout 120 torchrun --standalone --nproc_per_node=2 bench/train_throughput.py --variant "$DDP_VARIANT" \
      --name "$DDP_VARIANT-2gpu" --data-dir "$DATA" --steps 10 --loop-steps 0 --peak-tflops 790 \
      --json "$OUT/ours.jsonl" 2>&1 | grep -v "^preflight" | tail -3 >> "$OUT/variants0.txt"
fi
python3 bench/report.py --reference "$OUT/reference.txt" --ours "$OUT/ours.jsonl" | tee "$OUT/table.md"
echo "total $SECONDS s"
