"""The head's forward, and the input gradients whose output is 768 wide (the head's, wqkv's,
w_gate_up's, wo's), asked as one matmul and as launches of a few thousand rows (`kernels.mm_rows`),
timed alone on a CUDA GPU.

Each way runs back to back for --seconds, so the GPU settles at the clock its power cap allows,
and the GPU's energy counter is read around it. The operands are shaped like the step's, not
drawn from randn alone: under the cap a matmul's clock depends on its data (the head's matmuls
run 10-15% faster in the step, on softmax - onehot and 0.02-scaled weights, than alone on
randn: docs/PERFORMANCE.md, calls 28 and 36).

    python bench/dgrad_rows.py [--seconds 1] [--json out.jsonl] [--best rows.json]
    python bench/dgrad_rows.py --once ROWS     # the head's one launch each way, for a profiler:
    ncu --metrics dram__bytes_read.sum,gpu__time_duration.sum -k regex:nvjet python bench/dgrad_rows.py --once 6336

--best writes the fastest row counts as JSON ({"head_fwd": rows, "head": rows, "normed": rows}:
the head's forward, its input gradient, the folded matmuls' input gradients; 0 where one matmul is
fastest, or not 1% slower, or not timed).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path[:0] = [str(Path(__file__).resolve().parents[1] / "trainer")]

TOKENS, D, FF, V, VP = 64 * 1024, 768, 2048, 50257, 50304
# Whole waves on 132 SMs: 33 x 4 tiles of 192 x 192, 44 x 3 of 128 x 256, 22 x 6 of 256 x 128 or
# of 128 x 128 (two waves), and multiples.
ROWS = [2816, 4224, 5632, 6336, 8448, 11264, 12672, 16896, 22528, 33792]


def energy_mj() -> float | None:
    """The GPU's energy counter (millijoules since the driver loaded), or None without nvidia-smi."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=total_energy_consumption", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=10).stdout
        return float(out.split()[0])
    except (OSError, ValueError, IndexError, subprocess.TimeoutExpired):
        return None


def burst(fn, seconds: float) -> tuple[float, float | None]:
    """(ms per call, joules per call) over `seconds` of calls back to back."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    torch.cuda.synchronize()
    reps = max(3, int(seconds * 1000 / max(start.elapsed_time(end), 1e-3)))
    e0 = energy_mj()
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    torch.cuda.synchronize()
    e1 = energy_mj()
    joules = (e1 - e0) / 1000 / reps if e0 is not None and e1 is not None else None
    return start.elapsed_time(end) / reps, joules


def logits_grad(rows: int, generator: torch.Generator) -> torch.Tensor:
    """softmax - onehot (bf16) of logits drawn at a spread like an early run's, padded columns 0."""
    g = torch.zeros(rows, VP, device="cuda", dtype=torch.bfloat16)
    for s in range(0, rows, 4096):
        n = min(4096, rows - s)
        p = torch.softmax(torch.randn(n, V, device="cuda", generator=generator) * 2.0, dim=-1)
        p[torch.arange(n, device="cuda"), torch.randint(0, V, (n,), device="cuda", generator=generator)] -= 1.0
        g[s : s + n, :V] = p.to(torch.bfloat16)
    return g


def operands(generator: torch.Generator) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """(a, b) of each input gradient a @ b of one 64 x 1024 micro-batch, with the step's strides."""

    def weight(rows: int, cols: int) -> torch.Tensor:
        return (torch.randn(rows, cols, device="cuda", generator=generator) * 0.02).bfloat16()

    def grad(cols: int) -> torch.Tensor:  # a block's output gradient: small, as the step's are
        return (torch.randn(TOKENS, cols, device="cuda", generator=generator) * 1e-3).bfloat16()

    head_w = weight(VP, D)
    head_w[V:] = 0  # the padded rows of the tied embedding
    hidden = torch.randn(TOKENS, D, device="cuda", generator=generator).bfloat16()  # the final norm's output
    return {"head-fwd": (hidden, head_w.t()),  # the logits, h @ w.T
            "head": (logits_grad(TOKENS, generator), head_w),
            "w_gate_up": (grad(2 * FF), weight(2 * FF, D)),
            "wqkv": (grad(1280), weight(1280, D)),
            "wo": (grad(D), weight(D, D))}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seconds", type=float, default=1.0, help="how long each way runs back to back")
    p.add_argument("--json", help="append the results as JSON lines to this file")
    p.add_argument("--best", help="write the fastest row counts here as JSON")
    p.add_argument("--once", type=int, metavar="ROWS",
                   help="run the head's forward and input gradient once whole and once in launches of ROWS rows, then exit")
    p.add_argument("--only", nargs="+", choices=["head-fwd", "head", "w_gate_up", "wqkv", "wo"],
                   help="time these products alone (default: all)")
    args = p.parse_args()
    if not torch.cuda.is_available():
        print("dgrad_rows: needs a CUDA GPU", file=sys.stderr)
        return 2
    if args.seconds <= 0:
        p.error(f"--seconds must be above 0, got {args.seconds}")
    from x1_pretrain.kernels import mm_rows

    gen = torch.Generator(device="cuda").manual_seed(0)
    if args.once is not None:
        ops = operands(gen)
        for name in ("head-fwd", "head"):
            a, b = ops[name]
            torch.cuda.synchronize()
            whole, rows = a @ b, mm_rows(a, b, args.once)
            torch.cuda.synchronize()
            print(f"{name} once whole and once in {args.once}-row launches: max |difference| "
                  f"{(whole.float() - rows.float()).abs().max().item():.3g}")
            whole = rows = None
        return 0
    gpu = torch.cuda.get_device_name()
    times: dict[str, dict] = {}
    print(f"{'input gradient':<12} {'rows per matmul':>15} {'ms':>8} {'TFLOP/s':>8} {'J':>7} {'W':>5}")
    for name, (a, b) in operands(gen).items():
        if args.only and name not in args.only:
            continue
        flops = 2 * a.size(0) * a.size(1) * b.size(1)
        results = {}
        for rows in [0] + ROWS + (["swapped"] if name == "head" else []):  # the forward's swap writes other strides
            if rows == "swapped":
                fn = lambda a=a, b=b: (b.t() @ a.t()).t()  # noqa: E731
            else:
                fn = lambda a=a, b=b, rows=rows: mm_rows(a, b, rows)  # noqa: E731
            ms, joules = burst(fn, args.seconds)
            results[rows] = ms
            watts = f"{joules / ms * 1000:5.0f}" if joules is not None else "    -"
            print(f"{name:<12} {str(rows or 'one matmul'):>15} {ms:8.3f} {flops / ms / 1e9:8.0f} "
                  f"{joules if joules is not None else float('nan'):7.3f} {watts}", flush=True)
            if args.json:
                with open(args.json, "a") as f:
                    f.write(json.dumps({"gpu": gpu, "dgrad": name, "m": a.size(0), "k": a.size(1), "n": b.size(1),
                                        "rows": rows, "ms": round(ms, 4), "joules": joules,
                                        "time": time.strftime("%H:%M:%S")}) + "\n")
        times[name] = {r: ms for r, ms in results.items() if r != "swapped"}
    # The folded matmuls share one row count (kernels.NORMED_DGRAD_ROWS): the fastest for both together.
    best = {"head_fwd": fastest_rows(times["head-fwd"]) if "head-fwd" in times else 0,
            "head": fastest_rows(times["head"]) if "head" in times else 0,
            "normed": fastest_rows({r: times["wqkv"][r] + times["w_gate_up"][r] for r in times["wqkv"]})
            if "wqkv" in times and "w_gate_up" in times else 0}
    print(f"fastest row counts (0: one matmul): {best}")
    if args.best:
        Path(args.best).write_text(json.dumps(best))
    return 0


def fastest_rows(ms: dict[int, float]) -> int:
    """The row count of the fastest way, or 0 (one matmul) unless that is at least 1% faster."""
    fastest = min(ms, key=ms.get)
    return fastest if ms[fastest] < 0.99 * ms[0] else 0


if __name__ == "__main__":
    raise SystemExit(main())
