"""The trainer: `python -m x1_pretrain.train --config configs/x1-50m-a100.yaml ...` (docs/DESIGN.md §3, §5).

The loop is `train_loop` below, in the order you would check it at hour 14: learning rate →
forward/backward over the micro-batches → clip → optimizer step → log → eval → checkpoint →
budget → stop. Everything else is a component built by `setup` (data, model, checkpointer,
metrics, budget guard); on ranks other than 0 the logging components are no-op objects.

Exit codes are the contract with the watchdog (x1_common.contracts.ExitCode): 0 finished, 75
preempted (checkpoint written), 76 budget projection over the cap (checkpoint written), 77 spent
over the cap (no write), 78 launch refused, 79 diverged, 80 the final-loss forecast outside its band
with --stop-when-forecast-misses-band (checkpoint written), 2 bad config or data.
"""

from __future__ import annotations

import os
import signal


def _preempted_while_starting(signum: int, frame: object) -> None:
    os.write(2, b"SIGTERM during start-up, before anything was written: exit 75 (preempted)\n")
    os._exit(75)  # ExitCode.PREEMPTED; immediate: the imports it interrupts need no unwinding


# A SIGTERM from here until StopSignal takes over (the imports below: torch alone takes seconds)
# is a stop before anything was written: "preempted" to the watchdog (75), not a crash (143).
# Only as the program (python -m / torchrun -m): a process that imports this module keeps its own.
if __name__ == "__main__":
    signal.signal(signal.SIGTERM, _preempted_while_starting)

import argparse
import contextlib
import json
import logging
import math
import random
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from x1_common import restarts
from x1_common.contracts import (
    COST_URI_PASSWORD_ENV,
    COST_URI_USERNAME_ENV,
    END_REASONS,
    ExitCode,
    move_uri_credentials_to_env,
)
from x1_common.fsutil import write_json_atomic
from x1_common.logs import setup_logging
from x1_pretrain import cublaslt, levers, preflight, provenance
from x1_pretrain import distributed as D
from x1_pretrain.accounting import detect_gpu_key, expected_tokens_per_sec, flops_per_token, fmt_count
from x1_pretrain.budget_guard import Interval, Pace, Projection
from x1_pretrain.checkpoint import (
    OPTIM_FILE,
    Checkpointer,
    CheckpointError,
    CheckpointRefused,
    TrainerState,
    capture_rng,
    restore_rng,
)
from x1_pretrain.config import SEED_FLAGS, ConfigError, RunConfig, load_config
from x1_pretrain.data import split_window
from x1_pretrain.lease import take_trainer_lease
from x1_pretrain.model import Bf16Weights, Transformer, attention_backend, param_groups
from x1_pretrain.schedule import lr_at, lr_progress
from x1_pretrain.spikes import SpikeDetector, SpikeInjector

log = logging.getLogger("x1.train")


# MLflow statuses per exit: a stop on purpose is KILLED, a failure FAILED.
MLFLOW_STATUS = {0: "FINISHED", 75: "KILLED", 76: "KILLED", 77: "KILLED", 79: "FAILED", 80: "KILLED"}
# Exits after which nothing more will train (--run-dir writes the run folder after these).
FINAL_CODES = frozenset({ExitCode.FINISHED, ExitCode.BUDGET_PROJECTED, ExitCode.BUDGET_SPENT, ExitCode.DIVERGED,
                         ExitCode.FORECAST_STOP})
IMPORTED_AT = time.time()  # process_started_at's fallback where /proc is missing


class DataOrConfigError(Exception):
    """Something a person must fix (exit 2)."""


# ---------------------------------------------------------------------------------------------
# Small pieces the loop uses


class StopSignal:
    """SIGTERM / SIGINT set a flag; the loop checks it at every micro-step and checkpoints."""

    def __init__(self) -> None:
        self.signum: int | None = None
        self.at: float | None = None  # unix time of the first signal: a restart's downtime counts from it
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._handle)

    def _handle(self, signum: int, frame: Any) -> None:
        if self.signum is None:
            self.at = time.time()
            log.warning("%s received: finishing with an emergency checkpoint", signal.Signals(signum).name)
        self.signum = signum

    @property
    def requested(self) -> bool:
        return self.signum is not None

    @property
    def code(self) -> int:
        return int(ExitCode.PREEMPTED) if self.requested else 0


class BatchStream:
    """next() gives (step, micro, x, y) from the data.Prefetcher; close() stops its thread."""

    def __init__(self, prefetcher: Any):
        self.prefetcher = prefetcher
        self._it = iter(prefetcher)

    def __next__(self) -> tuple[int, int, torch.Tensor, torch.Tensor]:
        return next(self._it)

    def close(self) -> None:
        self.prefetcher.close()


class Throughput:
    """Tokens/s between log steps, eval and checkpoint time left out, and whether the interval was
    steady. The first interval of a process (compile, warm-up, the first optimizer step, a restore)
    and one that held an eval or a checkpoint say nothing about the steady rate: the throughput
    floor does not judge them, and the budget's pace does not average them in (docs/DESIGN.md §5)."""

    def __init__(self, first: str = "start", clock=time.perf_counter) -> None:
        self.clock = clock
        self._reset(clock(), [first])

    def _reset(self, now: float, not_steady: list[str]) -> None:
        self.t0, self.tokens, self.steps, self.paused_s = now, 0, 0, 0.0
        self.not_steady = not_steady
        self.paused: dict[str, list[float]] = {}

    def add(self, tokens: int) -> None:
        self.tokens += tokens
        self.steps += 1

    @contextlib.contextmanager
    def pause(self, kind: str):
        """Time spent in `kind` ("eval", "checkpoint") is left out of the rate and measured on its own."""
        t = self.clock()
        try:
            yield
        finally:
            seconds = self.clock() - t
            self.paused_s += seconds
            self.paused.setdefault(kind, []).append(seconds)
            if kind not in self.not_steady:
                self.not_steady.append(kind)

    def read(self) -> Interval:
        """The interval since the last read."""
        now = self.clock()
        interval = Interval(steps=self.steps, seconds=max(now - self.t0 - self.paused_s, 1e-9), tokens=self.tokens,
                            not_steady=tuple(self.not_steady), paused=self.paused)
        self._reset(now, [])
        return interval


class CompileWatch:
    """Counts the graphs torch.compile builds after the warm-up. There should be none: a
    recompile mid-run costs seconds to minutes and usually means an input changed its shape,
    strides or dtype (TORCH_LOGS=recompiles names the guard that failed)."""

    def __init__(self) -> None:
        self.seen = self._count()

    @staticmethod
    def _count() -> int:
        from torch._dynamo.utils import counters

        return int(counters["stats"]["unique_graphs"]) + int(counters["compiled_autograd"]["captures"])

    def new_graphs(self) -> int:
        """Graphs built since the last call."""
        now = self._count()
        new, self.seen = now - self.seen, now
        return new


@dataclass
class Run:
    """Every component the loop touches, built once by `setup`."""

    cfg: RunConfig
    dist: D.Dist
    raw_model: Transformer  # for state dicts and eval: no wrapper, no compile
    model: torch.nn.Module  # what the loop trains: compiled and/or DDP/FSDP2-wrapped
    optimizer: torch.optim.Optimizer
    batches: Any  # iterator of (step, micro, x, y) from data.Prefetcher
    make_batches: Any  # (start_step, micro_batch, grad_accum) -> a fresh batches iterator
    warmup_batch: Any  # micro_batch -> (B, T+1) windows of the first step, to compile on
    val: np.ndarray
    checkpointer: Checkpointer
    sink: Any  # tracking.MetricsSink or NullSink
    guard: Any  # budget_guard.BudgetGuard or NullGuard
    stop: StopSignal
    detector: SpikeDetector
    injector: SpikeInjector
    state: TrainerState
    grad_accum: int
    autocast: Any
    flops_per_token: float
    peak_tflops: float
    measured_peak_tflops: float | None
    pace: Pace  # the run's measured pace: the budget guard's projection reads it
    floor: float  # throughput floor, tokens/s (0: off); floor_source says where it comes from
    floor_source: str
    throughput: Throughput = field(default_factory=Throughput)
    compiles: CompileWatch = field(default_factory=CompileWatch)
    cudagraphs: bool = False  # compiled with a mode that replays CUDA graphs
    bf16_weights: Bf16Weights | None = None  # the step's bf16 weights, cast once for its micro-steps
    backward_context: Any = contextlib.nullcontext  # compiled autograd, when on
    last_saved_step: int = -1
    floor_warned_at: float = 0.0
    previous_heartbeat: Any = None  # what the process before this one left (a restart's downtime)
    first_step_logged: bool = False
    forecast: Any = None  # forecast.ForecastWatch: the final val loss the curve so far points to

    @property
    def micro_batch(self) -> int:
        return self.cfg.train.micro_batch_size


# ---------------------------------------------------------------------------------------------
# The loop


def train_loop(run: Run) -> int:
    cfg, total = run.cfg, run.cfg.train.total_steps
    step = run.state.step
    while step < total:
        # 1. learning rate
        lr = lr_at(step, cfg.optim, total, run.state.replans[-1] if run.state.replans else None)
        for group in run.optimizer.param_groups:
            group["lr"] = lr
        if (note := run.injector.announcement(step, run.detector)) is not None:
            log.warning(note)
            run.sink.tags({"x1.spike_injection": note})
            run.sink.log(step, {"spike_injection_skipped": float(run.injector.natural_spike_before(run.detector) is not None)})

        # 2. forward/backward over the micro-batches (gradients averaged over the whole step)
        injected = run.injector.active(step, run.detector)
        loss, interrupted = accumulate(run, step)
        if interrupted:  # SIGTERM mid-step: drop the partial gradients, keep the last full step
            return stop_run(run, step, ExitCode.PREEMPTED, "preempted")

        # 3. clip (the norm is taken before clipping, so a spike shows in the log)
        grad_norm = torch.nn.utils.clip_grad_norm_(run.raw_model.parameters(), cfg.optim.grad_clip)
        if hasattr(grad_norm, "full_tensor"):  # FSDP2: a DTensor
            grad_norm = grad_norm.full_tensor()

        # 4. optimizer step, unless the loss or the gradient is not finite
        loss_v, grad_norm_v, finite = step_unless_nonfinite(run.optimizer, run.dist, loss, grad_norm)
        if finite:
            run.state.nonfinite_in_row = 0
        else:
            run.state.nonfinite_in_row += 1
            log.warning("step %d: non-finite loss %s / grad norm %s: optimizer step skipped (%d in a row)",
                        step, loss_v, grad_norm_v, run.state.nonfinite_in_row)
            run.sink.log(step, {"nonfinite_step": 1.0})
        # Under CUDA graphs the gradients stay allocated: the first backward of a step would
        # otherwise take the graph's output buffer as .grad, which the next replay overwrites.
        run.optimizer.zero_grad(set_to_none=not run.cudagraphs)
        step += 1
        run.state.step = step
        run.state.tokens_seen += cfg.train.tokens_per_step
        run.throughput.add(cfg.train.tokens_per_step)
        if run.state.nonfinite_in_row >= cfg.train.max_nonfinite_in_row:
            return diverged(run, step)
        flagged = finite and run.detector.update(step, loss_v)
        run.forecast.observe(step, loss_v, flagged or injected)  # flagged steps stay out of its fit
        if flagged or injected:  # the post-mortem's evidence, at the step itself
            log_spike_step(run, step, loss_v, grad_norm_v, flagged)
        if not run.first_step_logged:
            log_first_step(run, step)

        # 5. log
        if step % cfg.train.log_every == 0 or step == total:
            log_step(run, step, loss_v, grad_norm_v, lr)

        # 6. eval on the fixed val windows, and the final val loss the curve so far points to
        forecast_code = 0
        if step % cfg.train.eval_every == 0 or step == total:
            with run.throughput.pause("eval"):
                forecast_code = D.agree(run.dist, judge_forecast(run, step, evaluate(run, step)))

        # 7. checkpoint
        if step % cfg.checkpoint.every == 0 or step == total:
            with run.throughput.pause("checkpoint"):
                save_checkpoint(run, step)

        if forecast_code and step < total:  # asked for with --stop-when-forecast-misses-band
            return stop_run(run, step, ExitCode.FORECAST_STOP, run.forecast.last_alert)

        # 8. budget: spent, and what the steps left need at the run's measured pace (rank 0 reads
        # and logs its decision; it reaches every rank through `agree`)
        budget = run.guard.maybe_check(step)
        if budget.checked:
            log_budget(run, step, budget.projection)

        # 9. stop?
        code = D.agree(run.dist, run.stop.code, budget.exit_code or 0)
        if code:
            if code == budget.exit_code == ExitCode.BUDGET_PROJECTED and run.dist.is_main:
                write_budget_stop(Path(cfg.checkpoint.dir), step, total, budget.fits_steps, budget.reason,
                                  run.state.config_hash)
            return stop_run(run, step, ExitCode(code), budget.reason if budget.exit_code == code else "preempted")
    return finish(run, step)


def step_unless_nonfinite(optimizer: torch.optim.Optimizer, dist: D.Dist, loss: torch.Tensor,
                          grad_norm: torch.Tensor) -> tuple[float, float, bool]:
    """The optimizer's step unless the loss or the gradient norm is not finite: (loss, grad norm,
    whether it stepped), read back in the loop's one CPU-GPU sync per step.

    Fused AdamW can be told on the device to skip (`found_inf`, as a GradScaler tells it). Then the
    two numbers are copied out and the step queued before the CPU waits, and it waits for the copy
    alone: the GPU runs the step while the CPU does the step's bookkeeping. Ranks of a group agree
    on the CPU first, so there the step waits for the sync."""
    vals = torch.stack([loss, grad_norm.float()])
    on_device = bool(optimizer.defaults.get("fused")) and not dist.enabled
    if on_device:
        optimizer.found_inf = (~torch.isfinite(vals)).any().float()
        host = torch.empty(2, pin_memory=vals.is_cuda)
        host.copy_(vals, non_blocking=True)
        copied = torch.cuda.Event() if vals.is_cuda else None
        if copied is not None:
            copied.record()
        optimizer.step()
        if copied is not None:
            copied.synchronize()
        loss_v, grad_norm_v = host.tolist()
    else:
        loss_v, grad_norm_v = vals.tolist()
    finite = D.agree(dist, 0 if math.isfinite(loss_v) and math.isfinite(grad_norm_v) else 1) == 0
    if finite and not on_device:
        optimizer.step()
    return loss_v, grad_norm_v, finite


def accumulate(run: Run, step: int) -> tuple[torch.Tensor, bool]:
    """Forward and backward over grad_accum micro-batches. Returns (mean loss, interrupted)."""
    total = torch.zeros((), device=run.dist.device)
    # d(step loss)/d(micro loss) = 1 / grad_accum, handed to backward as a tensor: compiled autograd
    # (torch 2.11, CUDA) fails on the Python scalar that `(loss / grad_accum).backward()` leaves in
    # the graph. The gradients are the same numbers.
    weight = torch.full((), 1.0 / run.grad_accum, device=run.dist.device)
    copies = run.bf16_weights.refresh() if run.bf16_weights is not None else None  # after the last optimizer step
    for micro in range(run.grad_accum):
        if run.cudagraphs:  # each micro-step is a new replay; the last one's outputs are consumed
            torch.compiler.cudagraph_mark_step_begin()
        s, m, x, y = next(run.batches)
        assert (s, m) == (step, micro), f"batch order broken: got {(s, m)} for {(step, micro)}"
        if run.injector.active(step, run.detector):
            x, y = (t.to(run.dist.device) for t in split_window(run.injector.windows(step, micro, x.size(0))))
        # The backward too runs inside: FSDP2 decides at its end whether to reduce-scatter.
        with D.maybe_no_sync(run.model, sync=micro == run.grad_accum - 1):
            loss = forward_backward(run, run.model, x, y, weight, copies)
        total += loss.detach()
        # A single process can stop between micro-steps; ranks of a group agree once per step
        # (stopping alone mid-accumulation would leave the others waiting in an all-reduce).
        if run.stop.requested and not run.dist.enabled:
            return total, True
    if run.bf16_weights is not None:  # the weight gradients summed in fp32 buffers become .grad
        run.bf16_weights.publish()
    if run.injector.active(step, run.detector):
        run.sink.log(step + 1, {"spike_injected": 1.0})
    return total / run.grad_accum, False


def forward_backward(run: Run, model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor,
                     weight: torch.Tensor, copies: dict[str, Any] | None) -> torch.Tensor:
    """One micro-batch's loss, and its backward scaled by `weight` (1 / grad_accum); `copies`, the
    step's bf16 weights when the run takes them once per step. The warm-up calls this too: the
    same call is the same compiled graph, forward and backward."""
    with run.autocast():
        loss = model(x, y) if copies is None else model(x, y, copies)
    with run.backward_context():
        loss.backward(weight)
    return loss


# ---------------------------------------------------------------------------------------------
# What the loop calls at log, eval, checkpoint and exit


def log_step(run: Run, step: int, loss: float, grad_norm: float, lr: float) -> None:
    if run.dist.enabled:  # one process has its loss already: no round trip through the GPU
        loss = float(D.mean_over_ranks(run.dist, torch.tensor(loss, device=run.dist.device)))
    interval = run.throughput.read()
    run.pace.record(interval, step)
    tps, tokens = interval.tokens_per_sec, interval.tokens
    run.state.train_seconds += interval.seconds
    tps_per_gpu = tps / run.dist.world_size
    mfu = tps_per_gpu * run.flops_per_token / (run.peak_tflops * 1e12) if run.peak_tflops else 0.0
    param_norm = total_norm(run.raw_model.parameters())
    metrics = {
        "loss": loss,
        "lr": lr,
        "grad_norm": grad_norm,
        "param_norm": param_norm,
        "tokens_per_sec": tps,
        "mfu": mfu,
        "tokens_seen": float(run.state.tokens_seen),
        "wall_hours": (time.time() - run.state.run_started) / 3600,  # since the run's first start
        "train_hours": run.state.train_seconds / 3600,
        "clipped": float(grad_norm > run.cfg.optim.grad_clip),
    }
    p = run.sink.prom
    # Each MFU names its peak: the datasheet's (docs/DESIGN.md §4) and, where given, the measured matmul peak.
    mfu_text = f"mfu {mfu:.3f} of datasheet {run.peak_tflops:g} TFLOP/s" if run.peak_tflops else "mfu n/a (no datasheet peak)"
    p.mfu.labels(peak="datasheet", peak_tflops=f"{run.peak_tflops:g}").set(mfu)
    if run.measured_peak_tflops:
        metrics["mfu_measured_peak"] = tps_per_gpu * run.flops_per_token / (run.measured_peak_tflops * 1e12)
        mfu_text += f", {metrics['mfu_measured_peak']:.3f} of measured {run.measured_peak_tflops:g}"
        p.mfu.labels(peak="measured", peak_tflops=f"{run.measured_peak_tflops:g}").set(metrics["mfu_measured_peak"])
    if graphs := run.compiles.new_graphs():
        metrics["recompiled_graphs"] = float(graphs)
        log.warning("torch.compile built %d graph(s) after the warm-up, since the last log step: a recompile "
                    "costs seconds to minutes (TORCH_LOGS=recompiles names the guard that failed)", graphs)
    run.sink.log(step, metrics)
    log_budget(run, step, run.guard.projection(step))
    p.step.set(step)
    p.progress.set(step / run.cfg.train.total_steps)
    p.tokens.inc(tokens)
    p.tps.set(tps)
    p.loss.set(metrics["loss"])
    p.grad_norm.set(grad_norm)
    p.lr.set(lr)
    run.sink.heartbeat.beat(step, "training")
    steady = "" if interval.steady else f" (not steady: {'+'.join(interval.not_steady)})"
    log.info("step %d/%d loss %.4f lr %.2e grad %.3f tok/s %.0f%s %s", step, run.cfg.train.total_steps,
             metrics["loss"], lr, grad_norm, tps, steady, mfu_text)
    warn_if_slow(run, step, interval)


def log_budget(run: Run, step: int, projection: Projection | None) -> None:
    """Spend and the projection the guard judges (its own, the sidecar's, the larger), to MLflow and
    /metrics: at every budget check and every log step."""
    if projection is None:  # guard off, or no reading yet
        return
    own, hours = projection.own_usd, projection.hours_needed
    metrics = {"spent_usd": projection.spent_usd, "projected_usd": projection.judged_usd,
               "projected_sidecar_usd": projection.sidecar_usd}
    if own is not None and hours is not None:
        metrics.update(projected_own_usd=own, hours_needed=hours)
    run.sink.log(step, metrics)
    p = run.sink.prom
    p.spent.set(projection.spent_usd)
    p.projected.set(projection.judged_usd)
    p.projected_sidecar.set(projection.sidecar_usd)
    p.projected_own.set(math.nan if own is None else own)  # NaN: no pace yet, a gap in Grafana
    p.hours_needed.set(math.nan if hours is None else hours)
    need = projection.need
    p.eta.set(math.nan if need is None else need.seconds)  # wall seconds: the pace is measured in wall time


def log_spike_step(run: Run, step: int, loss: float, grad_norm: float, flagged: bool) -> None:
    """A flagged or injected step's own numbers: its loss, its grad norm (before clipping) and
    whether clipping fired. The log steps every `log_every` rarely fall on a spike's steps; without
    these the post-mortem could not say whether the clip caught it."""
    metrics = {"spike_loss": loss} if math.isfinite(loss) else {}
    clip = run.cfg.optim.grad_clip
    if math.isfinite(grad_norm):  # a non-finite step skipped the optimizer: no clip decision to log
        metrics.update(spike_grad_norm=grad_norm, spike_clipped=float(grad_norm > clip))
    if flagged:
        metrics.update(spike=1.0, spike_ema=run.detector.ema)
        log.warning("loss spike at step %d: %.3f vs EMA %.3f, grad norm %.3f %s the clip of %g", step, loss,
                    run.detector.ema, grad_norm, "over" if grad_norm > clip else "within", clip)
    run.sink.log(step, metrics)


def process_started_at() -> float:
    """Unix time this process started, interpreter and imports included (Linux: from /proc, to
    10 ms; elsewhere: when this module was imported)."""
    try:
        fields = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
        uptime = float(Path("/proc/uptime").read_text().split()[0])
        return time.time() - (uptime - int(fields[19]) / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return IMPORTED_AT


def log_first_step(run: Run, step: int) -> None:
    """What a start costs, as numbers: process start -> this process's first step done, and on a
    resume how the previous process stopped (x1_common.restarts: the downtime's definition)."""
    run.first_step_logged = True
    now = time.time()
    previous = run.previous_heartbeat
    # A container restarted by its host often has the same pid: a beat older than this process is not its own.
    resumed = run.state.restarts > 0 and previous is not None and (previous.pid != os.getpid()
                                                                   or previous.time < process_started_at())
    stopped = restarts.previous_stop(previous.phase, previous.time, previous.step, previous.signal_time) \
        if resumed else None
    start = restarts.Start(step, now, now - process_started_at(), stopped)
    metrics = {"startup_seconds": start.startup_seconds, "first_step_unix": now}
    if stopped is not None:
        metrics.update(stopped_unix=stopped.unix, stopped_by=float(restarts.STOPPED_BY.index(stopped.by)),
                       stopped_step=float(stopped.step))
        if stopped.by != "last heartbeat":  # the figure every report shows; a kill's comes from the watchdog's exit
            metrics["downtime_seconds"] = restarts.downtime_seconds(stopped, now)
    run.sink.log(step, metrics)
    log.info(restarts.start_line(start))
    if (tuned := cublaslt.summary()) is not None:
        log.info(tuned)


def total_norm(params) -> float:
    # foreach on a GPU: a few kernels for all parameters, not one each (the GPU idles while the
    # log step waits for this number). get_total_norm is torch >= 2.6 (the lever table's
    # get-total-norm row); before it, the norm of the per-tensor norms is the same number.
    tensors = [p.detach() for p in params]
    if hasattr(torch.nn.utils, "get_total_norm"):
        norm = torch.nn.utils.get_total_norm(tensors)
    else:
        norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(t) for t in tensors]))
    return (norm.full_tensor() if hasattr(norm, "full_tensor") else norm).item()


def warn_if_slow(run: Run, step: int, interval: Interval) -> None:
    """The hour-1 throughput floor, judged on steady intervals only: the first interval of a process and
    one holding an eval or a checkpoint are slow for reasons that are not a problem. A real
    slowdown (a starved data loader, an eager fallback) shows in the first steady interval."""
    first_hour = run.state.train_seconds < 3600
    if not run.floor or not first_hour or not interval.steady or interval.tokens_per_sec >= run.floor:
        return
    if time.time() - run.floor_warned_at > 600:
        run.floor_warned_at = time.time()
        log.warning(
            "step %d: throughput %.0f tokens/s (a steady interval of %d steps) is under the floor of %.0f (%s): "
            "stop and diagnose. Usual causes: torch.compile did not fuse or fell back to eager (look for compile "
            "warnings), the attention kernel is not flash (preflight line), the data loader is CPU-bound (iostat; "
            "prefetch depth)", step, interval.tokens_per_sec, interval.steps, run.floor, run.floor_source)


def throughput_floor(cfg: RunConfig, expected: tuple[float, str] | None) -> tuple[float, str]:
    """The floor in tokens/s and where it comes from: the config's, else a share of the expected."""
    t = cfg.train
    if t.min_tokens_per_sec is not None:
        return t.min_tokens_per_sec, "train.min_tokens_per_sec" if t.min_tokens_per_sec else "off: train.min_tokens_per_sec 0"
    if expected is None:
        return 0.0, "off: no throughput expected on this machine (--expected-tokens-per-sec sets one)"
    return t.floor_fraction * expected[0], f"{t.floor_fraction:g} x the expected {fmt_count(expected[0])} tokens/s"


def expected_throughput(cfg: RunConfig, device: torch.device, world_size: int) -> tuple[float, str] | None:
    """Tokens/s this run expects over all its GPUs, and where the figure comes from: the config's
    (--expected-tokens-per-sec), else plan's for the GPU found here; None on a CPU."""
    if cfg.train.expected_tokens_per_sec is not None:
        return cfg.train.expected_tokens_per_sec, "given: --expected-tokens-per-sec"
    if device.type != "cuda":
        return None
    gpu = detect_gpu_key(torch.cuda.get_device_name(device))
    row = expected_tokens_per_sec(gpu, cfg.model) if gpu is not None else None
    if row is None:
        return None
    return row.tokens_per_sec * world_size, f"plan's figure for {world_size}x {gpu} ({row.source})"


@torch.no_grad()
def evaluate(run: Run, step: int) -> float:
    """Mean loss over the fixed val windows, on the uncompiled model (no recompile for eval)."""
    model = run.raw_model
    model.eval()
    losses = []
    for i in range(0, len(run.val), run.micro_batch):
        w = torch.from_numpy(run.val[i : i + run.micro_batch]).to(run.dist.device)
        with run.autocast():
            losses.append(model(w[:, :-1], w[:, 1:]).float() * w.size(0))
    model.train()
    val_loss = (torch.stack(losses).sum() / len(run.val)).item()
    run.sink.log(step, {"val_loss": val_loss})
    run.sink.prom.val_loss.set(val_loss)
    log.info("step %d val_loss %.4f", step, val_loss)
    return val_loss


def forecast_watch(args: argparse.Namespace, cfg: RunConfig, state: TrainerState, is_main: bool):
    """The final-loss forecast (x1_pretrain.forecast), continuing the curve a checkpoint kept."""
    from x1_common.alerts import AlertSender
    from x1_pretrain.forecast import ForecastError, ForecastWatch

    alerts = None
    if is_main:
        try:
            alerts = AlertSender.from_env()
        except ValueError as e:
            raise ConfigError(f"alerts: {e}") from None
    try:
        return ForecastWatch.for_run(cfg.optim, cfg.train.total_steps, cfg.train.log_every, state.forecast,
                                     band=args.forecast_band, stop_outside=args.stop_when_forecast_misses_band,
                                     alerts=alerts)
    except ForecastError as e:
        raise DataOrConfigError(f"forecast: {e}") from None


def judge_forecast(run: Run, step: int, val_loss: float) -> int:
    """The forecast at this eval: logged, published, alerted on; 80 to stop, else 0."""
    return run.forecast.judge(step, val_loss, run.sink, run.guard.projection(step))


def full_states(run: Run) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Consolidated model and optimizer state on CPU (a collective under FSDP2: every rank calls it)."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
    return (get_model_state_dict(run.raw_model, options=opts),
            get_optimizer_state_dict(run.raw_model, run.optimizer, options=opts))


def save_checkpoint(run: Run, step: int) -> None:
    if run.last_saved_step == step:
        return
    run.sink.heartbeat.beat(step, "checkpointing")
    model_state, optim_state = full_states(run)
    if run.dist.is_main:
        run.state.spike = run.detector.state()
        run.state.forecast = run.forecast.state()
        # Windows are a pure function of (seed, step, sample index): the step is the position.
        run.state.sampler = {"seed": run.cfg.train.seed, "next_step": step}
        run.state.rng = capture_rng()
        run.state.mlflow_run_id = run.sink.run_id or run.state.mlflow_run_id
        run.state.micro_batch_size = run.micro_batch
        run.sink.persist()  # the steps this checkpoint covers are never logged again after a resume
        seconds = run.checkpointer.save(step, model_state, optim_state, run.state)
        run.sink.prom.ckpt_step.set(step)
        run.sink.prom.ckpt_seconds.set(seconds)
        run.sink.log(step, {"checkpoint_seconds": seconds})
        log.info("checkpoint step_%08d written in %.2f s", step, seconds)
    D.barrier(run.dist)
    run.last_saved_step = step
    run.sink.heartbeat.beat(step, "training")


def stop_run(run: Run, step: int, code: ExitCode, reason: str) -> int:
    """75, 76 and 80 checkpoint first; 77 exits at once without writing (already over the cap)."""
    if code in (ExitCode.PREEMPTED, ExitCode.BUDGET_PROJECTED, ExitCode.FORECAST_STOP):
        t = time.perf_counter()
        try:
            save_checkpoint(run, step)
            log.warning("%s at step %d: checkpoint in %.2f s, exit %d", END_REASONS[code], step,
                        time.perf_counter() - t, int(code))
        except CheckpointError as e:  # the stop stands (a budget stop above all); the older checkpoints remain
            log.error("%s at step %d: %s; exit %d all the same", END_REASONS[code], step, e, int(code))
    else:
        log.error("%s at step %d: exit %d without a checkpoint write", reason, step, int(code))
    run.sink.tags({"x1.end": END_REASONS[code], "x1.end_reason": reason[:500]})
    # RunPod spot gives 5 s after SIGTERM: the checkpoint comes first, the metrics get what is left
    # (anything unsent is spooled to disk and sent by the next start).
    run.sink.close(MLFLOW_STATUS[int(code)], timeout=3.0 if code == ExitCode.PREEMPTED else 30.0)
    # The stop record the next start measures its downtime from: the SIGTERM's time, else this exit's.
    run.sink.heartbeat.beat(step, "stopped", signal_time=run.stop.at)
    return int(code)


def diverged(run: Run, step: int) -> int:
    log.error("diverged: %d non-finite steps in a row at step %d. Check the data's token ids, the fp32 master "
              "weights and the learning rate; resume from the last checkpoint with a lower lr to continue.",
              run.state.nonfinite_in_row, step)
    run.sink.tags({"x1.end": END_REASONS[ExitCode.DIVERGED],
                   "x1.end_reason": f"{run.state.nonfinite_in_row} non-finite steps in a row at step {step}"})
    run.sink.close("FAILED", timeout=30.0)
    return int(ExitCode.DIVERGED)


def finish(run: Run, step: int) -> int:
    save_checkpoint(run, step)
    model_state, optim_state = full_states(run)
    if run.dist.is_main:
        run.checkpointer.save_final(model_state, optim_state, step, run.state.config_hash)
        log.info("finished: %s", run.checkpointer.root / "final.safetensors")
    run.sink.heartbeat.beat(step, "finished")
    # x1.end_reason too: an earlier process of this run may have left "preempted" there.
    run.sink.tags({"x1.end": END_REASONS[ExitCode.FINISHED], "x1.end_reason": f"total steps reached (step {step})"})
    run.sink.close("FINISHED", timeout=60.0)
    return int(ExitCode.FINISHED)


# ---------------------------------------------------------------------------------------------
# Setup: config → data → checkpoint → budget → model → optimizer → tracking → compile


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m x1_pretrain.train",
        description="Train the X1 decoder. Exit codes: 0 finished, 75 preempted, 76/77 budget, 78 launch refused, "
        "79 diverged, 80 forecast stop (asked for), 2 bad config/data. Run under torchrun for several GPUs.",
    )
    p.add_argument("--config", required=True, help="run config YAML (configs/x1-50m-a100.yaml)")
    p.add_argument("--set", action="append", default=[], metavar="SECTION.FIELD=VALUE",
                   help="override any config field, e.g. --set optim.lr=1e-3 (repeatable)")
    seed = p.add_argument_group("the run's flags")
    seed.add_argument("--data-dir", help="folder with train.bin, val.bin, meta.json")
    seed.add_argument("--ckpt-dir", help="checkpoints folder (step_XXXXXXXX/, latest, final.safetensors)")
    seed.add_argument("--mlflow-uri", help="file://, sqlite:// or http:// tracking URI")
    seed.add_argument("--total-steps", type=int, help="optimizer steps (the cosine ends here)")
    seed.add_argument("--ckpt-every", type=int, help="steps between checkpoints")
    seed.add_argument("--eval-every", type=int, help="steps between val evals")
    seed.add_argument("--log-every", type=int, help="steps between metric logs")
    seed.add_argument("--resume-from-latest", action="store_true",
                      help="continue from the newest complete, verified checkpoint (no step folder: start fresh; "
                      "step folders of which none verifies: exit 2 naming each, nothing touched)")
    seed.add_argument("--inject-spike-at-step", type=int, metavar="N",
                      help="replace the batches of steps N..N+4 with rare-token sequences (skipped after a natural spike)")
    budget = p.add_argument_group("budget guard (on only with --budget-cap-usd)")
    budget.add_argument("--budget-cap-usd", type=float, help="hard cap: projected over it → checkpoint, exit 76; spent over it → exit 77")
    budget.add_argument("--budget-curr-cost-uri", help="budget.json path or the sidecar's /budget URL")
    budget.add_argument("--budget-alert-usd", type=float, help="email + Slack once per crossing (30)")
    budget.add_argument("--budget-check-every-min", type=float, help="minutes between readings (30)")
    budget.add_argument("--budget-stale-after-min", type=float, help="a reading older than this alerts as stale (15)")
    budget.add_argument("--max-price-usd-per-hr", type=float, help="refuse to launch above this price (1.40)")
    budget.add_argument("--planned-rate-usd-per-hr", type=float, help="planned price: the pre-launch sentence; 1.2x over it warns")
    budget.add_argument("--planned-hours", type=float, help="planned hours for the pre-launch sentence")
    budget.add_argument("--expected-tokens-per-sec", type=float, metavar="N",
                        help="tokens/s this run expects (all GPUs): the figure given to `plan --tokens-per-sec`. "
                        "Default: plan's figure for the GPU found; none on a CPU. The launch check and the default "
                        "throughput floor use it")
    budget.add_argument("--dry-run-budget", action="store_true", help="walk simulated readings through every rule, print, exit 0")
    ops = p.add_argument_group("operations")
    ops.add_argument("--metrics-port", type=int, help="Prometheus /metrics port (9791; 0 disables)")
    ops.add_argument("--metrics-host", help="address /metrics listens on (127.0.0.1; 0.0.0.0 inside a container)")
    ops.add_argument("--heartbeat-file", help="heartbeat JSON the watchdog reads (/workspace/logs/heartbeat.json)")
    ops.add_argument("--allow-config-change", action="store_true",
                     help="resume even though the config hash (model, optimizer, schedule) changed")
    ops.add_argument("--allow-data-change", action="store_true",
                     help="resume on another corpus than the checkpoint trained on (recorded in it and on MLflow)")
    ops.add_argument("--allow-tracking-change", action="store_true",
                     help="resume against another MLflow server: a new MLflow run there, tagged with the old one")
    ops.add_argument("--measured-peak-tflops", type=float, help="this GPU's measured bf16 matmul peak, for a second MFU")
    ops.add_argument("--run-name", help="MLflow run name (default: config name and start time)")
    ops.add_argument("--forecast-band", type=float, nargs=2, metavar=("LO", "HI"),
                     help="final val loss band the forecast is judged against: an alert when its interval lies "
                          "wholly outside, once per crossing (default 3.20 3.50, the definition of done's)")
    ops.add_argument("--stop-when-forecast-misses-band", action="store_true",
                     help="stop (checkpoint, exit 80) when the forecast's interval lies wholly outside --forecast-band")
    ops.add_argument("--run-dir", metavar="DIR",
                     help="after a final exit (finished, budget stop, divergence) write the run folder here "
                          "(python -m x1_pretrain.finish: export_run, the spike post-mortem draft, dod)")
    return p


def config_from_args(args: argparse.Namespace) -> RunConfig:
    overrides = {SEED_FLAGS[k]: v for k, v in vars(args).items() if k in SEED_FLAGS and v is not None}
    return load_config(args.config, args.set, overrides)


def credentials_out_of_config(cfg: RunConfig) -> RunConfig:
    """The config with no user:password left in its URIs: they go to the environment, where the
    clients read them, so no param, state file, log line or error of the run can carry them."""
    try:
        mlflow_uri = move_uri_credentials_to_env(cfg.tracking.mlflow_uri, "MLFLOW_TRACKING_USERNAME",
                                                 "MLFLOW_TRACKING_PASSWORD", "tracking.mlflow_uri (--mlflow-uri)")
        cost_uri = move_uri_credentials_to_env(cfg.budget.curr_cost_uri, COST_URI_USERNAME_ENV, COST_URI_PASSWORD_ENV,
                                               "budget.curr_cost_uri (--budget-curr-cost-uri)")
    except ValueError as e:
        raise ConfigError(str(e)) from None
    return cfg.model_copy(update={
        "tracking": cfg.tracking.model_copy(update={"mlflow_uri": mlflow_uri}),
        "budget": cfg.budget.model_copy(update={"curr_cost_uri": cost_uri}),
    })


def git_sha() -> str:
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5,
                             cwd=Path(__file__).resolve().parent)
        return out.stdout.strip() or "unknown"
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"


def versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    out = {"torch": torch.__version__, "python": sys.version.split()[0]}
    for pkg in ("flash-attn", "transformers", "numpy", "tiktoken", "mlflow-skinny", "mlflow", "safetensors", "torchao"):
        try:
            out[pkg] = version(pkg)
        except PackageNotFoundError:
            out[pkg] = "absent"
    return out


def flatten(d: dict[str, Any], prefix: str = "") -> dict[str, str]:
    out: dict[str, str] = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(flatten(v, key + "."))
        else:
            out[key] = str(v)
    return out


def autocast_factory(cfg: RunConfig, device: torch.device):
    if cfg.train.precision == "bf16-mixed":
        return lambda: torch.autocast(device_type=device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def resume_point(args, cfg: RunConfig, checkpointer: Checkpointer, d: D.Dist):
    """The checkpoint to continue from (None: fresh start), agreed on by every rank.

    --resume-from-latest takes the newest folder that verifies and loads, skipping newer broken
    ones with a warning (docs/DESIGN.md §5). When step folders exist and none of them does, the run is
    refused (exit 2) naming each folder and what is wrong with it: starting over would overwrite
    them, and that is a person's decision, never a relaunch's. Nothing is moved or deleted. A folder
    whose optimizer state is refused (objects whose loading would run code) stops the resume there,
    exit 2: it was written by someone, not damaged, and an older folder is no answer to that."""
    path, problem, loaded = None, None, None
    if d.is_main:
        existing = checkpointer.step_dirs()
        if args.resume_from_latest:
            failed: list[tuple[Path, str]] = []
            for candidate in existing:
                why = checkpointer.verify(candidate)
                if why is None:
                    try:
                        loaded = checkpointer.load(candidate, map_location="cpu")
                    except CheckpointRefused as e:  # written by someone, not damaged: never skipped
                        problem = str(e)
                        break
                    except CheckpointError as e:
                        why = str(e).removeprefix(f"{candidate}: ")
                if why is None:
                    path = candidate
                    break
                failed.append((candidate, why))
            if path is not None:
                for bad, why in failed:
                    log.warning("skipping checkpoint %s: %s", bad, why)
            elif existing and problem is None:
                problem = (f"{checkpointer.root}: none of its {len(existing)} checkpoint folder(s) verifies: "
                           + "; ".join(f"{bad.name}: {why}" for bad, why in failed)
                           + ". Nothing was moved, overwritten or deleted. To start this run over, give a new "
                           "--ckpt-dir, or move these folders away yourself")
        elif existing:
            problem = (f"{checkpointer.root} already holds checkpoints ({existing[0].name}, ...): pass "
                       "--resume-from-latest to continue that run, or give a new --ckpt-dir")
    # Every rank learns rank 0's verdict: a rank that raised alone would leave the others waiting.
    path, problem = D.broadcast_object(d, (str(path) if path else None, problem))
    if problem is not None:
        raise DataOrConfigError(problem)
    if path is None:
        return None
    if loaded is None:  # the other ranks: the folder rank 0 verified and loaded
        try:
            loaded = checkpointer.load(Path(path), map_location="cpu")
        except CheckpointError as e:
            raise DataOrConfigError(str(e)) from None
    if loaded.state.config_hash != cfg.config_hash():
        old_total = total_steps_change(cfg, loaded.state)
        if old_total is not None:
            replan(args, cfg, loaded, old_total)
        else:
            msg = (f"{path}: config hash {loaded.state.config_hash[:12]} differs from this config's "
                   f"{cfg.config_hash()[:12]} (model, optimizer or schedule changed)")
            if not args.allow_config_change:
                raise DataOrConfigError(msg + "; pass --allow-config-change to continue anyway")
            log.warning("%s; continuing (--allow-config-change)", msg)
    if loaded.state.step > cfg.train.total_steps:
        raise DataOrConfigError(
            f"train.total_steps: {cfg.train.total_steps} is below step {loaded.state.step} of the checkpoint "
            f"{loaded.path.name}: a run cannot go back, and its final.safetensors would be rewritten from a later "
            f"step than it says; give --total-steps {loaded.state.step} or more (nothing was written)")
    return loaded


def check_provenance(args, cfg: RunConfig, loaded, corpus: dict[str, Any]) -> None:
    """The checkpoint is this run's, made on this corpus and tracked on this server; changes that a
    flag accepts are recorded in the state (and, through it, on the MLflow run). Exit 2 otherwise."""
    state = loaded.state
    try:
        provenance.check_run(Path(cfg.checkpoint.dir), loaded.path, state.run_id, state.run_started)
        changes = [provenance.check_corpus(loaded.path, state.corpus, corpus, state.step, args.allow_data_change),
                   provenance.check_tracking(loaded.path, (state.config.get("tracking") or {}).get("mlflow_uri"),
                                             state.mlflow_run_id, cfg.tracking.mlflow_uri, state.step,
                                             args.allow_tracking_change)]
    except provenance.ProvenanceError as e:
        raise DataOrConfigError(str(e)) from None
    for change in filter(None, changes):
        log.warning("resuming with another %s than %s's (--allow-%s-change): %s -> %s", change["what"],
                    loaded.path.name, change["what"], change["from"], change["to"])
        state.changes.append(change)
        if change["what"] == "tracking":
            state.mlflow_run_id = None  # a new MLflow run on the new server


BUDGET_STOP_FILE = "budget-stop.json"  # in the checkpoint folder: the last budget stop and the steps that fit


def write_budget_stop(ckpt_root: Path, step: int, total_steps: int, fits: int | None, reason: str,
                      config_hash: str) -> None:
    """What a re-plan is judged against: the step the run stopped at for its budget, its total
    steps then, and the total steps that fit the cap at that reading."""
    from datetime import datetime, timezone

    try:
        write_json_atomic(ckpt_root / BUDGET_STOP_FILE, {
            "step": step, "total_steps": total_steps, "fits_steps": fits, "reason": reason[:1000],
            "config_hash": config_hash, "time_utc": datetime.now(timezone.utc).isoformat(timespec="seconds")})
    except OSError as e:  # the stop stands; a re-plan then needs --allow-config-change
        log.error("%s not written (%s): continuing with fewer steps will need --allow-config-change",
                  ckpt_root / BUDGET_STOP_FILE, e)


def read_budget_stop(ckpt_root: Path) -> dict[str, Any] | None:
    import json

    try:
        stop = json.loads((ckpt_root / BUDGET_STOP_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError):
        return None
    ok = isinstance(stop, dict) and all(isinstance(stop.get(k), int) and not isinstance(stop.get(k), bool)
                                        for k in ("step", "total_steps"))
    return stop if ok else None


def total_steps_change(cfg: RunConfig, state: TrainerState) -> int | None:
    """The checkpoint's total steps when they are the only change of the run's math (model, data
    order, optimizer, the rest of the schedule all the same); None otherwise."""
    old = (state.config.get("train") or {}).get("total_steps") if isinstance(state.config, dict) else None
    if not isinstance(old, int) or isinstance(old, bool) or old == cfg.train.total_steps:
        return None
    as_before = cfg.model_copy(update={"train": cfg.train.model_copy(update={"total_steps": old})})
    return old if as_before.config_hash() == state.config_hash else None


def replan(args, cfg: RunConfig, loaded, old_total: int) -> None:
    """A resume whose only change is train.total_steps: a re-plan. Accepted without
    --allow-config-change after a budget stop (or a refused launch) when the new total is no more
    than what fitted the cap then; recorded in the trainer state (then MLflow and the manifest),
    the cosine re-targeted from this step (lr_progress)."""
    from datetime import datetime, timezone

    state, new_total = loaded.state, cfg.train.total_steps
    stop = read_budget_stop(Path(cfg.checkpoint.dir))
    after_stop = stop is not None and stop["step"] >= state.step and stop["total_steps"] == old_total
    fits = stop.get("fits_steps") if after_stop else None
    if after_stop and isinstance(fits, int) and new_total <= fits:
        why = f"budget stop at step {stop['step']} ({stop.get('time_utc')}): --total-steps {fits} fitted the cap"
    elif args.allow_config_change:
        why = "--allow-config-change"
    elif after_stop:
        raise DataOrConfigError(
            f"--total-steps {new_total}: more than the {fits if fits is not None else '(unknown)'} steps that fitted "
            f"the cap at the budget stop of step {stop['step']} ({BUDGET_STOP_FILE} in {cfg.checkpoint.dir}); give "
            f"--total-steps {fits if fits is not None else 'N'} or fewer, or pass --allow-config-change to go over it")
    else:
        raise DataOrConfigError(
            f"{loaded.path}: train.total_steps changed from {old_total} to {new_total} and this run did not stop for "
            f"its budget; pass --allow-config-change to re-plan it anyway (the cosine is re-targeted from step "
            f"{state.step}, the learning rate unchanged there)")
    previous = state.replans[-1] if state.replans else None
    progress = lr_progress(state.step, cfg.optim, old_total, previous)
    lr = lr_at(state.step, cfg.optim, old_total, previous)
    state.replans.append({"step": state.step, "old_total_steps": old_total, "new_total_steps": new_total,
                          "time_utc": datetime.now(timezone.utc).isoformat(timespec="seconds"), "why": why,
                          "lr_at_step": lr, "lr_progress": progress})
    loaded.replanned = True
    state.config_hash = cfg.config_hash()  # the change is recorded: later resumes of this plan need nothing
    log.warning("re-plan at step %d: train.total_steps %d -> %d (%s); the cosine is re-targeted from this step: lr "
                "%.3e here as before, min_lr %.1e at step %d", state.step, old_total, new_total, why, lr,
                cfg.optim.min_lr, new_total)


def check_paths(cfg: RunConfig) -> None:
    """The config's paths are of the right kind before anything is read or written: a folder
    where a folder goes, a file where a file goes, and a parent that can be created."""
    def where(label: str, path: str, folder: bool) -> None:
        try:
            p = Path(path)
            if p.exists() or p.is_symlink():
                if folder and not p.is_dir():
                    raise DataOrConfigError(f"{label}: {p} exists and is not a folder")
                if not folder and p.is_dir():
                    raise DataOrConfigError(f"{label}: {p} is a folder, expected a file")
                if folder and not os.access(p, os.W_OK | os.X_OK):
                    raise DataOrConfigError(f"{label}: {p} is not writable")
                return
            parent = p.parent
            while not parent.exists() and parent != parent.parent:
                parent = parent.parent
        except (OSError, ValueError) as e:  # a NUL byte, a name too long, a loop of symlinks
            raise DataOrConfigError(f"{label}: {path!r} is not a usable path ({e})") from None
        if not parent.is_dir():
            raise DataOrConfigError(f"{label}: {p} cannot be created: {parent} is not a folder")
        if not os.access(parent, os.W_OK | os.X_OK):
            raise DataOrConfigError(f"{label}: {p} cannot be created: {parent} is not writable")

    where("checkpoint.dir (--ckpt-dir)", cfg.checkpoint.dir, folder=True)
    where("tracking.heartbeat_file (--heartbeat-file)", cfg.tracking.heartbeat_file, folder=False)
    data = Path(cfg.data.dir)
    if data.exists() and not data.is_dir():
        raise DataOrConfigError(f"data.dir (--data-dir): {data} exists and is not a folder")
    uri = cfg.budget.curr_cost_uri
    if cfg.budget.cap_usd is not None and not uri.startswith(("http://", "https://")) and Path(uri).is_dir():
        raise DataOrConfigError(f"budget.curr_cost_uri (--budget-curr-cost-uri): {uri} is a folder, expected budget.json")


def check_device(cfg: RunConfig) -> None:
    """train.device=cuda needs a GPU this process can use (under torchrun, one per local rank); on
    a GPU host (auto too), CUDA must initialise: a driver too old for this torch's CUDA is named
    here, exit 2, rather than a crash later or a 50M run quietly on the CPU."""
    if cfg.train.device == "cpu":
        return
    if (problem := preflight.cuda_init_problem()) is not None:
        raise DataOrConfigError(f"train.device: {cfg.train.device}: {problem}")
    if cfg.train.device != "cuda":
        return
    if not torch.cuda.is_available():
        raise DataOrConfigError("train.device: cuda, but no CUDA GPU is usable here (torch.cuda.is_available() is "
                                "False: no GPU, no driver, or a CPU build of torch); use --set train.device=auto or cpu")
    local = os.environ.get("LOCAL_RANK", "0")
    count = torch.cuda.device_count()
    if not local.isdigit() or int(local) >= count:
        raise DataOrConfigError(f"train.device: cuda, but LOCAL_RANK={local} and only {count} GPU(s) are visible")


def check_space(checkpointer: Checkpointer, loaded, model: torch.nn.Module) -> None:
    """Room for one more checkpoint, found before training: a save that fails on a full disk
    costs the steps since the last one, and a relaunch into the same full disk would train them
    again only to fail again. Failing here, in seconds, lets the watchdog's give-up rule end it."""
    if loaded is not None:
        need = sum(f.stat().st_size for f in loaded.path.iterdir() if f.is_file())
    else:  # fp32 weights + AdamW's two fp32 moments, plus the state and marker
        need = sum(p.numel() for p in model.parameters()) * 4 * 3 + (1 << 20)
    checkpointer.check_space(need)


def earlier_start(cfg: RunConfig) -> dict[str, Any]:
    """What a start of this same run (same config hash) that died before its first checkpoint left
    in mlflow-run.json: its MLflow run id, tracking URI and start time. {} when there is none."""
    try:
        saved = json.loads((Path(cfg.checkpoint.dir) / "mlflow-run.json").read_text())
    except (OSError, ValueError, RecursionError):
        return {}
    if not isinstance(saved, dict) or saved.get("config_hash") != cfg.config_hash():
        return {}
    started = saved.get("started")
    ok = isinstance(saved.get("run_id"), str) and (started is None or (
        isinstance(started, (int, float)) and not isinstance(started, bool) and math.isfinite(started)))
    return saved if ok else {}


def build_tracking(cfg: RunConfig, d: D.Dist, state: TrainerState, run_name: str,
                   extra_tags: dict[str, str] | None = None):
    from x1_pretrain.tracking import Heartbeat, MetricsSink, MlflowLogger, NullSink, PrometheusMetrics

    # Several hosts: every host's first process beats, for that host's watchdog, saying which it is.
    node = {"rank": d.rank, "node_rank": d.node.rank, "nnodes": d.node.count, "hostname": d.node.hostname}
    node = node if d.node.count > 1 else None
    if not d.is_main:
        return NullSink(Heartbeat(cfg.tracking.heartbeat_file, node) if node and d.local_rank == 0 else None)
    ckpt_root = Path(cfg.checkpoint.dir)
    ckpt_root.mkdir(parents=True, exist_ok=True)
    run_file = ckpt_root / "mlflow-run.json"

    def remember(run_id: str) -> None:
        write_json_atomic(run_file, {"run_id": run_id, "config_hash": state.config_hash, "uri": cfg.tracking.mlflow_uri,
                                     "started": state.run_started})

    run_id = state.mlflow_run_id
    if run_id is None:  # an earlier start of this run died, or checkpointed, before MLflow's first answer
        earlier = earlier_start(cfg)
        same_run = state.step == 0 or earlier.get("started") == state.run_started
        run_id = earlier.get("run_id") if same_run and earlier.get("uri") == cfg.tracking.mlflow_uri else None
    tags = {"x1.config_hash": state.config_hash, "x1.git_sha": git_sha(), "x1.world_size": str(d.world_size),
            "x1.nnodes": str(d.node.count),
            "x1.ckpt_dir": str(Path(cfg.checkpoint.dir).resolve()), "x1.data_dir": str(Path(cfg.data.dir).resolve()),
            "x1.seed": str(cfg.train.seed), "x1.config_name": cfg.name}
    tags.update({f"x1.version.{k}": v for k, v in versions().items()})
    tags.update(extra_tags or {})
    tags["x1.run_id"] = state.run_id
    if state.changes:  # what --allow-data-change / --allow-tracking-change let through, oldest first
        tags["x1.provenance_changes"] = json.dumps(state.changes, sort_keys=True)
        moved = [c for c in state.changes if c["what"] == "tracking"]
        if moved:
            tags["x1.previous_mlflow_run"] = f"{moved[-1]['from']} {moved[-1]['previous_run_id']}"
    mlflow = MlflowLogger(
        cfg.tracking.mlflow_uri, cfg.tracking.experiment, run_id=run_id, run_name=run_name,
        params=flatten(cfg.resolved()), tags=tags, spool_path=ckpt_root / "mlflow-spool.jsonl", on_run_id=remember,
    )
    if state.changes:  # a resumed run is not re-tagged at start: said to it explicitly
        mlflow.set_tags({k: tags[k] for k in ("x1.provenance_changes", "x1.previous_mlflow_run", "x1.data_dir")
                         if k in tags})
    mlflow.start()
    prom = PrometheusMetrics(cfg.tracking.metrics_port, cfg.tracking.metrics_host)
    prom.node.labels(**d.node.labels()).set(1)
    return MetricsSink(mlflow, prom, Heartbeat(cfg.tracking.heartbeat_file, node))


def compile_choice(cfg: RunConfig, ckpt_root: Path, previous_heartbeat) -> str | None:
    """torch.compile mode to use, or None for eager. A process that died while compiling (its
    heartbeat says "compiling") makes the next start use mode default; a second such death, eager."""
    if not cfg.train.compile:
        return None
    marker = ckpt_root / "compile-deaths.json"
    deaths = 0
    if marker.is_file():
        try:
            saved = json.loads(marker.read_text()).get("deaths", 0)
            deaths = saved if isinstance(saved, int) and not isinstance(saved, bool) and saved >= 0 else 0
        except (OSError, ValueError, AttributeError, RecursionError):
            deaths = 0  # a damaged marker: counted again from here
    if previous_heartbeat is not None and previous_heartbeat.phase == "compiling" and previous_heartbeat.pid != os.getpid():
        deaths += 1
        write_json_atomic(marker, {"deaths": deaths})
    if deaths >= 2:
        log.warning("two earlier starts died while compiling: running eager (slower, but it runs)")
        return None
    if deaths == 1 and cfg.train.compile_mode != "default":
        log.warning("an earlier start died while compiling with mode %s: using mode default", cfg.train.compile_mode)
        return "default"
    return cfg.train.compile_mode


def warm_up(run: Run, mode: str | None, ckpt_root: Path) -> None:
    """First forward/backward: compiles (or falls back to eager, and says so), and halves the
    micro-batch on a CUDA out-of-memory (accumulation doubles, tokens per step unchanged)."""
    raw, d = run.raw_model, run.dist
    model = raw
    run.backward_context = compiled_autograd(run, mode)
    while mode is not None or d.device.type == "cuda":  # CPU eager has nothing to find out
        run.sink.heartbeat.beat(run.state.step, "compiling" if mode else "startup")
        model = torch.compile(raw, mode=mode) if mode is not None else raw
        # The first step's batch as the loop gets it (contiguous, on the device) and the loop's
        # backward weight: any difference from the loop's call would compile a second graph at
        # the first real step (~27 s on an H200) instead of here.
        x, y = (t.to(d.device) for t in split_window(run.warmup_batch(run.micro_batch)))
        weight = torch.full((), 1.0 / run.grad_accum, device=d.device)
        t = time.perf_counter()
        try:
            # Compiled autograd compiles a second graph for a backward that adds into existing
            # gradients: run that one here too, so that a failure falls back now, not mid-run.
            copies = run.bf16_weights.refresh() if run.bf16_weights is not None else None
            for _ in range(1 if run.backward_context is contextlib.nullcontext else 2):
                forward_backward(run, model, x, y, weight, copies)
            failed = 0
        except torch.cuda.OutOfMemoryError:
            failed = 2
        except Exception as e:  # noqa: BLE001 - any compile failure: eager is slower but runs
            if mode is None:
                raise
            log.warning("torch.compile failed (%s): falling back to eager", str(e).splitlines()[0][:300])
            failed = 1
        raw.zero_grad(set_to_none=True)
        failed = D.agree(d, failed)
        if failed == 1:
            mode = None
            model = raw  # on a CPU the loop ends here, with no eager pass to set it
            run.backward_context = contextlib.nullcontext
            torch._dynamo.reset()
            continue
        if failed == 2:
            if run.micro_batch <= 1:
                raise DataOrConfigError("CUDA out of memory at micro-batch 1: the model does not fit this GPU")
            halve_micro_batch(run)
            torch.cuda.empty_cache()
            continue
        break
    run.cudagraphs = mode in levers.CUDA_GRAPH_MODES
    if run.cudagraphs:  # see the loop's zero_grad
        for p in raw.parameters():
            p.grad = torch.zeros_like(p)
    if mode is not None:
        log.info("torch.compile mode=%s: first step in %.1f s", mode, time.perf_counter() - t)
        (ckpt_root / "compile-deaths.json").unlink(missing_ok=True)
    run.model = D.wrap(model, d, run.cfg.train.distributed) if run.cfg.train.distributed == "ddp" else model


def compiled_autograd(run: Run, mode: str | None):
    """The backward's context: compiled autograd when the config asks for it and it can apply.

    torch.compile alone compiles the backward of the forward it traced; the fp32 gradient
    accumulation (`.grad += g`) still runs as separate eager kernels, once per micro-batch and
    parameter. Compiled autograd traces the whole backward, accumulation included, so the
    compiler can fuse the bf16 -> fp32 cast and the add into the kernels around them.
    """
    if not run.cfg.train.compiled_autograd or mode is None:  # off, or switched off by its lever probe
        return contextlib.nullcontext
    if run.dist.enabled or mode != "default":
        log.info("train.compiled_autograd is off: it runs in one process with compile mode default "
                    "(here: world size %d, mode %s)", run.dist.world_size, mode)
        return contextlib.nullcontext
    from torch._dynamo import compiled_autograd as ca

    log.info("compiled autograd: the backward and the gradient accumulation compile as one graph")
    compiler = torch.compile(backend="inductor")
    return lambda: ca._enable(compiler)


def halve_micro_batch(run: Run) -> None:
    old = run.micro_batch
    run.cfg = run.cfg.model_copy(update={"train": run.cfg.train.model_copy(update={"micro_batch_size": old // 2})})
    run.grad_accum = run.cfg.grad_accum(run.dist.world_size)
    run.batches.close()
    run.batches = run.make_batches(run.state.step, run.micro_batch, run.grad_accum)
    log.warning("CUDA out of memory on the first step: micro-batch %d -> %d, gradient accumulation -> %d "
                "(tokens per step unchanged)", old, run.micro_batch, run.grad_accum)


def setup(args: argparse.Namespace, cfg: RunConfig, stop: StopSignal) -> Run | int:
    from x1_pretrain import data as data_mod
    from x1_pretrain.budget_guard import BudgetGuard

    started = time.monotonic()  # the start-up a restart costs is measured from here (budget_guard.Pace)
    check_device(cfg)
    check_paths(cfg)
    d = D.init(cfg.train.device)
    if not d.is_main:  # one voice: rank 0 logs, the others speak only of problems
        logging.getLogger().setLevel(logging.WARNING)
    grad_accum = cfg.grad_accum(d.world_size)  # ConfigError when the world size does not divide
    # Each lever probed once: what this torch and this GPU (or the architecture train.gpu_arch names)
    # cannot run is switched off in the config, with a line saying so (x1_pretrain.levers).
    features = levers.probe(d.device, cfg.train.gpu_arch)
    cfg, lever_table = levers.resolve(cfg, features, d.world_size)
    if d.is_main:
        lever_table.log()
    if cfg.train.float8 != "off":  # before anything is read or written
        from x1_pretrain.float8 import unsupported

        problem = unsupported(d.device) or levers.float8_problem(features)
        if problem is not None:
            raise DataOrConfigError(f"train.float8={cfg.train.float8}: {problem}; or --set train.float8=off")
    # One trainer per checkpoint folder (x1_pretrain.lease), taken before anything is written there.
    code = D.agree(d, take_trainer_lease(cfg.checkpoint.dir) if d.is_main else 0)
    if code:
        return code
    seed_everything(cfg.train.seed)
    if d.device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    else:
        # Bit-exact CPU resumes need the same reductions run to run.
        torch.use_deterministic_algorithms(True, warn_only=True)

    if d.is_main:  # rank 0 checks the token ids once (cached); the others then find the verdict
        data_mod.open_token_data(cfg.data.dir, cfg.model.vocab_size)
    D.barrier(d)
    tokens = data_mod.open_token_data(cfg.data.dir, cfg.model.vocab_size)
    val = data_mod.val_windows(tokens.val, cfg.model.seq_len, cfg.train.eval_windows, cfg.train.seed)

    guard = BudgetGuard.from_config(cfg.budget) if d.is_main else BudgetGuard.from_config(cfg.budget.model_copy(update={"cap_usd": None}))

    checkpointer = Checkpointer(cfg.checkpoint.dir, cfg.checkpoint.keep_last, cfg.model)
    loaded = resume_point(args, cfg, checkpointer, d)
    corpus = provenance.corpus_identity(cfg.data.dir, tokens.meta)
    if loaded is not None:
        check_provenance(args, cfg, loaded, corpus)
        state = loaded.state
        state.restarts += 1
        state.config = cfg.resolved()
        try:
            restore_rng(state.rng)
        except CheckpointError as e:
            raise DataOrConfigError(f"{loaded.path}: {e}") from None
        state.run_started = state.run_started or time.time() - state.train_seconds  # older checkpoints
        log.info("resuming from %s at step %d (%d tokens seen)", loaded.path, state.step, state.tokens_seen)
    else:
        state = TrainerState(step=0, tokens_seen=0, config_hash=cfg.config_hash(), config=cfg.resolved(),
                             sampler={}, world_size=d.world_size,
                             run_started=earlier_start(cfg).get("started") or time.time())
    state.world_size = d.world_size
    # The run's id: the checkpoint's, else that of an earlier start of this run (same start time).
    state.run_id = state.run_id or provenance.recorded_run_id(Path(cfg.checkpoint.dir), state.run_started) \
        or provenance.new_run_id()
    state.corpus = corpus
    if d.is_main:  # every start: the checkpoint dir names the run it holds (a fresh start, a new one)
        provenance.remember_run(Path(cfg.checkpoint.dir), state.run_id, state.run_started)
    replanned = loaded is not None and loaded.replanned
    if state.step >= cfg.train.total_steps and loaded is None:
        raise DataOrConfigError(f"train.total_steps: {cfg.train.total_steps} leaves nothing to train")

    # Budget before anything expensive (no model yet): a refused launch costs nothing. With the
    # step known, the guard also judges whether the steps left can finish under the cap at the
    # plan's throughput for this GPU (on a CPU there is none: the first steady interval decides).
    expected = expected_throughput(cfg, d.device, d.world_size)
    pace = Pace(total_steps=cfg.train.total_steps, tokens_per_step=cfg.train.tokens_per_step,
                eval_every=cfg.train.eval_every, ckpt_every=cfg.checkpoint.every,
                eval_tokens=cfg.train.eval_windows * cfg.model.seq_len, start_step=state.step,
                # a re-plan's stop was planned: only interruptions are extrapolated over the steps left
                restarts=max(state.restarts - len(state.replans), 0),
                expected_tokens_per_sec=expected[0] if expected else None,
                expected_source=expected[1] if expected else "", started=started)
    pre = guard.prelaunch(pace)
    if pre.exit_code == ExitCode.LAUNCH_REFUSED and pre.fits_steps is not None and state.step > 0 and d.is_main:
        # A resume refused for its projection: the same re-plan as after a budget stop continues it.
        write_budget_stop(Path(cfg.checkpoint.dir), state.step, cfg.train.total_steps, pre.fits_steps, pre.reason,
                          state.config_hash)
    code = D.agree(d, pre.exit_code or 0)
    if code:
        log.error("launch refused: %s", pre.reason if pre.exit_code else "rank 0 refused the launch")
        return code
    floor, floor_source = throughput_floor(cfg, expected)
    log.info("throughput floor: %s", f"{floor:.0f} tokens/s ({floor_source}), judged on steady intervals of the "
             "first hour" if floor else floor_source)

    raw = Transformer(cfg.model)
    if loaded is not None:
        try:
            raw.load_state_dict(loaded.model_state, strict=True)
        except RuntimeError:  # a verified folder whose tensors are not this model's
            from x1_pretrain.checkpoint import MODEL_FILE
            from x1_pretrain.weights import state_mismatch

            raise DataOrConfigError(f"{loaded.path / MODEL_FILE}: the weights do not fit this config's model: "
                                    f"{state_mismatch(raw, loaded.model_state)}") from None
    if d.is_main:
        check_space(checkpointer, loaded, raw)
    raw.to(d.device)
    backend = attention_backend(cfg.model, d.device)
    raw.set_attention_backend(backend)
    raw.use_kernels(use_kernels(cfg.train.kernels, d.device))
    raw.use_cublaslt(cfg.train.cublaslt != "off" and d.device.type == "cuda")
    if cfg.train.residual == "bf16":
        raw.residual_dtype = torch.bfloat16
    if cfg.train.float8 != "off":
        from x1_pretrain import float8

        float8.convert(raw, cfg.train.float8)
    if cfg.train.distributed == "fsdp2":
        D.wrap(raw, d, "fsdp2")
    fused = cfg.optim.fused == "on" or (cfg.optim.fused == "auto" and d.device.type == "cuda")
    optimizer = torch.optim.AdamW(param_groups(raw, cfg.optim.weight_decay), lr=cfg.optim.lr,
                                  betas=(cfg.optim.beta1, cfg.optim.beta2), eps=cfg.optim.eps, fused=fused)
    if loaded is not None:
        try:
            load_optimizer(raw, optimizer, loaded.optim_state)
        except (KeyError, TypeError, ValueError, RuntimeError) as e:
            why = str(e).splitlines()[0][:1000] if str(e) else ""
            raise DataOrConfigError(f"{loaded.path / OPTIM_FILE}: the optimizer state does not fit this model's "
                                    f"optimizer ({type(e).__name__}: {why})") from None

    sink = build_tracking(cfg, d, state, run_name=args.run_name or f"{cfg.name}-{time.strftime('%Y%m%d-%H%M%S')}",
                          extra_tags=lever_table.tags())
    previous_heartbeat = sink.heartbeat.previous() if d.is_main else None  # before this process's first beat
    sink.heartbeat.beat(state.step, "startup")
    sink.prom.tokens.inc(state.tokens_seen)
    sink.prom.total_steps.set(cfg.train.total_steps)
    sink.prom.progress.set(state.step / cfg.train.total_steps)
    sink.prom.restarts.set(state.restarts)
    info = preflight.collect(d.device, backend, cfg.checkpoint.dir)
    warnings = preflight.warnings_for(info)
    if d.is_main:
        print(preflight.render(info, warnings), file=sys.stderr, flush=True)
        sink.tags({f"x1.preflight.{k}": str(v) for k, v in info.items()})
        if loaded is not None:
            sink.log(state.step, {"restart": 1.0})
        if replanned:  # MLflow keeps params as first logged: the change is a tag and a metric of its own
            r = state.replans[-1]
            sink.tags({f"x1.replan.{len(state.replans)}": json.dumps(r, sort_keys=True),
                       "x1.total_steps": str(cfg.train.total_steps)})
            sink.log(state.step, {"replan_total_steps": float(r["new_total_steps"]),
                                  "replan_old_total_steps": float(r["old_total_steps"])})

    rare = None
    if args.inject_spike_at_step is not None and state.step < args.inject_spike_at_step + 5:
        rare = data_mod.rare_token_ids(tokens.train, cfg.model.vocab_size)
    detector = SpikeDetector.from_state(cfg.train.spike_factor, cfg.train.spike_ema_beta, state.spike)
    injector = SpikeInjector(args.inject_spike_at_step, rare, cfg.train.seed, cfg.model.seq_len, d.rank)

    samples_per_step = cfg.train.tokens_per_step // cfg.model.seq_len
    sampler = data_mod.WindowSampler(tokens.train, cfg.model.seq_len, cfg.train.seed, samples_per_step)

    def make_batches(start: int, micro_batch: int, accum: int):
        def source(step: int, micro: int) -> np.ndarray:
            return sampler.windows(step, data_mod.micro_batch_indices(micro, d.rank, micro_batch, d.world_size))

        keys = ((s, m) for s in range(start, cfg.train.total_steps) for m in range(accum))
        return BatchStream(data_mod.Prefetcher(source, keys, d.device, depth=cfg.data.prefetch,
                                               pin_memory=cfg.data.pin_memory and d.device.type == "cuda"))

    gpu_key = info.get("gpu_key", "cpu")
    run = Run(
        cfg=cfg, dist=d, raw_model=raw, model=raw, optimizer=optimizer,
        batches=make_batches(state.step, cfg.train.micro_batch_size, grad_accum),
        make_batches=make_batches, warmup_batch=lambda b: sampler.windows(state.step, range(b)), val=val, checkpointer=checkpointer, sink=sink, guard=guard, stop=stop,
        detector=detector, injector=injector, state=state, grad_accum=grad_accum,
        autocast=autocast_factory(cfg, d.device), flops_per_token=flops_per_token(cfg.model),
        peak_tflops=info.get("peak_bf16_tflops", 0.0) if gpu_key != "cpu" else 0.0,
        measured_peak_tflops=args.measured_peak_tflops, pace=pace, floor=floor, floor_source=floor_source,
    )
    run.previous_heartbeat = previous_heartbeat
    run.forecast = forecast_watch(args, cfg, state, d.is_main)
    run.bf16_weights = bf16_weights(cfg, d, raw)
    if loaded is not None:
        run.last_saved_step = state.step  # that checkpoint exists: a SIGTERM now need not rewrite it
    warm_up(run, compile_choice(cfg, Path(cfg.checkpoint.dir), previous_heartbeat), Path(cfg.checkpoint.dir))
    run.throughput = Throughput("resume" if loaded is not None else "start")
    run.compiles = CompileWatch()
    sink.heartbeat.beat(state.step, "training")
    return run


def bf16_weights(cfg: RunConfig, d: D.Dist, model: Transformer) -> Bf16Weights | None:
    """The step's bf16 weights, cast once per optimizer step (train.weight_casts=per-step), where
    they replace autocast's casts exactly: bf16-mixed, one process (FSDP2 holds shards, DDP's
    hooks were not measured with it), no float8 (torchao casts its own weights), and no CUDA
    graphs (a replay copies every input that is not a parameter or buffer into its own memory).
    A trainer's config has been through levers.resolve, which switches weight_casts off in those
    cases with a line saying why; this holds the rule for any other caller too."""
    if cfg.train.weight_casts != "per-step" or cfg.train.precision != "bf16-mixed":
        return None
    if d.enabled or cfg.train.float8 != "off" or cfg.train.compile_mode in levers.CUDA_GRAPH_MODES:
        log.info("train.weight_casts=per-step applies to one process without float8 or CUDA graphs: "
                 "casting at each micro-step")
        return None
    accumulate = cfg.train.grad_accumulation == "in-matmul"
    how = ""
    if accumulate:
        from x1_pretrain.kernels import addmm_into_fp32

        how = ("; weight gradients added in fp32 by their matmuls" if addmm_into_fp32(d.device) else
               "; weight gradients summed in fp32 buffers (this torch's matmul cannot add into fp32 itself: "
               "each product in bf16, then an add, as autograd's accumulation does)")
    log.info("bf16 weights: cast once per optimizer step, shared by its %d micro-steps%s", cfg.grad_accum(d.world_size), how)
    return Bf16Weights(model, torch.bfloat16, accumulate=accumulate)


def use_kernels(choice: str, device: torch.device) -> bool:
    from x1_pretrain.losses import fused_available

    if choice == "torch":
        return False
    if not fused_available(device):
        if choice == "triton":
            log.warning("train.kernels=triton needs Triton on a CUDA GPU: using PyTorch's ops")
        return False
    return True


def optimizer_mismatch(model: torch.nn.Module, state: dict[str, Any]) -> str | None:
    """What in a saved optimizer state does not match `model`'s parameters (a state from a model of
    another width), each tensor named with both shapes; None when every moment fits its parameter."""
    shapes = {name: tuple(p.shape) for name, p in model.named_parameters()}
    per_param = state.get("state")
    if not isinstance(per_param, dict):
        return "no per-parameter 'state' map"
    bad = []
    for name, entry in per_param.items():
        if name not in shapes:
            bad.append(f"{name}: in the file, not a parameter of this model")
            continue
        for key, t in (entry.items() if isinstance(entry, dict) else ()):
            if isinstance(t, torch.Tensor) and t.dim() > 0 and tuple(t.shape) != shapes[name]:
                bad.append(f"{key} of {name}: shape {tuple(t.shape)} in the file, {shapes[name]} in this model")
    if not bad:
        return None
    return "; ".join(bad[:4]) + (f" (and {len(bad) - 4} more)" if len(bad) > 4 else "")


def load_optimizer(model: torch.nn.Module, optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

    if problem := optimizer_mismatch(model, state):  # else AdamW fails at its first step, deep in a kernel
        raise ValueError(problem)
    # The saved groups say how that process ran (fused, foreach); this process decides for itself.
    for group in state.get("param_groups", []):
        for key in ("fused", "foreach", "capturable", "differentiable"):
            group.pop(key, None)
    set_optimizer_state_dict(model, optimizer, optim_state_dict=state,
                             options=StateDictOptions(full_state_dict=True))


def main(argv: list[str] | None = None) -> int:
    setup_logging()
    args = build_parser().parse_args(argv)
    if (too_old := levers.floor_problem()) is not None:  # before any work: nothing read, nothing written
        print(f"error: {too_old}", file=sys.stderr)
        return ExitCode.USAGE
    try:
        cfg = credentials_out_of_config(config_from_args(args))
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return ExitCode.USAGE
    if args.dry_run_budget:
        from x1_pretrain.budget_guard import dry_run

        return dry_run(cfg.budget)
    if args.forecast_band is not None and not (math.isfinite(args.forecast_band[0]) and math.isfinite(args.forecast_band[1])
                                               and 0 <= args.forecast_band[0] < args.forecast_band[1]):
        print(f"error: --forecast-band {args.forecast_band[0]} {args.forecast_band[1]}: LO and HI must be finite, "
              "0 <= LO < HI", file=sys.stderr)
        return ExitCode.USAGE
    if args.inject_spike_at_step is not None and not 0 <= args.inject_spike_at_step < cfg.train.total_steps:
        print(f"error: --inject-spike-at-step {args.inject_spike_at_step} is outside 0..{cfg.train.total_steps - 1}",
              file=sys.stderr)
        return ExitCode.USAGE
    stop = StopSignal()
    run = None
    try:
        from x1_pretrain.data import DataError

        try:
            run = setup(args, cfg, stop)
        except (ConfigError, DataError, DataOrConfigError) as e:
            log.error("%s", e)
            return ExitCode.USAGE
        except CheckpointError:
            raise
        except OSError as e:
            # A path that passed check_paths and still failed (a full disk, a race, a mount gone):
            # said in a line, and a crash to the watchdog (relaunch with backoff, then give up).
            log.error("setup failed: %s; exit 1", e)
            return 1
        if isinstance(run, int):
            return run
        if stop.requested:  # SIGTERM during setup: nothing new to save
            return ExitCode.PREEMPTED
        code = train_loop(run)
        if args.run_dir and run.dist.is_main and code in FINAL_CODES:
            from x1_pretrain.finish import write_run_folder

            write_run_folder(cfg.tracking.mlflow_uri, Path(args.run_dir), run_id=run.sink.run_id,
                             ckpt_dir=Path(cfg.checkpoint.dir))
        return code
    except CheckpointError as e:
        # A full disk above all. Exit 1 is a crash to the watchdog: it relaunches with backoff
        # (space may come back); a relaunch that stops in check_space again, before its first
        # step, with the same error, is a start-up failure: final, alerted (exit 81).
        log.error("%s", e)
        log.error("exit 1: checkpoint not written (the watchdog relaunches; it gives up after --max-restarts)")
        return 1
    finally:
        if run is not None and not isinstance(run, int):
            run.batches.close()
        D.shutdown()


if __name__ == "__main__":
    sys.exit(main())
