#!/usr/bin/env bash
# The trainer image's software stack on a GPU: its pinned requirements over the machine's torch
# 2.11.0+cu130 (what the image installs), then one of two parts, each within one device call:
#
#   PART=levers  the GPU tests; the plain reference; the step as shipped and the step with an
#                A100's lever set (train.gpu_arch=sm80), side by side; the trainer on a stand-in
#                torch 2.6 lacking the three calls newer than it, and on a stand-in 2.5.1 (refused)
#   PART=path    loss parity of the sm80 lever set against the plain PyTorch path (200 steps of
#                real text), and the whole path: the watchdog supervising the trainer, a SIGTERM
#                after the first checkpoint, the relaunch and resume, the finish, export_run, dod
#
#   REFERENCE=path/to/reference_50m.py DATA=.device/data PART=levers OUT=out bash bench/device_stack_check.sh
# Wheels carried in .whl (the image's pins the machine lacks) install into /tmp/site first;
# versions.txt lists every pin against what ran.
set -u
OUT=${OUT:-bench-out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl > "$OUT/pip.txt" 2>&1
  export PYTHONPATH="/tmp/site"
fi
export PYTHONPATH="$PWD:$PWD/trainer:$PWD/budget-sidecar:$PWD/watchdog${PYTHONPATH:+:$PYTHONPATH}"
python3 - > "$OUT/versions.txt" 2>&1 <<'PY'
from importlib.metadata import version, PackageNotFoundError
import re, torch, triton
print(f"torch {torch.__version__} (CUDA {torch.version.cuda}, cuDNN {torch.backends.cudnn.version()}), triton {triton.__version__}")
for line in open("trainer/requirements.txt").read().splitlines() + open("watchdog/requirements.txt").read().splitlines():
    line = line.split("#")[0].strip()
    if not line: continue
    name, pin = re.split(r"==", line)
    try: got = version(name)
    except PackageNotFoundError: got = "absent"
    print(f"{name:20s} pinned {pin:12s} ran {got:12s} {'' if got == pin else '<- another version'}")
PY
cat "$OUT/versions.txt"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"

if [ "${PART:-levers}" = levers ]; then
  timeout 150 python3 -m pytest -q -p no:cacheprovider -x tests/test_cublaslt.py tests/test_losses.py tests/test_kernels.py \
      tests/test_triton_kernels.py -k "not interpreter" > "$OUT/gpu-tests.txt" 2>&1
  tail -3 "$OUT/gpu-tests.txt"
  timeout 150 python3 "$REFERENCE" > "$OUT/reference.txt" 2>&1
  tail -2 "$OUT/reference.txt"
  PEAK=$(sed -n 's/.*ceilings: matmul \([0-9]*\) TFLOP.*/\1/p' "$OUT/reference.txt")
  for v in shipped sm80; do
    timeout 150 python3 bench/train_throughput.py --variant "$v" --data-dir "$DATA" --steps 8 --loop-steps 0 \
        --peak-tflops "${PEAK:-790}" --json "$OUT/ours.jsonl" 2>&1 | grep -E "lever|tokens/s|MFU|error|Error" >> "$OUT/variants.txt"
  done
  python3 bench/report.py --reference "$OUT/reference.txt" --ours "$OUT/ours.jsonl" | tee "$OUT/table.md"
  # A torch 2.6 without get_total_norm, compiled autograd's _enable and addmm(out_dtype=), the
  # shipped 50M config, 12 steps; then a torch reporting 2.5.1.
  S=/tmp/standin; rm -rf $S; mkdir -p $S
  timeout 180 python3 tests/torch_standin.py --version 2.6.0 --without get_total_norm,compiled_autograd,addmm_out_dtype \
      x1_pretrain.train --config configs/x1-50m-a100.yaml --data-dir "$DATA" --ckpt-dir $S/ckpt \
      --mlflow-uri file://$S/mlruns --total-steps 12 --ckpt-every 12 --eval-every 12 --log-every 4 --metrics-port 0 \
      --heartbeat-file $S/hb.json --set optim.warmup_steps=2 > "$OUT/standin-2.6.txt" 2>&1
  echo "stand-in 2.6.0 without the three calls: exit $?" | tee -a "$OUT/standin-2.6.txt"
  grep -E "lever|step +12|torch.compile|Error" "$OUT/standin-2.6.txt" | tail -15
  timeout 60 python3 tests/torch_standin.py --version 2.5.1 x1_pretrain.train --config configs/x1-50m-a100.yaml \
      --data-dir "$DATA" --ckpt-dir $S/ckpt2 --mlflow-uri file://$S/mlruns2 --total-steps 12 > "$OUT/standin-2.5.txt" 2>&1
  echo "stand-in 2.5.1: exit $?; checkpoint folder made: $([ -e $S/ckpt2 ] && echo yes || echo no)" | tee -a "$OUT/standin-2.5.txt"
  tail -2 "$OUT/standin-2.5.txt"
else
  timeout 330 python3 bench/loss_parity.py --config configs/x1-50m-a100.yaml --data-dir "$DATA" --out /tmp/parity \
      --steps 200 --tokens-per-step 65536 --tolerance 0.005 \
      --baseline train.kernels=torch --baseline train.cublaslt=off --baseline train.residual=fp32 \
      --baseline train.weight_casts=per-micro-step --baseline train.grad_accumulation=autograd \
      --baseline train.compiled_autograd=false --candidate train.gpu_arch=sm80 > "$OUT/parity.txt" 2>&1
  echo "parity exit $?" >> "$OUT/parity.txt"; tail -6 "$OUT/parity.txt"
  cp /tmp/parity/parity.json "$OUT/" 2>/dev/null
  # The whole path under the watchdog (process mode): 50M config, 120 steps of 65,536 tokens.
  W=/tmp/ws; rm -rf $W; mkdir -p $W/logs
  python3 -m x1_watchdog --mode process --heartbeat-file $W/logs/heartbeat.json --events-file $W/logs/events.jsonl \
      --state-file $W/logs/watchdog-state.json --port 0 --backoff-base-seconds 1 --trainer-log $W/logs/trainer.log -- \
      python3 -m x1_pretrain.train --config configs/x1-50m-a100.yaml --data-dir "$DATA" --ckpt-dir $W/checkpoints \
      --mlflow-uri file://$W/mlruns --total-steps 120 --ckpt-every 40 --eval-every 40 --log-every 10 --metrics-port 0 \
      --heartbeat-file $W/logs/heartbeat.json --set train.tokens_per_step=65536 --set optim.warmup_steps=10 \
      --resume-from-latest > $W/logs/watchdog.log 2>&1 &
  WD=$!
  for _ in $(seq 1 200); do [ -f $W/checkpoints/step_00000040/COMPLETE.json ] && break; sleep 1; done
  sleep 3; TP=$(python3 -c "import json;print(json.load(open('$W/logs/heartbeat.json'))['pid'])")
  echo "SIGTERM to trainer pid $TP at $(date +%T)"; kill -TERM "$TP"
  wait $WD; echo "watchdog exit $?" | tee "$OUT/path.txt"
  python3 -m x1_pretrain.export_run --mlflow-uri file://$W/mlruns --output $W/run >> "$OUT/path.txt" 2>&1
  echo "export_run exit $?" >> "$OUT/path.txt"
  python3 -m x1_pretrain.dod $W/run --band 4.0 9.0 >> "$OUT/path.txt" 2>&1; echo "dod exit $?" >> "$OUT/path.txt"
  grep -E "lever|resum|exit|step +(40|120)" $W/logs/watchdog.log | tail -25 >> "$OUT/path.txt"
  cat $W/logs/events.jsonl >> "$OUT/path.txt"
  python3 -c "import json;m=json.load(open('$W/run/manifest.json'));print(json.dumps({k:m.get(k) for k in ('levers','versions','end','restarts')},indent=1))" >> "$OUT/path.txt" 2>&1
  tail -60 "$OUT/path.txt"
fi
echo "total $SECONDS s"
