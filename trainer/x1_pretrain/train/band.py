"""The band the run is judged on, declared before its first step and never changed afterwards.

One band per run, in this order: a measured scaling ladder's prediction ± its tolerance
(`--ladder ladder.json`, made by `python -m x1_pretrain.ladder` on this run's corpus, tokenizer,
context and model family), an explicit `--band LO HI`, else the lab's [3.20, 3.50]. It goes into
every checkpoint (a resume keeps it whatever its flags say), onto MLflow (`x1.declared_band`),
into the run folder's manifest (`declared_band`), and the forecast's alert, the plots and `dod`
all read it from there.
"""

from __future__ import annotations

import json
import logging
from typing import Any

from x1_common.scaling import DeclaredBand, LadderFileError, declare_band, load_ladder, predict, provenance_differences
from x1_pretrain.config import RunConfig
from x1_pretrain.train.accounting import flops_per_token, param_counts
from x1_pretrain.train.provenance import corpus_identity, same_corpus

log = logging.getLogger("x1.train")
MLFLOW_TAG = "x1.declared_band"


class BandError(ValueError):
    """A ladder that cannot declare this run's band (exit 2); the message names the difference."""


def run_provenance(cfg: RunConfig, meta: dict[str, Any], ladder_corpus: Any = None) -> dict[str, Any]:
    """What a ladder must share with this run (x1_common.scaling.PROVENANCE_KEYS); a ladder's corpus
    fingerprint of the earlier form (with the files' times) names this corpus too."""
    corpus = corpus_identity(cfg.data.dir, meta)
    return {"corpus": ladder_corpus if same_corpus(ladder_corpus, corpus) else corpus["fingerprint"],
            "tokenizer": meta.get("tokenizer"), "vocab_size": cfg.model.vocab_size, "seq_len": cfg.model.seq_len,
            "model_family": cfg.model.family}


def ladder_prediction(path: str, cfg: RunConfig, meta: dict[str, Any]) -> tuple[dict[str, Any], Any]:
    """(the ladder, its prediction for this run's N and D); BandError when it is another run's."""
    try:
        ladder = load_ladder(path)
    except LadderFileError as e:
        raise BandError(f"--ladder: {e}") from None
    theirs = ladder.get("provenance") or {}
    diffs = provenance_differences(theirs, run_provenance(cfg, meta, theirs.get("corpus")))
    if diffs:
        raise BandError(f"--ladder {path}: made for another run: " + "; ".join(diffs) +
                        ". Make a ladder on this run's data and config (python -m x1_pretrain.ladder run)")
    counts = param_counts(cfg.model)
    tokens = cfg.train.total_steps * cfg.train.tokens_per_step
    return ladder, predict(ladder, counts["total"], tokens, counts["non_embedding"], flops_per_token(cfg.model))


def declared(recorded: dict[str, Any], ladder_path: str | None, flag_band: tuple[float, float] | None,
             cfg: RunConfig, meta: dict[str, Any]) -> tuple[DeclaredBand, dict[str, Any], dict[str, Any] | None]:
    """The run's band, what to record of it, and the ladder (checked to be this run's) where one was
    given, for the forecast's prior. A band recorded by an earlier start is kept."""
    ladder = prediction = None
    if ladder_path:
        ladder, prediction = ladder_prediction(ladder_path, cfg, meta)
    kept = DeclaredBand.from_dict(recorded)
    if kept is not None:
        differs = (kept.source != "ladder" or (prediction is not None and (prediction.low, prediction.high) !=
                                                (kept.low, kept.high))) if ladder_path else \
            flag_band is not None and (kept.source != "flag" or tuple(flag_band) != (kept.low, kept.high))
        if differs:
            asked = "--ladder" if ladder_path else f"--band {flag_band[0]:g} {flag_band[1]:g}"  # type: ignore[index]
            log.warning("band: %s is not used for the band: this run declared %s before its first step, and a band "
                        "never changes afterwards", asked, kept.describe())
        return kept, recorded, ladder
    record: dict[str, Any] = {}
    if ladder is not None and prediction is not None:
        record = {"ladder": str(ladder_path), "ladder_prediction": prediction.as_dict(), "fit": {
            k: ladder["fit"][k] for k in ("E", "A", "B", "alpha", "beta", "n_convention")}}
        if flag_band is not None:
            log.warning("band: --band %g %g is not used: the ladder's band comes first", *flag_band)
    band = declare_band(prediction, flag_band)
    return band, {**band.as_dict(), **record}, ladder


def log_declared(band: DeclaredBand, record: dict[str, Any], kept: bool) -> None:
    how = "kept from the run's start" if kept else "declared before the first step"
    log.info("band %s %s: the definition of done judges the final val loss against it", band.describe(), how)
    if (wide := band.width_warning()) is not None:
        log.warning("band: %s", wide)


def tag(record: dict[str, Any]) -> dict[str, str]:
    return {MLFLOW_TAG: json.dumps(record, sort_keys=True)}
