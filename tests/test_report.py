"""bench/report.py: the device call's table, and the bounds that the reference's rounded figures
put on its tokens/s and on every ratio taken against it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from conftest import REPO

REFERENCE = """bf16 matmul 8192^3: 790 TFLOP/s; copy: 4.26 TB/s
('ref-50M V=50257', 32, '640k', '389', '0.493', '0.393', '18.1', '3') nonemb=50.3M total=127.5M flops/tok=609M

ceilings: matmul 790 TFLOP/s measured (989 datasheet), copy 4.26 TB/s
| model | micro-batch | tokens/s | TFLOP/s | MFU(measured peak) | MFU(989) | peak GiB | compile s |
|---|---|---|---|---|---|---|---|
| ref-50M V=50257 | 32 | 640k | 389 | 0.493 | 0.393 | 18.1 | 3 |
"""


def test_the_ratio_is_bounded_by_every_rounded_figure_of_the_reference(tmp_path: Path):
    (tmp_path / "reference.txt").write_text(REFERENCE)
    ours = {"name": "shipped", "bare_tokens_per_sec": 864000.0, "flops_per_token": 609071616.0, "world_size": 1,
            "peak_mem_gib": 23.6, "setup_and_compile_s": 40.0, "loop_tokens_per_sec": None}
    (tmp_path / "ours.jsonl").write_text(json.dumps(ours) + "\n")
    proc = subprocess.run([sys.executable, str(REPO / "bench" / "report.py"), "--reference", str(tmp_path / "reference.txt"),
                           "--ours", str(tmp_path / "ours.jsonl")], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert "| ours shipped | 864k | 1.350 |" in proc.stdout  # against the printed 640k
    # '640k' alone allows 639.5k-640.5k; 389 TFLOP/s at 609M (+-0.5M) FLOPs per token allows at most
    # 389.5e12 / 608.5e6 = 640.1k: so the ratio printed 1.350 lies in 864k / 640.1k-639.5k.
    bounds = lines.index(next(line for line in lines if line.startswith("the reference prints rounded figures")))
    assert "lies in 639.5k-640.1k tokens/s" in lines[bounds]
    assert lines[bounds + 1] == "| ours shipped | 1.3498-1.3511 |"
