"""Text from a checkpoint: prefill the prompt once, then one token at a time through the KV cache.

    python -m x1_pretrain.sample --checkpoint /workspace/checkpoints/final.safetensors \\
        --prompt "The meaning of life is" --max-new-tokens 100 --temperature 0.8 --top-k 50 --seed 0

prints the continuation on stdout (the speed goes to stderr). The prompt is
conditioned as [<|endoftext|>] + its tokens, as every training document started; generation stops
at the next <|endoftext|> (the model ending the document) unless --no-stop-at-eot. `--temperature
0` is greedy; `--no-cache` recomputes the whole sequence at every step, for comparison. Runs in
fp32 on the CPU by default. The prompt plus the new tokens must fit in the context (seq_len): a
longer request is refused (exit 2) rather than slid, since positions past seq_len were never trained
and a sliding window would silently forget the start of the prompt. Without --max-new-tokens it
generates up to 100 tokens, fewer when the context holds fewer after the prompt (and says so).
"""

from __future__ import annotations

import argparse
import math
import sys
import time

import torch

from x1_common.contracts import ExitCode
from x1_pretrain.checkpoint.load import model_from_weights
from x1_pretrain.config import ConfigError
from x1_pretrain.data.tokenizer import EOT_TOKEN, encode_document, gpt2_encoding
from x1_pretrain.model.transformer import KVCache, Transformer


def sample_next(logits: torch.Tensor, temperature: float, top_k: int, generator: torch.Generator | None) -> torch.Tensor:
    """Next token per row of `logits` (B, V): argmax at temperature 0, else softmax(logits / T) over the top k.

    top_k = 0 samples from the whole vocabulary.
    """
    if temperature == 0:
        return logits.argmax(dim=-1)
    logits = logits.float() / temperature
    if 0 < top_k < logits.size(-1):
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]  # (B, 1): the k-th largest
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    return torch.multinomial(probs, num_samples=1, generator=generator).squeeze(-1)


@torch.no_grad()
def generate(
    model: Transformer,
    prompt_ids: list[int],
    max_new_tokens: int,
    temperature: float = 0.8,
    top_k: int = 50,
    generator: torch.Generator | None = None,
    use_cache: bool = True,
    stop_token: int | None = None,
) -> list[int]:
    """New token ids after `prompt_ids` (which the caller conditions, e.g. [EOT] + tokens).

    With the cache: one forward over the prompt fills the KV cache, then each step feeds only the
    last token. Without: each step runs the whole sequence again (quadratic; for comparison).
    Generation stops after `max_new_tokens` or right after emitting `stop_token` (which is returned).
    """
    cfg = model.cfg
    if not prompt_ids:
        raise ValueError("prompt_ids is empty: condition on at least [<|endoftext|>]")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be at least 1, got {max_new_tokens}")
    if len(prompt_ids) + max_new_tokens > cfg.seq_len:
        raise ValueError(
            f"prompt ({len(prompt_ids)} tokens with the leading <|endoftext|>) + max_new_tokens ({max_new_tokens}) "
            f"= {len(prompt_ids) + max_new_tokens} exceeds the model's context of {cfg.seq_len} tokens; "
            f"at most {cfg.seq_len - len(prompt_ids)} new tokens fit"
        )
    if temperature < 0 or not math.isfinite(temperature):
        raise ValueError(f"temperature must be a finite number >= 0, got {temperature}")
    if top_k < 0:
        raise ValueError(f"top_k must be >= 0 (0 = no limit), got {top_k}")
    model.eval()
    param = next(model.parameters())
    seq = torch.tensor([prompt_ids], dtype=torch.long, device=param.device)  # (1, T)
    cache = KVCache.empty(cfg, 1, len(prompt_ids) + max_new_tokens, param.device, param.dtype) if use_cache else None
    out: list[int] = []
    feed = seq
    for _ in range(max_new_tokens):
        if use_cache:
            logits = model.logits(feed, cache)[:, -1]  # prefill on the first step, then (1, 1) steps
        else:
            logits = model.logits(seq)[:, -1]
        nxt = sample_next(logits, temperature, top_k, generator)  # (1,)
        token = int(nxt.item())  # .item(): one host sync per token, needed to check for the stop token
        out.append(token)
        if token == stop_token:
            break
        feed = nxt.view(1, 1)
        seq = torch.cat([seq, feed], dim=1)
    return out


DEFAULT_NEW_TOKENS = 100


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m x1_pretrain.sample",
        description="Generate text from a checkpoint with a KV cache (fp32, CPU by default).",
        epilog="The prompt is conditioned as <|endoftext|> + prompt, as every training document started.",
    )
    p.add_argument("--checkpoint", required=True, metavar="PATH",
                   help="final.safetensors, a step_XXXXXXXX/ folder, or a checkpoint dir (its final or latest)")
    p.add_argument("--prompt", default="", help="text to continue (default: empty, i.e. a document from scratch)")
    p.add_argument("--max-new-tokens", type=int,
                   help=f"tokens to generate at most (default {DEFAULT_NEW_TOKENS}, or what the context holds after "
                        "the prompt when that is less); more than the context holds is refused")
    p.add_argument("--temperature", type=float, default=0.8, help="softmax temperature; 0 = greedy (default 0.8)")
    p.add_argument("--top-k", type=int, default=50, help="sample among the k most likely tokens; 0 = all (default 50)")
    p.add_argument("--seed", type=int, default=0, help="seed of the sampling generator (default 0)")
    p.add_argument("--stop-at-eot", action=argparse.BooleanOptionalAction, default=True,
                   help="stop when the model emits <|endoftext|>, the end of its document (default on)")
    p.add_argument("--no-cache", action="store_true", help="recompute the whole sequence each step (slow; to compare)")
    p.add_argument("--device", default="cpu", help="torch device (default cpu); the model runs in fp32")
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.max_new_tokens is not None and args.max_new_tokens < 1:
        parser.error(f"--max-new-tokens must be at least 1, got {args.max_new_tokens}")
    if args.temperature < 0 or not math.isfinite(args.temperature):
        parser.error(f"--temperature must be a finite number >= 0, got {args.temperature}")
    if args.top_k < 0:
        parser.error(f"--top-k must be >= 0 (0 = no limit), got {args.top_k}")
    try:
        device = torch.device(args.device)
        model = model_from_weights(args.checkpoint, device)
    except (FileNotFoundError, ConfigError, RuntimeError) as e:
        print(f"error: --checkpoint {args.checkpoint}: {e}", file=sys.stderr)
        return ExitCode.USAGE

    prompt_ids = [EOT_TOKEN, *encode_document(args.prompt)]
    max_new = args.max_new_tokens
    if max_new is None:  # a default must work on every model: a tiny one's context may hold less than 100
        room = model.cfg.seq_len - len(prompt_ids)
        if room < 1:
            print(f"error: --prompt is {len(prompt_ids)} tokens with the leading <|endoftext|>: the model's context "
                  f"of {model.cfg.seq_len} tokens leaves no room for a new one", file=sys.stderr)
            return ExitCode.USAGE
        max_new = min(DEFAULT_NEW_TOKENS, room)
        if max_new < DEFAULT_NEW_TOKENS:
            print(f"[{max_new} new tokens at most: the model's context of {model.cfg.seq_len} holds that many after "
                  f"the {len(prompt_ids)}-token prompt]", file=sys.stderr)
    generator = torch.Generator(device=device).manual_seed(args.seed)
    t0 = time.perf_counter()
    try:
        new = generate(model, prompt_ids, max_new, args.temperature, args.top_k, generator,
                       use_cache=not args.no_cache, stop_token=EOT_TOKEN if args.stop_at_eot else None)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return ExitCode.USAGE
    seconds = time.perf_counter() - t0
    text = new[:-1] if new and new[-1] == EOT_TOKEN and args.stop_at_eot else new
    print(gpt2_encoding().decode(text))
    print(
        f"[{len(new)} tokens in {seconds:.2f} s ({len(new) / seconds:.1f} tokens/s), prompt {len(prompt_ids)} tokens, "
        f"{'no cache' if args.no_cache else 'KV cache'}, {device}]",
        file=sys.stderr,
    )
    return ExitCode.FINISHED


if __name__ == "__main__":
    sys.exit(main())
