"""Weight-only int8 and int4 inference of the Hugging Face export, next to bf16: generation tokens/s,
$ per million generated tokens at a given GPU price, and the loss on val windows.

    python bench/quant_inference.py --export x1-50m-hf --val-bin /workspace/data/tokenized/val.bin
    python bench/quant_inference.py --checkpoint /workspace/checkpoints/final.safetensors --val-bin ...
    python bench/quant_inference.py                      # random init of configs/x1-50m-a100.yaml
    python bench/quant_inference.py --device cpu --quick  # a small model on the CPU: checks the script (~1 min)

Measuring an --export needs only torch, transformers and numpy; building one (--checkpoint, or the
random init) also imports the trainer package (pydantic, pyyaml, safetensors), not the tokenizer's.
On one H200 the default run takes ~70 s and `--compile` ~140 s (random init, 4 modes, batch 1 and 32).

The model is the export loaded by `transformers` (AutoModelForCausalLM, bf16) and generation is its
`generate`, greedy. By default: the dynamic KV cache, eager (no torch.compile, no CUDA graphs), what
a user of the export gets. `--compile`: a static KV cache with the decode step compiled
(torch.compile reduce-overhead, i.e. CUDA graphs), which removes most of the per-token Python and
launch overhead that dominates a model this small.

Quantization replaces every nn.Linear, the tied output head included, and the input embedding by a
row lookup of quantized rows (under int8 the head's own rows and scales, tied as in the bf16 model;
under int4 a plain int4 copy, since tinygemm's tiled layout cannot be gathered by row):

    int8     per-output-channel symmetric scales, torch._weight_int8pack_mm
    int8-dq  the same int8 weights, dequantized to bf16 at each call before a bf16 matmul
    int4     groups of --group-size along K, asymmetric (scale + zero), tinygemm torch._weight_int4pack_mm
             (CUDA sm80+; torch._weight_int4pack_mm_for_cpu on the CPU). A Linear whose in-features do
             not fit the kernel's tiling stays bf16 and is counted as kept.

Each mode is first probed on a small matrix against a dequantized reference; a mode whose kernel is
missing on this device, or gives wrong numbers, is skipped with the reason. The last thing printed
is a markdown table. Tokens/s counts generated tokens only (prompt tokens are not counted, their
prefill time is); $ per million generated tokens = price per hour / 3600 / tokens/s x 1e6.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import shutil
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

REPO = Path(__file__).resolve().parents[1]
for _p in (REPO / "trainer", REPO):  # run from a checkout without installing the package
    if str(_p) not in sys.path:
        sys.path.insert(0, str(_p))

EOT_TOKEN = 50256  # <|endoftext|>: every training document starts after one
H200_USD_PER_HR = 3.50  # on-demand H200 order of magnitude; pass the price you pay
# The quick CPU check: small enough for two cores, shaped so that every Linear fits the int4 tiling.
QUICK_MODEL = ["model.n_layer=2", "model.d_model=256", "model.n_head=4", "model.n_kv_head=2", "model.d_ff=512",
               "model.seq_len=128"]
# mode -> how its matmuls run (printed above the table)
KERNELS = {
    "bf16": "nn.Linear in bf16",
    "int8": "torch._weight_int8pack_mm (PyTorch's int8 weight-only kernel)",
    "int8-dq": "int8 weights dequantized to bf16 at each call, then a bf16 matmul (one fused kernel under --compile)",
    "int4": "torch._weight_int4pack_mm (tinygemm), groups along K",
}
MODES = tuple(KERNELS)


class UsageError(ValueError):
    """Bad input: the message names it; the script exits 2."""


# ------------------------------------------------------------------------------------------------
# Weight-only quantized linears


class Int8WeightOnlyLinear(nn.Module):
    """y = x @ (q * s).T with q int8 (N, K) and one scale per output row: ~half the bytes of bf16."""

    def __init__(self, linear: nn.Linear, dequant: bool = False):
        super().__init__()
        self.dequant = dequant  # False: the int8pack kernel; True: cast then a bf16 matmul
        w = linear.weight.detach().float()
        scale = w.abs().amax(dim=1).clamp(min=1e-12) / 127.0  # (N,) symmetric per output channel
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.register_buffer("weight_int8", torch.round(w / scale[:, None]).clamp(-128, 127).to(torch.int8))
        self.register_buffer("scales", scale.to(linear.weight.dtype))

    def dequantized(self) -> torch.Tensor:
        return self.weight_int8.float() * self.scales.float()[:, None]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.dequant:
            # Scale W, not the output: inductor rewrites linear(x, q.to(bf16)) * s into the int8pack kernel,
            # which is the other mode. This writes a bf16 copy of W per call (one fused kernel when compiled).
            return F.linear(x, self.weight_int8.to(x.dtype) * self.scales[:, None])
        y = torch._weight_int8pack_mm(x.reshape(-1, self.in_features).contiguous(), self.weight_int8, self.scales)
        return y.reshape(*x.shape[:-1], self.out_features)


class Int4WeightOnlyLinear(nn.Module):
    """tinygemm int4: groups of `group_size` along K, each with a bf16 scale and zero (~quarter of bf16).

    Dequantization is (q - 8) * scale + zero, q in [0, 15]. Output rows are padded to a multiple of 16
    (CUDA's kernel wants 8, the CPU's 16) for the 50257-row head, and sliced back.
    """

    def __init__(self, linear: nn.Linear, group_size: int, inner_k_tiles: int = 8):
        super().__init__()
        if not int4_fits(linear, group_size, inner_k_tiles):
            raise ValueError(f"in_features {linear.in_features} does not fit int4 tiling (group {group_size})")
        w = linear.weight.detach().float()
        N, K = w.shape
        n_pad = -N % 16
        if n_pad:
            w = torch.cat([w, w.new_zeros(n_pad, K)])
        q, scale, zero = int4_groups(w, group_size)
        scales_and_zeros = torch.stack([scale, zero], dim=2).transpose(0, 1).contiguous()  # (K / g, N_pad, 2)
        self.in_features, self.out_features, self.group_size = K, N, group_size
        self._q_for_reference = q  # for the probe's dequantized reference; quantize_model drops it
        self.register_buffer("packed", _int4_pack(q, inner_k_tiles))
        self.register_buffer("scales_and_zeros", scales_and_zeros)

    def dequantized(self) -> torch.Tensor:
        q = self._q_for_reference.float().reshape(-1, self.group_size)
        sz = self.scales_and_zeros.float().transpose(0, 1).reshape(-1, 2)  # (N_pad * K / g, 2)
        w = (q - 8.0) * sz[:, :1] + sz[:, 1:]
        return w.reshape(-1, self.in_features)[: self.out_features]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, self.in_features).to(torch.bfloat16).contiguous()  # the kernels need dense rows
        if self.packed.device.type == "cpu":
            y = torch._weight_int4pack_mm_for_cpu(x2, self.packed, self.group_size, self.scales_and_zeros)
        else:
            y = torch._weight_int4pack_mm(x2, self.packed, self.group_size, self.scales_and_zeros)
        return y[:, : self.out_features].reshape(*x.shape[:-1], self.out_features).to(x.dtype)


def int4_groups(w: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(q int32 (N, K) in [0, 15], scale (N, K / g), zero (N, K / g)) with w ~ (q - 8) * scale + zero.

    Scale and zero are rounded to bf16 first, as the kernel holds them, so q is chosen for them.
    """
    N, K = w.shape
    groups = w.float().reshape(N, K // group_size, group_size)
    lo, hi = groups.amin(dim=2), groups.amax(dim=2)
    scale = ((hi - lo).clamp(min=1e-6) / 15.0).to(torch.bfloat16)
    zero = (lo + 8.0 * scale.float()).to(torch.bfloat16)
    q = (groups - zero.float()[..., None]) / scale.float()[..., None] + 8.0
    return q.round().clamp(0, 15).to(torch.int32).reshape(N, K), scale, zero


def int4_fits(linear: nn.Linear, group_size: int, inner_k_tiles: int = 8) -> bool:
    K = linear.in_features
    return K % group_size == 0 and K % (inner_k_tiles * 16) == 0


def _int4_pack(q: torch.Tensor, inner_k_tiles: int) -> torch.Tensor:
    """The kernel's tiled layout. The CPU op takes the int32 values; CUDA's takes two per uint8 byte."""
    if q.device.type == "cpu":
        return torch._convert_weight_to_int4pack_for_cpu(q, inner_k_tiles)
    pairs = (q[:, ::2] << 4 | q[:, 1::2]).to(torch.uint8)  # (N, K / 2)
    return torch._convert_weight_to_int4pack(pairs, inner_k_tiles)


class Int8Embedding(nn.Module):
    """Row lookup of int8 rows times their scale. Shares the head's buffers when the head is int8 (tied)."""

    def __init__(self, weight_int8: torch.Tensor, scales: torch.Tensor, vocab: int):
        super().__init__()
        self.vocab = vocab
        # The same tensors as the int8 head's when tied: one copy in memory, counted once by weight_bytes.
        self.register_buffer("weight_int8", weight_int8)
        self.register_buffer("scales", scales)

    @classmethod
    def from_embedding(cls, emb: nn.Embedding) -> Int8Embedding:
        w = emb.weight.detach().float()
        scale = w.abs().amax(dim=1).clamp(min=1e-12) / 127.0  # one per row, as the int8 head's
        weight_int8 = torch.round(w / scale[:, None]).clamp(-128, 127).to(torch.int8)
        return cls(weight_int8, scale.to(emb.weight.dtype), emb.num_embeddings)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.weight_int8[idx].to(self.scales.dtype) * self.scales[idx, None]


class Int4Embedding(nn.Module):
    """Row lookup of int4 rows (two per byte, groups of `group_size` with a scale and zero each).

    A second copy beside the int4 head: tinygemm's tiled layout cannot be gathered by row.
    """

    def __init__(self, emb: nn.Embedding, group_size: int):
        super().__init__()
        q, scale, zero = int4_groups(emb.weight.detach(), group_size)
        self.group_size, self.dim = group_size, emb.embedding_dim
        self.register_buffer("packed", (q[:, ::2] << 4 | q[:, 1::2]).to(torch.uint8))  # (V, K / 2)
        self.register_buffer("scale", scale)
        self.register_buffer("zero", zero)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        b = self.packed[idx].to(torch.int32)  # (..., K / 2)
        q = torch.stack([b >> 4, b & 15], dim=-1).reshape(*idx.shape, -1, self.group_size).to(torch.bfloat16)
        w = (q - 8.0) * self.scale[idx][..., None] + self.zero[idx][..., None]
        return w.reshape(*idx.shape, self.dim)


def quantize_model(model: nn.Module, mode: str, group_size: int) -> tuple[int, list[str]]:
    """Replace each nn.Linear and the input embedding in place; returns (linears quantized, kept bf16).

    The head is tied to the embedding: under int8 both use one set of int8 rows and scales; under
    int4 the embedding is a second, plain int4 copy (tinygemm's tiled layout cannot be gathered by row).
    """
    if mode == "bf16":
        return 0, []
    targets = [(parent, name, child, f"{pname}.{name}".lstrip("."))
               for pname, parent in model.named_modules() for name, child in parent.named_children()
               if isinstance(child, nn.Linear)]
    done, kept = 0, []
    for parent, name, linear, full in targets:
        if mode == "int4" and not int4_fits(linear, group_size):
            kept.append(full)
            continue
        if mode.startswith("int8"):
            new: nn.Module = Int8WeightOnlyLinear(linear, dequant=mode == "int8-dq")
        else:
            new = Int4WeightOnlyLinear(linear, group_size)
            del new._q_for_reference  # the model never needs the unpacked values
        setattr(parent, name, new)
        done += 1
    emb = model.get_input_embeddings()
    head = model.get_output_embeddings()
    if isinstance(head, Int8WeightOnlyLinear) and head.weight_int8.shape[0] == emb.num_embeddings:
        model.set_input_embeddings(Int8Embedding(head.weight_int8, head.scales, emb.num_embeddings))
    elif mode.startswith("int8") or emb.embedding_dim % group_size:
        model.set_input_embeddings(Int8Embedding.from_embedding(emb))
    else:
        model.set_input_embeddings(Int4Embedding(emb, group_size))
    return done, kept


def probe(mode: str, device: torch.device, group_size: int) -> str | None:
    """None when `mode`'s kernel runs here and matches a dequantized reference; else why not."""
    if mode == "bf16":
        return None
    torch.manual_seed(0)
    linear = nn.Linear(2 * group_size, 72, bias=False).to(device, torch.bfloat16)  # 72 rows: exercises the padding
    x = torch.randn(5, 2 * group_size, device=device, dtype=torch.bfloat16)
    kernel = KERNELS[mode].split(" (")[0]
    try:
        if mode.startswith("int8"):
            q: nn.Module = Int8WeightOnlyLinear(linear, dequant=mode == "int8-dq")
        else:
            q = Int4WeightOnlyLinear(linear, group_size)
        y = q(x).float()
        ref = x.float() @ q.dequantized().T
    except (RuntimeError, NotImplementedError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        return f"{kernel} does not run on {device.type} here: {first[:160]}"
    err = ((y - ref).abs().max() / ref.abs().max()).item()
    if not math.isfinite(err) or err > 2e-2:
        return f"{kernel} gives wrong numbers on {device.type} (max relative error {err:.3g} vs the dequantized weights)"
    return None


# ------------------------------------------------------------------------------------------------
# The export, the data, the measurements


def prepare_export(args: argparse.Namespace, workdir: Path) -> tuple[Path, str]:
    """(export folder, what it is): --export as given, else built from --checkpoint or a random init."""
    if args.export:
        export_dir = Path(args.export)
        if not (export_dir / "config.json").is_file() or not (export_dir / "model.safetensors").is_file():
            raise UsageError(f"--export {export_dir}: no config.json + model.safetensors (make one with x1_pretrain.hf_export)")
        return export_dir, f"export {export_dir}"
    try:
        from x1_pretrain.config import ConfigError, load_config
        from x1_pretrain.model.transformer import Transformer
        from x1_pretrain.run import hf_export
    except ImportError as e:
        raise UsageError(f"building an export needs the trainer's packages ({e}); pass --export DIR instead") from None
    out = workdir / "export"
    if args.checkpoint:
        try:
            hf_export.export(args.checkpoint, out, dtype="bf16", with_tokenizer=False)
        except (FileNotFoundError, ConfigError, hf_export.ExportError) as e:
            raise UsageError(f"--checkpoint: {e}") from None
        return out, f"checkpoint {args.checkpoint}"
    try:
        cfg = load_config(args.config, QUICK_MODEL if args.quick else []).model
    except ConfigError as e:
        raise UsageError(f"--config: {e}") from None
    torch.manual_seed(0)
    model = Transformer(cfg)
    out.mkdir(parents=True)
    hf_export.write_export(out, model.state_dict(), cfg, source="random init", dtype=torch.bfloat16, with_tokenizer=False)
    shape = f"{cfg.n_layer}x{cfg.d_model}, seq {cfg.seq_len}"
    return out, f"random init of {Path(args.config).name}{' (quick: ' + shape + ')' if args.quick else ''}"


def load_model(export_dir: Path, device: torch.device) -> nn.Module:
    import transformers
    from transformers import AutoModelForCausalLM

    dtype_kw = "dtype" if int(transformers.__version__.split(".")[0]) >= 5 else "torch_dtype"
    model = AutoModelForCausalLM.from_pretrained(export_dir, attn_implementation="sdpa", **{dtype_kw: torch.bfloat16})
    return model.to(device).eval()


def val_windows(val_bin: str | None, n: int, length: int, vocab: int) -> tuple[torch.Tensor, str]:
    """(n, length) token windows: evenly spaced through val.bin (uint16), else seeded random ids."""
    if val_bin is None:
        g = torch.Generator().manual_seed(0)
        return torch.randint(0, vocab, (n, length), generator=g), "random tokens (no --val-bin): loss shows only drift"
    path = Path(val_bin)
    if not path.is_file():
        raise UsageError(f"--val-bin {path}: no such file")
    if path.stat().st_size % 2:
        raise UsageError(f"--val-bin {path}: odd byte size; expected flat uint16 tokens (nanoGPT format)")
    data = np.memmap(path, dtype=np.uint16, mode="r")
    if len(data) < n * length:
        raise UsageError(f"--val-bin {path}: {len(data)} tokens, fewer than {n} windows x {length}")
    starts = np.linspace(0, len(data) - length, n).astype(np.int64)
    windows = torch.from_numpy(np.stack([data[s : s + length].astype(np.int64) for s in starts]))
    if int(windows.max()) >= vocab:
        raise UsageError(f"--val-bin {path}: token id {int(windows.max())} >= vocab {vocab}; not GPT-2 BPE")
    return windows, f"{path.name}: {n} windows x {length - 1} predicted tokens"


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)  # CUDA work is asynchronous: time only what has finished


@torch.no_grad()
def eval_loss(model: nn.Module, windows: torch.Tensor, batch: int, device: torch.device) -> float:
    total, count = 0.0, 0
    for i in range(0, len(windows), batch):
        w = windows[i : i + batch].to(device)
        logits = model(w[:, :-1]).logits  # (B, T, V) in the model's dtype
        loss = F.cross_entropy(logits.float().flatten(0, 1), w[:, 1:].flatten(), reduction="sum")
        total, count = total + loss.item(), count + w[:, 1:].numel()
    return total / count


@torch.no_grad()
def generation_tokens_per_sec(model: nn.Module, prompts: torch.Tensor, new_tokens: int, device: torch.device,
                              repeats: int, compile_decode: bool) -> tuple[float, float]:
    """(generated tokens/s, seconds of the warm-up run, which includes any compilation)."""
    from transformers import GenerationConfig

    cache = {"cache_implementation": "static"} if compile_decode else {}
    # Greedy, exactly new_tokens each (min = max keeps <|endoftext|> from ending a row early).
    def run(n: int) -> torch.Tensor:
        # Replacing the model's own generation config: the export's sampling defaults would be merged in.
        model.generation_config = GenerationConfig(max_new_tokens=n, min_new_tokens=n, do_sample=False, bos_token_id=EOT_TOKEN,
                                                   eos_token_id=EOT_TOKEN, pad_token_id=EOT_TOKEN, **cache)
        return model.generate(prompts, attention_mask=torch.ones_like(prompts))

    t0 = time.perf_counter()
    run(new_tokens if compile_decode else 4)  # warm-up: kernels chosen, caches allocated, graphs compiled
    sync(device)
    warmup = time.perf_counter() - t0
    best = math.inf
    for _ in range(repeats):  # the best of a few: other processes only ever make a run slower
        sync(device)
        t0 = time.perf_counter()
        out = run(new_tokens)
        sync(device)
        best = min(best, time.perf_counter() - t0)
        generated = out.shape[1] - prompts.shape[1]
        assert generated == new_tokens, f"generated {generated} tokens, asked {new_tokens}"
    return prompts.shape[0] * new_tokens / best, warmup


def compile_decode(model: nn.Module) -> None:
    """transformers 5 compiles the decode step itself when the cache is static (CUDA); older ones do not."""
    try:
        from transformers import CompileConfig  # noqa: F401 - present where generate compiles by itself
    except ImportError:
        model.forward = torch.compile(model.forward, mode="reduce-overhead")


def weight_bytes(model: nn.Module) -> int:
    seen: set[int] = set()
    total = 0
    for t in [*model.parameters(), *model.buffers()]:
        if t.data_ptr() in seen or t.dtype == torch.float32 and t.dim() == 1 and t.numel() <= 1024:
            continue  # a tied tensor counted once; rotary inv_freq is not a weight
        seen.add(t.data_ptr())
        total += t.numel() * t.element_size()
    return total


@dataclass
class Result:
    mode: str
    skipped: str | None = None
    linears_quantized: int = 0
    linears_kept: list[str] = field(default_factory=list)
    weights_mib: float = 0.0
    loss: float = float("nan")
    tokens_per_sec: dict[int, float] = field(default_factory=dict)


def usd_per_million(tokens_per_sec: float, price_usd_per_hr: float) -> float:
    return price_usd_per_hr / 3600.0 / tokens_per_sec * 1e6


def render_table(results: list[Result], batches: list[int], price: float) -> str:
    base = next((r.loss for r in results if r.mode == "bf16" and r.skipped is None), float("nan"))
    head = ["mode", "linears int", "weights MiB", "val loss", "Δ loss vs bf16"]
    for b in batches:
        head += [f"tok/s @{b}", f"$/M tok @{b}"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in results:
        if r.skipped:
            lines.append(f"| {r.mode} | skipped: {r.skipped} |" + " |" * (len(head) - 2))
            continue
        cells = [r.mode, f"{r.linears_quantized}" + (f" ({len(r.linears_kept)} kept bf16)" if r.linears_kept else ""),
                 f"{r.weights_mib:.0f}", f"{r.loss:.4f}", "—" if r.mode == "bf16" else f"{r.loss - base:+.4f}"]
        for b in batches:
            tps = r.tokens_per_sec.get(b, float("nan"))
            cells += [f"{tps:,.0f}", f"{usd_per_million(tps, price):.3f}"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def int_list(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python bench/quant_inference.py",
        description="bf16 vs weight-only int8 / int4 inference of the Hugging Face export: generation tokens/s, "
                    "$ per million generated tokens, loss on val windows. Prints a markdown table last.",
    )
    src = p.add_mutually_exclusive_group()
    src.add_argument("--export", metavar="DIR", help="a folder written by x1_pretrain.hf_export")
    src.add_argument("--checkpoint", metavar="PATH", help="a checkpoint to export first (final.safetensors, step_*)")
    p.add_argument("--config", default=str(REPO / "configs" / "x1-50m-a100.yaml"),
                   help="with neither: random init of this config's model (default the 50M config)")
    p.add_argument("--val-bin", metavar="PATH", help="val.bin (uint16 GPT-2 ids); default: seeded random tokens, labelled")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", help="cuda or cpu (default: cuda if present)")
    p.add_argument("--modes", default=",".join(MODES), help=f"comma-separated subset of {','.join(MODES)} (default all)")
    p.add_argument("--batch-sizes", type=int_list, help="generation batch sizes (default 1,32; quick 1,4)")
    p.add_argument("--new-tokens", type=int, help="tokens generated per sequence (default 128; quick 16)")
    p.add_argument("--prompt-len", type=int, help="prompt tokens, <|endoftext|> first (default 32; quick 8)")
    p.add_argument("--eval-windows", type=int, help="val windows of seq_len tokens for the loss (default 64; quick 4)")
    p.add_argument("--compile", action="store_true",
                   help="static KV cache + torch.compile (reduce-overhead: CUDA graphs) for the decode steps; "
                        "~10-15 s of compile per mode and batch size on an H200")
    p.add_argument("--repeats", type=int, default=2, help="timed generations per batch size; the best counts (2)")
    p.add_argument("--eval-batch", type=int, default=8, help="windows per forward for the loss (default 8)")
    p.add_argument("--group-size", type=int, default=128, choices=[32, 64, 128, 256], help="int4 group size along K (128)")
    p.add_argument("--price-usd-per-hr", type=float, default=H200_USD_PER_HR,
                   help=f"GPU price for $ per million tokens (default {H200_USD_PER_HR}, an H200)")
    p.add_argument("--quick", action="store_true", help="small sizes (and a small random model): checks the script on a CPU")
    p.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    quick = args.quick
    batches = args.batch_sizes or ([1, 4] if quick else [1, 32])
    new_tokens = args.new_tokens or (16 if quick else 128)
    prompt_len = args.prompt_len or (8 if quick else 32)
    n_windows = args.eval_windows or (4 if quick else 64)
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if not modes or set(modes) - set(MODES):
        parser.error(f"--modes {args.modes!r}: expected a subset of {','.join(MODES)}")
    for name, value in (("--new-tokens", new_tokens), ("--prompt-len", prompt_len), ("--eval-windows", n_windows),
                        ("--eval-batch", args.eval_batch), ("--repeats", args.repeats)):
        if value < 1:
            parser.error(f"{name} must be at least 1, got {value}")
    if not (args.price_usd_per_hr > 0 and math.isfinite(args.price_usd_per_hr)):
        parser.error(f"--price-usd-per-hr must be a positive number, got {args.price_usd_per_hr}")
    try:
        device = torch.device(args.device)
    except RuntimeError as e:
        parser.error(f"--device {args.device!r}: {e}")
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device here (use --device cpu)")

    import transformers

    transformers.logging.set_verbosity_error()  # per-call generate notices would bury the numbers
    workdir = Path(tempfile.mkdtemp(prefix="x1-quant-bench-"))
    try:
        try:
            export_dir, source = prepare_export(args, workdir)
            hf_config = json.loads((export_dir / "config.json").read_text())
            seq_len, vocab = int(hf_config["max_position_embeddings"]), int(hf_config["vocab_size"])
            if prompt_len + new_tokens > seq_len:
                raise UsageError(f"--prompt-len {prompt_len} + --new-tokens {new_tokens} exceeds the context of {seq_len}")
            windows, val_label = val_windows(args.val_bin, n_windows, seq_len + 1, vocab)
        except UsageError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        prompts_all = windows[:, :prompt_len].clone()
        prompts_all[:, 0] = EOT_TOKEN  # conditioned as training documents start

        gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu"
        print(f"device: {device} ({gpu}); torch {torch.__version__}, transformers {transformers.__version__}")
        print(f"model: {source}; context {seq_len}, vocab {vocab}")
        print(f"loss: {val_label}")
        how = "static KV cache, torch.compile reduce-overhead" if args.compile else "dynamic KV cache, eager"
        print(f"generation: HF generate, greedy, {how}; prompt {prompt_len} tokens, "
              f"{new_tokens} new tokens, batch sizes {batches}, best of {args.repeats}")
        print(f"price: ${args.price_usd_per_hr:.2f}/h (--price-usd-per-hr)", flush=True)

        results: list[Result] = []
        for mode in modes:
            reason = probe(mode, device, args.group_size)
            if reason:
                print(f"[{mode}] skipped: {reason}", flush=True)
                results.append(Result(mode, skipped=reason))
                continue
            model = load_model(export_dir, device)
            if args.compile:
                compile_decode(model)
            n_q, kept = quantize_model(model, mode, args.group_size)
            r = Result(mode, linears_quantized=n_q, linears_kept=kept, weights_mib=weight_bytes(model) / 2**20)
            if device.type == "cuda":
                torch.cuda.empty_cache()
            t0 = time.perf_counter()
            r.loss = eval_loss(model, windows, args.eval_batch, device)
            print(f"[{mode}] {n_q} linears quantized{f', {len(kept)} kept bf16' if kept else ''}, "
                  f"{r.weights_mib:.0f} MiB, loss {r.loss:.4f} ({time.perf_counter() - t0:.1f} s)", flush=True)
            for b in batches:
                prompts = prompts_all[torch.arange(b) % len(prompts_all)].to(device)
                r.tokens_per_sec[b], warmup = generation_tokens_per_sec(model, prompts, new_tokens, device, args.repeats,
                                                                        args.compile)
                print(f"[{mode}] batch {b}: {r.tokens_per_sec[b]:,.0f} tokens/s (warm-up {warmup:.1f} s)", flush=True)
            results.append(r)
            del model
            if device.type == "cuda":
                torch.cuda.empty_cache()
    finally:
        shutil.rmtree(workdir, ignore_errors=True)

    if args.json:
        Path(args.json).write_text(json.dumps({"device": str(device), "gpu": gpu, "source": source, "loss_on": val_label,
                                               "price_usd_per_hr": args.price_usd_per_hr, "new_tokens": new_tokens,
                                               "prompt_len": prompt_len, "results": [asdict(r) for r in results]},
                                              indent=2) + "\n")
    print()
    for mode in modes:
        print(f"- {mode}: {KERNELS[mode]}")
    print()
    print(render_table(results, batches, args.price_usd_per_hr))
    return 0


if __name__ == "__main__":
    sys.exit(main())
