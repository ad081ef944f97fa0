"""The cross-entropy kernels for one micro-batch of the 50M config (32 x 1024 rows of 50304 bf16
logits, 3.3 GB), timed on a CUDA GPU: the forward (loss and logsumexp per row, one read) and the
backward (the gradient, one read and one write), with the bytes each moves per second, and the
head's matmul + loss forward and backward as the trainer runs them, eager.

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
FWD_SHAPES = [(2048, 8, 4), (4096, 8, 8), (8192, 8, 8), (4096, 16, 8)]  # BLOCK, K, warps
BWD_SHAPES = [(4096, 16), (8192, 16), (4096, 8)]  # BLOCK, warps


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
    logits = (torch.randn(N, VP, device="cuda") * 3).bfloat16()
    targets = torch.randint(0, V, (N,), device="cuda")
    dloss = torch.full((N,), 1.0 / N, device="cuda")
    _, lse = losses.ce_fwd(logits, targets, V)
    gb = logits.numel() * logits.element_size() / 1e9  # one read or one write of the logits
    rows = []
    for what, fn, passes in (
        ("kernel: forward (loss, logsumexp)", lambda: losses.ce_fwd(logits, targets, V), 1),
        ("kernel: backward (gradient)", lambda: losses.ce_bwd(logits, targets, lse, dloss, V), 2),
    ):
        ms = time_ms(fn)
        rows.append({"what": what, "ms": round(ms, 3), "TB_per_s": round(passes * gb / ms, 2)})
    loss = torch.empty(N, device="cuda")
    for block, k, warps in FWD_SHAPES:  # the kernels' other launch shapes
        ms = time_ms(lambda b=block, k=k, w=warps: losses._ce_fwd_kernel[(N,)](logits, VP, targets, loss, lse, V, VP,
                                                                              BLOCK=b, K=k, num_warps=w))
        rows.append({"what": f"kernel: forward, BLOCK={block} K={k} warps={warps}", "ms": round(ms, 3),
                     "TB_per_s": round(gb / ms, 2)})
    grad = torch.empty_like(logits)
    for block, warps in BWD_SHAPES:
        ms = time_ms(lambda b=block, w=warps: losses._ce_bwd_kernel[(N,)](logits, VP, grad, targets, lse, dloss, V, VP,
                                                                          BLOCK=b, num_warps=w))
        rows.append({"what": f"kernel: backward, BLOCK={block} warps={warps}", "ms": round(ms, 3),
                     "TB_per_s": round(2 * gb / ms, 2)})

    h = (torch.randn(N, D, device="cuda") * 0.5).bfloat16().requires_grad_()
    w = (torch.randn(VP, D, device="cuda") * 0.05).requires_grad_()  # fp32 master, as in training

    def head_and_loss():
        loss = losses.fused_cross_entropy(F.linear(h, w.bfloat16()), targets, V)
        (loss / 16).backward()

    ms = time_ms(head_and_loss)
    rows.append({"what": "head matmul + loss, forward and backward", "ms": round(ms, 3)})
    gpu = torch.cuda.get_device_name()
    for r in rows:
        extra = f"  {r['TB_per_s']} TB/s" if "TB_per_s" in r else ""
        print(f"{r['what']:<45} {r['ms']:8.3f} ms{extra}")
        if args.json:
            with open(args.json, "a") as f:
                f.write(json.dumps({"gpu": gpu, **r}) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
