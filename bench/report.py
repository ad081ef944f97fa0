"""One table from a device call: the plain reference's rows and ours, with the ratio and MFU.

    python bench/report.py [--reference reference.txt [--reference-after reference-after.txt]] --ours ours.jsonl [--smi smi.csv]

The ratio is ours over the reference's plain row (vocab 50257, micro-batch 32) measured in the
same call; MFU is per GPU, against the matmul peak measured in that call and against the 989
datasheet. Runs on several GPUs show their total tokens/s. The loop's overhead is against the
mean of the bare step timed before and after the loop, and against the one before it alone.
With --smi (nvidia-smi's CSV: timestamp, clocks.sm, clocks.mem, power.draw, power.limit, ...),
one line more: the SM clock and the power while the GPU worked hard (over 85% of its limit).
With --reference-after (the reference run again after ours), one table more: each of our rows
against the reference before, after and the mean of the two, and MFU against the mean peak.
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
    # The FLOPs per token each row was counted with, printed after its tuple (rounded to 1M)
    flops = {m.group(1): float(m.group(2)) * 1e6 for m in re.finditer(r"\('(ref-50M[^']*)'.*flops/tok=(\d+)M", text)}
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 8 and cells[0].startswith("ref-50M"):
            tps = float(cells[2].rstrip("k")) * 1e3
            rows.append({"name": cells[0], "micro_batch": int(cells[1]), "tokens_per_sec": tps,
                         "tflops": float(cells[3]), "mfu_measured": float(cells[4]), "peak_gib": float(cells[6]),
                         "flops_per_token": flops.get(cells[0])})
    return peak, rows


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--reference", help="the reference script's output (its rows and measured peak)")
    p.add_argument("--ours", required=True)
    p.add_argument("--reference-after", help="the reference script's output, run again after ours in the same call")
    p.add_argument("--smi", help="nvidia-smi samples taken through the call (bench/run.py writes smi.csv for a plan with smi = true)")
    args = p.parse_args()
    peak, ref_rows = parse_reference(open(args.reference).read()) if args.reference else (None, [])
    ours = [json.loads(line) for line in open(args.ours) if line.strip()]
    base = plain_row(ref_rows)
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
        tflops = tflops_per_gpu(o)
        loop = f"{o['loop_tokens_per_sec']/1e3:.0f}k" if o.get("loop_tokens_per_sec") else ""
        overhead = f"{o['loop_overhead']*100:.1f}%" if o.get("loop_overhead") is not None else ""
        if o.get("loop_overhead_bracketed") is not None:
            overhead = f"{o['loop_overhead_bracketed']*100:.1f}% ({overhead} vs before)"
        print(f"| ours {o['name']} | {tps/1e3:.0f}k | {ratio:.3f} | {tflops:.0f} | {tflops/peak:.3f} | {tflops/989:.3f} | "
              f"{loop} | {overhead} | {o['peak_mem_gib']} | {o['setup_and_compile_s']} |")
    if base:
        lo, hi = plain_bounds(base, peak)
        print(f"\nthe reference prints rounded figures: from them its {base['name']} row lies in {lo/1e3:.1f}k-{hi/1e3:.1f}k "
              "tokens/s, and each ratio in")
        for o in ours:
            print(f"| ours {o['name']} | {o['bare_tokens_per_sec'] / hi:.4f}-{o['bare_tokens_per_sec'] / lo:.4f} |")
    if args.reference_after and base:
        print(bracket_table(base, peak, *parse_reference(open(args.reference_after).read()), ours))
    if args.smi:
        print(smi_summary(open(args.smi).read()))
    return 0


def plain_row(rows: list[dict]) -> dict | None:
    """The reference's plain row (vocab 50257), the one every ratio is taken against."""
    return next((r for r in rows if r["name"].endswith("V=50257")), None)


def plain_bounds(row: dict, peak: float | None) -> tuple[float, float]:
    """The reference row's tokens/s as an interval. The reference prints it rounded to 1k, its
    TFLOP/s to 1, its MFU to 0.001 of a peak rounded to 1 TFLOP/s, and the FLOPs per token that
    link them to 1M: each figure bounds the tokens/s, and the interval is where all of them agree.
    A ratio of 1.35 against 638k is 1.349-1.351 from the tokens/s alone."""
    tps = row["tokens_per_sec"]
    lo, hi = tps - 500, tps + 500
    if flops := row.get("flops_per_token"):
        f_lo, f_hi = flops - 0.5e6, flops + 0.5e6
        lo, hi = max(lo, (row["tflops"] - 0.5) * 1e12 / f_hi), min(hi, (row["tflops"] + 0.5) * 1e12 / f_lo)
        if peak:
            lo = max(lo, (row["mfu_measured"] - 0.0005) * (peak - 0.5) * 1e12 / f_hi)
            hi = min(hi, (row["mfu_measured"] + 0.0005) * (peak + 0.5) * 1e12 / f_lo)
    return lo, hi


def tflops_per_gpu(o: dict) -> float:
    return o["bare_tokens_per_sec"] / o.get("world_size", 1) * o["flops_per_token"] / 1e12


def bracket_table(before: dict, peak_before: float, peak_after: float | None, rows_after: list[dict], ours: list[dict]) -> str:
    """Our rows against the reference's plain row timed before ours and again after them."""
    after = plain_row(rows_after)
    if after is None or peak_after is None:
        return "reference after: no plain row or no peak in its output"
    mean = (before["tokens_per_sec"] + after["tokens_per_sec"]) / 2
    mean_peak = (peak_before + peak_after) / 2
    lines = [f"\nreference {before['name']}: {before['tokens_per_sec']/1e3:.0f}k before ours, "
             f"{after['tokens_per_sec']/1e3:.0f}k after, mean {mean/1e3:.0f}k; matmul peak {peak_before:.0f} before, "
             f"{peak_after:.0f} after",
             "| run | tokens/s | ratio vs before | ratio vs after | ratio vs mean | MFU (mean peak) |",
             "|---|---|---|---|---|---|"]
    for o in ours:
        tps, tflops = o["bare_tokens_per_sec"], tflops_per_gpu(o)
        lines.append(f"| ours {o['name']} | {tps/1e3:.0f}k | {tps/before['tokens_per_sec']:.3f} | "
                     f"{tps/after['tokens_per_sec']:.3f} | {tps/mean:.3f} | {tflops/mean_peak:.3f} |")
    return "\n".join(lines)


def smi_summary(text: str) -> str:
    """The SM clock and power over the samples above 85% of the power limit: the training steps."""
    busy = []
    for line in text.splitlines():
        cells = [c.strip() for c in line.split(",")]
        try:
            clock, power, limit = (float(cells[i].split()[0]) for i in (1, 3, 4))
        except (IndexError, ValueError):
            continue  # a header, or a field this driver does not report
        if power > 0.85 * limit:
            busy.append((clock, power, limit, cells[-1]))
    if not busy:
        return "nvidia-smi: no sample above 85% of the power limit"
    clocks = sorted(b[0] for b in busy)
    capped = sum(b[3] not in ("0x0000000000000000", "[N/A]") for b in busy)
    return (f"nvidia-smi, {len(busy)} samples over 85% of the {busy[0][2]:.0f} W limit: SM clock "
            f"{sum(clocks) / len(clocks):.0f} MHz on average ({clocks[0]:.0f}-{clocks[-1]:.0f}), "
            f"{sum(b[1] for b in busy) / len(busy):.0f} W on average, a clock event reason set in {capped}")


if __name__ == "__main__":
    sys.exit(main())
