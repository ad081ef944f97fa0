"""The forecast measured and its priors made: the ladder's prior for a run (prior_from_ladder), the
laws it is compared with, and, from complete runs' curves (bench/forecast_curves.py's JSON), the
shape priors (fit_priors) and the leave-one-out accuracy table (evaluate). The forecast itself, what
the trainer runs at every eval, is x1_pretrain.train.forecast.

    python -m x1_pretrain.forecast evaluate CURVES.json     # leave-one-out accuracy table
    python -m x1_pretrain.forecast evaluate CURVES.json --compare --ladder LADDER.json
    python -m x1_pretrain.forecast evaluate CURVES.json --compare --earlier-runs EARLIER.json
    python -m x1_pretrain.forecast fit-priors CURVES.json --output forecast_priors.json
"""

from __future__ import annotations

import argparse
import csv
import functools
import json
import math
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from x1_common import scaling
from x1_common.fsutil import write_json_atomic
from x1_pretrain.config import ModelConfig
from x1_pretrain.train.forecast import (
    FRACTIONS,
    PROBE_AREAS,
    PROBE_AREAS_CHOICES,
    Z90,
    Curve,
    Forecast,
    ForecastError,
    LadderPrior,
    Priors,
    Schedule,
    areas,
    forecast,
    read_json_object,
    use_probe_areas,
)
from x1_pretrain.train.forecast_rule import ACCURACY_GOAL, MIN_POINTS, TRAIN_BINS
from x1_pretrain.train.provenance import same_corpus

# ---------------------------------------------------------------------------------------------
# The ladder as prior: its prediction for this run, and shape priors fitted on its complete rungs

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
    if isinstance(ladder.get("fit"), dict):
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
# The laws compared with it (docs/FORECAST.md), fitted with every parameter live


def fit_power(steps: np.ndarray, losses: np.ndarray, total: int) -> float:
    """E + A t^-alpha, every parameter fitted: the schedule-blind extrapolation."""
    from scipy.optimize import curve_fit  # here: SciPy is 0.6 s of every trainer's start
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
    from scipy.optimize import least_squares  # here: SciPy is 0.6 s of every trainer's start
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
    _, _, alpha, C = fit_family_law([run], memory, C0=0.0)
    return float(C), float(alpha)


def fit_priors(runs: list[RunCurve], memories: tuple[float, ...] = (0.02, 0.1, 0.3), provenance: dict | None = None,
               use_probes: bool = True) -> Priors:
    """C and alpha from complete runs (their mean and spread), the memory the one whose Cs agree best,
    and the interval's scale calibrated so that 90% of these runs' own forecasts at 10/25/50% hold
    their final value (each forecast made with priors from the other runs, with their probes when
    they have them and `use_probes`)."""
    if len(runs) < 2:
        raise ForecastError(f"{len(runs)} complete run(s): priors and their calibration need 2 at least")
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


# ---------------------------------------------------------------------------------------------
# Earlier complete runs of the run's own family as prior: the prior a ladder would give if it were as
# accurate as runs of the same model, data, tokens per step and peak lr. Their val points, each at its
# own schedule's areas, share one law L0 + A S1^-alpha - C S2 (the law is a function of the schedule's
# areas alone: that is what makes one fit serve runs of any length and warm-up); its value at this
# run's last step is the prediction, and its spread the error of each earlier run predicted from the
# others (leave-one-out).


def _family_points(runs: list[RunCurve], memory: float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    s1, s2, y = [], [], []
    for run in runs:
        S1, S2 = areas(run.schedule, memory)
        keep = run.val_steps >= max(run.schedule.warmup_steps, 1)
        steps = run.val_steps[keep].astype(int)
        s1.append(S1[steps])
        s2.append(S2[steps])
        y.append(run.val[keep])
    return np.concatenate(s1), np.concatenate(s2), np.concatenate(y)


def fit_family_law(runs: list[RunCurve], memory: float, C0: float = 0.5) -> np.ndarray:
    """(L0, A, alpha, C) of one law through every complete run's val points past its warm-up (of
    one run: fit_complete), the fit started from C = C0."""
    from scipy.optimize import least_squares  # here: SciPy is 0.6 s of every trainer's start
    s1, s2, y = _family_points(runs, memory)

    def residuals(theta):
        L0, A, alpha, C = theta
        return L0 + A * s1 ** -alpha - C * s2 - y

    res = least_squares(residuals, [max(y.min() - 1.0, 0.0), 5.0, 0.5, C0],
                        bounds=([0.0, 0.0, 0.01, 0.0], [y.min(), np.inf, 3.0, np.inf]), x_scale="jac", max_nfev=5000)
    return res.x


def family_prediction(theta: np.ndarray, schedule: Schedule, memory: float) -> float:
    """The family law's val loss at the last step of a run with this schedule."""
    S1, S2 = areas(schedule, memory)
    L0, A, alpha, C = theta
    T = schedule.total_steps
    return float(L0 + A * S1[T] ** -alpha - C * S2[T])


def _same_family(ref: RunCurve, run: RunCurve) -> str:
    """What differs between an earlier run and this one (empty: the same family)."""
    for what, a, b in (("n_params", ref.n_params, run.n_params), ("tokens_per_step", ref.tokens_per_step, run.tokens_per_step),
                       ("peak lr", ref.schedule.lr, run.schedule.lr)):
        if a is None or b is None or not math.isclose(a, b, rel_tol=0.01):
            return f"{what} {a} against this run's {b}"
    return ""


def prior_from_runs(refs: list[RunCurve], run: RunCurve, use_probes: bool = True) -> LadderPrior:
    """The forecast's prior from earlier complete runs of the run's family (the run itself, by name,
    never among them): the family law's prediction for this run's schedule, with the leave-one-out
    spread as its sd, and the shape priors fit_priors makes from the same runs. ForecastError names a
    run of another family, or too few."""
    refs = [r for r in refs if r.name != run.name]
    check_family(refs, run)
    priors = fit_priors(refs, use_probes=use_probes, provenance={"earlier runs": [r.name for r in refs]})
    misses = [family_prediction(fit_family_law(refs[:j] + refs[j + 1:], priors.memory), r.schedule, priors.memory)
              - r.final for j, r in enumerate(refs)]
    sd = max(float(np.sqrt(np.mean(np.square(misses)))), 0.01)
    mean = family_prediction(fit_family_law(refs, priors.memory), run.schedule, priors.memory)
    return LadderPrior(mean=mean, sd=sd, priors=priors, source=f"the law of {len(refs)} earlier complete runs of this family",
                       name=f"prior of {len(refs)} earlier runs")


def check_family(refs: list[RunCurve], run: RunCurve) -> None:
    """ForecastError unless there are two earlier runs or more, each of the run's family."""
    for r in refs:
        if differs := _same_family(r, run):
            raise ForecastError(f"earlier run {r.name} is not of {run.name}'s family: {differs}")
    if len(refs) < 2:
        raise ForecastError(f"{run.name}: {len(refs)} earlier complete run(s) of its family; 2 needed for a "
                            "prior and its spread")


def earlier_run(folder: Path, model: ModelConfig, corpus: dict[str, Any], n_params: float) -> RunCurve:
    """A finished run's folder (--run-dir: its manifest.json and metrics.csv) as a complete curve of
    val points, checked to be of this run's model and corpus; ForecastError names what differs."""
    manifest = read_json_object(folder / "manifest.json")
    config = manifest.get("config") if isinstance(manifest.get("config"), dict) else {}
    theirs = config.get("model") if isinstance(config.get("model"), dict) else {}
    # Compared as the trainer logs them (str of each value): a manifest's config may be MLflow's
    # params, strings, where the checkpoint that held it typed is gone.
    ours = {k: str(v) for k, v in model.model_dump().items()}
    theirs = {k: str(v) for k, v in theirs.items()}
    if differs := sorted(k for k in {*ours, *theirs} if ours.get(k) != theirs.get(k)):
        raise ForecastError(f"{folder}: another model (model.{differs[0]} {theirs.get(differs[0])} against this "
                            f"run's {ours.get(differs[0])})")
    if not same_corpus(manifest.get("corpus_fingerprint"), corpus):
        raise ForecastError(f"{folder}: trained on another corpus (fingerprint {manifest.get('corpus_fingerprint')}, "
                            f"this run's {corpus['fingerprint']})")
    try:
        train, optim = config["train"], config["optim"]
        schedule = Schedule(lr=float(optim["lr"]), min_lr=float(optim["min_lr"]), warmup_steps=int(optim["warmup_steps"]),
                            total_steps=int(train["total_steps"]))
        tokens_per_step = int(train["tokens_per_step"])
    except (KeyError, TypeError, ValueError) as e:
        raise ForecastError(f"{folder}/manifest.json: no usable config.train / config.optim ({e})") from None
    try:
        with open(folder / "metrics.csv", newline="") as f:
            val = sorted((int(r["step"]), float(r["value"])) for r in csv.DictReader(f) if r["name"] == "val_loss")
    except (OSError, KeyError, ValueError) as e:
        raise ForecastError(f"{folder}/metrics.csv: cannot be read ({type(e).__name__}: {e})") from None
    val = [(s, v) for s, v in dict(val).items() if math.isfinite(v)]
    if not val or val[-1][0] != schedule.total_steps:
        last = val[-1][0] if val else "none"
        raise ForecastError(f"{folder}: not a complete run (its last eval is at step {last} of {schedule.total_steps})")
    return RunCurve(str(folder), schedule, np.zeros(0), np.array([s for s, _ in val], dtype=float),
                    np.array([v for _, v in val]), n_params=n_params, tokens_per_step=tokens_per_step)


def evaluate(runs: list[RunCurve], multi_power: bool = True, use_probes: bool = True,
             ladder: dict[str, Any] | None = None, earlier: list[RunCurve] | None = None) -> list[dict[str, Any]]:
    """Leave-one-out: for each run, priors (and the interval's calibration) from the others, then its
    forecasts at 10/25/50% against its final val loss; beside them the plain power law and the
    multi-power law fitted on the same points. With `use_probes`, each forecast also fits the run's
    cooldown probes forked before it; with `ladder` (a ladder.json), the ladder's prediction for the
    run and its rungs' shape priors take the place of the other runs' (prior_from_ladder); with
    `earlier` (complete runs of the family), their law's (prior_from_runs)."""
    rows = []
    mpl = [fit_multi_power(r)[3:] for r in runs] if multi_power else []
    for i, run in enumerate(runs):
        rest = runs[:i] + runs[i + 1:]
        prior = (ladder_for(ladder, run) if ladder is not None else
                 prior_from_runs(earlier, run, use_probes) if earlier is not None else None)
        priors = prior.priors if prior is not None else fit_priors(rest, use_probes=use_probes)
        decay = np.median([d for j, d in enumerate(mpl) if j != i], axis=0) if multi_power else None
        row: dict[str, Any] = {"run": run.name, "steps": run.schedule.total_steps,
                               "warmup": run.schedule.warmup_steps,
                               "floor": round(run.schedule.min_lr / run.schedule.lr, 3), "final": run.final,
                               "probes": len(run.probes) if use_probes else 0, "ladder": prior is not None,
                               "prior": "ladder" if ladder is not None else "earlier runs" if earlier is not None else "none"}
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
            within = sum(abs(f["error"]) <= ACCURACY_GOAL.get(p, np.inf) for f in made)
            summary.append(f"at {p}%: {len(made)} forecasts, mean |error| {mae:.3f} nats, max {max(abs(f['error']) for f in made):.3f}, "
                           f"{within}/{len(made)} within {ACCURACY_GOAL.get(p, float('nan')):g}; the interval held the final value in "
                           f"{hits}/{len(made)}; plain power law mean |error| {np.mean(power) if power else float('nan'):.3f} "
                           f"({len(power)} fits); multi-power law (same protocol) {np.mean(multi) if multi else float('nan'):.3f} "
                           f"({len(multi)} fits)")
    return "\n".join(lines) + "\n\n" + "\n".join(f"- {s}" for s in summary)


def compare(runs: list[RunCurve], ladder: dict[str, Any] | None,
            earlier: list[RunCurve] | None = None) -> tuple[str, dict[str, list[dict[str, Any]]]]:
    """The leave-one-out accuracy with and without the runs' probes (where they have any) and with and
    without the ladder (where one is given), and with earlier complete runs of the family as prior
    (where given): each one's effect, on the same runs."""
    priors = [("no", {}), *([("yes", {"ladder": ladder})] if ladder is not None else []),
              *([("earlier runs", {"earlier": earlier})] if earlier is not None else [])]
    combos = [(probes, name, given) for name, given in priors
              for probes in ([False, True] if any(r.probes for r in runs) else [False])]
    lines = ["| probes | ladder | " + " | ".join(f"{p}%: mean abs error, within goal, interval held" for p in ("10", "25", "50"))
             + " |", "|---|---|---|---|---|"]
    out: dict[str, list[dict[str, Any]]] = {}
    for probes, lad, given in combos:
        rows = evaluate(runs, multi_power=False, use_probes=probes, **given)
        out[f"probes={'yes' if probes else 'no'},ladder={lad}"] = rows
        cells = []
        for p in ("10", "25", "50"):
            made = [r[p] for r in rows if r[p] is not None]
            cells.append("no forecast" if not made else
                         f"{np.mean([abs(f['error']) for f in made]):.3f} ({len(made)} runs), "
                         f"{sum(abs(f['error']) <= ACCURACY_GOAL[p] for f in made)}/{len(made)} within {ACCURACY_GOAL[p]:g}, "
                         f"{sum(f['hit'] for f in made)}/{len(made)}")
        lines.append(f"| {'yes' if probes else 'no'} | {lad} | " + " | ".join(cells) + " |")
    return "\n".join(lines), out


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
    ev.add_argument("--earlier-runs", type=Path, metavar="CURVES.json",
                    help="earlier complete runs of the same family (model, tokens per step, peak lr) as each run's "
                         "prior: their one law's prediction and its leave-one-out spread. It may be CURVES itself (the "
                         "runs --runs chose): a run is never among its own earlier runs (by name)")
    ev.add_argument("--runs", metavar="NAMES", help="only these runs of CURVES (comma-separated names), e.g. to leave "
                    "out a run's twin")
    ev.add_argument("--compare", action="store_true",
                    help="one summary row each with and without the probes, the ladder and the earlier runs "
                         "(no per-run table)")
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
        if args.cmd == "evaluate" and args.runs:
            names = args.runs.split(",")
            if unknown := sorted(set(names) - {r.name for r in runs}):
                raise ForecastError(f"--runs: {', '.join(unknown)} not in {args.curves}")
            runs = [r for r in runs if r.name in names]
        if args.cmd == "evaluate":
            ladder = read_json_object(args.ladder) if args.ladder else None
            earlier = load_curves(args.earlier_runs) if args.earlier_runs else None
            if earlier is not None and args.earlier_runs.resolve() == args.curves.resolve():
                earlier = runs  # CURVES itself: the same runs (--runs), each never its own earlier run
            if ladder is not None:
                for run in runs:  # every run's prior is made before minutes of fitting: a bad ladder fails now
                    ladder_for(ladder, run)
            if (args.compare or (ladder is None and earlier is None)) and len(runs) < 3:
                raise ForecastError(f"{len(runs)} runs: leave-one-out needs 3 at least (each run's priors from the "
                                    "others, and their interval's calibration from those others' own)")
            if ladder is not None and earlier is not None and not args.compare:
                raise ForecastError("--ladder and --earlier-runs are two priors: give one, or both with --compare")
            for run in runs if earlier is not None else ():  # likewise a run of another family, or too few
                check_family([r for r in earlier if r.name != run.name], run)
            if args.compare:
                table, out = compare(runs, ladder, earlier)
                print(table)
                if args.json:
                    write_json_atomic(args.json, out)
                return 0
            rows = evaluate(runs, multi_power=not args.no_multi_power, use_probes=not args.without_probes,
                            ladder=ladder, earlier=earlier)
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
    try:
        priors = fit_priors(runs, provenance=provenance)
    except ForecastError as e:
        print(f"error: {args.curves}: {e}", file=sys.stderr)
        return 2
    write_json_atomic(args.output, json.loads(priors.to_json()))
    print(priors.to_json(), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
