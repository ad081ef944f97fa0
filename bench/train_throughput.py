"""Throughput of the project's own training step and loop on a GPU (issue: GPU throughput).

    python bench/train_throughput.py --data-dir DATA --config configs/x1-50m-a100.yaml \\
        [--variant shipped | --set train.kernels=torch ...] [--steps 10] [--loop-steps 30] --json out.jsonl

Builds the run exactly as `python -m x1_pretrain.train` does (`train.setup`: data, model, compile,
optimizer, MLflow, Prometheus, heartbeat, budget guard), then measures

  bare  — the step the loop runs: `train.accumulate` over the micro-batches + clip + AdamW step,
          timed over --steps optimizer steps with one sync at the end;
  loop  — `train.train_loop` itself for --loop-steps steps, logging every 10 steps to MLflow,
          Prometheus and the heartbeat, with the budget guard on; its own logged tokens/s; then
          the bare step once more, so the loop's overhead is also judged against the mean of the
          bare step before and after it (a GPU that slows as it warms would count against the loop).

Prints tokens/s, TFLOP/s, MFU against the datasheet and the measured matmul peak, peak memory and
compile seconds as one JSON line. Run one variant per process (compile caches and memory start clean).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import tomllib

# Every run compiles from scratch (its setup-and-compile seconds are reported), and a variant
# never times kernels that an earlier process compiled and cached.
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", tempfile.mkdtemp(prefix="x1-inductor-"))

import torch  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "trainer")]


def matmul_peak_tflops() -> float:
    n = 8192
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(10):
        a @ b
    end.record()
    torch.cuda.synchronize()
    return 2 * n**3 / (start.elapsed_time(end) / 1000 / 10) / 1e12


# The variants of the step (bench/plans.toml [variants]): each a list of config overrides on top
# of configs/x1-50m-a100.yaml; the loop's code is the same in all.
PLANS = Path(__file__).with_name("plans.toml")
VARIANTS: dict[str, list[str]] = tomllib.loads(PLANS.read_text())["variants"]


def resolve_variant(name: str) -> list[str]:
    """'a+b' combines variants: their overrides in that order. A name not in the table is refused
    (ValueError naming it and those there are): a misspelt variant would otherwise be timed as
    something else."""
    sets: list[str] = []
    for part in name.split("+"):
        if part not in VARIANTS:
            raise ValueError(f"no variant {part!r} in {PLANS.name} [variants]; there are: {', '.join(VARIANTS)}")
        sets += VARIANTS[part]
    return sets


def gpu_work(trace: Path) -> list[dict]:
    """A Chrome trace's GPU events: its kernels, copies and memsets (not the operators that launched them)."""
    return [e for e in json.loads(trace.read_text())["traceEvents"]
            if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset") and "dur" in e]


def gpu_idle(events: list[dict], top: int = 10) -> dict:
    """From the GPU's events (`gpu_work`): its span over the profiled step, the time no kernel,
    copy or memset ran in it, and the longest such gaps with the kernels either side."""
    work = sorted((e["ts"], e["ts"] + e["dur"], e["name"][:60]) for e in events)
    gaps, idle = [], 0.0
    busy_until, last = work[0][1], work[0][2]
    for start, end, name in work[1:]:
        if start > busy_until:
            gaps.append((start - busy_until, last, name))
            idle += start - busy_until
        if end > busy_until:
            busy_until, last = end, name
    gaps.sort(reverse=True)
    return {"span_ms": round((busy_until - work[0][0]) / 1000, 2), "idle_ms": round(idle / 1000, 2),
            "gaps_over_50us": sum(g[0] > 50 for g in gaps),
            "longest": [{"us": round(g, 1), "after": a, "before": b} for g, a, b in gaps[:top]]}


def kernel_table(events: list[dict], top: int = 60) -> str:
    """From the GPU's events (`gpu_work`): every kernel, copy and memset by name, with its total
    time, calls and mean, the largest first. The profiler's own table ranks operators and kernels
    together and cuts at a row count, which left ~130 ms of a step's kernels out of the profiles
    before call 48 (the head's input gradient among them)."""
    totals: dict[str, list[float]] = {}
    for e in events:
        t = totals.setdefault(e["name"][:100], [0.0, 0])
        t[0] += e["dur"]
        t[1] += 1
    rows = sorted(totals.items(), key=lambda kv: -kv[1][0])
    everything = sum(t for t, _ in totals.values())
    lines = [f"{'kernel':<100} {'total ms':>9} {'calls':>6} {'mean us':>9}"]
    lines += [f"{name:<100} {t / 1000:9.3f} {n:6d} {t / n:9.1f}" for name, (t, n) in rows[:top]]
    shown = sum(t for _, (t, _) in rows[:top])
    lines.append(f"kernels listed: {shown / 1000:.1f} ms of {everything / 1000:.1f} ms in {len(rows)} kernels")
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default=str(REPO / "configs/x1-50m-a100.yaml"))
    p.add_argument("--data-dir", required=True)
    p.add_argument("--variant", help=f"a named variant (bench/plans.toml), or several joined by +: {', '.join(VARIANTS)}")
    p.add_argument("--set", action="append", default=[], metavar="SECTION.FIELD=VALUE", help="a config override")
    p.add_argument("--profile", action="store_true",
                   help="print the top CUDA kernels of the profiled bare steps (--profile-steps) and their GPU idle time")
    p.add_argument("--trace", help="with --profile: keep the profiled steps' Chrome trace here")
    p.add_argument("--profile-steps", type=int, default=1,
                   help="with --profile: this many steps in a row, queued without a sync between them (the idle "
                        "time between two steps shows only with 2 or more)")
    p.add_argument("--steps", type=int, default=10, help="optimizer steps timed for the bare step")
    p.add_argument("--loop-steps", type=int, default=30, help="optimizer steps of the full loop (0 skips it)")
    p.add_argument("--peak-tflops", type=float, help="measured matmul peak (measured here when omitted)")
    p.add_argument("--name", default="ours")
    p.add_argument("--json", help="append the result as a JSON line to this file")
    args = p.parse_args()
    if args.profile_steps < 1:
        p.error(f"--profile-steps must be at least 1, got {args.profile_steps}")
    if args.variant:
        try:
            args.set = resolve_variant(args.variant) + args.set
        except ValueError as e:
            p.error(str(e))
        args.name = args.variant if args.name == "ours" else args.name

    from x1_common.fsutil import write_json_atomic
    from x1_pretrain.config import ConfigError, load_config
    from x1_pretrain.train.components import StopSignal, Throughput
    from x1_pretrain.train.loop import accumulate, train_loop
    from x1_pretrain.train.parser import build_parser, config_from_args
    from x1_pretrain.train.setup import setup

    try:  # an override naming a field that is not there (or a value it refuses): before any work
        load_config(args.config, args.set)
    except ConfigError as e:
        p.error(f"the config with {args.set}: {e}")

    cuda = torch.cuda.is_available()
    sync = torch.cuda.synchronize if cuda else (lambda: None)  # CPU: a dry run of this script
    peak = args.peak_tflops or (matmul_peak_tflops() if cuda else 1.0)
    work = Path(tempfile.mkdtemp(prefix="x1-bench-"))
    budget = work / "budget.json"
    write_json_atomic(budget, {"spent_usd": 1.0, "rate_usd_per_hr": 3.5, "hours_elapsed": 0.3,
                               "projected_total_usd": 20.0, "last_update_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())})
    total = args.steps + args.loop_steps + 3
    argv = ["--config", args.config, "--data-dir", args.data_dir, "--ckpt-dir", str(work / "ckpt"),
            "--mlflow-uri", f"file://{work}/mlruns", "--total-steps", str(total), "--log-every", "10",
            "--eval-every", "1000000", "--ckpt-every", "1000000", "--metrics-port", "0",
            "--heartbeat-file", str(work / "heartbeat.json"), "--budget-cap-usd", "35",
            "--budget-curr-cost-uri", str(budget), "--max-price-usd-per-hr", "10",
            "--set", f"optim.warmup_steps={min(1000, total)}"]  # a timing run may be shorter than the warmup
    for s in args.set:
        argv += ["--set", s]
    targs = build_parser().parse_args(argv)
    cfg = config_from_args(targs)
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    run = setup(targs, cfg, StopSignal())
    compile_s = time.perf_counter() - t0
    assert not isinstance(run, int), f"setup refused: exit {run}"

    # bare: the loop's step, nothing else
    def one_step(step: int) -> None:
        loss, _ = accumulate(run, step)
        torch.nn.utils.clip_grad_norm_(run.raw_model.parameters(), cfg.optim.grad_clip)
        run.optimizer.step()
        run.optimizer.zero_grad(set_to_none=not run.cudagraphs)

    def bare(first: int) -> float:
        t = time.perf_counter()
        for i in range(first, first + args.steps):
            one_step(i)
        sync()
        return args.steps * cfg.train.tokens_per_step / (time.perf_counter() - t)

    one_step(0)  # first real step: finishes autotuning / graph capture
    sync()
    bare_tps = bare(1)
    if args.profile:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU]) as prof:
            for i in range(args.profile_steps):
                one_step(args.steps + 1 + i)
            sync()
        if cuda:
            trace = Path(args.trace or work / "trace.json")
            prof.export_chrome_trace(str(trace))
            events = gpu_work(trace)
            print(kernel_table(events), flush=True)
            print(json.dumps({"gpu_timeline": gpu_idle(events)}), flush=True)
        else:
            print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=40, max_name_column_width=100), flush=True)
        after = args.steps + 1 + args.profile_steps  # the first step the profile did not take
        run.batches.close()
        run.batches = run.make_batches(after, run.micro_batch, run.grad_accum)
        run.state.step = after

    loop_tps = bare_after_tps = None
    intervals: list[float] = []
    if args.loop_steps:
        if not args.profile:
            run.batches.close()
            run.state.step = args.steps + 1
            run.batches = run.make_batches(run.state.step, run.micro_batch, run.grad_accum)
        run.throughput = Throughput()
        train_loop(run)
        from mlflow.tracking import MlflowClient

        client = MlflowClient(f"file://{work}/mlruns")
        exp = client.get_experiment_by_name(cfg.tracking.experiment)
        rid = client.search_runs([exp.experiment_id])[0].info.run_id
        hist = sorted(client.get_metric_history(rid, "tokens_per_sec"), key=lambda m: m.step)
        intervals = [m.value for m in hist[1:]] or [m.value for m in hist]  # the first interval holds warm-up
        loop_tps = statistics.median(intervals)
        # The bare step once more, after the loop: a GPU that slowed as it warmed shows here, and
        # the loop is also judged against the mean of the bare step before and after it.
        run.batches.close()
        run.batches = run.make_batches(1, run.micro_batch, run.grad_accum)  # the first bare run's batches again
        bare_after_tps = bare(1)
    run.batches.close()

    fpt = run.flops_per_token
    result = {
        "name": args.name, "sets": args.set, "gpu": torch.cuda.get_device_name() if cuda else "cpu",
        "torch": torch.__version__, "micro_batch": run.micro_batch, "grad_accum": run.grad_accum,
        "kernels": "triton" if run.raw_model.fused_loss else "torch", "padded_vocab": cfg.model.padded_vocab_size,
        "bare_tokens_per_sec": round(bare_tps), "bare_tflops": round(bare_tps * fpt / 1e12, 1),
        "bare_mfu_measured": round(bare_tps * fpt / 1e12 / peak, 4), "bare_mfu_989": round(bare_tps * fpt / 1e12 / 989, 4),
        "loop_tokens_per_sec": round(loop_tps) if loop_tps else None,
        "loop_overhead": round(1 - loop_tps / bare_tps, 4) if loop_tps else None,
        "loop_intervals": [round(v) for v in intervals] if loop_tps else None,
        "bare_after_tokens_per_sec": round(bare_after_tps) if loop_tps else None,
        "loop_overhead_bracketed": round(1 - 2 * loop_tps / (bare_tps + bare_after_tps), 4) if loop_tps else None,
        "peak_mem_gib": round(torch.cuda.max_memory_allocated() / 2**30, 1) if cuda else 0.0, "setup_and_compile_s": round(compile_s, 1),
        "matmul_peak_tflops": round(peak, 1), "flops_per_token": fpt,
    }
    result["world_size"] = run.dist.world_size
    if cfg.train.grad_accumulation == "in-matmul":  # which path kernels.wgrad_accumulate took here
        from x1_pretrain.ops.kernels import addmm_into_fp32

        result["wgrad_added_by_matmul"] = addmm_into_fp32(run.dist.device)
    if not run.dist.is_main:
        return 0
    print(json.dumps(result), flush=True)
    if args.json:
        with open(args.json, "a") as f:
            f.write(json.dumps(result) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
