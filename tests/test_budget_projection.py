"""The trainer's own budget projection and its throughput floor, without a running trainer (docs/DESIGN.md §5, §6).

- `Pace`: the hours the remaining steps need, from the plan's throughput until the first steady log
  interval and a rolling measure after, plus eval, checkpoint and restart overheads;
- the guard judges the larger of that projection (+ its margin) and the sidecar's: at launch a run
  the plan's throughput cannot finish is refused with 78 and the steps that fit; the first measured
  pace is judged at once; a price change moves the projection;
- `Throughput` marks the intervals that say nothing about the steady rate (the start or a resume,
  an eval, a checkpoint), and the floor warns on a steady interval only: a data loader really
  starved (a slow source behind the real `data.Prefetcher`) warns in its first steady interval;
- the floor follows the plan for each shipped config; the sidecar without planned hours says that
  its projection is the spend so far.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from datetime import datetime, timezone
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

from budget_sidecar.app import create_app
from budget_sidecar.poller import Poller
from budget_sidecar.settings import SidecarSettings
from conftest import CONFIGS, run_module
from x1_common.alerts import AlertSender
from x1_common.contracts import read_budget_file
from x1_pretrain.config import BudgetConfig, load_config
from x1_pretrain.train.accounting import expected_tokens_per_sec, fmt_count, steps_that_fit, tokens_per_sec_table
from x1_pretrain.train.budget_guard import Action, BudgetGuard, Interval, Pace, _count_due

T0 = 1_900_000_000.0
STEP_TOKENS = 524_288  # the 50M config's step
A100 = tokens_per_sec_table()["a100-80gb"].tokens_per_sec  # plan's A100 figure (an estimate, ~273k)


class Clock:
    def __init__(self, t: float = T0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


class Quiet(AlertSender):
    def send(self, kind, subject, body, fields=None):
        return []


def write_budget(path: Path, *, spent: float, rate: float = 1.10, projected: float | None = None,
                 updated: float = T0) -> None:
    path.write_text(json.dumps({
        "spent_usd": spent, "rate_usd_per_hr": rate, "hours_elapsed": spent / rate,
        "projected_total_usd": spent if projected is None else projected,
        "last_update_utc": datetime.fromtimestamp(updated, timezone.utc).isoformat().replace("+00:00", "Z"),
    }))


def seed_pace(clock: Clock, *, start_step: int = 0, total: int = 84_000, expected: float | None = A100,
              restarts: int = 0) -> Pace:
    """The lab's run: 84,000 steps of 512K tokens, eval and checkpoint every 1800 steps."""
    return Pace(total_steps=total, tokens_per_step=STEP_TOKENS, eval_every=1800, ckpt_every=1800,
                eval_tokens=128 * 1024, start_step=start_step, restarts=restarts, expected_tokens_per_sec=expected,
                expected_source="plan's A100 figure", started=clock.t, clock=clock)


def steady(steps: int, tokens_per_sec: float, **kw) -> Interval:
    return Interval(steps=steps, seconds=steps * STEP_TOKENS / tokens_per_sec, tokens=steps * STEP_TOKENS, **kw)


def guard_for(path: Path, clock: Clock, pace: Pace | None = None, **cfg) -> BudgetGuard:
    config = BudgetConfig(cap_usd=35.0, curr_cost_uri=str(path), first_reading_timeout_min=0.01,
                          stale_after_min=1e6, **cfg)
    return BudgetGuard(config, Quiet(), clock, sleep=lambda s: setattr(clock, "t", clock.t + s), pace=pace)


# --- Pace: what the steps left need ---------------------------------------------------------------


def test_count_due_counts_multiples_and_the_last_step() -> None:
    assert _count_due(0, 84_000, 1800) == 47  # 46 multiples + the final step
    assert _count_due(0, 3600, 1800) == 2  # 3600 is both
    assert _count_due(1800, 1800, 1800) == 0
    assert _count_due(1799, 1801, 1800) == 2


def test_before_any_measure_the_pace_is_the_plans_and_on_a_cpu_there_is_none() -> None:
    clock = Clock()
    need = seed_pace(clock).need(0)
    assert need is not None and need.pace.startswith(f"plan: {fmt_count(A100)}")
    assert need.seconds_per_step == pytest.approx(STEP_TOKENS / A100)
    # 84,000 steps at plan's A100 figure: the ~48 h plan itself prints for the lab's steps
    assert need.seconds / 3600 == pytest.approx(84_000 * STEP_TOKENS / A100 / 3600, rel=0.01)
    assert need.evals_left == 47 and need.ckpts_left == 48  # the final files count as one more
    assert need.restarts_ahead == 0  # a first start expects none
    assert seed_pace(clock, expected=None).need(0) is None


def test_the_first_steady_interval_replaces_the_plan_and_a_rolling_window_follows_drift() -> None:
    clock = Clock()
    pace = seed_pace(clock)
    pace.record(steady(10, 100_000, not_steady=("start",)), 10)  # the first interval: not a pace
    assert not pace.measured and pace.need().pace.startswith("plan")
    pace.record(steady(10, 200_000), 20)
    assert pace.measured
    need = pace.need()
    assert need.pace == "measured: the first steady interval"
    assert need.seconds_per_step == pytest.approx(STEP_TOKENS / 200_000)
    assert need.steps_left == 84_000 - 20
    for step in range(30, 30 + 10 * 400, 10):  # ~2.6 s per step: 400 intervals are ~3 h of training
        pace.record(steady(10, 150_000), step)
    need = pace.need()
    assert need.pace.startswith("measured: rolling over")
    assert need.seconds_per_step == pytest.approx(STEP_TOKENS / 150_000, rel=1e-6)  # the 200k interval aged out


def test_measured_eval_checkpoint_and_restart_overheads_are_added() -> None:
    clock = Clock()
    pace = seed_pace(clock, start_step=42_000, restarts=2)
    clock.t += 90.0  # setup + compile of this process
    pace.record(steady(10, 100_000, not_steady=("resume",)), 42_010)  # the slow first interval
    pace.record(steady(10, 250_000, not_steady=("eval", "checkpoint"), paused={"eval": [4.0], "checkpoint": [6.0]}),
                42_020)
    pace.record(steady(10, 250_000), 42_030)
    need = pace.need(42_030)
    sps = STEP_TOKENS / 250_000
    assert need.eval_s == 4.0 and need.eval_note == "measured" and need.ckpt_s == 6.0
    assert need.restart_s == pytest.approx(90.0 - 10 * sps)  # start to first read, less its steps' own time
    assert need.restarts_ahead == pytest.approx(2 * (84_000 - 42_030) / 42_030)
    assert need.seconds == pytest.approx(need.steps_left * sps + need.evals_left * 4.0 + need.ckpts_left * 6.0
                                         + need.restarts_ahead * need.restart_s)
    assert "evals x 4 s (measured)" in need.describe()


# --- the guard judges the larger projection -------------------------------------------------------


def test_the_labs_84000_steps_at_plans_a100_figure_are_refused_at_launch_with_the_steps_that_fit(tmp_path) -> None:
    path, clock = tmp_path / "budget.json", Clock()
    write_budget(path, spent=0.5)  # the sidecar without planned hours: its projection is the spend
    guard = guard_for(path, clock)
    d = guard.prelaunch(seed_pace(clock))
    assert (d.action, d.exit_code) == (Action.REFUSE_LAUNCH, 78), d.reason
    p = d.projection
    assert p.sidecar_usd == pytest.approx(0.5) and p.own_usd > 50  # ~48 h x $1.10 x 1.1
    fits = int(d.reason.split("--total-steps ")[1].split()[0])
    expected = steps_that_fit(35 - 0.5, 1.10, STEP_TOKENS / A100, 0.10)
    assert fits == expected // 100 * 100 and 45_000 < fits < 84_000
    # and those steps are accepted
    guard = guard_for(path, clock)
    d = guard.prelaunch(seed_pace(clock, total=fits))
    assert d.action == Action.CONTINUE and d.projection.own_usd <= 35.0, d.reason


def test_plans_proposed_steps_are_accepted_at_launch(tmp_path) -> None:
    for hours in ("24", "31"):  # the default, and a plan near the cap (its buffer $0.90)
        proc = run_module("x1_pretrain.plan", "--config", str(CONFIGS / "x1-50m-a100.yaml"), "--price-usd-per-hr",
                          "1.10", "--hours", hours, "--json")
        assert proc.returncode == 0, proc.stderr
        steps = json.loads(proc.stdout)["proposed_total_steps"]
        path, clock = tmp_path / f"budget-{hours}.json", Clock()
        write_budget(path, spent=0.75 * 1.10)  # the plan's setup hours, billed
        d = guard_for(path, clock).prelaunch(seed_pace(clock, total=steps))
        assert d.action == Action.CONTINUE, (hours, steps, d.reason)


def test_a_run_measured_too_slow_stops_with_76_at_its_first_steady_interval(tmp_path) -> None:
    path, clock = tmp_path / "budget.json", Clock()
    write_budget(path, spent=1.0)
    pace = seed_pace(clock, total=40_000)  # plan's proposal for 24 h at $1.10
    guard = guard_for(path, clock, check_every_min=30)
    assert guard.prelaunch(pace).action == Action.CONTINUE
    clock.t += 60
    assert guard.maybe_check(10).reason == "budget check not due"
    pace.record(steady(10, 180_000), 20)  # 30% under plan: 40,000 steps need ~32 h
    clock.t += 60
    write_budget(path, spent=1.1, updated=clock.t)
    d = guard.maybe_check(20)  # judged at once, not at the next half hour
    assert (d.action, d.exit_code) == (Action.CHECKPOINT_AND_EXIT, 76), d.reason
    assert "measured: the first steady interval" in d.reason and "--total-steps" in d.reason
    assert d.projection.sidecar_usd < 35 < d.projection.own_usd


def test_the_same_run_at_plan_speed_is_not_stopped(tmp_path) -> None:
    path, clock = tmp_path / "budget.json", Clock()
    write_budget(path, spent=1.0)
    pace = seed_pace(clock, total=40_000)
    guard = guard_for(path, clock)
    guard.prelaunch(pace)
    pace.record(steady(10, A100), 20)
    d = guard.maybe_check(20)
    assert d.action == Action.CONTINUE and d.projection.own_usd < 35, d.reason


def test_a_tripled_price_moves_the_own_projection_over_the_cap(tmp_path) -> None:
    path, clock = tmp_path / "budget.json", Clock()
    write_budget(path, spent=5.0)
    pace = seed_pace(clock, start_step=10_000, total=40_000)
    pace.record(steady(10, A100), 10_010)
    guard = guard_for(path, clock, pace)
    before = guard.check(10_010)
    write_budget(path, spent=5.0, rate=3.30, updated=clock.t)
    after = guard.check(10_010)
    assert before.action == Action.CONTINUE and after.exit_code == 76
    assert after.projection.own_usd - 5.0 == pytest.approx(3 * (before.projection.own_usd - 5.0))


def test_the_sidecars_projection_still_stops_when_it_is_the_larger(tmp_path) -> None:
    path, clock = tmp_path / "budget.json", Clock()
    write_budget(path, spent=10.0, projected=36.0)
    pace = seed_pace(clock, start_step=39_990, total=40_000)
    pace.record(steady(10, A100), 39_990)
    d = guard_for(path, clock, pace).check(39_990)
    assert d.exit_code == 76 and d.projection.own_usd < 11 and d.projection.judged_usd == pytest.approx(36.0)


def test_every_budget_check_logs_one_line_with_the_projections_inputs(tmp_path, caplog) -> None:
    path, clock = tmp_path / "budget.json", Clock()
    write_budget(path, spent=2.0)
    pace = seed_pace(clock, total=30_000)
    pace.record(steady(10, A100), 10)
    guard = guard_for(path, clock, pace)
    with caplog.at_level(logging.INFO, logger="x1.budget_guard"):
        guard.check(10)
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("budget: continue")]
    assert len(lines) == 1
    line = lines[0]
    for part in ("spent $2 at $1.10/h", f"29,990 steps x {STEP_TOKENS / A100:.3g} s (measured: the first steady interval)",
                 "evals x", "checkpoints x", "restarts x", "h billed", "+10%", "-> own $", "sidecar's $2",
                 "projected $", "of $35"):
        assert part in line, (part, line)


def test_billed_hours_follow_the_readings_time_scale(tmp_path) -> None:
    path, clock = tmp_path / "budget.json", Clock()
    doc = {"spent_usd": 1.0, "rate_usd_per_hr": 1.0, "hours_elapsed": 1.0, "projected_total_usd": 1.0,
           "last_update_utc": datetime.fromtimestamp(T0, timezone.utc).isoformat().replace("+00:00", "Z"),
           "time_scale": 360.0}
    path.write_text(json.dumps(doc))
    pace = Pace(total_steps=100, tokens_per_step=512, eval_every=1000, ckpt_every=1000, eval_tokens=0,
                started=clock.t, clock=clock)
    pace.record(Interval(steps=10, seconds=10.0, tokens=5120), 10)  # 1 s per step: 90 s = 9 billed h
    d = guard_for(path, clock, pace).check(10)
    assert d.projection.hours_needed == pytest.approx(90 * 360 / 3600, rel=0.01)


# --- the throughput floor ---------------------------------------------------------------------------


def test_throughput_marks_the_start_a_resume_an_eval_and_a_checkpoint_as_not_steady() -> None:
    from x1_pretrain.train.components import Throughput

    t = [0.0]
    tp = Throughput("resume", clock=lambda: t[0])
    for _ in range(5):
        tp.add(100)
        t[0] += 1.0
    first = tp.read()
    assert first.not_steady == ("resume",) and first.steps == 5 and first.tokens_per_sec == pytest.approx(100)
    tp.add(100)
    with tp.pause("eval"):
        t[0] += 30.0
    t[0] += 1.0
    with tp.pause("checkpoint"):
        t[0] += 5.0
    tp.add(100)
    t[0] += 1.0
    second = tp.read()
    assert second.not_steady == ("eval", "checkpoint") and second.paused == {"eval": [30.0], "checkpoint": [5.0]}
    assert second.seconds == pytest.approx(2.0)  # eval and checkpoint time left out of the rate
    tp.add(100)
    t[0] += 1.0
    assert tp.read().steady


def floor_run(floor: float) -> SimpleNamespace:
    """What warn_if_slow reads of a Run: the floor and the run's training time so far."""
    return SimpleNamespace(floor=floor, floor_source="a test floor", floor_warned_at=0.0,
                           state=SimpleNamespace(train_seconds=0.0))


def test_a_starved_data_loader_warns_in_its_first_steady_interval_and_not_before(caplog) -> None:
    import torch

    from x1_pretrain.data.loader import Prefetcher
    from x1_pretrain.train.components import Throughput, warn_if_slow

    starved = threading.Event()
    windows = np.zeros((4, 65), dtype=np.uint16)

    def source(step: int, micro: int) -> np.ndarray:
        if starved.is_set():
            time.sleep(0.05)  # a loader that cannot keep up: ~20 batches/s
        return windows

    keys = ((s, 0) for s in range(10_000))
    loader = Prefetcher(source, keys, torch.device("cpu"), depth=2, pin_memory=False)
    batches = iter(loader)
    run = floor_run(floor=256 * 40)  # 40 batches/s of 256 tokens
    tp = Throughput("start")
    warned_at: list[int] = []
    try:
        with caplog.at_level(logging.WARNING, logger="x1.train"):
            step = 0
            for phase in ("slow start", "fast", "fast", "starved", "starved"):
                if phase == "slow start":
                    time.sleep(0.5)  # compile, warm-up: the first interval is slow, and not judged
                starved.set() if phase == "starved" else starved.clear()
                for _ in range(10):
                    next(batches)
                    tp.add(256)
                    step += 1
                n = len(caplog.records)
                warn_if_slow(run, step, tp.read())
                if len(caplog.records) > n:
                    warned_at.append(step)
    finally:
        loader.close()
    # The first starved interval may still hold prefetched batches; the one after is all starved.
    assert warned_at in ([40], [50]), warned_at
    assert "under the floor" in caplog.text and "a test floor" in caplog.text


def test_only_a_steady_interval_of_the_first_hour_is_judged(caplog) -> None:
    from x1_pretrain.train.components import warn_if_slow

    slow = Interval(steps=10, seconds=10.0, tokens=100)
    with caplog.at_level(logging.WARNING, logger="x1.train"):
        for why in (("start",), ("resume",), ("eval",), ("checkpoint",)):
            warn_if_slow(floor_run(1000), 10, Interval(10, 10.0, 100, not_steady=why))
        late = floor_run(1000)
        late.state.train_seconds = 3601.0
        warn_if_slow(late, 10, slow)
        warn_if_slow(floor_run(0), 10, slow)  # floor off
        assert caplog.text == ""
        warn_if_slow(floor_run(1000), 10, slow)
    assert "step 10: throughput 10 tokens/s (a steady interval of 10 steps) is under the floor of 1000" in caplog.text


@pytest.mark.parametrize("config, gpu", [("x1-50m-a100.yaml", "a100-80gb"), ("x1-50m-h200.yaml", "h200")])
def test_each_gpu_configs_floor_is_under_what_plan_expects_for_that_gpu(config, gpu) -> None:
    from x1_pretrain.train.setup import throughput_floor

    cfg = load_config(CONFIGS / config)
    plan = expected_tokens_per_sec(gpu, cfg.model)
    floor, source = throughput_floor(cfg, (plan.tokens_per_sec, plan.source))
    assert 0 < floor <= 0.8 * plan.tokens_per_sec, (floor, plan, source)


def test_the_default_floor_is_a_share_of_the_expected_throughput_and_off_without_one() -> None:
    from x1_pretrain.train.setup import throughput_floor

    cfg = load_config(CONFIGS / "x1-50m-a100.yaml")
    assert cfg.train.min_tokens_per_sec is None
    assert throughput_floor(cfg, (254_000.0, "plan"))[0] == pytest.approx(0.6 * 254_000)
    assert throughput_floor(cfg, None)[0] == 0.0
    pinned = load_config(CONFIGS / "x1-50m-a100.yaml", ["train.min_tokens_per_sec=123"])
    assert throughput_floor(pinned, (254_000.0, "plan")) == (123, "train.min_tokens_per_sec")


def test_the_expected_throughput_is_the_given_one_else_none_on_a_cpu() -> None:
    import torch

    from x1_pretrain.train.setup import expected_throughput

    cfg = load_config(CONFIGS / "tiny-cpu.yaml")
    assert expected_throughput(cfg, torch.device("cpu"), 1) is None
    given = load_config(CONFIGS / "tiny-cpu.yaml", overrides={"train.expected_tokens_per_sec": 5000.0})
    assert expected_throughput(given, torch.device("cpu"), 2) == (5000.0, "given: --expected-tokens-per-sec")


def test_plans_figure_is_scaled_by_flops_for_another_model() -> None:
    big = load_config(CONFIGS / "x1-50m-a100.yaml", ["model.d_model=1536", "model.n_head=24", "model.n_kv_head=8",
                                                      "model.d_ff=4096"]).model
    same = expected_tokens_per_sec("a100-80gb", load_config(CONFIGS / "x1-50m-a100.yaml").model)
    scaled = expected_tokens_per_sec("a100-80gb", big)
    assert same.tokens_per_sec == A100 and "scaled" in scaled.source and scaled.tokens_per_sec < A100 / 2
    assert expected_tokens_per_sec("cpu", big) is None


# --- the sidecar without planned hours --------------------------------------------------------------


def test_the_sidecar_without_planned_hours_says_its_projection_is_the_spend_so_far(tmp_path) -> None:
    clock = Clock()
    for planned, basis in ((None, "spent only: no planned hours"), (10.0, "spent + rate x the rest of 10 planned hours")):
        settings = SidecarSettings(provider="static", rate_usd_per_hr=2.0, output=tmp_path / f"b{planned}.json",
                                   planned_hours=planned)
        poller = Poller(settings, None, clock=clock)
        poller.poll_once()
        clock.t += 3600
        poller.poll_once()
        doc = json.loads(settings.output.read_text())
        assert doc["projection"] == basis and doc["planned_hours"] == planned
        reading = read_budget_file(settings.output)
        assert reading.projected_total_usd == pytest.approx(2.0 if planned is None else 2.0 + 2.0 * 9)
        text = TestClient(create_app(settings, poller)).get("/metrics").text
        values = {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples}
        assert values["x1_budget_planned_hours"] == (planned or 0.0)
