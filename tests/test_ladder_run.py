"""A real ladder on the CPU: `ladder plan` against the money, `ladder run` training its rungs with
the trainer, two at once, killed with SIGKILL mid-way and finished without retraining a rung."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO, cli_env, run_module, wait_for

# The tiny config made wider (128) so that two narrower sizes (32, 64) fit below it.
TARGET = ["--config", str(REPO / "configs" / "tiny-cpu.yaml"), "--set", "model.d_model=128", "--set", "model.d_ff=344",
          "--set", "model.n_head=8", "--set", "model.n_kv_head=4",
          "--set", "train.eval_windows=4"]
SMALL = ["--sizes", "2", "--budgets", "2", "--no-lr-sweep", "--smallest-width", "32", "--gpu", "h200",
         "--tokens-per-sec", "20000", "--total-steps", "1000"]


def plan(tmp_path: Path, data: Path, *extra: str) -> subprocess.CompletedProcess:
    return run_module("x1_pretrain.ladder", "plan", *TARGET, "--data-dir", str(data), *SMALL, "--out",
                      str(tmp_path / "ladder"), *extra)


def test_plan_says_what_the_ladder_costs_in_the_labs_form_and_writes_the_plan(tmp_path, tiny_data):
    proc = plan(tmp_path, tiny_data, "--tokens-per-param", "0.0065")
    assert proc.returncode == 0, proc.stderr
    first = proc.stdout.splitlines()[0]
    assert first.startswith("This ladder will run 4 rungs on 1× H200 141GB at $1.10/h for ~")
    assert "with the main run's $" in first and "of the $35 cap." in first
    saved = json.loads((tmp_path / "ladder" / "plan.json").read_text())
    assert [r["role"] for r in saved["rungs"]] == ["fit"] * 4
    assert saved["inputs"]["provenance"]["tokenizer"] == "gpt2"
    widths = sorted({r["model"]["d_model"] for r in saved["rungs"]})
    assert widths == [32, 64]


def test_a_ladder_that_would_take_the_run_over_its_cap_is_refused_with_78_and_nothing_started(tmp_path, tiny_data):
    proc = plan(tmp_path, tiny_data, "--tokens-per-param", "0.0065", "--budget-usd", "0.5", "--price-usd-per-hr", "1.0",
                "--tokens-per-sec", "200")
    assert proc.returncode == 78, proc.stdout + proc.stderr
    assert "Refused:" in proc.stdout and "over the cap" in proc.stdout
    assert not (tmp_path / "ladder").exists()


def test_a_rung_needing_more_tokens_than_the_corpus_holds_exits_2_naming_both_numbers(tmp_path, tiny_data):
    proc = plan(tmp_path, tiny_data, "--tokens-per-param", "5")
    assert proc.returncode == 2
    meta = json.loads((tiny_data / "meta.json").read_text())
    assert "the corpus holds" in proc.stderr and f"{meta['train_tokens']:,}" in proc.stderr
    assert not (tmp_path / "ladder").exists()


def test_named_widths_on_a_token_grid_give_every_size_the_same_budgets(tmp_path, tiny_data):
    proc = plan(tmp_path, tiny_data, "--widths", "32,64,96", "--budgets-by", "tokens", "--budget-step", "3",
                "--max-flops", "3e12")
    assert proc.returncode == 0, proc.stderr
    rungs = json.loads((tmp_path / "ladder" / "plan.json").read_text())["rungs"]
    assert sorted({r["model"]["d_model"] for r in rungs}) == [32, 64, 96]
    grid = {w: sorted(r["tokens"] for r in rungs if r["model"]["d_model"] == w) for w in (32, 64, 96)}
    for budgets in grid.values():  # the same budgets at every size, each ~3x the last (whole steps)
        assert len(budgets) == 2 and budgets[1] / budgets[0] == pytest.approx(3, rel=0.2)
        assert budgets[0] == pytest.approx(grid[32][0], rel=0.2)
    flops = sum(r["flops_per_token"] * r["tokens"] for r in rungs)
    assert flops == pytest.approx(3e12, rel=0.2)


def test_iso_flop_budgets_give_every_size_the_same_compute_and_the_smallest_the_most_tokens(tmp_path, tiny_data):
    proc = plan(tmp_path, tiny_data, "--widths", "32,64,96", "--budgets-by", "flops", "--max-flops", "3e12")
    assert proc.returncode == 0, proc.stderr
    rungs = json.loads((tmp_path / "ladder" / "plan.json").read_text())["rungs"]
    for k in range(2):  # the k-th budget of every size: the same FLOPs (whole steps aside)
        level = [sorted(r["flops_per_token"] * r["tokens"] for r in rungs if r["model"]["d_model"] == w)[k]
                 for w in (32, 64, 96)]
        assert max(level) / min(level) == pytest.approx(1, abs=0.2)
    most = max(rungs, key=lambda r: r["tokens"])
    assert most["model"]["d_model"] == 32


def test_each_rung_warms_up_for_the_share_of_its_steps_that_the_main_run_will(tmp_path, tiny_data):
    """The share is of the steps the main run will train (--total-steps, or what plan proposes), not
    of the config's total_steps: a rung of a 400-step run with 10 warm-up steps warms up for 2.5%."""
    proc = plan(tmp_path, tiny_data, "--tokens-per-param", "0.0065", "--total-steps", "400")
    assert proc.returncode == 0, proc.stderr
    rungs = json.loads((tmp_path / "ladder" / "plan.json").read_text())["rungs"]
    for r in rungs:  # tiny-cpu.yaml: 10 warm-up steps of its 200; the main run here trains 400
        assert r["recipe"]["warmup_steps"] == round(r["recipe"]["total_steps"] * 10 / 400), r["name"]
    assert any(r["recipe"]["warmup_steps"] != round(r["recipe"]["total_steps"] * 10 / 200) for r in rungs)


@pytest.mark.parametrize("flags, named", [(["--widths", "32,256"], "--widths 256"), (["--widths", "32,40"], "--widths"),
                                          (["--budgets-by", "tokens", "--tokens-per-param", "0.01"], "--tokens-per-param"),
                                          (["--budget-step", "1"], "--budget-step 1")])
def test_bad_widths_or_budgets_exit_2_naming_the_flag_and_write_nothing(tmp_path, tiny_data, flags, named):
    proc = plan(tmp_path, tiny_data, *flags)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert named in proc.stderr
    assert not (tmp_path / "ladder").exists()


@pytest.mark.slow
def test_a_ladder_killed_mid_way_finishes_without_retraining_a_finished_rung(tmp_path, tiny_data):
    assert plan(tmp_path, tiny_data, "--tokens-per-param", "0.0065", "--jobs", "2").returncode == 0
    folder = tmp_path / "ladder"
    names = [r["name"] for r in json.loads((folder / "plan.json").read_text())["rungs"]]
    argv = [sys.executable, "-m", "x1_pretrain.ladder", "run", "--dir", str(folder)]
    log1 = tmp_path / "run1.log"
    with open(log1, "wb") as out:
        runner = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=cli_env(), cwd=REPO)

    def checkpointed_unfinished() -> bool:
        done = {r["name"] for r in json.loads((folder / "rungs.json").read_text())} if (folder / "rungs.json").exists() else set()
        return bool(done) and any((folder / "rungs" / n / "checkpoints" / "latest").exists() for n in names if n not in done)

    try:
        wait_for(checkpointed_unfinished, timeout=400, what="a finished rung and another one checkpointed")
    finally:
        runner.send_signal(signal.SIGKILL)
        runner.wait()
    text = log1.read_text()
    # Two rungs at once: the second started before the first finished.
    starts = [line for line in text.splitlines() if "ladder: started" in line]
    assert len(starts) >= 2 and text.index(starts[1]) < text.index(" done: final val loss"), text
    finished = json.loads((folder / "rungs.json").read_text())
    done_logs = {r["name"]: (folder / "rungs" / r["name"] / "train.log").read_bytes() for r in finished}
    # The rungs it left get SIGTERM as the runner dies (the parent-death signal): they checkpoint and go.
    wait_for(lambda: not any(_alive(f) for f in (folder / "rungs").glob("*/heartbeat.json")), timeout=120,
             what="the killed ladder's rungs to stop")

    proc = subprocess.run(argv, capture_output=True, text=True, env=cli_env(), cwd=REPO, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    after = json.loads((folder / "rungs.json").read_text())
    assert sorted(r["name"] for r in after) == sorted(names)
    assert after[: len(finished)] == finished  # kept as they were
    for name, log in done_logs.items():
        assert (folder / "rungs" / name / "train.log").read_bytes() == log, f"{name} was trained again"
        assert f"started {name}" not in proc.stdout
    assert "already done" in proc.stdout
    resumed = [n for n in names if n not in done_logs and "resuming from" in (folder / "rungs" / n / "train.log").read_text()]
    assert resumed, "no interrupted rung resumed from its checkpoint"
    for r in after:
        assert r["final_val_loss"] > 0 and r["curve"][-1][0] == r["schedule"]["total_steps"]
    # Four rungs are too few for the law's five parameters: said, and the rungs kept.
    assert "no fit: the fit: too few rungs" in proc.stdout
    assert not (folder / "ladder.json").exists()


def _alive(heartbeat: Path) -> bool:
    try:
        pid = json.loads(heartbeat.read_text())["pid"]
        os.kill(pid, 0)
    except (OSError, ValueError, KeyError):
        return False
    # A zombie (reaped by nobody yet) is not running a rung.
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except OSError:
        return False


def test_the_run_refuses_a_folder_without_a_plan_naming_what_to_give(tmp_path):
    proc = run_module("x1_pretrain.ladder", "run", "--dir", str(tmp_path / "nothing-here"))
    assert proc.returncode == 2
    assert "no plan.json" in proc.stderr and "--config" in proc.stderr
