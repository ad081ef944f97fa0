"""The lab's price rule as a command, against the fake billing API as a real process: 0 under the
max, 78 over it, and --wait re-checking until the price comes down."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from budget_sidecar.testing import FakeBilling, ManagedProcess, wait_until

KEY = "sk-price-3b7d1e"


@pytest.fixture(scope="module")
def lambda_fake(tmp_path_factory):
    fake = FakeBilling.start(tmp_path_factory.mktemp("lambda"), provider="lambda", instance_id="i-1", api_key=KEY)
    yield fake
    fake.stop()


@pytest.fixture(autouse=True)
def default_price(request):
    if "lambda_fake" in request.fixturenames:
        request.getfixturevalue("lambda_fake").control(price_usd_per_hr=1.10, fail_mode="none")


def price_cmd(*args: str, url: str, provider: str = "lambda") -> list[str]:
    return [sys.executable, "-m", "budget_sidecar.price", "--provider", provider, "--api-url", url, *args]


def run(cmd: list[str], **env: str) -> subprocess.CompletedProcess[str]:
    full = {**os.environ, "LAMBDA_API_KEY": KEY, "RUNPOD_API_KEY": KEY, **env}
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=full)


def test_a_price_under_the_max_exits_0(lambda_fake: FakeBilling) -> None:
    proc = run(price_cmd("--instance-type", "gpu_1x_a100_sxm4", "--max-price-usd-per-hr", "1.40", url=lambda_fake.url))
    assert proc.returncode == 0, proc.stderr
    assert "$1.10/h" in proc.stdout and "launch" in proc.stdout


def test_the_flag_is_named_as_in_plan_and_train_and_the_old_spelling_still_works(lambda_fake: FakeBilling) -> None:
    lambda_fake.control(price_usd_per_hr=1.30)
    for flag in ("--max-price-usd-per-hr", "--max-usd-per-hr"):
        proc = run(price_cmd("--instance-type", "gpu_1x_a100_sxm4", flag, "1.20", url=lambda_fake.url))
        assert proc.returncode == 78 and "over the max $1.20/h" in proc.stdout, (flag, proc.stdout + proc.stderr)
    assert "--max-price-usd-per-hr" in run(price_cmd("--help", url=lambda_fake.url)).stdout
    assert "--max-usd-per-hr" not in run(price_cmd("--help", url=lambda_fake.url)).stdout


def test_a_price_over_the_max_exits_78(lambda_fake: FakeBilling) -> None:
    lambda_fake.control(price_usd_per_hr=3.3)
    proc = run(price_cmd("--instance-type", "gpu_1x_a100_sxm4", "--max-price-usd-per-hr", "1.40", url=lambda_fake.url))
    assert proc.returncode == 78
    assert "$3.30/h is over the max $1.40/h" in proc.stdout and "RunPod community" in proc.stdout


def test_wait_rechecks_until_the_price_comes_down(lambda_fake: FakeBilling, tmp_path: Path) -> None:
    lambda_fake.control(price_usd_per_hr=3.3)
    every_h = 0.5 / 3600  # re-check every half second
    p = ManagedProcess(price_cmd("--instance-type", "gpu_1x_a100_sxm4", "--wait", "--every-hours", str(every_h),
                                 url=lambda_fake.url),
                       tmp_path / "price.log", env={**os.environ, "LAMBDA_API_KEY": KEY, "PYTHONUNBUFFERED": "1"})
    try:
        wait_until(lambda: p.log_text().count("over the max") >= 2, 60, what="two refused checks")
        assert p.alive()
        lambda_fake.control(price_usd_per_hr=1.20)
        wait_until(lambda: not p.alive(), 60, what="the command to exit")
        assert p.proc.returncode == 0
        assert "$1.20/h is within the max" in p.log_text()
    finally:
        p.stop()


def test_wait_gives_up_after_max_wait_hours(lambda_fake: FakeBilling) -> None:
    lambda_fake.control(price_usd_per_hr=3.3)
    t0 = time.monotonic()
    proc = run(price_cmd("--instance-type", "gpu_1x_a100_sxm4", "--wait", "--every-hours", str(0.3 / 3600),
                         "--max-wait-hours", str(1.0 / 3600), url=lambda_fake.url))
    assert proc.returncode == 78 and proc.stdout.count("over the max") >= 2
    assert time.monotonic() - t0 < 60


def test_an_api_that_cannot_answer_refuses_the_launch(lambda_fake: FakeBilling) -> None:
    lambda_fake.control(fail_mode="500")
    proc = run(price_cmd("--instance-type", "gpu_1x_a100_sxm4", url=lambda_fake.url))
    assert proc.returncode == 78 and "cannot read the price" in proc.stdout
    assert KEY not in proc.stdout + proc.stderr


def test_runpod_reads_the_gpu_type_price(tmp_path: Path) -> None:
    fake = FakeBilling.start(tmp_path, provider="runpod", instance_id="pod-1", api_key=KEY, price_usd_per_hr=0.79)
    try:
        ok = run(price_cmd("--instance-type", "NVIDIA A100 80GB PCIe", url=fake.url, provider="runpod"))
        assert ok.returncode == 0 and "$0.79/h" in ok.stdout
        secure = run(price_cmd("--instance-type", "NVIDIA A100 80GB PCIe", "--market", "secure", "--max-usd-per-hr",
                               "1.0", url=fake.url, provider="runpod"))
        assert secure.returncode == 78  # 0.79 x 1.7 on secure cloud
    finally:
        fake.stop()


@pytest.mark.parametrize("args, env, named", [
    (["--instance-type", "gpu_9x_nothing"], {}, "gpu_9x_nothing"),
    (["--instance-type", "gpu_1x_a100_sxm4"], {"LAMBDA_API_KEY": ""}, "LAMBDA_API_KEY"),
    (["--instance-type", "gpu_1x_a100_sxm4", "--max-price-usd-per-hr", "-1"], {}, "--max-price-usd-per-hr"),
])
def test_usage_errors_exit_2_naming_the_problem(lambda_fake: FakeBilling, args, env, named) -> None:
    proc = run(price_cmd(*args, url=lambda_fake.url), **env)
    assert proc.returncode == 2 and named in proc.stderr


def test_the_fallback_the_refusal_prints_runs_as_shown(lambda_fake: FakeBilling, tmp_path: Path) -> None:
    import shlex

    lambda_fake.control(price_usd_per_hr=3.3)
    refused = run(price_cmd("--instance-type", "gpu_1x_a100_sxm4", "--max-usd-per-hr", "1.40", url=lambda_fake.url))
    assert refused.returncode == 78
    hint = refused.stdout.split("RunPod community (RUNPOD_API_KEY): ", 1)[1].splitlines()[0]
    argv = shlex.split(hint)
    assert argv[:3] == ["python", "-m", "budget_sidecar.price"] and "--instance-type" in argv
    runpod = FakeBilling.start(tmp_path / "runpod", provider="runpod", instance_id="pod-1", api_key=KEY)
    try:
        proc = run([sys.executable, *argv[1:], "--api-url", runpod.url])
        # Accepted as shown: a verdict on the community price (0 or 78), not a usage error (2).
        assert proc.returncode in (0, 78), proc.stdout + proc.stderr
        assert "runpod NVIDIA A100 80GB PCIe: price $" in proc.stdout and "launch" in proc.stdout
        listed = run([sys.executable, "-m", "budget_sidecar.price", "--provider", "runpod", "--market", "community",
                      "--list", "--api-url", runpod.url])
        assert listed.returncode == 0 and "runpod (community) NVIDIA A100 80GB PCIe: $" in listed.stdout, listed.stderr
    finally:
        runpod.stop()
    missing = run([sys.executable, "-m", "budget_sidecar.price", "--provider", "runpod", "--api-url", runpod.url])
    assert missing.returncode == 2 and "--instance-type is required (or --list" in missing.stderr
