"""The watchdog's Docker mode on the real Docker Engine: the trainer is a container (the stub
trainer, in the local Python base image) that the watchdog starts, watches and reads the output
of through the Engine API, as it does the compose stack's trainer. The start-up-failure rule
needs the container's own output, which only a real engine's log stream gives.

Where no engine is reachable these tests skip with the reason; under CI=true they fail instead:
.ci/run sets the engine up, so a skip there would hide a broken setup.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from compose_stack import PYTHON_IMAGE, require_engine, run

from conftest import REPO, cli_env
from receivers import WebhookReceiver

ADDMM = "addmm() got an unexpected keyword argument 'out_dtype' (tensor at {addr})"
ADDMM_LINE = r"TypeError: addmm\(\) got an unexpected keyword argument 'out_dtype' \(tensor at 0x[0-9a-f]+\)"


@pytest.fixture(scope="module")
def engine() -> None:
    require_engine("the Docker tests")


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


class TrainerContainer:
    """A created (not started) container running tests/stub_trainer.py with `stub_args`, its
    heartbeat and progress in a host folder, and the watchdog in docker mode pointed at it."""

    def __init__(self, root: Path, stub_args: list[str]) -> None:
        self.root = root
        self.name = f"x1t-watchdog-{uuid.uuid4().hex[:10]}"
        self.work = root / "work"
        self.work.mkdir()
        self.logs = root / "logs"
        # The compose trainer's command carries --resume-from-latest: so does this one.
        command = ["python", "/x1/stub_trainer.py", "--heartbeat-file", "/work/heartbeat.json",
                   "--progress-file", "/work/progress.json", "--starts-file", "/work/starts.jsonl",
                   "--resume-from-latest", *stub_args]
        run(["docker", "create", "--name", self.name, "--user", f"{os.getuid()}:{os.getgid()}",
             "-e", "PYTHONPATH=/x1", "-e", "PYTHONUNBUFFERED=1",
             "-v", f"{REPO / 'x1_common'}:/x1/x1_common:ro",
             "-v", f"{REPO / 'tests' / 'stub_trainer.py'}:/x1/stub_trainer.py:ro",
             "-v", f"{self.work}:/work", PYTHON_IMAGE, *command])

    def watchdog(self, *opts: str, env: dict[str, str] | None = None, timeout: float = 120) -> int:
        self.log_path = self.root / "watchdog.log"
        with open(self.log_path, "ab") as log:
            return subprocess.run(
                [sys.executable, "-m", "x1_watchdog", "--mode", "docker", "--container", self.name,
                 "--heartbeat-file", str(self.work / "heartbeat.json"),
                 "--events-file", str(self.logs / "watchdog-events.jsonl"),
                 "--state-file", str(self.logs / "watchdog-state.json"), "--port", "0", "--check-seconds", "0.2",
                 "--backoff-base-seconds", "0.2", *opts],
                stdout=log, stderr=subprocess.STDOUT, env=env or cli_env(), cwd=REPO, timeout=timeout,
            ).returncode

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    @property
    def events(self) -> list[dict[str, Any]]:
        return read_jsonl(self.logs / "watchdog-events.jsonl")

    @property
    def state(self) -> dict[str, Any]:
        return json.loads((self.logs / "watchdog-state.json").read_text())

    @property
    def starts(self) -> list[dict[str, Any]]:
        return [r for r in read_jsonl(self.work / "starts.jsonl") if "argv" in r]

    def inspect(self) -> dict[str, Any]:
        return json.loads(run(["docker", "inspect", self.name]).stdout)[0]["State"]

    def remove(self) -> None:
        run(["docker", "rm", "-f", self.name], check=False)


@pytest.fixture
def container(engine: None, tmp_path: Path) -> Iterator[Any]:
    made: list[TrainerContainer] = []

    def make(*stub_args: str) -> TrainerContainer:
        made.append(TrainerContainer(tmp_path, list(stub_args)))
        return made[-1]

    try:
        yield make
    finally:
        for c in made:
            c.remove()


@pytest.fixture
def slack() -> Iterator[WebhookReceiver]:
    receiver = WebhookReceiver(path="/services/T000/B000/secret-hook")
    try:
        yield receiver
    finally:
        receiver.close()


def test_same_startup_error_twice_in_a_container_stops_relaunching_with_exit_code_81(container, slack):
    trainer = container("--fail-at-startup", "--error", ADDMM)
    env = cli_env(SLACK_WEBHOOK_URL=slack.url)
    rc = trainer.watchdog("--max-restarts", "10", env=env)
    assert rc == 81, trainer.log()
    assert [e["event"] for e in trainer.events] == ["start", "exit", "relaunch", "start", "exit", "startup_failure"]
    assert len(trainer.starts) == 2 and trainer.inspect()["ExitCode"] == 1
    first, second = (e for e in trainer.events if e["event"] == "exit")
    # The error's line from the container's own log stream (the engine's), not the goodbye after it.
    for e in (first, second):
        assert re.fullmatch(ADDMM_LINE, e["error"]) and e["progress"] == "still at step 0", e
    final = trainer.state["final"]
    assert (final["exit_code"], final["reason"], final["error"]) == (81, "startup-failure", second["error"])
    assert len(slack.posts) == 1 and second["error"] in slack.posts[0]["text"]

    # A restarted watchdog (compose restarts it) honours the decision: no start, no second alert.
    assert trainer.watchdog(env=env) == 81
    assert len(trainer.starts) == 2 and len(slack.posts) == 1


def test_container_that_crashes_after_a_step_keeps_being_relaunched_until_max_restarts(container):
    trainer = container("--steps", "20", "--step-seconds", "0.05", "--crash", "--error", ADDMM)
    assert trainer.watchdog("--max-restarts", "2") == 1, trainer.log()
    assert [e["event"] for e in trainer.events][-1] == "give_up"
    assert [s["from_step"] for s in trainer.starts] == [0, 1, 2]  # a step each launch: progress
    assert trainer.state["final"]["reason"] == "given-up"


@pytest.mark.parametrize("provider", ["lambda", "runpod"])
def test_docker_mode_terminate_answered_ok_leaving_the_instance_running_is_still_billing(container, tmp_path, provider):
    """--terminate-on-finish in docker mode (compose's watchdog): a terminate the provider answers
    "ok" while the instance runs on is "terminate sent, still billing" (exit 82), never terminated;
    the restarted watchdog reads it back, sends again and records the end once the provider shows it."""
    from money import assert_fake_holds_nothing_unrecorded

    from budget_sidecar.testing import FakeBilling

    key = "docker-terminate-key-3f9a"
    fake = FakeBilling.start(tmp_path / "fake", provider=provider, instance_id="inst-1", api_key=key)
    try:
        fake.control(terminate_effect={"mode": "ignore"})
        trainer = container("--steps", "1", "--step-seconds", "0.05")
        termination = tmp_path / "logs" / "termination.json"
        opts = ["--terminate-on-finish", "--provider", provider, "--api-url", fake.url, "--instance-id", "inst-1",
                "--termination-file", str(termination), "--terminate-confirm-seconds", "2"]
        env = cli_env(**{f"{provider.upper()}_API_KEY": key})
        assert trainer.watchdog(*opts, env=env) == 82, trainer.log()
        record = json.loads(termination.read_text())
        assert record["confirmed"] is False and trainer.state["final"]["terminated"] is False
        assert "STILL BILLING" in trainer.log() and fake.state()["instances"]["inst-1"]["billing"]
        assert_fake_holds_nothing_unrecorded(fake, {"inst-1": record})

        fake.control(terminate_effect={"mode": "now"})
        assert trainer.watchdog(*opts, env=env) == 0, trainer.log()
        record = json.loads(termination.read_text())
        assert record["confirmed"] is True and trainer.state["final"]["terminated"] is True
        assert len(trainer.starts) == 1
        assert_fake_holds_nothing_unrecorded(fake, {"inst-1": record})
    finally:
        fake.stop()
