"""bench/restart_cost.py on CPU with the tiny config: the real trainer under the watchdog in
process mode, a SIGTERM, the relaunch and resume, the finish. What it reports comes from the run
folder the trainer wrote itself (--run-dir): each start's time to first step and the preemption's
downtime, in the manifest and in MLflow."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO, TINY_CONFIG, cli_env

pytestmark = pytest.mark.slow


def test_a_preemption_is_measured_from_the_exit_to_the_relaunched_process_first_step(tiny_data: Path,
                                                                                     tmp_path: Path) -> None:
    out = tmp_path / "rc"
    proc = subprocess.run(
        [sys.executable, str(REPO / "bench" / "restart_cost.py"), "--data-dir", str(tiny_data), "--out", str(out),
         "--config", str(TINY_CONFIG), "--steps", "16", "--sigterm-at", "8", "--log-every", "4", "--spike-at", "5"],
        capture_output=True, text=True, timeout=400, env=cli_env(), cwd=REPO)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    summary = json.loads((out / "restart-cost.json").read_text())
    assert summary["events"] == [["start", None], ["exit", 75], ["relaunch", 75], ["start", None], ["exit", 0]]

    # Two processes, each with its own log, each measured from its start to its first step.
    first, second = summary["starts"]
    assert first["first_step"] == 1 and second["first_step"] > summary["sigterm"]["step"] - 4
    assert all(0 < s["startup_seconds"] < 120 for s in summary["starts"])
    logs = [p["log"] for p in summary["processes"]]
    assert len(logs) == 2 and len(set(logs)) == 2
    assert summary["processes"][0]["emergency_checkpoint_seconds"] is not None
    assert "resuming from" in (out / "logs" / logs[1]).read_text()
    assert f"===== {logs[0]}" in proc.stdout and f"===== {logs[1]}" in proc.stdout

    # The restart: exit 75 -> the relaunched process's first step, which holds the watchdog's backoff
    # and that process's startup.
    (restart,) = summary["restarts"]
    assert restart["exit_code"] == 75 and restart["cause"] == "preempted" and restart["stopped_by"] == "SIGTERM"
    assert restart["resumed_first_step"] == second["first_step"]
    assert restart["downtime_seconds"] >= restart["relaunch_delay_seconds"] + restart["startup_seconds"] - 1.0
    assert restart["downtime_seconds"] < restart["relaunch_delay_seconds"] + restart["startup_seconds"] + 30
    assert "SIGTERM at step" in proc.stdout and f"restart 1: {restart['downtime_seconds']:.1f} s down" in proc.stdout

    # The manifest says it, consistently with how the run ended.
    manifest = json.loads((out / "run" / "manifest.json").read_text())
    assert manifest["end"] == "finished" and "preempted" not in manifest["end_detail"]
    assert manifest["restarts"] == 1 and manifest["restart_cost"]["downtime_seconds_total"] == restart["downtime_seconds"]

    # MLflow holds the trainer's own numbers: one startup per process, one downtime for the resume.
    from x1_pretrain.run.record import load_run

    record = load_run(f"file://{out / 'mlruns'}", manifest["mlflow"]["run_id"])
    assert len(record.raw["startup_seconds"]) == 2
    ((step, _, value),) = record.raw["downtime_seconds"]
    assert step == second["first_step"] and value == restart["downtime_seconds"]  # one figure

    # The trainer wrote its run folder at the finish: export, post-mortem, dod with check 6 pending.
    dod = json.loads((out / "run" / "dod.json").read_text())
    assert dod["pending"] == [6] and (out / "run" / "spike-postmortem.md").is_file()
