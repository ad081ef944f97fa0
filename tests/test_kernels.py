"""Our RoPE and SwiGLU ops, and the norms folded into the matmuls around them: the same function
and gradient as the model's PyTorch path.

On the CPU the ops run their PyTorch implementation; on a CUDA GPU the same tests check the
Triton kernels (bf16 tolerance), also with gradients in the transposed layout attention's
backward produces. Under TRITON_INTERPRET=1 (tests/test_triton_kernels.py) the CPU runs the
Triton kernels."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from x1_pretrain.model.transformer import RMSNorm, apply_rope, rope_tables
from x1_pretrain.ops.kernels import normed_linear, rope_qkv, swiglu

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def tol(device):
    return {"rtol": 1e-5, "atol": 1e-5} if device == "cpu" else {"rtol": 2e-2, "atol": 2e-2}


def reference_rope(qkv, cos, sin, H, Hkv):
    B, T, C = qkv.shape
    hd = C // (H + 2 * Hkv)
    q, k, v = qkv.float().view(B, T, H + 2 * Hkv, hd).split([H, Hkv, Hkv], dim=2)
    return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v


def row_scale(B, T, device):
    """A per-token scale as a folded norm passes it: (B, T, 1) fp32, here spread over 0.25-4."""
    return torch.exp(torch.randn(B, T, 1, device=device)).clamp(0.25, 4.0)


@pytest.mark.parametrize("scaled", [False, True], ids=["plain", "row-scaled"])
@pytest.mark.parametrize("device", DEVICES)
def test_rope_op_matches_the_pytorch_rotation_and_its_gradient(device, scaled):
    torch.manual_seed(0)
    H, Hkv, hd, B, T = 12, 4, 64, 2, 93  # 186 tokens: the kernels' last tile of tokens is partly masked
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    cos, sin = (t.to(device) for t in rope_tables(hd, T, 10000.0))
    qkv = torch.randn(B, T, (H + 2 * Hkv) * hd, device=device, dtype=dtype, requires_grad=True)
    ref_in = qkv.detach().float().requires_grad_()
    scale = row_scale(B, T, device) if scaled else None
    q, k, v = rope_qkv(qkv, cos, sin, H, Hkv, scale)
    rq, rk, rv = reference_rope(ref_in * scale if scaled else ref_in, cos, sin, H, Hkv)
    for ours, ref in ((q, rq), (k, rk), (v, rv)):
        torch.testing.assert_close(ours.float(), ref, **tol(device))
    # Gradients in (B, H, T, hd) memory order, as SDPA's backward hands them over.
    gq = torch.randn(B, H, T, hd, device=device, dtype=dtype).transpose(1, 2)
    gk = torch.randn(B, Hkv, T, hd, device=device, dtype=dtype).transpose(1, 2)
    gv = torch.randn(B, Hkv, T, hd, device=device, dtype=dtype).transpose(1, 2)
    torch.autograd.backward((q, k, v), (gq, gk, gv))
    torch.autograd.backward((rq, rk, rv), (gq.float(), gk.float(), gv.float()))
    torch.testing.assert_close(qkv.grad.float(), ref_in.grad, **tol(device))


@pytest.mark.parametrize("scaled", [False, True], ids=["plain", "row-scaled"])
@pytest.mark.parametrize("device", DEVICES)
def test_swiglu_op_matches_silu_times_up_and_its_gradient(device, scaled):
    torch.manual_seed(1)
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    gu = (torch.randn(3, 50, 2 * 172, device=device, dtype=dtype) * 3).requires_grad_()
    ref_in = gu.detach().float().requires_grad_()
    scale = row_scale(3, 50, device) if scaled else None
    h = swiglu(gu, scale)
    gate, up = (ref_in * scale if scaled else ref_in).chunk(2, dim=-1)
    ref = F.silu(gate) * up
    torch.testing.assert_close(h.float(), ref, **tol(device))
    dh = torch.randn_like(ref)
    h.backward(dh.to(dtype))
    ref.backward(dh)
    torch.testing.assert_close(gu.grad.float(), ref_in.grad, **tol(device))


@pytest.mark.parametrize("device", DEVICES)
def test_model_with_our_kernels_computes_the_same_loss_and_gradients(device):
    from conftest import TINY_CONFIG
    from x1_pretrain.config import load_config
    from x1_pretrain.model.transformer import Transformer

    torch.manual_seed(2)
    model = Transformer(load_config(TINY_CONFIG).model).to(device)
    idx = torch.randint(0, 50257, (2, 32), device=device)
    plain = model(idx, idx)
    plain.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    model.use_kernels(True)
    fused = model(idx, idx)
    fused.backward()
    torch.testing.assert_close(fused, plain, rtol=1e-5, atol=1e-5)
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, grads[n], rtol=1e-4, atol=1e-6, msg=n)


def test_the_row_scale_must_come_detached():
    # The ops treat it as a constant; normed_linear returns it so and accounts for its gradient.
    gu = torch.randn(2, 3, 8, requires_grad=True)
    with pytest.raises(ValueError, match="row scale is a constant"):
        swiglu(gu, torch.ones(2, 3, 1, requires_grad=True))


def plain_block_parts(x, weight, norm):
    """RMSNorm, then the matmul in the weight's dtype (as autocast casts it): what normed_linear folds."""
    return F.linear(norm(x).to(weight.dtype), weight)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("consumer", ["swiglu", "rope"])
@pytest.mark.parametrize("device", DEVICES)
def test_a_norm_folded_into_its_matmul_gives_the_same_output_and_gradients(device, consumer, dtype):
    # RMSNorm(x) @ W.T == r * (x @ (W * w).T), the consumer applying r: the output and the
    # gradients of x, W and the norm's weight w match the unfolded norm, through either consumer.
    # In fp32 they match to rounding; in bf16 the two round in different places, so each is held
    # to the fp32 result: the fold no less accurate than the norm written out.
    torch.manual_seed(3)
    B, T, D = 2, 37, 64
    H, Hkv, hd = 4, 2, 16
    out = 2 * 96 if consumer == "swiglu" else (H + 2 * Hkv) * hd
    x = torch.randn(B, T, D, device=device) * torch.linspace(0.1, 5, T, device=device)[None, :, None]
    weight = torch.randn(out, D, device=device) * D**-0.5
    norm = RMSNorm(D, 1e-5).to(device)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.3 * torch.randn(D, device=device))
    cos, sin = (t.to(device) for t in rope_tables(hd, T, 10000.0))
    out_grads = None

    def run(fold, dtype):
        nonlocal out_grads
        xs, ws = x.to(dtype).clone().requires_grad_(), weight.clone().requires_grad_()
        norm.zero_grad()
        if fold:
            z, r = normed_linear(xs, ws, norm.weight, norm.eps)
        else:
            z, r = plain_block_parts(xs, ws.to(dtype), norm), None
        outs = (swiglu(z, r),) if consumer == "swiglu" else rope_qkv(z, cos, sin, H, Hkv, r)
        if out_grads is None:
            out_grads = [torch.randn(o.shape, device=device) for o in outs]
        torch.autograd.backward(outs, [g.to(o.dtype) for g, o in zip(out_grads, outs, strict=True)])
        return [o.float() for o in outs] + [xs.grad.float(), ws.grad.float(), norm.weight.grad.float()]

    names = [f"output {i}" for i in range(1 if consumer == "swiglu" else 3)] + ["x grad", "weight grad", "norm weight grad"]
    truth = run(fold=False, dtype=torch.float32)
    folded = run(fold=True, dtype=dtype)
    if dtype == torch.float32:
        for name, a, b in zip(names, folded, truth, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5, msg=lambda m, name=name: f"{name}: {m}")
        return
    plain = run(fold=False, dtype=dtype)
    for name, a, b, t in zip(names, folded, plain, truth, strict=True):
        err_fold, err_plain = ((a - t).norm() / t.norm()).item(), ((b - t).norm() / t.norm()).item()
        assert err_fold < max(2 * err_plain, 1e-3), f"{name}: the fold's error {err_fold:.2e}, the plain path's {err_plain:.2e}"
