"""compose.yaml and the process runner run the same services: x1_pretrain.stack.services, rendered in
compose mode, is compared with compose.yaml as compose reads it (PyYAML, compose's variable
interpolation, and each `sh -c` command run with a stand-in `python` that records its arguments).

- for several .env files (the example, nothing set, every optional flag on, another provider and
  other ports), every service's argv, environment, published port and health URL agree;
- the comparison fails when compose.yaml changes alone, and when the definition changes alone;
- in process mode every server listens on 127.0.0.1 at the .env's *_HOST_PORT, reaches its peers
  there, and the trainer's environment is compose's trainer environment (no provider API key).
"""

from __future__ import annotations

import dataclasses
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from test_static_checks import dockerfile_stages, image_chain
from test_static_checks import interpolate_all as interpolate  # compose's ${VAR...} over a parsed document

from conftest import REPO
from x1_common import envfile
from x1_pretrain.stack import services as S

COMPOSE_FILE = REPO / "compose.yaml"
ENV_EXAMPLE = REPO / ".env.example"
# The images whose entrypoint takes compose's `command:` as its arguments.
IMAGE_ENTRYPOINTS = {"prometheus": ["prometheus"]}
IMAGE_STAGES = dockerfile_stages()  # every image is a stage of the one Dockerfile

# ---------------------------------------------------------------------------------------------
# compose.yaml as compose reads it

def env_example() -> dict[str, str]:
    values = {}
    for line in ENV_EXAMPLE.read_text(encoding="utf-8").splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            key, _, value = line.partition("=")
            values[key.strip()] = value.strip()
    return values


def effective_argv(name: str, service: dict, tmp_path: Path) -> list[str]:
    """What the container's process is started with: `sh -c` scripts are run, with a stand-in
    `python` on PATH that writes down the arguments it is exec'd with."""
    command = list(service["command"])
    if command[:2] != ["sh", "-c"]:
        return [*IMAGE_ENTRYPOINTS.get(name, []), *command]
    bin_dir = tmp_path / f"bin-{name}"
    bin_dir.mkdir(exist_ok=True)
    (bin_dir / "python").write_text("#!/bin/sh\nprintf '%s\\0' \"$@\" > \"$ARGV_FILE\"\n")
    (bin_dir / "python").chmod(0o755)
    argv_file = tmp_path / f"argv-{name}"
    env = {**environment(service), "PATH": f"{bin_dir}:/usr/bin:/bin", "ARGV_FILE": str(argv_file)}
    proc = subprocess.run(command, env=env, capture_output=True, text=True, timeout=30)
    assert proc.returncode == 0, proc.stderr
    return ["python", *argv_file.read_text().split("\0")[:-1]]


def environment(service: dict) -> dict[str, str]:
    env = service.get("environment") or {}
    if isinstance(env, list):
        env = dict(item.split("=", 1) if "=" in item else (item, "") for item in env)
    return {k: "" if v is None else str(v) for k, v in env.items()}


def differences(compose_text: str, values: dict[str, str], tmp_path: Path) -> list[str]:
    """Every way compose.yaml, read with these .env values, and the definitions disagree."""
    doc = interpolate(yaml.safe_load(compose_text), values)
    settings = S.Settings(values)
    defined = S.services(settings, S.COMPOSE)
    out = []
    for name, spec in defined.items():
        service = doc["services"].get(name)
        if service is None:
            out.append(f"{name}: defined, not in compose.yaml")
            continue
        argv = effective_argv(name, service, tmp_path)
        if argv != spec.argv:
            out.append(f"{name}: argv differs:\n  compose.yaml: {argv}\n  definition:   {spec.argv}")
        env = environment(service)
        if env != spec.env:
            keys = sorted(k for k in set(env) | set(spec.env) if env.get(k) != spec.env.get(k))
            out.append(f"{name}: environment differs in {keys}")
        if spec.port is not None:
            container, host_var = S.PORTS[name]
            expected = [f"127.0.0.1:{settings[host_var]}:{container}"]
            if service.get("ports") != expected or spec.port != container:
                out.append(f"{name}: ports {service.get('ports')} vs the definition's {expected} (port {spec.port})")
        if spec.health_path is not None:
            test = " ".join(service.get("healthcheck", {}).get("test", []))
            if f"http://127.0.0.1:{spec.port}{spec.health_path}" not in test:
                out.append(f"{name}: healthcheck {test!r} does not ask {spec.health_path} on port {spec.port}")
        image = "".join(s.text for s in image_chain(name)[1]) if name in IMAGE_STAGES else None  # common stage too
        for key, value in spec.image_env.items():
            if image is not None and not re.search(rf"\b{key}={value}\b", image):
                out.append(f"{name}: the image sets no {key}={value} (the Dockerfile's {name} stage)")
    return out


VARIANTS = {
    "env-example": {},
    "nothing-set": None,  # only compose's required DOCKER_GID: every default on both sides
    "every-option": {"TERMINATE_ON_FINISH": "1", "PROVIDER": "runpod", "INSTANCE_ID": "pod-abc123",
                     "PROVIDER_API_URL": "http://billing.test:8080", "PLANNED_HOURS": "26",
                     "SLACK_WEBHOOK_URL": "https://hooks.test/T0/B0/x", "SMTP_HOST": "smtp.test", "SMTP_PORT": "587",
                     "SMTP_TO": "a@b.test", "HF_TOKEN": "hf_test_token_0123"},
    "static-other-ports": {"PROVIDER": "static", "RATE_USD_PER_HR": "0.79", "MLFLOW_HOST_PORT": "15000",
                           "SIDECAR_HOST_PORT": "19792", "TRAINER_METRICS_HOST_PORT": "19791",
                           "WATCHDOG_METRICS_HOST_PORT": "19793", "PROMETHEUS_HOST_PORT": "19090",
                           "X1_CONFIG": "configs/x1-50m-h200.yaml", "TOTAL_STEPS": "20000", "NPROC": "2",
                           "TRAIN_EXTRA_ARGS": "--inject-spike-at-step 12000", "MLFLOW_WORKERS": "4",
                           "STALL_SECONDS": "900", "BUDGET_POLL_SECONDS": "60", "TERMINATE_ON_FINISH": "1"},
    # The first host of two: the sidecar counts both instances (INSTANCE_IDS), the watchdog its own.
    "two-hosts": {"NNODES": "2", "RDZV_ENDPOINT": "10.19.0.5:29400", "RDZV_ID": "x1-run-1", "INSTANCE_ID": "i-first",
                  "INSTANCE_IDS": "i-first,i-second"},
}


def variant(name: str) -> dict[str, str]:
    extra = VARIANTS[name]
    return {"DOCKER_GID": "999"} if extra is None else {**env_example(), **extra}


@pytest.mark.parametrize("name", VARIANTS)
def test_compose_yaml_runs_what_the_definitions_say(name, tmp_path):
    assert differences(COMPOSE_FILE.read_text(encoding="utf-8"), variant(name), tmp_path) == []


# ---------------------------------------------------------------------------------------------
# Either side changed alone


COMPOSE_EDITS = [
    ("trainer", "--log-every=${LOG_EVERY:-10}", "--log-every=${LOG_EVERY:-20}"),
    ("trainer", "      - --resume-from-latest\n", ""),
    ("trainer", "TRITON_CACHE_DIR: /workspace/cache/triton", "TRITON_CACHE_DIR: /tmp/triton"),
    ("budget-sidecar", '--poll-seconds "$$BUDGET_POLL_SECONDS"', "--poll-seconds 60"),
    ("budget-sidecar", '"127.0.0.1:${SIDECAR_HOST_PORT:-9792}:9792"', '"127.0.0.1:${SIDECAR_HOST_PORT:-9792}:9794"'),
    ("watchdog", " --hold-after-final\n", "\n"),
    ("watchdog", "      RUNPOD_API_KEY: ${RUNPOD_API_KEY:-}\n      # Give-up", "      # Give-up"),
    ("mlflow-server", "--workers=${MLFLOW_WORKERS:-2}", "--workers=2"),
    ("prometheus", "--storage.tsdb.retention.time=30d", "--storage.tsdb.retention.time=15d"),
    ("prepare", "HF_HOME: /workspace/cache/huggingface", "HF_HOME: /workspace/hf"),
]


@pytest.mark.parametrize(("service", "old", "new"), COMPOSE_EDITS)
def test_an_edit_of_compose_yaml_alone_is_caught(service, old, new, tmp_path):
    text = COMPOSE_FILE.read_text(encoding="utf-8")
    assert text.count(old) == 1, f"the edit's anchor {old!r} is not (once) in compose.yaml"
    found = [d for name in VARIANTS for d in differences(text.replace(old, new), variant(name), tmp_path)]
    assert found and all(d.startswith(f"{service}:") for d in found), found


def edited(define, **change):
    """A definition with one thing changed, as a hand edit of services.py would change it."""
    def wrapper(settings, mode):
        spec = define(settings, mode)
        fields = {k: (v(spec) if callable(v) else v) for k, v in change.items()}
        return dataclasses.replace(spec, **fields)
    return wrapper


DEFINITION_EDITS = {
    "trainer flag value": ("trainer", {"argv": lambda s: [a.replace("--log-every=", "--log-every=2") for a in s.argv]}),
    "trainer flag added": ("trainer", {"argv": lambda s: [*s.argv, "--allow-config-change"]}),
    "sidecar environment": ("budget-sidecar", {"env": lambda s: {**s.env, "BUDGET_POLL_SECONDS": "60"}}),
    "watchdog flag dropped": ("watchdog", {"argv": lambda s: [a for a in s.argv if a != "--hold-after-final"]}),
    "mlflow port": ("mlflow-server", {"port": 5001}),
    "mlflow health": ("mlflow-server", {"health_path": "/ready"}),
    "prometheus flag order": ("prometheus", {"argv": lambda s: [s.argv[0], *reversed(s.argv[1:])]}),
}


@pytest.mark.parametrize("edit", DEFINITION_EDITS)
def test_an_edit_of_the_definition_alone_is_caught(edit, tmp_path, monkeypatch):
    service, change = DEFINITION_EDITS[edit]
    monkeypatch.setitem(S.DEFINITIONS, service, edited(S.DEFINITIONS[service], **change))
    text = COMPOSE_FILE.read_text(encoding="utf-8")
    found = [d for name in VARIANTS for d in differences(text, variant(name), tmp_path)]
    assert found and all(d.startswith(f"{service}:") for d in found), found


# ---------------------------------------------------------------------------------------------
# Process mode: the parameters


def process_services(values: dict[str, str], tmp_path: Path) -> dict[str, S.Service]:
    return S.services(S.Settings(values), S.process_mode(tmp_path / "ws", sys.executable, REPO))


def test_in_process_mode_every_server_listens_on_localhost_at_the_env_ports_and_reaches_its_peers_there(tmp_path):
    values = {**env_example(), **VARIANTS["static-other-ports"]}
    specs = process_services(values, tmp_path)
    ws = str((tmp_path / "ws").resolve())
    assert "0.0.0.0" not in " ".join(a for spec in specs.values() for a in spec.argv)
    assert specs["mlflow-server"].port == 15000 and "--host=127.0.0.1" in specs["mlflow-server"].argv
    assert "--port=15000" in specs["mlflow-server"].argv
    sidecar = specs["budget-sidecar"].argv
    assert sidecar[sidecar.index("--host") + 1:sidecar.index("--port") + 2] == ["127.0.0.1", "--port", "19792"]
    assert sidecar[sidecar.index("--output") + 1] == f"{ws}/budget.json"
    assert specs["prometheus"].argv[-1] == "--web.listen-address=127.0.0.1:19090"
    watchdog = specs["watchdog"].argv
    own, trainer = watchdog[:watchdog.index("--")], watchdog[watchdog.index("--") + 1:]
    assert own[own.index("--metrics-host") + 1] == "127.0.0.1" and own[own.index("--port") + 1] == "19793"
    assert own[own.index("--mode") + 1] == "process" and "--container" not in own
    assert "--mlflow-uri=http://127.0.0.1:15000" in trainer and "--metrics-host=127.0.0.1" in trainer
    assert "--metrics-port=19791" in trainer and f"--budget-curr-cost-uri={ws}/budget.json" in trainer
    assert trainer[trainer.index("bash"):trainer.index("bash") + 2] == ["bash", f"{REPO}/trainer/entrypoint.sh"]


def test_in_process_mode_the_trainer_gets_composes_trainer_environment_and_no_provider_key(tmp_path):
    values = {**env_example(), "LAMBDA_API_KEY": "secret_lambda_key_0123", "SLACK_WEBHOOK_URL": "https://hooks.test/x"}
    specs = process_services(values, tmp_path)
    watchdog = specs["watchdog"]
    assert watchdog.env["LAMBDA_API_KEY"] == "secret_lambda_key_0123"  # to terminate at the end
    trainer = watchdog.argv[watchdog.argv.index("--") + 1:]
    assert trainer[0] == "env"
    removed = {trainer[i + 1] for i, a in enumerate(trainer) if a == "-u"}
    assert {"LAMBDA_API_KEY", "RUNPOD_API_KEY", "PROVIDER", "INSTANCE_ID", "STALL_SECONDS"} <= removed
    assert not removed & set(specs["trainer"].env)  # SLACK_WEBHOOK_URL etc. stay: the budget guard alerts
    assert watchdog.env["X1_TRAIN_EXTRA_ARGS"] == "" and watchdog.env["X1_PYTHON"] == sys.executable
    # No secret on any command line (`ps` shows those to every user of the machine).
    assert "secret_lambda_key_0123" not in " ".join(a for spec in specs.values() for a in spec.argv)
    assert "hooks.test" not in " ".join(a for spec in specs.values() for a in spec.argv)


def test_the_env_file_is_read_as_compose_reads_it_and_the_shell_wins(tmp_path):
    env_file = tmp_path / ".env"
    env_file.write_text("# comment\n\nexport TOTAL_STEPS=20000\nPROVIDER='runpod'\nINSTANCE_ID=\"pod 1\"\n"
                        "LOG_EVERY=5   # every 5 steps\nCKPT_EVERY=\n")
    settings = S.Settings.load(env_file, environ={"LOG_EVERY": "20", "UNRELATED": "x"})
    assert settings["TOTAL_STEPS"] == "20000" and settings["PROVIDER"] == "runpod"
    assert settings["INSTANCE_ID"] == "pod 1"
    assert settings["LOG_EVERY"] == "20"  # the shell's environment over .env, as for compose
    assert settings["CKPT_EVERY"] == "1800"  # empty: compose's default
    for bad, message in (("JUST A LINE\n", r"\.env:1: not KEY=VALUE"), ("A=${B}\n", r"\.env:1: A: variable"),
                         ("X1_CONFIG='configs/x\n", r"\.env:1: X1_CONFIG: unbalanced quote")):
        env_file.write_text(bad)
        with pytest.raises(S.SettingsError, match=message):
            S.Settings.load(env_file, environ={})
    with pytest.raises(S.SettingsError, match="no such file"):
        S.Settings.load(tmp_path / "absent.env", environ={})


def test_env_error_names_the_key_not_the_value(tmp_path):
    # A secret typed with ':' for '=' (or pasted alone on a line): the error names the line's key.
    env_file = tmp_path / ".env"
    for line, named in (("SMTP_PASSWORD: hunter2-s3cret\n", "'SMTP_PASSWORD'"), ("SMTP_PASSWORD hunter2\n", "'SMTP_PASSWORD'"),
                        ("hunter2-s3cret\n", "no KEY"), ("hunter2s3cret\n", "no KEY"), ("hunter2 pw\n", "no KEY")):
        env_file.write_text(f"PROVIDER=static\n{line}")
        proc = subprocess.run([sys.executable, "-m", "x1_pretrain.stack", "up", "--env-file", str(env_file),
                               "--workspace", str(tmp_path / "ws")], capture_output=True, text=True, timeout=60, cwd=REPO)
        assert proc.returncode == 2, proc.stderr
        assert f"{env_file}:2: not KEY=VALUE" in proc.stderr and named in proc.stderr
        assert "hunter2" not in proc.stdout + proc.stderr and "Traceback" not in proc.stderr


def test_every_setting_compose_reads_has_the_same_default_in_the_definition():
    raw = yaml.safe_load(COMPOSE_FILE.read_text(encoding="utf-8"))
    text = yaml.safe_dump(raw)
    compose_defaults = {}
    for m in re.finditer(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?::-([^}]*))?\}", text):
        compose_defaults.setdefault(m.group(1), set()).add(m.group(2) or "")
    ours = set(S.DEFAULTS)
    for name, defaults in compose_defaults.items():
        assert name in envfile.KEYS, f"compose.yaml reads {name}, which x1_common.envfile (and .env.example) lacks"
        if not envfile.KEYS[name].stack:
            continue  # build, volume, Grafana and the env-check's own settings: no service's command or environment
        assert name in ours, f"compose.yaml reads {name}; x1_pretrain.stack.services.DEFAULTS does not know it"
        if name == "RESULTS_DIR":  # the watchdog's /results mount needs a host path even when unset (unused then)
            defaults = defaults - {"/tmp/x1-results-unset"}
        assert defaults == {S.DEFAULTS[name]}, f"{name}: compose's default {defaults} vs {S.DEFAULTS[name]!r}"
