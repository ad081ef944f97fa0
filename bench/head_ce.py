"""The tied head and its loss for one micro-batch of the 50M config (32 x 1024 tokens, d_model
768, 50304 columns), timed on a CUDA GPU, forward + backward, eager:

  linear+ce    F.linear, then our cross-entropy op (loss in the forward, gradient recomputed in
               the backward): the lever before this one
  linear_ce    losses.linear_cross_entropy as the trainer calls it (gradient of the logits written
               in the forward; the backward is the head's two matmuls)

and the forward-with-gradient kernel alone at several shapes (block, two-pass or online, warps),
against the two kernels it replaces, with the bytes each moves per second.

    python bench/head_ce.py [--json out.jsonl]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "trainer")]

N, D, V, VP = 32 * 1024, 768, 50257, 50304
SHAPES = [(4096, 0, 8), (8192, 0, 16), (8192, 0, 32), (16384, 0, 32), (4096, 1, 8), (8192, 1, 16), (16384, 1, 32)]


def time_ms(fn, reps: int = 20) -> float:
    for _ in range(3):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json", help="append the results as JSON lines to this file")
    args = p.parse_args()
    if not torch.cuda.is_available():
        print("head_ce: needs a CUDA GPU", file=sys.stderr)
        return 2
    from x1_pretrain import losses

    torch.manual_seed(0)
    h = (torch.randn(N, D, device="cuda") * 0.5).bfloat16().requires_grad_()
    w = (torch.randn(VP, D, device="cuda") * 0.05).requires_grad_()  # fp32 master, as in training
    targets = torch.randint(0, V, (N,), device="cuda")
    rows = []

    def step_linear_then_ce():
        loss = losses.fused_cross_entropy(F.linear(h, w.bfloat16()), targets, V)
        (loss / 16).backward()

    def step_linear_ce():
        (losses.linear_cross_entropy(h, w, targets, V) / 16).backward()

    for name, fn in (("linear+ce", step_linear_then_ce), ("linear_ce", step_linear_ce)):
        torch.cuda.reset_peak_memory_stats()
        ms = time_ms(fn)
        rows.append({"what": name, "ms": round(ms, 3), "peak_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2)})
        h.grad = w.grad = None

    logits = (torch.randn(N, VP, device="cuda") * 3).bfloat16()
    grad, loss, lse = torch.empty_like(logits), torch.empty(N, device="cuda"), torch.empty(N, device="cuda")
    dloss = torch.full((N,), 1.0 / N, device="cuda")
    gb = logits.numel() * logits.element_size() / 1e9  # one read or one write of the logits

    def old_kernels():
        losses._ce_fwd_vec_kernel[(N,)](logits, VP, targets, loss, lse, V, BLOCK=2048, num_warps=8)
        losses._ce_bwd_kernel[(N,)](logits, VP, grad, targets, lse, dloss, V, VP, BLOCK=losses._BLOCK, num_warps=16)

    ms = time_ms(old_kernels)
    rows.append({"what": "kernels: loss fwd + grad bwd (before)", "ms": round(ms, 3), "TB_per_s": round(3 * gb / ms, 2)})
    for block, online, warps in SHAPES:
        def fwd_grad(block=block, online=online, warps=warps):
            losses._ce_fwd_grad_kernel[(N,)](logits, VP, grad, targets, loss, V, VP, 1.0 / N,
                                             BLOCK=block, ONLINE=online, num_warps=warps)

        ms = time_ms(fwd_grad)
        shipped = {"BLOCK": block, "ONLINE": online, "num_warps": warps} == losses.CE_GRAD_KERNEL
        rows.append({"what": f"kernel: fwd+grad BLOCK={block} ONLINE={online} warps={warps}" + (" (shipped)" if shipped else ""),
                     "ms": round(ms, 3), "TB_per_s": round(2 * gb / ms, 2)})
    gpu = torch.cuda.get_device_name()
    for r in rows:
        print(f"{r['what']:<60} {r['ms']:8.3f} ms  " + "  ".join(f"{k}={v}" for k, v in r.items() if k not in ("what", "ms")))
        if args.json:
            with open(args.json, "a") as f:
                f.write(json.dumps({"gpu": gpu, **r}) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
