#!/usr/bin/env bash
# A second ladder design against the targets of bench/ladder_device_call.sh (the same corpus, rebuilt:
# its meta.json hash says whether it is the same), and the aggregate tokens/s of rungs at once against
# one alone (bench/ladder_concurrency.py), in one device call. Run from the repository root on the GPU
# machine, with the plain reference at $REFERENCE and the wheels the machine lacks in .whl/, writing
# under $OUT:
#   REFERENCE=.device/reference_50m.py OUT=out BUDGETS_BY=flops WIDTHS=48,96,192,288 bash bench/ladder_design_call.sh
source bench/device_env.sh
B="python3 bench/ladder_accuracy.py"; W=/tmp/w2; D=/tmp/d
corpus_and_reference "$D" "$W"
if [ "${LADDER:-1}" = 1 ]; then  # LADDER=0: the concurrency measurement alone (CORPUS_MB=40 is then enough)
  timeout $(( $(left) - 250 )) $B ladder --data $D --work $W --jobs 8 --budgets-by "${BUDGETS_BY:-flops}" \
    --widths "${WIDTHS:-48,96,192,288}" > $W/ladder.txt 2>&1
  echo "ladder done at ${SECONDS} s" >> "$OUT/env.txt"
fi
timeout $(( $(left) - 10 )) python3 bench/ladder_concurrency.py --data $D --work $W/concurrency --widths 144,336 \
  --jobs 1,8 --steps 400 > "$OUT/concurrency.md" 2>&1
echo "concurrency done at ${SECONDS} s" >> "$OUT/env.txt"
cp $D/meta.json "$OUT/corpus-meta.json"
tar czf "$OUT/ladder-design.tgz" --exclude='*.safetensors' --exclude='*.pt' --exclude=mlruns --exclude='ckpt' -C $W .
tail -8 "$OUT/concurrency.md"; cat "$OUT/env.txt"
