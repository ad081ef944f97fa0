"""Parameters, FLOPs, MFU, throughput tables and the Chinchilla prediction — no torch needed.

FLOPs per token follow PaLM (Chowdhery 2022, App. B): 6 * N_matmul + 12 * n_layer * d_model * seq_len,
N_matmul counting every weight used in a matmul (the output head too; the embedding lookup and the
norm weights not). The head counts the real vocabulary: padded rows do no useful work.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from x1_pretrain.config import ModelConfig, TrainConfig

# Datasheet dense bf16 peaks, TFLOP/s (docs/DESIGN.md §4). PCIe parts run at lower clocks and power.
GPU_PEAK_TFLOPS = {
    "a100-40gb": 312.0,
    "a100-80gb": 312.0,
    "h100-sxm": 989.0,
    "h100-pcie": 756.0,
    "h200": 989.0,
    "cpu": 0.0,
}

GPU_DISPLAY = {
    "a100-40gb": "A100 40GB",
    "a100-80gb": "A100 80GB",
    "h100-sxm": "H100 80GB SXM",
    "h100-pcie": "H100 80GB PCIe",
    "h200": "H200 141GB",
}


@dataclass(frozen=True)
class Throughput:
    tokens_per_sec: float
    source: str  # how we know: "measured ..." or "estimate ..."


# Tokens/s of the 50M config (micro-batch 32 x 1024) per GPU. H200: our trainer's step, measured
# (docs/PERFORMANCE.md: date, command, the reference beside it). Others: the same MFU on their
# datasheet peak, labelled as estimates. Never 500k on an A100: that would be 98% of its peak.
_MEASURED = {
    "h200": Throughput(864_000.0, "measured: this trainer's step on one H200, 864-879k tokens/s over four runs, "
                                  "the low end (docs/PERFORMANCE.md)"),
}
_MEASURED_MFU_DATASHEET = 0.532  # that measurement over the 989 TFLOP/s datasheet peak (864k x 609.1M / 989T)
_MEASURED_FLOPS_PER_TOKEN = 609.1e6  # the 50M config's (flops_per_token(ModelConfig()) = 609.07M)


def tokens_per_sec_table() -> dict[str, Throughput]:
    table = dict(_MEASURED)
    for gpu, peak in GPU_PEAK_TFLOPS.items():
        if gpu in table or peak <= 0:
            continue
        tps = _MEASURED_MFU_DATASHEET * peak * 1e12 / _MEASURED_FLOPS_PER_TOKEN
        table[gpu] = Throughput(round(tps, -3), f"estimate: H200-measured MFU {_MEASURED_MFU_DATASHEET} x {peak:.0f} TFLOP/s datasheet")
    return table


def expected_tokens_per_sec(gpu: str, model: ModelConfig) -> Throughput | None:
    """Tokens/s `plan` expects for `model` on one `gpu`: the table's figure, which is the 50M
    config's, scaled by FLOPs/token for another model (the same MFU: an estimate). None where
    there is no figure: a CPU, an unknown GPU. The trainer's launch check and throughput floor
    use this same number, so that what plan promised is what the run is held to."""
    row = tokens_per_sec_table().get(gpu)
    if row is None:
        return None
    ratio = _MEASURED_FLOPS_PER_TOKEN / flops_per_token(model)
    if abs(ratio - 1.0) < 0.01:  # the 50M config itself
        return row
    return Throughput(round(row.tokens_per_sec * ratio, -2),
                      f"{row.source}, scaled by FLOPs/token to this model (same MFU assumed: an estimate)")


def throughput_floor(train: TrainConfig, expected_tokens_per_sec: float | None) -> tuple[float, str]:
    """The hour-1 throughput floor in tokens/s ("stop and diagnose") and where it comes from: the
    config's min_tokens_per_sec, else floor_fraction x the throughput expected (plan's table for the
    GPU found, or --expected-tokens-per-sec). The trainer warns under it; plan prints it."""
    if train.min_tokens_per_sec is not None:
        return (train.min_tokens_per_sec,
                "train.min_tokens_per_sec" if train.min_tokens_per_sec else "off: train.min_tokens_per_sec 0")
    if expected_tokens_per_sec is None:
        return 0.0, "off: no throughput expected on this machine (--expected-tokens-per-sec sets one)"
    return (train.floor_fraction * expected_tokens_per_sec,
            f"{train.floor_fraction:g} x the expected {fmt_count(expected_tokens_per_sec)} tokens/s")


def steps_that_fit(budget_left_usd: float, rate_usd_per_hr: float, seconds_per_step: float, margin: float) -> int:
    """Optimizer steps whose billed time, plus the margin on it, costs at most `budget_left_usd`.

    The same arithmetic as the trainer's own projection (budget_guard.Pace): spent + rate x
    hours still needed x (1 + margin) <= cap. Overheads (evals, checkpoints) are left to the margin.
    """
    if budget_left_usd <= 0 or seconds_per_step <= 0:
        return 0
    if rate_usd_per_hr <= 0:
        raise ValueError("steps_that_fit: a rate of $0/h buys unlimited steps")
    hours = budget_left_usd / (rate_usd_per_hr * (1.0 + margin))
    return int(hours * 3600.0 / seconds_per_step)


def param_counts(cfg: ModelConfig) -> dict[str, int]:
    d, hd = cfg.d_model, cfg.head_dim
    attn = d * (cfg.n_head + 2 * cfg.n_kv_head) * hd + cfg.n_head * hd * d
    mlp = 3 * d * cfg.d_ff
    norms = 2 * d
    per_layer = attn + mlp + norms
    non_embedding = cfg.n_layer * per_layer + d  # + final norm
    embedding = cfg.vocab_size * d  # tied: the head is this same matrix
    return {
        "non_embedding": non_embedding,
        "embedding": embedding,
        "total": non_embedding + embedding,
        "matmul": cfg.n_layer * (attn + mlp) + embedding,  # every weight used in a matmul, head incl.
        "padded_rows": (cfg.padded_vocab_size - cfg.vocab_size) * d,
    }


def flops_per_token(cfg: ModelConfig) -> float:
    return 6.0 * param_counts(cfg)["matmul"] + 12.0 * cfg.n_layer * cfg.d_model * cfg.seq_len


def mfu(tokens_per_sec: float, cfg: ModelConfig, peak_tflops: float) -> float:
    if peak_tflops <= 0:
        return 0.0
    return tokens_per_sec * flops_per_token(cfg) / (peak_tflops * 1e12)


def detect_gpu_key(device_name: str) -> str | None:
    """Map torch.cuda.get_device_name() to a peak-table key."""
    n = device_name.lower()
    if "h200" in n:
        return "h200"
    if "h100" in n:
        return "h100-pcie" if "pcie" in n else "h100-sxm"
    if "a100" in n:
        return "a100-40gb" if "40gb" in n else "a100-80gb"
    return None


# Hoffmann et al. 2022 ("Chinchilla"), approach 3 fit. Fitted on MassiveText with a
# SentencePiece tokenizer: on FineWeb-Edu with GPT-2 BPE it is a guide, not a promise.
CHINCHILLA = {"E": 1.69, "A": 406.4, "B": 410.7, "alpha": 0.34, "beta": 0.28}


def chinchilla_loss(n_params: float, n_tokens: float) -> float:
    """Predicted loss; N counts all parameters, embeddings included (Hoffmann's convention)."""
    c = CHINCHILLA
    return c["E"] + c["A"] / n_params ** c["alpha"] + c["B"] / max(n_tokens, 1.0) ** c["beta"]


# What the fit was made on (Hoffmann 2022: models of 70M-16B parameters, 5B-500B tokens).
CHINCHILLA_FIT_RANGE = {"params": (7e7, 1.6e10), "tokens": (5e9, 5e11)}


@dataclass(frozen=True)
class LossPrediction:
    value: float  # nats/token, never above a uniform guess over the vocabulary
    fit: float  # the fit's own number
    in_fit_range: bool
    note: str | None  # why `value` differs from `fit`, or why to trust it less


def predicted_loss(n_params: float, n_tokens: float, vocab_size: int) -> LossPrediction:
    """The Chinchilla fit's loss, bounded by ln(vocab): a model that learned nothing scores a
    uniform guess, so a larger figure (a tiny model, a few thousand tokens) only says the fit does
    not apply there."""
    fit = chinchilla_loss(n_params, n_tokens)
    uniform = math.log(vocab_size)
    (p_lo, p_hi), (t_lo, t_hi) = CHINCHILLA_FIT_RANGE["params"], CHINCHILLA_FIT_RANGE["tokens"]
    in_range = p_lo <= n_params <= p_hi and t_lo <= n_tokens <= t_hi
    outside = ("" if in_range else f"{fmt_count(n_params)} parameters and {fmt_count(n_tokens)} tokens lie outside "
               f"the fit's {fmt_count(p_lo)}-{fmt_count(p_hi)} parameters and {fmt_count(t_lo)}-{fmt_count(t_hi)} tokens")
    if fit > uniform:
        return LossPrediction(uniform, fit, in_range, f"the fit gives {fit:.2f}, worse than a uniform guess over "
                              f"{vocab_size} tokens (ln {vocab_size} = {uniform:.2f}): capped there"
                              + (f"; {outside}" if outside else ""))
    return LossPrediction(fit, fit, in_range, outside or None)


def chinchilla_optimal_tokens(n_params: float) -> float:
    """Tokens for which `n_params` is the fit's compute-optimal size (C = 6 N D)."""
    # Hoffmann eq. 4: N_opt(C) = G (C/6)^a with a = beta/(alpha+beta); invert for C, D = C/(6N).
    c = CHINCHILLA
    a = c["beta"] / (c["alpha"] + c["beta"])
    g = (c["alpha"] * c["A"] / (c["beta"] * c["B"])) ** (1.0 / (c["alpha"] + c["beta"]))
    return (n_params / g) ** (1.0 / a) / n_params


def fmt_count(n: float) -> str:
    for unit, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.{1 if abs(n) / scale < 100 else 0}f}{unit}"
    return f"{n:.0f}"


def usd(x: float) -> str:
    """$35 for whole dollars, $26.40 otherwise."""
    return f"${x:.0f}" if abs(x - round(x)) < 0.005 else f"${x:.2f}"
