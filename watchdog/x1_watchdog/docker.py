"""Docker mode's trainer handle: the trainer container, driven through the Docker Engine API on
the mounted socket (httpx over a unix socket, no Docker SDK).

Every decision is the supervisor's, shared with process mode and tested there; this file only
translates start / poll / signal / kill, and the trainer's last words, into four Engine API calls:

    GET  /v{api}/containers/{name}/json              State.Running, ExitCode, OOMKilled, StartedAt, Pid
    POST /v{api}/containers/{name}/start             204 started, 304 already running
    POST /v{api}/containers/{name}/kill?signal=SIG   204 sent, 409 not running
    GET  /v{api}/containers/{name}/logs?since=T      the output since the start (a start-up failure's error)

The API version is negotiated as the Docker SDKs do. An engine serves a band of versions, from
its MinAPIVersion to its ApiVersion, and refuses any other with HTTP 400 ("client version 1.43
is too new. Maximum supported API version is 1.41"). Debian 12's docker.io (Engine 20.10) serves
up to 1.41; Engine 29 serves 1.44 to 1.52. So no pinned version works on every GPU host: the
handle asks the daemon once (the unversioned GET /version, or GET /_ping's API-Version header),
speaks min(CLIENT_MAX_API, ApiVersion), never below MinAPIVersion, and asks again once when a
call is refused as too old or too new (the engine was upgraded under a running watchdog).

Every failure here is a TrainerUnreachable (handles.py): the socket missing or not ours to use,
an engine too old, a container the runtime refuses to start. The supervisor then stays up,
reports itself unhealthy, alerts and retries; exiting would only have compose restart the
watchdog into the same error while the trainer runs unsupervised.

The container's own command carries --resume-from-latest (the trainer starts fresh when there
is no checkpoint yet), so `start(resume)` has nothing to add. The socket is root-equivalent:
compose gives it to this service only.
"""

from __future__ import annotations

import errno
import logging
import os
import re
import signal
import stat
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import httpx

from x1_watchdog.handles import TrainerExit, TrainerUnreachable
from x1_watchdog.policy import OUTPUT_TAIL_BYTES

log = logging.getLogger(__name__)


@dataclass(frozen=True, order=True)
class ApiVersion:
    """An Engine API version. Compared as numbers: 1.9 < 1.41 < 1.100 (as strings 1.9 > 1.41)."""

    major: int
    minor: int

    @classmethod
    def parse(cls, text: str) -> ApiVersion:
        m = re.fullmatch(r"v?(\d+)\.(\d+)", str(text).strip())
        if not m:
            raise ValueError(f"not a Docker Engine API version: {text!r}")
        return cls(int(m.group(1)), int(m.group(2)))

    def __str__(self) -> str:
        return f"{self.major}.{self.minor}"


# The band this client speaks. 1.41 is Engine 20.10 (Debian 12's docker.io), the oldest engine
# tested; 1.52 is Engine 29, the newest whose API reference the calls above were checked
# against (none has changed since 1.24). A newer engine is spoken to at 1.52, or at its own
# minimum when that is higher still (the SDKs never go below it either).
CLIENT_MIN_API = ApiVersion(1, 41)
CLIENT_MAX_API = ApiVersion(1, 52)

# What a daemon answers for a version outside its band (moby api/server/middleware/version.go):
#   client version 1.43 is too new. Maximum supported API version is 1.41
#   client version 1.43 is too old. Minimum supported API version is 1.44, please upgrade ...
_REFUSED = re.compile(r"client version \S+ is too (old|new)", re.IGNORECASE)


@dataclass(frozen=True)
class Engine:
    """What the daemon said about itself, and the version chosen to speak to it."""

    api_version: ApiVersion  # the newest it serves
    min_api_version: ApiVersion | None  # the oldest it serves (unknown from /_ping alone)
    version: str  # the engine's release, e.g. 20.10.24+dfsg1; "" when unknown
    speak: ApiVersion

    def describe(self) -> str:
        band = f"{self.min_api_version}..{self.api_version}" if self.min_api_version else f"up to {self.api_version}"
        release = f"Docker Engine {self.version}" if self.version else "the Docker Engine"
        return f"{release} (API {band}), spoken to at API {self.speak}"


def choose_version(api_version: ApiVersion, min_api_version: ApiVersion | None, version: str = "") -> Engine:
    """min(CLIENT_MAX_API, the daemon's newest), never below the daemon's minimum; refuses an
    engine older than CLIENT_MIN_API, naming both versions."""
    release = f"Docker Engine {version}" if version else "the Docker Engine"
    if api_version < CLIENT_MIN_API:
        raise TrainerUnreachable(
            f"{release} serves Engine API {api_version} at most; the watchdog needs API {CLIENT_MIN_API} "
            f"(Docker Engine 20.10) or newer: upgrade Docker on this host"
        )
    speak = min(CLIENT_MAX_API, api_version)
    if min_api_version is not None and speak < min_api_version:
        log.warning("%s requires Engine API %s or newer, past the %s this watchdog was checked against; "
                    "speaking %s", release, min_api_version, CLIENT_MAX_API, min_api_version)
        speak = min_api_version
    return Engine(api_version, min_api_version, version, speak)


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


def demux_logs(raw: bytes) -> bytes:
    """A container's log stream as text. Without a TTY the engine multiplexes stdout and stderr in
    frames (one byte for the stream: 0 stdin, 1 stdout, 2 stderr; three zero bytes; the length as
    four big-endian bytes; the payload); with a TTY the stream is the raw output."""
    out, i = bytearray(), 0
    while i + 8 <= len(raw) and raw[i] in (0, 1, 2) and raw[i + 1:i + 4] == b"\0\0\0":
        size = int.from_bytes(raw[i + 4:i + 8], "big")
        out += raw[i + 8:i + 8 + size]
        i += 8 + size
    return bytes(out) if i == len(raw) else raw


def refusal(resp: httpx.Response) -> str | None:
    """The daemon's message when it refused the request's API version, else None."""
    if resp.status_code != 400:
        return None
    try:
        message = str(resp.json().get("message", ""))
    except ValueError:
        message = resp.text
    return message if _REFUSED.search(message) else None


def socket_problem(path: str, error: BaseException) -> str:
    """Why the socket cannot be used, in terms a person can act on."""
    cause: BaseException | None = error
    while cause is not None and not isinstance(cause, OSError):
        cause = cause.__cause__ or cause.__context__
    code = cause.errno if isinstance(cause, OSError) else None
    if code == errno.ENOENT or not os.path.exists(path):
        return (f"no Docker Engine socket at {path}: mount the host's socket into the watchdog "
                f"(compose: /var/run/docker.sock:/var/run/docker.sock) or pass --docker-socket")
    if code in (errno.EACCES, errno.EPERM):
        try:
            st = os.stat(path)
            owner = f"owner uid {st.st_uid}, group {st.st_gid}, mode {stat.filemode(st.st_mode)}"
            gid = st.st_gid
        except OSError:
            owner, gid = "owner unknown", None
        fix = f"DOCKER_GID={gid}" if gid is not None else "DOCKER_GID"
        return (f"permission denied on the Docker Engine socket {path} ({owner}); the watchdog runs as "
                f"uid {os.getuid()} with groups {sorted(os.getgroups())}: give it the socket's group "
                f"(compose: {fix} in .env, `stat -c %g {path}` on the host)")
    if code in (errno.ECONNREFUSED, errno.ENOTSOCK):
        return f"the Docker Engine at {path} refuses connections: is dockerd running? ({cause})"
    return f"cannot reach the Docker Engine at {path}: {type(error).__name__}: {error}"


class DockerHandle:
    def __init__(
        self,
        container: str,
        socket_path: str = "/var/run/docker.sock",
        timeout: float = 10.0,
        on_engine: Callable[[Engine], None] | None = None,
    ) -> None:
        self.container = container
        self.label = f"container {container}"
        self.socket_path = socket_path
        self._client = httpx.Client(
            transport=httpx.HTTPTransport(uds=socket_path),
            base_url="http://docker",  # the host part is ignored over a unix socket
            timeout=timeout,
        )
        self._on_engine = on_engine or (lambda engine: None)  # e.g. the metrics' engine info
        self.engine: Engine | None = None  # negotiated on the first call, not at construction
        self._pid: int | None = None
        self._started_at = 0.0

    @property
    def pid(self) -> int | None:
        return self._pid  # the host's pid of the container's main process, for the logs

    @property
    def started_at(self) -> float:
        return self._started_at

    # -- the API version -----------------------------------------------------------------------

    def _raw(self, method: str, path: str, **params: str) -> httpx.Response:
        try:
            return self._client.request(method, path, params=params or None)
        except httpx.HTTPError as e:
            raise TrainerUnreachable(socket_problem(self.socket_path, e)) from e

    def negotiate(self) -> Engine:
        """Asks the daemon which versions it serves (unversioned requests get its newest)."""
        resp = self._raw("GET", "/version")
        info: dict[str, Any] = {}
        if resp.status_code == 200:
            try:
                info = resp.json()
            except ValueError:
                info = {}
        try:
            if info.get("ApiVersion"):
                min_text = info.get("MinAPIVersion")
                engine = choose_version(ApiVersion.parse(info["ApiVersion"]),
                                        ApiVersion.parse(min_text) if min_text else None, str(info.get("Version", "")))
            else:
                # An engine or proxy without /version: /_ping's header names the newest it serves.
                ping = self._raw("GET", "/_ping")
                header = ping.headers.get("API-Version")
                if not header:
                    raise TrainerUnreachable(
                        f"the Docker Engine at {self.socket_path} names no API version (GET /version: HTTP "
                        f"{resp.status_code}; GET /_ping: HTTP {ping.status_code}, no API-Version header)")
                engine = choose_version(ApiVersion.parse(header), None)
        except ValueError as e:
            raise TrainerUnreachable(f"the Docker Engine at {self.socket_path}: {e}") from e
        if engine != self.engine:
            log.info("%s", engine.describe())
        self.engine = engine
        self._on_engine(engine)
        return engine

    def _call(self, method: str, path: str, **params: str) -> httpx.Response:
        """One Engine API call at the negotiated version; negotiated again, once, if refused."""
        engine = self.engine or self.negotiate()
        resp = self._raw(method, f"/v{engine.speak}/containers/{self.container}{path}", **params)
        refused = refusal(resp)
        if refused is None:
            return resp
        log.warning("the Docker Engine refused API %s (%s): negotiating again", engine.speak, refused)
        engine = self.negotiate()
        resp = self._raw(method, f"/v{engine.speak}/containers/{self.container}{path}", **params)
        refused_again = refusal(resp)
        if refused_again is not None:
            self.engine = None  # ask afresh next time
            raise TrainerUnreachable(
                f"the Docker Engine refuses API {engine.speak} too, after negotiating: {refused_again}")
        return resp

    # -- the trainer handle --------------------------------------------------------------------

    def _inspect(self) -> dict[str, Any]:
        resp = self._call("GET", "/json")
        if resp.status_code == 404:
            raise TrainerUnreachable(
                f"no container named {self.container!r} (docker ps -a; compose's container_name; "
                f"`docker compose up -d` creates it)")
        if resp.status_code != 200:
            raise TrainerUnreachable(f"docker inspect {self.container}: HTTP {resp.status_code}: {resp.text[:300]}")
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
            # e.g. HTTP 500 "error setting rlimit type 8: operation not permitted" (compose.cpu.yaml)
            raise TrainerUnreachable(f"docker start {self.container}: HTTP {resp.status_code}: {resp.text[:300]}")
        self._pid = self._inspect().get("Pid") or None
        log.info("started %s (pid %s)", self.label, self._pid)

    def poll(self) -> TrainerExit | None:
        # A failure raises TrainerUnreachable: the supervisor reports it and keeps treating the
        # trainer as running (a daemon restart must not end the supervision).
        state = self._inspect()
        if state.get("Running") or state.get("Restarting"):
            return None
        return exit_from_state(state)

    def signal(self, sig: int) -> None:
        name = signal.Signals(sig).name
        try:
            resp = self._call("POST", "/kill", signal=name)
        except TrainerUnreachable as e:
            log.warning("docker kill -s %s %s: %s", name, self.container, e)
            return
        if resp.status_code not in (204, 409):  # 409: not running any more, which is the goal
            log.warning("docker kill -s %s %s: HTTP %d", name, self.container, resp.status_code)

    def identity(self) -> dict[str, Any] | None:
        return {"container": self.container}

    def output_tail(self) -> str | None:
        """The container's output since this trainer started (`docker logs --since --tail`)."""
        since = str(int(self._started_at)) if self._started_at else "0"
        try:
            resp = self._call("GET", "/logs", stdout="1", stderr="1", since=since, tail="500")
        except TrainerUnreachable as e:
            log.warning("docker logs %s: %s", self.container, e)
            return None
        if resp.status_code != 200:  # e.g. a logging driver that cannot be read back
            log.warning("docker logs %s: HTTP %d: %s", self.container, resp.status_code, resp.text[:300])
            return None
        return demux_logs(resp.content)[-OUTPUT_TAIL_BYTES:].decode("utf-8", errors="replace")

    def end_leftover(self, identity: dict[str, Any], grace_seconds: float) -> None:
        pass  # the container is the same one: start() adopts it if it still runs

    def kill(self) -> None:
        # Killing the container's main process ends its pid namespace: nothing inside survives.
        self.signal(signal.SIGKILL)
