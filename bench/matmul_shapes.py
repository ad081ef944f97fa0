"""Every matmul of one 50M micro-batch (64 x 1024 tokens, as shipped), timed alone on a CUDA GPU:
the forward, the input gradient (dgrad) and the weight gradient (wgrad) of each linear layer and
of the head, as autograd asks cuBLAS for them; the same product asked the other way round
(C^T = B^T A^T, which hands cuBLAS's heuristic m and n swapped); through cuBLASLt; and with both
operands stored with the reduced dimension contiguous (K-major: for a dgrad, the weight stored
transposed). A shape that runs at a lower fraction of the peak than its neighbours (the head's
dgrad) shows here, and what another formulation would buy.

    python bench/matmul_shapes.py [--json out.jsonl]
"""

from __future__ import annotations

import argparse
import json
import sys

import torch
from head_ce import time_ms  # bench/ is this script's folder

TOKENS, D, FF, VP = 64 * 1024, 768, 2048, 50304
# (name, out_features, in_features) of each linear of a block, and the tied head
LINEARS = [("wqkv", 1280, D), ("wo", D, D), ("w_gate_up", 2 * FF, D), ("w_down", D, FF), ("head", VP, D)]


def products(out_f: int, in_f: int) -> dict[str, tuple]:
    """(A, B) per pass, so that the pass is A @ B with the strides autograd gives cuBLAS."""
    x = torch.randn(TOKENS, in_f, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(out_f, in_f, device="cuda", dtype=torch.bfloat16)
    g = torch.randn(TOKENS, out_f, device="cuda", dtype=torch.bfloat16)
    return {"fwd": (x, w.t()), "dgrad": (g, w), "wgrad": (g.t(), x)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json", help="append the results as JSON lines to this file")
    args = p.parse_args()
    if not torch.cuda.is_available():
        print("matmul_shapes: needs a CUDA GPU", file=sys.stderr)
        return 2
    gpu = torch.cuda.get_device_name()
    lib = torch.backends.cuda.preferred_blas_library()
    total = {"as autograd asks": 0.0, "best of the four": 0.0}
    print(f"{'matmul':<18} {'m x n x k':>22} {'as asked':>10} {'swapped':>10} {'cuBLASLt':>10} {'K-major':>10}"
          "  TFLOP/s (as asked / best)")
    for name, out_f, in_f in LINEARS:
        for what, (a, b) in products(out_f, in_f).items():
            flops = 2 * a.size(0) * a.size(1) * b.size(1)
            asked = time_ms(lambda a=a, b=b: a @ b)
            swapped = time_ms(lambda a=a, b=b: (b.t() @ a.t()).t())
            torch.backends.cuda.preferred_blas_library("cublaslt")
            lt = time_ms(lambda a=a, b=b: a @ b)
            torch.backends.cuda.preferred_blas_library(lib)
            ak, bk = a.contiguous(), b.t().contiguous().t()  # copies made once, outside the timing
            kmajor = time_ms(lambda a=ak, b=bk: a @ b)
            ak = bk = None
            best = min(asked, swapped, lt, kmajor)
            count = 8 if name != "head" else 1  # per micro-batch: 8 blocks, one head
            total["as autograd asks"] += count * asked
            total["best of the four"] += count * best
            mnk = f"{a.size(0)} x {b.size(1)} x {a.size(1)}"
            print(f"{name + ' ' + what:<18} {mnk:>22} {asked:10.3f} {swapped:10.3f} {lt:10.3f} {kmajor:10.3f}  "
                  f"{flops / asked / 1e9:6.0f} / {flops / best / 1e9:6.0f}")
            if args.json:
                with open(args.json, "a") as f:
                    f.write(json.dumps({"gpu": gpu, "matmul": f"{name} {what}", "m": a.size(0), "n": b.size(1),
                                        "k": a.size(1), "asked_ms": round(asked, 4), "swapped_ms": round(swapped, 4),
                                        "cublaslt_ms": round(lt, 4), "k_major_ms": round(kmajor, 4)}) + "\n")
    for k, v in total.items():
        print(f"per micro-batch, {k}: {v:.2f} ms")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
