"""One source per figure: every number README.md, docs/DEPLOY.md, .env.example and the configs'
comments quote about speed, floor, hours, dollars and steps is what the tool computes for the
inputs they state (plan's table, the trainer's launch check: budget_guard.launch_projection), so
a figure changed in one place and not the other fails here.
"""

from __future__ import annotations

import json

import pytest

from conftest import CONFIGS, REPO, run_module
from x1_pretrain.config import load_config
from x1_pretrain.train.accounting import expected_tokens_per_sec, fmt_count, throughput_floor, usd
from x1_pretrain.train.budget_guard import launch_projection

README = (REPO / "README.md").read_text(encoding="utf-8")
DEPLOY = (REPO / "docs" / "DEPLOY.md").read_text(encoding="utf-8")
ENV_EXAMPLE = (REPO / ".env.example").read_text(encoding="utf-8")
A100_CONFIG = (CONFIGS / "x1-50m-a100.yaml").read_text(encoding="utf-8")
H200_CONFIG = (CONFIGS / "x1-50m-h200.yaml").read_text(encoding="utf-8")
PRICE, CAP, SETUP_H = 1.10, 35.0, 0.75  # the lab's: what the docs' examples state


def flat(text: str) -> str:
    """Prose with its line breaks and comment markers gone, so a phrase may wrap."""
    return " ".join(line.strip().lstrip("#").strip() for line in text.splitlines())


@pytest.fixture(scope="module")
def plan() -> dict:
    proc = run_module("x1_pretrain.plan", "--config", str(CONFIGS / "x1-50m-a100.yaml"), "--gpu", "a100-80gb",
                      "--provider", "lambda", "--price-usd-per-hr", f"{PRICE:g}", "--budget-usd", f"{CAP:g}", "--json")
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


@pytest.fixture(scope="module")
def cfg():
    return load_config(str(CONFIGS / "x1-50m-a100.yaml"), [])


def test_the_a100_and_h200_speeds_and_floors_are_plans(plan, cfg):
    a100 = fmt_count(plan["tokens_per_sec"])
    floor = fmt_count(plan["floor_tokens_per_sec"])
    assert plan["floor_tokens_per_sec"] == throughput_floor(cfg.train, plan["tokens_per_sec"])[0]
    assert (a100, floor) == ("273k", "164k")  # the figures below, as plan prints them today
    assert f"(A100 80GB: ~{a100} tokens/s, an estimate;" in flat(DEPLOY)
    assert f"(A100: ~{floor} tokens/s;" in flat(DEPLOY)
    assert f"(A100: ~{floor} of its ~{a100} estimate;" in flat(A100_CONFIG)
    h200 = load_config(str(CONFIGS / "x1-50m-h200.yaml"), [])
    measured = expected_tokens_per_sec("h200", h200.model).tokens_per_sec
    assert f"H200: {fmt_count(measured)}, measured" in flat(DEPLOY)
    assert (f"stated, not {h200.train.floor_fraction:g} x plan's {fmt_count(measured)} "
            f"({fmt_count(h200.train.floor_fraction * measured)})") in H200_CONFIG


def test_the_labs_84000_steps_are_quoted_as_the_launch_check_projects_them(plan, cfg):
    lab = launch_projection(cfg, cfg.train.total_steps, plan["tokens_per_sec"], PRICE, CAP, spent_usd=PRICE * SETUP_H)
    hours, projected, fits = f"{lab.hours:.1f} h", usd(lab.projected_usd), lab.fits
    assert (plan["config_total_steps"], plan["config_hours"], plan["config_projected_usd"]) == (
        cfg.train.total_steps, round(lab.hours, 3), round(lab.projected_usd, 2))
    # .env.example's TOTAL_STEPS comment
    env = flat(ENV_EXAMPLE)
    assert f"The lab's {cfg.train.total_steps} below need {hours} of training at plan's A100 figure" in env
    assert f"a projected {projected} over the ${CAP:g} cap" in env and f"names the --total-steps that fit ({fits})" in env
    # DEPLOY's example refusal: the trainer's line for these inputs
    deploy = flat(DEPLOY)
    assert f"once the {SETUP_H:g} h of setup have been billed ({usd(PRICE * SETUP_H)})" in deploy
    assert (f"budget: projected total {projected} is over the cap ${CAP:g}: launch refused; --total-steps {fits} fits "
            f"(of {cfg.train.total_steps:,})") in deploy
    assert (f"spent {usd(PRICE * SETUP_H)} at ${PRICE:.2f}/h; still needed: {lab.need.steps_left:,} steps x "
            f"{lab.need.seconds_per_step:.3g} s (plan: {fmt_count(plan['tokens_per_sec'])} tokens/s, ...) + "
            f"{lab.need.evals_left} evals x {lab.need.eval_s:.2g} s (estimated: a forward) + ... = {lab.hours:.3g} h "
            f"billed, +10% -> own {projected}") in deploy
    # ... and what plan proposes beside it
    assert plan["fits_total_steps"] == fits
    assert (f"({fits:,} steps here) and no more than its `--hours` buy ({plan['hours_total_steps']:,} in 24 h at this "
            "speed)") in deploy


def test_the_pre_launch_sentence_and_the_predicted_loss_the_readme_quotes_are_plans(plan):
    assert f'("{plan["sentence"]}")' in flat(README)
    assert plan["proposed_hours"] == pytest.approx(24, abs=0.05)  # DEPLOY: "the plan's hours (24)"
    assert "the plan's hours (24) into PLANNED_HOURS" in DEPLOY
    assert f"(about {plan['predicted_val_loss']:.1f} for the planned run)" in flat(README)


def test_the_data_passes_and_the_one_pass_fetch_deploy_quotes_are_plans(plan):
    from x1_pretrain.data.prepare import PARQUET_BYTES_PER_TOKEN, TOKEN_BYTES

    deploy = flat(DEPLOY)
    assert f"~{plan['data_passes']:.1f} for the lab's 24 h" in deploy
    assert plan["one_pass"]["command"] in deploy
    assert f"about {PARQUET_BYTES_PER_TOKEN + TOKEN_BYTES:g} GB of disk per billion tokens" in deploy
