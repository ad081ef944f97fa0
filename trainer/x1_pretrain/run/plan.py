"""Before renting: what the money buys, in one sentence, and whether to launch at all.

    python -m x1_pretrain.plan --config configs/x1-50m-a100.yaml --gpu a100-80gb --provider lambda \\
        --price-usd-per-hr 1.10 --hours 24 --budget-usd 35 [--write-env .env]

prints "This will launch 1× A100 80GB on-demand on Lambda at $1.10/h, run ~24 h including setup =
$26.40. Budget: $35. Confirmed acceptable, $8.60 buffer." followed by the numbers behind it, and
exits 78 (launch refused) when the price is over the GPU's max price or nothing fits the budget.
The hours and the cost in the sentence are those of the steps proposed (fewer than --hours buys
when the budget does not stretch that far), setup included.

Light on purpose: a laptop runs it after a plain `pip install .` (no torch, no numpy).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path

from x1_common.contracts import ExitCode
from x1_common.scaling import LAB_BAND
from x1_pretrain.config import ConfigError, RunConfig, load_config
from x1_pretrain.train.accounting import (
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
    usd,
)
from x1_pretrain.train.forecast_rule import rule_text
from x1_pretrain.train.schedule import probe_plan

PROVIDER_DISPLAY = {"lambda": "Lambda", "runpod": "RunPod", "static": "on-prem"}
# What each provider sells: Lambda on-demand instances only (no spot market); RunPod interruptible
# ("spot") and on-demand pods; a static rate is a machine of your own.
MARKETS = {"lambda": ("on-demand",), "runpod": ("interruptible", "on-demand"), "static": ("on-prem",)}
# Where to look when the price is too high, per provider asked for.
CHEAPER_ELSEWHERE = {
    "lambda": "wait and re-check (python -m budget_sidecar.price --wait), or a RunPod interruptible pod of the "
              "same GPU (python -m budget_sidecar.price --provider runpod)",
    "runpod": "wait and re-check (python -m budget_sidecar.price --provider runpod --wait), an interruptible "
              "pod instead of on-demand, or another GPU type",
    "static": "the rate is yours: lower the steps or raise the budget",
}

# The lab's band for the final val loss of the 50M run on FineWeb-Edu with GPT-2 BPE: the definition
# of done's check 2 for a run without a ladder or a --band of its own (x1_pretrain.train.band).
DOD_BAND = LAB_BAND
# The max price on the A100 80GB, the reference GPU of the budget; other GPUs get the price at
# which their tokens cost what the A100's do at this price (max_price_for).
A100_MAX_PRICE_USD_PER_HR = 1.40


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
    cost_usd: float  # compute only, as in the sentence: what the proposed steps bill, setup included
    total_usd: float  # compute + the configured extra lines
    buffer_usd: float
    predicted_val_loss: float
    predicted_val_loss_note: str
    dod_band: tuple[float, float]
    band_note: str  # which number to believe: the fit's prediction or the band
    chinchilla_optimal_tokens: float
    proposed_hours: float  # setup + the proposed steps' training time (what the sentence bills)
    max_price_source: str
    verdict: str  # "go" or "refuse"
    reasons: list[str] = field(default_factory=list)
    sentence: str = ""
    probes: str = ""  # the cooldown probes' cost (train.cooldown_probes), counted in the proposed hours; "" when off
    probe_hours: float = 0.0
    probe_usd: float = 0.0

    def to_json(self) -> dict:
        return asdict(self)


def max_price_for(gpu: str, cfg: RunConfig) -> tuple[float, str]:
    """The GPU's price ceiling: the price at which its tokens cost what the A100 80GB's do at
    A100_MAX_PRICE_USD_PER_HR (same throughput table as the plan), and how it was found."""
    ref = expected_tokens_per_sec("a100-80gb", cfg.model)
    row = expected_tokens_per_sec(gpu, cfg.model)
    if gpu == "a100-80gb" or ref is None or row is None:
        return A100_MAX_PRICE_USD_PER_HR, "the A100 80GB's"
    ceiling = round(A100_MAX_PRICE_USD_PER_HR * row.tokens_per_sec / ref.tokens_per_sec, 2)
    return ceiling, (f"{usd(A100_MAX_PRICE_USD_PER_HR)}/h on the A100 80GB x this GPU's {fmt_count(row.tokens_per_sec)} "
                     f"/ the A100's {fmt_count(ref.tokens_per_sec)} tokens/s: the same price per token")


def band_note(predicted: float, band: tuple[float, float]) -> str:
    """What the fit's prediction means against the definition of done's band."""
    lo, hi = band
    where = "below" if predicted < lo else "above" if predicted > hi else "inside"
    return (f"the definition of done asks for a final val loss in [{lo:.2f}, {hi:.2f}] (check 2); the Chinchilla "
            f"fit's {predicted:.2f} is {where} it. The fit was made on another corpus (MassiveText) with another "
            "tokenizer, so its nats are not this run's: believe the band, the lab's figure for this model on "
            "FineWeb-Edu with GPT-2 BPE. A run that ends below the band fails check 2 too: look for val leaking into train "
            "or an eval bug before calling it a win")


def make_plan(
    cfg: RunConfig,
    *,
    gpu: str,
    provider: str,
    price_usd_per_hr: float,
    hours: float,
    budget_usd: float,
    max_price_usd_per_hr: float | None = None,
    tokens_per_sec: float | None = None,
    setup_hours: float = 0.75,
    market: str | None = None,
    extras_usd: dict[str, float] | None = None,
) -> Plan:
    extras = {k: v for k, v in (extras_usd or {}).items() if v}
    market = market or MARKETS[provider][0]
    if market not in MARKETS[provider]:
        raise ConfigError(f"--market {market}: {PROVIDER_DISPLAY[provider]} sells {' or '.join(MARKETS[provider])} "
                          "instances")
    if max_price_usd_per_hr is None:
        max_price_usd_per_hr, max_source = max_price_for(gpu, cfg)
    else:
        max_source = "given: --max-price-usd-per-hr"
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
    # --total-steps is never refused by the trainer. The other lines of the budget (storage, egress,
    # a restart held back) come off first.
    # Its evals are counted as it counts them before measuring one: a forward over the eval tokens
    # at three times the training rate, every eval_every steps.
    eval_share = cfg.train.eval_windows * cfg.model.seq_len / (3.0 * cfg.train.tokens_per_step * cfg.train.eval_every)
    # Cooldown probes: their steps are a fixed share of the run's (each probe_share x its fork step).
    probe_share = cfg.train.cooldown_probe_share * sum(cfg.train.cooldown_probes)
    step_s = cfg.train.tokens_per_step / tps * (1.0 + eval_share + probe_share)
    fits = steps_that_fit(budget_usd - sum(extras.values()) - price_usd_per_hr * setup_hours, price_usd_per_hr,
                          step_s, cfg.budget.margin)
    if fits >= 1000:  # a round figure, as the trainer names one, with a little slack
        fits = fits // 100 * 100
    bought = int(tokens // (cfg.train.tokens_per_step * (1.0 + probe_share)))  # the probes' steps take their share
    proposed = min(bought, fits)
    # What the proposed steps bill, setup included: --hours when they fill it, fewer when the budget binds.
    run_hours = hours if proposed == bought else setup_hours + proposed * step_s / 3600.0
    cost = price_usd_per_hr * run_hours
    total = cost + sum(extras.values())
    reasons = []
    if price_usd_per_hr > max_price_usd_per_hr:
        reasons.append(
            f"price {usd(price_usd_per_hr)}/h is over the max price {usd(max_price_usd_per_hr)}/h for the "
            f"{GPU_DISPLAY.get(gpu, gpu)}: {CHEAPER_ELSEWHERE[provider]}"
        )
    if proposed < 1:
        reasons.append(f"no step fits the budget {usd(budget_usd)} after {setup_hours:g} h of setup at "
                       f"{usd(price_usd_per_hr)}/h" + (" and the other lines" if extras else ""))
    elif total > budget_usd:
        reasons.append(f"projected {usd(total)} is over the budget {usd(budget_usd)}")
    verdict = "refuse" if reasons else "go"
    what = f"1× {GPU_DISPLAY.get(gpu, gpu)} {market} on {PROVIDER_DISPLAY.get(provider, provider)}"
    shown_hours = f"{run_hours:g}" if run_hours == hours else f"{run_hours:.1f}"
    sentence = (
        f"This will launch {what} at {usd(price_usd_per_hr)}/h, run ~{shown_hours} h including setup = {usd(cost)}. "
        f"Budget: {usd(budget_usd)}. "
    )
    sentence += (
        f"Confirmed acceptable, {usd(budget_usd - cost)} buffer."
        if verdict == "go"
        else "Refused: " + "; ".join(reasons) + "."
    )
    predicted = round(chinchilla_loss(counts["total"], tokens / (1.0 + probe_share) if proposed == bought else
                                      proposed * cfg.train.tokens_per_step), 3)
    probes = probe_plan(cfg.train.cooldown_probes, cfg.train.cooldown_probe_share, proposed)
    probe_steps = sum(k for _, _, k in probes)
    eval_s = cfg.train.eval_windows * cfg.model.seq_len / (3.0 * tps)
    probe_hours = (probe_steps * cfg.train.tokens_per_step / tps + len(probes) * eval_s) / 3600.0
    probe_text = "" if not probes else (
        f"{len(probes)} at {', '.join(f'{share:.3g}' for share, _, _ in probes)} of the run: {probe_steps:,} steps "
        f"({probe_steps / max(proposed, 1):.1%} of the run's) + {len(probes)} evals = ~{probe_hours:.2g} h = "
        f"{usd(probe_hours * price_usd_per_hr)} at {usd(price_usd_per_hr)}/h, counted in the proposed steps' hours")
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
        proposed_total_steps=proposed,
        cost_usd=round(cost, 2),
        total_usd=round(total, 2),
        buffer_usd=round(budget_usd - total, 2),
        predicted_val_loss=predicted,
        predicted_val_loss_note=(
            "Hoffmann 2022 fit (E={E}, A={A}, B={B}, alpha={alpha}, beta={beta}), N = all parameters incl. "
            "embeddings, D = the proposed steps' tokens; fitted on MassiveText with another tokenizer, so a guide "
            "for FineWeb-Edu / GPT-2 BPE"
        ).format(**CHINCHILLA),
        dod_band=DOD_BAND,
        band_note=band_note(predicted, DOD_BAND),
        chinchilla_optimal_tokens=chinchilla_optimal_tokens(counts["total"]),
        proposed_hours=round(run_hours, 3),
        max_price_source=max_source,
        verdict=verdict,
        reasons=reasons,
        sentence=sentence,
        probes=probe_text,
        probe_hours=round(probe_hours, 3),
        probe_usd=round(probe_hours * price_usd_per_hr, 2),
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
        ("max price", f"{usd(plan.max_price_usd_per_hr)}/h ({plan.max_price_source})"),
        ("predicted val loss", f"{plan.predicted_val_loss:.2f} nats/token (Chinchilla fit, another corpus: a guide)"),
        ("DoD band", f"[{plan.dod_band[0]:.2f}, {plan.dod_band[1]:.2f}] final val loss (check 2): the number to "
                     "believe"),
        ("Chinchilla-optimal", f"{fmt_count(plan.chinchilla_optimal_tokens)} tokens for {fmt_count(plan.params_total)} params (fit)"),
    ]
    lines += [f"  {k:<20} {v}" for k, v in rows]
    lines.append("")
    lines.append(f"Loss: {plan.band_note}.")
    lines.append("")
    if plan.proposed_total_steps < seed_steps:
        lines.append(
            f"The config's {seed_steps:,} steps = {fmt_count(seed_tokens)} tokens would need ~{hours_needed:.0f} h "
            f"(~{usd(hours_needed * plan.price_usd_per_hr)}) at this speed."
        )
    if plan.proposed_total_steps < int(plan.tokens // plan.tokens_per_step):
        lines.append(f"The trainer's own projection (spent + rate x the time left, +{cfg.budget.margin:.0%}) fits "
                     f"{plan.proposed_total_steps:,} steps under {usd(plan.budget_usd)} after {plan.setup_hours:g} h of setup.")
    lines.append(f"Proposed: --total-steps {plan.proposed_total_steps} (~{plan.proposed_hours:.1f} h with setup = "
                 f"{usd(plan.cost_usd)} at {usd(plan.price_usd_per_hr)}/h"
                 + (f", {usd(plan.total_usd)} with the other lines" if plan.extras_usd else "") + ")")

    lines.append(rule_text(plan.proposed_total_steps, cfg.optim.warmup_steps, cfg.train.eval_every, cfg.train.log_every))
    if plan.probes:
        lines.append(f"Cooldown probes (train.cooldown_probes): {plan.probes}.")
    if plan.tokens_per_sec_source.startswith("given"):
        # The trainer's launch check and throughput floor otherwise use the table's figure for its GPU.
        lines.append(f"Give the trainer the same throughput: --expected-tokens-per-sec {plan.tokens_per_sec:g}")
    return "\n".join(lines)


def env_values(plan: Plan, cfg: RunConfig) -> dict[str, str]:
    """The .env settings this plan proposes."""
    values = {"PROVIDER": plan.provider, "TOTAL_STEPS": str(plan.proposed_total_steps),
              "BUDGET_CAP_USD": f"{plan.budget_usd:g}", "MAX_PRICE_USD_PER_HR": f"{plan.max_price_usd_per_hr:g}",
              "PLANNED_HOURS": f"{plan.proposed_hours:.2f}"}
    if plan.provider == "static":
        values["RATE_USD_PER_HR"] = f"{plan.price_usd_per_hr:g}"
    return values


def write_env(path: Path, values: dict[str, str]) -> None:
    """`values` set in the .env at `path` (created if absent): a line `KEY=...` already there is
    replaced in place, the others added at the end; every other line kept as it was. Written to a
    temp file, fsynced and renamed: a crash leaves the old file or the new one."""
    lines = path.read_text(encoding="utf-8").splitlines() if path.exists() else []
    left = dict(values)
    out = []
    for line in lines:
        key = line.split("=", 1)[0].strip() if "=" in line and not line.lstrip().startswith("#") else None
        if key in left:
            out.append(f"{key}={left.pop(key)}")
        else:
            out.append(line)
    if left:
        out.append("# written by python -m x1_pretrain.plan --write-env")
        out += [f"{k}={v}" for k, v in left.items()]
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write("\n".join(out) + "\n")
            f.flush()
            os.fsync(f.fileno())
        if path.exists():
            os.chmod(tmp, path.stat().st_mode & 0o777)  # a .env holds secrets: keep its mode
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m x1_pretrain.plan",
        description="The pre-launch sentence and numbers: what the budget buys; exit 78 when the launch should not happen.",
    )
    p.add_argument("--config", required=True, help="run config YAML, e.g. configs/x1-50m-a100.yaml")
    p.add_argument("--set", action="append", default=[], metavar="SECTION.FIELD=VALUE", help="override a config field")
    p.add_argument("--gpu", default="a100-80gb", choices=sorted(k for k in GPU_PEAK_TFLOPS if k != "cpu"))
    p.add_argument("--provider", default="lambda", choices=sorted(PROVIDER_DISPLAY))
    p.add_argument("--market", choices=["on-demand", "interruptible", "spot"],
                   help="Lambda: on-demand (all it sells, the default); RunPod: interruptible (the default; "
                        "'spot' is the same) or on-demand")
    p.add_argument("--price-usd-per-hr", type=float, required=True, help="current price of the instance, $/h")
    p.add_argument("--hours", type=float, default=24.0, help="hours rented, setup included (default 24)")
    p.add_argument("--setup-hours", type=float, default=0.75, help="of those, hours not training: pull, tokenize, compile (0.75)")
    p.add_argument("--budget-usd", type=float, default=35.0, help="the hard cap (35)")
    p.add_argument("--max-price-usd-per-hr", type=float,
                   help="refuse above this price (default per GPU: $1.40/h on the A100 80GB, other GPUs at the "
                        "same price per token)")
    p.add_argument("--tokens-per-sec", type=float, help="measured throughput; default: the table per GPU")
    p.add_argument("--storage-usd", type=float, default=0.0, help="persistent disk for the run (seed: $2)")
    p.add_argument("--egress-usd", type=float, default=0.0, help="data download egress (seed: $1)")
    p.add_argument("--restart-buffer-usd", type=float, default=0.0, help="money held back for one relaunch (seed: $5)")
    p.add_argument("--json", action="store_true", help="print only a JSON object")
    p.add_argument("--write-env", type=Path, metavar="PATH",
                   help="write the proposed values (TOTAL_STEPS, BUDGET_CAP_USD, MAX_PRICE_USD_PER_HR, "
                        "PLANNED_HOURS, PROVIDER) into this .env, keeping its other lines; atomic")
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
    market = "interruptible" if args.market == "spot" else args.market
    try:
        plan = make_plan(
            cfg,
            gpu=args.gpu,
            provider=args.provider,
            market=market,
            price_usd_per_hr=args.price_usd_per_hr,
            hours=args.hours,
            setup_hours=args.setup_hours,
            budget_usd=args.budget_usd,
            max_price_usd_per_hr=args.max_price_usd_per_hr,
            tokens_per_sec=args.tokens_per_sec,
            extras_usd={"storage": args.storage_usd, "egress": args.egress_usd,
                        "restart buffer": args.restart_buffer_usd},
        )
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return ExitCode.USAGE
    if args.write_env is not None:
        try:
            write_env(args.write_env, env_values(plan, cfg))
        except (OSError, ValueError) as e:
            print(f"error: --write-env {args.write_env}: {e}", file=sys.stderr)
            return ExitCode.USAGE
        if not args.json:
            print(f"wrote {', '.join(env_values(plan, cfg))} into {args.write_env}", file=sys.stderr)
    if args.json:
        print(json.dumps(plan.to_json(), indent=2))
    else:
        print(render(plan, cfg))
    return ExitCode.LAUNCH_REFUSED if plan.verdict == "refuse" else ExitCode.FINISHED


if __name__ == "__main__":
    sys.exit(main())
