"""Shared fixtures: the repo's paths, a CLI runner, free ports, and one tiny tokenized corpus per
test session (built from the Python standard library's docstrings, no download)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
CONFIGS = REPO / "configs"
TINY_CONFIG = CONFIGS / "tiny-cpu.yaml"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cli_env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env.setdefault("PYTHONUNBUFFERED", "1")
    env.update(extra)
    return env


def run_module(module: str, *args: str, timeout: float = 300, env: dict[str, str] | None = None,
               cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    """`python -m module args...` in a fresh process; returns the finished process (never raises on rc)."""
    return subprocess.run(
        [sys.executable, "-m", module, *args],
        capture_output=True, text=True, timeout=timeout, env=env or cli_env(), cwd=cwd or REPO,
    )


@pytest.fixture(scope="session")
def corpus_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """~2 MB of real English (stdlib docstrings) as FineWeb-Edu-schema parquet."""
    out = tmp_path_factory.mktemp("corpus")
    proc = run_module("x1_pretrain.corpus", "stdlib-docstrings", "--output", str(out), "--max-mb", "2")
    assert proc.returncode == 0, proc.stderr
    return out


@pytest.fixture(scope="session")
def tiny_data(tmp_path_factory: pytest.TempPathFactory, corpus_dir: Path) -> Path:
    """train.bin / val.bin / meta.json tokenized from `corpus_dir` (GPT-2 BPE)."""
    out = tmp_path_factory.mktemp("tokenized")
    proc = run_module(
        "x1_pretrain.tokenize_data", "--input-dir", str(corpus_dir), "--output-dir", str(out),
        "--tokenizer", "gpt2", "--val-fraction", "0.02", "--workers", "2", "--seed", "42",
    )
    assert proc.returncode == 0, proc.stderr
    return out
