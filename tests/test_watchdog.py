"""The watchdog in process mode, supervising tests/stub_trainer.py: docs/DESIGN.md §3's decision table,
stalls, signal forwarding, give-up with an alert, the state a restarted watchdog honours, and
its Prometheus page. Real processes, signals, files and sockets throughout."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from conftest import REPO, cli_env, free_port, run_module, wait_for
from receivers import WebhookReceiver
from x1_common.contracts import ExitCode, end_reason

STUB = Path(__file__).with_name("stub_trainer.py")


def wait_until(predicate: Callable[[], Any], timeout: float = 30.0, what: str = "condition") -> Any:
    return wait_for(predicate, timeout, what, interval=0.05, tolerate=(OSError, ValueError, KeyError, IndexError))


def alive(pid: int) -> bool:
    """A zombie counts as gone: it runs nothing and holds no GPU."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] not in ("Z", "X")


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


class Workdir:
    """One run's files, a way to start the watchdog on them, and cleanup of every process."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.heartbeat = root / "heartbeat.json"
        self.progress = root / "progress.json"
        self.starts_file = root / "starts.jsonl"
        self.events_file = root / "logs" / "watchdog-events.jsonl"
        self.state_file = root / "logs" / "watchdog-state.json"
        self.worker_pid_file = root / "worker.json"
        self.procs: list[subprocess.Popen[bytes]] = []
        self.logs: list[Path] = []

    def stub(self, *extra: str) -> list[str]:
        return [sys.executable, str(STUB), "--heartbeat-file", str(self.heartbeat), "--progress-file",
                str(self.progress), "--starts-file", str(self.starts_file), *extra]

    def args(self, stub_args: list[str], *opts: str, port: int = 0) -> list[str]:
        return [
            "--heartbeat-file", str(self.heartbeat), "--events-file", str(self.events_file),
            "--state-file", str(self.state_file), "--port", str(port), "--check-seconds", "0.1",
            "--backoff-base-seconds", "0.05", "--term-grace-seconds", "10", *opts, "--", *self.stub(*stub_args),
        ]

    def start(self, stub_args: list[str], *opts: str, port: int = 0, env: dict[str, str] | None = None
              ) -> subprocess.Popen[bytes]:
        log_path = self.root / f"watchdog-{len(self.logs)}.log"
        self.logs.append(log_path)
        with open(log_path, "wb") as log:
            proc = subprocess.Popen(
                [sys.executable, "-m", "x1_watchdog", *self.args(stub_args, *opts, port=port)],
                stdout=log, stderr=subprocess.STDOUT, env=env or cli_env(), cwd=REPO, start_new_session=True,
            )
        self.procs.append(proc)
        return proc

    def run(self, stub_args: list[str], *opts: str, timeout: float = 60.0, env: dict[str, str] | None = None) -> int:
        proc = self.start(stub_args, *opts, env=env)
        return proc.wait(timeout)

    def log(self, i: int = -1) -> str:
        return self.logs[i].read_text(errors="replace")

    @property
    def events(self) -> list[dict[str, Any]]:
        return read_jsonl(self.events_file)

    def kinds(self) -> list[str]:
        return [e["event"] for e in self.events]

    @property
    def starts(self) -> list[dict[str, Any]]:
        return [r for r in read_jsonl(self.starts_file) if "argv" in r]

    @property
    def ends(self) -> list[dict[str, Any]]:
        return [r for r in read_jsonl(self.starts_file) if "exit" in r]

    @property
    def state(self) -> dict[str, Any]:
        return json.loads(self.state_file.read_text())

    def heartbeat_of(self, pid: int, min_step: int) -> dict[str, Any] | None:
        hb = json.loads(self.heartbeat.read_text())
        return hb if hb["pid"] == pid and hb["step"] >= min_step else None

    def cleanup(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
                try:
                    proc.wait(10)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait(10)
        # Stubs live in their own process groups (the watchdog's doing): end any left behind.
        pids = [s["pid"] for s in self.starts]
        if self.worker_pid_file.exists():
            pids.append(json.loads(self.worker_pid_file.read_text())["pid"])
        for pid in pids:
            try:
                cmdline = Path(f"/proc/{pid}/cmdline").read_text(errors="replace")
            except FileNotFoundError:
                continue
            if alive(pid) and ("stub_trainer" in cmdline or "time.sleep(600)" in cmdline):  # ours, not a reused pid
                for sig in (signal.SIGCONT, signal.SIGKILL):
                    try:
                        os.kill(pid, sig)
                    except ProcessLookupError:
                        pass


@pytest.fixture
def wd(tmp_path: Path) -> Iterator[Workdir]:
    w = Workdir(tmp_path)
    try:
        yield w
    finally:
        w.cleanup()


def scrape(port: int) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


# --------------------------------------------------------------------------------------------
# docs/DESIGN.md §3: final codes stop, and stay stopped


@pytest.fixture
def slack() -> Iterator[WebhookReceiver]:
    receiver = WebhookReceiver(path="/services/T000/B000/secret-hook")
    try:
        yield receiver
    finally:
        receiver.close()


@pytest.mark.parametrize("code", [0, 2, 76, 77, 78, 79])
def test_final_exit_code_is_never_relaunched_even_by_a_restarted_watchdog(wd: Workdir, slack: WebhookReceiver, code: int):
    env = cli_env(SLACK_WEBHOOK_URL=slack.url)
    rc = wd.run(["--steps", "1", "--step-seconds", "0.05", "--exit-code", str(code)], env=env)
    assert rc == code, wd.log()
    assert wd.kinds() == ["start", "exit"]
    exit_event = wd.events[1]
    assert exit_event["exit_code"] == code and exit_event["reason"] == end_reason(code)
    assert wd.state["final"]["exit_code"] == code
    # docs/DESIGN.md §3: budget stops, a refused launch and a divergence are alerted; a finish and a bad config are not.
    assert len(slack.posts) == (1 if code in (76, 77, 78, 79) else 0)

    # compose (or a reboot) restarts the watchdog: it reads the decision and launches nothing.
    rc = wd.run(["--steps", "1", "--step-seconds", "0.05", "--exit-code", str(code)], env=env)
    assert rc == code, wd.log()
    assert wd.kinds() == ["start", "exit"]
    assert len(wd.starts) == 1
    assert "final decision" in wd.log()


def test_hold_after_final_stays_up_until_stopped_then_exits_with_the_final_code(wd: Workdir):
    port = free_port()
    proc = wd.start(["--steps", "0", "--exit-code", "76"], "--hold-after-final", port=port)
    wait_until(lambda: wd.kinds() == ["start", "exit"], 30, "the budget stop")
    time.sleep(0.5)
    assert proc.poll() is None  # compose's unless-stopped would otherwise restart it in a loop
    assert scrape(port)[("x1_watchdog_trainer_up", ())] == 0
    os.kill(proc.pid, signal.SIGTERM)
    assert proc.wait(30) == 76, wd.log()
    assert len(wd.starts) == 1


def test_reset_state_starts_a_new_run_after_a_final_decision(wd: Workdir):
    assert wd.run(["--steps", "1", "--step-seconds", "0.05"]) == 0
    assert wd.run(["--steps", "1", "--step-seconds", "0.05"], "--reset-state") == 0, wd.log()
    assert len(wd.starts) == 2
    assert "--resume-from-latest" not in wd.starts[1]["argv"]  # a new run starts from scratch


# --------------------------------------------------------------------------------------------
# Crashes: backoff, give-up, alert


def test_trainer_that_crashes_every_time_is_given_up_after_max_restarts_with_an_alert(
    wd: Workdir, slack: WebhookReceiver
):
    env = cli_env(SLACK_WEBHOOK_URL=slack.url)
    rc = wd.run(["--steps", "5", "--step-seconds", "0.01", "--crash"], "--max-restarts", "2", env=env)
    assert rc == 1, wd.log()
    assert wd.kinds() == ["start", "exit", "relaunch", "start", "exit", "relaunch", "start", "exit", "give_up"]
    relaunches = [e for e in wd.events if e["event"] == "relaunch"]
    assert [e["reason"] for e in relaunches] == ["crashed", "crashed"]
    assert [e["delay_seconds"] for e in relaunches] == [0.05, 0.1]  # exponential backoff
    give_up = wd.events[-1]
    assert give_up["exit_code"] == 1 and give_up["restarts_in_window"] == 2 and give_up["alerted"] == ["webhook"]
    assert wd.state["final"]["reason"] == "given-up"

    assert len(slack.posts) == 1 and "gave up" in slack.posts[0]["text"]
    assert slack.url not in wd.log()  # the webhook URL is a secret

    # A restarted watchdog honours the give-up.
    assert wd.run(["--steps", "5", "--crash"], env=env) == 1
    assert len(wd.starts) == 3


# --------------------------------------------------------------------------------------------
# Start-up failures: the same error twice before the first step stops the relaunches

# The error of a trainer whose torch lacks a call it needs; {addr} differs in every process, as
# the repr of an object does, and the stub's goodbye line after the traceback carries the time.
ADDMM = "addmm() got an unexpected keyword argument 'out_dtype' (tensor at {addr})"
ADDMM_LINE = r"TypeError: addmm\(\) got an unexpected keyword argument 'out_dtype' \(tensor at 0x[0-9a-f]+\)"


def test_same_startup_error_twice_stops_relaunching_with_exit_code_81_and_one_alert(wd: Workdir, slack: WebhookReceiver):
    env = cli_env(SLACK_WEBHOOK_URL=slack.url)
    trainer_log = wd.root / "trainer.log"
    stub = ["--fail-at-startup", "--error", ADDMM]
    rc = wd.run(stub, "--trainer-log", str(trainer_log), "--max-restarts", "10", env=env)
    assert rc == ExitCode.STARTUP_FAILED == 81, wd.log()
    assert wd.kinds() == ["start", "exit", "relaunch", "start", "exit", "startup_failure"]
    assert len(wd.starts) == 2 and wd.starts[1]["argv"].count("--resume-from-latest") == 1
    first, second = (e for e in wd.events if e["event"] == "exit")
    for e in (first, second):
        assert e["exit_code"] == 1 and e["progress"] == "still at step 0"
        assert re.fullmatch(ADDMM_LINE, e["error"]), e  # the traceback's line, not the goodbye after it
    assert first["error"] != second["error"]  # two addresses, one error
    decision = wd.events[-1]
    assert (decision["exit_code"], decision["error"], decision["alerted"]) == (1, second["error"], ["webhook"])

    final = wd.state["final"]
    assert (final["exit_code"], final["reason"], final["trainer_exit_code"]) == (81, "startup-failure", 1)
    assert final["error"] == second["error"]
    assert len(slack.posts) == 1
    assert "trainer cannot start" in slack.posts[0]["text"] and second["error"] in slack.posts[0]["text"]

    # The decision is final: a restarted watchdog launches nothing and does not alert again.
    assert wd.run(stub, "--trainer-log", str(trainer_log), env=env) == 81
    assert len(wd.starts) == 2 and len(slack.posts) == 1 and "final decision" in wd.log()


def test_without_a_trainer_log_two_startup_crashes_with_the_same_code_are_a_startup_failure(
        wd: Workdir, slack: WebhookReceiver):
    rc = wd.run(["--fail-at-startup", "--error", ADDMM], env=cli_env(SLACK_WEBHOOK_URL=slack.url))
    assert rc == 81, wd.log()
    assert re.search(ADDMM_LINE, wd.log())  # the output went to the watchdog's own, unread
    assert wd.state["final"]["error"] == "" and len(wd.starts) == 2
    assert len(slack.posts) == 1 and "--trainer-log" in slack.posts[0]["text"]


def test_the_error_line_is_the_tracebacks_or_the_last_error_and_times_addresses_pids_do_not_count():
    from x1_watchdog.policy import StartupFailure, error_line

    traceback = ("Traceback (most recent call last):\n  File \"train.py\", line 9, in <module>\n    main()\n"
                 "TypeError: addmm() got an unexpected keyword argument 'out_dtype'\n"
                 "View run tiny-20261204-201201 at: http://127.0.0.1:5000/#/experiments/1\n")
    assert error_line(traceback) == "TypeError: addmm() got an unexpected keyword argument 'out_dtype'"
    logged = ("2026-12-04 20:12:01,123 INFO x1.train: preflight ok\n"
              "2026-12-04 20:12:02,456 ERROR x1.train: setup failed: [Errno 28] No space left on device; exit 1\n"
              "shutting down\n")
    assert error_line(logged).endswith("ERROR x1.train: setup failed: [Errno 28] No space left on device; exit 1")
    assert error_line("") == "" and error_line("just this\n\n") == "just this"

    one = StartupFailure.from_output(1, logged)
    later = StartupFailure.from_output(1, logged.replace("20:12:02,456", "20:14:40,001"))
    assert one.error != later.error and later.same_as(one.to_dict())
    assert not StartupFailure.from_output(2, logged).same_as(one.to_dict())  # another exit code
    pids = [StartupFailure.from_output(1, f"RuntimeError: worker (pid {n}) at 0x7f{n:x} died\n") for n in (11, 12)]
    assert pids[1].same_as(pids[0].to_dict())
    assert not StartupFailure.from_output(1, "RuntimeError: CUDA error on device 1\n").same_as(
        StartupFailure.from_output(1, "RuntimeError: CUDA error on device 2\n").to_dict())


def test_resumed_trainer_that_dies_before_its_first_new_step_twice_is_a_startup_failure(wd: Workdir):
    # A run in progress: stopped (SIGTERM forwarded) after a few steps, its progress saved.
    proc = wd.start(["--steps", "20", "--step-seconds", "0.1"])
    first = wait_until(lambda: wd.starts and wd.starts[0]["pid"], 30, "the trainer")
    wait_until(lambda: wd.heartbeat_of(first, 3), 30, "step 3")
    os.kill(proc.pid, signal.SIGTERM)
    assert proc.wait(30) == 75, wd.log()
    saved = json.loads(wd.progress.read_text())["step"]

    # The next start resumes from that step and dies there, twice: no new step, the same error.
    rc = wd.run(["--steps", "20", "--fail-at-startup", "--error", ADDMM], "--trainer-log", str(wd.root / "t.log"))
    assert rc == 81, wd.log()
    assert [s["from_step"] for s in wd.starts] == [0, saved, saved]
    assert all(s["argv"].count("--resume-from-latest") == 1 for s in wd.starts[1:])
    assert [e["progress"] for e in wd.events if e["event"] == "exit"][1:] == [f"still at step {saved}"] * 2


def test_different_startup_errors_keep_being_relaunched_until_max_restarts(wd: Workdir):
    rc = wd.run(["--fail-at-startup", "--error", "CUDA error: out of memory on attempt {start}"],
                "--trainer-log", str(wd.root / "trainer.log"), "--max-restarts", "3")
    assert rc == 1, wd.log()
    assert wd.kinds()[-1] == "give_up" and len(wd.starts) == 4  # today's rule: --max-restarts
    errors = [e["error"] for e in wd.events if e["event"] == "exit"]
    assert errors == [f"TypeError: CUDA error: out of memory on attempt {n}" for n in (1, 2, 3, 4)]
    assert wd.state["final"]["reason"] == "given-up"


def test_same_error_after_progress_is_a_crash_relaunched_until_max_restarts(wd: Workdir):
    rc = wd.run(["--steps", "20", "--step-seconds", "0.01", "--crash", "--error", ADDMM],
                "--trainer-log", str(wd.root / "trainer.log"), "--max-restarts", "3")
    assert rc == 1, wd.log()
    assert wd.kinds()[-1] == "give_up" and len(wd.starts) == 4
    exits = [e for e in wd.events if e["event"] == "exit"]
    assert all(e["exit_code"] == 1 and "error" not in e for e in exits), exits
    assert [s["from_step"] for s in wd.starts] == [0, 1, 2, 3]  # a step each time: progress


def test_preemptions_before_the_first_step_keep_being_relaunched(wd: Workdir):
    # SIGTERM during start-up each time (a flaky spot host): exit 75 is a preemption, whatever the step.
    proc = wd.start(["--steps", "3", "--startup-seconds", "30"], "--trainer-log", str(wd.root / "trainer.log"),
                    "--max-restarts", "5")
    for n in range(1, 4):
        pid = wait_until(lambda n=n: len(wd.starts) >= n and wd.starts[n - 1]["pid"], 30, f"start {n}")
        wait_until(lambda pid=pid: alive(pid) and Path(f"/proc/{pid}/cmdline").exists(), 10, "the stub")
        os.kill(pid, signal.SIGTERM)
    wait_until(lambda: len(wd.starts) >= 4, 30, "the fourth start")
    kinds = wd.kinds()
    assert kinds.count("relaunch") == 3 and "startup_failure" not in kinds and proc.poll() is None
    assert [e["exit_code"] for e in wd.events if e["event"] == "exit"] == [75, 75, 75]
    os.kill(proc.pid, signal.SIGTERM)
    assert proc.wait(30) == 75


# --------------------------------------------------------------------------------------------
# Kills, stalls, and the resume flag


def test_sigkilled_trainer_is_relaunched_with_resume_flag_once_and_its_workers_die(wd: Workdir):
    port = free_port()
    proc = wd.start(["--steps", "10", "--step-seconds", "0.25", "--worker-pid-file", str(wd.worker_pid_file)],
                    port=port)
    first = wait_until(lambda: wd.starts and wd.starts[0]["pid"], 30, "the first trainer")
    wait_until(lambda: wd.heartbeat_of(first, 2), 30, "step 2")
    worker = wait_until(lambda: json.loads(wd.worker_pid_file.read_text())["pid"], 10, "the worker")
    os.kill(first, signal.SIGKILL)

    second = wait_until(lambda: len(wd.starts) >= 2 and wd.starts[1]["pid"], 30, "the relaunch")
    # The killed trainer's worker (a torchrun worker, say) must not outlive it holding the GPU.
    wait_until(lambda: not alive(worker), 10, "the orphaned worker to be killed")
    wait_until(lambda: wd.heartbeat_of(second, wd.starts[1]["from_step"] + 1), 30, "a step after the relaunch")
    metrics = scrape(port)
    assert metrics[("x1_watchdog_restarts_total", (("reason", "killed"),))] == 1
    assert metrics[("x1_watchdog_restarts_total", (("reason", "crashed"),))] == 0
    assert metrics[("x1_watchdog_trainer_up", ())] == 1
    assert metrics[("x1_watchdog_downtime_seconds_total", ())] > 0

    os.kill(second, signal.SIGKILL)
    assert proc.wait(60) == 0, wd.log()
    starts = wd.starts
    assert len(starts) == 3
    assert "--resume-from-latest" not in starts[0]["argv"]
    for s in starts[1:]:
        assert s["argv"].count("--resume-from-latest") == 1
    assert starts[1]["from_step"] >= 2 and starts[2]["from_step"] >= starts[1]["from_step"]
    assert json.loads(wd.progress.read_text())["step"] == 10

    relaunches = [e for e in wd.events if e["event"] == "relaunch"]
    assert [(e["reason"], e["exit_code"], e["signal"]) for e in relaunches] == [("killed", 137, 9)] * 2
    assert all(e["downtime_seconds"] >= 0.05 for e in relaunches)
    assert [e["restart"] for e in wd.events if e["event"] == "start"] == [0, 1, 2]
    assert [e["pid"] for e in wd.events if e["event"] == "start"] == [s["pid"] for s in starts]


def test_frozen_trainer_is_detected_as_stalled_terminated_and_relaunched(wd: Workdir):
    proc = wd.start(["--steps", "8", "--step-seconds", "0.2"],
                    "--stall-seconds", "3", "--startup-grace-seconds", "3")
    first = wait_until(lambda: wd.starts and wd.starts[0]["pid"], 30, "the first trainer")
    wait_until(lambda: wd.heartbeat_of(first, 2), 30, "step 2")
    os.kill(first, signal.SIGSTOP)

    assert proc.wait(60) == 0, wd.log()
    assert not alive(first)
    kinds = wd.kinds()
    assert kinds == ["start", "stall", "exit", "relaunch", "start", "exit"], kinds
    stall, exit_event, relaunch = wd.events[1:4]
    assert stall["pid"] == first and stall["heartbeat_age_seconds"] > 3
    # SIGTERM then SIGCONT: the frozen trainer wakes up, saves and exits 75.
    assert exit_event["reason"] == "stall" and exit_event["exit_code"] == 75
    assert relaunch["reason"] == "stall"
    assert wd.starts[1]["argv"].count("--resume-from-latest") == 1
    assert json.loads(wd.progress.read_text())["step"] == 8


def test_trainer_deaf_to_sigterm_in_a_hang_is_killed_after_the_grace(wd: Workdir):
    proc = wd.start(["--steps", "4", "--step-seconds", "0.1", "--hang-at-step", "2"],
                    "--stall-seconds", "2", "--startup-grace-seconds", "2", "--term-grace-seconds", "1")
    assert proc.wait(60) == 0, wd.log()
    exits = [e for e in wd.events if e["event"] == "exit"]
    assert (exits[0]["reason"], exits[0]["exit_code"], exits[0]["signal"]) == ("stall", 137, 9)
    assert not alive(wd.starts[0]["pid"])
    assert json.loads(wd.progress.read_text())["step"] == 4


def test_no_own_heartbeat_within_the_startup_grace_is_a_stall(wd: Workdir):
    # A fresh-looking heartbeat left by a previous process must not vouch for the new one.
    wd.heartbeat.write_text(json.dumps({"step": 3, "time": time.time(), "pid": 1, "phase": "training"}))
    rc = wd.run(["--startup-seconds", "60"], "--startup-grace-seconds", "1", "--stall-seconds", "100",
                "--max-restarts", "0")
    assert rc == 75, wd.log()  # SIGTERM during its startup: the stub saves and exits 75
    assert wd.kinds() == ["start", "stall", "exit", "give_up"]
    assert "no heartbeat" in wd.events[1]["detail"]


# --------------------------------------------------------------------------------------------
# Stopping the watchdog


def test_sigterm_to_the_watchdog_is_forwarded_and_not_followed_by_a_relaunch(wd: Workdir):
    stub = ["--steps", "14", "--step-seconds", "0.2"]
    proc = wd.start(stub)
    first = wait_until(lambda: wd.starts and wd.starts[0]["pid"], 30, "the trainer")
    wait_until(lambda: wd.heartbeat_of(first, 2), 30, "step 2")
    os.kill(proc.pid, signal.SIGTERM)

    assert proc.wait(30) == 75, wd.log()
    assert not alive(first)
    assert wd.kinds() == ["start", "exit"]
    assert wd.events[1]["stop_requested"] is True and wd.events[1]["exit_code"] == 75
    saved = json.loads(wd.progress.read_text())["step"]
    assert saved >= 2  # the emergency checkpoint was waited for
    assert wd.state["final"] is None  # a stop is not a decision about the run

    # `docker compose up` again: the run continues from the emergency checkpoint.
    assert wd.run(stub) == 0, wd.log()
    assert wd.starts[1]["argv"].count("--resume-from-latest") == 1 and wd.starts[1]["from_step"] == saved


def test_trainer_left_by_a_killed_watchdog_is_stopped_before_the_next_one_starts(wd: Workdir):
    stub = ["--steps", "14", "--step-seconds", "0.2"]
    proc = wd.start(stub)
    orphan = wait_until(lambda: wd.starts and wd.starts[0]["pid"], 30, "the trainer")
    wait_until(lambda: wd.heartbeat_of(orphan, 2), 30, "step 2")
    os.kill(proc.pid, signal.SIGKILL)  # the watchdog dies; its trainer, in its own session, does not
    proc.wait(10)
    assert alive(orphan)

    assert wd.run(stub) == 0, wd.log()
    assert not alive(orphan)
    assert "still running" in wd.log()
    second = wd.starts[1]
    # The orphan got SIGTERM and saved before the new trainer started: one writer at a time.
    orphan_end = next(e for e in wd.ends if e["pid"] == orphan)
    assert orphan_end["exit"] == 75 and orphan_end["time"] < second["time"]
    assert second["from_step"] == orphan_end["step"] and second["argv"].count("--resume-from-latest") == 1
    assert json.loads(wd.progress.read_text())["step"] == 14


def test_second_watchdog_on_one_state_file_is_refused_and_signals_nothing(wd: Workdir):
    stub = ["--steps", "400", "--step-seconds", "0.05"]
    first = wd.start(stub)
    trainer = wait_until(lambda: wd.starts and wd.starts[0]["pid"], 30, "the trainer")
    wait_until(lambda: wd.heartbeat_of(trainer, 2), 30, "step 2")

    assert wd.run(stub, timeout=60) == 2, wd.log()
    second_log = wd.log()
    assert f"state file {wd.state_file} is in use by another watchdog" in second_log
    assert f"pid {first.pid}" in second_log and "Traceback" not in second_log
    # Nothing signalled, nothing started: the first one's run goes on.
    assert alive(trainer) and first.poll() is None
    assert [s["pid"] for s in wd.starts] == [trainer] and not wd.ends
    step = json.loads(wd.progress.read_text())["step"]
    wait_until(lambda: json.loads(wd.progress.read_text())["step"] > step, 30, "the trainer stepping on")


def test_a_watchdog_after_a_sigkilled_one_takes_its_state_file_over(wd: Workdir):
    stub = ["--steps", "6", "--step-seconds", "0.05"]
    proc = wd.start(stub)
    orphan = wait_until(lambda: wd.starts and wd.starts[0]["pid"], 30, "the trainer")
    os.kill(proc.pid, signal.SIGKILL)  # its lease stays behind, held by no one
    proc.wait(10)
    assert wd.run(stub) == 0, wd.log()
    assert "taken over from watchdog" in wd.log() and not alive(orphan)


# --------------------------------------------------------------------------------------------
# Command line and environment


def test_busy_metrics_port_is_a_warning_not_a_failure(wd: Workdir):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        proc = wd.start(["--steps", "1", "--step-seconds", "0.05"], port=busy.getsockname()[1])
        assert proc.wait(60) == 0, wd.log()
    assert "metrics server not started" in wd.log()


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        ([], "needs the trainer command"),
        (["--stall-seconds", "-1", "--", "true"], "--stall-seconds"),
        (["--max-restarts", "-1", "--", "true"], "--max-restarts"),
        (["--mode", "docker"], "--container"),
        (["--terminate-on-finish", "--", "true"], "--provider"),
        (["--terminate-on-finish", "--provider", "lambda", "--instance-id", "i", "--", "true"], "LAMBDA_API_KEY"),
        (["--", "/nonexistent/trainer"], "cannot start the trainer command"),
    ],
)
def test_usage_errors_exit_2_naming_the_problem(tmp_path: Path, argv: list[str], message: str):
    files = ["--heartbeat-file", str(tmp_path / "hb.json"), "--events-file", str(tmp_path / "ev.jsonl"),
             "--state-file", str(tmp_path / "state.json"), "--port", "0"]
    env = {k: v for k, v in cli_env().items() if k not in ("LAMBDA_API_KEY", "RUNPOD_API_KEY")}
    proc = run_module("x1_watchdog", *files, *argv, timeout=60, env=env)
    assert proc.returncode == 2, proc.stderr
    assert message in proc.stderr


def test_corrupt_state_file_is_refused_with_exit_2(wd: Workdir):
    wd.state_file.parent.mkdir(parents=True)
    wd.state_file.write_text("{not json")
    assert wd.run(["--steps", "1"]) == 2
    assert str(wd.state_file) in wd.log() and "--reset-state" in wd.log()
    assert wd.starts == []


def test_unwritable_records_are_refused_with_exit_2(wd: Workdir):
    not_a_dir = wd.root / "logs-is-a-file"
    not_a_dir.write_text("")
    wd.state_file = not_a_dir / "state.json"  # fails even for root, unlike a chmod
    assert wd.run(["--steps", "1"]) == 2
    assert f"--state-file {wd.state_file}: cannot create its directory" in wd.log()
    assert wd.starts == []


def test_help_explains_the_modes_and_exit_codes():
    proc = run_module("x1_watchdog", "--help", timeout=60)
    assert proc.returncode == 0
    for words in ("process", "docker", "provider", "--resume-from-latest", "exit codes", "GPU host"):
        assert words in proc.stdout


def test_the_startup_grace_covers_start_up_only_not_a_trainer_already_in_its_loop(tmp_path):
    import json

    from x1_watchdog.policy import StallDetector

    hb = tmp_path / "heartbeat.json"
    clock = [1000.0]
    detector = StallDetector(hb, stall_seconds=10, startup_grace_seconds=600, clock=lambda: clock[0])
    detector.arm(started_at=1000.0)
    hb.write_text(json.dumps({"step": 0, "time": 1001.0, "pid": 1, "phase": "compiling"}))
    clock[0] = 1300.0
    assert detector.check() is None  # compiling for 5 min: inside the grace
    hb.write_text(json.dumps({"step": 40, "time": 1310.0, "pid": 1, "phase": "training"}))
    clock[0] = 1315.0
    assert detector.check() is None
    clock[0] = 1340.0
    stalled = detector.check()  # 25 s without a new beat, 5.7 min after start
    assert stalled is not None and "step 40" in stalled
