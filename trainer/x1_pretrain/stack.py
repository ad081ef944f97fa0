"""`python -m x1_pretrain.stack up|status|down|prepare`: the X1 stack as processes, on a host
without Docker (a RunPod pod is itself a container), from the same .env as compose.yaml.

    python -m x1_pretrain.stack prepare --env-file .env --workspace /workspace   # once: data
    python -m x1_pretrain.stack up      --env-file .env --workspace /workspace   # -d to detach
    python -m x1_pretrain.stack status  --workspace /workspace
    python -m x1_pretrain.stack down    --workspace /workspace

Each service's command line and environment come from x1_common.services, the definition
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
a requested stop and not relaunched; then the sidecar, MLflow and Prometheus. `up` again, after a
`down`, a reboot or a pod resume, continues the run from its latest checkpoint; a final decision
of the watchdog (finished, budget stop, divergence, given up, start-up failure) is honoured: it
does not relaunch.

One stack per workspace: `up` takes a lease on the workspace (x1_pretrain.lease) and a second `up`
is refused, exit 2, naming the first, which it leaves alone. Logs: WS/logs/<service>.log, the
trainer's own output in WS/logs/trainer.log, this runner's in WS/logs/stack.log, and the state
`status` and `down` read in WS/logs/stack.json.

Also the library behind `make demo` (x1_pretrain.demo) and the tests: Workspace, Service, ports.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import json
import logging
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from x1_common import restarts
from x1_common import services as S
from x1_common.contracts import SIDECAR_PORT, TRAINER_METRICS_PORT, WATCHDOG_METRICS_PORT, ExitCode, Heartbeat
from x1_common.fsutil import write_json_atomic
from x1_common.logs import RedactSecrets
from x1_pretrain import lease as L

REPO = Path(__file__).resolve().parents[2]
TINY_CONFIG = REPO / "configs" / "tiny-cpu.yaml"
PROMETHEUS_YML = REPO / "monitoring" / "prometheus" / "prometheus.yml"

# compose.yaml's ports; the fake billing API has none (the real one is on the internet).
DEFAULT_PORTS = {
    "mlflow": 5000,
    "trainer": TRAINER_METRICS_PORT,
    "sidecar": SIDECAR_PORT,
    "watchdog": WATCHDOG_METRICS_PORT,
    "prometheus": 9090,
    "fake_billing": 0,
}
# Ports.<name> -> the .env variable that sets it
PORT_VARS = {"mlflow": "MLFLOW_HOST_PORT", "trainer": "TRAINER_METRICS_HOST_PORT", "sidecar": "SIDECAR_HOST_PORT",
             "watchdog": "WATCHDOG_METRICS_HOST_PORT", "prometheus": "PROMETHEUS_HOST_PORT"}

# A file in the workspace that says the demo made it: Workspace.reset() wipes only such a folder.
MARKER = ".x1-demo-workspace"

# How long a stopping service gets before SIGKILL: the watchdog its --term-grace-seconds (60 by
# default) for the trainer's emergency checkpoint, and some more for itself.
STOP_GRACE = {"watchdog": 100.0}
HEALTHY_TIMEOUT_S = 300.0  # MLflow's first start (database migrations) and the sidecar's first reading
RESTART_BACKOFF_MAX_S = 60.0
DETACHED_ENV = "X1_STACK_DETACHED"  # set for the runner `up -d` leaves in the background
# Where running stacks claim their ports (PortReservation); shared by every stack on this host.
PORTS_DIR = Path(os.environ.get("X1_STACK_PORTS_DIR") or Path(tempfile.gettempdir()) / "x1-stack-ports")

log = logging.getLogger("x1.stack")


class StackError(RuntimeError):
    """A service did not start or died; the message names it and quotes its log."""


class UsageError(StackError):
    """Bad input (a setting, a path, a second `up`): exit 2, nothing started."""


# ---------------------------------------------------------------------------------------------
# The workspace: /workspace of compose, as a folder


@dataclass(frozen=True)
class Workspace:
    root: Path

    @property
    def data(self) -> Path:
        return self.root / "data"

    @property
    def corpus(self) -> Path:
        return self.data / "corpus"

    @property
    def tokenized(self) -> Path:
        return self.data / "tokenized"

    @property
    def checkpoints(self) -> Path:
        return self.root / "checkpoints"

    @property
    def mlruns(self) -> Path:
        return self.root / "mlruns"

    @property
    def logs(self) -> Path:
        return self.root / "logs"

    @property
    def budget_file(self) -> Path:
        return self.root / "budget.json"

    @property
    def run_dir(self) -> Path:
        return self.root / "run"

    @property
    def heartbeat(self) -> Path:
        return self.logs / "heartbeat.json"

    @property
    def events_file(self) -> Path:
        return self.logs / "watchdog-events.jsonl"

    @property
    def state_file(self) -> Path:
        return self.logs / "watchdog-state.json"

    @property
    def termination_file(self) -> Path:
        return self.logs / "termination.json"

    @property
    def stack_file(self) -> Path:
        return self.logs / "stack.json"

    @property
    def prometheus(self) -> Path:
        return self.root / "prometheus"

    def log(self, name: str) -> Path:
        return self.logs / f"{name}.log"

    def data_ready(self) -> bool:
        """tokenize_data writes meta.json last (temp + rename): its presence means a complete output."""
        return (self.tokenized / "meta.json").is_file()

    def reset(self, keep_data: bool) -> None:
        """An empty workspace (the tokenized corpus kept when `keep_data` and complete), for the demo.

        Refuses a non-empty folder that is not a workspace of ours: --workspace pointed at the
        wrong place must not cost someone their files.
        """
        root = self.root
        if root.exists() and not root.is_dir():
            raise StackError(f"workspace {root} exists and is not a folder")
        if root.is_dir() and any(root.iterdir()) and not (root / MARKER).is_file():
            raise StackError(f"workspace {root} is not empty and was not made by the demo (no {MARKER}); "
                             "choose another --workspace or empty it yourself")
        keep = keep_data and self.data_ready()
        if root.is_dir():
            for child in root.iterdir():
                if child.name == MARKER or (keep and child == self.data):
                    continue
                if child.is_dir() and not child.is_symlink():
                    shutil.rmtree(child)
                else:
                    child.unlink()
        if not keep and self.data.exists():
            shutil.rmtree(self.data)
        for d in (self.root, self.data, self.checkpoints, self.mlruns, self.logs):
            d.mkdir(parents=True, exist_ok=True)
        (root / MARKER).write_text("made by python -m x1_pretrain.demo; wiped by its next run\n", encoding="utf-8")

    def files(self) -> Iterator[Path]:
        """Every regular file under the workspace."""
        for dirpath, _dirs, names in os.walk(self.root):
            for name in names:
                yield Path(dirpath) / name


# ---------------------------------------------------------------------------------------------
# Ports


def port_is_free(port: int) -> bool:
    """True when nothing listens on `port` (any address): what a service binding it needs.

    SO_REUSEADDR, as the services' own servers set it, so a port left in TIME_WAIT by a previous
    run counts as free and only a real listener counts as busy.
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("0.0.0.0", port))
        except OSError:
            return False
    return True


class PortReservation:
    """A stack's claim on its ports, on this host, for as long as its runner lives.

    The port check alone misses a port whose server is down for a moment: the trainer between
    a crash and its relaunch, or still loading. A second stack given the same port would pass
    the check, and Prometheus would then scrape the other run's numbers under this run's name.
    So each runner holds a POSIX lock on PORTS_DIR/<port>.lock per port (the kernel drops it when
    the runner dies, SIGKILL included) and writes its workspace into it for the message."""

    def __init__(self) -> None:
        self._fds: list[int] = []

    def claim(self, port: int, workspace: Path) -> str | None:
        """None with `port` held; else who holds it, in words."""
        PORTS_DIR.mkdir(parents=True, exist_ok=True)
        with contextlib.suppress(OSError):
            os.chmod(PORTS_DIR, 0o1777)  # every user's stacks share it, as /tmp
        path = PORTS_DIR / f"{port}.lock"
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
        except OSError as e:
            return f"cannot open {path} ({e.strerror})"
        try:
            fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            holder = os.read(fd, 4096).decode("utf-8", errors="replace").strip()
            os.close(fd)
            return holder or "another X1 stack"
        os.ftruncate(fd, 0)
        os.write(fd, f"the X1 stack in {workspace} (runner pid {os.getpid()})".encode())
        self._fds.append(fd)
        return None

    def release(self) -> None:
        for fd in self._fds:
            os.close(fd)  # drops the lock
        self._fds.clear()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass(frozen=True)
class Ports:
    mlflow: int
    trainer: int
    sidecar: int
    watchdog: int
    prometheus: int
    fake_billing: int

    def items(self) -> list[tuple[str, int]]:
        return [(name, getattr(self, name)) for name in DEFAULT_PORTS]

    def env(self) -> dict[str, str]:
        """The .env lines that put the stack on these ports."""
        return {var: str(getattr(self, name)) for name, var in PORT_VARS.items()}


def choose_ports(use_defaults: bool = True) -> tuple[Ports, list[str]]:
    """The ports to use, and a note for each default that was busy.

    With `use_defaults`, compose's ports (5000, 9791-9793, 9090) where they are free; a busy one
    is reported and replaced by a free port, never fought over. Without, free ports throughout
    (tests, which run beside other tests).
    """
    chosen: dict[str, int] = {}
    notes: list[str] = []
    for name, default in DEFAULT_PORTS.items():
        if use_defaults and default and default not in chosen.values() and port_is_free(default):
            chosen[name] = default
            continue
        port = free_port()
        while port in chosen.values():
            port = free_port()
        if use_defaults and default:
            notes.append(f"port {default} ({name.replace('_', ' ')}) is busy: using {port} instead")
        chosen[name] = port
    return Ports(**chosen), notes


# ---------------------------------------------------------------------------------------------
# One service


def wait_until(predicate: Callable[[], Any], timeout: float, what: str, interval: float = 0.2) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise StackError(f"timed out after {timeout:g} s waiting for {what}")
        time.sleep(interval)


def http_status(url: str, timeout: float = 5.0) -> int | None:
    """The HTTP status of GET url (errors included), or None when nothing answers."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            return resp.status
    except urllib.error.HTTPError as e:
        return e.code
    except (urllib.error.URLError, OSError):
        return None


def http_json(url: str, timeout: float = 5.0) -> Any:
    with urllib.request.urlopen(url, timeout=timeout) as resp:
        return json.loads(resp.read())


def health_body(url: str, timeout: float = 2.0) -> dict[str, Any]:
    """The JSON a health URL answers, whatever its status (the sidecar's 503 says why); {} if none."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            body = resp.read(65536)
    except urllib.error.HTTPError as e:
        body = e.read(65536)
    except (urllib.error.URLError, OSError):
        return {}
    try:
        data = json.loads(body)
    except ValueError:
        return {}
    return data if isinstance(data, dict) else {}


class Service:
    """A child process in its own process group, its output appended to a log file."""

    def __init__(self, name: str, argv: list[str], log_path: Path, env: dict[str, str], url: str | None = None,
                 health_path: str | None = None) -> None:
        self.name = name
        self.argv = argv
        self.log_path = log_path
        self.url = url
        self.health_path = health_path
        self.started = time.time()
        log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = open(log_path, "ab")  # noqa: SIM115 - closed in stop()
        try:
            # start_new_session: signals from the terminal reach the runner only, which stops the
            # services in order.
            self.proc = subprocess.Popen(argv, stdout=self._log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         env=env, cwd=REPO, start_new_session=True)
        except OSError as e:
            self._log.close()
            raise StackError(f"cannot start {name} ({argv[0]}): {e.strerror}") from e

    @property
    def pid(self) -> int:
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc.poll() is None

    def log_tail(self, chars: int = 3000) -> str:
        try:
            return self.log_path.read_text(encoding="utf-8", errors="replace")[-chars:]
        except OSError:
            return ""

    def check_alive(self) -> None:
        if not self.alive():
            raise StackError(f"{self.name} exited with code {self.proc.returncode}; the end of {self.log_path}:\n"
                             f"{self.log_tail()}")

    def healthy(self, strict: bool = False) -> bool:
        """Answers its health URL: any status below 500 (the sidecar's 503 'no reading yet' is not
        up), or with `strict` a 2xx only, as compose's healthchecks ask."""
        self.check_alive()
        if self.url is None or self.health_path is None:
            return True
        status = http_status(self.url + self.health_path, timeout=2.0)
        return status is not None and (200 <= status < 300 if strict else status < 500)

    def wait(self, timeout: float | None = None) -> int | None:
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            return None

    def stop(self, grace: float = 10.0) -> int | None:
        """SIGTERM to its group, up to `grace` seconds, then SIGKILL to whatever of the group is left."""
        if self.proc.poll() is None:
            signal_group(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(grace)
            except subprocess.TimeoutExpired:
                pass
        signal_group(self.proc.pid, signal.SIGKILL)  # stragglers: mlflow's uvicorn worker, a tokenizer pool
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            pass
        if not self._log.closed:
            self._log.close()
        return self.proc.returncode


def mlflow_server(db: Path, artifacts: Path, port: int, log_path: Path, env: dict[str, str]) -> Service:
    """A real `mlflow server` on 127.0.0.1:port over a sqlite backend (tests that need one alone)."""
    return Service(
        "mlflow-server",
        [sys.executable, "-m", "mlflow", "server", "--backend-store-uri", f"sqlite:///{db.resolve()}",
         "--artifacts-destination", str(artifacts.resolve()), "--host", "127.0.0.1", "--port", str(port),
         "--workers", "1"],
        log_path,
        # MLflow 3's job runner (huey workers) is not used here and costs a core at start.
        dict(env, MLFLOW_SERVER_ENABLE_JOB_EXECUTION="false"),
        url=f"http://127.0.0.1:{port}", health_path="/health",
    )


def signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def is_trainer_process(pid: int) -> bool:
    """True when `pid` is alive and runs x1_pretrain.train (not a later process that got its pid)."""
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state not in ("Z", "X") and b"x1_pretrain.train" in cmdline


@contextlib.contextmanager
def signals_ignored() -> Iterator[None]:
    """SIGINT and SIGTERM ignored inside (main thread only: elsewhere Python cannot set handlers)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    saved = {sig: signal.signal(sig, signal.SIG_IGN) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, handler in saved.items():
            signal.signal(sig, handler)


def read_events(ws: Workspace) -> list[dict[str, Any]]:
    """The watchdog's decisions so far (a torn last line, being written, is left out)."""
    try:
        lines = ws.events_file.read_text(encoding="utf-8").splitlines()
    except OSError:
        return []
    out = []
    for line in lines:
        try:
            out.append(json.loads(line))
        except ValueError:
            continue
    return out


def trainer_pid(ws: Workspace) -> int | None:
    """The pid of the trainer the watchdog started last, while it runs."""
    starts = [e for e in read_events(ws) if e.get("event") == "start" and isinstance(e.get("pid"), int)]
    if not starts:
        return None
    pid = starts[-1]["pid"]
    return pid if is_trainer_process(pid) else None


def read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


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


def workspace_arg(text: str) -> Workspace:
    root = Path(text).expanduser()
    if root.exists() and not root.is_dir():
        raise argparse.ArgumentTypeError(f"{root} exists and is not a folder")
    return Workspace(root.resolve())


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

    # -- the record status and down read --------------------------------------------------------

    def record(self) -> None:
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
                    quick = time.time() - svc.started < 60
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

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
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
# status


STEP_LINE = re.compile(r"\bstep (\d+)/(\d+) loss (\S+) lr \S+ grad \S+ tok/s (\d+)")
# The trainer's budget line: the billed hours its steps left need, and the projection it judges.
BUDGET_LINE = re.compile(r"budget: [^\n]*?= ([\d.e+]+) h billed[^\n]*?projected \$([\d.]+) of \$([\d.]+)")
# The trainer's forecast line at each eval (x1_pretrain.forecast): the final val loss and its interval.
FORECAST_LINE = re.compile(r"forecast: (final val loss [\d.]+ \[[\d.]+, [\d.]+\] at step \d+, made at step \d+"
                           r"|not enough points yet at step \d+/\d+)")


def latest_checkpoint(ws: Workspace) -> str | None:
    try:
        return (ws.checkpoints / "latest").read_text(encoding="utf-8").strip() or None
    except OSError:
        return None


def last_step_line(path: Path, chars: int = 20000, pattern: re.Pattern[str] = STEP_LINE) -> re.Match[str] | None:
    try:
        with open(path, "rb") as f:
            f.seek(max(0, f.seek(0, os.SEEK_END) - chars))
            text = f.read().decode("utf-8", errors="replace")
    except OSError:
        return None
    found = None
    for found in pattern.finditer(text):  # noqa: B007 - the last one
        pass
    return found


def at_a_glance(trainer: dict[str, Any], budget: dict[str, Any], judged: re.Match[str] | None,
                state: dict[str, Any], last_event: dict[str, Any] | None) -> dict[str, Any]:
    """What a person checking a paid run wants first: % done, ETA, spend so far, projected spend at
    the finish, restarts, the last decision. None where it is not known yet."""
    step, total = trainer.get("step"), trainer.get("total_steps")
    scale = budget.get("time_scale") if isinstance(budget.get("time_scale"), (int, float)) else 1.0
    eta_h = float(judged[1]) / max(float(scale), 1.0) if judged else None  # billed hours -> wall hours
    final = state.get("final")
    return {
        "percent_done": round(100.0 * step / total, 1) if step is not None and total else None,
        "eta_hours": None if final else eta_h,
        "spent_usd": budget.get("spent_usd"),
        "projected_at_finish_usd": float(judged[2]) if judged else budget.get("projected_total_usd"),
        "projection_source": "the trainer's (its measured pace)" if judged else "the sidecar's" if budget else None,
        "restarts": state.get("restarts_total"),
        "last_decision": describe_decision(last_event),
    }


def collect_status(ws: Workspace) -> dict[str, Any]:
    seen = L.probe(ws.root)
    record = read_json(ws.stack_file) or {}
    running = seen.owner is not None and seen.alive
    services: dict[str, Any] = {}
    recorded = record.get("services") or {}
    for name in [n for n in S.START_ORDER if n in recorded]:
        info = recorded[name]
        pid, ticks = info.get("pid"), info.get("start_ticks")
        alive = running and seen.local and isinstance(pid, int) and L.proc_start_ticks(pid) == ticks
        health = None
        if alive and info.get("url") and info.get("health_path"):
            code = http_status(info["url"] + info["health_path"], timeout=3.0)
            health = "healthy" if code is not None and 200 <= code < 300 else f"unhealthy ({code or 'no answer'})"
        services[name] = {"pid": pid, "running": alive, "health": health if alive else None,
                          "url": info.get("url"), "restarts": info.get("restarts", 0), "log": info.get("log")}
    beat = Heartbeat.read(ws.heartbeat)
    tpid = trainer_pid(ws) if running and seen.local else None
    step = last_step_line(ws.log("trainer"))
    trainer: dict[str, Any] = {"pid": tpid, "running": tpid is not None,
                               "step": beat.step if beat else None, "phase": beat.phase if beat else None,
                               "heartbeat_age_s": round(time.time() - beat.time, 1) if beat else None,
                               "total_steps": int(step[2]) if step else None,
                               "loss": float(step[3]) if step else None,
                               "tokens_per_s": int(step[4]) if step else None,
                               "latest_checkpoint": latest_checkpoint(ws)}
    budget = read_json(ws.budget_file) or {}
    events = read_events(ws)
    state = read_json(ws.state_file) or {}
    return {
        "workspace": str(ws.root),
        "running": running,
        "runner": {"pid": seen.owner.pid if seen.owner else None, "host": seen.owner.host if seen.owner else None,
                   "since": seen.owner.since if seen.owner else None, "why": seen.why,
                   "state": record.get("state")},
        "services": services,
        "trainer": trainer,
        "budget": {k: budget.get(k) for k in ("spent_usd", "cap_usd", "projected_total_usd", "rate_usd_per_hr",
                                              "last_update_utc", "stale", "source", "provider")},
        "watchdog": {"last_event": events[-1] if events else None, "final": state.get("final"),
                     "restarts_total": state.get("restarts_total")},
        "at_a_glance": at_a_glance(trainer, budget, last_step_line(ws.log("trainer"), pattern=BUDGET_LINE), state,
                                   events[-1] if events else None),
        "forecast": forecast[1] if (forecast := last_step_line(ws.log("trainer"), pattern=FORECAST_LINE)) else None,
        "restarts": run_restarts(ws, events),
    }


def run_restarts(ws: Workspace, events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each restart with its downtime, as the manifest will have it (x1_common.restarts): the
    trainer's start records in trainer.log joined with the watchdog's events."""
    try:
        with open(ws.log("trainer"), encoding="utf-8", errors="replace") as f:
            starts = restarts.starts_in_log(f)
    except OSError:
        starts = []
    return restarts.restarts(starts, events)


def describe_decision(e: dict[str, Any] | None) -> str:
    if not e:
        return "none yet"
    kind = e.get("event")
    if kind == "start":
        return f"started the trainer (pid {e.get('pid')}, {'resuming' if e.get('resume') else 'fresh'}) at {e.get('time')}"
    if kind == "exit":
        how = "stop requested" if e.get("stop_requested") else e.get("reason")
        return f"trainer exited {e.get('exit_code')} ({how}) at {e.get('time')}"
    if kind == "relaunch":
        return f"relaunch #{e.get('restart')} after {e.get('reason')} (exit {e.get('exit_code')}) at {e.get('time')}"
    if kind == "startup_failure":
        return (f"start-up failure: the trainer exited {e.get('exit_code')} before its first step twice in a row "
                f"with the same error, not relaunched (watchdog exit {e.get('watchdog_exit_code')}) at {e.get('time')}")
    if kind == "terminate":
        done = "terminated" if e.get("ok") else f"terminate FAILED ({e.get('error')})"
        return f"{done} the {e.get('provider')} instance {e.get('instance_id')} after {e.get('reason')} at {e.get('time')}"
    return f"{kind}: {e.get('reason') or e.get('detail') or ''} at {e.get('time')}".rstrip()


def render_status(st: dict[str, Any]) -> str:
    r = st["runner"]
    lines = []
    if st["running"]:
        since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(r["since"])) if r["since"] else "?"
        lines.append(f"stack in {st['workspace']}: running (runner pid {r['pid']} on {r['host']}, since {since})")
    else:
        lines.append(f"stack in {st['workspace']}: not running" + (f" (last state: {r['state']})" if r["state"] else ""))
    for name, svc in st["services"].items():
        if not st["running"]:
            break
        state = svc["health"] or ("running" if svc["running"] else "NOT RUNNING")
        restarted = f", restarted {svc['restarts']}x" if svc["restarts"] else ""
        lines.append(f"  {name:15s} {state:24s} pid {svc['pid']}{restarted}  {svc['url'] or ''}")
    g = st.get("at_a_glance") or {}
    if g:
        def money(v: Any) -> str:
            return f"${v:.2f}" if isinstance(v, (int, float)) else "?"

        done = f"{g['percent_done']:.1f}% done" if g["percent_done"] is not None else "% done: ?"
        eta = (f"ETA {g['eta_hours']:.2f} h" if g["eta_hours"] is not None else
               "ETA: none (stopped)" if st["watchdog"]["final"] else "ETA: ? (no pace yet)")
        lines.append(f"  at a glance: {done}, {eta}, spent {money(g['spent_usd'])}, projected "
                     f"{money(g['projected_at_finish_usd'])} at the finish"
                     + (f" ({g['projection_source']})" if g["projection_source"] else "")
                     + f", restarts {g['restarts'] if g['restarts'] is not None else 0}; last decision: {g['last_decision']}")
    if st.get("forecast"):
        lines.append(f"  forecast: {st['forecast']}")
    t = st["trainer"]
    if t["step"] is not None:
        of = f"/{t['total_steps']}" if t["total_steps"] else ""
        speed = f", {t['tokens_per_s']:,} tok/s, loss {t['loss']:.4f}" if t["tokens_per_s"] is not None else ""
        who = f"pid {t['pid']}" if t["running"] else "not running"
        lines.append(f"  {'trainer':15s} {who}: step {t['step']}{of} ({t['phase']}, heartbeat {t['heartbeat_age_s']:.0f} s "
                     f"ago){speed}; latest checkpoint {t['latest_checkpoint'] or 'none'}")
    else:
        lines.append(f"  {'trainer':15s} no heartbeat yet")
    b = st["budget"]
    if b.get("spent_usd") is not None:
        stale = ", STALE" if b.get("stale") else ""
        lines.append(f"  spend: ${b['spent_usd']:.2f} of the ${b['cap_usd']:g} cap (projected ${b['projected_total_usd']:.2f}, "
                     f"${b['rate_usd_per_hr']:g}/h, {b['provider']}, reading {b['last_update_utc']}{stale})")
    else:
        lines.append("  spend: no budget reading yet")
    lines += [f"  {restarts.describe(r)}" for r in st.get("restarts", [])]
    w = st["watchdog"]
    lines.append(f"  watchdog's last decision: {describe_decision(w['last_event'])}")
    if w["final"]:
        f = w["final"]
        lines.append(f"  final decision: {f.get('reason')} (exit {f.get('exit_code')} at {f.get('time')}): "
                     "the trainer is not launched again")
        if f.get("error"):
            lines.append(f"  the trainer's error: {f['error']}")
    return "\n".join(lines)


def cmd_status(args: argparse.Namespace) -> int:
    st = collect_status(args.workspace)
    print(json.dumps(st, indent=2) if args.json else render_status(st))
    if not st["running"]:
        return 1
    healthy = all(s["running"] and s["health"] in (None, "healthy") for s in st["services"].values())
    return 0 if healthy else 1


# ---------------------------------------------------------------------------------------------


DESCRIPTION = """\
The X1 stack as processes, for a host without Docker (a RunPod pod is itself a container): the
MLflow server (sqlite under WORKSPACE/mlruns), the budget sidecar (the provider of .env; static
rate supported), the watchdog in process mode supervising the trainer with compose's trainer
flags, and Prometheus when it is installed. Each service's command line and environment are
x1_common.services', the definition compose.yaml is tested against; here every server listens on
127.0.0.1 at the .env's *_HOST_PORT ports (a pod's 0.0.0.0 is the internet, and MLflow and the
sidecar have no authentication: reach them through SSH).

commands:
  prepare   download and tokenize into WORKSPACE/data (compose's `prepare` service), once
  up        start the stack in the foreground (-d: in the background, returning once it runs);
            Ctrl-C or SIGTERM stop it in order, the trainer first with its emergency checkpoint.
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
