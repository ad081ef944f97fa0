"""Before renting: what the money buys, in the seed's one sentence, and whether to launch at all.

    python -m x1_pretrain.plan --config configs/x1-50m-a100.yaml --gpu a100-80gb --provider lambda \\
        --price-usd-per-hr 1.10 --hours 24 --budget-usd 35

prints "This will launch 1× A100 80GB spot on Lambda at $1.10/h, run ~24 h including setup =
$26.40. Budget: $35. Confirmed acceptable, $8.60 buffer." followed by the numbers behind it, and
exits 78 (launch refused) when the price is over the max price or the projection over the budget.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import asdict, dataclass, field

from x1_common.contracts import ExitCode
from x1_pretrain.accounting import (
    CHINCHILLA,
    GPU_DISPLAY,
    GPU_PEAK_TFLOPS,
    chinchilla_loss,
    chinchilla_optimal_tokens,
    expected_tokens_per_sec,
    flops_per_token,
    fmt_count,
    mfu,
    param_counts,
    steps_that_fit,
)
from x1_pretrain.config import ConfigError, RunConfig, load_config

PROVIDER_DISPLAY = {"lambda": "Lambda", "runpod": "RunPod", "static": "on-prem"}


def usd(x: float) -> str:
    """$35 for whole dollars, $26.40 otherwise (the seed's style)."""
    return f"${x:.0f}" if abs(x - round(x)) < 0.005 else f"${x:.2f}"


@dataclass
class Plan:
    gpu: str
    provider: str
    market: str
    price_usd_per_hr: float
    hours: float
    setup_hours: float
    budget_usd: float
    max_price_usd_per_hr: float
    extras_usd: dict[str, float]
    params_non_embedding: int
    params_total: int
    flops_per_token: float
    tokens_per_sec: float
    tokens_per_sec_source: str
    mfu_datasheet: float
    tokens: float
    tokens_per_step: int
    proposed_total_steps: int
    cost_usd: float  # compute only, as the seed's sentence
    total_usd: float  # compute + the configured extra lines
    buffer_usd: float
    predicted_val_loss: float
    predicted_val_loss_note: str
    chinchilla_optimal_tokens: float
    verdict: str  # "go" or "refuse"
    reasons: list[str] = field(default_factory=list)
    sentence: str = ""

    def to_json(self) -> dict:
        return asdict(self)


def make_plan(
    cfg: RunConfig,
    *,
    gpu: str,
    provider: str,
    price_usd_per_hr: float,
    hours: float,
    budget_usd: float,
    max_price_usd_per_hr: float = 1.40,
    tokens_per_sec: float | None = None,
    setup_hours: float = 0.75,
    market: str = "spot",
    extras_usd: dict[str, float] | None = None,
) -> Plan:
    extras = {k: v for k, v in (extras_usd or {}).items() if v}
    counts = param_counts(cfg.model)
    if tokens_per_sec is None:
        row = expected_tokens_per_sec(gpu, cfg.model)  # the trainer's launch check and floor use this same figure
        if row is None:
            raise ConfigError(f"--gpu {gpu}: no throughput figure for it; give --tokens-per-sec")
        tps, source = row.tokens_per_sec, row.source
    else:
        tps, source = float(tokens_per_sec), "given: --tokens-per-sec"
    train_hours = max(hours - setup_hours, 0.0)
    tokens = tps * train_hours * 3600.0
    # The trainer refuses a launch whose steps, at this throughput plus its margin, would not finish
    # under the cap once the setup hours are spent: propose no more than that, so that a plan's
    # --total-steps is never refused by the trainer.
    # Its evals are counted as it counts them before measuring one: a forward over the eval tokens
    # at three times the training rate, every eval_every steps.
    eval_share = cfg.train.eval_windows * cfg.model.seq_len / (3.0 * cfg.train.tokens_per_step * cfg.train.eval_every)
    fits = steps_that_fit(budget_usd - price_usd_per_hr * setup_hours, price_usd_per_hr,
                          cfg.train.tokens_per_step / tps * (1.0 + eval_share), cfg.budget.margin)
    if fits >= 1000:  # a round figure, as the trainer names one, with a little slack
        fits = fits // 100 * 100
    cost = price_usd_per_hr * hours
    total = cost + sum(extras.values())
    reasons = []
    if price_usd_per_hr > max_price_usd_per_hr:
        reasons.append(
            f"price {usd(price_usd_per_hr)}/h is over the max price {usd(max_price_usd_per_hr)}/h: "
            "wait 4 hours and re-check (budget_sidecar.price --wait), or try RunPod community"
        )
    if total > budget_usd:
        reasons.append(f"projected {usd(total)} is over the budget {usd(budget_usd)}")
    verdict = "refuse" if reasons else "go"
    what = f"1× {GPU_DISPLAY.get(gpu, gpu)} {market} on {PROVIDER_DISPLAY.get(provider, provider)}"
    sentence = (
        f"This will launch {what} at {usd(price_usd_per_hr)}/h, run ~{hours:g} h including setup = {usd(cost)}. "
        f"Budget: {usd(budget_usd)}. "
    )
    sentence += (
        f"Confirmed acceptable, {usd(budget_usd - cost)} buffer."
        if verdict == "go"
        else "Refused: " + "; ".join(reasons) + "."
    )
    return Plan(
        gpu=gpu,
        provider=provider,
        market=market,
        price_usd_per_hr=price_usd_per_hr,
        hours=hours,
        setup_hours=setup_hours,
        budget_usd=budget_usd,
        max_price_usd_per_hr=max_price_usd_per_hr,
        extras_usd=extras,
        params_non_embedding=counts["non_embedding"],
        params_total=counts["total"],
        flops_per_token=flops_per_token(cfg.model),
        tokens_per_sec=tps,
        tokens_per_sec_source=source,
        mfu_datasheet=mfu(tps, cfg.model, GPU_PEAK_TFLOPS.get(gpu, 0.0)),
        tokens=tokens,
        tokens_per_step=cfg.train.tokens_per_step,
        proposed_total_steps=min(int(tokens // cfg.train.tokens_per_step), fits),
        cost_usd=round(cost, 2),
        total_usd=round(total, 2),
        buffer_usd=round(budget_usd - total, 2),
        predicted_val_loss=round(chinchilla_loss(counts["total"], tokens), 3),
        predicted_val_loss_note=(
            "Hoffmann 2022 fit (E={E}, A={A}, B={B}, alpha={alpha}, beta={beta}), N = all parameters incl. "
            "embeddings; fitted on MassiveText with another tokenizer, so a guide for FineWeb-Edu / GPT-2 BPE"
        ).format(**CHINCHILLA),
        chinchilla_optimal_tokens=chinchilla_optimal_tokens(counts["total"]),
        verdict=verdict,
        reasons=reasons,
        sentence=sentence,
    )


def render(plan: Plan, cfg: RunConfig) -> str:
    seed_steps = cfg.train.total_steps
    seed_tokens = seed_steps * cfg.train.tokens_per_step
    lines = [plan.sentence, ""]
    if plan.extras_usd:
        lines.append("Other lines of the budget (not in the sentence, which counts compute only):")
        for name, value in plan.extras_usd.items():
            lines.append(f"  {name:<16} {usd(value)}")
        left = f"{usd(plan.buffer_usd)} left" if plan.buffer_usd >= 0 else f"{usd(-plan.buffer_usd)} over"
        lines.append(f"  {'total':<16} {usd(plan.total_usd)} of {usd(plan.budget_usd)}, {left}")
        lines.append("")
    hours_needed = seed_tokens / plan.tokens_per_sec / 3600 + plan.setup_hours
    rows = [
        ("parameters", f"{fmt_count(plan.params_non_embedding)} non-embedding, {fmt_count(plan.params_total)} total"),
        ("FLOPs/token", f"{plan.flops_per_token / 1e6:.0f}M (PaLM: 6 N_matmul + 12 L d T)"),
        ("tokens/s", f"{fmt_count(plan.tokens_per_sec)} ({plan.tokens_per_sec_source})"),
        ("MFU (datasheet)", f"{plan.mfu_datasheet:.3f}"),
        ("training hours", f"{plan.hours - plan.setup_hours:g} (of {plan.hours:g}, {plan.setup_hours:g} h setup)"),
        ("tokens bought", f"{fmt_count(plan.tokens)} = {int(plan.tokens // plan.tokens_per_step):,} steps of "
                          f"{fmt_count(plan.tokens_per_step)}"),
        ("predicted val loss", f"{plan.predicted_val_loss:.2f} nats/token (Chinchilla fit, another corpus: a guide)"),
        ("Chinchilla-optimal", f"{fmt_count(plan.chinchilla_optimal_tokens)} tokens for {fmt_count(plan.params_total)} params (fit)"),
    ]
    lines += [f"  {k:<20} {v}" for k, v in rows]
    lines.append("")
    if plan.proposed_total_steps < seed_steps:
        lines.append(
            f"The config's {seed_steps:,} steps = {fmt_count(seed_tokens)} tokens would need ~{hours_needed:.0f} h "
            f"(~{usd(hours_needed * plan.price_usd_per_hr)}) at this speed."
        )
    if plan.proposed_total_steps < int(plan.tokens // plan.tokens_per_step):
        lines.append(f"The trainer's own projection (spent + rate x the time left, +{cfg.budget.margin:.0%}) fits "
                     f"{plan.proposed_total_steps:,} steps under {usd(plan.budget_usd)} after {plan.setup_hours:g} h of setup.")
    lines.append(f"Proposed: --total-steps {plan.proposed_total_steps}")
    if plan.tokens_per_sec_source.startswith("given"):
        # The trainer's launch check and throughput floor otherwise use the table's figure for its GPU.
        lines.append(f"Give the trainer the same throughput: --expected-tokens-per-sec {plan.tokens_per_sec:g}")
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m x1_pretrain.plan",
        description="The pre-launch sentence and numbers: what the budget buys; exit 78 when the launch should not happen.",
    )
    p.add_argument("--config", required=True, help="run config YAML, e.g. configs/x1-50m-a100.yaml")
    p.add_argument("--set", action="append", default=[], metavar="SECTION.FIELD=VALUE", help="override a config field")
    p.add_argument("--gpu", default="a100-80gb", choices=sorted(k for k in GPU_PEAK_TFLOPS if k != "cpu"))
    p.add_argument("--provider", default="lambda", choices=sorted(PROVIDER_DISPLAY))
    p.add_argument("--market", default="spot", choices=["spot", "on-demand"])
    p.add_argument("--price-usd-per-hr", type=float, required=True, help="current price of the instance, $/h")
    p.add_argument("--hours", type=float, default=24.0, help="hours rented, setup included (default 24)")
    p.add_argument("--setup-hours", type=float, default=0.75, help="of those, hours not training: pull, tokenize, compile (0.75)")
    p.add_argument("--budget-usd", type=float, default=35.0, help="the hard cap (35)")
    p.add_argument("--max-price-usd-per-hr", type=float, default=1.40, help="refuse above this price (1.40)")
    p.add_argument("--tokens-per-sec", type=float, help="measured throughput; default: the table per GPU")
    p.add_argument("--storage-usd", type=float, default=0.0, help="persistent disk for the run (seed: $2)")
    p.add_argument("--egress-usd", type=float, default=0.0, help="data download egress (seed: $1)")
    p.add_argument("--restart-buffer-usd", type=float, default=0.0, help="money held back for one relaunch (seed: $5)")
    p.add_argument("--json", action="store_true", help="print only a JSON object")
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    for name in ("price_usd_per_hr", "hours", "budget_usd", "max_price_usd_per_hr", "tokens_per_sec", "setup_hours"):
        value = getattr(args, name)
        if value is not None and (not math.isfinite(value) or value < 0 or (value == 0 and name != "setup_hours")):
            parser.error(f"--{name.replace('_', '-')} must be a positive number, got {value}")
    if args.setup_hours >= args.hours:
        parser.error(f"--setup-hours {args.setup_hours:g} leaves no training time in --hours {args.hours:g}")
    try:
        cfg = load_config(args.config, args.set)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return ExitCode.USAGE
    plan = make_plan(
        cfg,
        gpu=args.gpu,
        provider=args.provider,
        market=args.market,
        price_usd_per_hr=args.price_usd_per_hr,
        hours=args.hours,
        setup_hours=args.setup_hours,
        budget_usd=args.budget_usd,
        max_price_usd_per_hr=args.max_price_usd_per_hr,
        tokens_per_sec=args.tokens_per_sec,
        extras_usd={"storage": args.storage_usd, "egress": args.egress_usd, "restart buffer": args.restart_buffer_usd},
    )
    if args.json:
        print(json.dumps(plan.to_json(), indent=2))
    else:
        print(render(plan, cfg))
    return ExitCode.LAUNCH_REFUSED if plan.verdict == "refuse" else ExitCode.FINISHED


if __name__ == "__main__":
    sys.exit(main())
