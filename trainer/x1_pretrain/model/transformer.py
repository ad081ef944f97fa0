"""The 50M Llama-style decoder (docs/DESIGN.md §4): RMSNorm, SwiGLU, RoPE, grouped-query attention, tied
embedding and head, vocab padded to a tensor-core-friendly size.

Parameter names are plain and stable (`tok_emb.weight`, `layers.3.attn.wqkv.weight`, ...): they
are the names in model.safetensors. Q, K and V share one matmul (`wqkv`), gate and up share one
(`w_gate_up`): fewer, larger kernels. RoPE uses the rotate-half layout of Hugging Face's Llama, so
the export needs no permutation of the Q/K rows.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from x1_pretrain.config import ModelConfig
from x1_pretrain.ops import cublaslt
from x1_pretrain.ops.kernels import normed_linear, rope_qkv, swiglu, wgrad_accumulate
from x1_pretrain.ops.losses import fused_cross_entropy, head_cross_entropy

try:  # flash-attn, where installed, runs only when the config asks (model.attention); SDPA is the same math
    from flash_attn import flash_attn_func  # type: ignore[import-not-found]
except Exception:  # noqa: BLE001 - an ImportError, or a CUDA/driver mismatch at import
    flash_attn_func = None

_SDPA_HAS_GQA = "enable_gqa" in (F.scaled_dot_product_attention.__doc__ or "")


def attention_backend(cfg: ModelConfig, device: torch.device) -> str:
    """'flash-attn' or 'sdpa', honouring the config and what this machine can do."""
    if cfg.attention == "sdpa" or device.type != "cuda":
        return "sdpa"
    if flash_attn_func is None:
        if cfg.attention == "flash-attn":
            warnings.warn("attention=flash-attn but flash-attn does not import here: using PyTorch SDPA", stacklevel=2)
        return "sdpa"
    return "flash-attn"


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in fp32 whatever the autocast dtype, as Llama does; the compiler fuses the casts.
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


def rope_tables(head_dim: int, max_len: int, base: float, device: torch.device | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin of shape (max_len, head_dim), rotate-half layout (angle i repeated at i and i + hd/2)."""
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float64, device=device) / head_dim))
    t = torch.arange(max_len, dtype=torch.float64, device=device)
    freqs = torch.outer(t, inv_freq)
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().float(), emb.sin().float()


def rope_kernel_fits(head_dim: int, n_kv_head: int) -> bool:
    """Whether kernels.rope_qkv takes this shape: Triton's ranges are powers of two, and the kernel
    spans half a head and the whole key/value width (a 288-wide model's 96 does not fit)."""
    def pow2(n: int) -> bool:
        return n > 0 and n & (n - 1) == 0
    return pow2(head_dim // 2) and pow2(head_dim * n_kv_head)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x: (B, T, H, hd); cos/sin: (T, hd) broadcast over batch and heads
    cos = cos[None, :, None, :].to(x.dtype)
    sin = sin[None, :, None, :].to(x.dtype)
    x1, x2 = x.chunk(2, dim=-1)
    rotated = torch.cat((-x2, x1), dim=-1)
    return x * cos + rotated * sin


@dataclass
class KVCache:
    """Keys and values of the tokens seen so far, per layer, for generation."""

    k: list[torch.Tensor]  # per layer (B, max_len, n_kv_head, hd)
    v: list[torch.Tensor]
    pos: int = 0

    @classmethod
    def empty(cls, cfg: ModelConfig, batch: int, max_len: int, device: torch.device, dtype: torch.dtype) -> KVCache:
        shape = (batch, max_len, cfg.n_kv_head, cfg.head_dim)
        return cls(
            k=[torch.zeros(shape, device=device, dtype=dtype) for _ in range(cfg.n_layer)],
            v=[torch.zeros(shape, device=device, dtype=dtype) for _ in range(cfg.n_layer)],
        )


# ---- bf16 weights taken once per optimizer step -------------------------------------------------


class _Bf16Copy(torch.autograd.Function):
    """A weight's bf16 copy (`Bf16Weights`) in place of the cast autocast takes at each micro-step:
    the same values forward, and backward the cast's gradient, the copy's as the weight's dtype."""

    @staticmethod
    def forward(ctx, weight: torch.Tensor, copy: torch.Tensor) -> torch.Tensor:
        ctx.dtype = weight.dtype
        return copy.view_as(copy)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad.to(ctx.dtype), None


class _LinearIntoAcc(torch.autograd.Function):
    """x @ copy.T whose weight gradient is added into `acc`, an fp32 buffer that `Bf16Weights`
    turns into the weight's .grad after the step's last micro-step (`kernels.wgrad_accumulate`):
    autograd gets no gradient for the weight."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, copy: torch.Tensor, acc: torch.Tensor, lt: bool) -> torch.Tensor:
        x = x.to(copy.dtype)  # what autocast does to a linear layer's input
        ctx.save_for_backward(x, copy, acc)
        ctx.lt = lt
        return cublaslt.matmul(x, copy.t(), lt)

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        x, copy, acc = ctx.saved_tensors
        wgrad_accumulate(acc, dy, x, ctx.lt)
        return cublaslt.matmul(dy, copy, ctx.lt), None, None, None


def _copy(copies: dict[str, Any] | None, key: str) -> torch.Tensor | None:
    return None if copies is None else copies[key]


def _acc(copies: dict[str, Any] | None, key: str) -> torch.Tensor | None:
    """The fp32 buffer `key`'s weight gradient is added into, when the step accumulates that way."""
    return None if copies is None else copies.get(key + ".acc")


def _linear(x: torch.Tensor, layer: nn.Linear, copies: dict[str, Any] | None, key: str, lt: bool = False
            ) -> torch.Tensor:
    """layer(x), with the weight's bf16 copy for this optimizer step when there is one (and its
    gradient added into an fp32 buffer, when the step accumulates that way). `lt`: the matmuls at
    the cuBLASLt algorithm tuned for them (train.cublaslt), where they run on a GPU."""
    copy, acc = _copy(copies, key), _acc(copies, key)
    if copy is None:
        return layer(x)
    if acc is not None:
        return _LinearIntoAcc.apply(x, copy, acc, lt)
    return F.linear(x, _Bf16Copy.apply(layer.weight, copy))


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.n_head, self.n_kv_head, self.head_dim = cfg.n_head, cfg.n_kv_head, cfg.head_dim
        self.wqkv = nn.Linear(cfg.d_model, (cfg.n_head + 2 * cfg.n_kv_head) * cfg.head_dim, bias=False)
        self.wo = nn.Linear(cfg.n_head * cfg.head_dim, cfg.d_model, bias=False)
        self.backend = "sdpa"
        self.fused = False  # kernels.rope_qkv instead of PyTorch ops (training on CUDA)
        self.lt = False  # tuned cuBLASLt matmuls (Transformer.use_cublaslt)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: KVCache | None = None, layer: int = 0,
        copies: dict[str, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        qkv = _linear(x, self.wqkv, copies, "wqkv", self.lt)
        return _linear(self.attend(qkv, cos, sin, cache, layer), self.wo, copies, "wo", self.lt)

    def attend(self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: KVCache | None = None,
               layer: int = 0, scale: torch.Tensor | None = None) -> torch.Tensor:
        """Attention's output before its projection, (B, T, H hd), from the fused projection qkv
        (B, T, (H + 2 Hkv) hd); `scale` (B, T, 1): a per-token factor of qkv (a folded norm's)."""
        B, T, _ = qkv.shape
        H, Hkv, hd = self.n_head, self.n_kv_head, self.head_dim
        if self.fused and cache is None:
            q, k, v = rope_qkv(qkv, cos, sin, H, Hkv, scale)
        else:  # q and k rotated as one tensor: one kernel each way instead of two
            if scale is not None:
                qkv = (qkv.float() * scale).to(qkv.dtype)
            qk = apply_rope(qkv[..., : (H + Hkv) * hd].view(B, T, H + Hkv, hd), cos, sin)
            q, k = qk.split([H, Hkv], dim=2)  # (B, T, H, hd), (B, T, Hkv, hd)
            v = qkv[..., (H + Hkv) * hd :].view(B, T, Hkv, hd)
        start = 0
        if cache is not None:
            start = cache.pos
            cache.k[layer][:, start : start + T] = k
            cache.v[layer][:, start : start + T] = v
            k, v = cache.k[layer][:, : start + T], cache.v[layer][:, : start + T]
        if self.backend == "flash-attn" and cache is None:
            y = flash_attn_func(q, k, v, causal=True)  # takes (B, T, H, hd), GQA natively
        else:
            y = self._sdpa(q, k, v, start)
        return y.reshape(B, T, self.n_head * self.head_dim)

    def _sdpa(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int) -> torch.Tensor:
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # (B, H, T, hd)
        T, S = q.size(2), k.size(2)
        if self.n_kv_head != self.n_head and not _SDPA_HAS_GQA:  # torch < 2.5
            rep = self.n_head // self.n_kv_head
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        gqa = {"enable_gqa": True} if (self.n_kv_head != self.n_head and _SDPA_HAS_GQA) else {}
        if start == 0 or T == 1:
            # No cache, or one new token that may see everything before it: plain causal / no mask.
            y = F.scaled_dot_product_attention(q, k, v, is_causal=(start == 0 and T > 1), **gqa)
        else:  # several new tokens after a cached prefix: causal mask offset by `start`
            mask = torch.ones(T, S, dtype=torch.bool, device=q.device).tril(diagonal=start)
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, **gqa)
        return y.transpose(1, 2)  # (B, T, H, hd)


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.w_gate_up = nn.Linear(cfg.d_model, 2 * cfg.d_ff, bias=False)
        self.w_down = nn.Linear(cfg.d_ff, cfg.d_model, bias=False)
        self.fused = False  # kernels.swiglu instead of PyTorch ops (training on CUDA)
        self.lt = False  # tuned cuBLASLt matmuls (Transformer.use_cublaslt)

    def forward(self, x: torch.Tensor, copies: dict[str, torch.Tensor] | None = None) -> torch.Tensor:
        gate_up = _linear(x, self.w_gate_up, copies, "w_gate_up", self.lt)
        if self.fused:
            h = swiglu(gate_up)
        else:
            gate, up = gate_up.chunk(2, dim=-1)
            h = F.silu(gate) * up
        return _linear(h, self.w_down, copies, "w_down", self.lt)


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.attn_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.attn = Attention(cfg)
        self.mlp_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.mlp = MLP(cfg)

    def folds_norms(self, cache: KVCache | None = None) -> bool:
        """Whether forward takes the folded path (`_folded`): with the Triton kernels on, outside
        generation, each block's norms are folded into the matmul after them and the kernel after
        that applies the norm's per-token scale (kernels.normed_linear)."""
        return cache is None and self.attn.fused and self.mlp.fused

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: KVCache | None, layer: int,
                copies: dict[str, torch.Tensor] | None = None) -> torch.Tensor:
        """`copies`: this block's bf16 weights for the current optimizer step (`Bf16Weights`), or
        None for autocast's casts."""
        if self.folds_norms(cache):
            return self._folded(x, cos, sin, copies)
        x = x + self.attn(self.attn_norm(x), cos, sin, cache, layer, copies)
        return x + self.mlp(self.mlp_norm(x), copies)

    def _folded(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                copies: dict[str, torch.Tensor] | None) -> torch.Tensor:
        """The same block, its norms folded into wqkv and w_gate_up: the normed activations are
        never written, and RoPE's and SwiGLU's kernels apply the norms' per-token scale."""
        lt = self.attn.lt
        qkv, r = normed_linear(x, self.attn.wqkv.weight, self.attn_norm.weight, self.attn_norm.eps,
                               _copy(copies, "wqkv_folded"), _acc(copies, "wqkv_folded"), lt)
        x = x + _linear(self.attn.attend(qkv, cos, sin, scale=r), self.attn.wo, copies, "wo", lt)
        gate_up, r = normed_linear(x, self.mlp.w_gate_up.weight, self.mlp_norm.weight, self.mlp_norm.eps,
                                   _copy(copies, "w_gate_up_folded"), _acc(copies, "w_gate_up_folded"), lt)
        return x + _linear(swiglu(gate_up, r), self.mlp.w_down, copies, "w_down", lt)


class Transformer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.tok_emb = nn.Embedding(cfg.padded_vocab_size, cfg.d_model)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        cos, sin = rope_tables(cfg.head_dim, cfg.seq_len, cfg.rope_base)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self.fused_loss = False  # losses.fused_cross_entropy instead of an fp32 copy of the logits
        self.lt = False  # tuned cuBLASLt matmuls (use_cublaslt)
        # None: the stream keeps the embedding's dtype (fp32). bf16: cast once after the lookup;
        # under bf16 autocast every block's output is bf16 too, so the whole stream stays bf16.
        self.residual_dtype: torch.dtype | None = None
        self.reset_parameters()

    def reset_parameters(self) -> None:
        cfg = self.cfg
        for name, p in self.named_parameters():
            if p.dim() < 2:
                continue  # norm weights stay at one
            std = cfg.init_std
            if cfg.scaled_residual_init and name.endswith(("attn.wo.weight", "mlp.w_down.weight")):
                std = cfg.init_std / math.sqrt(2 * cfg.n_layer)
            nn.init.normal_(p, mean=0.0, std=std)
        with torch.no_grad():  # padded rows: never an input, their logits are masked out
            self.tok_emb.weight[cfg.vocab_size :].zero_()

    def set_attention_backend(self, backend: str) -> None:
        for block in self.layers:
            block.attn.backend = backend

    def use_cublaslt(self, on: bool) -> None:
        """Every matmul of the training step at the cuBLASLt algorithm timed fastest for its shape
        on this GPU (x1_pretrain.ops.cublaslt; train.cublaslt), where it runs on a GPU in 16 bits."""
        self.lt = on
        for block in self.layers:
            block.attn.lt = block.mlp.lt = on

    def use_kernels(self, on: bool) -> None:
        """Our Triton kernels (cross-entropy, RoPE, SwiGLU) instead of PyTorch's ops; same math.
        RoPE's kernel stays off for a shape it cannot take (`rope_kernel_fits`): PyTorch's ops then."""
        self.fused_loss = on
        rope = on and rope_kernel_fits(self.cfg.head_dim, self.cfg.n_kv_head)
        for block in self.layers:
            block.mlp.fused = on
            block.attn.fused = rope

    def hidden(self, idx: torch.Tensor, cache: KVCache | None = None,
               copies: dict[str, Any] | None = None) -> torch.Tensor:
        """Final normed hidden states (B, T, d_model); `copies` as in forward."""
        T = idx.size(1)
        start = cache.pos if cache is not None else 0
        cos, sin = self.rope_cos[start : start + T], self.rope_sin[start : start + T]
        x = self.tok_emb(idx)  # (B, T, d_model)
        if self.residual_dtype is not None:
            x = x.to(self.residual_dtype)
        for i, block in enumerate(self.layers):
            x = block(x, cos, sin, cache, i, None if copies is None else copies["layers"][i])
        if cache is not None:
            cache.pos += T
        return self.norm(x)

    def logits(self, idx: torch.Tensor, cache: KVCache | None = None) -> torch.Tensor:
        """Logits over the real vocabulary (B, T, vocab_size); padded rows are dropped."""
        h = self.hidden(idx, cache)
        return F.linear(h, self.tok_emb.weight[: self.cfg.vocab_size])

    def forward(self, idx: torch.Tensor, targets: torch.Tensor, copies: dict[str, Any] | None = None) -> torch.Tensor:
        """Mean next-token cross-entropy in fp32. idx, targets: (B, T) int64. `copies`: the bf16
        weights of the current optimizer step (`Bf16Weights.refresh`), or None for autocast's casts."""
        h = self.hidden(idx, copies=copies)
        # The tied head's weight: the embedding's, its step copy, or the copy alone when the head's
        # weight gradient goes into an fp32 buffer rather than through autograd.
        acc = _acc(copies, "head")
        if copies is None:
            w = self.tok_emb.weight
        elif acc is None:
            w = _Bf16Copy.apply(self.tok_emb.weight, copies["head"])
        else:
            w = copies["head"]
        # In training, with the loss kernel on: the head and the loss as one autograd Function whose
        # forward also writes the logits' gradient (losses.head_cross_entropy).
        if self.fused_loss and torch.is_grad_enabled():
            if torch.is_autocast_enabled(h.device.type):  # the casts autocast gives the head's F.linear
                dtype = torch.get_autocast_dtype(h.device.type)
                h, w = h.to(dtype), w.to(dtype)
            return head_cross_entropy(h, w, targets, self.cfg.vocab_size, acc, self.lt)
        logits = F.linear(h, w) if acc is None else _LinearIntoAcc.apply(h, w, acc, self.lt)  # (B, T, padded V); tied head
        if self.fused_loss:
            return fused_cross_entropy(logits, targets, self.cfg.vocab_size)
        # Padded columns never count: slice them off before the softmax.
        logits = logits[..., : self.cfg.vocab_size].float()
        return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))


class Bf16Weights:
    """The bf16 weights of one optimizer step, for its micro-steps to share.

    Under autocast every micro-step casts each fp32 weight to bf16 again (with the norms folded,
    times the norm's weight first): at micro-batch 64, 8 casts per step of weights that change
    only at the optimizer step. `refresh` takes them once; the trainer calls it before each step's
    first micro-step and hands its result to the forward. Only that forward gets them (eval,
    sampling and export never do), so no forward reads copies older than the weights it trains.
    Same values, same gradients: each copy's gradient reaches its fp32 weight as the cast's did.

    With `accumulate`, each copy also has an fp32 buffer that its weight-gradient matmul adds into
    at every micro-step (`kernels.wgrad_accumulate`), and `publish`, after the step's last
    micro-step, turns the buffers into the weights' .grad: a folded product's buffer is split into
    its weight's and its norm's gradients there, once per step; the tied head's is added to the
    embedding's gradient, which autograd accumulates as before.

    Whether a block's copies are folded with its norms follows the path its forward will take
    (`Block.folds_norms`); a block that takes the other path finds no copy under its keys."""

    def __init__(self, model: Transformer, dtype: torch.dtype = torch.bfloat16, accumulate: bool = False):
        self.copies: dict[str, Any] = {"layers": []}
        # copy, its weight, the norm weight folded into it (or None), its fp32 gradient buffer (or None)
        self._sources: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]] = []

        def add(into: dict[str, Any], key: str, weight: torch.Tensor, norm_weight: torch.Tensor | None = None) -> None:
            copy = into[key] = torch.empty_like(weight, dtype=dtype)
            acc = None
            if accumulate:
                acc = into[key + ".acc"] = torch.zeros_like(weight, dtype=torch.float32)
            self._sources.append((copy, weight, norm_weight, acc))

        for block in model.layers:
            attn, mlp, mine = block.attn, block.mlp, {}
            if block.folds_norms():  # the two matmuls after a norm
                add(mine, "wqkv_folded", attn.wqkv.weight, block.attn_norm.weight)
                add(mine, "w_gate_up_folded", mlp.w_gate_up.weight, block.mlp_norm.weight)
            else:
                add(mine, "wqkv", attn.wqkv.weight)
                add(mine, "w_gate_up", mlp.w_gate_up.weight)
            add(mine, "wo", attn.wo.weight)
            add(mine, "w_down", mlp.w_down.weight)
            self.copies["layers"].append(mine)
        add(self.copies, "head", model.tok_emb.weight)
        self.head_weight = model.tok_emb.weight

    @torch.no_grad()
    def refresh(self) -> dict[str, Any]:
        """The copies, taken again from the weights as they are now (after the last optimizer step),
        and the gradient buffers emptied."""
        for copy, weight, norm_weight, acc in self._sources:
            # The fold's product in fp32, then one rounding: what normed_linear computes itself.
            copy.copy_(weight if norm_weight is None else weight.float() * norm_weight.float())
            if acc is not None:
                acc.zero_()
        return self.copies

    @torch.no_grad()
    def publish(self) -> None:
        """The buffers' sums as the weights' .grad, after the step's last micro-step (accumulate)."""
        for _, weight, norm_weight, acc in self._sources:
            if acc is None:
                continue
            if weight is self.head_weight:  # tied: the embedding's own gradient came through autograd
                weight.grad = acc if weight.grad is None else weight.grad.add_(acc)
            elif norm_weight is None:
                weight.grad = acc
            else:  # acc is d(loss)/d(weight * norm_weight)
                weight.grad = acc * norm_weight
                norm_weight.grad = (acc * weight).sum(0)


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Decay on matrices; none on norms and the (tied) embedding (docs/DESIGN.md §5)."""
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        (decay if p.dim() >= 2 and "tok_emb" not in name else no_decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
