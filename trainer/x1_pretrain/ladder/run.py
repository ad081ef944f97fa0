"""`ladder run`: every rung trained by the trainer itself, several at once, and resumable.

Each rung is `python -m x1_pretrain.train` (the run's own loop, data, evals and budget guard) with
the rung's model and recipe given as `--set`, its own checkpoint folder under DIR/rungs/NAME/ and
`--resume-from-latest`. The runner keeps `--jobs` of them going at once and writes each finished
rung to DIR/rungs.json at once (atomically), so a preempted or killed ladder continues where it
stopped: finished rungs are never rerun, an interrupted rung resumes from its checkpoint. When
every rung is done it fits the law (fit.py) and draws the report.

It speaks the trainer's exit codes, so the watchdog supervises it as it supervises the trainer:
0 done; 75 stopped by SIGTERM/SIGINT/SIGHUP (its rungs checkpointed); 76 the ladder plus the main
run would cost more than the cap (checked before each rung starts, and any rung's own 76); 77
spent over the cap; 2 bad input; 1 a rung crashed (the watchdog relaunches, the ladder resumes).
Its rungs get SIGTERM if the runner itself dies (Linux's parent-death signal), so a SIGKILLed
ladder leaves checkpoints, not orphans.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import math
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from x1_common.contracts import (
    PHASE_FINISHED,
    PHASE_STARTUP,
    PHASE_STOPPED,
    PHASE_TRAINING,
    ExitCode,
    format_utc,
    read_budget_file,
    read_json_file,
    utc_now,
)
from x1_common.contracts import Heartbeat as HeartbeatFile
from x1_common.fsutil import write_json_atomic
from x1_common.lease import LEASE_FILE, Lease, LeaseKind, Owner
from x1_pretrain.ladder.plan import LadderPlan, RungSpec
from x1_pretrain.train.accounting import fmt_count, usd
from x1_pretrain.train.tracking import Heartbeat

log = logging.getLogger("x1.ladder")

PLAN_FILE = "plan.json"
RUNGS_FILE = "rungs.json"
RUN_FILE = "ladder-run.json"  # the MLflow parent run, the ladder's wall time and dollars so far
HEARTBEAT_FILE = "heartbeat.json"
STATE_FILE = "trainer_state.json"
PROGRESS_EVERY_S = 30.0
LEASE_WAIT_S = 120.0  # a rung's previous process may still be writing its emergency checkpoint
BUDGET_STOPS = (ExitCode.BUDGET_PROJECTED, ExitCode.BUDGET_SPENT, ExitCode.LAUNCH_REFUSED)
# The last step once every rung is done: the folder fitted into its ladder.json (None: no fit). The
# command line passes it in, so this module holds no fitting code and never imports the command line.
Fit = Callable[[Path, LadderPlan], "dict[str, Any] | None"]


@dataclass
class Settings:
    """What every rung's trainer gets besides its model and recipe."""

    folder: Path
    config: str
    sets: list[str]
    data_dir: str
    mlflow_uri: str
    jobs: int
    cap_usd: float | None = None
    cost_uri: str | None = None
    alert_usd: float | None = None
    python: str = sys.executable
    extra_args: list[str] = field(default_factory=list)
    heartbeat: Path | None = None  # a second heartbeat: the trainer's, which the stack's watchdog reads


# ---------------------------------------------------------------------------------------------
# The folder


def read_rungs(folder: Path) -> list[dict[str, Any]]:
    path = folder / RUNGS_FILE
    if not path.exists():
        return []
    data = read_json_file(path)
    if not isinstance(data, list):
        raise ValueError(f"{path}: not a list of rungs")
    return data


def write_rungs(folder: Path, rungs: list[dict[str, Any]]) -> None:
    write_json_atomic(folder / RUNGS_FILE, rungs)


def rung_dir(folder: Path, name: str) -> Path:
    return folder / "rungs" / name


def rung_result(spec: RungSpec, folder: Path, code: int, seconds: float) -> dict[str, Any]:
    """rungs.json's entry for a rung that ended, from its newest checkpoint's trainer state."""
    ckpt = rung_dir(folder, spec.name) / "checkpoints"
    state: dict[str, Any] = {}
    with contextlib.suppress(OSError, ValueError):
        latest = (ckpt / "latest").read_text().strip()
        state = read_json_file(ckpt / latest / STATE_FILE)
    forecast = state.get("forecast") or {}
    # The trainer keeps every eval's val loss in its forecast's curve (train/forecast.py).
    points = (forecast.get("curve") or {}).get("val") or forecast.get("val") or []
    curve = [[int(s), float(v)] for s, v in points if math.isfinite(float(v))]
    rec = spec.recipe
    diverged = code == ExitCode.DIVERGED
    final = curve[-1][1] if curve and curve[-1][0] == rec["total_steps"] else None
    train_seconds = float(state.get("train_seconds") or 0.0)
    return {
        "name": spec.name, "role": spec.role, "n_params": spec.n_params,
        "n_params_nonembedding": spec.n_params_nonembedding, "flops_per_token": spec.flops_per_token,
        "tokens": int(state.get("tokens_seen") or spec.tokens), "final_val_loss": final if not diverged else
        (curve[-1][1] if curve else None), "diverged": diverged, "model": spec.model,
        "schedule": {"total_steps": rec["total_steps"], "warmup_steps": rec["warmup_steps"], "lr": rec["lr"],
                     "min_lr": rec["min_lr"], "tokens_per_step": rec["tokens_per_step"], "beta2": rec["beta2"],
                     "schedule": "cosine"},
        "lr_scale": spec.lr_scale, "curve": curve, "train_seconds": train_seconds,
        "tokens_per_sec": (int(state.get("tokens_seen") or 0) / train_seconds) if train_seconds else None,
        "wall_seconds": round(seconds, 1), "exit_code": code, "finished_utc": format_utc(utc_now()),
    }


# ---------------------------------------------------------------------------------------------
# One rung's process


def _die_with_parent() -> None:
    """In the child, before exec: SIGTERM when the runner dies, SIGKILL included (Linux)."""
    with contextlib.suppress(Exception):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def rung_argv(spec: RungSpec, s: Settings, parent_run_id: str | None) -> list[str]:
    d = rung_dir(s.folder, spec.name)
    rec = spec.recipe
    argv = [s.python, "-m", "x1_pretrain.train", "--config", s.config]
    for item in [*s.sets, *spec.sets()]:
        argv += ["--set", item]
    if parent_run_id:
        argv += ["--set", f"tracking.parent_run_id={parent_run_id}"]
    argv += ["--data-dir", s.data_dir, "--ckpt-dir", str(d / "checkpoints"), "--mlflow-uri", s.mlflow_uri,
             "--total-steps", str(rec["total_steps"]), "--eval-every", str(spec.eval_every),
             "--ckpt-every", str(max(spec.eval_every, rec["total_steps"] // 4)),
             "--log-every", str(max(1, min(10, spec.eval_every))), "--resume-from-latest", "--metrics-port", "0",
             "--heartbeat-file", str(d / "heartbeat.json"), "--run-name", f"ladder {spec.name}"]
    if s.cap_usd is not None:
        argv += ["--budget-cap-usd", f"{s.cap_usd:g}", "--budget-curr-cost-uri", str(s.cost_uri)]
        if s.alert_usd is not None:
            argv += ["--budget-alert-usd", f"{s.alert_usd:g}"]
    return argv + s.extra_args


def wait_for_lease(ckpt: Path, timeout: float = LEASE_WAIT_S) -> None:
    """Until no live process holds the rung's checkpoint folder (a killed runner's rung may still
    be writing its emergency checkpoint: it got SIGTERM when the runner died)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            owner = Owner.from_json((ckpt / LEASE_FILE).read_text())
        except (OSError, ValueError):
            return
        try:
            os.kill(owner.pid, 0)
        except ProcessLookupError:
            return
        except PermissionError:
            pass
        time.sleep(0.5)


@dataclass
class Running:
    spec: RungSpec
    proc: subprocess.Popen[bytes]
    started: float
    log: Any


def start(spec: RungSpec, s: Settings, parent_run_id: str | None) -> Running:
    d = rung_dir(s.folder, spec.name)
    (d / "checkpoints").mkdir(parents=True, exist_ok=True)
    wait_for_lease(d / "checkpoints")
    logf = open(d / "train.log", "ab")  # appended: an interrupted rung's log goes on
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(rung_argv(spec, s, parent_run_id), stdout=logf, stderr=subprocess.STDOUT, env=env,
                            preexec_fn=_die_with_parent if sys.platform.startswith("linux") else None)
    return Running(spec, proc, time.monotonic(), logf)


def rung_step(folder: Path, name: str) -> int:
    hb = HeartbeatFile.read(rung_dir(folder, name) / "heartbeat.json")
    return hb.step if hb is not None else 0


def tail(path: Path, lines: int = 12) -> str:
    with contextlib.suppress(OSError):
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    return ""


# ---------------------------------------------------------------------------------------------
# The MLflow parent run


def parent_run(s: Settings, record: dict[str, Any]) -> str | None:
    """The ladder's MLflow run (created once, kept in ladder-run.json): each rung is its child."""
    if record.get("parent_run_id"):
        return str(record["parent_run_id"])
    try:
        from mlflow.tracking import MlflowClient

        client = MlflowClient(tracking_uri=s.mlflow_uri)
        exp = client.get_experiment_by_name("x1-pretraining")
        exp_id = exp.experiment_id if exp is not None else client.create_experiment("x1-pretraining")
        run = client.create_run(exp_id, run_name="ladder", tags={"x1.ladder": str(s.folder)})
        return run.info.run_id
    except Exception as e:  # noqa: BLE001 - the ladder runs without its parent run rather than not at all
        log.warning("ladder: no MLflow parent run (%s: %s); the rungs are logged as runs of their own",
                    type(e).__name__, str(e)[:200])
        return None


def close_parent(s: Settings, run_id: str | None, ladder: dict[str, Any] | None, status: str) -> None:
    if not run_id:
        return
    try:
        from mlflow.entities import Metric, Param
        from mlflow.tracking import MlflowClient

        client = MlflowClient(tracking_uri=s.mlflow_uri)
        if ladder is not None:
            now = int(time.time() * 1000)
            fit = ladder["fit"]
            params = [Param(f"fit_{k}", repr(fit[k])) for k in ("E", "A", "B", "alpha", "beta", "n_convention")]
            metrics = [Metric("tolerance_heldout_error", ladder["tolerance"]["heldout_error"], now, 0)]
            if ladder.get("prediction"):
                p = ladder["prediction"]
                metrics += [Metric(f"prediction_{k}", p[k], now, 0) for k in ("val_loss", "low", "high")]
            with contextlib.suppress(Exception):
                client.log_batch(run_id, metrics=metrics, params=params)
        client.set_terminated(run_id, status)
    except Exception as e:  # noqa: BLE001
        log.warning("ladder: could not close the MLflow parent run (%s)", str(e)[:200])


# ---------------------------------------------------------------------------------------------
# The budget, as the ladder sees it


def budget_verdict(s: Settings, plan: LadderPlan, pending_seconds: float) -> tuple[int, str] | None:
    """(exit code, why) when the ladder must not start another rung, else None."""
    if s.cap_usd is None or not s.cost_uri or "://" in s.cost_uri:  # the sidecar's URL: the rungs' guards read it
        return None
    try:
        r = read_budget_file(s.cost_uri)
    except (OSError, ValueError) as e:
        log.warning("ladder: no budget reading at %s (%s): the rungs' own guards still judge it", s.cost_uri, e)
        return None
    age_h = max(0.0, (utc_now() - r.last_update_utc).total_seconds() / 3600.0)
    spent = r.spent_usd + r.rate_usd_per_hr * age_h
    if spent > s.cap_usd:
        return int(ExitCode.BUDGET_SPENT), f"spent {usd(spent)} is over the cap {usd(s.cap_usd)}"
    projected = spent + r.rate_usd_per_hr * pending_seconds / 3600.0 + plan.main_cost_usd
    if projected > s.cap_usd:
        return int(ExitCode.BUDGET_PROJECTED), (
            f"spent {usd(spent)} + the rungs left (~{pending_seconds / 3600:.2f} h at {usd(r.rate_usd_per_hr)}/h) + the "
            f"main run's {usd(plan.main_cost_usd)} = {usd(projected)} is over the cap {usd(s.cap_usd)}")
    return None


# ---------------------------------------------------------------------------------------------
# The runner


class Stop:
    """SIGTERM, SIGINT and SIGHUP (an SSH session that drops) stop the ladder in order: each rung
    gets SIGTERM, checkpoints and exits 75; then the runner exits 75."""

    def __init__(self) -> None:
        self.signal: int | None = None

    @contextlib.contextmanager
    def installed(self) -> Iterator[Stop]:
        old = {sig: signal.signal(sig, self._on) for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)}
        try:
            yield self
        finally:
            for sig, h in old.items():
                signal.signal(sig, h)

    def _on(self, signum: int, frame: object) -> None:
        self.signal = signum


def progress_line(plan: LadderPlan, done: list[dict[str, Any]], running: dict[str, Running], folder: Path,
                  started: float, spent: float | None) -> str:
    total = len(plan.rungs)
    parts = []
    for r in running.values():
        parts.append(f"{r.spec.name} {rung_step(folder, r.spec.name)}/{r.spec.recipe['total_steps']}")
    # The pace so far against the plan's figures, for the ETA of what is left.
    planned_done = sum(x.seconds for x in plan.rungs if x.name in {d["name"] for d in done})
    pace = ((time.monotonic() - started) / planned_done) if planned_done > 0 else 1.0
    left = 0.0
    for x in plan.rungs:
        if any(d["name"] == x.name for d in done):
            continue
        frac = 1.0
        if x.name in running:
            frac = 1.0 - rung_step(folder, x.name) / max(1, x.recipe["total_steps"])
        left += x.seconds * frac
    eta_min = left * pace / max(1, plan.jobs) / 60.0
    money = f"{usd(spent)} spent of ~{usd(plan.cost_usd)}" if spent is not None else f"~{usd(plan.cost_usd)} planned"
    return (f"ladder: {len(done)}/{total} rungs done" + (f", running {', '.join(parts)}" if parts else "")
            + f"; ETA ~{eta_min:.0f} min; {money}")


def run(plan: LadderPlan, s: Settings, *, fit: Fit | None = None) -> int:
    s.folder.mkdir(parents=True, exist_ok=True)
    lease = Lease(s.folder, LeaseKind.LADDER).acquire()
    try:
        return _run(plan, s, fit)
    finally:
        lease.release()


def _run(plan: LadderPlan, s: Settings, fit: Fit | None) -> int:
    record_path = s.folder / RUN_FILE
    record: dict[str, Any] = read_json_file(record_path) if record_path.exists() else {}
    record.setdefault("started_utc", format_utc(utc_now()))
    record["parent_run_id"] = parent_run(s, record)
    spent0 = _spent(s)
    record.setdefault("spent_at_start_usd", spent0)
    write_json_atomic(record_path, record)
    hb = [Heartbeat(s.folder / HEARTBEAT_FILE), *([Heartbeat(s.heartbeat)] if s.heartbeat else [])]
    done = read_rungs(s.folder)
    finished = {d["name"] for d in done}
    # The longest first: the ladder's wall time is then close to its GPU time over --jobs.
    pending = sorted((r for r in plan.rungs if r.name not in finished), key=lambda r: -r.seconds)
    if finished:
        log.info("ladder: %d rung(s) already done (%s): kept, not rerun", len(finished), ", ".join(sorted(finished)))
    running: dict[str, Running] = {}
    crashes: dict[str, int] = {}
    started = time.monotonic()
    last_progress = 0.0
    code = 0
    reason = ""
    stop = Stop()
    with stop.installed():
        _beat(hb, done, running, s.folder, PHASE_STARTUP)
        while running or (pending and not reason):
            if stop.signal is not None and not reason:
                reason = f"signal {signal.Signals(stop.signal).name}"
                code = int(ExitCode.PREEMPTED)
                _terminate_all(running)
            if not reason:
                verdict = budget_verdict(s, plan, sum(x.seconds for x in pending) / max(1, plan.jobs))
                if verdict is not None and pending:
                    code, reason = verdict
                    log.error("ladder: %s: no more rungs start", reason)
                    _terminate_all(running)
            while not reason and pending and len(running) < s.jobs:
                spec = pending.pop(0)
                running[spec.name] = start(spec, s, record["parent_run_id"])
                log.info("ladder: started %s (%s params, %s tokens, %d steps)", spec.name, fmt_count(spec.n_params),
                         fmt_count(spec.tokens), spec.recipe["total_steps"])
            for name, r in list(running.items()):
                rc = r.proc.poll()
                if rc is None:
                    continue
                r.log.close()
                del running[name]
                elapsed = time.monotonic() - r.started
                if rc in (ExitCode.FINISHED, ExitCode.DIVERGED):
                    entry = rung_result(r.spec, s.folder, rc, elapsed)
                    done.append(entry)
                    write_rungs(s.folder, done)
                    shown = f"{entry['final_val_loss']:.4f}" if entry["final_val_loss"] is not None else "none"
                    log.info("ladder: %s %s: final val loss %s in %.0f s", name,
                             "diverged" if rc else "done", shown, elapsed)
                elif rc == ExitCode.PREEMPTED and reason:
                    log.info("ladder: %s stopped at its checkpoint (exit 75)", name)
                elif rc == ExitCode.PREEMPTED:  # a SIGTERM the ladder did not send: its checkpoint is there
                    log.warning("ladder: %s preempted (exit 75): resumed", name)
                    pending.insert(0, r.spec)
                elif rc in BUDGET_STOPS:
                    if not reason:
                        code, reason = rc, f"rung {name} stopped on the budget (exit {rc})"
                        log.error("ladder: %s", reason)
                        _terminate_all(running)
                elif rc == ExitCode.USAGE:
                    if not reason:
                        code, reason = int(ExitCode.USAGE), f"rung {name} refused its config (exit 2)"
                        log.error("ladder: %s; its log ends:\n%s", reason, tail(rung_dir(s.folder, name) / "train.log"))
                        _terminate_all(running)
                else:
                    crashes[name] = crashes.get(name, 0) + 1
                    log.error("ladder: %s crashed (exit %s); its log ends:\n%s", name, rc,
                              tail(rung_dir(s.folder, name) / "train.log"))
                    if not reason:
                        code, reason = 1, f"rung {name} crashed (exit {rc})"
                        _terminate_all(running)
            now = time.monotonic()
            if now - last_progress >= PROGRESS_EVERY_S or not running:
                last_progress = now
                spent = _spent(s)
                print(progress_line(plan, done, running, s.folder, started,
                                    None if spent is None or spent0 is None else spent - spent0), flush=True)
                _beat(hb, done, running, s.folder, PHASE_TRAINING)
            if running or (pending and not reason):
                time.sleep(0.3)
    record["wall_seconds"] = round(float(record.get("wall_seconds") or 0.0) + time.monotonic() - started, 1)
    spent = _spent(s)
    if spent is not None and record.get("spent_at_start_usd") is not None:
        record["spent_usd"] = round(spent - float(record["spent_at_start_usd"]), 4)
    write_json_atomic(record_path, record)
    if reason:
        _beat(hb, done, running, s.folder, PHASE_STOPPED)
        log.warning("ladder stopped: %s; exit %d (%d of %d rungs done: `ladder run` again continues)",
                    reason, code, len(done), len(plan.rungs))
        close_parent(s, record["parent_run_id"], None, "KILLED")
        return code
    _beat(hb, done, running, s.folder, PHASE_FINISHED)
    ladder = None
    if fit is not None:
        ladder = fit(s.folder, plan)
    close_parent(s, record["parent_run_id"], ladder, "FINISHED")
    return 0


def _terminate_all(running: dict[str, Running]) -> None:
    for r in running.values():
        with contextlib.suppress(ProcessLookupError):
            r.proc.send_signal(signal.SIGTERM)


def _spent(s: Settings) -> float | None:
    if not s.cost_uri or "://" in s.cost_uri:
        return None
    try:
        return read_budget_file(s.cost_uri).spent_usd
    except (OSError, ValueError):
        return None


def _beat(beats: list[Heartbeat], done: list[dict[str, Any]], running: dict[str, Running], folder: Path,
          phase: str) -> None:
    """The ladder's heartbeat, the trainer's own (x1_pretrain.train.tracking): its step is every
    rung's steps so far, so the watchdog's stall detector sees the ladder move while any rung does.
    The trainer's heartbeat file, where the stack gives one, says `startup` once the ladder ends:
    what comes next is the trainer's start, not a finished or stopped run of its own."""
    steps = sum(int(d.get("schedule", {}).get("total_steps") or 0) for d in done)
    steps += sum(rung_step(folder, name) for name in running)
    for i, hb in enumerate(beats):
        hb.beat(steps, phase if i == 0 or phase == PHASE_TRAINING else PHASE_STARTUP)
