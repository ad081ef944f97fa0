"""The stack's workspace (/workspace of compose, as a folder), the ports it claims, the files its
services leave there."""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import json
import logging
import os
import shutil
import socket
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from x1_common.contracts import SIDECAR_PORT, TRAINER_METRICS_PORT, WATCHDOG_METRICS_PORT

REPO = Path(__file__).resolve().parents[3]
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

def is_trainer_process(pid: int) -> bool:
    """True when `pid` is alive and runs x1_pretrain.train (not a later process that got its pid)."""
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state not in ("Z", "X") and b"x1_pretrain.train" in cmdline


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


def workspace_arg(text: str) -> Workspace:
    root = Path(text).expanduser()
    if root.exists() and not root.is_dir():
        raise argparse.ArgumentTypeError(f"{root} exists and is not a folder")
    return Workspace(root.resolve())
