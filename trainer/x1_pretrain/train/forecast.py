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

Its priors and its accuracy table are made from complete runs' curves, and the ladder's prior from
a ladder.json, in x1_pretrain.train.forecast_calibration (`python -m x1_pretrain.forecast`).
"""

from __future__ import annotations

import functools
import json
import logging
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from x1_common.contracts import MLFLOW_FORECAST_METRICS, ExitCode
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
FRACTIONS = (0.10, 0.25, 0.50)  # of the run: where the dod line and the accuracy table compare a forecast
Z90 = 1.6449  # the interval is a nominal 90% one before calibration
NOISE = 0.01  # nats: a loss point's typical scatter, which weighs the alpha prior against the points


class ForecastError(ValueError):
    """A priors or curves file that cannot be used: the message names the file and the field."""


def read_json_object(path: Path) -> dict[str, Any]:
    """A JSON file that must hold one object (priors, a ladder); ForecastError names what is wrong."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        raise ForecastError(f"{path}: cannot be read as JSON ({e})") from None
    if not isinstance(data, dict):
        raise ForecastError(f"{path}: not a JSON object")
    return data


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
        data = read_json_object(path)
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
    ladder: bool = False  # combined with a prior's prediction (LadderPrior: the ladder's, or earlier runs')
    prior_name: str = "ladder prior"  # which, in the line's words

    @property
    def ready(self) -> bool:
        return self.value is not None

    def sources(self) -> str:
        """What the forecast used besides its own curve: its probes, and the ladder or its absence."""
        probes = f" + {self.probe_points} probe{'s' if self.probe_points > 1 else ''}" if self.probe_points else ""
        return f"{probes}, law {self.law}, {self.prior_name if self.ladder else 'no ladder'}"

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
                    val_points=len(p.vs), train_points=len(p.ts), probe_points=len(p.probes), ladder=ladder is not None,
                    prior_name=ladder.name if ladder is not None else "")


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
    name: str = "ladder prior"  # what the forecast line calls it

    def combine(self, value: float, half: float) -> tuple[float, float]:
        """The run's own forecast (value, 90% half-width) and the ladder's, weighted by the inverse of
        their variances: (value, half-width) of the combination."""
        own_var = (half / Z90) ** 2
        if own_var <= 0 or not math.isfinite(own_var):
            return value, half
        w_own, w_ladder = 1.0 / own_var, 1.0 / self.sd ** 2
        mean = (w_own * value + w_ladder * self.mean) / (w_own + w_ladder)
        return mean, Z90 / math.sqrt(w_own + w_ladder)



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
