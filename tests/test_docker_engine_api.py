"""The watchdog's Docker mode against a fake Docker Engine on a real unix socket (tests/
fake_docker_engine.py), which answers and refuses as dockerd does: API-version negotiation for
Engine 20.10 (1.41) through 29 (1.52, minimum 1.44) and later, an engine too old, an engine
upgraded under a running watchdog, and a socket that is missing or not ours. The real engine
runs in tests/test_docker_compose.py."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from fake_docker_engine import FakeEngine
from prometheus_client.parser import text_string_to_metric_families

from conftest import REPO, cli_env, free_port, wait_for
from receivers import WebhookReceiver
from x1_watchdog.docker import CLIENT_MAX_API, CLIENT_MIN_API, ApiVersion, DockerHandle, choose_version
from x1_watchdog.handles import TrainerUnreachable

NAME = "x1-trainer"


@pytest.fixture
def sock() -> Iterator[Path]:
    # AF_UNIX paths are limited to 107 bytes; pytest's tmp_path can be longer.
    short = Path(f"/tmp/x1-fake-docker-{os.getpid()}-{time.monotonic_ns() % 10**9}")
    short.mkdir()
    yield short / "docker.sock"
    for p in short.iterdir():
        p.unlink()
    short.rmdir()


def engine_at(sock: Path, api: str, min_api: str | None, release: str, **kw: Any) -> FakeEngine:
    engine = FakeEngine(sock, api_version=api, min_api_version=min_api, engine_version=release, **kw)
    engine.add_container(NAME, running=True)
    return engine


# ---------------------------------------------------------------------------------------------
# Versions are numbers, and the choice follows the SDKs


def test_api_versions_compare_as_numbers_not_strings():
    assert ApiVersion.parse("1.9") < ApiVersion.parse("1.41") < ApiVersion.parse("1.100")
    assert ApiVersion.parse("v1.44") == ApiVersion(1, 44)
    assert str(ApiVersion.parse("1.52")) == "1.52"
    for bad in ("", "1", "1.x", "one.two", "1.41.0"):
        with pytest.raises(ValueError, match="not a Docker Engine API version"):
            ApiVersion.parse(bad)


@pytest.mark.parametrize(("api", "min_api", "speak"), [
    ("1.41", "1.12", "1.41"),   # Engine 20.10: Debian 12's docker.io
    ("1.43", "1.12", "1.43"),   # Engine 24
    ("1.47", "1.24", "1.47"),   # Engine 27
    ("1.52", "1.44", "1.52"),   # Engine 29
    ("1.60", "1.44", "1.52"),   # a later engine: the newest this client knows
    ("1.60", "1.55", "1.55"),   # a later engine whose minimum is past that: never below its minimum
    ("1.100", None, "1.52"),    # 1.100 > 1.52 as numbers (as strings it would sort first)
])
def test_chosen_version_is_the_highest_both_speak_never_below_the_engines_minimum(api, min_api, speak):
    engine = choose_version(ApiVersion.parse(api), ApiVersion.parse(min_api) if min_api else None)
    assert str(engine.speak) == speak


@pytest.mark.parametrize("api", ["1.40", "1.9"])
def test_engine_older_than_api_141_is_refused_naming_both_versions(api):
    with pytest.raises(TrainerUnreachable) as e:
        choose_version(ApiVersion.parse(api), ApiVersion(1, 12), "19.03.15")
    assert f"API {api}" in str(e.value) and str(CLIENT_MIN_API) in str(e.value)
    assert "Docker Engine 19.03.15" in str(e.value) and "upgrade Docker" in str(e.value)


# ---------------------------------------------------------------------------------------------
# The handle against engines of every band, over a real socket


@pytest.mark.parametrize(("api", "min_api", "release"), [
    ("1.41", "1.12", "20.10.24+dfsg1"),
    ("1.43", "1.12", "24.0.9"),
    ("1.47", "1.24", "27.5.1"),
    ("1.52", "1.44", "29.0.0"),
])
def test_handle_negotiates_and_drives_the_container_on_each_engine(sock, api, min_api, release):
    with engine_at(sock, api, min_api, release) as engine:
        handle = DockerHandle(NAME, socket_path=str(sock))
        handle.start(resume=True)  # running: adopted, not restarted
        assert engine.containers[NAME].starts == 0 and handle.pid == 4242
        assert handle.poll() is None
        handle.signal(signal.SIGTERM)  # the fake trainer exits 75, as after its emergency checkpoint
        ex = handle.poll()
        assert ex is not None and ex.code == 75 and ex.reason == "preempted"
        handle.start(resume=True)
        assert engine.containers[NAME].starts == 1 and handle.poll() is None
        handle.kill()
        ex = handle.poll()
        assert ex is not None and ex.code == 137 and ex.signal == signal.SIGKILL

        # One unversioned question, then every call at the chosen version, none refused.
        assert [r.path for r in engine.requests if r.version is None] == ["/version"]
        assert {r.version for r in engine.versioned()} == {api}
        assert engine.refused() == []
        assert handle.engine is not None and str(handle.engine.speak) == api
        assert release in handle.engine.describe()


def test_engine_with_api_140_is_refused_clearly_before_any_versioned_call(sock):
    with engine_at(sock, "1.40", "1.12", "19.03.15") as engine:
        handle = DockerHandle(NAME, socket_path=str(sock))
        with pytest.raises(TrainerUnreachable) as e:
            handle.start(resume=True)
        assert "Docker Engine 19.03.15 serves Engine API 1.40 at most" in str(e.value)
        assert "needs API 1.41 (Docker Engine 20.10) or newer" in str(e.value)
        assert engine.versioned() == []


def test_a_newer_engine_than_the_client_knows_is_spoken_to_at_the_clients_newest(sock):
    with engine_at(sock, "1.55", "1.44", "31.0.0") as engine:
        handle = DockerHandle(NAME, socket_path=str(sock))
        handle.start(resume=True)
        assert handle.poll() is None
        assert {r.version for r in engine.versioned()} == {str(CLIENT_MAX_API)}


def test_engine_without_version_endpoint_is_negotiated_through_ping(sock):
    # /_ping's API-Version header is all some socket proxies pass through.
    with engine_at(sock, "1.45", None, "26.1.4", serve_version_endpoint=False) as engine:
        handle = DockerHandle(NAME, socket_path=str(sock))
        handle.start(resume=True)
        assert handle.poll() is None
        assert [r.path for r in engine.requests if r.version is None] == ["/version", "/_ping"]
        assert {r.version for r in engine.versioned()} == {"1.45"}


@pytest.mark.parametrize(("before", "after", "refusal"), [
    (("1.41", "1.12", "20.10.24"), ("1.52", "1.44", "29.0.0"), "too old"),  # upgraded to Engine 29
    (("1.47", "1.24", "27.5.1"), ("1.41", "1.12", "20.10.24"), "too new"),  # replaced by an older one
])
def test_engine_replaced_mid_run_refuses_once_then_the_handle_renegotiates(sock, before, after, refusal):
    with engine_at(sock, *before) as engine:
        handle = DockerHandle(NAME, socket_path=str(sock))
        handle.start(resume=True)
        assert handle.poll() is None
        engine.upgrade(*after)
        assert handle.poll() is None  # refused, asked again, answered: the caller never knew
        refused = engine.refused()
        assert len(refused) == 1 and refused[0].version == before[0]
        assert str(handle.engine.speak) == after[0]
        engine.exit(NAME, 75)
        ex = handle.poll()
        assert ex is not None and ex.code == 75
        handle.start(resume=True)
        assert engine.containers[NAME].starts == 1
        assert [r.path for r in engine.requests if r.version is None] == ["/version", "/version"]
        assert len(engine.refused()) == 1
        assert f"client version {before[0]} is {refusal}" in refused[0].message
        after_upgrade = engine.requests[engine.requests.index(refused[0]) + 1:]
        assert {r.version for r in after_upgrade if r.version} == {after[0]}


def test_missing_socket_is_named_with_how_to_mount_it(sock):
    handle = DockerHandle(NAME, socket_path=str(sock))
    with pytest.raises(TrainerUnreachable) as e:
        handle.poll()
    assert f"no Docker Engine socket at {sock}" in str(e.value) and "docker.sock" in str(e.value)


def test_socket_nobody_listens_on_says_the_engine_refuses_connections(sock):
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.bind(str(sock))  # bound, never listening: what a dead dockerd leaves behind
    try:
        handle = DockerHandle(NAME, socket_path=str(sock))
        with pytest.raises(TrainerUnreachable, match="refuses connections: is dockerd running"):
            handle.poll()
    finally:
        s.close()


def poll_as(uid: int, sock: Path) -> str:
    """DockerHandle.poll()'s error, asked from a forked child running as `uid` with no groups:
    root passes every permission check, the watchdog (uid 1000) does not."""
    handle = DockerHandle(NAME, socket_path=str(sock))
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: drop to uid, ask, write the answer, leave without cleanup
        try:
            os.close(read_end)
            os.setgroups([])
            os.setgid(uid)
            os.setuid(uid)
            try:
                handle.poll()
                answer = "no error"
            except TrainerUnreachable as e:
                answer = str(e)
            os.write(write_end, answer.encode())
        finally:
            os._exit(0)
    os.close(write_end)
    with os.fdopen(read_end, "rb") as f:
        answer = f.read().decode()
    os.waitpid(pid, 0)
    return answer


def test_socket_of_another_group_is_a_permission_error_naming_the_group_and_docker_gid(sock):
    with engine_at(sock, "1.41", "1.12", "20.10.24"):
        os.chmod(sock, 0o660)  # dockerd's mode: root and the docker group
        gid = sock.stat().st_gid
        if os.geteuid() == 0:
            answer = poll_as(65534, sock)
        else:
            os.chmod(sock, 0o000)
            try:
                DockerHandle(NAME, socket_path=str(sock)).poll()
                answer = "no error"
            except TrainerUnreachable as e:
                answer = str(e)
    assert f"permission denied on the Docker Engine socket {sock}" in answer
    assert f"group {gid}" in answer and "with groups [" in answer
    assert f"DOCKER_GID={gid}" in answer and "stat -c %g" in answer


# ---------------------------------------------------------------------------------------------
# The watchdog process: unhealthy, alerting and retrying instead of exiting into a restart loop


def metric(port: int, name: str) -> float | None:
    import urllib.request

    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name:
                return sample.value
    return None


def wait_until(predicate: Callable[[], Any], timeout: float, what: str) -> Any:
    return wait_for(predicate, timeout, what, interval=0.1, tolerate=(OSError, ValueError, KeyError))


def events(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


class Watchdog:
    def __init__(self, tmp_path: Path, sock: Path, webhook: str) -> None:
        self.port = free_port()
        self.events_file = tmp_path / "logs" / "events.jsonl"
        self.log = tmp_path / "watchdog.log"
        argv = [sys.executable, "-m", "x1_watchdog", "--mode", "docker", "--container", NAME,
                "--docker-socket", str(sock), "--heartbeat-file", str(tmp_path / "heartbeat.json"),
                "--events-file", str(self.events_file), "--state-file", str(tmp_path / "logs" / "state.json"),
                "--port", str(self.port), "--check-seconds", "0.2", "--backoff-base-seconds", "0.5",
                "--backoff-max-seconds", "2", "--stall-seconds", "0"]
        with self.log.open("wb") as out:
            self.proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, cwd=REPO,
                                         env=cli_env(SLACK_WEBHOOK_URL=webhook))

    def healthcheck(self) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "x1_watchdog.healthcheck",
                               f"http://127.0.0.1:{self.port}/metrics"], capture_output=True, text=True, timeout=30)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


@pytest.fixture
def slack() -> Iterator[WebhookReceiver]:
    receiver = WebhookReceiver()
    try:
        yield receiver
    finally:
        receiver.close()


@pytest.fixture
def watchdog_factory(tmp_path: Path, sock: Path, slack: WebhookReceiver) -> Iterator[Callable[[], Watchdog]]:
    started: list[Watchdog] = []

    def start() -> Watchdog:
        wd = Watchdog(tmp_path, sock, slack.url)
        started.append(wd)
        return wd

    yield start
    for wd in started:
        wd.stop()


def test_watchdog_on_too_old_an_engine_stays_up_unhealthy_alerts_and_recovers_after_an_upgrade(
        sock, watchdog_factory, slack):
    with engine_at(sock, "1.40", "1.12", "19.03.15") as engine:
        wd = watchdog_factory()
        wait_until(lambda: metric(wd.port, "x1_watchdog_healthy") == 0, 60, "x1_watchdog_healthy 0")
        unhealthy = wait_until(lambda: [e for e in events(wd.events_file) if e["event"] == "unhealthy"], 30,
                               "an unhealthy event")
        assert "API 1.40" in unhealthy[0]["detail"] and "1.41" in unhealthy[0]["detail"]
        check = wd.healthcheck()
        assert check.returncode == 1 and "x1_watchdog_healthy 0" in check.stderr
        alert = wait_until(lambda: slack.posts, 30, "the unhealthy alert")
        assert "API 1.40" in json.dumps(alert[0])

        # It retries with backoff (0.5, 1, 2, 2, ... s), neither exiting nor spinning.
        time.sleep(4)
        assert wd.proc.poll() is None
        asks = [r for r in engine.requests if r.path == "/version"]
        assert 3 <= len(asks) <= 8, len(asks)
        assert len(slack.posts) == 1  # one alert per outage, not one per retry

        engine.upgrade("1.41", "1.12", "20.10.24+dfsg1")
        wait_until(lambda: metric(wd.port, "x1_watchdog_healthy") == 1, 30, "x1_watchdog_healthy 1")
        assert wd.healthcheck().returncode == 0
        wait_until(lambda: events(wd.events_file)[-1]["event"] == "start", 30, "the adoption")
        kinds = [e["event"] for e in events(wd.events_file)]
        assert kinds[-2:] == ["healthy", "start"]
        assert engine.containers[NAME].starts == 0  # the running trainer was adopted, not restarted
        assert metric(wd.port, "x1_watchdog_docker_engine_info") == 1
        assert wd.proc.poll() is None


def test_watchdog_without_a_socket_stays_up_unhealthy_then_supervises_once_the_engine_appears(
        sock, watchdog_factory, slack):
    wd = watchdog_factory()
    wait_until(lambda: metric(wd.port, "x1_watchdog_healthy") == 0, 60, "x1_watchdog_healthy 0")
    unhealthy = wait_until(lambda: [e for e in events(wd.events_file) if e["event"] == "unhealthy"], 30,
                           "an unhealthy event")
    assert f"no Docker Engine socket at {sock}" in unhealthy[0]["detail"]
    assert wd.proc.poll() is None
    with engine_at(sock, "1.52", "1.44", "29.0.0") as engine:
        wait_until(lambda: metric(wd.port, "x1_watchdog_healthy") == 1, 30, "x1_watchdog_healthy 1")
        # Supervising for real now: a preemption (75) is relaunched at Engine 29's version.
        engine.exit(NAME, 75)
        wait_until(lambda: engine.containers[NAME].starts == 1, 30, "the relaunch")
        assert {r.version for r in engine.versioned()} == {"1.52"}
    assert wd.proc.poll() is None


def test_watchdog_follows_an_engine_upgraded_under_it_and_still_relaunches(sock, watchdog_factory):
    with engine_at(sock, "1.41", "1.12", "20.10.24+dfsg1") as engine:
        wd = watchdog_factory()
        wait_until(lambda: [e for e in events(wd.events_file) if e["event"] == "start"], 60, "the adoption")
        engine.upgrade("1.52", "1.44", "29.0.0")  # refuses the 1.41 the watchdog speaks
        wait_until(lambda: engine.refused(), 30, "the refusal")
        engine.exit(NAME, 75)
        wait_until(lambda: len([e for e in events(wd.events_file) if e["event"] == "start"]) == 2, 30,
                   "the relaunch after the upgrade")
        assert engine.containers[NAME].starts == 1
        kinds = [e["event"] for e in events(wd.events_file)]
        assert kinds == ["start", "exit", "relaunch", "start"]  # no unhealthy: one refusal, renegotiated
        assert len(engine.refused()) == 1
        assert metric(wd.port, "x1_watchdog_healthy") == 1
