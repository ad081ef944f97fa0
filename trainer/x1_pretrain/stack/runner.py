"""`python -m x1_pretrain.stack up|status|down|prepare`: the X1 stack as processes, on a host
without Docker (a RunPod pod is itself a container), from the same .env as compose.yaml.

    python -m x1_pretrain.stack prepare --env-file .env --workspace /workspace   # once: data
    python -m x1_pretrain.stack up      --env-file .env --workspace /workspace   # -d to detach
    python -m x1_pretrain.stack status  --workspace /workspace
    python -m x1_pretrain.stack down    --workspace /workspace

Each service's command line and environment come from x1_pretrain.stack.services, the definition
compose.yaml is tested against; here in process mode (every server on 127.0.0.1, at the .env's
*_HOST_PORT ports). `up` starts, like `docker compose up`:

    compose service   here
    ---------------   ----
    prometheus        prometheus (when installed), scraping 127.0.0.1
    mlflow-server     python -m mlflow server, sqlite under WS/mlruns
    budget-sidecar    python -m budget_sidecar, the provider of .env
    watchdog          python -m x1_watchdog --mode process -- <compose's trainer command>
    trainer           the watchdog's child: trainer/entrypoint.sh (torchrun when NPROC > 1)

in that order, the watchdog once MLflow and the sidecar are healthy (compose's depends_on). A
service that dies is restarted with a backoff (compose's `restart: unless-stopped`); the trainer
only by the watchdog. Ctrl-C, SIGTERM or `down` stop them in the reverse order: the watchdog
forwards the stop to the trainer, which writes its emergency checkpoint and exits 75, recorded as
a requested stop and not relaunched; then the sidecar, MLflow and Prometheus. A hangup (SIGHUP:
the SSH session of a foreground `up` dropped) stops nothing: the runner goes on, logging to
stack.log only, and the run goes on training. `up` again, after a
`down`, a reboot or a pod resume, continues the run from its latest checkpoint; a final decision
of the watchdog (finished, budget stop, divergence, given up, start-up failure) is honoured: it
does not relaunch.

One stack per workspace: `up` takes a lease on the workspace (x1_pretrain.train.lease) and a second `up`
is refused, exit 2, naming the first, which it leaves alone. Logs: WS/logs/<service>.log, the
trainer's own output in WS/logs/trainer.log, this runner's in WS/logs/stack.log, and the state
`status` and `down` read in WS/logs/stack.json.

Also the library behind `make demo` (x1_pretrain.demo) and the tests: Workspace, Service, ports.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from x1_common.contracts import ExitCode
from x1_common.fsutil import WriteHealth, write_json_atomic
from x1_common.logs import RedactSecrets
from x1_pretrain.stack import services as S
from x1_pretrain.stack.process import (
    HEALTHY_TIMEOUT_S,
    STOP_GRACE,
    Service,
    health_body,
    signal_group,
    signals_ignored,
    wait_until,
)
from x1_pretrain.stack.status import cmd_status, collect_status, latest_checkpoint, render_status
from x1_pretrain.stack.workspace import (
    PORT_VARS,
    PROMETHEUS_YML,
    REPO,
    PortReservation,
    StackError,
    UsageError,
    Workspace,
    port_is_free,
    read_events,
    read_json,
    trainer_pid,
    workspace_arg,
)
from x1_pretrain.train import lease as L

RESTART_BACKOFF_MAX_S = 60.0
DETACHED_ENV = "X1_STACK_DETACHED"  # set for the runner `up -d` leaves in the background

log = logging.getLogger("x1.stack")


# ---------------------------------------------------------------------------------------------
# Settings: what `up` refuses before it starts anything


def check_settings(s: S.Settings, ws: Workspace) -> None:
    """Exit-2 problems of the .env, each naming its variable; compose would only find them when a
    service fails to start."""
    problems = []

    def number(var: str, kind: type, low: float | None = None, optional: bool = False) -> None:
        text = s[var]
        if optional and text == "":
            return
        try:
            value = kind(text)
        except ValueError:
            problems.append(f"{var}={text!r} is not {'a whole number' if kind is int else 'a number'}")
            return
        if low is not None and not value >= low:
            problems.append(f"{var}={text!r} must be at least {low:g}")

    if s["PROVIDER"] not in ("lambda", "runpod", "static"):
        problems.append(f"PROVIDER={s['PROVIDER']!r} must be lambda, runpod or static")
    elif s["PROVIDER"] == "static":
        if not s["RATE_USD_PER_HR"]:
            problems.append("RATE_USD_PER_HR: the static provider needs the hourly rate")
    else:
        if not s["INSTANCE_ID"]:
            problems.append(f"INSTANCE_ID: the {s['PROVIDER']} provider needs the instance (pod) id")
        key = "LAMBDA_API_KEY" if s["PROVIDER"] == "lambda" else "RUNPOD_API_KEY"
        if not s[key]:
            problems.append(f"{key}: the {s['PROVIDER']} provider needs its API key (in .env or the environment)")
        if s["RATE_USD_PER_HR"]:
            problems.append(f"RATE_USD_PER_HR is for the static provider only; {s['PROVIDER']} reads its price")
    for var in ("TOTAL_STEPS", "CKPT_EVERY", "EVAL_EVERY", "LOG_EVERY", "NPROC", "NNODES", "RDZV_JOIN_TIMEOUT",
                "MLFLOW_WORKERS"):
        number(var, int, 1)
    for var in ("MAX_RESTARTS", "DATA_MAX_SHARDS"):
        number(var, int, 0)
    for var in ("BUDGET_CAP_USD", "BUDGET_ALERT_USD", "MAX_PRICE_USD_PER_HR", "BUDGET_POLL_SECONDS",
                "STALL_SECONDS", "STARTUP_GRACE_SECONDS", "RESTART_WINDOW_SECONDS"):
        number(var, float, 0)
    for var in ("RATE_USD_PER_HR", "PLANNED_HOURS"):
        number(var, float, 0, optional=True)
    for var in PORT_VARS.values():
        text = s[var]
        if not (text.isdigit() and 1 <= int(text) <= 65535):
            problems.append(f"{var}={text!r} must be a port number in 1..65535")
    with contextlib.suppress(ValueError):
        if float(s["BUDGET_ALERT_USD"]) > float(s["BUDGET_CAP_USD"]):
            problems.append(f"BUDGET_ALERT_USD={s['BUDGET_ALERT_USD']} is above BUDGET_CAP_USD={s['BUDGET_CAP_USD']}")
    if s["NNODES"] != "1" and not (s["RDZV_ENDPOINT"] and s["RDZV_ID"]):
        problems.append(f"NNODES={s['NNODES']} needs RDZV_ENDPOINT (HOST:PORT of one host) and RDZV_ID (the same on every host)")
    if s["TERMINATE_ON_FINISH"] not in ("0", "1"):
        problems.append(f"TERMINATE_ON_FINISH={s['TERMINATE_ON_FINISH']!r} must be 0 or 1")
    if s["TERMINATE_ON_FINISH"] == "1" and s["PROVIDER"] == "static":
        problems.append("TERMINATE_ON_FINISH=1 needs a provider with an API (lambda or runpod), not static")
    if s["TERMINATE_ON_FINISH"] == "1" and not s["RESULTS_DIR"]:
        problems.append("TERMINATE_ON_FINISH=1 needs RESULTS_DIR: a folder on storage that outlives the instance "
                        "(a Lambda persistent filesystem, a RunPod network volume) where the run folder is copied "
                        "before the terminate; the workspace dies with the instance")
    if s["PROVIDER_API_URL"] and not s["PROVIDER_API_URL"].startswith(("http://", "https://")):
        problems.append(f"PROVIDER_API_URL={s['PROVIDER_API_URL']!r} must start with http:// or https://")
    config = Path(s["X1_CONFIG"])
    if not (config if config.is_absolute() else REPO / config).is_file():
        problems.append(f"X1_CONFIG={s['X1_CONFIG']!r}: no such file (relative paths are from {REPO})")
    ports = [s[var] for var in PORT_VARS.values()]
    if len(set(ports)) != len(ports):
        problems.append(f"the *_HOST_PORT settings must differ: {', '.join(f'{v}={s[v]}' for v in PORT_VARS.values())}")
    if problems:
        raise UsageError("; ".join(problems))
    if not ws.data_ready():
        raise UsageError(f"no tokenized data in {ws.tokenized} (meta.json is written last): run "
                         f"`python -m x1_pretrain.stack prepare --env-file ENV --workspace {ws.root}` first")


# ---------------------------------------------------------------------------------------------
# The runner


def base_environment(extra_path: str) -> dict[str, str]:
    """What every service inherits from the runner: its environment minus every variable of .env
    (a service gets those only as compose's `environment:` gives them), with this interpreter's
    folder first on PATH (torchrun, for NPROC > 1)."""
    env = {k: v for k, v in os.environ.items() if k not in S.DEFAULTS and k != DETACHED_ENV}
    env["PATH"] = extra_path + os.pathsep + env.get("PATH", "/usr/bin:/bin")
    return env


def prometheus_config(ws: Workspace, settings: S.Settings) -> Path:
    """monitoring/prometheus/prometheus.yml with the jobs pointed at 127.0.0.1 and the rules by path."""
    import yaml

    config = yaml.safe_load(PROMETHEUS_YML.read_text(encoding="utf-8"))
    config["rule_files"] = [str(PROMETHEUS_YML.parent / pattern) for pattern in config.get("rule_files", [])]
    for job in config["scrape_configs"]:
        job["static_configs"] = [{"targets": [f"127.0.0.1:{settings.port(job['job_name'])}"]}]
    path = ws.prometheus / "prometheus.yml"
    ws.prometheus.mkdir(parents=True, exist_ok=True)
    path.write_text("# written by python -m x1_pretrain.stack from monitoring/prometheus/prometheus.yml\n"
                    + yaml.safe_dump(config, sort_keys=False), encoding="utf-8")
    return path


class Runner:
    """`up` in the foreground: starts the services, keeps them up, stops them in order."""

    def __init__(self, settings: S.Settings, ws: Workspace, env_file: Path | None, use_prometheus: bool) -> None:
        self.settings = settings
        self.ws = ws
        self.env_file = env_file
        self.prometheus = shutil.which("prometheus") if use_prometheus else None
        self.specs = S.services(settings, S.process_mode(ws.root, sys.executable, REPO, self.prometheus or "prometheus"))
        self.base_env = base_environment(str(Path(sys.executable).parent))
        self.running: dict[str, Service] = {}
        self.restarts: dict[str, int] = {}  # for status
        self.in_a_row: dict[str, int] = {}  # deaths within a minute of the start, for the backoff
        self.next_start: dict[str, float] = {}
        self.state = "starting"
        self.stop_requested = threading.Event()
        self.lease: L.Lease | None = None
        self.ports = PortReservation()
        self.writes = WriteHealth(log)

    # -- the record status and down read --------------------------------------------------------

    def record(self) -> None:
        """WS/logs/stack.json, what `status` and `down` read. A disk that refuses it stops nothing
        (said once; the next record tries again): status then looks at the processes themselves."""
        try:
            self._record()
        except OSError as e:
            self.writes.failed(self.ws.stack_file, e, "`status` may show an older record; retried at the next change")
        else:
            self.writes.succeeded(self.ws.stack_file)

    def _record(self) -> None:
        me = self.lease.owner if self.lease else None
        write_json_atomic(self.ws.stack_file, {
            "state": self.state,
            "runner": {"pid": os.getpid(), "host": socket.gethostname(), "boot_id": L.boot_id(),
                       "pid_ns": L.pid_namespace(), "start_ticks": L.proc_start_ticks(os.getpid()),
                       "since": me.since if me else time.time(), "env_file": str(self.env_file) if self.env_file else None,
                       "log": str(self.ws.log("stack"))},
            "services": {
                name: {"pid": svc.pid, "start_ticks": L.proc_start_ticks(svc.pid), "log": str(svc.log_path),
                       "url": svc.url, "health_path": svc.health_path, "restarts": self.restarts.get(name, 0),
                       "started": svc.started}
                for name, svc in self.running.items()
            },
            "trainer_log": str(self.ws.log("trainer")),
            "updated": time.time(),
        }, durable=False)

    # -- starting ------------------------------------------------------------------------------

    def start_service(self, name: str) -> Service:
        spec = self.specs[name]
        env = {**self.base_env, "PYTHONUNBUFFERED": "1", **spec.image_env, **spec.env}
        url = f"http://127.0.0.1:{spec.port}" if spec.port else None
        svc = Service(name, spec.argv, self.ws.log(name), env, url=url, health_path=spec.health_path)
        self.running[name] = svc
        log.info("%-15s pid %-7d %s  log %s", name, svc.pid, (url or "") + (spec.health_path or ""), svc.log_path)
        return svc

    def check_ports(self) -> None:
        """Every port free and claimed for this stack (PortReservation), or UsageError naming each."""
        busy, claimed = [], []
        for name in ("mlflow-server", "budget-sidecar", "watchdog", "trainer", *(["prometheus"] if self.prometheus else [])):
            port = self.specs[name].port
            if not port:
                continue
            holder = self.ports.claim(port, self.ws.root)
            if holder is not None:
                claimed.append(f"{S.PORTS[name][1]}={port} ({name}) is claimed by {holder}")
            elif not port_is_free(port):
                busy.append(f"{S.PORTS[name][1]}={port} ({name})")
        problems = ([f"in use by another program: {', '.join(busy)}"] if busy else []) + claimed
        if problems:
            self.ports.release()
            raise UsageError(f"{'; '.join(problems)}; set free ports in .env")

    def check_provider_accepts_the_key(self, sidecar: Service) -> None:
        """A sidecar with no reading whose provider refused the API key (401/403) will not get one
        by waiting: UsageError now, with the provider's answer, rather than a timeout minutes later."""
        if sidecar.url is None:
            return
        health = health_body(sidecar.url + (sidecar.health_path or "/healthz"))
        if health.get("last_error_kind") != "auth" or health.get("last_update_utc"):
            return
        provider = self.settings["PROVIDER"]
        key = "LAMBDA_API_KEY" if provider == "lambda" else "RUNPOD_API_KEY"
        answer = str(health.get("last_error") or "").rstrip(". ")
        raise UsageError(f"the budget sidecar cannot read the spend: {answer}. The {provider} API "
                         f"refused the key: check {key} (in {self.env_file or 'the environment'}) and INSTANCE_ID; "
                         f"see {sidecar.log_path}")

    def up(self) -> None:
        """Everything started and healthy, the watchdog supervising the trainer."""
        for d in (self.ws.logs, self.ws.checkpoints, self.ws.mlruns, self.ws.root / "cache"):
            d.mkdir(parents=True, exist_ok=True)
        final = (read_json(self.ws.state_file) or {}).get("final")
        replan = (final or {}).get("exit_code") in (76, 78) and final.get("total_steps") not in (
            None, int(self.settings["TOTAL_STEPS"]))
        if final and replan:
            log.info("%s holds a budget decision (%s, exit %s at %s) for %s total steps: set aside for this re-plan "
                     "to %s", self.ws.state_file, final.get("reason"), final.get("exit_code"), final.get("time"),
                     final.get("total_steps"), self.settings["TOTAL_STEPS"])
        elif final:
            again = (" (after a budget stop: `up --total-steps N` with the N it says fits continues the run)"
                     if final.get("exit_code") in (76, 78) else " (a new run needs a new workspace)")
            log.warning("%s holds a final decision (%s, exit %s at %s): the watchdog will not launch the trainer%s",
                        self.ws.state_file, final.get("reason"), final.get("exit_code"), final.get("time"), again)
        if self.prometheus:
            prometheus_config(self.ws, self.settings)
            self.start_service("prometheus")
        else:
            log.info("%-15s not installed (apt-get install prometheus): skipped", "prometheus")
        servers = [self.start_service("mlflow-server"), self.start_service("budget-sidecar")]
        self.record()
        pending = list(servers)

        def ready() -> bool:
            # compose's depends_on: service_healthy (a 2xx: the sidecar answers 503 while it has no reading)
            for svc in list(pending):
                if svc.healthy(strict=True):
                    pending.remove(svc)
                elif svc.name == "budget-sidecar":
                    self.check_provider_accepts_the_key(svc)
            return not pending or self.stop_requested.is_set()

        try:
            wait_until(ready, HEALTHY_TIMEOUT_S, "MLflow and the budget sidecar", interval=0.5)
        except UsageError:
            raise  # it names its cause and its log already
        except StackError as e:
            raise StackError(f"{e}; see {', '.join(str(s.log_path) for s in pending)}") from None
        if self.stop_requested.is_set():
            return
        watchdog = self.start_service("watchdog")
        wait_until(lambda: watchdog.healthy(strict=True) or self.stop_requested.is_set(), 60,
                   f"the watchdog's /metrics (see {watchdog.log_path})", interval=0.5)
        self.state = "running"
        self.record()
        log.info("up: trainer output in %s; stop with Ctrl-C or `python -m x1_pretrain.stack down --workspace %s` "
                 "(the trainer first, with its emergency checkpoint)", self.ws.log("trainer"), self.ws.root)

    # -- keeping up ------------------------------------------------------------------------------

    def supervise(self) -> None:
        """Until a stop is asked: a service that died is restarted after a backoff that doubles while
        it keeps dying within a minute of its start (compose's unless-stopped)."""
        final_seen = (read_json(self.ws.state_file) or {}).get("final")
        while not self.stop_requested.wait(1.0):
            final = (read_json(self.ws.state_file) or {}).get("final")
            if final and not final_seen:  # said once, here and in stack.log: the watchdog now holds
                log.warning("the watchdog's final decision: %s (exit %s)%s; the trainer is not launched again "
                            "(`python -m x1_pretrain.stack status --workspace %s`)", final.get("reason"),
                            final.get("exit_code"), f": {final['error']}" if final.get("error") else "", self.ws.root)
            final_seen = final_seen or final
            for name, svc in list(self.running.items()):
                if svc.alive():
                    continue
                if name not in self.next_start:
                    quick = time.monotonic() - svc.started_mono < 60
                    self.in_a_row[name] = self.in_a_row.get(name, 0) + 1 if quick else 0
                    delay = min(2.0 ** self.in_a_row[name], RESTART_BACKOFF_MAX_S)
                    self.next_start[name] = time.monotonic() + delay
                    log.error("%s exited with code %s; restarting it in %.0f s. The end of %s:\n%s", name,
                              svc.proc.returncode, delay, svc.log_path, svc.log_tail(1500))
                    svc.stop(0)
                elif time.monotonic() >= self.next_start[name]:
                    del self.next_start[name]
                    self.restarts[name] = self.restarts.get(name, 0) + 1
                    try:
                        self.start_service(name)
                    except StackError as e:
                        log.error("%s", e)
                    self.record()

    # -- stopping ------------------------------------------------------------------------------

    def down(self) -> None:
        """The reverse of the start order: the watchdog (which stops the trainer with its emergency
        checkpoint and records the stop as requested) first. A second signal meanwhile is ignored:
        cutting the clean-up short would leave orphans."""
        with signals_ignored():
            self.state = "stopping"
            self.record()
            for name in reversed(S.START_ORDER):
                svc = self.running.get(name)
                if svc is None:
                    continue
                code = svc.stop(grace=STOP_GRACE.get(name, 15.0))
                log.info("%-15s stopped (exit %s)", name, code)
                if name == "watchdog":
                    self.report_trainer_stop()
                del self.running[name]
            # A trainer left by a watchdog that could not stop it (killed itself) must not run on alone.
            pid = trainer_pid(self.ws)
            if pid is not None:
                log.warning("trainer pid %d still running after the watchdog: SIGKILL", pid)
                signal_group(pid, signal.SIGKILL)
            self.state = "stopped"
            self.record()

    def report_trainer_stop(self) -> None:
        events = read_events(self.ws)
        last = events[-1] if events else None
        if last and last.get("event") == "exit":
            how = "a requested stop" if last.get("stop_requested") else last.get("reason")
            latest = (self.ws.checkpoints / "latest").read_text().strip() if (self.ws.checkpoints / "latest").is_file() else None
            log.info("trainer pid %s exited %s (%s); latest checkpoint %s", last.get("pid"), last.get("exit_code"),
                     how, latest or "none")


def end_leftovers(ws: Workspace) -> list[str]:
    """Services a runner that died left running (its stack.json), on this host: stopped in order.
    After a reboot or a pod resume there are none (other boot id, or other pids)."""
    record = read_json(ws.stack_file) or {}
    runner = record.get("runner") or {}
    if runner.get("boot_id") != L.boot_id() or runner.get("pid_ns") != L.pid_namespace():
        return []
    stopped = []
    services = record.get("services") or {}
    for name in reversed(S.START_ORDER):
        info = services.get(name) or {}
        pid, ticks = info.get("pid"), info.get("start_ticks")
        if not isinstance(pid, int) or ticks is None or L.proc_start_ticks(pid) != ticks:
            continue
        signal_group(pid, signal.SIGTERM)
        deadline = time.monotonic() + STOP_GRACE.get(name, 15.0)
        while time.monotonic() < deadline and L.proc_start_ticks(pid) == ticks:
            time.sleep(0.2)
        signal_group(pid, signal.SIGKILL)
        stopped.append(f"{name} (pid {pid})")
    pid = trainer_pid(ws)
    if pid is not None:
        signal_group(pid, signal.SIGKILL)
        stopped.append(f"trainer (pid {pid})")
    return stopped


# ---------------------------------------------------------------------------------------------
# The commands


def setup_runner_logging(ws: Workspace) -> None:
    """The runner's lines on stderr and in WS/logs/stack.log (detached, stderr is that file), secrets redacted."""
    fmt = logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s", "%Y-%m-%d %H:%M:%S")
    handlers: list[logging.Handler] = [logging.StreamHandler(sys.stderr)]
    if os.environ.get(DETACHED_ENV) != "1":
        ws.logs.mkdir(parents=True, exist_ok=True)
        handlers.append(logging.FileHandler(ws.log("stack"), encoding="utf-8"))
    root = logging.getLogger()
    root.handlers[:] = handlers
    for h in handlers:
        h.setFormatter(fmt)
        h.addFilter(RedactSecrets())
    root.setLevel(logging.INFO)


def leave_terminal() -> None:
    """After a hangup: log to stack.log only, and point stdin, stdout and stderr at /dev/null, so
    that nothing this runner still prints (or reads) meets a terminal that is gone (EIO, or a stop
    as a background process of it)."""
    root = logging.getLogger()
    root.handlers[:] = [h for h in root.handlers if isinstance(h, logging.FileHandler)
                        or not isinstance(h, logging.StreamHandler)]
    with contextlib.suppress(OSError):
        null = os.open(os.devnull, os.O_RDWR)
        for fd in (0, 1, 2):
            os.dup2(null, fd)
        os.close(null)


def refuse_if_running(ws: Workspace) -> None:
    seen = L.probe(ws.root)
    if seen.owner is not None and seen.alive:
        raise UsageError(f"a stack is already running in {ws.root}: {seen.owner.describe()} ({seen.why}); "
                         f"`python -m x1_pretrain.stack status --workspace {ws.root}` shows it, `down` stops it")


def check_writable(ws: Workspace) -> None:
    """`up` writes logs, checkpoints, budget.json and MLflow's store into the workspace: one it
    cannot write in (a read-only mount, another user's folder) is bad input, said before anything
    starts, not an OSError from deep inside."""
    for folder in (ws.root, ws.logs, ws.checkpoints, ws.mlruns):
        probe = folder / f".x1-write-test-{os.getpid()}"
        try:
            folder.mkdir(parents=True, exist_ok=True)
            probe.write_bytes(b"")
            probe.unlink()
        except OSError as e:
            raise UsageError(f"workspace {ws.root}: cannot write in {folder} ({e.strerror}); `up` writes its logs, "
                             "checkpoints, budget.json and MLflow's store there: give a writable --workspace") from None


def cmd_up(args: argparse.Namespace) -> int:
    ws: Workspace = args.workspace
    settings = S.Settings.load(args.env_file)
    if args.total_steps is not None:  # a re-plan: over the .env's TOTAL_STEPS, for the trainer and the watchdog
        settings = S.Settings({**settings.values, "TOTAL_STEPS": str(args.total_steps)})
    check_settings(settings, ws)
    refuse_if_running(ws)  # before anything is written: the running stack is left alone
    check_writable(ws)
    if args.detach:
        return detach(args, ws)
    runner = Runner(settings, ws, args.env_file.resolve() if args.env_file else None, not args.no_prometheus)

    def lost(problem: str) -> None:
        log.error("the workspace lease was lost (%s): stopping", problem)
        runner.stop_requested.set()

    setup_runner_logging(ws)
    try:
        runner.lease = L.Lease(ws.root, L.LeaseKind.STACK, on_lost=lost).acquire()
    except (L.LeaseHeld, L.LeaseError) as e:
        raise UsageError(str(e)) from None

    def on_signal(signum: int, _frame: Any) -> None:
        log.info("%s: stopping the stack (the trainer first, with its emergency checkpoint)",
                 signal.Signals(signum).name)
        runner.stop_requested.set()

    def on_hangup(signum: int, _frame: Any) -> None:
        # The terminal went away (an SSH session that dropped): a paid run goes on training. Its
        # lines go to stack.log only from here; `status` shows the stack, `down` stops it.
        if os.environ.get(DETACHED_ENV) != "1":  # `up -d`: stderr is stack.log already, and no terminal
            leave_terminal()
        log.warning("SIGHUP: the terminal is gone; the stack keeps running (this runner's lines go on in %s): "
                    "`python -m x1_pretrain.stack status --workspace %s` shows it, `down` stops it",
                    ws.log("stack"), ws.root)

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGHUP, on_hangup)
    log.info("x1 stack in %s from %s: provider %s%s", ws.root, args.env_file or "the environment",
             settings["PROVIDER"], f" ({settings['INSTANCE_ID']})" if settings["INSTANCE_ID"] else "")
    code = 0
    try:
        if left := end_leftovers(ws):
            log.warning("stopped what a previous runner left running: %s", ", ".join(left))
        runner.check_ports()
        runner.up()
        runner.supervise()
    except UsageError as e:
        log.error("%s", e)
        raise
    except StackError as e:
        log.error("%s", e)
        code = 1
    finally:
        runner.down()
        runner.ports.release()
        runner.lease.release()
        log.info("down")
    return code


def detach(args: argparse.Namespace, ws: Workspace) -> int:
    """`up -d`: the same `up`, in a session of its own with its output in WS/logs/stack.log; returns
    once the stack is running (or says why it did not start)."""
    ws.logs.mkdir(parents=True, exist_ok=True)
    argv = [sys.executable, "-m", "x1_pretrain.stack", "up", "--workspace", str(ws.root)]
    if args.env_file is not None:
        argv += ["--env-file", str(args.env_file.resolve())]
    if args.no_prometheus:
        argv.append("--no-prometheus")
    if args.total_steps is not None:
        argv += ["--total-steps", str(args.total_steps)]
    with open(ws.log("stack"), "ab") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=out, stdin=subprocess.DEVNULL, cwd=REPO,
                                env=dict(os.environ, **{DETACHED_ENV: "1"}), start_new_session=True)

    def started() -> bool:
        record = read_json(ws.stack_file) or {}
        return proc.poll() is not None or (record.get("runner", {}).get("pid") == proc.pid
                                           and record.get("state") == "running")

    try:
        wait_until(started, HEALTHY_TIMEOUT_S + 60, "the stack to come up", interval=0.5)
    except StackError as e:
        print(f"up -d: {e}; it goes on in the background (pid {proc.pid}): see {ws.log('stack')}", file=sys.stderr)
        return 1
    if proc.poll() is not None:
        tail = ws.log("stack").read_text(encoding="utf-8", errors="replace")[-3000:]
        print(f"up -d: the stack did not start (exit {proc.returncode}); the end of {ws.log('stack')}:\n{tail}",
              file=sys.stderr)
        return proc.returncode or 1
    print(f"x1 stack up in {ws.root} (runner pid {proc.pid}, log {ws.log('stack')})")
    print(render_status(collect_status(ws)))
    return 0


def cmd_down(args: argparse.Namespace) -> int:
    ws: Workspace = args.workspace
    seen = L.probe(ws.root)
    if seen.owner is not None and seen.alive:
        if not seen.local:
            raise UsageError(f"the stack in {ws.root} runs on another host ({seen.owner.describe()}): "
                             "run `down` there")
        print(f"stopping the stack in {ws.root} (runner {seen.owner.describe()}): the trainer first, "
              "with its emergency checkpoint", flush=True)
        try:
            os.kill(seen.owner.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
        gone = lambda: not L.probe(ws.root).alive  # noqa: E731
        try:
            wait_until(gone, args.timeout, "the stack to stop", interval=0.5)
        except StackError:
            print(f"down: the runner (pid {seen.owner.pid}) is still stopping after {args.timeout:g} s; "
                  f"see {ws.log('stack')}", file=sys.stderr)
            return 1
    else:
        left = end_leftovers(ws)
        if not left:
            print(f"no stack is running in {ws.root}")
            return 0
        print(f"the runner was gone; stopped what it left running: {', '.join(left)}")
    events = read_events(ws)
    last = events[-1] if events else None
    if last and last.get("event") == "exit":
        how = "stop requested, not relaunched" if last.get("stop_requested") else last.get("reason")
        print(f"trainer: exit {last.get('exit_code')} ({how}); latest checkpoint {latest_checkpoint(ws) or 'none'}")
    print(f"down: {ws.root}")
    return 0


def cmd_prepare(args: argparse.Namespace) -> int:
    """`docker compose run --rm prepare`: download and tokenize into WS/data, in the foreground."""
    ws: Workspace = args.workspace
    settings = S.Settings.load(args.env_file)
    spec = S.services(settings, S.process_mode(ws.root, sys.executable, REPO))["prepare"]
    ws.data.mkdir(parents=True, exist_ok=True)
    env = {**base_environment(str(Path(sys.executable).parent)), **spec.image_env, **spec.env}
    print("prepare: " + " ".join(spec.argv), flush=True)
    return subprocess.call(spec.argv, env=env, cwd=REPO)


# ---------------------------------------------------------------------------------------------


DESCRIPTION = """\
The X1 stack as processes, for a host without Docker (a RunPod pod is itself a container): the
MLflow server (sqlite under WORKSPACE/mlruns), the budget sidecar (the provider of .env; static
rate supported), the watchdog in process mode supervising the trainer with compose's trainer
flags, and Prometheus when it is installed. Each service's command line and environment are
x1_pretrain.stack.services', the definition compose.yaml is tested against; here every server listens on
127.0.0.1 at the .env's *_HOST_PORT ports (a pod's 0.0.0.0 is the internet, and MLflow and the
sidecar have no authentication: reach them through SSH).

commands:
  prepare   download and tokenize into WORKSPACE/data (compose's `prepare` service), once
  up        start the stack in the foreground (-d: in the background, returning once it runs);
            Ctrl-C or SIGTERM stop it in order, the trainer first with its emergency checkpoint.
            A hangup (SIGHUP: the SSH session dropped) does not: the stack keeps running, the
            runner's lines go on in WORKSPACE/logs/stack.log, `status` shows it, `down` stops it.
            Again after a `down`, a reboot or a pod resume, it continues the run from its latest
            checkpoint; a final decision of the watchdog (finished, budget stop, divergence,
            given up, start-up failure: WORKSPACE/logs/watchdog-state.json) is honoured, the
            trainer not relaunched.
  status    each service's health, the trainer's step and tokens/s, spend vs cap, the watchdog's
            last decision (--json for scripts); exit 0 when running and healthy, else 1
  down      stop the stack started by `up` in WORKSPACE (also one whose runner died)

Settings come from --env-file, the same .env as compose (cp .env.example .env), with the shell's
environment over it as for compose; secrets reach only the services compose gives them to, in
their environment. Logs: WORKSPACE/logs/<service>.log, trainer.log (the trainer's own output),
stack.log (this runner), watchdog-events.jsonl (every decision). One stack per workspace and one
trainer per checkpoint folder: a second `up` is refused (exit 2) naming the running one.

exit codes: 0 done; 1 a service failed (see its log); 2 bad input (a setting, a path, a stack
already running), naming it.
"""


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m x1_pretrain.stack", description=DESCRIPTION,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True, metavar="{prepare,up,status,down}")

    def common(sp: argparse.ArgumentParser, env: bool) -> None:
        sp.add_argument("--workspace", type=workspace_arg, required=True,
                        help="the folder compose mounts at /workspace: data/, checkpoints/, mlruns/, logs/, budget.json "
                             "(on RunPod: the network volume, /workspace)")
        if env:
            sp.add_argument("--env-file", type=Path, default=None,
                            help="the .env compose reads (default: none, only the environment and compose's defaults)")

    sp = sub.add_parser("up", help="start the stack (foreground; -d detaches)")
    common(sp, env=True)
    sp.add_argument("-d", "--detach", action="store_true", help="run in the background, return once it is up")
    sp.add_argument("--no-prometheus", action="store_true", help="do not start Prometheus even when installed")
    sp.add_argument("--total-steps", type=int, metavar="N",
                    help="the run's total steps, over the .env's TOTAL_STEPS: after a budget stop, the N it says "
                         "fits continues the run from its checkpoint (the stop's decision is set aside for this "
                         "re-plan only)")
    sp = sub.add_parser("status", help="health, step, tokens/s, spend, the watchdog's last decision")
    common(sp, env=False)
    sp.add_argument("--json", action="store_true", help="the same as JSON")
    sp = sub.add_parser("down", help="stop the stack, the trainer first with its emergency checkpoint")
    common(sp, env=False)
    sp.add_argument("--timeout", type=float, default=300.0, help="seconds to wait for it to stop (default 300)")
    sp = sub.add_parser("prepare", help="download + tokenize the data into WORKSPACE/data, once")
    common(sp, env=True)
    return p


COMMANDS = {"up": cmd_up, "status": cmd_status, "down": cmd_down, "prepare": cmd_prepare}


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if getattr(args, "env_file", None) is not None and not args.env_file.is_file():
        parser.error(f"--env-file {args.env_file}: no such file (cp .env.example .env)")
    try:
        return COMMANDS[args.command](args)
    except (UsageError, S.SettingsError) as e:
        print(f"error: {e}", file=sys.stderr)
        return int(ExitCode.USAGE)
    except StackError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
