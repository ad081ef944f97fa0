#!/usr/bin/env bash
# The ladder's and the forecast's GPU benchmark in one device call (docs/SCALING.md, docs/FORECAST.md):
# the corpus and the plain reference; the ladder beside targets T1-T4 (cooldown probes on); T5 with
# --ladder and probes once the ladder is fitted; the accuracy table. Run from the
# repository root on the GPU machine, with the plain reference at $REFERENCE and the wheels the machine
# lacks in .whl/ (docs/PERFORMANCE.md says which), writing under $OUT:
#   REFERENCE=.device/reference_50m.py OUT=out bash bench/ladder_device_call.sh
source bench/device_env.sh
B="python3 bench/ladder_accuracy.py"; W=/tmp/w; D=/tmp/d; P="--probes 0.025,0.05,0.1"
corpus_and_reference "$D" "$W"
( timeout $(( $(left) - 150 )) $B ladder --data $D --work $W --jobs 8 > $W/ladder.txt 2>&1
  echo "ladder done at ${SECONDS} s" >> "$OUT/env.txt"
  timeout $(left) $B targets --data $D --work $W --names T5 $P --ladder $W/ladder/ladder.json > $W/t5.txt 2>&1 ) &
LT=$!
timeout $(left) $B targets --data $D --work $W --names T1,T2,T3,T4 $P > $W/t1234.txt 2>&1 &
TG=$!
wait $TG
echo "T1-T4 done at ${SECONDS} s" >> "$OUT/env.txt"
wait $LT
echo "T5 done at ${SECONDS} s" >> "$OUT/env.txt"
$B table --work $W > "$OUT/table.md" 2>&1
$B curves --work $W --names T1,T2,T3,T4,T5 --out $W/target_curves.json --device "$(head -2 "$OUT/env.txt" | tail -1)"
tar czf "$OUT/ladder-bench.tgz" --exclude='*.safetensors' --exclude='*.pt' --exclude=mlruns -C $W .
cat "$OUT/table.md" "$OUT/env.txt"
