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
import os
import re
import shutil
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from x1_common import restarts
from x1_common.contracts import (
    END_REASONS,
    BudgetFormatError,
    ExitCode,
    end_reason,
    format_utc,
    move_uri_credentials_to_env,
    read_budget_file,
    redact,
    scrub_record,
    utc_now,
)
from x1_common.fsutil import make_readable, sha256_file, write_json_atomic, write_text_atomic
from x1_common.restarts import Start
from x1_common.restarts import label as restart_label
from x1_pretrain.outputs import NotOurFiles, place

# The export is run by a person waiting at a prompt: MLflow's own client would retry an
# unreachable server 7 times with backoff; we retry a few times ourselves and say so.
os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "30")
os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")  # the lab's file:///workspace/mlruns

log = logging.getLogger("x1.export_run")

MANIFEST_FORMAT = "x1-run-manifest-v1"
DEFAULT_BAND = (3.20, 3.50)  # docs/DESIGN.md §8 check 2: the final val loss of the 50M run
REQUIRED_VERSIONS = ("torch", "flash-attn", "transformers", "numpy", "tiktoken", "mlflow")
CONNECT_DELAYS_S = (1.0, 2.0, 4.0)  # a server that is just starting gets ~7 s


class ExportError(Exception):
    """Bad input a person must fix (exit 2); the message names what is missing."""


Series = list[tuple[int, float]]  # (step, value), ascending steps, one value per step
RAW_KEYS = ("restart", "startup_seconds", "first_step_unix", "downtime_seconds", "stopped_unix", "stopped_by",
            "stopped_step", "wall_hours")

# ---------------------------------------------------------------------------------------------
# Reading a run from MLflow


@dataclass
class RunRecord:
    """One MLflow run as the artifacts need it: metadata, params, tags and metric series."""

    uri: str  # as given; may hold credentials, so never written anywhere (see safe_uri)
    run_id: str
    experiment_id: str
    experiment_name: str
    run_name: str
    status: str
    start_ms: int | None
    end_ms: int | None
    params: dict[str, str]
    tags: dict[str, str]
    series: dict[str, Series]  # the surviving value per (step, name)
    logged: dict[str, int] = field(default_factory=dict)  # raw entries per name, duplicates included
    # Every entry, duplicates included, of the metrics logged once per process start (RAW_KEYS):
    # two starts that resume from one checkpoint log them at the same step.
    raw: dict[str, list[tuple[int, int, float]]] = field(default_factory=dict)  # (step, timestamp ms, value)

    def get(self, name: str) -> Series:
        return self.series.get(name, [])

    def last(self, name: str) -> tuple[int, float] | None:
        s = self.series.get(name)
        return s[-1] if s else None

    def flagged(self, name: str) -> list[int]:
        """Steps where an event metric (spike, spike_injected, restart...) was logged as 1.0."""
        return [s for s, v in self.get(name) if v >= 0.5]

    @property
    def last_step(self) -> int:
        return max((s[-1][0] for s in self.series.values() if s), default=0)


def safe_uri(uri: str) -> str:
    """The tracking URI with any user:password removed and secret env values masked."""
    parts = urlsplit(uri)
    if parts.username or parts.password:
        host = parts.hostname or ""
        netloc = f"***@{host}" + (f":{parts.port}" if parts.port else "")
        uri = urlunsplit((parts.scheme, netloc, parts.path, parts.query, parts.fragment))
    return redact(uri)


_URI = re.compile(r"^[a-z][a-z0-9+.-]*://", re.I)


def scrub(obj: Any) -> Any:
    """`obj` with no secret left in it: credentials in URIs, secret env values, and the values of
    secret-named keys (contracts.scrub_record)."""
    if isinstance(obj, dict):
        return {k: scrub(v) for k, v in scrub_record(obj).items()}
    if isinstance(obj, list):
        return [scrub(v) for v in obj]
    if isinstance(obj, str):
        return safe_uri(obj) if _URI.match(obj) else redact(obj)
    return obj


def _local_store_problem(uri: str) -> str | None:
    """For sqlite:// and file:// URIs, what is missing on disk. MLflow would silently create an
    empty store at a mistyped path; an export must say the path is wrong instead."""
    scheme = urlsplit(uri).scheme
    if scheme == "sqlite":
        path = uri[len("sqlite:///"):] if uri.startswith("sqlite:///") else ""
        if path and path != ":memory:" and not Path(path).is_file():
            return f"no MLflow database at {path} (from --mlflow-uri {safe_uri(uri)})"
    elif scheme in ("file", ""):
        path = urlsplit(uri).path if scheme == "file" else uri
        if not Path(path).is_dir():
            return f"no MLflow file store at {path} (from --mlflow-uri {safe_uri(uri)})"
    return None


def connect(uri: str):
    """An MlflowClient that has answered once; ExportError when the store is missing or the
    server does not answer after a short retry."""
    from mlflow.tracking import MlflowClient

    delays = CONNECT_DELAYS_S
    problem = _local_store_problem(uri)
    if problem:
        raise ExportError(problem)
    client = MlflowClient(tracking_uri=uri)
    for attempt in range(len(delays) + 1):
        try:
            client.search_experiments(max_results=1)
            return client
        except Exception as e:  # noqa: BLE001 - connection refused, DNS, HTTP 5xx, bad store: all "cannot read"
            if attempt == len(delays):
                first = redact(str(e)).splitlines()[0][:300] if str(e) else type(e).__name__
                raise ExportError(f"cannot read the MLflow tracking store at {safe_uri(uri)} after "
                                  f"{attempt + 1} tries: {first}") from None
            time.sleep(delays[attempt])
    raise AssertionError("unreachable")


def find_run(client, uri: str, run_id: str | None, experiment: str | None):
    """The run asked for, or the newest X1 run (tag x1.config_hash) of the experiment(s)."""
    from mlflow.exceptions import MlflowException

    if run_id:
        try:
            return client.get_run(run_id)
        except MlflowException:
            raise ExportError(f"no run with id {run_id!r} at {safe_uri(uri)}") from None
    if experiment:
        exp = client.get_experiment_by_name(experiment)
        if exp is None:
            names = ", ".join(e.name for e in client.search_experiments()) or "none"
            raise ExportError(f"no experiment named {experiment!r} at {safe_uri(uri)} (there are: {names})")
        exp_ids = [exp.experiment_id]
    else:
        exp_ids = [e.experiment_id for e in client.search_experiments()]
    runs = client.search_runs(exp_ids, order_by=["attributes.start_time DESC"], max_results=50) if exp_ids else []
    if not runs:
        where = f"experiment {experiment!r}" if experiment else "any experiment"
        raise ExportError(f"no runs in {where} at {safe_uri(uri)}: has the trainer logged to this URI?")
    # Prefer a run the trainer made over anything else someone logged to the same server.
    return next((r for r in runs if "x1.config_hash" in r.data.tags), runs[0])


def surviving(history: list[Any]) -> Series:
    """One value per step: the one logged last. After a resume the steps between the checkpoint
    and the kill were logged twice; the resumed process's values are the ones the run kept."""
    best: dict[int, tuple[int, int, float]] = {}
    for order, m in enumerate(history):
        rank = (int(m.timestamp), order)  # ties in the same millisecond: the later row wins
        if m.step not in best or rank >= best[m.step][:2]:
            best[m.step] = (*rank, float(m.value))
    return [(step, v) for step, (_, _, v) in sorted(best.items())]


def read_histories(client, uri: str, run_id: str, keys: list[str]) -> dict[str, list[Any]]:
    """Every logged value of every key. get_metric_history pages through the store itself."""
    def one(key: str) -> list[Any]:
        return list(client.get_metric_history(run_id, key))

    if urlsplit(uri).scheme in ("http", "https"):
        # Network-bound: a few requests in flight at once. (A local sqlite store is CPU-bound in
        # the ORM and is read one key at a time.)
        with ThreadPoolExecutor(max_workers=4) as pool:
            return dict(zip(keys, pool.map(one, keys), strict=True))
    return {key: one(key) for key in keys}


def load_run(uri: str, run_id: str | None = None, experiment: str | None = None) -> RunRecord:
    client = connect(uri)
    run = find_run(client, uri, run_id, experiment)
    exp = client.get_experiment(run.info.experiment_id)
    keys = sorted(run.data.metrics)
    histories = read_histories(client, uri, run.info.run_id, keys)
    return RunRecord(
        uri=uri,
        run_id=run.info.run_id,
        experiment_id=run.info.experiment_id,
        experiment_name=exp.name if exp is not None else "",
        run_name=run.info.run_name or "",
        status=run.info.status,
        start_ms=run.info.start_time,
        end_ms=run.info.end_time,
        params=dict(run.data.params),
        tags=dict(run.data.tags),
        series={k: surviving(h) for k, h in histories.items()},
        logged={k: len(h) for k, h in histories.items()},
        raw={k: [(int(m.step), int(m.timestamp), float(m.value)) for m in histories[k]] for k in RAW_KEYS if k in histories},
    )


# ---------------------------------------------------------------------------------------------
# The run's facts


def unflatten(params: dict[str, str]) -> dict[str, Any]:
    """{"model.n_layer": "8"} -> {"model": {"n_layer": "8"}}; "None" -> None (str(None) in MLflow)."""
    tree: dict[str, Any] = {}
    for key, value in params.items():
        node = tree
        *parents, leaf = key.split(".")
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = None if value == "None" else value
    return tree


@dataclass
class ConfigFacts:
    resolved: dict[str, Any]
    source: str
    notes: list[str]


def run_config(record: RunRecord, ckpt_dir: Path) -> ConfigFacts:
    """The resolved config: the newest checkpoint's (typed, and updated by any resume with
    --allow-config-change), else MLflow's params validated back into a RunConfig."""
    from x1_pretrain.checkpoint import STATE_FILE, TrainerState
    from x1_pretrain.config import ConfigError, config_from_dict

    tag_hash = record.tags.get("x1.config_hash")
    for step_dir in sorted(ckpt_dir.glob("step_*"), reverse=True):
        try:
            state = TrainerState.from_json((step_dir / STATE_FILE).read_text())
        except (OSError, ValueError, TypeError):
            continue
        if state.config and (tag_hash is None or state.config_hash == tag_hash):
            return ConfigFacts(state.config, f"{step_dir / STATE_FILE}", [])
    notes = []
    tree = unflatten(record.params)
    try:
        cfg = config_from_dict(tree)
        if tag_hash and cfg.config_hash() != tag_hash:
            notes.append(f"the config rebuilt from MLflow params hashes to {cfg.config_hash()[:12]}, the run's "
                         f"x1.config_hash tag is {tag_hash[:12]}: the run changed config on a resume")
        return ConfigFacts(cfg.resolved(), "MLflow params", notes)
    except ConfigError as e:
        notes.append(f"MLflow params do not validate as this version's config ({e}); kept as logged")
        return ConfigFacts(tree, "MLflow params (as logged, strings)", notes)


def read_events(path: Path | None) -> list[dict[str, Any]]:
    if path is None:
        return []
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except OSError as e:
        raise ExportError(f"--events-file {path}: {e.strerror}") from None
    except UnicodeDecodeError as e:
        raise ExportError(f"--events-file {path}: not UTF-8 text (byte offset {e.start})") from None
    events = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            event = json.loads(line)
        except (json.JSONDecodeError, RecursionError) as e:
            raise ExportError(f"--events-file {path}: line {n} is not JSON ({e})") from None
        if not isinstance(event, dict):
            raise ExportError(f"--events-file {path}: line {n} is not a JSON object")
        events.append(event)
    return events


def end_of_run(record: RunRecord, events: list[dict[str, Any]]) -> tuple[str, str]:
    """(end, how we know). The trainer tags x1.end on every exit it controls."""
    tag = record.tags.get("x1.end")
    if tag:
        reason = record.tags.get("x1.end_reason")
        if reason and reason != tag and reason in END_REASONS.values():
            # A trainer older than the tags' fix left an earlier exit's reason ("preempted") beside a
            # later exit's end ("finished"): that word does not describe this end.
            return tag, (f"tag x1.end; MLflow status {record.status} (its x1.end_reason {reason!r} was left by an "
                         "earlier exit of this run)")
        return tag, reason or f"tag x1.end; MLflow status {record.status}"
    finals = [e for e in events if e.get("event") in ("exit", "give_up")]
    if finals:
        last = finals[-1]
        if last.get("event") == "give_up":
            return "given-up", f"no x1.end tag; the watchdog gave up: {last.get('detail', '')}".strip()
        code = last.get("exit_code")
        return end_reason(code if isinstance(code, int) else None), \
            f"no x1.end tag; the watchdog's last exit event: code {code} ({last.get('reason', '?')})"
    if record.status == "RUNNING":
        # MLflow cannot tell a live run from one whose process died without a word (SIGKILL, a
        # lost host): both stay RUNNING. "running" is what MLflow says, not a diagnosis.
        return "running", ("no x1.end tag and the MLflow run is still RUNNING: either it is training, or its "
                           "process died without a word (SIGKILL, a lost host)")
    return "unknown", f"no x1.end tag; MLflow status {record.status}"


@dataclass
class WeightsChoice:
    path: Path
    step: int | None
    why: str
    skipped: list[str]


def choose_weights(ckpt_dir: Path, end: str) -> WeightsChoice:
    """final.safetensors for a finished run; the newest complete, verified checkpoint otherwise."""
    from x1_pretrain.checkpoint import FINAL_WEIGHTS, MODEL_FILE, Checkpointer
    from x1_pretrain.config import ConfigError, ModelConfig
    from x1_pretrain.weights import read_metadata

    if not ckpt_dir.is_dir():
        raise ExportError(f"checkpoint dir {ckpt_dir} does not exist (pass --ckpt-dir)")
    final = ckpt_dir / FINAL_WEIGHTS

    def step_of(path: Path) -> int | None:
        step = read_metadata(path).get("step")
        return int(step) if isinstance(step, int) else None

    skipped = []
    if final.is_file() and end in ("finished", "running", "unknown"):
        why = ("the run finished: the trainer's final weights" if end == "finished" else
               f"the run's end is {end!r}, but final.safetensors exists (the trainer writes it only at its last step)")
        try:
            return WeightsChoice(final, step_of(final), why, [])
        except ConfigError as e:  # a damaged final: the newest verified checkpoint instead, said so
            skipped.append(f"{FINAL_WEIGHTS}: {e}")
    checkpointer = Checkpointer(ckpt_dir, keep_last=1, model_cfg=ModelConfig())  # the config is used only to save
    for step_dir in checkpointer.step_dirs():
        problem = checkpointer.verify(step_dir)
        if problem:
            skipped.append(f"{step_dir.name}: {problem}")
            continue
        path = step_dir / MODEL_FILE
        try:
            step = step_of(path)
        except ConfigError as e:
            skipped.append(f"{step_dir.name}: {e}")
            continue
        if end == "finished":
            why = (f"the run is marked finished but {final} is missing: the newest complete, verified "
                   f"checkpoint ({step_dir.name}) instead")
        else:
            why = (f"the run ended {end!r} before its last step: the newest complete, verified checkpoint "
                   f"({step_dir.name})")
        if skipped:
            why += f"; skipped {'; '.join(skipped)}"
        return WeightsChoice(path, step, why, skipped)
    detail = f" (skipped {'; '.join(skipped)})" if skipped else ""
    raise ExportError(f"no weights in {ckpt_dir}: no final.safetensors and no complete, verified step_* "
                      f"checkpoint{detail}")


def budget_facts(path: Path | None, missing: Path | None = None) -> dict[str, Any]:
    """Spend from the sidecar's last reading. No reading is not an error: spent_usd is null with
    the reason, and the DoD's spend check fails saying so. A file that is not a reading is."""
    if path is None:
        why = (f"--budget-file {missing}: no such file" if missing else
               "no budget file (the sidecar writes /workspace/budget.json): pass --budget-file")
        return {"spent_usd": None, "spent_usd_reason": why}
    try:
        reading = read_budget_file(path)
    except (OSError, BudgetFormatError) as e:
        raise ExportError(f"budget file {path}: {e}") from None
    facts: dict[str, Any] = {"spent_usd": reading.spent_usd, "budget": {**reading.to_dict(), "file": str(path)}}
    extra = json.loads(path.read_text(encoding="utf-8")).get("instance_type")  # informative; not in every sidecar
    if isinstance(extra, str) and extra:
        facts["budget"]["instance_type"] = extra
    if reading.stale:
        facts["spent_usd_note"] = ("the last reading is marked stale (the provider API was failing): the spend "
                                   "is the sidecar's estimate from the last known rate")
    return facts


def _find_instance_type(obj: Any) -> str | None:
    """The instance type anywhere in a provider record: Lambda's instance_type.name, RunPod's
    machine.gpuDisplayName or gpuTypeId."""
    if isinstance(obj, dict):
        it = obj.get("instance_type")
        if isinstance(it, dict) and isinstance(it.get("name"), str):
            return it["name"]
        for key in ("gpuDisplayName", "gpuTypeId"):
            if isinstance(obj.get(key), str):
                return obj[key]
        values = list(obj.values())
    elif isinstance(obj, list):
        values = obj
    else:
        return None
    for v in values:
        found = _find_instance_type(v)
        if found:
            return found
    return None


def termination_facts(path: Path | None) -> dict[str, Any] | None:
    from x1_pretrain.dod import termination_evidence

    if path is None:
        return None
    if path.suffix.lower() == ".png":
        return {"file": "termination.png", "source": str(path), "kind": "screenshot"}
    try:
        record = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ExportError(f"termination record {path}: not JSON ({e})") from None
    evidence = termination_evidence(record)
    facts = {"file": "termination.json", "source": str(path), "kind": "provider record",
             "shows_terminated": evidence is not None, "evidence": evidence}
    if isinstance(record, dict):
        for key in ("provider", "instance_id", "time"):
            if isinstance(record.get(key), str):
                facts[key] = record[key]
    facts["instance_type"] = _find_instance_type(record)
    return facts


def _number(text: str | None) -> int | float | str | None:
    if text is None:
        return None
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def cluster_spec(record: RunRecord, budget: dict[str, Any], termination: dict[str, Any] | None) -> dict[str, Any]:
    pre = {k.removeprefix("x1.preflight."): v for k, v in record.tags.items() if k.startswith("x1.preflight.")}
    reading = budget.get("budget") or {}
    term = termination or {}
    gpu_count = _number(pre.get("gpu_count"))
    return {
        "gpu_name": pre.get("gpu_name", "unknown"),
        "gpu_count": gpu_count,
        "gpu_memory_gb": _number(pre.get("gpu_memory_gb")),
        "gpu_form_factor": pre.get("gpu_form_factor"),
        "driver": pre.get("driver", "none (no GPU)" if gpu_count == 0 else "unknown"),
        "cuda_runtime": pre.get("cuda_runtime"),
        "cpu": f"{pre['vcpus']} vCPUs" if "vcpus" in pre else "unknown",
        "vcpus": _number(pre.get("vcpus")),
        "ram_gb": _number(pre.get("ram_gb")),
        "attention": pre.get("attention"),
        "world_size": _number(record.tags.get("x1.world_size")),
        "provider": reading.get("provider") or term.get("provider") or "unknown",
        "instance_id": reading.get("instance_id") or term.get("instance_id") or "unknown",
        "instance_type": (term.get("instance_type") or reading.get("instance_type")
                          or "unknown (no provider record with it: give --termination-file)"),
        "preflight": pre,
    }


def versions_of(record: RunRecord) -> dict[str, str]:
    v = {k.removeprefix("x1.version."): val for k, val in record.tags.items() if k.startswith("x1.version.")}
    if v.get("mlflow", "absent") == "absent" and v.get("mlflow-skinny", "absent") != "absent":
        v["mlflow"] = f"{v['mlflow-skinny']} (mlflow-skinny)"  # the trainer image carries only the client
    for pkg in REQUIRED_VERSIONS:
        v.setdefault(pkg, "unknown (not logged)")
    return v


def predictions(model_cfg, tokens_seen: float, config: dict[str, Any]) -> dict[str, Any]:
    from x1_pretrain.accounting import CHINCHILLA, param_counts, predicted_loss

    n = param_counts(model_cfg)["total"]
    label = "Chinchilla fit (Hoffmann 2022), N = all parameters; fitted on another corpus and tokenizer: a guide"
    now = predicted_loss(n, tokens_seen, model_cfg.vocab_size)
    out: dict[str, Any] = {
        "predicted_val_loss": round(now.value, 4),
        "predicted_val_loss_basis": {"n_params": n, "tokens": tokens_seen, "fit": label, "constants": CHINCHILLA,
                                     "fit_value": round(now.fit, 4), "in_fit_range": now.in_fit_range,
                                     "note": now.note},
    }
    train = config.get("train") if isinstance(config.get("train"), dict) else {}
    try:
        planned = float(train["total_steps"]) * float(train["tokens_per_step"])
        plan = predicted_loss(n, planned, model_cfg.vocab_size)
        out["planned_val_loss"] = {"value": round(plan.value, 4), "tokens": planned, "fit_value": round(plan.fit, 4),
                                   "in_fit_range": plan.in_fit_range, "note": plan.note,
                                   "label": "the plan's prediction for the planned tokens (total_steps x tokens_per_step)"}
    except (KeyError, TypeError, ValueError):
        pass
    return out


def predicted_vs_band(model_cfg, tokens_seen: float, band: tuple[float, float]) -> str:
    """Which number to believe when the fit's prediction and the DoD's band disagree (plan says the same)."""
    from x1_pretrain.plan import band_note

    return band_note(predictions(model_cfg, tokens_seen, {})["predicted_val_loss"], band)


def replans(record: RunRecord) -> list[dict[str, Any]]:
    """The run's re-plans (old and new total steps, when, why), from the trainer's x1.replan.N tags."""
    found = []
    for key, value in record.tags.items():
        head, _, n = key.rpartition(".")
        if head == "x1.replan" and n.isdigit():
            try:
                item = json.loads(value)
            except ValueError:
                item = {"text": value}
            found.append((int(n), item if isinstance(item, dict) else {"text": value}))
    return [item for _, item in sorted(found, key=lambda t: t[0])]


def forecast_of(record: RunRecord, train_cfg: dict[str, Any], final: float | None) -> dict[str, Any] | None:
    """The final-loss forecast's history and what it said at 10/25/50% (x1_pretrain.forecast)."""
    from x1_common.contracts import MLFLOW_FORECAST_METRICS
    from x1_pretrain.forecast import forecast_summary, history_from_series

    history = history_from_series(*(record.get(k) for k in MLFLOW_FORECAST_METRICS))
    total = _float_or_none(train_cfg.get("total_steps"))
    return forecast_summary(history, int(total) if total else None, final)


def spike_summary(record: RunRecord) -> dict[str, Any]:
    injected = record.flagged("spike_injected")
    skipped = record.flagged("spike_injection_skipped")
    return {
        # MLflow steps count completed steps: the batches of step N show at N+1.
        "injected_at_step": injected[0] - 1 if injected else (skipped[0] if skipped else None),
        "injected_mlflow_steps": injected,
        "injection_skipped": bool(skipped),
        "injection_note": record.tags.get("x1.spike_injection"),
        "detected_mlflow_steps": record.flagged("spike"),
    }


def restart_count(record: RunRecord, events: list[dict[str, Any]], events_path: Path | None) -> dict[str, Any]:
    # Raw entries, not surviving ones: two resumes from the same checkpoint log `restart` twice at one step.
    from_mlflow = record.logged.get("restart", 0)
    cost = restart_cost(record, events)
    if events_path is not None:
        relaunches = sum(1 for e in events if e.get("event") == "relaunch")
        return {"restarts": relaunches, "restarts_source": f"watchdog relaunch events in {events_path}",
                "restarts_logged_by_trainer": from_mlflow, "restart_cost": cost}
    return {"restarts": from_mlflow, "restarts_source": "MLflow metric `restart` (one per resumed start)",
            "restart_cost": cost}


def process_starts(record: RunRecord) -> list[Start]:
    """Every start that reached its first step, oldest first, with what it knew of the process
    before it (train.log_first_step). The metrics of one start share its log call: the same step
    and timestamp."""
    by_call = {}
    keys = ("startup_seconds", "downtime_seconds", "stopped_unix", "stopped_by", "stopped_step")
    for key in keys:
        for step, ts, value in record.raw.get(key, []):
            by_call[(key, step, ts)] = value
    starts = []
    for step, ts, value in record.raw.get("first_step_unix", []):
        if ("startup_seconds", step, ts) not in by_call:
            continue
        previous = None
        if (stopped := by_call.get(("stopped_unix", step, ts))) is not None:
            by = restarts.STOPPED_BY[int(by_call.get(("stopped_by", step, ts), 2))]
            at = by_call.get(("stopped_step", step, ts))
            previous = restarts.Stop(stopped, by, None if at is None else int(at))
        elif (down := by_call.get(("downtime_seconds", step, ts))) is not None:  # a run from before stopped_unix
            previous = restarts.Stop(value - down, "last heartbeat")
        starts.append(Start(step, value, by_call[("startup_seconds", step, ts)], previous))
    return sorted(starts, key=lambda p: p.first_step_unix)


def restart_cost(record: RunRecord, events: list[dict[str, Any]]) -> dict[str, Any]:
    """What each start and each restart cost, in seconds.

    startup: the process's start -> its first optimizer step done (logged by the trainer). A
    restart's downtime: x1_common.restarts, the one definition `stack status`, the demo and
    throughput.png use too. A number that was not logged is null, with the reason; never guessed."""
    starts = process_starts(record)
    out: dict[str, Any] = {
        "starts": [{"first_step": p.first_step, "first_step_utc": format_utc_unix(p.first_step_unix),
                    "startup_seconds": round(p.startup_seconds, 3)} for p in starts],
        "startup_note": "process start -> its first optimizer step done: interpreter, imports, data checks, model, "
                        "compile (or its cache), warm-up, restore",
    }
    found = restarts.restarts(starts, events)
    source = ("the watchdog's relaunch events and the trainer's start records (MLflow)"
              if any(e.get("event") == "relaunch" for e in events) else "the trainer's start records (MLflow)")
    for r in found:
        r["source"] = source
    out["restarts"] = found
    out["downtime_note"] = restarts.DEFINITION
    measured = [r["downtime_seconds"] for r in found if r.get("downtime_seconds") is not None]
    out["downtime_seconds_total"] = round(sum(measured), 1) if len(measured) == len(found) else None
    if len(measured) != len(found):
        out["downtime_seconds_total_why"] = f"not measured: {len(found) - len(measured)} restart(s) without a figure"
    return out


def format_utc_unix(t: float) -> str:
    from datetime import datetime, timezone

    return format_utc(datetime.fromtimestamp(t, timezone.utc))


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


def _join_by_step(a: Series, b: Series) -> list[tuple[float, float]]:
    """(b's value, a's value) at the steps both were logged: e.g. (wall hours, tokens/s)."""
    bd = dict(b)
    return [(bd[s], v) for s, v in a if s in bd]


def draw_figures(out: Path, record: RunRecord, band: tuple[float, float], predicted: float | None,
                 clip: float | None, title: str, restart_cost: dict[str, Any] | None = None) -> None:
    from x1_pretrain import plots

    # One band per restart, from its stop to the relaunched process's first step (x1_common.restarts).
    bands = restart_bands(record.raw.get("wall_hours", []), (restart_cost or {}).get("restarts", []))

    injected = record.flagged("spike_injected")
    window = (injected[0], injected[-1]) if injected else None
    flagged = set(record.flagged("spike"))  # spike_loss holds the injected steps' losses too
    from x1_common.contracts import MLFLOW_FORECAST_METRICS
    from x1_pretrain.forecast import history_from_series

    plots.loss_curve(out / "loss-curve.png", record.get("loss"), record.get("val_loss"), band=band,
                     predicted=predicted, title=f"{title}: loss", injection=window,
                     forecast=history_from_series(*(record.get(k) for k in MLFLOW_FORECAST_METRICS)),
                     spikes=[(s, v) for s, v in record.get("spike_loss") if s in flagged])
    plots.gradnorm_curve(out / "gradnorm-curve.png", record.get("grad_norm"), record.get("param_norm"), clip=clip,
                         title=f"{title}: gradient and parameter norms", injection=window,
                         spikes=record.get("spike_grad_norm"))
    wall = record.get("wall_hours")
    plots.throughput_curve(out / "throughput.png", _segments(record.get("tokens_per_sec"), wall, bands), gaps=bands,
                           mfu=_segments(record.get("mfu"), wall, bands), title=f"{title}: throughput")


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


def _float_or_none(v: Any) -> float | None:
    try:
        return float(v)
    except (TypeError, ValueError):
        return None


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
    from x1_pretrain.config import ConfigError, model_config_from_json
    from x1_pretrain.weights import read_metadata

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
    tokens = record.last("tokens_seen")
    tokens_seen = tokens[1] if tokens else record.last_step * float(_float_or_none(train_cfg.get("tokens_per_step")) or 0)
    wall = [v for _, v in record.get("wall_hours")]
    trained = [v for _, v in record.get("train_hours")]
    loss, val = record.last("loss"), record.last("val_loss")
    now_ms = int(time.time() * 1000)
    seed = _number(record.tags.get("x1.seed")) if "x1.seed" in record.tags else train_cfg.get("seed")
    manifest: dict[str, Any] = {
        "format": MANIFEST_FORMAT,
        "created_utc": format_utc(utc_now()),
        "mlflow": {"run_id": record.run_id, "run_name": record.run_name, "experiment": record.experiment_name,
                   "experiment_id": record.experiment_id, "status": record.status, "tracking_uri": safe_uri(record.uri)},
        "seed": seed,
        "versions": versions_of(record),
        # each speed lever the config asked for: "on", or "off: why" (x1_pretrain.levers)
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
        "loss_curve_band": list(band),  # shaded on loss-curve.png; the DoD takes its band from `dod --band`
        **predictions(model_cfg, tokens_seen, config.resolved),
        "predicted_vs_band": predicted_vs_band(model_cfg, tokens_seen, band),
        **restart_count(record, events, inputs.events),
        "replans": replans(record),
        "replans_note": ("each change of the total steps on a resume (after a budget stop: the steps that fitted): "
                         "the cosine re-targeted from that step, its learning rate unchanged there"),
        "spikes": spike_summary(record),
        "forecast": forecast_of(record, train_cfg, val[1] if val else None),
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


def export(args: argparse.Namespace) -> tuple[Path, dict[str, Any]]:
    out = Path(args.output)
    if out.exists() and not out.is_dir():
        raise ExportError(f"--output {out} exists and is not a folder")
    if out.is_dir() and any(out.iterdir()) and not args.force:
        raise ExportError(f"--output {out} exists and is not empty: pass --force to replace the exported files "
                          "(files the export does not write, such as spike-postmortem.md, are kept)")
    band = (float(args.band[0]), float(args.band[1]))
    if not band[0] < band[1]:
        raise ExportError(f"--band {band[0]} {band[1]}: LO must be below HI")

    record = load_run(args.mlflow_uri, args.run_id, args.experiment)
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
        write_text_atomic(tmp / "metrics.csv", metrics_csv(record.series), durable=False)
        write_text_atomic(tmp / "mlflow-run-uri.txt", run_uri_text(record), durable=False)
        if inputs.budget is not None:
            _copy_json_scrubbed(inputs.budget, tmp / "budget.json")
        if termination is not None and termination["file"] == "termination.png":
            shutil.copyfile(inputs.termination, tmp / "termination.png")  # type: ignore[arg-type]
            note = inputs.termination.with_name("termination-note.txt")  # type: ignore[union-attr]
            if note.is_file():  # what the person says the screenshot shows: dod's check 6 needs it
                shutil.copyfile(note, tmp / note.name)
        elif termination is not None:
            _copy_json_scrubbed(inputs.termination, tmp / "termination.json")  # type: ignore[arg-type]
        clip = _float_or_none((manifest["config"].get("optim") or {}).get("grad_clip"))
        title = f"{record.run_name or record.run_id[:8]} ({manifest['config_name']})"
        draw_figures(tmp, record, band, manifest["predicted_val_loss"], clip, title, manifest.get("restart_cost"))
        manifest["files"] = {p.name: sha256_file(p) for p in sorted(tmp.iterdir()) if p.is_file()}
        write_json_atomic(tmp / "manifest.json", manifest)  # last: a folder with a manifest is complete
        make_readable(tmp)  # mkdtemp made it private; the run folder is for reading
        for p in tmp.iterdir():
            if p.is_file():
                _fsync_file(p)
        _swap_into_place(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out, manifest


def copy_weights(src: Path, dst: Path) -> str:
    """Copy the weights; returns the copy's sha256. A checkpoint's copy must match the sha256 its
    completion marker recorded: a running trainer may prune that folder while we read it."""
    from x1_pretrain.checkpoint import MARKER

    try:
        shutil.copyfile(src, dst)
        sha = sha256_file(dst)
        marker = src.parent / MARKER
        expected = json.loads(marker.read_text())["files"][src.name] if marker.is_file() else sha
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ExportError(f"{src} changed while it was copied ({e}): is the trainer still running? Export again") from None
    if sha != expected:
        raise ExportError(f"{src} changed while it was copied (sha256 {sha[:12]}, its marker says {expected[:12]}): "
                          "is the trainer still running? Export again")
    return sha


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
    and a name the export writes that an earlier export did not is refused (x1_pretrain.outputs)."""
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
            "short retry, no weights, --output not empty without --force), with a message naming it."
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
    p.add_argument("--band", nargs=2, type=float, metavar=("LO", "HI"), default=DEFAULT_BAND,
                   help="final val loss band shaded on loss-curve.png (default 3.20 3.50, docs/DESIGN.md §8)")
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
