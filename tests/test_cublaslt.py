"""Matmuls through cuBLASLt with a timed algorithm: the same products as PyTorch's, whatever the
operands' layout and whichever candidate runs; the accumulating form adds once. The layout
mapping is checked on the CPU; the matmuls need a CUDA GPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from x1_pretrain.ops import cublaslt, losses

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="cuBLASLt needs a CUDA GPU")


def test_an_operand_is_described_as_stored_row_major_or_transposed_view_and_anything_else_is_refused():
    x = torch.empty(6, 4)
    assert cublaslt._transposed_col_major(x) == (cublaslt._OP_N, 4, 6, 4)  # x^T, stored column-major
    assert cublaslt._transposed_col_major(x.t()) == (cublaslt._OP_T, 4, 6, 4)  # x itself, transposed by the op
    assert cublaslt._transposed_col_major(torch.empty(6, 8)[:, :4]) == (cublaslt._OP_N, 4, 6, 8)  # a wider row
    with pytest.raises(ValueError, match="neither row- nor column-major"):
        cublaslt._transposed_col_major(torch.empty(6, 8)[:, ::2])


def test_without_a_gpu_the_tuned_matmuls_say_they_are_unavailable():
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    assert not cublaslt.available()


def _plan_with_candidates(*algos: int) -> cublaslt._Plan:
    results = []
    for first_word in algos:
        r = cublaslt._HeuristicResult()
        r.algo.data[0], r.algo.data[3] = first_word, 7
        results.append(r)
    return cublaslt._Plan(None, (None, None, None), results, stored_as="NVIDIA H200|sm_90|130100|64 x 1280 x 768")


def test_a_choice_kept_in_the_cache_file_is_taken_by_the_next_process_while_its_algorithm_is_the_same(
        tmp_path, monkeypatch):
    cache = tmp_path / "cache" / "cublaslt.json"
    monkeypatch.setenv(cublaslt.CACHE_ENV, str(cache))
    tuned = _plan_with_candidates(11, 12, 13)
    tuned.chosen, tuned.pytorch_ms, tuned.timings_ms = 2, 0.5, [0.6, 0.55, 0.4]
    cublaslt._store_choice(tuned)
    assert json.loads(cache.read_text())[tuned.stored_as]["rank"] == 2
    assert not list(cache.parent.glob("*.tmp"))

    assert cublaslt._stored_choice(_plan_with_candidates(11, 12, 13)) == 2  # a relaunch: same heuristic answer
    assert cublaslt._stored_choice(_plan_with_candidates(11, 12, 99)) is None  # another algorithm at rank 2: timed
    assert cublaslt._stored_choice(_plan_with_candidates(11, 12)) is None  # fewer candidates
    other_shape = _plan_with_candidates(11, 12, 13)
    other_shape.stored_as += "0"
    assert cublaslt._stored_choice(other_shape) is None

    pytorch_won = _plan_with_candidates(21, 22)
    pytorch_won.stored_as, pytorch_won.chosen, pytorch_won.pytorch_ms = "another shape", cublaslt.PYTORCH, 0.3
    pytorch_won.timings_ms = [0.4, 0.5]
    cublaslt._store_choice(pytorch_won)
    assert cublaslt._stored_choice(_plan_with_candidates(11, 12, 13)) == 2, "the second choice kept the first"
    fresh = _plan_with_candidates(21, 22)
    fresh.stored_as = "another shape"
    assert cublaslt._stored_choice(fresh) == cublaslt.PYTORCH


def test_the_summary_line_counts_the_shapes_timed_and_kept_and_names_the_file(monkeypatch):
    monkeypatch.setattr(cublaslt, "_plans", {})
    assert cublaslt.summary() is None, "nothing to say before the first matmul"
    for key, source in enumerate(["timed", "kept", "kept", "captured", ""]):
        plan = _plan_with_candidates(1)
        plan.source = source
        cublaslt._plans[key] = plan
    monkeypatch.setenv(cublaslt.CACHE_ENV, "/workspace/cache/cublaslt.json")
    assert cublaslt.summary() == ("cuBLASLt: 4 matmul shapes, 1 timed, 2 at the algorithm kept in "
                                  "/workspace/cache/cublaslt.json, 1 at the heuristic's first (inside a CUDA graph)")
    monkeypatch.delenv(cublaslt.CACHE_ENV)
    assert "kept in no file (X1_CUBLASLT_CACHE unset)" in cublaslt.summary()


def test_a_missing_torn_or_unwritable_cache_file_means_timing_again_and_never_an_error(tmp_path, monkeypatch):
    plan = _plan_with_candidates(1, 2)
    plan.chosen, plan.pytorch_ms, plan.timings_ms = 1, 0.5, [0.6, 0.4]
    monkeypatch.delenv(cublaslt.CACHE_ENV, raising=False)
    cublaslt._store_choice(plan)  # no file named: nothing kept
    assert cublaslt._stored_choice(plan) is None
    cache = tmp_path / "cublaslt.json"
    monkeypatch.setenv(cublaslt.CACHE_ENV, str(cache))
    assert cublaslt._stored_choice(plan) is None  # none yet
    cache.write_text('{"NVIDIA H200|sm_90|130100|64 x 1280 x 768": {"rank": 1, "al')
    assert cublaslt._stored_choice(plan) is None
    cache.write_text("[1, 2]")
    assert cublaslt._stored_choice(plan) is None
    blocked = tmp_path / "a-file"
    blocked.write_text("")
    monkeypatch.setenv(cublaslt.CACHE_ENV, str(blocked / "cublaslt.json"))  # its folder cannot be made
    cublaslt._store_choice(plan)
    assert cublaslt._stored_choice(plan) is None


def _operands(m: int, n: int, k: int, a_t: bool, b_t: bool) -> tuple[torch.Tensor, torch.Tensor]:
    a = torch.randn(k, m, device="cuda").bfloat16().t() if a_t else torch.randn(m, k, device="cuda").bfloat16()
    b = torch.randn(n, k, device="cuda").bfloat16().t() if b_t else torch.randn(k, n, device="cuda").bfloat16()
    return a, b


@CUDA
@pytest.mark.parametrize(("a_t", "b_t"), [(False, False), (False, True), (True, False), (True, True)])
def test_the_tuned_matmul_is_the_product_for_every_operand_layout(a_t, b_t):
    assert cublaslt.available()
    torch.manual_seed(0)
    a, b = _operands(1000, 776, 520, a_t, b_t)
    ours = cublaslt.tuned_mm(a, b)
    assert ours.shape == (1000, 776) and ours.is_contiguous() and ours.dtype == torch.bfloat16
    torch.testing.assert_close(ours.float(), a.float() @ b.float(), rtol=2e-2, atol=2e-2)
    pytorch_ms, candidates_ms = cublaslt.tuning(a, b)
    assert pytorch_ms > 0 and candidates_ms, "the first call times PyTorch's call and the candidates"


@CUDA
def test_every_candidate_the_tuning_times_computes_the_same_product():
    torch.manual_seed(1)
    a, b = _operands(2048, 1280, 768, False, True)  # a block's qkv projection, as the forward asks it
    ref = a.float() @ b.float()
    cublaslt.tuned_mm(a, b)
    n = len(cublaslt.tuning(a, b)[1])
    assert n >= 1
    for i in [cublaslt.PYTORCH, *range(n)]:
        torch.testing.assert_close(cublaslt.tuned_mm(a, b, algo=i).float(), ref, rtol=2e-2, atol=2e-2)


@CUDA
def test_the_accumulating_matmul_adds_its_product_once_in_fp32():
    torch.manual_seed(2)
    g = torch.randn(4096, 1000, device="cuda").bfloat16()
    x = torch.randn(4096, 64, device="cuda").bfloat16()
    acc = torch.randn(1000, 64, device="cuda")
    before = acc.clone()
    cublaslt.tuned_addmm_(acc, g.t(), x)  # the first call also tunes, into a scratch buffer
    cublaslt.tuned_addmm_(acc, g.t(), x)
    torch.testing.assert_close(acc, before + 2 * (g.t().float() @ x.float()), rtol=1e-4, atol=1e-2)


@CUDA
def test_the_head_with_tuned_matmuls_gives_the_loss_and_gradients_of_the_head_without():
    torch.manual_seed(3)
    vocab, padded, d = 9000, 9024, 64
    h = torch.randn(2048, d, device="cuda").bfloat16().requires_grad_()
    w = (torch.randn(padded, d, device="cuda") * 0.5).bfloat16().requires_grad_()
    targets = torch.randint(0, vocab, (2048,), device="cuda")
    results = []
    for tuned in (False, True):
        acc = torch.zeros(padded, d, device="cuda")
        loss = losses._HeadLoss.apply(h, w, targets, vocab, acc, tuned).mean()
        (dh,) = torch.autograd.grad(loss, [h])
        results.append((loss, dh, acc))
    for plain, tuned in zip(*results, strict=True):
        torch.testing.assert_close(tuned.float(), plain.float(), rtol=2e-2, atol=1e-5)


def test_the_availability_check_compiles_into_a_graph_as_a_constant():
    # torch.compile meets cublaslt.available() in every linear layer's forward: it must not break
    # the graph (it loads a library through ctypes, which dynamo cannot trace).
    f = torch.compile(lambda x: x * 2 if cublaslt.available() else x - 1, fullgraph=True, backend="eager")
    x = torch.ones(3)
    assert torch.equal(f(x), x * 2 if cublaslt.available() else x - 1)


def test_off_the_gpu_or_switched_off_a_layers_matmul_is_pytorchs():
    x, w = torch.randn(2, 5, 8), torch.randn(3, 8)
    assert not cublaslt.use_for(x)  # fp32, and on the CPU
    assert torch.equal(cublaslt.matmul(x, w.t()), x @ w.t())
    if torch.cuda.is_available():
        xb, wb = x.cuda().bfloat16(), w.cuda().bfloat16()
        assert cublaslt.use_for(xb)
        assert torch.equal(cublaslt.matmul(xb, wb.t(), False), xb @ wb.t())  # train.cublaslt=off: PyTorch's call


@CUDA
def test_tuning_without_pytorchs_fp32_addmm_times_only_cublaslts_candidates(monkeypatch):
    # A torch older than 2.8 has no addmm(out_dtype=): PyTorch's call must not be among the
    # candidates of an add into fp32 (it raised TypeError at the first backward), nor a kept choice.
    monkeypatch.setattr(cublaslt, "_ADDMM_INTO_FP32", False)
    monkeypatch.delenv(cublaslt.CACHE_ENV, raising=False)
    g = torch.randn(3000, 512, device="cuda").bfloat16()
    x = torch.randn(3000, 96, device="cuda").bfloat16()
    acc = torch.zeros(512, 96, device="cuda")
    cublaslt.tuned_addmm_(acc, g.t(), x)
    pytorch_ms, candidates_ms = cublaslt.tuning(g.t(), x, torch.float32)
    assert pytorch_ms is None and candidates_ms
    assert cublaslt.chosen(g.t(), x, torch.float32) != cublaslt.PYTORCH
    torch.testing.assert_close(acc, g.t().float() @ x.float(), rtol=1e-2, atol=1e-1)


@CUDA
def test_a_layers_matmul_and_its_weight_gradient_through_the_tuned_path_match_pytorchs():
    from x1_pretrain.ops.kernels import wgrad_accumulate

    torch.manual_seed(4)
    x = torch.randn(4, 512, 768, device="cuda").bfloat16()
    w = torch.randn(1280, 768, device="cuda").bfloat16()
    dy = torch.randn(4, 512, 1280, device="cuda").bfloat16()
    out = {}
    for enabled in (False, True):
        acc = torch.ones(1280, 768, device="cuda")
        wgrad_accumulate(acc, dy, x, enabled)
        out[enabled] = (cublaslt.matmul(x, w.t(), enabled), cublaslt.matmul(dy, w, enabled), acc)
    assert out[True][0].shape == (4, 512, 1280) and out[True][1].shape == (4, 512, 768)
    for plain, tuned in zip(out[False], out[True], strict=True):
        torch.testing.assert_close(tuned.float(), plain.float(), rtol=2e-2, atol=2e-2)


@CUDA
def test_a_second_process_runs_the_algorithms_the_first_chose_without_timing_them(tmp_path):
    script = """
import json, sys, torch
from x1_pretrain.ops import cublaslt
torch.manual_seed(0)
a = torch.randn(4096, 768, device="cuda").bfloat16()
b = torch.randn(2304, 768, device="cuda").bfloat16().t()
g = torch.randn(4096, 2304, device="cuda").bfloat16()
acc = torch.zeros(2304, 768, device="cuda")
cublaslt.tuned_mm(a, b)
cublaslt.tuned_addmm_(acc, g.t(), a)
print(json.dumps([cublaslt.chosen(a, b), cublaslt.tuning(a, b)[1] != [], cublaslt.summary()]))
"""
    env = {**os.environ, cublaslt.CACHE_ENV: str(tmp_path / "cublaslt.json")}
    runs = [json.loads(subprocess.run([sys.executable, "-c", script], env=env, check=True, capture_output=True,
                                      text=True).stdout.splitlines()[-1]) for _ in range(2)]
    assert runs[0][1] and not runs[1][1], "the first process timed the candidates, the second did not"
    assert runs[0][0] == runs[1][0], "both ran the same algorithm"
    assert runs[0][2].startswith("cuBLASLt: 2 matmul shapes, 2 timed, 0 at the algorithm kept in "), runs[0][2]
    assert runs[1][2].startswith("cuBLASLt: 2 matmul shapes, 0 timed, 2 at the algorithm kept in "), runs[1][2]
    assert len(json.loads((tmp_path / "cublaslt.json").read_text())) >= 2


def test_available_carries_the_mark_torch_compiler_sets_for_a_constant_result():
    # Our decorator spares every process the import of torch._dynamo; it must stay the one torch
    # applies, or torch.compile would trace into available() instead of keeping its answer.
    def probe() -> bool:
        return True

    marked = torch.compiler.assume_constant_result(probe)
    marks = {k: v for k, v in vars(marked).items() if k.startswith("_dynamo")}
    assert marks, "torch.compiler.assume_constant_result no longer marks the function itself"
    assert {k: v for k, v in vars(cublaslt.available).items() if k.startswith("_dynamo")} == marks


def test_importing_the_trainer_does_not_import_the_compiler_or_scipy():
    # Each trainer, rung and test process starts with these imports; torch._dynamo (2 s) comes with
    # torch.compile when a run compiles, SciPy (0.6 s) with the first forecast.
    code = ("import sys, x1_pretrain.train.main; "
            "print(sorted(m for m in ('torch._dynamo', 'scipy.optimize') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
