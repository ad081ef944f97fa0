"""The fused cross-entropy: same loss and gradient as F.cross_entropy, padded columns excluded.
On the CPU the ops run their PyTorch paths, or the Triton kernels themselves under
TRITON_INTERPRET=1 (tests/test_triton_kernels.py); on a GPU, the kernels."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from x1_pretrain.ops.kernels import INTERPRET
from x1_pretrain.ops.losses import _HeadLoss, fused_available, fused_cross_entropy, head_cross_entropy

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


@pytest.mark.parametrize("device", DEVICES)
def test_head_and_loss_in_one_function_match_linear_then_cross_entropy_in_value_and_both_gradients(device):
    # 300 rows over 3 programs (the interpreter's grid): each program loops over its rows; 9000
    # columns: several tiles per pass, the last partial, with padded columns and padded rows of w.
    torch.manual_seed(3)
    vocab, padded, d = 9000, 9024, 32
    h = torch.randn(3, 100, d, device=device).requires_grad_()
    w = (torch.randn(padded, d, device=device) * 0.5).requires_grad_()
    with torch.no_grad():
        w[vocab:] = 0
    targets = torch.randint(0, vocab, (3, 100), device=device)
    ours = head_cross_entropy(h, w, targets, vocab)
    (ours * 0.25).backward()  # a scaled loss, as with gradient accumulation
    g_h, g_w = h.grad.clone(), w.grad.clone()
    h.grad = w.grad = None
    ref = F.cross_entropy(F.linear(h, w)[..., :vocab].reshape(-1, vocab), targets.reshape(-1))
    (ref * 0.25).backward()
    torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(g_h, h.grad, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(g_w, w.grad, rtol=1e-4, atol=1e-6)
    assert g_w[vocab:].abs().max() == 0  # padded columns never count


@pytest.mark.parametrize("device", DEVICES)
def test_the_head_functions_backward_scales_each_row_by_its_own_loss_gradient(device):
    # The forward writes the unscaled softmax - onehot; a row's loss gradient is applied to the
    # matmuls' inputs and outputs. Weights differing per row (not a mean) pin that it is per row.
    torch.manual_seed(4)
    vocab, d = 1000, 16
    h = torch.randn(40, d, device=device).requires_grad_()
    w = torch.randn(vocab, d, device=device).requires_grad_()
    targets = torch.randint(0, vocab, (40,), device=device)
    weights = torch.rand(40, device=device) * 3
    (_HeadLoss.apply(h, w, targets, vocab, None, False) * weights).sum().backward()
    g_h, g_w = h.grad.clone(), w.grad.clone()
    h.grad = w.grad = None
    (F.cross_entropy(h @ w.t(), targets, reduction="none") * weights).sum().backward()
    torch.testing.assert_close(g_h, h.grad, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(g_w, w.grad, rtol=1e-4, atol=1e-6)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the Triton kernel needs a CUDA GPU")
def test_the_forward_and_gradient_kernel_on_bf16_logits_matches_the_two_kernels_it_replaces():
    from x1_pretrain.ops.losses import ce_bwd, ce_fwd, ce_fwd_grad

    torch.manual_seed(5)
    vocab, padded = 50257, 50304
    logits = (torch.randn(4096, padded, device="cuda") * 4).bfloat16()
    targets = torch.randint(0, vocab, (4096,), device="cuda")
    loss, grad, scale = ce_fwd_grad(logits, targets, vocab)
    ref_loss, lse = ce_fwd(logits, targets, vocab)
    ref_grad = ce_bwd(logits, targets, lse, torch.ones_like(lse), vocab)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-5)
    # one bf16 rounding apart at most: of p or of e = p / scale
    torch.testing.assert_close(grad.float() * scale[:, None], ref_grad.float(), rtol=1e-2, atol=1e-5)
    assert grad[:, vocab:].abs().max() == 0
    assert (scale < 1).all()  # the scale is 1 / sum(exp(x - max)): the row's max counts 1, the others more than 0


@pytest.mark.parametrize("device", DEVICES)
def test_the_forward_and_gradient_kernels_gradient_is_softmax_minus_onehot_once_scaled_and_its_loss_exact(device):
    # Unnormalised e = exp(x - max) is written, the target's column e_t - sum(e), with 1 / sum(e)
    # per row returned; scaled back it is the plain gradient. Sorted rows (the max last or first)
    # and a row whose target is its max pin the max pass and the target's fix-up.
    from x1_pretrain.ops.losses import ce_fwd_grad

    torch.manual_seed(7)
    vocab, padded = 9000, 9024
    logits = torch.randn(300, padded, device=device) * 5
    logits[:4] = (logits[:4] * 8).sort(dim=-1).values
    logits[2:4] = logits[2:4].flip(-1)
    targets = torch.randint(0, vocab, (300,), device=device)
    targets[5] = logits[5, :vocab].argmax()
    loss, grad, scale = ce_fwd_grad(logits, targets, vocab)
    ref = logits[:, :vocab].detach().float().requires_grad_()
    F.cross_entropy(ref, targets, reduction="sum").backward()
    torch.testing.assert_close(loss, F.cross_entropy(logits[:, :vocab].float(), targets, reduction="none"),
                               rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(grad[:, :vocab] * scale[:, None], ref.grad, rtol=1e-4, atol=1e-6)
    assert grad[:, vocab:].abs().max() == 0


def test_model_loss_is_the_same_with_the_fused_path():
    from conftest import TINY_CONFIG
    from x1_pretrain.config import load_config
    from x1_pretrain.model.transformer import Transformer

    torch.manual_seed(2)
    model = Transformer(load_config(TINY_CONFIG).model)
    idx = torch.randint(0, 50257, (2, 16))
    plain = model(idx, idx)
    model.fused_loss = True
    torch.testing.assert_close(model(idx, idx), plain, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("device", DEVICES)
def test_fused_cross_entropy_is_exact_when_every_column_raises_the_running_max(device):
    # Rows sorted ascending rescale the running sum at every element; descending never do.
    # 9000 columns: several iterations of each kernel's column loop, the last one partly masked.
    torch.manual_seed(6)
    vocab, padded = 9000, 9024
    logits = (torch.randn(8, padded, device=device) * 40).sort(dim=-1).values
    logits[4:] = logits[4:].flip(-1)
    targets = torch.randint(0, vocab, (8,), device=device)
    ours = fused_cross_entropy(logits, targets, vocab)
    torch.testing.assert_close(ours, F.cross_entropy(logits[:, :vocab], targets), rtol=1e-5, atol=1e-4)


@pytest.mark.skipif(not INTERPRET, reason="only under TRITON_INTERPRET=1 (tests/test_triton_kernels.py)")
def test_the_interpreter_sends_cpu_tensors_through_the_triton_kernels():
    assert fused_available(torch.device("cpu"))
