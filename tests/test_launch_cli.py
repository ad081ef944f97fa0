"""`x1` refusing before anything is rented: a price over the ceiling, a wrong API key, bad input;
and the pre-launch sentence made of plan's numbers for the .env's steps.

Against the fake provider API as a real process (budget_sidecar.fake_billing on 127.0.0.1); the
whole path with SSH and containers is tests/test_launch.py.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from budget_sidecar.testing import FakeBilling
from conftest import REPO

X1 = str(Path(sys.executable).parent / "x1")
KEY = "cli-test-key-4f1c9a7e"


@pytest.fixture()
def ssh_key(tmp_path: Path) -> Path:
    if shutil.which("ssh-keygen") is None:
        if os.environ.get("CI") == "true":
            pytest.fail("CI=true and no ssh-keygen: .ci/docker-setup installs openssh-client", pytrace=False)
        pytest.skip("no ssh-keygen (Debian's openssh-client)")
    key = tmp_path / "id_ed25519"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(key)], check=True)
    return key


@pytest.fixture(params=["lambda", "runpod"])
def fake(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[FakeBilling]:
    f = FakeBilling.start(tmp_path / "fake", provider=request.param, instance_id="existing-1", api_key=KEY,
                          price_usd_per_hr=1.10)
    f.provider = request.param  # type: ignore[attr-defined]
    try:
        yield f
    finally:
        f.stop()


def x1(*args: str, key: str | None, provider: str, state: Path) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("LAMBDA_API_KEY", "RUNPOD_API_KEY")}
    env["X1_STATE_DIR"] = str(state)
    if key is not None:
        env[f"{provider.upper()}_API_KEY"] = key
    return subprocess.run([X1, *args], capture_output=True, text=True, timeout=120, env=env, stdin=subprocess.DEVNULL)


@pytest.fixture()
def env_file(tmp_path: Path) -> Path:
    path = tmp_path / "run.env"
    path.write_text("TOTAL_STEPS=2000\n")  # a run the trainer accepts under the $35 cap
    return path


def launch_args(fake: FakeBilling, ssh_key: Path, env_file: Path, *extra: str) -> list[str]:
    return ["launch", "--provider", fake.provider, "--api-url", fake.url, "--ssh-key", str(ssh_key),
            "--ssh-key-name", "laptop", "--env-file", str(env_file), "--yes", *extra]


def test_price_over_the_ceiling_is_refused_and_nothing_is_launched(fake, ssh_key, env_file, tmp_path):
    fake.control(price_usd_per_hr=2.50)
    proc = x1(*launch_args(fake, ssh_key, env_file, "--max-price-usd-per-hr", "1.40"), key=KEY, provider=fake.provider,
              state=tmp_path / "state")
    assert proc.returncode == 78, proc.stdout + proc.stderr
    # RunPod: the interruptible market, as plan plans it: the community spot price, the fake's own.
    assert "$2.50/h is over the max $1.40/h" in proc.stdout
    assert "nothing was rented" in proc.stdout
    state = fake.state()
    assert state["launch_calls"] == [] and state.get("create_calls", []) == []
    assert list(state["instances"]) == ["existing-1"]
    assert not (tmp_path / "state" / "instances").exists()


@pytest.mark.parametrize("budget", ["35", "20"])
def test_the_pre_launch_sentence_is_plans_numbers_for_the_envs_steps(fake, ssh_key, tmp_path, budget):
    """`x1 plan --write-env` then `x1 launch`: the launch prices the .env's TOTAL_STEPS at plan's
    speed for the GPU it rents, so its hours and dollars are the plan's, whatever binds."""
    env_file = tmp_path / ".env"
    shutil.copy(REPO / ".env.example", env_file)
    gpu = "a100-40gb" if fake.provider == "lambda" else "a100-80gb"  # what each rents (its type's own memory)
    market = [] if fake.provider == "lambda" else ["--market", "interruptible"]
    plan = subprocess.run([X1, "plan", "--config", "configs/x1-50m-a100.yaml", "--gpu", gpu, "--provider",
                           fake.provider, *market, "--price-usd-per-hr", "1.10", "--budget-usd", budget,
                           "--write-env", str(env_file), "--json"], capture_output=True, text=True, cwd=REPO,
                          timeout=120)
    assert plan.returncode == 0, plan.stderr
    planned = json.loads(plan.stdout)
    if float(budget) < 30:  # the alert line must stay under the cap (the trainer refuses it otherwise)
        env_file.write_text(env_file.read_text().replace("BUDGET_ALERT_USD=30", "BUDGET_ALERT_USD=15"))
    args = [a for a in launch_args(fake, ssh_key, env_file) if a != "--yes"]
    proc = x1(*args, key=KEY, provider=fake.provider, state=tmp_path / "state")
    # No terminal to confirm on: refused after the sentence, before anything is rented.
    assert proc.returncode == 2 and "no terminal to ask for confirmation" in proc.stderr, proc.stdout + proc.stderr
    steps = planned["proposed_total_steps"]
    assert (f"run ~{planned['proposed_hours']:.1f} h including setup = ${planned['cost_usd']:.2f} "
            f"({steps:,} steps of .env's TOTAL_STEPS") in proc.stdout, proc.stdout
    assert f"Budget: ${budget}. Confirmed acceptable, ${float(budget) - planned['cost_usd']:.2f} buffer." in proc.stdout
    assert fake.state()["launch_calls"] == [] and fake.state().get("create_calls", []) == []


def test_a_wrong_api_key_is_a_clear_error_that_never_shows_the_key(fake, ssh_key, env_file, tmp_path):
    wrong = "wrong-key-SECRET-77aa19"
    proc = x1(*launch_args(fake, ssh_key, env_file), key=wrong, provider=fake.provider, state=tmp_path / "state")
    assert proc.returncode == 2, proc.stdout + proc.stderr
    var = f"{fake.provider.upper()}_API_KEY"
    assert f"refused the key in {var}" in proc.stderr
    assert wrong not in proc.stdout + proc.stderr
    assert fake.state()["auth_failures"] >= 1 and fake.state()["launch_calls"] == []
    # status and down on a recorded instance say the same, without the key
    state = tmp_path / "state"
    record = {"provider": fake.provider, "instance_id": "existing-1", "api_url": fake.url, "instance_type": "t",
              "region": None, "price_usd_per_hr": 1.1, "stack": "processes", "ssh_user": "root",
              "ssh_key": str(ssh_key), "remote_repo": "/workspace/x1", "workspace": "/workspace/ws"}
    (state / "instances").mkdir(parents=True)
    (state / "instances" / "existing-1.json").write_text(json.dumps(record))
    (state / "current").write_text("existing-1\n")
    for command in ("status", "down"):
        proc = x1(command, key=wrong, provider=fake.provider, state=state)
        assert proc.returncode == 2 and f"refused the key in {var}" in proc.stderr, proc.stderr
        assert wrong not in proc.stdout + proc.stderr
    assert fake.state()["terminate_calls"] == []


def test_a_missing_api_key_names_the_variable(ssh_key, env_file, tmp_path):
    proc = x1("launch", "--provider", "runpod", "--ssh-key", str(ssh_key), "--env-file", str(env_file), "--yes",
              key=None, provider="runpod", state=tmp_path / "state")
    assert proc.returncode == 2
    assert "RUNPOD_API_KEY is not set" in proc.stderr


def test_no_recorded_instance_is_a_usage_error(tmp_path):
    proc = x1("status", key=KEY, provider="lambda", state=tmp_path / "empty")
    assert proc.returncode == 2 and "no instance recorded" in proc.stderr and "x1 launch" in proc.stderr


def test_every_subcommand_has_help():
    for command in ("launch", "status", "logs", "fetch", "down"):
        proc = subprocess.run([X1, command, "--help"], capture_output=True, text=True, timeout=60)
        assert proc.returncode == 0 and f"usage: x1 {command}" in proc.stdout
