"""One table from a device call: the plain reference's rows and ours, with the ratio and MFU.

    python bench/report.py [--reference reference.txt] --ours ours.jsonl

The ratio is ours over the reference's plain row (vocab 50257, micro-batch 32) measured in the
same call; MFU is per GPU, against the matmul peak measured in that call and against the 989
datasheet. Runs on several GPUs show their total tokens/s.
"""

from __future__ import annotations

import argparse
import json
import re
import sys


def parse_reference(text: str) -> tuple[float | None, list[dict]]:
    peak = None
    m = re.search(r"ceilings: matmul (\d+) TFLOP/s measured", text)
    if m:
        peak = float(m.group(1))
    rows = []
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 8 and cells[0].startswith("ref-50M"):
            tps = float(cells[2].rstrip("k")) * 1e3
            rows.append({"name": cells[0], "micro_batch": int(cells[1]), "tokens_per_sec": tps,
                         "tflops": float(cells[3]), "mfu_measured": float(cells[4]), "peak_gib": float(cells[6])})
    return peak, rows


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--reference", help="the reference script's output (its rows and measured peak)")
    p.add_argument("--ours", required=True)
    args = p.parse_args()
    peak, ref_rows = parse_reference(open(args.reference).read()) if args.reference else (None, [])
    ours = [json.loads(line) for line in open(args.ours) if line.strip()]
    base = next((r for r in ref_rows if r["name"].endswith("V=50257")), None)
    peak = peak or (ours[0]["matmul_peak_tflops"] if ours else None)
    print(f"measured bf16 matmul peak: {peak} TFLOP/s (989 datasheet)")
    print("| run | tokens/s | ratio vs reference | TFLOP/s per GPU | MFU (measured peak) | MFU (989) | loop tokens/s | loop overhead | peak GiB | compile s |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in ref_rows:
        ratio = r["tokens_per_sec"] / base["tokens_per_sec"] if base else float("nan")
        print(f"| reference {r['name']} | {r['tokens_per_sec']/1e3:.0f}k | {ratio:.3f} | {r['tflops']:.0f} | "
              f"{r['mfu_measured']:.3f} | {r['tflops']/989:.3f} | | | {r['peak_gib']:.1f} | |")
    for o in ours:
        tps = o["bare_tokens_per_sec"]
        ratio = tps / base["tokens_per_sec"] if base else float("nan")
        tflops = tps / o.get("world_size", 1) * o["flops_per_token"] / 1e12  # per GPU
        loop = f"{o['loop_tokens_per_sec']/1e3:.0f}k" if o.get("loop_tokens_per_sec") else ""
        overhead = f"{o['loop_overhead']*100:.1f}%" if o.get("loop_overhead") is not None else ""
        print(f"| ours {o['name']} | {tps/1e3:.0f}k | {ratio:.3f} | {tflops:.0f} | {tflops/peak:.3f} | {tflops/989:.3f} | "
              f"{loop} | {overhead} | {o['peak_mem_gib']} | {o['setup_and_compile_s']} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
