"""How well does a scaling ladder predict runs it never saw? The GPU benchmark of docs/SCALING.md.

    python3 bench/ladder_accuracy.py corpus  --data D                  # real text, tokenized
    python3 bench/ladder_accuracy.py ladder  --data D --work W         # plan (4.5% of the targets' compute), run, fit
    python3 bench/ladder_accuracy.py targets --data D --work W --names T1,T2 [--probes 0.025,0.05,0.1]  # or U1-U6 (FRESH)
    python3 bench/ladder_accuracy.py table   --work W                  # predicted [interval] vs actual

The targets are the lab's model family (configs/x1-50m-a100.yaml: RMSNorm, SwiGLU, RoPE, tied
embedding, 3 query heads per key/value head, width 96 per layer) at the width that fits a device
call: d_model 384, 4 layers, 25.6M parameters (6.3M without the embedding), 12,288 tokens a step,
lr 1e-3 (AdamW beta2 0.99, as the ladder's rule gives small batches), 4,000 to 9,000 steps with
warm-ups of 150 to 450: four held-out runs, each larger in N and D than every rung, trained by
the trainer; and a fifth (T5, 2,500 steps) started with `--ladder` once the ladder is fitted: its
band and its forecast's prior come from the ladder live (the others' forecasts with the ladder are
replayed from their curves). The ladder: widths 144, 192, 288 and 336 (2-4 layers: no rung too
shallow to copy from its context, as code rewards), every size on
the same three token budgets (a full grid), planned with `--max-flops` so that its rungs, the
learning-rate check included, add up to 4.5% of T1-T4's training compute (under the 5% it may
cost; T5 only lowers the share). The corpus is every distinct .py file of the machine's Python
(standard library and site-packages, `python -m x1_pretrain.corpus installed-source`): real text,
code and docstrings, no download.

Everything a step writes goes under --work; `table` prints the accuracy table and writes
W/accuracy.json. Several steps can run in one device call (bench/ladder_device_call.sh).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "trainer")]

CONFIG = "configs/x1-50m-a100.yaml"
TOKENS_PER_STEP = 12288
# The 50M config's family at d_model 384 (width 96 per layer, 3 query heads per kv head, d_ff 8/3).
MODEL_SETS = ["model.d_model=384", "model.n_layer=4", "model.n_head=6", "model.n_kv_head=2", "model.d_ff=1024"]
COMMON_SETS = [*MODEL_SETS, f"train.tokens_per_step={TOKENS_PER_STEP}", "train.micro_batch_size=12",
               "optim.lr=1e-3", "optim.min_lr=1e-4", "optim.beta2=0.99"]
# name -> (steps, warm-up). T1c is T1 without cooldown probes: the probes' effect on the GPU run.
# T5 starts once the ladder is fitted, with `--ladder`: the run that shows the declared band and the
# forecast with the ladder's prior live; the ladder's compute is sized on T1-T4 alone.
TARGETS = {"T1": (4000, 150), "T2": (5500, 250), "T3": (7000, 350), "T4": (9000, 450), "T5": (2500, 100)}
# A second held-out set of the same family, for the forecast (docs/FORECAST.md): other lengths and
# warm-ups, another seed (init and data order). None of it is among the runs a forecast method was
# chosen on; T1-T5's complete curves serve as the family's earlier runs.
FRESH = {"U1": (2000, 50), "U2": (3000, 200), "U3": (4500, 100), "U4": (6000, 300), "U5": (7500, 250),
         "U6": (6500, 500)}
FRESH_SEED = 7
SIZED_ON = ("T1", "T2", "T3", "T4")
CONTROLS = {"T1c": "T1"}
LADDER_SHARE_OF_TARGETS = 0.045  # of the targets' training compute (the goal: at most 5%)
LADDER_WIDTHS = "144,192,288,336"  # 4 sizes below 384: 2, 2, 3 and 4 layers (no 1-layer rung)


def env() -> dict[str, str]:
    paths = [str(REPO), str(REPO / "trainer"), *filter(None, [os.environ.get("PYTHONPATH")])]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(paths), "PYTHONUNBUFFERED": "1"}


def sh(argv: list[str], log: Path | None = None) -> tuple[int, float]:
    t = time.monotonic()
    print("$ " + " ".join(argv), flush=True)
    if log is None:
        rc = subprocess.run(argv, env=env(), cwd=REPO).returncode
    else:
        log.parent.mkdir(parents=True, exist_ok=True)
        with open(log, "ab") as f:
            rc = subprocess.run(argv, env=env(), cwd=REPO, stdout=f, stderr=subprocess.STDOUT).returncode
    took = time.monotonic() - t
    print(f"  exit {rc} in {took:.1f} s", flush=True)
    return rc, took


def cmd_corpus(args: argparse.Namespace) -> int:
    src = Path(args.data).with_name(Path(args.data).name + "-src")
    rc, t1 = sh([sys.executable, "-m", "x1_pretrain.corpus", "installed-source", "--output", str(src),
                 "--max-mb", str(args.max_mb), "--file-mb", "32"])
    if rc:
        return rc
    rc, t2 = sh([sys.executable, "-m", "x1_pretrain.tokenize_data", "--input-dir", str(src), "--output-dir", args.data,
                 "--tokenizer", "gpt2", "--val-fraction", "0.002", "--workers", str(os.cpu_count() or 4), "--seed", "42"])
    meta = json.loads((Path(args.data) / "meta.json").read_text())
    print(f"corpus: {meta['train_tokens']:,} train tokens, {meta['val_tokens']:,} val tokens, {meta['documents']:,} "
          f"documents ({t1:.0f} s to collect, {t2:.0f} s to tokenize)")
    return rc


def target_sets(warmup: int, extra: list[str] | None = None) -> list[str]:
    return [*COMMON_SETS, f"optim.warmup_steps={warmup}", *(extra or [])]


def recipe(name: str) -> tuple[int, int, list[str]]:
    """(steps, warm-up, its own config overrides) of a target, a control or a run of the fresh set."""
    if name in FRESH:
        return (*FRESH[name], [f"train.seed={FRESH_SEED}"])
    return (*TARGETS[CONTROLS.get(name, name)], [])


def targets_compute() -> float:
    from x1_pretrain.config import load_config
    from x1_pretrain.train.accounting import flops_per_token

    fpt = flops_per_token(load_config(str(REPO / CONFIG), COMMON_SETS).model)
    return sum(TARGETS[name][0] for name in SIZED_ON) * TOKENS_PER_STEP * fpt


def cmd_ladder(args: argparse.Namespace) -> int:
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    folder = work / "ladder"
    steps, warmup = TARGETS["T4"]  # the largest target: the rungs' recipe is scaled from it
    sets = [x for s in target_sets(warmup, args.set) for x in ("--set", s)]
    flops = LADDER_SHARE_OF_TARGETS * targets_compute() * args.scale
    argv = [sys.executable, "-m", "x1_pretrain.ladder", "run", "--dir", str(folder), "--config", CONFIG, *sets,
            "--data-dir", args.data, "--gpu", args.gpu, "--price-usd-per-hr", str(args.price), "--total-steps", str(steps),
            "--max-flops", f"{flops:.6g}", "--jobs", str(args.jobs), "--mlflow-uri", f"file://{(work / 'mlruns').resolve()}",
            "--widths", args.widths, "--budgets-by", args.budgets_by]
    if args.sizes:
        argv += ["--sizes", str(args.sizes)]
    if args.budgets:
        argv += ["--budgets", str(args.budgets)]
    rc, took = sh(argv)
    (work / "ladder-seconds.txt").write_text(f"{took:.1f}\n")
    return rc


def cmd_targets(args: argparse.Namespace) -> int:
    work = Path(args.work)
    procs = []
    for name in args.names.split(","):
        steps, warmup, own = recipe(name)
        if args.steps:
            steps, warmup = args.steps, args.warmup
        d = work / "targets" / name
        sets = target_sets(warmup, [*own, *args.set])
        if args.probes and name not in CONTROLS:
            sets.append(f"train.cooldown_probes=[{args.probes}]")
        argv = [sys.executable, "-m", "x1_pretrain.train", "--config", CONFIG, *[x for s in sets for x in ("--set", s)],
                "--data-dir", args.data, "--ckpt-dir", str(d / "ckpt"), "--mlflow-uri", f"file://{(work / 'mlruns').resolve()}",
                "--total-steps", str(steps), "--eval-every", str(max(10, steps // 40)), "--ckpt-every", str(steps // 2),
                "--log-every", "10", "--metrics-port", "0", "--heartbeat-file", str(d / "heartbeat.json"),
                "--run-name", f"target {name}", "--run-dir", str(d / "run")]
        if args.ladder:
            argv += ["--ladder", args.ladder]
        d.mkdir(parents=True, exist_ok=True)
        print("$ " + " ".join(argv), flush=True)
        procs.append((name, time.monotonic(), subprocess.Popen(argv, env=env(), cwd=REPO, stdout=open(d / "train.log", "ab"),
                                                             stderr=subprocess.STDOUT)))
    worst = 0
    for name, t0, p in procs:
        rc = p.wait()
        print(f"target {name}: exit {rc} in {time.monotonic() - t0:.0f} s", flush=True)
        worst = worst or rc
    return worst


def final_val(ckpt: Path, steps: int) -> float | None:
    """The val loss at the run's last step; None for a run stopped short of it (the call's deadline)."""
    latest = (ckpt / "latest").read_text().strip()
    state = json.loads((ckpt / latest / "trainer_state.json").read_text())
    val = ((state.get("forecast") or {}).get("curve") or {}).get("val") or []
    return val[-1][1] if val and val[-1][0] == steps else None


def cmd_table(args: argparse.Namespace) -> int:
    from x1_common.scaling import load_ladder, predict
    from x1_pretrain.config import load_config
    from x1_pretrain.train.accounting import flops_per_token, param_counts

    work = Path(args.work)
    ladder = load_ladder(work / "ladder" / "ladder.json")
    rungs = ladder["rungs"]
    ladder_flops = sum(r["flops_per_token"] * r["tokens"] for r in rungs) + sum(
        r["flops_per_token"] * r["tokens"] for r in ladder.get("lr_sweep", []))
    largest_rung = max(r["flops_per_token"] * r["tokens"] for r in rungs)
    rows, total_flops = [], 0.0
    for name, (steps, warmup) in TARGETS.items():
        ckpt = work / "targets" / name / "ckpt"
        if not (ckpt / "latest").exists():
            continue
        cfg = load_config(CONFIG, target_sets(warmup))
        counts = param_counts(cfg.model)
        fpt = flops_per_token(cfg.model)
        tokens = steps * TOKENS_PER_STEP
        p = predict(ladder, counts["total"], tokens, counts["non_embedding"], fpt)
        actual = final_val(ckpt, steps)
        if actual is None:
            print(f"{name}: stopped before its step {steps}: left out")
            continue
        total_flops += fpt * tokens
        rows.append({"target": name, "steps": steps, "warmup": warmup, "n_params": counts["total"], "tokens": tokens,
                     "compute_over_largest_rung": fpt * tokens / largest_rung, "predicted": p.val_loss, "low": p.low,
                     "high": p.high, "tolerance": p.tolerance, "actual": actual,
                     "error": None if actual is None else p.val_loss - actual,
                     "covered": None if actual is None else p.low <= actual <= p.high})
    out = {"rungs": len(rungs), "ladder_flops": ladder_flops, "targets_flops": total_flops,
           "ladder_share_of_targets": ladder_flops / total_flops if total_flops else None,
           "n_convention": ladder["fit"]["n_convention"], "conventions": ladder.get("conventions"),
           "tolerance": ladder["tolerance"], "fit": {k: ladder["fit"][k] for k in ("E", "A", "B", "alpha", "beta")},
           "targets": rows}
    (work / "accuracy.json").write_text(json.dumps(out, indent=2))
    print("| target | steps | warm-up | tokens | compute / largest rung | predicted [interval] | actual | error | covered |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        actual = "—" if r["actual"] is None else f"{r['actual']:.4f}"
        err = "—" if r["error"] is None else f"{r['error']:+.4f}"
        print(f"| {r['target']} | {r['steps']} | {r['warmup']} | {r['tokens'] / 1e6:.1f}M | {r['compute_over_largest_rung']:.1f}x "
              f"| {r['predicted']:.4f} [{r['low']:.4f}, {r['high']:.4f}] | {actual} | {err} | {r['covered']} |")
    if total_flops:
        print(f"ladder: {len(rungs)} rungs (+{len(ladder.get('lr_sweep', []))} lr check), {ladder_flops:.3g} FLOPs = "
              f"{ladder_flops / total_flops:.1%} of these targets' {total_flops:.3g}; N convention {out['n_convention']}")
    return 0


def cmd_curves(args: argparse.Namespace) -> int:
    """The targets' curves (their run folders' metrics.csv) as a forecast curves file, for
    `python -m x1_pretrain.forecast evaluate` (with and without the probes and the ladder)."""
    import csv
    import math

    from x1_pretrain.config import load_config
    from x1_pretrain.train.accounting import flops_per_token, param_counts

    work = Path(args.work)
    runs = []
    for name in args.names.split(","):
        steps, warmup, _ = recipe(name)
        rows = list(csv.DictReader(open(work / "targets" / name / "run" / "metrics.csv")))
        series: dict[str, dict[int, float]] = {}
        for r in rows:
            series.setdefault(r["name"], {})[int(r["step"])] = float(r["value"])
        last = max(series.get("val_loss", {0: 0}))
        if last != steps:
            print(f"{name}: its last eval is at step {last} of {steps}: left out (not a complete run)")
            continue
        train = [series.get("loss", {}).get(s, math.nan) for s in range(1, steps + 1)]
        cfg = load_config(CONFIG, target_sets(warmup))
        counts = param_counts(cfg.model)
        probes = [{"step": s, "steps": int(series["probe_steps"][s]), "val_loss": v}
                  for s, v in sorted(series.get("probe_val_loss", {}).items())]
        val = sorted(series["val_loss"].items())
        runs.append({"name": name, "steps": steps, "warmup": warmup, "lr": cfg.optim.lr, "min_lr": cfg.optim.min_lr,
                     "train_loss": train, "val_steps": [s for s, _ in val], "val_loss": [v for _, v in val],
                     "probes": probes, "tokens_per_step": TOKENS_PER_STEP, "n_params": counts["total"],
                     "nonembedding_params": counts["non_embedding"], "flops_per_token": flops_per_token(cfg.model)})
    out = {"made": "bench/ladder_accuracy.py curves", "device": args.device, "model": CONFIG,
           "tokens_per_step": TOKENS_PER_STEP, "runs": runs}
    Path(args.out).write_text(json.dumps(out))
    print(f"{len(runs)} runs written to {args.out}")
    return 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("corpus")
    s.add_argument("--data", required=True)
    s.add_argument("--max-mb", type=float, default=900)
    s.set_defaults(func=cmd_corpus)
    s = sub.add_parser("ladder")
    s.add_argument("--data", required=True)
    s.add_argument("--work", required=True)
    s.add_argument("--gpu", default="h200")
    s.add_argument("--price", type=float, default=3.0)
    s.add_argument("--jobs", type=int, default=4)
    s.add_argument("--scale", type=float, default=1.0, help="the ladder's compute times this (a smoke run: 0.1)")
    s.add_argument("--sizes", type=int)
    s.add_argument("--budgets", type=int)
    s.add_argument("--widths", default=LADDER_WIDTHS)
    s.add_argument("--budgets-by", default="tokens", choices=("params", "tokens", "flops"))
    s.add_argument("--set", action="append", default=[], help="more config overrides (a CPU smoke run: train.device=cpu)")
    s.set_defaults(func=cmd_ladder)
    s = sub.add_parser("targets")
    s.add_argument("--data", required=True)
    s.add_argument("--work", required=True)
    s.add_argument("--names", default="T1,T2,T3,T4,T5")
    s.add_argument("--ladder")
    s.add_argument("--probes", help="cooldown probes, shares of the run (train.cooldown_probes)")
    s.add_argument("--steps", type=int, help="a smoke run: this many steps instead of the target's")
    s.add_argument("--warmup", type=int, default=20)
    s.add_argument("--set", action="append", default=[], help="more config overrides (a CPU smoke run: train.device=cpu)")
    s.set_defaults(func=cmd_targets)
    s = sub.add_parser("table")
    s.add_argument("--work", required=True)
    s.set_defaults(func=cmd_table)
    s = sub.add_parser("curves")
    s.add_argument("--work", required=True)
    s.add_argument("--names", default="T1,T2,T3,T4,T5")
    s.add_argument("--out", required=True)
    s.add_argument("--device", default="")
    s.set_defaults(func=cmd_curves)
    args = p.parse_args()
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
