"""Our RoPE and SwiGLU ops: the same function and gradient as the model's PyTorch path.

On the CPU the ops run their PyTorch implementation; on a CUDA GPU the same tests check the
Triton kernels (bf16 tolerance), also with gradients in the transposed layout attention's
backward produces."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from x1_pretrain.kernels import rope_qkv, swiglu
from x1_pretrain.model import apply_rope, rope_tables

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
    H, Hkv, hd, B, T = 12, 4, 64, 2, 93  # 186 tokens: the kernels' last tile of tokens is partly masked
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
def test_model_with_our_kernels_computes_the_same_loss_and_gradients(device):
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
