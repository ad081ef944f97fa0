"""`python -m x1_pretrain.train --dry-run-budget`: simulated sidecar readings through every rule of
the budget guard (train/budget_guard.py), each decision printed, no alert sent and nothing trained."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any

from x1_common.alerts import AlertSender
from x1_common.contracts import BudgetReading, ExitCode
from x1_pretrain.config import BudgetConfig
from x1_pretrain.train.accounting import tokens_per_sec_table, usd
from x1_pretrain.train.budget_guard import (
    RATE_WARNING_FACTOR,
    Action,
    BudgetGuard,
    Decision,
    Interval,
    Pace,
    ReadError,
    planned_sentence,
)

# --------------------------------------------------------------------------------------------
# --dry-run-budget: simulated readings through every rule.


class _RecordingAlerts(AlertSender):
    """Alerts in the dry run: recorded, never sent."""

    def __init__(self) -> None:
        super().__init__()
        self.sent: list[str] = []

    def send(self, kind: str, subject: str, body: str, fields: Mapping[str, Any] | None = None) -> list[str]:
        self.sent.append(kind)
        return []


@dataclass(frozen=True)
class _Step:
    title: str
    call: str  # "plan" (the sentence alone), "prelaunch" or "check"
    reading: dict[str, Any] | None  # spent, rate, projected, age_min, stale; None: the source fails
    expect: tuple[Action, int | None, tuple[str, ...]]
    new_guard: bool = False
    pace: str | None = None  # "plan": the default 84,000 steps at plan's A100 figure; "measured": too slow a measure


def _scenario(cfg: BudgetConfig, cap: float) -> Iterator[_Step]:
    alert, maxp = cfg.alert_usd, cfg.max_price_usd_per_hr
    rate = min(cfg.planned_rate_usd_per_hr or 1.10, maxp)
    stale_age = cfg.stale_after_min + 5
    C, X, N, R = Action.CONTINUE, Action.CHECKPOINT_AND_EXIT, Action.EXIT_NOW, Action.REFUSE_LAUNCH

    def r(spent: float, projected: float | None = None, rate_: float = rate, age: float = 0.0, stale: bool = False):
        return {"spent": spent, "rate": rate_, "projected": spent if projected is None else projected,
                "age_min": age, "stale": stale}

    low = min(1.0, alert / 4)
    if cfg.planned_rate_usd_per_hr is not None and cfg.planned_hours is not None:
        _, ok = planned_sentence(cfg.planned_rate_usd_per_hr, cfg.planned_hours, cap, maxp)
        yield _Step("start: the plan itself (the pre-launch sentence)", "plan", None,
                    (C, None, ()) if ok else (R, 78, ()))
    yield _Step("start: no reading comes", "prelaunch", None, (R, 78, ()), new_guard=True)
    yield _Step("start: price over the max price", "prelaunch", r(low, low, rate_=maxp + 0.5), (R, 78, ()), new_guard=True)
    yield _Step("start: projection over the cap", "prelaunch", r(low, cap + 5), (R, 78, ()), new_guard=True)
    yield _Step("start: spent already over the cap", "prelaunch", r(cap + 1), (N, 77, ()), new_guard=True)
    yield _Step("start: at the plan's throughput the steps cannot finish under the cap (the sidecar's projection "
                "has no planned hours)", "prelaunch", r(low), (R, 78, ()), new_guard=True, pace="plan")
    yield _Step("start: a good first reading", "prelaunch", r(low, alert - 1), (C, None, ()), new_guard=True)
    yield _Step("run: under every line", "check", r(alert - 2, alert - 1), (C, None, ()))
    yield _Step("run: spent crosses the alert line", "check", r(alert + 0.5, alert + 1), (C, None, ("alert-line",)))
    yield _Step("run: still over the line (no second alert)", "check", r(alert + 0.8, alert + 1), (C, None, ()))
    yield _Step(f"run: rate over {RATE_WARNING_FACTOR:g}x the plan", "check",
                r(alert + 0.9, alert + 1, rate_=(cfg.planned_rate_usd_per_hr or rate) * 1.5), (C, None, ("rate",)))
    yield _Step("run: the sidecar marks its reading stale", "check", r(alert + 1, alert + 1, stale=True),
                (C, None, ("stale",)))
    yield _Step("run: fresh again (stale alert re-armed)", "check", r(alert + 1.1, alert + 1.1), (C, None, ()))
    yield _Step(f"run: a reading {stale_age:g} min old", "check", r(alert + 1.1, alert + 1.1, age=stale_age),
                (C, None, ("stale",)))
    yield _Step("run: the source is unreadable (the last reading, extrapolated)", "check", None, (C, None, ()))
    yield _Step("run: projected total over the cap", "check", r(alert + 1.5, cap + 2), (X, 76, ()))
    yield _Step("run: the trainer's own projection over the cap (measured pace too slow for the steps left; the "
                "sidecar's under)", "check", r(low), (X, 76, ()), new_guard=True, pace="measured")
    gap_h = 1.0
    old_spent = cap - rate * gap_h / 2
    yield _Step(f"run: an old stale reading, extrapolated {gap_h:g} h at its rate, passes the cap", "check",
                r(old_spent, old_spent, age=60 * gap_h, stale=True), (N, 77, ()), new_guard=True)
    yield _Step("run: spent over the cap", "check", r(cap + 0.5), (N, 77, ()), new_guard=True)


def dry_run(cfg: BudgetConfig, out: Callable[[str], None] = print) -> int:
    """Walk simulated readings through every rule, print each decision. 0 when each rule decided as
    the contract says (1 would mean a bug in the guard)."""
    cap = cfg.cap_usd if cfg.cap_usd is not None else 35.0
    cfg = cfg.model_copy(update={"cap_usd": cap, "first_reading_timeout_min": min(cfg.first_reading_timeout_min, 5.0)})
    out(f"Budget guard dry run: cap {usd(cap)}{'' if cfg.cap_usd else ' (no --budget-cap-usd: simulated)'}, "
        f"alert line {usd(cfg.alert_usd)}, max price {usd(cfg.max_price_usd_per_hr)}/h, stale after "
        f"{cfg.stale_after_min:g} min. Simulated readings, simulated clock; no alert is sent.")
    t = [1_900_000_000.0]
    quiet = logging.getLogger("x1.budget_guard.dry_run")
    quiet.propagate, quiet.disabled = False, True
    current: list[dict[str, Any] | None] = [None]

    def reader() -> tuple[BudgetReading, float]:
        d = current[0]
        if d is None:
            raise ReadError("simulated: source unreadable")
        updated = datetime.fromtimestamp(t[0] - d["age_min"] * 60.0, timezone.utc)
        return BudgetReading(spent_usd=d["spent"], rate_usd_per_hr=d["rate"], hours_elapsed=0.0,
                             projected_total_usd=d["projected"], last_update_utc=updated, cap_usd=cap,
                             stale=d["stale"]), 1.0

    def sleep(s: float) -> None:
        t[0] += s

    def pace(kind: str | None) -> Pace | None:
        """The default run (84,000 steps of 512K tokens) at plan's A100 estimate, or measured slower."""
        if kind is None:
            return None
        p = Pace(total_steps=84_000, tokens_per_step=524_288, eval_every=1800, ckpt_every=1800, eval_tokens=131_072,
                 start_step=0 if kind == "plan" else 40_000,
                 expected_tokens_per_sec=tokens_per_sec_table()["a100-80gb"].tokens_per_sec,
                 expected_source="plan's A100 80GB estimate (simulated)", clock=lambda: t[0])
        if kind == "measured":  # one steady interval of 10 steps at 200k tokens/s
            p.record(Interval(steps=10, seconds=10 * 524_288 / 200_000.0, tokens=10 * 524_288), 40_000)
        return p

    # The plan is judged once on its own; the other steps leave it out so that each reaches its rule.
    run_cfg = cfg.model_copy(update={"planned_hours": None})
    guard: BudgetGuard | None = None
    failures = 0
    for n, step in enumerate(_scenario(cfg, cap), 1):
        alerts = _RecordingAlerts()
        if guard is None or step.new_guard:
            guard = BudgetGuard(run_cfg, alerts, clock=lambda: t[0], log=quiet, reader=reader, sleep=sleep)
        guard.alerts = alerts
        current[0] = step.reading
        t[0] += 60.0
        if step.call == "plan":
            rate, hours = cfg.planned_rate_usd_per_hr or 0.0, cfg.planned_hours or 0.0
            sentence, ok = planned_sentence(rate, hours, cap, cfg.max_price_usd_per_hr)
            d = Decision(Action.CONTINUE if ok else Action.REFUSE_LAUNCH, None if ok else int(ExitCode.LAUNCH_REFUSED),
                         sentence, None, None)
        elif step.call == "prelaunch":
            d = guard.prelaunch(pace(step.pace))
        else:
            guard.pace = pace(step.pace) if step.pace else guard.pace
            d = guard.check()
        if step.call == "plan":
            seen = f"the plan: {usd(cfg.planned_rate_usd_per_hr or 0)}/h for {cfg.planned_hours:g} h"
        elif step.reading is None:
            seen = "no reading (source unreadable)"
        else:
            rd = step.reading
            seen = (f"spent {usd(rd['spent'])}, rate {usd(rd['rate'])}/h, projected {usd(rd['projected'])}, "
                    f"{rd['age_min']:g} min old{', marked stale' if rd['stale'] else ''}")
        got = (d.action, d.exit_code, d.alerts)
        ok = got == step.expect
        failures += not ok
        code = f" -> exit {d.exit_code}" if d.exit_code is not None else ""
        out(f"{n:>2}. {step.title}")
        out(f"    reading: {seen}")
        out(f"    decision: {d.action.value}{code}; alerts: {', '.join(d.alerts) or 'none'}")
        out(f"    {d.reason}")
        if not ok:
            out(f"    MISMATCH: expected {step.expect[0].value}, exit {step.expect[1]}, alerts {step.expect[2]}")
    out("Every rule decided as the contract says." if not failures else f"{failures} decision(s) differ from the contract.")
    return 0 if not failures else 1
