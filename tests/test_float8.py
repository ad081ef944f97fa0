"""float8 training (torchao): which layers it converts, that it computes what the model computes
within float8's rounding, that a machine that cannot run it is refused before anything is
written, and the parity benchmark end to end (CPU: PyTorch's own float8 matmul; the GPU test runs
where a GPU with float8 tensor cores is)."""

from __future__ import annotations

import copy
import importlib.util
import json
import sys

import pytest
import torch

from conftest import CONFIGS, REPO, TINY_CONFIG, cli_env, run_module, train_args
from x1_pretrain.config import ConfigError, load_config
from x1_pretrain.model.transformer import Transformer
from x1_pretrain.ops import float8

pytest.importorskip("torchao.float8")
from torchao.float8.float8_linear import Float8Linear  # noqa: E402

BLOCK_LINEARS = ("attn.wqkv", "attn.wo", "mlp.w_gate_up", "mlp.w_down")


def tiny(d_ff: int = 176) -> Transformer:
    torch.manual_seed(0)
    return Transformer(load_config(TINY_CONFIG, [f"model.d_ff={d_ff}"]).model)


def float8_names(model: torch.nn.Module) -> list[str]:
    return [name for name, m in model.named_modules() if isinstance(m, Float8Linear)]


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_float8_swaps_every_block_linear_and_keeps_the_parameters_and_their_names(recipe):
    model = tiny()
    before = dict(model.named_parameters())
    converted = float8.convert(model, recipe)
    expected = [f"layers.{i}.{name}" for i in range(2) for name in BLOCK_LINEARS]
    assert sorted(converted) == sorted(expected) == sorted(float8_names(model))
    after = dict(model.named_parameters())
    # The same Parameter objects: checkpoints, the optimizer and weight tying are untouched.
    assert after.keys() == before.keys() and all(after[k] is before[k] for k in before)
    assert model.state_dict().keys() == tiny().state_dict().keys()


def test_linears_whose_sizes_are_not_multiples_of_16_keep_their_precision():
    model = tiny(d_ff=172)  # the tiny config's own width: 2 x 172 = 344 rows, 172 columns
    converted = float8.convert(model, "tensorwise")
    assert sorted(converted) == [f"layers.{i}.attn.{n}" for i in range(2) for n in ("wo", "wqkv")]
    assert not any("mlp" in name for name in float8_names(model))


def test_float8_loss_and_gradients_stay_within_float8_rounding_of_the_model():
    ref = tiny()
    f8 = copy.deepcopy(ref)
    float8.convert(f8, "tensorwise")
    g = torch.Generator().manual_seed(1)
    w = torch.randint(0, 50257, (8, 65), generator=g)
    x, y = w[:, :-1], w[:, 1:]
    loss_ref, loss_f8 = ref(x, y), f8(x, y)
    loss_ref.backward()
    loss_f8.backward()
    assert abs(loss_f8.item() - loss_ref.item()) / loss_ref.item() < 1e-3
    assert loss_f8.item() != loss_ref.item()  # the float8 matmuls did run
    for (name, p_ref), p_f8 in zip(ref.named_parameters(), f8.parameters(), strict=True):
        cos = torch.nn.functional.cosine_similarity(p_ref.grad.flatten(), p_f8.grad.flatten(), dim=0).item()
        assert cos > 0.99, f"{name}: cosine {cos:.4f} between the gradients"


@pytest.mark.parametrize(
    "name, capability, refused",
    [("NVIDIA A100-SXM4-80GB", (8, 0), True), ("NVIDIA A10G", (8, 6), True), ("NVIDIA L4", (8, 9), False),
     ("NVIDIA H200", (9, 0), False), ("NVIDIA B200", (10, 0), False)],
)
def test_only_gpus_with_float8_tensor_cores_are_accepted(name, capability, refused):
    problem = float8.capability_problem(name, capability)
    assert (problem is not None) == refused
    if refused:
        assert name in problem and f"{capability[0]}.{capability[1]}" in problem and "8.9" in problem


def test_float8_enters_the_config_hash_only_when_on():
    base = load_config(TINY_CONFIG)
    assert load_config(TINY_CONFIG, ["train.float8=off"]).config_hash() == base.config_hash()
    tensorwise = load_config(TINY_CONFIG, ["train.float8=tensorwise"]).config_hash()
    rowwise = load_config(TINY_CONFIG, ["train.float8=rowwise"]).config_hash()
    assert len({base.config_hash(), tensorwise, rowwise}) == 3
    with pytest.raises(ConfigError, match=r"^train\.float8"):
        load_config(TINY_CONFIG, ["train.float8=e4m3"])


def test_a_trainer_without_torchao_refuses_float8_with_exit_2_and_writes_nothing(tmp_path, tiny_data):
    hidden = tmp_path / "no-torchao"
    (hidden / "torchao").mkdir(parents=True)
    (hidden / "torchao" / "__init__.py").write_text("raise ImportError('No module named torchao')\n")
    ckpt = tmp_path / "ckpt"
    env = cli_env(PYTHONPATH=f"{hidden}:{cli_env().get('PYTHONPATH', '')}")
    proc = run_module("x1_pretrain.train", *train_args(tiny_data, ckpt, f"file://{tmp_path}/mlruns", total=4),
                      "--set", "optim.warmup_steps=2", "--set", "train.float8=tensorwise", env=env)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "train.float8=tensorwise" in proc.stderr and "pip install torchao" in proc.stderr
    assert not ckpt.exists() and not (tmp_path / "mlruns").exists()


@pytest.fixture(scope="module")
def parity():
    spec = importlib.util.spec_from_file_location("loss_parity", REPO / "bench" / "loss_parity.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_parity_verdict_fails_when_either_final_loss_moves_more_than_the_tolerance(parity):
    base = {"final_val_loss": 4.00, "tail_train_loss": 4.10}
    assert parity.verdict(base, {"final_val_loss": 4.03, "tail_train_loss": 4.12}, 0.01)["verdict"] == "PASS"
    assert parity.verdict(base, {"final_val_loss": 4.05, "tail_train_loss": 4.10}, 0.01)["verdict"] == "FAIL"
    assert parity.verdict(base, {"final_val_loss": 4.00, "tail_train_loss": 4.00}, 0.01)["verdict"] == "FAIL"


def test_parity_benchmark_trains_both_runs_and_the_float8_weights_load_as_a_plain_model(tmp_path, tiny_data, parity, capsys):
    from x1_pretrain.checkpoint.load import model_from_weights

    out = tmp_path / "parity"
    code = parity.main(["--config", str(TINY_CONFIG), "--data-dir", str(tiny_data), "--out", str(out), "--steps", "12",
                        "--tokens-per-step", "512", "--log-every", "2", "--set", "model.d_ff=176"])
    printed = capsys.readouterr().out
    result = json.loads((out / "parity.json").read_text())
    assert code == (0 if result["verdict"] == "PASS" else 1) and result["verdict"] in printed
    base, f8 = result["baseline"], result["candidate"]
    assert [s for s, _ in base["loss"]] == [s for s, _ in f8["loss"]] == list(range(2, 13, 2))
    assert base["loss"][-1][1] < base["loss"][0][1] and f8["loss"][-1][1] < f8["loss"][0][1]
    assert result["val_loss_rel_diff"] == pytest.approx(abs(f8["final_val_loss"] - base["final_val_loss"]) / base["final_val_loss"])
    assert "float8 (tensorwise): 8 linear layers in float8" in (out / "float8-tensorwise" / "train.log").read_text()
    assert (out / "parity.png").stat().st_size > 10_000
    # The float8 run's weights are a plain model's: same names, and they load without torchao's modules.
    model = model_from_weights(out / "float8-tensorwise" / "ckpt" / "final.safetensors")
    assert float8_names(model) == [] and len(list(model.parameters())) == len(list(tiny().parameters()))


def test_parity_benchmark_refuses_bad_input_with_exit_2_before_training(tmp_path, parity, capsys):
    code = parity.main(["--data-dir", str(tmp_path / "nowhere"), "--out", str(tmp_path / "out"), "--steps", "0"])
    err = capsys.readouterr().err
    assert code == 2 and "--steps must be positive" in err and "no train.bin" in err
    assert not (tmp_path / "out").exists()


needs_float8_gpu = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability() < float8.MIN_CAPABILITY,
    reason="needs a GPU with float8 tensor cores (compute capability 8.9+)")


@needs_float8_gpu
@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_float8_on_the_gpu_computes_the_50m_models_loss_and_gradients_within_float8_rounding(recipe):
    # The 50M model's widths, two of its blocks, eager: the trainer's compiled path is what
    # bench/loss_parity.py runs.
    cfg = load_config(CONFIGS / "x1-50m-h200.yaml", ["model.n_layer=2"]).model
    torch.manual_seed(0)
    ref = Transformer(cfg).cuda()
    f8 = copy.deepcopy(ref)
    assert len(float8.convert(f8, recipe)) == 4 * cfg.n_layer
    w = torch.randint(0, cfg.vocab_size, (8, cfg.seq_len + 1), device="cuda")
    losses = []
    for model in (ref, f8):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(w[:, :-1], w[:, 1:])
        loss.backward()
        losses.append(loss.item())
    cosines = {name: torch.nn.functional.cosine_similarity(p_ref.grad.flatten().float(), p_f8.grad.flatten().float(),
                                                           dim=0).item()
               for (name, p_ref), p_f8 in zip(ref.named_parameters(), f8.parameters(), strict=True)}
    worst = min(cosines, key=cosines.get)
    summary = f"losses {losses}; gradient cosines {({k: round(v, 4) for k, v in cosines.items()})}"
    assert losses[1] != losses[0] and abs(losses[1] - losses[0]) / losses[0] < 1e-2, summary
    assert cosines[worst] > 0.98, summary


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
