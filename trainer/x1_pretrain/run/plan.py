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
from x1_common.scaling import (
    LAB_BAND,
    DeclaredBand,
    LadderFileError,
    Prediction,
    declare_band,
    load_ladder,
    provenance_differences,
)
from x1_common.scaling import predict as predict_from_ladder
from x1_pretrain.config import ConfigError, RunConfig, load_config
from x1_pretrain.data.prepare import FINEWEB_EDU, FINEWEB_EDU_100BT, data_need
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
    throughput_floor,
    usd,
)
from x1_pretrain.train.budget_guard import launch_projection
from x1_pretrain.train.forecast_rule import accuracy_text, rule_text
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
    tokens: float  # what the proposed steps train on (proposed_total_steps x tokens_per_step)
    tokens_per_step: int
    proposed_total_steps: int
    hours_total_steps: int  # what --hours would buy at this throughput
    fits_total_steps: int  # what the trainer's launch check fits under the cap after the setup and other lines
    floor_tokens_per_sec: float  # the hour-1 throughput floor the trainer will hold this run to
    floor_source: str
    config_total_steps: int  # the config's own total (the lab's 84,000), and what the launch check makes of it
    config_hours: float  # billed training hours at this throughput, evals included, the margin not
    config_projected_usd: float  # the trainer's projection at launch: spent before + rate x hours x (1 + margin)
    data_source: str  # the sample `prepare` fetches by default
    data_passes: float  # passes over it the proposed tokens make
    one_pass: dict  # fetching the proposed tokens as unique ones: prepare's command, disk and tokenizing time
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
    band_source: str = "lab"  # whose band the run is judged on: the ladder's (--ladder) or the lab's
    ladder_prediction: dict | None = None  # the ladder's val loss, low, high at the proposed tokens (--ladder)
    ladder_hours: float = 0.0  # the ladder run first (--ladder-share), in the proposed hours
    ladder_usd: float = 0.0
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


def ladder_note(p: Prediction, chinchilla: float) -> str:
    """What the measured ladder says, and which number to believe."""
    return (f"the scaling ladder measured on this run's corpus, tokenizer and model family predicts "
            f"{p.val_loss:.3f} [{p.low:.3f}, {p.high:.3f}] (its tolerance {p.tolerance:.3f} measured by leaving its "
            f"largest size out): the run declares that band before its first step and the definition of done judges "
            f"check 2 against it. Hoffmann's fit says {chinchilla:.2f} (another corpus: a guide); the lab's "
            f"[{LAB_BAND[0]:.2f}, {LAB_BAND[1]:.2f}] is shown beside it")


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
    ladder_share: float = 0.0,
    ladder: dict | None = None,
) -> Plan:
    """The plan. `ladder_share`: a scaling ladder runs first, for that share of the main run's
    training hours (its hours and dollars come off before the main run's steps are proposed);
    `ladder`: a fitted ladder.json (checked by the caller), whose prediction for the proposed run
    is shown first and whose band the run is judged on."""
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
    # What --hours buys: the steps their training hours hold at this throughput.
    # Cooldown probes take a fixed share of the run's steps (each probe_share x its fork step).
    probe_share = cfg.train.cooldown_probe_share * sum(cfg.train.cooldown_probes)
    # A ladder comes first: its hours (a share of the main run's, which depend on the steps proposed:
    # found in a few rounds) are spent before the trainer's launch check, as on the instance.
    ladder_hours = 0.0
    for _ in range(4 if ladder_share > 0 else 1):
        bought = int(tps * max(hours - setup_hours - ladder_hours, 0.0) * 3600.0
                     // (cfg.train.tokens_per_step * (1.0 + probe_share)))
        # The trainer refuses a launch whose steps, at this throughput plus its margin, would not finish
        # under the cap once the setup hours are spent (and the other lines of the budget: storage,
        # egress, a restart held back, the ladder): propose no more than that, so that a plan's
        # --total-steps is never refused by the trainer. The same arithmetic as the trainer's launch
        # check (budget_guard.launch_projection): its evals, as it counts them before measuring one.
        before = price_usd_per_hr * (setup_hours + ladder_hours) + sum(extras.values())
        fits = launch_projection(cfg, max(bought, 1), tps, price_usd_per_hr, budget_usd, spent_usd=before).fits
        proposed = max(min(bought, fits), 0)
        # What the proposed steps bill: their training hours at this throughput, evals included (the
        # margin is the trainer's slack, not a bill).
        train_hours = launch_projection(cfg, proposed, tps, price_usd_per_hr, budget_usd).hours if proposed else 0.0
        ladder_hours = ladder_share * train_hours
    run_hours = setup_hours + ladder_hours + train_hours
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
    shown_hours = f"{hours:g}" if proposed == bought and abs(run_hours - hours) < 0.05 else f"{run_hours:.1f}"
    including = f"setup and the ladder's {ladder_hours:.1f} h" if ladder_hours else "setup"
    sentence = (
        f"This will launch {what} at {usd(price_usd_per_hr)}/h, run ~{shown_hours} h including {including} = "
        f"{usd(cost)}. Budget: {usd(budget_usd)}. "
    )
    sentence += (
        f"Confirmed acceptable, {usd(budget_usd - cost)} buffer."
        if verdict == "go"
        else "Refused: " + "; ".join(reasons) + "."
    )
    tokens = proposed * cfg.train.tokens_per_step
    predicted = round(chinchilla_loss(counts["total"], tokens), 3)
    measured = None
    if ladder is not None and proposed:
        measured = predict_from_ladder(ladder, counts["total"], tokens, counts["non_embedding"],
                                       flops_per_token(cfg.model))
    band = declare_band(measured, None)
    lab = launch_projection(cfg, cfg.train.total_steps, tps, price_usd_per_hr, budget_usd, spent_usd=before)
    floor = throughput_floor(cfg.train, tps)
    need = data_need(tokens)
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
        hours_total_steps=bought,
        fits_total_steps=fits,
        floor_tokens_per_sec=floor[0],
        floor_source=floor[1],
        config_total_steps=cfg.train.total_steps,
        config_hours=round(lab.hours, 3),
        config_projected_usd=round(lab.projected_usd, 2),
        data_source=FINEWEB_EDU.label,
        data_passes=need.passes,
        one_pass={"command": f"python -m x1_pretrain.prepare --output-dir /workspace/data --source "
                             f"{FINEWEB_EDU_100BT.name} --max-tokens {tokens / 1e9:.1f}B",
                  "source": FINEWEB_EDU_100BT.label, "disk_gb": round(need.disk_gb),
                  "parquet_gb": round(need.parquet_gb), "tokens_gb": round(need.tokens_gb),
                  "tokenize_minutes": round(need.tokenize_minutes)},
        cost_usd=round(cost, 2),
        total_usd=round(total, 2),
        buffer_usd=round(budget_usd - total, 2),
        predicted_val_loss=predicted,
        predicted_val_loss_note=(
            "Hoffmann 2022 fit (E={E}, A={A}, B={B}, alpha={alpha}, beta={beta}), N = all parameters incl. "
            "embeddings, D = the proposed steps' tokens; fitted on MassiveText with another tokenizer, so a guide "
            "for FineWeb-Edu / GPT-2 BPE"
        ).format(**CHINCHILLA),
        dod_band=(band.low, band.high),
        band_note=band_note(predicted, DOD_BAND) if measured is None else ladder_note(measured, predicted),
        band_source=band.source,
        ladder_prediction=None if measured is None else measured.as_dict(),
        ladder_hours=round(ladder_hours, 3),
        ladder_usd=round(ladder_hours * price_usd_per_hr, 2),
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
    """The sentence, then the numbers behind it. The table shows what the plan proposes (its hours,
    steps, tokens and predicted loss), whichever of the hours, the budget or the price binds."""
    lines = [plan.sentence, ""]
    if plan.extras_usd:
        lines.append("Other lines of the budget (not in the sentence, which counts compute only):")
        for name, value in plan.extras_usd.items():
            lines.append(f"  {name:<16} {usd(value)}")
        left = f"{usd(plan.buffer_usd)} left" if plan.buffer_usd >= 0 else f"{usd(-plan.buffer_usd)} over"
        lines.append(f"  {'total':<16} {usd(plan.total_usd)} of {usd(plan.budget_usd)}, {left}")
        lines.append("")
    train_hours = plan.proposed_hours - plan.setup_hours - plan.ladder_hours
    passes = (f"~{plan.data_passes:.1f} passes over the data" if plan.data_passes > 1.05 else
              "one pass over the data or less")
    wide = DeclaredBand(*plan.dod_band, plan.band_source).width_warning()  # a band that can hardly fail
    rows = [
        ("parameters", f"{fmt_count(plan.params_non_embedding)} non-embedding, {fmt_count(plan.params_total)} total"),
        ("FLOPs/token", f"{plan.flops_per_token / 1e6:.0f}M (PaLM: 6 N_matmul + 12 L d T)"),
        ("tokens/s", f"{fmt_count(plan.tokens_per_sec)} ({plan.tokens_per_sec_source})"),
        ("MFU (datasheet)", f"{plan.mfu_datasheet:.3f}"),
        ("throughput floor", f"{fmt_count(plan.floor_tokens_per_sec)} tokens/s ({plan.floor_source}): under it in "
                             "the first hour, the trainer says stop and diagnose" if plan.floor_tokens_per_sec else
                             plan.floor_source),
        ("training hours", f"{train_hours:.2f} (of {plan.proposed_hours:.2f}, {plan.setup_hours:g} h setup"
                           + (f", {plan.ladder_hours:.2f} h the ladder)" if plan.ladder_hours else ")")),
        ("tokens bought", f"{fmt_count(plan.tokens)} = {plan.proposed_total_steps:,} steps of "
                          f"{fmt_count(plan.tokens_per_step)}"),
        ("data", f"{fmt_count(plan.tokens)} tokens from {plan.data_source} (~{(FINEWEB_EDU.tokens or 0) / 1e9:g}B "
                 f"tokens): {passes}"),
        ("max price", f"{usd(plan.max_price_usd_per_hr)}/h ({plan.max_price_source})"),
        *([("ladder (measured)", f"{plan.ladder_prediction['val_loss']:.3f} "
                                  f"[{plan.ladder_prediction['low']:.3f}, {plan.ladder_prediction['high']:.3f}] "
                                  f"at {fmt_count(plan.tokens)} tokens: the number to believe")]
          if plan.ladder_prediction else []),
        ("predicted val loss", f"{plan.predicted_val_loss:.2f} nats/token at {fmt_count(plan.tokens)} tokens "
                               "(Chinchilla fit, another corpus: a guide)"),
        ("DoD band", f"[{plan.dod_band[0]:.2f}, {plan.dod_band[1]:.2f}] final val loss (check 2), "
                     + ("the ladder's: the run declares it before its first step" if plan.band_source == "ladder"
                        else "the lab's (no ladder): the number to believe")
                     + (f"; {wide}" if wide else "")),
        *([("ladder first", f"~{plan.ladder_hours:.2f} h = {usd(plan.ladder_usd)} before the main run (LADDER_SHARE "
                            "of its training hours), in the sentence's hours")] if plan.ladder_hours else []),
        ("Chinchilla-optimal", f"{fmt_count(plan.chinchilla_optimal_tokens)} tokens for {fmt_count(plan.params_total)} params (fit)"),
    ]
    lines += [f"  {k:<20} {v}" for k, v in rows]
    lines.append("")
    lines.append(f"Loss: {plan.band_note}.")
    lines.append("")
    # What bounds the proposal: the hours asked, or the money (the budget, or a price that eats it).
    before = f"after {plan.setup_hours:g} h of setup" + (" and the other lines" if plan.extras_usd else "")
    fits = (f"the trainer's launch check (spent + rate x the hours the steps need, +{cfg.budget.margin:.0%}) fits "
            f"{plan.fits_total_steps:,} steps under {usd(plan.budget_usd)} at {usd(plan.price_usd_per_hr)}/h {before}")
    if plan.proposed_total_steps < plan.hours_total_steps:
        lines.append(f"The money binds: {plan.hours:g} h would buy {plan.hours_total_steps:,} steps, but {fits}.")
    else:
        lines.append(f"The hours bind: {plan.hours:g} h buy {plan.hours_total_steps:,} steps; {fits}.")
    if plan.config_total_steps > plan.proposed_total_steps:
        verdict = ("over the cap: the trainer refuses them at launch (exit 78)"
                   if plan.config_projected_usd > plan.budget_usd else "under the cap")
        lines.append(
            f"The config's {plan.config_total_steps:,} steps = "
            f"{fmt_count(plan.config_total_steps * plan.tokens_per_step)} tokens need {plan.config_hours:.1f} h of "
            f"training at this speed: the trainer's launch check projects {usd(plan.config_projected_usd)} with the "
            f"setup, {verdict}.")
    if plan.data_passes > 1.05:
        o = plan.one_pass
        lines.append(f"One pass over unique tokens instead: `{o['command']}` fetches them from {o['source']}: "
                     f"~{o['parquet_gb']} GB of parquet and ~{o['tokens_gb']} GB of tokens (~{o['disk_gb']} GB of "
                     f"disk), ~{o['tokenize_minutes']} min to tokenize on 16 workers, plus the download.")
    lines.append(f"Proposed: --total-steps {plan.proposed_total_steps} (~{plan.proposed_hours:.1f} h with setup = "
                 f"{usd(plan.cost_usd)} at {usd(plan.price_usd_per_hr)}/h"
                 + (f", {usd(plan.total_usd)} with the other lines" if plan.extras_usd else "") + ")")

    lines.append(rule_text(plan.proposed_total_steps, cfg.optim.warmup_steps, cfg.train.eval_every, cfg.train.log_every))
    lines.append(accuracy_text())
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
    p.add_argument("--ladder-share", type=float, default=0.0, metavar="SHARE",
                   help="a scaling ladder runs first (LADDER=1 in .env) for this share of the main run's training "
                        "hours, e.g. 0.05: its hours and dollars come off before the steps are proposed (default 0)")
    p.add_argument("--ladder", type=Path, metavar="LADDER.json",
                   help="a fitted ladder (python -m x1_pretrain.ladder): its prediction for the proposed run first, "
                        "and its band as the one the run will be judged on")
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
    if not 0 <= args.ladder_share < 1:
        parser.error(f"--ladder-share must be a share of the main run's hours in [0, 1), got {args.ladder_share}")
    ladder = None
    if args.ladder is not None:
        try:
            ladder = load_ladder(args.ladder)
        except LadderFileError as e:
            print(f"error: --ladder: {e}", file=sys.stderr)
            return ExitCode.USAGE
        diffs = provenance_differences(ladder.get("provenance") or {}, {
            "vocab_size": cfg.model.vocab_size, "seq_len": cfg.model.seq_len, "model_family": cfg.model.family})
        if diffs:
            print(f"error: --ladder {args.ladder}: made for another run: {'; '.join(diffs)}", file=sys.stderr)
            return ExitCode.USAGE
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
            ladder_share=args.ladder_share,
            ladder=ladder,
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
