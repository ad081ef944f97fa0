"""The budget guard (docs/DESIGN.md §6): the trainer's side of the budget contract. There is no silent-overspend mode.

    guard = BudgetGuard.from_config(cfg.budget)     # NullGuard when --budget-cap-usd is not given
    pre = guard.prelaunch(pace)                      # waits for a first reading; 77 / 78 refuse the launch
    ...
    decision = guard.maybe_check(step)               # every optimizer step; reads every check_every_min
    if decision.exit_code: ...                       # 76: checkpoint then exit; 77: exit now

The reading is budget.json (a path) or the sidecar's /budget (a URL). Spend is always judged
extrapolated — `spent_usd + rate_usd_per_hr × age of the reading` — never the raw figure and never
zero; an unreadable source means "no new reading", and the last one keeps being extrapolated.
The rules, in order:

1. spent > cap: exit 77 at once, no checkpoint write;
2. projected total > cap: clean checkpoint, exit 76. The projected total is the larger of the
   sidecar's projected_total_usd (which cannot know how long the run is) and the trainer's own:
   spent + rate x the hours its remaining steps need at its measured pace (`Pace`: the plan's
   throughput until the first steady log interval, then a rolling measure), plus its measured
   eval, checkpoint and restart overheads, plus `margin` of that time;
3. spent > alert line: email + webhook, once per crossing;
4. rate > 1.2 × planned rate: warning alert (the planned rate is the first reading's when not given);
5. reading older than stale_after_min or marked stale: stale-data alert, once per episode.

Two clocks. A reading's date is the sidecar's wall clock, compared with ours once, when the reading
is first read: that gives its age then. From there on its age grows on the monotonic clock, as do
every interval of the guard (the checks' cadence, the wait for a first reading): a wall clock
stepped back (NTP) never makes the spend look lower nor a stale reading fresh, and one stepped
forward never adds hours that did not pass to a reading already read.

No torch here: the dry run and the tests import this without it.
"""

from __future__ import annotations

import base64
import contextlib
import dataclasses
import logging
import os
import time
import urllib.error
import urllib.request
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime, timezone
from enum import Enum
from pathlib import Path
from typing import TYPE_CHECKING, Any

from x1_common.alerts import AlertSender
from x1_common.contracts import (
    CLOCK_SKEW_S,
    COST_URI_PASSWORD_ENV,
    COST_URI_USERNAME_ENV,
    MAX_JSON_FILE_BYTES,
    BudgetReading,
    ExitCode,
    finite_number,
    parse_json_strict,
    read_json_file,
)
from x1_pretrain.config import BudgetConfig, ConfigError, RunConfig
from x1_pretrain.train.accounting import fmt_count, steps_that_fit, usd
from x1_pretrain.train.schedule import probe_plan

if TYPE_CHECKING:
    from collections.abc import Mapping

RATE_WARNING_FACTOR = 1.2  # an hourly rate 20% over plan is worth a human's look
READ_TIMEOUT_S = 5.0  # one HTTP read of the sidecar's /budget
ROLLING_S = 1800.0  # the rolling pace spans the last 30 min of steady training: drift shows within the hour

_log = logging.getLogger("x1.budget_guard")


class Action(str, Enum):
    CONTINUE = "continue"
    CHECKPOINT_AND_EXIT = "checkpoint-and-exit"
    EXIT_NOW = "exit-now"
    REFUSE_LAUNCH = "refuse-launch"


@dataclass(frozen=True)
class Decision:
    action: Action
    exit_code: int | None  # 76 / 77 / 78, None for CONTINUE
    reason: str  # one human sentence, printed and logged
    spent_usd: float | None  # extrapolated spend judged (None when no reading yet)
    projected_usd: float | None
    alerts: tuple[str, ...] = ()  # alert kinds raised during this check: "alert-line", "rate", "stale"
    projection: Projection | None = None  # the projection judged, with its inputs (None before any reading)
    checked: bool = True  # False between checks (not due) and with the guard off: nothing new to log
    fits_steps: int | None = None  # a stop or a refusal: the total steps that fit the cap (None: no pace)


class ReadError(Exception):
    """No usable reading from the source this time (missing, unreachable, torn, invalid)."""


# --------------------------------------------------------------------------------------------
# The run's own pace: how long its remaining steps take, as the trainer measures itself.


@dataclass(frozen=True)
class Interval:
    """One log interval of training, as train.Throughput measures it."""

    steps: int
    seconds: float  # training time: eval and checkpoint time left out
    tokens: int
    # Why the interval says nothing about the steady rate: "start" or "resume" (the first interval
    # of a process: compile, warm-up, first optimizer step, a restore), "eval", "checkpoint".
    not_steady: tuple[str, ...] = ()
    paused: dict[str, list[float]] = field(default_factory=dict)  # seconds of each eval / checkpoint in it

    @property
    def steady(self) -> bool:
        return not self.not_steady

    @property
    def tokens_per_sec(self) -> float:
        return self.tokens / max(self.seconds, 1e-9)


@dataclass(frozen=True)
class Need:
    """The wall time the run still needs, and what it is made of (the budget log line's inputs)."""

    steps_left: int
    seconds_per_step: float
    pace: str  # where seconds_per_step comes from: the plan's throughput, or measured
    evals_left: int
    eval_s: float
    eval_note: str  # "measured" or how it is estimated
    ckpts_left: int  # the final files count as one
    ckpt_s: float
    restarts_ahead: float  # the restarts so far, extrapolated over the steps left
    restart_s: float  # this process's start-up: setup, compile, warm-up, the slow first interval
    probes_left: int = 0  # cooldown probes still ahead (train.cooldown_probes)
    probe_steps: int = 0  # their steps, together
    probe_s: float = 0.0  # their seconds, together: their steps and evals
    probe_note: str = ""  # "measured" or how it is estimated

    @property
    def seconds(self) -> float:
        return (self.steps_left * self.seconds_per_step + self.evals_left * self.eval_s
                + self.ckpts_left * self.ckpt_s + self.restarts_ahead * self.restart_s + self.probe_s)

    def describe(self) -> str:
        probes = (f" + {self.probes_left} probe{'s' if self.probes_left > 1 else ''} of {self.probe_steps:,} steps = "
                  f"{self.probe_s:.2g} s ({self.probe_note})" if self.probes_left else "")
        return (f"{self.steps_left:,} steps x {self.seconds_per_step:.3g} s ({self.pace}) + {self.evals_left} evals x "
                f"{self.eval_s:.2g} s ({self.eval_note}) + {self.ckpts_left} checkpoints x {self.ckpt_s:.2g} s + "
                f"{self.restarts_ahead:.1f} restarts x {self.restart_s:.0f} s{probes}")


def _count_due(after: int, upto: int, every: int) -> int:
    """How many of the steps after+1 .. upto are multiples of `every` or the last step (`upto`)."""
    if after >= upto:
        return 0
    return upto // every - after // every + (1 if upto % every else 0)


def total_steps_that_fit(total_steps: int, need: Need, cap_usd: float, spent_usd: float, rate_usd_per_hr: float,
                         margin: float, time_scale: float = 1.0) -> int:
    """The total steps whose projection (spent + rate x billed hours x (1 + margin)) stays under the
    cap, at `need`'s pace: the figure a refusal or a budget stop names, and `plan` proposes."""
    done = total_steps - need.steps_left
    # Per step left, its share of the evals, checkpoints and restarts too: they scale with the steps.
    billed_s_per_step = need.seconds / need.steps_left * time_scale
    fits = done + steps_that_fit(cap_usd - spent_usd, rate_usd_per_hr, billed_s_per_step, margin)
    if fits >= 1000:  # a round figure leaves a little slack for the minutes a relaunch bills
        fits = fits // 100 * 100
    return fits


@dataclass(frozen=True)
class LaunchProjection:
    """What the trainer's launch check judges for `total_steps` before its first step (rule 2 at
    step 0, at plan's throughput): the one arithmetic behind plan's table, the trainer's refusal
    and the figures the docs quote."""

    total_steps: int
    need: Need
    rate_usd_per_hr: float
    spent_usd: float
    margin: float
    fits: int  # the total steps that fit the cap

    @property
    def hours(self) -> float:
        """Billed hours the steps need, evals included, the margin not."""
        return self.need.seconds / 3600.0

    @property
    def projected_usd(self) -> float:
        return self.spent_usd + self.rate_usd_per_hr * self.hours * (1.0 + self.margin)


def launch_projection(cfg: RunConfig, total_steps: int, tokens_per_sec: float, rate_usd_per_hr: float,
                      cap_usd: float, spent_usd: float = 0.0) -> LaunchProjection:
    """The launch check's projection of a fresh run of `total_steps` (see LaunchProjection)."""
    probes = [(fork, k) for _, fork, k in probe_plan(cfg.train.cooldown_probes, cfg.train.cooldown_probe_share,
                                                     total_steps)]
    pace = Pace(total_steps=total_steps, tokens_per_step=cfg.train.tokens_per_step, eval_every=cfg.train.eval_every,
                ckpt_every=cfg.checkpoint.every, eval_tokens=cfg.train.eval_windows * cfg.model.seq_len,
                expected_tokens_per_sec=tokens_per_sec, expected_source="plan", probes=probes)
    need = pace.need(0)
    assert need is not None  # a pace with an expected throughput always has a need
    return LaunchProjection(total_steps, need, rate_usd_per_hr, spent_usd, cfg.budget.margin,
                            total_steps_that_fit(total_steps, need, cap_usd, spent_usd, rate_usd_per_hr,
                                                 cfg.budget.margin))


class Pace:
    """How long the run still needs, from what it has measured of itself (docs/DESIGN.md §6, rule 2).

    Seconds per step: the plan's throughput (`expected_tokens_per_sec`) until the first steady
    interval is measured, then the steady intervals of the last ROLLING_S seconds. On a machine
    with no plan figure (a CPU) there is no pace until that first steady interval.
    Overheads: the mean measured seconds per eval and per checkpoint times those still due (an
    eval not yet measured: its tokens at three times the training rate, a forward only); this
    process's start-up times the restarts expected at the rate seen so far (none on a first start);
    and the cooldown probes still ahead (`probes`: (fork step, steps) each): their steps at the
    seconds per probe step measured on the probes so far (an eval and the copies included), else at
    the training pace plus an eval each.
    """

    def __init__(self, *, total_steps: int, tokens_per_step: int, eval_every: int, ckpt_every: int,
                 eval_tokens: int, start_step: int = 0, restarts: int = 0,
                 expected_tokens_per_sec: float | None = None, expected_source: str = "",
                 started: float | None = None, clock: Callable[[], float] = time.monotonic,
                 probes: list[tuple[int, int]] | tuple[tuple[int, int], ...] = ()) -> None:
        self.total_steps, self.tokens_per_step = total_steps, tokens_per_step
        self.eval_every, self.ckpt_every, self.eval_tokens = eval_every, ckpt_every, eval_tokens
        self.step, self.restarts = start_step, restarts
        self.expected_tokens_per_sec, self.expected_source = expected_tokens_per_sec, expected_source
        self.clock = clock
        self.started = clock() if started is None else started
        self._steady: deque[tuple[int, float]] = deque()  # (steps, seconds) of recent steady intervals
        self._steady_s = 0.0
        self._steady_steps_total = 0
        self._pauses: dict[str, list[float]] = {"eval": [], "checkpoint": []}
        self._startup: tuple[float, int] | None = None  # (seconds from `started` to the first read, its steps)
        self.probes = list(probes)
        self._probed: list[tuple[int, float]] = []  # (steps, seconds) of the probes this process ran

    def record_probe(self, steps: int, seconds: float) -> None:
        """A probe's length and its seconds, copies and eval included."""
        self._probed.append((steps, seconds))

    @property
    def measured(self) -> bool:
        """True once a steady interval has been measured."""
        return self._steady_steps_total > 0

    def record(self, interval: Interval, step: int) -> None:
        self.step = step
        if self._startup is None:
            self._startup = (self.clock() - self.started, interval.steps)
        for kind, seconds in interval.paused.items():
            self._pauses.setdefault(kind, []).extend(seconds)
        if not interval.steady or interval.steps <= 0:
            return
        self._steady.append((interval.steps, interval.seconds))
        self._steady_s += interval.seconds
        self._steady_steps_total += interval.steps
        while len(self._steady) > 1 and self._steady_s - self._steady[0][1] >= ROLLING_S:
            self._steady_s -= self._steady.popleft()[1]

    def seconds_per_step(self) -> tuple[float, str] | None:
        if self._steady:
            steps = sum(n for n, _ in self._steady)
            how = ("measured: the first steady interval" if len(self._steady) == 1 and
                   self._steady_steps_total == steps else f"measured: rolling over {steps:,} steps")
            return self._steady_s / steps, how
        if self.expected_tokens_per_sec:
            return (self.tokens_per_step / self.expected_tokens_per_sec,
                    f"plan: {fmt_count(self.expected_tokens_per_sec)} tokens/s, {self.expected_source}")
        return None

    def need(self, step: int | None = None) -> Need | None:
        """What the steps after `step` still need; None while there is no pace at all."""
        step = self.step if step is None else step
        pace = self.seconds_per_step()
        if pace is None:
            return None
        sps, how = pace
        evals = self._pauses.get("eval") or []
        if evals:
            eval_s, eval_note = sum(evals) / len(evals), "measured"
        else:
            eval_s, eval_note = self.eval_tokens / self.tokens_per_step * sps / 3.0, "estimated: a forward"
        ckpts = self._pauses.get("checkpoint") or []
        ckpt_s = sum(ckpts) / len(ckpts) if ckpts else 0.0
        steps_left = max(self.total_steps - step, 0)
        restart_s = 0.0
        if self._startup is not None:
            restart_s = max(0.0, self._startup[0] - self._startup[1] * sps)
        restarts_ahead = self.restarts * steps_left / step if step > 0 else 0.0
        ahead = [k for fork, k in self.probes if fork > step]
        if self._probed:
            per_step = sum(s for _, s in self._probed) / max(sum(k for k, _ in self._probed), 1)
            probe_s, probe_note = sum(ahead) * per_step, "measured"
        else:
            probe_s, probe_note = sum(ahead) * sps + len(ahead) * eval_s, "estimated: their steps at the pace + an eval"
        return Need(
            steps_left=steps_left, seconds_per_step=sps, pace=how,
            evals_left=_count_due(step, self.total_steps, self.eval_every), eval_s=eval_s, eval_note=eval_note,
            ckpts_left=_count_due(step, self.total_steps, self.ckpt_every) + (1 if steps_left else 0), ckpt_s=ckpt_s,
            restarts_ahead=restarts_ahead, restart_s=restart_s, probes_left=len(ahead), probe_steps=sum(ahead),
            probe_s=probe_s, probe_note=probe_note,
        )


@dataclass(frozen=True)
class Projection:
    """What rule 2 judges: the larger of the sidecar's projection and the trainer's own."""

    spent_usd: float  # extrapolated
    rate_usd_per_hr: float
    sidecar_usd: float  # the sidecar's projected_total_usd, extrapolated (never under the spend)
    own_usd: float | None  # spent + rate x billed hours needed x (1 + margin); None: no pace yet
    hours_needed: float | None  # billed hours still needed, margin not included
    margin: float
    need: Need | None
    no_own: str = ""  # why there is no own projection, when there is none

    @property
    def judged_usd(self) -> float:
        return max(self.sidecar_usd, self.own_usd if self.own_usd is not None else 0.0)

    def line(self, cap: float) -> str:
        """The projection's inputs and result, in one line."""
        head = f"spent {usd(self.spent_usd)} at {usd(self.rate_usd_per_hr)}/h"
        if self.need is None or self.own_usd is None or self.hours_needed is None:
            own = f"own projection: {self.no_own or 'none'}"
        else:
            own = (f"still needed: {self.need.describe()} = {self.hours_needed:.3g} h billed, "
                   f"+{self.margin:.0%} -> own {usd(self.own_usd)}")
        return f"{head}; {own}; sidecar's {usd(self.sidecar_usd)}: projected {usd(self.judged_usd)} of {usd(cap)}"


def budget_request(uri: str) -> urllib.request.Request:
    """GET `uri`, with basic auth from X1_COST_URI_USERNAME/PASSWORD when set (a proxy in front of
    the sidecar); the URL itself never carries them (see train.credentials_out_of_config)."""
    request = urllib.request.Request(uri)
    user, password = os.environ.get(COST_URI_USERNAME_ENV), os.environ.get(COST_URI_PASSWORD_ENV)
    if user is not None or password is not None:
        token = base64.b64encode(f"{user or ''}:{password or ''}".encode()).decode("ascii")
        request.add_header("Authorization", f"Basic {token}")
    return request


def read_source(uri: str, timeout: float = READ_TIMEOUT_S) -> tuple[BudgetReading, float]:
    """The reading at `uri` (a path or an http(s) URL) and its time scale (1 outside tests and the demo).

    The time scale is an informative field of the sidecar's (tests and the demo run its clock
    fast). No field outside the contract may make spend look lower: a scale under 1, or one that
    is not a finite number, is read as 1 — it can only ever speed the meter up."""
    try:
        if uri.startswith(("http://", "https://")):
            with urllib.request.urlopen(budget_request(uri), timeout=timeout) as resp:
                data = parse_json_strict(resp.read(MAX_JSON_FILE_BYTES + 1), what=uri, finite=False)
        else:
            # Non-finite numbers parse: from_dict refuses them where money is (the contract's keys).
            data = read_json_file(uri, finite=False)
        reading = BudgetReading.from_dict(data)
    except urllib.error.HTTPError as e:
        raise ReadError(f"{uri}: HTTP {e.code}") from None
    except (urllib.error.URLError, TimeoutError, OSError) as e:
        raise ReadError(f"{uri}: {getattr(e, 'reason', None) or e}") from None
    except ValueError as e:  # UnreadableFileError, BudgetFormatError
        raise ReadError(f"{uri}: {str(e).removeprefix(uri + ': ')}") from None
    scale = finite_number(data.get("time_scale", 1.0))
    return reading, max(1.0, scale or 1.0)


def planned_sentence(rate: float, hours: float, cap: float, max_price: float) -> tuple[str, bool]:
    """The pre-launch sentence for this run, and whether the launch is acceptable."""
    cost = rate * hours
    head = f"This run is planned at {usd(rate)}/h, ~{hours:g} h including setup = {usd(cost)}. Budget: {usd(cap)}. "
    reasons = []
    if rate > max_price:
        reasons.append(f"price {usd(rate)}/h is over the max price {usd(max_price)}/h")
    if cost > cap:
        reasons.append(f"projected {usd(cost)} is over the budget {usd(cap)}")
    if reasons:
        return head + "Refused: " + "; ".join(reasons) + ".", False
    return head + f"Confirmed acceptable, {usd(cap - cost)} buffer.", True


class BudgetGuard:
    enabled = True

    def __init__(
        self,
        cfg: BudgetConfig,
        alerts: AlertSender | None = None,
        clock: Callable[[], float] = time.time,
        log: logging.Logger = _log,
        *,
        reader: Callable[[], tuple[BudgetReading, float]] | None = None,
        sleep: Callable[[float], None] = time.sleep,
        pace: Pace | None = None,
        monotonic: Callable[[], float] | None = None,
    ) -> None:
        """`clock` is the wall clock, compared with the readings' dates; `monotonic` measures every
        duration (by default time.monotonic, or `clock` itself where a test drives one clock)."""
        if cfg.cap_usd is None:
            raise ValueError("BudgetGuard needs cap_usd; use BudgetGuard.from_config for the off switch")
        self.cfg = cfg
        self.cap: float = cfg.cap_usd
        self.alerts = alerts if alerts is not None else AlertSender()
        self.clock = clock
        self.monotonic = monotonic or (time.monotonic if clock is time.time else clock)
        self.log = log
        self.sleep = sleep
        self._read = reader or (lambda: read_source(cfg.curr_cost_uri))
        self.last_reading: BudgetReading | None = None
        self._time_scale = 1.0
        self._origin: float | None = None  # when last_reading's age starts (its date, unless that is in the future)
        self._age_at_read = 0.0  # last_reading's age when it was first read (wall clock against its date) ...
        self._read_mono = 0.0  # ... and that moment on the monotonic clock: its age grows from there
        self._rate_floor = 0.0  # the previous reading's rate: a lower new rate is extrapolated at this one
        self._last_read_at: float | None = None
        self._last_check: float | None = None
        self.planned_rate: float | None = cfg.planned_rate_usd_per_hr
        self.pace = pace  # the run's own pace; None: judged by the sidecar's projection alone
        self._step: int | None = None
        self._held: Decision | None = None  # a stop found where the loop could not act on it (a cooldown probe)
        self._judged_measured = False  # the first measured pace is judged at once, not at the next due check
        # One alert per crossing: each flag is set when its alert goes out, cleared when the
        # condition clears, so a second crossing alerts again.
        self._over_alert_line = False
        self._rate_high = False
        self._stale = False

    @classmethod
    def from_config(
        cls,
        cfg: BudgetConfig,
        alerts: AlertSender | None = None,
        clock: Callable[[], float] = time.time,
        log: logging.Logger = _log,
        **kw: Any,
    ) -> BudgetGuard | NullGuard:
        """The guard, or NullGuard when cfg.cap_usd is None. Alerts from the environment by default
        (ConfigError naming the variable when a channel is half-configured)."""
        if cfg.cap_usd is None:
            return NullGuard()
        if alerts is None:
            try:
                alerts = AlertSender.from_env()
            except ValueError as e:
                raise ConfigError(f"alerts: {e}") from None
        guard = cls(cfg, alerts, clock, log, **kw)
        log.info(
            "budget guard on: cap %s, alert at %s, reading %s every %g min, channels: %s",
            usd(guard.cap), usd(cfg.alert_usd), cfg.curr_cost_uri, cfg.check_every_min,
            ", ".join(alerts.channels) or "none (alerts only logged)",
        )
        return guard

    # --- the numbers --------------------------------------------------------------------------
    def _age_s(self, reading: BudgetReading, now: float) -> float:
        """Seconds the meter has run since `reading`, at `now` on the monotonic clock: its age when
        first read, plus the monotonic time since. A reading dated in the future has no age of its
        own: it counts from `_origin` (see _try_read), never from its date, so that a wrong clock or
        a damaged file cannot stop the extrapolation."""
        if reading is self.last_reading and self._origin is not None:
            return self._age_at_read + max(0.0, now - self._read_mono)
        return max(0.0, self.clock() - reading.last_update_utc.timestamp())

    def _extrapolate(self, reading: BudgetReading, now: float) -> tuple[float, float]:
        """(spent, projected) at `now` if the meter kept running at the reading's rate — or at the
        previous reading's, when this one's is lower: when the price fell is unknown, so the
        higher of the two counts (the sidecar's rule for the interval between two polls)."""
        rate = reading.rate_usd_per_hr
        if reading is self.last_reading:
            rate = max(rate, self._rate_floor)
        billed_h = self._age_s(reading, now) * self._time_scale / 3600.0
        spent = reading.spent_usd + rate * billed_h
        # The projection already counts the remaining planned hours at the same rate: only the
        # spend itself can overtake it (a run that outlives its plan).
        return spent, max(reading.projected_total_usd, spent)

    def spent_usd_now(self) -> float | None:
        """Extrapolated spend now, for MLflow and Prometheus; None before any reading."""
        if self.last_reading is None:
            return None
        return self._extrapolate(self.last_reading, self.monotonic())[0]

    def projection(self, step: int | None = None) -> Projection | None:
        """The projection rule 2 would judge now (None before any reading): for MLflow and /metrics too."""
        if step is not None:
            self._step = step
        if self.last_reading is None:
            return None
        return self._project(self.last_reading, self.monotonic())

    def _project(self, reading: BudgetReading, now: float) -> Projection:
        spent, sidecar = self._extrapolate(reading, now)
        need = self.pace.need(self._step) if self.pace is not None else None
        own = hours = None
        if need is not None:
            hours = need.seconds * self._time_scale / 3600.0  # wall seconds -> billed hours (x1 outside tests)
            own = spent + reading.rate_usd_per_hr * hours * (1.0 + self.cfg.margin)
        no_own = ("" if need is not None else "no pace given" if self.pace is None else
                  "no pace yet (no plan throughput for this machine: the first steady interval decides)")
        return Projection(spent_usd=spent, rate_usd_per_hr=reading.rate_usd_per_hr, sidecar_usd=sidecar,
                          own_usd=own, hours_needed=hours, margin=self.cfg.margin, need=need, no_own=no_own)

    def _fits(self, p: Projection) -> int | None:
        """The total steps that fit the cap at the pace measured (None where there is no pace)."""
        if p.need is None or p.rate_usd_per_hr <= 0 or self.pace is None or p.need.steps_left <= 0:
            return None
        return total_steps_that_fit(self.pace.total_steps, p.need, self.cap, p.spent_usd, p.rate_usd_per_hr,
                                    self.cfg.margin, self._time_scale)

    def _steps_that_fit(self, p: Projection, fits: int | None, resume: bool) -> str:
        """'; --total-steps N fits (of M): continue with ...' for a refusal or a stop, naming the
        exact commands that continue the run with what fits (README "After a budget stop")."""
        if fits is None or self.pace is None:
            return ""
        done = self.pace.total_steps - (p.need.steps_left if p.need is not None else 0)
        if fits <= done:
            return f"; no more steps fit the cap (step {done:,} done of {self.pace.total_steps:,})"
        flags = f"{'--resume-from-latest ' if resume else ''}--total-steps {fits}"
        return (f"; --total-steps {fits} fits (of {self.pace.total_steps:,}): continue with `{flags}` "
                f"(stack: `python -m x1_pretrain.stack up --total-steps {fits} ...`; compose: set TOTAL_STEPS={fits} "
                f"in .env, then `docker compose up -d`)")

    def _try_read(self) -> str | None:
        """Read the source into last_reading; the error in words when there is no new reading.

        A reading dated more than the clock skew ahead of our clock is suspect: it is marked
        stale (the stale-data alert goes out) and its age is counted from the last time we read
        the source and did not find it (it was written after that), or, for a first reading, from
        the earlier of the file's modification time and now. Spend never looks lower for it."""
        now = self.clock()
        previous_read, self._last_read_at = self._last_read_at, now
        try:
            reading, scale = self._read()
        except ReadError as e:
            return str(e)
        prev = self.last_reading
        written = reading.last_update_utc.timestamp()
        same = prev is not None and self._origin is not None and prev.last_update_utc == reading.last_update_utc \
            and prev.spent_usd == reading.spent_usd and prev.rate_usd_per_hr == reading.rate_usd_per_hr
        if same and self._origin is not None and prev is not None:
            # The reading we already had: its age runs on from when it was first read (the
            # monotonic clock: no step of the wall clock since counts), and one that was dated in
            # the future stays suspect after our clock has caught up with its date.
            self._rate_floor = prev.rate_usd_per_hr
            self.last_reading, self._time_scale = dataclasses.replace(reading, stale=reading.stale or prev.stale), scale
            return None
        if written <= now + CLOCK_SKEW_S:
            origin = min(written, now)  # a date a little ahead (two clocks) is "now", never later
        else:
            origin = now if previous_read is None else previous_read
            if not self.cfg.curr_cost_uri.startswith(("http://", "https://")):
                with contextlib.suppress(OSError):
                    origin = min(origin, Path(self.cfg.curr_cost_uri).stat().st_mtime)
            self.log.warning(
                "budget reading from %s is dated %.1f h in the future (%s): not trusted as fresh; its age is "
                "counted from %s and it is treated as stale", self.cfg.curr_cost_uri, (written - now) / 3600.0,
                reading.last_update_utc.isoformat(), datetime.fromtimestamp(origin, timezone.utc).isoformat())
            reading = dataclasses.replace(reading, stale=True)
        self._rate_floor = prev.rate_usd_per_hr if prev is not None else 0.0
        if reading.rate_usd_per_hr < self._rate_floor:
            self.log.warning("budget reading's rate %s/h is below the previous reading's %s/h: extrapolating at the "
                             "higher until the next reading", usd(reading.rate_usd_per_hr), usd(self._rate_floor))
        self.last_reading, self._time_scale, self._origin = reading, scale, origin
        self._age_at_read, self._read_mono = max(0.0, now - origin), self.monotonic()
        return None

    # --- start ------------------------------------------------------------------------------
    def prelaunch(self, pace: Pace | None = None) -> Decision:
        """Wait for a first reading and judge it; with `pace`, also whether the run's steps can finish
        under the cap at the plan's throughput (no pace: the first steady interval decides)."""
        cfg = self.cfg
        if pace is not None:
            self.pace = pace
            self._step = pace.step
        if cfg.planned_rate_usd_per_hr is not None and cfg.planned_hours is not None:
            sentence, ok = planned_sentence(cfg.planned_rate_usd_per_hr, cfg.planned_hours, self.cap,
                                            cfg.max_price_usd_per_hr)
            self.log.info("%s", sentence)
            if not ok:
                return Decision(Action.REFUSE_LAUNCH, ExitCode.LAUNCH_REFUSED, sentence, None, None)

        timeout_s = cfg.first_reading_timeout_min * 60.0
        deadline = self.monotonic() + timeout_s
        every = min(5.0, max(0.2, timeout_s / 20))
        next_note = self.monotonic()
        while True:
            why = self._try_read()
            now = self.monotonic()
            if why is None and self.last_reading is not None:
                age = self._age_s(self.last_reading, now)
                if age <= cfg.stale_after_min * 60.0:
                    break
                why = f"the reading is {age / 60:.1f} min old (fresh means under {cfg.stale_after_min:g} min)"
            if now >= deadline:
                reason = (f"no fresh budget reading from {cfg.curr_cost_uri} within {cfg.first_reading_timeout_min:g} min "
                          f"({why}): launch refused")
                self.log.error("%s", reason)
                return Decision(Action.REFUSE_LAUNCH, ExitCode.LAUNCH_REFUSED, reason, None, None)
            if now >= next_note:
                self.log.info("waiting for a first budget reading from %s (%.0f s left): %s",
                              cfg.curr_cost_uri, deadline - now, why)
                next_note = now + 30.0
            self.sleep(every)

        reading = self.last_reading
        assert reading is not None
        now = self.monotonic()
        self._last_check = now
        if self.planned_rate is None:
            self.planned_rate = reading.rate_usd_per_hr
            self.log.info("planned rate taken from the first reading: %s/h", usd(self.planned_rate))
        p = self._project(reading, now)
        spent, projected = p.spent_usd, p.judged_usd
        if spent > self.cap:
            return self._decide(Action.EXIT_NOW, ExitCode.BUDGET_SPENT,
                                f"spent {usd(spent)} is already over the cap {usd(self.cap)}: not starting", spent,
                                projected, projection=p)
        if reading.rate_usd_per_hr > cfg.max_price_usd_per_hr:
            return self._decide(Action.REFUSE_LAUNCH, ExitCode.LAUNCH_REFUSED,
                                f"price {usd(reading.rate_usd_per_hr)}/h is over the max price "
                                f"{usd(cfg.max_price_usd_per_hr)}/h: launch refused", spent, projected, projection=p)
        if projected > self.cap:
            fits = self._fits(p)
            resume = self.pace is not None and self.pace.step > 0
            return self._decide(Action.REFUSE_LAUNCH, ExitCode.LAUNCH_REFUSED,
                                f"projected total {usd(projected)} is over the cap {usd(self.cap)}: launch refused"
                                f"{self._steps_that_fit(p, fits, resume)}. {p.line(self.cap)}", spent, projected,
                                projection=p, fits=fits)
        return self._judge(now, prefix="launch accepted")

    # --- during the run ---------------------------------------------------------------------
    def maybe_check(self, step: int | None = None) -> Decision:
        """Cheap enough for every optimizer step: reads only when check_every_min has passed, or
        when the run has just measured its first steady pace (judged at once: a run that cannot
        finish stops in its first minutes, not half an hour later). A decision held back (`hold`)
        comes first."""
        if self._held is not None:
            held, self._held = self._held, None
            return held
        now = self.monotonic()
        if step is not None:
            self._step = step
        first_pace = self.pace is not None and self.pace.measured and not self._judged_measured
        if not first_pace and self._last_check is not None and now - self._last_check < self.cfg.check_every_min * 60.0:
            if self.last_reading is None:
                return Decision(Action.CONTINUE, None, "budget check not due", None, None, checked=False)
            p = self._project(self.last_reading, now)
            return Decision(Action.CONTINUE, None, "budget check not due", p.spent_usd, p.judged_usd, projection=p,
                            checked=False)
        return self.check(step)

    def hold(self, decision: Decision) -> None:
        """A stop decided during a cooldown probe: the probe is dropped, and the loop's next
        maybe_check returns this decision, acted on at the run's own step."""
        self._held = decision

    def check(self, step: int | None = None) -> Decision:
        """Read now and apply the rules in order."""
        now = self.monotonic()
        self._last_check = now
        if step is not None:
            self._step = step
        if self.pace is not None and self.pace.measured:
            self._judged_measured = True
        why = self._try_read()
        if why is not None:
            self.log.warning("no new budget reading (%s): judging the last one, extrapolated", why)
        if self.last_reading is None:
            reason = f"no budget reading at all from {self.cfg.curr_cost_uri} ({why})"
            sent = self._raise_once("stale", True, "Budget data missing", reason, {})
            self.log.error("%s", reason)
            return Decision(Action.CONTINUE, None, reason, None, None, sent)
        return self._judge(now)

    def _judge(self, now: float, prefix: str = "continue") -> Decision:
        reading = self.last_reading
        assert reading is not None
        p = self._project(reading, now)
        spent, projected = p.spent_usd, p.judged_usd
        age_min = self._age_s(reading, now) / 60.0
        fields = {"spent_usd": round(spent, 2), "projected_usd": round(projected, 2), "cap_usd": self.cap,
                  "rate_usd_per_hr": reading.rate_usd_per_hr, "reading_age_min": round(age_min, 1),
                  "source": reading.source or "?"}
        # 1. spent over the cap: exit at once. Nothing else runs first, an alert send included
        # (it can take seconds); the watchdog alerts on the stop.
        if spent > self.cap:
            return self._decide(Action.EXIT_NOW, ExitCode.BUDGET_SPENT,
                                f"spent {usd(spent)} (extrapolated from a reading {age_min:.0f} min old) is over the cap "
                                f"{usd(self.cap)}: exiting now without a checkpoint", spent, projected, projection=p)
        # 3. to 5.: alerts, no action. Judged before rule 2 acts, so that a stop for the projection
        # still tells the person why (a price that tripled: the rate warning, then the stop).
        sent = self._alerts(reading, spent, projected, age_min, fields)
        # 2. projected total over the cap: a clean checkpoint, then exit.
        if projected > self.cap:
            fits = self._fits(p)
            return self._decide(Action.CHECKPOINT_AND_EXIT, ExitCode.BUDGET_PROJECTED,
                                f"projected total {usd(projected)} is over the cap {usd(self.cap)} (spent {usd(spent)}): "
                                f"checkpoint and exit{self._steps_that_fit(p, fits, True)}. {p.line(self.cap)}", spent,
                                projected, sent, projection=p, fits=fits)
        notes = [n for n, on in (("alert line crossed", "alert-line" in sent), ("rate over plan", "rate" in sent),
                                 ("stale reading", "stale" in sent)) if on]
        reason = f"{prefix}: {p.line(self.cap)}" + (f" ({', '.join(notes)})" if notes else "")
        self.log.info("budget: %s", reason)
        return Decision(Action.CONTINUE, None, reason, spent, projected, tuple(sent), projection=p)

    def _alerts(self, reading: BudgetReading, spent: float, projected: float, age_min: float,
                fields: Mapping[str, Any]) -> list[str]:
        sent: list[str] = []
        sent += self._raise_once(
            "alert-line", spent > self.cfg.alert_usd, f"Budget: {usd(spent)} spent, over the {usd(self.cfg.alert_usd)} alert line",
            f"Spend {usd(spent)} has crossed the alert line {usd(self.cfg.alert_usd)}; cap {usd(self.cap)}, "
            f"projected {usd(projected)}. No action taken.", fields)
        planned = self.planned_rate
        rate_high = planned is not None and reading.rate_usd_per_hr > RATE_WARNING_FACTOR * planned
        sent += self._raise_once(
            "rate", rate_high, f"Budget: rate {usd(reading.rate_usd_per_hr)}/h is over 1.2x the plan",
            f"The hourly rate {usd(reading.rate_usd_per_hr)}/h is over {RATE_WARNING_FACTOR:g} x the planned "
            f"{usd(planned or 0)}/h. Decide whether to stop the run or let it continue; projected {usd(projected)} "
            f"of {usd(self.cap)}.", fields)
        stale = reading.stale or age_min > self.cfg.stale_after_min
        sent += self._raise_once(
            "stale", stale, "Budget data stale",
            f"The budget reading is {age_min:.0f} min old{' and marked stale by the sidecar' if reading.stale else ''}; "
            f"spend is judged extrapolated at {usd(reading.rate_usd_per_hr)}/h = {usd(spent)}.", fields)
        return sent

    def _raise_once(self, kind: str, condition: bool, subject: str, body: str, fields: Mapping[str, Any]) -> list[str]:
        flag = {"alert-line": "_over_alert_line", "rate": "_rate_high", "stale": "_stale"}[kind]
        if not condition:
            setattr(self, flag, False)
            return []
        if getattr(self, flag):
            return []
        setattr(self, flag, True)
        self.alerts.send(kind, subject, body, dict(fields))  # never raises
        return [kind]

    def _decide(self, action: Action, code: int, reason: str, spent: float | None, projected: float | None,
                alerts: list[str] | None = None, projection: Projection | None = None,
                fits: int | None = None) -> Decision:
        self.log.error("budget: %s", reason)
        return Decision(action, int(code), reason, spent, projected, tuple(alerts or ()), projection, fits_steps=fits)


class NullGuard:
    """The guard when --budget-cap-usd is not given: never reads, never stops."""

    enabled = False
    last_reading: BudgetReading | None = None

    _OFF = Decision(Action.CONTINUE, None, "budget guard off (no --budget-cap-usd)", None, None, checked=False)

    def prelaunch(self, pace: Pace | None = None) -> Decision:
        return self._OFF

    def maybe_check(self, step: int | None = None) -> Decision:
        return self._OFF

    def check(self, step: int | None = None) -> Decision:
        return self._OFF

    def hold(self, decision: Decision) -> None:
        pass

    def spent_usd_now(self) -> float | None:
        return None

    def projection(self, step: int | None = None) -> Projection | None:
        return None
