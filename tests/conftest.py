"""Shared fixtures: the repo's paths, a CLI runner, free ports, and one tiny tokenized corpus per
test session (built from the Python standard library's docstrings, no download)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[1]
CONFIGS = REPO / "configs"
TINY_CONFIG = CONFIGS / "tiny-cpu.yaml"


def wait_for(predicate: Callable[[], Any], timeout: float, what: str = "a condition", interval: float = 0.2,
             tolerate: tuple[type[Exception], ...] = ()) -> Any:
    """Poll `predicate` until it returns something truthy and return that; fail the test after
    `timeout` seconds. `tolerate`: exceptions that mean "not yet" (a file another process has not
    written yet)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            value = predicate()
        except tolerate:
            value = None
        if value:
            return value
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout:g} s waiting for {what}")
        time.sleep(interval)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def sigint_as_in_a_terminal() -> None:
    """A child's `preexec_fn`: SIGINT's default restored, as a terminal's foreground job has it. A
    suite started in the background by a non-interactive shell (`bash .ci/run &`) hands its children
    SIGINT ignored, Python then keeps it ignored, and a test's Ctrl-C would never land."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


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


# ---- the trainer on the tiny config ---------------------------------------------------------

REFERENCE_STEPS = 40


def train_args(data: Path, ckpt: Path, mlflow_uri: str, *extra: str, total: int = REFERENCE_STEPS) -> list[str]:
    """The lab's command line for the tiny CPU config, writing under `ckpt`."""
    return [
        "--config", str(TINY_CONFIG), "--data-dir", str(data), "--ckpt-dir", str(ckpt),
        "--mlflow-uri", mlflow_uri, "--total-steps", str(total), "--ckpt-every", "10", "--eval-every", "20",
        "--log-every", "5", "--metrics-port", "0", "--heartbeat-file", str(ckpt / "heartbeat.json"), *extra,
    ]


def start_trainer(args: list[str], log_path: Path, env: dict[str, str] | None = None) -> subprocess.Popen:
    log = open(log_path, "ab")
    return subprocess.Popen([sys.executable, "-m", "x1_pretrain.train", *args], stdout=log, stderr=subprocess.STDOUT,
                            env=env or cli_env(), cwd=REPO, start_new_session=True)


@pytest.fixture(scope="session")
def reference_run(tmp_path_factory: pytest.TempPathFactory, tiny_data: Path) -> Path:
    """An uninterrupted tiny run of REFERENCE_STEPS steps; returns its checkpoint dir."""
    root = tmp_path_factory.mktemp("reference")
    ckpt = root / "ckpt"
    proc = run_module("x1_pretrain.train", *train_args(tiny_data, ckpt, f"file://{root}/mlruns"), timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (ckpt / "final.safetensors").is_file()
    return ckpt


# The tests that build and run containers on a real Docker Engine. `make test` runs the suite on two
# processes, a test file at a time each (pytest-xdist --dist loadfile: a file's module-scoped
# servers start once and its tests keep their order); there these files go first, so that their
# minutes overlap the rest of the suite. In one process they go last: every other test's result is
# in before their minutes start.
DOCKER_ENGINE_TESTS = ("test_docker_compose.py", "test_docker_watchdog.py", "test_launch.py", "test_multinode.py")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    parallel = "PYTEST_XDIST_WORKER" in os.environ  # collection runs in each xdist worker
    items.sort(key=lambda item: (item.path.name in DOCKER_ENGINE_TESTS) != parallel)  # stable within each group


def pytest_report_header(config: pytest.Config) -> str | None:
    """The Docker Engine and Compose the Docker tests run against, when there are any."""
    import shutil

    if shutil.which("docker") is None:
        return "docker: no client on PATH"
    fmt = "Engine {{.Server.Version}} (API {{.Server.APIVersion}}, minimum {{.Server.MinAPIVersion}})"
    try:
        engine = subprocess.run(["docker", "version", "--format", fmt], capture_output=True, text=True, timeout=30)
        compose = subprocess.run(["docker", "compose", "version", "--short"], capture_output=True, text=True,
                                 timeout=30)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"docker: {e}"
    if engine.returncode != 0:
        return "docker: no engine reachable"
    return f"docker: {engine.stdout.strip()}, Compose {compose.stdout.strip() or 'none'}"


_docker_seconds: list[float] = []


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if Path(report.fspath).name.startswith("test_docker_"):
        _docker_seconds.append(report.duration)  # setup, call and teardown: builds and stacks included


def pytest_terminal_summary(terminalreporter, exitstatus: int, config: pytest.Config) -> None:
    if _docker_seconds:
        terminalreporter.write_line(f"docker tests (tests/test_docker_*.py): {sum(_docker_seconds):.0f} s wall time")
