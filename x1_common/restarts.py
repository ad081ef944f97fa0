"""A restart's downtime, defined once: every place that shows one (the trainer's first-step log
line and MLflow, the run folder's manifest, throughput.png, `stack status`, `make demo`) computes
it here, from the same two moments, so one run shows one number per restart everywhere.

    downtime = resumed - stopped, in seconds rounded to 0.1

stopped: the moment the previous trainer process stopped training. By precedence:
  1. "SIGTERM": it received SIGTERM (a preemption notice, `docker stop`, `stack down`); its
     last heartbeat (phase "stopped") carries signal_time. The emergency checkpoint, the metrics
     flush and the process's exit are downtime.
  2. "exit": it stopped by itself (a budget or forecast stop, a crash it caught); its last
     heartbeat is phase "stopped" at its exit.
  3. "exit": it left no stop record (a kill, an OOM): the watchdog's exit event, where there is
     a watchdog.
  4. "last heartbeat": none of these (a kill without a watchdog): its last sign of life, so the
     figure is an upper bound.
resumed: the moment the relaunched process completed its first optimizer step (its
first_step_unix, logged by it to MLflow and in its start record line).

Standard library only: the launcher-side tools and `stack status` read it without torch.
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any

from x1_common.contracts import CLOCK_SKEW_S, PHASE_FINISHED, PHASE_STOPPED

STOPPED_BY = ("SIGTERM", "exit", "last heartbeat")  # MLflow's stopped_by metric is the index

DEFINITION = ("downtime: the previous process's SIGTERM (else its exit: its own stop record, else the "
              "watchdog's exit event, else its last heartbeat) -> the relaunched process's first optimizer step done")

# The trainer's log line at its first step ends with its start record, as JSON: `stack status`
# reads the run's restarts back from trainer.log with START_RECORD.
START_RECORD = re.compile(r"start record (\{.*\})\s*$")


@dataclass(frozen=True)
class Stop:
    """When the previous process stopped training, how that is known, and at which completed step."""

    unix: float
    by: str  # one of STOPPED_BY
    step: int | None = None


@dataclass(frozen=True)
class Start:
    """A trainer process at its first completed step, with what it knew of the process before it."""

    first_step: int
    first_step_unix: float
    startup_seconds: float
    previous: Stop | None = None  # None: a fresh start, or a resume with no heartbeat left

    def record(self) -> dict[str, Any]:
        out: dict[str, Any] = {"first_step": self.first_step, "first_step_unix": self.first_step_unix,
                               "startup_seconds": self.startup_seconds}
        if self.previous is not None:
            out.update(stopped_unix=self.previous.unix, stopped_by=self.previous.by, stopped_step=self.previous.step)
        return out

    @classmethod
    def from_record(cls, d: dict[str, Any]) -> Start:
        previous = None
        if d.get("stopped_unix") is not None and d.get("stopped_by") in STOPPED_BY:
            previous = Stop(float(d["stopped_unix"]), d["stopped_by"], d.get("stopped_step"))
        return cls(int(d["first_step"]), float(d["first_step_unix"]), float(d["startup_seconds"]), previous)


def previous_stop(phase: str, time: float, step: int, signal_time: float | None) -> Stop:
    """What the previous process's last heartbeat says of its stop (precedence 1, 2 or 4)."""
    if phase == PHASE_STOPPED and signal_time is not None:
        return Stop(signal_time, "SIGTERM", step)
    if phase in (PHASE_STOPPED, PHASE_FINISHED):
        return Stop(time, "exit", step)
    return Stop(time, "last heartbeat", step)


def on_this_clock(stop: Stop, stop_mono: float | None, stop_boot: str | None, boot: str | None, now: float,
                  now_mono: float) -> Stop:
    """`stop` moved into this process's wall-clock frame: where both processes ran on one boot, its
    time is measured back from `now` on the monotonic clock they share, so that a wall clock
    stepped between the stop and now (NTP, a resumed VM) does not change the downtime. Elsewhere
    (another host, a reboot between), its own wall-clock time, as it was."""
    if stop_mono is None or stop_boot is None or stop_boot != boot:
        return stop
    return dataclasses.replace(stop, unix=now - max(0.0, now_mono - stop_mono))


def stop_moment(own: Stop | None, watchdog_exit_unix: float | None) -> Stop | None:
    """The stop a restart's downtime counts from: the process's own record (SIGTERM or exit) over
    the watchdog's exit event over the last heartbeat."""
    if own is not None and own.by != "last heartbeat":
        return own
    if watchdog_exit_unix is not None:
        return Stop(watchdog_exit_unix, "exit", own.step if own else None)
    return own


def downtime_seconds(stopped: Stop | None, resumed_unix: float | None) -> float | None:
    if stopped is None or resumed_unix is None:
        return None
    return round(resumed_unix - stopped.unix, 1)


def utc(unix: float) -> str:
    return datetime.fromtimestamp(unix, timezone.utc).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def _event_unix(e: dict[str, Any]) -> float | None:
    try:
        return datetime.fromisoformat(str(e.get("time")).replace("Z", "+00:00")).timestamp()
    except ValueError:
        return None


def restarts(starts: Iterable[Start], events: Iterable[dict[str, Any]] = ()) -> list[dict[str, Any]]:
    """One entry per restart, oldest first: when it stopped and how that is known, from which step,
    the step it resumed at, the downtime, the cause.

    With the watchdog's events, a restart is a relaunch event: the exit before it, and the first
    start whose first step came after that exit (and before the next exit; none: the relaunched
    process ended before its first step, and the downtime is not measured). Without them, every
    start that followed an earlier process is one."""
    starts = sorted(starts, key=lambda s: s.first_step_unix)
    events = list(events)
    out: list[dict[str, Any]] = []
    if any(e.get("event") == "relaunch" for e in events):
        exit_times = sorted(t for e in events if e.get("event") == "exit" and (t := _event_unix(e)) is not None)
        for n, rel in enumerate((e for e in events if e.get("event") == "relaunch"), 1):
            rel_t = _event_unix(rel)
            ex_t = max((t for t in exit_times if rel_t is not None and t <= rel_t), default=None)
            until = min((t for t in exit_times if ex_t is not None and t > ex_t), default=float("inf"))
            nxt = next((s for s in starts if ex_t is not None and ex_t < s.first_step_unix < until), None)
            own = nxt.previous if nxt is not None else None
            earlier = max((t for t in exit_times if ex_t is not None and t < ex_t), default=float("-inf"))
            if own is not None and not earlier < own.unix <= (ex_t or own.unix) + CLOCK_SKEW_S:
                own = None  # the beat of another process than the one that exited here
            item = entry(n, stop_moment(own, ex_t), nxt)
            item.update(cause=rel.get("reason"), exit_code=rel.get("exit_code"),
                        relaunch_delay_seconds=rel.get("downtime_seconds"))  # exit -> relaunch (backoff)
            out.append(item)
    else:
        for n, s in enumerate((s for s in starts if s.previous is not None), 1):
            item = entry(n, s.previous, s)
            item.update(cause=None, exit_code=None)
            out.append(item)
    return out


def entry(n: int, stopped: Stop | None, resumed: Start | None) -> dict[str, Any]:
    item: dict[str, Any] = {
        "restart": n,
        "stopped_utc": utc(stopped.unix) if stopped else None,
        "stopped_unix": stopped.unix if stopped else None,
        "stopped_by": stopped.by if stopped else None,
        "stopped_at_step": stopped.step if stopped else None,
        "resumed_first_step": resumed.first_step if resumed else None,
        "resumed_unix": resumed.first_step_unix if resumed else None,
        "startup_seconds": round(resumed.startup_seconds, 3) if resumed else None,
        "downtime_seconds": downtime_seconds(stopped, resumed.first_step_unix if resumed else None),
    }
    if item["downtime_seconds"] is None:
        item["why"] = ("not measured: the relaunched process logged no first step (it ended before one, or its "
                       "metrics never reached MLflow)" if resumed is None else "not measured: no stop time known")
    return item


def label(r: dict[str, Any]) -> str:
    """The short form, as throughput.png labels a restart's band."""
    d = r.get("downtime_seconds")
    return f"restart {r['restart']}: {d:.1f} s" if d is not None else f"restart {r['restart']}: downtime not measured"


def describe(r: dict[str, Any]) -> str:
    """The long form, as `stack status` and `make demo` print a restart."""
    cause = f" ({r['cause']}, exit {r['exit_code']})" if r.get("cause") else ""
    if r.get("downtime_seconds") is None:
        return f"{label(r)}{cause}: {r.get('why', 'not measured')}"
    at = f" at step {r['stopped_at_step']}" if r.get("stopped_at_step") is not None else ""
    return (f"{label(r)} down{cause}: {r['stopped_by']}{at} {r['stopped_utc']} -> "
            f"step {r['resumed_first_step']} done")


def start_line(start: Start) -> str:
    """The trainer's log line at its first step; `stack status` reads its JSON back."""
    own = downtime_seconds(start.previous, start.first_step_unix)
    since = ""
    if start.previous is not None:
        bound = "at most " if start.previous.by == "last heartbeat" else ""
        since = f"; {bound}{own:.1f} s since the previous process's {start.previous.by} at step {start.previous.step}"
    return (f"first step of this process (step {start.first_step}) done {start.startup_seconds:.1f} s after it "
            f"started{since}; start record {json.dumps(start.record(), sort_keys=True)}")


def starts_in_log(lines: Iterable[str]) -> list[Start]:
    out = []
    for line in lines:
        if "start record {" not in line or not (m := START_RECORD.search(line)):
            continue
        try:
            out.append(Start.from_record(json.loads(m[1])))
        except (ValueError, KeyError, TypeError):
            continue  # a torn line
    return out
