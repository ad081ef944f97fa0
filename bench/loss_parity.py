"""Loss parity of a training lever against the same run without it, on real text.

    python bench/loss_parity.py --data-dir DATA --out DIR [--config configs/x1-50m-h200.yaml]
        [--steps 300] [--tokens-per-step 65536] [--tolerance 0.01] [--set ...]
        [--recipe tensorwise | --baseline SECTION.FIELD=VALUE ... --candidate SECTION.FIELD=VALUE ...]

Trains the config twice with `python -m x1_pretrain.train`, the trainer users run, from the same
seed over the same batches, for --steps optimizer steps of --tokens-per-step tokens (a short
cosine with a tenth of it as warmup): once with the --baseline overrides, once with the
--candidate ones. Without them it compares float8 training (`train.float8=RECIPE`) with the same
run in bf16; `--baseline train.kernels=torch --candidate train.kernels=triton`, say, compares our
kernels with PyTorch's plain ops. Then compares

  val loss    — the final eval on the fixed validation windows, and
  train loss  — the mean of the logged train losses over the last tenth of the steps;

both must differ by no more than --tolerance (relative) for the verdict to be PASS. Writes
parity.json, parity.png (both loss curves and their relative difference) and each run's log,
checkpoints and MLflow store under --out. Exit 0 PASS, 1 FAIL, 2 bad input or a run that failed.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "trainer")]


def relative(a: float, b: float) -> float:
    return abs(a - b) / abs(b)


def verdict(base: dict, candidate: dict, tolerance: float) -> dict:
    """Both final losses of the candidate run against the baseline's: their relative differences and PASS / FAIL."""
    val = relative(candidate["final_val_loss"], base["final_val_loss"])
    train = relative(candidate["tail_train_loss"], base["tail_train_loss"])
    return {"val_loss_rel_diff": val, "train_loss_rel_diff": train, "tolerance": tolerance,
            "verdict": "PASS" if max(val, train) <= tolerance else "FAIL"}


class Run:
    """One start of the trainer, writing under OUT/NAME; `result()` waits for it and reads back
    its losses and throughput as MLflow recorded them."""

    def __init__(self, name: str, args: argparse.Namespace, sets: list[str]):
        self.name, self.sets, self.steps, self.log_every = name, sets, args.steps, args.log_every
        self.work = args.out / name
        self.uri = f"file://{self.work.resolve()}/mlruns"
        cmd = [sys.executable, "-m", "x1_pretrain.train", "--config", str(args.config), "--data-dir", str(args.data_dir),
               "--ckpt-dir", str(self.work / "ckpt"), "--mlflow-uri", self.uri, "--total-steps", str(args.steps),
               "--log-every", str(args.log_every), "--eval-every", str(args.steps), "--ckpt-every", str(args.steps),
               "--metrics-port", "0", "--heartbeat-file", str(self.work / "heartbeat.json"), "--run-name", f"parity-{name}",
               "--set", f"train.tokens_per_step={args.tokens_per_step}",
               "--set", f"optim.warmup_steps={max(args.steps // 10, 1)}"]
        for s in [*args.set, *sets]:
            cmd += ["--set", s]
        self.work.mkdir(parents=True, exist_ok=True)
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), str(REPO / "trainer"), os.environ.get("PYTHONPATH", "")]))
        print(f"{name}: training {args.steps} steps ({' '.join(sets)}), log in {self.work / 'train.log'}", flush=True)
        self.t0, self.wall = time.perf_counter(), None
        with open(self.work / "train.log", "w") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=REPO)

    def wait(self) -> int:
        if self.wall is None:
            self.proc.wait()
            self.wall = round(time.perf_counter() - self.t0, 1)
        return self.proc.returncode

    def result(self) -> dict:
        from x1_pretrain.run.record import load_run

        if (rc := self.wait()) != 0:
            tail = (self.work / "train.log").read_text().splitlines()[-15:]
            raise RunFailed(f"{self.name}: the trainer exited {rc}:\n" + "\n".join(tail))
        record = load_run(self.uri)
        losses = record.get("loss")
        tail = [v for s, v in losses if s > self.steps - max(self.steps // 10, self.log_every)]
        tps = [v for _, v in record.get("tokens_per_sec")[1:]]  # the first interval holds the compile
        return {"name": self.name, "sets": self.sets, "loss": losses, "final_val_loss": record.last("val_loss")[1],
                "tail_train_loss": statistics.fmean(tail), "tokens_per_sec": statistics.median(tps) if tps else None,
                "wall_s": self.wall}

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


class RunFailed(RuntimeError):
    pass


def plot(base: dict, candidate: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 6), sharex=True, height_ratios=[3, 1])
    for run in (base, candidate):
        top.plot(*zip(*run["loss"], strict=True), label=f"{run['name']} (val {run['final_val_loss']:.4f})")
    top.set_ylabel("train loss")
    top.legend()
    top.set_title(f"{candidate['name']} vs {base['name']}")
    b, f = dict(base["loss"]), dict(candidate["loss"])
    steps = sorted(set(b) & set(f))
    bottom.plot(steps, [100 * (f[s] - b[s]) / b[s] for s in steps], color="tab:red")
    bottom.axhline(0, color="grey", lw=0.5)
    bottom.set_ylabel("difference %")
    bottom.set_xlabel("optimizer step")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", type=Path, default=REPO / "configs/x1-50m-h200.yaml")
    p.add_argument("--data-dir", type=Path, required=True, help="tokenized data: train.bin, val.bin, meta.json")
    p.add_argument("--out", type=Path, required=True, help="folder for both runs, parity.json and parity.png")
    p.add_argument("--steps", type=int, default=300, help="optimizer steps of each run (300)")
    p.add_argument("--tokens-per-step", type=int, default=65536, help="tokens per optimizer step (65536)")
    p.add_argument("--recipe", choices=["tensorwise", "rowwise"], default="tensorwise",
                   help="float8 recipe of the candidate when neither --baseline nor --candidate is given")
    p.add_argument("--baseline", action="append", default=[], metavar="SECTION.FIELD=VALUE",
                   help="overrides of the baseline run (default: train.float8=off)")
    p.add_argument("--candidate", action="append", default=[], metavar="SECTION.FIELD=VALUE",
                   help="overrides of the candidate run (default: train.float8=RECIPE)")
    p.add_argument("--tolerance", type=float, default=0.01, help="largest relative difference of a final loss (0.01)")
    p.add_argument("--log-every", type=int, default=5, help="steps between logged train losses (5)")
    p.add_argument("--set", action="append", default=[], metavar="SECTION.FIELD=VALUE", help="for both runs")
    p.add_argument("--together", action="store_true",
                   help="run both at once on the one GPU: the compiles overlap (minutes saved); no tokens/s reported")
    args = p.parse_args(argv)
    problems = [f"--{k.replace('_', '-')} must be positive" for k in ("steps", "tokens_per_step", "log_every")
                if getattr(args, k) < 1]
    problems += [f"--data-dir {args.data_dir}: no {f}" for f in ("train.bin", "val.bin", "meta.json")
                 if not (args.data_dir / f).is_file()]
    problems += [f"--config {args.config}: no such file"] if not args.config.is_file() else []
    problems += [f"--out {args.out}: already holds parity.json"] if (args.out / "parity.json").exists() else []
    if problems:
        print("error: " + "; ".join(problems), file=sys.stderr)
        return 2
    runs: list[Run] = []
    try:
        if args.baseline or args.candidate:
            pairs = (("baseline", args.baseline), ("candidate", args.candidate))
        else:
            pairs = (("baseline", ["train.float8=off"]), (f"float8-{args.recipe}", [f"train.float8={args.recipe}"]))
        for name, sets in pairs:
            runs.append(Run(name, args, sets))
            if not args.together and runs[-1].wait() != 0:
                runs[-1].result()  # raises RunFailed with the end of its log
        base, candidate = (run.result() for run in runs)
    except RunFailed as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    finally:
        for run in runs:
            run.kill()
    if args.together:  # two processes shared the GPU: their tokens/s say nothing about the lever
        base["tokens_per_sec"] = candidate["tokens_per_sec"] = None
    result = {"config": str(args.config), "steps": args.steps, "tokens_per_step": args.tokens_per_step,
              "baseline": base, "candidate": candidate, **verdict(base, candidate, args.tolerance)}
    (args.out / "parity.json").write_text(json.dumps(result, indent=1))
    plot(base, candidate, args.out / "parity.png")
    tps = {r["name"]: f"{r['tokens_per_sec']:,.0f}" if r["tokens_per_sec"] else "" for r in (base, candidate)}
    print(f"\n{args.steps} steps x {args.tokens_per_step} tokens, {args.config.name}")
    print("| run | final val loss | train loss, last tenth | tokens/s | wall s |\n|---|---|---|---|---|")
    for r in (base, candidate):
        print(f"| {r['name']} | {r['final_val_loss']:.4f} | {r['tail_train_loss']:.4f} | {tps[r['name']]} | {r['wall_s']} |")
    print(f"relative difference: val {result['val_loss_rel_diff'] * 100:.2f}%, train {result['train_loss_rel_diff'] * 100:.2f}% "
          f"(tolerance {args.tolerance * 100:g}%): {result['verdict']}")
    return 0 if result["verdict"] == "PASS" else 1


if __name__ == "__main__":
    sys.exit(main())
