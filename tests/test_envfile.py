""".env is checked everywhere it is read: the process stack, compose's env-check service (the
command it runs, and that every service waits for it), and `x1 launch` before anything is rented.

A key X1 does not read is an error naming it and the nearest key it does (exit 2), a value of the
wrong type an error naming the key, and a key X1 once read a warning naming what replaced it. The
keys are x1_common.envfile's, which .env.example documents one for one.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from test_static_checks import variables_used

from budget_sidecar.testing import FakeBilling
from conftest import REPO, run_module
from x1_common import envfile
from x1_common.contracts import SECRET_ENV_VARS
from x1_pretrain.stack import services as S

ENV_EXAMPLE = REPO / ".env.example"
COMPOSE_FILES = ("compose.yaml", "compose.cpu.yaml", "compose.multinode.yaml", "compose.build-ca.yaml")


def example_with(tmp_path: Path, *lines: str) -> Path:
    """The unedited .env.example with `lines` appended: what `cp .env.example .env` and an edit give."""
    path = tmp_path / ".env"
    path.write_text(ENV_EXAMPLE.read_text(encoding="utf-8") + "\n".join(lines) + "\n", encoding="utf-8")
    return path


def example_values() -> dict[str, str]:
    values = {}
    for line in ENV_EXAMPLE.read_text(encoding="utf-8").splitlines():
        if line.strip() and not line.startswith("#"):
            key, _, value = line.partition("=")
            values[key] = value
    return values


# ---------------------------------------------------------------------------------------------
# One list of keys


def test_env_example_documents_exactly_the_known_keys_with_their_defaults():
    listed = example_values()
    assert list(listed) == list(envfile.KEYS)  # the same keys, in the same order
    assert {k: v for k, v in listed.items()} == {k: key.default for k, key in envfile.KEYS.items()}
    # The process stack's defaults are these too, for the keys it reads.
    assert S.DEFAULTS == {k: key.default for k, key in envfile.KEYS.items() if key.stack}


def test_every_variable_the_compose_files_interpolate_is_a_known_key():
    for name in COMPOSE_FILES:
        # The text without its comment lines (compose's !reset / !override tags are not PyYAML's).
        lines = (REPO / name).read_text(encoding="utf-8").splitlines()
        used = variables_used("\n".join(line for line in lines if not line.lstrip().startswith("#")))
        assert used <= set(envfile.KEYS), f"{name} reads {sorted(used - set(envfile.KEYS))}, which .env.example lacks"


def test_the_unedited_env_example_passes_the_check():
    values, warnings = envfile.load_env_file(ENV_EXAMPLE)
    assert warnings == [] and values == example_values()


def test_no_secret_has_a_type_so_no_message_ever_quotes_one():
    # value_problems quotes a value of the wrong type: secrets are text, never checked, never quoted.
    for name in SECRET_ENV_VARS:
        if name in envfile.KEYS:
            assert envfile.KEYS[name].check is envfile.text, name


# ---------------------------------------------------------------------------------------------
# The check, as a command (compose's env-check service runs it)


@pytest.mark.parametrize(("line", "named"), [
    ("BUDGET_CAP=20", "BUDGET_CAP is not a setting X1 reads (did you mean BUDGET_CAP_USD?"),
    ("TOTAL_STEP=43500", "TOTAL_STEP is not a setting X1 reads (did you mean TOTAL_STEPS?"),
    ("budget_alert_usd=25", "budget_alert_usd is not a setting X1 reads (did you mean BUDGET_ALERT_USD?"),
    ("MAX_PRICE_PER_HR=1.2", "MAX_PRICE_PER_HR is not a setting X1 reads (did you mean MAX_PRICE_USD_PER_HR?"),
    ("WANDB_PROJECT=x1", "WANDB_PROJECT is not a setting X1 reads (no known key is close"),
])
def test_an_unknown_key_is_refused_naming_it_and_the_nearest_known_key(tmp_path, capsys, line, named):
    assert envfile.main([str(example_with(tmp_path, line))]) == 2
    err = capsys.readouterr().err
    assert named in err and ".env.example lists every one" in err
    # named by its key, the value never quoted (the file's path, which may hold the same digits, aside)
    assert line.split("=")[1] not in err.replace(str(tmp_path), "")


@pytest.mark.parametrize(("line", "named"), [
    ("TOTAL_STEPS=lots", "TOTAL_STEPS='lots' is not a whole number"),
    ("TOTAL_STEPS=0", "TOTAL_STEPS='0' must be at least 1"),
    ("BUDGET_CAP_USD=-5", "BUDGET_CAP_USD='-5' must be a positive number"),
    ("BUDGET_ALERT_USD=thirty", "BUDGET_ALERT_USD='thirty' is not a number"),
    ("SMTP_PORT=smtp", "SMTP_PORT='smtp' must be a port number in 1..65535"),
    ("TRAINER_FLOAT8=yes", "TRAINER_FLOAT8='yes' must be 0 or 1"),
    ("SMTP_STARTTLS=maybe", "SMTP_STARTTLS='maybe' must be 0 or 1 (or true/false, yes/no, on/off)"),
    ("RDZV_ENDPOINT=10.19.0.5", "RDZV_ENDPOINT='10.19.0.5' must be HOST:PORT"),
    ("PROVIDER=aws", "PROVIDER='aws' must be lambda, runpod or static"),
    ("PROVIDER_API_URL=localhost:8790", "PROVIDER_API_URL='localhost:8790' must start with http:// or https://"),
    ("TORCH_VERSION=latest", "TORCH_VERSION='latest' must be a torch release such as 2.11.0"),
    ("TORCH_CUDA=cu130", "TORCH_CUDA='cu130' must be a CUDA version such as 13.0, or none"),
    ("TRAINER_SHM_SIZE=lots", "TRAINER_SHM_SIZE='lots' must be a size such as 16gb"),
])
def test_a_value_of_the_wrong_type_is_refused_naming_the_key(tmp_path, capsys, line, named):
    assert envfile.main([str(example_with(tmp_path, line))]) == 2
    assert named in capsys.readouterr().err


@pytest.mark.parametrize("line", ["TORCH_CUDA=12.8", "TORCH_CUDA=none"])
def test_a_cuda_version_or_torchs_cpu_build_is_accepted(tmp_path, line):
    assert envfile.main([str(example_with(tmp_path, line))]) == 0


def test_a_retired_key_is_a_warning_naming_what_replaced_it(tmp_path):
    proc = run_module("x1_common.envfile", str(example_with(tmp_path, "NGC_PYTORCH_TAG=24.10-py3")), timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "warning:" in proc.stderr and "NGC_PYTORCH_TAG is no longer read" in proc.stderr
    assert "TORCH_VERSION and TORCH_CUDA" in proc.stderr


def test_compose_own_variables_are_left_to_compose(tmp_path):
    values, warnings = envfile.load_env_file(example_with(tmp_path, "COMPOSE_PROJECT_NAME=x1", "COMPOSE_PROFILES=monitoring"))
    assert values["COMPOSE_PROJECT_NAME"] == "x1" and warnings == []


# ---------------------------------------------------------------------------------------------
# Compose: the env-check service, before everything else


def test_compose_checks_the_env_file_before_any_service_starts():
    compose = yaml.safe_load((REPO / "compose.yaml").read_text(encoding="utf-8"))
    check = compose["services"]["env-check"]
    (mount,) = check["volumes"]
    # The file compose read (./.env, or X1_ENV_FILE for `--env-file F`), read-only, never created empty.
    assert (mount["type"], mount["source"], mount["read_only"]) == ("bind", "${X1_ENV_FILE:-./.env}", True)
    assert mount["bind"]["create_host_path"] is False
    assert check["command"] == ["python", "-m", "x1_common.envfile", mount["target"]]
    assert check["restart"] == "no" and check["network_mode"] == "none"
    for name, service in compose["services"].items():
        if name in ("env-check", "watchdog", "prometheus", "grafana"):
            continue
        assert service["depends_on"]["env-check"] == {"condition": "service_completed_successfully"}, name
    # The watchdog starts after the trainer, which waits for the check.
    assert "trainer" in compose["services"]["watchdog"]["depends_on"]


def test_the_env_check_command_refuses_a_misspelt_key_as_the_container_runs_it(tmp_path):
    # As compose.yaml's env-check runs it, on the mounted file, from the image's working directory.
    env_file = example_with(tmp_path, "BUDGET_CAP=20")
    target = tmp_path / "run" / "settings.env"
    target.parent.mkdir()
    shutil.copyfile(env_file, target)
    proc = subprocess.run([sys.executable, "-m", "x1_common.envfile", str(target)], capture_output=True, text=True,
                          timeout=60, cwd=tmp_path)
    assert proc.returncode == 2 and "did you mean BUDGET_CAP_USD?" in proc.stderr


# ---------------------------------------------------------------------------------------------
# The process stack and `x1 launch`


def test_stack_up_refuses_a_misspelt_key_before_anything_starts(tmp_path, tiny_data):
    ws = tmp_path / "ws"
    shutil.copytree(tiny_data, ws / "data" / "tokenized")
    env_file = example_with(tmp_path, "PROVIDER=static", "RATE_USD_PER_HR=0.10", "BUDGET_CAP=20")
    proc = run_module("x1_pretrain.stack", "up", "-d", "--env-file", str(env_file), "--workspace", str(ws), timeout=120)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "BUDGET_CAP is not a setting X1 reads (did you mean BUDGET_CAP_USD?" in proc.stderr
    assert sorted(p.name for p in ws.iterdir()) == ["data"]  # nothing started, nothing written
    prepare = run_module("x1_pretrain.stack", "prepare", "--env-file", str(env_file), "--workspace", str(ws), timeout=60)
    assert prepare.returncode == 2 and "did you mean BUDGET_CAP_USD?" in prepare.stderr


def test_stack_up_warns_of_a_retired_key_and_goes_on_to_its_other_checks(tmp_path):
    env_file = example_with(tmp_path, "PROVIDER=static", "RATE_USD_PER_HR=0.10", "NGC_PYTORCH_TAG=24.10-py3")
    proc = run_module("x1_pretrain.stack", "up", "--env-file", str(env_file), "--workspace", str(tmp_path / "ws"),
                      timeout=60)
    assert "warning:" in proc.stderr and "NGC_PYTORCH_TAG is no longer read" in proc.stderr
    assert proc.returncode == 2 and "no tokenized data" in proc.stderr  # the next check, not the key


def test_x1_launch_refuses_a_misspelt_key_before_renting(tmp_path):
    if shutil.which("ssh-keygen") is None:
        pytest.skip("no ssh-keygen (Debian's openssh-client)")
    key = tmp_path / "id_ed25519"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(key)], check=True)
    fake = FakeBilling.start(tmp_path / "fake", provider="lambda", instance_id="existing-1", api_key="k-0123456789",
                             price_usd_per_hr=1.10)
    try:
        env_file = example_with(tmp_path, "BUDGET_CAP=20")
        env = {k: v for k, v in os.environ.items() if k not in ("LAMBDA_API_KEY", "RUNPOD_API_KEY")}
        env.update(LAMBDA_API_KEY="k-0123456789", X1_STATE_DIR=str(tmp_path / "state"))
        proc = subprocess.run([str(Path(sys.executable).parent / "x1"), "launch", "--provider", "lambda", "--api-url",
                               fake.url, "--ssh-key", str(key), "--ssh-key-name", "laptop", "--env-file", str(env_file),
                               "--yes"], capture_output=True, text=True, timeout=120, env=env, stdin=subprocess.DEVNULL)
        assert proc.returncode == 2, proc.stdout + proc.stderr
        assert "BUDGET_CAP is not a setting X1 reads (did you mean BUDGET_CAP_USD?" in proc.stderr
        state = fake.state()
        assert state["launch_calls"] == [] and state.get("create_calls", []) == []
        assert list(state["instances"]) == ["existing-1"]
    finally:
        fake.stop()


def test_the_data_sources_env_accepts_are_preps_own():
    from x1_pretrain.data.prepare import SOURCES

    check = envfile.KEYS["DATA_SOURCE"].check
    assert all(check(name) is None for name in SOURCES)
    assert check("fineweb") == "must be fineweb-edu, fineweb-edu-100bt or pile-cc"
    assert check("fineweb").removeprefix("must be ").replace(" or ", ", ").split(", ") == list(SOURCES)
