"""The fused cross-entropy ops: same loss and gradients as F.linear + F.cross_entropy, padded
columns excluded. On the CPU they run their PyTorch paths, or the Triton kernels themselves under
TRITON_INTERPRET=1 (tests/test_triton_kernels.py); on a GPU, the kernels."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import x1_pretrain.losses as losses
from x1_pretrain.kernels import INTERPRET
from x1_pretrain.losses import fused_available, fused_cross_entropy, linear_cross_entropy

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.mark.parametrize("device", DEVICES)
def test_fused_cross_entropy_matches_torch_in_value_and_gradient(device):
    torch.manual_seed(0)
    vocab, padded = 1000, 1024
    logits = (torch.randn(64, padded, device=device) * 3).requires_grad_()
    targets = torch.randint(0, vocab, (64,), device=device)
    ours = fused_cross_entropy(logits, targets, vocab)
    (ours * 0.25).backward()  # a scaled loss, as with gradient accumulation
    g_ours = logits.grad.clone()
    logits.grad = None
    ref = F.cross_entropy(logits[:, :vocab], targets)
    (ref * 0.25).backward()
    torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(g_ours, logits.grad, rtol=1e-5, atol=1e-6)
    assert g_ours[:, vocab:].abs().max() == 0  # padded columns never count


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the Triton kernel needs a CUDA GPU")
def test_fused_cross_entropy_kernel_on_bf16_logits_matches_fp32_reference():
    assert fused_available(torch.device("cuda"))
    torch.manual_seed(1)
    vocab, padded = 50257, 50304
    logits = (torch.randn(2048, padded, device="cuda") * 4).bfloat16().requires_grad_()
    targets = torch.randint(0, vocab, (2048,), device="cuda")
    ours = fused_cross_entropy(logits, targets, vocab)
    ours.backward()
    ref_logits = logits.detach().float().requires_grad_()
    ref = F.cross_entropy(ref_logits[:, :vocab], targets)
    ref.backward()
    assert abs(ours.item() - ref.item()) < 1e-4
    rel = (logits.grad.float() - ref_logits.grad).norm() / ref_logits.grad.norm()
    assert rel < 1e-2  # bf16 gradient
    assert logits.grad[:, vocab:].abs().max() == 0


def test_model_loss_is_the_same_with_the_fused_path():
    from conftest import TINY_CONFIG
    from x1_pretrain.config import load_config
    from x1_pretrain.model import Transformer

    torch.manual_seed(2)
    model = Transformer(load_config(TINY_CONFIG).model)
    idx = torch.randint(0, 50257, (2, 16))
    plain = model(idx, idx)
    model.fused_loss = True
    torch.testing.assert_close(model(idx, idx), plain, rtol=1e-5, atol=1e-5)


# The forward-with-gradient kernel's shapes: the shipped one, the online variant, a small block.
KERNEL_SHAPES = [
    losses.CE_GRAD_KERNEL,
    {"BLOCK": 256, "ONLINE": 1, "num_warps": 4},
    {"BLOCK": 128, "ONLINE": 0, "num_warps": 4},
]


@pytest.mark.parametrize("shape", KERNEL_SHAPES, ids=["shipped", "online", "small-block"])
@pytest.mark.parametrize("device", DEVICES)
def test_linear_cross_entropy_matches_linear_then_cross_entropy_in_value_and_gradients(device, shape, monkeypatch):
    monkeypatch.setattr(losses, "CE_GRAD_KERNEL", shape)
    torch.manual_seed(3)
    vocab, padded, d = 1000, 1024, 48
    h = torch.randn(2, 40, d, device=device, requires_grad=True)
    w = (torch.randn(padded, d, device=device) * 0.5).requires_grad_()
    targets = torch.randint(0, vocab, (2, 40), device=device)
    ours = linear_cross_entropy(h, w, targets, vocab)
    (ours * 0.25).backward()  # accumulation's 1/grad_accum reaches the op as its upstream gradient
    g_h, g_w = h.grad.clone(), w.grad.clone()
    h.grad = w.grad = None
    ref = F.cross_entropy(F.linear(h, w)[..., :vocab].reshape(-1, vocab), targets.reshape(-1))
    (ref * 0.25).backward()
    torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(g_h, h.grad, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(g_w, w.grad, rtol=1e-4, atol=1e-6)
    assert g_w[vocab:].abs().max() == 0  # padded rows of the head never learn


def test_linear_cross_entropy_under_torch_compile_gives_the_eager_gradients():
    torch.manual_seed(4)
    vocab, padded, d = 500, 512, 32
    h0, w0 = torch.randn(64, d), torch.randn(padded, d) * 0.5
    targets = torch.randint(0, vocab, (64,))

    def loss_fn(h, w):
        return linear_cross_entropy(h, w, targets, vocab) / 16

    grads = []
    for fn in (loss_fn, torch.compile(loss_fn, backend="aot_eager")):
        h, w = h0.clone().requires_grad_(), w0.clone().requires_grad_()
        fn(h, w).backward()
        grads.append((h.grad, w.grad))
    for eager, compiled in zip(*grads, strict=True):
        torch.testing.assert_close(compiled, eager, rtol=1e-6, atol=1e-7)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the Triton kernel needs a CUDA GPU")
def test_linear_cross_entropy_on_bf16_matches_an_fp32_reference():
    torch.manual_seed(5)
    vocab, padded, d = 50257, 50304, 768
    h = (torch.randn(2048, d, device="cuda") * 0.5).bfloat16().requires_grad_()
    w = (torch.randn(padded, d, device="cuda") * 0.05).bfloat16().requires_grad_()
    targets = torch.randint(0, vocab, (2048,), device="cuda")
    ours = linear_cross_entropy(h, w, targets, vocab)
    ours.backward()
    rh, rw = (t.detach().float().requires_grad_() for t in (h, w))
    ref = F.cross_entropy((rh @ rw.t())[:, :vocab], targets)
    ref.backward()
    assert abs(ours.item() - ref.item()) < 2e-3  # the logits are rounded to bf16 once
    for g, r in ((h.grad, rh.grad), (w.grad, rw.grad)):
        assert (g.float() - r).norm() / r.norm() < 2e-2
    assert w.grad[vocab:].abs().max() == 0


@pytest.mark.skipif(not INTERPRET, reason="only under TRITON_INTERPRET=1 (tests/test_triton_kernels.py)")
def test_the_interpreter_sends_cpu_tensors_through_the_triton_kernels():
    assert fused_available(torch.device("cpu"))
