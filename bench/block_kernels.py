"""The attention block's own kernels for one micro-batch of the 50M config (64 x 1024 tokens, 12
query heads, 4 KV heads, head dim 64), timed alone on a CUDA GPU:

  rope       RoPE forward and backward on the fused qkv projection (`kernels.rope_qkv`), the
             kernel as shipped at several launch shapes, with the bytes each moves per second
             (the kernel before it, one program per 64 tokens x one head, is in git at fa8f50d:
             removed in 6c8dcc1; docs/PERFORMANCE.md has its figures);
  attention  SDPA (cuDNN) forward + backward with q, k, v in the layout the model hands over
             ((B, T, H, hd) memory, transposed views) against (B, H, T, hd) memory, each from
             the projection's output to the (B, T, C) input of the output projection, copies
             included; with --profile, the kernels of each.

    python bench/block_kernels.py [--profile] [--json out.jsonl]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from head_ce import time_ms  # bench/ is this script's folder

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "trainer")]

B, T, H, HKV, HD = 64, 1024, 12, 4, 64
ROPE_SHAPES = [(16, 4), (32, 4), (64, 4), (32, 8), (64, 8), (128, 8)]  # tokens per program, warps


def rope_rows(emit) -> None:
    import triton

    from x1_pretrain.model.transformer import rope_tables
    from x1_pretrain.ops import kernels as K

    cos, sin = (t.cuda() for t in rope_tables(HD, T, 10000.0))
    qkv = torch.randn(B, T, (H + 2 * HKV) * HD, device="cuda", dtype=torch.bfloat16)
    # gradients as cuDNN's backward hands them over: (B, H, T, hd) memory, (B, T, H, hd) views
    dq = torch.randn(B, H, T, HD, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
    dk, dv = (torch.randn(B, HKV, T, HD, device="cuda", dtype=torch.bfloat16).transpose(1, 2) for _ in range(2))
    gbytes = 2 * qkv.numel() * 2 / 1e9  # read once, written once, fwd and bwd alike
    ref_out = None

    def forward(launch: dict) -> list[torch.Tensor]:
        # kernels.rope_qkv's launch, at the launch shape given (the op itself takes ROPE_LAUNCH)
        q, k, v = (qkv.new_empty(B, T, n, HD) for n in (H, HKV, HKV))
        K._rope_fwd_kernel[(triton.cdiv(B * T, launch["BLOCK_N"]),)](
            qkv, cos, sin, q, k, v, qkv, B * T, T, H=H, HKV=HKV, HD=HD, HAS_SCALE=False, **launch)
        return [q, k, v]

    def backward(launch: dict) -> torch.Tensor:
        # kernels.rope_qkv_backward's launch, likewise
        out = dq.new_empty(B, T, (H + 2 * HKV) * HD)
        K._rope_bwd_kernel[(triton.cdiv(B * T, launch["BLOCK_N"]),)](
            dq, dk, dv, cos, sin, dq, out, B * T, T, *dq.stride(), *dk.stride(), *dv.stride(),
            H=H, HKV=HKV, HD=HD, HAS_SCALE=False, **launch)
        return out

    def one(name: str, launch: dict) -> None:
        nonlocal ref_out
        fwd = time_ms(lambda: forward(launch))
        bwd = time_ms(lambda: backward(launch))
        out = torch.cat([t.reshape(B * T, -1) for t in forward(launch)] + [backward(launch).reshape(B * T, -1)], dim=1)
        same = True if ref_out is None else bool(torch.equal(out, ref_out))
        ref_out = out if ref_out is None else ref_out
        emit({"bench": "rope", "kernel": name, "fwd_us": round(fwd * 1000, 1), "bwd_us": round(bwd * 1000, 1),
              "fwd_tb_s": round(gbytes / fwd, 2), "bwd_tb_s": round(gbytes / bwd, 2), "bit_identical_to_first": same})

    one(f"all heads, {K.ROPE_LAUNCH['BLOCK_N']} tokens x {K.ROPE_LAUNCH['num_warps']} warps (shipped)", K.ROPE_LAUNCH)
    for block, warps in ROPE_SHAPES:
        if {"BLOCK_N": block, "num_warps": warps} != K.ROPE_LAUNCH:
            one(f"all heads, {block} tokens x {warps} warps", {"BLOCK_N": block, "num_warps": warps})


def attention_rows(emit, profile: bool) -> None:
    torch.backends.cuda.enable_flash_sdp(False)
    torch.backends.cuda.enable_mem_efficient_sdp(False)
    torch.backends.cuda.enable_math_sdp(False)
    C = H * HD
    dy = torch.randn(B, T, C, device="cuda", dtype=torch.bfloat16)

    def inputs(layout: str):
        if layout == "bthd":  # as the model: (B, T, heads, hd) memory, transposed views
            q = torch.randn(B, T, H, HD, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
            k, v = (torch.randn(B, T, HKV, HD, device="cuda", dtype=torch.bfloat16).transpose(1, 2) for _ in range(2))
        else:
            q = torch.randn(B, H, T, HD, device="cuda", dtype=torch.bfloat16)
            k, v = (torch.randn(B, HKV, T, HD, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        return [t.requires_grad_() for t in (q, k, v)]

    def step(q, k, v, backward: bool):
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        y = y.transpose(1, 2).reshape(B, T, C)  # the output projection's input; a copy unless (B, T, H, hd) memory
        if backward:
            torch.autograd.grad(y, (q, k, v), dy)

    for layout in ("bthd", "bhtd"):
        q, k, v = inputs(layout)
        fwd = time_ms(lambda q=q, k=k, v=v: step(q, k, v, False), reps=10)
        both = time_ms(lambda q=q, k=k, v=v: step(q, k, v, True), reps=10)
        emit({"bench": "attention", "layout": layout, "fwd_ms": round(fwd, 3), "fwd_bwd_ms": round(both, 3),
              "per_step_ms (x 8 layers x 8 micro-batches)": round(both * 64, 1)})
        if profile:
            from torch.profiler import ProfilerActivity
            from torch.profiler import profile as prof_ctx

            with prof_ctx(activities=[ProfilerActivity.CUDA]) as prof:
                step(q, k, v, True)
                torch.cuda.synchronize()
            print(f"-- attention, {layout}", flush=True)
            print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=12, max_name_column_width=90), flush=True)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--profile", action="store_true", help="print the kernels of each attention layout")
    p.add_argument("--json", help="append each row as a JSON line to this file")
    args = p.parse_args()
    if not torch.cuda.is_available():
        print("block_kernels: needs a CUDA GPU", file=sys.stderr)
        return 2

    def emit(row: dict) -> None:
        print(json.dumps(row), flush=True)
        if args.json:
            with open(args.json, "a") as f:
                f.write(json.dumps(row) + "\n")

    rope_rows(emit)
    attention_rows(emit, args.profile)
    return 0


if __name__ == "__main__":
    sys.exit(main())
