"""A fixed mistake unblocks the run: a bad-config (2) or start-up-failure (81) decision holds only
while the trainer is given what it was refused for (x1_watchdog.inputs).

- the watchdog (from its trainer command, or the container compose created) and the trainer's own
  launcher (trainer/entrypoint.sh's gate) read the same inputs, in process and in compose mode;
- the real launcher refuses the same inputs, trains on changed ones (a flag, the data's meta.json),
  and never on a finished run; `gate --clear` sets any decision aside by hand;
- in docker mode a watchdog holding after exit 2 sees compose recreate the trainer container from a
  fixed .env, sets the decision aside and supervises it (the fake engine on a real socket).

The process stack's whole path (exit 2 from a changed TOTAL_STEPS, the fix, a plain `up`, the
resume from the checkpoint) is tests/test_stack.py's live sequence.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from fake_docker_engine import FakeEngine

from conftest import REPO, cli_env, free_port, wait_for
from x1_pretrain.stack import services as S
from x1_watchdog.inputs import command_inputs, trainer_inputs
from x1_watchdog.records import StateStore

ENTRYPOINT = REPO / "trainer" / "entrypoint.sh"
NAME = "x1-trainer"


def tiny_settings() -> S.Settings:
    return S.Settings({"PROVIDER": "static", "RATE_USD_PER_HR": "0.10", "X1_CONFIG": "configs/tiny-cpu.yaml",
                       "TOTAL_STEPS": "40", "TRAIN_EXTRA_ARGS": "--run-name tiny", "SMTP_HOST": "mail.test"})


def test_the_watchdog_and_the_trainers_launcher_read_the_same_inputs(tmp_path):
    settings = tiny_settings()
    # Process mode: the watchdog runs `env -u ... bash entrypoint.sh ARGS` with its own environment;
    # the launcher sees ARGS as "$@" and the trainer's environment.
    running = S.services(settings, S.process_mode(tmp_path, sys.executable, REPO))
    watchdog, trainer = running["watchdog"], running["trainer"]
    child = watchdog.argv[watchdog.argv.index("--") + 1:]
    seen_by_watchdog = command_inputs(child, {**os.environ, **watchdog.env})
    seen_by_launcher = trainer_inputs(trainer.argv[2:], {**trainer.env, **trainer.image_env})
    assert seen_by_watchdog == seen_by_launcher
    assert "--total-steps=40" in seen_by_watchdog["args"] and seen_by_watchdog["env"]["SMTP_HOST"] == "mail.test"
    assert seen_by_watchdog["config_sha256"] is not None  # process mode: both read configs/tiny-cpu.yaml
    # Compose: the watchdog reads the container's Cmd and Env; the launcher runs as x1-train ARGS.
    composed = S.services(settings, S.COMPOSE)["trainer"]
    assert command_inputs(composed.argv, composed.env) == trainer_inputs(composed.argv[1:], composed.env)


# ---------------------------------------------------------------------------------------------
# The trainer's launcher (trainer/entrypoint.sh), run as it is


@pytest.fixture()
def launcher(tmp_path: Path):
    """trainer/entrypoint.sh with X1_PYTHON a stand-in that runs the gate for real and, for the
    trainer, only notes that it was started."""
    trained = tmp_path / "trained"
    python = tmp_path / "python"
    python.write_text(f"#!/bin/sh\nif [ \"$2\" = x1_pretrain.train ]; then echo \"$@\" > {trained}; exit 0; fi\n"
                      f"exec {sys.executable} \"$@\"\n")
    python.chmod(0o755)
    state_file = tmp_path / "logs" / "watchdog-state.json"

    def run(*args: str, **env: str) -> tuple[subprocess.CompletedProcess[str], bool]:
        trained.unlink(missing_ok=True)
        proc = subprocess.run(["bash", str(ENTRYPOINT), *args], capture_output=True, text=True, timeout=60, cwd=REPO,
                              env=cli_env(X1_PYTHON=str(python), X1_WATCHDOG_STATE_FILE=str(state_file), **env))
        return proc, trained.exists()

    run.state_file = state_file  # type: ignore[attr-defined]
    return run


def refused(state_file: Path, code: int, args: list[str], env: dict[str, str]) -> None:
    """A state file whose final decision `code` refused a launch of `args` with `env`."""
    state = StateStore(state_file)
    state.record_start({"container": NAME}, trainer_inputs(args, env))
    state.record_final(code, {2: "bad-config", 81: "startup-failure", 0: "finished"}[code])


def test_the_launcher_refuses_the_same_inputs_and_trains_on_fixed_ones(launcher, tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    (data / "meta.json").write_text('{"train_tokens": 1000}')
    args = ["--config=configs/tiny-cpu.yaml", f"--data-dir={data}", "--total-steps=60", "--resume-from-latest"]
    refused(launcher.state_file, 2, args, os.environ)

    proc, trained = launcher(*args)
    assert proc.returncode == 2 and not trained
    assert "not training again" in proc.stderr and "once what it was refused for has changed" in proc.stderr

    fixed = [a if a != "--total-steps=60" else "--total-steps=40" for a in args]
    proc, trained = launcher(*fixed)
    assert proc.returncode == 0 and trained, proc.stderr
    assert "changed since: arguments --total-steps=60 (was), --total-steps=40 (now)" in proc.stderr

    # Bad data, re-prepared: the same flags, another meta.json.
    (data / "meta.json").write_text('{"train_tokens": 2000}')
    proc, trained = launcher(*args)
    assert proc.returncode == 0 and trained and "the data's meta.json (sha256" in proc.stderr
    # An extra flag through TRAIN_EXTRA_ARGS is an input too.
    (data / "meta.json").write_text('{"train_tokens": 1000}')
    proc, trained = launcher(*args, X1_TRAIN_EXTRA_ARGS="--allow-config-change")
    assert proc.returncode == 0 and trained and "X1_TRAIN_EXTRA_ARGS '' -> '--allow-config-change'" in proc.stderr
    assert json.loads(launcher.state_file.read_text())["final"]["exit_code"] == 2  # the launcher never writes it


def test_a_finished_run_or_a_budget_stop_holds_whatever_the_inputs(launcher):
    args = ["--config=configs/tiny-cpu.yaml", "--total-steps=60"]
    for code in (0, 76):
        launcher.state_file.unlink(missing_ok=True)
        state = StateStore(launcher.state_file)
        state.record_start(None, trainer_inputs(args, os.environ))
        state.record_final(code, "finished" if code == 0 else "budget-stop")
        assert "inputs" not in json.loads(launcher.state_file.read_text())["final"]
        proc, trained = launcher("--config=configs/tiny-cpu.yaml", "--total-steps=40")
        assert proc.returncode == code and not trained, proc.stderr


def test_gate_clear_sets_a_decision_aside_by_hand_and_the_next_launch_trains(launcher):
    args = ["--config=configs/tiny-cpu.yaml", "--total-steps=60"]
    refused(launcher.state_file, 2, args, os.environ)
    clear = subprocess.run([sys.executable, "-m", "x1_watchdog.gate", "--clear", str(launcher.state_file)],
                           capture_output=True, text=True, timeout=60)
    assert clear.returncode == 0 and "set aside" in clear.stderr and "resumes from its latest checkpoint" in clear.stderr
    state = json.loads(launcher.state_file.read_text())
    assert state["final"] is None and state["cleared"][0]["exit_code"] == 2
    proc, trained = launcher(*args)
    assert proc.returncode == 0 and trained


# ---------------------------------------------------------------------------------------------
# Docker mode: a held watchdog and a container compose recreated from a fixed .env


@pytest.fixture
def sock() -> Iterator[Path]:
    # AF_UNIX paths are limited to 107 bytes; pytest's tmp_path can be longer.
    short = Path(f"/tmp/x1-fix-docker-{os.getpid()}-{time.monotonic_ns() % 10**9}")
    short.mkdir()
    yield short / "docker.sock"
    for p in short.iterdir():
        p.unlink()
    short.rmdir()


def events(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def test_a_held_watchdog_supervises_the_container_compose_recreated_from_a_fixed_env(tmp_path, sock):
    composed = S.services(tiny_settings(), S.COMPOSE)["trainer"]
    wrong = S.services(S.Settings({**tiny_settings().values, "TOTAL_STEPS": "60"}), S.COMPOSE)["trainer"]
    engine = FakeEngine(sock, api_version="1.41", min_api_version="1.12")
    container = engine.add_container(NAME, running=True)
    container.cmd, container.env = wrong.argv, wrong.env
    state_file, events_file = tmp_path / "logs" / "state.json", tmp_path / "logs" / "events.jsonl"
    argv = [sys.executable, "-m", "x1_watchdog", "--mode", "docker", "--container", NAME, "--docker-socket", str(sock),
            "--heartbeat-file", str(tmp_path / "heartbeat.json"), "--events-file", str(events_file),
            "--state-file", str(state_file), "--port", str(free_port()), "--check-seconds", "0.2",
            "--stall-seconds", "0", "--hold-after-final"]
    with engine, open(tmp_path / "watchdog.log", "wb") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, cwd=tmp_path, env=cli_env())
        try:
            wait_for(lambda: [e["event"] for e in events(events_file)] == ["start"], 60, "the adoption")
            engine.exit(NAME, 2)  # the trainer refused its config
            final = wait_for(lambda: json.loads(state_file.read_text())["final"], 60, "the decision",
                             tolerate=(OSError, ValueError))
            assert final["exit_code"] == 2 and "--total-steps=60" in final["inputs"]["args"]
            time.sleep(6)  # the holding watchdog looks at the container: unchanged, it holds
            assert [e["event"] for e in events(events_file)] == ["start", "exit"] and container.starts == 0

            # `docker compose up -d` after the fix: a new container of the same name, started by compose.
            engine.recreate(NAME, composed.argv, composed.env, running=True)
            wait_for(lambda: [e["event"] for e in events(events_file)] == ["start", "exit", "fixed", "start"], 30,
                     "the fix seen and the container supervised")
            fixed = events(events_file)[2]
            assert "arguments --total-steps=60 (was), --total-steps=40 (now)" in fixed["changed"]
            assert json.loads(state_file.read_text())["final"] is None
            engine.exit(NAME, 0)  # supervised again: its end is the watchdog's decision
            wait_for(lambda: (json.loads(state_file.read_text())["final"] or {}).get("exit_code") == 0, 30,
                     "the finished run recorded", tolerate=(OSError, ValueError))
            assert proc.poll() is None  # holding again
        finally:
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=30)
