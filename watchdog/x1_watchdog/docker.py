"""Docker mode's trainer handle: the trainer container, driven through the Docker SDK on the
mounted socket.

Every decision is the supervisor's, shared with process mode and tested there; this file only
translates start / poll / signal / kill, and the trainer's last words, into four Engine API calls,
made by name (a container recreated by compose keeps its name, not its id):

    inspect_container   State.Running, ExitCode, OOMKilled, StartedAt, Pid
    start               204 started, 304 already running
    kill(signal=SIG)    204 sent, 409 not running
    logs(since=T)       the output since the start (a start-up failure's error)

The API version is chosen here, not by the SDK's version="auto", which speaks whatever the daemon
names as its newest. An engine serves a band of versions, from its MinAPIVersion to its
ApiVersion, and refuses any other with HTTP 400 ("client version 1.43 is too new. Maximum
supported API version is 1.41"). Debian 12's docker.io (Engine 20.10) serves up to 1.41; Engine
29 serves 1.44 to 1.52. So the handle asks the daemon once (the unversioned GET /version, or
GET /_ping's API-Version header for a socket proxy without /version), speaks
min(CLIENT_MAX_API, ApiVersion), never below MinAPIVersion, and asks again once when a call is
refused as too old or too new (the engine was upgraded under a running watchdog).

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
from typing import Any, TypeVar

import docker
import requests
from docker.errors import APIError, DockerException, NotFound

from x1_watchdog.handles import TrainerExit, TrainerUnreachable
from x1_watchdog.inputs import command_inputs
from x1_watchdog.policy import OUTPUT_TAIL_BYTES

log = logging.getLogger(__name__)
T = TypeVar("T")


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




def refusal(error: APIError) -> str | None:
    """The daemon's message when it refused the request's API version, else None."""
    message = str(error.explanation or "")
    return message if error.status_code == 400 and _REFUSED.search(message) else None


def socket_problem(path: str, error: BaseException) -> str:
    """Why the socket cannot be used, in terms a person can act on."""
    # The socket's own error, under the SDK's wrappers (requests' ConnectionError is an OSError too,
    # without an errno).
    cause: BaseException | None = error
    while cause is not None and not (isinstance(cause, OSError) and cause.errno is not None):
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
        self.timeout = timeout
        self._on_engine = on_engine or (lambda engine: None)  # e.g. the metrics' engine info
        self.engine: Engine | None = None  # negotiated on the first call, not at construction
        self._api: docker.APIClient | None = None  # the SDK's client, at the negotiated version
        self._pid: int | None = None
        self._started_at = 0.0

    @property
    def pid(self) -> int | None:
        return self._pid  # the host's pid of the container's main process, for the logs

    @property
    def started_at(self) -> float:
        return self._started_at

    # -- the API version -----------------------------------------------------------------------

    def _client(self, version: ApiVersion) -> docker.APIClient:
        # The SDK's low-level client (DockerClient.api): it calls containers by name, where the
        # high-level Container objects go by id. Built with an explicit version it sends nothing
        # yet. The timeout applies to every call: a hung daemon is a failed check, not a hang.
        return docker.APIClient(base_url=f"unix://{self.socket_path}", version=str(version), timeout=self.timeout)

    def _send(self, call: Callable[[docker.APIClient], T]) -> T:
        try:
            return call(self._api)
        except APIError:
            raise  # the engine answered: the caller reads the answer
        except (requests.RequestException, DockerException) as e:
            raise TrainerUnreachable(socket_problem(self.socket_path, e)) from e

    def negotiate(self) -> Engine:
        """Asks the daemon which versions it serves (unversioned requests get its newest)."""
        if self._api is None:
            self._api = self._client(CLIENT_MIN_API)  # unsent: both questions below are unversioned
        try:
            info: dict[str, Any] = self._send(lambda api: api.version(api_version=False))
        except APIError as e:
            info, answered = {}, e.status_code
        else:
            answered = 200
        try:
            if info.get("ApiVersion"):
                min_text = info.get("MinAPIVersion")
                engine = choose_version(ApiVersion.parse(info["ApiVersion"]),
                                        ApiVersion.parse(min_text) if min_text else None, str(info.get("Version", "")))
            else:
                # An engine or proxy without /version: /_ping's header names the newest it serves.
                ping = self._send(lambda api: api.get(f"{api.base_url}/_ping", timeout=self.timeout))
                header = ping.headers.get("API-Version")
                if not header:
                    raise TrainerUnreachable(
                        f"the Docker Engine at {self.socket_path} names no API version (GET /version: HTTP "
                        f"{answered}; GET /_ping: HTTP {ping.status_code}, no API-Version header)")
                engine = choose_version(ApiVersion.parse(header), None)
        except ValueError as e:
            raise TrainerUnreachable(f"the Docker Engine at {self.socket_path}: {e}") from e
        if engine != self.engine:
            log.info("%s", engine.describe())
        if self._api.api_version != str(engine.speak):
            self._api.close()
            self._api = self._client(engine.speak)
        self.engine = engine
        self._on_engine(engine)
        return engine

    def _call(self, what: str, call: Callable[[docker.APIClient], T]) -> T:
        """One Engine API call at the negotiated version, negotiated again, once, if refused. Any
        other error answer is a TrainerUnreachable naming the command (`what`) and the answer."""
        engine = self.engine or self.negotiate()
        for attempt in (1, 2):
            try:
                return self._send(call)
            except NotFound as e:
                raise TrainerUnreachable(
                    f"no container named {self.container!r} (docker ps -a; compose's container_name; "
                    f"`docker compose up -d` creates it)") from e
            except APIError as e:
                refused = refusal(e)
                if refused is None:  # e.g. HTTP 500 "error setting rlimit type 8: operation not permitted"
                    raise TrainerUnreachable(f"{what}: HTTP {e.status_code}: {str(e.explanation)[:300]}") from e
                if attempt == 2:
                    self.engine = None  # ask afresh next time
                    raise TrainerUnreachable(
                        f"the Docker Engine refuses API {engine.speak} too, after negotiating: {refused}") from e
            log.warning("the Docker Engine refused API %s (%s): negotiating again", engine.speak, refused)
            engine = self.negotiate()
        raise AssertionError("unreachable: the second attempt returns or raises")

    # -- the trainer handle --------------------------------------------------------------------

    def _inspect(self) -> dict[str, Any]:
        return self._call(f"docker inspect {self.container}", lambda api: api.inspect_container(self.container))["State"]

    def start(self, resume: bool) -> None:
        state = self._inspect()
        if state.get("Running"):
            # Compose started it before us, or a previous watchdog did: supervise, do not restart.
            self._pid = state.get("Pid") or None
            self._started_at = parse_docker_time(str(state.get("StartedAt", ""))) or time.time()
            log.info("adopted running %s (pid %s)", self.label, self._pid)
            return
        self._started_at = time.time()
        # HTTP 304 (already running) is no error; compose.cpu.yaml's rlimit refusal is HTTP 500.
        self._call(f"docker start {self.container}", lambda api: api.start(self.container))
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
            self._call(f"docker kill -s {name} {self.container}", lambda api: api.kill(self.container, signal=name))
        except TrainerUnreachable as e:
            answer = e.__cause__.status_code if isinstance(e.__cause__, APIError) else None
            if answer != 409:  # 409: not running any more, which is the goal
                log.warning("%s", e if answer else f"docker kill -s {name} {self.container}: {e}")

    def identity(self) -> dict[str, Any] | None:
        return {"container": self.container}

    def inputs(self) -> dict[str, Any] | None:
        """The container's command and environment as compose (re)created it; None while the engine
        cannot be reached."""
        try:
            config = self._call(f"docker inspect {self.container}",
                                lambda api: api.inspect_container(self.container)).get("Config") or {}
        except TrainerUnreachable as e:
            log.debug("cannot read the trainer container's settings: %s", e)  # held: asked again in seconds
            return None
        env = dict(item.split("=", 1) if "=" in item else (item, "") for item in config.get("Env") or [])
        return command_inputs([*(config.get("Entrypoint") or []), *(config.get("Cmd") or [])], env)

    def output_tail(self) -> str | None:
        """The container's output since this trainer started (`docker logs --since --tail`); the SDK
        joins the stdout and stderr frames of a container without a TTY."""
        since = int(self._started_at) or None
        try:
            raw = self._call(f"docker logs {self.container}", lambda api: api.logs(
                self.container, stdout=True, stderr=True, since=since, tail=500))
        except TrainerUnreachable as e:  # e.g. a logging driver that cannot be read back
            log.warning("%s", e if isinstance(e.__cause__, APIError) else f"docker logs {self.container}: {e}")
            return None
        return raw[-OUTPUT_TAIL_BYTES:].decode("utf-8", errors="replace")

    def end_leftover(self, identity: dict[str, Any], grace_seconds: float) -> None:
        pass  # the container is the same one: start() adopts it if it still runs

    def kill(self) -> None:
        # Killing the container's main process ends its pid namespace: nothing inside survives.
        self.signal(signal.SIGKILL)
