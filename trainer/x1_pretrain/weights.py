"""Weights files: safetensors, fp32, plain parameter names, the model config in the metadata.

One `model.safetensors` or `final.safetensors` is enough to rebuild the model (SPEC §4):

    model = model_from_weights("checkpoints/final.safetensors")

Compile and DDP wrappers add prefixes (`_orig_mod.`, `module.`); they never reach the file.

All our metadata sits under one key, "x1", as sorted JSON: safetensors writes its metadata map in
an order that changes from process to process, and a file must come out byte-identical every time
it is written from the same weights (bit-exact resume, the DoD's round trip).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save as safetensors_bytes

from x1_common.fsutil import write_bytes_atomic
from x1_pretrain.config import ConfigError, ModelConfig, model_config_from_json

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
    except SafetensorError as e:  # truncated, corrupt, or not safetensors at all
        raise ConfigError(f"{path}: not a readable safetensors file: {e}") from None


def read_metadata(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Our metadata ({"format", "model_config", "step", ...}); {} for a file that has none."""
    with _open(path) as f:
        raw = (f.metadata() or {}).get(METADATA_KEY)
    try:
        return json.loads(raw) if raw else {}
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path}: unreadable {METADATA_KEY!r} metadata: {e}") from None


def load_weights(path: str | os.PathLike[str]) -> tuple[dict[str, torch.Tensor], ModelConfig, dict[str, Any]]:
    """(state dict, model config, metadata). Raises ConfigError when the file carries no config."""
    path = resolve_weights_path(path)
    metadata = read_metadata(path)
    if "model_config" not in metadata:
        raise ConfigError(f"{path}: no model config in the safetensors metadata; not an X1 weights file")
    cfg = model_config_from_json(json.dumps(metadata["model_config"]))
    with _open(path) as f:
        try:
            state = {k: f.get_tensor(k) for k in f.keys()}
        except SafetensorError as e:
            raise ConfigError(f"{path}: not a readable safetensors file: {e}") from None
    return state, cfg, metadata


def resolve_weights_path(path: str | os.PathLike[str]) -> Path:
    """A .safetensors file, a step_XXXXXXXX/ folder, or a checkpoint dir (its final or latest)."""
    p = Path(path)
    if p.is_file():
        return p
    if (p / "model.safetensors").is_file():
        return p / "model.safetensors"
    if (p / "final.safetensors").is_file():
        return p / "final.safetensors"
    latest = p / "latest"
    if latest.is_file():
        step_dir = p / latest.read_text().strip()
        if (step_dir / "model.safetensors").is_file():
            return step_dir / "model.safetensors"
    raise FileNotFoundError(f"{p}: no weights file (expected a .safetensors file, a step_* folder or a checkpoint dir)")


def model_from_weights(path: str | os.PathLike[str], device: str | torch.device = "cpu"):
    from x1_pretrain.model import Transformer

    state, cfg, _ = load_weights(path)
    model = Transformer(cfg)
    model.load_state_dict(state, strict=True)
    return model.to(device)
