"""`make demo`: the whole X1 stack as local processes on CPU, then the definition-of-done report.

    python -m x1_pretrain.demo --workspace demo-workspace [--steps 200] [--fresh]

What `docker compose up` does on the GPU host, on a machine with neither Docker nor a GPU
(docs/DESIGN.md §2), and through the very commands a RunPod user types: the demo writes a .env (the fake
billing API standing in for Lambda's, the tiny config) and runs `python -m x1_pretrain.stack
up -d`, `status` and `down` (x1_pretrain.stack) on it. A small real-text corpus (the standard
library's docstrings) is built and tokenized first; the real sidecar, MLflow server, watchdog
(and Prometheus, when installed) run the tiny trainer through one simulated preemption and one
injected loss spike. Then the run is exported, its spike post-mortem drafted and the DoD checked.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import secrets
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

from x1_common.restarts import describe as describe_restart
from x1_pretrain.stack.process import Service, signals_ignored, wait_until
from x1_pretrain.stack.workspace import (
    REPO,
    TINY_CONFIG,
    Ports,
    StackError,
    Workspace,
    choose_ports,
    read_events,
    read_json,
    trainer_pid,
)
from x1_pretrain.train.lease import probe

# ---------------------------------------------------------------------------------------------
# The demo's numbers, and why

DEFAULT_STEPS = 200  # 2-9 min of training on 2 cores (0.3-2 s/step, busy machines the slower); the whole demo 7-12 min
MIN_STEPS = 40  # room for a checkpoint, the preemption and the 5 spiked steps before the end

# The money. The default plan: 1x A100 80GB on-demand on Lambda at $1.10/h for ~24 h = $26.40 of a $35 cap.
PRICE_USD_PER_HR = 1.10
PLANNED_HOURS = 24.0
CAP_USD = 35.0
ALERT_USD = 30.0
# Billed time runs 120x faster than wall time: one wall minute bills 2 h ($2.20). A 3-5 minute
# demo bills 6-10 h (~$7-11) and shows the meter moving; the cap would be reached only after
# ~16 wall minutes, so even a very slow machine finishes well inside it.
TIME_SCALE = 120.0

# One CPU thread for the tiny trainer: its 64-wide matmuls are too small for two. Measured on 2
# cores: the same steps (same losses) in half the CPU time, and 1.3-2x faster when the machine is
# busy, with the second core left to the services (MLflow, sidecar, fake billing) beside it.
TRAINER_THREADS = 1

CORPUS_MB = 2.0  # ~580k GPT-2 tokens: more than the 200 x 512 = 102k tokens the run trains on

# The DoD's val-loss band for this run. docs/DESIGN.md §8's [3.20, 3.50] is the 50M model's after ~5B
# tokens; this 2-layer, 64-wide model sees 20-120k tokens. On this corpus (measured, not read
# from the run): a uniform guess scores ln(50257) = 10.8; the corpus's own unigram statistics
# (no context at all) score 6.48 on val; the tiny model reaches ~6.8 after 30 steps, ~6.4 after
# 60 and ~5.9 after 200, deterministic on CPU. The band asks that it learned about as much as unigram
# statistics at least (< 7.0; a run that stopped learning early - a broken lr, data or resume -
# stays far above: 10.8 untrained, ~8 after 20 steps) and nothing impossible for its size
# (> 4.5 would mean val leaked into train).
BAND = (4.5, 7.0)


@dataclass(frozen=True)
class Schedule:
    """When things happen in a run of `steps` optimizer steps."""

    steps: int
    ckpt_every: int
    eval_every: int
    log_every: int
    preempt_at: int  # SIGTERM to the trainer once it has logged this step
    spike_at: int  # --inject-spike-at-step: the batches of steps spike_at .. spike_at+4 are replaced

    @classmethod
    def for_steps(cls, steps: int) -> Schedule:
        # Preemption at ~40%, after the first checkpoint; the spike at ~60%, after the resume, so
        # the relaunched trainer is the one that injects it and the detector sees it.
        every = max(10, steps // 6 // 10 * 10)
        log_every = 10 if steps >= 100 else 5
        return cls(steps=steps, ckpt_every=every, eval_every=every, log_every=log_every,
                   preempt_at=round(steps * 0.4 / log_every) * log_every, spike_at=round(steps * 0.6))


DESCRIPTION = f"""\
The X1 stack on this machine, as processes, on CPU: no Docker, no GPU, no cloud account.

  1. data: the standard library's docstrings as a FineWeb-Edu-style corpus ({CORPUS_MB:g} MB),
     tokenized with GPT-2 BPE (x1_pretrain.corpus, x1_pretrain.tokenize_data);
  2. services: the fake billing API (Lambda's API shape, an A100 at ${PRICE_USD_PER_HR:.2f}/h, billed
     time {TIME_SCALE:g}x faster than wall time), then the stack from WORKSPACE/demo.env with
     `python -m x1_pretrain.stack up -d` (the command a RunPod pod runs): the budget sidecar
     polling the fake every second, an MLflow server (sqlite), Prometheus when installed, and the
     watchdog supervising the tiny trainer (configs/tiny-cpu.yaml) with the budget guard on (cap
     ${CAP_USD:g}, alert ${ALERT_USD:g});
  3. one simulated preemption: SIGTERM to the trainer process mid-run -> emergency checkpoint,
     exit 75 -> the watchdog relaunches it with --resume-from-latest; one injected loss spike.
     (A spot reclaim of the whole instance kills the watchdog too: bringing it back is the job of
     the watchdog's provider mode, off the GPU host, which one machine cannot show.)
  4. at the end the watchdog terminates the (fake) instance, then export_run writes the run folder,
     postmortem drafts the spike post-mortem, dod checks docs/DESIGN.md §8's six lines, and
     `python -m x1_pretrain.stack down` stops the stack.

Everything goes under WORKSPACE: demo.env, data/, checkpoints/, mlruns/, logs/ (one log per
service, trainer.log, the watchdog's events, termination.json), budget.json and run/ (the exported run: manifest,
metrics, plots, final.safetensors, spike-postmortem.md, dod.json). Each run starts from a clean
workspace: everything in it is deleted first except the tokenized corpus, which is reused when
complete (--fresh rebuilds it too). A non-empty folder the demo did not make is refused.

Ports: compose's defaults (MLflow 5000, trainer 9791, sidecar 9792, watchdog 9793, Prometheus
9090) where free; a busy one is reported and replaced by a free port. Every service listens on
127.0.0.1. The provider API key is made up for the session and passed to the stack in its
environment (demo.env leaves it empty); it is never printed nor written.

Ctrl-C stops every process the demo started (the trainer with an emergency checkpoint).
Exit status: 0 when every DoD check passes; 1 when one fails or the run did not finish; 2 for
a usage error or a service that would not start; 130 after Ctrl-C.
"""


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m x1_pretrain.demo", description=DESCRIPTION,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workspace", type=Path, default=Path("demo-workspace"),
                   help="the demo's folder, wiped at start (default ./demo-workspace)")
    p.add_argument("--steps", type=int, default=DEFAULT_STEPS,
                   help=f"optimizer steps of the tiny run (default {DEFAULT_STEPS}; at least {MIN_STEPS})")
    p.add_argument("--band", type=float, nargs=2, metavar=("LO", "HI"), default=BAND,
                   help=f"the DoD's final val-loss band (default {BAND[0]:g} {BAND[1]:g}: the tiny model's, see the source)")
    p.add_argument("--fresh", action="store_true", help="also rebuild the corpus and its tokens")
    p.add_argument("--free-ports", action="store_true",
                   help="use free ports instead of compose's defaults (to run beside a stack already up)")
    p.add_argument("--timeout-min", type=float, default=20.0,
                   help="give up (and stop everything) after this many minutes of training (default 20)")
    return p


# ---------------------------------------------------------------------------------------------
# Output


class Console:
    """The demo's own lines, prefixed with the seconds since start."""

    def __init__(self, out: TextIO = sys.stdout) -> None:
        self.out = out
        self.t0 = time.monotonic()

    def say(self, text: str = "") -> None:
        stamp = f"[{time.monotonic() - self.t0:6.1f}s] " if text else ""
        for line in text.splitlines() or [""]:
            print(stamp + line, file=self.out, flush=True)

    def section(self, title: str) -> None:
        print(f"\n== {title}", file=self.out, flush=True)


class LogFollower:
    """The new complete lines of a file that another process appends to."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.offset = 0
        self.partial = b""

    def lines(self) -> Iterator[str]:
        try:
            with open(self.path, "rb") as f:
                f.seek(self.offset)
                chunk = f.read()
        except OSError:
            return
        self.offset += len(chunk)
        *complete, self.partial = (self.partial + chunk).split(b"\n")
        for line in complete:
            yield line.decode("utf-8", errors="replace")


# The trainer's log line at each log step (train.log_step) and after each eval (train.evaluate).
STEP_LINE = re.compile(r"\bstep (\d+)/(\d+) loss (\S+) lr \S+ grad \S+ tok/s (\d+)")
VAL_LINE = re.compile(r"\bstep (\d+) val_loss (\S+)")
# Lines of the trainer and the watchdog worth showing as they come.
NOTABLE = re.compile(r"This run is planned|launch accepted|loss spike|spike injection|injecting|resuming from|"
                     r"emergency checkpoint|preempted at|relaunching|budget: (?!continue)|terminat|"
                     r"forecast: final|ALERT \[forecast\]", re.IGNORECASE)


def spent_usd(ws: Workspace) -> float | None:
    try:
        return float(json.loads(ws.budget_file.read_text(encoding="utf-8"))["spent_usd"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def describe_event(e: dict[str, Any]) -> str | None:
    kind = e.get("event")
    if kind == "start":
        how = "resuming from the latest checkpoint" if e.get("resume") else "fresh start"
        return f"watchdog: trainer started, pid {e.get('pid')} ({how})"
    if kind == "exit":
        return f"watchdog: trainer pid {e.get('pid')} exited with code {e.get('exit_code')} ({e.get('reason')})"
    if kind == "relaunch":
        # Not the downtime: that ends at the relaunched process's first step, and the demo prints
        # it from the manifest after the export (x1_common.restarts).
        return f"watchdog: relaunch #{e.get('restart')} after {e.get('reason')} (exit {e.get('exit_code')})"
    if kind == "terminate":
        ok = "terminated" if e.get("ok") else f"terminate FAILED: {e.get('error')}"
        return f"watchdog: instance {e.get('instance_id')} {ok} ({e.get('termination_file', '')})"
    if kind in ("stall", "give_up"):
        return f"watchdog: {kind}: {e.get('detail') or e.get('reason')}"
    return None


# ---------------------------------------------------------------------------------------------
# The demo's stages


class OneShots:
    """The demo's one-shot commands (corpus, tokenize, export...), each logged to WS/logs/<name>.log;
    stopped if the demo is interrupted."""

    def __init__(self, ws: Workspace) -> None:
        self.ws = ws
        self.current: Service | None = None

    def run(self, name: str, argv: list[str], timeout: float, env: dict[str, str] | None = None) -> int:
        service = Service(name, argv, self.ws.log(name), env or dict(os.environ, PYTHONUNBUFFERED="1"))
        self.current = service
        try:
            code = service.wait(timeout)
            if code is None:
                raise StackError(f"{name} did not finish within {timeout:g} s; see {service.log_path}")
            return code
        finally:
            service.stop(5)
            self.current = None


def stack_command(ws: Workspace, *args: str, env: dict[str, str] | None = None,
                  timeout: float = 600) -> subprocess.CompletedProcess[str]:
    """`python -m x1_pretrain.stack ARGS --workspace WS`, as a user runs it."""
    return subprocess.run([sys.executable, "-m", "x1_pretrain.stack", *args, "--workspace", str(ws.root)],
                          capture_output=True, text=True, timeout=timeout, env=env, cwd=REPO)


def demo_env(ws: Workspace, ports: Ports, sched: Schedule, instance_id: str, band: tuple[float, float] = BAND) -> Path:
    """The .env a user would write for this run (no secret in it: the key comes from the environment).
    The run declares the demo's band before its first step (--band), as a run declares its own."""
    extra = (f"--inject-spike-at-step {sched.spike_at} --run-name x1-demo --band {band[0]:g} {band[1]:g} "
             # Wall minutes: with the billing clock sped up, the guard must look more often than the
             # production 30 min to see anything happen in a demo.
             f"--budget-check-every-min 0.25 --planned-rate-usd-per-hr {PRICE_USD_PER_HR:g} "
             f"--planned-hours {PLANNED_HOURS:g}")
    values = {
        "PROVIDER": "lambda", "INSTANCE_ID": instance_id, "LAMBDA_API_KEY": "",
        "PROVIDER_API_URL": f"http://127.0.0.1:{ports.fake_billing}", "PLANNED_HOURS": f"{PLANNED_HOURS:g}",
        "BUDGET_POLL_SECONDS": "1", "BUDGET_CAP_USD": f"{CAP_USD:g}", "BUDGET_ALERT_USD": f"{ALERT_USD:g}",
        "X1_CONFIG": str(TINY_CONFIG.relative_to(TINY_CONFIG.parents[1])), "TOTAL_STEPS": str(sched.steps),
        "CKPT_EVERY": str(sched.ckpt_every), "EVAL_EVERY": str(sched.eval_every), "LOG_EVERY": str(sched.log_every),
        "TRAIN_EXTRA_ARGS": extra,
        # A tiny trainer starts in seconds: minutes of grace would only slow a stuck demo down.
        "STALL_SECONDS": "120", "STARTUP_GRACE_SECONDS": "120", "MAX_RESTARTS": "3",
        # The run folder is copied to RESULTS_DIR before the (fake) instance is terminated: on a
        # real host, storage that outlives the instance.
        "TERMINATE_ON_FINISH": "1", "RESULTS_DIR": str(ws.root / "results"), "MLFLOW_WORKERS": "1", **ports.env(),
    }
    path = ws.root / "demo.env"
    path.write_text("# written by python -m x1_pretrain.demo: the .env of the demo's run\n"
                    + "".join(f"{k}={v}\n" for k, v in values.items()), encoding="utf-8")
    return path


def prepare_data(ws: Workspace, steps: OneShots, console: Console) -> None:
    if ws.data_ready():
        meta = json.loads((ws.tokenized / "meta.json").read_text(encoding="utf-8"))
        console.say(f"data: reusing {ws.tokenized} ({meta.get('train_tokens', 0):,} train tokens; --fresh rebuilds it)")
        return
    py = sys.executable
    t = time.monotonic()
    if steps.run("corpus", [py, "-m", "x1_pretrain.corpus", "stdlib-docstrings", "--output", str(ws.corpus),
                            "--max-mb", f"{CORPUS_MB:g}"], timeout=300) != 0:
        raise StackError(f"building the corpus failed; see {ws.log('corpus')}")
    console.say(f"data: corpus of stdlib docstrings in {ws.corpus} ({time.monotonic() - t:.1f} s)")
    t = time.monotonic()
    if steps.run("tokenize", [py, "-m", "x1_pretrain.tokenize_data", "--input-dir", str(ws.corpus),
                              "--output-dir", str(ws.tokenized), "--tokenizer", "gpt2", "--val-fraction", "0.02",
                              "--workers", "2", "--seed", "42"], timeout=300) != 0:
        raise StackError(f"tokenizing failed; see {ws.log('tokenize')}")
    meta = json.loads((ws.tokenized / "meta.json").read_text(encoding="utf-8"))
    console.say(f"data: {meta['train_tokens']:,} train / {meta['val_tokens']:,} val GPT-2 tokens in {ws.tokenized} "
                f"({time.monotonic() - t:.1f} s)")


def stack_running(ws: Workspace) -> bool:
    return probe(ws.root).alive


def follow_training(ws: Workspace, sched: Schedule, console: Console, timeout_s: float) -> tuple[dict[str, Any], bool]:
    """Prints progress until the watchdog records its final decision; sends the simulated
    preemption on the way. Returns that decision and whether the preemption was relaunched."""
    log = LogFollower(ws.log("trainer"))
    seen_events = 0
    preempted_pid: int | None = None
    relaunched = False
    deadline = time.monotonic() + timeout_s
    while True:
        final = (read_json(ws.state_file) or {}).get("final")
        for line in log.lines():
            if m := STEP_LINE.search(line):
                step, total, loss, tps = int(m[1]), int(m[2]), m[3], int(m[4])
                spent = spent_usd(ws)
                money = f"  spent ${spent:6.2f} of ${CAP_USD:g}" if spent is not None else ""
                console.say(f"step {step:4d}/{total}  loss {loss:>7}  {tps:7,d} tok/s{money}")
                if preempted_pid is None and step >= sched.preempt_at:
                    preempted_pid = preempt(ws, console, step)
            elif m := VAL_LINE.search(line):
                console.say(f"step {int(m[1]):4d}  val_loss {m[2]}")
            elif NOTABLE.search(line):
                console.say("  " + line.split(": ", 1)[-1].strip()[:160])
        events = read_events(ws)
        for e in events[seen_events:]:
            if text := describe_event(e):
                console.say(text)
            relaunched |= e.get("event") == "relaunch" and preempted_pid is not None and e.get("exit_code") == 75
        seen_events = len(events)
        # The final decision is written before the instance is terminated: wait for that too.
        terminated = any(e.get("event") == "terminate" for e in events)
        if final and (terminated or final.get("exit_code") not in (0, 76, 77, 79) or final.get("reason") == "given-up"):
            return final, relaunched
        if not stack_running(ws):
            raise StackError(f"the stack stopped before the run ended; see {ws.log('stack')}")
        if time.monotonic() > deadline:
            raise StackError(f"training did not finish within {timeout_s / 60:g} min; see {ws.log('trainer')}")
        time.sleep(0.3)


def preempt(ws: Workspace, console: Console, step: int) -> int | None:
    """SIGTERM to the trainer process (not the watchdog): what a spot reclaim or `docker stop` sends."""
    pid = trainer_pid(ws)
    if pid is None:
        console.say(f"step {step}: no trainer running to preempt")
        return None
    console.say(f"simulated preemption: SIGTERM to trainer pid {pid} at step {step} "
                "(expect: emergency checkpoint, exit 75, relaunch with --resume-from-latest)")
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        return None
    return pid


def finish_run(ws: Workspace, steps: OneShots, mlflow_uri: str, console: Console, band: tuple[float, float]) -> int:
    """The run folder with the demo's band, then the DoD table; 0 only when every step succeeded.

    The trainer (--run-dir) already wrote the folder at its final exit, with the default band,
    and the watchdog added termination.json to it. `finish` writes it again from the same run
    with the demo's band (manifest, plots and dod agree on it): it replaces an earlier export
    (never a folder of something else) and keeps the post-mortem draft."""
    py = sys.executable
    run_id = None
    run_file = ws.checkpoints / "mlflow-run.json"
    if run_file.is_file():
        run_id = json.loads(run_file.read_text(encoding="utf-8")).get("run_id")
    lo_hi = [f"{band[0]:g}", f"{band[1]:g}"]
    finish = [py, "-m", "x1_pretrain.finish", "--mlflow-uri", mlflow_uri, "--output", str(ws.run_dir),
              "--ckpt-dir", str(ws.checkpoints), "--budget-file", str(ws.budget_file),
              "--termination-file", str(ws.termination_file), "--events-file", str(ws.events_file),
              "--band", *lo_hi, "--cap-usd", f"{CAP_USD:g}", *(["--run-id", run_id] if run_id else [])]
    t = time.monotonic()
    finished = steps.run("finish", finish, timeout=300)
    console.say(f"finish (export_run, post-mortem, dod with the band {band[0]:g}-{band[1]:g}): exit {finished} "
                f"({time.monotonic() - t:.1f} s)" + (f"; see {ws.log('finish')}" if finished else ""))
    code = steps.run("dod", [py, "-m", "x1_pretrain.dod", str(ws.run_dir), "--band", *lo_hi,
                             "--cap-usd", f"{CAP_USD:g}"], timeout=300)
    try:
        cost = json.loads((ws.run_dir / "manifest.json").read_text(encoding="utf-8")).get("restart_cost") or {}
    except (OSError, ValueError):
        cost = {}
    for r in cost.get("restarts", []):
        console.say(describe_restart(r))
    console.section("Definition of done")
    print(ws.log("dod").read_text(encoding="utf-8", errors="replace").rstrip(), flush=True)
    return code or finished


def print_artifacts(ws: Workspace) -> None:
    print(f"\n== Artifacts (under {ws.root}/)", flush=True)
    if ws.run_dir.is_dir():
        for f in sorted(ws.run_dir.iterdir()):
            print(f"  run/{f.name:28s} {f.stat().st_size:>12,d} bytes")
    print(f"  logs/       one log per service, trainer.log, stack.log, watchdog-events.jsonl, termination.json\n"
          f"  mlruns/     the MLflow store: mlflow ui --backend-store-uri sqlite:///{ws.mlruns.resolve()}/mlflow.db\n"
          f"  demo.env, checkpoints/, budget.json, data/", flush=True)


# ---------------------------------------------------------------------------------------------


def run_demo(args: argparse.Namespace, console: Console) -> int:
    # Absolute: the services run from the repository root, whatever the caller's directory.
    ws = Workspace(args.workspace.resolve())
    ws.reset(keep_data=not args.fresh)
    ports, notes = choose_ports(use_defaults=not args.free_ports)
    sched = Schedule.for_steps(args.steps)
    instance_id = f"demo-{uuid.uuid4().hex[:12]}"
    # Made up for this session, like a key from the provider's console; only the children see it.
    api_key = "x1demo-" + secrets.token_urlsafe(24)
    # The stack's environment: the key (.env leaves it empty, the shell's value wins, as for
    # compose), the sidecar's billing clock at the fake's speed (X1_BUDGET_TIME_SCALE, the
    # sidecar's own setting), one CPU thread per process.
    stack_env = dict(os.environ, LAMBDA_API_KEY=api_key, X1_BUDGET_TIME_SCALE=f"{TIME_SCALE:g}",
                     OMP_NUM_THREADS=str(TRAINER_THREADS), PYTHONUNBUFFERED="1")

    console.say(f"workspace {ws.root}")
    for note in notes:
        console.say(f"warning: {note}")
    console.say("ports: " + ", ".join(f"{name.replace('_', ' ')} {port}" for name, port in ports.items()))
    console.say(f"plan: {sched.steps} steps of {TINY_CONFIG.name}; preemption at step {sched.preempt_at}, spike "
                f"injected at steps {sched.spike_at}-{sched.spike_at + 4}; billing {TIME_SCALE:g}x wall time")

    steps = OneShots(ws)
    fake: Service | None = None
    started = False
    try:
        console.section("The cloud, the data, the stack")
        fake = Service("fake-billing", [
            sys.executable, "-m", "budget_sidecar.fake_billing", "--host", "127.0.0.1", "--port", str(ports.fake_billing),
            "--provider", "lambda", "--instance-id", instance_id, "--price-usd-per-hr", f"{PRICE_USD_PER_HR:g}",
            "--time-scale", f"{TIME_SCALE:g}"],
            # The key in the environment, never on a command line (`ps` shows those to every user).
            ws.log("fake-billing"), dict(os.environ, BILLING_API_KEY=api_key, PYTHONUNBUFFERED="1"),
            url=f"http://127.0.0.1:{ports.fake_billing}", health_path="/_state")
        prepare_data(ws, steps, console)
        env_file = demo_env(ws, ports, sched, instance_id, tuple(args.band))
        wait_until(fake.healthy, 60, "the fake billing API")
        console.say(f"fake billing API  {fake.url}  (instance {instance_id}, ${PRICE_USD_PER_HR:.2f}/h)")
        console.say(f"$ python -m x1_pretrain.stack up -d --env-file {env_file} --workspace {ws.root}")
        started = True
        up = stack_command(ws, "up", "-d", "--env-file", str(env_file), env=stack_env)
        if up.returncode != 0:
            raise StackError(f"stack up failed (exit {up.returncode}):\n{(up.stdout + up.stderr)[-3000:]}")
        console.say(up.stdout.rstrip())
        console.say(f"MLflow server     http://127.0.0.1:{ports.mlflow}; trainer output {ws.log('trainer')}")

        console.section("Training under the watchdog")
        t = time.monotonic()
        final, relaunched = follow_training(ws, sched, console, args.timeout_min * 60)
        code = int(final["exit_code"])
        console.say(f"the watchdog's final decision: {final.get('reason')} (exit {code}) after "
                    f"{time.monotonic() - t:.0f} s of training"
                    + ("" if relaunched else "; WARNING: the preemption relaunch was not seen"))
        spent = spent_usd(ws)
        if spent is not None:
            console.say(f"spend: ${spent:.2f} of the ${CAP_USD:g} cap (billed at {TIME_SCALE:g}x)")
        status = stack_command(ws, "status", timeout=60)
        console.say("$ python -m x1_pretrain.stack status\n" + status.stdout.rstrip())

        console.section("Export, post-mortem, definition of done")
        dod_code = finish_run(ws, steps, f"http://127.0.0.1:{ports.mlflow}", console, tuple(args.band))
    finally:
        # Also after Ctrl-C: the stack down (the trainer first, with its emergency checkpoint), the
        # one-shot in progress and the fake cloud. A second Ctrl-C must not cut this short.
        with signals_ignored():
            if steps.current is not None:
                steps.current.stop(5)
            if started:
                down = stack_command(ws, "down", timeout=300)
                console.say("$ python -m x1_pretrain.stack down\n" + (down.stdout + down.stderr).rstrip())
            if fake is not None:
                fake.stop(5)
    print_artifacts(ws)
    if code != 0:
        print(f"\nThe run did not finish (final decision: exit {code}): see {ws.logs}/watchdog.log", flush=True)
        return dod_code or 1
    print("\nAll DoD checks pass." if dod_code == 0 else f"\nA step failed or a DoD check failed (exit {dod_code}): "
          f"see {ws.logs}/finish.log and dod.log.", flush=True)
    return dod_code


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.steps < MIN_STEPS:
        parser.error(f"--steps must be at least {MIN_STEPS} (a checkpoint, the preemption and the spike fit), "
                     f"got {args.steps}")
    lo, hi = args.band
    if not (math.isfinite(lo) and math.isfinite(hi) and lo < hi):
        parser.error(f"--band: LO < HI, both finite, got {lo:g} {hi:g}")
    if not args.timeout_min > 0:
        parser.error(f"--timeout-min must be positive, got {args.timeout_min:g}")
    console = Console()

    # SIGTERM as Ctrl-C: either way the `finally` of the stack stops every child.
    def interrupt(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, interrupt)
    try:
        return run_demo(args, console)
    except KeyboardInterrupt:
        console.say("interrupted: every process the demo started has been stopped")
        return 130
    except StackError as e:
        console.say(f"error: {e}")
        return 2


if __name__ == "__main__":
    sys.exit(main())
