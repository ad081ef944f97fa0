"""`python -m x1_pretrain.stack up|status|down` on CPU: the real services as processes (MLflow
server, budget sidecar with the static provider, watchdog, tiny trainer, Prometheus when
installed), driven through the command line a RunPod user types.

One stack, one run, in the order of its life (the tests below share it and run in file order):
up -> status -> a second up refused -> SIGTERM to the trainer relaunched -> down (emergency
checkpoint, stop recorded as requested) -> up resumes with no step lost -> a power cut (every
process SIGKILLed) and up continues -> the run finishes, and up again honours that final decision.
Before it, bad input: exit 2 naming the problem, nothing started.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.parse
from pathlib import Path

import pytest

from conftest import cli_env, free_port, run_module, wait_for
from x1_pretrain.stack import process, workspace
from x1_pretrain.stack import runner as stack_mod
from x1_pretrain.train import lease as L

PROMETHEUS = shutil.which("prometheus")
TOTAL_STEPS = 40


def stack(*args: str, timeout: float = 420, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return run_module("x1_pretrain.stack", *args, timeout=timeout, env=env)


def write_env(path: Path, **values: str) -> Path:
    path.write_text("".join(f"{k}={v}\n" for k, v in values.items()), encoding="utf-8")
    return path


def tiny_settings(**extra: str) -> dict[str, str]:
    """The .env of a tiny CPU run: static provider, free ports, fast polls."""
    ports = {var: str(free_port()) for var in workspace.PORT_VARS.values()}
    return {"PROVIDER": "static", "RATE_USD_PER_HR": "0.10", "BUDGET_POLL_SECONDS": "1",
            "X1_CONFIG": "configs/tiny-cpu.yaml", "TOTAL_STEPS": str(TOTAL_STEPS), "CKPT_EVERY": "10",
            "EVAL_EVERY": "20", "LOG_EVERY": "2", "STALL_SECONDS": "180", "STARTUP_GRACE_SECONDS": "180",
            "MLFLOW_WORKERS": "1", **ports, **extra}


# ---------------------------------------------------------------------------------------------
# Bad input: exit 2, the problem named, nothing started


def test_help_explains_every_command():
    proc = stack("--help", timeout=60)
    assert proc.returncode == 0
    for word in ("prepare", "up", "status", "down", "127.0.0.1", "watchdog-state.json", "emergency checkpoint"):
        assert word in proc.stdout
    up = stack("up", "--help", timeout=60)
    assert "--env-file" in up.stdout and "--detach" in up.stdout and "--workspace" in up.stdout


@pytest.mark.parametrize(("settings", "message"), [
    ({"PROVIDER": "aws"}, "PROVIDER='aws' must be lambda, runpod or static"),
    ({"PROVIDER": "static", "RATE_USD_PER_HR": ""}, "RATE_USD_PER_HR: the static provider needs the hourly rate"),
    ({"PROVIDER": "runpod", "RATE_USD_PER_HR": "", "INSTANCE_ID": "pod1"}, "RUNPOD_API_KEY: the runpod provider needs"),
    ({"TOTAL_STEPS": "lots"}, "TOTAL_STEPS='lots' is not a whole number"),
    ({"MLFLOW_HOST_PORT": "70000"}, "MLFLOW_HOST_PORT='70000' must be a port number"),
    ({"TERMINATE_ON_FINISH": "yes"}, "TERMINATE_ON_FINISH='yes' must be 0 or 1"),
    ({"X1_CONFIG": "configs/nope.yaml"}, "X1_CONFIG='configs/nope.yaml': no such file"),
    ({"BUDGET_ALERT_USD": "40"}, "BUDGET_ALERT_USD=40 is above BUDGET_CAP_USD=35"),
    ({"NNODES": "two"}, "NNODES='two' is not a whole number"),
    ({"NNODES": "2", "RDZV_ENDPOINT": "10.19.0.5:29400"}, "NNODES=2 needs RDZV_ENDPOINT (HOST:PORT of one host) and RDZV_ID"),
])
def test_bad_settings_are_refused_naming_the_variable(tmp_path, tiny_data, capsys, monkeypatch, settings, message):
    monkeypatch.delenv("RUNPOD_API_KEY", raising=False)
    ws = tmp_path / "ws"
    shutil.copytree(tiny_data, ws / "data" / "tokenized")
    env_file = write_env(tmp_path / ".env", **{**tiny_settings(), **settings})
    assert stack_mod.main(["up", "--env-file", str(env_file), "--workspace", str(ws)]) == 2
    assert message in capsys.readouterr().err
    assert sorted(p.name for p in ws.iterdir()) == ["data"]  # nothing written


def test_up_without_data_a_missing_env_file_or_a_file_as_workspace_is_refused(tmp_path, capsys):
    env_file = write_env(tmp_path / ".env", **tiny_settings())
    assert stack_mod.main(["up", "--env-file", str(env_file), "--workspace", str(tmp_path / "ws")]) == 2
    err = capsys.readouterr().err
    assert f"no tokenized data in {tmp_path / 'ws' / 'data' / 'tokenized'}" in err and "stack prepare" in err
    assert not (tmp_path / "ws").exists()
    with pytest.raises(SystemExit) as e:
        stack_mod.main(["up", "--env-file", str(tmp_path / "absent.env"), "--workspace", str(tmp_path / "ws")])
    assert e.value.code == 2 and "absent.env: no such file" in capsys.readouterr().err
    (tmp_path / "afile").write_text("x")
    with pytest.raises(SystemExit) as e:
        stack_mod.main(["status", "--workspace", str(tmp_path / "afile")])
    assert e.value.code == 2 and "exists and is not a folder" in capsys.readouterr().err


def test_status_and_down_where_no_stack_ever_ran(tmp_path):
    status = stack("status", "--workspace", str(tmp_path), timeout=60)
    assert status.returncode == 1 and "not running" in status.stdout and "no heartbeat yet" in status.stdout
    down = stack("down", "--workspace", str(tmp_path), timeout=60)
    assert down.returncode == 0 and f"no stack is running in {tmp_path}" in down.stdout


def test_a_read_only_workspace_is_refused_with_exit_2_naming_it(tmp_path, tiny_data):
    ws = tmp_path / "ws"
    shutil.copytree(tiny_data, ws / "data" / "tokenized")
    ro = tmp_path / "ro"
    ro.mkdir()
    mounted = os.geteuid() == 0 and shutil.which("mount") and subprocess.run(
        ["mount", "--bind", str(ws), str(ro)], capture_output=True).returncode == 0
    if not mounted:
        pytest.skip("a read-only mount needs root and mount")
    try:
        if subprocess.run(["mount", "-o", "remount,bind,ro", str(ro)], capture_output=True).returncode != 0:
            pytest.skip("this kernel refused a read-only bind mount")
        env_file = write_env(tmp_path / ".env", **tiny_settings())
        for detach in ([], ["-d"]):
            proc = stack("up", *detach, "--env-file", str(env_file), "--workspace", str(ro), timeout=60)
            assert proc.returncode == 2, proc.stdout + proc.stderr
            assert f"workspace {ro}: cannot write in {ro} (Read-only file system)" in proc.stderr
            assert "Traceback" not in proc.stderr
        assert sorted(p.name for p in ws.iterdir()) == ["data"]
    finally:
        subprocess.run(["umount", str(ro)], capture_output=True)


def test_a_wrong_api_key_is_reported_by_up_d_at_once_with_the_providers_answer(tmp_path, tiny_data):
    from budget_sidecar.testing import FakeBilling

    ws = tmp_path / "ws"
    shutil.copytree(tiny_data, ws / "data" / "tokenized")
    fake = FakeBilling.start(tmp_path / "fake", provider="lambda", instance_id="inst-1", api_key="sk-right-0c9d8e7f")
    wrong = "sk-wrong-1a2b3c4d"
    try:
        settings = tiny_settings(PROVIDER="lambda", RATE_USD_PER_HR="", INSTANCE_ID="inst-1", LAMBDA_API_KEY=wrong,
                                 PROVIDER_API_URL=fake.url)
        env_file = write_env(tmp_path / ".env", **settings)
        started = time.monotonic()
        proc = stack("up", "-d", "--no-prometheus", "--env-file", str(env_file), "--workspace", str(ws), timeout=200)
        took = time.monotonic() - started
    finally:
        fake.stop()
    out = proc.stdout + proc.stderr
    assert proc.returncode == 2, out
    assert took < 120, f"{took:.0f} s: it waited for a timeout"  # the timeout is 300 s
    assert "the budget sidecar cannot read the spend" in out and "HTTP 401" in out and "check LAMBDA_API_KEY" in out
    assert "timed out" not in out and wrong not in out
    assert stack("status", "--workspace", str(ws), timeout=60).returncode == 1  # nothing left running


def test_a_port_another_stack_holds_fails_the_port_check_while_its_server_is_down(tmp_path, tiny_data, monkeypatch):
    # The first stack's trainer is between a crash and its relaunch: its metrics port is free to
    # bind, but is that stack's. A second stack given the same port must not pass.
    ports_dir = tmp_path / "ports"
    monkeypatch.setattr(workspace, "PORTS_DIR", ports_dir)
    other = workspace.PortReservation()
    port = free_port()
    assert other.claim(port, tmp_path / "first-ws") is None
    try:
        ws = tmp_path / "ws"
        shutil.copytree(tiny_data, ws / "data" / "tokenized")
        env_file = write_env(tmp_path / ".env", **{**tiny_settings(), "TRAINER_METRICS_HOST_PORT": str(port)})
        proc = stack("up", "-d", "--no-prometheus", "--env-file", str(env_file), "--workspace", str(ws), timeout=120,
                     env=cli_env(X1_STACK_PORTS_DIR=str(ports_dir)))
        assert proc.returncode == 2, proc.stdout + proc.stderr
        assert (f"TRAINER_METRICS_HOST_PORT={port} (trainer) is claimed by the X1 stack in {tmp_path / 'first-ws'} "
                f"(runner pid {os.getpid()})") in proc.stderr
        assert not (ws / "logs" / "mlflow-server.log").exists()  # refused before any service started
    finally:
        other.release()


# ---------------------------------------------------------------------------------------------
# A trainer that cannot start: two launches, then the start-up failure decision, not a loop

# An install whose trainer module cannot load (a CUDA library missing from the image, say): on
# PYTHONPATH, so it reaches the trainer the way the rest of the runner's environment does.
BROKEN_INSTALL = """\
import importlib.abc
import sys


class MissingCudaRuntime(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "x1_pretrain.train.main":  # the trainer program (the stack imports x1_pretrain.train.lease)
            raise ImportError("libcudart.so.13: cannot open shared object file: No such file or directory")
        return None


sys.meta_path.insert(0, MissingCudaRuntime())
"""


@pytest.mark.slow
def test_trainer_that_cannot_start_is_stopped_after_two_launches_and_status_shows_the_startup_failure(
        tmp_path, tiny_data):
    ws = workspace.Workspace(tmp_path / "ws")
    shutil.copytree(tiny_data, ws.tokenized)
    broken = tmp_path / "broken-install"
    broken.mkdir()
    (broken / "sitecustomize.py").write_text(BROKEN_INSTALL)
    env_file = write_env(tmp_path / ".env", **tiny_settings())
    env = cli_env(OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join(filter(None, [str(broken), os.environ.get("PYTHONPATH")])))
    proc = stack("up", "-d", "--env-file", str(env_file), "--workspace", str(ws.root), env=env)
    try:
        assert proc.returncode == 0, proc.stdout + proc.stderr
        final = wait_for(lambda: (workspace.read_json(ws.state_file) or {}).get("final"), 180, "the watchdog's decision")
        assert (final["exit_code"], final["reason"], final["trainer_exit_code"]) == (81, "startup-failure", 1)
        assert "libcudart.so.13: cannot open shared object file" in final["error"]
        kinds = [e["event"] for e in workspace.read_events(ws)]
        assert kinds == ["start", "exit", "relaunch", "start", "exit", "startup_failure"]

        status = stack("status", "--workspace", str(ws.root), timeout=60)
        assert status.returncode == 0, status.stdout + status.stderr  # the stack is up; the watchdog holds
        assert "watchdog's last decision: start-up failure: the trainer exited 1 before its first step" in status.stdout
        assert "final decision: startup-failure (exit 81" in status.stdout
        assert f"the trainer's error: {final['error']}" in status.stdout
        wait_for(lambda: "final decision: startup-failure (exit 81)" in ws.log("stack").read_text(), 30,
                 "the runner's report")
        time.sleep(3)
        assert [e["event"] for e in workspace.read_events(ws)] == kinds  # no third launch
        assert workspace.trainer_pid(ws) is None
    finally:
        stack("down", "--workspace", str(ws.root))


@pytest.mark.slow
def test_a_hangup_leaves_a_foreground_stack_running_and_status_tells_the_truth_after_its_runner_dies(
        tmp_path, tiny_data):
    """An SSH session that drops sends SIGHUP to a foreground `up`: the stack keeps running (the run
    goes on training) and `status` says so. Even a runner killed outright (SIGKILL: no handler runs)
    leaves nothing unseen: `status` names each process still running, the trainer included, and
    `down` stops them in order, the trainer first with its checkpoint."""
    ws = workspace.Workspace(tmp_path / "ws")
    shutil.copytree(tiny_data, ws.tokenized)
    env_file = write_env(tmp_path / ".env", **tiny_settings(TOTAL_STEPS="5000", CKPT_EVERY="1000"))
    master, terminal = os.openpty()  # `up` in the foreground of a terminal, as over SSH
    proc = subprocess.Popen([sys.executable, "-m", "x1_pretrain.stack", "up", "--env-file", str(env_file),
                             "--workspace", str(ws.root), "--no-prometheus"],
                            stdin=terminal, stdout=terminal, stderr=terminal, cwd=workspace.REPO,
                            env=cli_env(OMP_NUM_THREADS="1"), start_new_session=True)
    os.close(terminal)
    shown: list[bytes] = []

    def read_terminal() -> None:
        with contextlib.suppress(OSError):
            while chunk := os.read(master, 65536):
                shown.append(chunk)

    threading.Thread(target=read_terminal, daemon=True).start()
    live = Live(ws.root, env_file, {})
    try:
        live.wait_training_past(2, timeout=300)
        os.close(master)  # the session drops: the terminal is gone ...
        proc.send_signal(signal.SIGHUP)  # ... and its process gets SIGHUP
        wait_for(lambda: "SIGHUP: the terminal is gone; the stack keeps running" in ws.log("stack").read_text(), 30,
                 "the runner's line about the hangup")
        time.sleep(2)
        assert proc.poll() is None  # the runner is still there, supervising
        st = live.status()
        assert st["running"] and st["orphaned"] == [] and st["trainer"]["running"], st
        assert all(svc["running"] and svc["health"] == "healthy" for svc in st["services"].values()), st["services"]
        step = live.step()
        live.wait_training_past(step + 2)  # training goes on

        proc.kill()  # now the runner dies with no chance to clean up
        proc.wait(30)
        trainer = workspace.trainer_pid(ws)
        status = stack("status", "--workspace", str(ws.root), timeout=60)
        assert status.returncode == 1, status.stdout + status.stderr
        assert "its runner is gone, but mlflow-server, budget-sidecar, watchdog, trainer still run" in status.stdout
        assert re.search(rf"trainer\s+pid {trainer}: step \d+/5000 \(training", status.stdout), status.stdout
        assert "not running" not in status.stdout
        assert set(live.status()["orphaned"]) == {"mlflow-server", "budget-sidecar", "watchdog", "trainer"}

        left = live.processes()
        down = stack("down", "--workspace", str(ws.root))
        assert down.returncode == 0, down.stdout + down.stderr
        assert "the runner was gone; stopped what it left running: watchdog (pid" in down.stdout
        assert "trainer: exit 75 (stop requested, not relaunched)" in down.stdout
        preempted = int(re.findall(r"preempted at step (\d+): checkpoint", live.trainer_log())[-1])
        assert (ws.checkpoints / "latest").read_text().strip() == f"step_{preempted:08d}"
        assert all(L.proc_start_ticks(pid) is None for pid in [*left.values(), trainer] if pid != left["runner"])
    finally:
        if proc.poll() is None:
            proc.kill()
        stack("down", "--workspace", str(ws.root))


# ---------------------------------------------------------------------------------------------
# One stack's life


class Live:
    def __init__(self, ws: Path, env_file: Path, settings: dict[str, str]) -> None:
        self.ws = workspace.Workspace(ws)
        self.env_file = env_file
        self.settings = settings

    def up(self) -> subprocess.CompletedProcess[str]:
        return stack("up", "-d", "--env-file", str(self.env_file), "--workspace", str(self.ws.root),
                     env=cli_env(OMP_NUM_THREADS="1"))

    def status(self) -> dict:
        proc = stack("status", "--json", "--workspace", str(self.ws.root), timeout=60)
        return json.loads(proc.stdout)

    def events(self) -> list[dict]:
        return workspace.read_events(self.ws)

    def kinds(self) -> list[tuple]:
        return [(e["event"], e.get("exit_code"), e.get("stop_requested")) for e in self.events()]

    def step(self) -> int:
        beat = self.st_heartbeat()
        return beat.step if beat is not None and beat.phase == "training" else -1

    def st_heartbeat(self):
        from x1_common.contracts import Heartbeat

        return Heartbeat.read(self.ws.heartbeat)

    def trainer_log(self) -> str:
        return self.ws.log("trainer").read_text(encoding="utf-8", errors="replace")

    def wait_training_past(self, step: int, timeout: float = 240) -> int:
        return wait_for(lambda: self.step() >= step and self.step(), timeout, f"the trainer past step {step}")

    def processes(self) -> dict[str, int]:
        record = json.loads(self.ws.stack_file.read_text())
        return {"runner": record["runner"]["pid"], **{n: s["pid"] for n, s in record["services"].items()}}


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory, tiny_data: Path):
    root = tmp_path_factory.mktemp("stack")
    ws = root / "workspace"
    shutil.copytree(tiny_data, ws / "data" / "tokenized")
    settings = tiny_settings()
    env = Live(ws, write_env(root / ".env", **settings), settings)
    proc = env.up()
    assert proc.returncode == 0, proc.stdout + proc.stderr + (ws / "logs" / "stack.log").read_text()[-4000:]
    try:
        yield env
    finally:
        stack("down", "--workspace", str(ws))


@pytest.mark.slow
def test_up_starts_every_service_healthy_with_a_log_each_and_the_trainer_trains(live):
    st = live.status()
    assert st["running"] is True
    names = {"mlflow-server", "budget-sidecar", "watchdog"} | ({"prometheus"} if PROMETHEUS else set())
    assert set(st["services"]) == names
    assert all(s["running"] and s["health"] == "healthy" for s in st["services"].values()), st["services"]
    for name in names:
        assert live.ws.log(name).is_file()
    live.wait_training_past(4)
    assert re.search(r"step \d+/40 loss", live.trainer_log())  # the trainer's own log
    assert "step 2/40" not in live.ws.log("watchdog").read_text()
    # Every server on 127.0.0.1 only, at the .env's port.
    for var, name in (("MLFLOW_HOST_PORT", "mlflow-server"), ("SIDECAR_HOST_PORT", "budget-sidecar"),
                      ("WATCHDOG_METRICS_HOST_PORT", "watchdog"), ("TRAINER_METRICS_HOST_PORT", "trainer")):
        port = int(live.settings[var])
        with socket.socket() as s:
            assert s.connect_ex(("127.0.0.1", port)) == 0, name
        other = socket.gethostbyname(socket.gethostname())
        if other != "127.0.0.1" and not other.startswith("127."):
            with socket.socket() as s:
                s.settimeout(2)
                assert s.connect_ex((other, port)) != 0, f"{name} listens beyond 127.0.0.1"
    if PROMETHEUS:  # it scrapes the three /metrics, at 127.0.0.1 (the config it was given)
        url = f"http://127.0.0.1:{live.settings['PROMETHEUS_HOST_PORT']}/api/v1/query?query=" + urllib.parse.quote("up")

        def all_up() -> bool:
            result = process.http_json(url)["data"]["result"]
            return {r["metric"]["job"]: r["value"][1] for r in result} == {
                "trainer": "1", "budget-sidecar": "1", "watchdog": "1"}

        wait_for(all_up, 90, "Prometheus scraping trainer, sidecar and watchdog", interval=2)


@pytest.mark.slow
def test_status_reports_health_step_tokens_per_second_spend_and_the_last_decision(live):
    live.wait_training_past(6)
    proc = stack("status", "--workspace", str(live.ws.root), timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    text = proc.stdout
    assert re.search(rf"running \(runner pid \d+ on {re.escape(socket.gethostname())}", text)
    assert re.search(r"mlflow-server\s+healthy", text) and re.search(r"budget-sidecar\s+healthy", text)
    assert re.search(r"trainer\s+pid \d+: step \d+/40 \(training, heartbeat \d+ s ago\), [\d,]+ tok/s, loss \d", text), text
    assert re.search(r"spend: \$\d+\.\d\d of the \$35 cap .*\$0\.1/h, static", text), text
    assert "watchdog's last decision: started the trainer" in text
    st = live.status()
    assert st["trainer"]["tokens_per_s"] > 0 and st["budget"]["provider"] == "static"


@pytest.mark.slow
def test_a_second_up_is_refused_and_leaves_the_running_stack_alone(live):
    before = live.processes()
    record = live.ws.stack_file.read_bytes()
    events = live.events()
    step = live.step()
    proc = live.up()
    assert proc.returncode == 2, proc.stdout + proc.stderr
    runner = L.read_owner(live.ws.root)
    assert f"a stack is already running in {live.ws.root}: host {socket.gethostname()}, pid {before['runner']}, " \
           f"since 20" in proc.stderr
    assert runner.pid == before["runner"]
    assert live.processes() == before and live.ws.stack_file.read_bytes() == record and live.events() == events
    assert all(L.proc_start_ticks(pid) is not None for pid in before.values())
    live.wait_training_past(step + 2)  # the trainer goes on


@pytest.mark.slow
def test_sigterm_to_the_trainer_is_a_preemption_the_watchdog_relaunches(live):
    pid = workspace.trainer_pid(live.ws)
    assert pid is not None
    os.kill(pid, signal.SIGTERM)
    wait_for(lambda: len(live.events()) >= 4, 120, "the relaunch")
    assert live.kinds() == [("start", None, None), ("exit", 75, False), ("relaunch", 75, None), ("start", None, None)]
    assert live.events()[3]["resume"] is True
    step = int(re.findall(r"preempted at step (\d+): checkpoint", live.trainer_log())[-1])
    wait_for(lambda: f"resuming from {live.ws.checkpoints / f'step_{step:08d}'} at step {step}" in live.trainer_log(),
             120, "the relaunched trainer's resume")
    # Its downtime: the SIGTERM -> the relaunched process's first step, as the trainer logged it.
    (restart,) = wait_for(lambda: live.status()["restarts"] if "start record" in live.trainer_log().split(
        "resuming from")[-1] else None, 120, "the relaunched trainer's first step")
    assert (restart["cause"], restart["stopped_by"], restart["stopped_at_step"]) == ("preempted", "SIGTERM", step)
    assert restart["resumed_first_step"] == step + 1 and restart["downtime_seconds"] > 0
    status = stack("status", "--workspace", str(live.ws.root), timeout=60).stdout
    assert f"restart 1: {restart['downtime_seconds']:.1f} s down (preempted, exit 75): SIGTERM at step {step}" in status
    assert f"{restart['downtime_seconds']:.1f} s since the previous process's SIGTERM at step {step}" in live.trainer_log()


@pytest.mark.slow
def test_down_stops_the_trainer_first_with_its_emergency_checkpoint_recorded_as_requested(live):
    live.wait_training_past(int(re.findall(r"resuming from .* at step (\d+)", live.trainer_log())[-1]) + 2)
    pids = live.processes()
    proc = stack("down", "--workspace", str(live.ws.root))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "trainer: exit 75 (stop requested, not relaunched)" in proc.stdout
    assert live.kinds()[-1] == ("exit", 75, True)
    assert [k for k, *_ in live.kinds()].count("start") == 2  # no relaunch after the requested stop
    step = int(re.findall(r"preempted at step (\d+): checkpoint", live.trainer_log())[-1])
    assert (live.ws.checkpoints / "latest").read_text().strip() == f"step_{step:08d}"
    assert all(L.proc_start_ticks(pid) is None for pid in pids.values())  # every process gone
    assert not (live.ws.root / L.LEASE_FILE).exists() and not (live.ws.checkpoints / L.LEASE_FILE).exists()
    for var in workspace.PORT_VARS.values():
        assert workspace.port_is_free(int(live.settings[var])), var
    stack_log = live.ws.log("stack").read_text()
    order = [stack_log.index(f"{name:15s} stopped") for name in ("watchdog", "budget-sidecar", "mlflow-server")]
    assert order == sorted(order)  # the trainer (through the watchdog) first
    assert json.loads(live.ws.stack_file.read_text())["state"] == "stopped"
    status = stack("status", "--workspace", str(live.ws.root), timeout=60)
    assert status.returncode == 1 and "not running (last state: stopped)" in status.stdout
    assert "trainer exited 75 (stop requested)" in status.stdout


@pytest.mark.slow
def test_up_again_resumes_with_no_step_lost(live):
    step = int(re.findall(r"preempted at step (\d+): checkpoint", live.trainer_log())[-1])
    proc = live.up()
    assert proc.returncode == 0, proc.stdout + proc.stderr
    wait_for(lambda: f"resuming from {live.ws.checkpoints / f'step_{step:08d}'} at step {step}" in live.trainer_log(),
             180, f"the resume at step {step}")
    assert live.kinds()[-1] == ("start", None, None) and live.events()[-1]["resume"] is True
    live.wait_training_past(step + 2)


@pytest.mark.slow
def test_up_after_a_power_cut_takes_the_dead_runners_lease_over_and_continues_the_run(live):
    live.wait_training_past(int(re.findall(r"resuming from .* at step (\d+)", live.trainer_log())[-1]) + 2)
    # The pod stops: every process dies at once, no handler runs, the leases stay behind.
    doomed = live.processes()
    doomed["trainer"] = workspace.trainer_pid(live.ws)
    for pid in doomed.values():
        process.signal_group(pid, signal.SIGKILL) if pid != doomed["runner"] else os.kill(pid, signal.SIGKILL)
    wait_for(lambda: all(L.proc_start_ticks(p) is None for p in doomed.values()), 30, "every process dead")
    latest = (live.ws.checkpoints / "latest").read_text().strip()
    resumes = live.trainer_log().count("resuming from")
    assert (live.ws.root / L.LEASE_FILE).exists()
    proc = live.up()
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert re.search(rf"lease on workspace .* taken over from stack host \S+, pid {doomed['runner']}",
                     live.ws.log("stack").read_text())
    step = int(latest.removeprefix("step_"))
    wait_for(lambda: live.trainer_log().count("resuming from") > resumes, 180, "the resume after the power cut")
    assert live.trainer_log().rsplit("resuming from", 1)[1].startswith(f" {live.ws.checkpoints / latest} at step {step}")
    assert re.search(rf"taken over from trainer host \S+, pid {doomed['trainer']}, .*not running", live.trainer_log())


@pytest.mark.slow
def test_a_finished_run_is_final_and_up_again_does_not_relaunch_it(live):
    wait_for(lambda: (workspace.read_json(live.ws.state_file) or {}).get("final"), 400, "the run to finish")
    final = workspace.read_json(live.ws.state_file)["final"]
    assert (final["exit_code"], final["reason"]) == (0, "finished")
    assert (live.ws.checkpoints / "final.safetensors").is_file()
    # The watchdog holds (compose's restart policy would loop an exiting one): the stack stays up.
    st = live.status()
    assert st["running"] and st["services"]["watchdog"]["health"] == "healthy" and st["trainer"]["pid"] is None
    assert stack("down", "--workspace", str(live.ws.root)).returncode == 0
    starts = [k for k, *_ in live.kinds()].count("start")
    proc = live.up()
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "final decision: finished (exit 0" in proc.stdout
    wait_for(lambda: "holds a final decision" in live.ws.log("watchdog").read_text(), 60, "the watchdog's refusal")
    time.sleep(3)
    assert [k for k, *_ in live.kinds()].count("start") == starts and workspace.trainer_pid(live.ws) is None


# ---------------------------------------------------------------------------------------------
# docs/DEPLOY.md's RunPod section runs as written

DEPLOY = Path(__file__).resolve().parents[1] / "docs" / "DEPLOY.md"


def runpod_section() -> str:
    text = DEPLOY.read_text(encoding="utf-8")
    start = re.search(r"^## \d+\. RunPod", text, re.M)
    assert start is not None, "docs/DEPLOY.md has no numbered RunPod section"
    return text[start.start():text.index("## Security notes")]


def test_every_stack_command_in_the_runpod_section_is_accepted_by_the_cli():
    commands = re.findall(r"python -m x1_pretrain\.stack ([a-z]+(?: [^`\n|';]*)?)", runpod_section())
    assert {c.split()[0] for c in commands} == {"prepare", "up", "status", "down"}, commands
    parser = stack_mod.build_parser()
    for command in commands:
        args = parser.parse_args(command.replace("\\", "").split())
        assert args.workspace.root == Path("/workspace")


def test_the_pod_start_command_waits_for_a_set_up_then_runs_up_from_the_volume(tmp_path):
    start = re.search(r"```sh\n(bash -c '.*')\n```", runpod_section())[1]
    volume = tmp_path / "volume"
    command = start.replace("/workspace", str(volume))
    # Not set up yet: it waits (the pod stays up for you to set it up), starting nothing.
    proc = subprocess.Popen(["bash", "-c", command], start_new_session=True)
    try:
        with pytest.raises(subprocess.TimeoutExpired):
            proc.wait(2)
        assert not volume.exists()
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)
    # Set up: the venv's python, .env beside the code, the tokenized data; it execs `stack up`.
    (volume / "venv" / "bin").mkdir(parents=True)
    (volume / "venv" / "bin" / "python").write_text(f"#!/bin/sh\nexec {sys.executable} \"$@\"\n")
    (volume / "venv" / "bin" / "python").chmod(0o755)
    (volume / "x1").mkdir()
    write_env(volume / "x1" / ".env", **tiny_settings(PROVIDER="aws"))  # refused at once: proves the path taken
    (volume / "data" / "tokenized").mkdir(parents=True)
    (volume / "data" / "tokenized" / "meta.json").write_text("{}")
    done = subprocess.run(["bash", "-c", command], capture_output=True, text=True, timeout=120, env=cli_env())
    assert done.returncode == 2 and "PROVIDER='aws' must be lambda, runpod or static" in done.stderr, done.stderr
