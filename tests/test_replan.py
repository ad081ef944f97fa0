"""Continuing after a budget stop with the steps that fit (a re-plan).

End to end on the tiny CPU config: the watchdog (process mode) supervises the real trainer with
the budget guard on, reading a budget.json this test keeps fresh at a static rate. The rate is
high enough that the run's 2,000 steps cannot fit the cap at the pace the trainer measures: it
checkpoints and exits 76, naming the steps that fit. The watchdog records the stop for that
plan; started again with the total the stop proposed (as `stack up --total-steps N` and compose's
TOTAL_STEPS=N start it), it sets the stop aside for that re-plan, and the trainer resumes without
--allow-config-change, records the change, re-targets its cosine and finishes.

The spend in budget.json is held still (a fixed `spent_usd`, a fresh timestamp every 50 ms): the
run's own projection — its measured pace times the rate — then alone decides, whatever the
speed of the machine running the test.
"""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
import threading
from collections.abc import Iterator
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import pytest

from conftest import REPO, TINY_CONFIG, cli_env, train_args
from x1_pretrain.checkpoint.store import TrainerState
from x1_pretrain.config import load_config
from x1_pretrain.train.schedule import lr_at
from x1_watchdog.records import StateStore

pytestmark = pytest.mark.slow

CAP = 1000.0
SPENT = 100.0
# $900 left at $400,000/h buys ~7 s of billed time with the 10% margin: a few dozen to a few
# hundred tiny CPU steps, never the 2,000 planned.
RATE = 400_000.0
PLANNED = 2000
TIMEOUT = 300.0


class StaticMeter:
    """budget.json as the sidecar writes it for a static rate, with the spend held at SPENT."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._stop = threading.Event()
        self.write()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()

    def write(self) -> None:
        now = datetime.now(timezone.utc).isoformat().replace("+00:00", "Z")
        doc = {"spent_usd": SPENT, "rate_usd_per_hr": RATE, "hours_elapsed": SPENT / RATE,
               "projected_total_usd": SPENT, "last_update_utc": now, "cap_usd": CAP, "provider": "static",
               "instance_id": "", "source": "static", "stale": False}
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_text(json.dumps(doc))
        os.replace(tmp, self.path)

    def _loop(self) -> None:
        while not self._stop.wait(0.05):
            self.write()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)


@pytest.fixture
def meter(tmp_path: Path) -> Iterator[StaticMeter]:
    m = StaticMeter(tmp_path / "budget.json")
    yield m
    m.close()


def watchdog(tmp_path: Path, data: Path, total: int) -> subprocess.CompletedProcess[str]:
    """The watchdog with the run planned at `total` steps, as the stack and compose start it."""
    ckpt = tmp_path / "ckpt"
    trainer = train_args(data, ckpt, f"file://{tmp_path}/mlruns", "--log-every", "5", "--ckpt-every", "1000",
                         "--eval-every", "1000", "--budget-cap-usd", str(CAP), "--budget-curr-cost-uri",
                         str(tmp_path / "budget.json"), "--budget-check-every-min", "0.002", "--max-price-usd-per-hr", str(RATE),
                         "--budget-alert-usd", str(CAP), total=total)
    argv = [sys.executable, "-m", "x1_watchdog", "--mode", "process", "--heartbeat-file", str(ckpt / "heartbeat.json"),
            "--events-file", str(tmp_path / "events.jsonl"), "--state-file", str(tmp_path / "state.json"),
            "--trainer-log", str(tmp_path / "trainer.log"), "--port", "0", "--total-steps", str(total),
            "--", sys.executable, "-m", "x1_pretrain.train", *trainer]
    return subprocess.run(argv, capture_output=True, text=True, timeout=TIMEOUT, cwd=REPO,
                          env=cli_env(MLFLOW_ALLOW_FILE_STORE="true"))


def latest_state(ckpt: Path) -> dict[str, Any]:
    return json.loads((ckpt / (ckpt / "latest").read_text().strip() / "trainer_state.json").read_text())


def test_budget_stop_then_replan_resumes_without_allow_config_change(tmp_path, tiny_data, meter, monkeypatch) -> None:
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # this test reads the trainer's file store
    ckpt = tmp_path / "ckpt"
    first = watchdog(tmp_path, tiny_data, PLANNED)
    log = (tmp_path / "trainer.log").read_text()
    assert first.returncode == 76, first.stderr[-3000:] + log[-3000:]

    # The stop names the exact command, and the watchdog keeps it as final for that plan.
    found = re.search(r"--total-steps (\d+) fits \(of 2,000\): continue with `--resume-from-latest --total-steps (\d+)`",
                      log)
    assert found and found[1] == found[2], log[-3000:]
    fits = int(found[1])
    stop = json.loads((ckpt / "budget-stop.json").read_text())
    stopped_at = latest_state(ckpt)["step"]
    assert stop["step"] == stopped_at and stop["total_steps"] == PLANNED and stop["fits_steps"] == fits
    assert stopped_at < fits < PLANNED
    state = json.loads((tmp_path / "state.json").read_text())
    assert state["final"]["exit_code"] == 76 and state["final"]["total_steps"] == PLANNED

    # The same plan again: the stop is honoured, the trainer not launched.
    again = watchdog(tmp_path, tiny_data, PLANNED)
    assert again.returncode == 76 and "not launching the trainer" in again.stderr
    assert (tmp_path / "trainer.log").read_text() == log

    # The re-plan: half way from the stop to what fits leaves room for a slower machine after the restart.
    replanned = stopped_at + max(1, (fits - stopped_at) // 2)
    second = watchdog(tmp_path, tiny_data, replanned)
    log = (tmp_path / "trainer.log").read_text()
    assert second.returncode == 0, second.stderr[-3000:] + log[-3000:]
    assert "set aside for --total-steps" in second.stderr
    assert "--allow-config-change" not in log.split("re-plan at step")[0][-2000:]
    assert f"re-plan at step {stopped_at}: train.total_steps {PLANNED} -> {replanned}" in log
    assert (ckpt / "final.safetensors").is_file()

    # Recorded: the trainer state, the watchdog's state and events, MLflow.
    final_state = TrainerState.from_json((ckpt / (ckpt / "latest").read_text().strip() / "trainer_state.json").read_text())
    assert final_state.step == replanned
    [r] = final_state.replans
    assert (r["step"], r["old_total_steps"], r["new_total_steps"]) == (stopped_at, PLANNED, replanned)
    assert "budget stop at step" in r["why"] and r["time_utc"]
    state = json.loads((tmp_path / "state.json").read_text())
    assert state["final"]["exit_code"] == 0 and state["replans"][0]["total_steps"] == PLANNED
    events = [json.loads(line) for line in (tmp_path / "events.jsonl").read_text().splitlines()]
    assert [e["new_total_steps"] for e in events if e["event"] == "replan"] == [replanned]

    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"file://{tmp_path}/mlruns")
    run_id = json.loads((ckpt / "mlflow-run.json").read_text())["run_id"]
    tag = json.loads(client.get_run(run_id).data.tags["x1.replan.1"])
    assert tag["new_total_steps"] == replanned and tag["old_total_steps"] == PLANNED
    assert [m.value for m in client.get_metric_history(run_id, "replan_total_steps")] == [replanned]

    # No jump in the learning rate: at the stop's step the re-targeted schedule gives the old value,
    # and every lr logged after it follows the re-targeted cosine down to min_lr at the new end.
    optim = load_config(TINY_CONFIG).optim
    assert r["lr_at_step"] == pytest.approx(lr_at(stopped_at, optim, PLANNED))
    assert lr_at(stopped_at, optim, replanned, r) == pytest.approx(r["lr_at_step"])
    assert lr_at(replanned, optim, replanned, r) == pytest.approx(optim.min_lr)
    logged = {m.step: m.value for m in client.get_metric_history(run_id, "lr")}
    after = [s for s in logged if s > stopped_at]
    assert after, logged
    for s in after:  # logged at step s: the lr of the step that took it there
        assert logged[s] == pytest.approx(lr_at(s - 1, optim, replanned, r), rel=1e-6)


def test_a_replan_above_what_fitted_the_budget_stop_is_refused_naming_the_steps(tmp_path, tiny_data, meter) -> None:
    first = watchdog(tmp_path, tiny_data, PLANNED)
    assert first.returncode == 76, first.stderr[-3000:]
    fits = json.loads((tmp_path / "ckpt" / "budget-stop.json").read_text())["fits_steps"]
    too_many = watchdog(tmp_path, tiny_data, fits + 1)
    assert too_many.returncode == 2, too_many.stderr[-3000:]
    log = (tmp_path / "trainer.log").read_text()
    assert f"--total-steps {fits + 1}: more than the {fits} steps that fitted the cap" in log
    assert f"give --total-steps {fits} or fewer" in log


def test_a_budget_stop_is_set_aside_only_for_a_plan_with_other_total_steps(tmp_path) -> None:
    path = tmp_path / "state.json"
    store = StateStore(path, total_steps=400)
    store.record_start()
    store.record_final(76, "budget-stop")
    assert StateStore(path).clear_for_replan() is None  # no total given: honoured
    assert StateStore(path, total_steps=400).clear_for_replan() is None  # the same plan: honoured
    cleared = StateStore(path, total_steps=170).clear_for_replan()
    assert cleared is not None and cleared["total_steps"] == 400 and cleared["new_total_steps"] == 170
    replanned = StateStore(path, total_steps=170)
    assert replanned.final is None and replanned.starts == 1  # the trainer resumes, it does not start over
    replanned.record_final(76, "budget-stop")  # the re-plan stopped too: its own decision, for 170
    assert StateStore(path, total_steps=170).clear_for_replan() is None
    finished = StateStore(path, total_steps=150)
    finished.record_final(0, "finished")
    assert StateStore(path, total_steps=120).clear_for_replan() is None  # only budget decisions are set aside


def test_the_cosine_retargeted_at_a_replan_keeps_the_learning_rate_and_ends_at_min_lr() -> None:
    optim = load_config(TINY_CONFIG).optim
    old, new, s0 = 2000, 120, 60
    from x1_pretrain.train.schedule import lr_progress

    r = {"step": s0, "lr_progress": lr_progress(s0, optim, old)}
    assert lr_at(s0, optim, new, r) == pytest.approx(lr_at(s0, optim, old))
    assert lr_at(new, optim, new, r) == pytest.approx(optim.min_lr)
    lrs = [lr_at(s, optim, new, r) for s in range(s0, new + 1)]
    assert all(a >= b for a, b in zip(lrs[:-1], lrs[1:], strict=True))  # decays monotonically
    # The plain schedule at the new total would have jumped at s0:
    assert not math.isclose(lr_at(s0, optim, new), lr_at(s0, optim, old), rel_tol=1e-3)
