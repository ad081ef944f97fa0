#!/usr/bin/env bash
# A second ladder design against the targets of bench/ladder_device_call.sh (the same corpus, rebuilt:
# its meta.json hash says whether it is the same), and the aggregate tokens/s of rungs at once against
# one alone (bench/ladder_concurrency.py), in one device call. Run from the repository root on the GPU
# machine, with the plain reference at $REFERENCE and the wheels the machine lacks in .whl/, writing
# under $OUT:
#   REFERENCE=.device/reference_50m.py OUT=out BUDGETS_BY=flops WIDTHS=48,96,192,288 bash bench/ladder_design_call.sh
set -u
END=${END:-570}
left() { echo $(( END - SECONDS > 5 ? END - SECONDS : 5 )); }
export PYTHONUNBUFFERED=1 TORCHINDUCTOR_CACHE_DIR=/tmp/inductor TRITON_CACHE_DIR=/tmp/triton
if compgen -G ".whl/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site || exit 1
fi
mkdir -p "$OUT"
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv; python3 -c "import torch,sys;print(torch.__version__, sys.version)"; date -u; } > "$OUT/env.txt" 2>&1
B="python3 bench/ladder_accuracy.py"; W=/tmp/w2; D=/tmp/d
rm -rf "$W"; mkdir -p "$W"
python3 "$REFERENCE" > "$OUT/reference.txt" 2>&1 &
REF=$!
[ -f $D/meta.json ] || timeout 150 $B corpus --data $D --max-mb 900 > $W/corpus.txt 2>&1
wait $REF
echo "corpus and reference done at ${SECONDS} s" >> "$OUT/env.txt"
timeout $(( $(left) - 250 )) $B ladder --data $D --work $W --jobs 8 --budgets-by "${BUDGETS_BY:-flops}" \
  --widths "${WIDTHS:-48,96,192,288}" > $W/ladder.txt 2>&1
echo "ladder done at ${SECONDS} s" >> "$OUT/env.txt"
timeout $(( $(left) - 10 )) python3 bench/ladder_concurrency.py --data $D --work $W/concurrency --widths 96,288 \
  --jobs 1,8 --steps 400 > "$OUT/concurrency.md" 2>&1
echo "concurrency done at ${SECONDS} s" >> "$OUT/env.txt"
cp $D/meta.json "$OUT/corpus-meta.json"
tar czf "$OUT/ladder-design.tgz" --exclude='*.safetensors' --exclude='*.pt' --exclude=mlruns --exclude='ckpt' -C $W .
tail -8 "$OUT/concurrency.md"; cat "$OUT/env.txt"
