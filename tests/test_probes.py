"""Cooldown probes (train.cooldown_probes) on the tiny CPU config: the run bit for bit as without them
(weights and optimizer state after each probe and at the end), a SIGTERM during one (exit 75, the
run's own checkpoint, the probe retried after the resume), where each probe's loss goes (MLflow, the
log, the forecast, the checkpoint), the forecast's consistency with its own points on a real run,
and the probes' cost in the budget's projection and in `plan`."""

from __future__ import annotations

import json
import signal
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from conftest import CONFIGS, REFERENCE_STEPS, run_module, start_trainer, train_args, wait_for
from x1_common.contracts import ExitCode
from x1_pretrain.checkpoint.store import load_optimizer_file
from x1_pretrain.config import ConfigError, load_config
from x1_pretrain.train.budget_guard import Action, Decision, Interval, Pace
from x1_pretrain.train.schedule import probe_lr, probe_plan

# Probes at a quarter and half of the reference run (steps 10 and 20), each half as long as the steps so far.
PROBES = ("--set", "train.cooldown_probes=[0.25,0.5]", "--set", "train.cooldown_probe_share=0.5")


def tensors_equal(a, b, where: str = "") -> None:
    """Every tensor of two nested state dicts equal (torch.equal), and every other value too."""
    if isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys(), where
        for k in a:
            tensors_equal(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, (list, tuple)):
        assert isinstance(b, (list, tuple)) and len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            tensors_equal(x, y, f"{where}[{i}]")
    elif torch.is_tensor(a):
        assert torch.is_tensor(b) and a.dtype == b.dtype and torch.equal(a, b), f"{where} differs"
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"


def same_checkpoint(one: Path, other: Path) -> None:
    tensors_equal(load_file(one / "model.safetensors"), load_file(other / "model.safetensors"), "model")
    tensors_equal(load_optimizer_file(one / "optimizer.pt", "cpu"), load_optimizer_file(other / "optimizer.pt", "cpu"),
                  "optimizer")


def state_of(ckpt: Path, step: int) -> dict:
    return json.loads((ckpt / f"step_{step:08d}" / "trainer_state.json").read_text())


@pytest.fixture(scope="module")
def probe_run(tmp_path_factory: pytest.TempPathFactory, tiny_data: Path) -> tuple[Path, Path, str]:
    """The reference run's command with two probes, and an eval every 5 steps (evals change no weight):
    (checkpoint dir, MLflow file store, its log)."""
    root = tmp_path_factory.mktemp("probes")
    ckpt = root / "ckpt"
    args = train_args(tiny_data, ckpt, f"file://{root}/mlruns", *PROBES, "--eval-every", "5")
    proc = run_module("x1_pretrain.train", *args, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return ckpt, root / "mlruns", proc.stderr


def test_a_probe_leaves_the_run_bit_identical_after_it_and_at_the_end(probe_run, reference_run):
    ckpt, _, log = probe_run
    assert "cooldown probe 1/2 (0.25 of the run): forked at step 10, 5 steps" in log
    assert "cooldown probe 2/2 (0.5 of the run): forked at step 20, 10 steps" in log
    # The checkpoints at the probes' own steps are written after them: the state the run went on from.
    for step in range(20, REFERENCE_STEPS + 1, 10):  # (keep_last 3: step 10 is gone)
        same_checkpoint(ckpt / f"step_{step:08d}", reference_run / f"step_{step:08d}")
    assert (ckpt / "final.safetensors").read_bytes() == (reference_run / "final.safetensors").read_bytes()
    tensors_equal(load_optimizer_file(ckpt / "final-optimizer.pt", "cpu"),
                  load_optimizer_file(reference_run / "final-optimizer.pt", "cpu"), "final optimizer")


def test_each_probe_goes_to_mlflow_the_log_the_forecast_and_the_checkpoint(probe_run):
    ckpt, mlruns, log = probe_run
    [metric] = list(mlruns.glob("*/*/metrics/probe_val_loss"))
    logged = {int(line.split()[2]): float(line.split()[1]) for line in metric.read_text().splitlines()}
    assert sorted(logged) == [10, 20]  # at the step each was forked from
    results = state_of(ckpt, REFERENCE_STEPS)["probes"]["results"]
    assert [(r["step"], r["steps"]) for r in results] == [(10, 5), (20, 10)]
    for r in results:
        assert r["val_loss"] == pytest.approx(logged[r["step"]])
        assert f"probe_val_loss {r['val_loss']:.4f}" in log and f"the run goes on from step {r['step']} as it was" in log
    forecast = state_of(ckpt, REFERENCE_STEPS)["forecast"]
    assert forecast["curve"]["probes"] == [[10, 5, pytest.approx(logged[10])], [20, 10, pytest.approx(logged[20])]]
    lines = [ln for ln in log.splitlines() if "forecast: final val loss" in ln]
    assert lines[-1].endswith("+ 2 probes, law lr-annealing, no ladder")
    assert forecast["history"][-1]["probes"] == 2 and forecast["history"][-1]["ladder"] is False


def test_the_forecast_made_at_the_last_eval_is_that_evals_value(probe_run):
    ckpt, _, _ = probe_run
    forecast = state_of(ckpt, REFERENCE_STEPS)["forecast"]
    final = dict(forecast["curve"]["val"])[REFERENCE_STEPS]
    made = {h["step"]: h["value"] for h in forecast["history"]}
    assert abs(made[REFERENCE_STEPS] - final) <= 0.03, (made, final)


def test_sigterm_during_a_probe_exits_75_with_the_runs_checkpoint_and_the_resume_retries_it(tmp_path, tiny_data,
                                                                                           reference_run):
    ckpt = tmp_path / "ckpt"
    # One probe at half the run (step 20), as long as the steps so far: time to stop it midway.
    args = train_args(tiny_data, ckpt, f"file://{tmp_path}/mlruns", "--set", "train.cooldown_probes=[0.5]",
                      "--set", "train.cooldown_probe_share=1.0")
    log = tmp_path / "train.log"
    proc = start_trainer(args, log)
    wait_for(lambda: "forked at step 20" in log.read_text() or proc.poll() is not None, timeout=300,
             what="the probe to start")
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=120) == ExitCode.PREEMPTED, log.read_text()[-3000:]
    text = log.read_text()
    assert "cooldown probe 1/1 (0.5 of the run) from step 20 dropped: stop signal after" in text
    assert (ckpt / "latest").read_text().strip() == "step_00000020"
    same_checkpoint(ckpt / "step_00000020", reference_run / "step_00000020")  # nothing of the run lost
    stopped = state_of(ckpt, 20)
    assert stopped["probes"]["dropped"][0]["step"] == 20 and not stopped["probes"]["results"]

    proc = start_trainer(args + ["--resume-from-latest"], log)
    assert proc.wait(timeout=600) == 0, log.read_text()[-3000:]
    text = log.read_text()
    assert "cooldown probe 1/1 (0.5 of the run) from step 20 was dropped by a stop: retried from step 21" in text
    assert (ckpt / "final.safetensors").read_bytes() == (reference_run / "final.safetensors").read_bytes()
    done = state_of(ckpt, REFERENCE_STEPS)
    assert [(r["step"], r["steps"]) for r in done["probes"]["results"]] == [(21, 19)]  # to the last step
    # The forecast's state continues across the stop: the evals before it and after, its history too.
    curve = done["forecast"]["curve"]
    assert [s for s, _ in curve["val"]] == [20, 40] and curve["probes"][0][:2] == [21, 19]
    assert curve["seen_train"] == REFERENCE_STEPS and done["forecast"]["history"][-1]["step"] == REFERENCE_STEPS


def test_the_probes_still_ahead_count_in_the_budget_projection():
    # The 50M run's probes at 2.5%, 5% and 10% of 84,000 steps, 15% of the steps so far each.
    plan = probe_plan([0.025, 0.05, 0.1], 0.15, 84_000)
    assert [(f, k) for _, f, k in plan] == [(2100, 315), (4200, 630), (8400, 1260)]
    pace = Pace(total_steps=84_000, tokens_per_step=524_288, eval_every=1800, ckpt_every=1800, eval_tokens=131_072,
                expected_tokens_per_sec=524_288.0, expected_source="given", probes=[(f, k) for _, f, k in plan])
    without = Pace(total_steps=84_000, tokens_per_step=524_288, eval_every=1800, ckpt_every=1800,
                   eval_tokens=131_072, expected_tokens_per_sec=524_288.0, expected_source="given")
    need, bare = pace.need(1000), without.need(1000)
    assert need.probes_left == 3 and need.probe_steps == 2205
    # Before one is measured: their steps at the run's pace (1 s a step here) and an eval each.
    assert need.probe_s == pytest.approx(2205 * 1.0 + 3 * need.eval_s)
    assert need.seconds == pytest.approx(bare.seconds + need.probe_s)
    assert "+ 3 probes of 2,205 steps" in need.describe() and "estimated" in need.describe()
    # One measured (its copies and eval included, 1.2 s a probe step): the two still ahead at that rate.
    pace.record(Interval(steps=10, seconds=10.0, tokens=5_242_880), 2200)
    pace.record_probe(315, 378.0)
    after = pace.need(2200)
    assert after.probes_left == 2 and after.probe_s == pytest.approx((630 + 1260) * 1.2)
    assert "(measured)" in after.describe()
    assert pace.need(9000).probes_left == 0 and "probes" not in pace.need(9000).describe()


def test_a_budget_stop_found_during_a_probe_is_acted_on_at_the_runs_next_check():
    from x1_common.alerts import AlertSender
    from x1_pretrain.config import BudgetConfig
    from x1_pretrain.train.budget_guard import BudgetGuard, ReadError

    def unreadable():
        raise ReadError("budget.json: missing")

    guard = BudgetGuard(BudgetConfig(cap_usd=10.0, alert_usd=5.0), AlertSender(), reader=unreadable)
    stop = Decision(Action.CHECKPOINT_AND_EXIT, int(ExitCode.BUDGET_PROJECTED), "projected over", 9.0, 11.0)
    guard.hold(stop)
    assert guard.maybe_check(20) is stop  # the loop's budget check at the run's own step gets it, once
    after = guard.maybe_check(20)
    assert after is not stop and after.exit_code is None and "no budget reading" in after.reason


def test_the_probe_lr_goes_from_the_runs_to_the_floor_in_the_1_sqrt_shape():
    lrs = [probe_lr(j, 100, 3e-4, 3e-5) for j in range(100)]
    assert lrs[-1] == pytest.approx(3e-5) and lrs[0] < 3e-4 and all(a > b for a, b in zip(lrs, lrs[1:], strict=False))
    assert lrs[49] == pytest.approx(3e-5 + 2.7e-4 * (1 - 0.5 ** 0.5))  # half-way: 1 - sqrt(1/2) of the drop left


@pytest.mark.parametrize("value, field", [("[1.5]", "train.cooldown_probes"), ("[0.1,0.1]", "train.cooldown_probes"),
                                          ("[0.95]", "train.cooldown_probes")])
def test_probe_shares_that_cannot_run_are_refused_naming_the_field(value, field):
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        load_config(CONFIGS / "tiny-cpu.yaml", [f"train.cooldown_probes={value}"])


def test_plan_prints_the_probes_cost_and_counts_it_in_the_proposed_steps():
    lab = ["--config", str(CONFIGS / "x1-50m-a100.yaml"), "--price-usd-per-hr", "1.10"]
    bare = run_module("x1_pretrain.plan", *lab, "--json")
    probed = run_module("x1_pretrain.plan", *lab, "--set", "train.cooldown_probes=[0.025,0.05,0.1]")
    assert bare.returncode == 0 and probed.returncode == 0, probed.stderr
    line = next(ln for ln in probed.stdout.splitlines() if ln.startswith("Cooldown probes"))
    assert "3 at 0.025, 0.05, 0.1 of the run" in line and "(2.6% of the run's) + 3 evals" in line and " h = $" in line
    proposed = int(probed.stdout.split("Proposed: --total-steps ")[1].split()[0])
    assert proposed < json.loads(bare.stdout)["proposed_total_steps"]
    assert "Cooldown probes" not in run_module("x1_pretrain.plan", *lab).stdout


def test_the_manifest_lists_each_probe_from_its_mlflow_metrics(probe_run):
    from x1_pretrain.run.export import probes_of
    from x1_pretrain.run.record import load_run

    _, mlruns, _ = probe_run
    record = load_run(f"file://{mlruns}")
    listed = probes_of(record)
    assert [(p["step"], p["steps"]) for p in listed] == [(10, 5), (20, 10)]
    assert all(p["val_loss"] > 0 and p["seconds"] > 0 for p in listed)
