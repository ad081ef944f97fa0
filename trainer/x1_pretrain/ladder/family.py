"""The rungs' models and their training settings, scaled from the run's own config.

A rung is the target's model made smaller: the same block (RMSNorm, SwiGLU, RoPE, tied embedding),
the same ratios (query heads per key/value head, SwiGLU width per model width), the same vocabulary,
context and tokenizer; only the width and the depth change, together, so that width / depth stays
the target's (768 / 8 = 96 for the 50M config). That is what "the same model family" means here,
and `model_family` writes it down for the provenance check.

Per-size training settings follow one stated rule, anchored at the target's own settings (the run
a ladder predicts is trained as its config says, so the rungs are scaled from it, not from
somebody else's tuned values), with the exponents of Porian et al. 2024 as OLMo-core's ladder uses them:

    peak lr          lr_target * (N / N_target) ^ (-1/3)
    tokens per step  tpp_target * (N / N_target) ^ (2/3), down to a whole number of windows, >= 8 windows
    warm-up          the target's share of its run (its warm-up steps / the steps the main run will
                     train, not the config's total_steps), of the rung's own steps
    AdamW beta2      0.99 where a step holds <= 128 windows of 1024 tokens (Porian: small batches need the
                     longer average), else the target's
    cosine floor     the target's floor as a share of its peak

N here counts every parameter (the embedding included). `ladder run --lr-sweep` checks the lr rule
on the smallest size (x0.5, x1, x2); docs/SCALING.md gives what it found.
"""

from __future__ import annotations

from dataclasses import dataclass

from x1_pretrain.config import ModelConfig, RunConfig
from x1_pretrain.train.accounting import flops_per_token, param_counts

LR_EXPONENT = -1.0 / 3.0
BATCH_EXPONENT = 2.0 / 3.0
MIN_WINDOWS_PER_STEP = 8
SMALL_BATCH_TOKENS = 128 * 1024  # at or under this many tokens per step, AdamW's beta2 is 0.99
SMALL_BATCH_BETA2 = 0.99


def model_family(m: ModelConfig) -> str:
    """What a rung shares with its target, in one string (ladder.json's provenance)."""
    return m.family


MIN_HEAD_DIM = 16  # a power of two, as the target's: the fused RoPE kernel works on half a head a lane


def _head_dim(d_model: int, groups: int, preferred: int) -> int:
    """The target's head dim where the width allows it, else the largest power of two >= 16 that does
    (the fused RoPE kernel takes power-of-two head dims only)."""
    hd = preferred
    while hd >= min(MIN_HEAD_DIM, preferred):
        if d_model % (hd * groups) == 0 and hd & (hd - 1) == 0:
            return hd
        hd //= 2
    raise ValueError(f"d_model {d_model}: no power-of-two head dim >= {MIN_HEAD_DIM} gives a whole number of "
                     f"{groups}-head groups")


def scaled_model(target: ModelConfig, d_model: int) -> ModelConfig:
    """The target's model at width `d_model`, its depth keeping the target's width / depth."""
    groups = target.n_head // target.n_kv_head
    aspect = target.d_model / target.n_layer
    n_layer = max(1, round(d_model / aspect))
    hd = _head_dim(d_model, groups, target.head_dim)
    n_head = d_model // hd
    ff_ratio = target.d_ff / target.d_model
    d_ff = max(8, int(round(d_model * ff_ratio / 8)) * 8)
    return target.model_copy(update={"n_layer": n_layer, "d_model": d_model, "n_head": n_head,
                                     "n_kv_head": n_head // groups, "d_ff": d_ff})


def widths_for(target: ModelConfig, count: int, smallest: int | None = None) -> list[int]:
    """The `count` largest widths below the target's whose key/value width (d_model / query heads
    per kv head) is a power of two, as the fused attention kernels need (the 50M model's 256): for
    the 50M model 48, 96, 192 and 384. `smallest` raises the floor."""
    groups = target.n_head // target.n_kv_head
    widths, w = [], groups * 16
    while w < target.d_model:
        if w >= (smallest or 0):
            widths.append(w)
        w *= 2
    return widths[-count:]


@dataclass(frozen=True)
class Recipe:
    """One rung's training settings (what the trainer gets through --set)."""

    lr: float
    min_lr: float
    tokens_per_step: int
    micro_batch_size: int
    warmup_steps: int
    total_steps: int
    beta2: float

    def sets(self) -> list[str]:
        return [f"optim.lr={self.lr:.6g}", f"optim.min_lr={self.min_lr:.6g}", f"optim.warmup_steps={self.warmup_steps}",
                f"optim.beta2={self.beta2:g}", f"train.tokens_per_step={self.tokens_per_step}",
                f"train.micro_batch_size={self.micro_batch_size}"]


def recipe(target: RunConfig, model: ModelConfig, tokens: float, lr_scale: float = 1.0, *,
           main_total_steps: int) -> Recipe:
    """The rule above, for a rung of `model` trained on `tokens`, the main run `main_total_steps` long
    (asked for, not read from the config: its total_steps is the lab's figure, not what the run buys)."""
    n_t, n = param_counts(target.model)["total"], param_counts(model)["total"]
    ratio = n / n_t
    seq = model.seq_len
    windows = max(MIN_WINDOWS_PER_STEP, int(target.train.tokens_per_step * ratio ** BATCH_EXPONENT) // seq)
    windows = min(windows, target.train.tokens_per_step // seq)
    micro = min(target.train.micro_batch_size, windows)
    while windows % micro:
        micro -= 1
    tps = windows * seq
    total = max(1, int(round(tokens / tps)))
    share = min(1.0, target.optim.warmup_steps / main_total_steps)
    lr = target.optim.lr * ratio ** LR_EXPONENT * lr_scale
    beta2 = SMALL_BATCH_BETA2 if tps <= SMALL_BATCH_TOKENS else target.optim.beta2
    return Recipe(lr=lr, min_lr=lr * target.optim.min_lr / target.optim.lr, tokens_per_step=tps,
                  micro_batch_size=micro, warmup_steps=min(total, int(round(share * total))), total_steps=total,
                  beta2=beta2)


@dataclass(frozen=True)
class SizeFacts:
    d_model: int
    n_layer: int
    n_params: int
    n_params_nonembedding: int
    flops_per_token: float


def size_facts(model: ModelConfig) -> SizeFacts:
    c = param_counts(model)
    return SizeFacts(model.d_model, model.n_layer, c["total"], c["non_embedding"], flops_per_token(model))
