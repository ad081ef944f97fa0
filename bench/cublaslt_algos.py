"""Every matmul of one 50M micro-batch (64 x 1024 tokens), timed on a CUDA GPU three ways: as
PyTorch runs it (cuBLAS's heuristic's first algorithm), as cuBLASLt's heuristic's first through
`x1_pretrain.cublaslt`, and as `cublaslt.tuned_mm` runs it: the fastest of PyTorch's call and the
heuristic's `CANDIDATES` best, timed one by one ("rank" -1: PyTorch's).
The weight gradients as the step runs them: added into an fp32 accumulator by the matmul.
Whether any shape has an algorithm faster than the one PyTorch gets, and by how much.

    python bench/cublaslt_algos.py [--json out.jsonl]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
from head_ce import time_ms  # bench/ is this script's folder
from matmul_shapes import LINEARS, products

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "trainer")]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json", help="append the results as JSON lines to this file")
    args = p.parse_args()
    if not torch.cuda.is_available():
        print("cublaslt_algos: needs a CUDA GPU", file=sys.stderr)
        return 2
    from x1_pretrain.ops import cublaslt

    if not cublaslt.available():
        print("cublaslt_algos: cuBLASLt could not be loaded", file=sys.stderr)
        return 2
    gpu = torch.cuda.get_device_name()
    totals = {"pytorch": 0.0, "tuned": 0.0}
    print(f"{'matmul':<14} {'m x n x k':>22} {'PyTorch':>9} {'Lt #0':>9} {'fastest':>9} {'rank':>5} {'of':>3}"
          "  TFLOP/s (PyTorch / fastest)")
    for name, out_f, in_f in LINEARS:
        for what, (a, b) in products(out_f, in_f).items():
            flops = 2 * a.size(0) * a.size(1) * b.size(1)
            if what == "wgrad":  # added into fp32, as the step's weight gradients are
                acc = torch.zeros(a.size(0), b.size(1), device="cuda")
                torch_ms = time_ms(lambda a=a, b=b, acc=acc: torch.addmm(acc, a, b, out_dtype=torch.float32, out=acc))
                cublaslt.tuned_addmm_(acc, a, b)
                _, timings = cublaslt.tuning(a, b, torch.float32)
                first = time_ms(lambda a=a, b=b, acc=acc: cublaslt.tuned_addmm_(acc, a, b, algo=0))
                tuned = time_ms(lambda a=a, b=b, acc=acc: cublaslt.tuned_addmm_(acc, a, b))
            else:
                torch_ms = time_ms(lambda a=a, b=b: a @ b)
                cublaslt.tuned_mm(a, b)
                _, timings = cublaslt.tuning(a, b)
                first = time_ms(lambda a=a, b=b: cublaslt.tuned_mm(a, b, algo=0))
                tuned = time_ms(lambda a=a, b=b: cublaslt.tuned_mm(a, b))
            rank = cublaslt.chosen(a, b, torch.float32 if what == "wgrad" else None)
            count = 8 if name != "head" else 1  # per micro-batch: 8 blocks, one head
            totals["pytorch"] += count * torch_ms
            totals["tuned"] += count * min(torch_ms, tuned)
            mnk = f"{a.size(0)} x {b.size(1)} x {a.size(1)}"
            print(f"{name + ' ' + what:<14} {mnk:>22} {torch_ms:9.3f} {first:9.3f} {tuned:9.3f} {rank:5d} "
                  f"{len(timings):3d}  {flops / torch_ms / 1e9:6.0f} / {flops / tuned / 1e9:6.0f}")
            if args.json:
                with open(args.json, "a") as f:
                    f.write(json.dumps({"gpu": gpu, "matmul": f"{name} {what}", "m": a.size(0), "n": b.size(1),
                                        "k": a.size(1), "pytorch_ms": round(torch_ms, 4), "lt_first_ms": round(first, 4),
                                        "tuned_ms": round(tuned, 4), "rank": rank,
                                        "candidates_ms": [round(t, 4) for t in timings]}) + "\n")
    print(f"per micro-batch: PyTorch {totals['pytorch']:.2f} ms, the faster of PyTorch and the tuned one per "
          f"shape {totals['tuned']:.2f} ms ({100 * (1 - totals['tuned'] / totals['pytorch']):.1f}% less)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
