"""When the final-loss forecast first judges a run, and by what rule: the part of x1_pretrain.forecast
that `plan` prints, in the standard library alone (plan runs on a laptop without numpy or SciPy).
"""

from __future__ import annotations

from typing import Any

from x1_common.scaling import LAB_BAND

LAW = "lr-annealing"  # the law the trainer forecasts with
MIN_VAL_POINTS = 2  # evals after the warm-up, at least
MIN_POINTS = 6  # evals and train bins after the warm-up together, at least
TRAIN_BINS = 200  # train losses are averaged in bins of total_steps / TRAIN_BINS steps (at least log_every)
DEFAULT_BAND = LAB_BAND  # the lab's band; a run judges against the band it declared (train/band.py)


def first_judged_step(total_steps: int, warmup_steps: int, eval_every: int, log_every: int) -> int | None:
    """The first eval with enough points for a forecast (None: never, in this run)."""
    width = max(total_steps // TRAIN_BINS, log_every, 1)
    first = max(warmup_steps, 1)
    for e in [*range(eval_every, total_steps, eval_every), total_steps]:
        evals = sum(1 for s in {*range(eval_every, e + 1, eval_every), e} if s >= first)
        bins = max((e - first) // width, 0)
        if evals >= MIN_VAL_POINTS and evals + bins >= MIN_POINTS:
            return e
    return None


def rule_text(total_steps: int, warmup_steps: int, eval_every: int, log_every: int,
              band: tuple[float, float] = DEFAULT_BAND) -> str:
    """When a run is first judged, and by what rule: what `plan` prints."""
    first = first_judged_step(total_steps, warmup_steps, eval_every, log_every)
    when = (f"first at step {first:,} ({first / total_steps:.0%} of the run)" if first else
            "never in this run (too few evals past the warm-up)")
    return (f"final-loss forecast: at every eval from the run's own curve, {when}: it needs {MIN_VAL_POINTS} evals "
            f"past the warm-up and {MIN_POINTS} points in all (law {LAW}, decay term from complete runs). An alert "
            f"when its interval lies wholly outside --forecast-band (default {band[0]:.2f}-{band[1]:.2f}), once per "
            "crossing; with --stop-when-forecast-misses-band the run then stops with a checkpoint, exit 80")


# What the forecast achieved on GPU runs it was not calibrated on (each run's priors from the others,
# no probes, no ladder): mean |error| in nats at 10%, 25% and 50% of the run. Each row is the "no | no"
# row of its file, which `python -m x1_pretrain.forecast evaluate ... --compare` wrote (docs/FORECAST.md);
# tests/test_plan.py holds the two to each other.
MEASURED_ACCURACY = (
    ("3 runs of the 50M config (2,000-2,600 steps)", "docs/forecast-runs/gpu-50m-compare.txt", (0.127, 0.050, 0.060)),
    ("5 runs at d384 (2,000-4,800 steps)", "docs/forecast-runs/gpu-d384-compare.txt", (0.363, 0.126, 0.149)),
    ("5 runs at d384 (2,500-9,000 steps)", "docs/forecast-runs/gpu-d384-long-compare.txt", (0.330, 0.259, 0.190)),
)
# The same with earlier complete runs of the family as the prior (--forecast-earlier-runs; each run's
# earlier runs the others of its set, leave-one-out, or another set's): the "no | earlier runs" row
# of each file.
MEASURED_WITH_EARLIER_RUNS = (
    ("the first set", "docs/forecast-runs/gpu-50m-compare-earlier.txt", (0.043, 0.041, 0.030)),
    ("the second", "docs/forecast-runs/gpu-d384-compare-earlier.txt", (0.092, 0.088, 0.093)),
    ("the third", "docs/forecast-runs/gpu-d384-long-compare-earlier.txt", (0.031, 0.033, 0.030)),
    ("a fourth, of another seed, with the third's runs as its earlier runs",
     "docs/forecast-runs/gpu-d384-fresh-compare-earlier-from-long.txt", (0.077, 0.076, 0.071)),
)
# The accuracy asked of the forecast, mean |error| in nats at 25% and 50% of the run (10% has no goal of
# its own: the 25% one, for scale). `forecast evaluate` counts its forecasts within it.
ACCURACY_GOAL = {"10": 0.05, "25": 0.05, "50": 0.03}


def accuracy_text() -> str:
    """How far to trust the forecast, as measured: what `plan` prints under the rule."""
    rows = "; ".join(f"{'/'.join(f'{e:.2f}' for e in errors)} on {what}" for what, _, errors in MEASURED_ACCURACY)
    earlier = ", ".join(f"{'/'.join(f'{e:.2f}' for e in errors)} on {what}" for what, _, errors in MEASURED_WITH_EARLIER_RUNS)
    return (f"forecast accuracy, measured on held-out GPU runs (docs/FORECAST.md): mean |error| in nats at 10/25/50% "
            f"of the run {rows}; with earlier runs of the same config as its prior (--forecast-earlier-runs) {earlier}; "
            f"the aim is {ACCURACY_GOAL['25']:g} at 25% and {ACCURACY_GOAL['50']:g} at 50%, met on average only with "
            "earlier runs, and not on every set: judge by the forecast's interval, not its point")


def summary_text(summary: dict[str, Any] | None) -> str:
    """One line for `dod`: what the forecast said at 10/25/50% of the run, against the final value."""
    if not summary:
        return "forecast: none logged"
    parts = []
    for key, h in summary["at"].items():
        if h is None:
            parts.append(f"{key}: not yet")
        else:
            held = "" if "held" not in h else (", held" if h["held"] else ", missed")
            err = f" ({h['error']:+.3f}{held})" if "error" in h else ""
            parts.append(f"{key}: {h['value']:.3f} [{h['low']:.3f}, {h['high']:.3f}]{err}")
    return "forecast at " + "; ".join(parts)
