"""Weights files: safetensors, fp32, plain parameter names, the model config in the metadata.

One `model.safetensors` or `final.safetensors` is enough to rebuild the model (SPEC §4):

    model = model_from_weights("checkpoints/final.safetensors")

Compile and DDP wrappers add prefixes (`_orig_mod.`, `module.`); they never reach the file.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save as safetensors_bytes

from x1_common.fsutil import write_bytes_atomic
from x1_pretrain.config import ConfigError, ModelConfig, model_config_from_json

MODEL_CONFIG_KEY = "x1.model_config"
FORMAT_KEY = "x1.format"
FORMAT = "x1-llama-v1"
_WRAPPER_PREFIXES = ("_orig_mod.", "module.", "_fsdp_wrapped_module.")


def plain_name(name: str) -> str:
    for prefix in _WRAPPER_PREFIXES:
        name = name.replace(prefix, "")
    return name


def plain_state_dict(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """fp32, contiguous, CPU copies under plain names."""
    return {plain_name(k): v.detach().to("cpu", torch.float32).contiguous() for k, v in state.items()}


def weights_bytes(state: dict[str, torch.Tensor], model_cfg: ModelConfig, extra: dict[str, str] | None = None) -> bytes:
    metadata = {FORMAT_KEY: FORMAT, MODEL_CONFIG_KEY: model_cfg.model_dump_json(), **(extra or {})}
    return safetensors_bytes(plain_state_dict(state), metadata=metadata)


def save_weights(path: str | os.PathLike[str], state: dict[str, torch.Tensor], model_cfg: ModelConfig,
                 extra: dict[str, str] | None = None) -> None:
    write_bytes_atomic(path, weights_bytes(state, model_cfg, extra))


def read_metadata(path: str | os.PathLike[str]) -> dict[str, str]:
    with safe_open(str(path), framework="pt") as f:
        return dict(f.metadata() or {})


def load_weights(path: str | os.PathLike[str]) -> tuple[dict[str, torch.Tensor], ModelConfig, dict[str, str]]:
    """(state dict, model config, metadata). Raises ConfigError when the file carries no config."""
    path = resolve_weights_path(path)
    with safe_open(str(path), framework="pt") as f:
        metadata = dict(f.metadata() or {})
        state = {k: f.get_tensor(k) for k in f.keys()}
    if MODEL_CONFIG_KEY not in metadata:
        raise ConfigError(f"{path}: no {MODEL_CONFIG_KEY} in the safetensors metadata; not an X1 weights file")
    return state, model_config_from_json(metadata[MODEL_CONFIG_KEY]), metadata


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


def describe(path: str | os.PathLike[str]) -> dict:
    meta = read_metadata(path)
    return {k: (json.loads(v) if k == MODEL_CONFIG_KEY else v) for k, v in meta.items()}
