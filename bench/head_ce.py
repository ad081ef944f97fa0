"""The cross-entropy kernels for one micro-batch of the 50M config (64 x 1024 rows of 50304 bf16
logits, 6.6 GB), timed on a CUDA GPU: the forward (loss and logsumexp per row, one read), the
backward (the gradient, one read and one write) and the kernel that does both (one read from HBM
if the second read of each row hits L2, and one write) at several launch shapes, with the bytes
each moves per second; the head's three matmuls, its input gradient asked five ways; and the head's matmul +
loss forward and backward as the trainer runs them, eager, both ways.

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

N, D, V, VP = 64 * 1024, 768, 50257, 50304
FWD_SHAPES = [(4096, 8, 8), (8192, 8, 8)]  # BLOCK, K, warps
BWD_SHAPES = [(4096, 16), (8192, 16)]  # BLOCK, warps
HINTS = ("evict_last", "evict_first")  # the L2 eviction hints of the two passes' loads
GRAD_SHAPES = [(8192, 8, 32, 2, HINTS), (8192, 8, 32, 2, ("", "")), (8192, 8, 32, 1, HINTS), (4096, 8, 16, 2, HINTS),
               (4096, 8, 16, 3, HINTS), (4096, 8, 16, 4, HINTS), (8192, 8, 16, 2, HINTS), (16384, 8, 32, 1, HINTS),
               (2048, 8, 8, 8, HINTS)]  # BLOCK, K, warps, programs per SM, hints


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
    p.add_argument("--best", help="write the fastest forward-and-gradient launch here, as losses.GRAD_LAUNCH's JSON "
                                  "(a candidate for losses.GRAD_LAUNCH, which the step then runs once it is committed there)")
    p.add_argument("--once", action="store_true",
                   help="only launch the forward-and-gradient kernel, then the forward kernel, once each (for a profiler: "
                        "ncu -k regex:_ce_fwd python bench/head_ce.py --once)")
    p.add_argument("--grad-only", action="store_true", help="only the forward-and-gradient kernel's launches")
    args = p.parse_args()
    if not torch.cuda.is_available():
        print("head_ce: needs a CUDA GPU", file=sys.stderr)
        return 2
    from x1_pretrain.ops import losses

    torch.manual_seed(0)
    logits = (torch.randn(N, VP, device="cuda") * 3).bfloat16()
    targets = torch.randint(0, V, (N,), device="cuda")
    if args.once:
        losses.ce_fwd_grad(logits, targets, V)
        losses.ce_fwd(logits, targets, V)
        torch.cuda.synchronize()
        return 0
    dloss = torch.full((N,), 1.0 / N, device="cuda")
    _, lse = losses.ce_fwd(logits, targets, V)
    gb = logits.numel() * logits.element_size() / 1e9  # one read or one write of the logits
    rows = []
    for what, fn, passes in () if args.grad_only else (
        ("kernel: forward (loss, logsumexp)", lambda: losses.ce_fwd(logits, targets, V), 1),
        ("kernel: backward (gradient)", lambda: losses.ce_bwd(logits, targets, lse, dloss, V), 2),
    ):
        ms = time_ms(fn)
        rows.append({"what": what, "ms": round(ms, 3), "TB_per_s": round(passes * gb / ms, 2)})
    loss = torch.empty(N, device="cuda")
    for block, k, warps in [] if args.grad_only else FWD_SHAPES:  # the kernels' other launch shapes
        ms = time_ms(lambda b=block, k=k, w=warps: losses._ce_fwd_kernel[(N,)](logits, VP, targets, loss, lse, V, VP,
                                                                              BLOCK=b, K=k, num_warps=w))
        rows.append({"what": f"kernel: forward, BLOCK={block} K={k} warps={warps}", "ms": round(ms, 3),
                     "TB_per_s": round(gb / ms, 2)})
    grad = torch.empty_like(logits)
    for block, warps in [] if args.grad_only else BWD_SHAPES:
        ms = time_ms(lambda b=block, w=warps: losses._ce_bwd_kernel[(N,)](logits, VP, grad, targets, lse, dloss, V, VP,
                                                                          BLOCK=b, num_warps=w))
        rows.append({"what": f"kernel: backward, BLOCK={block} warps={warps}", "ms": round(ms, 3),
                     "TB_per_s": round(2 * gb / ms, 2)})

    sms = torch.cuda.get_device_properties(0).multi_processor_count
    best = (float("inf"), None)
    for block, k, warps, per_sm, (first, second) in GRAD_SHAPES:  # 1 read + 1 write if L2 serves the 2nd read
        regs = min(255, 65536 // (per_sm * warps * 32))  # as losses.ce_fwd_grad launches them
        def launch(b=block, k=k, w=warps, p=per_sm, f=first, s=second, r=regs):
            return losses._ce_fwd_grad_kernel[(sms * p,)](logits, VP, grad, targets, loss, lse, N, V, VP,
                                                          BLOCK=b, K=k, FIRST=f, SECOND=s, num_warps=w, maxnreg=r)
        compiled = launch()
        ms = time_ms(launch)
        info = f" ({getattr(compiled, 'n_regs', '?')} registers, {getattr(compiled, 'n_spills', '?')} spills)"
        rows.append({"what": f"kernel: forward + gradient, BLOCK={block} K={k} warps={warps} per SM={per_sm} "
                             f"hints={first or 'none'}/{second or 'none'}{info}",
                     "ms": round(ms, 3), "TB_per_s": round(2 * gb / ms, 2)})
        best = min(best, (ms, {"BLOCK": block, "K": k, "num_warps": warps, "PER_SM": per_sm, "FIRST": first,
                               "SECOND": second}), key=lambda b: b[0])
    if args.best:
        Path(args.best).write_text(json.dumps(best[1]))
    if args.grad_only:
        return _print(rows, args.json)

    w16 = (torch.randn(VP, D, device="cuda") * 0.05).bfloat16()
    per_wave = sms * 192 // (D // 192)  # rows of 192 x 192 tiles that fill one wave: 6336 on 132 SMs
    cut = N // per_wave * per_wave  # 63360: the rest, 2176 rows, another kernel (split-K, maybe)
    wt = w16.t().contiguous()  # (d_model, Vp): w's rows are the reduced dimension, contiguous
    dgrads = [("as asked: grad @ w", lambda: grad @ w16),
              ("w stored transposed (both operands K-major): grad @ wt.T", lambda: grad @ wt.t()),
              ("w transposed there: grad @ w.T.contiguous().T", lambda: grad @ w16.t().contiguous().t()),
              ("swapped: (w.T @ grad.T).T", lambda: (w16.t() @ grad.t()).t()),
              (f"rows split at {cut}", lambda: torch.cat([grad[:cut] @ w16, grad[cut:] @ w16]))]
    try:
        torch.mm(grad[:256], w16, out_dtype=torch.float32)
        dgrads.append(("fp32 output", lambda: torch.mm(grad, w16, out_dtype=torch.float32)))
    except (TypeError, RuntimeError) as e:
        print(f"mm with out_dtype: {e}")
    x16 = (torch.randn(N, D, device="cuda") * 0.5).bfloat16()
    others = [("head forward: x @ w.T", lambda: x16 @ w16.t()), ("head weight gradient: grad.T @ x", lambda: grad.t() @ x16)]
    for what, fn in [(f"head input gradient, {what}", fn) for what, fn in dgrads] + others:
        ms = time_ms(fn)
        rows.append({"what": what, "ms": round(ms, 3), "TFLOP_per_s": round(2 * N * VP * D / ms / 1e9, 1)})
    x16 = wt = None

    h = (torch.randn(N, D, device="cuda") * 0.5).bfloat16().requires_grad_()
    w = (torch.randn(VP, D, device="cuda") * 0.05).requires_grad_()  # fp32 master, as in training

    def head_and_loss():
        loss = losses.fused_cross_entropy(F.linear(h, w.bfloat16()), targets, V)
        (loss / 8).backward()

    def head_loss_one_kernel():
        (losses.head_cross_entropy(h, w.bfloat16(), targets, V) / 8).backward()

    logits = grad = None  # 13 GB back before the head's runs
    for what, fn in (("head matmul + loss, forward and backward (two kernels)", head_and_loss),
                     ("head matmul + loss, forward and backward (one kernel)", head_loss_one_kernel)):
        torch.cuda.reset_peak_memory_stats()
        ms = time_ms(fn, reps=10)
        rows.append({"what": what, "ms": round(ms, 3), "peak_GiB": round(torch.cuda.max_memory_allocated() / 2**30, 1)})
    return _print(rows, args.json)


def _print(rows: list[dict], json_path: str | None) -> int:
    gpu = torch.cuda.get_device_name()
    for r in rows:
        extra = "".join(f"  {r[key]} {unit}" for key, unit in (("TB_per_s", "TB/s"), ("TFLOP_per_s", "TFLOP/s"),
                                                                ("peak_GiB", "GiB peak")) if key in r)
        print(f"{r['what']:<75} {r['ms']:8.3f} ms{extra}")
        if json_path:
            with open(json_path, "a") as f:
                f.write(json.dumps({"gpu": gpu, **r}) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
