"""`python -m x1_pretrain.ladder plan|run|fit|predict|report`: the scaling ladder's commands.

    ladder plan    --config C --data-dir D --gpu G --provider P --price-usd-per-hr X [--out DIR]
    ladder run     [--dir DIR] [the plan's flags, when DIR has no plan.json yet] [--mlflow-uri U] [budget flags]
    ladder fit     RUNGS.json [--out DIR] [--target-params N --target-tokens D]
    ladder predict --ladder FILE --params N --tokens D [--nonembedding-params N]
    ladder report  --ladder FILE [--out DIR]

Exit codes: 0 done; 2 bad input (named); 78 the ladder would take the run over its cap (nothing
started); `run` also 75 (stopped by a signal: run it again to continue), 76/77 (budget), 1 (a rung
crashed). docs/SCALING.md says what each step does and what was measured.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import sys
from pathlib import Path
from typing import Any

from x1_common.contracts import ExitCode, read_budget_file, read_json_file
from x1_common.fsutil import write_json_atomic
from x1_common.scaling import LadderFileError, load_ladder, predict
from x1_pretrain.config import ConfigError, load_config
from x1_pretrain.ladder.family import model_family
from x1_pretrain.ladder.fit import BOOTSTRAP_SAMPLES, RungsError, make_ladder
from x1_pretrain.ladder.plan import (
    DEFAULT_BUDGETS,
    DEFAULT_SHARE,
    DEFAULT_SIZES,
    LadderPlan,
    LadderPlanError,
    LadderRefused,
    make_ladder_plan,
    render,
)
from x1_pretrain.ladder.report import write_report
from x1_pretrain.ladder.run import PLAN_FILE, RUN_FILE, RUNGS_FILE, Settings, read_rungs, run, rung_dir, rung_step
from x1_pretrain.train.accounting import GPU_PEAK_TFLOPS, detect_gpu_key
from x1_pretrain.train.parser import build_parser as trainer_parser
from x1_pretrain.train.parser import config_from_args
from x1_pretrain.train.provenance import corpus_identity

log = logging.getLogger("x1.ladder")
DEFAULT_DIR = "/workspace/ladder"
LADDER_FILE = "ladder.json"


class UsageError(ValueError):
    pass


# ---------------------------------------------------------------------------------------------
# The corpus and the provenance


def read_meta(data_dir: str) -> dict[str, Any]:
    path = Path(data_dir) / "meta.json"
    try:
        meta = read_json_file(path)
    except FileNotFoundError:
        raise UsageError(f"--data-dir {data_dir}: no meta.json (tokenize the corpus first: python -m "
                         "x1_pretrain.tokenize_data)") from None
    except (OSError, ValueError) as e:
        raise UsageError(f"{path}: {e}") from None
    if not isinstance(meta, dict):
        raise UsageError(f"{path}: not a JSON object")
    return meta


def provenance(cfg: Any, data_dir: str) -> dict[str, Any]:
    """What the ladder shares with its run (x1_common.scaling.PROVENANCE_KEYS)."""
    meta = read_meta(data_dir)
    return {"corpus": corpus_identity(data_dir, meta)["fingerprint"], "tokenizer": meta.get("tokenizer", "unknown"),
            "vocab_size": cfg.model.vocab_size, "seq_len": cfg.model.seq_len, "model_family": model_family(cfg.model),
            "corpus_train_tokens": meta.get("train_tokens")}


# ---------------------------------------------------------------------------------------------
# plan


def add_plan_flags(p: argparse.ArgumentParser, required: bool) -> None:
    g = p.add_argument_group("the plan (what `ladder plan` takes)")
    g.add_argument("--config", required=required, help="the main run's config (the rungs are its model, smaller)")
    g.add_argument("--set", action="append", default=[], metavar="SECTION.FIELD=VALUE",
                   help="override a config field, as the trainer's --set (repeatable); the rungs get it too")
    g.add_argument("--data-dir", required=required, help="the tokenized corpus (train.bin, val.bin, meta.json)")
    g.add_argument("--gpu", default="a100-80gb", choices=sorted(k for k, v in GPU_PEAK_TFLOPS.items() if v > 0),
                   help="the GPU the rungs and the main run train on (default a100-80gb)")
    g.add_argument("--provider", default="lambda", choices=("lambda", "runpod", "static"))
    g.add_argument("--price-usd-per-hr", type=float, default=1.10, help="$/h of the instance (default 1.10)")
    g.add_argument("--budget-usd", type=float, default=35.0, help="the run's cap, ladder included (default 35)")
    g.add_argument("--hours", type=float, default=24.0, help="the rental the main run is planned for (default 24)")
    g.add_argument("--total-steps", type=int, help="the main run's steps (default: what plan proposes for the money)")
    g.add_argument("--share", type=float, default=DEFAULT_SHARE,
                   help=f"the ladder's GPU time as a share of the main run's (default {DEFAULT_SHARE})")
    g.add_argument("--sizes", type=int, default=DEFAULT_SIZES, help=f"model sizes (default {DEFAULT_SIZES})")
    g.add_argument("--budgets", type=int, default=DEFAULT_BUDGETS,
                   help=f"token budgets per size, each 2x the last (default {DEFAULT_BUDGETS})")
    g.add_argument("--no-lr-sweep", action="store_true", help="skip the learning-rate check on the smallest size")
    g.add_argument("--jobs", type=int, default=None, help="rungs trained at once (default 4 on a GPU, 2 on a CPU)")
    g.add_argument("--concurrency-gain", type=float, default=None,
                   help="aggregate tokens/s of --jobs rungs at once over one alone (default: the GPU's figure, "
                        "docs/SCALING.md; 1 on a CPU)")
    g.add_argument("--tokens-per-sec", type=float, help="the main run's tokens/s, where plan has no figure")
    g.add_argument("--smallest-width", type=int, help="the narrowest rung's d_model (default: an eighth of the target's)")
    g.add_argument("--tokens-per-param", type=float,
                   help="each size's smallest budget in tokens per parameter, instead of what the share buys")
    g.add_argument("--max-flops", type=float,
                   help="the rungs' training compute in all (FLOPs), instead of what the share buys")
    g.add_argument("--widths", type=widths_list, metavar="W,W,...",
                   help="the sizes by d_model (e.g. 96,144,192,288), instead of --sizes of the default widths; "
                        "each gets the target's width/depth, its head dim a power of two")
    g.add_argument("--budgets-by", choices=("params", "tokens", "flops"), default="params",
                   help="params (default): each size's budgets are multiples of its parameter count; tokens: every "
                        "size trains on the same token budgets (a full grid, small sizes as long as large ones); "
                        "flops: every size at the same compute budgets (iso-FLOP, the smallest size longest)")
    g.add_argument("--budget-step", type=float, default=2.0, help="each token budget over the last (default 2)")


def widths_list(text: str) -> list[int]:
    try:
        widths = [int(w) for w in text.split(",") if w.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: whole numbers separated by commas, like 96,144,192,288") from None
    if len(widths) < 2 or min(widths) <= 0:
        raise argparse.ArgumentTypeError(f"{text!r}: at least two positive widths")
    return widths


# Aggregate tokens/s of several rungs at once over one alone: small models leave most of a big GPU
# idle, so several at once cost little more time than one. On an H100, 8 rungs at once gave 2.98x
# (d144) and 1.69x (d336) at 8-10 windows a step (docs/SCALING.md, bench/ladder_concurrency.py);
# 2.0 lies between, an estimate for other sizes and batches; the A100's is not measured. rungs.json
# records what ran.
CONCURRENCY_GAIN = {"h200": 2.0, "h100-sxm": 2.0, "h100-pcie": 2.0, "a100-80gb": 1.6, "a100-40gb": 1.6}


def plan_from_args(args: argparse.Namespace) -> tuple[LadderPlan, dict[str, Any]]:
    try:
        cfg = load_config(args.config, args.set)
    except (ConfigError, OSError) as e:
        raise UsageError(str(e)) from None
    prov = provenance(cfg, args.data_dir)
    on_cpu = cfg.train.device == "cpu"
    jobs = args.jobs or (2 if on_cpu else 4)
    gain = args.concurrency_gain or (1.0 if on_cpu or jobs == 1 else CONCURRENCY_GAIN.get(args.gpu, 1.0))
    try:
        plan = make_ladder_plan(cfg, gpu=args.gpu, provider=args.provider, price_usd_per_hr=args.price_usd_per_hr,
                                cap_usd=args.budget_usd, hours=args.hours, main_total_steps=args.total_steps,
                                share=args.share, sizes=args.sizes, budgets=args.budgets,
                                lr_sweep=not args.no_lr_sweep, jobs=jobs, concurrency_gain=gain,
                                corpus_train_tokens=prov.get("corpus_train_tokens"),
                                tokens_per_sec=args.tokens_per_sec, smallest_width=args.smallest_width,
                                tokens_per_param=args.tokens_per_param, max_flops=args.max_flops,
                                widths=args.widths, budgets_by=args.budgets_by, budget_step=args.budget_step)
    except (ConfigError, ValueError) as e:
        if isinstance(e, LadderRefused):
            raise
        raise UsageError(str(e)) from None
    extra = {"config": str(args.config), "sets": list(args.set), "data_dir": str(args.data_dir), "provenance": prov}
    return plan, extra


def write_plan(folder: Path, plan: LadderPlan, extra: dict[str, Any]) -> None:
    write_json_atomic(folder / PLAN_FILE, {**plan.to_json(), "inputs": extra})


def load_plan(folder: Path) -> tuple[LadderPlan, dict[str, Any]]:
    data = read_json_file(folder / PLAN_FILE)
    extra = data.pop("inputs")
    return LadderPlan.from_json(data), extra


def plan_once(folder: Path, args: argparse.Namespace) -> tuple[LadderPlan, dict[str, Any]] | int:
    """DIR's plan, made (said, and written) from `args` when DIR has none yet; 78 when refused."""
    if (folder / PLAN_FILE).exists():
        return load_plan(folder)
    plan, extra = plan_from_args(args)
    print(render(plan))
    if plan.verdict != "go":
        return int(ExitCode.LAUNCH_REFUSED)
    write_plan(folder, plan, extra)
    return plan, extra


def cmd_plan(args: argparse.Namespace) -> int:
    plan, extra = plan_from_args(args)
    print(render(plan))
    if plan.verdict != "go":
        return int(ExitCode.LAUNCH_REFUSED)
    out = Path(args.out)
    if (out / PLAN_FILE).exists() and read_rungs(out):
        raise UsageError(f"{out} already holds a ladder with finished rungs ({out / RUNGS_FILE}); plan into another "
                         "folder, or `ladder run --dir` it to continue")
    write_plan(out, plan, extra)
    print(f"plan written to {out / PLAN_FILE}")
    return 0


# ---------------------------------------------------------------------------------------------
# run


def cmd_run(args: argparse.Namespace) -> int:
    folder = Path(args.dir)
    if not (folder / PLAN_FILE).exists() and not (args.config and args.data_dir):
        raise UsageError(f"{folder}: no {PLAN_FILE}; give the plan's flags (--config, --data-dir, --gpu, ...) or "
                         "run `ladder plan --out DIR` first")
    planned = plan_once(folder, args)
    if isinstance(planned, int):
        return planned
    plan, extra = planned
    if args.jobs:
        plan.jobs = args.jobs
    settings = Settings(folder=folder, config=extra["config"], sets=extra["sets"], data_dir=extra["data_dir"],
                        mlflow_uri=args.mlflow_uri or f"file://{(folder / 'mlruns').resolve()}", jobs=plan.jobs,
                        cap_usd=args.budget_cap_usd, cost_uri=args.budget_curr_cost_uri, alert_usd=args.budget_alert_usd)
    return run(plan, settings, fit=None if args.no_fit else fit_folder)


def cmd_status(args: argparse.Namespace) -> int:
    """Where the ladder in DIR stands: its plan, the rungs done, those under way, the fit."""
    folder = Path(args.dir)
    if not (folder / PLAN_FILE).exists():
        raise UsageError(f"{folder}: no ladder here (no {PLAN_FILE})")
    plan, _ = load_plan(folder)
    done = {r["name"]: r for r in read_rungs(folder)}
    record = read_json_file(folder / RUN_FILE) if (folder / RUN_FILE).exists() else {}
    print(plan.sentence)
    for r in plan.rungs:
        if r.name in done:
            d = done[r.name]
            loss = "diverged" if d.get("diverged") else f"final val loss {d['final_val_loss']:.4f}"
            print(f"  {r.name:<22} done      {loss} ({d.get('wall_seconds', 0):.0f} s)")
        elif rung_dir(folder, r.name).exists():
            print(f"  {r.name:<22} started   step {rung_step(folder, r.name)}/{r.recipe['total_steps']}")
        else:
            print(f"  {r.name:<22} pending")
    spent = record.get("spent_usd")
    print(f"rungs    {len(done)}/{len(plan.rungs)} done" + (f"; ${spent:.2f} spent" if isinstance(spent, (int, float)) else ""))
    if (folder / LADDER_FILE).exists():
        print(summary(read_json_file(folder / LADDER_FILE), folder / LADDER_FILE))
    return 0


# ---------------------------------------------------------------------------------------------
# step: the ladder as the stack's step before the main run, from the trainer's own command line


def gpu_here() -> str | None:
    """The plan-table key of the GPU this process sees, None without one."""
    import torch

    return detect_gpu_key(torch.cuda.get_device_name(0)) if torch.cuda.is_available() else None


def price_now(cost_uri: str | None) -> float | None:
    """$/h as the sidecar last read it (budget.json), where there is a reading."""
    if not cost_uri or "://" in cost_uri:
        return None
    try:
        return read_budget_file(cost_uri).rate_usd_per_hr or None
    except (OSError, ValueError):
        return None


def cmd_step(args: argparse.Namespace) -> int:
    """The trainer's arguments in, the ladder run for that run out (DIR/ladder.json), once: a
    folder that already holds ladder.json is done and says so. Then the stack starts the trainer
    with --ladder DIR/ladder.json (trainer/entrypoint.sh)."""
    folder = Path(args.dir)
    if (folder / LADDER_FILE).exists():
        print(f"ladder: {folder / LADDER_FILE} is there: the main run takes its band and its forecast's prior from it")
        return 0
    targs = args.trainer_args[1:] if args.trainer_args[:1] == ["--"] else args.trainer_args
    try:
        t = trainer_parser().parse_args(targs)
        cfg = config_from_args(t)
    except SystemExit as e:  # argparse has said what is wrong
        return int(e.code or 2)
    except (ConfigError, OSError) as e:
        raise UsageError(str(e)) from None
    b = cfg.budget
    ns = args
    if not (folder / PLAN_FILE).exists():
        gpu = gpu_here() or args.gpu
        price = price_now(b.curr_cost_uri) or args.price_usd_per_hr
        ns = argparse.Namespace(config=t.config, set=list(t.set), data_dir=cfg.data.dir, gpu=gpu, provider=args.provider,
                                price_usd_per_hr=price, budget_usd=b.cap_usd or args.budget_usd, hours=args.hours,
                                total_steps=cfg.train.total_steps, share=args.share, sizes=args.sizes,
                                budgets=args.budgets, no_lr_sweep=args.no_lr_sweep, jobs=args.jobs,
                                concurrency_gain=args.concurrency_gain, tokens_per_sec=cfg.train.expected_tokens_per_sec,
                                smallest_width=args.smallest_width, tokens_per_param=args.tokens_per_param,
                                max_flops=args.max_flops, widths=args.widths, budgets_by=args.budgets_by,
                                budget_step=args.budget_step)
    planned = plan_once(folder, ns)
    if isinstance(planned, int):
        return planned
    plan, extra = planned
    settings = Settings(folder=folder, config=extra["config"], sets=extra["sets"], data_dir=extra["data_dir"],
                        mlflow_uri=cfg.tracking.mlflow_uri, jobs=plan.jobs, cap_usd=b.cap_usd,
                        cost_uri=b.curr_cost_uri if b.cap_usd is not None else None, alert_usd=b.alert_usd,
                        heartbeat=Path(cfg.tracking.heartbeat_file))
    return run(plan, settings, fit=fit_folder)


# ---------------------------------------------------------------------------------------------
# fit, predict, report


def target_of(plan_data: dict[str, Any]) -> dict[str, Any]:
    """The main run a plan.json was made for, as `make_ladder` takes it."""
    t = plan_data["target"]
    target: dict[str, Any] = {"n_params": t["n_params"], "tokens": t["tokens"],
                              "n_params_nonembedding": t["n_params_nonembedding"], "flops_per_token": t["flops_per_token"]}
    corpus = plan_data.get("inputs", {}).get("provenance", {}).get("corpus_train_tokens")
    if corpus and t["tokens"] > corpus:
        target["repeats_data"] = (f"the run's {t['tokens']:,} tokens are {t['tokens'] / corpus:.1f} passes over the "
                                  f"corpus's {corpus:,}: the law is for tokens seen once")
    return target


def fit_and_write(rungs: Any, source: str, out: Path, plan_data: dict[str, Any] | None,
                  target: dict[str, Any] | None = None, samples: int | None = None) -> dict[str, Any]:
    """OUT/ladder.json and its report from a rungs list (the lr check's rungs are kept beside the
    fit, not in it). RungsError (a ValueError) names what cannot be fitted; nothing is written then."""

    def is_sweep(r: Any) -> bool:
        return isinstance(r, dict) and r.get("role") == "lr-sweep"

    fitted = [r for r in rungs if not is_sweep(r)] if isinstance(rungs, list) else rungs
    if target is None and plan_data is not None:
        target = target_of(plan_data)
    prov = None
    if plan_data is not None:
        prov = {k: v for k, v in plan_data.get("inputs", {}).get("provenance", {}).items() if k != "corpus_train_tokens"}
    ladder = make_ladder(fitted, source=source, target=target, provenance=prov, samples=samples or BOOTSTRAP_SAMPLES)
    ladder["lr_sweep"] = [r for r in rungs if is_sweep(r)] if isinstance(rungs, list) else []
    out.mkdir(parents=True, exist_ok=True)
    write_json_atomic(out / LADDER_FILE, ladder)
    print(summary(ladder, out / LADDER_FILE))
    for path in write_report(ladder, out):
        print(f"written  {path}")
    return ladder


def fit_folder(folder: Path, plan: LadderPlan | None = None) -> dict[str, Any] | None:
    """`run`'s last step: DIR/rungs.json fitted into DIR/ladder.json; None (said) when it cannot be."""
    plan_data = read_json_file(folder / PLAN_FILE) if (folder / PLAN_FILE).exists() else None
    try:
        return fit_and_write(read_rungs(folder), str(folder / RUNGS_FILE), folder, plan_data)
    except RungsError as e:
        print(f"ladder: no fit: {e}")
        return None


def summary(ladder: dict[str, Any], path: Path) -> str:
    f, tol, chk = ladder["fit"], ladder["tolerance"], ladder["heldout_check"]
    lines = [f"fit      L(N, D) = {f['E']:.4f} + {f['A']:.4g} / N^{f['alpha']:.4f} + {f['B']:.4g} / D^{f['beta']:.4f}"
             f"   (N: {f['n_convention']} parameters; {f['points']} rungs)"]
    for c, v in ladder["conventions"].items():
        lines.append(f"N        {c}: the fit without the largest size misses it by {v['heldout_max_abs_error']:.4f} nats"
                     + ("  <- kept" if c == f["n_convention"] else ""))
    lines.append(f"tolerance {tol['heldout_error']:.4f} nats (held-out check over {chk['reach']:.2f} decades of compute), "
                 "scaled with the target's distance")
    p = ladder.get("prediction")
    if p:
        lines.append(f"predict  {p['val_loss']:.4f} [{p['low']:.4f}, {p['high']:.4f}] for {p['n_params']:.4g} parameters "
                     f"and {p['tokens']:.4g} tokens (tolerance {p['tolerance']:.4f})" + (f"; {p['note']}" if p.get("note") else ""))
    for note in ladder.get("left_out", []):
        lines.append(f"left out {note}")
    for note in ladder.get("notes", []):
        lines.append(f"note     {note}")
    lines.append(f"written  {path}")
    return "\n".join(lines)


def cmd_fit(args: argparse.Namespace) -> int:
    rungs_path = Path(args.rungs)
    try:
        # Non-finite numbers parse: the check of each rung names the entry that holds one.
        rungs = read_json_file(rungs_path, finite=False)
    except FileNotFoundError:
        raise UsageError(f"{rungs_path}: no such file") from None
    except (OSError, ValueError) as e:
        raise UsageError(str(e) if str(rungs_path) in str(e) else f"{rungs_path}: {e}") from None
    out = Path(args.out) if args.out else rungs_path.parent
    target = None
    if args.target_params is not None or args.target_tokens is not None:
        if args.target_params is None or args.target_tokens is None:
            raise UsageError("--target-params and --target-tokens go together")
        target = {"n_params": args.target_params, "tokens": args.target_tokens,
                  "n_params_nonembedding": args.target_nonembedding_params}
    beside = rungs_path.parent / PLAN_FILE  # a ladder's own folder: its plan gives the target and the provenance
    plan_data = read_json_file(beside) if beside.exists() else None
    try:
        fit_and_write(rungs, str(rungs_path), out, plan_data, target, args.bootstrap)
    except RungsError as e:
        raise UsageError(str(e)) from None
    return 0


def cmd_predict(args: argparse.Namespace) -> int:
    ladder = load_ladder(args.ladder)
    p = predict(ladder, args.params, args.tokens, args.nonembedding_params)
    print(json.dumps({"val_loss": p.val_loss, "low": p.low, "high": p.high, "tolerance": p.tolerance,
                      "n_convention": p.n_convention, "n_params": p.n_params, "tokens": p.tokens}))
    return 0


def cmd_report(args: argparse.Namespace) -> int:
    ladder = load_ladder(args.ladder)
    out = Path(args.out) if args.out else Path(args.ladder).parent
    for path in write_report(ladder, out):
        print(f"written  {path}")
    return 0


# ---------------------------------------------------------------------------------------------
# The command line


def positive(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not (math.isfinite(v) and v > 0):
        raise argparse.ArgumentTypeError(f"{text} is not a positive finite number")
    return v


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m x1_pretrain.ladder", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)

    sp = sub.add_parser("plan", help="choose the rungs against the money; write DIR/plan.json",
                        description="Choose the rungs against the money and say what they cost, in one sentence. "
                                    "Exit 78 when the ladder and the main run together would pass the cap.")
    add_plan_flags(sp, required=True)
    sp.add_argument("--out", default=DEFAULT_DIR, help=f"the ladder's folder (default {DEFAULT_DIR})")
    sp.set_defaults(func=cmd_plan)

    sp = sub.add_parser("run", help="train the rungs (resumable), then fit and report",
                        description="Train every rung of DIR/plan.json with the trainer, --jobs at once; finished "
                                    "rungs go to DIR/rungs.json at once and are never rerun. Then fit and report.")
    sp.add_argument("--dir", default=DEFAULT_DIR, help=f"the ladder's folder (default {DEFAULT_DIR})")
    add_plan_flags(sp, required=False)
    sp.add_argument("--mlflow-uri", help="the tracking server (default: a file store in DIR/mlruns)")
    sp.add_argument("--budget-cap-usd", type=positive, help="the run's cap: the ladder stops (76) before a rung "
                    "that would take the ladder and the main run over it, and each rung's guard judges it")
    sp.add_argument("--budget-curr-cost-uri", help="budget.json (the sidecar's)")
    sp.add_argument("--budget-alert-usd", type=positive, help="the alert line the rungs' guards use")
    sp.add_argument("--no-fit", action="store_true", help="train only; fit later with `ladder fit`")
    sp.set_defaults(func=cmd_run)

    sp = sub.add_parser("status", help="where the ladder in DIR stands: rungs done and under way, the fit")
    sp.add_argument("--dir", default=DEFAULT_DIR, help=f"the ladder's folder (default {DEFAULT_DIR})")
    sp.set_defaults(func=cmd_status)

    sp = sub.add_parser("step", help="the stack's step before the main run: the ladder for the trainer's own arguments",
                        description="Plan (from the trainer's arguments, this GPU and the sidecar's price) and run "
                                    "the ladder into DIR, then fit it: the stack runs this before the main run when "
                                    ".env has LADDER=1, and starts the trainer with --ladder DIR/ladder.json. Done "
                                    "when DIR holds ladder.json.")
    sp.add_argument("--dir", default=DEFAULT_DIR, help=f"the ladder's folder (default {DEFAULT_DIR})")
    add_plan_flags(sp, required=False)
    sp.add_argument("trainer_args", nargs=argparse.REMAINDER, help="-- then the trainer's arguments")
    sp.set_defaults(func=cmd_step)

    sp = sub.add_parser("fit", help="fit the law to a rungs file; write ladder.json",
                        description="Fit L(N, D) = E + A/N^alpha + B/D^beta to RUNGS.json (a list of objects with at "
                                    "least n_params, tokens, final_val_loss) and write OUT/ladder.json.")
    sp.add_argument("rungs", help="rungs.json: from `ladder run`, or any list of {n_params, tokens, final_val_loss}")
    sp.add_argument("--out", help="where ladder.json goes (default: beside RUNGS.json; created if missing)")
    sp.add_argument("--target-params", type=positive, help="the run to predict: its parameters (all of them)")
    sp.add_argument("--target-nonembedding-params", type=positive, help="... and those outside the embedding")
    sp.add_argument("--target-tokens", type=positive, help="... and its training tokens")
    sp.add_argument("--bootstrap", type=int, help="bootstrap resamples kept in the file (default 200)")
    sp.set_defaults(func=cmd_fit)

    sp = sub.add_parser("predict", help="the law's val loss and interval for N parameters and D tokens (one JSON line)")
    sp.add_argument("--ladder", required=True, help="ladder.json")
    sp.add_argument("--params", type=positive, required=True, help="parameters, all of them")
    sp.add_argument("--nonembedding-params", type=positive, help="parameters outside the embedding")
    sp.add_argument("--tokens", type=positive, required=True, help="training tokens")
    sp.set_defaults(func=cmd_predict)

    sp = sub.add_parser("report", help="ladder.png and ladder.md from a ladder.json")
    sp.add_argument("--ladder", required=True, help="ladder.json")
    sp.add_argument("--out", help="where the report goes (default: beside the ladder file)")
    sp.set_defaults(func=cmd_report)
    return p


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stdout)
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args))
    except (UsageError, LadderPlanError, LadderFileError) as e:
        print(f"error: {e}", file=sys.stderr)
        return int(ExitCode.USAGE)
    except LadderRefused as e:
        print(f"refused: {e}", file=sys.stderr)
        return int(ExitCode.LAUNCH_REFUSED)
