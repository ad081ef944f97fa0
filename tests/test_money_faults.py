"""Money never leaks: `x1 launch`, `x1 status` and `x1 down` against the fake provider made to
misbehave as real APIs do (answers lost, late, proxied or cut short after the instance was created;
signals mid-create; terminates answered "ok" that leave the instance running; 404 pages that are
not the API's), on both providers. Each test ends by asking the fake for every instance it holds:
none may bill without a record here that says so (tests/money.py).

The fake provider is one real process per provider for the module, emptied before each test
({"reset": true}). `x1` runs in this process (its `main`, with its own environment, output and
exit code) except where a signal is sent: there it is a real process and the signals are real.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from unittest import mock

import httpx
import pytest
from money import assert_fake_holds_nothing_unrecorded

from budget_sidecar.testing import FakeBilling, wait_until
from conftest import REPO
from x1_common.providers import make_client
from x1_launch.cli import main as x1_main

X1 = str(Path(sys.executable).parent / "x1")
KEY = "money-test-key-81c3f0aa"
PROVIDERS = ("lambda", "runpod")
TERMINATED = {"lambda": "terminated", "runpod": "TERMINATED"}
RUNNING = {"lambda": "active", "runpod": "RUNNING"}
# A run the trainer accepts at $1.10/h under the $35 cap (2,000 steps of the 50M config: ~1.8 h).
FITTING_ENV = "TOTAL_STEPS=2000\nBUDGET_CAP_USD=35\nMAX_PRICE_USD_PER_HR=1.40\n"
# The same, with a ceiling over RunPod's on-demand price ($1.54/h in the fake).
FITTING_ON_DEMAND_ENV = "TOTAL_STEPS=2000\nBUDGET_CAP_USD=35\nMAX_PRICE_USD_PER_HR=2\n"


@pytest.fixture(scope="module")
def fakes(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, FakeBilling]]:
    root = tmp_path_factory.mktemp("money-fakes")
    started = {p: FakeBilling.start(root, provider=p, instance_id="seed", api_key=KEY, price_usd_per_hr=1.10,
                                    boot_seconds=0.0) for p in PROVIDERS}
    try:
        yield started
    finally:
        for f in started.values():
            f.stop()


@pytest.fixture(params=PROVIDERS)
def fake(request: pytest.FixtureRequest, fakes: dict[str, FakeBilling]) -> FakeBilling:
    f = fakes[request.param]
    f.control(reset=True)
    f.provider = request.param  # type: ignore[attr-defined]
    return f


@pytest.fixture(scope="module")
def ssh_key(tmp_path_factory: pytest.TempPathFactory) -> Path:
    if shutil.which("ssh-keygen") is None:
        if os.environ.get("CI") == "true":
            pytest.fail("CI=true and no ssh-keygen: .ci/docker-setup installs openssh-client", pytrace=False)
        pytest.skip("no ssh-keygen (Debian's openssh-client)")
    key = tmp_path_factory.mktemp("money-ssh") / "id_ed25519"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(key)], check=True)
    return key


def env_for(provider: str, state: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("LAMBDA_API_KEY", "RUNPOD_API_KEY")}
    return {**env, "X1_STATE_DIR": str(state), f"{provider.upper()}_API_KEY": KEY, "PYTHONUNBUFFERED": "1"}


def quick_client(*args: Any, **kw: Any) -> Any:
    """The real client, without Lambda's 1 request/s spacing and with short backoffs (tests only)."""
    return make_client(*args, **kw, min_interval_s=0.0, backoff_s=0.2)


def x1(fake: FakeBilling, state: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """`x1 ARGS` as the command line runs it: its environment (the key, the state folder), its
    output and its exit code."""
    out, err = io.StringIO(), io.StringIO()
    saved = dict(os.environ)
    os.environ.clear()
    os.environ.update(env_for(fake.provider, state))
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err), \
                mock.patch("x1_launch.cli.make_client", quick_client):
            try:
                code = x1_main(list(args))
            except SystemExit as e:  # argparse
                code = e.code if isinstance(e.code, int) else 2
    finally:
        os.environ.clear()
        os.environ.update(saved)
    return subprocess.CompletedProcess([X1, *args], code, out.getvalue(), err.getvalue())


def launch_args(fake: FakeBilling, ssh_key: Path, env_file: Path, *extra: str) -> list[str]:
    # --boot-timeout 0.5: the launch ends right after the create (no SSH server behind the fake);
    # what these tests judge is the create and its record.
    return ["launch", "--provider", fake.provider, "--api-url", fake.url, "--ssh-key", str(ssh_key),
            "--ssh-key-name", "laptop", "--env-file", str(env_file), "--yes", "--http-timeout", "1",
            "--boot-timeout", "0.5", "--create-settle-seconds", "3", *extra]


def fitting_env(tmp_path: Path) -> Path:
    path = tmp_path / "run.env"
    path.write_text(FITTING_ENV)
    return path


def records(state: Path) -> list[dict[str, Any]]:
    folder = state / "instances"
    return [json.loads(p.read_text()) for p in sorted(folder.glob("*.json"))] if folder.is_dir() else []


def created(fake: FakeBilling) -> list[str]:
    """The ids of the instances the fake's create calls made (Lambda launch, RunPod deploy)."""
    st = fake.state()
    return [c["instance_id"] for c in st["launch_calls"] + st["create_calls"]]


def record_of(fake: FakeBilling, state: Path, instance_id: str = "seed") -> None:
    """A record as `x1 launch` leaves it, for an instance the fake holds (it was launched earlier)."""
    rec = {"provider": fake.provider, "instance_id": instance_id, "api_url": fake.url, "instance_type": "t",
           "region": None, "price_usd_per_hr": 1.1, "stack": "processes", "ssh_user": "root", "ssh_key": "k",
           "remote_repo": "/workspace/x1", "workspace": "/workspace/ws", "stage": "ssh", "name": "x1-20260101-000000",
           "phase": "created", "launched_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(time.time() - 3600))}
    (state / "instances").mkdir(parents=True, exist_ok=True)
    (state / "instances" / f"{instance_id}.json").write_text(json.dumps(rec))
    (state / "current").write_text(instance_id + "\n")


def seed(fake: FakeBilling) -> None:
    """One running instance, as an earlier launch left it."""
    fake.control(reset=True)
    st = fake.state()
    assert st["instances"] == {}
    # The fake's starting instance is gone after a reset: make one through the API as x1 would.
    if fake.provider == "lambda":
        r = httpx.post(f"{fake.url}/api/v1/instance-operations/launch", headers={"Authorization": f"Bearer {KEY}"},
                       json={"region_name": "us-east-1", "instance_type_name": "gpu_1x_a100_sxm4", "name": "x1-seed"})
    else:
        r = httpx.post(f"{fake.url}/graphql", headers={"Authorization": f"Bearer {KEY}"}, json={
            "query": "mutation D($input: PodFindAndDeployOnDemandInput!) { podFindAndDeployOnDemand(input: $input) { id } }",
            "variables": {"input": {"gpuTypeId": "NVIDIA A100 80GB PCIe", "imageName": "i", "name": "x1-seed",
                                    "cloudType": "COMMUNITY"}}})
    assert r.status_code == 200, r.text


def the_only_instance(fake: FakeBilling) -> str:
    ids = list(fake.state()["instances"])
    assert len(ids) == 1, ids
    return ids[0]


# --------------------------------------------------------------------------------------------
# On record before it exists


@pytest.mark.parametrize("mode", ["timeout", "500", "502-html", "garbage", "close"])
def test_a_lost_create_answer_is_found_by_name_and_recorded(fake, ssh_key, tmp_path, mode):
    state = tmp_path / "state"
    fake.control(fault={"mode": mode, "on": "create", "when": "after", "count": 1, "hold_s": 2})
    proc = x1(fake, state, *launch_args(fake, ssh_key, fitting_env(tmp_path)))
    out = proc.stdout + proc.stderr
    [made] = created(fake)  # the create happened, its answer was lost
    assert fake.state()["faults_hit"] == [{"op": "create", "mode": mode, "when": "after"}]
    display = "Lambda" if fake.provider == "lambda" else "RunPod"
    assert "the create's answer was lost" in out and f"found it: {display} lists {made}" in out, out
    assert "nothing was rented" not in out and "nothing appears to be rented" not in out
    [rec] = records(state)
    assert rec["instance_id"] == made and rec["phase"] == "created" and rec["name"].startswith("x1-")
    assert rec["observed"]["how"].startswith("listed under its name")
    assert "still running and billing" in out and made in out  # the boot never came: it says what bills
    assert_fake_holds_nothing_unrecorded(fake, state)


def test_a_create_the_provider_never_made_is_not_created_after_the_settle_time(fake, ssh_key, tmp_path):
    state = tmp_path / "state"
    fake.control(fault={"mode": "502-html", "on": "create", "when": "before", "count": 1})
    proc = x1(fake, state, *launch_args(fake, ssh_key, fitting_env(tmp_path)))
    assert proc.returncode == 1 and created(fake) == []
    assert "the create's answer was lost" in proc.stderr and "nothing appears to be rented" in proc.stderr
    assert f"x1 status --provider {fake.provider}" in proc.stderr
    [rec] = records(state)
    assert rec["phase"] == "not-created" and rec["instance_id"] == ""
    assert_fake_holds_nothing_unrecorded(fake, state)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP, signal.SIGKILL], ids=lambda s: s.name)
def test_a_signal_during_the_create_then_x1_down_ends_the_instance(fake, ssh_key, tmp_path, sig):
    state = tmp_path / "state"
    # The create answers 2 s late: the signal comes while x1 waits for it.
    fake.control(fault={"mode": "slow", "on": "create", "when": "after", "count": 1, "hold_s": 2})
    args = launch_args(fake, ssh_key, fitting_env(tmp_path))
    args[args.index("--http-timeout") + 1] = "10"
    proc = subprocess.Popen([X1, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            stdin=subprocess.DEVNULL, env=env_for(fake.provider, state))
    wait_until(lambda: created(fake), 60, what="the create call")
    [pending] = records(state)  # on disk before the create call
    assert pending["phase"] == "creating" and pending["instance_id"] == "" and pending["name"].startswith("x1-")
    proc.send_signal(sig)
    out, err = proc.communicate(timeout=60)
    [made] = created(fake)
    if sig == signal.SIGKILL:
        assert proc.returncode == -signal.SIGKILL
        assert [r["phase"] for r in records(state)] == ["creating"]  # all a killed launch leaves: its record
    else:
        assert proc.returncode == 128 + sig, out + err
        assert f"interrupted ({sig.name})" in err and made in err and "x1 down --no-fetch --instance" in err
        [rec] = records(state)
        assert rec["instance_id"] == made and rec["phase"] == "created"
    assert_fake_holds_nothing_unrecorded(fake, state)
    down = x1(fake, state, "down", "--http-timeout", "2", "--confirm-timeout", "10")
    assert down.returncode == 0, down.stdout + down.stderr
    if sig == signal.SIGKILL:
        assert f"found {pending['name']}" in down.stdout
    assert fake.state()["instances"][made]["status"] == TERMINATED[fake.provider]
    [rec] = records(state)
    assert rec["instance_id"] == made and rec["phase"] == "terminated"
    assert_fake_holds_nothing_unrecorded(fake, state)


# --------------------------------------------------------------------------------------------
# "Terminated" is the provider's state


def test_a_terminate_answered_ok_that_leaves_the_instance_running_is_still_billing(fake, tmp_path):
    state = tmp_path / "state"
    seed(fake)
    iid = the_only_instance(fake)
    record_of(fake, state, iid)
    fake.control(terminate_effect={"mode": "ignore"})
    down = x1(fake, state, "down", "--http-timeout", "2", "--confirm-timeout", "1.5")
    assert down.returncode == 1, down.stdout + down.stderr
    assert fake.state()["terminate_calls"][:1] == [iid] and fake.state()["instances"][iid]["billing"]
    assert (f"but the provider lists it {RUNNING[fake.provider]}: instance {iid} is STILL BILLING (terminate sent, "
            f"still billing)") in down.stderr
    assert f"End it with: x1 down --no-fetch --instance {iid}" in down.stderr
    [rec] = records(state)
    assert rec["phase"] == "terminate-sent" and rec["observed"]["raw_status"] == RUNNING[fake.provider]
    assert_fake_holds_nothing_unrecorded(fake, state)
    status = x1(fake, state, "status", "--http-timeout", "2")
    assert "terminate sent, still billing" in status.stdout

    # The provider terminates asynchronously: it is terminated once it shows so, not before.
    fake.control(terminate_effect={"mode": "async", "delay_s": 1})
    down = x1(fake, state, "down", "--http-timeout", "2", "--confirm-timeout", "20")
    assert down.returncode == 0, down.stdout + down.stderr
    assert f"instance {iid} terminated: the provider lists it {TERMINATED[fake.provider]}" in down.stdout
    [rec] = records(state)
    assert rec["phase"] == "terminated" and rec["observed"]["raw_status"] == TERMINATED[fake.provider]
    assert_fake_holds_nothing_unrecorded(fake, state)


def test_a_404_that_is_not_the_apis_is_never_gone(fake, tmp_path):
    state = tmp_path / "state"
    seed(fake)
    iid = the_only_instance(fake)
    record_of(fake, state, iid)
    fake.control(fault={"mode": "404-html", "on": "get"})
    down = x1(fake, state, "down", "--http-timeout", "2")
    assert down.returncode == 1, down.stdout + down.stderr
    assert f"instance {iid} could not be read" in down.stderr and "not the" in down.stderr
    assert "nothing was sent, and it may still bill" in down.stderr
    assert fake.state()["terminate_calls"] == []
    [rec] = records(state)
    assert rec["phase"] == "created" and rec["observed"]["status"] == "unread"
    assert_fake_holds_nothing_unrecorded(fake, state)

    # The API answers again: the instance is active, and `down` ends it.
    fake.control(fault=None)
    down = x1(fake, state, "down", "--http-timeout", "2", "--confirm-timeout", "10")
    assert down.returncode == 0 and fake.state()["instances"][iid]["status"] == TERMINATED[fake.provider]
    assert_fake_holds_nothing_unrecorded(fake, state)


def test_the_apis_own_not_found_after_the_terminate_is_gone(fake, tmp_path):
    state = tmp_path / "state"
    seed(fake)
    iid = the_only_instance(fake)
    record_of(fake, state, iid)
    fake.control(terminate_effect={"mode": "gone"})  # terminated, then forgotten (RunPod: a null pod)
    down = x1(fake, state, "down", "--http-timeout", "2", "--confirm-timeout", "10")
    assert down.returncode == 0, down.stdout + down.stderr
    assert "the provider no longer knows it (its own not-found answer)" in down.stdout
    assert fake.state()["instances"] == {} and records(state)[0]["phase"] == "terminated"
    assert_fake_holds_nothing_unrecorded(fake, state)


def test_a_recorded_end_the_provider_contradicts_is_reopened_and_ended(fake, tmp_path):
    state = tmp_path / "state"
    seed(fake)
    iid = the_only_instance(fake)
    record_of(fake, state, iid)
    rec = json.loads((state / "instances" / f"{iid}.json").read_text())
    (state / "instances" / f"{iid}.json").write_text(json.dumps({**rec, "phase": "terminated", "terminated": True}))
    status = x1(fake, state, "status", "--http-timeout", "2")
    assert f"{iid}: running ({RUNNING[fake.provider]})" in status.stdout  # asked, not trusted
    assert records(state)[0]["phase"] == "created"
    down = x1(fake, state, "down", "--http-timeout", "2", "--confirm-timeout", "10")
    assert down.returncode == 0 and fake.state()["instances"][iid]["status"] == TERMINATED[fake.provider]
    assert_fake_holds_nothing_unrecorded(fake, state)


# --------------------------------------------------------------------------------------------
# A second launch, and an instance with no record here


def test_a_second_launch_names_what_still_bills_counts_it_and_refuses(fake, ssh_key, tmp_path):
    state = tmp_path / "state"
    seed(fake)
    iid = the_only_instance(fake)
    record_of(fake, state, iid)
    proc = x1(fake, state, *launch_args(fake, ssh_key, fitting_env(tmp_path)))
    assert proc.returncode == 78, proc.stdout + proc.stderr
    assert f"Still billing: {'Lambda' if fake.provider == 'lambda' else 'RunPod'} instance {iid}" in proc.stdout
    assert "so far at $1.10/h" in proc.stdout and "more over these" in proc.stdout
    assert f"may still bill: {iid}" in proc.stdout and "--alongside-running" in proc.stdout
    assert "Refused while it bills (below)" in proc.stdout and "Confirmed acceptable" not in proc.stdout
    assert created(fake) == [iid]  # only the earlier one
    assert_fake_holds_nothing_unrecorded(fake, state)


def test_an_instance_with_no_record_here_is_listed_and_ended_by_provider(fake, tmp_path):
    state = tmp_path / "lost-state"  # another laptop, a lost folder: nothing recorded
    seed(fake)
    iid = the_only_instance(fake)
    listed = x1(fake, state, "status", "--provider", fake.provider, "--api-url", fake.url)
    assert listed.returncode == 1, listed.stdout + listed.stderr
    assert f"{iid}  x1-seed" in listed.stdout and "NO RECORD HERE" in listed.stdout
    assert f"x1 down --provider {fake.provider} --instance {iid}" in listed.stdout
    down = x1(fake, state, "down", "--provider", fake.provider, "--api-url", fake.url, "--instance", iid,
              "--http-timeout", "2", "--confirm-timeout", "10")
    assert down.returncode == 0, down.stdout + down.stderr
    assert fake.state()["instances"][iid]["status"] == TERMINATED[fake.provider]
    [rec] = records(state)
    assert rec["instance_id"] == iid and rec["phase"] == "terminated"
    assert_fake_holds_nothing_unrecorded(fake, state)


# --------------------------------------------------------------------------------------------
# One truth before the money: the trainer's own launch check, and the documented create


def test_the_unedited_env_example_is_refused_before_any_create(fake, ssh_key, tmp_path):
    state = tmp_path / "state"
    env_file = tmp_path / ".env"
    shutil.copy(REPO / ".env.example", env_file)  # TOTAL_STEPS=84000: the trainer refuses it (78)
    proc = x1(fake, state, *launch_args(fake, ssh_key, env_file))
    assert proc.returncode == 78, proc.stdout + proc.stderr
    assert "84,000 steps of .env's TOTAL_STEPS" in proc.stdout
    assert "Refused by the trainer's launch check: projected total $" in proc.stdout
    assert "The trainer on the instance would refuse this run (exit 78)" in proc.stdout
    assert "x1 plan --config configs/x1-50m-a100.yaml --gpu " in proc.stdout and f"--write-env {env_file}" in proc.stdout
    assert "Confirmed acceptable" not in proc.stdout
    st = fake.state()
    assert st["launch_calls"] == [] and st["create_calls"] == [] and records(state) == []
    assert_fake_holds_nothing_unrecorded(fake, state)


def test_launch_without_an_env_file_says_how_to_make_one(fake, ssh_key, tmp_path):
    args = launch_args(fake, ssh_key, tmp_path / "x")
    i = args.index("--env-file")
    proc = x1(fake, tmp_path / "state", *(args[:i] + args[i + 2:]))
    assert proc.returncode == 2
    assert "cp .env.example .env" in proc.stderr and "--write-env .env" in proc.stderr
    assert created(fake) == []
    assert_fake_holds_nothing_unrecorded(fake, tmp_path / "state")


def test_the_create_asks_for_the_planned_gpu_market_image_and_driver(fake, ssh_key, tmp_path):
    state = tmp_path / "state"
    proc = x1(fake, state, *launch_args(fake, ssh_key, fitting_env(tmp_path)))
    st = fake.state()
    if fake.provider == "lambda":
        [call] = st["launch_calls"]
        # Lambda's single A100 is its 40 GB card; the sentence names it in Lambda's own words.
        assert call["instance_type_name"] == "gpu_1x_a100_sxm4" and call["region_name"] == "us-east-1"
        assert "1× A100 (40 GB SXM4) [gpu_1x_a100_sxm4] on-demand on Lambda at $1.10/h" in proc.stdout
        assert "Lambda offers no single A100 80GB" in proc.stdout and "the 50M run fits in 40 GB" in proc.stdout
    else:
        [call] = st["create_calls"]
        # The market plan plans (interruptible), bid at the price read; a host whose driver runs CUDA 13.
        assert call["operation"] == "podRentInterruptable" and call["bidPerGpu"] == 1.10
        assert call["gpuTypeId"] == "NVIDIA A100 80GB PCIe" and call["cloudType"] == "COMMUNITY"
        assert call["imageName"] == "runpod/base:1.0.2-ubuntu2204" and call["minCudaVersion"] == "13.0"
        assert call["volumeMountPath"] == "/workspace" and call["env_keys"] == ["PUBLIC_KEY"]
        assert "1× A100 PCIe (80 GB) [NVIDIA A100 80GB PCIe] interruptible on RunPod at $1.10/h" in proc.stdout
    [rec] = records(state)
    assert rec["instance_id"] == call["instance_id"] and rec["phase"] == "created"
    assert_fake_holds_nothing_unrecorded(fake, state)


def test_runpod_on_demand_is_asked_for_by_name(fakes, ssh_key, tmp_path):
    fake = fakes["runpod"]
    fake.control(reset=True)
    fake.provider = "runpod"  # type: ignore[attr-defined]
    state = tmp_path / "state"
    env_file = tmp_path / "on-demand.env"
    env_file.write_text(FITTING_ON_DEMAND_ENV)
    proc = x1(fake, state, *launch_args(fake, ssh_key, env_file, "--market", "on-demand"))
    [call] = fake.state()["create_calls"]
    assert call["operation"] == "podFindAndDeployOnDemand" and "bidPerGpu" not in call
    assert "on-demand on RunPod at $1.54/h" in proc.stdout  # community on demand: 1.4x spot in the fake
    assert_fake_holds_nothing_unrecorded(fake, state)


def test_the_runpod_boot_script_makes_the_venv_on_the_volume_with_the_pinned_torch():
    from x1_launch.remote import Layout, boot_script

    script = boot_script(Layout("/workspace/x1", "/workspace/ws", "processes"))
    assert "python3 -m venv --system-site-packages /workspace/venv" in script
    assert "test -x /workspace/venv/bin/python ||" in script  # made once: a resume finds it
    assert "/workspace/venv/bin/python /workspace/x1/trainer/torch_pin.py --version 2.11.0 --cuda 13.0" in script
    assert "-m pip install -q torch==2.11.0" in script
    assert "/workspace/venv/bin/python -m x1_pretrain.stack up -d" in script
    assert " python3 -m pip install" not in script  # nothing onto the image's Python or its container disk
