"""What a person checking a paid run sees first: `stack status`'s at-a-glance line and the
/metrics series behind it (% done, ETA, spend so far, projected spend at the finish, restarts,
the last decision), from the files a run leaves in its workspace."""

from __future__ import annotations

import json
import time

from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from x1_common import contracts as C
from x1_pretrain.stack.status import collect_status, render_status
from x1_pretrain.stack.workspace import Workspace
from x1_watchdog.metrics import WatchdogMetrics
from x1_watchdog.records import EventLog

BUDGET_LINE = ("12:00:00 INFO x1.budget_guard: budget: continue: spent $10.50 at $1.10/h; still needed: 20,000 steps x "
               "1.92 s (measured: rolling over 900 steps) + ... = 11.7 h billed, +10% -> own $24.66; sidecar's "
               "$11.02: projected $24.66 of $35\n")


def workspace(tmp_path, final=None):
    ws = Workspace(tmp_path)
    ws.logs.mkdir(parents=True)
    (ws.logs / "trainer.log").write_text(
        "12:00:00 INFO x1.train: step 30000/50000 loss 3.7000 lr 3.00e-04 grad 0.300 tok/s 273000 mfu 0.53\n"
        + BUDGET_LINE)
    ws.heartbeat.write_text(json.dumps({"step": 30000, "time": time.time(), "pid": 1, "phase": "training"}))
    ws.budget_file.write_text(json.dumps({"spent_usd": 10.5, "cap_usd": 35, "projected_total_usd": 11.02,
                                          "rate_usd_per_hr": 1.1, "last_update_utc": "2026-12-04T12:00:00Z",
                                          "stale": False, "source": "provider-api", "provider": "lambda"}))
    ws.state_file.write_text(json.dumps({"version": 1, "final": final, "starts": 3, "restarts_total": 2}))
    EventLog(ws.events_file).write("relaunch", restart=2, reason="preempted", exit_code=75, downtime_seconds=21.0)
    return ws


def test_status_shows_percent_done_eta_spend_projection_restarts_and_the_last_decision(tmp_path):
    st = collect_status(workspace(tmp_path))
    glance = st["at_a_glance"]
    assert glance["percent_done"] == 60.0 and glance["eta_hours"] == 11.7
    assert glance["spent_usd"] == 10.5 and glance["projected_at_finish_usd"] == 24.66 and glance["restarts"] == 2
    assert glance["last_decision"].startswith("relaunch #2 after preempted (exit 75)")
    line = next(ln for ln in render_status(st).splitlines() if "at a glance" in ln)
    assert ("60.0% done, ETA 11.70 h, spent $10.50, projected $24.66 at the finish (the trainer's, at its measured "
            "pace), restarts 2; last decision: relaunch #2 after preempted") in line


def test_a_stopped_run_shows_no_eta_and_its_spend_as_the_projection(tmp_path):
    st = collect_status(workspace(tmp_path, final={"exit_code": 76, "reason": "budget-stop", "time": "t"}))
    assert st["at_a_glance"]["eta_hours"] is None
    assert st["at_a_glance"]["projected_at_finish_usd"] == 10.5  # not the trainer's last $24.66 nor the sidecar's
    assert "ETA: none (stopped)" in render_status(st)


def test_the_watchdogs_metrics_carry_its_last_decision(tmp_path):
    metrics = WatchdogMetrics()
    events = EventLog(tmp_path / "events.jsonl")
    events.on_write = metrics.last_decision
    events.write("exit", pid=7, exit_code=76, reason="budget-stop")
    families = {f.name: f for f in text_string_to_metric_families(generate_latest(metrics.registry).decode())}
    [family] = [f for name, f in families.items() if name.startswith(C.M_WATCHDOG_LAST_DECISION)]
    [sample] = family.samples
    assert sample.labels["event"] == "exit" and sample.labels["exit_code"] == "76"
    assert sample.labels["reason"] == "budget-stop" and sample.labels["time"]


def test_status_shows_the_trainers_last_forecast(tmp_path):
    from x1_pretrain.train.forecast import Forecast

    ws = workspace(tmp_path)
    assert collect_status(ws)["forecast"] is None  # no eval yet: nothing to show
    early = Forecast(step=1800, total_steps=50000, law="lr-annealing", reason="1 evals past the warm-up").line()
    later = Forecast(step=28800, total_steps=50000, law="lr-annealing", value=3.412, low=3.351, high=3.478,
                     val_points=15, train_points=80).line()
    with open(ws.logs / "trainer.log", "a") as f:
        f.write(f"12:01:00 INFO x1.forecast: {early}\n12:02:00 INFO x1.forecast: {later}\n")
    st = collect_status(ws)
    assert st["forecast"] == "final val loss 3.412 [3.351, 3.478] at step 50000, made at step 28800"
    assert "  forecast: final val loss 3.412 [3.351, 3.478] at step 50000" in render_status(st)
