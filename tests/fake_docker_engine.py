"""A fake Docker Engine on a real unix socket, for the watchdog's API-version tests.

It answers the calls the watchdog makes the way dockerd does, version checks included
(moby api/server/middleware/version.go): a request under /vX.Y/ outside the band
[min_api_version, api_version] is refused with HTTP 400 and Docker's own message,

    {"message": "client version 1.43 is too new. Maximum supported API version is 1.41"}
    {"message": "client version 1.43 is too old. Minimum supported API version is 1.44, please upgrade your client to a newer version"}

and an unversioned request is served at the engine's newest version. `upgrade()` swaps the band
under a running client (the engine upgraded mid-run). Containers are plain records: start, kill
(a SIGTERM ends the "trainer" with 75, as the real one exits after its emergency checkpoint) and
inspect.

    engine = FakeEngine(tmp_path / "docker.sock", api_version="1.41", min_api_version="1.12")
    engine.add_container("x1-trainer", running=True)
    with engine:
        ...  # DockerHandle("x1-trainer", socket_path=str(engine.path))
"""

from __future__ import annotations

import json
import os
import re
import signal
import socketserver
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit


def _as_tuple(version: str) -> tuple[int, int]:
    major, minor = version.split(".")
    return int(major), int(minor)


@dataclass
class Container:
    name: str
    running: bool = False
    exit_code: int = 0
    pid: int = 0
    started_at: str = "0001-01-01T00:00:00Z"
    oom_killed: bool = False
    term_exit_code: int = 75  # what SIGTERM ends it with: the trainer's preemption code
    starts: int = 0
    cmd: list[str] = field(default_factory=list)  # Config.Cmd and Config.Env, as compose created it
    env: dict[str, str] = field(default_factory=dict)


@dataclass
class Request:
    method: str
    path: str  # without the query
    version: str | None  # the /vX.Y/ prefix, None when unversioned
    status: int
    message: str = ""  # the error message answered, if any


@dataclass
class FakeEngine:
    path: Path
    api_version: str = "1.41"
    min_api_version: str | None = "1.12"  # None: /version names no minimum
    engine_version: str = "20.10.24+dfsg1"
    serve_version_endpoint: bool = True  # False: GET /version is 404 (a socket proxy); /_ping still answers
    containers: dict[str, Container] = field(default_factory=dict)
    requests: list[Request] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._lock = threading.Lock()
        self._server: socketserver.ThreadingUnixStreamServer | None = None
        self._thread: threading.Thread | None = None

    # -- the test's controls --------------------------------------------------------------------

    def add_container(self, name: str, running: bool = False, exit_code: int = 0) -> Container:
        c = Container(name, running=running, exit_code=exit_code)
        if running:
            c.pid, c.started_at = 4242, time.strftime("%Y-%m-%dT%H:%M:%S.123456789Z", time.gmtime())
        self.containers[name] = c
        return c

    def upgrade(self, api_version: str, min_api_version: str | None, engine_version: str) -> None:
        """The engine replaced under a running client: a new band of versions from now on."""
        with self._lock:
            self.api_version, self.min_api_version, self.engine_version = api_version, min_api_version, engine_version

    def exit(self, name: str, code: int) -> None:
        with self._lock:
            c = self.containers[name]
            c.running, c.exit_code = False, code

    def recreate(self, name: str, cmd: list[str], env: dict[str, str], running: bool) -> None:
        """What `docker compose up` does with a container whose settings changed: a new one of the
        same name, with the new command and environment, started (or not)."""
        with self._lock:
            c = self.containers[name]
            c.cmd, c.env, c.running, c.exit_code = list(cmd), dict(env), running, 0
            if running:
                c.pid, c.started_at = 5151, time.strftime("%Y-%m-%dT%H:%M:%S.123456789Z", time.gmtime())

    def versioned(self) -> list[Request]:
        return [r for r in self.requests if r.version is not None]

    def refused(self) -> list[Request]:
        return [r for r in self.requests if r.status == 400]

    # -- serving -------------------------------------------------------------------------------

    def start(self) -> FakeEngine:
        if self.path.exists():
            self.path.unlink()
        engine = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the base class's name
                pass  # a unix socket has no client address to log

            def do_GET(self) -> None:
                engine._dispatch(self, "GET")

            def do_POST(self) -> None:
                engine._dispatch(self, "POST")

            def do_HEAD(self) -> None:
                engine._dispatch(self, "HEAD")

        self._server = socketserver.ThreadingUnixStreamServer(str(self.path), Handler)
        self._server.daemon_threads = True
        os.chmod(self.path, 0o660)  # as dockerd's: owner and group only
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
        if self.path.exists():
            self.path.unlink()

    def __enter__(self) -> FakeEngine:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- dockerd's behaviour -------------------------------------------------------------------

    def _dispatch(self, h: BaseHTTPRequestHandler, method: str) -> None:
        url = urlsplit(h.path)
        m = re.match(r"^/v([0-9]+\.[0-9]+)(/.*)$", url.path)
        version, path = (m.group(1), m.group(2)) if m else (None, url.path)
        length = int(h.headers.get("Content-Length") or 0)
        if length:
            h.rfile.read(length)
        with self._lock:
            status, body, headers = self._answer(method, path, version, parse_qs(url.query))
            message = body.get("message", "") if isinstance(body, dict) and status >= 400 else ""
            self.requests.append(Request(method, path, version, status, message))
        data = b"" if body is None else (body if isinstance(body, bytes) else json.dumps(body).encode())
        h.send_response(status)
        h.send_header("Api-Version", self.api_version)
        h.send_header("Server", f"Docker/{self.engine_version} (linux)")
        for k, v in headers.items():
            h.send_header(k, v)
        if status not in (204, 304):
            h.send_header("Content-Type", "application/json" if not isinstance(body, bytes) else "text/plain")
            h.send_header("Content-Length", str(len(data)))
        h.end_headers()
        if status not in (204, 304) and method != "HEAD":
            h.wfile.write(data)

    def _answer(self, method: str, path: str, version: str | None,
                query: dict[str, list[str]]) -> tuple[int, Any, dict[str, str]]:
        if version is not None:
            if self.min_api_version is not None and _as_tuple(version) < _as_tuple(self.min_api_version):
                return 400, {"message": f"client version {version} is too old. Minimum supported API version is "
                                        f"{self.min_api_version}, please upgrade your client to a newer version"}, {}
            if _as_tuple(version) > _as_tuple(self.api_version):
                return 400, {"message": f"client version {version} is too new. Maximum supported API version is "
                                        f"{self.api_version}"}, {}
        if path == "/_ping":
            return 200, b"OK", {"Docker-Experimental": "false"}  # Api-Version: on every answer, as dockerd
        if path == "/version" and method == "GET":
            if not self.serve_version_endpoint:
                return 404, {"message": "page not found"}, {}
            info: dict[str, Any] = {"Version": self.engine_version, "ApiVersion": self.api_version,
                                    "Os": "linux", "Arch": "amd64", "GoVersion": "go1.19.8"}
            if self.min_api_version is not None:
                info["MinAPIVersion"] = self.min_api_version
            return 200, info, {}
        m = re.match(r"^/containers/([^/]+)/(json|start|kill)$", path)
        if not m:
            return 404, {"message": "page not found"}, {}
        name, action = m.groups()
        c = self.containers.get(name)
        if c is None:
            return 404, {"message": f"No such container: {name}"}, {}
        if action == "json" and method == "GET":
            return 200, {"Id": f"{abs(hash(name)):064x}"[:64], "Name": f"/{name}", "State": {
                "Status": "running" if c.running else "exited", "Running": c.running, "Paused": False,
                "Restarting": False, "OOMKilled": c.oom_killed, "Dead": False, "Pid": c.pid if c.running else 0,
                "ExitCode": 0 if c.running else c.exit_code, "Error": "", "StartedAt": c.started_at,
                "FinishedAt": "0001-01-01T00:00:00Z"},
                "Config": {"Cmd": c.cmd or None, "Entrypoint": None, "Env": [f"{k}={v}" for k, v in c.env.items()],
                           "Tty": False}}, {}
        if action == "start" and method == "POST":
            if c.running:
                return 304, None, {}
            c.running, c.starts, c.pid = True, c.starts + 1, 4242 + c.starts + 1
            c.started_at = time.strftime("%Y-%m-%dT%H:%M:%S.123456789Z", time.gmtime())
            return 204, None, {}
        if action == "kill" and method == "POST":
            if not c.running:
                return 409, {"message": f"Cannot kill container: {name}: Container {name} is not running"}, {}
            sig_name = (query.get("signal") or ["SIGKILL"])[0]
            sig = signal.Signals[sig_name if sig_name.startswith("SIG") else f"SIG{sig_name}"]
            if sig in (signal.SIGTERM, signal.SIGINT):
                c.running, c.exit_code = False, c.term_exit_code
            elif sig == signal.SIGKILL:
                c.running, c.exit_code = False, 128 + int(sig)
            return 204, None, {}
        return 405, {"message": "method not allowed"}, {}
