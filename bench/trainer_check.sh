#!/usr/bin/env bash
# The real trainer on one GPU, as users run it: the 50M config with compile on a real-text corpus,
# a SIGTERM mid-run (emergency checkpoint, exit 75), and a resume to the end.
#   DATA=path/to/tokenized STEPS=100 bash bench/trainer_check.sh
set -u
CK=${CK:-/tmp/x1-check/ckpt}
rm -rf "$(dirname "$CK")"
mkdir -p "$CK"
STEPS=${STEPS:-100}
ARGS=(--config "${CONFIG:-configs/x1-50m-h200.yaml}" --data-dir "$DATA" --ckpt-dir "$CK" --mlflow-uri "file://$(dirname "$CK")/mlruns"
      --total-steps "$STEPS" --ckpt-every 50 --eval-every 25 --log-every 10 --metrics-port 9791
      --heartbeat-file "$CK/heartbeat.json" --set optim.warmup_steps=20)
python3 -m x1_pretrain.train "${ARGS[@]}" &
pid=$!
stop_at=$((STEPS * 6 / 10))
python3 - "$CK/heartbeat.json" "$stop_at" <<'PY'
import json, sys, time, urllib.request
path, target = sys.argv[1], int(sys.argv[2])
while True:
    try:
        hb = json.load(open(path))
        if hb["phase"] == "training" and hb["step"] >= target:
            break
    except (OSError, ValueError, KeyError):
        pass
    time.sleep(0.5)
try:
    text = urllib.request.urlopen("http://127.0.0.1:9791/metrics", timeout=5).read().decode()
except OSError as e:
    text = f"/metrics not reachable: {e}"
print("\n".join(l for l in text.splitlines() if l.startswith(("x1_train_tokens_per_second", "x1_train_mfu_ratio", "x1_train_loss", "x1_train_step"))))
PY
t0=$(date +%s.%N)
kill -TERM "$pid"
wait "$pid"
echo "first process: exit $? after SIGTERM, $(python3 -c "print(round($(date +%s.%N) - $t0, 2))") s from signal to exit"
python3 -m x1_pretrain.train "${ARGS[@]}" --resume-from-latest
echo "resumed process: exit $?"
ls -la "$CK"
