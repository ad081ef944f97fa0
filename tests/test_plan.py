"""`plan`: the seed's pre-launch sentence, its refusal, and the numbers behind it."""

from __future__ import annotations

import json

from conftest import CONFIGS, run_module

SEED = ["--config", str(CONFIGS / "x1-50m-a100.yaml"), "--gpu", "a100-80gb", "--provider", "lambda",
        "--hours", "24", "--budget-usd", "35"]


def test_plan_prints_the_seed_sentence():
    proc = run_module("x1_pretrain.plan", *SEED, "--price-usd-per-hr", "1.10")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines()[0] == (
        "This will launch 1× A100 80GB spot on Lambda at $1.10/h, run ~24 h including setup = $26.40. "
        "Budget: $35. Confirmed acceptable, $8.60 buffer."
    )
    assert "Proposed: --total-steps" in proc.stdout


def test_plan_refuses_with_78_above_the_max_price():
    proc = run_module("x1_pretrain.plan", *SEED, "--price-usd-per-hr", "1.50")
    assert proc.returncode == 78
    assert "Refused" in proc.stdout and "max price $1.40/h" in proc.stdout


def test_plan_refuses_when_the_projection_exceeds_the_budget():
    proc = run_module("x1_pretrain.plan", *SEED, "--price-usd-per-hr", "1.30", "--restart-buffer-usd", "5",
                      "--storage-usd", "2", "--egress-usd", "1", "--json")
    assert proc.returncode == 78
    plan = json.loads(proc.stdout)
    assert plan["verdict"] == "refuse" and "over the budget" in plan["reasons"][0]


def test_plan_json_has_the_numbers_and_only_json_on_stdout():
    proc = run_module("x1_pretrain.plan", *SEED, "--price-usd-per-hr", "1.10", "--json")
    assert proc.returncode == 0
    plan = json.loads(proc.stdout)
    for key in ["params_non_embedding", "params_total", "flops_per_token", "tokens_per_sec", "hours", "tokens",
                "cost_usd", "buffer_usd", "predicted_val_loss", "chinchilla_optimal_tokens", "proposed_total_steps",
                "verdict", "reasons"]:
        assert key in plan, key
    assert plan["verdict"] == "go" and plan["reasons"] == []
    assert plan["cost_usd"] == 26.40 and plan["buffer_usd"] == 8.60
    # Throughput from the table, never the seed's impossible 500k on an A100; labelled as an estimate.
    assert plan["tokens_per_sec"] < 300_000 and plan["tokens_per_sec_source"].startswith("estimate")
    assert plan["proposed_total_steps"] == int(plan["tokens"] // 524288)
    # Hoffmann's N counts all parameters: 88.9M, so the prediction is below ln(V) and above E.
    assert 1.69 < plan["predicted_val_loss"] < 4.0


def test_plan_uses_given_throughput():
    proc = run_module("x1_pretrain.plan", *SEED, "--price-usd-per-hr", "1.10", "--tokens-per-sec", "250000", "--json")
    plan = json.loads(proc.stdout)
    assert plan["tokens_per_sec"] == 250000
    assert abs(plan["tokens"] - 250000 * (24 - 0.75) * 3600) < 1


def test_plan_rejects_nonsense_numbers_with_2():
    proc = run_module("x1_pretrain.plan", *SEED, "--price-usd-per-hr", "-1")
    assert proc.returncode == 2 and "--price-usd-per-hr" in proc.stderr
