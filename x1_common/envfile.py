"""The settings of `.env`: every key X1 reads, its default and its type, and the check every reader
runs on a `.env` file (the process stack, compose's `env-check` service, `x1 launch`).

    values, warnings = load_env_file(".env")     # EnvFileError: every problem named, the file never quoted
    python -m x1_common.envfile .env             # the same check as a command: exit 2 on a problem

Compose passes a container only the variables compose.yaml names, so a key it does not know
(`BUDGET_CAP=20` for BUDGET_CAP_USD) would be ignored without a word and the run would go on
under the default $35 cap. Here such a key is an error naming it and the nearest known key, a
value of the wrong type (`TOTAL_STEPS=lots`) an error naming the key and the type, and a key X1
once read and no longer does a warning naming what replaced it. Compose's own `COMPOSE_*`
variables are compose's business and pass unchecked.

.env.example documents exactly the keys of KEYS, with these defaults (tests/test_envfile.py);
compose.yaml's `${VAR:-default}` and the process stack's defaults (x1_pretrain.stack.services)
are these too. Standard library only: every image and the laptop import it.
"""

from __future__ import annotations

import difflib
import os
import re
import sys
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path


class EnvFileError(ValueError):
    """A .env that cannot be used; the message names the file, the line or the key, never a value
    that may be a secret."""


# ---------------------------------------------------------------------------------------------
# Types: each a check that returns what is wrong with a non-empty value (None when it is fine)

Check = Callable[[str], "str | None"]


def text(_value: str) -> str | None:
    return None


def whole(low: int) -> Check:
    def check(value: str) -> str | None:
        try:
            n = int(value)
        except ValueError:
            return "is not a whole number"
        return None if n >= low else f"must be at least {low}"
    return check


def number(low: float, positive: bool = False) -> Check:
    def check(value: str) -> str | None:
        try:
            x = float(value)
        except ValueError:
            return "is not a number"
        if x != x or x in (float("inf"), float("-inf")):
            return "is not a finite number"
        if positive and not x > 0:
            return "must be a positive number"
        return None if x >= low else f"must be at least {low:g}"
    return check


def port(value: str) -> str | None:
    return None if value.isdigit() and 1 <= int(value) <= 65535 else "must be a port number in 1..65535"


def choice(*allowed: str) -> Check:
    def check(value: str) -> str | None:
        return None if value in allowed else f"must be {', '.join(allowed[:-1])} or {allowed[-1]}"
    return check


def zero_or_one(value: str) -> str | None:
    return None if value in ("0", "1") else "must be 0 or 1"


def flag(value: str) -> str | None:
    # x1_common.alerts reads 1/true/yes/on as on; anything else would silently read as off
    return None if value.lower() in ("0", "1", "true", "false", "yes", "no", "on", "off") else \
        "must be 0 or 1 (or true/false, yes/no, on/off)"


def url(value: str) -> str | None:
    return None if value.startswith(("http://", "https://")) else "must start with http:// or https://"


def host_port(value: str) -> str | None:
    host, sep, p = value.rpartition(":")
    return None if sep and host and port(p) is None else "must be HOST:PORT"


def pattern(regex: str, what: str) -> Check:
    compiled = re.compile(regex)

    def check(value: str) -> str | None:
        return None if compiled.fullmatch(value) else f"must be {what}"
    return check


@dataclass(frozen=True)
class Key:
    name: str
    default: str  # compose's default (`${NAME:-default}`) and .env.example's value; "" = unset
    check: Check = text
    stack: bool = True  # read by the process stack too; False: by compose (or its builds) only


# In .env.example's order. Each key's meaning is documented there, where people read it.
KEYS: dict[str, Key] = {k.name: k for k in (
    # the instance and its bill
    Key("PROVIDER", "lambda", choice("lambda", "runpod", "static")),
    Key("INSTANCE_ID", ""),
    Key("INSTANCE_IDS", ""),
    Key("LAMBDA_API_KEY", ""),
    Key("RUNPOD_API_KEY", ""),
    Key("PROVIDER_API_URL", "", url),
    Key("RATE_USD_PER_HR", "", number(0)),
    Key("PLANNED_HOURS", "", number(0, positive=True)),
    Key("BUDGET_POLL_SECONDS", "300", number(0, positive=True)),
    # the budget contract
    Key("BUDGET_CAP_USD", "35", number(0, positive=True)),
    Key("BUDGET_ALERT_USD", "30", number(0)),
    Key("MAX_PRICE_USD_PER_HR", "1.40", number(0, positive=True)),
    # the trainer
    Key("X1_CONFIG", "configs/x1-50m-a100.yaml"),
    Key("TOTAL_STEPS", "84000", whole(1)),
    Key("CKPT_EVERY", "1800", whole(1)),
    Key("EVAL_EVERY", "1800", whole(1)),
    Key("LOG_EVERY", "10", whole(1)),
    Key("NPROC", "1", whole(1)),
    Key("NNODES", "1", whole(1)),
    Key("RDZV_ENDPOINT", "", host_port),
    Key("RDZV_ID", ""),
    Key("RDZV_JOIN_TIMEOUT", "600", whole(1)),
    Key("X1_SHARED", "", stack=False),
    Key("TRAIN_EXTRA_ARGS", ""),
    Key("LADDER", "0", zero_or_one),
    Key("LADDER_SHARE", "0.05", number(0, positive=True)),
    Key("TRAINER_SHM_SIZE", "16gb", pattern(r"\d+(\.\d+)?[bkmgBKMG]?[bB]?", "a size such as 16gb"), stack=False),
    Key("TORCH_VERSION", "2.11.0", pattern(r"\d+\.\d+(\.\d+)?", "a torch release such as 2.11.0"), stack=False),
    # none: torch's CPU build (trainer/torch_pin.py --cuda none), for an image built on a CPU-only host.
    Key("TORCH_CUDA", "13.0", pattern(r"\d+\.\d+|none", "a CUDA version such as 13.0, or none for torch's CPU build"),
        stack=False),
    Key("PYTHON_IMAGE", "python:3.11.11-slim-bookworm", stack=False),
    Key("BUILD_CA_BUNDLE", "", stack=False),
    Key("TRAINER_FLOAT8", "0", zero_or_one, stack=False),
    Key("TRAINER_CONTAINER_NAME", "x1-trainer", pattern(r"[a-zA-Z0-9][a-zA-Z0-9_.-]*", "a container name")),
    # the watchdog
    Key("DOCKER_GID", "999", whole(0), stack=False),
    Key("STALL_SECONDS", "600", number(0)),
    Key("STARTUP_GRACE_SECONDS", "600", number(0)),
    Key("MAX_RESTARTS", "10", whole(0)),
    Key("RESTART_WINDOW_SECONDS", "3600", number(0)),
    Key("TERMINATE_ON_FINISH", "0", zero_or_one),
    Key("RESULTS_DIR", ""),
    # alerts
    Key("SLACK_WEBHOOK_URL", ""),
    Key("SMTP_HOST", ""),
    Key("SMTP_PORT", "", port),
    Key("SMTP_USER", ""),
    Key("SMTP_PASSWORD", ""),
    Key("SMTP_FROM", ""),
    Key("SMTP_TO", ""),
    Key("SMTP_STARTTLS", "", flag),
    # data
    Key("HF_TOKEN", ""),
    Key("DATA_SOURCE", "fineweb-edu", choice("fineweb-edu", "fineweb-edu-100bt", "pile-cc")),
    Key("DATA_MAX_SHARDS", "0", whole(0)),
    Key("TOKENIZE_WORKERS", "16", whole(1)),
    Key("VAL_FRACTION", "0.001", number(0, positive=True)),
    # MLflow
    Key("MLFLOW_WORKERS", "2", whole(1)),
    # storage
    Key("X1_WORKSPACE", "", stack=False),
    # published ports (the process stack: the ports the services listen on)
    Key("MLFLOW_HOST_PORT", "5000", port),
    Key("SIDECAR_HOST_PORT", "9792", port),
    Key("TRAINER_METRICS_HOST_PORT", "9791", port),
    Key("WATCHDOG_METRICS_HOST_PORT", "9793", port),
    Key("PROMETHEUS_HOST_PORT", "9090", port),
    Key("GRAFANA_HOST_PORT", "3000", port, stack=False),
    # Grafana
    Key("GF_SECURITY_ADMIN_USER", "admin", stack=False),
    Key("GF_SECURITY_ADMIN_PASSWORD", "", stack=False),
    # compose's settings check: the file it reads when it is not ./.env
    Key("X1_ENV_FILE", "", stack=False),
)}

# Keys X1 once read and no longer does: a warning naming what took their place, not an error
# (an old .env must not stop a run over a key that no longer matters).
RETIRED: dict[str, str] = {
    "NGC_PYTORCH_TAG": "the trainer image no longer starts from an NGC image: it installs torch from PyPI on "
                       "PYTHON_IMAGE, the release and CUDA set by TORCH_VERSION and TORCH_CUDA",
}

# Compose's own variables, read by compose from .env: left to it.
COMPOSE_PREFIX = "COMPOSE_"


# ---------------------------------------------------------------------------------------------
# Reading a .env file, as compose reads it

_KEY = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_SHOWN_KEY = re.compile(r"([A-Z_][A-Z0-9_]*)[:\s]")


def read_env_file(path: str | os.PathLike[str]) -> dict[str, str]:
    """KEY=VALUE lines as compose reads them: comments, blank lines, `export `, quotes.

    Interpolation inside .env (`A=${B}`) is refused rather than read differently from compose.
    """
    path = Path(path)
    try:
        content = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise EnvFileError(f"{path}: no such file (cp .env.example {path})") from None
    except (OSError, UnicodeDecodeError) as e:
        raise EnvFileError(f"{path}: cannot read it ({e})") from None
    values: dict[str, str] = {}
    for line_no, raw in enumerate(content.splitlines(), start=1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        line = line.removeprefix("export ").lstrip()
        key, sep, value = line.partition("=")
        key = key.strip()
        if not sep or not _KEY.fullmatch(key):
            # Named by its key, never quoted: a malformed line is often a secret typed wrong.
            # Only an upper-case name followed by ':' or a space reads as the key: the start of a
            # token pasted on its own line (a lone word, `sk-...`) is the secret and is not named.
            start = _SHOWN_KEY.match(line)
            named = f"the line starting with {start.group(1)!r}" if start else "a line that starts with no KEY"
            raise EnvFileError(f"{path}:{line_no}: not KEY=VALUE: {named} (its value is not shown)")
        value = value.strip()
        if len(value) >= 2 and value[0] == value[-1] and value[0] in "'\"":
            quote, value = value[0], value[1:-1]
            if quote == '"':
                value = value.replace("\\n", "\n").replace('\\"', '"').replace("\\\\", "\\")
        else:
            value = re.split(r"\s+#", value, maxsplit=1)[0].rstrip()
            if value[:1] in ("'", '"'):
                raise EnvFileError(f"{path}:{line_no}: {key}: unbalanced quote")
            if "${" in value or re.search(r"\$[A-Za-z_]", value):
                raise EnvFileError(f"{path}:{line_no}: {key}: variable references in .env are not supported here; "
                                   "write the value out")
        values[key] = value
    return values


# ---------------------------------------------------------------------------------------------
# The check


def nearest_key(name: str) -> str | None:
    """The known key `name` was most likely meant to be: the same letters in another case, the
    known key it begins (BUDGET_CAP -> BUDGET_CAP_USD), else the closest spelling."""
    upper = name.upper()
    if upper in KEYS:
        return upper
    extended = [k for k in KEYS if k.startswith(upper + "_") or k.startswith(upper)]
    if len(extended) == 1:
        return extended[0]
    close = difflib.get_close_matches(upper, list(KEYS), n=1, cutoff=0.6)
    return close[0] if close else None


def key_problems(keys: Iterable[str]) -> tuple[list[str], list[str]]:
    """(errors, warnings) for the keys of a .env: unknown ones, retired ones."""
    errors, warnings = [], []
    for key in keys:
        if key in KEYS or key.startswith(COMPOSE_PREFIX):
            continue
        if key in RETIRED:
            warnings.append(f"{key} is no longer read: {RETIRED[key]}")
            continue
        near = nearest_key(key)
        hint = f"did you mean {near}?" if near else "no known key is close"
        errors.append(f"{key} is not a setting X1 reads ({hint} .env.example lists every one)")
    return errors, warnings


def value_problems(values: Mapping[str, str]) -> list[str]:
    """What is wrong with the values of known keys (an empty value is unset: the default holds)."""
    problems = []
    for name, value in values.items():
        key = KEYS.get(name)
        if key is None or value == "":
            continue
        wrong = key.check(value)
        if wrong:  # secrets have no type (text): a value quoted here is never one
            problems.append(f"{name}={value!r} {wrong}")
    return problems


def load_env_file(path: str | os.PathLike[str]) -> tuple[dict[str, str], list[str]]:
    """The file's values and its warnings; EnvFileError naming every unknown key (with the nearest
    known one) and every value of the wrong type."""
    values = read_env_file(path)
    errors, warnings = key_problems(values)
    errors += value_problems(values)
    if errors:
        raise EnvFileError(f"{path}: " + "; ".join(errors))
    return values, warnings


USAGE = """usage: python -m x1_common.envfile ENV_FILE

Checks a .env: every key one X1 reads (for one it does not, the nearest it does is named), every
value of the right type; a key X1 no longer reads is a warning naming what replaced it. Exit 0
when the file can be used, 2 when not."""


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if args[:1] in (["-h"], ["--help"]):
        print(USAGE)
        return 0
    if len(args) != 1:
        print(USAGE, file=sys.stderr)
        return 2
    try:
        values, warnings = load_env_file(args[0])
    except EnvFileError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    for warning in warnings:
        print(f"warning: {args[0]}: {warning}", file=sys.stderr)
    known = sum(1 for key in values if key in KEYS)
    print(f"{args[0]}: {known} settings X1 reads, each of the right type"
          + (f"; {len(values) - known} other{'s' if len(values) - known > 1 else ''} (compose's own, or no longer "
             "read)" if known < len(values) else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
