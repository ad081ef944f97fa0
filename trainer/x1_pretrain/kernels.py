"""Hand-written Triton kernels for the two elementwise steps the compiler does poorly here.

The profile of one training step on an H200 (docs/PERFORMANCE.md) showed two of inductor's
generated kernels far from memory bandwidth: the backward of RoPE, where the gradients of q, k and
v are rotated back and concatenated into the gradient of the fused qkv projection (index
arithmetic and masked loads for every element: ~5x over the bytes it moves), and the backward of
SwiGLU (~2x). Both are pure data movement with a few flops, so a kernel over tiles of
(tokens x head_dim) or (tokens x d_ff) reaches the bandwidth.

    q, k, v = rope_qkv(qkv, cos, sin, n_head, n_kv_head)   # qkv: (B, T, (H + 2 Hkv) hd)
    h = swiglu(gate_up)                                   # gate_up: (B, T, 2 d_ff)
    y = swiglu_down(gate_up, w_down)                      # swiglu(gate_up) @ w_down.T

The last is SwiGLU and the down projection as one autograd Function whose backward computes the
down projection's input gradient in a Triton matmul with SwiGLU's backward in its epilogue: the
d_ff-wide gradient between them never goes to memory.

The first two are torch.library custom ops (opaque to torch.compile) with a plain PyTorch path that runs
wherever Triton does not (the CPU, tests). Math in fp32, stored in the input's dtype.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

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
    def _rope_fwd_kernel(qkv_ptr, cos_ptr, sin_ptr, q_ptr, k_ptr, v_ptr, N, T,
                         H: tl.constexpr, HKV: tl.constexpr, HD: tl.constexpr, BLOCK_N: tl.constexpr):
        half: tl.constexpr = HD // 2
        n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        mask = (n < N)[:, None]
        n64 = n.to(tl.int64)[:, None]
        d = tl.arange(0, half)[None, :]
        t = (n % T)[:, None]
        c = tl.load(cos_ptr + t * HD + d, mask=mask, other=0.0)
        s = tl.load(sin_ptr + t * HD + d, mask=mask, other=0.0)
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
        tl.store(v_ptr + n64 * (HKV * HD) + e, v, mask=mask)

    @triton.jit
    def _rope_bwd_kernel(dq_ptr, dk_ptr, dv_ptr, cos_ptr, sin_ptr, out_ptr, N, T,
                         qb, qt, qh, qd, kb, kt, kh, kd, vb, vt, vh, vd,
                         H: tl.constexpr, HKV: tl.constexpr, HD: tl.constexpr, BLOCK_N: tl.constexpr):
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
            else:
                o1, o2 = g1, g2
            tl.store(out + j * HD + d, o1.to(out_ptr.dtype.element_ty), mask=mask)
            tl.store(out + j * HD + half + d, o2.to(out_ptr.dtype.element_ty), mask=mask)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, sign: float) -> torch.Tensor:
    """x * cos + R(x) * sin in fp32 with R the rotate-half (sign -1) or its transpose (sign +1)."""
    x1, x2 = x.float().chunk(2, dim=-1)
    rotated = torch.cat((sign * x2, -sign * x1), dim=-1)
    return x.float() * cos[None, :, None, :] + rotated * sin[None, :, None, :]


@torch.library.custom_op("x1::rope_qkv", mutates_args=())
def rope_qkv(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, n_head: int, n_kv_head: int
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Split the fused projection (B, T, (H + 2 Hkv) hd) into rotated q (B, T, H, hd), rotated
    k (B, T, Hkv, hd) and v (B, T, Hkv, hd); cos/sin: (T, hd) fp32, rotate-half layout, each angle
    at i and i + hd/2 (`model.rope_tables`; the kernels read the first half)."""
    B, T, C = qkv.shape
    hd = C // (n_head + 2 * n_kv_head)
    if not triton_ok(qkv):
        x = qkv.view(B, T, n_head + 2 * n_kv_head, hd)
        q, k, v = x.split([n_head, n_kv_head, n_kv_head], dim=2)
        return (_rotate(q, cos, sin, -1.0).to(qkv.dtype), _rotate(k, cos, sin, -1.0).to(qkv.dtype), v.contiguous())
    qkv = qkv.contiguous()
    q = qkv.new_empty(B, T, n_head, hd)
    k = qkv.new_empty(B, T, n_kv_head, hd)
    v = qkv.new_empty(B, T, n_kv_head, hd)
    grid = (triton.cdiv(B * T, ROPE_LAUNCH["BLOCK_N"]),)
    _rope_fwd_kernel[grid](qkv, cos, sin, q, k, v, B * T, T, H=n_head, HKV=n_kv_head, HD=hd, **ROPE_LAUNCH)
    return q, k, v


@rope_qkv.register_fake
def _(qkv, cos, sin, n_head, n_kv_head):
    B, T, C = qkv.shape
    hd = C // (n_head + 2 * n_kv_head)
    return qkv.new_empty(B, T, n_head, hd), qkv.new_empty(B, T, n_kv_head, hd), qkv.new_empty(B, T, n_kv_head, hd)


@torch.library.custom_op("x1::rope_qkv_backward", mutates_args=())
def rope_qkv_backward(dq: torch.Tensor, dk: torch.Tensor, dv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
                      ) -> torch.Tensor:
    """Gradient of the fused projection: the rotations undone, q | k | v concatenated."""
    B, T, H, hd = dq.shape
    Hkv = dk.size(2)
    if not triton_ok(dq):
        parts = [_rotate(dq, cos, sin, 1.0), _rotate(dk, cos, sin, 1.0), dv.float()]
        return torch.cat(parts, dim=2).to(dq.dtype).reshape(B, T, (H + 2 * Hkv) * hd)
    out = dq.new_empty(B, T, (H + 2 * Hkv) * hd)
    grid = (triton.cdiv(B * T, ROPE_LAUNCH["BLOCK_N"]),)
    _rope_bwd_kernel[grid](dq, dk, dv, cos, sin, out, B * T, T, *dq.stride(), *dk.stride(), *dv.stride(),
                           H=H, HKV=Hkv, HD=hd, **ROPE_LAUNCH)
    return out


@rope_qkv_backward.register_fake
def _(dq, dk, dv, cos, sin):
    B, T, H, hd = dq.shape
    return dq.new_empty(B, T, (H + 2 * dk.size(2)) * hd)


def _rope_setup(ctx, inputs, output) -> None:
    _, cos, sin, _, _ = inputs
    ctx.save_for_backward(cos, sin)


def _rope_backward(ctx, dq, dk, dv):
    cos, sin = ctx.saved_tensors
    return rope_qkv_backward(dq, dk, dv, cos, sin), None, None, None, None


rope_qkv.register_autograd(_rope_backward, setup_context=_rope_setup)


# ---- SwiGLU ------------------------------------------------------------------------------------

if triton is not None:

    @triton.jit
    def _swiglu_fwd_kernel(gu_ptr, h_ptr, total, F_: tl.constexpr, BLOCK: tl.constexpr):
        i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = i < total
        row, col = i // F_, i % F_
        g = tl.load(gu_ptr + row * (2 * F_) + col, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(gu_ptr + row * (2 * F_) + F_ + col, mask=mask, other=0.0).to(tl.float32)
        h = g * tl.sigmoid(g) * u
        tl.store(h_ptr + i, h.to(h_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _swiglu_bwd_kernel(gu_ptr, dh_ptr, dgu_ptr, total, F_: tl.constexpr, BLOCK: tl.constexpr):
        i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = i < total
        row, col = i // F_, i % F_
        g = tl.load(gu_ptr + row * (2 * F_) + col, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(gu_ptr + row * (2 * F_) + F_ + col, mask=mask, other=0.0).to(tl.float32)
        dh = tl.load(dh_ptr + i, mask=mask, other=0.0).to(tl.float32)
        sig = tl.sigmoid(g)
        silu = g * sig
        dg = dh * u * sig * (1.0 + g * (1.0 - sig))
        du = dh * silu
        tl.store(dgu_ptr + row * (2 * F_) + col, dg.to(dgu_ptr.dtype.element_ty), mask=mask)
        tl.store(dgu_ptr + row * (2 * F_) + F_ + col, du.to(dgu_ptr.dtype.element_ty), mask=mask)


SWIGLU_LAUNCH = {"BLOCK": 2048, "num_warps": 8}  # elements per program, warps


@torch.library.custom_op("x1::swiglu", mutates_args=())
def swiglu(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for gate_up = [gate | up] along the last dim."""
    if not triton_ok(gate_up):
        gate, up = gate_up.float().chunk(2, dim=-1)
        return (F.silu(gate) * up).to(gate_up.dtype)
    gate_up = gate_up.contiguous()
    f = gate_up.size(-1) // 2
    h = gate_up.new_empty(*gate_up.shape[:-1], f)
    total = h.numel()
    _swiglu_fwd_kernel[(triton.cdiv(total, SWIGLU_LAUNCH["BLOCK"]),)](gate_up, h, total, F_=f, **SWIGLU_LAUNCH)
    return h


@swiglu.register_fake
def _(gate_up):
    return gate_up.new_empty(*gate_up.shape[:-1], gate_up.size(-1) // 2)


@torch.library.custom_op("x1::swiglu_backward", mutates_args=())
def swiglu_backward(gate_up: torch.Tensor, dh: torch.Tensor) -> torch.Tensor:
    if not triton_ok(gate_up):
        gate, up = gate_up.float().chunk(2, dim=-1)
        sig = torch.sigmoid(gate)
        dg = dh.float() * up * sig * (1 + gate * (1 - sig))
        du = dh.float() * gate * sig
        return torch.cat((dg, du), dim=-1).to(gate_up.dtype)
    dh = dh.contiguous()
    dgu = torch.empty_like(gate_up)
    total = dh.numel()
    _swiglu_bwd_kernel[(triton.cdiv(total, SWIGLU_LAUNCH["BLOCK"]),)](gate_up, dh, dgu, total, F_=dh.size(-1),
                                                                      **SWIGLU_LAUNCH)
    return dgu


@swiglu_backward.register_fake
def _(gate_up, dh):
    return torch.empty_like(gate_up)


def _swiglu_setup(ctx, inputs, output) -> None:
    ctx.save_for_backward(inputs[0])


def _swiglu_bwd(ctx, dh):
    (gate_up,) = ctx.saved_tensors
    return swiglu_backward(gate_up.contiguous(), dh)


swiglu.register_autograd(_swiglu_bwd, setup_context=_swiglu_setup)


# ---- SwiGLU's backward in the epilogue of the down projection's input gradient --------------------

# The down projection's input gradient dh = dy @ w_down (tokens x d_ff, from K = d_model) was
# written by cuBLAS and read straight back by SwiGLU's backward: 2 x 268 MB per layer and
# micro-batch of 64 x 1024 tokens, ~0.3 ms of a step that runs at the GPU's power cap
# (docs/PERFORMANCE.md). Here each output tile of dh stays in registers: the epilogue loads the
# tile's gate and up, and writes the gradients of both. One program per SM (PER_SM) walks its
# tiles, so that the loads of a tile's matmul overlap the previous tile's epilogue; every load and
# store is a TMA block copy through a tensor descriptor. SUBTILE: the epilogue in two halves of
# BLOCK_N / 2 columns, fewer registers live at once.
DOWN_LAUNCH = {"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 64, "SUBTILE": True, "PER_SM": 1, "num_warps": 8,
               "num_stages": 3}

if triton is not None:

    @triton.jit
    def _swiglu_bwd_tile(dh, g_desc, u_desc, dg_desc, du_desc, om, on, out_ty: tl.constexpr):
        g = g_desc.load([om, on]).to(tl.float32)
        u = u_desc.load([om, on]).to(tl.float32)
        sig = tl.sigmoid(g)
        dg_desc.store([om, on], (dh * u * sig * (1.0 + g * (1.0 - sig))).to(out_ty))
        du_desc.store([om, on], (dh * g * sig).to(out_ty))

    @triton.jit
    def _down_swiglu_bwd_kernel(dy_ptr, w_ptr, gu_ptr, dgu_ptr, M, K, F_, BLOCK_M: tl.constexpr,
                                BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SUBTILE: tl.constexpr):
        EPI_N: tl.constexpr = BLOCK_N // 2 if SUBTILE else BLOCK_N
        out_ty: tl.constexpr = dgu_ptr.dtype.element_ty
        dy_desc = tl.make_tensor_descriptor(dy_ptr, shape=[M, K], strides=[K, 1], block_shape=[BLOCK_M, BLOCK_K])
        w_desc = tl.make_tensor_descriptor(w_ptr, shape=[K, F_], strides=[F_, 1], block_shape=[BLOCK_K, BLOCK_N])
        # gate and up as two (M, d_ff) views of gate_up's rows: a tile past d_ff reads zeros and
        # writes nothing, instead of reaching into the other half.
        g_desc = tl.make_tensor_descriptor(gu_ptr, shape=[M, F_], strides=[2 * F_, 1], block_shape=[BLOCK_M, EPI_N])
        u_desc = tl.make_tensor_descriptor(gu_ptr + F_, shape=[M, F_], strides=[2 * F_, 1], block_shape=[BLOCK_M, EPI_N])
        dg_desc = tl.make_tensor_descriptor(dgu_ptr, shape=[M, F_], strides=[2 * F_, 1], block_shape=[BLOCK_M, EPI_N])
        du_desc = tl.make_tensor_descriptor(dgu_ptr + F_, shape=[M, F_], strides=[2 * F_, 1],
                                            block_shape=[BLOCK_M, EPI_N])
        # Tiles in row-band order: a band of dy is read from HBM once, its other tiles find it in L2.
        n_tiles = tl.cdiv(F_, BLOCK_N)
        tiles = tl.cdiv(M, BLOCK_M) * n_tiles
        k_steps = tl.cdiv(K, BLOCK_K)
        for tile in tl.range(tl.program_id(0), tiles, tl.num_programs(0), flatten=True):
            om = (tile // n_tiles) * BLOCK_M
            on = (tile % n_tiles) * BLOCK_N
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for ki in range(k_steps):
                acc = tl.dot(dy_desc.load([om, ki * BLOCK_K]), w_desc.load([ki * BLOCK_K, on]), acc)
            if SUBTILE:
                left, right = tl.split(acc.reshape(BLOCK_M, 2, EPI_N).permute(0, 2, 1))
                _swiglu_bwd_tile(left, g_desc, u_desc, dg_desc, du_desc, om, on, out_ty)
                _swiglu_bwd_tile(right, g_desc, u_desc, dg_desc, du_desc, om, on + EPI_N, out_ty)
            else:
                _swiglu_bwd_tile(acc, g_desc, u_desc, dg_desc, du_desc, om, on, out_ty)


def _tma_scratch(size: int, alignment: int, stream: int | None) -> torch.Tensor:
    """Global memory Triton asks for to build tensor descriptors on the device."""
    return torch.empty(size, device="cuda", dtype=torch.int8)


def _tma_ok(dy: torch.Tensor, w: torch.Tensor, gate_up: torch.Tensor) -> bool:
    """A GPU with TMA (Hopper on), and TMA's rules: 16-byte aligned bases and row strides (d_model
    and d_ff multiples of 8 in bf16)."""
    if dy.is_cuda and torch.cuda.get_device_capability(dy.device)[0] < 9:
        return False  # an A100: cuBLAS and the SwiGLU kernel, as before the fused kernel
    step = 16 // w.element_size()
    return dy.size(1) % step == 0 and w.size(1) % step == 0 and all(
        t.data_ptr() % 16 == 0 for t in (dy, w, gate_up))


@torch.library.custom_op("x1::down_swiglu_backward", mutates_args=())
def down_swiglu_backward(dy: torch.Tensor, w: torch.Tensor, gate_up: torch.Tensor) -> torch.Tensor:
    """Gradient of gate_up (N, 2 d_ff) through swiglu(gate_up) @ w.T, given dy (N, d_model) and
    w (d_model, d_ff)."""
    # dy may come in fp32 (an fp32 residual stream): the matmul runs in w's dtype, as autocast's would
    dy, w, gate_up = dy.to(w.dtype).contiguous(), w.contiguous(), gate_up.contiguous()
    if not triton_ok(dy) or not _tma_ok(dy, w, gate_up):
        return swiglu_backward(gate_up, dy @ w)
    (m, k), f = dy.shape, w.size(1)
    launch = dict(DOWN_LAUNCH)
    bm, bn, per_sm = launch.pop("BLOCK_M"), launch.pop("BLOCK_N"), launch.pop("PER_SM")
    dgu = torch.empty_like(gate_up)
    tiles = triton.cdiv(m, bm) * triton.cdiv(f, bn)
    if dy.is_cuda:
        triton.set_allocator(_tma_scratch)
        programs = torch.cuda.get_device_properties(dy.device).multi_processor_count * per_sm
    else:
        programs = 3  # the interpreter: a few programs, each walking several tiles
    _down_swiglu_bwd_kernel[(min(tiles, programs),)](dy, w, gate_up, dgu, m, k, f, BLOCK_M=bm, BLOCK_N=bn, **launch)
    return dgu


@down_swiglu_backward.register_fake
def _(dy, w, gate_up):
    return torch.empty_like(gate_up)


class _SwiGLUDown(torch.autograd.Function):
    """swiglu(gate_up) @ w.T whose backward is one matmul for w's gradient and one for gate_up's,
    the second with SwiGLU's backward in its epilogue."""

    @staticmethod
    def forward(ctx, gate_up: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        h = swiglu(gate_up)
        ctx.save_for_backward(gate_up, h, w)
        return h @ w.t()

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        gate_up, h, w = ctx.saved_tensors
        dy2 = dy.reshape(-1, dy.size(-1))
        dgu = down_swiglu_backward(dy2, w, gate_up.reshape(-1, gate_up.size(-1)))
        dw = dy2.t() @ h.reshape(-1, h.size(-1))
        return dgu.view(gate_up.shape), dw


def swiglu_down(gate_up: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up @ w.T for gate_up = [gate | up] (..., 2 d_ff) and w (d_model, d_ff), in the
    dtype of its inputs: under autocast the caller casts them as the down projection would."""
    return _SwiGLUDown.apply(gate_up, w)
