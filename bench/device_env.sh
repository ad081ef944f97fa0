# Sourced by the device-call scripts (bench/ladder_device_call.sh, bench/ladder_design_call.sh): the
# deadline helper, the caches, the wheels the GPU machine lacks (.whl/), $OUT and its env.txt.
# Every step has a deadline inside the call's 10 minutes (END, seconds from the start), so whatever
# finished comes back.
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

# The plain reference (its tokens/s beside the call's figures) while the real-text corpus is built
# into $1 (skipped where it is there; CORPUS_MB caps it, default 900), the work folder $2 made empty.
corpus_and_reference() {
  rm -rf "$2"; mkdir -p "$2"
  python3 "$REFERENCE" > "$OUT/reference.txt" 2>&1 &
  local ref=$!
  [ -f "$1/meta.json" ] || timeout 150 python3 bench/ladder_accuracy.py corpus --data "$1" --max-mb "${CORPUS_MB:-900}" > "$2/corpus.txt" 2>&1
  wait $ref
  echo "corpus and reference done at ${SECONDS} s" >> "$OUT/env.txt"
}
