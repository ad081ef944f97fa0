"""The supported torch range and the levers' probes (x1_pretrain.levers): a lever whose need is
unmet is switched off with a line saying so, recorded in MLflow and the manifest; a torch below
the floor is refused before any work; the image's pin, the floor and the measured figures agree."""

from __future__ import annotations

import dataclasses
import json
import re
import sys

import pytest
import torch

from conftest import REPO, cli_env, run_module, train_args
from x1_pretrain.config import load_config
from x1_pretrain.ops import levers

STANDIN = REPO / "tests" / "torch_standin.py"

# An H200 with everything: the features of the machine every figure was measured on.
HOPPER = levers.Features(cuda=True, capability=(9, 0), bf16=True, triton=True, cublaslt=True, addmm_out_dtype=True,
                         compiled_autograd=True, get_total_norm=True, flash_attn=True, torchao=True)
A100_CONFIG = REPO / "configs" / "x1-50m-a100.yaml"


def table_row(table: levers.LeverTable, name: str) -> levers.Lever:
    return next(r for r in table.rows if r.name == name)


def test_the_shipped_a100_config_runs_every_lever_on_a_gpu_that_has_them():
    cfg = load_config(A100_CONFIG)
    resolved, table = levers.resolve(cfg, HOPPER)
    assert resolved == cfg
    assert all(r.on and not r.note for r in table.rows), table.rows
    assert {"fused-kernels", "cublaslt-tuning", "bf16-step-weights", "in-matmul-accumulation", "compiled-autograd",
            "get-total-norm"} <= {r.name for r in table.rows}


@pytest.mark.parametrize(("missing", "lever", "field", "fallback"), [
    ({"triton": False}, "fused-kernels", "kernels", "torch"),
    ({"cublaslt": False}, "cublaslt-tuning", "cublaslt", "off"),
    ({"compiled_autograd": False}, "compiled-autograd", "compiled_autograd", False),
    ({"bf16": False, "capability": (7, 5)}, "bf16-step-weights", "weight_casts", "per-micro-step"),
    ({"cuda": False, "capability": None, "triton": False, "cublaslt": False, "addmm_out_dtype": False},
     "fused-kernels", "kernels", "torch"),
])
def test_an_unmet_need_switches_its_lever_off_in_the_config_and_says_why(missing, lever, field, fallback):
    cfg = load_config(A100_CONFIG)
    resolved, table = levers.resolve(cfg, dataclasses.replace(HOPPER, **missing))
    row = table_row(table, lever)
    assert not row.on and row.note and row.needs
    assert getattr(resolved.train, field) == fallback
    assert resolved.config_hash() == cfg.config_hash()  # a lever never changes the run's math


def test_in_matmul_accumulation_without_an_fp32_matmul_keeps_the_sums_and_says_how():
    cfg = load_config(A100_CONFIG)
    resolved, table = levers.resolve(cfg, dataclasses.replace(HOPPER, cublaslt=False, addmm_out_dtype=False))
    row = table_row(table, "in-matmul-accumulation")
    assert row.on and "bf16, then an fp32 add" in row.note
    assert resolved.train.grad_accumulation == "in-matmul"
    # cuBLASLt alone is enough to add into fp32 (a torch older than 2.8 on a GPU)
    _, table = levers.resolve(cfg, dataclasses.replace(HOPPER, addmm_out_dtype=False))
    assert table_row(table, "in-matmul-accumulation").note == ""


def test_cuda_graphs_and_compiled_autograd_off_the_gpu_or_under_torchrun():
    cfg = load_config(A100_CONFIG, ["train.compile_mode=reduce-overhead"])
    resolved, table = levers.resolve(cfg, dataclasses.replace(HOPPER, cuda=False, capability=None))
    assert not table_row(table, "cuda-graphs").on and "without CUDA graphs" in table_row(table, "cuda-graphs").note
    assert resolved.train.weight_casts == "per-micro-step"  # a replay copies its inputs: no step copies with graphs
    resolved, table = levers.resolve(load_config(A100_CONFIG), HOPPER, world_size=2)
    assert not resolved.train.compiled_autograd and "not in one process" in table_row(table, "compiled-autograd").note
    assert resolved.train.weight_casts == "per-micro-step" and resolved.train.grad_accumulation == "autograd"


def test_flash_attn_runs_only_when_asked_and_falls_back_to_sdpa_where_it_cannot():
    assert load_config(A100_CONFIG).model.attention == "sdpa"
    resolved, table = levers.resolve(load_config(A100_CONFIG), HOPPER)
    assert "flash-attn" not in {r.name for r in table.rows}  # SDPA, what was measured, unless asked
    asked = load_config(A100_CONFIG, ["model.attention=flash-attn"])
    resolved, table = levers.resolve(asked, HOPPER)
    assert resolved.model.attention == "flash-attn" and "asked for" in table_row(table, "flash-attn").note
    resolved, table = levers.resolve(asked, dataclasses.replace(HOPPER, flash_attn=False))
    assert resolved.model.attention == "sdpa" and not table_row(table, "flash-attn").on


def test_a_config_written_with_attention_auto_reads_as_sdpa():
    assert load_config(A100_CONFIG, ["model.attention=auto"]).model.attention == "sdpa"


def test_the_sm80_lever_set_never_takes_a_hopper_only_path():
    a100 = dataclasses.replace(HOPPER, capability=levers.ARCH_CAPABILITY["sm80"])
    assert a100.arch == "sm80"
    assert levers.float8_problem(a100) is not None and levers.float8_problem(HOPPER) is None
    resolved, table = levers.resolve(load_config(A100_CONFIG, ["train.gpu_arch=sm80"]), a100)
    assert resolved.train.float8 == "off"
    assert all(r.on for r in table.rows)  # the A100 keeps every other lever


def test_probing_on_this_machine_answers_each_need():
    f = levers.probe(torch.device("cpu"))
    assert not f.cuda and not f.triton and not f.cublaslt and not f.addmm_out_dtype
    assert f.get_total_norm == hasattr(torch.nn.utils, "get_total_norm")


@pytest.mark.parametrize(("version", "refused"), [
    ("2.5.1", True), ("2.5.1+cu124", True), ("2.5.0a0+e000cf0", True), ("1.13.1", True), ("garbage", True),
    ("2.6.0", False), ("2.11.0+cu130", False), ("2.13.0+cpu", False), ("2.10.0a0+git1234", False),
])
def test_the_floor_is_judged_on_the_release_number(version, refused):
    problem = levers.floor_problem(version)
    assert (problem is not None) == refused
    if refused:
        assert version in problem and "2.6" in problem


def test_a_torch_below_the_floor_is_refused_with_exit_2_naming_both_versions_before_any_work(tmp_path, tiny_data):
    ckpt = tmp_path / "ckpt"
    proc = run_module_standin(["--version", "2.5.1"], *train_args(tiny_data, ckpt, f"file://{tmp_path}/mlruns", total=4))
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "torch 2.5.1 is below the supported floor 2.6" in proc.stderr and levers.TORCH_MEASURED in proc.stderr
    assert not ckpt.exists() and not (tmp_path / "mlruns").exists()


def run_module_standin(standin_args: list[str], *args: str, module: str = "x1_pretrain.train"):
    import subprocess

    return subprocess.run([sys.executable, str(STANDIN), *standin_args, module, *args], capture_output=True,
                          text=True, timeout=300, env=cli_env(), cwd=REPO)


def test_a_torch_lacking_the_three_newer_calls_trains_and_says_so_in_its_log_mlflow_and_manifest(tmp_path, tiny_data):
    # torch 2.6 with none of the calls newer than it: get_total_norm (2.6 has it; gone here to pin the
    # fallback), compiled autograd's _enable (2.7) and addmm's out_dtype (2.8). The config asks for
    # every lever they serve: bf16 step weights with in-matmul accumulation and compiled autograd.
    ckpt, mlruns = tmp_path / "ckpt", f"file://{tmp_path}/mlruns"
    proc = run_module_standin(
        ["--version", "2.6.0", "--without", "get_total_norm,compiled_autograd,addmm_out_dtype"],
        *train_args(tiny_data, ckpt, mlruns, total=12), "--set", "optim.warmup_steps=2",
        "--set", "train.precision=bf16-mixed", "--set", "train.weight_casts=per-step",
        "--set", "train.grad_accumulation=in-matmul", "--set", "train.compiled_autograd=true")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert re.search(r"lever get-total-norm off: the norm of the per-tensor norms", proc.stderr)
    assert re.search(r"lever compiled-autograd off: train.compile is off", proc.stderr)
    assert re.search(r"lever in-matmul-accumulation on: each product in bf16, then an fp32 add", proc.stderr)
    assert (ckpt / "final.safetensors").is_file()
    out = tmp_path / "run"
    export = run_module("x1_pretrain.export_run", "--mlflow-uri", mlruns, "--output", str(out))
    assert export.returncode == 0, export.stderr[-2000:]
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["levers"]["get-total-norm"].startswith("off: the norm of the per-tensor norms")
    assert manifest["levers"]["bf16-step-weights"] == "on"
    assert manifest["levers"]["fused-kernels"].startswith("off")  # a CPU: PyTorch's ops
    assert manifest["versions"]["torch"] == "2.6.0"


def test_a_compile_that_fails_falls_back_to_eager_and_says_so(tmp_path, tiny_data):
    ckpt = tmp_path / "ckpt"
    proc = run_module_standin(["--without", "compile"], *train_args(tiny_data, ckpt, f"file://{tmp_path}/mlruns", total=4),
                              "--set", "optim.warmup_steps=2", "--set", "train.compile=true")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "torch.compile failed (this torch.compile cannot compile the model): falling back to eager" in proc.stderr
    assert (ckpt / "final.safetensors").is_file()


def test_the_grad_norm_without_get_total_norm_is_the_same_number(monkeypatch):
    from x1_pretrain.train.components import total_norm

    params = [torch.randn(5, 3), torch.randn(7), torch.randn(2, 2, 2)]
    with_call = total_norm(params)
    monkeypatch.delattr(torch.nn.utils, "get_total_norm")
    assert total_norm(params) == pytest.approx(with_call, rel=1e-6)


# ---- one supported range, stated once and agreed everywhere ---------------------------------

def _arg_default(text: str, name: str) -> str:
    return re.search(rf"^ARG {name}=(\S+)$", text, re.M).group(1)


def test_the_image_pin_the_floor_and_the_measured_figures_agree():
    dockerfile = (REPO / "Dockerfile").read_text()
    assert _arg_default(dockerfile, "TORCH_VERSION") == levers.TORCH_MEASURED
    assert _arg_default(dockerfile, "TORCH_CUDA") == levers.CUDA_MEASURED
    assert "nvcr.io" not in dockerfile
    compose = (REPO / "compose.yaml").read_text()
    assert f"TORCH_VERSION: ${{TORCH_VERSION:-{levers.TORCH_MEASURED}}}" in compose
    assert f"TORCH_CUDA: ${{TORCH_CUDA:-{levers.CUDA_MEASURED}}}" in compose
    env = (REPO / ".env.example").read_text()
    assert f"\nTORCH_VERSION={levers.TORCH_MEASURED}\n" in env and f"\nTORCH_CUDA={levers.CUDA_MEASURED}\n" in env
    floor = ".".join(map(str, levers.TORCH_FLOOR))
    pyproject = (REPO / "pyproject.toml").read_text()
    assert f'"torch>={floor}"' in pyproject and "torch>=2.5" not in pyproject
    deploy = (REPO / "docs" / "DEPLOY.md").read_text()
    assert f"torch {levers.TORCH_MEASURED}" in deploy and f"floor is torch {floor}" in deploy and "R580" in deploy
    assert "nvcr.io/nvidia/pytorch:24.10" not in deploy
    # docs/PERFORMANCE.md's current figures were measured on the image's torch
    perf = (REPO / "docs" / "PERFORMANCE.md").read_text()
    summary = perf[perf.index("## Summary"):][:4000]
    assert f"torch {levers.TORCH_MEASURED}+cu{levers.CUDA_MEASURED.replace('.', '')}" in summary


def test_the_torch_pin_check_fails_a_build_that_drifts():
    sys.path.insert(0, str(REPO / "trainer"))
    try:
        import torch_pin
    finally:
        sys.path.pop(0)
    assert torch_pin.problem("2.11.0+cu130", "13.0", "2.11.0", "13.0") is None
    assert torch_pin.problem("2.13.0+cpu", None, "2.13.0", "none") is None
    assert "2.5.0a0" in torch_pin.problem("2.5.0a0+e000cf0", "12.6", "2.11.0", "13.0")
    assert "CUDA 12.8" in torch_pin.problem("2.11.0+cu128", "12.8", "2.11.0", "13.0")
    assert "CPU build" in torch_pin.problem("2.11.0+cpu", None, "2.11.0", "13.0")
    installed = run_module("trainer.torch_pin", "--version", torch.__version__.split("+")[0], "--cuda",
                           torch.version.cuda or "none")
    assert installed.returncode == 0, installed.stderr
    drifted = run_module("trainer.torch_pin", "--version", "2.11.0", "--cuda", "13.0")
    assert drifted.returncode == (0 if torch.__version__.startswith("2.11.0") and torch.version.cuda == "13.0" else 1)


def test_a_driver_too_old_for_the_builds_cuda_is_refused_naming_driver_and_cuda(monkeypatch, tmp_path, tiny_data):
    from x1_pretrain.train import preflight
    from x1_pretrain.train.components import DataOrConfigError
    from x1_pretrain.train.setup import check_device

    assert preflight.cuda_init_problem() is None or torch.cuda.is_available() is False
    # A GPU host whose driver CUDA cannot use: the driver file says 535, this torch's CUDA fails to initialise.
    monkeypatch.setattr(preflight, "driver_version", lambda: "535.104.05")
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    monkeypatch.setattr(torch.cuda, "init", lambda: (_ for _ in ()).throw(
        RuntimeError("The NVIDIA driver on your system is too old (found version 12020).")))
    problem = preflight.cuda_init_problem()
    assert "CUDA 13.0" in problem and "driver 535.104.05" in problem and "too old" in problem and "R580" in problem
    with pytest.raises(DataOrConfigError, match=r"^train.device: auto: CUDA 13.0 .* driver 535.104.05"):
        check_device(load_config(A100_CONFIG))
    check_device(load_config(A100_CONFIG, ["train.device=cpu"]))  # a CPU run asks nothing of CUDA
