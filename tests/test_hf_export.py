"""The Hugging Face export: transformers' LlamaForCausalLM gives our logits, AutoTokenizer gives our ids,
and the folder appears complete or not at all."""

from __future__ import annotations

import json
import os
import stat
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from conftest import CONFIGS, TINY_CONFIG, run_module
from x1_pretrain.checkpoint.weights import save_weights
from x1_pretrain.config import load_config
from x1_pretrain.data.tokenizer import EOT_TOKEN, gpt2_encoding
from x1_pretrain.model.transformer import Transformer
from x1_pretrain.run import hf_export
from x1_pretrain.run.sample import generate

transformers = pytest.importorskip("transformers")
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

# The dtype argument of from_pretrained is `dtype` in transformers 5, `torch_dtype` before.
_DTYPE_KW = "dtype" if int(transformers.__version__.split(".")[0]) >= 5 else "torch_dtype"

# English, accents, CJK, emoji (multi-byte and ZWJ sequences), Arabic, code, whitespace runs,
# contractions, digits, and strings that look like special tokens but are text in our data.
MULTILINGUAL = (
    "The quick brown fox doesn't jump; it's 2024 and we've 3.14159 reasons.\n"
    "Café, naïve façade, Ærøskøbing, straße, Ἀθῆναι, Привет, мир!\n"
    "日本語のテキストと中文混合，한국어도 있어요。\n"
    "Emoji: 🤖🎉👩‍👩‍👧‍👦 🇫🇷 ✔︎\n"
    "مرحبا بالعالم، هذا نص عربي.\n"
    "def f(x):\n\treturn {'a': x ** 2}  # comment\n"
    "    indented    with   runs\t\t of\u00a0whitespace   \n\n\n"
    "<|endoftext|>after the fake end<|endoftext|><|im_start|>user\nhi<|im_end|> <s></s> [INST]\n"
    "trailing spaces   "
)


def random_model(cfg, seed: int = 0) -> Transformer:
    """Random init with the norm weights moved off one, so that a norm mapped to the wrong place shows."""
    torch.manual_seed(seed)
    model = Transformer(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:
                p.add_(0.2 * torch.randn_like(p))
    return model


def write_checkpoint(root: Path, model: Transformer) -> Path:
    """A step_* folder as the trainer writes it (model.safetensors, config in the metadata)."""
    step = root / "checkpoints" / "step_00000100"
    save_weights(step / "model.safetensors", model.state_dict(), model.cfg)
    return step


def load_hf(export_dir: Path, attn: str):
    return AutoModelForCausalLM.from_pretrained(export_dir, attn_implementation=attn, **{_DTYPE_KW: torch.float32}).eval()


def max_logit_diff(model: Transformer, hf_model, idx: torch.Tensor) -> float:
    with torch.no_grad():
        ours = model.logits(idx)
        theirs = hf_model(idx).logits.float()
    assert theirs.shape == ours.shape == (*idx.shape, 50257)
    return (ours - theirs).abs().max().item()


@pytest.fixture(scope="module")
def tiny_export(tmp_path_factory: pytest.TempPathFactory) -> tuple[Transformer, Path]:
    # rope_base off the default 10000: a config.json whose rope_theta were ignored would not pass.
    cfg = load_config(TINY_CONFIG, ["model.rope_base=500", "model.norm_eps=1e-6"]).model
    model = random_model(cfg)
    root = tmp_path_factory.mktemp("tiny")
    assert hf_export.main(["--checkpoint", str(write_checkpoint(root, model)), "--output", str(root / "hf")]) == 0
    return model, root / "hf"


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_transformers_llama_logits_match_ours_on_the_tiny_config(tiny_export, attn):
    model, export_dir = tiny_export
    idx = torch.randint(0, 50257, (2, model.cfg.seq_len), generator=torch.Generator().manual_seed(1))
    assert max_logit_diff(model, load_hf(export_dir, attn), idx) < 1e-4


def test_transformers_llama_logits_match_ours_on_the_50m_config_at_random_init(tmp_path):
    cfg = load_config(CONFIGS / "x1-50m-a100.yaml").model
    model = random_model(cfg, seed=3)
    out = hf_export.export(write_checkpoint(tmp_path, model), tmp_path / "hf")
    idx = torch.randint(0, 50257, (1, 64), generator=torch.Generator().manual_seed(2))
    for attn in ("eager", "sdpa"):
        assert max_logit_diff(model, load_hf(out, attn), idx) < 1e-4, attn


def test_the_logits_check_catches_an_interleaved_rotary_layout(tiny_export):
    """Permuting Q/K rows as Meta-to-HF conversions do must break the match: the check has teeth."""
    model, export_dir = tiny_export
    hf_model = load_hf(export_dir, "eager")
    hd = model.cfg.head_dim
    with torch.no_grad():
        for layer in hf_model.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj):
                w = proj.weight
                heads = w.shape[0] // hd
                proj.weight.copy_(w.view(heads, hd // 2, 2, -1).transpose(1, 2).reshape_as(w))
    idx = torch.randint(0, 50257, (1, 32), generator=torch.Generator().manual_seed(1))
    assert max_logit_diff(model, hf_model, idx) > 1e-3


def test_export_config_names_the_models_shapes_and_drops_padded_rows(tiny_export):
    model, export_dir = tiny_export
    cfg = model.cfg
    config = json.loads((export_dir / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert config["vocab_size"] == 50257 and cfg.padded_vocab_size == 50304
    assert (config["num_attention_heads"], config["num_key_value_heads"]) == (cfg.n_head, cfg.n_kv_head)
    assert cfg.n_kv_head < cfg.n_head  # the tiny config exercises GQA
    assert (config["hidden_size"], config["intermediate_size"], config["head_dim"]) == (cfg.d_model, cfg.d_ff, cfg.head_dim)
    assert config["num_hidden_layers"] == cfg.n_layer
    assert config["rope_theta"] == 500.0 and config["rms_norm_eps"] == 1e-6
    assert config["max_position_embeddings"] == cfg.seq_len
    assert config["tie_word_embeddings"] is True
    assert config["bos_token_id"] == config["eos_token_id"] == EOT_TOKEN
    with safe_open(str(export_dir / "model.safetensors"), framework="pt") as f:
        assert f.get_slice("model.embed_tokens.weight").get_shape() == [50257, cfg.d_model]
        assert "lm_head.weight" not in set(f.keys())  # tied: loaded as embed_tokens
        assert f.metadata()["format"] == "pt"
    gen = json.loads((export_dir / "generation_config.json").read_text())
    assert gen["bos_token_id"] == gen["eos_token_id"] == EOT_TOKEN


def test_transformers_greedy_generation_equals_ours_on_an_eot_conditioned_prompt(tiny_export):
    model, export_dir = tiny_export
    tok = AutoTokenizer.from_pretrained(export_dir)
    prompt = [tok.bos_token_id, *tok("The meaning of life is")["input_ids"]]
    assert prompt[0] == EOT_TOKEN
    ours = generate(model, prompt, 24, temperature=0, stop_token=EOT_TOKEN)
    hf_model = load_hf(export_dir, "sdpa")
    with torch.no_grad():
        out = hf_model.generate(torch.tensor([prompt]), max_new_tokens=24, do_sample=False,
                                attention_mask=torch.ones(1, len(prompt), dtype=torch.long))
    assert out[0, len(prompt):].tolist() == ours


@pytest.mark.parametrize("use_fast", [True, False])
def test_exported_tokenizer_gives_our_tiktoken_ids_on_multilingual_text(tiny_export, use_fast):
    _, export_dir = tiny_export
    tok = AutoTokenizer.from_pretrained(export_dir, use_fast=use_fast)
    ours = gpt2_encoding().encode_ordinary(MULTILINGUAL)
    assert EOT_TOKEN not in ours  # the literal "<|endoftext|>" is text for us ...
    assert tok(MULTILINGUAL)["input_ids"] == ours  # ... and for the export, which adds no token of its own
    assert tok.encode(MULTILINGUAL) == ours
    assert tok.decode(ours) == MULTILINGUAL
    assert tok.bos_token_id == tok.eos_token_id == EOT_TOKEN
    assert tok.decode([EOT_TOKEN]) == "<|endoftext|>"


def test_bf16_export_loads_with_bf16_weights(tmp_path):
    cfg = load_config(TINY_CONFIG).model
    model = random_model(cfg)
    out = hf_export.export(write_checkpoint(tmp_path, model), tmp_path / "hf", dtype="bf16", with_tokenizer=False)
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == "bfloat16"
    hf_model = AutoModelForCausalLM.from_pretrained(out, **{_DTYPE_KW: torch.bfloat16})
    assert hf_model.model.embed_tokens.weight.dtype == torch.bfloat16
    idx = torch.randint(0, 50257, (1, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert (model.logits(idx) - hf_model(idx).logits.float()).abs().max().item() < 0.1


def test_missing_checkpoint_exits_2_and_leaves_no_output(tmp_path):
    proc = run_module("x1_pretrain.hf_export", "--checkpoint", str(tmp_path / "nope"), "--output", str(tmp_path / "hf"))
    assert proc.returncode == 2
    assert "nope" in proc.stderr and "no weights file" in proc.stderr
    assert list(tmp_path.iterdir()) == []


def test_corrupt_weights_file_exits_2_and_leaves_no_partial_folder(tmp_path, capsys):
    bad = tmp_path / "final.safetensors"
    bad.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json at all}")
    assert hf_export.main(["--checkpoint", str(bad), "--output", str(tmp_path / "hf")]) == 2
    assert "final.safetensors" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["final.safetensors"]


def test_existing_output_is_kept_unless_forced(tiny_export, tmp_path, capsys):
    model, _ = tiny_export
    ckpt = write_checkpoint(tmp_path, model)
    out = tmp_path / "hf"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    assert hf_export.main(["--checkpoint", str(ckpt), "--output", str(out)]) == 2
    assert "already exists" in capsys.readouterr().err
    assert (out / "keep.txt").exists()
    assert hf_export.main(["--checkpoint", str(ckpt / "model.safetensors"), "--output", str(out), "--force"]) == 0
    assert (out / "keep.txt").read_text() == "mine" and (out / "model.safetensors").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoints", "hf"]  # no temp or old folder left


def tree(root: Path) -> dict[str, str]:
    return {p.relative_to(root).as_posix(): p.read_bytes().hex() if p.is_file() else "dir" for p in sorted(root.rglob("*"))}


def test_hf_export_force_keeps_files_it_did_not_write(tiny_export, tmp_path, capsys):
    """--output pointing at the workspace itself: its checkpoints, tracking database and budget stay
    byte for byte; a second --force replaces the first export's files, and removes those of them
    the second one does not write (--no-tokenizer: the tokenizer files)."""
    model, _ = tiny_export
    workspace = tmp_path / "workspace"
    ckpt = write_checkpoint(workspace, model)
    (workspace / "mlflow.db").write_bytes(b"SQLite format 3\x00" + bytes(range(256)))
    (workspace / "budget.json").write_text('{"spent_usd": 17.995}')
    (workspace / "logs").mkdir()
    (workspace / "logs" / "trainer.log").write_text("step 1\n")
    theirs = tree(workspace)

    assert hf_export.main(["--checkpoint", str(ckpt), "--output", str(workspace), "--force"]) == 0
    after = tree(workspace)
    assert {k: v for k, v in after.items() if k in theirs} == theirs
    assert set(after) - set(theirs) == set(hf_export.EXPORT_FILES)

    assert hf_export.main(["--checkpoint", str(ckpt), "--output", str(workspace), "--force", "--dtype", "bf16",
                           "--no-tokenizer"]) == 0
    again = tree(workspace)
    assert {k: v for k, v in again.items() if k in theirs} == theirs
    assert set(again) - set(theirs) == set(hf_export.EXPORT_FILES) - {
        "vocab.json", "merges.txt", "tokenizer_config.json", "special_tokens_map.json"}
    assert json.loads((workspace / "config.json").read_text())["torch_dtype"] == "bfloat16"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["workspace"]  # no temp folder left


def test_hf_export_force_refuses_files_of_its_names_that_no_export_wrote(tiny_export, tmp_path, capsys):
    """A folder with a person's README.md and config.json but no export's model.safetensors: those
    are not ours to replace. Exit 2 naming them; nothing in the folder changes, no temp left."""
    model, _ = tiny_export
    ckpt = write_checkpoint(tmp_path, model)
    out = tmp_path / "project"
    out.mkdir()
    (out / "README.md").write_text("# my notes\n")
    (out / "config.json").write_text('{"mine": true}')
    before = tree(out)

    assert hf_export.main(["--checkpoint", str(ckpt), "--output", str(out), "--force"]) == 2

    err = capsys.readouterr().err
    assert "README.md" in err and "config.json" in err and "nothing was replaced" in err, err
    assert tree(out) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoints", "project"]


@pytest.fixture
def bench(monkeypatch):
    """bench/quant_inference.py as a module (bench/ is not a package)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("quant_inference", Path(__file__).parents[1] / "bench" / "quant_inference.py")
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "quant_inference", module)  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_int4_embedding_rows_equal_the_int4_heads_dequantized_rows(bench):
    torch.manual_seed(0)
    emb = torch.nn.Embedding(40, 256).to(torch.bfloat16)
    head = torch.nn.Linear(256, 40, bias=False).to(torch.bfloat16)
    head.weight = emb.weight
    idx = torch.tensor([[0, 39, 7], [3, 3, 12]])
    rows = bench.Int4Embedding(emb, 128)(idx)
    reference = bench.Int4WeightOnlyLinear(head, 128).dequantized()[idx]
    torch.testing.assert_close(rows.float(), reference, rtol=0, atol=1e-2)
    assert (rows.float() - emb.weight.float()[idx]).abs().max() < 0.1 * emb.weight.float().abs().max()


def test_quantized_inference_bench_runs_end_to_end_on_the_cpu(bench, tmp_path, capsys):
    """bench/quant_inference.py --quick on val.bin windows: every mode measured, the quantized ones near bf16."""
    val = tmp_path / "val.bin"
    torch.randint(0, 50257, (4096,), generator=torch.Generator().manual_seed(0)).numpy().astype("uint16").tofile(val)
    out = tmp_path / "results.json"
    code = bench.main(["--device", "cpu", "--quick", "--val-bin", str(val), "--batch-sizes", "1,2", "--new-tokens", "4",
                       "--repeats", "1", "--eval-windows", "2", "--price-usd-per-hr", "2.0", "--json", str(out)])
    assert code == 0
    printed = capsys.readouterr().out
    lines = printed.rstrip().splitlines()
    head = max(i for i, line in enumerate(lines) if line.startswith("| mode |"))
    assert len(lines) - head == 2 + len(bench.MODES) and all(line.startswith("|") for line in lines[head:])
    results = {r["mode"]: r for r in json.loads(out.read_text())["results"]}
    assert set(results) == {"bf16", "int8", "int8-dq", "int4"} and not any(r["skipped"] for r in results.values())
    # The quick model is mostly vocabulary, and int4 keeps a second copy of it for the lookup: both ~half.
    assert max(results[m]["weights_mib"] for m in ("int8", "int8-dq", "int4")) < 0.6 * results["bf16"]["weights_mib"]
    for mode in ("int8", "int8-dq", "int4"):
        assert abs(results[mode]["loss"] - results["bf16"]["loss"]) < 0.05
        assert all(tps > 0 for tps in results[mode]["tokens_per_sec"].values())
    assert "$2.00/h" in printed


def test_the_export_folder_and_every_file_in_it_get_the_umasks_permissions(tiny_export):
    _, out = tiny_export
    umask = os.umask(0)
    os.umask(umask)
    assert stat.S_IMODE(out.stat().st_mode) == 0o777 & ~umask  # not mkdtemp's 0700
    files = list(out.iterdir())
    assert "model.safetensors" in {f.name for f in files}
    assert {f.name: stat.S_IMODE(f.stat().st_mode) for f in files} == {f.name: 0o666 & ~umask for f in files}
