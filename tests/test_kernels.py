"""Our RoPE and SwiGLU ops: the same function and gradient as the model's PyTorch path.

On the CPU the ops run their PyTorch implementation; on a CUDA GPU the same tests check the
Triton kernels (bf16 tolerance), also with gradients in the transposed layout attention's
backward produces."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from x1_pretrain import model as model_mod
from x1_pretrain.kernels import add_rmsnorm, rope_qkv, swiglu
from x1_pretrain.model import RMSNorm, apply_rope, rope_tables

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def tol(device):
    return {"rtol": 1e-5, "atol": 1e-5} if device == "cpu" else {"rtol": 2e-2, "atol": 2e-2}


def reference_rope(qkv, cos, sin, H, Hkv):
    B, T, C = qkv.shape
    hd = C // (H + 2 * Hkv)
    q, k, v = qkv.float().view(B, T, H + 2 * Hkv, hd).split([H, Hkv, Hkv], dim=2)
    return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v


@pytest.mark.parametrize("device", DEVICES)
def test_rope_op_matches_the_pytorch_rotation_and_its_gradient(device):
    torch.manual_seed(0)
    H, Hkv, hd, B, T = 12, 4, 64, 2, 96
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    cos, sin = (t.to(device) for t in rope_tables(hd, T, 10000.0))
    qkv = torch.randn(B, T, (H + 2 * Hkv) * hd, device=device, dtype=dtype, requires_grad=True)
    ref_in = qkv.detach().float().requires_grad_()
    q, k, v = rope_qkv(qkv, cos, sin, H, Hkv)
    rq, rk, rv = reference_rope(ref_in, cos, sin, H, Hkv)
    for ours, ref in ((q, rq), (k, rk), (v, rv)):
        torch.testing.assert_close(ours.float(), ref, **tol(device))
    # Gradients in (B, H, T, hd) memory order, as SDPA's backward hands them over.
    gq = torch.randn(B, H, T, hd, device=device, dtype=dtype).transpose(1, 2)
    gk = torch.randn(B, Hkv, T, hd, device=device, dtype=dtype).transpose(1, 2)
    gv = torch.randn(B, Hkv, T, hd, device=device, dtype=dtype).transpose(1, 2)
    torch.autograd.backward((q, k, v), (gq, gk, gv))
    torch.autograd.backward((rq, rk, rv), (gq.float(), gk.float(), gv.float()))
    torch.testing.assert_close(qkv.grad.float(), ref_in.grad, **tol(device))


@pytest.mark.parametrize("device", DEVICES)
def test_swiglu_op_matches_silu_times_up_and_its_gradient(device):
    torch.manual_seed(1)
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    gu = (torch.randn(3, 50, 2 * 172, device=device, dtype=dtype) * 3).requires_grad_()
    ref_in = gu.detach().float().requires_grad_()
    h = swiglu(gu)
    gate, up = ref_in.chunk(2, dim=-1)
    ref = F.silu(gate) * up
    torch.testing.assert_close(h.float(), ref, **tol(device))
    dh = torch.randn_like(ref)
    h.backward(dh.to(dtype))
    ref.backward(dh)
    torch.testing.assert_close(gu.grad.float(), ref_in.grad, **tol(device))


@pytest.mark.parametrize("device", DEVICES)
def test_add_rmsnorm_op_matches_the_residual_add_and_rmsnorm_and_their_gradients(device):
    torch.manual_seed(3)
    D, eps = 96, 1e-5  # D not a power of two: the kernels mask the padded columns
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    x = torch.randn(5, 37, D, device=device, requires_grad=True)  # the fp32 residual stream
    delta = (torch.randn(5, 37, D, device=device) * 2).to(dtype).requires_grad_()  # a sublayer's output
    norm = RMSNorm(D, eps).to(device)
    with torch.no_grad():
        norm.weight.mul_(torch.rand(D, device=device) + 0.5)
    ref_x, ref_delta = x.detach().clone().requires_grad_(), delta.detach().float().requires_grad_()
    ref_w = norm.weight.detach().clone().requires_grad_()
    y, h = add_rmsnorm(x, delta, norm.weight, eps)
    ref_y = ref_x + ref_delta
    ref_h = ref_w * (ref_y * torch.rsqrt(ref_y.pow(2).mean(-1, keepdim=True) + eps))
    assert y.dtype == torch.float32 and h.dtype == dtype
    torch.testing.assert_close(y, ref_y, **tol(device))
    torch.testing.assert_close(h.float(), ref_h, **tol(device))
    # Both outputs carry gradient: y goes on along the stream, h into the next sublayer.
    gy, gh = torch.randn_like(ref_y), torch.randn_like(ref_h).to(dtype).float()  # h's gradient arrives in h's dtype
    torch.autograd.backward((y, h), (gy, gh.to(dtype)))
    torch.autograd.backward((ref_y, ref_h), (gy, gh))
    assert x.grad.dtype == torch.float32 and delta.grad.dtype == dtype
    torch.testing.assert_close(x.grad, ref_x.grad, **tol(device))
    torch.testing.assert_close(delta.grad.float(), ref_delta.grad, **tol(device))
    torch.testing.assert_close(norm.weight.grad, ref_w.grad, rtol=1e-4 if device == "cpu" else 2e-2, atol=1e-3)


@pytest.mark.parametrize("add_norm", [False, True], ids=["add-norm-torch", "add-norm-kernel"])
@pytest.mark.parametrize("device", DEVICES)
def test_model_with_our_kernels_computes_the_same_loss_and_gradients(device, add_norm, monkeypatch):
    monkeypatch.setattr(model_mod, "FUSED_ADD_NORM", add_norm)
    from conftest import TINY_CONFIG
    from x1_pretrain.config import load_config
    from x1_pretrain.model import Transformer

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
