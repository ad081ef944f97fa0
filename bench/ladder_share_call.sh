#!/usr/bin/env bash
# How large a share of the targets' compute does the ladder need on this corpus? Two ladders of
# bench/ladder_accuracy.py's design at SCALES times its 4.5% share (default 3 and 10: 13.5% and 45%),
# at once, fitted against the targets of bench/ladder_device_call.sh (the same corpus, rebuilt: its
# meta.json hash, in each ladder.json's provenance, says whether it is the same). Run from the
# repository root on the GPU machine, with the plain reference at $REFERENCE and the wheels the
# machine lacks in .whl/, writing under $OUT:
#   END=460 REFERENCE=.device/reference_50m.py OUT=out bash bench/ladder_share_call.sh
# then, here, each ladder against that call's targets: copy its work folder, put a ladder/ from this
# call in it, and run `python3 bench/ladder_accuracy.py table --work FOLDER`.
source bench/device_env.sh
B="python3 bench/ladder_accuracy.py"; D=/tmp/d
corpus_and_reference "$D" /tmp/ws
for s in ${SCALES:-3 10}; do
  mkdir -p /tmp/ws/x$s
  timeout $(( $(left) - 20 )) $B ladder --data $D --work /tmp/ws/x$s --jobs 6 --scale $s > /tmp/ws/x$s/ladder.txt 2>&1 &
done
wait
echo "ladders done at ${SECONDS} s" >> "$OUT/env.txt"
cp $D/meta.json "$OUT/corpus-meta.json"
tar czf "$OUT/ladder-share.tgz" --exclude='*.safetensors' --exclude='*.pt' --exclude=mlruns --exclude='ckpt' -C /tmp/ws .
for s in ${SCALES:-3 10}; do tail -9 /tmp/ws/x$s/ladder.txt; done; cat "$OUT/env.txt"
