"""One service as a process group: started, health-checked, stopped; the MLflow server's command."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from x1_pretrain.stack.workspace import REPO, StackError

# How long a stopping service gets before SIGKILL: the watchdog its --term-grace-seconds (60 by
# default) for the trainer's emergency checkpoint, and some more for itself.
STOP_GRACE = {"watchdog": 100.0}
HEALTHY_TIMEOUT_S = 300.0  # MLflow's first start (database migrations) and the sidecar's first reading

log = logging.getLogger("x1.stack")


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
        self.started = time.time()  # for people (stack.json)
        self.started_mono = time.monotonic()  # for its uptime: no step of the wall clock counts
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
