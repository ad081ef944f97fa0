"""Rungs at once on one GPU against one alone: the aggregate tokens/s behind `ladder plan`'s
--concurrency-gain (docs/SCALING.md).

    python3 bench/ladder_concurrency.py --data D --work W [--widths 96,288] [--jobs 1,8] [--steps 600]

A rung here is what bench/ladder_accuracy.py's ladder trains: the 50M family at one width, with the
recipe the ladder's rule gives it for the benchmark's d384 target, run by the trainer
(`python -m x1_pretrain.train`). For each width and each K in --jobs, K copies start together; each
one's tokens/s is the median of its logged intervals after its first fifth (start-up and compile
left out), and the aggregate is their sum. The gain is the aggregate over one alone.
"""

from __future__ import annotations

import argparse
import csv
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "trainer")]

from bench.ladder_accuracy import CONFIG, TARGETS, env, target_sets  # noqa: E402


def rung_sets(width: int, tokens: int) -> list[str]:
    from x1_pretrain.config import load_config
    from x1_pretrain.ladder.family import recipe, scaled_model

    target = load_config(str(REPO / CONFIG), target_sets(TARGETS["T4"][1]))
    model = scaled_model(target.model, width)
    shape = [f"model.{k}={getattr(model, k)}" for k in ("n_layer", "d_model", "n_head", "n_kv_head", "d_ff")]
    return [*target_sets(TARGETS["T4"][1]), *shape, *recipe(target, model, tokens, main_total_steps=TARGETS["T4"][0]).sets()]


def median_tokens_per_sec(run_dir: Path, steps: int) -> float | None:
    rows = list(csv.DictReader(open(run_dir / "metrics.csv")))
    values = [float(r["value"]) for r in rows if r["name"] == "tokens_per_sec" and int(r["step"]) > steps // 5]
    return statistics.median(values) if values else None


def measure(args: argparse.Namespace, width: int, jobs: int) -> dict:
    work = Path(args.work) / f"d{width}-x{jobs}"
    sets = [*rung_sets(width, args.steps * 8192), *args.set]
    procs = []
    t0 = time.monotonic()
    for i in range(jobs):
        d = work / f"r{i}"
        d.mkdir(parents=True, exist_ok=True)
        argv = [sys.executable, "-m", "x1_pretrain.train", "--config", CONFIG, *[x for s in sets for x in ("--set", s)],
                "--data-dir", args.data, "--ckpt-dir", str(d / "ckpt"), "--mlflow-uri", f"file://{(work / 'mlruns').resolve()}",
                "--total-steps", str(args.steps), "--eval-every", str(args.steps), "--ckpt-every", str(args.steps),
                "--log-every", "10", "--metrics-port", "0", "--heartbeat-file", str(d / "heartbeat.json"),
                "--run-name", f"d{width} x{jobs} #{i}", "--run-dir", str(d / "run")]
        procs.append(subprocess.Popen(argv, env=env(), cwd=REPO, stdout=open(d / "train.log", "ab"), stderr=subprocess.STDOUT))
    codes = [p.wait() for p in procs]
    each = [median_tokens_per_sec(work / f"r{i}" / "run", args.steps) for i in range(jobs)]
    done = [x for x in each if x is not None]
    row = {"width": width, "jobs": jobs, "exit_codes": codes, "tokens_per_sec_each": each,
           "aggregate_tokens_per_sec": sum(done) if len(done) == jobs else None, "wall_seconds": time.monotonic() - t0}
    print(json.dumps(row), flush=True)
    return row


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", required=True, help="the tokenized corpus")
    p.add_argument("--work", required=True, help="where the runs and concurrency.json go")
    p.add_argument("--widths", default="96,288")
    p.add_argument("--jobs", default="1,8", help="rungs at once, each value a measurement (1 first: the baseline)")
    p.add_argument("--steps", type=int, default=600)
    p.add_argument("--set", action="append", default=[], help="more config overrides (a CPU smoke run: train.device=cpu)")
    args = p.parse_args()
    rows = [measure(args, int(w), int(k)) for w in args.widths.split(",") for k in args.jobs.split(",")]
    print("| width | rungs at once | tokens/s each (median) | aggregate tokens/s | over one alone |")
    print("|---|---|---|---|---|")
    for r in rows:
        alone = next((x["aggregate_tokens_per_sec"] for x in rows if x["width"] == r["width"] and x["jobs"] == 1), None)
        each = [x for x in r["tokens_per_sec_each"] if x is not None]
        agg = r["aggregate_tokens_per_sec"]
        gain = f"{agg / alone:.2f}x" if agg and alone else "—"
        print(f"| {r['width']} | {r['jobs']} | {min(each, default=0) / 1e6:.2f}-{max(each, default=0) / 1e6:.2f}M | "
              f"{(agg or 0) / 1e6:.2f}M | {gain} |")
    (Path(args.work) / "concurrency.json").write_text(json.dumps(rows, indent=2))
    return 0 if all(not any(r["exit_codes"]) for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
