"""The trainer's program: parse → set up → train → (with --run-dir) the run folder, by its own command."""

from __future__ import annotations

import atexit
import logging
import math
import os
import subprocess
import sys
from pathlib import Path

from x1_common.contracts import ExitCode
from x1_common.logs import setup_logging
from x1_pretrain.checkpoint.store import CheckpointError
from x1_pretrain.config import ConfigError
from x1_pretrain.data.loader import DataError
from x1_pretrain.ops import levers
from x1_pretrain.train import distributed as D
from x1_pretrain.train.budget_sim import dry_run
from x1_pretrain.train.components import DataOrConfigError, Run, StopSignal
from x1_pretrain.train.loop import train_loop
from x1_pretrain.train.parser import build_parser, config_from_args, credentials_out_of_config
from x1_pretrain.train.setup import setup

log = logging.getLogger("x1.train")
# Exits after which nothing more will train (--run-dir writes the run folder after these).
FINAL_CODES = frozenset({ExitCode.FINISHED, ExitCode.BUDGET_PROJECTED, ExitCode.BUDGET_SPENT, ExitCode.DIVERGED,
                         ExitCode.FORECAST_STOP})


def write_run_folder(mlflow_uri: str, run_dir: Path, run_id: str | None, ckpt_dir: Path) -> None:
    """The run folder (export, post-mortem draft, dod) by its own command, `python -m x1_pretrain.finish`:
    the trainer does not import the run-folder tools. Its exit code is logged, never returned: the
    trainer exits with its own code, which the watchdog acts on. MLflow credentials, moved out of the
    URI into the environment at start-up, reach it through the inherited environment."""
    argv = [sys.executable, "-m", "x1_pretrain.finish", "--mlflow-uri", mlflow_uri, "--output", str(run_dir),
            "--ckpt-dir", str(ckpt_dir), *(["--run-id", run_id] if run_id else [])]
    code = subprocess.run(argv, check=False).returncode
    if code != 0:
        log.warning("the run folder %s: `python -m x1_pretrain.finish` exited %d (its messages are above)", run_dir, code)


def main(argv: list[str] | None = None) -> int:
    built: list[Run] = []
    code = run_trainer(argv, built)
    if built and built[0].dist.enabled:
        # Leave here, with the DDP model still referenced. Freeing it frees its Reducer, whose gloo
        # process group joins its worker threads while this thread holds the GIL; a worker still
        # releasing the last all-reduce's tensors needs the GIL: a deadlock after the run has
        # finished (seen under load: the final weights written, the process never exiting). Every
        # file is durable by now; the exit handlers (the lease's release) still run.
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        atexit._run_exitfuncs()
        os._exit(code)
    return code


def run_trainer(argv: list[str] | None, built: list[Run]) -> int:
    """The trainer's command; `built` receives the run once it is set up."""
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
            log.error("setup failed: %s; exit %d", e, ExitCode.ENVIRONMENT)
            return ExitCode.ENVIRONMENT
        if isinstance(run, int):
            return run
        built.append(run)
        if stop.requested:  # SIGTERM during setup: nothing new to save
            return ExitCode.PREEMPTED
        code = train_loop(run)
        if args.run_dir and run.dist.is_main and code in FINAL_CODES:
            write_run_folder(cfg.tracking.mlflow_uri, Path(args.run_dir), run.sink.run_id, Path(cfg.checkpoint.dir))
        return code
    except CheckpointError as e:
        # A full disk above all: the environment's exit code, 1, a crash to the watchdog: it
        # relaunches with backoff (space may come back); a relaunch that stops in check_space
        # again, before its first step, with the same error, is a start-up failure: final, alerted (exit 81).
        log.error("%s", e)
        log.error("exit %d: checkpoint not written (the watchdog relaunches; it gives up after --max-restarts)",
                  ExitCode.ENVIRONMENT)
        return ExitCode.ENVIRONMENT
    finally:
        if run is not None and not isinstance(run, int):
            run.batches.close()
        D.shutdown()
