"""The watchdog against the provider's API, here the fake billing API as a real process:
--terminate-on-finish (the DoD's proof of termination) and provider mode (bring a preempted
instance back: RunPod podResume, Lambda relaunch of the same type, region, user-data and file
system)."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from test_watchdog import Workdir, read_jsonl, scrape, wait_until

from budget_sidecar.testing import FakeBilling
from conftest import REPO, cli_env, free_port

API_KEY = "fake-billing-key-5c1e7a"
KEY_ENV = {"lambda": "LAMBDA_API_KEY", "runpod": "RUNPOD_API_KEY"}
TERMINATED = {"lambda": "terminated", "runpod": "TERMINATED"}


@pytest.fixture
def fakes(tmp_path: Path) -> Iterator[Callable[..., FakeBilling]]:
    started: list[FakeBilling] = []

    def start(provider: str, instance_id: str, **kw: Any) -> FakeBilling:
        fake = FakeBilling.start(tmp_path / "fake", provider=provider, instance_id=instance_id, api_key=API_KEY, **kw)
        started.append(fake)
        return fake

    try:
        yield start
    finally:
        for fake in started:
            fake.stop()


@pytest.fixture
def wd(tmp_path: Path) -> Iterator[Workdir]:
    w = Workdir(tmp_path)
    try:
        yield w
    finally:
        w.cleanup()


def provider_env(provider: str) -> dict[str, str]:
    return cli_env(**{KEY_ENV[provider]: API_KEY})


def assert_no_key(*texts: str) -> None:
    for text in texts:
        assert API_KEY not in text


# --------------------------------------------------------------------------------------------
# --terminate-on-finish


@pytest.mark.parametrize("provider", ["lambda", "runpod"])
def test_terminate_on_finish_leaves_the_instance_terminated_and_writes_termination_json(
    wd: Workdir, fakes: Callable[..., FakeBilling], provider: str
):
    fake = fakes(provider, "inst-1")
    termination = wd.root / "logs" / "termination.json"
    rc = wd.run(["--steps", "1", "--step-seconds", "0.05"], "--terminate-on-finish", "--provider", provider,
                "--api-url", fake.url, "--instance-id", "inst-1", "--termination-file", str(termination),
                env=provider_env(provider))
    assert rc == 0, wd.log()

    state = fake.state()
    assert state["instances"]["inst-1"]["status"] == TERMINATED[provider]
    assert state["terminate_calls"] == ["inst-1"]
    record = json.loads(termination.read_text())
    assert record["provider"] == provider and record["instance_id"] == "inst-1" and record["exit_code"] == 0
    assert "data" in record["response"]
    assert record["instance_after"]["status"] == "terminated"
    assert wd.kinds() == ["start", "exit", "terminate"]
    assert wd.events[-1]["ok"] is True
    assert wd.state["final"]["terminated"] is True
    assert_no_key(termination.read_text(), wd.events_file.read_text(), wd.log(), wd.state_file.read_text())


@pytest.mark.parametrize(("code", "terminated"), [(77, True), (78, False)])
def test_budget_stop_terminates_but_a_refused_launch_does_not(
    wd: Workdir, fakes: Callable[..., FakeBilling], code: int, terminated: bool
):
    fake = fakes("runpod", "pod-1")
    rc = wd.run(["--steps", "0", "--exit-code", str(code)], "--terminate-on-finish", "--provider", "runpod",
                "--api-url", fake.url, "--instance-id", "pod-1", "--termination-file", str(wd.root / "t.json"),
                env=provider_env("runpod"))
    assert rc == code, wd.log()
    assert (fake.state()["terminate_calls"] == ["pod-1"]) is terminated
    assert (wd.root / "t.json").exists() is terminated


def test_failed_terminate_is_alerted_and_retried_by_a_restarted_watchdog(wd: Workdir, fakes: Callable[..., FakeBilling]):
    fake = fakes("lambda", "inst-1")
    fake.control(fail_mode="500")
    opts = ["--terminate-on-finish", "--provider", "lambda", "--api-url", fake.url, "--instance-id", "inst-1",
            "--termination-file", str(wd.root / "termination.json")]
    assert wd.run(["--steps", "0"], *opts, env=provider_env("lambda")) == 0, wd.log()
    assert wd.events[-1]["event"] == "terminate" and wd.events[-1]["ok"] is False
    assert "ALERT" in wd.log() and "still billing" in wd.log()
    assert not (wd.root / "termination.json").exists()

    fake.control(fail_mode="none")
    assert wd.run(["--steps", "0"], *opts, env=provider_env("lambda")) == 0, wd.log()
    assert fake.state()["instances"]["inst-1"]["status"] == "terminated"
    assert json.loads((wd.root / "termination.json").read_text())["instance_id"] == "inst-1"
    assert len(wd.starts) == 1  # the finished run was not relaunched to get there


# --------------------------------------------------------------------------------------------
# Provider mode


class Keeper:
    """`python -m x1_watchdog --mode provider` as a process, with its files."""

    def __init__(self, wd: Workdir, provider: str, fake: FakeBilling, instance_id: str, *opts: str,
                 port: int = 0) -> None:
        self.wd = wd
        self.log_path = wd.root / f"keeper-{len(wd.logs)}.log"
        wd.logs.append(self.log_path)
        args = [
            sys.executable, "-m", "x1_watchdog", "--mode", "provider", "--provider", provider, "--api-url", fake.url,
            "--instance-id", instance_id, "--poll-seconds", "0.2", "--backoff-base-seconds", "0.05",
            "--events-file", str(wd.events_file), "--state-file", str(wd.state_file), "--port", str(port), *opts,
        ]
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, env=provider_env(provider),
                                         cwd=REPO, start_new_session=True)
        wd.procs.append(self.proc)

    def events(self, kind: str) -> list[dict[str, Any]]:
        return [e for e in read_jsonl(self.wd.events_file) if e["event"] == kind]

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")


def test_provider_mode_resumes_a_preempted_runpod_pod_and_stops_when_it_is_terminated(
    wd: Workdir, fakes: Callable[..., FakeBilling]
):
    fake = fakes("runpod", "pod-1", boot_seconds=0.3)
    port = free_port()
    keeper = Keeper(wd, "runpod", fake, "pod-1", port=port)
    wait_until(lambda: keeper.events("start"), 30, "the pod seen running")

    fake.control(preempt=True)
    relaunch = wait_until(lambda: keeper.events("relaunch"), 30, "the pod brought back")[0]
    assert relaunch["ok"] is True and relaunch["reason"] == "instance-preempted" and relaunch["instance_id"] == "pod-1"
    back = wait_until(lambda: keeper.events("start")[1:], 30, "the pod running again")[0]
    assert back["downtime_seconds"] > 0 and back["restart"] == 1
    assert fake.state()["resume_calls"] == [{"pod_id": "pod-1", "gpu_count": 1}]
    metrics = scrape(port)
    assert metrics[("x1_watchdog_restarts_total", (("reason", "instance-preempted"),))] == 1
    assert metrics[("x1_watchdog_trainer_up", ())] == 1
    assert metrics[("x1_watchdog_downtime_seconds_total", ())] > 0

    fake.control(terminate=True)  # the run's own watchdog (or you) terminated it: done
    assert keeper.proc.wait(30) == 0, keeper.log()
    assert keeper.events("exit")[-1]["reason"] == "instance-terminated"
    assert len(fake.state()["resume_calls"]) == 1
    assert_no_key(keeper.log(), wd.events_file.read_text())

    again = Keeper(wd, "runpod", fake, "pod-1")  # a restarted keeper honours the end
    assert again.proc.wait(30) == 0
    assert "final decision" in again.log()


def test_provider_mode_relaunches_a_preempted_lambda_instance_and_follows_the_new_id(
    wd: Workdir, fakes: Callable[..., FakeBilling]
):
    fake = fakes("lambda", "inst-1", boot_seconds=0.3)
    user_data = wd.root / "cloud-init.yaml"
    user_data.write_text("#cloud-config\nruncmd:\n  - [sh, -c, 'cd /lambda/nfs/x1-fs/x1 && docker compose up -d']\n")
    opts = ["--user-data-file", str(user_data), "--file-system-name", "x1-fs", "--ssh-key-name", "me"]
    keeper = Keeper(wd, "lambda", fake, "inst-1", *opts)
    wait_until(lambda: keeper.events("start"), 30, "the instance seen running")

    fake.control(preempt=True)
    relaunch = wait_until(lambda: keeper.events("relaunch"), 30, "the relaunch")[0]
    launch = fake.state()["launch_calls"][0]
    new_id = launch["instance_id"]
    assert relaunch["ok"] is True and relaunch["instance_id"] == new_id and relaunch["previous_instance_id"] == "inst-1"
    assert launch["instance_type_name"] == "gpu_1x_a100_sxm4" and launch["region_name"] == "us-east-1"
    assert launch["file_system_names"] == ["x1-fs"] and launch["ssh_key_names"] == ["me"]
    assert launch["user_data"] == user_data.read_text()
    back = wait_until(lambda: keeper.events("start")[1:], 30, "the new instance running")[0]
    assert back["instance_id"] == new_id and back["downtime_seconds"] > 0
    assert wd.state["instance_id"] == new_id and wd.state["origin_instance_id"] == "inst-1"

    fake.control(terminate=True, instance_id=new_id)
    assert keeper.proc.wait(30) == 0, keeper.log()
    assert len(fake.state()["launch_calls"]) == 1


def test_provider_api_outage_is_not_mistaken_for_a_preemption(wd: Workdir, fakes: Callable[..., FakeBilling]):
    fake = fakes("runpod", "pod-1")
    keeper = Keeper(wd, "runpod", fake, "pod-1")
    wait_until(lambda: keeper.events("start"), 30, "the pod seen running")
    fake.control(fail_mode="garbage")
    wait_until(lambda: "poll 3 failed" in keeper.log(), 30, "three failed polls")
    assert "ALERT" in keeper.log()  # a person hears that preemptions go unseen
    assert keeper.proc.poll() is None
    assert keeper.events("exit") == [] and keeper.events("relaunch") == []
    fake.control(fail_mode="none", terminate=True)
    assert keeper.proc.wait(30) == 0, keeper.log()
    assert fake.state()["resume_calls"] == []


def test_provider_mode_gives_up_after_max_restarts(wd: Workdir, fakes: Callable[..., FakeBilling]):
    fake = fakes("runpod", "pod-1")
    keeper = Keeper(wd, "runpod", fake, "pod-1", "--max-restarts", "0")
    wait_until(lambda: keeper.events("start"), 30, "the pod seen running")
    fake.control(preempt=True)
    assert keeper.proc.wait(30) == 1, keeper.log()
    assert keeper.events("give_up")[0]["reason"] == "instance-preempted"
    assert fake.state()["resume_calls"] == []
    assert wd.state["final"]["reason"] == "given-up"
