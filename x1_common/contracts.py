"""The contracts every X1 service shares: trainer exit codes, the budget.json schema, the
heartbeat file, metric names and default ports.

Standard library only: the watchdog and the sidecar import this without torch, and a reader in
any language can follow it. Change a value here and every service changes with it.
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from enum import IntEnum
from pathlib import Path
from typing import Any

# --------------------------------------------------------------------------------------------
# Exit codes of the trainer (SPEC §3). The watchdog acts on them; compose and scripts see them.


class ExitCode(IntEnum):
    FINISHED = 0  # total steps reached, final artifacts written
    USAGE = 2  # bad config / usage / data: a person must fix something
    PREEMPTED = 75  # SIGTERM/SIGINT: emergency checkpoint written, relaunch
    BUDGET_PROJECTED = 76  # projected total > cap: clean checkpoint, stop
    BUDGET_SPENT = 77  # spent > cap: exit at once, no checkpoint write
    LAUNCH_REFUSED = 78  # pre-launch check refused (price, projection, no reading)
    DIVERGED = 79  # too many non-finite steps in a row


# Codes after which nobody relaunches the trainer. Anything else (75, a crash, a kill) relaunches.
FINAL_EXIT_CODES = frozenset(
    {
        ExitCode.FINISHED,
        ExitCode.USAGE,
        ExitCode.BUDGET_PROJECTED,
        ExitCode.BUDGET_SPENT,
        ExitCode.LAUNCH_REFUSED,
        ExitCode.DIVERGED,
    }
)

# The manifest's `end` field and the watchdog's events speak these words.
END_REASONS = {
    ExitCode.FINISHED: "finished",
    ExitCode.USAGE: "bad-config",
    ExitCode.PREEMPTED: "preempted",
    ExitCode.BUDGET_PROJECTED: "budget-stop",
    ExitCode.BUDGET_SPENT: "budget-overspent",
    ExitCode.LAUNCH_REFUSED: "launch-refused",
    ExitCode.DIVERGED: "diverged",
}


def should_relaunch(code: int | None) -> bool:
    """True for a preemption (75), a crash (any other code) or a kill (None / negative)."""
    return code is None or code not in FINAL_EXIT_CODES


def end_reason(code: int | None) -> str:
    if code is None or code < 0:
        return "killed"
    try:
        return END_REASONS[ExitCode(code)]
    except ValueError:
        return "crashed"


# --------------------------------------------------------------------------------------------
# Default ports (SPEC §3): away from node_exporter's 9100 and DCGM's 9400. 0 disables.

TRAINER_METRICS_PORT = 9791
SIDECAR_PORT = 9792
WATCHDOG_METRICS_PORT = 9793

# --------------------------------------------------------------------------------------------
# budget.json (SPEC §6). Readers need only the seed's five keys; the rest are informative.

BUDGET_REQUIRED_KEYS = (
    "spent_usd",
    "rate_usd_per_hr",
    "hours_elapsed",
    "projected_total_usd",
    "last_update_utc",
)


class BudgetFormatError(ValueError):
    """A budget reading that cannot be trusted; the message names the key."""


def utc_now() -> datetime:
    return datetime.now(timezone.utc)


def format_utc(t: datetime) -> str:
    return t.astimezone(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def parse_utc(text: str) -> datetime:
    t = datetime.fromisoformat(text.replace("Z", "+00:00"))  # 3.10's fromisoformat lacks "Z"
    if t.tzinfo is None:
        raise ValueError(f"timestamp {text!r} has no timezone")
    return t.astimezone(timezone.utc)


@dataclass(frozen=True)
class BudgetReading:
    spent_usd: float
    rate_usd_per_hr: float
    hours_elapsed: float
    projected_total_usd: float
    last_update_utc: datetime
    cap_usd: float | None = None
    provider: str | None = None
    instance_id: str | None = None
    source: str | None = None  # "provider-api" or "estimate"
    stale: bool = False

    @classmethod
    def from_dict(cls, data: Any) -> BudgetReading:
        if not isinstance(data, dict):
            raise BudgetFormatError(f"budget reading must be a JSON object, got {type(data).__name__}")
        missing = [k for k in BUDGET_REQUIRED_KEYS if k not in data]
        if missing:
            raise BudgetFormatError(f"budget reading lacks {', '.join(missing)}")
        numbers = {}
        for key in BUDGET_REQUIRED_KEYS[:4]:
            value = data[key]
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise BudgetFormatError(f"budget reading: {key} must be a number, got {value!r}")
            if not math.isfinite(value) or value < 0:
                raise BudgetFormatError(f"budget reading: {key} must be finite and >= 0, got {value!r}")
            numbers[key] = float(value)
        try:
            updated = parse_utc(str(data["last_update_utc"]))
        except ValueError as e:
            raise BudgetFormatError(f"budget reading: last_update_utc is not an ISO-8601 UTC time: {e}") from e
        cap = data.get("cap_usd")
        return cls(
            **numbers,
            last_update_utc=updated,
            cap_usd=float(cap) if isinstance(cap, (int, float)) and not isinstance(cap, bool) else None,
            provider=data.get("provider"),
            instance_id=data.get("instance_id"),
            source=data.get("source"),
            stale=bool(data.get("stale", False)),
        )

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["last_update_utc"] = format_utc(self.last_update_utc)
        return d

    def age_seconds(self, now: datetime | None = None) -> float:
        return max(0.0, ((now or utc_now()) - self.last_update_utc).total_seconds())

    def extrapolated_spent_usd(self, now: datetime | None = None) -> float:
        """What has been spent by `now` if the meter kept running at the last known rate.

        A reading is a lower bound the moment it is written: judging it raw would let an old
        file, or a sidecar that died, hide spend.
        """
        return self.spent_usd + self.rate_usd_per_hr * self.age_seconds(now) / 3600.0

    def extrapolated_projected_total_usd(self, now: datetime | None = None) -> float:
        # The projection already counts the remaining hours at the same rate; it can only be
        # overtaken by the spend itself (a run that outlives its planned hours).
        return max(self.projected_total_usd, self.extrapolated_spent_usd(now))


def read_budget_file(path: str | os.PathLike[str]) -> BudgetReading:
    with open(path, encoding="utf-8") as f:
        try:
            data = json.load(f)
        except json.JSONDecodeError as e:
            raise BudgetFormatError(f"{path}: not JSON ({e})") from e
    return BudgetReading.from_dict(data)


# --------------------------------------------------------------------------------------------
# Heartbeat (trainer → watchdog): {"step", "time", "pid", "phase"}, rewritten atomically.

HEARTBEAT_PHASES = ("startup", "compiling", "training", "checkpointing", "finished")


@dataclass(frozen=True)
class Heartbeat:
    step: int
    time: float  # unix seconds
    pid: int
    phase: str

    @classmethod
    def read(cls, path: str | os.PathLike[str]) -> Heartbeat | None:
        """The last heartbeat, or None when there is none (or it is unreadable)."""
        try:
            d = json.loads(Path(path).read_text(encoding="utf-8"))
            return cls(step=int(d["step"]), time=float(d["time"]), pid=int(d["pid"]), phase=str(d["phase"]))
        except (OSError, ValueError, KeyError, TypeError):
            return None


# --------------------------------------------------------------------------------------------
# Metric names. Prometheus names carry the unit; MLflow names are the seed's short ones.

# Trainer, Prometheus (port 9791)
M_TRAIN_STEP = "x1_train_step"
M_TRAIN_TOKENS = "x1_train_tokens"  # counter: exported as x1_train_tokens_total
M_TRAIN_TOKENS_PER_SECOND = "x1_train_tokens_per_second"
M_TRAIN_MFU = "x1_train_mfu_ratio"
M_TRAIN_LOSS = "x1_train_loss"
M_TRAIN_VAL_LOSS = "x1_train_val_loss"
M_TRAIN_GRAD_NORM = "x1_train_grad_norm"
M_TRAIN_LR = "x1_train_lr"
M_TRAIN_SPENT = "x1_train_budget_spent_usd"
M_CHECKPOINT_LAST_STEP = "x1_checkpoint_last_step"
M_CHECKPOINT_SAVE_SECONDS = "x1_checkpoint_save_seconds"

# Budget sidecar, Prometheus (port 9792)
M_BUDGET_SPENT = "x1_budget_spent_usd"
M_BUDGET_RATE = "x1_budget_rate_usd_per_hour"
M_BUDGET_PROJECTED = "x1_budget_projected_total_usd"
M_BUDGET_CAP = "x1_budget_cap_usd"
M_BUDGET_LAST_UPDATE = "x1_budget_last_update_timestamp_seconds"
M_BUDGET_POLL_FAILURES = "x1_budget_poll_failures"  # counter: x1_budget_poll_failures_total
M_BUDGET_STALE = "x1_budget_stale"
M_BUDGET_ALERT = "x1_budget_alert_usd"  # the alert line (SPEC §6: $30)

# Watchdog, Prometheus (port 9793)
M_WATCHDOG_RESTARTS = "x1_watchdog_restarts"  # counter with label reason: x1_watchdog_restarts_total
M_WATCHDOG_TRAINER_UP = "x1_watchdog_trainer_up"
M_WATCHDOG_DOWNTIME = "x1_watchdog_downtime_seconds"  # counter: x1_watchdog_downtime_seconds_total
M_WATCHDOG_HEALTHY = "x1_watchdog_healthy"  # 0 while it cannot reach its trainer (docker mode: the Engine API)
M_WATCHDOG_DOCKER_ENGINE = "x1_watchdog_docker_engine"  # info: x1_watchdog_docker_engine_info{api_version,...}

# Counters: prometheus_client exports them with a `_total` suffix.
COUNTER_METRICS = frozenset({M_TRAIN_TOKENS, M_BUDGET_POLL_FAILURES, M_WATCHDOG_RESTARTS, M_WATCHDOG_DOWNTIME})

# MLflow metric keys logged by the trainer (export_run and postmortem read these).
MLFLOW_TRAIN_METRICS = (
    "loss",
    "lr",
    "grad_norm",
    "param_norm",
    "tokens_per_sec",
    "mfu",
    "tokens_seen",
    "spent_usd",
)
MLFLOW_VAL_LOSS = "val_loss"
MLFLOW_SPIKE = "spike"  # 1.0 at a detected spike's step
MLFLOW_SPIKE_INJECTED = "spike_injected"  # 1.0 at each injected step
MLFLOW_NONFINITE = "nonfinite_step"  # 1.0 at a skipped (non-finite) step
MLFLOW_CLIPPED = "clipped"  # 1.0 when the grad norm was over the clip threshold
MLFLOW_RESTART = "restart"  # 1.0 at the step a resumed process starts from
MLFLOW_WALL_HOURS = "wall_hours"  # wall-clock hours since the run's first start (downtime included)
MLFLOW_TRAIN_HOURS = "train_hours"  # hours spent training, summed over restarts (eval, checkpoints excluded)

# Secrets: environment variables whose values never reach a log, a file or MLflow.
SECRET_ENV_VARS = (
    "LAMBDA_API_KEY",
    "RUNPOD_API_KEY",
    "BILLING_API_KEY",
    "SLACK_WEBHOOK_URL",
    "SMTP_PASSWORD",
    "HF_TOKEN",
    "HUGGING_FACE_HUB_TOKEN",
    "GF_SECURITY_ADMIN_PASSWORD",
    "MLFLOW_TRACKING_PASSWORD",
    "MLFLOW_TRACKING_TOKEN",
)


def secret_values(environ: dict[str, str] | None = None) -> list[str]:
    env = os.environ if environ is None else environ
    return [env[k] for k in SECRET_ENV_VARS if len(env.get(k, "")) >= 4]


def redact(text: str, environ: dict[str, str] | None = None) -> str:
    """`text` with every secret value from the environment replaced by ***."""
    for value in secret_values(environ):
        text = text.replace(value, "***")
    return text


# Keys whose values are secrets in records we keep (a Lambda instance record carries a
# jupyter_token and a jupyter_url that opens the instance).
_SECRET_KEY = re.compile(r"(^|_)(token|password|passwd|secret|api_?key|authorization)($|_)|^jupyter_url$", re.I)


def scrub_record(obj: Any) -> Any:
    """A JSON-like record with the values of secret-named keys masked and secret env values redacted."""
    if isinstance(obj, dict):
        return {k: "***" if _SECRET_KEY.search(str(k)) and v not in (None, "") else scrub_record(v)
                for k, v in obj.items()}
    if isinstance(obj, list):
        return [scrub_record(v) for v in obj]
    if isinstance(obj, str):
        return redact(obj)
    return obj
