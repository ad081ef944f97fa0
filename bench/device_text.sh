#!/usr/bin/env bash
# Real English text for the GPU loss checks (float8 parity): GPT-2 tokens of every docstring of
# the standard library and this project's venv (~60 MB of text, ~16M tokens), as FineWeb-Edu-schema
# parquet first (x1_pretrain.corpus installed-docstrings), then tokenized. No download.
#   bash bench/device_text.sh [OUT_DIR=.device/text]
set -euo pipefail
OUT=${1:-.device/text}
PY=${PY:-.venv/bin/python}
SRC=$(mktemp -d)
trap 'rm -rf "$SRC"' EXIT
export PYTHONPATH="$PWD:$PWD/trainer${PYTHONPATH:+:$PYTHONPATH}"
"$PY" -m x1_pretrain.corpus installed-docstrings --output "$SRC/corpus" --max-mb 400
rm -rf "$OUT"
"$PY" -m x1_pretrain.tokenize_data --input-dir "$SRC/corpus" --output-dir "$OUT" --tokenizer gpt2 --val-fraction 0.005 --seed 42
