"""The 50M model of docs/DESIGN.md §4: sizes, FLOPs, causality, GQA, RoPE, tying, attention paths, learning."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from conftest import CONFIGS, TINY_CONFIG
from x1_pretrain.config import load_config
from x1_pretrain.model.transformer import Attention, Transformer, apply_rope, rope_kernel_fits, rope_tables
from x1_pretrain.train.accounting import flops_per_token, param_counts


def tiny(**sets):
    return load_config(TINY_CONFIG, [f"model.{k}={v}" for k, v in sets.items()]).model


def test_50m_config_has_the_labs_sizes_and_flops():
    cfg = load_config(CONFIGS / "x1-50m-a100.yaml").model
    counts = param_counts(cfg)
    assert counts["non_embedding"] == pytest.approx(50.3e6, rel=0.01)
    assert counts["total"] == pytest.approx(88.9e6, rel=0.01)
    assert flops_per_token(cfg) == pytest.approx(609e6, rel=0.01)
    # The analytic count is the real module's, less the never-used padded rows.
    model = Transformer(cfg)
    real = sum(p.numel() for p in model.parameters()) - counts["padded_rows"]
    assert real == counts["total"]


def test_changing_a_token_changes_no_earlier_logit():
    torch.manual_seed(0)
    model = Transformer(tiny()).eval()
    idx = torch.randint(0, 50257, (2, 32))
    t = 17
    other = idx.clone()
    other[:, t] = (other[:, t] + 1) % 50257
    with torch.no_grad():
        a, b = model.logits(idx), model.logits(other)
    assert torch.equal(a[:, :t], b[:, :t])
    assert not torch.allclose(a[:, t:], b[:, t:])


def _plain_mha(x, wq, wk, wv, wo, n_head, cos, sin):
    """Textbook multi-head causal attention with explicit softmax, for comparison."""
    B, T, d = x.shape
    hd = d // n_head
    q = apply_rope((x @ wq.T).view(B, T, n_head, hd), cos, sin).transpose(1, 2)
    k = apply_rope((x @ wk.T).view(B, T, n_head, hd), cos, sin).transpose(1, 2)
    v = (x @ wv.T).view(B, T, n_head, hd).transpose(1, 2)
    scores = q @ k.transpose(-1, -2) / math.sqrt(hd)
    scores = scores.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
    y = scores.softmax(-1) @ v
    return y.transpose(1, 2).reshape(B, T, d) @ wo.T


def test_gqa_with_as_many_kv_heads_as_heads_is_plain_multi_head_attention():
    torch.manual_seed(0)
    cfg = tiny(n_kv_head=4)
    attn = Attention(cfg)
    x = torch.randn(2, 16, cfg.d_model)
    cos, sin = rope_tables(cfg.head_dim, 16, cfg.rope_base)
    wq, wk, wv = attn.wqkv.weight.split(cfg.d_model, dim=0)
    with torch.no_grad():
        ours = attn(x, cos, sin)
        ref = _plain_mha(x, wq, wk, wv, attn.wo.weight, cfg.n_head, cos, sin)
    torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-6)


def test_gqa_equals_multi_head_attention_with_repeated_kv_heads():
    torch.manual_seed(1)
    cfg = tiny(n_kv_head=2)
    attn = Attention(cfg)
    hd, H, Hkv = cfg.head_dim, cfg.n_head, cfg.n_kv_head
    x = torch.randn(2, 16, cfg.d_model)
    cos, sin = rope_tables(hd, 16, cfg.rope_base)
    wq, wk, wv = attn.wqkv.weight.split([H * hd, Hkv * hd, Hkv * hd], dim=0)
    rep = H // Hkv
    wk_full = wk.view(Hkv, hd, -1).repeat_interleave(rep, dim=0).reshape(H * hd, -1)
    wv_full = wv.view(Hkv, hd, -1).repeat_interleave(rep, dim=0).reshape(H * hd, -1)
    with torch.no_grad():
        torch.testing.assert_close(attn(x, cos, sin), _plain_mha(x, wq, wk_full, wv_full, attn.wo.weight, H, cos, sin),
                                   rtol=1e-5, atol=1e-6)


def test_rope_scores_depend_only_on_relative_position():
    torch.manual_seed(2)
    hd = 16
    cos, sin = rope_tables(hd, 128, 10000.0)
    q, k = torch.randn(hd, dtype=torch.float64), torch.randn(hd, dtype=torch.float64)

    def score(m, n):
        qm = apply_rope(q.view(1, 1, 1, hd), cos[m : m + 1].double(), sin[m : m + 1].double())
        kn = apply_rope(k.view(1, 1, 1, hd), cos[n : n + 1].double(), sin[n : n + 1].double())
        return (qm * kn).sum().item()

    for offset in (0, 3, 17):
        values = [score(m + offset, m) for m in (0, 5, 40, 100)]
        assert max(values) - min(values) < 1e-5, values
    assert abs(score(10, 0) - score(20, 0)) > 1e-3  # and it does depend on the distance


def test_head_and_embedding_share_storage():
    model = Transformer(tiny())
    names = [n for n, _ in model.named_parameters()]
    assert not any("head" in n for n in names)  # no second V x d matrix exists
    idx = torch.randint(10, 100, (1, 8))  # token 7 is not an input: only the head can see row 7
    with torch.no_grad():
        before = model.logits(idx)
        model.tok_emb.weight[7] += 1.0  # touch one embedding row: exactly its logit column moves
        after = model.logits(idx)
    changed = (before != after).any(dim=(0, 1))
    assert changed[7] and changed.sum() == 1
    loss = model(idx, idx)
    loss.backward()
    assert model.tok_emb.weight.grad[: model.cfg.vocab_size].abs().sum() > 0


def test_padded_vocab_rows_never_count():
    torch.manual_seed(3)
    model = Transformer(tiny())
    cfg = model.cfg
    assert cfg.padded_vocab_size == 50304 and model.tok_emb.weight.shape[0] == 50304
    idx = torch.randint(0, cfg.vocab_size, (2, 16))
    with torch.no_grad():
        model.tok_emb.weight[cfg.vocab_size :] = 100.0  # huge padded logits would dominate a softmax
        loss = model(idx, idx)
        ref = F.cross_entropy(model.logits(idx).reshape(-1, cfg.vocab_size), idx.reshape(-1))
    assert model.logits(idx).shape[-1] == cfg.vocab_size
    torch.testing.assert_close(loss, ref)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="flash-attn needs a CUDA GPU")
def test_sdpa_and_flash_attn_paths_agree():
    pytest.importorskip("flash_attn")
    torch.manual_seed(4)
    cfg = load_config(CONFIGS / "x1-50m-a100.yaml").model
    model = Transformer(cfg).cuda()
    idx = torch.randint(0, cfg.vocab_size, (2, 256), device="cuda")
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
        model.set_attention_backend("sdpa")
        a = model.logits(idx).float()
        model.set_attention_backend("flash-attn")
        b = model.logits(idx).float()
    assert (a - b).abs().max() < 5e-2  # bf16 kernels, different reduction order


def test_tiny_model_overfits_one_fixed_batch():
    torch.manual_seed(5)
    model = Transformer(tiny())
    idx = torch.randint(0, 50257, (4, 33))
    x, y = idx[:, :-1], idx[:, 1:]
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for _ in range(150):
        loss = model(x, y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        if loss.item() < 0.1:
            break
    assert loss.item() < 0.1



def test_a_bf16_residual_stream_stays_bf16_between_blocks_and_keeps_the_loss():
    torch.manual_seed(0)
    model = Transformer(tiny())
    idx = torch.randint(0, 50257, (2, 32))
    targets = torch.randint(0, 50257, (2, 32))
    seen: list[torch.dtype] = []
    for block in model.layers:
        block.register_forward_hook(lambda mod, args, out: seen.append(out.dtype))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        fp32_stream = model(idx, targets)
        assert seen == [torch.float32] * len(model.layers)  # plain autocast: the embedding's dtype
        seen.clear()
        model.residual_dtype = torch.bfloat16
        bf16_stream = model(idx, targets)
    assert seen == [torch.bfloat16] * len(model.layers)
    assert bf16_stream.item() == pytest.approx(fp32_stream.item(), rel=5e-3)


def test_the_residual_dtype_enters_the_config_hash_only_when_it_is_not_the_default():
    base = load_config(TINY_CONFIG)
    assert load_config(TINY_CONFIG, ["train.residual=fp32"]).config_hash() == base.config_hash()
    assert load_config(TINY_CONFIG, ["train.residual=bf16"]).config_hash() != base.config_hash()


@pytest.mark.parametrize("d_model, n_head, n_kv_head, fits", [(768, 12, 4, True), (384, 6, 2, True), (96, 3, 1, True),
                                                              (288, 9, 3, False), (144, 9, 3, False), (240, 15, 5, False)])
def test_the_rope_kernel_is_used_only_for_shapes_it_takes_and_the_other_kernels_stay(d_model, n_head, n_kv_head, fits):
    # The ladder's rungs come in widths like 288 (key/value width 96), which Triton's power-of-two
    # ranges cannot span: RoPE then runs as PyTorch ops, the rest keeps its kernels.
    cfg = load_config(TINY_CONFIG, [f"model.d_model={d_model}", f"model.n_head={n_head}", f"model.n_kv_head={n_kv_head}",
                                    "model.n_layer=1"])
    assert rope_kernel_fits(cfg.model.head_dim, cfg.model.n_kv_head) is fits
    model = Transformer(cfg.model)
    model.use_kernels(True)
    assert model.fused_loss and all(b.mlp.fused for b in model.layers)
    assert all(b.attn.fused is fits for b in model.layers)
