"""Where a (re)started run picks up: the checkpoint to load, the checks that it belongs to this
run, a re-plan of the total steps, the budget stop's note and the optimizer state."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import torch

from x1_common.fsutil import write_json_atomic
from x1_pretrain.checkpoint.store import Checkpointer, CheckpointError, CheckpointRefused, TrainerState
from x1_pretrain.config import RunConfig
from x1_pretrain.train import distributed as D
from x1_pretrain.train import provenance
from x1_pretrain.train.components import DataOrConfigError
from x1_pretrain.train.schedule import lr_at, lr_progress

log = logging.getLogger("x1.train")


def resume_point(args, cfg: RunConfig, checkpointer: Checkpointer, d: D.Dist):
    """The checkpoint to continue from (None: fresh start), agreed on by every rank.

    --resume-from-latest takes the newest folder that verifies and loads, skipping newer broken
    ones with a warning (docs/DESIGN.md §5). When step folders exist and none of them does, the run is
    refused (exit 2) naming each folder and what is wrong with it: starting over would overwrite
    them, and that is a person's decision, never a relaunch's. Nothing is moved or deleted. A folder
    whose optimizer state is refused (objects whose loading would run code) stops the resume there,
    exit 2: it was written by someone, not damaged, and an older folder is no answer to that."""
    path, problem, loaded = None, None, None
    if d.is_main:
        existing = checkpointer.step_dirs()
        if args.resume_from_latest:
            failed: list[tuple[Path, str]] = []
            for candidate in existing:
                why = checkpointer.verify(candidate)
                if why is None:
                    try:
                        loaded = checkpointer.load(candidate, map_location="cpu")
                    except CheckpointRefused as e:  # written by someone, not damaged: never skipped
                        problem = str(e)
                        break
                    except CheckpointError as e:
                        why = str(e).removeprefix(f"{candidate}: ")
                if why is None:
                    path = candidate
                    break
                failed.append((candidate, why))
            if path is not None:
                for bad, why in failed:
                    log.warning("skipping checkpoint %s: %s", bad, why)
            elif existing and problem is None:
                problem = (f"{checkpointer.root}: none of its {len(existing)} checkpoint folder(s) verifies: "
                           + "; ".join(f"{bad.name}: {why}" for bad, why in failed)
                           + ". Nothing was moved, overwritten or deleted. To start this run over, give a new "
                           "--ckpt-dir, or move these folders away yourself")
        elif existing:
            problem = (f"{checkpointer.root} already holds checkpoints ({existing[0].name}, ...): pass "
                       "--resume-from-latest to continue that run, or give a new --ckpt-dir")
    # Every rank learns rank 0's verdict: a rank that raised alone would leave the others waiting.
    path, problem = D.broadcast_object(d, (str(path) if path else None, problem))
    if problem is not None:
        raise DataOrConfigError(problem)
    if path is None:
        return None
    if loaded is None:  # the other ranks: the folder rank 0 verified and loaded
        try:
            loaded = checkpointer.load(Path(path), map_location="cpu")
        except CheckpointError as e:
            raise DataOrConfigError(str(e)) from None
    if loaded.state.config_hash != cfg.config_hash():
        old_total = total_steps_change(cfg, loaded.state)
        if old_total is not None:
            replan(args, cfg, loaded, old_total)
        else:
            msg = (f"{path}: config hash {loaded.state.config_hash[:12]} differs from this config's "
                   f"{cfg.config_hash()[:12]} (model, optimizer or schedule changed)")
            if not args.allow_config_change:
                raise DataOrConfigError(msg + "; pass --allow-config-change to continue anyway")
            log.warning("%s; continuing (--allow-config-change)", msg)
    if loaded.state.step > cfg.train.total_steps:
        raise DataOrConfigError(
            f"train.total_steps: {cfg.train.total_steps} is below step {loaded.state.step} of the checkpoint "
            f"{loaded.path.name}: a run cannot go back, and its final.safetensors would be rewritten from a later "
            f"step than it says; give --total-steps {loaded.state.step} or more (nothing was written)")
    return loaded


def check_provenance(args, cfg: RunConfig, loaded, corpus: dict[str, Any]) -> None:
    """The checkpoint is this run's, made on this corpus and tracked on this server; changes that a
    flag accepts are recorded in the state (and, through it, on the MLflow run). Exit 2 otherwise."""
    state = loaded.state
    try:
        provenance.check_run(Path(cfg.checkpoint.dir), loaded.path, state.run_id, state.run_started)
        changes = [provenance.check_corpus(loaded.path, state.corpus, corpus, state.step, args.allow_data_change),
                   provenance.check_tracking(loaded.path, (state.config.get("tracking") or {}).get("mlflow_uri"),
                                             state.mlflow_run_id, cfg.tracking.mlflow_uri, state.step,
                                             args.allow_tracking_change)]
    except provenance.ProvenanceError as e:
        raise DataOrConfigError(str(e)) from None
    for change in filter(None, changes):
        log.warning("resuming with another %s than %s's (--allow-%s-change): %s -> %s", change["what"],
                    loaded.path.name, change["what"], change["from"], change["to"])
        state.changes.append(change)
        if change["what"] == "tracking":
            state.mlflow_run_id = None  # a new MLflow run on the new server


BUDGET_STOP_FILE = "budget-stop.json"  # in the checkpoint folder: the last budget stop and the steps that fit


def write_budget_stop(ckpt_root: Path, step: int, total_steps: int, fits: int | None, reason: str,
                      config_hash: str) -> None:
    """What a re-plan is judged against: the step the run stopped at for its budget, its total
    steps then, and the total steps that fit the cap at that reading."""
    from datetime import datetime, timezone

    try:
        write_json_atomic(ckpt_root / BUDGET_STOP_FILE, {
            "step": step, "total_steps": total_steps, "fits_steps": fits, "reason": reason[:1000],
            "config_hash": config_hash, "time_utc": datetime.now(timezone.utc).isoformat(timespec="seconds")})
    except OSError as e:  # the stop stands; a re-plan then needs --allow-config-change
        log.error("%s not written (%s): continuing with fewer steps will need --allow-config-change",
                  ckpt_root / BUDGET_STOP_FILE, e)


def read_budget_stop(ckpt_root: Path) -> dict[str, Any] | None:
    try:
        stop = json.loads((ckpt_root / BUDGET_STOP_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError):
        return None
    ok = isinstance(stop, dict) and all(isinstance(stop.get(k), int) and not isinstance(stop.get(k), bool)
                                        for k in ("step", "total_steps"))
    return stop if ok else None


def total_steps_change(cfg: RunConfig, state: TrainerState) -> int | None:
    """The checkpoint's total steps when they are the only change of the run's math (model, data
    order, optimizer, the rest of the schedule all the same); None otherwise."""
    old = (state.config.get("train") or {}).get("total_steps") if isinstance(state.config, dict) else None
    if not isinstance(old, int) or isinstance(old, bool) or old == cfg.train.total_steps:
        return None
    as_before = cfg.model_copy(update={"train": cfg.train.model_copy(update={"total_steps": old})})
    return old if as_before.config_hash() == state.config_hash else None


def replan(args, cfg: RunConfig, loaded, old_total: int) -> None:
    """A resume whose only change is train.total_steps: a re-plan. Accepted without
    --allow-config-change after a budget stop (or a refused launch) when the new total is no more
    than what fitted the cap then; recorded in the trainer state (then MLflow and the manifest),
    the cosine re-targeted from this step (lr_progress)."""
    from datetime import datetime, timezone

    state, new_total = loaded.state, cfg.train.total_steps
    stop = read_budget_stop(Path(cfg.checkpoint.dir))
    after_stop = stop is not None and stop["step"] >= state.step and stop["total_steps"] == old_total
    fits = stop.get("fits_steps") if after_stop else None
    if after_stop and isinstance(fits, int) and new_total <= fits:
        why = f"budget stop at step {stop['step']} ({stop.get('time_utc')}): --total-steps {fits} fitted the cap"
    elif args.allow_config_change:
        why = "--allow-config-change"
    elif after_stop:
        raise DataOrConfigError(
            f"--total-steps {new_total}: more than the {fits if fits is not None else '(unknown)'} steps that fitted "
            f"the cap at the budget stop of step {stop['step']} ({BUDGET_STOP_FILE} in {cfg.checkpoint.dir}); give "
            f"--total-steps {fits if fits is not None else 'N'} or fewer, or pass --allow-config-change to go over it")
    else:
        raise DataOrConfigError(
            f"{loaded.path}: train.total_steps changed from {old_total} to {new_total} and this run did not stop for "
            f"its budget; pass --allow-config-change to re-plan it anyway (the cosine is re-targeted from step "
            f"{state.step}, the learning rate unchanged there)")
    previous = state.replans[-1] if state.replans else None
    progress = lr_progress(state.step, cfg.optim, old_total, previous)
    lr = lr_at(state.step, cfg.optim, old_total, previous)
    state.replans.append({"step": state.step, "old_total_steps": old_total, "new_total_steps": new_total,
                          "time_utc": datetime.now(timezone.utc).isoformat(timespec="seconds"), "why": why,
                          "lr_at_step": lr, "lr_progress": progress})
    loaded.replanned = True
    state.config_hash = cfg.config_hash()  # the change is recorded: later resumes of this plan need nothing
    log.warning("re-plan at step %d: train.total_steps %d -> %d (%s); the cosine is re-targeted from this step: lr "
                "%.3e here as before, min_lr %.1e at step %d", state.step, old_total, new_total, why, lr,
                cfg.optim.min_lr, new_total)


def optimizer_mismatch(model: torch.nn.Module, state: dict[str, Any]) -> str | None:
    """What in a saved optimizer state does not match `model`'s parameters (a state from a model of
    another width), each tensor named with both shapes; None when every moment fits its parameter."""
    shapes = {name: tuple(p.shape) for name, p in model.named_parameters()}
    per_param = state.get("state")
    if not isinstance(per_param, dict):
        return "no per-parameter 'state' map"
    bad = []
    for name, entry in per_param.items():
        if name not in shapes:
            bad.append(f"{name}: in the file, not a parameter of this model")
            continue
        for key, t in (entry.items() if isinstance(entry, dict) else ()):
            if isinstance(t, torch.Tensor) and t.dim() > 0 and tuple(t.shape) != shapes[name]:
                bad.append(f"{key} of {name}: shape {tuple(t.shape)} in the file, {shapes[name]} in this model")
    if not bad:
        return None
    return "; ".join(bad[:4]) + (f" (and {len(bad) - 4} more)" if len(bad) > 4 else "")


def load_optimizer(model: torch.nn.Module, optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

    if problem := optimizer_mismatch(model, state):  # else AdamW fails at its first step, deep in a kernel
        raise ValueError(problem)
    # The saved groups say how that process ran (fused, foreach); this process decides for itself.
    for group in state.get("param_groups", []):
        for key in ("fused", "foreach", "capturable", "differentiable"):
            group.pop(key, None)
    set_optimizer_state_dict(model, optimizer, optim_state_dict=state,
                             options=StateDictOptions(full_state_dict=True))
