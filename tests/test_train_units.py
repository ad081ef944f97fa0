"""Small pieces of the trainer: the schedule, the compile-mode fallback after deaths while compiling,
the CUDA-graph mode's gradient bookkeeping, and compiled autograd."""

from __future__ import annotations

import math

import numpy as np
import pytest

from conftest import TINY_CONFIG
from x1_common.contracts import Heartbeat
from x1_pretrain.config import load_config
from x1_pretrain.train.schedule import lr_at
from x1_pretrain.train.setup import compile_choice


def test_lr_warms_up_linearly_then_follows_the_cosine_to_min_lr():
    optim = load_config(TINY_CONFIG, ["optim.lr=1.0", "optim.min_lr=0.1", "optim.warmup_steps=10"]).optim
    assert lr_at(0, optim, 110) == pytest.approx(0.1) and lr_at(9, optim, 110) == pytest.approx(1.0)
    assert lr_at(10, optim, 110) == pytest.approx(1.0)
    assert lr_at(60, optim, 110) == pytest.approx(0.1 + 0.45 * (1 + math.cos(math.pi * 0.5)))
    assert lr_at(110, optim, 110) == pytest.approx(0.1) and lr_at(500, optim, 110) == pytest.approx(0.1)


def test_a_death_while_compiling_falls_back_to_mode_default_then_to_eager(tmp_path):
    cfg = load_config(TINY_CONFIG, ["train.compile=true", "train.compile_mode=max-autotune"])
    assert compile_choice(cfg, tmp_path, None) == "max-autotune"
    healthy = Heartbeat(step=5, time=0.0, pid=1, phase="training")
    assert compile_choice(cfg, tmp_path, healthy) == "max-autotune"
    died = Heartbeat(step=0, time=0.0, pid=1, phase="compiling")
    assert compile_choice(cfg, tmp_path, died) == "default"  # the first death: mode default
    assert compile_choice(cfg, tmp_path, died) is None  # the second: eager, slower but it runs
    eager_cfg = load_config(TINY_CONFIG, ["train.compile=false"])
    assert compile_choice(eager_cfg, tmp_path, died) is None


def compiled_runs(tmp_path, tiny_data, key: str, values: tuple[str, str]) -> list[tuple[str, object]]:
    """Two 4-step compiled runs of the tiny config differing in train.<key>: (stderr, final weights path).

    Steps 1-3 carry an injected spike, whose batches come from another path than the loader's;
    neither those nor the loader's first batches may compile a graph the warm-up did not."""
    from conftest import run_module, train_args

    out = []
    for value in values:
        ckpt = tmp_path / value
        ckpt.mkdir()
        proc = run_module("x1_pretrain.train", *train_args(tiny_data, ckpt, f"file://{ckpt}/mlruns", total=4),
                          "--set", "optim.warmup_steps=2", "--set", "train.compile=true",
                          "--set", f"train.{key}={value}", "--inject-spike-at-step", "1")
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert "after the warm-up" not in proc.stderr, proc.stderr[-3000:]
        out.append((proc.stderr, ckpt / "final.safetensors"))
    return out


def test_the_compile_watch_counts_a_recompile_caused_by_other_strides():
    import torch

    from x1_pretrain.data.loader import split_window
    from x1_pretrain.train.components import CompileWatch

    f = torch.compile(lambda x: (x * 2).sum(), backend="eager")
    w = np.arange(2 * 9).reshape(2, 9)
    x, _ = split_window(w)
    f(x)
    watch = CompileWatch()
    f(split_window(w)[0])  # the same shape and strides: the cached graph
    assert watch.new_graphs() == 0
    f(torch.from_numpy(w)[:, :-1])  # a (2, 8) view of (2, 9): other strides, a second graph
    assert watch.new_graphs() == 1


def test_a_cuda_graph_compile_mode_trains_the_same_weights_as_mode_default(tmp_path, tiny_data):
    # Under CUDA graphs the loop keeps the gradients allocated and marks each micro-step as a new
    # replay; on the CPU there are no graphs, so this pins that the bookkeeping leaves the math alone.
    (log_a, final_a), (log_b, final_b) = compiled_runs(tmp_path, tiny_data, "compile_mode", ("default", "reduce-overhead"))
    assert "torch.compile mode=default" in log_a and "torch.compile mode=reduce-overhead" in log_b
    assert final_a.read_bytes() == final_b.read_bytes()


def assert_close_weights(final_a, final_b, rel_tol: float = 5e-5) -> None:
    from safetensors.torch import load_file

    a, b = load_file(final_a), load_file(final_b)
    for name, w in a.items():
        rel = ((b[name] - w).abs().max() / w.abs().max()).item()
        assert rel < rel_tol, f"{name}: relative difference {rel:.2e}"


def test_compiled_autograd_trains_the_same_weights_as_the_eager_backward(tmp_path, tiny_data):
    # Compiled autograd moves the fp32 gradient accumulation into the compiled backward: the same
    # sums, though the compiler may fuse them in another order (last-bit differences).
    (log_off, final_off), (log_on, final_on) = compiled_runs(tmp_path, tiny_data, "compiled_autograd", ("off", "on"))
    assert "compiled autograd" not in log_off and "compiled autograd" in log_on
    assert_close_weights(final_off, final_on)


@pytest.mark.parametrize("fused", [False, True], ids=["skipped-on-the-cpu", "skipped-on-the-device"])
def test_a_nonfinite_step_leaves_weights_and_optimizer_state_as_they_were(fused):
    # Fused AdamW skips on the device (found_inf), queued before the sync; the others are not called.
    import torch

    from x1_pretrain.train.distributed import Dist
    from x1_pretrain.train.loop import step_unless_nonfinite

    single = Dist(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))
    w = torch.nn.Parameter(torch.ones(8))
    opt = torch.optim.AdamW([w], lr=0.1, weight_decay=0.1, fused=fused)
    w.grad = torch.full((8,), 0.5)
    assert step_unless_nonfinite(opt, single, torch.tensor(2.0), torch.tensor(1.0)) == (2.0, 1.0, True)
    after_one = w.detach().clone()
    state = {k: v.clone() for k, v in opt.state[w].items()}
    assert not torch.equal(after_one, torch.ones(8))
    for loss, norm in ((float("nan"), 1.0), (2.0, float("inf"))):
        loss_v, norm_v, stepped = step_unless_nonfinite(opt, single, torch.tensor(loss), torch.tensor(norm))
        assert not stepped and (math.isnan(loss_v) or math.isinf(norm_v))
        assert torch.equal(w.detach(), after_one)
        for key, value in opt.state[w].items():
            assert torch.equal(value, state[key]), key
    step_unless_nonfinite(opt, single, torch.tensor(2.0), torch.tensor(1.0))
    assert not torch.equal(w.detach(), after_one) and opt.state[w]["step"].item() == 2
