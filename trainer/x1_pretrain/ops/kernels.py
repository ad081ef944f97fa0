"""Hand-written Triton kernels for the two elementwise steps the compiler does poorly here.

The profile of one training step on an H200 (docs/PERFORMANCE.md) showed two of inductor's
generated kernels far from memory bandwidth: the backward of RoPE, where the gradients of q, k and
v are rotated back and concatenated into the gradient of the fused qkv projection (index
arithmetic and masked loads for every element: ~5x over the bytes it moves), and the backward of
SwiGLU (~2x). Both are pure data movement with a few flops, so a kernel over tiles of
(tokens x head_dim) or (tokens x d_ff) reaches the bandwidth.

    q, k, v = rope_qkv(qkv, cos, sin, n_head, n_kv_head)   # qkv: (B, T, (H + 2 Hkv) hd)
    h = swiglu(gate_up)                                   # gate_up: (B, T, 2 d_ff)

Both are torch.library custom ops (opaque to torch.compile) with a plain PyTorch path that runs
wherever Triton does not (the CPU, tests). Math in fp32, stored in the input's dtype.

Both also take an optional per-row `scale`: the 1 / rms of the norm before their matmul, which
`normed_linear` leaves to them (the norm folded into its neighbours, below), so that the normed
activations are never written.
"""

from __future__ import annotations

import os
from typing import Optional  # the custom ops' schemas: torch reads Optional[Tensor] on every version we run

import torch
import torch.nn.functional as F

from x1_pretrain.ops import cublaslt

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only torch builds have no Triton
    triton = None


# The Triton interpreter (TRITON_INTERPRET=1, read by Triton when a kernel is defined) runs the
# same kernels on CPU tensors through numpy: the tests check the GPU code with it on machines
# without a GPU.
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


def triton_device(device: torch.device) -> bool:
    """Whether tensors on `device` go through the Triton kernels."""
    return triton is not None and (device.type == "cuda" or INTERPRET)


def triton_ok(t: torch.Tensor) -> bool:
    return triton_device(t.device)


# ---- RoPE on the fused qkv projection --------------------------------------------------------

# One program: BLOCK_N tokens, every head. The cos and sin of its tokens are loaded once for all
# 16 rotated heads, and each head is read as its two halves, so no element is loaded twice (one
# program per head, the kernels before 2026-12-02, read 32 KB of fp32 tables from L2 for 8 KB of
# bf16 data: 109 -> 96 us forward, 113 -> 99 us backward per layer and micro-batch on an H200).
# The tables repeat each angle at i and i + hd/2 (rotate-half layout, `model.rope_tables`): the
# first half of each row is enough.
ROPE_LAUNCH = {"BLOCK_N": 32, "num_warps": 4}  # tokens per program, warps

if triton is not None:

    @triton.jit
    def _rope_fwd_kernel(qkv_ptr, cos_ptr, sin_ptr, q_ptr, k_ptr, v_ptr, scale_ptr, N, T,
                         H: tl.constexpr, HKV: tl.constexpr, HD: tl.constexpr, BLOCK_N: tl.constexpr,
                         HAS_SCALE: tl.constexpr):
        half: tl.constexpr = HD // 2
        n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        mask = (n < N)[:, None]
        n64 = n.to(tl.int64)[:, None]
        d = tl.arange(0, half)[None, :]
        t = (n % T)[:, None]
        c = tl.load(cos_ptr + t * HD + d, mask=mask, other=0.0)
        s = tl.load(sin_ptr + t * HD + d, mask=mask, other=0.0)
        if HAS_SCALE:  # a row's scale multiplies the rotation: both are linear
            r = tl.load(scale_ptr + n, mask=n < N, other=0.0)[:, None]
            c, s = c * r, s * r
        row = qkv_ptr + n64 * ((H + 2 * HKV) * HD)
        for j in tl.static_range(H + HKV):
            x1 = tl.load(row + j * HD + d, mask=mask, other=0.0).to(tl.float32)
            x2 = tl.load(row + j * HD + half + d, mask=mask, other=0.0).to(tl.float32)
            if j < H:
                dst = q_ptr + n64 * (H * HD) + j * HD
            else:
                dst = k_ptr + n64 * (HKV * HD) + (j - H) * HD
            tl.store(dst + d, (x1 * c - x2 * s).to(q_ptr.dtype.element_ty), mask=mask)  # rotate-half: (-x2, x1)
            tl.store(dst + half + d, (x2 * c + x1 * s).to(q_ptr.dtype.element_ty), mask=mask)
        e = tl.arange(0, HKV * HD)[None, :]
        v = tl.load(row + (H + HKV) * HD + e, mask=mask, other=0.0)
        if HAS_SCALE:
            v = (v.to(tl.float32) * r).to(v_ptr.dtype.element_ty)
        tl.store(v_ptr + n64 * (HKV * HD) + e, v, mask=mask)

    @triton.jit
    def _rope_bwd_kernel(dq_ptr, dk_ptr, dv_ptr, cos_ptr, sin_ptr, scale_ptr, out_ptr, N, T,
                         qb, qt, qh, qd, kb, kt, kh, kd, vb, vt, vh, vd,
                         H: tl.constexpr, HKV: tl.constexpr, HD: tl.constexpr, BLOCK_N: tl.constexpr,
                         HAS_SCALE: tl.constexpr):
        # Gradients arrive in whatever layout attention's backward wrote them (strides given);
        # the output is the contiguous gradient of the qkv projection.
        half: tl.constexpr = HD // 2
        n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        mask = (n < N)[:, None]
        b = (n // T).to(tl.int64)[:, None]
        t = (n % T)[:, None]
        d = tl.arange(0, half)[None, :]
        c = tl.load(cos_ptr + t * HD + d, mask=mask, other=0.0)
        s = tl.load(sin_ptr + t * HD + d, mask=mask, other=0.0)
        if HAS_SCALE:  # as in the forward: the scale rides on cos and sin, and on v's copy below
            r = tl.load(scale_ptr + n, mask=n < N, other=0.0)[:, None]
            c, s = c * r, s * r
        out = out_ptr + n.to(tl.int64)[:, None] * ((H + 2 * HKV) * HD)
        for j in tl.static_range(H + 2 * HKV):
            if j < H:
                src = dq_ptr + b * qb + t * qt + j * qh
                g1 = tl.load(src + d * qd, mask=mask, other=0.0).to(tl.float32)
                g2 = tl.load(src + (half + d) * qd, mask=mask, other=0.0).to(tl.float32)
            elif j < H + HKV:
                src = dk_ptr + b * kb + t * kt + (j - H) * kh
                g1 = tl.load(src + d * kd, mask=mask, other=0.0).to(tl.float32)
                g2 = tl.load(src + (half + d) * kd, mask=mask, other=0.0).to(tl.float32)
            else:
                src = dv_ptr + b * vb + t * vt + (j - H - HKV) * vh
                g1 = tl.load(src + d * vd, mask=mask, other=0.0).to(tl.float32)
                g2 = tl.load(src + (half + d) * vd, mask=mask, other=0.0).to(tl.float32)
            if j < H + HKV:  # the transpose of the rotation: (g2, -g1)
                o1, o2 = g1 * c + g2 * s, g2 * c - g1 * s
            elif HAS_SCALE:
                o1, o2 = g1 * r, g2 * r
            else:
                o1, o2 = g1, g2
            tl.store(out + j * HD + d, o1.to(out_ptr.dtype.element_ty), mask=mask)
            tl.store(out + j * HD + half + d, o2.to(out_ptr.dtype.element_ty), mask=mask)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, sign: float) -> torch.Tensor:
    """x * cos + R(x) * sin in fp32 with R the rotate-half (sign -1) or its transpose (sign +1)."""
    x1, x2 = x.float().chunk(2, dim=-1)
    rotated = torch.cat((sign * x2, -sign * x1), dim=-1)
    return x.float() * cos[None, :, None, :] + rotated * sin[None, :, None, :]


def _row_scaled(x: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
    """x (B, T, ...) in fp32, each token's row times its scale (B, T, 1) if there is one."""
    if scale is None:
        return x.float()
    return x.float() * scale.float().reshape(*x.shape[:2], *([1] * (x.dim() - 2)))


def _scale_arg(scale: torch.Tensor | None, like: torch.Tensor) -> tuple[torch.Tensor, bool]:
    """A kernel's scale pointer and its HAS_SCALE switch: without a scale, any pointer (never read)."""
    if scale is None:
        return like, False
    assert scale.dtype == torch.float32 and scale.is_contiguous(), "the row scale: contiguous fp32, one per token"
    return scale, True


@torch.library.custom_op("x1::rope_qkv", mutates_args=())
def rope_qkv(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, n_head: int, n_kv_head: int,
             scale: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # noqa: UP045
    """Split the fused projection (B, T, (H + 2 Hkv) hd) into rotated q (B, T, H, hd), rotated
    k (B, T, Hkv, hd) and v (B, T, Hkv, hd); cos/sin: (T, hd) fp32, rotate-half layout, each angle
    at i and i + hd/2 (`model.rope_tables`; the kernels read the first half). With `scale`
    (B, T, 1) fp32, each token's q, k and v are also multiplied by its scale, a constant to autograd."""
    B, T, C = qkv.shape
    hd = C // (n_head + 2 * n_kv_head)
    if not triton_ok(qkv):
        x = _row_scaled(qkv, scale).view(B, T, n_head + 2 * n_kv_head, hd)
        q, k, v = x.split([n_head, n_kv_head, n_kv_head], dim=2)
        return (_rotate(q, cos, sin, -1.0).to(qkv.dtype), _rotate(k, cos, sin, -1.0).to(qkv.dtype),
                v.to(qkv.dtype).contiguous())
    qkv = qkv.contiguous()
    q = qkv.new_empty(B, T, n_head, hd)
    k = qkv.new_empty(B, T, n_kv_head, hd)
    v = qkv.new_empty(B, T, n_kv_head, hd)
    grid = (triton.cdiv(B * T, ROPE_LAUNCH["BLOCK_N"]),)
    scale_ptr, has_scale = _scale_arg(scale, qkv)
    _rope_fwd_kernel[grid](qkv, cos, sin, q, k, v, scale_ptr, B * T, T, H=n_head, HKV=n_kv_head, HD=hd,
                           HAS_SCALE=has_scale, **ROPE_LAUNCH)
    return q, k, v


@rope_qkv.register_fake
def _(qkv, cos, sin, n_head, n_kv_head, scale=None):
    B, T, C = qkv.shape
    hd = C // (n_head + 2 * n_kv_head)
    return qkv.new_empty(B, T, n_head, hd), qkv.new_empty(B, T, n_kv_head, hd), qkv.new_empty(B, T, n_kv_head, hd)


@torch.library.custom_op("x1::rope_qkv_backward", mutates_args=())
def rope_qkv_backward(dq: torch.Tensor, dk: torch.Tensor, dv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                      scale: Optional[torch.Tensor] = None) -> torch.Tensor:  # noqa: UP045
    """Gradient of the fused projection: the rotations undone (and the row scale applied),
    q | k | v concatenated."""
    B, T, H, hd = dq.shape
    Hkv = dk.size(2)
    if not triton_ok(dq):
        parts = [_rotate(dq, cos, sin, 1.0), _rotate(dk, cos, sin, 1.0), dv.float()]
        return _row_scaled(torch.cat(parts, dim=2), scale).to(dq.dtype).reshape(B, T, (H + 2 * Hkv) * hd)
    out = dq.new_empty(B, T, (H + 2 * Hkv) * hd)
    grid = (triton.cdiv(B * T, ROPE_LAUNCH["BLOCK_N"]),)
    scale_ptr, has_scale = _scale_arg(scale, dq)
    _rope_bwd_kernel[grid](dq, dk, dv, cos, sin, scale_ptr, out, B * T, T, *dq.stride(), *dk.stride(), *dv.stride(),
                           H=H, HKV=Hkv, HD=hd, HAS_SCALE=has_scale, **ROPE_LAUNCH)
    return out


@rope_qkv_backward.register_fake
def _(dq, dk, dv, cos, sin, scale=None):
    B, T, H, hd = dq.shape
    return dq.new_empty(B, T, (H + 2 * dk.size(2)) * hd)


def _constant_scale(scale: torch.Tensor | None) -> None:
    if scale is not None and scale.requires_grad:
        raise ValueError("the row scale is a constant to these ops: pass it detached (normed_linear returns it so)")


def _rope_setup(ctx, inputs, output) -> None:
    _, cos, sin, _, _, scale = inputs
    _constant_scale(scale)
    ctx.save_for_backward(cos, sin, scale)


def _rope_backward(ctx, dq, dk, dv):
    cos, sin, scale = ctx.saved_tensors
    return rope_qkv_backward(dq, dk, dv, cos, sin, scale), None, None, None, None, None


rope_qkv.register_autograd(_rope_backward, setup_context=_rope_setup)


# ---- SwiGLU ------------------------------------------------------------------------------------

if triton is not None:

    @triton.jit
    def _swiglu_fwd_kernel(gu_ptr, h_ptr, scale_ptr, total, F_: tl.constexpr, BLOCK: tl.constexpr,
                           HAS_SCALE: tl.constexpr):
        i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = i < total
        row, col = i // F_, i % F_
        g = tl.load(gu_ptr + row * (2 * F_) + col, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(gu_ptr + row * (2 * F_) + F_ + col, mask=mask, other=0.0).to(tl.float32)
        if HAS_SCALE:
            r = tl.load(scale_ptr + row, mask=mask, other=0.0)
            g, u = g * r, u * r
        h = g * tl.sigmoid(g) * u
        tl.store(h_ptr + i, h.to(h_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _swiglu_bwd_kernel(gu_ptr, dh_ptr, dgu_ptr, scale_ptr, total, F_: tl.constexpr, BLOCK: tl.constexpr,
                           HAS_SCALE: tl.constexpr):
        i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = i < total
        row, col = i // F_, i % F_
        g = tl.load(gu_ptr + row * (2 * F_) + col, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(gu_ptr + row * (2 * F_) + F_ + col, mask=mask, other=0.0).to(tl.float32)
        dh = tl.load(dh_ptr + i, mask=mask, other=0.0).to(tl.float32)
        if HAS_SCALE:  # the gradient at the scaled gate and up, then through the scale
            r = tl.load(scale_ptr + row, mask=mask, other=0.0)
            g, u, dh = g * r, u * r, dh * r
        sig = tl.sigmoid(g)
        silu = g * sig
        dg = dh * u * sig * (1.0 + g * (1.0 - sig))
        du = dh * silu
        tl.store(dgu_ptr + row * (2 * F_) + col, dg.to(dgu_ptr.dtype.element_ty), mask=mask)
        tl.store(dgu_ptr + row * (2 * F_) + F_ + col, du.to(dgu_ptr.dtype.element_ty), mask=mask)


SWIGLU_LAUNCH = {"BLOCK": 2048, "num_warps": 8}  # elements per program, warps


@torch.library.custom_op("x1::swiglu", mutates_args=())
def swiglu(gate_up: torch.Tensor, scale: Optional[torch.Tensor] = None) -> torch.Tensor:  # noqa: UP045
    """silu(gate) * up for gate_up = [gate | up] along the last dim; with `scale` (B, T, 1) fp32,
    of gate and up each multiplied by its token's scale, a constant to autograd."""
    if not triton_ok(gate_up):
        gate, up = _row_scaled(gate_up, scale).chunk(2, dim=-1)
        return (F.silu(gate) * up).to(gate_up.dtype)
    gate_up = gate_up.contiguous()
    f = gate_up.size(-1) // 2
    h = gate_up.new_empty(*gate_up.shape[:-1], f)
    total = h.numel()
    scale_ptr, has_scale = _scale_arg(scale, gate_up)
    _swiglu_fwd_kernel[(triton.cdiv(total, SWIGLU_LAUNCH["BLOCK"]),)](gate_up, h, scale_ptr, total, F_=f,
                                                                      HAS_SCALE=has_scale, **SWIGLU_LAUNCH)
    return h


@swiglu.register_fake
def _(gate_up, scale=None):
    return gate_up.new_empty(*gate_up.shape[:-1], gate_up.size(-1) // 2)


@torch.library.custom_op("x1::swiglu_backward", mutates_args=())
def swiglu_backward(gate_up: torch.Tensor, dh: torch.Tensor, scale: Optional[torch.Tensor] = None) -> torch.Tensor:  # noqa: UP045
    if not triton_ok(gate_up):
        gate, up = _row_scaled(gate_up, scale).chunk(2, dim=-1)
        sig = torch.sigmoid(gate)
        dg = dh.float() * up * sig * (1 + gate * (1 - sig))
        du = dh.float() * gate * sig
        return _row_scaled(torch.cat((dg, du), dim=-1), scale).to(gate_up.dtype)
    dh = dh.contiguous()
    dgu = torch.empty_like(gate_up)
    total = dh.numel()
    scale_ptr, has_scale = _scale_arg(scale, gate_up)
    _swiglu_bwd_kernel[(triton.cdiv(total, SWIGLU_LAUNCH["BLOCK"]),)](gate_up, dh, dgu, scale_ptr, total, F_=dh.size(-1),
                                                                      HAS_SCALE=has_scale, **SWIGLU_LAUNCH)
    return dgu


@swiglu_backward.register_fake
def _(gate_up, dh, scale=None):
    return torch.empty_like(gate_up)


def _swiglu_setup(ctx, inputs, output) -> None:
    _constant_scale(inputs[1])
    ctx.save_for_backward(inputs[0], inputs[1])


def _swiglu_bwd(ctx, dh):
    gate_up, scale = ctx.saved_tensors
    return swiglu_backward(gate_up.contiguous(), dh, scale), None


swiglu.register_autograd(_swiglu_bwd, setup_context=_swiglu_setup)


# ---- RMSNorm folded into the matmul that reads it ---------------------------------------------
#
# A block's norm feeds one matmul, whose output feeds RoPE or SwiGLU. RMSNorm(x) @ W.T with norm
# weight w is r * (x @ (W * w).T), r = 1 / rms(x) per token: so the matmul can read the stream x
# itself, the kernel after it applies r, and the normed activations are never written, read back
# or kept for the backward (100 MB each way per norm and 65,536-token micro-batch).


class _NormedLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                folded: torch.Tensor | None, acc: torch.Tensor | None, lt: bool):
        dtype = torch.get_autocast_dtype(x.device.type) if torch.is_autocast_enabled(x.device.type) else x.dtype
        r = torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps)
        if folded is None:  # else the step's copy (model.Bf16Weights): the same product, taken once per step
            folded = (weight.float() * norm_weight.float()).to(dtype)
        z = cublaslt.matmul(x.to(dtype), folded.t(), lt)
        ctx.lt = lt
        ctx.mark_non_differentiable(r)
        ctx.save_for_backward(x, weight, norm_weight, folded, r, acc)
        return z, r

    @staticmethod
    def backward(ctx, dz: torch.Tensor, _dr: torch.Tensor | None):
        # dz arrives already multiplied by r (the consumer's backward applied it). The loss reaches
        # x through the matmul and through r; r's gradient, sum_j dy_j z_j, equals x . (dz @ W') / r,
        # so it comes from the matmul's input gradient rather than another pass over z.
        x, weight, norm_weight, folded, r, acc = ctx.saved_tensors
        dx_lin = cublaslt.matmul(dz, folded, ctx.lt)
        xf, g = x.float(), dx_lin.float()
        dx = g - xf * (r * r) * (xf * g).mean(-1, keepdim=True)  # d r / d x = -r^3 x / D
        if acc is not None:  # the folded product's gradient summed over the step in fp32, split once per step
            wgrad_accumulate(acc, dz, x.to(dz.dtype), ctx.lt)
            return dx.to(x.dtype), None, None, None, None, None, None
        d_folded = dz.reshape(-1, dz.size(-1)).t() @ x.reshape(-1, x.size(-1)).to(dz.dtype)
        d_folded = d_folded.float()
        d_weight, d_norm_weight = d_folded * norm_weight.float(), (d_folded * weight.float()).sum(0)
        return dx.to(x.dtype), d_weight.to(weight.dtype), d_norm_weight.to(norm_weight.dtype), None, None, None, None


def normed_linear(x: torch.Tensor, weight: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                  folded: torch.Tensor | None = None, acc: torch.Tensor | None = None, lt: bool = False
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """(z, r) with RMSNorm(x; norm_weight, eps) @ weight.T == r * z: z = x @ (weight * norm_weight).T
    in the compute dtype, r (..., 1) fp32 the norm's 1 / rms per token.

    r comes back as a constant to autograd, for `rope_qkv` or `swiglu` to apply as their `scale`:
    the gradient through r is computed here, which holds only if z goes to exactly one of them,
    with this r as its scale. `folded`: (weight * norm_weight) in the compute dtype, when the caller
    took it already for this optimizer step; its gradient goes to weight and norm_weight, or with
    `acc` (fp32, weight's shape) is added into acc, from which the caller takes weight's and
    norm_weight's gradients once per step (model.Bf16Weights.publish). `lt`: its matmuls at their
    tuned cuBLASLt algorithm (train.cublaslt)."""
    return _NormedLinear.apply(x, weight, norm_weight, eps, folded, acc, lt)


# ---- weight gradients added into fp32 by their matmul ----------------------------------------
#
# Under gradient accumulation each micro-step's weight-gradient matmul writes a bf16 gradient,
# which a second kernel reads, casts and adds into the fp32 .grad (~2.7 ms per step at micro-batch
# 64 on an H200, docs/PERFORMANCE.md, call 43). cuBLAS can add into an fp32 matrix itself (C fp32,
# beta = 1), as Megatron-LM's gradient-accumulation fusion does: the bf16 gradient is never written
# and each micro-step's sum stays in fp32.

addmm_into_fp32 = cublaslt.addmm_into_fp32  # the probe lives beside cuBLASLt's tuning, which needs it too


@torch.library.custom_op("x1::wgrad_accumulate", mutates_args=("acc",))
def wgrad_accumulate(acc: torch.Tensor, grad_out: torch.Tensor, inp: torch.Tensor, lt: bool = False) -> None:
    """acc += grad_out^T @ inp, summed in fp32: a linear layer's weight gradient (out, in) added
    into its fp32 accumulator. grad_out (..., out) and inp (..., in) in the compute dtype. `lt`: at
    the tuned cuBLASLt algorithm (train.cublaslt), where it can run."""
    g, x = grad_out.reshape(-1, grad_out.size(-1)), inp.reshape(-1, inp.size(-1))
    if lt and cublaslt.use_for(g) and acc.is_contiguous():
        cublaslt.tuned_addmm_(acc, g.t(), x)
    elif addmm_into_fp32(acc.device):
        torch.addmm(acc, g.t(), x, out_dtype=torch.float32, out=acc)
    else:  # the CPU, or a torch without it: the product in the inputs' dtype, then the add, as autograd's
        acc.add_(g.t() @ x)  # accumulation computes it (an fp32 product would cost 4 bytes per logit for the head)


@wgrad_accumulate.register_fake
def _(acc, grad_out, inp, lt=False) -> None:
    return None
