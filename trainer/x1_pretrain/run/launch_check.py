"""The trainer's own launch check, asked before anything is rented (`x1 launch` runs it on the laptop).

    check = launch_check(cfg, gpu="a100-40gb", price_usd_per_hr=1.10, setup_hours=0.75)
    check.ok, check.reason, check.hours, check.cost_usd

It is the check the trainer runs when it starts on the rented instance, `BudgetGuard.prelaunch`
with the run's pace: the config and the flags the stack gives the trainer (TOTAL_STEPS,
BUDGET_CAP_USD, MAX_PRICE_USD_PER_HR, TRAIN_EXTRA_ARGS from the .env), plan's tokens/s for the GPU
rented (the figure the trainer looks up for the GPU it finds), and the price read now. The reading
it judges is the one the trainer would see at its start: the setup hours (image, data, compile)
already billed at that price. A run the trainer would refuse (exit 78) is refused here, before
any money; the hours and the cost come from the same projection, so the sentence `x1 launch`
prints is the trainer's numbers, not a guess of hours.

No torch: the laptop runs it after a plain `pip install .`.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from datetime import datetime, timezone

from x1_common.alerts import AlertSender
from x1_common.contracts import BudgetReading, ExitCode
from x1_pretrain.config import RunConfig
from x1_pretrain.train.accounting import expected_tokens_per_sec
from x1_pretrain.train.budget_guard import BudgetGuard, Pace

_quiet = logging.getLogger("x1.launch_check")
_quiet.propagate = False
_quiet.addHandler(logging.NullHandler())


@dataclass(frozen=True)
class LaunchCheck:
    ok: bool
    exit_code: int | None  # 78 (refused) or 77 (over the cap already); None when accepted
    reason: str  # the trainer's sentence for its decision
    total_steps: int
    hours: float | None  # setup + the hours the steps need at plan's speed (margin not included)
    cost_usd: float | None  # price x hours
    projected_usd: float | None  # what the trainer judges: with its margin
    tokens_per_sec: float | None
    tokens_per_sec_source: str
    fits_steps: int | None  # the total steps that fit the cap, when the steps asked do not


def launch_check(cfg: RunConfig, *, gpu: str | None, price_usd_per_hr: float, setup_hours: float,
                 gpus: int = 1, provider: str = "lambda") -> LaunchCheck:
    """The trainer's prelaunch decision for `cfg` on `gpus` x `gpu` at `price_usd_per_hr`, the
    setup hours billed. `gpu` is plan's key (a100-40gb, a100-80gb, h100-sxm, ...)."""
    if cfg.train.expected_tokens_per_sec is not None:
        tps, source = cfg.train.expected_tokens_per_sec, "given: --expected-tokens-per-sec"
    else:
        row = expected_tokens_per_sec(gpu, cfg.model) if gpu else None
        tps = row.tokens_per_sec * gpus if row else None
        source = f"plan's figure for {gpus}x {gpu} ({row.source})" if row else f"no plan figure for {gpu or 'this GPU'}"
    pace = Pace(total_steps=cfg.train.total_steps, tokens_per_step=cfg.train.tokens_per_step,
                eval_every=cfg.train.eval_every, ckpt_every=cfg.checkpoint.every,
                eval_tokens=cfg.train.eval_windows * cfg.model.seq_len, start_step=0, restarts=0,
                expected_tokens_per_sec=tps, expected_source=source)
    now = datetime.now(timezone.utc)
    spent = price_usd_per_hr * setup_hours
    reading = BudgetReading(spent_usd=spent, rate_usd_per_hr=price_usd_per_hr, hours_elapsed=setup_hours,
                            projected_total_usd=spent, last_update_utc=now, cap_usd=cfg.budget.cap_usd or 0.0,
                            provider=provider, instance_id=None, source="provider-api")
    guard = BudgetGuard(cfg.budget, alerts=AlertSender(), log=_quiet, reader=lambda: (reading, 1.0),
                        clock=lambda: now.timestamp(), sleep=lambda s: None)
    decision = guard.prelaunch(pace)
    p = decision.projection
    hours = None if p is None or p.hours_needed is None else setup_hours + p.hours_needed
    refused = decision.exit_code in (ExitCode.LAUNCH_REFUSED, ExitCode.BUDGET_SPENT)
    return LaunchCheck(
        ok=not refused and tps is not None, exit_code=decision.exit_code if refused else (
            None if tps is not None else int(ExitCode.LAUNCH_REFUSED)),
        reason=decision.reason if tps is not None or refused else (
            f"no throughput figure for {gpu or 'this GPU'}: the steps cannot be priced (TRAIN_EXTRA_ARGS="
            "--expected-tokens-per-sec N gives one)"),
        total_steps=cfg.train.total_steps, hours=hours,
        cost_usd=None if hours is None else price_usd_per_hr * hours,
        projected_usd=decision.projected_usd, tokens_per_sec=tps, tokens_per_sec_source=source,
        fits_steps=decision.fits_steps)
