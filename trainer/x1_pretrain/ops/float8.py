"""float8 training (torchao) for the blocks' linear layers: `train.float8: tensorwise | rowwise`.

    problem = float8.unsupported(device)    # None, or a sentence saying why not here
    converted = float8.convert(model, "tensorwise")   # before compile, DDP / FSDP2 and the optimizer

Each nn.Linear inside the blocks (wqkv, wo, w_gate_up, w_down) becomes torchao's Float8Linear: its
input, weight and output gradient are cast to float8 with a dynamic scale (one per tensor, or one
per row for "rowwise") and the forward and both backward matmuls run on the float8 tensor cores.
The master weights stay fp32 under the same names, so checkpoints, model.safetensors and the HF
export are those of a bf16 run. The tied head stays bf16: it is the embedding too, and its logits
feed the loss directly.

Whether it pays depends on the width: the casts cost memory traffic in proportion to the
activations, the saving is in proportion to the matmul FLOPs. At the 50M model's d_model 768 it
measured slower than bf16 on an H200 (docs/PERFORMANCE.md, "float8"), so the shipped configs keep
it off; wider models are where it is for.
"""

from __future__ import annotations

import logging

import torch
import torch.nn as nn

log = logging.getLogger("x1.float8")
# The torchao wheel carries CUDA extensions that float8 training does not use; on a torch build
# other than the one they were compiled for, torchao logs their load failure as a warning that
# would only alarm.
logging.getLogger("torchao").setLevel(logging.ERROR)

# Float8 tensor cores: Ada (8.9: L4, L40S) and Hopper (9.0: H100, H200) onwards; an A100 (8.0) has none.
MIN_CAPABILITY = (8, 9)
TORCHAO_HINT = "pip install torchao==0.18.0 (it needs torch >= 2.11)"


def unsupported(device: torch.device) -> str | None:
    """Why float8 training cannot run on `device`, or None when it can. The CPU runs it (PyTorch
    has a CPU float8 matmul), slowly: that is for tests, not for training."""
    if device.type == "cuda":
        problem = capability_problem(torch.cuda.get_device_name(device), torch.cuda.get_device_capability(device))
        if problem:
            return problem
    try:
        import torchao.float8  # noqa: F401
    except ImportError as e:
        return f"torchao does not import ({e}): {TORCHAO_HINT}"
    return None


def capability_problem(name: str, capability: tuple[int, int]) -> str | None:
    if tuple(capability) >= MIN_CAPABILITY:
        return None
    return (f"{name} is compute capability {capability[0]}.{capability[1]}: float8 matmuls need "
            f"{MIN_CAPABILITY[0]}.{MIN_CAPABILITY[1]} or newer (H100, H200, L4, L40S)")


def eligible(module: nn.Module, fqn: str) -> bool:
    """The blocks' linear layers whose sizes the float8 matmul takes (both multiples of 16)."""
    return (fqn.startswith("layers.") and isinstance(module, nn.Linear)
            and module.in_features % 16 == 0 and module.out_features % 16 == 0)


def convert(model: nn.Module, recipe: str) -> list[str]:
    """Swap the eligible linear layers for Float8Linear in place; returns their names. The
    parameters are the same objects afterwards, so an optimizer may be built before or after."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    linears = {name: m for name, m in model.named_modules() if isinstance(m, nn.Linear)}
    converted = [name for name, m in linears.items() if eligible(m, name)]
    skipped = sorted(set(linears) - set(converted))
    convert_to_float8_training(model, module_filter_fn=eligible, config=Float8LinearConfig.from_recipe_name(recipe))
    log.info("float8 (%s): %d linear layers in float8, the tied head as it was%s", recipe, len(converted),
             f"; also as they were (a size not a multiple of 16): {', '.join(skipped)}" if skipped else "")
    return converted
