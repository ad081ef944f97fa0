"""Checkpoints that survive a kill at any instant (SPEC §5).

    K/step_00001800/
        model.safetensors     fp32, plain names, model config in the metadata
        optimizer.pt          full (consolidated) optimizer state, keyed by parameter name
        trainer_state.json    step, tokens, sampler position, RNG states, config hash, MLflow run id
        COMPLETE.json         sha256 of every file above — written last, after they are fsynced
    K/latest                  "step_00001800", replaced atomically after the folder is complete

A folder is written as `.tmp-step_XXXXXXXX-<pid>/` and renamed only once complete, so a kill
during a save leaves the previous checkpoint as the newest complete one. Loading verifies every
hash; a corrupt or incomplete checkpoint is skipped with a warning naming it. (Peers lost runs to
in-place overwrites and to "latest" pointing at a checkpoint that was not yet durable.)
"""

from __future__ import annotations

import base64
import hashlib
import io
import json
import logging
import os
import random
import re
import shutil
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from x1_common.contracts import format_utc, utc_now
from x1_common.fsutil import fsync_dir, sha256_file, write_bytes_atomic, write_text_atomic
from x1_pretrain.config import ModelConfig
from x1_pretrain.weights import weights_bytes

log = logging.getLogger("x1.checkpoint")

STEP_DIR = re.compile(r"^step_(\d{8})$")
MARKER = "COMPLETE.json"
MODEL_FILE = "model.safetensors"
OPTIM_FILE = "optimizer.pt"
STATE_FILE = "trainer_state.json"
FINAL_WEIGHTS = "final.safetensors"
FINAL_OPTIM = "final-optimizer.pt"


def step_dir_name(step: int) -> str:
    return f"step_{step:08d}"


@dataclass
class TrainerState:
    """Everything besides weights and optimizer that a resume needs to continue bit-exactly."""

    step: int  # optimizer steps completed
    tokens_seen: int
    config_hash: str
    config: dict[str, Any]  # the resolved run config
    sampler: dict[str, Any]  # {"seed", "next_step"}: windows are a pure function of these
    mlflow_run_id: str | None = None
    world_size: int = 1
    micro_batch_size: int = 0
    rng: dict[str, Any] = field(default_factory=dict)
    spike: dict[str, Any] = field(default_factory=dict)  # detector EMA, injection bookkeeping
    nonfinite_in_row: int = 0
    train_seconds: float = 0.0  # wall seconds spent training, summed over restarts
    run_started: float = 0.0  # unix time of the run's first start (wall hours count from here)
    restarts: int = 0
    created_utc: str = ""

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> TrainerState:
        data = json.loads(text)
        known = {f for f in cls.__dataclass_fields__}
        return cls(**{k: v for k, v in data.items() if k in known})


# ---- RNG states: python, numpy, torch CPU, every CUDA device --------------------------------


def _b64(t: torch.Tensor) -> str:
    return base64.b64encode(t.cpu().numpy().tobytes()).decode()


def _unb64(s: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(s)), dtype=torch.uint8)


def capture_rng() -> dict[str, Any]:
    version, internal, gauss = random.getstate()
    np_state = np.random.get_state()
    return {
        "python": [version, list(internal), gauss],
        "numpy": [np_state[0], np_state[1].tolist(), int(np_state[2]), int(np_state[3]), float(np_state[4])],
        "torch": _b64(torch.get_rng_state()),
        "cuda": [_b64(s) for s in torch.cuda.get_rng_state_all()] if torch.cuda.is_available() else [],
    }


def restore_rng(state: dict[str, Any]) -> None:
    if not state:
        return
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    name, key, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, np.array(key, dtype=np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(_unb64(state["torch"]))
    cuda = [_unb64(s) for s in state.get("cuda", [])]
    if cuda and torch.cuda.is_available() and len(cuda) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all(cuda)


# ---- the checkpointer ------------------------------------------------------------------------


@dataclass
class Loaded:
    path: Path
    model_state: dict[str, torch.Tensor]
    optim_state: dict[str, Any]
    state: TrainerState


class CheckpointError(RuntimeError):
    pass


class Checkpointer:
    def __init__(self, root: str | os.PathLike[str], keep_last: int, model_cfg: ModelConfig):
        self.root = Path(root)
        self.keep_last = keep_last
        self.model_cfg = model_cfg

    # -- saving --

    def save(self, step: int, model_state: dict[str, torch.Tensor], optim_state: dict[str, Any],
             state: TrainerState) -> float:
        """Write step_XXXXXXXX/ completely, then point `latest` at it. Returns seconds taken."""
        t0 = time.perf_counter()
        self.root.mkdir(parents=True, exist_ok=True)
        name = step_dir_name(step)
        final = self.root / name
        tmp = self.root / f".tmp-{name}-{os.getpid()}"
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir()
        state.created_utc = format_utc(utc_now())
        blobs = {
            MODEL_FILE: weights_bytes(model_state, self.model_cfg, {"step": step, "config_hash": state.config_hash}),
            OPTIM_FILE: _torch_bytes(optim_state),
            STATE_FILE: state.to_json().encode(),
        }
        hashes = {}
        for fname, data in blobs.items():
            hashes[fname] = hashlib.sha256(data).hexdigest()
            _write_durable(tmp / fname, data)
        marker = {"step": step, "files": hashes, "complete_utc": format_utc(utc_now())}
        _write_durable(tmp / MARKER, json.dumps(marker, indent=2).encode())  # last: the folder is now complete
        fsync_dir(tmp)
        if final.exists():  # the same step saved again (e.g. SIGTERM right after a periodic save)
            shutil.rmtree(final)
        os.rename(tmp, final)
        fsync_dir(self.root)
        write_text_atomic(self.root / "latest", name + "\n")
        self._prune()
        return time.perf_counter() - t0

    def save_final(self, model_state: dict[str, torch.Tensor], optim_state: dict[str, Any], step: int,
                   config_hash: str) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        write_bytes_atomic(self.root / FINAL_OPTIM, _torch_bytes(optim_state))
        write_bytes_atomic(
            self.root / FINAL_WEIGHTS,
            weights_bytes(model_state, self.model_cfg, {"step": step, "config_hash": config_hash}),
        )

    def _prune(self) -> None:
        complete = [p for p in self.step_dirs() if (p / MARKER).is_file()]
        for old in complete[self.keep_last :]:
            shutil.rmtree(old, ignore_errors=True)
        for tmp in self.root.glob(".tmp-step_*"):  # left by a process killed mid-save
            pid = tmp.name.rsplit("-", 1)[-1]
            if pid.isdigit() and int(pid) != os.getpid() and not _pid_alive(int(pid)):
                shutil.rmtree(tmp, ignore_errors=True)

    # -- loading --

    def step_dirs(self) -> list[Path]:
        """step_* folders, newest first."""
        if not self.root.is_dir():
            return []
        dirs = [p for p in self.root.iterdir() if p.is_dir() and STEP_DIR.match(p.name)]
        return sorted(dirs, key=lambda p: p.name, reverse=True)

    def verify(self, path: Path) -> str | None:
        """None when complete and every hash matches; else what is wrong."""
        marker = path / MARKER
        if not marker.is_file():
            return "no completion marker (incomplete save)"
        try:
            files = json.loads(marker.read_text())["files"]
        except (ValueError, KeyError) as e:
            return f"unreadable completion marker ({e})"
        for fname, expected in files.items():
            f = path / fname
            if not f.is_file():
                return f"{fname} missing"
            if sha256_file(f) != expected:
                return f"{fname} does not match its sha256"
        return None

    def newest_verified(self) -> Path | None:
        for path in self.step_dirs():
            problem = self.verify(path)
            if problem is None:
                return path
            log.warning("skipping checkpoint %s: %s", path, problem)
        return None

    def load(self, path: Path, map_location: str | torch.device = "cpu") -> Loaded:
        from x1_pretrain.weights import load_weights

        model_state, _, _ = load_weights(path / MODEL_FILE)
        optim_state = torch.load(path / OPTIM_FILE, map_location=map_location, weights_only=False)
        state = TrainerState.from_json((path / STATE_FILE).read_text())
        return Loaded(path, model_state, optim_state, state)


def _torch_bytes(obj: Any) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def _write_durable(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
