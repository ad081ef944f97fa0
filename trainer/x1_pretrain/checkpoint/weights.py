"""Weights files: safetensors, fp32, plain parameter names, the model config in the metadata.

One `model.safetensors` or `final.safetensors` is enough to rebuild the model (docs/DESIGN.md §4):

    model = model_from_weights("checkpoints/final.safetensors")   # checkpoint/load.py

Compile and DDP wrappers add prefixes (`_orig_mod.`, `module.`); they never reach the file.

All our metadata sits under one key, "x1", as sorted JSON: safetensors writes its metadata map in
an order that changes from process to process, and a file must come out byte-identical every time
it is written from the same weights (bit-exact resume, the DoD's round trip).
"""

from __future__ import annotations

import json
import logging
import os
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save as safetensors_bytes

from x1_common.contracts import parse_json_strict
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


def read_weights(path: str | os.PathLike[str]) -> tuple[dict[str, torch.Tensor], ModelConfig, dict[str, Any]]:
    """(state dict, model config, metadata) of one weights file. Raises ConfigError when the file
    carries no config. `load.load_weights` takes a checkpoint folder too."""
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
