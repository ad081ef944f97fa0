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
import stat
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from enum import IntEnum
from typing import Any

# --------------------------------------------------------------------------------------------
# Exit codes of the trainer (docs/DESIGN.md §3). The watchdog acts on them; compose and scripts see them.


class ExitCode(IntEnum):
    FINISHED = 0  # total steps reached, final artifacts written
    # The environment failed, not the input: a disk that refuses a write (full, over quota,
    # read-only), said in one line naming the path and the free space (x1_common.fsutil.disk_fault).
    # Every command's code for it; to the watchdog a crash like any other (relaunch with backoff).
    ENVIRONMENT = 1
    USAGE = 2  # bad config / usage / data: a person must fix something
    PREEMPTED = 75  # SIGTERM/SIGINT: emergency checkpoint written, relaunch
    BUDGET_PROJECTED = 76  # projected total > cap: clean checkpoint, stop
    BUDGET_SPENT = 77  # spent > cap: exit at once, no checkpoint write
    LAUNCH_REFUSED = 78  # pre-launch check refused (price, projection, no reading)
    DIVERGED = 79  # too many non-finite steps in a row
    FORECAST_STOP = 80  # asked for: the final-loss forecast's interval left the band; clean checkpoint, stop
    # The watchdog's, never the trainer's own: the trainer failed twice in a row with the same
    # error before completing its first step (a broken image, an incompatible torch, a bad
    # driver). Relaunching would only pay for the same start-up again: stop, alert.
    STARTUP_FAILED = 81
    # The watchdog's, never the trainer's own: --terminate-on-finish sent the terminate, and after
    # --terminate-confirm-seconds of reading back and sending again the provider still lists the
    # instance as not terminated. It is still billing: alerted, recorded, and a restarted watchdog
    # tries again.
    TERMINATE_UNCONFIRMED = 82


# The provider's own word for an instance that has ended, as its records show it, and Lambda's
# error code for an id it does not know (its error shape: {"error": {"code", "message"}}). Only
# these, read back after a terminate, prove an instance terminated (dod's check 6).
TERMINATED_RAW_STATUS = {"lambda": "terminated", "runpod": "TERMINATED"}
LAMBDA_NOT_FOUND_CODE = "global/object-does-not-exist"

# Codes after which nobody relaunches the trainer. Anything else (75, a crash, a kill) relaunches.
FINAL_EXIT_CODES = frozenset(
    {
        ExitCode.FINISHED,
        ExitCode.USAGE,
        ExitCode.BUDGET_PROJECTED,
        ExitCode.BUDGET_SPENT,
        ExitCode.LAUNCH_REFUSED,
        ExitCode.DIVERGED,
        ExitCode.FORECAST_STOP,
        ExitCode.STARTUP_FAILED,
    }
)

# The manifest's `end` field and the watchdog's events speak these words.
END_REASONS = {
    ExitCode.FINISHED: "finished",
    ExitCode.ENVIRONMENT: "crashed",  # exit 1 is also any uncaught error's: the watchdog cannot tell them apart
    ExitCode.USAGE: "bad-config",
    ExitCode.PREEMPTED: "preempted",
    ExitCode.BUDGET_PROJECTED: "budget-stop",
    ExitCode.BUDGET_SPENT: "budget-overspent",
    ExitCode.LAUNCH_REFUSED: "launch-refused",
    ExitCode.DIVERGED: "diverged",
    ExitCode.FORECAST_STOP: "forecast-stop",
    ExitCode.STARTUP_FAILED: "startup-failure",
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
# Default ports (docs/DESIGN.md §3): away from node_exporter's 9100 and DCGM's 9400. 0 disables.

TRAINER_METRICS_PORT = 9791
SIDECAR_PORT = 9792
WATCHDOG_METRICS_PORT = 9793

# --------------------------------------------------------------------------------------------
# budget.json (docs/DESIGN.md §6). Readers need only the lab's five keys; the rest are informative.

BUDGET_REQUIRED_KEYS = (
    "spent_usd",
    "rate_usd_per_hr",
    "hours_elapsed",
    "projected_total_usd",
    "last_update_utc",
)


class BudgetFormatError(ValueError):
    """A budget reading that cannot be trusted; the message names the key."""


# --------------------------------------------------------------------------------------------
# Reading a file another process writes (budget.json, the heartbeat, the watchdog's state, a
# checkpoint's markers, meta.json). Such a file can be torn, truncated, replaced by garbage or by
# something that is not a file at all; a reader must never crash on it nor hang on it.

MAX_JSON_FILE_BYTES = 64 << 20  # far over any file we write; a bigger one is not ours
CLOCK_SKEW_S = 120.0  # a time this far ahead of our clock is still "now" (two clocks of one host, rounding)


class UnreadableFileError(ValueError):
    """A file that exists but cannot be used: not a regular file, too big, not UTF-8, not JSON, a
    duplicated key or a non-finite number. The message names the file and the problem."""


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            # Our writers never repeat a key; json.loads would silently keep the last one.
            raise ValueError(f"key {key!r} appears twice")
        out[key] = value
    return out


def _finite_float(text: str) -> float:
    x = float(text)
    if not math.isfinite(x):  # 1e999 parses to inf
        raise ValueError(f"number {text} is out of range")
    return x


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


def parse_json_strict(text: str | bytes, what: str = "JSON", finite: bool = True) -> Any:
    """JSON with no duplicated key and (unless `finite` is False, for a reader that repairs such
    values itself) no NaN / Infinity nor a number that overflows to inf. UnreadableFileError (a
    ValueError) naming `what` otherwise."""
    numbers: dict[str, Any] = {"parse_float": _finite_float, "parse_constant": _no_constant} if finite else {}
    try:
        if isinstance(text, bytes):
            text = text.decode("utf-8")
        return json.loads(text, object_pairs_hook=_no_duplicates, **numbers)
    except UnicodeDecodeError as e:
        raise UnreadableFileError(f"{what}: not UTF-8 text (byte {e.object[e.start]:#04x} at offset {e.start})") from None
    except json.JSONDecodeError as e:
        raise UnreadableFileError(f"{what}: not JSON ({e})") from None
    except RecursionError:
        raise UnreadableFileError(f"{what}: JSON nested too deeply") from None
    except ValueError as e:
        raise UnreadableFileError(f"{what}: {e}") from None


def read_file_bytes(path: str | os.PathLike[str], max_bytes: int = MAX_JSON_FILE_BYTES) -> bytes:
    """The bytes of a regular file. FileNotFoundError when it is missing; UnreadableFileError for a
    folder, a FIFO, a socket or a device (opened without blocking, so a FIFO never hangs us), a
    file over `max_bytes`, or any other OS error."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    except FileNotFoundError:
        raise
    except OSError as e:
        raise UnreadableFileError(f"{path}: cannot open it ({e.strerror or e})") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise UnreadableFileError(f"{path}: not a regular file ({_file_kind(st.st_mode)})")
        if st.st_size > max_bytes:
            raise UnreadableFileError(f"{path}: {st.st_size} bytes, more than the {max_bytes} a file of ours holds")
        chunks, total = [], 0
        while True:
            block = os.read(fd, 1 << 20)
            if not block:
                break
            total += len(block)
            if total > max_bytes:
                raise UnreadableFileError(f"{path}: grew past {max_bytes} bytes while being read")
            chunks.append(block)
        return b"".join(chunks)
    except OSError as e:
        raise UnreadableFileError(f"{path}: cannot read it ({e.strerror or e})") from None
    finally:
        os.close(fd)


def _file_kind(mode: int) -> str:
    for test, word in ((stat.S_ISDIR, "a folder"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket"),
                       (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device")):
        if test(mode):
            return word
    return "not a plain file"


def read_json_file(path: str | os.PathLike[str], max_bytes: int = MAX_JSON_FILE_BYTES, finite: bool = True) -> Any:
    """The JSON value in `path`: FileNotFoundError when missing, UnreadableFileError for anything
    else that is wrong (see read_file_bytes, parse_json_strict). Never another exception."""
    return parse_json_strict(read_file_bytes(path, max_bytes), what=str(path), finite=finite)


def finite_number(value: Any) -> float | None:
    """A finite float from a JSON number (not a bool, not a string), else None."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    try:
        x = float(value)
    except OverflowError:  # an int too large for a float
        return None
    return x if math.isfinite(x) else None


def utc_now() -> datetime:
    return datetime.now(timezone.utc)


def format_utc(t: datetime) -> str:
    return t.astimezone(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def parse_utc(text: str) -> datetime:
    """An ISO-8601 time with a timezone, in UTC. ValueError (naming the text) for anything else."""
    if not isinstance(text, str):
        raise ValueError(f"timestamp {text!r} is not a string")
    try:
        t = datetime.fromisoformat(text.replace("Z", "+00:00"))  # 3.10's fromisoformat lacks "Z"
        if t.tzinfo is None:
            raise ValueError(f"timestamp {text!r} has no timezone")
        t = t.astimezone(timezone.utc)
        t.timestamp()  # years 1 and 9999 with an offset overflow here, not later in a reader
    except (OverflowError, OSError) as e:
        raise ValueError(f"timestamp {text!r} is out of range ({e})") from None
    return t


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
        """A reading from budget.json's document. Only the lab's five keys decide money; of the
        informative ones, a `stale` that is anything but false (or absent) counts as stale, and a
        value of the wrong type is dropped, never guessed."""
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
            x = finite_number(value)
            if x is None or x < 0:
                raise BudgetFormatError(f"budget reading: {key} must be finite and >= 0, got {value!r}")
            numbers[key] = x
        try:
            updated = parse_utc(data["last_update_utc"])
        except ValueError as e:
            raise BudgetFormatError(f"budget reading: last_update_utc is not an ISO-8601 UTC time: {e}") from e
        cap = finite_number(data.get("cap_usd"))

        def text(key: str) -> str | None:
            v = data.get(key)
            return v if isinstance(v, str) else None

        return cls(
            **numbers,
            last_update_utc=updated,
            cap_usd=cap if cap is not None and cap > 0 else None,
            provider=text("provider"),
            instance_id=text("instance_id"),
            source=text("source"),
            stale=data.get("stale") not in (False, None),
        )

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["last_update_utc"] = format_utc(self.last_update_utc)
        return d

    def age_seconds(self, now: datetime | None = None) -> float:
        """Seconds since the reading. A reading dated ahead of `now` by more than the clock skew
        has no trustworthy age: ValueError, so that no caller extrapolates it as fresh (the
        budget guard counts such a reading's age from when it first saw it)."""
        age = ((now or utc_now()) - self.last_update_utc).total_seconds()
        if age < -CLOCK_SKEW_S:
            raise ValueError(f"budget reading dated {-age:.0f} s in the future ({format_utc(self.last_update_utc)})")
        return max(0.0, age)

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
    """budget.json as a reading. FileNotFoundError when missing; BudgetFormatError (a ValueError)
    naming the file for anything else wrong with it."""
    try:
        # Non-finite numbers parse: from_dict refuses them in the contract's fields, and an
        # informative field must not make the whole reading unreadable.
        data = read_json_file(path, finite=False)
    except UnreadableFileError as e:
        raise BudgetFormatError(str(e)) from None
    try:
        return BudgetReading.from_dict(data)
    except BudgetFormatError as e:
        raise BudgetFormatError(f"{path}: {e}") from None


# --------------------------------------------------------------------------------------------
# Heartbeat (trainer → watchdog): {"step", "time", "pid", "phase"} (+ "signal_time" once stopped by
# SIGTERM), rewritten atomically. Also "mono" (and "signal_mono"): the same moments on the monotonic
# clock, which every process of one boot ("boot_id") shares and no step of the wall clock moves.

# The phases the trainer writes (train/), which the watchdog's policy and compose's healthcheck read.
PHASE_STARTUP = "startup"  # imports, data checks, the model built: before the first step
PHASE_COMPILING = "compiling"  # torch.compile's warm-up: minutes, on a first start
PHASE_TRAINING = "training"
PHASE_CHECKPOINTING = "checkpointing"
PHASE_FINISHED = "finished"  # total steps reached
PHASE_STOPPED = "stopped"  # any other exit (preempted, budget, forecast): the next start measures its downtime from it
HEARTBEAT_PHASES = (PHASE_STARTUP, PHASE_COMPILING, PHASE_TRAINING, PHASE_CHECKPOINTING, PHASE_FINISHED, PHASE_STOPPED)
# A trainer in these has not reached its loop yet: the watchdog gives it the start-up grace.
STARTUP_PHASES = (PHASE_STARTUP, PHASE_COMPILING)


@dataclass(frozen=True)
class Heartbeat:
    step: int
    time: float  # unix seconds
    pid: int
    phase: str
    signal_time: float | None = None  # phase "stopped" after a SIGTERM: when it came (a restart's downtime)
    mono: float | None = None  # `time` on the monotonic clock of boot `boot_id`
    signal_mono: float | None = None  # `signal_time` on it
    boot_id: str | None = None

    @classmethod
    def read(cls, path: str | os.PathLike[str]) -> Heartbeat | None:
        """The last heartbeat, or None when there is none or it is unusable: unreadable, not an
        object, a field missing or of the wrong type, a time that is not a finite number. A time
        in the future is returned as it is: the watchdog decides what such a beat is worth."""
        try:
            d = read_json_file(path, max_bytes=1 << 20)
        except (OSError, ValueError):
            return None
        if not isinstance(d, dict):
            return None
        step, pid, when, phase = d.get("step"), d.get("pid"), finite_number(d.get("time")), d.get("phase")
        if not (_plain_int(step) and _plain_int(pid) and when is not None and isinstance(phase, str)):
            return None
        boot = d.get("boot_id")
        return cls(step=step, time=when, pid=pid, phase=phase, signal_time=finite_number(d.get("signal_time")),
                   mono=finite_number(d.get("mono")), signal_mono=finite_number(d.get("signal_mono")),
                   boot_id=boot if isinstance(boot, str) else None)


def boot_id() -> str | None:
    """This kernel's boot id: shared by every process and container of the host, new after each
    reboot. Two monotonic times compare only under one boot id."""
    try:
        with open("/proc/sys/kernel/random/boot_id", encoding="ascii") as f:
            return f.read().strip() or None
    except OSError:
        return None


def _plain_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


# --------------------------------------------------------------------------------------------
# Metric names. Prometheus names carry the unit; MLflow names are the lab's short ones.

# Trainer, Prometheus (port 9791)
M_TRAIN_STEP = "x1_train_step"
M_TRAIN_TOKENS = "x1_train_tokens"  # counter: exported as x1_train_tokens_total
M_TRAIN_TOKENS_PER_SECOND = "x1_train_tokens_per_second"
M_TRAIN_MFU = "x1_train_mfu_ratio"  # labels: peak = datasheet | measured, peak_tflops = the peak it is against
M_TRAIN_LOSS = "x1_train_loss"
M_TRAIN_VAL_LOSS = "x1_train_val_loss"
M_TRAIN_GRAD_NORM = "x1_train_grad_norm"
# The final val loss the run's curve so far points to, and its interval (x1_pretrain.forecast)
M_TRAIN_FORECAST = "x1_train_forecast_val_loss"
M_TRAIN_FORECAST_LOW = "x1_train_forecast_val_loss_low"
M_TRAIN_FORECAST_HIGH = "x1_train_forecast_val_loss_high"
M_TRAIN_LR = "x1_train_lr"
# 1, labelled with the host rank 0 runs on: node_rank, nnodes, hostname (several hosts: which is which)
M_TRAIN_NODE_INFO = "x1_train_node_info"
M_TRAIN_SPENT = "x1_train_budget_spent_usd"
# The budget guard's projection (docs/DESIGN.md §6 rule 2): what it judges (the larger of the two below), the
# trainer's own (spent + rate x the hours its remaining steps need + margin), the sidecar's as the
# guard extrapolates it, and the billed hours the trainer still needs (margin not included).
M_TRAIN_PROJECTED = "x1_train_budget_projected_total_usd"
M_TRAIN_PROJECTED_OWN = "x1_train_budget_projected_own_usd"
M_TRAIN_PROJECTED_SIDECAR = "x1_train_budget_projected_sidecar_usd"
M_TRAIN_HOURS_NEEDED = "x1_train_budget_hours_needed"
M_TRAIN_PROGRESS = "x1_train_progress_ratio"  # step / total steps: % done at a glance
M_TRAIN_TOTAL_STEPS = "x1_train_total_steps"
M_TRAIN_ETA = "x1_train_eta_seconds"  # wall seconds the steps left need at the measured pace
M_TRAIN_RESTARTS = "x1_train_restarts"  # resumed starts of this run (preemptions, crashes, re-plans)
M_CHECKPOINT_LAST_STEP = "x1_checkpoint_last_step"
M_CHECKPOINT_SAVE_SECONDS = "x1_checkpoint_save_seconds"
M_TRAIN_WRITE_FAILING = "x1_train_write_failing"  # 1 while its heartbeat or metrics spool cannot be written
M_TRAIN_WRITE_ERROR = "x1_train_write_error"  # info: x1_train_write_error_info{error}: the path and the cause

# Budget sidecar, Prometheus (port 9792)
M_BUDGET_SPENT = "x1_budget_spent_usd"
M_BUDGET_RATE = "x1_budget_rate_usd_per_hour"
M_BUDGET_PROJECTED = "x1_budget_projected_total_usd"
M_BUDGET_CAP = "x1_budget_cap_usd"
M_BUDGET_LAST_UPDATE = "x1_budget_last_update_timestamp_seconds"
M_BUDGET_POLL_FAILURES = "x1_budget_poll_failures"  # counter: x1_budget_poll_failures_total
M_BUDGET_STALE = "x1_budget_stale"
M_BUDGET_ALERT = "x1_budget_alert_usd"  # the alert line (docs/DESIGN.md §6: $30)
M_BUDGET_PLANNED_HOURS = "x1_budget_planned_hours"  # 0: none, the sidecar's projection is the spend so far
M_BUDGET_WRITE_FAILING = "x1_budget_write_failing"  # 1 while budget.json or its ledger cannot be written

# Watchdog, Prometheus (port 9793)
M_WATCHDOG_RESTARTS = "x1_watchdog_restarts"  # counter with label reason: x1_watchdog_restarts_total
M_WATCHDOG_TRAINER_UP = "x1_watchdog_trainer_up"
M_WATCHDOG_DOWNTIME = "x1_watchdog_downtime_seconds"  # counter: x1_watchdog_downtime_seconds_total
M_WATCHDOG_HEALTHY = "x1_watchdog_healthy"  # 0 while it cannot reach its trainer (docker: the Engine API) or write its files
M_WATCHDOG_LAST_DECISION = "x1_watchdog_last_decision"  # info: x1_watchdog_last_decision_info{event,exit_code,reason,time}
M_WATCHDOG_DOCKER_ENGINE = "x1_watchdog_docker_engine"  # info: x1_watchdog_docker_engine_info{api_version,...}
M_WATCHDOG_WRITE_FAILING = "x1_watchdog_write_failing"  # 1 while its state or events file cannot be written
M_WATCHDOG_WRITE_ERROR = "x1_watchdog_write_error"  # info: x1_watchdog_write_error_info{error}: the path and the cause

# Counters: prometheus_client exports them with a `_total` suffix.
COUNTER_METRICS = frozenset({M_TRAIN_TOKENS, M_BUDGET_POLL_FAILURES, M_WATCHDOG_RESTARTS, M_WATCHDOG_DOWNTIME})

# MLflow metric keys logged by the trainer (train/components.py, loop.py), read by export_run and the
# post-mortem (run/). Each step of `log_every`:
MLFLOW_LOSS = "loss"
MLFLOW_LR = "lr"
MLFLOW_GRAD_NORM = "grad_norm"  # before clipping
MLFLOW_PARAM_NORM = "param_norm"
MLFLOW_TOKENS_PER_SEC = "tokens_per_sec"
MLFLOW_MFU = "mfu"
MLFLOW_TOKENS_SEEN = "tokens_seen"
MLFLOW_SPENT_USD = "spent_usd"
MLFLOW_WALL_HOURS = "wall_hours"  # wall-clock hours since the run's first start (downtime included)
MLFLOW_TRAIN_HOURS = "train_hours"  # hours spent training, summed over restarts (eval, checkpoints excluded)
MLFLOW_CLIPPED = "clipped"  # 1.0 when the grad norm was over the clip threshold
# The guard's projection at each log step and budget check (see M_TRAIN_PROJECTED*): judged, own,
# sidecar's; billed hours needed.
MLFLOW_PROJECTED_USD = "projected_usd"
MLFLOW_PROJECTED_OWN_USD = "projected_own_usd"
MLFLOW_PROJECTED_SIDECAR_USD = "projected_sidecar_usd"
MLFLOW_HOURS_NEEDED = "hours_needed"
MLFLOW_VAL_LOSS = "val_loss"
# Logged at each eval's step once the forecast has enough points
MLFLOW_FORECAST_METRICS = ("forecast_val_loss", "forecast_val_loss_low", "forecast_val_loss_high")
# Logged at the step each cooldown probe was forked from (train.cooldown_probes): its annealed val
# loss, its length in steps and the seconds it took
MLFLOW_PROBE_VAL_LOSS = "probe_val_loss"
MLFLOW_PROBE_STEPS = "probe_steps"
MLFLOW_PROBE_SECONDS = "probe_seconds"
MLFLOW_SPIKE = "spike"  # 1.0 at a detected spike's step
MLFLOW_SPIKE_INJECTED = "spike_injected"  # 1.0 at each injected step
MLFLOW_NONFINITE = "nonfinite_step"  # 1.0 at a skipped (non-finite) step
MLFLOW_RESTART = "restart"  # 1.0 at the step a resumed process starts from

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
    "X1_COST_URI_PASSWORD",
)

# The trainer's budget URL (--budget-curr-cost-uri) behind a proxy that asks for basic auth: the
# user and password live here, never in the URL the run records (a user:password@ given in the
# URL is moved here at start-up). MLflow's are MLFLOW_TRACKING_USERNAME/PASSWORD, as its client reads them.
COST_URI_USERNAME_ENV = "X1_COST_URI_USERNAME"
COST_URI_PASSWORD_ENV = "X1_COST_URI_PASSWORD"

# scheme://userinfo@ ; greedy up to the authority's last @, as urllib splits it.
_URI_USERINFO = re.compile(r"\b([a-z][a-z0-9+.-]*://)[^\s/?#]*@", re.I)


def move_uri_credentials_to_env(uri: str, user_env: str, password_env: str, what: str,
                                environ: Any = None) -> str:
    """`uri` without its user:password, which go to `user_env`/`password_env` for the client that
    needs them (MLflow's reads MLFLOW_TRACKING_USERNAME/PASSWORD). What a run records, logs or
    sends as a parameter is the returned URI. ValueError (naming the variable, never a value) when
    the environment already holds other credentials."""
    env = os.environ if environ is None else environ
    clean, user, password = split_uri_credentials(uri)
    for name, value in ((user_env, user), (password_env, password)):
        if value is None:
            continue
        if env.get(name, value) != value:
            raise ValueError(f"{what}: the URL carries credentials and {name} holds others; give them in one place")
        env[name] = value
    return clean


def strip_uri_credentials(text: str) -> str:
    """`text` with the user[:password] of every URI in it replaced by ***."""
    return _URI_USERINFO.sub(r"\1***@", text)


def split_uri_credentials(uri: str) -> tuple[str, str | None, str | None]:
    """(the URI without its user[:password], the user, the password); (uri, None, None) without."""
    from urllib.parse import unquote, urlsplit, urlunsplit

    parts = urlsplit(uri)
    if "@" not in parts.netloc:
        return uri, None, None
    userinfo, _, hostport = parts.netloc.rpartition("@")
    user, sep, password = userinfo.partition(":")
    clean = urlunsplit((parts.scheme, hostport, parts.path, parts.query, parts.fragment))
    return clean, unquote(user) or None, unquote(password) if sep else None


def secret_values(environ: dict[str, str] | None = None) -> list[str]:
    env = os.environ if environ is None else environ
    return [env[k] for k in SECRET_ENV_VARS if len(env.get(k, "")) >= 4]


def redact(text: str, environ: dict[str, str] | None = None) -> str:
    """`text` with every secret value from the environment, and the credentials of every URI in
    it, replaced by ***."""
    for value in secret_values(environ):
        text = text.replace(value, "***")
    return strip_uri_credentials(text)


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
