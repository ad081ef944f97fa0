"""The backward of residual add + RMSNorm for one micro-batch of the 50M config (32 x 1024 rows
of 768), timed on a CUDA GPU: our kernel at several launch shapes against what torch.compile
makes of the same math, with the bytes each moves per second (dy, y in fp32 and dh in bf16 read;
dx in fp32 and its bf16 copy written: 403 MB).

    python bench/norm_kernels.py [--json out.jsonl]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "trainer"), str(REPO / "bench")]

from head_ce import time_ms  # noqa: E402

N, D = 32 * 1024, 768
SHAPES = [(8, 1, 8), (4, 1, 4), (4, 2, 4), (2, 4, 4), (8, 2, 8), (16, 1, 8), (4, 4, 8)]  # BLOCK_R, ITERS, warps


def compiled_reference():
    def backward(dy, dh, y, rstd, w):
        xhat = y * rstd[:, None]
        g = dh.float() * w
        dx = dy + rstd[:, None] * (g - xhat * (g * xhat).mean(-1, keepdim=True))
        return dx, dx.to(torch.bfloat16), (dh.float() * xhat).sum(0)

    return torch.compile(backward)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json", help="append the results as JSON lines to this file")
    args = p.parse_args()
    if not torch.cuda.is_available():
        print("norm_kernels: needs a CUDA GPU", file=sys.stderr)
        return 2
    from x1_pretrain import kernels

    torch.manual_seed(0)
    y = torch.randn(N, D, device="cuda")
    dy = torch.randn(N, D, device="cuda")
    dh = torch.randn(N, D, device="cuda").bfloat16()
    w = torch.rand(D, device="cuda") + 0.5
    rstd = torch.rsqrt(y.pow(2).mean(-1) + 1e-5)
    gb = (3 * N * D * 4 + 2 * N * D * 2) / 1e9
    ref = compiled_reference()
    want = ref(dy, dh, y, rstd, w)
    rows = [{"what": "torch.compile of the same math", "ms": round(time_ms(lambda: ref(dy, dh, y, rstd, w)), 3)}]
    for block_r, iters, warps in SHAPES:
        kernels.ADD_NORM_BWD_LAUNCH = {"BLOCK_R": block_r, "ITERS": iters, "num_warps": warps}
        got = kernels._add_rmsnorm_backward(dy, dh, y, rstd, w, torch.bfloat16)
        err = max(float((a.float() - b.float()).norm() / b.float().norm()) for a, b in zip(got, want, strict=True))
        ms = time_ms(lambda: kernels._add_rmsnorm_backward(dy, dh, y, rstd, w, torch.bfloat16))
        rows.append({"what": f"kernel: BLOCK_R={block_r} ITERS={iters} warps={warps}", "ms": round(ms, 3), "rel_err": f"{err:.1e}"})
    gpu = torch.cuda.get_device_name()
    for r in rows:
        r["TB_per_s"] = round(gb / r["ms"], 2)
        print(f"{r['what']:<40} {r['ms']:8.3f} ms  {r['TB_per_s']} TB/s  {r.get('rel_err', '')}")
        if args.json:
            with open(args.json, "a") as f:
                f.write(json.dumps({"gpu": gpu, **r}) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
