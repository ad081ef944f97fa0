"""The loop's small components: the stop signal, the batch stream, throughput and recompile
watches, the Run that holds every component the loop touches, and what it logs each step."""

from __future__ import annotations

import contextlib
import logging
import math
import os
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from x1_common import restarts
from x1_common.contracts import (
    MLFLOW_CLIPPED,
    MLFLOW_GRAD_NORM,
    MLFLOW_HOURS_NEEDED,
    MLFLOW_LOSS,
    MLFLOW_LR,
    MLFLOW_MFU,
    MLFLOW_PARAM_NORM,
    MLFLOW_PROJECTED_OWN_USD,
    MLFLOW_PROJECTED_SIDECAR_USD,
    MLFLOW_PROJECTED_USD,
    MLFLOW_SPENT_USD,
    MLFLOW_TOKENS_PER_SEC,
    MLFLOW_TOKENS_SEEN,
    MLFLOW_TRAIN_HOURS,
    MLFLOW_WALL_HOURS,
    PHASE_TRAINING,
    ExitCode,
    boot_id,
)
from x1_pretrain.checkpoint.store import Checkpointer, TrainerState
from x1_pretrain.config import RunConfig
from x1_pretrain.model.transformer import Bf16Weights, Transformer
from x1_pretrain.ops import cublaslt
from x1_pretrain.train import distributed as D
from x1_pretrain.train.budget_guard import Interval, Pace, Projection
from x1_pretrain.train.spikes import SpikeDetector, SpikeInjector

log = logging.getLogger("x1.train")
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
        self.at_mono: float | None = None  # the same moment on the monotonic clock (the downtime's measure)
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._handle)

    def _handle(self, signum: int, frame: Any) -> None:
        if self.signum is None:
            self.at, self.at_mono = time.time(), time.monotonic()
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
    make_batches: Any  # (start_step, micro_batch, grad_accum[, end_step]) -> a fresh batches iterator
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
    probes: Any = None  # probes.CooldownProbes, or probes.NoProbes when train.cooldown_probes is empty

    @property
    def micro_batch(self) -> int:
        return self.cfg.train.micro_batch_size


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
        MLFLOW_LOSS: loss,
        MLFLOW_LR: lr,
        MLFLOW_GRAD_NORM: grad_norm,
        MLFLOW_PARAM_NORM: param_norm,
        MLFLOW_TOKENS_PER_SEC: tps,
        MLFLOW_MFU: mfu,
        MLFLOW_TOKENS_SEEN: float(run.state.tokens_seen),
        MLFLOW_WALL_HOURS: (time.time() - run.state.run_started) / 3600,  # since the run's first start
        MLFLOW_TRAIN_HOURS: run.state.train_seconds / 3600,
        MLFLOW_CLIPPED: float(grad_norm > run.cfg.optim.grad_clip),
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
    p.loss.set(metrics[MLFLOW_LOSS])
    p.grad_norm.set(grad_norm)
    p.lr.set(lr)
    run.sink.heartbeat.beat(step, PHASE_TRAINING)
    steady = "" if interval.steady else f" (not steady: {'+'.join(interval.not_steady)})"
    log.info("step %d/%d loss %.4f lr %.2e grad %.3f tok/s %.0f%s %s", step, run.cfg.train.total_steps,
             metrics[MLFLOW_LOSS], lr, grad_norm, tps, steady, mfu_text)
    warn_if_slow(run, step, interval)


def log_budget(run: Run, step: int, projection: Projection | None) -> None:
    """Spend and the projection the guard judges (its own, the sidecar's, the larger), to MLflow and
    /metrics: at every budget check and every log step."""
    if projection is None:  # guard off, or no reading yet
        return
    own, hours = projection.own_usd, projection.hours_needed
    metrics = {MLFLOW_SPENT_USD: projection.spent_usd, MLFLOW_PROJECTED_USD: projection.judged_usd,
               MLFLOW_PROJECTED_SIDECAR_USD: projection.sidecar_usd}
    if own is not None and hours is not None:
        metrics.update({MLFLOW_PROJECTED_OWN_USD: own, MLFLOW_HOURS_NEEDED: hours})
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
    if stopped is not None:  # measured on the monotonic clock where the previous process ran on this boot
        stop_mono = previous.signal_mono if stopped.by == "SIGTERM" else previous.mono
        stopped = restarts.on_this_clock(stopped, stop_mono, previous.boot_id, boot_id(), now, time.monotonic())
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
