"""The down projection's input gradient and SwiGLU's backward for one layer and micro-batch of the
50M config (64 x 1024 tokens, d_model 768, d_ff 2048), timed on a CUDA GPU: cuBLAS's matmul
followed by our SwiGLU backward kernel (two kernels, the 268 MB gradient between them written and
read back) against the matmul with SwiGLU's backward in its epilogue
(`kernels.down_swiglu_backward`) at several launch shapes, each checked against the two kernels.

    python bench/swiglu_down.py [--json out.jsonl] [--best best.json]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "trainer")]

N, D, F = 64 * 1024, 768, 2048
# BLOCK_M, BLOCK_N, BLOCK_K, SUBTILE, programs per SM, warps, stages. Call 31-32's kernel (one
# program per tile, pointer loads) took 0.75-0.85 ms at every shape against 0.61 for the two kernels.
SHAPES = [(128, 128, 64, True, 1, 8, 3), (128, 128, 64, True, 1, 8, 4), (128, 128, 64, False, 1, 8, 3),
          (128, 256, 64, True, 1, 8, 3), (128, 256, 64, True, 1, 8, 4), (256, 128, 64, True, 1, 8, 3),
          (128, 128, 64, True, 2, 8, 2), (128, 128, 64, True, 2, 4, 3), (64, 128, 64, True, 2, 4, 4),
          (128, 256, 64, True, 1, 4, 3), (128, 128, 128, True, 1, 8, 2)]


def time_ms(fn, reps: int = 50) -> float:
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
    p.add_argument("--best", help="write the fastest launch here, as kernels.DOWN_LAUNCH's JSON "
                                  "(bench/train_throughput.py --patch x1_pretrain.kernels.DOWN_LAUNCH=...)")
    p.add_argument("--faster-than-two", metavar="PATH",
                   help="write the fastest launch here only if it beats the two kernels (for a script to branch on)")
    args = p.parse_args()
    if not torch.cuda.is_available():
        print("swiglu_down: needs a CUDA GPU", file=sys.stderr)
        return 2
    from x1_pretrain import kernels

    torch.manual_seed(0)
    dy = torch.randn(N, D, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(D, F, device="cuda", dtype=torch.bfloat16) / D**0.5
    gu = torch.randn(N, 2 * F, device="cuda", dtype=torch.bfloat16) * 2
    flops = 2 * N * D * F
    rows = []

    def two_kernels():
        return kernels.swiglu_backward(gu, dy @ w)

    expected = two_kernels()
    t_mm = time_ms(lambda: dy @ w)
    t_two = time_ms(two_kernels)
    rows.append({"name": "cuBLAS + swiglu_backward", "ms": t_two, "matmul_ms": t_mm, "tflops": flops / t_two / 1e9})
    print(f"{'launch':<34} {'ms':>7} {'TFLOP/s':>8} {'max |diff|':>10}")
    print(f"{'cuBLAS dgrad alone':<34} {t_mm:7.3f} {flops / t_mm / 1e9:8.0f}")
    print(f"{'cuBLAS + swiglu_backward':<34} {t_two:7.3f} {flops / t_two / 1e9:8.0f}")
    best = None
    for bm, bn, bk, subtile, per_sm, warps, stages in SHAPES:
        launch = {"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "SUBTILE": subtile, "PER_SM": per_sm,
                  "num_warps": warps, "num_stages": stages}
        kernels.DOWN_LAUNCH = launch
        name = f"fused {bm}x{bn}x{bk}{' sub' if subtile else ''} x{per_sm}/SM w{warps} s{stages}"
        try:
            got = kernels.down_swiglu_backward(dy, w, gu)
            t = time_ms(lambda: kernels.down_swiglu_backward(dy, w, gu))
        except Exception as e:  # noqa: BLE001 - a launch shape that does not fit: report it, go on
            print(f"{name:<34} failed: {type(e).__name__}: {str(e)[:120]}")
            continue
        diff = (got.float() - expected.float()).abs().max().item()
        print(f"{name:<34} {t:7.3f} {flops / t / 1e9:8.0f} {diff:10.4f}")
        rows.append({"name": name, "ms": t, "tflops": flops / t / 1e9, "max_abs_diff": diff, "launch": launch})
        if best is None or t < best[0]:
            best = (t, launch)
    if best is not None:
        print(f"best: {best[1]} {best[0]:.3f} ms against {t_two:.3f} ms for the two kernels "
              f"({(t_two - best[0]) * 64:.1f} ms per step of 8 layers x 8 micro-batches)")
        if args.best:
            Path(args.best).write_text(json.dumps(best[1]))
        if args.faster_than_two and best[0] < t_two:
            Path(args.faster_than_two).write_text(json.dumps(best[1]))
    if args.json:
        with open(args.json, "a") as f:
            for r in rows:
                f.write(json.dumps({"bench": "swiglu_down", **r}) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
