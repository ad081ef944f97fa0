"""The scaling law a ladder measured, as its readers need it: `plan`, the trainer, `dod`, the forecast.

    ladder = load_ladder("/workspace/ladder/ladder.json")
    p = predict(ladder, n_params=88.9e6, tokens=22.9e9, nonembedding_params=50.3e6)
    p.val_loss, p.low, p.high          # the law's value and the declared interval around it

The law is Chinchilla's form, L(N, D) = E + A / N^alpha + B / D^beta (Hoffmann et al. 2022), fitted
by `python -m x1_pretrain.ladder fit` on the run's own small runs (the rungs). Evaluating it is
closed-form, and the interval comes from parameter samples the fit keeps in the file (a bootstrap
over rungs), so this module needs the standard library alone: `x1 plan` on a laptop reads it
without NumPy or SciPy.

The interval a ladder declares is two things added together:
- the bootstrap's 5-95% range of the law's value at the target (how much the rungs' noise moves it);
- the **tolerance**: the fit refitted without its largest size predicts that size's rungs; the
  largest absolute error of that check, scaled up by how much farther the target lies beyond the
  largest rung (in compute, on a log scale) than the check reached, never narrower. Extrapolating
  twice as far as the check did may miss by twice as much; it is not allowed to miss by less.

A ladder speaks only for the run it was made for: the same corpus (its meta.json's fingerprint), tokenizer,
vocabulary, context and model family. `provenance_differences` names what differs.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

from x1_common.contracts import read_json_file

LADDER_FILE_VERSION = 1
LAW_PARAMS = ("E", "A", "B", "alpha", "beta")
# Which N the law counts: every parameter (Hoffmann's convention, the embedding included), or those
# outside the embedding (Kaplan's). With GPT-2's 50,257-token vocabulary the tied embedding is most
# of a small model, so the two disagree most on small rungs; `fit` keeps the one that predicts
# held-out rungs better and says which.
N_TOTAL = "total"
N_NONEMBEDDING = "non-embedding"
N_CONVENTIONS = (N_TOTAL, N_NONEMBEDDING)

# The lab's band for the final val loss of the 50M run (the definition of done's check 2 when no
# ladder and no --band declared another). It fits ~5B tokens; what the run's money buys may land
# below it: a measured ladder says where.
LAB_BAND = (3.20, 3.50)
BAND_SOURCES = ("ladder", "flag", "lab")
# A band wider than twice the lab's (0.60 nats) can hardly fail a run: a ladder whose rungs were too
# short to show the law declares one honestly (its tolerance grows with the distance to the target),
# and the run is then told so where the band is shown (the band line, plan, dod's check 2).
WIDE_BAND_NATS = 2 * (LAB_BAND[1] - LAB_BAND[0])

# The bootstrap range kept in the interval: 5% to 95%, a nominal 90% interval before the tolerance.
INTERVAL_QUANTILES = (0.05, 0.95)

# What a ladder and its run must share, and how a difference is named.
PROVENANCE_KEYS = {
    "corpus": "corpus (its meta.json fingerprint)",
    "tokenizer": "tokenizer",
    "vocab_size": "vocabulary size",
    "seq_len": "context length",
    "model_family": "model family",
}


class LadderFileError(ValueError):
    """A ladder.json that cannot be used; the message names the file and the field."""


@dataclass(frozen=True)
class Law:
    E: float
    A: float
    B: float
    alpha: float
    beta: float

    def loss(self, n: float, d: float) -> float:
        return self.E + self.A / n ** self.alpha + self.B / d ** self.beta

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Law:
        return cls(*(float(d[k]) for k in LAW_PARAMS))

    def as_dict(self) -> dict[str, float]:
        return asdict(self)


@dataclass(frozen=True)
class Prediction:
    n_params: float
    tokens: float
    val_loss: float
    low: float
    high: float
    tolerance: float
    n_convention: str

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class DeclaredBand:
    """The band the run is judged on (definition of done, check 2), fixed before its first step."""

    low: float
    high: float
    source: str  # "ladder", "flag" or "lab"
    prediction: float | None = None  # the ladder's central value, where the band is the ladder's

    def as_dict(self) -> dict[str, Any]:
        return {k: v for k, v in asdict(self).items() if v is not None}

    @classmethod
    def from_dict(cls, d: Any) -> DeclaredBand | None:
        """None for anything that is not a recorded band (an older manifest has none)."""
        if not isinstance(d, Mapping) or d.get("source") not in BAND_SOURCES:
            return None
        lo, hi = _finite(d.get("low")), _finite(d.get("high"))
        if lo is None or hi is None or not lo < hi:
            return None
        return cls(lo, hi, str(d["source"]), _finite(d.get("prediction")))

    def describe(self) -> str:
        what = {"ladder": f"the ladder's prediction {self.prediction:.3f} ± its tolerance" if self.prediction is not None
                else "the ladder's", "flag": "given on the command line", "lab": "the lab's"}[self.source]
        return f"[{self.low:.2f}, {self.high:.2f}] ({what})"

    def width_warning(self) -> str | None:
        """What to tell the run when its band is too wide to judge it; None for the lab's or a narrower one."""
        width = self.high - self.low
        if self.source == "lab" or width <= WIDE_BAND_NATS:
            return None
        why = ("the ladder's rungs were too short or too few to measure the law this far out (its ladder.md says "
               "how far its held-out check reached)" if self.source == "ladder" else "as given on the command line")
        return (f"this band is {width:.2f} nats wide, more than twice the lab's {LAB_BAND[1] - LAB_BAND[0]:.2f}: "
                f"it passes almost any run; {why}")


def declare_band(ladder_prediction: Prediction | None, flag_band: tuple[float, float] | None) -> DeclaredBand:
    """One band per run, in this order: the ladder's, an explicit band, the lab's."""
    if ladder_prediction is not None:
        return DeclaredBand(ladder_prediction.low, ladder_prediction.high, "ladder", ladder_prediction.val_loss)
    if flag_band is not None:
        return DeclaredBand(float(flag_band[0]), float(flag_band[1]), "flag")
    return DeclaredBand(*LAB_BAND, "lab")


def _finite(v: Any) -> float | None:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        return None
    return float(v)


# ---------------------------------------------------------------------------------------------
# ladder.json


def load_ladder(path: str | os.PathLike[str]) -> dict[str, Any]:
    """ladder.json, checked for what its readers use; LadderFileError names the file and the field."""
    try:
        data = read_json_file(path)
    except FileNotFoundError:
        raise LadderFileError(f"{path}: no such file (make it with `python -m x1_pretrain.ladder fit`)") from None
    except (OSError, ValueError) as e:
        raise LadderFileError(f"{path}: not a ladder file ({e})") from None
    check_ladder(data, str(path))
    return data


def check_ladder(data: Any, where: str = "ladder.json") -> None:
    if not isinstance(data, Mapping):
        raise LadderFileError(f"{where}: not a JSON object")
    fit = data.get("fit")
    if not isinstance(fit, Mapping):
        raise LadderFileError(f"{where}: fit: missing")
    for k in LAW_PARAMS:
        if _finite(fit.get(k)) is None:
            raise LadderFileError(f"{where}: fit.{k}: missing or not a finite number")
    if fit.get("n_convention") not in N_CONVENTIONS:
        raise LadderFileError(f"{where}: fit.n_convention: {fit.get('n_convention')!r} is not one of {N_CONVENTIONS}")
    tol = data.get("tolerance")
    if not isinstance(tol, Mapping):
        raise LadderFileError(f"{where}: tolerance: missing")
    for k in ("heldout_error", "check_reach", "largest_rung_compute"):
        v = _finite(tol.get(k))
        if v is None or v < 0 or (k != "heldout_error" and v <= 0):
            raise LadderFileError(f"{where}: tolerance.{k}: missing or not a positive finite number")
    samples = data.get("bootstrap", {}).get("samples") if isinstance(data.get("bootstrap"), Mapping) else None
    if not isinstance(samples, list) or not samples:
        raise LadderFileError(f"{where}: bootstrap.samples: missing (the fit's parameter samples)")
    for i, s in enumerate(samples):
        if not isinstance(s, list) or len(s) != len(LAW_PARAMS) or any(_finite(v) is None for v in s):
            raise LadderFileError(f"{where}: bootstrap.samples[{i}]: not {len(LAW_PARAMS)} finite numbers {LAW_PARAMS}")


def law_of(ladder: Mapping[str, Any]) -> Law:
    return Law.from_dict(ladder["fit"])


def compute_of(n_params: float, tokens: float, flops_per_token: float | None = None) -> float:
    """Training FLOPs: flops_per_token x tokens where known, else 6 N D."""
    return (flops_per_token if flops_per_token else 6.0 * n_params) * tokens


def tolerance_at(ladder: Mapping[str, Any], compute: float) -> float:
    """The held-out check's error, scaled by how far `compute` lies beyond the largest rung
    relative to how far the check reached (both as log10 ratios of compute), never narrower."""
    tol = ladder["tolerance"]
    reach = math.log10(max(compute, 1.0) / float(tol["largest_rung_compute"]))
    return float(tol["heldout_error"]) * max(1.0, reach / float(tol["check_reach"]))


def n_for(convention: str, n_params: float, nonembedding_params: float | None) -> float:
    if convention == N_TOTAL:
        return float(n_params)
    if nonembedding_params is None:
        raise LadderFileError("this ladder counts N without the embedding: give the non-embedding parameter count")
    return float(nonembedding_params)


def quantile(sorted_values: list[float], q: float) -> float:
    """Linear interpolation between order statistics (NumPy's default)."""
    if not sorted_values:
        raise ValueError("no values")
    pos = q * (len(sorted_values) - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, len(sorted_values) - 1)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (pos - lo)


def predict(ladder: Mapping[str, Any], n_params: float, tokens: float, nonembedding_params: float | None = None,
            flops_per_token: float | None = None) -> Prediction:
    """The law's value at (N, D) and the interval the ladder declares around it."""
    if not (n_params > 0 and tokens > 0):
        raise ValueError(f"n_params and tokens must be positive (got {n_params}, {tokens})")
    convention = ladder["fit"]["n_convention"]
    n = n_for(convention, n_params, nonembedding_params)
    central = law_of(ladder).loss(n, tokens)
    values = []
    for s in ladder["bootstrap"]["samples"]:
        try:
            v = Law(*s).loss(n, tokens)
        except (OverflowError, ZeroDivisionError):
            continue
        if math.isfinite(v):
            values.append(v)
    values.sort()
    if values:
        lo_q, hi_q = (quantile(values, q) for q in INTERVAL_QUANTILES)
    else:
        lo_q = hi_q = central
    tol = tolerance_at(ladder, compute_of(n_params, tokens, flops_per_token))
    return Prediction(n_params=float(n_params), tokens=float(tokens), val_loss=central,
                      low=max(0.0, min(lo_q, central) - tol), high=max(hi_q, central) + tol, tolerance=tol,
                      n_convention=convention)


def provenance_differences(ladder_provenance: Mapping[str, Any], run_provenance: Mapping[str, Any]) -> list[str]:
    """What the ladder was made on that the run is not, one phrase each ([] when they agree).

    A key the ladder does not know (`unknown`, or missing: a rungs file from elsewhere) is named
    too: a prediction that cannot be tied to the run's corpus is not the run's."""
    out = []
    for key, name in PROVENANCE_KEYS.items():
        theirs, ours = ladder_provenance.get(key, "unknown"), run_provenance.get(key)
        if ours is None:
            continue
        if theirs != ours:
            out.append(f"{name}: the ladder's is {_short(theirs)}, the run's {_short(ours)}")
    return out


def _short(v: Any) -> str:
    s = str(v)
    return repr(s[:12] + "…") if len(s) > 16 and all(c in "0123456789abcdef" for c in s) else repr(s)
