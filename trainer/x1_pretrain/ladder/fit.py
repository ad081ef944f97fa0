"""The fit: L(N, D) = E + A / N^alpha + B / D^beta over the rungs, as the Chinchilla replication did it.

Hoffmann et al. 2022's Approach 3, with what Besiroglu et al. 2024 found wrong in the original
corrected: the loss is a Huber loss (delta 1e-3) on log-loss, the law in log-sum-exp form

    log L = LSE(a - alpha log N, b - beta log D, e),   A = e^a, B = e^b, E = e^e

minimised with L-BFGS-B (SciPy) started from the best points of Hoffmann's grid of starts
(alpha, beta in {0, 0.5, ..., 2}; e in {-1, -0.5, ..., 1}; a, b in {0, 5, ..., 25}: 4,500 points,
each scored first, the best `STARTS` refined), run to convergence, and the parameters kept
unrounded. The interval is a bootstrap over rungs (each resample refitted, warm-started from the full
fit); the tolerance is measured by leaving the largest size out (x1_common.scaling says how it is used).

Which N: the fit is made twice, counting every parameter and counting those outside the
embedding; the one whose leave-largest-out check misses by less is kept, and ladder.json says
which and by how much each missed.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from scipy.optimize import minimize

from x1_common.scaling import (
    LADDER_FILE_VERSION,
    LAW_PARAMS,
    N_CONVENTIONS,
    N_NONEMBEDDING,
    N_TOTAL,
    Law,
    compute_of,
    predict,
)

HUBER_DELTA = 1e-3
STARTS = 16  # grid points refined by L-BFGS-B, the best by the objective
BOOTSTRAP_SAMPLES = 200
# The Huber values of log-losses are ~1e-5: L-BFGS-B's stopping rule is relative to max(|f|, 1),
# so the objective is divided by delta^2 to put it near 1 (the minimum does not move).
_SCALE = 1.0 / HUBER_DELTA**2
N_FIT_PARAMS = len(LAW_PARAMS)
MIN_CHECK_REACH = 0.1  # log10 of compute: a check that reached less is counted as having reached this far

_GRID = np.array(np.meshgrid(
    np.arange(0, 30, 5.0),  # a = log A
    np.arange(0, 30, 5.0),  # b = log B
    np.arange(-1, 1.5, 0.5),  # e = log E
    np.arange(0, 2.5, 0.5),  # alpha
    np.arange(0, 2.5, 0.5),  # beta
    indexing="ij")).reshape(5, -1).T
_BOUNDS = [(-10.0, 60.0), (-10.0, 60.0), (-5.0, 5.0), (0.0, 4.0), (0.0, 4.0)]


class RungsError(ValueError):
    """Rungs that cannot be fitted; the message names the entry and the problem (exit 2)."""


@dataclass(frozen=True)
class Point:
    """One rung as the fit sees it."""

    index: int  # its place in rungs.json
    n_params: float
    n_nonembedding: float | None
    tokens: float
    loss: float
    flops_per_token: float | None

    def n(self, convention: str) -> float:
        return self.n_params if convention == N_TOTAL else float(self.n_nonembedding)  # type: ignore[arg-type]

    @property
    def compute(self) -> float:
        return compute_of(self.n_params, self.tokens, self.flops_per_token)


# ---------------------------------------------------------------------------------------------
# Reading rungs


def _positive(entry: Mapping[str, Any], key: str, where: str, required: bool = True) -> float | None:
    v = entry.get(key)
    if v is None and not required:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise RungsError(f"{where}: {key}: {'missing' if v is None else f'{v!r} is not a number'}")
    if not math.isfinite(v) or v <= 0:
        raise RungsError(f"{where}: {key}: {v} is not a positive finite number")
    return float(v)


def read_points(rungs: Any, source: str = "rungs.json") -> tuple[list[Point], list[str]]:
    """The fit's points, and the rungs left out (diverged), named. RungsError for a bad entry."""
    if not isinstance(rungs, list):
        raise RungsError(f"{source}: not a list of rungs")
    points, left_out = [], []
    for i, r in enumerate(rungs):
        where = f"{source}: rung {i}" + (f" ({r['name']})" if isinstance(r, Mapping) and isinstance(r.get("name"), str) else "")
        if not isinstance(r, Mapping):
            raise RungsError(f"{where}: not an object")
        if r.get("diverged") is True:
            left_out.append(where.split(": ", 1)[1] + ": diverged, left out of the fit")
            continue
        n = _positive(r, "n_params", where)
        d = _positive(r, "tokens", where)
        loss = _positive(r, "final_val_loss", where)
        ne = _positive(r, "n_params_nonembedding", where, required=False)
        fpt = _positive(r, "flops_per_token", where, required=False)
        points.append(Point(i, n, ne, d, loss, fpt))  # type: ignore[arg-type]
    return points, left_out


def check_enough(points: Sequence[Point], what: str = "the fit") -> None:
    sizes = {p.n_params for p in points}
    budgets = {p.tokens for p in points}
    if len(sizes) < 2 or len(budgets) < 2 or len(points) < N_FIT_PARAMS + 2:
        raise RungsError(f"{what}: too few rungs: {len(points)} usable of {len(sizes)} size(s) and {len(budgets)} token "
                         f"budget(s); the law has {N_FIT_PARAMS} parameters and needs at least 2 sizes, 2 budgets and "
                         f"{N_FIT_PARAMS + 2} rungs")


def conventions_available(points: Sequence[Point]) -> list[str]:
    """Both conventions where every rung knows its non-embedding count, else every parameter."""
    return list(N_CONVENTIONS) if all(p.n_nonembedding is not None for p in points) else [N_TOTAL]


# ---------------------------------------------------------------------------------------------
# The objective and one fit


def _arrays(points: Sequence[Point], convention: str) -> tuple[list[float], list[float], list[float]]:
    return ([math.log(p.n(convention)) for p in points], [math.log(p.tokens) for p in points],
            [math.log(p.loss) for p in points])


def _huber(r: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    a = np.abs(r)
    quad = a <= HUBER_DELTA
    value = np.where(quad, 0.5 * r * r, HUBER_DELTA * (a - 0.5 * HUBER_DELTA))
    slope = np.where(quad, r, HUBER_DELTA * np.sign(r))
    return value, slope


def _objective(x: np.ndarray, ln_n: list[float], ln_d: list[float], ln_l: list[float],
               weights: list[float]) -> tuple[float, np.ndarray]:
    """The Huber objective and its gradient. Plain floats: with tens of points NumPy's per-call
    overhead would cost ten times the arithmetic, and a fit evaluates this ~10^5 times."""
    a, b, e, alpha, beta = (float(v) for v in x)
    f = ga = gb = ge = galpha = gbeta = 0.0
    exp, log = math.exp, math.log
    for n, d, ll, w in zip(ln_n, ln_d, ln_l, weights, strict=True):
        if not w:
            continue
        t1, t2 = a - alpha * n, b - beta * d
        m = max(t1, t2, e)
        x1, x2, x3 = exp(t1 - m), exp(t2 - m), exp(e - m)
        s = x1 + x2 + x3
        r = m + log(s) - ll
        if -HUBER_DELTA <= r <= HUBER_DELTA:
            f += w * 0.5 * r * r
            slope = w * r
        else:
            f += w * HUBER_DELTA * (abs(r) - 0.5 * HUBER_DELTA)
            slope = w * (HUBER_DELTA if r > 0 else -HUBER_DELTA)
        w1, w2, w3 = slope * x1 / s, slope * x2 / s, slope * x3 / s
        ga += w1
        gb += w2
        ge += w3
        galpha -= w1 * n
        gbeta -= w2 * d
    return f * _SCALE, np.array([ga, gb, ge, galpha, gbeta]) * _SCALE


def _grid_scores(ln_n: Sequence[float], ln_d: Sequence[float], ln_l: Sequence[float],
                 weights: Sequence[float]) -> np.ndarray:
    g = _GRID
    ln_n, ln_d, ln_l, weights = (np.asarray(v, dtype=float) for v in (ln_n, ln_d, ln_l, weights))
    t1 = g[:, 0:1] - g[:, 3:4] * ln_n[None, :]
    t2 = g[:, 1:2] - g[:, 4:5] * ln_d[None, :]
    t3 = np.broadcast_to(g[:, 2:3], t1.shape)
    lse = np.logaddexp(np.logaddexp(t1, t2), t3)
    value, _ = _huber(lse - ln_l[None, :])
    return (value * weights[None, :]).sum(axis=1)


def _refine(x0: np.ndarray, args: tuple) -> tuple[np.ndarray, float]:
    res = minimize(_objective, x0, args=args, jac=True, method="L-BFGS-B", bounds=_BOUNDS,
                   options={"maxiter": 5000, "ftol": 1e-12, "gtol": 1e-9})
    return res.x, float(res.fun) / _SCALE


def fit_points(points: Sequence[Point], convention: str, weights: np.ndarray | None = None,
               warm: Iterable[np.ndarray] = ()) -> tuple[np.ndarray, float]:
    """The best (a, b, e, alpha, beta) and its objective. `warm`: starts tried before the grid's
    (a bootstrap refit starts from the full fit); with warm starts the grid is not used."""
    ln_n, ln_d, ln_l = _arrays(points, convention)
    w = [1.0] * len(points) if weights is None else [float(v) for v in weights]
    args = (ln_n, ln_d, ln_l, w)
    warm = list(warm)
    k = 0 if warm else STARTS
    starts = warm + ([_GRID[i] for i in np.argsort(_grid_scores(*args))[:k]] if k else [])
    best_x, best_f = None, math.inf
    for x0 in starts:
        x, f = _refine(np.asarray(x0, dtype=float), args)
        if f < best_f:
            best_x, best_f = x, f
    return best_x, best_f  # type: ignore[return-value]


def law_from(x: np.ndarray) -> Law:
    a, b, e, alpha, beta = (float(v) for v in x)
    return Law(E=math.exp(e), A=math.exp(a), B=math.exp(b), alpha=alpha, beta=beta)


# ---------------------------------------------------------------------------------------------
# The held-out check, the bootstrap, the whole ladder


@dataclass(frozen=True)
class Check:
    convention: str
    heldout_n_params: float
    errors: list[dict[str, float]]  # per held-out rung: tokens, actual, predicted, error
    max_abs_error: float
    reach: float  # log10(compute of the held-out size's largest rung / the rest's largest)


def leave_largest_out(points: Sequence[Point], convention: str) -> Check:
    largest = max(p.n_params for p in points)
    rest = [p for p in points if p.n_params != largest]
    held = [p for p in points if p.n_params == largest]
    check_enough(rest, f"the tolerance check (the fit without the largest size, {largest:.4g} parameters)")
    law = law_from(fit_points(rest, convention)[0])
    errors = []
    for p in held:
        pred = law.loss(p.n(convention), p.tokens)
        errors.append({"index": p.index, "n_params": p.n_params, "tokens": p.tokens, "actual": p.loss,
                       "predicted": pred, "error": pred - p.loss})
    reach = math.log10(max(p.compute for p in held) / max(p.compute for p in rest))
    return Check(convention, largest, errors, max(abs(e["error"]) for e in errors), max(reach, MIN_CHECK_REACH))


def bootstrap(points: Sequence[Point], convention: str, best: np.ndarray, samples: int, seed: int) -> list[list[float]]:
    """Parameter samples (E, A, B, alpha, beta) from refits on rungs drawn with replacement."""
    rng = np.random.default_rng(seed)
    out: list[list[float]] = []
    tries = 0
    while len(out) < samples and tries < samples * 5:
        tries += 1
        counts = np.bincount(rng.integers(0, len(points), len(points)), minlength=len(points)).astype(float)
        chosen = [p for p, c in zip(points, counts, strict=True) if c > 0]
        if len({p.n_params for p in chosen}) < 2 or len({p.tokens for p in chosen}) < 2:
            continue
        x, _ = fit_points(points, convention, weights=counts, warm=[best])
        law = law_from(x)
        out.append([law.E, law.A, law.B, law.alpha, law.beta])
    return out


def corpus_hash(meta_bytes: bytes) -> str:
    return hashlib.sha256(meta_bytes).hexdigest()


SIZE_SPREAD_NATS = 0.05  # sizes this close at one budget: the rungs show no size at all
SIZE_RANGE = 4.0  # ... over at least this ratio of parameters


def regime_notes(points: Sequence[Point], convention: str, law: Law) -> list[str]:
    """What says the rungs are not where the law holds (measured on the GPU, docs/SCALING.md: both
    ladders that showed these missed their targets by 0.6-1.1 nats): at one token budget shared by
    3+ sizes spanning SIZE_RANGE x in N, final losses within SIZE_SPREAD_NATS of each other (the
    rungs are in training's first, fast part, where loss follows steps, not size); or an exponent
    of 1 or more (the fit bending to that part)."""
    notes = []
    by_budget: dict[float, list[Point]] = {}
    for p in points:
        key = next((k for k in by_budget if abs(p.tokens / k - 1) < 0.05), p.tokens)
        by_budget.setdefault(key, []).append(p)
    shared = [(d, ps) for d, ps in by_budget.items()
              if len({p.n(convention) for p in ps}) >= 3
              and max(p.n(convention) for p in ps) >= SIZE_RANGE * min(p.n(convention) for p in ps)]
    if shared:
        d, ps = max(shared, key=lambda x: x[0])
        spread = max(p.loss for p in ps) - min(p.loss for p in ps)
        if spread < SIZE_SPREAD_NATS:
            notes.append(f"at {d:,.0f} tokens the {len(ps)} sizes ended within {spread:.3f} nats of each other: size "
                         "does not show at these budgets, the rungs are still in training's first, fast part, and a "
                         "prediction beyond them is not to be trusted (longer rungs: a larger --share)")
    steep = [f"{k} {getattr(law, k):.2f}" for k in ("alpha", "beta") if getattr(law, k) >= 1.0]
    if steep:
        notes.append(f"the fitted {' and '.join(steep)}: an exponent of 1 or more is the fit bending to the rungs' "
                     "first, fast part of training, not a property of the model family")
    return notes


def make_ladder(rungs: list[dict[str, Any]], *, source: str = "rungs.json", target: Mapping[str, float] | None = None,
                provenance: Mapping[str, Any] | None = None, samples: int = BOOTSTRAP_SAMPLES, seed: int = 0,
                left_out_extra: Sequence[str] = ()) -> dict[str, Any]:
    """ladder.json's content from the rungs (RungsError for rungs that cannot be fitted)."""
    points, left_out = read_points(rungs, source)
    check_enough(points)
    notes: list[str] = []
    conventions = conventions_available(points)
    if N_NONEMBEDDING not in conventions:
        notes.append("the rungs give no non-embedding parameter counts: N counts every parameter")
    checks = {c: leave_largest_out(points, c) for c in conventions}
    convention = min(conventions, key=lambda c: checks[c].max_abs_error)
    best, objective = fit_points(points, convention)
    law = law_from(best)
    check = checks[convention]
    notes += regime_notes(points, convention, law)
    largest_compute = max(p.compute for p in points)
    ladder: dict[str, Any] = {
        "version": LADDER_FILE_VERSION,
        "law": "L(N, D) = E + A / N^alpha + B / D^beta",
        "rungs": rungs,
        "left_out": [*left_out, *left_out_extra],
        "fit": {**law.as_dict(), "n_convention": convention, "objective": objective, "points": len(points),
                "method": f"Huber (delta {HUBER_DELTA}) on log-loss, L-BFGS-B from the {STARTS} best of a "
                          f"{len(_GRID)}-point grid of starts"},
        "conventions": {c: {"heldout_max_abs_error": checks[c].max_abs_error,
                            "heldout_n_params": checks[c].heldout_n_params} for c in conventions},
        "heldout_check": {"convention": convention, "heldout_n_params": check.heldout_n_params,
                          "errors": check.errors, "max_abs_error": check.max_abs_error, "reach": check.reach},
        "tolerance": {"heldout_error": check.max_abs_error, "check_reach": check.reach,
                      "largest_rung_compute": largest_compute,
                      "rule": "the held-out check's largest |error| x max(1, the target's log10 compute beyond the "
                              "largest rung / the check's)"},
        "bootstrap": {"samples": [], "resampled": "rungs, with replacement", "seed": seed},
        "provenance": dict(provenance) if provenance else {"provenance": "unknown"},
        "notes": notes,
    }
    ladder["bootstrap"]["samples"] = bootstrap(points, convention, best, samples, seed)
    if target is not None:
        p = predict(ladder, target["n_params"], target["tokens"], target.get("n_params_nonembedding"),
                    target.get("flops_per_token"))
        ladder["prediction"] = {k: v for k, v in p.as_dict().items()}
        if target.get("repeats_data"):
            ladder["prediction"]["note"] = str(target["repeats_data"])
    else:
        ladder["prediction"] = None
    return ladder
