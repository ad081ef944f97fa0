"""Each X1 service's command line and environment, from the .env settings: the one definition
behind compose.yaml and the process runner (`python -m x1_pretrain.stack`).

    settings = Settings.load(".env")                     # .env, overridden by the shell, as compose does
    services(settings, COMPOSE)["trainer"].argv          # what compose.yaml's trainer runs
    services(settings, process_mode("/workspace", ...))  # what the runner starts on a host without Docker

compose.yaml keeps its commands written out, since it is the file people read; the test
tests/test_stack_compose.py renders these definitions in compose mode for several .env files and
compares them, argv, environment, published port and health URL, with compose.yaml as compose
reads it, so neither side can change alone. What differs between the two modes is a parameter
(`Mode`), never a second copy:

    parameter         compose                                 process
    ---------         -------                                 -------
    workspace         /workspace (the volume)                 the --workspace folder
    bind host         0.0.0.0 (inside the container,          127.0.0.1 (a pod's 0.0.0.0 is the internet;
                      published on 127.0.0.1 only)            MLflow and the sidecar have no auth)
    ports, peers      fixed container ports, service names    the *_HOST_PORT ports of .env, 127.0.0.1
    programs          the images' (x1-train, mlflow, python)  trainer/entrypoint.sh, this interpreter
    supervision       watchdog --mode docker --container      watchdog --mode process -- <trainer>

Standard library only: every image and the runner import it.
"""

from __future__ import annotations

import os
import posixpath
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from x1_common.envfile import KEYS, EnvFileError
from x1_common.envfile import load_env_file as load_env_file  # re-exported: the launcher reads .env through here
from x1_common.envfile import read_env_file as read_env_file

# compose.yaml's defaults (`${VAR:-default}`), for every variable the services read: the keys of
# x1_common.envfile (the one list of .env's keys, their defaults and types) that are not compose's
# own (the image builds, Grafana, the Docker group). Empty means unset, as for compose's `:-`.
# Secrets default to empty and stay out of every command line.
DEFAULTS: dict[str, str] = {k.name: k.default for k in KEYS.values() if k.stack}

ALERT_VARS = ("SLACK_WEBHOOK_URL", "SMTP_HOST", "SMTP_PORT", "SMTP_USER", "SMTP_PASSWORD", "SMTP_FROM", "SMTP_TO",
              "SMTP_STARTTLS")

# service -> (its port inside the container, the .env variable of the host port it is published on)
PORTS: dict[str, tuple[int, str]] = {
    "mlflow-server": (5000, "MLFLOW_HOST_PORT"),
    "budget-sidecar": (9792, "SIDECAR_HOST_PORT"),
    "trainer": (9791, "TRAINER_METRICS_HOST_PORT"),
    "watchdog": (9793, "WATCHDOG_METRICS_HOST_PORT"),
    "prometheus": (9090, "PROMETHEUS_HOST_PORT"),
}

# The order services start in (compose's depends_on: the trainer waits for a healthy MLflow and
# sidecar; the watchdog starts the trainer). They stop in the reverse order, the trainer first.
START_ORDER = ("prometheus", "mlflow-server", "budget-sidecar", "watchdog")


# A .env file that cannot be used (x1_common.envfile): the message names the file and the line or key.
SettingsError = EnvFileError

@dataclass(frozen=True)
class Settings:
    """The values compose.yaml interpolates: .env, then the shell's environment over it (compose's
    precedence), then compose's defaults for what is empty or unset."""

    values: Mapping[str, str] = field(default_factory=dict)
    warnings: tuple[str, ...] = ()  # about the .env file: keys X1 no longer reads

    @classmethod
    def load(cls, env_file: str | os.PathLike[str] | None, environ: Mapping[str, str] | None = None) -> Settings:
        """SettingsError naming every key of `env_file` X1 does not read (and the nearest it does)."""
        values, warnings = load_env_file(env_file) if env_file is not None else ({}, [])
        environ = os.environ if environ is None else environ
        for key in DEFAULTS:
            if key in environ:
                values[key] = environ[key]
        return cls(values, tuple(warnings))

    def __getitem__(self, key: str) -> str:
        if key not in DEFAULTS:
            raise KeyError(f"{key} is not a setting compose.yaml reads")
        return self.values.get(key) or DEFAULTS[key]

    def port(self, service: str) -> int:
        return int(self[PORTS[service][1]])


# ---------------------------------------------------------------------------------------------
# The mode: where the definition differs, as parameters


@dataclass(frozen=True)
class Mode:
    name: str  # "compose" or "process"
    workspace: str  # /workspace, or the folder the runner was given
    bind_host: str  # where servers listen
    python: str  # the interpreter that runs the Python services
    repo: str  # where configs/ and trainer/entrypoint.sh are (the images' working directory: /opt/x1)
    prometheus: str = "prometheus"  # the Prometheus binary

    @property
    def compose(self) -> bool:
        return self.name == "compose"

    def ws(self, *parts: str) -> str:
        return posixpath.join(self.workspace, *parts)

    def port(self, service: str, settings: Settings) -> int:
        """The port `service` listens on: its container port, or as a process the host port of .env."""
        return PORTS[service][0] if self.compose else settings.port(service)

    def peer(self, service: str, settings: Settings) -> str:
        """host:port at which the other services reach `service`."""
        host = service if self.compose else "127.0.0.1"
        return f"{host}:{self.port(service, settings)}"

    def program(self, name: str) -> list[str]:
        if self.compose:
            return [name]
        return {
            # The image's launcher (torchrun when NPROC > 1, the per-rank exit codes) as a script.
            "x1-train": ["bash", f"{self.repo}/trainer/entrypoint.sh"],
            "python": [self.python],
            "mlflow": [self.python, "-m", "mlflow"],
            "prometheus": [self.prometheus],
        }[name]


COMPOSE = Mode("compose", workspace="/workspace", bind_host="0.0.0.0", python="python", repo="/opt/x1")


def process_mode(workspace: str | os.PathLike[str], python: str, repo: str | os.PathLike[str],
                 prometheus: str = "prometheus") -> Mode:
    return Mode("process", workspace=str(Path(workspace).resolve()), bind_host="127.0.0.1", python=python,
                repo=str(Path(repo).resolve()), prometheus=prometheus)


@dataclass(frozen=True)
class Service:
    """One service as it runs: its command line, its environment (compose's `environment:`, secrets
    included: for the child only, never logged), where it listens and how it says it is healthy."""

    name: str
    argv: list[str]
    env: dict[str, str]
    port: int | None = None
    health_path: str | None = None  # HTTP path answering 2xx when healthy; None: no HTTP check
    image_env: dict[str, str] = field(default_factory=dict)  # set by the image's ENV (process mode supplies it)


# ---------------------------------------------------------------------------------------------
# The definitions


def trainer(s: Settings, m: Mode) -> Service:
    # The lab's command; x1-train adds torchrun when NPROC > 1 and appends X1_TRAIN_EXTRA_ARGS.
    argv = [
        *m.program("x1-train"),
        f"--config={s['X1_CONFIG']}",
        f"--data-dir={m.ws('data', 'tokenized')}",
        f"--ckpt-dir={m.ws('checkpoints')}",
        f"--mlflow-uri=http://{m.peer('mlflow-server', s)}",
        f"--total-steps={s['TOTAL_STEPS']}",
        f"--ckpt-every={s['CKPT_EVERY']}",
        f"--eval-every={s['EVAL_EVERY']}",
        f"--log-every={s['LOG_EVERY']}",
        "--resume-from-latest",
        f"--budget-cap-usd={s['BUDGET_CAP_USD']}",
        f"--budget-alert-usd={s['BUDGET_ALERT_USD']}",
        f"--max-price-usd-per-hr={s['MAX_PRICE_USD_PER_HR']}",
        f"--budget-curr-cost-uri={m.ws('budget.json')}",
        f"--metrics-port={m.port('trainer', s)}",
        f"--metrics-host={m.bind_host}",
        f"--heartbeat-file={m.ws('logs', 'heartbeat.json')}",
        # After a final exit: export, post-mortem draft and dod into the run folder on the volume,
        # before a terminating watchdog ends the instance (it adds termination.json there).
        f"--run-dir={m.ws('run')}",
    ]
    env = {
        "NPROC": s["NPROC"],
        # Several hosts: torchrun's c10d rendezvous (trainer/entrypoint.sh)
        "NNODES": s["NNODES"],
        "RDZV_ENDPOINT": s["RDZV_ENDPOINT"],
        "RDZV_ID": s["RDZV_ID"],
        "RDZV_JOIN_TIMEOUT": s["RDZV_JOIN_TIMEOUT"],
        "X1_TRAIN_EXTRA_ARGS": s["TRAIN_EXTRA_ARGS"],
        # The scaling ladder before the main run (trainer/entrypoint.sh, x1_pretrain.ladder step)
        "X1_LADDER": s["LADDER"],
        "X1_LADDER_SHARE": s["LADDER_SHARE"],
        "X1_LADDER_DIR": m.ws("ladder"),
        # torch.compile's caches on the volume: a relaunch after a preemption recompiles from cache.
        "TORCHINDUCTOR_CACHE_DIR": m.ws("cache", "inductor"),
        "TRITON_CACHE_DIR": m.ws("cache", "triton"),
        # The matmul algorithms timed at the first start: a relaunch runs the same ones, untimed.
        "X1_CUBLASLT_CACHE": m.ws("cache", "cublaslt.json"),
        **{k: s[k] for k in ALERT_VARS},
    }
    image_env = {"PYTHONUNBUFFERED": "1"} if m.compose else {"PYTHONUNBUFFERED": "1", "X1_PYTHON": m.python}
    return Service("trainer", argv, env, port=m.port("trainer", s), image_env=image_env)


def budget_sidecar(s: Settings, m: Mode) -> Service:
    argv = [
        *m.program("python"), "-m", "budget_sidecar",
        # Several hosts: INSTANCE_IDS (below: the last --instance-id counts) lists every host's id,
        # INSTANCE_ID stays this host's own, for its watchdog; a static rate is counted NNODES times.
        "--provider", s["PROVIDER"], "--instance-id", s["INSTANCE_ID"], "--nodes", s["NNODES"],
        "--poll-seconds", s["BUDGET_POLL_SECONDS"], "--output", m.ws("budget.json"),
        "--cap-usd", s["BUDGET_CAP_USD"], "--alert-usd", s["BUDGET_ALERT_USD"],
        "--host", m.bind_host, "--port", str(m.port("budget-sidecar", s)),
    ]
    # Optional flags only when their variable is set (compose: a shell's ${VAR:+...}).
    for var, flag in (("INSTANCE_IDS", "--instance-id"), ("PROVIDER_API_URL", "--api-url"), ("PLANNED_HOURS", "--planned-hours"),
                      ("RATE_USD_PER_HR", "--rate-usd-per-hr")):
        if s[var]:
            argv += [flag, s[var]]
    env = {k: s[k] for k in ("LAMBDA_API_KEY", "RUNPOD_API_KEY", "PROVIDER", "PROVIDER_API_URL", "INSTANCE_ID",
                             "INSTANCE_IDS", "NNODES", "BUDGET_POLL_SECONDS", "BUDGET_CAP_USD", "BUDGET_ALERT_USD", "PLANNED_HOURS",
                             "RATE_USD_PER_HR")}
    return Service("budget-sidecar", argv, env, port=m.port("budget-sidecar", s), health_path="/healthz",
                   image_env={"PYTHONUNBUFFERED": "1"})


def watchdog(s: Settings, m: Mode) -> Service:
    if m.compose:
        supervision = ["--mode", "docker", "--container", s["TRAINER_CONTAINER_NAME"]]
    else:
        supervision = ["--mode", "process", "--trainer-log", m.ws("logs", "trainer.log")]
    argv = [
        *m.program("python"), "-m", "x1_watchdog", *supervision,
        "--heartbeat-file", m.ws("logs", "heartbeat.json"),
        "--stall-seconds", s["STALL_SECONDS"], "--startup-grace-seconds", s["STARTUP_GRACE_SECONDS"],
        "--max-restarts", s["MAX_RESTARTS"], "--restart-window-seconds", s["RESTART_WINDOW_SECONDS"],
        "--events-file", m.ws("logs", "watchdog-events.jsonl"),
        "--state-file", m.ws("logs", "watchdog-state.json"),
        # The plan's total: a budget stop of another total is set aside for this re-plan.
        "--total-steps", s["TOTAL_STEPS"],
        # After a final decision it stays up instead of exiting into compose's restart loop.
        "--port", str(m.port("watchdog", s)), "--metrics-host", m.bind_host, "--hold-after-final",
    ]
    if s["TERMINATE_ON_FINISH"] == "1":
        argv += ["--terminate-on-finish", "--provider", s["PROVIDER"], "--instance-id", s["INSTANCE_ID"],
                 "--termination-file", m.ws("logs", "termination.json"), "--run-dir", m.ws("run")]
        if s["RESULTS_DIR"]:  # compose mounts it at /results
            argv += ["--keep-run-dir", "/results" if m.compose else s["RESULTS_DIR"]]
        if s["PROVIDER_API_URL"]:
            argv += ["--api-url", s["PROVIDER_API_URL"]]
    env = {
        "TRAINER_CONTAINER_NAME": s["TRAINER_CONTAINER_NAME"],
        **{k: s[k] for k in ("TOTAL_STEPS", "STALL_SECONDS", "STARTUP_GRACE_SECONDS", "MAX_RESTARTS", "RESTART_WINDOW_SECONDS",
                             "TERMINATE_ON_FINISH", "RESULTS_DIR", "PROVIDER", "PROVIDER_API_URL", "INSTANCE_ID",
                             # used only to terminate the instance at the end (TERMINATE_ON_FINISH=1)
                             "LAMBDA_API_KEY", "RUNPOD_API_KEY")},
        **{k: s[k] for k in ALERT_VARS},  # give-up and budget-stop alerts
    }
    return Service("watchdog", argv, env, port=m.port("watchdog", s), health_path="/metrics",
                   image_env={"PYTHONUNBUFFERED": "1"})


def mlflow_server(s: Settings, m: Mode) -> Service:
    port = m.port("mlflow-server", s)
    # --allowed-hosts: MLflow refuses Host headers it does not know (DNS-rebinding protection);
    # under compose the trainer calls it by its service name.
    names = ["mlflow-server", f"mlflow-server:{port}"] if m.compose else []
    argv = [
        *m.program("mlflow"), "server",
        f"--backend-store-uri=sqlite:///{m.ws('mlruns', 'mlflow.db')}",
        f"--artifacts-destination={m.ws('mlruns', 'artifacts')}",
        f"--host={m.bind_host}",
        f"--port={port}",
        f"--workers={s['MLFLOW_WORKERS']}",
        "--allowed-hosts=" + ",".join([*names, "localhost", "localhost:*", "127.0.0.1", "127.0.0.1:*"]),
    ]
    # The image's ENV: MLflow 3's job runner (GenAI jobs) is unused and costs ~200 MB per worker.
    return Service("mlflow-server", argv, {}, port=port, health_path="/health",
                   image_env={"PYTHONUNBUFFERED": "1", "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"})


def prometheus(s: Settings, m: Mode) -> Service:
    port = m.port("prometheus", s)
    # The image's own config scrapes the service names; the runner writes one for 127.0.0.1.
    config = "/etc/prometheus/prometheus.yml" if m.compose else m.ws("prometheus", "prometheus.yml")
    argv = [
        *m.program("prometheus"),
        f"--config.file={config}",
        f"--storage.tsdb.path={'/prometheus' if m.compose else m.ws('prometheus', 'data')}",
        "--storage.tsdb.retention.time=30d",
        f"--web.listen-address={m.bind_host}:{port}",
    ]
    return Service("prometheus", argv, {}, port=port, health_path="/-/ready")


def prepare(s: Settings, m: Mode) -> Service:
    """One shot: download + tokenize into WS/data (`docker compose run --rm prepare`)."""
    argv = [
        *m.program("python"), "-m", "x1_pretrain.prepare",
        f"--output-dir={m.ws('data')}",
        f"--source={s['DATA_SOURCE']}",
        f"--max-shards={s['DATA_MAX_SHARDS']}",
        f"--workers={s['TOKENIZE_WORKERS']}",
        f"--val-fraction={s['VAL_FRACTION']}",
    ]
    env = {"HF_TOKEN": s["HF_TOKEN"], "HF_HOME": m.ws("cache", "huggingface")}
    return Service("prepare", argv, env, image_env={"PYTHONUNBUFFERED": "1"})


DEFINITIONS = {
    "trainer": trainer,
    "budget-sidecar": budget_sidecar,
    "watchdog": watchdog,
    "mlflow-server": mlflow_server,
    "prometheus": prometheus,
    "prepare": prepare,
}


def services(settings: Settings, mode: Mode) -> dict[str, Service]:
    """Every service, as `mode` runs it.

    In process mode the watchdog runs the trainer as its child: its command line ends with
    `-- <trainer>`, and the trainer's environment is compose's trainer environment exactly, the
    watchdog's own variables (the provider's API keys among them) removed with `env -u`.
    """
    out = {name: define(settings, mode) for name, define in DEFINITIONS.items()}
    if not mode.compose:
        t, w = out["trainer"], out["watchdog"]
        drop = sorted(set(w.env) - set(t.env) - set(t.image_env))
        child = ["env", *[arg for key in drop for arg in ("-u", key)], *t.argv]
        out["watchdog"] = Service(w.name, [*w.argv, "--", *child], {**w.env, **t.env, **t.image_env}, w.port,
                                  w.health_path, w.image_env)
    return out
