"""The budget guard's decisions (docs/DESIGN.md §6), driven by budget.json files the tests write: the rules in
order, spend always judged extrapolated, alerts once per crossing (to a real webhook receiver and a
real SMTP server), the first-reading wait, the pre-launch sentence, and the dry run."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import threading
import time
from datetime import datetime, timezone
from pathlib import Path

import pytest
from aiosmtpd.controller import Controller

from budget_sidecar.testing import Sidecar, free_port
from receivers import Inbox, WebhookReceiver
from x1_common.alerts import AlertSender
from x1_pretrain.config import BudgetConfig, ConfigError
from x1_pretrain.train.budget_guard import Action, BudgetGuard, NullGuard, read_source
from x1_pretrain.train.budget_sim import dry_run

T0 = 1_900_000_000.0


class Clock:
    def __init__(self, t: float = T0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


class Recorder(AlertSender):
    """Counts alerts without delivering them (delivery has its own tests below)."""

    def __init__(self) -> None:
        super().__init__()
        self.kinds: list[str] = []

    def send(self, kind, subject, body, fields=None):
        self.kinds.append(kind)
        return []


def write_budget(path: Path, *, spent: float, rate: float = 1.10, projected: float | None = None,
                 updated: float = T0, stale: bool = False, **extra) -> None:
    doc = {
        "spent_usd": spent, "rate_usd_per_hr": rate, "hours_elapsed": spent / rate if rate else 0.0,
        "projected_total_usd": spent if projected is None else projected,
        "last_update_utc": datetime.fromtimestamp(updated, timezone.utc).isoformat().replace("+00:00", "Z"),
        "cap_usd": 35.0, "provider": "lambda", "instance_id": "i-1", "source": "provider-api", "stale": stale, **extra,
    }
    path.write_text(json.dumps(doc))


@pytest.fixture
def budget_file(tmp_path: Path) -> Path:
    return tmp_path / "budget.json"


def make_guard(budget_file: Path, clock: Clock | None = None, alerts: AlertSender | None = None,
               **cfg) -> tuple[BudgetGuard, Clock, AlertSender]:
    clock = clock or Clock()
    alerts = alerts if alerts is not None else Recorder()
    config = BudgetConfig(cap_usd=35.0, curr_cost_uri=str(budget_file), **cfg)
    guard = BudgetGuard.from_config(config, alerts=alerts, clock=clock)
    assert isinstance(guard, BudgetGuard)
    return guard, clock, alerts


# --- the rules, in order --------------------------------------------------------------------------


@pytest.mark.parametrize("spent, projected, rate, age_min, stale, action, code, alerts", [
    # 1. spent over the cap wins over everything, and exits without a checkpoint
    (36.0, 40.0, 5.0, 30, True, Action.EXIT_NOW, 77, ()),
    # 2. projection over the cap: checkpoint, then exit -- the alerts say why before it stops
    (31.0, 36.0, 5.0, 30, True, Action.CHECKPOINT_AND_EXIT, 76, ("alert-line", "rate", "stale")),
    (20.0, 36.0, 1.10, 0, False, Action.CHECKPOINT_AND_EXIT, 76, ()),
    # 3.-5. alerts only, all of them at once when all apply
    (31.0, 34.0, 5.0, 30, False, Action.CONTINUE, None, ("alert-line", "rate", "stale")),
    (31.0, 34.0, 1.10, 0, False, Action.CONTINUE, None, ("alert-line",)),
    (10.0, 30.0, 1.40, 0, False, Action.CONTINUE, None, ("rate",)),
    (10.0, 30.0, 1.10, 0, True, Action.CONTINUE, None, ("stale",)),
    (10.0, 30.0, 1.10, 16, False, Action.CONTINUE, None, ("stale",)),
    (10.0, 30.0, 1.10, 0, False, Action.CONTINUE, None, ()),
])
def test_rules_apply_in_the_contract_order(budget_file, spent, projected, rate, age_min, stale, action, code,
                                           alerts) -> None:
    # age 30 min at $5/h adds $2.50 to the reading; the projections above already include it.
    write_budget(budget_file, spent=spent - rate * age_min / 60, rate=rate, projected=projected,
                 updated=T0 - age_min * 60, stale=stale)
    guard, _, sender = make_guard(budget_file, planned_rate_usd_per_hr=1.10)
    d = guard.check()
    assert (d.action, d.exit_code, d.alerts) == (action, code, alerts), d.reason
    assert sender.kinds == list(alerts)
    assert d.spent_usd == pytest.approx(spent)
    assert d.reason


def test_an_old_reading_is_judged_as_spent_plus_rate_times_its_age(budget_file) -> None:
    write_budget(budget_file, spent=30.0, rate=2.0, projected=33.0, updated=T0 - 3 * 3600)
    guard, _, _ = make_guard(budget_file)
    d = guard.check()
    assert d.spent_usd == pytest.approx(36.0)
    assert (d.action, d.exit_code) == (Action.EXIT_NOW, 77)


def test_a_stale_file_whose_extrapolation_passes_the_cap_stops_the_run(budget_file) -> None:
    # The sidecar died 2 h ago with $33 spent at $1.10/h: $35.20 now.
    write_budget(budget_file, spent=33.0, rate=1.10, projected=33.0, updated=T0 - 2 * 3600, stale=True)
    guard, _, _ = make_guard(budget_file)
    d = guard.check()
    assert (d.action, d.exit_code) == (Action.EXIT_NOW, 77)
    assert d.spent_usd == pytest.approx(35.2)


def test_an_unreadable_source_is_no_new_reading_and_the_last_one_keeps_running(budget_file) -> None:
    write_budget(budget_file, spent=20.0, rate=2.0, projected=30.0)
    guard, clock, sender = make_guard(budget_file)
    assert guard.check().action == Action.CONTINUE
    budget_file.write_text('{"spent_usd": 0, "rate_')  # torn / garbage: must not read as $0
    clock.t += 4 * 3600
    d = guard.check()
    assert d.spent_usd == pytest.approx(28.0)
    assert d.alerts == ("stale",)  # 4 h old now
    budget_file.unlink()  # gone altogether
    clock.t += 4 * 3600
    d = guard.check()
    assert (d.action, d.exit_code) == (Action.EXIT_NOW, 77) and d.spent_usd == pytest.approx(36.0)


def test_a_reading_with_a_time_scale_is_extrapolated_on_the_scaled_clock(budget_file) -> None:
    write_budget(budget_file, spent=10.0, rate=2.0, projected=20.0, updated=T0 - 5, time_scale=3600.0)
    guard, _, _ = make_guard(budget_file)
    assert guard.check().spent_usd == pytest.approx(10.0 + 2.0 * 5)  # 5 s at 3600x = 5 billed hours


def test_spent_usd_now_extrapolates_from_the_last_reading(budget_file) -> None:
    write_budget(budget_file, spent=5.0, rate=1.0, projected=20.0)
    guard, clock, _ = make_guard(budget_file)
    assert guard.spent_usd_now() is None
    guard.check()
    clock.t += 1800
    assert guard.spent_usd_now() == pytest.approx(5.5)


# --- once per crossing -----------------------------------------------------------------------------


def test_the_alert_line_alerts_once_per_crossing(budget_file) -> None:
    guard, clock, sender = make_guard(budget_file)
    kinds = []
    for spent in (29.0, 30.5, 31.0, 31.5, 29.5, 30.2, 30.4):  # down to 29.5: e.g. a corrected figure
        write_budget(budget_file, spent=spent, projected=34.0, updated=clock.t)
        kinds.append(guard.check().alerts)
        clock.t += 60
    assert kinds == [(), ("alert-line",), (), (), (), ("alert-line",), ()]
    assert sender.kinds == ["alert-line", "alert-line"]


def test_the_rate_warning_uses_the_first_reading_as_plan_when_none_is_given(budget_file) -> None:
    write_budget(budget_file, spent=1.0, rate=1.10, projected=20.0)
    guard, clock, sender = make_guard(budget_file, first_reading_timeout_min=0.01)
    assert guard.prelaunch().action == Action.CONTINUE
    assert guard.planned_rate == pytest.approx(1.10)
    seen = []
    for rate in (1.30, 3.30, 3.30, 1.10, 3.30):
        clock.t += 60
        write_budget(budget_file, spent=2.0, rate=rate, projected=20.0, updated=clock.t)
        seen.append(guard.check().alerts)
    assert seen == [(), ("rate",), (), (), ("rate",)]


def test_the_stale_alert_goes_out_once_per_episode(budget_file) -> None:
    guard, clock, sender = make_guard(budget_file, stale_after_min=15)
    write_budget(budget_file, spent=5.0, projected=20.0, updated=clock.t)
    seen = [guard.check().alerts]
    for _ in range(3):  # the file stops changing: 20, 40, 60 min old
        clock.t += 20 * 60
        seen.append(guard.check().alerts)
    write_budget(budget_file, spent=7.0, projected=20.0, updated=clock.t)
    seen.append(guard.check().alerts)
    write_budget(budget_file, spent=7.1, projected=20.0, updated=clock.t, stale=True)
    seen.append(guard.check().alerts)
    assert seen == [(), ("stale",), (), (), (), ("stale",)]


def test_maybe_check_reads_only_when_check_every_min_has_passed(budget_file) -> None:
    write_budget(budget_file, spent=5.0, projected=20.0)
    reads = []
    clock = Clock()

    def counting_reader():
        reads.append(clock.t)
        return read_source(str(budget_file))

    config = BudgetConfig(cap_usd=35.0, curr_cost_uri=str(budget_file), check_every_min=30)
    guard = BudgetGuard(config, Recorder(), clock, reader=counting_reader)
    guard.check()
    for _ in range(100):  # steps within the half hour: no read, a cheap CONTINUE
        clock.t += 10
        d = guard.maybe_check()
        assert d.action == Action.CONTINUE and d.exit_code is None
    assert len(reads) == 1
    clock.t += 30 * 60
    guard.maybe_check()
    assert len(reads) == 2


def test_maybe_check_between_reads_still_reports_the_extrapolated_spend(budget_file) -> None:
    write_budget(budget_file, spent=5.0, rate=2.0, projected=20.0)
    guard, clock, _ = make_guard(budget_file, check_every_min=30)
    guard.check()
    clock.t += 15 * 60
    assert guard.maybe_check().spent_usd == pytest.approx(5.5)


# --- the start ----------------------------------------------------------------------------------


def test_prelaunch_waits_for_the_first_reading(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / "budget.json"
    config = BudgetConfig(cap_usd=35.0, curr_cost_uri=str(path), first_reading_timeout_min=0.5)
    guard = BudgetGuard.from_config(config, alerts=Recorder())
    threading.Timer(1.0, lambda: write_budget(path, spent=1.0, projected=20.0, updated=time.time())).start()
    t0 = time.monotonic()
    with caplog.at_level(logging.INFO, logger="x1.budget_guard"):
        d = guard.prelaunch()
    assert d.action == Action.CONTINUE and d.exit_code is None
    assert 0.9 <= time.monotonic() - t0 < 20
    assert "waiting for a first budget reading" in caplog.text


def test_prelaunch_without_any_reading_refuses_with_78(tmp_path: Path) -> None:
    config = BudgetConfig(cap_usd=35.0, curr_cost_uri=str(tmp_path / "never.json"), first_reading_timeout_min=0.03)
    t0 = time.monotonic()
    d = BudgetGuard.from_config(config, alerts=Recorder()).prelaunch()
    assert (d.action, d.exit_code) == (Action.REFUSE_LAUNCH, 78)
    assert 1.5 <= time.monotonic() - t0 < 15
    assert "no fresh budget reading" in d.reason


def test_prelaunch_does_not_take_a_leftover_old_file_as_the_first_reading(budget_file) -> None:
    write_budget(budget_file, spent=3.0, projected=20.0, updated=time.time() - 3600)
    config = BudgetConfig(cap_usd=35.0, curr_cost_uri=str(budget_file), first_reading_timeout_min=0.02)
    d = BudgetGuard.from_config(config, alerts=Recorder()).prelaunch()
    assert d.exit_code == 78 and "min old" in d.reason


@pytest.mark.parametrize("spent, rate, projected, action, code, words", [
    (36.0, 1.10, 36.0, Action.EXIT_NOW, 77, "over the cap"),
    (1.0, 1.50, 20.0, Action.REFUSE_LAUNCH, 78, "max price"),
    (1.0, 1.10, 40.0, Action.REFUSE_LAUNCH, 78, "projected"),
    (1.0, 1.10, 26.4, Action.CONTINUE, None, "launch accepted"),
])
def test_prelaunch_judges_the_first_reading(budget_file, spent, rate, projected, action, code, words) -> None:
    write_budget(budget_file, spent=spent, rate=rate, projected=projected, updated=time.time())
    guard = BudgetGuard.from_config(BudgetConfig(cap_usd=35.0, curr_cost_uri=str(budget_file)), alerts=Recorder())
    d = guard.prelaunch()
    assert (d.action, d.exit_code) == (action, code) and words in d.reason


def test_the_plan_prints_the_pre_launch_sentence_and_refuses_a_bad_one(budget_file, caplog) -> None:
    write_budget(budget_file, spent=0.5, projected=26.4, updated=time.time())
    good = BudgetConfig(cap_usd=35.0, curr_cost_uri=str(budget_file), planned_rate_usd_per_hr=1.10, planned_hours=24)
    with caplog.at_level(logging.INFO, logger="x1.budget_guard"):
        assert BudgetGuard.from_config(good, alerts=Recorder()).prelaunch().action == Action.CONTINUE
    assert ("This run is planned at $1.10/h, ~24 h including setup = $26.40. Budget: $35. "
            "Confirmed acceptable, $8.60 buffer.") in caplog.text
    for bad in (good.model_copy(update={"planned_rate_usd_per_hr": 1.60}),  # over the max price
                good.model_copy(update={"planned_hours": 40})):  # $44 > $35
        d = BudgetGuard.from_config(bad, alerts=Recorder()).prelaunch()
        assert (d.action, d.exit_code) == (Action.REFUSE_LAUNCH, 78) and "Refused" in d.reason


def test_the_guard_reads_the_sidecar_url(tmp_path: Path) -> None:
    sidecar = Sidecar.start(tmp_path, tmp_path / "ws" / "budget.json", provider="static", poll_seconds=0.5,
                            extra_args=["--rate-usd-per-hr", "1.0", "--planned-hours", "24"])
    try:
        config = BudgetConfig(cap_usd=35.0, curr_cost_uri=sidecar.url + "/budget", first_reading_timeout_min=0.5)
        guard = BudgetGuard.from_config(config, alerts=Recorder())
        d = guard.prelaunch()
        assert d.action == Action.CONTINUE, d.reason
        assert d.projected_usd == pytest.approx(24.0, abs=0.1)
        assert guard.last_reading is not None and guard.last_reading.provider == "static"
    finally:
        sidecar.stop()


def test_without_a_cap_the_guard_is_off() -> None:
    guard = BudgetGuard.from_config(BudgetConfig(cap_usd=None))
    assert isinstance(guard, NullGuard) and guard.enabled is False
    for d in (guard.prelaunch(), guard.maybe_check(), guard.check()):
        assert d.action == Action.CONTINUE and d.exit_code is None
    assert guard.spent_usd_now() is None


def test_half_configured_alerts_are_a_config_error(monkeypatch, budget_file) -> None:
    monkeypatch.setenv("SMTP_HOST", "mail.example.org")
    monkeypatch.delenv("SMTP_TO", raising=False)
    with pytest.raises(ConfigError, match="SMTP_TO"):
        BudgetGuard.from_config(BudgetConfig(cap_usd=35.0, curr_cost_uri=str(budget_file)))


# --- alerts delivered for real --------------------------------------------------------------------


@pytest.fixture
def channels():
    receiver, inbox = WebhookReceiver(path="/hook/guard-secret-77"), Inbox()
    smtpd = Controller(inbox, hostname="127.0.0.1", port=free_port())
    smtpd.start()
    env = {"SLACK_WEBHOOK_URL": receiver.url, "SMTP_HOST": "127.0.0.1", "SMTP_PORT": str(smtpd.port),
           "SMTP_FROM": "x1@example.org", "SMTP_TO": "ops@example.org"}
    yield AlertSender.from_env(env), receiver, inbox
    smtpd.stop()
    receiver.close()


def test_an_alert_crossing_sends_exactly_one_webhook_post_and_one_email(budget_file, channels) -> None:
    sender, receiver, inbox = channels
    guard, clock, _ = make_guard(budget_file, alerts=sender)
    for spent in (29.0, 30.4, 30.9, 31.6):
        write_budget(budget_file, spent=spent, projected=34.0, updated=clock.t)
        assert guard.check().action == Action.CONTINUE
        clock.t += 60
    assert len(receiver.posts) == 1 and "$30.40" in receiver.posts[0]["text"]
    assert len(inbox.messages) == 1 and "alert line" in inbox.messages[0]["Subject"]


def test_an_alert_that_cannot_be_delivered_never_stops_the_guard(budget_file, caplog) -> None:
    dead = free_port()
    sender = AlertSender.from_env({"SLACK_WEBHOOK_URL": f"http://127.0.0.1:{dead}/hook/x", "SMTP_HOST": "127.0.0.1",
                                   "SMTP_PORT": str(dead), "SMTP_TO": "ops@example.org"}, timeout_s=2.0)
    write_budget(budget_file, spent=31.0, projected=34.0)
    guard, _, _ = make_guard(budget_file, alerts=sender)
    with caplog.at_level(logging.ERROR):
        d = guard.check()
    assert d.action == Action.CONTINUE and d.alerts == ("alert-line",)
    assert "not delivered" in caplog.text


# --- the dry run ----------------------------------------------------------------------------------


def test_the_dry_run_walks_every_rule_and_returns_0() -> None:
    lines: list[str] = []
    assert dry_run(BudgetConfig(cap_usd=35.0, planned_rate_usd_per_hr=1.10, planned_hours=24), out=lines.append) == 0
    text = "\n".join(lines)
    for expected in ("exit 78", "exit 77", "exit 76", "alerts: alert-line", "alerts: rate", "alerts: stale",
                     "This run is planned at $1.10/h", "no second alert", "extrapolated", "unreadable"):
        assert expected in text, expected
    assert "MISMATCH" not in text


def test_the_dry_run_is_fast_and_needs_no_file_or_network() -> None:
    t0 = time.monotonic()
    assert dry_run(BudgetConfig(cap_usd=12.0, alert_usd=9.0, curr_cost_uri="http://127.0.0.1:9/nothing"),
                   out=lambda _: None) == 0
    assert time.monotonic() - t0 < 5


def test_the_guard_module_does_not_import_torch() -> None:
    code = "import sys, x1_pretrain.train.budget_sim as g; g.dry_run(g.BudgetConfig(cap_usd=35), out=lambda _: None); " \
           "print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == "False", out.stderr
