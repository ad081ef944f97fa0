"""A model from whatever a person points at: a .safetensors file, a step_XXXXXXXX/ folder, or a
checkpoint dir (its final, else its newest checkpoint that verifies). Above the file format
(weights.py) and the store (store.py), which it uses to find a checkpoint that verifies."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from x1_common.contracts import read_file_bytes
from x1_pretrain.checkpoint.store import MARKER, MODEL_FILE, STEP_DIR, Checkpointer
from x1_pretrain.checkpoint.weights import log, read_weights, state_mismatch
from x1_pretrain.config import ConfigError, ModelConfig
from x1_pretrain.model.transformer import Transformer


def load_weights(path: str | os.PathLike[str]) -> tuple[dict[str, torch.Tensor], ModelConfig, dict[str, Any]]:
    """(state dict, model config, metadata) from a weights file or a folder (resolve_weights_path)."""
    return read_weights(resolve_weights_path(path))


def resolve_weights_path(path: str | os.PathLike[str]) -> Path:
    """A .safetensors file, a step_XXXXXXXX/ folder, or a checkpoint dir (its final, else its
    newest checkpoint that verifies).

    A step folder is used only when it verifies (its completion marker's hashes match), so a
    reader never builds a model from a torn save (a folder named explicitly that holds a
    model.safetensors and no marker at all is taken as it is, with a warning). The `latest` pointer is a hint only: when it
    is unreadable, names no step folder or names one that does not verify, the newest folder
    that verifies is taken, with a warning naming what was skipped. ConfigError when the path
    holds nothing usable, naming what was found wrong; FileNotFoundError when it does not exist."""
    p = Path(path)
    if p.is_file():
        return p
    if not p.exists():
        raise FileNotFoundError(f"{p}: no weights file (no such file or folder)")
    if not p.is_dir():
        raise ConfigError(f"{p}: not a weights file nor a folder")
    ckpt = Checkpointer(p.parent if STEP_DIR.match(p.name) or (p / MARKER).exists() else p, 1, ModelConfig())
    if (p / MARKER).exists() or (p / MARKER).is_symlink():  # a step folder as the trainer writes it
        problem = ckpt.verify(p)
        if problem is not None:
            raise ConfigError(f"{p}: checkpoint does not verify: {problem}")
        return p / MODEL_FILE
    if (p / MODEL_FILE).is_file():  # a folder someone assembled: theirs to vouch for
        log.warning("%s has no %s: its %s is used unverified", p, MARKER, MODEL_FILE)
        return p / MODEL_FILE
    if (p / "final.safetensors").is_file():
        return p / "final.safetensors"
    pointed = None
    try:
        text = read_file_bytes(p / "latest", max_bytes=4096).decode("utf-8").strip()
        pointed = text if STEP_DIR.match(text) else None
    except (OSError, ValueError):
        pass
    skipped = []
    if pointed is not None:
        problem = ckpt.verify(p / pointed)
        if problem is None:
            return p / pointed / MODEL_FILE
        skipped.append(f"{pointed} (named by latest): {problem}")
    newest, failed = ckpt.verify_all()
    skipped += [f"{d.name}: {why}" for d, why in failed if d.name != pointed]
    if newest is not None:
        if skipped:
            log.warning("%s: using %s; skipped %s", p, newest.name, "; ".join(skipped))
        return newest / MODEL_FILE
    if skipped:
        raise ConfigError(f"{p}: no final.safetensors and no checkpoint that verifies ({'; '.join(skipped)})")
    raise FileNotFoundError(f"{p}: no weights file (expected a .safetensors file, a step_* folder or a checkpoint dir)")

def model_from_weights(path: str | os.PathLike[str], device: str | torch.device = "cpu"):
    state, cfg, _ = load_weights(path)
    model = Transformer(cfg)
    try:
        model.load_state_dict(state, strict=True)
    except RuntimeError:  # tensors missing, extra or of other shapes than the config says
        raise ConfigError(f"{path}: the weights do not fit the model config in its metadata: "
                          f"{state_mismatch(model, state)}") from None
    return model.to(device)

