"""A wall clock stepped back 10 minutes (NTP correcting a fast clock) or forward 2 hours (a VM
resumed, a clock set by hand) changes no duration: stall detection stays on and stalls no healthy
trainer, and spend never looks lower (nor gains hours that did not pass).

Each test drives two clocks it controls: a monotonic clock, which only real time moves, and a
wall clock, which the test also steps. The trainer's heartbeats and the sidecar's readings are
dated by the stepped wall clock, as they would be on the host.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from test_budget_guard import Recorder, write_budget

from budget_sidecar.poller import Poller
from budget_sidecar.settings import SidecarSettings
from x1_common import restarts
from x1_common.contracts import Heartbeat, boot_id, read_budget_file
from x1_pretrain.config import BudgetConfig
from x1_pretrain.train import tracking
from x1_pretrain.train.budget_guard import Action, BudgetGuard
from x1_watchdog.policy import LaunchProgress, StallDetector

BACK_10_MIN = -600.0
FORWARD_2_H = 7200.0


class Clocks:
    """`mono()` moves only with `advance`; `wall()` with it, and also with `step` (the step a host's
    clock takes)."""

    def __init__(self) -> None:
        self.elapsed = 0.0
        self.offset = 0.0

    def advance(self, seconds: float) -> None:
        self.elapsed += seconds

    def step(self, seconds: float) -> None:
        self.offset += seconds

    def mono(self) -> float:
        return 5_000.0 + self.elapsed

    def wall(self) -> float:
        return 1_900_000_000.0 + self.elapsed + self.offset


# ---- the watchdog's stall detection ----------------------------------------------------------------------


class Trainer:
    """Beats into the heartbeat file as the trainer does, dated by the host's wall clock."""

    def __init__(self, path: Path, clocks: Clocks) -> None:
        self.path, self.clocks, self.step = path, clocks, 0

    def beat(self, phase: str = "training") -> None:
        self.step += 1 if phase == "training" else 0
        self.path.write_text(json.dumps({"step": self.step, "time": self.clocks.wall(), "pid": 4242, "phase": phase}))


def detector(hb: Path, clocks: Clocks) -> StallDetector:
    return StallDetector(hb, stall_seconds=60.0, startup_grace_seconds=30.0, clock=clocks.mono, wall=clocks.wall)


def test_a_wall_clock_stepped_back_10_minutes_at_a_start_leaves_stall_detection_on(tmp_path: Path) -> None:
    """Before: beats dated before the trainer's wall-clock start were dropped as the previous
    process's, so a trainer started just before a step back had no heartbeat at all and, with the
    grace measured on the stepped wall clock, was never judged: stall detection off."""
    c, hb = Clocks(), tmp_path / "heartbeat.json"
    hb.write_text(json.dumps({"step": 7, "time": c.wall() - 5, "pid": 1, "phase": "stopped"}))  # the previous process's
    det, progress = detector(hb, c), LaunchProgress(hb)
    trainer = Trainer(hb, c)
    det.arm(c.wall())
    progress.arm(c.wall())
    c.step(BACK_10_MIN)  # NTP, one second after the start
    c.advance(1)
    trainer.beat("startup")
    progress.observe()
    assert det.own_heartbeat() is not None and det.check() is None
    for _ in range(12):  # two minutes of training, beating every 10 s: its beats count, it is not stalled
        c.advance(10)
        trainer.beat()
        assert det.check() is None
        progress.observe()
    assert progress.progressed and progress.describe() == "from step 0 to step 12"
    c.advance(59)  # then it freezes: found stalled once the beat is 60 s unchanged, on the monotonic clock
    assert det.check() is None
    c.advance(2)
    stalled = det.check()
    assert stalled is not None and stalled.startswith("heartbeat unchanged for 61 s (step 12, phase training)")
    assert det.heartbeat_age() == pytest.approx(61.0)


def test_a_wall_clock_stepped_back_10_minutes_mid_run_does_not_hide_a_frozen_trainer(tmp_path: Path) -> None:
    c, hb = Clocks(), tmp_path / "heartbeat.json"
    det, trainer = detector(hb, c), Trainer(hb, c)
    det.arm(c.wall())
    for _ in range(6):
        c.advance(10)
        trainer.beat()
        assert det.check() is None
    c.step(BACK_10_MIN)  # the trainer froze just as the clock went back: its last beat is "10 min in the future"
    for _ in range(6):
        c.advance(10)
        assert det.check() is None  # 10 .. 60 s unchanged: within the limit
    c.advance(5)
    assert det.check() is not None  # 65 s: stalled, as it would be without the step


def test_a_wall_clock_stepped_forward_2_hours_stalls_no_healthy_trainer_and_still_finds_a_frozen_one(
        tmp_path: Path) -> None:
    """Before: a beat's age was the wall clock minus its date: 2 h at once, and a healthy trainer
    was killed as stalled."""
    c, hb = Clocks(), tmp_path / "heartbeat.json"
    det, trainer = detector(hb, c), Trainer(hb, c)
    det.arm(c.wall())
    trainer.beat("startup")
    for n in range(12):
        c.advance(10)
        if n == 5:
            c.step(FORWARD_2_H)  # between two beats: the last one is now "2 h old" by the wall clock
            assert det.check() is None
        trainer.beat()
        assert det.check() is None
    c.advance(55)  # frozen: not stalled before the limit ...
    assert det.check() is None
    c.advance(10)  # ... and stalled after it
    assert (stalled := det.check()) is not None and "unchanged for 65 s" in stalled


# ---- the budget guard's ageing of a reading ------------------------------------------------------------


def guard(path: Path, c: Clocks, cap: float = 35.0, alerts: Recorder | None = None) -> BudgetGuard:
    cfg = BudgetConfig(cap_usd=cap, alert_usd=min(30.0, cap), curr_cost_uri=str(path), stale_after_min=15,
                       check_every_min=5)
    return BudgetGuard(cfg, alerts or Recorder(), clock=c.wall, monotonic=c.mono)


RATE = 2.0  # $/h


def usd_for(seconds: float) -> float:
    return RATE * seconds / 3600.0


def test_spend_never_looks_lower_when_the_wall_clock_steps_back_10_minutes(tmp_path: Path) -> None:
    """Before: the extrapolation was rate x (wall now - the reading's date), clamped at 0: after the
    step the reading looked 10 minutes younger, and the spend fell back to the bare reading."""
    c, path, alerts = Clocks(), tmp_path / "budget.json", Recorder()
    write_budget(path, spent=10.0, rate=RATE, projected=20.0, updated=c.wall())
    g = guard(path, c, alerts=alerts)
    assert g.check().action == Action.CONTINUE
    seen = [g.spent_usd_now()]
    for _ in range(10):  # a reading minute by minute, the step back after the third
        c.advance(60)
        if len(seen) == 3:
            c.step(BACK_10_MIN)
        seen.append(g.spent_usd_now())
    assert seen == sorted(seen)  # never lower
    assert seen[-1] == pytest.approx(10.0 + usd_for(600))  # exactly the time that passed, at the reading's rate

    # No new reading for 16 minutes of real time: stale, though by the stepped wall clock it is 6 min old.
    c.advance(360)
    decision = g.check()
    assert "stale" in decision.alerts and decision.spent_usd == pytest.approx(10.0 + usd_for(960))

    # The sidecar's next reading, dated by the stepped clock, carries on from there.
    write_budget(path, spent=10.0 + usd_for(960), rate=RATE, projected=20.0, updated=c.wall())
    assert g.check().spent_usd == pytest.approx(10.0 + usd_for(960))
    c.advance(60)
    assert g.spent_usd_now() == pytest.approx(10.0 + usd_for(1020))


def test_a_wall_clock_stepped_forward_2_hours_adds_no_phantom_spend_and_stops_nothing(tmp_path: Path) -> None:
    """Before: a reading read before the step aged 2 h at once: $4 of phantom spend at $2/h, over
    this cap: a run stopped (exit 77) for money never spent."""
    c, path, alerts = Clocks(), tmp_path / "budget.json", Recorder()
    write_budget(path, spent=10.0, rate=RATE, projected=10.5, updated=c.wall())
    g = guard(path, c, cap=12.5, alerts=alerts)
    assert g.check().action == Action.CONTINUE
    c.advance(60)
    c.step(FORWARD_2_H)
    c.advance(60)
    assert g.spent_usd_now() == pytest.approx(10.0 + usd_for(120))
    c.advance(300)  # the next due check, the sidecar's file not rewritten yet
    decision = g.maybe_check()
    assert decision.action == Action.CONTINUE and decision.exit_code is None
    assert decision.spent_usd == pytest.approx(10.0 + usd_for(420)) and "stale" not in decision.alerts
    assert alerts.kinds == []


# ---- the sidecar's charging between polls -------------------------------------------------------------


def test_the_sidecar_charges_the_time_that_passed_whatever_the_wall_clock_says(tmp_path: Path) -> None:
    """Before: a poll after a step back charged nothing for its interval (the wall clock went
    backwards), one after a step forward charged the 2 hours too."""
    c = Clocks()
    settings = SidecarSettings(provider="static", rate_usd_per_hr=RATE, output=tmp_path / "budget.json",
                               poll_seconds=300)
    poller = Poller(settings, None, clock=c.wall, monotonic=c.mono)
    poller.poll_once()  # the first poll starts the meter
    spent = []
    for step in (0.0, BACK_10_MIN, 0.0, FORWARD_2_H, 0.0):
        c.step(step)
        c.advance(300)
        poller.poll_once()
        spent.append(read_budget_file(settings.output).spent_usd)
    assert spent == pytest.approx([usd_for(300 * n) for n in range(1, 6)], abs=1e-6)


# ---- a restart's downtime ------------------------------------------------------------------------------


def test_a_restarts_downtime_is_the_monotonic_time_between_the_stop_and_the_first_step(tmp_path: Path) -> None:
    """The stopped process's heartbeat carries its SIGTERM on the monotonic clock; the relaunched
    process on the same boot measures back from its first step on that clock: a wall clock stepped
    back 10 min (or forward 2 h) in between leaves a 42 s downtime 42 s, not -558 s (or 2 h)."""
    hb = tmp_path / "heartbeat.json"
    beat = tracking.Heartbeat(hb)
    wall, mono = time.time(), time.monotonic()
    beat.beat(30, "stopped", signal_time=wall, signal_mono=mono)
    previous = Heartbeat.read(hb)
    assert previous is not None and previous.signal_mono == mono and previous.boot_id == boot_id() is not None
    for step in (BACK_10_MIN, FORWARD_2_H):
        stopped = restarts.previous_stop(previous.phase, previous.time, previous.step, previous.signal_time)
        first_step = wall + 42.0 + step  # the relaunched process's first step, by the stepped wall clock
        moved = restarts.on_this_clock(stopped, previous.signal_mono, previous.boot_id, boot_id(), first_step, mono + 42.0)
        assert restarts.downtime_seconds(moved, first_step) == 42.0
        assert moved.by == "SIGTERM" and moved.step == 30
    # Another boot (a reboot, another host): the monotonic clocks do not compare; the wall clocks say it.
    other = restarts.on_this_clock(stopped, previous.signal_mono, "another-boot", boot_id(), wall + 42.0, 1.0)
    assert restarts.downtime_seconds(other, wall + 42.0) == 42.0
