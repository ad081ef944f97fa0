"""The cloud of tests/test_launch*.py: the fake provider API with containers as its instances.

    net = DockerNetwork.create()                        # a Docker network of its own
    image = build_instance_image()                    # tests/docker/instance.Dockerfile, once
    cloud = FakeProvider.start("runpod", net, image, public_key)
    subprocess.run(["x1", "launch", "--provider", "runpod", "--api-url", cloud.url, ...])

`FakeProvider` runs budget_sidecar.fake_billing's FakeCloud in this process (uvicorn on a thread),
listening on the network's gateway address: the one address both this machine (where `x1` and the
off-host watchdog run) and the containers (whose budget sidecar polls the provider) reach. Each
instance the API creates is a container on that network (`DockerMachines`), started with the
pod's start command (RunPod) or sshd alone (Lambda); a preemption stops the container, a resume
starts it again, a terminate removes it. Every container, image and network is named x1-i43-*.
"""

from __future__ import annotations

import json
import os
import shlex
import socket
import subprocess
import threading
import time
import urllib.request
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import uvicorn
from compose_stack import TORCH_IMAGE, ca_bundle, run

from budget_sidecar.fake_billing import FakeCloud, create_app
from conftest import REPO, sigint_as_in_a_terminal

PREFIX = "x1-i43"
INSTANCE_IMAGE = f"{PREFIX}-instance:test"
API_KEY = "launch-test-key-0123456789"  # the fake provider's bearer key: a test value


def build_instance_image() -> float:
    """tests/docker/instance.Dockerfile on the local torch base, through Compose's BuildKit (the CA
    bundle as a build secret); returns the seconds it took."""
    t = time.monotonic()
    env = {**os.environ, "X1_INSTANCE_IMAGE": INSTANCE_IMAGE, "TRAINER_BASE_IMAGE": TORCH_IMAGE,
           "BUILD_CA_BUNDLE": ca_bundle() or "/etc/ssl/certs/ca-certificates.crt"}
    run(["docker", "compose", "-p", f"{PREFIX.replace('-', '')}build", "-f", "tests/docker/compose.instance.yaml",
         "build"], timeout=1800, cwd=REPO, env=env)
    return time.monotonic() - t


@dataclass(frozen=True)
class DockerNetwork:
    name: str
    gateway: str

    @classmethod
    def create(cls) -> DockerNetwork:
        name = f"{PREFIX}-net-{uuid.uuid4().hex[:6]}"
        run(["docker", "network", "create", "--label", f"{PREFIX}=1", name])
        info = json.loads(run(["docker", "network", "inspect", name]).stdout)[0]
        return cls(name, info["IPAM"]["Config"][0]["Gateway"])

    def remove(self) -> None:
        for cid in run(["docker", "ps", "-aq", "--filter", f"network={self.name}"], check=False).stdout.split():
            run(["docker", "rm", "-f", cid], check=False)
        run(["docker", "network", "rm", self.name], check=False)


class DockerMachines:
    """The containers behind the fake's instances (budget_sidecar.fake_billing.Machines)."""

    def __init__(self, network: DockerNetwork, image: str, authorized_key: str, stop_seconds: int = 2) -> None:
        self.network = network
        self.image = image
        self.authorized_key = authorized_key  # what a Lambda instance gets for its ssh_key_names
        self.stop_seconds = stop_seconds
        self.tag = uuid.uuid4().hex[:6]
        self.done: list[tuple[str, str]] = []  # (operation, instance id), as each one completed

    def container(self, instance_id: str) -> str:
        return f"{PREFIX}-inst-{self.tag}-{instance_id[:14]}"

    def create(self, instance_id: str, env: dict[str, str], command: str | None) -> None:
        env = {"PUBLIC_KEY": self.authorized_key, **env}
        argv = ["docker", "run", "-d", "--name", self.container(instance_id), "--network", self.network.name,
                "--label", f"{PREFIX}=1", "--hostname", instance_id[:14]]
        for key, value in env.items():
            argv += ["-e", f"{key}={value}"]
        argv.append(self.image)
        if command:
            argv += ["sh", "-c", command]
        run(argv, timeout=120)
        self.done.append(("create", instance_id))

    def stop(self, instance_id: str) -> None:
        run(["docker", "stop", "-t", str(self.stop_seconds), self.container(instance_id)], timeout=120)
        self.done.append(("stop", instance_id))

    def start(self, instance_id: str) -> None:
        run(["docker", "start", self.container(instance_id)], timeout=120)
        self.done.append(("start", instance_id))

    def remove(self, instance_id: str) -> None:
        run(["docker", "rm", "-f", self.container(instance_id)], timeout=120)
        self.done.append(("remove", instance_id))

    def address(self, instance_id: str) -> tuple[str, int] | None:
        proc = run(["docker", "inspect", self.container(instance_id)], check=False)
        if proc.returncode != 0:
            return None
        info = json.loads(proc.stdout)[0]
        if not info["State"]["Running"]:
            return None
        ip = info["NetworkSettings"]["Networks"][self.network.name]["IPAddress"]
        return (ip, 22) if ip else None

    def exists(self, instance_id: str) -> bool:
        return run(["docker", "inspect", self.container(instance_id)], check=False).returncode == 0

    def running(self, instance_id: str) -> bool:
        return self.address(instance_id) is not None

    def exec(self, instance_id: str, command: str, timeout: float = 60) -> str:
        return run(["docker", "exec", self.container(instance_id), "bash", "-c", command], timeout=timeout).stdout


class FakeProvider:
    """The fake Lambda or RunPod API on the test network's gateway, with containers as instances."""

    def __init__(self, cloud: FakeCloud, machines: DockerMachines, host: str, port: int) -> None:
        self.cloud = cloud
        self.machines = machines
        self.url = f"http://{host}:{port}"
        self.server = uvicorn.Server(uvicorn.Config(create_app(cloud, API_KEY), host=host, port=port,
                                                    log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, name="fake-provider", daemon=True)

    @classmethod
    def start(cls, provider: str, network: DockerNetwork, machines: DockerMachines, price: float = 1.10,
              time_scale: float = 60.0) -> FakeProvider:
        cloud = FakeCloud(provider, "unused", price, time_scale, boot_seconds=1.0, machines=machines,
                          start_with_instance=False)
        with socket.socket() as s:
            s.bind((network.gateway, 0))
            port = s.getsockname()[1]
        fake = cls(cloud, machines, network.gateway, port)
        fake.thread.start()
        deadline = time.monotonic() + 30
        while not fake.server.started:
            if time.monotonic() > deadline or not fake.thread.is_alive():
                raise AssertionError(f"the fake provider API did not start on {fake.url}")
            time.sleep(0.05)
        return fake

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)

    def control(self, **body: Any) -> dict[str, Any]:
        req = urllib.request.Request(f"{self.url}/_control", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=120) as resp:
            return json.loads(resp.read())

    def state(self) -> dict[str, Any]:
        return self.cloud.state()

    def live(self) -> list[str]:
        """Instances the provider bills or could start again (not terminated)."""
        return [i for i, v in self.state()["instances"].items() if v["status"] not in ("terminated", "TERMINATED")]


class X1:
    """`x1` as a user runs it: the console script of the venv, its records in a folder of the test's."""

    def __init__(self, state_dir: Path, api_key_var: str, api_key: str = API_KEY) -> None:
        self.state_dir = state_dir
        exe = Path(os.environ.get("X1_EXE", str(Path(__import__("sys").executable).parent / "x1")))
        self.exe = str(exe)
        self.env = {k: v for k, v in os.environ.items() if k not in ("LAMBDA_API_KEY", "RUNPOD_API_KEY")}
        self.env.update({api_key_var: api_key, "X1_STATE_DIR": str(state_dir), "PYTHONUNBUFFERED": "1"})

    def __call__(self, *args: str, timeout: float = 300, env: dict[str, str] | None = None,
                 cwd: Path | None = None, quiet: bool = False) -> subprocess.CompletedProcess[str]:
        """`x1 ARGS`; the transcript (command, exit code, seconds, output) goes to the test's output."""
        t = time.monotonic()
        proc = subprocess.run([self.exe, *args], capture_output=True, text=True, timeout=timeout,
                              env={**self.env, **(env or {})}, cwd=cwd, stdin=subprocess.DEVNULL)
        if not quiet:
            print(f"[{time.strftime('%H:%M:%S')}] $ x1 {shlex.join(args)}   # exit {proc.returncode} in "
                  f"{time.monotonic() - t:.1f} s\n{proc.stdout}{proc.stderr}", flush=True)
        return proc

    def start(self, *args: str, cwd: Path | None = None) -> Running:
        """`x1 ARGS` running, its lines collected; a Ctrl-C (SIGINT) reaches it as at a terminal."""
        return Running(subprocess.Popen([self.exe, *args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                        env=self.env, cwd=cwd, stdin=subprocess.DEVNULL,
                                        preexec_fn=sigint_as_in_a_terminal))


class Running:
    """A running `x1` whose output lines are collected as they come."""

    def __init__(self, proc: subprocess.Popen[str]) -> None:
        self.proc = proc
        self.lines: list[str] = []
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line)

    @property
    def output(self) -> str:
        return "".join(self.lines)

    def wait_for_line(self, predicate: Callable[[str], bool], timeout: float) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for line in list(self.lines):
                if predicate(line):
                    return line
            if self.proc.poll() is not None and not self.reader.is_alive():
                break
            time.sleep(0.05)
        raise AssertionError(f"x1 (exit {self.proc.poll()}) did not print the line waited for:\n{self.output}")

    def finish(self, timeout: float = 120) -> int:
        code = self.proc.wait(timeout=timeout)
        self.reader.join(timeout=10)
        print(self.output, flush=True)
        return code
