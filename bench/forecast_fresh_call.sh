#!/usr/bin/env bash
# The forecast's second held-out set in one device call (docs/FORECAST.md): the corpus and the plain
# reference, then bench/ladder_accuracy.py's fresh runs U1-U6 (the d384 family of T1-T5, other
# lengths, warm-ups and seed, cooldown probes on) at once, and their curves file. Run from the
# repository root on the GPU machine, with the plain reference at $REFERENCE and the wheels the
# machine lacks in .whl/, writing under $OUT:
#   END=570 REFERENCE=.device/reference_50m.py OUT=out bash bench/forecast_fresh_call.sh
# (NAMES=U1,U2,U4 runs fewer of them: a shorter call)
source bench/device_env.sh
B="python3 bench/ladder_accuracy.py"; W=/tmp/w; D=/tmp/d; NAMES=${NAMES:-U1,U2,U3,U4,U5,U6}
corpus_and_reference "$D" "$W"
timeout $(( $(left) - 15 )) $B targets --data $D --work $W --names $NAMES --probes 0.025,0.05,0.1 > $W/targets.txt 2>&1
echo "U1-U6 done at ${SECONDS} s" >> "$OUT/env.txt"
$B curves --work $W --names $NAMES --out "$OUT/gpu-d384-fresh-curves.json" --device "$(head -2 "$OUT/env.txt" | tail -1)"
cp $D/meta.json "$OUT/corpus-meta.json"
tar czf "$OUT/forecast-fresh.tgz" --exclude='*.safetensors' --exclude='*.pt' --exclude=mlruns --exclude=ckpt -C $W .
cat $W/targets.txt | grep -v '^\$' ; cat "$OUT/env.txt"
