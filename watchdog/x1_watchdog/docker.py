"""Docker mode's trainer handle: the trainer container, driven through the Docker Engine API on
the mounted socket (httpx over a unix socket, API version pinned).

This module is exercised on the GPU host, under compose; the machines that run `make test` have
no Docker engine. It is therefore kept thin: every decision is the supervisor's, shared with
process mode and tested there; this file only translates start / poll / signal / kill into
four Engine API calls:

    GET  /containers/{name}/json              State.Running, State.ExitCode, State.OOMKilled, State.StartedAt
    POST /containers/{name}/start             204 started, 304 already running
    POST /containers/{name}/kill?signal=SIG   204 sent, 409 not running

The container's own command carries --resume-from-latest (the trainer starts fresh when there
is no checkpoint yet), so `start(resume)` has nothing to add. The socket is root-equivalent:
compose gives it to this service only.
"""

from __future__ import annotations

import logging
import signal
import time
from datetime import datetime
from typing import Any

import httpx

from x1_watchdog.handles import StartError, TrainerExit

log = logging.getLogger(__name__)

API_VERSION = "v1.43"  # Docker Engine 24+; newer daemons serve older versions unchanged


def parse_docker_time(text: str) -> float | None:
    """Docker's RFC 3339 times carry nanoseconds; Python parses microseconds. None for the zero time."""
    if not text or text.startswith("0001-"):
        return None
    head, _, frac = text.rstrip("Z").partition(".")
    frac = "".join(ch for ch in frac if ch.isdigit())[:6].ljust(6, "0")
    try:
        return datetime.fromisoformat(f"{head}.{frac}+00:00").timestamp()
    except ValueError:
        return None


def exit_from_state(state: dict[str, Any]) -> TrainerExit:
    code = int(state.get("ExitCode", -1))
    detail = "OOMKilled" if state.get("OOMKilled") else str(state.get("Error") or "")
    # The runtime reports a container killed by signal N as 128 + N, as a shell does.
    sig = code - 128 if 128 < code <= 128 + 64 else None
    return TrainerExit(code=code, signal=sig, detail=detail)


class DockerHandle:
    def __init__(self, container: str, socket_path: str = "/var/run/docker.sock", timeout: float = 10.0) -> None:
        self.container = container
        self.label = f"container {container}"
        self.socket_path = socket_path
        self._client = httpx.Client(
            transport=httpx.HTTPTransport(uds=socket_path),
            base_url=f"http://docker/{API_VERSION}",  # the host part is ignored over a unix socket
            timeout=timeout,
        )
        self._pid: int | None = None
        self._started_at = 0.0
        self._warned_at = 0.0

    @property
    def pid(self) -> int | None:
        return self._pid  # the host's pid of the container's main process, for the logs

    @property
    def started_at(self) -> float:
        return self._started_at

    def _call(self, method: str, path: str, **params: str) -> httpx.Response:
        try:
            return self._client.request(method, f"/containers/{self.container}{path}", params=params or None)
        except httpx.HTTPError as e:
            raise StartError(f"cannot reach the Docker Engine at {self.socket_path}: {type(e).__name__}: {e}") from e

    def _inspect(self) -> dict[str, Any]:
        resp = self._call("GET", "/json")
        if resp.status_code == 404:
            raise StartError(f"no container named {self.container!r} (docker ps -a; compose's container_name)")
        if resp.status_code != 200:
            raise StartError(f"docker inspect {self.container}: HTTP {resp.status_code}: {resp.text[:200]}")
        return resp.json()["State"]

    def start(self, resume: bool) -> None:
        state = self._inspect()
        if state.get("Running"):
            # Compose started it before us, or a previous watchdog did: supervise, do not restart.
            self._pid = state.get("Pid") or None
            self._started_at = parse_docker_time(str(state.get("StartedAt", ""))) or time.time()
            log.info("adopted running %s (pid %s)", self.label, self._pid)
            return
        self._started_at = time.time()
        resp = self._call("POST", "/start")
        if resp.status_code not in (204, 304):
            raise StartError(f"docker start {self.container}: HTTP {resp.status_code}: {resp.text[:200]}")
        self._pid = self._inspect().get("Pid") or None
        log.info("started %s (pid %s)", self.label, self._pid)

    def poll(self) -> TrainerExit | None:
        try:
            state = self._inspect()
        except StartError as e:
            # A daemon restart must not end the supervision; the heartbeat still tells a stall.
            if time.monotonic() - self._warned_at > 60:
                log.warning("%s; treating the trainer as running", e)
                self._warned_at = time.monotonic()
            return None
        if state.get("Running") or state.get("Restarting"):
            return None
        return exit_from_state(state)

    def signal(self, sig: int) -> None:
        name = signal.Signals(sig).name
        try:
            resp = self._call("POST", "/kill", signal=name)
        except StartError as e:
            log.warning("docker kill -s %s %s: %s", name, self.container, e)
            return
        if resp.status_code not in (204, 409):  # 409: not running any more, which is the goal
            log.warning("docker kill -s %s %s: HTTP %d", name, self.container, resp.status_code)

    def identity(self) -> dict[str, Any] | None:
        return {"container": self.container}

    def end_leftover(self, identity: dict[str, Any], grace_seconds: float) -> None:
        pass  # the container is the same one: start() adopts it if it still runs

    def kill(self) -> None:
        # Killing the container's main process ends its pid namespace: nothing inside survives.
        self.signal(signal.SIGKILL)
