"""The step's bf16 weights (model.Bf16Weights, train.weight_casts=per-step): cast once per optimizer
step instead of by autocast at every micro-step, with the same values and the same gradients."""

from __future__ import annotations

import pytest
import torch

from conftest import TINY_CONFIG, run_module, train_args


def tiny_model(kernels: bool):
    from x1_pretrain.config import load_config
    from x1_pretrain.model.transformer import Transformer

    torch.manual_seed(0)
    model = Transformer(load_config(TINY_CONFIG, []).model)
    model.use_kernels(kernels)  # on the CPU the kernels' PyTorch paths; with them the norms fold
    model.residual_dtype = torch.bfloat16
    with torch.no_grad():  # norm weights away from one, so that a fold that forgot them would show
        for p in model.parameters():
            if p.dim() == 1:
                p.add_(torch.randn_like(p) * 0.1)
    return model


def loss_and_grads(model, x, y, copies=None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = model(x, y) if copies is None else model(x, y, copies)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def bf16_run(ckpt, tiny_data, steps: int, *sets: str) -> tuple[object, str]:
    """A bf16-mixed run of the tiny config on the CPU: (its final weights' path, its stderr)."""
    extra = [a for s in sets for a in ("--set", s)]
    proc = run_module("x1_pretrain.train", *train_args(tiny_data, ckpt, f"file://{ckpt}/mlruns", total=steps),
                      "--set", "optim.warmup_steps=2", "--set", "train.precision=bf16-mixed", *extra)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return ckpt / "final.safetensors", proc.stderr


def batch(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    w = torch.randint(0, 50257, (2, 65), generator=g)
    return w[:, :-1], w[:, 1:]


@pytest.mark.parametrize("kernels", [False, True], ids=["plain-path", "norms-folded"])
def test_the_step_copies_give_autocasts_loss_and_gradients_bit_for_bit(kernels):
    from x1_pretrain.model.transformer import Bf16Weights

    model = tiny_model(kernels)
    assert all(b.folds_norms() == kernels for b in model.layers)
    x, y = batch(1)
    loss, grads = loss_and_grads(model, x, y)
    loss_c, grads_c = loss_and_grads(model, x, y, Bf16Weights(model).refresh())
    assert torch.equal(loss, loss_c)
    for name, g in grads.items():
        assert g.dtype == torch.float32 and torch.equal(g, grads_c[name]), name


def test_refresh_takes_the_weights_as_the_optimizer_step_left_them():
    from x1_pretrain.model.transformer import Bf16Weights

    model = tiny_model(True)
    copies = Bf16Weights(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    x, y = batch(2)
    loss_and_grads(model, x, y, copies.refresh())
    opt.step()
    fresh, _ = loss_and_grads(model, x, y)
    stale, _ = loss_and_grads(model, x, y, copies.copies)  # last step's copies: a different loss
    assert not torch.equal(stale, fresh)
    refreshed, _ = loss_and_grads(model, x, y, copies.refresh())
    assert torch.equal(refreshed, fresh)


def test_a_block_given_copies_for_the_other_path_finds_none():
    from x1_pretrain.model.transformer import Bf16Weights

    model = tiny_model(False)
    copies = Bf16Weights(model).refresh()  # unfolded copies
    model.use_kernels(True)  # now the blocks fold their norms: the folded product is not among them
    x, y = batch(3)
    with pytest.raises(KeyError, match="wqkv_folded"):
        loss_and_grads(model, x, y, copies)


def test_a_bf16_run_trains_the_same_weights_with_copies_per_step_as_with_autocasts_casts(tmp_path, tiny_data):
    # Accumulation 2 (tiny config): each step's two micro-steps share one refresh, and each step's
    # refresh follows the optimizer step before it; a stale copy would change every later weight.
    from safetensors.torch import load_file

    finals, logs = {}, {}
    for casts in ("per-step", "per-micro-step"):
        final, logs[casts] = bf16_run(tmp_path / casts, tiny_data, 4, "train.grad_accumulation=autograd",
                                      f"train.weight_casts={casts}")
        finals[casts] = load_file(final)
    assert "cast once per optimizer step" in logs["per-step"]
    assert "cast once per optimizer step" not in logs["per-micro-step"]
    a, b = finals["per-step"], finals["per-micro-step"]
    assert a.keys() == b.keys()
    for name, w in a.items():
        assert torch.equal(w, b[name]), name


@pytest.mark.parametrize(("sets", "world_size", "takes_copies"), [
    (["train.precision=bf16-mixed"], 1, True),
    (["train.precision=bf16-mixed", "train.weight_casts=per-micro-step"], 1, False),
    ([], 1, False),  # fp32: no casts to replace
    (["train.precision=bf16-mixed", "train.float8=tensorwise"], 1, False),  # torchao casts its own
    (["train.precision=bf16-mixed", "train.compile_mode=reduce-overhead"], 1, False),  # replays copy their inputs
    (["train.precision=bf16-mixed"], 2, False),  # under torchrun each rank casts per micro-step
], ids=["bf16-one-process", "asked-per-micro-step", "fp32", "float8", "cuda-graphs", "two-processes"])
def test_the_trainer_takes_copies_only_where_they_replace_autocasts_casts_exactly(sets, world_size, takes_copies):
    from x1_pretrain.config import load_config
    from x1_pretrain.model.transformer import Bf16Weights, Transformer
    from x1_pretrain.train.distributed import Dist
    from x1_pretrain.train.setup import bf16_weights

    cfg = load_config(TINY_CONFIG, sets)
    dist = Dist(rank=0, world_size=world_size, local_rank=0, device=torch.device("cpu"))
    copies = bf16_weights(cfg, dist, Transformer(cfg.model))
    assert isinstance(copies, Bf16Weights) if takes_copies else copies is None


# ---- weight gradients added in fp32 by their matmuls (train.grad_accumulation=in-matmul) ----------


def step_grads(model, batches, copies=None, autocast=True) -> dict[str, torch.Tensor]:
    """The gradients of one optimizer step over `batches` (its micro-steps), published if `copies`."""
    model.zero_grad(set_to_none=True)
    step_copies = copies.refresh() if copies is not None else None
    for x, y in batches:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            loss = model(x, y) if step_copies is None else model(x, y, step_copies)
        (loss / len(batches)).backward()
    if copies is not None:
        copies.publish()
    return {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("kernels", [False, True], ids=["plain-path", "norms-folded"])
def test_gradients_added_in_their_matmuls_are_as_close_to_fp32_as_autograds(kernels):
    # Three micro-steps. The fp32 step is the truth both are held to: summing in the matmul skips
    # the bf16 rounding of each micro-step's part, so it may be closer, never farther (5% slack for
    # the forward's own bf16 noise). A wrong split of a folded product's gradient into its weight's
    # and its norm's would be off by ~100%.
    from x1_pretrain.model.transformer import Bf16Weights

    model = tiny_model(kernels)
    batches = [batch(10 + i) for i in range(3)]
    autograd = step_grads(model, batches)
    in_matmul = step_grads(model, batches, Bf16Weights(model, accumulate=True))
    model.residual_dtype = None
    fp32 = step_grads(model, batches, autocast=False)
    for name, truth in fp32.items():
        err_autograd = ((autograd[name] - truth).norm() / truth.norm()).item()
        err_in_matmul = ((in_matmul[name] - truth).norm() / truth.norm()).item()
        assert err_autograd < 0.02, name  # the bf16 step itself is close to fp32
        assert err_in_matmul <= 1.05 * err_autograd, f"{name}: {err_in_matmul:.2e} against autograd's {err_autograd:.2e}"


def test_a_step_that_accumulates_in_the_matmuls_leaves_no_gradient_from_the_step_before():
    from x1_pretrain.model.transformer import Bf16Weights

    model = tiny_model(True)
    copies = Bf16Weights(model, accumulate=True)
    first = step_grads(model, [batch(20)], copies)
    step_grads(model, [batch(21)], copies)
    again = step_grads(model, [batch(20)], copies)  # refresh emptied the buffers: the same step's gradients
    for name, g in first.items():
        assert torch.equal(g, again[name]), name


def test_accumulating_in_the_matmuls_without_the_step_copies_is_refused():
    from x1_pretrain.config import ConfigError, load_config

    with pytest.raises(ConfigError, match="weight_casts=per-step"):
        load_config(TINY_CONFIG, ["train.grad_accumulation=in-matmul", "train.weight_casts=per-micro-step"])


def test_a_bf16_run_that_accumulates_in_the_matmuls_learns_what_autograds_run_learns(tmp_path, tiny_data):
    # Adam's first steps amplify last-bit gradient differences on near-zero elements, so the
    # weights are compared as a model: the loss both final models give on held-out windows.
    from safetensors.torch import load_file

    from x1_pretrain.config import load_config
    from x1_pretrain.data.loader import open_token_data
    from x1_pretrain.model.transformer import Transformer

    cfg = load_config(TINY_CONFIG, [])
    val = torch.from_numpy(open_token_data(tiny_data, cfg.model.vocab_size).val[: 8 * 65].astype("int64")).view(8, 65)
    losses, logs = {}, {}
    for mode in ("autograd", "in-matmul"):
        final, logs[mode] = bf16_run(tmp_path / mode, tiny_data, 6, f"train.grad_accumulation={mode}")
        model = Transformer(cfg.model)
        model.load_state_dict(load_file(final))
        with torch.no_grad():
            losses[mode] = model(val[:, :-1], val[:, 1:]).item()
    assert "weight gradients" in logs["in-matmul"] and "weight gradients" not in logs["autograd"]
    assert abs(losses["in-matmul"] - losses["autograd"]) / losses["autograd"] < 0.005, losses
