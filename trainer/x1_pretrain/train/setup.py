"""Set-up, in order: config → data → checkpoint → budget → model → optimizer → tracking → compile.
`setup` builds the Run the loop trains (train/loop.py)."""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import math
import os
import random
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from x1_common.alerts import AlertSender
from x1_common.contracts import MLFLOW_RESTART, PHASE_COMPILING, PHASE_STARTUP, PHASE_TRAINING, ExitCode
from x1_common.fsutil import WriteHealth, write_json_atomic
from x1_pretrain.checkpoint.store import (
    MODEL_FILE,
    OPTIM_FILE,
    Checkpointer,
    CheckpointError,
    TrainerState,
    restore_rng,
)
from x1_pretrain.checkpoint.weights import state_mismatch
from x1_pretrain.config import ConfigError, RunConfig
from x1_pretrain.data import loader as data_mod
from x1_pretrain.data.loader import split_window
from x1_pretrain.model.transformer import Bf16Weights, Transformer, attention_backend, param_groups
from x1_pretrain.ops import cublaslt, float8, levers
from x1_pretrain.ops.float8 import unsupported
from x1_pretrain.ops.kernels import addmm_into_fp32
from x1_pretrain.ops.losses import fused_available
from x1_pretrain.train import distributed as D
from x1_pretrain.train import preflight, provenance
from x1_pretrain.train.accounting import (
    detect_gpu_key,
    expected_tokens_per_sec,
    flops_per_token,
    param_counts,
)
from x1_pretrain.train.accounting import throughput_floor as accounting_floor
from x1_pretrain.train.band import BandError, log_declared
from x1_pretrain.train.band import declared as declared_band
from x1_pretrain.train.band import tag as band_tag
from x1_pretrain.train.budget_guard import BudgetGuard, Pace
from x1_pretrain.train.components import BatchStream, CompileWatch, DataOrConfigError, Run, StopSignal, Throughput
from x1_pretrain.train.forecast import ForecastError, ForecastWatch, Schedule
from x1_pretrain.train.forecast_calibration import (
    RunCurve,
    check_family,
    earlier_run,
    prior_from_ladder,
    prior_from_runs,
)
from x1_pretrain.train.lease import take_trainer_lease
from x1_pretrain.train.loop import forward_backward
from x1_pretrain.train.probes import CooldownProbes
from x1_pretrain.train.resume import check_provenance, load_optimizer, resume_point, write_budget_stop
from x1_pretrain.train.spikes import SpikeDetector, SpikeInjector
from x1_pretrain.train.tracking import Heartbeat, MetricsSink, MlflowLogger, NullSink, PrometheusMetrics

log = logging.getLogger("x1.train")


def throughput_floor(cfg: RunConfig, expected: tuple[float, str] | None) -> tuple[float, str]:
    """The floor in tokens/s and where it comes from (accounting.throughput_floor: plan shows the same)."""
    return accounting_floor(cfg.train, expected[0] if expected else None)


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


def this_run_curve(cfg: RunConfig) -> RunCurve:
    """This run as the earlier runs' family law sees it: its schedule, size and tokens a step."""
    return RunCurve("this run", Schedule.from_config(cfg.optim, cfg.train.total_steps), np.zeros(0), np.zeros(0),
                    np.zeros(0), n_params=float(param_counts(cfg.model)["total"]), tokens_per_step=cfg.train.tokens_per_step)


def earlier_runs(args: argparse.Namespace, cfg: RunConfig, state: TrainerState,
                 ladder: dict[str, Any] | None) -> list[RunCurve] | None:
    """--forecast-earlier-runs: the folders of earlier complete runs of this run's family, read and
    checked (same model, tokens a step, peak lr and corpus; at least two): the forecast's prior."""
    if not getattr(args, "forecast_earlier_runs", None):
        return None
    if ladder is not None:
        raise DataOrConfigError("--forecast-earlier-runs and --ladder are two priors for the forecast: give one")
    try:
        this = this_run_curve(cfg)
        runs = [earlier_run(Path(f), cfg.model, state.corpus, this.n_params)
                for f in args.forecast_earlier_runs]
        check_family(runs, this)
    except ForecastError as e:
        raise DataOrConfigError(f"--forecast-earlier-runs: {e}") from None
    return runs


def forecast_watch(args: argparse.Namespace, cfg: RunConfig, state: TrainerState, is_main: bool,
                   band: tuple[float, float], ladder: dict[str, Any] | None = None,
                   earlier: list[RunCurve] | None = None):
    """The final-loss forecast (x1_pretrain.forecast), continuing the curve a checkpoint kept, judged
    against the run's declared band; with `ladder` (a ladder.json already checked to be this run's),
    its prediction and shape priors; with `earlier` (complete runs of its family, earlier_runs), their
    law's."""
    alerts = None
    if is_main:
        try:
            alerts = AlertSender.from_env()
        except ValueError as e:
            raise ConfigError(f"alerts: {e}") from None
    try:
        counts = param_counts(cfg.model)
        prior = None
        if ladder is not None:
            prior = prior_from_ladder(ladder, counts["total"], cfg.train.total_steps * cfg.train.tokens_per_step,
                                      counts["non_embedding"], flops_per_token(cfg.model))
        elif earlier is not None:  # earlier_runs refused the two together
            prior = prior_from_runs(earlier, this_run_curve(cfg))
        return ForecastWatch.for_run(cfg.optim, cfg.train.total_steps, cfg.train.log_every, state.forecast,
                                     band=band, stop_outside=args.stop_when_forecast_misses_band,
                                     alerts=alerts, ladder=prior)
    except ForecastError as e:
        raise DataOrConfigError(f"forecast: {e}") from None


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


def alert_in_background(alerts: AlertSender, error: str) -> None:
    """The alert of the trainer's first failing write, sent off the training thread (a webhook or
    an SMTP server can take seconds)."""
    threading.Thread(target=alerts.send, name="write-alert", daemon=True, args=(
        "write-failing", f"trainer cannot write: {error[:200]}",
        f"{error}\nTraining goes on and every next write tries again; free space (or remount read-write) on "
        "that disk before the next checkpoint, which cannot be written either.", {"error": error})).start()


def build_tracking(cfg: RunConfig, d: D.Dist, state: TrainerState, run_name: str,
                   extra_tags: dict[str, str] | None = None):

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
    if cfg.tracking.parent_run_id:  # MLflow's own tag: the run shows under its parent
        tags["mlflow.parentRunId"] = cfg.tracking.parent_run_id
    if state.changes:  # what --allow-data-change / --allow-tracking-change let through, oldest first
        tags["x1.provenance_changes"] = json.dumps(state.changes, sort_keys=True)
        moved = [c for c in state.changes if c["what"] == "tracking"]
        if moved:
            tags["x1.previous_mlflow_run"] = f"{moved[-1]['from']} {moved[-1]['previous_run_id']}"
    writes = WriteHealth(log)  # the heartbeat's and the spool's; /metrics and the alert are wired in setup
    mlflow = MlflowLogger(
        cfg.tracking.mlflow_uri, cfg.tracking.experiment, run_id=run_id, run_name=run_name,
        params=flatten(cfg.resolved()), tags=tags, spool_path=ckpt_root / "mlflow-spool.jsonl", on_run_id=remember,
        writes=writes,
    )
    if state.changes:  # a resumed run is not re-tagged at start: said to it explicitly
        mlflow.set_tags({k: tags[k] for k in ("x1.provenance_changes", "x1.previous_mlflow_run", "x1.data_dir")
                         if k in tags})
    mlflow.start()
    prom = PrometheusMetrics(cfg.tracking.metrics_port, cfg.tracking.metrics_host)
    prom.node.labels(**d.node.labels()).set(1)
    writes.on_change = prom.write_error
    return MetricsSink(mlflow, prom, Heartbeat(cfg.tracking.heartbeat_file, node, writes), writes)


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
    if previous_heartbeat is not None and previous_heartbeat.phase == PHASE_COMPILING and previous_heartbeat.pid != os.getpid():
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
        run.sink.heartbeat.beat(run.state.step, PHASE_COMPILING if mode else PHASE_STARTUP)
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
    started = time.monotonic()  # the start-up a restart costs is measured from here (budget_guard.Pace)
    check_device(cfg)
    check_paths(cfg)
    d = D.init(cfg.train.device)
    if not d.is_main:  # one voice: rank 0 logs, the others speak only of problems
        logging.getLogger().setLevel(logging.WARNING)
    grad_accum = cfg.grad_accum(d.world_size)  # ConfigError when the world size does not divide
    # Each lever probed once: what this torch and this GPU (or the architecture train.gpu_arch names)
    # cannot run is switched off in the config, with a line saying so (x1_pretrain.ops.levers).
    features = levers.probe(d.device, cfg.train.gpu_arch,
                            compiled_autograd=cfg.train.compiled_autograd and cfg.train.compile)
    cfg, lever_table = levers.resolve(cfg, features, d.world_size)
    if d.is_main:
        lever_table.log()
    if cfg.train.float8 != "off":  # before anything is read or written
        problem = unsupported(d.device) or levers.float8_problem(features)
        if problem is not None:
            raise DataOrConfigError(f"train.float8={cfg.train.float8}: {problem}; or --set train.float8=off")
    # One trainer per checkpoint folder (x1_pretrain.train.lease), taken before anything is written there.
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
    state, loaded = starting_state(args, cfg, d, checkpointer, provenance.corpus_identity(cfg.data.dir, tokens.meta))
    replanned = loaded is not None and loaded.replanned
    try:
        kept = bool(state.declared_band)
        band, state.declared_band, ladder = declared_band(state.declared_band, args.ladder, args.forecast_band, cfg,
                                                          tokens.meta)
    except BandError as e:
        raise DataOrConfigError(str(e)) from None
    if d.is_main:
        log_declared(band, state.declared_band, kept)
    earlier = earlier_runs(args, cfg, state, ladder)  # before the model: a bad folder costs nothing
    if state.step >= cfg.train.total_steps and loaded is None:
        raise DataOrConfigError(f"train.total_steps: {cfg.train.total_steps} leaves nothing to train")

    # Budget before anything expensive (no model yet): a refused launch costs nothing. With the
    # step known, the guard also judges whether the steps left can finish under the cap at the
    # plan's throughput for this GPU (on a CPU there is none: the first steady interval decides).
    expected = expected_throughput(cfg, d.device, d.world_size)
    probes = CooldownProbes.for_run(cfg, state.probes, state.step)
    pace = Pace(total_steps=cfg.train.total_steps, tokens_per_step=cfg.train.tokens_per_step,
                eval_every=cfg.train.eval_every, ckpt_every=cfg.checkpoint.every,
                eval_tokens=cfg.train.eval_windows * cfg.model.seq_len, start_step=state.step,
                # a re-plan's stop was planned: only interruptions are extrapolated over the steps left
                restarts=max(state.restarts - len(state.replans), 0),
                expected_tokens_per_sec=expected[0] if expected else None,
                expected_source=expected[1] if expected else "", started=started, probes=probes.ahead())
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

    raw, backend = build_model(cfg, d, loaded, checkpointer)
    optimizer = build_optimizer(cfg, raw, loaded, d.device)

    sink = build_tracking(cfg, d, state, run_name=args.run_name or f"{cfg.name}-{time.strftime('%Y%m%d-%H%M%S')}",
                          extra_tags={**lever_table.tags(), **band_tag(state.declared_band),
                                      "x1.corpus_fingerprint": str(state.corpus.get("fingerprint"))})
    if guard.enabled and isinstance(sink, MetricsSink):
        sink.writes.on_first = lambda error: alert_in_background(guard.alerts, error)
    previous_heartbeat = sink.heartbeat.previous() if d.is_main else None  # before this process's first beat
    sink.heartbeat.beat(state.step, PHASE_STARTUP)
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
            sink.log(state.step, {MLFLOW_RESTART: 1.0})
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

    def make_batches(start: int, micro_batch: int, accum: int, end: int | None = None):
        def source(step: int, micro: int) -> np.ndarray:
            return sampler.windows(step, data_mod.micro_batch_indices(micro, d.rank, micro_batch, d.world_size))

        keys = ((s, m) for s in range(start, end or cfg.train.total_steps) for m in range(accum))
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
    run.forecast = forecast_watch(args, cfg, state, d.is_main, (band.low, band.high), ladder, earlier)
    run.probes = probes
    run.bf16_weights = bf16_weights(cfg, d, raw)
    if loaded is not None:
        run.last_saved_step = state.step  # that checkpoint exists: a SIGTERM now need not rewrite it
    warm_up(run, compile_choice(cfg, Path(cfg.checkpoint.dir), previous_heartbeat), Path(cfg.checkpoint.dir))
    run.throughput = Throughput("resume" if loaded is not None else "start")
    run.compiles = CompileWatch()
    sink.heartbeat.beat(state.step, PHASE_TRAINING)
    return run


def starting_state(args: argparse.Namespace, cfg: RunConfig, d: D.Dist, checkpointer: Checkpointer,
                   corpus: dict[str, Any]):
    """The state this process starts from: the checkpoint resumed (checked to belong to this run,
    its RNG restored), else a fresh one. (state, the loaded checkpoint or None)."""
    loaded = resume_point(args, cfg, checkpointer, d)
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
    return state, loaded


def build_model(cfg: RunConfig, d: D.Dist, loaded, checkpointer: Checkpointer) -> tuple[Transformer, str]:
    """The model on its device with the resumed weights, its attention backend, kernels and
    float8 chosen, sharded under FSDP2. (model, attention backend)."""
    raw = Transformer(cfg.model)
    if loaded is not None:
        try:
            raw.load_state_dict(loaded.model_state, strict=True)
        except RuntimeError:  # a verified folder whose tensors are not this model's
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
        float8.convert(raw, cfg.train.float8)
    if cfg.train.distributed == "fsdp2":
        D.wrap(raw, d, "fsdp2")
    return raw, backend


def build_optimizer(cfg: RunConfig, raw: Transformer, loaded, device: torch.device) -> torch.optim.Optimizer:
    """AdamW over the model's parameter groups (fused on CUDA), with the resumed state."""
    fused = cfg.optim.fused == "on" or (cfg.optim.fused == "auto" and device.type == "cuda")
    optimizer = torch.optim.AdamW(param_groups(raw, cfg.optim.weight_decay), lr=cfg.optim.lr,
                                  betas=(cfg.optim.beta1, cfg.optim.beta2), eps=cfg.optim.eps, fused=fused)
    if loaded is not None:
        try:
            load_optimizer(raw, optimizer, loaded.optim_state)
        except (KeyError, TypeError, ValueError, RuntimeError) as e:
            why = str(e).splitlines()[0][:1000] if str(e) else ""
            raise DataOrConfigError(f"{loaded.path / OPTIM_FILE}: the optimizer state does not fit this model's "
                                    f"optimizer ({type(e).__name__}: {why})") from None
    return optimizer


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
        # kernels.wgrad_accumulate's order: the tuned cuBLASLt matmul first, then PyTorch's fp32 addmm
        tuned = cfg.train.cublaslt != "off" and d.device.type == "cuda" and cublaslt.available()
        how = ("; weight gradients added in fp32 by their matmuls (cuBLASLt)" if tuned else
               "; weight gradients added in fp32 by their matmuls" if addmm_into_fp32(d.device) else
               "; weight gradients summed in fp32 buffers (this torch's matmul cannot add into fp32 itself: "
               "each product in bf16, then an add, as autograd's accumulation does)")
    log.info("bf16 weights: cast once per optimizer step, shared by its %d micro-steps%s", cfg.grad_accum(d.world_size), how)
    return Bf16Weights(model, torch.bfloat16, accumulate=accumulate)


def use_kernels(choice: str, device: torch.device) -> bool:
    if choice == "torch":
        return False
    if not fused_available(device):
        if choice == "triton":
            log.warning("train.kernels=triton needs Triton on a CUDA GPU: using PyTorch's ops")
        return False
    return True
