"""kernels.mm_rows: a matmul asked a few thousand rows at a time (the head's forward and input
gradient, the folded matmuls' input gradients: losses.HEAD_FWD_ROWS, losses.HEAD_DGRAD_ROWS,
kernels.NORMED_DGRAD_ROWS): the same product as one matmul, and the same gradients for the model."""

from __future__ import annotations

import pytest
import torch

from x1_pretrain import kernels, losses
from x1_pretrain.kernels import mm_rows

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("rows", [0, 1, 7, 333, 999, 1000, 5000])
def test_mm_rows_is_the_product_of_one_matmul_whatever_the_rows_per_launch(device, rows):
    torch.manual_seed(0)
    a = torch.randn(1000, 300, device=device)
    b = torch.randn(300, 768, device=device)
    out = mm_rows(a, b, rows)
    assert out.shape == (1000, 768) and out.dtype == a.dtype
    torch.testing.assert_close(out, a @ b, rtol=1e-5, atol=1e-4)


def test_mm_rows_passes_the_custom_op_checks_and_compiles_without_a_graph_break():
    a, b = torch.randn(50, 16), torch.randn(16, 24)
    torch.library.opcheck(mm_rows, (a, b, 7))
    compiled = torch.compile(lambda a, b: mm_rows(a, b, 7) * 2, fullgraph=True, backend="aot_eager")
    torch.testing.assert_close(compiled(a, b), (a @ b) * 2)


def test_the_models_gradients_are_the_same_with_its_input_gradients_asked_in_row_launches(monkeypatch):
    from test_bf16_weights import batch, loss_and_grads, tiny_model

    model = tiny_model(kernels=True)  # the head as one Function, the norms folded: both switches' paths
    x, y = batch(2)
    loss, grads = loss_and_grads(model, x, y)
    calls = []

    def counted(a, b, rows):
        calls.append((a.size(0), rows))
        return mm_rows(a, b, rows)

    monkeypatch.setattr(losses, "mm_rows", counted)
    monkeypatch.setattr(kernels, "mm_rows", counted)
    monkeypatch.setattr(losses, "HEAD_FWD_ROWS", 41)
    monkeypatch.setattr(losses, "HEAD_DGRAD_ROWS", 37)
    monkeypatch.setattr(kernels, "NORMED_DGRAD_ROWS", 29)
    loss_r, grads_r = loss_and_grads(model, x, y)
    # the head's forward and input gradient once each, two folded matmuls per block; every one
    # over more rows than a launch takes
    assert sorted(r for _, r in calls) == [29] * 2 * len(model.layers) + [37, 41]
    assert all(n > r for n, r in calls)
    assert torch.equal(loss, loss_r)
    # The same products in bf16; a matmul over fewer rows may sum its long K (the head's 50304) in
    # another order, so a few roundings of bf16 apart, not bit for bit. A row put in the wrong
    # place would be off by the gradient's whole size.
    for name, g in grads.items():
        assert (grads_r[name] - g).abs().max() <= g.abs().max() / 64, name
