"""Will this run land in the band? A forecast of the final val loss from the run's own curve.

At every eval the trainer fits its curve so far (the val losses, and its train losses binned, with
an offset between the two) with a law that knows the learning-rate schedule, and predicts the val
loss at the last step, with an interval (docs/FORECAST.md):

    L(s) = L0 + A * S1(s)^-alpha - C * S2(s)                      (Tissue et al. 2024, arXiv 2408.11029)

S1 is the schedule's forward area (the sum of the learning rates so far, in units of the peak), S2
its annealing area (the drops of the learning rate, summed through a momentum that remembers a
fixed share of the run, divided by the run's length: measured on runs of 300 to 3000 steps, the
decay's weight C fitted in raw steps shrank as 1/length, in shares of the run it held). The run
knows its whole schedule in advance (warm-up, cosine to min_lr at total_steps), so S1 and S2 are
known for every step up to the end. From 10-25% of a cosine run the decay's weight C cannot be
identified (the learning rate has barely moved): C and the memory come from earlier complete runs
(forecast_priors.json, with their provenance), and the fit here moves only L0, A, alpha (alpha
held near its prior by a penalty term) and the train-val offset. SciPy's least_squares does the
fitting, with a soft-L1 loss: one bad point does not drag the fit.

The interval: the fit's covariance (Jacobian) and the spread the prior's uncertainty on C gives,
added in quadrature, then widened by a factor calibrated on held-out complete runs (a loss curve's
residuals are autocorrelated: the plain covariance is too narrow). Too few points gives a
"not enough points yet" forecast, never a number.

    python -m x1_pretrain.forecast evaluate CURVES.json     # leave-one-out accuracy table
    python -m x1_pretrain.forecast fit-priors CURVES.json --output forecast_priors.json
"""

from __future__ import annotations

import argparse
import functools
import json
import logging
import math
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from x1_common.contracts import MLFLOW_FORECAST_METRICS, ExitCode
from x1_common.fsutil import write_json_atomic
from x1_common.projection import at_finish
from x1_pretrain.train.forecast_rule import (
    DEFAULT_BAND,
    LAW,
    MIN_POINTS,
    MIN_VAL_POINTS,
    TRAIN_BINS,
)
from x1_pretrain.train.schedule import lr_at, probe_lr

log = logging.getLogger("x1.forecast")

PRIORS_FILE = Path(__file__).with_name("forecast_priors.json")
LAWS = ("lr-annealing", "power", "multi-power")
Z90 = 1.6449  # the interval is a nominal 90% one before calibration
NOISE = 0.01  # nats: a loss point's typical scatter, which weighs the alpha prior against the points


class ForecastError(ValueError):
    """A priors or curves file that cannot be used: the message names the file and the field."""


# ---------------------------------------------------------------------------------------------
# The schedule and its areas


@dataclass(frozen=True)
class Schedule:
    lr: float
    min_lr: float
    warmup_steps: int
    total_steps: int

    @classmethod
    def from_config(cls, optim: Any, total_steps: int) -> Schedule:
        return cls(lr=optim.lr, min_lr=optim.min_lr, warmup_steps=optim.warmup_steps, total_steps=total_steps)

    def rates(self) -> np.ndarray:
        """r[s] for s = 0..total: the learning rate of the step that ends at s, over the peak (r[0] = 0)."""
        r = np.zeros(self.total_steps + 1)
        r[1:] = [lr_at(s, self, self.total_steps) / self.lr for s in range(self.total_steps)]
        return r


@functools.lru_cache(maxsize=8)
def areas(schedule: Schedule, memory: float) -> tuple[np.ndarray, np.ndarray]:
    """(S1, S2) for s = 0..total. S1: the sum of the rates. S2: the sum of the momentum m of the
    rate's drops, m_s = lam * m_(s-1) + max(r_(s-1) - r_s, 0) (the warm-up's rises anneal nothing),
    over the total steps; lam = 1 - 1 / (memory x total steps): the same shape at any run length."""
    from scipy.signal import lfilter

    T = schedule.total_steps
    lam = 1.0 - 1.0 / max(memory * T, 1.0)
    r = schedule.rates()
    drops = np.zeros_like(r)
    drops[2:] = np.maximum(r[1:-1] - r[2:], 0.0)
    momentum = lfilter([1.0], [1.0, -lam], drops)
    return np.cumsum(r), np.cumsum(momentum) / T


# How a cooldown probe's end is placed on the law: "own" (the default): its own learning rates, the
# run's up to the fork and then the cooldown, as a run of its own of fork + k steps (the law's areas
# are in shares of a run's length); "run": the same rates in the units of the run it was forked from;
# "cosine": the areas of a whole cosine schedule of fork + k steps, the schedule Hägele et al. find a
# cooldown of 10-20% lands on. `python -m x1_pretrain.forecast evaluate --probe-areas` compares them.
PROBE_AREAS = "own"
PROBE_AREAS_CHOICES = ("own", "run", "cosine")


def use_probe_areas(how: str) -> None:
    """The placing of probes the forecasts of this process use (the evaluation's --probe-areas)."""
    global PROBE_AREAS
    if how not in PROBE_AREAS_CHOICES:
        raise ValueError(f"probe areas {how!r}: one of {', '.join(PROBE_AREAS_CHOICES)}")
    PROBE_AREAS = how


def _momentum_areas(r: np.ndarray, length: int, memory: float) -> tuple[float, float]:
    """(S1, S2) at the end of the rates r[0..n] of a run `length` steps long (as `areas` reckons them)."""
    from scipy.signal import lfilter

    lam = 1.0 - 1.0 / max(memory * length, 1.0)
    drops = np.zeros_like(r)
    drops[2:] = np.maximum(r[1:-1] - r[2:], 0.0)
    momentum = lfilter([1.0], [1.0, -lam], drops)
    return float(np.sum(r)), float(np.sum(momentum) / length)


@functools.lru_cache(maxsize=256)
def probe_areas(schedule: Schedule, memory: float, fork: int, steps: int, how: str = "own") -> tuple[float, float]:
    """(S1, S2) at the end of a cooldown probe forked at `fork`, `steps` long: its learning rates are
    the run's to the fork, then from the run's there to min_lr in the (1-sqrt) shape (schedule.probe_lr)."""
    if how == "cosine":
        whole = Schedule(schedule.lr, schedule.min_lr, schedule.warmup_steps, fork + steps)
        S1, S2 = areas(whole, memory)
        return float(S1[-1]), float(S2[-1])
    start = lr_at(fork, schedule, schedule.total_steps)
    cool = np.array([probe_lr(j, steps, start, schedule.min_lr) for j in range(steps)]) / schedule.lr
    rates = np.concatenate([schedule.rates()[: fork + 1], cool])
    return _momentum_areas(rates, schedule.total_steps if how == "run" else fork + steps, memory)


# ---------------------------------------------------------------------------------------------
# Priors: the decay term from earlier complete runs


@dataclass(frozen=True)
class Priors:
    """What the live fit does not estimate, from complete runs (fit_priors), and the interval's scale."""

    C: float  # weight of the annealing area
    C_sd: float  # its spread across the complete runs
    memory: float  # the annealing area's momentum remembers this share of the run
    alpha: float  # the forward area's exponent: the prior the live fit is held near
    alpha_sd: float
    interval_scale: float  # the calibration: the half-width is Z90 x this x the combined standard error
    provenance: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def load(cls, path: Path = PRIORS_FILE) -> Priors:
        try:
            data = json.loads(Path(path).read_text())
        except (OSError, ValueError) as e:
            raise ForecastError(f"{path}: cannot be read as JSON ({e})") from None
        if not isinstance(data, dict):
            raise ForecastError(f"{path}: not a JSON object")
        values = {}
        for name in ("C", "C_sd", "memory", "alpha", "alpha_sd", "interval_scale"):
            v = data.get(name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
                raise ForecastError(f"{path}: field {name!r} must be a finite number >= 0, got {v!r}")
            values[name] = float(v)
        if not 0 < values["memory"] <= 1:
            raise ForecastError(f"{path}: field 'memory' must lie in (0, 1], got {values['memory']}")
        return cls(**values, provenance=data.get("provenance", {}))

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2, sort_keys=True) + "\n"


# ---------------------------------------------------------------------------------------------
# The curve so far


@dataclass
class Curve:
    """Val losses at evals and train losses binned, with the steps flagged as spikes.

    The state a checkpoint keeps (`to_state` / `from_state`), so a resumed run continues its curve
    rather than starting it again; a step seen twice (the steps between a checkpoint and a crash run
    again after the resume) replaces its first value."""

    val: dict[int, float] = field(default_factory=dict)
    bins: dict[int, list[float]] = field(default_factory=dict)  # bin start step -> [sum of steps, sum of losses, n]
    bin_width: int = 1
    flagged: set[int] = field(default_factory=set)
    seen_train: int = 0  # the last train step added: a replayed step after a resume is not counted twice
    probes: dict[int, tuple[int, float]] = field(default_factory=dict)  # fork step -> (cooldown steps, val loss)

    def add_train(self, step: int, loss: float, flagged: bool = False) -> None:
        if flagged or not math.isfinite(loss):
            self.flagged.add(step)
            return
        if step <= self.seen_train:  # replayed after a resume: already in its bin
            return
        self.seen_train = step
        start = step - step % self.bin_width
        b = self.bins.setdefault(start, [0.0, 0.0, 0])
        b[0] += step
        b[1] += loss
        b[2] += 1

    def add_val(self, step: int, loss: float) -> None:
        if math.isfinite(loss):
            self.val[step] = loss

    def add_probe(self, fork: int, steps: int, loss: float) -> None:
        """A cooldown probe's annealed val loss (x1_pretrain.train.probes): forked at `fork`, `steps` long."""
        if math.isfinite(loss) and steps > 0:
            self.probes[fork] = (steps, loss)

    def train_points(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(mean step, mean loss, count) of each bin."""
        rows = [(s / n, total / n, n) for s, total, n in self.bins.values() if n]
        if not rows:
            return np.zeros(0), np.zeros(0), np.zeros(0)
        a = np.array(sorted(rows))
        return a[:, 0], a[:, 1], a[:, 2]

    def to_state(self) -> dict[str, Any]:
        return {"val": [[s, v] for s, v in sorted(self.val.items())],
                "bins": [[s, *b] for s, b in sorted(self.bins.items())], "bin_width": self.bin_width,
                "flagged": sorted(self.flagged), "seen_train": self.seen_train,
                "probes": [[f, k, v] for f, (k, v) in sorted(self.probes.items())]}

    @classmethod
    def from_state(cls, state: dict[str, Any], bin_width: int) -> Curve:
        curve = cls(bin_width=bin_width)
        if not state:
            return curve
        curve.val = {int(s): float(v) for s, v in state.get("val", [])}
        curve.bins = {int(row[0]): [float(row[1]), float(row[2]), int(row[3])] for row in state.get("bins", [])}
        curve.flagged = {int(s) for s in state.get("flagged", [])}
        curve.seen_train = int(state.get("seen_train", 0))
        curve.probes = {int(f): (int(k), float(v)) for f, k, v in state.get("probes", [])}
        if int(state.get("bin_width", bin_width)) != bin_width:
            # --total-steps changed the bin width: the bins so far stay as they are (each is a
            # point at its mean step); new steps go into bins of the new width, after them.
            curve.bins = {-(i + 1): b for i, b in enumerate(curve.bins.values())}
        return curve


# ---------------------------------------------------------------------------------------------
# The forecast


@dataclass(frozen=True)
class Forecast:
    step: int
    total_steps: int
    law: str
    value: float | None = None  # None: not enough points yet
    low: float | None = None
    high: float | None = None
    val_points: int = 0
    train_points: int = 0
    reason: str = ""  # why there is no number
    probe_points: int = 0  # cooldown probes among the points (train.cooldown_probes)
    ladder: bool = False  # combined with the ladder's prediction (LadderPrior)

    @property
    def ready(self) -> bool:
        return self.value is not None

    def sources(self) -> str:
        """What the forecast used besides its own curve: its probes, and the ladder or its absence."""
        probes = f" + {self.probe_points} probe{'s' if self.probe_points > 1 else ''}" if self.probe_points else ""
        return f"{probes}, law {self.law}, {'ladder prior' if self.ladder else 'no ladder'}"

    def line(self) -> str:
        if not self.ready:
            return f"forecast: not enough points yet at step {self.step}/{self.total_steps} ({self.reason})"
        return (f"forecast: final val loss {self.value:.3f} [{self.low:.3f}, {self.high:.3f}] at step "
                f"{self.total_steps}, made at step {self.step} from {self.val_points} evals + {self.train_points} "
                f"train-loss bins{self.sources()}")

    def outside(self, lo: float, hi: float) -> bool:
        """The whole interval lies outside [lo, hi]."""
        return self.ready and (self.low > hi or self.high < lo)


@dataclass(frozen=True)
class Points:
    """What a forecast fits, past the warm-up and away from spikes: val losses at evals, train losses
    binned (mean step, mean loss, count), and cooldown probes (fork step, steps, annealed val loss)."""

    vs: np.ndarray
    vl: np.ndarray
    ts: np.ndarray
    tl: np.ndarray
    tn: np.ndarray
    probes: tuple[tuple[int, int, float], ...] = ()

    @property
    def count(self) -> int:
        return len(self.vs) + len(self.ts) + len(self.probes)


def _points(curve: Curve, schedule: Schedule, after_spike: int, step: int | None = None) -> Points:
    first = max(schedule.warmup_steps, 1)
    flagged = np.array(sorted(curve.flagged))

    def near_spike(step: float) -> bool:
        if not len(flagged):
            return False
        i = np.searchsorted(flagged, step, side="right")
        return i > 0 and step - flagged[i - 1] <= after_spike

    vs = [(s, v) for s, v in sorted(curve.val.items()) if s >= first and s <= schedule.total_steps and not near_spike(s)]
    ts, tl, tn = curve.train_points()
    keep = [(s, v, n) for s, v, n in zip(ts, tl, tn, strict=True) if s >= first and s <= schedule.total_steps and not near_spike(s)]
    probes = tuple((f, k, v) for f, (k, v) in sorted(curve.probes.items())
                   if f >= first and f + k <= schedule.total_steps and (step is None or f <= step) and not near_spike(f))
    v_arr = np.array(vs, dtype=float).reshape(-1, 2)
    t_arr = np.array(keep, dtype=float).reshape(-1, 3)
    return Points(v_arr[:, 0], v_arr[:, 1], t_arr[:, 0], t_arr[:, 1], t_arr[:, 2], probes)


def _fit_annealing(p: Points, S1, S2, C: float, priors: Priors, probe_areas: np.ndarray | None = None,
                   C_live: bool = False) -> tuple[np.ndarray, np.ndarray, float]:
    """(theta = L0, A, alpha, offset, C; its covariance; residual scale). C is held at `C` unless
    `C_live` (cooldown probes: annealed points that measure it), then held near the prior's C by a
    penalty term as alpha is near the prior's alpha. `probe_areas`: (S1, S2) of each probe's end."""
    from scipy.optimize import least_squares

    vi, ti = p.vs.astype(int), np.rint(p.ts).astype(int)
    s1v, s2v, s1t, s2t = S1[vi], S2[vi], S1[ti], S2[ti]
    s1p, s2p = (probe_areas[:, 0], probe_areas[:, 1]) if probe_areas is not None else (np.zeros(0), np.zeros(0))
    lp = np.array([v for _, _, v in p.probes]) if probe_areas is not None else np.zeros(0)
    wt = np.sqrt(p.tn / p.tn.max()) if len(p.tn) else p.tn  # a fuller bin is a surer mean
    has_train = len(p.ts) > 0
    n_data = len(p.vl) + len(p.tl) + len(lp)

    def residuals(theta):
        L0, A, alpha, offset, c = theta
        rv = L0 + A * s1v ** -alpha - c * s2v - p.vl
        rt = (L0 + A * s1t ** -alpha - c * s2t + offset - p.tl) * wt
        rp = L0 + A * s1p ** -alpha - c * s2p - lp
        prior = [(alpha - priors.alpha) / max(priors.alpha_sd, 1e-3) * NOISE]
        if C_live:
            prior.append((c - priors.C) / max(priors.C_sd, 1e-3 * max(priors.C, 1e-3)) * NOISE)
        return np.concatenate([rv, rt, rp, prior])

    y_min = float(min(p.vl.min(), p.tl.min() if has_train else np.inf, lp.min() if len(lp) else np.inf))
    L0_0 = max(y_min - 0.5, 0.0)
    A_0 = max((p.vl[0] - L0_0) * s1v[0] ** priors.alpha, 1e-3)
    x0 = np.array([L0_0, A_0, priors.alpha, 0.0, C])
    lb = [0.0, 0.0, 0.01, -5.0, 0.0 if C_live else C - 1e-12]
    ub = [y_min + 5.0, np.inf, 3.0, 5.0, max(10.0 * C, 1.0) if C_live else C + 1e-12]
    if not has_train:  # no offset to fit: held at 0
        lb[3], ub[3] = -1e-9, 1e-9
    res = least_squares(residuals, np.clip(x0, lb, ub), bounds=(lb, ub), loss="soft_l1", f_scale=0.02,
                        x_scale="jac", max_nfev=2000)
    live = [0, 1, 2] + ([3] if has_train else []) + ([4] if C_live else [])
    dof = max(n_data - len(live), 1)
    data_res = res.fun[:n_data]
    s2 = float(np.sum(data_res ** 2) / dof)
    cov = np.zeros((5, 5))
    try:
        J = res.jac[:, live]
        cov[np.ix_(live, live)] = np.linalg.pinv(J.T @ J) * s2
    except np.linalg.LinAlgError:
        cov[:] = np.nan
    return res.x, cov, math.sqrt(s2)


def predict_annealing(theta: np.ndarray, S1: np.ndarray, S2: np.ndarray, C: float | None, step: int) -> float:
    L0, A, alpha = theta[:3]
    c = theta[4] if C is None else C
    return float(L0 + A * S1[step] ** -alpha - c * S2[step])


# The law's misfit at the run's own evals is not noise that averages out: on the ten complete runs of
# docs/forecast-runs its val residuals correlate over ~5% of the run (0.55 at lags up to 2.5%, 0.33 up
# to 5%, 0.15 up to 10%, none past 20%) with about 30% of their variance white. The forecast carries
# the recent residuals forward to the last step with that correlation (a Gaussian process's posterior
# mean, exponential kernel): at an eval that is the run's last step it is that eval's own value (within
# its noise), and from a few tenths of a run away the law alone speaks.
RESIDUAL_MEMORY = 0.05  # of the run: the residuals' correlation length
RESIDUAL_NOISE = 0.4  # their white share over their correlated share (variances)


def residual_carry(steps: np.ndarray, residuals: np.ndarray, at: int, total: int) -> float:
    """The val residuals (loss minus law) at `steps`, carried to step `at`: k(at)' (K + noise I)^-1 r."""
    if not len(steps):
        return 0.0
    scale = RESIDUAL_MEMORY * total
    K = np.exp(-np.abs(steps[:, None] - steps[None, :]) / scale) + RESIDUAL_NOISE * np.eye(len(steps))
    k = np.exp(-np.abs(at - steps) / scale)
    return float(k @ np.linalg.solve(K, residuals))


def forecast(curve: Curve, schedule: Schedule, priors: Priors, step: int, ladder: LadderPrior | None = None,
             use_probes: bool = True) -> Forecast:
    """The final val loss the curve so far points to, with its calibrated interval; with a ladder,
    combined with the ladder's prediction by their uncertainties."""
    T = schedule.total_steps
    after_spike = max(T // 50, 1)
    p = _points(curve, schedule, after_spike, step)
    if not use_probes:
        p = Points(p.vs, p.vl, p.ts, p.tl, p.tn)
    priors = ladder.priors if ladder is not None else priors
    if len(p.vs) < MIN_VAL_POINTS or p.count < MIN_POINTS:
        return Forecast(step=step, total_steps=T, law=LAW, val_points=len(p.vs), train_points=len(p.ts),
                        probe_points=len(p.probes), ladder=ladder is not None,
                        reason=f"{len(p.vs)} evals and {len(p.ts)} train-loss bins past the warm-up; "
                        f"{MIN_VAL_POINTS} evals and {MIN_POINTS} points in all needed")
    S1, S2 = areas(schedule, priors.memory)
    pa = np.array([probe_areas(schedule, priors.memory, f, k, PROBE_AREAS) for f, k, _ in p.probes]) if p.probes else None
    live = pa is not None

    def fit_predict(C: float) -> tuple[float, np.ndarray, np.ndarray]:
        theta, cov, _ = _fit_annealing(p, S1, S2, C, priors, pa, C_live=live)
        law = predict_annealing(theta, S1, S2, None, T)
        vi = p.vs.astype(int)
        r = p.vl - (theta[0] + theta[1] * S1[vi] ** -theta[2] - theta[4] * S2[vi])
        return law + residual_carry(p.vs, r, T, T), theta, cov

    value, theta, cov = fit_predict(priors.C)
    # The fit's own uncertainty: the prediction's gradient through the covariance.
    grad = np.zeros(5)
    base = predict_annealing(theta, S1, S2, None, T)
    for i in (0, 1, 2, 4):
        h = max(abs(theta[i]) * 1e-5, 1e-8)
        up = theta.copy()
        up[i] += h
        grad[i] = (predict_annealing(up, S1, S2, None, T) - base) / h
    var_fit = float(grad @ cov @ grad) if np.all(np.isfinite(cov)) else 0.0
    var_prior = 0.0
    if not live:  # the prior's: refit with C one spread either side (the live parameters move with it)
        spread = [fit_predict(C)[0] for C in (max(priors.C - priors.C_sd, 0.0), priors.C + priors.C_sd)]
        var_prior = ((spread[1] - spread[0]) / 2) ** 2
    half = Z90 * priors.interval_scale * math.sqrt(max(var_fit, 0.0) + var_prior)
    if ladder is not None:
        value, half = ladder.combine(value, half)
    return Forecast(step=step, total_steps=T, law=LAW, value=value, low=value - half, high=value + half,
                    val_points=len(p.vs), train_points=len(p.ts), probe_points=len(p.probes), ladder=ladder is not None)


# ---------------------------------------------------------------------------------------------
# The ladder as prior: a measured prediction of this run's final loss, and complete small-run curves


@dataclass(frozen=True)
class LadderPrior:
    """What a scaling ladder (ladder.json) says of this run: its final val loss as a distribution
    (mean, sd: the ladder's declared interval read as a 90% one), and the shape priors (C, memory,
    alpha, the interval's scale) fitted on the ladder's own complete rungs with `fit_priors`, in
    place of the shipped forecast_priors.json."""

    mean: float
    sd: float
    priors: Priors
    source: str  # where `mean` comes from, in words

    def combine(self, value: float, half: float) -> tuple[float, float]:
        """The run's own forecast (value, 90% half-width) and the ladder's, weighted by the inverse of
        their variances: (value, half-width) of the combination."""
        own_var = (half / Z90) ** 2
        if own_var <= 0 or not math.isfinite(own_var):
            return value, half
        w_own, w_ladder = 1.0 / own_var, 1.0 / self.sd ** 2
        mean = (w_own * value + w_ladder * self.mean) / (w_own + w_ladder)
        return mean, Z90 / math.sqrt(w_own + w_ladder)


def _number(d: Any, key: str, where: str, positive: bool = False) -> float:
    v = d.get(key) if isinstance(d, dict) else None
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or (positive and v <= 0):
        raise ForecastError(f"ladder: {where}{key} must be a {'positive' if positive else 'finite'} number, got {v!r}")
    return float(v)


def _rung_curve(rung: Any, i: int) -> RunCurve | None:
    """A rung's complete curve as a RunCurve of val points; None for a diverged rung."""
    where = f"rungs[{i}]."
    if not isinstance(rung, dict):
        raise ForecastError(f"ladder: rungs[{i}] is not an object")
    if rung.get("diverged"):
        return None
    sched = rung.get("schedule")
    if sched is None and rung.get("curve") is None:  # a rungs file with the fit's three keys only: no curve
        return None
    if not isinstance(sched, dict):
        raise ForecastError(f"ladder: {where}schedule must be an object")
    schedule = Schedule(lr=_number(sched, "lr", where + "schedule.", True),
                        min_lr=_number(sched, "min_lr", where + "schedule."),
                        warmup_steps=int(_number(sched, "warmup_steps", where + "schedule.")),
                        total_steps=int(_number(sched, "total_steps", where + "schedule.", True)))
    curve = rung.get("curve")
    try:
        points = np.array(curve, dtype=float).reshape(-1, 2)
    except (TypeError, ValueError):
        raise ForecastError(f"ladder: {where}curve must be a list of [step, val_loss] pairs") from None
    if not len(points) or not np.all(np.isfinite(points)):
        raise ForecastError(f"ladder: {where}curve is empty or holds a number that is not finite")
    points = points[np.argsort(points[:, 0])]
    if points[-1, 0] > schedule.total_steps or points[0, 0] < 0:
        raise ForecastError(f"ladder: {where}curve has a step outside 0..{schedule.total_steps}")
    return RunCurve(f"rung {i} ({_number(rung, 'n_params', where, True):.3g} params)", schedule, np.zeros(0),
                    points[:, 0], points[:, 1], n_params=float(rung["n_params"]))


def _predicted(ladder: dict[str, Any], n_params: float, tokens: float, nonembedding_params: float | None,
               flops_per_token: float | None) -> tuple[float, float, float, str]:
    """(val loss, low, high, source) the ladder predicts for this run's parameters and tokens: its
    law's value there (x1_common.scaling.predict) where the ladder holds a fit and that module is
    installed, else its `prediction` (as is where it was made for another size: said in `source`)."""
    try:
        from x1_common import scaling  # the ladder's law, closed form (stdlib)
    except ImportError:
        scaling = None
    if scaling is not None and isinstance(ladder.get("fit"), dict):
        try:
            got = scaling.predict(ladder, n_params, tokens, nonembedding_params=nonembedding_params,
                                  flops_per_token=flops_per_token)
        except (KeyError, TypeError, ValueError) as e:  # scaling.LadderFileError is a ValueError
            raise ForecastError(f"ladder: its law cannot predict this run ({type(e).__name__}: {e})") from None
        low, high = float(got.low), float(got.high)
        return float(got.val_loss), low, high, f"the ladder's law at {n_params:.3g} params, {tokens:.3g} tokens"
    pred = ladder.get("prediction")
    if not isinstance(pred, dict):
        raise ForecastError("ladder: neither a fit its law can be read from (x1_common.scaling) nor a prediction "
                            "{n_params, tokens, val_loss, low, high}")
    value = _number(pred, "val_loss", "prediction.", True)
    tol = ladder.get("tolerance")
    if "low" in pred or "high" in pred or isinstance(tol, bool) or not isinstance(tol, (int, float)):
        low, high = _number(pred, "low", "prediction."), _number(pred, "high", "prediction.")
    else:
        low, high = value - float(tol), value + float(tol)
    if not low <= value <= high:
        raise ForecastError(f"ladder: prediction's interval [{low}, {high}] does not hold its val_loss {value}")
    target = (_number(pred, "n_params", "prediction.", True), _number(pred, "tokens", "prediction.", True))
    if math.isclose(target[0], n_params, rel_tol=0.01) and math.isclose(target[1], tokens, rel_tol=0.01):
        return value, low, high, "the ladder's prediction for this run"
    return value, low, high, (f"the ladder's prediction for {target[0]:.3g} params, {target[1]:.3g} tokens, as is "
                              f"(this run: {n_params:.3g}, {tokens:.3g})")


def prior_from_ladder(ladder: dict[str, Any], n_params: float, tokens: float, nonembedding_params: float | None = None,
                      flops_per_token: float | None = None) -> LadderPrior:
    """The forecast's prior from a ladder.json (as a dict): the predictive distribution of this run's
    final val loss (`_predicted`: the ladder's law at this run's parameters and tokens, or its
    prediction), its interval read as a 90% one, and the shape priors fitted on the rungs' complete
    curves (the diverged ones left out). `nonembedding_params` for a law that counts N without the
    embedding. ForecastError names what is wrong."""
    if not isinstance(ladder, dict):
        raise ForecastError("ladder: not a JSON object")
    value, low, high, source = _predicted(ladder, n_params, tokens, nonembedding_params, flops_per_token)
    rungs = ladder.get("rungs")
    if not isinstance(rungs, list):
        raise ForecastError("ladder: rungs must be a list")
    priors = _rung_priors(json.dumps(rungs, sort_keys=True))
    sd = max((high - low) / (2 * Z90), 1e-3)  # the declared interval, read as a 90% one
    return LadderPrior(mean=value, sd=sd, priors=Priors(**{**asdict(priors), "provenance": {
        **priors.provenance, "prediction": source}}), source=source)


@functools.lru_cache(maxsize=4)
def _rung_priors(rungs: str) -> Priors:
    """fit_priors on the rungs' complete curves (seconds: cached for the runs of one evaluation)."""
    curves = [c for i, r in enumerate(json.loads(rungs)) if (c := _rung_curve(r, i)) is not None]
    first = [c for c in curves if np.sum(c.val_steps >= max(c.schedule.warmup_steps, 1)) >= MIN_POINTS]
    if len(first) < 2:
        # A ladder fitted from final losses alone (made elsewhere): its prediction still counts, the
        # shapes come from the shipped complete runs, and the provenance says so.
        shipped = Priors.load()
        return Priors(**{**asdict(shipped), "provenance": {**shipped.provenance, "ladder": (
            f"{len(first)} rung(s) with {MIN_POINTS} val points past their warm-up: the shipped shape priors")}})
    return fit_priors(first, provenance={"ladder": [c.name for c in first]})



# ---------------------------------------------------------------------------------------------
# The trainer's side: the curve as the run goes, a forecast at each eval, the band's early warning


@dataclass
class ForecastWatch:
    """What the loop calls: `observe` at every step, `at_eval` at every eval.

    The alert fires once per crossing: when a forecast's whole interval lies outside the band after
    one that did not (the first forecast too). It fires again only after a forecast has come back
    into the band. `state()` goes into the checkpoint, so a resumed run keeps its curve, its
    history and whether it already alerted."""

    schedule: Schedule
    priors: Priors
    band: tuple[float, float] = DEFAULT_BAND
    stop_outside: bool = False
    curve: Curve = field(default_factory=Curve)
    outside: bool = False
    history: list[dict[str, Any]] = field(default_factory=list)
    alerts: Any = None  # x1_common.alerts.AlertSender; None: this process does not speak (ranks other than 0)
    last_alert: str = ""
    ladder: LadderPrior | None = None  # the ladder's prediction and shape priors (prior_from_ladder), when given

    @classmethod
    def for_run(cls, optim: Any, total_steps: int, log_every: int, state: dict[str, Any] | None,
                band: tuple[float, float] | None = None, stop_outside: bool = False,
                priors: Priors | None = None, alerts: Any = None, ladder: LadderPrior | None = None) -> ForecastWatch:
        state = state or {}
        width = max(total_steps // TRAIN_BINS, log_every, 1)
        watch = cls(schedule=Schedule.from_config(optim, total_steps), priors=priors or Priors.load(),
                    band=tuple(band) if band else DEFAULT_BAND, stop_outside=stop_outside,
                    curve=Curve.from_state(state.get("curve", {}), width), outside=bool(state.get("outside", False)),
                    history=list(state.get("history", [])), alerts=alerts, ladder=ladder)
        return watch

    def state(self) -> dict[str, Any]:
        return {"curve": self.curve.to_state(), "outside": self.outside, "history": self.history}

    def observe(self, step: int, loss: float, flagged: bool) -> None:
        self.curve.add_train(step, loss, flagged)

    def add_probe(self, fork: int, steps: int, loss: float) -> None:
        """A cooldown probe's annealed val loss: a point of the next forecasts (train/probes.py)."""
        self.curve.add_probe(fork, steps, loss)

    def at_eval(self, step: int, val_loss: float) -> tuple[Forecast, bool]:
        """(the forecast now, whether it just crossed out of the band)."""
        self.curve.add_val(step, val_loss)
        f = forecast(self.curve, self.schedule, self.priors, step, self.ladder)
        if f.ready:
            self.history = [h for h in self.history if h["step"] < step]  # a replayed eval replaces its first
            self.history.append({"step": step, "total_steps": f.total_steps, "value": round(f.value, 5),
                                 "low": round(f.low, 5), "high": round(f.high, 5), "law": f.law,
                                 "probes": f.probe_points, "ladder": f.ladder})
        out = f.outside(*self.band)
        crossed = out and not self.outside
        if f.ready:  # "not enough points" says nothing either way: the state stays
            self.outside = out
        return f, crossed

    def judge(self, step: int, val_loss: float, sink: Any, projection: Any) -> int:
        """At an eval: the forecast, its `forecast:` line, MLflow metrics and /metrics gauges, the alert
        once per crossing. Returns 80 (ExitCode.FORECAST_STOP) when asked to stop and the interval
        lies outside the band, else 0. `projection`: the budget guard's (budget_guard.Projection) or None."""
        f, crossed = self.at_eval(step, val_loss)
        out = f.outside(*self.band)
        if self.alerts is None:  # not rank 0: the same decision, said by rank 0
            return int(ExitCode.FORECAST_STOP) if out and self.stop_outside else 0
        log.info("%s", f.line())
        if f.ready:
            sink.log(step, dict(zip(MLFLOW_FORECAST_METRICS, (f.value, f.low, f.high), strict=True)))
            sink.prom.forecast.set(f.value)
            sink.prom.forecast_low.set(f.low)
            sink.prom.forecast_high.set(f.high)
        if crossed:
            spent = to_finish = None
            if projection is not None:
                # The one projection at the finish (x1_common.projection), as `status` shows it.
                finish = at_finish(projection.spent_usd, trainer_usd=projection.own_usd,
                                   sidecar_usd=projection.sidecar_usd)
                spent, to_finish = projection.spent_usd, finish.more_usd if finish else None
            self.last_alert = self.alert_text(f, spent, to_finish)
            then = ("the run stops now (--stop-when-forecast-misses-band)" if self.stop_outside else
                    "the run continues (--stop-when-forecast-misses-band would stop it)")
            self.alerts.send("forecast", "X1 run forecast outside the band", f"{self.last_alert}. {then}",
                             {"step": step, "forecast": round(f.value, 4), "low": round(f.low, 4),
                              "high": round(f.high, 4), "band": list(self.band), "spent_usd": spent,
                              "to_finish_usd": to_finish})
        if out and self.stop_outside:
            self.last_alert = self.last_alert or self.alert_text(f, None, None)
            return int(ExitCode.FORECAST_STOP)
        return 0

    def alert_text(self, f: Forecast, spent_usd: float | None, to_finish_usd: float | None) -> str:
        lo, hi = self.band
        money = ("; no budget reading: the spend is not known" if spent_usd is None else
                 f"; spent ${spent_usd:.2f}" + (f", ${to_finish_usd:.2f} more to finish" if to_finish_usd is not None else ""))
        return (f"forecast {f.value:.2f} [{f.low:.2f}, {f.high:.2f}] at step {f.step}, band [{lo:.2f}, {hi:.2f}]"
                f"{money}")


# ---------------------------------------------------------------------------------------------
# After the run: what the forecast said at 10/25/50% against what came (manifest, dod, plot)


def history_from_series(value: list[tuple[int, float]], low: list[tuple[int, float]],
                        high: list[tuple[int, float]]) -> list[dict[str, float]]:
    """The forecasts logged to MLflow (forecast_val_loss, _low, _high at each eval's step), joined by step."""
    lo, hi = dict(low), dict(high)
    return [{"step": int(s), "value": v, "low": lo[s], "high": hi[s]} for s, v in sorted(value) if s in lo and s in hi]


def forecast_summary(history: list[dict[str, float]], total_steps: int | None, final: float | None) -> dict[str, Any] | None:
    """The manifest's `forecast`: every forecast made, and the last one made by 10%, 25% and 50% of
    the run, each against the final val loss (error, and whether its interval held it)."""
    if not history or not total_steps:
        return None
    at: dict[str, Any] = {}
    for frac in FRACTIONS:
        made = [h for h in history if h["step"] <= frac * total_steps]
        key = f"{int(frac * 100)}%"
        if not made:
            at[key] = None
            continue
        h = made[-1]
        at[key] = {**h}
        if final is not None:
            at[key].update(error=round(h["value"] - final, 4), held=h["low"] <= final <= h["high"])
    return {"law": LAW, "interval": "calibrated 90% (docs/FORECAST.md)", "history": history, "at": at,
            "final_val_loss": final}


# ---------------------------------------------------------------------------------------------
# The laws compared with it (docs/FORECAST.md), fitted with every parameter live


def fit_power(steps: np.ndarray, losses: np.ndarray, total: int) -> float:
    """E + A t^-alpha, every parameter fitted: the schedule-blind extrapolation."""
    from scipy.optimize import curve_fit

    def f(t, E, A, alpha):
        return E + A * t ** -alpha

    try:
        (E, A, alpha), _ = curve_fit(f, steps, losses, p0=[max(losses.min() - 0.5, 0.0), 5.0, 0.5],
                                     bounds=([0.0, 0.0, 0.01], [losses.min(), np.inf, 3.0]), maxfev=20000)
    except (RuntimeError, ValueError):
        return float("nan")
    return float(f(total, E, A, alpha))


def multi_power_loss(params: np.ndarray, schedule: Schedule, steps: np.ndarray) -> np.ndarray:
    """Luo et al. 2025 (arXiv 2503.12811): L0 + A (S1 + S_W)^-alpha - LD(t),
    LD(t) = B sum_k (r_(k-1) - r_k) G(r_k^-gamma S_k(t)), G(x) = 1 - (C x + 1)^-beta, S_k(t) = sum_(k..t) r."""
    L0, A, alpha, B, C, beta, gamma = params
    r = schedule.rates()
    S1 = np.cumsum(r)
    drops = np.zeros_like(r)
    drops[2:] = np.maximum(r[1:-1] - r[2:], 0.0)
    ks = np.nonzero(drops)[0]
    out = []
    for t in steps.astype(int):
        k = ks[ks <= t]
        if len(k):
            Skt = S1[t] - S1[k - 1]
            G = 1.0 - (C * np.maximum(r[k], 1e-12) ** -gamma * Skt + 1.0) ** -beta
            LD = B * float(np.sum(drops[k] * G))
        else:
            LD = 0.0
        out.append(L0 + A * max(S1[t], 1e-9) ** -alpha - LD)
    return np.array(out)


def fit_multi_power(run: RunCurve, until: int | None = None, decay: np.ndarray | None = None) -> np.ndarray:
    """The multi-power law's 7 parameters from the val points up to `until` (default: all). With
    `decay` (B, C, beta, gamma) given, only L0, A, alpha are fitted: the protocol the forecast uses."""
    from scipy.optimize import least_squares

    first = max(run.schedule.warmup_steps, 1)
    keep = (run.val_steps >= first) & (run.val_steps <= (until or run.schedule.total_steps))
    vs, vl = run.val_steps[keep], run.val[keep]
    if decay is None:
        x0, lb, ub = [vl.min() - 0.5, 1.0, 0.5, 0.3, 0.01, 0.5, 0.5], [0, 0, 0.01, 0, 1e-6, 0.01, 0], [vl.min(), np.inf, 3, 10, 10, 5, 3]
        res = least_squares(lambda p: multi_power_loss(p, run.schedule, vs) - vl, np.clip(x0, lb, ub), bounds=(lb, ub),
                            x_scale="jac", max_nfev=3000)
        return res.x
    res = least_squares(lambda p: multi_power_loss(np.concatenate([p, decay]), run.schedule, vs) - vl,
                        [max(vl.min() - 0.5, 0.0), 1.0, 0.5], bounds=([0, 0, 0.01], [vl.min(), np.inf, 3]),
                        x_scale="jac", max_nfev=3000)
    return np.concatenate([res.x, decay])


# ---------------------------------------------------------------------------------------------
# Curves from complete runs (bench/forecast_curves.py's JSON): priors and leave-one-out accuracy


@dataclass(frozen=True)
class RunCurve:
    name: str
    schedule: Schedule
    train: np.ndarray  # loss at steps 1..T (empty for a curve of val points alone: a ladder's rung)
    val_steps: np.ndarray
    val: np.ndarray
    probes: tuple[tuple[int, int, float], ...] = ()  # (fork step, steps, annealed val loss) of its cooldown probes
    n_params: float | None = None  # the model's (every parameter), for a ladder's prediction
    tokens_per_step: int | None = None
    nonembedding_params: float | None = None  # for a ladder whose law counts N without the embedding
    flops_per_token: float | None = None

    def curve_until(self, step: int, use_probes: bool = True) -> Curve:
        """The curve as the trainer has it at the eval at `step` (a probe forked there runs after it)."""
        curve = Curve(bin_width=max(self.schedule.total_steps // TRAIN_BINS, 1))
        for s in range(1, min(step, len(self.train)) + 1):
            if math.isfinite(self.train[s - 1]):  # a run's logs give every log_every-th step (NaN between)
                curve.add_train(s, float(self.train[s - 1]))
        for s, v in zip(self.val_steps, self.val, strict=True):
            if s <= step:
                curve.add_val(int(s), float(v))
        for fork, steps, v in self.probes if use_probes else ():
            if fork < step:
                curve.add_probe(fork, steps, v)
        return curve

    @property
    def final(self) -> float:
        return float(self.val[-1])


def load_curves(path: Path) -> list[RunCurve]:
    try:
        data = json.loads(Path(path).read_text())
        runs = []
        for r in data["runs"]:
            sched = Schedule(lr=float(r["lr"]), min_lr=float(r["min_lr"]), warmup_steps=int(r["warmup"]),
                             total_steps=int(r["steps"]))
            probes = tuple((int(q["step"]), int(q["steps"]), float(q["val_loss"])) for q in r.get("probes") or [])
            tps = r.get("tokens_per_step", data.get("tokens_per_step"))
            numbers = {k: float(r[k]) if r.get(k) is not None else None
                       for k in ("n_params", "nonembedding_params", "flops_per_token")}
            runs.append(RunCurve(r["name"], sched, np.array(r["train_loss"], dtype=float),
                                 np.array(r["val_steps"], dtype=float), np.array(r["val_loss"], dtype=float), probes,
                                 tokens_per_step=int(tps) if tps is not None else None, **numbers))
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ForecastError(f"{path}: not a curves file of bench/forecast_curves.py ({type(e).__name__}: {e})") from None
    if not runs:
        raise ForecastError(f"{path}: no runs")
    return runs


def fit_complete(run: RunCurve, memory: float) -> tuple[float, float]:
    """(C, alpha) of the whole curve, every parameter live: what a complete run says of the decay."""
    from scipy.optimize import least_squares

    S1, S2 = areas(run.schedule, memory)
    first = max(run.schedule.warmup_steps, 1)
    keep = run.val_steps >= first
    vs, vl = run.val_steps[keep].astype(int), run.val[keep]

    def residuals(theta):
        L0, A, alpha, C = theta
        return L0 + A * S1[vs] ** -alpha - C * S2[vs] - vl

    x0 = [max(vl.min() - 1.0, 0.0), 5.0, 0.5, 0.0]
    res = least_squares(residuals, x0, bounds=([0.0, 0.0, 0.01, 0.0], [vl.min(), np.inf, 3.0, np.inf]),
                        x_scale="jac", max_nfev=5000)
    return float(res.x[3]), float(res.x[2])


FRACTIONS = (0.10, 0.25, 0.50)
GOALS = {"10": 0.05, "25": 0.05, "50": 0.02}  # nats: the accuracy asked of the forecast at 25% and 50%


def fit_priors(runs: list[RunCurve], memories: tuple[float, ...] = (0.02, 0.1, 0.3), provenance: dict | None = None,
               use_probes: bool = True) -> Priors:
    """C and alpha from complete runs (their mean and spread), the memory the one whose Cs agree best,
    and the interval's scale calibrated so that 90% of these runs' own forecasts at 10/25/50% hold
    their final value (each forecast made with priors from the other runs, with their probes when
    they have them and `use_probes`)."""
    best = None
    for memory in memories:
        fits = [fit_complete(r, memory) for r in runs]
        Cs = np.array([c for c, _ in fits])
        alphas = np.array([a for _, a in fits])
        cv = float(np.std(Cs) / max(np.mean(Cs), 1e-12))
        if best is None or cv < best[0]:
            best = (cv, memory, Cs, alphas)
    _, memory, Cs, alphas = best
    base = Priors(C=float(np.mean(Cs)), C_sd=float(np.std(Cs)), memory=memory, alpha=float(np.mean(alphas)),
                  alpha_sd=float(max(np.std(alphas), 0.05)), interval_scale=1.0, provenance=provenance or {})
    # Calibration: standardized errors of leave-one-out forecasts at the checkpoints.
    z = []
    for i, run in enumerate(runs):
        others = leave_out(runs, i, memory, base.provenance, scale=1.0)
        for frac in FRACTIONS:
            f = forecast_at(run, others, frac, use_probes=use_probes)
            if f.ready and f.high > f.low:
                z.append(abs(f.value - run.final) / ((f.high - f.low) / 2))
    scale = float(np.quantile(z, 0.9)) if z else 1.0
    return Priors(**{**asdict(base), "interval_scale": max(scale, 1.0)})


def leave_out(runs: list[RunCurve], i: int, memory: float, provenance: dict, scale: float) -> Priors:
    fits = [fit_complete(r, memory) for j, r in enumerate(runs) if j != i]
    Cs = np.array([c for c, _ in fits])
    alphas = np.array([a for _, a in fits])
    return Priors(C=float(np.mean(Cs)), C_sd=float(np.std(Cs)), memory=memory, alpha=float(np.mean(alphas)),
                  alpha_sd=float(max(np.std(alphas), 0.05)), interval_scale=scale, provenance=provenance)


def forecast_at(run: RunCurve, priors: Priors, frac: float, ladder: LadderPrior | None = None,
                use_probes: bool = True) -> Forecast:
    step = int(round(run.schedule.total_steps * frac))
    return forecast(run.curve_until(step, use_probes), run.schedule, priors, step, ladder, use_probes)


def ladder_for(ladder: dict[str, Any], run: RunCurve) -> LadderPrior:
    """The ladder's prior for one run of a curves file: its own parameters and tokens."""
    if run.n_params is None or run.tokens_per_step is None:
        raise ForecastError(f"run {run.name}: no n_params / tokens_per_step in the curves file, which a ladder's "
                            "prediction needs (bench/forecast_curves.py writes both)")
    return prior_from_ladder(ladder, run.n_params, run.schedule.total_steps * run.tokens_per_step,
                             run.nonembedding_params, run.flops_per_token)


def evaluate(runs: list[RunCurve], multi_power: bool = True, use_probes: bool = True,
             ladder: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    """Leave-one-out: for each run, priors (and the interval's calibration) from the others, then its
    forecasts at 10/25/50% against its final val loss; beside them the plain power law and the
    multi-power law fitted on the same points. With `use_probes`, each forecast also fits the run's
    cooldown probes forked before it; with `ladder` (a ladder.json), the ladder's prediction for the
    run and its rungs' shape priors take the place of the other runs' (prior_from_ladder)."""
    rows = []
    mpl = [fit_multi_power(r)[3:] for r in runs] if multi_power else []
    for i, run in enumerate(runs):
        rest = runs[:i] + runs[i + 1:]
        prior = ladder_for(ladder, run) if ladder is not None else None
        priors = prior.priors if prior is not None else fit_priors(rest, use_probes=use_probes)
        decay = np.median([d for j, d in enumerate(mpl) if j != i], axis=0) if multi_power else None
        row: dict[str, Any] = {"run": run.name, "steps": run.schedule.total_steps,
                               "warmup": run.schedule.warmup_steps,
                               "floor": round(run.schedule.min_lr / run.schedule.lr, 3), "final": run.final,
                               "probes": len(run.probes) if use_probes else 0, "ladder": prior is not None}
        for frac in FRACTIONS:
            f = forecast_at(run, priors, frac, prior, use_probes)
            key = f"{int(frac * 100)}"
            row[key] = None if not f.ready else {"value": f.value, "low": f.low, "high": f.high,
                                                 "error": f.value - run.final, "hit": f.low <= run.final <= f.high}
            step = int(round(run.schedule.total_steps * frac))
            keep = (run.val_steps <= step) & (run.val_steps >= max(run.schedule.warmup_steps, 1))
            row[f"power_{key}"] = (fit_power(run.val_steps[keep], run.val[keep], run.schedule.total_steps) - run.final
                                   if keep.sum() >= 3 else None)
            if decay is not None:
                row[f"multi_power_{key}"] = None
                if keep.sum() >= 3:
                    p = fit_multi_power(run, step, decay)
                    row[f"multi_power_{key}"] = float(multi_power_loss(p, run.schedule, np.array([run.schedule.total_steps]))[0]) - run.final
        rows.append(row)
    return rows


def render_table(rows: list[dict[str, Any]]) -> str:
    head = ("| run | steps | warm-up | floor | final | " + " | ".join(f"{p}%: forecast [interval], error" for p in ("10", "25", "50"))
            + " | power law error 10/25/50% | multi-power error 10/25/50% |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        cells = []
        for p in ("10", "25", "50"):
            f = r[p]
            cells.append("not enough points" if f is None else
                         f"{f['value']:.3f} [{f['low']:.3f}, {f['high']:.3f}], {f['error']:+.3f} {'hit' if f['hit'] else 'MISS'}")
        power = "/".join("—" if r[f"power_{p}"] is None or not math.isfinite(r[f"power_{p}"]) else f"{r[f'power_{p}']:+.3f}"
                         for p in ("10", "25", "50"))
        multi = "/".join("—" if r.get(f"multi_power_{p}") is None or not math.isfinite(r[f"multi_power_{p}"])
                         else f"{r[f'multi_power_{p}']:+.3f}" for p in ("10", "25", "50"))
        lines.append(f"| {r['run']} | {r['steps']} | {r['warmup']} | {r['floor']:g} | {r['final']:.3f} | "
                     + " | ".join(cells) + f" | {power} | {multi} |")
    summary = []
    for p in ("10", "25", "50"):
        made = [r[p] for r in rows if r[p] is not None]
        if made:
            mae = float(np.mean([abs(f["error"]) for f in made]))
            hits = sum(f["hit"] for f in made)
            power = [abs(r[f"power_{p}"]) for r in rows if r[f"power_{p}"] is not None and math.isfinite(r[f"power_{p}"])]
            multi = [abs(r[f"multi_power_{p}"]) for r in rows
                     if r.get(f"multi_power_{p}") is not None and math.isfinite(r[f"multi_power_{p}"])]
            within = sum(abs(f["error"]) <= GOALS.get(p, np.inf) for f in made)
            summary.append(f"at {p}%: {len(made)} forecasts, mean |error| {mae:.3f} nats, max {max(abs(f['error']) for f in made):.3f}, "
                           f"{within}/{len(made)} within {GOALS.get(p, float('nan')):g}; the interval held the final value in "
                           f"{hits}/{len(made)}; plain power law mean |error| {np.mean(power) if power else float('nan'):.3f} "
                           f"({len(power)} fits); multi-power law (same protocol) {np.mean(multi) if multi else float('nan'):.3f} "
                           f"({len(multi)} fits)")
    return "\n".join(lines) + "\n\n" + "\n".join(f"- {s}" for s in summary)


def compare(runs: list[RunCurve], ladder: dict[str, Any] | None) -> tuple[str, dict[str, list[dict[str, Any]]]]:
    """The leave-one-out accuracy with and without the runs' probes (where they have any) and with and
    without the ladder (where one is given): each one's effect, on the same runs."""
    combos = [(probes, lad) for lad in ([None, ladder] if ladder is not None else [None])
              for probes in ([False, True] if any(r.probes for r in runs) else [False])]
    lines = ["| probes | ladder | " + " | ".join(f"{p}%: mean abs error, within goal, interval held" for p in ("10", "25", "50"))
             + " |", "|---|---|---|---|---|"]
    out: dict[str, list[dict[str, Any]]] = {}
    for probes, lad in combos:
        rows = evaluate(runs, multi_power=False, use_probes=probes, ladder=lad)
        out[f"probes={'yes' if probes else 'no'},ladder={'yes' if lad else 'no'}"] = rows
        cells = []
        for p in ("10", "25", "50"):
            made = [r[p] for r in rows if r[p] is not None]
            cells.append("no forecast" if not made else
                         f"{np.mean([abs(f['error']) for f in made]):.3f} ({len(made)} runs), "
                         f"{sum(abs(f['error']) <= GOALS[p] for f in made)}/{len(made)} within {GOALS[p]:g}, "
                         f"{sum(f['hit'] for f in made)}/{len(made)}")
        lines.append(f"| {'yes' if probes else 'no'} | {'yes' if lad else 'no'} | " + " | ".join(cells) + " |")
    return "\n".join(lines), out


def read_ladder(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        raise ForecastError(f"{path}: cannot be read as JSON ({e})") from None
    if not isinstance(data, dict):
        raise ForecastError(f"{path}: not a JSON object")
    return data


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m x1_pretrain.forecast", description="Fit the forecast's priors and measure its accuracy on complete runs' curves.")
    sub = p.add_subparsers(dest="cmd", required=True)
    ev = sub.add_parser("evaluate", help="leave-one-out accuracy at 10/25/50%% of each run")
    ev.add_argument("curves", type=Path, help="bench/forecast_curves.py's forecast_curves.json")
    ev.add_argument("--json", type=Path, help="also write the rows as JSON here")
    ev.add_argument("--without-probes", action="store_true",
                    help="leave the runs' cooldown probes out of their forecasts (bench/forecast_curves.py --probes)")
    ev.add_argument("--ladder", type=Path, metavar="LADDER.json",
                    help="with this ladder as prior: its prediction for each run (x1_common.scaling.predict at the "
                         "run's parameters and tokens) and its rungs' shape priors in place of the other runs'")
    ev.add_argument("--compare", action="store_true",
                    help="one summary row each with and without the probes and the ladder (no per-run table)")
    ev.add_argument("--no-multi-power", action="store_true", help="leave out the multi-power law's column (minutes)")
    ev.add_argument("--probe-areas", choices=PROBE_AREAS_CHOICES, default=PROBE_AREAS,
                    help=f"how a probe's end is placed on the law (default {PROBE_AREAS}; see PROBE_AREAS)")
    fp = sub.add_parser("fit-priors", help="the priors file from all the runs")
    fp.add_argument("curves", type=Path)
    fp.add_argument("--output", type=Path, required=True)
    args = p.parse_args(argv)
    if args.cmd == "evaluate":
        use_probe_areas(args.probe_areas)  # this process's evaluation only
    try:
        runs = load_curves(args.curves)
        if args.cmd == "evaluate":
            ladder = read_ladder(args.ladder) if args.ladder else None
            if ladder is not None:
                for run in runs:  # every run's prior is made before minutes of fitting: a bad ladder fails now
                    ladder_for(ladder, run)
            if args.compare:
                table, out = compare(runs, ladder)
                print(table)
                if args.json:
                    write_json_atomic(args.json, out)
                return 0
            rows = evaluate(runs, multi_power=not args.no_multi_power, use_probes=not args.without_probes,
                            ladder=ladder)
    except ForecastError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.cmd == "evaluate":
        print(render_table(rows))
        if args.json:
            write_json_atomic(args.json, rows)
        return 0
    meta = json.loads(args.curves.read_text())
    provenance = {"curves": str(args.curves), "made": meta.get("made"), "device": meta.get("device"),
                  "command": meta.get("command"), "runs": [r.name for r in runs], "model": meta.get("model"),
                  "tokens_per_step": meta.get("tokens_per_step"),
                  "how": "python -m x1_pretrain.forecast fit-priors " + str(args.curves)}
    priors = fit_priors(runs, provenance=provenance)
    tmp = args.output.with_name(f".{args.output.name}.tmp")
    tmp.write_text(priors.to_json())
    tmp.replace(args.output)
    print(priors.to_json(), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
