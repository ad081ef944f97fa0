"""Checkpoints that survive a kill at any instant (docs/DESIGN.md §5).

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

Every file of a folder is read as untrusted: a marker or a state of the wrong shape, a missing or
extra file, a hash that does not match, a folder that is a file, all make `verify` say what is
wrong, never raise. A save that fails (a full disk above all) removes its partial folder at once
and raises CheckpointError naming the folder; on a full disk CheckpointSpaceError says how much
a checkpoint needs. A save never replaces a folder of the same step that does not verify: that
one is renamed aside (`step_XXXXXXXX.unverified-<time>`), kept as evidence.

Loading never runs code from a file. optimizer.pt is a torch pickle, read with
`torch.load(weights_only=True)`: tensors, numbers, strings and plain containers only, so an
object whose unpickling would call a function is refused (CheckpointRefused, exit 2 naming the
file) rather than run. A sha256 in COMPLETE.json beside the file proves the file is whole, not
who wrote it: a refused file is never skipped for an older checkpoint, it stops the resume. The
weights are safetensors and everything else is JSON, neither of which can carry code.
"""

from __future__ import annotations

import base64
import errno
import hashlib
import io
import json
import logging
import os
import pickle
import random
import re
import shutil
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from x1_common.contracts import format_utc, parse_json_strict, read_file_bytes, read_json_file, utc_now
from x1_common.fsutil import disk_fault, fsync_dir, sha256_file, write_bytes_atomic, write_text_atomic
from x1_pretrain.checkpoint.weights import read_metadata, read_weights, weights_bytes
from x1_pretrain.config import ConfigError, ModelConfig

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
    forecast: dict[str, Any] = field(default_factory=dict)  # the forecast's curve so far and history (x1_pretrain.forecast)
    probes: dict[str, Any] = field(default_factory=dict)  # the cooldown probes done, dropped, skipped (train/probes.py)
    nonfinite_in_row: int = 0
    train_seconds: float = 0.0  # wall seconds spent training, summed over restarts
    run_started: float = 0.0  # unix time of the run's first start (wall hours count from here)
    restarts: int = 0
    created_utc: str = ""
    run_id: str = ""  # the run's identity, the same in every checkpoint of it (x1_pretrain.train.provenance)
    corpus: dict[str, Any] = field(default_factory=dict)  # the corpus trained on: dir, fingerprint, token counts
    changes: list[dict[str, Any]] = field(default_factory=list)  # corpus or tracking changes a flag accepted
    # Each change of train.total_steps on a resume (train.replan): step, old and new totals, when,
    # why, and the cosine's progress there (the schedule after it is re-targeted from that step).
    replans: list[dict[str, Any]] = field(default_factory=list)
    # The band the run is judged on (x1_common.scaling.DeclaredBand), fixed before its first step:
    # a resume keeps it whatever its flags say.
    declared_band: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2, sort_keys=True)

    @classmethod
    def from_json(cls, text: str | bytes) -> TrainerState:
        """The state in `text`; CheckpointError naming the field when it is not a trainer state."""
        try:
            data = parse_json_strict(text, what=STATE_FILE)
        except ValueError as e:
            raise CheckpointError(str(e)) from None
        if not isinstance(data, dict):
            raise CheckpointError(f"{STATE_FILE}: not a JSON object")
        for key, kinds in _STATE_FIELDS.items():
            if key not in data:
                if key in _STATE_REQUIRED:
                    raise CheckpointError(f"{STATE_FILE}: field {key!r} missing")
                continue
            value = data[key]
            if isinstance(value, bool) and bool not in kinds or not isinstance(value, kinds):
                raise CheckpointError(f"{STATE_FILE}: field {key!r} is {type(value).__name__}, expected "
                                      f"{' or '.join(k.__name__ for k in kinds)}")
            if key in _STATE_COUNTS and value < 0:
                raise CheckpointError(f"{STATE_FILE}: field {key!r} is negative ({value})")
        known = {f for f in cls.__dataclass_fields__}
        return cls(**{k: v for k, v in data.items() if k in known})


# Types of trainer_state.json's fields, checked before a resume trusts them.
_STATE_FIELDS: dict[str, tuple[type, ...]] = {
    "step": (int,), "tokens_seen": (int,), "config_hash": (str,), "config": (dict,), "sampler": (dict,),
    "mlflow_run_id": (str, type(None)), "world_size": (int,), "micro_batch_size": (int,), "rng": (dict,),
    "spike": (dict,), "forecast": (dict,), "probes": (dict,), "nonfinite_in_row": (int,), "train_seconds": (int, float),
    "run_started": (int, float), "restarts": (int,), "created_utc": (str,), "replans": (list,),
    "run_id": (str,), "corpus": (dict,), "changes": (list,), "declared_band": (dict,),
}
_STATE_REQUIRED = ("step", "tokens_seen", "config_hash", "config", "sampler")
_STATE_COUNTS = ("step", "tokens_seen", "world_size", "micro_batch_size", "nonfinite_in_row", "train_seconds",
                 "restarts")
# The files a complete folder holds besides its marker: the marker must list exactly these.
CHECKPOINT_FILES = (MODEL_FILE, OPTIM_FILE, STATE_FILE)
_SHA256 = re.compile(r"^[0-9a-f]{64}$")


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
    """Restore the RNG states of capture_rng; CheckpointError when `state` is not one."""
    try:
        _restore_rng(state)
    except (KeyError, TypeError, ValueError, RuntimeError, IndexError) as e:
        raise CheckpointError(f"{STATE_FILE}: the RNG states do not restore ({type(e).__name__}: {e})") from None


def _restore_rng(state: dict[str, Any]) -> None:
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
    replanned: bool = False  # this resume changed train.total_steps (train.replan): state.replans[-1]


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be written or read; the message names the folder and the problem."""


class CheckpointSpaceError(CheckpointError):
    """The disk under the checkpoint folder is full."""


class CheckpointRefused(CheckpointError):
    """A file of a verified folder holds what this trainer never writes (objects whose loading would
    run code): someone put it there. Never skipped for an older folder; a person decides. Exit 2."""


# torch.load(weights_only=True) had bypasses up to 2.5.1 (CVE-2025-32434): below 2.6 it is not a
# guarantee, and an optimizer state is not read at all.
SAFE_LOAD_TORCH = (2, 6)


def load_optimizer_file(path: Path, map_location: str | torch.device = "cpu") -> dict[str, Any]:
    """The optimizer state in `path` (optimizer.pt, final-optimizer.pt), read without running code.

    CheckpointRefused naming the file when it holds anything but tensors and plain containers, or
    when this torch cannot refuse such objects safely; CheckpointError when it is not a state."""
    if _torch_version() < SAFE_LOAD_TORCH:
        raise CheckpointRefused(
            f"{path}: not read: torch {torch.__version__} is below {'.'.join(map(str, SAFE_LOAD_TORCH))}, whose "
            "weights-only loading is the one that cannot be made to run code (CVE-2025-32434); upgrade torch")
    try:
        state = torch.load(path, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as e:  # weights_only refused a global or an opcode: nothing ran
        why = str(e).split("\n\n")[-1].strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise CheckpointRefused(
            f"{path}: refused: it holds objects other than tensors and plain containers, which loading would "
            f"run as code ({why[:200]}); the trainer never writes such a file. Nothing in it was run. Move the "
            "folder away (or restore it from a copy you trust), then relaunch") from None
    except (OSError, ValueError, RuntimeError, EOFError) as e:
        raise CheckpointError(f"{path}: does not load ({type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''})"
                              ) from None
    if not isinstance(state, dict):
        raise CheckpointError(f"{path}: does not hold an optimizer state (a {type(state).__name__})")
    return state


def _torch_version() -> tuple[int, int]:
    match = re.match(r"(\d+)\.(\d+)", torch.__version__)
    return (int(match.group(1)), int(match.group(2))) if match else (0, 0)


class Checkpointer:
    def __init__(self, root: str | os.PathLike[str], keep_last: int, model_cfg: ModelConfig):
        self.root = Path(root)
        self.keep_last = keep_last
        self.model_cfg = model_cfg

    # -- saving --

    def save(self, step: int, model_state: dict[str, torch.Tensor], optim_state: dict[str, Any],
             state: TrainerState) -> float:
        """Write step_XXXXXXXX/ completely, then point `latest` at it. Returns seconds taken.

        CheckpointError (CheckpointSpaceError on a full disk) when it cannot: the partial folder
        is gone by then, and the checkpoints already there are untouched."""
        t0 = time.perf_counter()
        name = step_dir_name(step)
        final = self.root / name
        tmp = self.root / f".tmp-{name}-{os.getpid()}"
        state.created_utc = format_utc(utc_now())
        blobs = {
            MODEL_FILE: weights_bytes(model_state, self.model_cfg, {"step": step, "config_hash": state.config_hash}),
            OPTIM_FILE: _torch_bytes(optim_state),
            STATE_FILE: state.to_json().encode(),
        }
        need = sum(len(b) for b in blobs.values())
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            self._remove_dead_temps()  # a killed save's leftovers: space first
            if tmp.exists():
                shutil.rmtree(tmp)
            tmp.mkdir()
            hashes = {}
            for fname, data in blobs.items():
                hashes[fname] = hashlib.sha256(data).hexdigest()
                _write_durable(tmp / fname, data)
            marker = {"step": step, "files": hashes, "complete_utc": format_utc(utc_now())}
            _write_durable(tmp / MARKER, json.dumps(marker, indent=2).encode())  # last: the folder is now complete
            fsync_dir(tmp)
            if final.exists() or final.is_symlink():  # the same step saved again (e.g. SIGTERM right after a periodic save)
                problem = self.verify(final)
                if problem is None:
                    shutil.rmtree(final)
                else:
                    aside = final.with_name(f"{name}.unverified-{time.strftime('%Y%m%dT%H%M%S')}")
                    log.warning("%s does not verify (%s): renamed to %s, not overwritten", final, problem, aside.name)
                    os.rename(final, aside)
            os.rename(tmp, final)
            fsync_dir(self.root)
            write_text_atomic(self.root / "latest", name + "\n")
        except OSError as e:
            shutil.rmtree(tmp, ignore_errors=True)
            raise self._write_error(e, f"checkpoint {name}", need) from None
        self._prune()
        return time.perf_counter() - t0

    def _write_error(self, e: OSError, what: str, need: int) -> CheckpointError:
        fault = disk_fault(e, self.root, need=need, what=what)
        if fault is not None:  # full, over quota, read-only: x1_common's one line, then what it means here
            kind = CheckpointSpaceError if e.errno in (errno.ENOSPC, errno.EDQUOT) else CheckpointError
            return kind(f"{fault}: {what} not written; the older checkpoints are untouched")
        return CheckpointError(f"{what} not written to {self.root}: {e.strerror or e}")

    def check_space(self, need: int) -> None:
        """CheckpointSpaceError when the disk under root cannot hold `need` more bytes (one more
        checkpoint): found at start-up, before the hours of training a failed save would waste."""
        free = free_gb(self.root) * 1e9
        if free < need:
            raise CheckpointSpaceError(
                f"no space left on device at {self.root}, need {need / 1e9:.2f} GB for the next checkpoint, "
                f"{free / 1e9:.2f} GB free: free some space (older runs, logs), then relaunch")

    def save_final(self, model_state: dict[str, torch.Tensor], optim_state: dict[str, Any], step: int,
                   config_hash: str) -> None:
        """final.safetensors + final-optimizer.pt. An existing final of another step is replaced
        only with a warning that names both steps (a run extended with a larger --total-steps)."""
        weights = self.root / FINAL_WEIGHTS
        if weights.is_file():
            try:
                old_step = read_metadata(weights).get("step")
            except Exception as e:  # noqa: BLE001 - any unreadable final is replaced, and said so
                old_step = f"unreadable ({e})"
            if old_step != step:
                log.warning("replacing %s of step %s with the weights of step %d", weights, old_step, step)
        optim_blob = _torch_bytes(optim_state)
        weights_blob = weights_bytes(model_state, self.model_cfg, {"step": step, "config_hash": config_hash})
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            write_bytes_atomic(self.root / FINAL_OPTIM, optim_blob)
            write_bytes_atomic(weights, weights_blob)
        except OSError as e:
            raise self._write_error(e, FINAL_WEIGHTS, len(optim_blob) + len(weights_blob)) from None

    def _prune(self) -> None:
        # The marker alone, not every hash: a save must stay within a spot instance's 5 s notice.
        complete = [p for p in self.step_dirs() if (p / MARKER).is_file()]
        for old in complete[self.keep_last :]:
            shutil.rmtree(old, ignore_errors=True)
        self._remove_dead_temps()

    def _remove_dead_temps(self) -> None:
        for tmp in self.root.glob(".tmp-step_*"):  # left by a process killed mid-save
            pid = tmp.name.rsplit("-", 1)[-1]
            if pid.isdigit() and int(pid) != os.getpid() and not _pid_alive(int(pid)):
                shutil.rmtree(tmp, ignore_errors=True)

    # -- loading --

    def step_dirs(self) -> list[Path]:
        """Entries named step_XXXXXXXX, newest first (a file of that name too: verify says what it is)."""
        try:
            entries = list(self.root.iterdir()) if self.root.is_dir() else []
        except OSError:
            return []
        return sorted((p for p in entries if STEP_DIR.match(p.name)), key=lambda p: p.name, reverse=True)

    def verify(self, path: Path) -> str | None:
        """None when complete and every hash matches; else what is wrong, in words. Never raises."""
        if not path.is_dir():
            return "not a folder"
        try:
            data = read_json_file(path / MARKER, max_bytes=1 << 20)
        except FileNotFoundError:
            return "no completion marker (incomplete save)"
        except ValueError as e:
            return f"unreadable completion marker ({str(e).removeprefix(str(path / MARKER) + ': ')})"
        files = data.get("files") if isinstance(data, dict) else None
        if not isinstance(files, dict):
            return f"completion marker of the wrong shape (no 'files' object: {_short(data)})"
        match = STEP_DIR.match(path.name)
        step = data.get("step")
        if match and (not isinstance(step, int) or isinstance(step, bool) or step != int(match.group(1))):
            return f"completion marker says step {_short(step)}, the folder is {path.name}"
        if sorted(files) != sorted(CHECKPOINT_FILES):
            return f"completion marker lists {sorted(files)}, expected {list(CHECKPOINT_FILES)}"
        for fname in CHECKPOINT_FILES:
            expected = files[fname]
            if not isinstance(expected, str) or not _SHA256.match(expected):
                return f"completion marker's sha256 of {fname} is not a hash ({_short(expected)})"
            f = path / fname
            if not f.is_file():
                return f"{fname} missing"
            try:
                actual = sha256_file(f)
            except OSError as e:
                return f"{fname} unreadable ({e.strerror or e})"
            if actual != expected:
                return f"{fname} does not match its sha256"
        try:
            state = TrainerState.from_json(read_file_bytes(path / STATE_FILE))
        except (CheckpointError, OSError, ValueError) as e:
            return f"{e}"
        if match and state.step != int(match.group(1)):
            return f"{STATE_FILE} says step {state.step}, the folder is {path.name}"
        return None

    def verify_all(self) -> tuple[Path | None, list[tuple[Path, str]]]:
        """(the newest folder that verifies or None, [(folder, what is wrong)] for each newer one)."""
        failed: list[tuple[Path, str]] = []
        for path in self.step_dirs():
            problem = self.verify(path)
            if problem is None:
                return path, failed
            failed.append((path, problem))
        return None, failed

    def newest_verified(self) -> Path | None:
        for path in self.step_dirs():
            problem = self.verify(path)
            if problem is None:
                return path
            log.warning("skipping checkpoint %s: %s", path, problem)
        return None

    def load(self, path: Path, map_location: str | torch.device = "cpu") -> Loaded:
        """A verified folder's contents; CheckpointError naming the folder when any part will not load."""
        try:
            model_state, _, _ = read_weights(path / MODEL_FILE)
            optim_state = load_optimizer_file(path / OPTIM_FILE, map_location)
            state = TrainerState.from_json(read_file_bytes(path / STATE_FILE))
        except CheckpointRefused:
            raise
        except CheckpointError as e:  # the optimizer file's errors name it already
            raise (e if str(e).startswith(str(path)) else CheckpointError(f"{path}: {e}")) from None
        except (ConfigError, OSError, ValueError, RuntimeError, EOFError) as e:
            raise CheckpointError(f"{path}: does not load ({type(e).__name__}: {e})") from None
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


def free_gb(path: Path) -> float:
    """Free GB on the filesystem of `path` (or of its nearest existing parent); inf if unknown."""
    probe = Path(path)
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    try:
        return shutil.disk_usage(probe).free / 1e9
    except OSError:
        return float("inf")


def _short(v: Any) -> str:
    text = repr(v)
    return text if len(text) <= 60 else text[:57] + "..."


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
