"""`plan`: the pre-launch sentence, its refusal, and the numbers behind it."""

from __future__ import annotations

import json

import pytest

from conftest import CONFIGS, REPO, run_module
from x1_pretrain.train.accounting import chinchilla_loss, fmt_count

LAB_RUN = ["--config", str(CONFIGS / "x1-50m-a100.yaml"), "--gpu", "a100-80gb", "--provider", "lambda",
        "--hours", "24", "--budget-usd", "35"]


def test_plan_prints_the_pre_launch_sentence():
    proc = run_module("x1_pretrain.plan", *LAB_RUN, "--price-usd-per-hr", "1.10")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines()[0] == (
        "This will launch 1× A100 80GB on-demand on Lambda at $1.10/h, run ~24 h including setup = $26.40. "
        "Budget: $35. Confirmed acceptable, $8.60 buffer."
    )
    assert "Proposed: --total-steps" in proc.stdout


def test_plan_states_when_the_forecast_first_judges_the_run():
    # The 50M config: warm-up 1000, evals every 1800 steps: the second eval is the first with enough points.
    proc = run_module("x1_pretrain.plan", *LAB_RUN, "--price-usd-per-hr", "1.10")
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("final-loss forecast:"))
    assert "first at step 3,600" in line and "--forecast-band (default 3.20-3.50)" in line and "exit 80" in line


def test_plan_states_the_forecasts_measured_accuracy_as_its_benchmark_files_hold_it():
    # Each figure is the "no probes, no ladder" row of a held-out GPU table in docs/forecast-runs/, or
    # with earlier runs as prior its "no probes, earlier runs" row.
    from x1_pretrain.train.forecast_rule import MEASURED_ACCURACY, MEASURED_WITH_EARLIER_RUNS

    proc = run_module("x1_pretrain.plan", *LAB_RUN, "--price-usd-per-hr", "1.10")
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("forecast accuracy, measured"))
    assert "the aim is 0.05 at 25% and 0.03 at 50%" in line
    for rows, prefix in ((MEASURED_ACCURACY, "| no | no |"), (MEASURED_WITH_EARLIER_RUNS, "| no | earlier runs |")):
        for what, path, errors in rows:
            row = next(x for x in (REPO / path).read_text().splitlines() if x.startswith(prefix))
            assert tuple(float(cell.split()[0]) for cell in row.strip("|").split("|")[2:5]) == errors, path
            assert "/".join(f"{e:.2f}" for e in errors) + f" on {what}" in line


def test_plan_refuses_with_78_above_the_max_price():
    proc = run_module("x1_pretrain.plan", *LAB_RUN, "--price-usd-per-hr", "1.50")
    assert proc.returncode == 78
    assert "Refused" in proc.stdout and "max price $1.40/h" in proc.stdout


def test_plan_proposes_the_steps_the_budget_fits_and_bills_those_not_the_hours_asked():
    # $1.30/h for 24 h is $31.20, plus $8 of other lines: over $35. The plan proposes fewer steps,
    # and its sentence bills what those steps take, not 24 h x the price.
    proc = run_module("x1_pretrain.plan", *LAB_RUN, "--price-usd-per-hr", "1.30", "--restart-buffer-usd", "5",
                      "--storage-usd", "2", "--egress-usd", "1", "--json")
    assert proc.returncode == 0, proc.stderr
    plan = json.loads(proc.stdout)
    assert plan["verdict"] == "go" and plan["proposed_total_steps"] < plan["hours_total_steps"]
    assert plan["proposed_hours"] < 24 and plan["cost_usd"] == round(1.30 * plan["proposed_hours"], 2)
    assert plan["total_usd"] <= 35 and plan["total_usd"] == round(plan["cost_usd"] + 8, 2)


def test_plan_refuses_when_no_step_fits_the_budget():
    proc = run_module("x1_pretrain.plan", *LAB_RUN, "--price-usd-per-hr", "1.30", "--storage-usd", "34.5", "--json")
    assert proc.returncode == 78
    plan = json.loads(proc.stdout)
    assert plan["verdict"] == "refuse" and "no step fits the budget" in plan["reasons"][0]


def test_plan_off_the_default_path_uses_the_gpus_own_ceiling_and_advice_for_the_provider_asked():
    h100 = ["--config", str(CONFIGS / "x1-50m-a100.yaml"), "--gpu", "h100-sxm", "--provider", "runpod"]
    ok = run_module("x1_pretrain.plan", *h100, "--price-usd-per-hr", "2.69")
    assert ok.returncode == 0, ok.stdout
    assert ok.stdout.startswith("This will launch 1× H100 80GB SXM interruptible on RunPod at $2.69/h, run ~")
    assert "$64.56" not in ok.stdout  # 24 h x $2.69: not what the proposed steps cost
    high = run_module("x1_pretrain.plan", *h100, "--price-usd-per-hr", "6.00", "--json")
    assert high.returncode == 78
    reason = json.loads(high.stdout)["reasons"][0]
    assert "over the max price $4.43/h for the H100 80GB SXM" in reason and "RunPod community" not in reason
    assert "python -m budget_sidecar.price --provider runpod --wait" in reason
    lam = run_module("x1_pretrain.plan", *LAB_RUN, "--price-usd-per-hr", "1.50", "--json")
    assert "RunPod interruptible pod" in json.loads(lam.stdout)["reasons"][0]
    spot = run_module("x1_pretrain.plan", *LAB_RUN, "--price-usd-per-hr", "1.10", "--market", "spot")
    assert spot.returncode == 2 and "Lambda sells on-demand instances" in spot.stderr


def test_plan_says_which_loss_to_believe_against_the_dod_band():
    proc = run_module("x1_pretrain.plan", *LAB_RUN, "--price-usd-per-hr", "1.10", "--json")
    plan = json.loads(proc.stdout)
    assert plan["dod_band"] == [3.2, 3.5] and plan["predicted_val_loss"] < 3.2
    assert f"fit's {plan['predicted_val_loss']:.2f} is below it" in plan["band_note"]
    assert "believe the band" in plan["band_note"]


def test_plan_json_has_the_numbers_and_only_json_on_stdout():
    proc = run_module("x1_pretrain.plan", *LAB_RUN, "--price-usd-per-hr", "1.10", "--json")
    assert proc.returncode == 0
    plan = json.loads(proc.stdout)
    for key in ["params_non_embedding", "params_total", "flops_per_token", "tokens_per_sec", "hours", "tokens",
                "cost_usd", "buffer_usd", "predicted_val_loss", "chinchilla_optimal_tokens", "proposed_total_steps",
                "verdict", "reasons"]:
        assert key in plan, key
    assert plan["verdict"] == "go" and plan["reasons"] == []
    assert plan["cost_usd"] == 26.40 and plan["buffer_usd"] == 8.60
    # Throughput from the table, never the lab's impossible 500k on an A100; labelled as an estimate.
    assert plan["tokens_per_sec"] < 300_000 and plan["tokens_per_sec_source"].startswith("estimate")
    assert plan["proposed_total_steps"] == int(plan["tokens"] // 524288)
    # Hoffmann's N counts all parameters: 88.9M, so the prediction is below ln(V) and above E.
    assert 1.69 < plan["predicted_val_loss"] < 4.0


def test_plan_uses_given_throughput():
    proc = run_module("x1_pretrain.plan", *LAB_RUN, "--price-usd-per-hr", "1.10", "--tokens-per-sec", "250000", "--json")
    plan = json.loads(proc.stdout)
    assert plan["tokens_per_sec"] == 250000
    assert plan["hours_total_steps"] == int(250000 * (24 - 0.75) * 3600 // 524288)
    assert plan["tokens"] == plan["proposed_total_steps"] * 524288


def test_plan_rejects_nonsense_numbers_with_2():
    proc = run_module("x1_pretrain.plan", *LAB_RUN, "--price-usd-per-hr", "-1")
    assert proc.returncode == 2 and "--price-usd-per-hr" in proc.stderr


# ---------------------------------------------------------------------------------------------
# One truth: the table shows what the plan proposes, whichever of the hours, the budget or the price binds


def plan_text_and_json(*flags: str) -> tuple[str, dict]:
    text = run_module("x1_pretrain.plan", *LAB_RUN[:-2], *flags)
    as_json = run_module("x1_pretrain.plan", *LAB_RUN[:-2], *flags, "--json")
    assert text.returncode == 0 and as_json.returncode == 0, text.stdout + text.stderr
    return text.stdout, json.loads(as_json.stdout)


def table_row(text: str, name: str) -> str:
    return next(line for line in text.splitlines() if line.startswith(f"  {name:<20} "))[23:]


@pytest.mark.parametrize(("flags", "binds"), [
    (("--price-usd-per-hr", "1.10", "--budget-usd", "20"), "The money binds"),  # the budget: 29,700 steps
    (("--price-usd-per-hr", "1.64", "--max-price-usd-per-hr", "2", "--budget-usd", "35"), "The money binds"),
    (("--price-usd-per-hr", "1.10", "--budget-usd", "35"), "The hours bind"),
])
def test_plans_table_is_its_proposal_whether_the_hours_the_budget_or_the_price_binds(flags, binds):
    text, plan = plan_text_and_json(*flags)
    steps, hours = plan["proposed_total_steps"], plan["proposed_hours"]
    assert f"Proposed: --total-steps {steps} (~{hours:.1f} h with setup = ${plan['cost_usd']:.2f}" in text
    assert f"run ~{hours:.1f} h including setup" in text or (hours == pytest.approx(24, abs=0.05) and "run ~24 h" in text)
    # The table: the proposal's training hours, its steps in the `tokens bought ... = N steps` form, its tokens.
    assert table_row(text, "training hours") == f"{hours - 0.75:.2f} (of {hours:.2f}, 0.75 h setup)"
    assert table_row(text, "tokens bought") == f"{fmt_count(steps * 524288)} = {steps:,} steps of 524k"
    assert plan["tokens"] == steps * 524288
    # The predicted loss is the proposal's, and names its token count.
    assert plan["predicted_val_loss"] == round(chinchilla_loss(plan["params_total"], steps * 524288), 3)
    assert table_row(text, "predicted val loss").startswith(
        f"{plan['predicted_val_loss']:.2f} nats/token at {fmt_count(steps * 524288)} tokens")
    # What --hours would buy appears only as what binds, never as the plan's figures.
    assert binds in text and f"{plan['hours_total_steps']:,} steps" in text
    if binds == "The money binds":
        assert steps == plan["fits_total_steps"] < plan["hours_total_steps"]
        assert "23.25" not in table_row(text, "training hours") and "43,583" not in table_row(text, "tokens bought")


def test_plan_proposes_what_the_trainers_own_launch_check_fits():
    # The trainer, launched with plan's proposal once the setup is billed, projects under the cap.
    from x1_pretrain.config import load_config
    from x1_pretrain.train.budget_guard import launch_projection

    text, plan = plan_text_and_json("--price-usd-per-hr", "1.10", "--budget-usd", "20")
    cfg = load_config(str(CONFIGS / "x1-50m-a100.yaml"), [])
    check = launch_projection(cfg, plan["proposed_total_steps"], plan["tokens_per_sec"], 1.10, 20, spent_usd=0.75 * 1.10)
    assert check.projected_usd <= 20 < launch_projection(cfg, plan["proposed_total_steps"] + 200, plan["tokens_per_sec"],
                                                          1.10, 20, spent_usd=0.75 * 1.10).projected_usd


def test_plan_states_the_passes_over_the_data_and_how_prepare_fetches_one_pass():
    from x1_pretrain.data import prepare

    text, plan = plan_text_and_json("--price-usd-per-hr", "1.10", "--budget-usd", "35")
    assert table_row(text, "data") == "22.9B tokens from FineWeb-Edu sample/10BT (~10B tokens): ~2.3 passes over the data"
    assert plan["data_passes"] == pytest.approx(plan["tokens"] / 10e9)
    one = plan["one_pass"]
    assert f"`{one['command']}` fetches them from FineWeb-Edu sample/100BT" in text
    assert f"~{one['disk_gb']} GB of disk" in text and f"~{one['tokenize_minutes']} min to tokenize" in text
    # 2.2 bytes of parquet and 2 of tokens a token: about 96 GB for 22.9B tokens.
    assert one["disk_gb"] == round(plan["tokens"] * 4.2 / 1e9)
    # The command it prints is one prepare accepts.
    args = prepare.parse_args(one["command"].split()[3:])
    assert args.source == "fineweb-edu-100bt" and args.max_tokens == pytest.approx(22.9e9)
