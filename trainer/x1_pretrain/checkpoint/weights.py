"""Weights files: safetensors, fp32, plain parameter names, the model config in the metadata.

One `model.safetensors` or `final.safetensors` is enough to rebuild the model (docs/DESIGN.md §4):

    model = model_from_weights("checkpoints/final.safetensors")

Compile and DDP wrappers add prefixes (`_orig_mod.`, `module.`); they never reach the file.

All our metadata sits under one key, "x1", as sorted JSON: safetensors writes its metadata map in
an order that changes from process to process, and a file must come out byte-identical every time
it is written from the same weights (bit-exact resume, the DoD's round trip).
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save as safetensors_bytes

from x1_common.contracts import parse_json_strict, read_file_bytes
from x1_common.fsutil import write_bytes_atomic
from x1_pretrain.config import ConfigError, ModelConfig, model_config_from_json

log = logging.getLogger("x1.weights")

METADATA_KEY = "x1"
FORMAT = "x1-llama-v1"
_WRAPPER_PREFIXES = ("_orig_mod.", "module.", "_fsdp_wrapped_module.")


def plain_name(name: str) -> str:
    for prefix in _WRAPPER_PREFIXES:
        name = name.replace(prefix, "")
    return name


def plain_state_dict(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """fp32, contiguous, CPU copies under plain names."""
    return {plain_name(k): v.detach().to("cpu", torch.float32).contiguous() for k, v in state.items()}


def weights_bytes(state: dict[str, torch.Tensor], model_cfg: ModelConfig, extra: dict[str, Any] | None = None) -> bytes:
    meta = {"format": FORMAT, "model_config": model_cfg.model_dump(mode="json"), **(extra or {})}
    return safetensors_bytes(plain_state_dict(state), metadata={METADATA_KEY: json.dumps(meta, sort_keys=True)})


def save_weights(path: str | os.PathLike[str], state: dict[str, torch.Tensor], model_cfg: ModelConfig,
                 extra: dict[str, Any] | None = None) -> None:
    write_bytes_atomic(path, weights_bytes(state, model_cfg, extra))


def _open(path: str | os.PathLike[str]):
    try:
        return safe_open(str(path), framework="pt")
    except (SafetensorError, OSError, ValueError) as e:  # truncated, corrupt, not safetensors, unreadable
        raise ConfigError(f"{path}: not a readable safetensors file: {e}") from None


def read_metadata(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Our metadata ({"format", "model_config", "step", ...}); {} for a file that has none.
    ConfigError for metadata that is not a JSON object."""
    with _open(path) as f:
        raw = (f.metadata() or {}).get(METADATA_KEY)
    if not raw:
        return {}
    try:
        meta = parse_json_strict(raw, what=f"{METADATA_KEY!r} metadata")
    except ValueError as e:
        raise ConfigError(f"{path}: unreadable {e}") from None
    if not isinstance(meta, dict):
        raise ConfigError(f"{path}: {METADATA_KEY!r} metadata is not a JSON object")
    return meta


def load_weights(path: str | os.PathLike[str]) -> tuple[dict[str, torch.Tensor], ModelConfig, dict[str, Any]]:
    """(state dict, model config, metadata). Raises ConfigError when the file carries no config."""
    path = resolve_weights_path(path)
    metadata = read_metadata(path)
    if "model_config" not in metadata:
        raise ConfigError(f"{path}: no model config in the safetensors metadata; not an X1 weights file")
    if not isinstance(metadata["model_config"], dict):
        raise ConfigError(f"{path}: the model config in the safetensors metadata is not an object")
    cfg = model_config_from_json(json.dumps(metadata["model_config"]))
    with _open(path) as f:
        try:
            state = {k: f.get_tensor(k) for k in f.keys()}
        except (SafetensorError, OSError, ValueError, RuntimeError) as e:
            raise ConfigError(f"{path}: not a readable safetensors file: {e}") from None
    return state, cfg, metadata


def resolve_weights_path(path: str | os.PathLike[str]) -> Path:
    """A .safetensors file, a step_XXXXXXXX/ folder, or a checkpoint dir (its final, else its
    newest checkpoint that verifies).

    A step folder is used only when it verifies (its completion marker's hashes match), so a
    reader never builds a model from a torn save (a folder named explicitly that holds a
    model.safetensors and no marker at all is taken as it is, with a warning). The `latest` pointer is a hint only: when it
    is unreadable, names no step folder or names one that does not verify, the newest folder
    that verifies is taken, with a warning naming what was skipped. ConfigError when the path
    holds nothing usable, naming what was found wrong; FileNotFoundError when it does not exist."""
    from x1_pretrain.checkpoint.store import MARKER, MODEL_FILE, STEP_DIR, Checkpointer

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


def state_mismatch(model: torch.nn.Module, state: dict[str, torch.Tensor], where: str = "the file") -> str:
    """What keeps `state` from loading into `model`, each tensor named with both shapes (as
    hf_export names them): "tok_emb.weight: shape (512, 64) in the file, (512, 128) in this model"."""
    expected = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    shapes = [f"{name}: shape {tuple(state[name].shape)} in {where}, {shape} in this model"
              for name, shape in expected.items() if name in state and tuple(state[name].shape) != shape]
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    parts = _listed(shapes, "")
    if missing:
        parts += _listed(missing, f"missing from {where}: ")
    if unexpected:
        parts += _listed(unexpected, f"in {where}, not in this model: ")
    return "; ".join(parts) or "no tensor differs in name or shape"


def _listed(items: list[str], prefix: str, most: int = 4) -> list[str]:
    if not items:
        return []
    more = f" (and {len(items) - most} more)" if len(items) > most else ""
    return [prefix + ", ".join(items[:most]) + more]


def model_from_weights(path: str | os.PathLike[str], device: str | torch.device = "cpu"):
    from x1_pretrain.model.transformer import Transformer

    state, cfg, _ = load_weights(path)
    model = Transformer(cfg)
    try:
        model.load_state_dict(state, strict=True)
    except RuntimeError:  # tensors missing, extra or of other shapes than the config says
        raise ConfigError(f"{path}: the weights do not fit the model config in its metadata: "
                          f"{state_mismatch(model, state)}") from None
    return model.to(device)
