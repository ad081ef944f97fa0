"""The run's facts for its manifest: config, end, weights, budget, cluster, predictions, forecast,
spikes, restarts and their cost, each read from the run record and the files beside it."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from x1_common import restarts
from x1_common.contracts import (
    END_REASONS,
    MLFLOW_FORECAST_METRICS,
    MLFLOW_RESTART,
    MLFLOW_SPIKE,
    MLFLOW_SPIKE_INJECTED,
    BudgetFormatError,
    end_reason,
    format_utc,
    read_budget_file,
)
from x1_common.restarts import Start
from x1_pretrain.checkpoint.store import FINAL_WEIGHTS, MODEL_FILE, STATE_FILE, Checkpointer, TrainerState
from x1_pretrain.checkpoint.weights import read_metadata
from x1_pretrain.config import ConfigError, ModelConfig, config_from_dict
from x1_pretrain.run.plan import band_note
from x1_pretrain.run.record import ExportError, RunRecord
from x1_pretrain.train.accounting import CHINCHILLA, param_counts, predicted_loss
from x1_pretrain.train.forecast import forecast_summary, history_from_series

REQUIRED_VERSIONS = ("torch", "flash-attn", "transformers", "numpy", "tiktoken", "mlflow")

log = logging.getLogger("x1.export_run")


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
    history = history_from_series(*(record.get(k) for k in MLFLOW_FORECAST_METRICS))
    total = _float_or_none(train_cfg.get("total_steps"))
    return forecast_summary(history, int(total) if total else None, final)


def spike_summary(record: RunRecord) -> dict[str, Any]:
    injected = record.flagged(MLFLOW_SPIKE_INJECTED)
    skipped = record.flagged("spike_injection_skipped")
    return {
        # MLflow steps count completed steps: the batches of step N show at N+1.
        "injected_at_step": injected[0] - 1 if injected else (skipped[0] if skipped else None),
        "injected_mlflow_steps": injected,
        "injection_skipped": bool(skipped),
        "injection_note": record.tags.get("x1.spike_injection"),
        "detected_mlflow_steps": record.flagged(MLFLOW_SPIKE),
    }


def restart_count(record: RunRecord, events: list[dict[str, Any]], events_path: Path | None) -> dict[str, Any]:
    # Raw entries, not surviving ones: two resumes from the same checkpoint log `restart` twice at one step.
    from_mlflow = record.logged.get(MLFLOW_RESTART, 0)
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


def _float_or_none(v: Any) -> float | None:
    try:
        return float(v)
    except (TypeError, ValueError):
        return None
