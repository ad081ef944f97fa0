"""One loop for 1 or N processes: torchrun sets RANK/WORLD_SIZE, this module does the rest.

    torchrun --standalone --nproc_per_node=2 -m x1_pretrain.train --config ... (same flags)

DDP by default; FSDP2 (`fully_shard`) when the config says `train.distributed: fsdp2`. Rank 0
logs, reads the budget and writes checkpoints; decisions (stop, budget, divergence) are agreed on
with one tiny all-reduce per optimizer step, so every rank leaves the loop at the same step with
the same exit code.

Across hosts (torchrun --nnodes N, trainer/entrypoint.sh's NNODES) nothing changes in the loop:
global rank 0 is the one writer (checkpoints, MLflow, heartbeat, run folder) wherever the
rendezvous put it, and `Dist.node` says which host this is. Every collective gives up after
X1_DIST_TIMEOUT_SECONDS (600 by default): a peer that froze or vanished without closing its
sockets ends the group with an error, which torchrun turns into a group restart or an exit.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import socket
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from x1_pretrain.config import ConfigError

TIMEOUT_ENV = "X1_DIST_TIMEOUT_SECONDS"
# Long enough for rank 0's pre-launch budget wait (5 min) and checkpoint writes, which the other
# ranks wait out in a collective; a dead peer still ends the group, and the group restarts.
TIMEOUT_DEFAULT_S = 600.0


@dataclass(frozen=True)
class Node:
    """Which host of the group this process runs on, as torchrun's rendezvous assigned it."""

    rank: int  # torchrun's GROUP_RANK: 0..nnodes-1, not tied to the rendezvous endpoint's host
    count: int  # nnodes
    hostname: str

    def labels(self) -> dict[str, str]:
        return {"node_rank": str(self.rank), "nnodes": str(self.count), "hostname": self.hostname}


@dataclass(frozen=True)
class Dist:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    node: Node = Node(0, 1, socket.gethostname())

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def enabled(self) -> bool:
        return self.world_size > 1


def pick_device(pref: str, local_rank: int) -> torch.device:
    if pref == "cpu" or (pref == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise RuntimeError("train.device=cuda but no CUDA GPU is visible")
    torch.cuda.set_device(local_rank)
    return torch.device("cuda", local_rank)


def collective_timeout() -> datetime.timedelta:
    """X1_DIST_TIMEOUT_SECONDS, checked (ConfigError: exit 2): how long a collective, and the
    group's init, may wait for the slowest rank."""
    text = os.environ.get(TIMEOUT_ENV, "").strip()
    if not text:
        return datetime.timedelta(seconds=TIMEOUT_DEFAULT_S)
    try:
        seconds = float(text)
    except ValueError:
        seconds = -1.0
    if not 1 <= seconds <= 86400:
        raise ConfigError(f"{TIMEOUT_ENV}={text!r}: expected seconds between 1 and 86400")
    return datetime.timedelta(seconds=seconds)


def init(device_pref: str) -> Dist:
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local = int(os.environ.get("LOCAL_RANK", "0"))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", str(world)))
    node = Node(rank=int(os.environ.get("GROUP_RANK", "0")), count=max(world // max(local_world, 1), 1),
                hostname=socket.gethostname())
    timeout = collective_timeout()
    device = pick_device(device_pref, local)
    if world > 1 and not dist.is_initialized():
        backend = "nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(backend=backend, timeout=timeout)
    return Dist(rank=rank, world_size=world, local_rank=local, device=device, node=node)


def shutdown() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def agree(d: Dist, *codes: int) -> int:
    """The largest code over the given ones and every rank (0 = carry on). Higher codes win:
    77 (exit now) over 76 (checkpoint, stop) over 75 (preempted)."""
    local = max(codes) if codes else 0
    if not d.enabled:
        return local
    t = torch.tensor([local], dtype=torch.int64, device=d.device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return int(t.item())


def mean_over_ranks(d: Dist, value: torch.Tensor) -> torch.Tensor:
    if not d.enabled:
        return value
    value = value.detach().clone()
    dist.all_reduce(value, op=dist.ReduceOp.SUM)
    return value / d.world_size


def broadcast_object(d: Dist, obj: Any) -> Any:
    if not d.enabled:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def barrier(d: Dist) -> None:
    if d.enabled:
        dist.barrier()


def wrap(model: nn.Module, d: Dist, mode: str) -> nn.Module:
    """The module the loop runs: the model itself, DDP around it, or the model sharded by FSDP2."""
    if not d.enabled:
        return model
    if mode == "fsdp2":
        try:
            from torch.distributed.fsdp import fully_shard  # torch >= 2.6
        except ImportError:
            from torch.distributed._composable.fsdp import fully_shard  # torch 2.5
        for block in model.layers:
            fully_shard(block)
        fully_shard(model)
        return model
    from torch.nn.parallel import DistributedDataParallel as DDP

    ids = [d.device.index] if d.device.type == "cuda" else None
    # gradient_as_bucket_view: grads live in the all-reduce buckets, no extra copy per step.
    return DDP(model, device_ids=ids, gradient_as_bucket_view=True)


@contextlib.contextmanager
def maybe_no_sync(model: nn.Module, sync: bool) -> Iterator[None]:
    """Skip the gradient all-reduce on all but the last micro-step of an accumulation. Wrap the
    forward and the backward: FSDP2 reduce-scatters (or not) at the end of the backward."""
    if sync:
        yield
    elif hasattr(model, "no_sync"):  # DDP
        with model.no_sync():
            yield
    elif hasattr(model, "set_requires_gradient_sync"):  # FSDP2
        # Accumulate unsharded gradients locally, and keep the parameters gathered between
        # micro-steps: one all-gather and one reduce-scatter per optimizer step, not per micro-step.
        model.set_requires_gradient_sync(False)
        model.set_reshard_after_backward(False)
        try:
            yield
        finally:
            model.set_requires_gradient_sync(True)
            model.set_reshard_after_backward(True)
    else:
        yield
