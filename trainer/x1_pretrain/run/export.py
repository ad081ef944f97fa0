"""`python -m x1_pretrain.export_run --mlflow-uri U --output DIR`: the run folder that proves a run.

    DIR/manifest.json         seed, versions, config hash + resolved config, cluster, spend, end, losses
    DIR/metrics.csv           long format step,name,value; one row per (step, name)
    DIR/loss-curve.png        train + val loss, the lab's expected points, the DoD band
    DIR/gradnorm-curve.png    grad norm (before clipping) and param norm
    DIR/throughput.png        tokens/s against wall-clock hours, restarts marked
    DIR/final.safetensors     the final weights, or the newest complete checkpoint of a run that stopped early
    DIR/mlflow-run-uri.txt    where the run lives in MLflow
    DIR/budget.json           the sidecar's last reading, when there is one
    DIR/termination.json|png  the proof the instance was terminated, when there is one

Everything is read through MlflowClient, so any tracking URI works (sqlite://, http://, the
the lab's file://). After a resume MLflow holds two values for the steps between the checkpoint and
the kill; the one logged last (the resumed process's) is the one that survives here.

The folder is built in a temp folder beside DIR and renamed into place at the end: a failed
export leaves no half-written folder. This module also holds the MLflow reading `postmortem` uses.
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import logging
import math
import os
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from x1_common.contracts import (
    END_REASONS,
    FINAL_EXIT_CODES,
    MLFLOW_FORECAST_METRICS,
    MLFLOW_GRAD_NORM,
    MLFLOW_LOSS,
    MLFLOW_MFU,
    MLFLOW_PARAM_NORM,
    MLFLOW_PROBE_SECONDS,
    MLFLOW_PROBE_STEPS,
    MLFLOW_PROBE_VAL_LOSS,
    MLFLOW_SPIKE,
    MLFLOW_SPIKE_INJECTED,
    MLFLOW_TOKENS_PER_SEC,
    MLFLOW_TOKENS_SEEN,
    MLFLOW_TRAIN_HOURS,
    MLFLOW_VAL_LOSS,
    MLFLOW_WALL_HOURS,
    ExitCode,
    format_utc,
    move_uri_credentials_to_env,
    utc_now,
)
from x1_common.fsutil import (
    DiskFaultError,
    disk_fault,
    disk_faults_named,
    make_readable,
    sha256_file,
    write_json_atomic,
    write_text_atomic,
)
from x1_common.projection import at_finish
from x1_common.restarts import label as restart_label
from x1_common.scaling import DeclaredBand, declare_band
from x1_pretrain.checkpoint.store import MARKER
from x1_pretrain.checkpoint.weights import read_metadata
from x1_pretrain.config import ConfigError, model_config_from_json
from x1_pretrain.run import plots
from x1_pretrain.run.dod import termination_facts
from x1_pretrain.run.facts import (
    WeightsChoice,
    _float_or_none,
    _number,
    budget_facts,
    choose_weights,
    cluster_spec,
    end_of_run,
    forecast_of,
    predicted_vs_band,
    predictions,
    read_events,
    replans,
    restart_count,
    run_config,
    spike_summary,
    versions_of,
)
from x1_pretrain.run.outputs import NotOurFiles, place
from x1_pretrain.run.record import ExportError, RunRecord, Series, load_run, safe_uri, scrub
from x1_pretrain.train.band import MLFLOW_TAG as BAND_TAG
from x1_pretrain.train.forecast import history_from_series

log = logging.getLogger("x1.export_run")

MANIFEST_FORMAT = "x1-run-manifest-v1"


# ---------------------------------------------------------------------------------------------
# Writing the folder


def metrics_csv(series: dict[str, Series]) -> str:
    rows = sorted((step, name, value) for name, s in series.items() for step, value in s)
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(("step", "name", "value"))
    w.writerows((step, name, repr(value)) for step, name, value in rows)
    return buf.getvalue()


def run_uri_text(record: RunRecord) -> str:
    lines = [f"runs:/{record.run_id}"]
    if urlsplit(record.uri).scheme in ("http", "https"):
        parts = urlsplit(record.uri)
        host = parts.hostname or ""
        base = urlunsplit((parts.scheme, host + (f":{parts.port}" if parts.port else ""), parts.path.rstrip("/"), "", ""))
        lines.insert(0, f"{base}/#/experiments/{record.experiment_id}/runs/{record.run_id}")
    lines += [
        f"tracking_uri: {safe_uri(record.uri)}",
        f"experiment: {record.experiment_name} (id {record.experiment_id})",
        f"run_id: {record.run_id}",
        f"run_name: {record.run_name}",
    ]
    return "\n".join(lines) + "\n"


def probes_of(record: RunRecord) -> list[dict[str, float]]:
    """The run's cooldown probes (train.cooldown_probes), from their MLflow metrics at each fork step:
    the step, the probe's length, its annealed val loss and its seconds."""
    steps, seconds = dict(record.get(MLFLOW_PROBE_STEPS)), dict(record.get(MLFLOW_PROBE_SECONDS))
    return [{"step": s, "steps": int(steps[s]) if s in steps else None, "val_loss": v, "seconds": seconds.get(s)}
            for s, v in record.get(MLFLOW_PROBE_VAL_LOSS)]


def _join_by_step(a: Series, b: Series) -> list[tuple[float, float]]:
    """(b's value, a's value) at the steps both were logged: e.g. (wall hours, tokens/s)."""
    bd = dict(b)
    return [(bd[s], v) for s, v in a if s in bd]


def draw_figures(out: Path, record: RunRecord, band: tuple[float, float], predicted: float | None,
                 clip: float | None, title: str, restart_cost: dict[str, Any] | None = None,
                 model: dict[str, Any] | None = None, declared: dict[str, Any] | None = None) -> None:

    # One band per restart, from its stop to the relaunched process's first step (x1_common.restarts).
    bands = restart_bands(record.raw.get(MLFLOW_WALL_HOURS, []), (restart_cost or {}).get("restarts", []))

    injected = record.flagged(MLFLOW_SPIKE_INJECTED)
    window = (injected[0], injected[-1]) if injected else None
    flagged = set(record.flagged(MLFLOW_SPIKE))  # spike_loss holds the injected steps' losses too

    plots.loss_curve(out / "loss-curve.png", record.get(MLFLOW_LOSS), record.get(MLFLOW_VAL_LOSS), band=band,
                     predicted=predicted, title=f"{title}: loss", injection=window,
                     forecast=history_from_series(*(record.get(k) for k in MLFLOW_FORECAST_METRICS)),
                     spikes=[(s, v) for s, v in record.get("spike_loss") if s in flagged],
                     lab_expected=plots.is_lab_model(model),  # the 50M run's table, not a tiny run's
                     band_label={"ladder": "the ladder's", "flag": "given to the run", "lab": "the lab's"}.get(
                         str((declared or {}).get("source")), ""),
                     ladder_prediction=(declared or {}).get("prediction") if (declared or {}).get("source") == "ladder"
                     else None)
    plots.gradnorm_curve(out / "gradnorm-curve.png", record.get(MLFLOW_GRAD_NORM), record.get(MLFLOW_PARAM_NORM), clip=clip,
                         title=f"{title}: gradient and parameter norms", injection=window,
                         spikes=record.get("spike_grad_norm"))
    wall = record.get(MLFLOW_WALL_HOURS)
    plots.throughput_curve(out / "throughput.png", _segments(record.get(MLFLOW_TOKENS_PER_SEC), wall, bands),
                           gaps=bands, mfu=_segments(record.get(MLFLOW_MFU), wall, bands), title=f"{title}: throughput")


def restart_bands(wall_raw: list[tuple[int, int, float]], restarts: list[dict[str, Any]]) -> list[tuple[float, float, str]]:
    """(from hours, to hours, label) per restart on the wall-hours axis: its stop -> the relaunched
    process's first step. The axis's origin (the run's first start) from the wall_hours metric:
    each value was logged at its MLflow timestamp."""
    if not wall_raw:
        return []
    offsets = sorted(ts / 1000 - hours * 3600 for _, ts, hours in wall_raw)
    origin = offsets[len(offsets) // 2]
    out = []
    for r in restarts:
        if r.get("stopped_unix") is None:
            continue  # nothing to place it at
        end = r.get("resumed_unix") if r.get("resumed_unix") is not None else r["stopped_unix"]
        out.append(((r["stopped_unix"] - origin) / 3600, (end - origin) / 3600, restart_label(r)))
    return out


def _segments(values: Series, wall: Series, bands: list[tuple[float, float, str]]) -> list[list[tuple[float, float]]]:
    """(wall hours, value) per stretch between restarts: no point inside a restart's band (the
    process was down), and no line drawn across one."""
    hours = dict(wall)
    segments: list[list[tuple[float, float]]] = [[]]
    edges = sorted((lo, hi) for lo, hi, _ in bands)
    slack = 0.05 / 3600  # a log at the first step itself is the band's end, not inside it (ms timestamps)
    for h, v in sorted((hours[step], v) for step, v in values if step in hours):
        if any(lo <= h < hi - slack for lo, hi in edges):
            continue
        if segments[-1] and any(segments[-1][-1][0] < lo <= h for lo, _ in edges):
            segments.append([])
        segments[-1].append((h, v))
    return [seg for seg in segments if seg]


@dataclass
class Inputs:
    ckpt_dir: Path
    budget: Path | None
    termination: Path | None
    events: Path | None
    missing: dict[str, Path] = field(default_factory=dict)  # flag -> a file given that does not exist

    def notes(self) -> list[str]:
        return [f"{flag} {path}: no such file, left out" for flag, path in self.missing.items()]


def locate_inputs(args: argparse.Namespace, record: RunRecord) -> Inputs:
    """Explicit flags first; otherwise the /workspace layout around the checkpoint dir
    (K/../budget.json, K/../logs/termination.json, K/../logs/watchdog-events.jsonl). A file named
    but absent (no terminate happened, no sidecar ran) is left out and noted, never fatal: the DoD
    then fails the check it was evidence for, naming it."""
    if args.ckpt_dir:
        ckpt = Path(args.ckpt_dir)
    elif record.tags.get("x1.ckpt_dir"):
        ckpt = Path(record.tags["x1.ckpt_dir"])
    else:
        raise ExportError(f"run {record.run_id} has no x1.ckpt_dir tag: pass --ckpt-dir")
    workspace = ckpt.parent

    missing: dict[str, Path] = {}

    def pick(flag: str, given: str | None, default: Path) -> Path | None:
        path = Path(given) if given else default
        if path.is_file():
            return path
        if given:
            missing[flag] = path
        return None

    return Inputs(
        ckpt_dir=ckpt,
        budget=pick("--budget-file", args.budget_file, workspace / "budget.json"),
        termination=pick("--termination-file", args.termination_file, workspace / "logs" / "termination.json"),
        events=pick("--events-file", args.events_file, workspace / "logs" / "watchdog-events.jsonl"),
        missing=missing,
    )


def build_manifest(record: RunRecord, inputs: Inputs, events: list[dict[str, Any]], budget: dict[str, Any],
                   termination: dict[str, Any] | None, weights: WeightsChoice, weights_copy: Path,
                   band: tuple[float, float]) -> dict[str, Any]:
    """The manifest, less its `files` section, with every secret scrubbed."""
    end, end_detail = end_of_run(record, events)
    config = run_config(record, inputs.ckpt_dir)
    try:
        meta = read_metadata(weights_copy)
        model_cfg = model_config_from_json(json.dumps(meta["model_config"]))
    except (KeyError, ConfigError) as e:
        raise ExportError(f"{weights.path}: not an X1 weights file (no usable model config in its metadata: {e})") from None
    notes = inputs.notes() + config.notes
    tag_hash = record.tags.get("x1.config_hash")
    if tag_hash and meta.get("config_hash") not in (None, tag_hash):
        notes.append(f"{weights.path} carries config hash {str(meta['config_hash'])[:12]}, the run's tag is "
                     f"{tag_hash[:12]}: were these weights written by another run?")
    train_cfg = config.resolved.get("train") if isinstance(config.resolved.get("train"), dict) else {}
    tokens = record.last(MLFLOW_TOKENS_SEEN)
    tokens_seen = tokens[1] if tokens else record.last_step * float(_float_or_none(train_cfg.get("tokens_per_step")) or 0)
    wall = [v for _, v in record.get(MLFLOW_WALL_HOURS)]
    trained = [v for _, v in record.get(MLFLOW_TRAIN_HOURS)]
    loss, val = record.last(MLFLOW_LOSS), record.last(MLFLOW_VAL_LOSS)
    now_ms = int(time.time() * 1000)
    seed = _number(record.tags.get("x1.seed")) if "x1.seed" in record.tags else train_cfg.get("seed")
    manifest: dict[str, Any] = {
        "format": MANIFEST_FORMAT,
        "created_utc": format_utc(utc_now()),
        "mlflow": {"run_id": record.run_id, "run_name": record.run_name, "experiment": record.experiment_name,
                   "experiment_id": record.experiment_id, "status": record.status, "tracking_uri": safe_uri(record.uri)},
        "seed": seed,
        # the corpus's fingerprint (x1_pretrain.train.provenance): a later run takes this one as its
        # forecast's earlier run (--forecast-earlier-runs) only on the same corpus
        "corpus_fingerprint": record.tags.get("x1.corpus_fingerprint"),
        "versions": versions_of(record),
        # each speed lever the config asked for: "on", or "off: why" (x1_pretrain.ops.levers)
        "levers": {k.removeprefix("x1.lever."): v for k, v in sorted(record.tags.items()) if k.startswith("x1.lever.")},
        "git_sha": record.tags.get("x1.git_sha", "unknown"),
        "config_name": record.tags.get("x1.config_name") or config.resolved.get("name"),
        "config_sha256": tag_hash,
        "config_sha256_covers": "model, optimizer, schedule incl. total steps, seed, precision (what a resume must not change)",
        "config": config.resolved,
        "config_source": config.source,
        "cluster": None,  # filled below, once budget and termination are known
        "spent_usd": budget["spent_usd"],
        "cap_usd": (budget.get("budget") or {}).get("cap_usd"),
        "end": end,
        "end_detail": end_detail,
        "steps": record.last_step,
        "total_steps": _number(str(train_cfg.get("total_steps"))) if train_cfg.get("total_steps") is not None else None,
        "tokens_seen": tokens_seen,
        "wall_hours": max(wall) if wall else None,
        "wall_hours_note": "wall-clock hours from the run's first start to its last log step, downtime included",
        "train_hours": max(trained) if trained else None,
        "train_hours_note": "training time summed over restarts (eval, checkpoints and downtime excluded)",
        "elapsed_hours": round(((record.end_ms or now_ms) - record.start_ms) / 3.6e6, 4) if record.start_ms else None,
        "final_train_loss": loss[1] if loss else None,
        "final_train_loss_step": loss[0] if loss else None,
        "final_val_loss": val[1] if val else None,
        "final_val_loss_step": val[0] if val else None,
        "loss_curve_band": list(band),  # shaded on loss-curve.png: the declared band (below)
        **predictions(model_cfg, tokens_seen, config.resolved),
        "predicted_vs_band": predicted_vs_band(model_cfg, tokens_seen, band),
        **restart_count(record, events, inputs.events),
        "replans": replans(record),
        "replans_note": ("each change of the total steps on a resume (after a budget stop: the steps that fitted): "
                         "the cosine re-targeted from that step, its learning rate unchanged there"),
        "spikes": spike_summary(record),
        "forecast": forecast_of(record, train_cfg, val[1] if val else None),
        "probes": probes_of(record),
        "final_weights": {"file": weights_copy.name, "sha256": sha256_file(weights_copy),
                          "bytes": weights_copy.stat().st_size, "source": str(weights.path), "step": weights.step,
                          "why": weights.why},
        "budget": budget.get("budget"),
        "termination": termination,
        "notes": notes,
    }
    for key in ("spent_usd_reason", "spent_usd_note"):
        if key in budget:
            manifest[key] = budget[key]
    manifest["cluster"] = cluster_spec(record, budget, termination)
    return scrub(manifest)


def declared_band_of(record: RunRecord, flag: tuple[float, float] | None) -> dict[str, Any]:
    """The band the run declared before its first step (its MLflow tag, x1_pretrain.train.band);
    for a run that recorded none (older), --band or the lab's, said so."""
    try:
        recorded = json.loads(record.tags.get(BAND_TAG, "null"))
    except ValueError:
        recorded = None
    if DeclaredBand.from_dict(recorded) is not None and not (recorded["source"] == "lab" and flag is not None):
        if flag is not None and (flag[0], flag[1]) != (recorded["low"], recorded["high"]):
            log.warning("--band %g %g not used: the run declared %s before its first step", flag[0], flag[1],
                        DeclaredBand.from_dict(recorded).describe())  # type: ignore[union-attr]
        return recorded
    if recorded is not None and flag is not None:  # the lab's by default: the run chose none of its own
        return {**declare_band(None, flag).as_dict(), "note": "the run declared no band of its own (the lab's by "
                "default): --band as given to export_run"}
    return {**declare_band(None, flag).as_dict(), "note": "the run recorded no band at its start (an older trainer): "
            + ("--band as given to export_run" if flag else "the lab's")}


def export(args: argparse.Namespace) -> tuple[Path, dict[str, Any]]:
    out = Path(args.output)
    if out.exists() and not out.is_dir():
        raise ExportError(f"--output {out} exists and is not a folder")
    if out.is_dir() and any(out.iterdir()) and not args.force:
        raise ExportError(f"--output {out} exists and is not empty: pass --force to replace the exported files "
                          "(files the export does not write, such as spike-postmortem.md, are kept)")
    flag = None if args.band is None else (float(args.band[0]), float(args.band[1]))
    if flag is not None and not (math.isfinite(flag[0]) and math.isfinite(flag[1]) and flag[0] < flag[1]):
        raise ExportError(f"--band {flag[0]} {flag[1]}: LO must be below HI, both finite")

    record = load_run(args.mlflow_uri, args.run_id, args.experiment)
    declared = declared_band_of(record, flag)
    band = (declared["low"], declared["high"])
    inputs = locate_inputs(args, record)
    events = read_events(inputs.events)
    budget = budget_facts(inputs.budget, inputs.missing.get("--budget-file"))
    termination = termination_facts(inputs.termination)
    end, _ = end_of_run(record, events)
    weights = choose_weights(inputs.ckpt_dir, end)

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.export-", dir=out.parent))
    try:
        copy_weights(weights.path, tmp / "final.safetensors")
        manifest = build_manifest(record, inputs, events, budget, termination, weights, tmp / "final.safetensors", band)
        manifest["declared_band"] = declared
        write_text_atomic(tmp / "metrics.csv", metrics_csv(record.series), durable=False)
        write_text_atomic(tmp / "mlflow-run-uri.txt", run_uri_text(record), durable=False)
        if inputs.budget is not None:
            _copy_budget(inputs.budget, tmp / "budget.json", end)
        if termination is not None and termination["file"] == "termination.png":
            shutil.copyfile(inputs.termination, tmp / "termination.png")  # type: ignore[arg-type]
            note = inputs.termination.with_name("termination-note.txt")  # type: ignore[union-attr]
            if note.is_file():  # what the person says the screenshot shows: dod's check 6 needs it
                shutil.copyfile(note, tmp / note.name)
        elif termination is not None:
            _copy_json_scrubbed(inputs.termination, tmp / "termination.json")  # type: ignore[arg-type]
        clip = _float_or_none((manifest["config"].get("optim") or {}).get("grad_clip"))
        title = f"{record.run_name or record.run_id[:8]} ({manifest['config_name']})"
        draw_figures(tmp, record, band, manifest["predicted_val_loss"], clip, title, manifest.get("restart_cost"),
                     manifest["config"].get("model"), declared)
        manifest["files"] = {p.name: sha256_file(p) for p in sorted(tmp.iterdir()) if p.is_file()}
        write_json_atomic(tmp / "manifest.json", manifest)  # last: a folder with a manifest is complete
        make_readable(tmp)  # mkdtemp made it private; the run folder is for reading
        for p in tmp.iterdir():
            if p.is_file():
                _fsync_file(p)
        _swap_into_place(tmp, out)
    except BaseException as e:
        shutil.rmtree(tmp, ignore_errors=True)
        # A disk that refused a file of the folder: said for the run folder, not its temp folder.
        if isinstance(e, OSError) and (fault := disk_fault(e, out, what=None if isinstance(e, DiskFaultError)
                                                           else "the run folder")) is not None:
            raise fault from None
        raise
    return out, manifest


def copy_weights(src: Path, dst: Path) -> str:
    """Copy the weights; returns the copy's sha256. A checkpoint's copy must match the sha256 its
    completion marker recorded: a running trainer may prune that folder while we read it."""
    try:
        with disk_faults_named(dst, need=src.stat().st_size, what=dst.name):
            shutil.copyfile(src, dst)
        sha = sha256_file(dst)
        marker = src.parent / MARKER
        expected = json.loads(marker.read_text())["files"][src.name] if marker.is_file() else sha
    except DiskFaultError:
        raise  # the disk's fault, not the trainer's
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ExportError(f"{src} changed while it was copied ({e}): is the trainer still running? Export again") from None
    if sha != expected:
        raise ExportError(f"{src} changed while it was copied (sha256 {sha[:12]}, its marker says {expected[:12]}): "
                          "is the trainer still running? Export again")
    return sha


# The manifest's `end` of a run that is over: nothing more is billed for it (a preemption is not an end).
ENDED = frozenset({END_REASONS[code] for code in FINAL_EXIT_CODES} | {"given-up"})


def _copy_budget(src: Path, dst: Path, end: str) -> None:
    """The sidecar's last reading, for the run folder. Once the run is over, its projection is its
    spend (x1_common.projection, as `status` shows it): the sidecar's own would still count the
    planned hours a finished or stopped run never bills."""
    doc = scrub(json.loads(src.read_text(encoding="utf-8")))
    spent = doc.get("spent_usd") if isinstance(doc, dict) else None
    if end in ENDED and isinstance(spent, (int, float)) and (finish := at_finish(spent, ended=True)) is not None:
        doc["projected_total_usd"] = round(finish.usd, 6)
        doc["projection"] = f"{finish.source} ({end})"
    write_json_atomic(dst, doc, durable=False)


def _copy_json_scrubbed(src: Path, dst: Path) -> None:
    """A JSON record copied with secret-named fields masked (the watchdog keeps the provider's raw
    instance record, which may carry a Jupyter token)."""
    write_json_atomic(dst, scrub(json.loads(src.read_text(encoding="utf-8"))), durable=False)


def _fsync_file(path: Path) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def _swap_into_place(tmp: Path, out: Path) -> None:
    """Rename the finished folder to `out`. An existing `out` (--force) has only an earlier export's
    files replaced (those its manifest.json lists); every other file is kept (the post-mortem a
    person filled in, a termination screenshot, dod.json, and anything of the folder's owner),
    and a name the export writes that an earlier export did not is refused (x1_pretrain.run.outputs)."""
    place(tmp, out, last="manifest.json", ours=_earlier_export_files(out), what="export_run")


def _earlier_export_files(out: Path) -> set[str]:
    """manifest.json and the files it lists, when `out` holds an earlier export's manifest."""
    try:
        files = json.loads((out / "manifest.json").read_text(encoding="utf-8")).get("files")
    except (OSError, ValueError, AttributeError, RecursionError):
        return set()
    if not isinstance(files, dict):
        return set()
    return {"manifest.json", *(n for n in files if isinstance(n, str) and "/" not in n and n not in ("", ".", ".."))}


# ---------------------------------------------------------------------------------------------
# Command line


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m x1_pretrain.export_run",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description=(
            "Export an MLflow run of the X1 trainer as a run folder: manifest.json, metrics.csv (step,name,value),\n"
            "loss-curve.png, gradnorm-curve.png, throughput.png, final.safetensors, mlflow-run-uri.txt, and\n"
            "copies of budget.json and the termination record when there are any. A run that stopped early\n"
            "(budget, divergence, preemption) exports its newest complete, verified checkpoint as\n"
            "final.safetensors and the manifest's `end` says why. The folder is built beside DIR and renamed\n"
            "into place: a failed export leaves nothing half-written."
        ),
        epilog=(
            "The checkpoint dir comes from the run's x1.ckpt_dir tag unless --ckpt-dir is given. Without the\n"
            "other flags the export looks beside it, in the /workspace layout: K/../budget.json,\n"
            "K/../logs/termination.json and K/../logs/watchdog-events.jsonl, and uses each one that exists.\n"
            "A file that is absent, named or not, is left out with a note and the DoD fails the check it was\n"
            "evidence for: no budget reading gives spent_usd: null with the reason.\n\n"
            "Exit codes: 0 exported; 2 bad input (no such run, no runs, tracking store unreachable after a\n"
            "short retry, no weights, --output not empty without --force), with a message naming it; 1 the disk\n"
            "refused the folder (full, over quota, read-only), naming it, its free space and what was needed:\n"
            "an earlier export there is left as it was."
        ),
    )
    p.add_argument("--mlflow-uri", required=True, help="tracking URI: sqlite:///..., http://host:5000 or file:///...")
    p.add_argument("--output", required=True, metavar="DIR", help="the run folder to write (created; parents too)")
    p.add_argument("--run-id", help="MLflow run id (default: the newest run the trainer logged)")
    p.add_argument("--experiment", help="look for the newest run only in this experiment (default: all)")
    p.add_argument("--ckpt-dir", metavar="K", help="checkpoint dir (default: the run's x1.ckpt_dir tag)")
    p.add_argument("--budget-file", metavar="F", help="the sidecar's budget.json (spent_usd, cap, provider)")
    p.add_argument("--termination-file", metavar="F",
                   help="the watchdog's termination.json (or a provider's terminate answer), or a .png screenshot")
    p.add_argument("--events-file", metavar="F", help="the watchdog's events (JSON lines): restarts = its relaunches")
    p.add_argument("--band", nargs=2, type=float, metavar=("LO", "HI"),
                   help="the band for a run that declared none at its start (an older trainer; default the lab's "
                        "3.20 3.50); a run's declared band always wins")
    p.add_argument("--force", action="store_true",
                   help="replace the exported files in a non-empty --output (other files there are kept)")
    return p


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    args = build_parser().parse_args(argv)
    try:
        # user:password in the URI go to MLflow's own variables: never into a message or a file
        args.mlflow_uri = move_uri_credentials_to_env(args.mlflow_uri, "MLFLOW_TRACKING_USERNAME",
                                                      "MLFLOW_TRACKING_PASSWORD", "--mlflow-uri")
        out, manifest = export(args)
    except (ExportError, NotOurFiles, ValueError) as e:
        print(f"export_run: error: {e}", file=sys.stderr)
        return int(ExitCode.USAGE)
    except OSError as e:
        fault = disk_fault(e, args.output) if not isinstance(e, DiskFaultError) else e
        if fault is None:
            raise
        print(f"export_run: error: {fault}: nothing exported, {args.output} is as it was; free some space (or remount "
              "it read-write), then export again", file=sys.stderr)
        return int(ExitCode.ENVIRONMENT)
    val = manifest["final_val_loss"]
    spent = manifest["spent_usd"]
    print(f"exported run {manifest['mlflow']['run_id']} to {out}: end {manifest['end']} at step {manifest['steps']}, "
          f"final val loss {'n/a' if val is None else f'{val:.4f}'}, "
          f"spent {'unknown' if spent is None else f'${spent:.2f}'}; "
          f"final.safetensors from {manifest['final_weights']['source']}")
    for note in manifest["notes"]:
        print(f"note: {note}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
