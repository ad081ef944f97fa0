"""Start the fake billing API and the sidecar as real processes on 127.0.0.1 (tests and the demo).

    fake = FakeBilling.start(log_dir, provider="lambda", instance_id="i-1", api_key=key, time_scale=360)
    try:
        fake.control(price_usd_per_hr=3.3)
        fake.state()["billed_usd"]
    finally:
        fake.stop()

Each process writes its stdout and stderr to a log file under `log_dir`, so a test can read (or
grep) everything it said. `stop()` sends SIGTERM, then SIGKILL if the process is still there.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ProcessExited(RuntimeError):
    """A process under test died while we waited for it."""


def wait_until(predicate: Callable[[], Any], timeout: float, interval: float = 0.1, what: str = "condition") -> Any:
    """The first truthy value of predicate() within `timeout` seconds; TimeoutError naming `what` otherwise."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            value = predicate()
        except ProcessExited:
            raise
        except Exception:  # not up yet, file half-written by another writer...
            value = None
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout:g} s waiting for {what}")
        time.sleep(interval)


def http_json(url: str, body: Any | None = None, timeout: float = 10.0) -> Any:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        return json.loads(resp.read())


class ManagedProcess:
    """A child process with its output in a log file; stop() is safe to call twice."""

    def __init__(self, args: list[str], log_path: Path, env: dict[str, str] | None = None) -> None:
        self.args = args
        self.log_path = log_path
        log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = open(log_path, "ab")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            args, stdout=self._log, stderr=subprocess.STDOUT, env=env or dict(os.environ, PYTHONUNBUFFERED="1")
        )

    def alive(self) -> bool:
        return self.proc.poll() is None

    def log_text(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    def stop(self, grace: float = 10.0) -> int | None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(grace)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        if not self._log.closed:
            self._log.close()
        return self.proc.returncode


class FakeBilling(ManagedProcess):
    """`python -m budget_sidecar.fake_billing` on a free port of 127.0.0.1."""

    def __init__(self, args: list[str], log_path: Path, url: str, env: dict[str, str] | None = None) -> None:
        super().__init__(args, log_path, env)
        self.url = url

    @classmethod
    def start(
        cls,
        log_dir: Path,
        *,
        provider: str,
        instance_id: str,
        api_key: str,
        price_usd_per_hr: float = 1.10,
        time_scale: float = 1.0,
        boot_seconds: float = 1.0,
        port: int | None = None,
        startup_timeout: float = 60.0,
    ) -> FakeBilling:
        port = port or free_port()
        args = [
            sys.executable, "-m", "budget_sidecar.fake_billing", "--host", "127.0.0.1", "--port", str(port),
            "--provider", provider, "--instance-id", instance_id, "--price-usd-per-hr", str(price_usd_per_hr),
            "--time-scale", str(time_scale), "--boot-seconds", str(boot_seconds),
        ]
        # The key travels in the environment, not on the command line (where `ps` would show it).
        env = dict(os.environ, PYTHONUNBUFFERED="1", BILLING_API_KEY=api_key)
        fake = cls(args, Path(log_dir) / f"fake-billing-{port}.log", f"http://127.0.0.1:{port}", env)
        try:
            wait_until(lambda: fake._check_up(), startup_timeout, 0.1, f"fake billing on port {port}")
        except BaseException:
            fake.stop()
            raise
        return fake

    def _check_up(self) -> bool:
        if not self.alive():
            raise_exit(self)
        return bool(self.state())

    def state(self) -> dict[str, Any]:
        return http_json(self.url + "/_state")

    def control(self, **body: Any) -> dict[str, Any]:
        return http_json(self.url + "/_control", body)


class Sidecar(ManagedProcess):
    """`python -m budget_sidecar` on a free port of 127.0.0.1."""

    def __init__(self, args: list[str], log_path: Path, url: str, output: Path, env: dict[str, str] | None) -> None:
        super().__init__(args, log_path, env)
        self.url = url
        self.output = output

    @classmethod
    def start(
        cls,
        log_dir: Path,
        output: Path,
        *,
        provider: str,
        instance_id: str = "",
        api_url: str | None = None,
        poll_seconds: float = 1.0,
        cap_usd: float = 35.0,
        alert_usd: float = 30.0,
        extra_args: list[str] | tuple[str, ...] = (),
        env: dict[str, str] | None = None,
        port: int | None = None,
        startup_timeout: float = 60.0,
    ) -> Sidecar:
        port = port or free_port()
        args = [
            sys.executable, "-m", "budget_sidecar", "--provider", provider, "--poll-seconds", str(poll_seconds),
            "--output", str(output), "--cap-usd", str(cap_usd), "--alert-usd", str(alert_usd),
            "--host", "127.0.0.1", "--port", str(port), *extra_args,
        ]
        if instance_id:
            args += ["--instance-id", instance_id]
        if api_url:
            args += ["--api-url", api_url]
        full_env = dict(os.environ, PYTHONUNBUFFERED="1", **(env or {}))
        sidecar = cls(args, Path(log_dir) / f"sidecar-{port}-{time.monotonic_ns()}.log", f"http://127.0.0.1:{port}",
                      Path(output), full_env)
        try:
            wait_until(lambda: sidecar._check_up(), startup_timeout, 0.1, f"sidecar on port {port}")
        except BaseException:
            sidecar.stop()
            raise
        return sidecar

    def _check_up(self) -> bool:
        if not self.alive():
            raise_exit(self)
        try:
            urllib.request.urlopen(self.url + "/healthz", timeout=5).close()
        except urllib.error.HTTPError:
            pass  # 503 (no reading yet, or stale) still means it is serving
        return True

    def budget(self) -> dict[str, Any]:
        return http_json(self.url + "/budget")


def raise_exit(p: ManagedProcess) -> None:
    raise ProcessExited(f"{p.args[2]} exited with {p.proc.returncode}:\n{p.log_text()[-3000:]}")
