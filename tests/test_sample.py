"""Sampling from a checkpoint: the KV cache changes nothing but the speed, the knobs mean what they say,
and the prompt is conditioned on <|endoftext|> as training documents were."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from conftest import TINY_CONFIG, run_module
from x1_pretrain.checkpoint.weights import save_weights
from x1_pretrain.config import load_config
from x1_pretrain.data.tokenizer import EOT_TOKEN, encode_document, gpt2_encoding
from x1_pretrain.model.transformer import Transformer
from x1_pretrain.run import sample
from x1_pretrain.run.sample import generate, sample_next

PROMPT = [EOT_TOKEN, *encode_document("Once upon a time")]


@pytest.fixture(scope="module")
def model() -> Transformer:
    # A wide init (std 0.2) makes a random model's greedy path wander over many tokens instead of
    # repeating one, so that a cache that drifts from the full recomputation shows within a few steps.
    cfg = load_config(TINY_CONFIG, ["model.init_std=0.2"]).model
    torch.manual_seed(0)
    return Transformer(cfg).eval()


@pytest.fixture(scope="module")
def checkpoint(model: Transformer, tmp_path_factory: pytest.TempPathFactory) -> Path:
    step = tmp_path_factory.mktemp("ckpt") / "step_00000010"
    save_weights(step / "model.safetensors", model.state_dict(), model.cfg)
    return step


def test_greedy_generation_with_the_kv_cache_equals_generation_without_it(model):
    n = model.cfg.seq_len - len(PROMPT)  # up to the last position of the context
    cached = generate(model, PROMPT, n, temperature=0, use_cache=True)
    full = generate(model, PROMPT, n, temperature=0, use_cache=False)
    assert len(cached) == n
    assert len(set(cached)) > n // 2  # a varied path, not one token repeated
    assert cached == full


def test_seeded_sampling_repeats_and_another_seed_differs(model):
    def draw(seed: int) -> list[int]:
        return generate(model, PROMPT, 20, temperature=1.0, top_k=50, generator=torch.Generator().manual_seed(seed))

    assert draw(0) == draw(0)
    assert draw(0) != draw(1)


def test_temperature_zero_and_top_k_one_are_both_greedy(model):
    greedy = generate(model, PROMPT, 12, temperature=0)
    top1 = generate(model, PROMPT, 12, temperature=1.5, top_k=1, generator=torch.Generator().manual_seed(7))
    assert top1 == greedy


def test_top_k_sampling_draws_only_among_the_k_most_likely_tokens():
    logits = torch.randn(4, 1000, generator=torch.Generator().manual_seed(0))
    allowed = torch.topk(logits, 5, dim=-1).indices
    gen = torch.Generator().manual_seed(0)
    drawn = torch.stack([sample_next(logits, 2.0, 5, gen) for _ in range(300)], dim=1)  # (4, 300)
    for row in range(4):
        assert set(drawn[row].tolist()) <= set(allowed[row].tolist())
        assert len(set(drawn[row].tolist())) == 5  # a high temperature reaches all of them


def test_low_temperature_concentrates_on_the_argmax():
    logits = torch.tensor([[1.0, 2.0, 3.0, 2.5]])
    gen = torch.Generator().manual_seed(0)
    cold = [int(sample_next(logits, 0.05, 0, gen)) for _ in range(200)]
    hot = [int(sample_next(logits, 5.0, 0, gen)) for _ in range(200)]
    assert cold.count(2) >= 198
    assert len(set(hot)) == 4


def test_generation_stops_right_after_the_stop_token(model):
    path = generate(model, PROMPT, 20, temperature=0)
    stop = path[5]
    first = path.index(stop)
    assert generate(model, PROMPT, 20, temperature=0, stop_token=stop) == path[: first + 1]


def test_a_request_past_the_context_is_refused_with_what_fits(model):
    fits = model.cfg.seq_len - len(PROMPT)
    with pytest.raises(ValueError, match=rf"at most {fits} new tokens fit"):
        generate(model, PROMPT, fits + 1, temperature=0)
    assert len(generate(model, PROMPT, fits, temperature=0)) == fits


def test_cli_conditions_the_prompt_on_eot_and_prints_the_continuation(checkpoint, model, monkeypatch, capsys):
    seen: dict[str, object] = {}
    real_generate = sample.generate

    def spy(m, prompt_ids, *args, **kwargs):
        seen["prompt_ids"], seen["stop_token"] = prompt_ids, kwargs.get("stop_token")
        return real_generate(m, prompt_ids, *args, **kwargs)

    monkeypatch.setattr(sample, "generate", spy)
    code = sample.main(["--checkpoint", str(checkpoint), "--prompt", "Once upon a time", "--max-new-tokens", "15",
                        "--temperature", "0"])
    assert code == 0
    assert seen["prompt_ids"] == PROMPT and seen["stop_token"] == EOT_TOKEN
    expected = generate(model, PROMPT, 15, temperature=0, stop_token=EOT_TOKEN)
    assert capsys.readouterr().out == gpt2_encoding().decode(expected) + "\n"


def test_cli_with_and_without_cache_prints_the_same_greedy_text(checkpoint, capsys):
    outs = []
    for extra in ([], ["--no-cache"]):
        assert sample.main(["--checkpoint", str(checkpoint), "--prompt", "x", "--max-new-tokens", "20",
                            "--temperature", "0", *extra]) == 0
        outs.append(capsys.readouterr().out)
    assert outs[0] == outs[1] and outs[0].strip()


def test_cli_refuses_a_request_longer_than_the_context(checkpoint, model, capsys):
    seq_len = model.cfg.seq_len
    code = sample.main(["--checkpoint", str(checkpoint), "--prompt", "Once upon a time", "--max-new-tokens", str(seq_len)])
    assert code == 2
    err = capsys.readouterr().err
    assert f"exceeds the model's context of {seq_len} tokens" in err
    assert f"at most {seq_len - len(PROMPT)} new tokens fit" in err
    assert capsys.readouterr().out == ""


def test_cli_without_weights_exits_2_naming_the_path(tmp_path):
    proc = run_module("x1_pretrain.sample", "--checkpoint", str(tmp_path), "--prompt", "hi")
    assert proc.returncode == 2
    assert str(tmp_path) in proc.stderr and "no weights file" in proc.stderr
    assert proc.stdout == ""


@pytest.mark.parametrize("flag,value", [("--temperature", "-1"), ("--top-k", "-3"), ("--max-new-tokens", "0")])
def test_cli_rejects_a_bad_knob_with_exit_2(checkpoint, flag, value, capsys):
    with pytest.raises(SystemExit) as exc:
        sample.main(["--checkpoint", str(checkpoint), flag, value])
    assert exc.value.code == 2
    assert flag in capsys.readouterr().err


def test_cli_without_max_new_tokens_fits_the_default_to_a_small_context(checkpoint, model, capsys, monkeypatch):
    seen: dict[str, int] = {}
    real_generate = sample.generate

    def spy(m, prompt_ids, max_new_tokens, *args, **kwargs):
        seen["max_new"] = max_new_tokens
        return real_generate(m, prompt_ids, max_new_tokens, *args, **kwargs)

    monkeypatch.setattr(sample, "generate", spy)
    assert model.cfg.seq_len < sample.DEFAULT_NEW_TOKENS + len(PROMPT)  # the tiny model: the default alone would not fit
    assert sample.main(["--checkpoint", str(checkpoint), "--prompt", "Once upon a time", "--no-stop-at-eot"]) == 0
    assert seen["max_new"] == model.cfg.seq_len - len(PROMPT)
    captured = capsys.readouterr()
    assert captured.out.strip() and f"{seen['max_new']} new tokens at most" in captured.err
    long_prompt = " ".join(["word"] * model.cfg.seq_len)
    assert sample.main(["--checkpoint", str(checkpoint), "--prompt", long_prompt]) == 2
    assert "leaves no room for a new one" in capsys.readouterr().err
