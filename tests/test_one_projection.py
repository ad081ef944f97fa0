"""One projection of the spend at the finish (x1_common.projection), wherever one is shown: `stack
status` (and `x1 status`, which shows status's), the forecast alert's `$X more to finish`, the
run folder's budget.json after the end, the sidecar's budget.json of a terminated instance.

The case that made them disagree: a run planned for 24 h (PLANNED_HOURS, the sidecar's guess at its
length) that its trainer knows will finish far sooner. The sidecar projects spent + rate x the
planned hours left; the trainer its steps left at its measured pace; after the end, the spend.
"""

from __future__ import annotations

import json
import re
import shutil
import time

from test_export_run import SPENT_USD, SpikedRun, spiked_run
from test_forecast import PRIORS, SCHEDULE, drawn_losses

from budget_sidecar.ledger import Ledger
from receivers import WebhookReceiver
from x1_common.alerts import AlertSender
from x1_common.projection import ENDED, SIDECARS, TRAINERS, at_finish
from x1_pretrain.stack.status import collect_status, render_status
from x1_pretrain.stack.workspace import Workspace
from x1_pretrain.train.budget_guard import Projection
from x1_pretrain.train.forecast import ForecastWatch
from x1_pretrain.train.tracking import NullSink
from x1_watchdog.records import EventLog

__all__ = ["spiked_run"]  # the shared session fixture, imported so pytest finds it here

# The demo's numbers: $5.00 spent at $1.10/h; the sidecar, planned for 24 h, projects $26.40; the
# trainer, 0.38 h from its last step, $5.46 (with its +10%).
SPENT, SIDECAR, OWN = 5.00, 26.40, 5.46
BUDGET_LINE = (f"12:00:00 INFO x1.budget_guard: budget: continue: spent ${SPENT:.2f} at $1.10/h; still needed: 600 steps "
               f"x 2.3 s (measured: rolling over 900 steps) + ... = 0.38 h billed, +10% -> own ${OWN:.2f}; sidecar's "
               f"${SIDECAR:.2f}: projected ${SIDECAR:.2f} of $35\n")


def workspace(root, final=None, spent=SPENT) -> Workspace:
    ws = Workspace(root)
    ws.logs.mkdir(parents=True, exist_ok=True)
    (ws.logs / "trainer.log").write_text(
        "12:00:00 INFO x1.train: step 400/1000 loss 3.7000 lr 3.00e-04 grad 0.300 tok/s 273000 mfu 0.53\n" + BUDGET_LINE)
    ws.heartbeat.write_text(json.dumps({"step": 400, "time": time.time(), "pid": 1, "phase": "training"}))
    ws.budget_file.write_text(json.dumps({"spent_usd": spent, "cap_usd": 35, "projected_total_usd": SIDECAR,
                                          "rate_usd_per_hr": 1.1, "last_update_utc": "2026-12-04T12:00:00Z",
                                          "stale": False, "source": "provider-api", "provider": "lambda"}))
    ws.state_file.write_text(json.dumps({"version": 1, "final": final, "starts": 1, "restarts_total": 0}))
    EventLog(ws.events_file).write("start", pid=1, resume=False)
    return ws


def projected_figures(text: str) -> list[str]:
    return re.findall(r"projected (\$[\d.]+)", text)


def test_the_projection_is_the_spend_once_ended_else_the_trainers_else_the_sidecars():
    assert at_finish(SPENT, trainer_usd=OWN, sidecar_usd=SIDECAR) == at_finish(SPENT, trainer_usd=OWN)
    assert at_finish(SPENT, trainer_usd=OWN, sidecar_usd=SIDECAR).source == TRAINERS
    assert at_finish(SPENT, sidecar_usd=SIDECAR).source == SIDECARS
    ended = at_finish(SPENT, trainer_usd=OWN, sidecar_usd=SIDECAR, ended=True)
    assert (ended.usd, ended.source, ended.more_usd) == (SPENT, ENDED, 0.0)
    assert at_finish(SPENT, trainer_usd=4.0).usd == SPENT  # a stale figure under the spend: the spend
    assert at_finish(None, sidecar_usd=SIDECAR) is None


def test_status_shows_one_projection_the_trainers_not_the_planned_hours(tmp_path):
    st = collect_status(workspace(tmp_path))
    assert st["at_a_glance"]["projected_at_finish_usd"] == OWN
    text = render_status(st)
    assert projected_figures(text) == [f"${OWN:.2f}"], text  # no second figure on the spend line
    assert f"projected ${OWN:.2f} at the finish ({TRAINERS})" in text


def test_the_forecast_alert_says_what_finishing_costs_by_the_same_projection():
    hook = WebhookReceiver()
    try:
        watch = ForecastWatch(schedule=SCHEDULE, priors=PRIORS, band=(3.20, 3.50),
                              alerts=AlertSender.from_env({"SLACK_WEBHOOK_URL": hook.url}))
        train, val = drawn_losses()
        spend = Projection(spent_usd=SPENT, rate_usd_per_hr=1.1, sidecar_usd=SIDECAR, own_usd=OWN, hours_needed=0.38,
                           margin=0.1, need=None)
        for s in range(1, 1501):  # the forecast (~2.90) lies below the band: one alert
            watch.observe(s, float(train[s]), False)
            if s in val:
                watch.judge(s, val[s], NullSink(), spend)
        (post,) = hook.posts
        more = at_finish(SPENT, trainer_usd=OWN, sidecar_usd=SIDECAR).more_usd
        assert f"spent ${SPENT:.2f}, ${more:.2f} more to finish" in post["text"]  # $0.46, not $21.40
    finally:
        hook.close()


def test_after_the_end_status_and_the_run_folders_budget_json_project_the_spend(spiked_run: SpikedRun, tmp_path):
    # The sidecar's budget.json of the finished run still projects its planned hours ($26.40).
    sidecar = json.loads((spiked_run.root / "budget.json").read_text())
    assert sidecar["projected_total_usd"] == 26.4 and sidecar["spent_usd"] == SPENT_USD
    folder = json.loads((spiked_run.root / "run" / "budget.json").read_text())
    assert folder["projected_total_usd"] == folder["spent_usd"] == SPENT_USD
    assert folder["projection"] == f"{ENDED} (finished)"
    # `status` on that workspace, the watchdog's decision recorded: the same figure.
    ws = workspace(tmp_path / "ws", final={"exit_code": 0, "reason": "finished", "time": "t"}, spent=SPENT_USD)
    shutil.copyfile(spiked_run.root / "budget.json", ws.budget_file)
    st = collect_status(ws)
    assert st["at_a_glance"]["projected_at_finish_usd"] == folder["projected_total_usd"]
    assert projected_figures(render_status(st)) == [f"${SPENT_USD:.2f}"]


def test_a_terminated_instances_budget_json_projects_its_spend():
    ledger = Ledger(provider="lambda", instance_id="inst-1")
    ledger.rate_usd_per_hr, ledger.spent_usd, ledger.hours_elapsed = 1.10, SPENT, 4.5
    ledger.instance_status = "running"
    running = ledger.reading(0.0, cap_usd=35, planned_hours=24, stale_after_failures=3, source="provider-api")
    assert running.projected_total_usd == round(SPENT + 1.10 * (24 - 4.5), 6)
    ledger.instance_status = "terminated"
    ended = ledger.reading(0.0, cap_usd=35, planned_hours=24, stale_after_failures=3, source="provider-api")
    assert ended.projected_total_usd == SPENT
