#!/usr/bin/env bash
# The GPU benchmarks' data: GPT-2 tokens of ~40 MB of Python source (the standard library and the
# site-packages of this project's venv, files of 4 KB or more, no tests), as docs/PERFORMANCE.md
# describes. Throughput does not depend on the text.
#   [DATA_MB=40] bash bench/device_data.sh [OUT_DIR=.device/data]
set -euo pipefail
OUT=${1:-.device/data}
PY=${PY:-.venv/bin/python}
SRC=$(mktemp -d)
trap 'rm -rf "$SRC"' EXIT
"$PY" - "$SRC" "${DATA_MB:-40}" <<'PY'
import shutil, sys, sysconfig
from pathlib import Path
dst, budget = Path(sys.argv[1]), int(sys.argv[2]) * 2**20
roots = [Path(sysconfig.get_paths()["stdlib"]), Path(sysconfig.get_paths()["purelib"])]
files = sorted(p for r in roots for p in r.rglob("*.py")
               if "test" not in str(p.relative_to(r)).lower() and p.stat().st_size >= 4096)
total = 0
for i, p in enumerate(files):
    if total >= budget:
        break
    shutil.copyfile(p, dst / f"{i:06d}.txt")
    total += p.stat().st_size
print(f"{i} files, {total / 2**20:.1f} MB")
PY
rm -rf "$OUT"
PYTHONPATH="$PWD:$PWD/trainer" "$PY" -m x1_pretrain.tokenize_data --input-dir "$SRC" --output-dir "$OUT" --val-fraction 0.005
