"""The learning-rate schedule: linear warm-up from 0, then cosine to the floor at the last step,
re-targeted from the step a re-plan resumes at.

Pure arithmetic on the optimizer section's lr, min_lr and warmup_steps, so that the trainer, the
final-loss forecast (x1_pretrain.forecast) and the benchmarks that train outside the trainer all
run the same schedule.
"""

from __future__ import annotations

import math
from typing import Any


def lr_progress(step: int, cfg, total_steps: int, replan: dict[str, Any] | None = None) -> float | None:
    """How far the cosine has gone at `step` (0 at the end of the warmup, 1 at the last step); None
    during the warmup.

    A re-plan (a new total_steps from a checkpoint, `replan`: {"step", "lr_progress"}) re-targets
    the cosine from the step it resumes at: the progress reached there under the old total is kept,
    and the rest of the way to 1 is spread over the steps to the new total. The learning rate at
    that step is the same number under both schedules (no jump); it then decays to min_lr at the
    new last step, faster or slower than before."""
    if step < cfg.warmup_steps:
        return None
    if replan is not None and replan.get("lr_progress") is not None and step >= replan["step"]:
        s0, p0 = replan["step"], float(replan["lr_progress"])
        return p0 + (1.0 - p0) * min((step - s0) / max(total_steps - s0, 1), 1.0)
    span = max(total_steps - cfg.warmup_steps, 1)
    return min((step - cfg.warmup_steps) / span, 1.0)


def lr_at(step: int, cfg, total_steps: int, replan: dict[str, Any] | None = None) -> float:
    """Linear warmup from 0 over warmup_steps, then cosine from lr to min_lr at the last step
    (re-targeted from a re-plan's step: lr_progress)."""
    progress = lr_progress(step, cfg, total_steps, replan)
    if progress is None:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    return cfg.min_lr + 0.5 * (cfg.lr - cfg.min_lr) * (1 + math.cos(math.pi * progress))


# ---------------------------------------------------------------------------------------------
# Cooldown probes (x1_pretrain.train.probes): short cooldowns forked from the run at a few shares of it


def probe_plan(shares: list[float] | tuple[float, ...], probe_share: float,
               total_steps: int) -> list[tuple[float, int, int]]:
    """(share, fork step, cooldown steps) of each probe: forked at round(share x total_steps), cooling
    down over probe_share x the steps so far (at least 1, and not past the run's last step). Probes
    that fall on step 0 or on the last step, or on the same step as an earlier one, are left out."""
    plan: list[tuple[float, int, int]] = []
    for share in sorted(shares):
        fork = round(share * total_steps)
        if 0 < fork < total_steps and all(fork != f for _, f, _ in plan):
            plan.append((share, fork, min(max(round(probe_share * fork), 1), total_steps - fork)))
    return plan


def probe_lr(j: int, steps: int, start_lr: float, floor: float) -> float:
    """The learning rate of a probe's j-th step (j = 0..steps-1): from start_lr down to the floor at
    its last step in the (1-sqrt) shape of Hägele et al. 2024 ("Scaling Laws and Compute-Optimal
    Training Beyond Fixed Training Durations", arXiv 2405.18392), which lands lower than a linear
    cooldown of the same length."""
    return floor + (start_lr - floor) * (1.0 - math.sqrt((j + 1) / steps))
