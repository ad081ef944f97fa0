"""What the watchdog leaves behind: the events file (one JSON line per decision) and the state
file (the decisions a restarted watchdog must honour).

The events file is for people and the run's export: append-only, one fsync per line, so the
last decision before a power cut is on disk. The state file is for the next watchdog: rewritten
atomically, so a reboot mid-write leaves the old decision or the new one, never half of each.

A write that fails (a full or read-only disk) never stops the supervision: an unsupervised
trainer is worse than a gap. Both files report to one WriteHealth: from the first failed write
the watchdog is unhealthy (x1_watchdog_healthy 0, x1_watchdog_write_error_info naming the path
and the cause), alerts once, says it once in its log, and writes again at its next decision.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import time
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from x1_common.contracts import CLOCK_SKEW_S, finite_number, parse_json_strict, read_file_bytes, read_json_file
from x1_common.fsutil import WriteHealth, disk_faults_named, write_json_atomic

log = logging.getLogger(__name__)

STATE_VERSION = 1


def _plain_int(v: Any, signed: bool = False) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and (signed or v >= 0)


def _short(v: Any) -> str:
    text = repr(v)
    return text if len(text) <= 80 else text[:77] + "..."


def iso_time(t: float | None = None) -> str:
    """UTC with milliseconds: two events in the same second stay ordered for a reader."""
    t = time.time() if t is None else t
    return datetime.fromtimestamp(t, timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%f")[:-3] + "Z"


class EventLog:
    """Appends `{"event": ..., "time": ..., **fields}` lines to a JSON-lines file."""

    def __init__(self, path: str | os.PathLike[str], writes: WriteHealth | None = None) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.writes = writes or WriteHealth(log)
        self.on_write: Callable[[dict[str, Any]], None] = lambda record: None  # e.g. /metrics' last decision

    def write(self, event: str, **fields: Any) -> dict[str, Any]:
        record = {"event": event, "time": iso_time(), **fields}
        line = json.dumps(record, sort_keys=False) + "\n"
        data = line.encode("utf-8")
        try:
            with disk_faults_named(self.path, need=len(data)):
                append_line(self.path, data)
        except OSError as e:
            # A full disk must not kill the supervisor: an unsupervised trainer is worse than a gap.
            self.writes.failed(self.path, e, "the events from here are in this log only, until a write succeeds")
            log.warning("event not written to %s: %s", self.path, line.strip())
        else:
            self.writes.succeeded(self.path)
        self.on_write(record)
        return record


def append_line(path: Path, data: bytes) -> None:
    """One line appended and fsynced. O_APPEND and one write: a reader tailing the file never
    sees half a line (but a disk that fills mid-line can leave one, which read_events skips)."""
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        if os.write(fd, data) != len(data):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
        os.fsync(fd)
    finally:
        os.close(fd)


def read_events(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """Every event in the file, oldest first (an empty list when there is no file yet).

    The file is appended to by a watchdog that may die mid-line (a power cut, a full disk): a line
    that is not a JSON object (torn, not UTF-8, garbage) is skipped with a warning naming its
    line number, never a reason to lose the others."""
    try:
        raw = read_file_bytes(path)
    except FileNotFoundError:
        return []
    events, bad = [], []
    for n, line in enumerate(raw.splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = parse_json_strict(line, what=f"line {n}")
        except ValueError:
            bad.append(n)
            continue
        if isinstance(record, dict) and isinstance(record.get("event"), str):
            events.append(record)
        else:
            bad.append(n)
    if bad:
        log.warning("events file %s: skipped %d line(s) that are not events (line %s)", path, len(bad),
                    ", ".join(map(str, bad[:10])) + (", ..." if len(bad) > 10 else ""))
    return events


class StateError(Exception):
    """The state file exists but cannot be trusted; the message names the file and the problem."""


# A budget stop (checkpoint written) and a refused launch: continued by a run re-planned to fewer steps.
REPLANNABLE_EXIT_CODES = frozenset({76, 78})


class StateStore:
    """The watchdog's persistent memory.

    `final` is the run-level decision (finished, budget stop, divergence, bad config, given up,
    start-up failure):
    once set, no watchdog relaunches anything until a person passes --reset-state. `restart_times`
    are the wall-clock times of relaunches, so the give-up window survives a watchdog restart.
    `instance_id` is the instance being followed in provider mode (a Lambda relaunch gets a new id).

    A damaged state file is read conservatively. When the whole file cannot be read (not UTF-8,
    not JSON, not a version-1 object), or its `final` is not a decision we can read, nobody can
    tell whether a final decision was there: StateError, and the watchdog refuses to start (exit
    2) rather than relaunch a run that may have stopped for its budget. Damage anywhere else
    only costs bookkeeping and is repaired with a warning: `restart_times` keeps only finite
    times that are not in the future (a relaunch never made must not count towards giving up),
    a bad `starts` counts as a run in progress (the trainer resumes, it never starts over), a bad
    `restarts_total` is recounted, and other fields of the wrong type are dropped.
    """

    def __init__(self, path: str | os.PathLike[str], fresh: bool = False, total_steps: int | None = None,
                 writes: WriteHealth | None = None) -> None:
        """`fresh` forgets whatever the file held (--reset-state) without reading it. `total_steps`:
        the run's planned total (--total-steps), kept with a final decision so that a re-plan can
        be told from a restart of the same plan (clear_for_replan). `writes`: where a failed write
        is reported (the watchdog's health)."""
        self.path = Path(path)
        self.total_steps = total_steps
        self.writes = writes or WriteHealth(log)
        if fresh:
            self.data = self._empty()
            self._save()
        else:
            self.data = self._load()

    def _load(self) -> dict[str, Any]:
        try:
            # NaN / Infinity parse (as Python writes them): _repair drops them where they are.
            data = read_json_file(self.path, finite=False)
        except FileNotFoundError:
            return self._empty()
        except ValueError as e:
            raise StateError(
                f"state file {self.path}: {str(e).removeprefix(str(self.path) + ': ')}; it may have held a final "
                "decision, so nothing is relaunched: inspect it, then pass --reset-state to start afresh"
            ) from None
        if not isinstance(data, dict) or data.get("version") != STATE_VERSION:
            raise StateError(
                f"state file {self.path}: not a version-{STATE_VERSION} watchdog state; "
                "pass --reset-state to start afresh"
            )
        final = data.get("final")
        if final is not None and not (isinstance(final, dict) and _plain_int(final.get("exit_code"), signed=True)):
            raise StateError(f"state file {self.path}: field 'final' must hold an integer exit_code "
                             "(it may be a final decision, so nothing is relaunched); pass --reset-state to start afresh")
        return self._repair(data)

    def _repair(self, data: dict[str, Any]) -> dict[str, Any]:
        """Fields other than `final` made usable; each repair is logged."""
        fixes: list[str] = []
        times = data.get("restart_times")
        if not isinstance(times, list):
            fixes.append(f"restart_times {_short(times)} is not a list: no relaunch counted")
            times = []
        limit = time.time() + CLOCK_SKEW_S
        kept = [float(t) for t in times if finite_number(t) is not None and float(t) <= limit]
        if len(kept) != len(times):
            dropped = [t for t in times if finite_number(t) is None or float(t) > limit]
            fixes.append(f"restart_times: dropped {len(dropped)} entr{'y' if len(dropped) == 1 else 'ies'} that are "
                         f"not past times ({_short(dropped)})")
        data["restart_times"] = kept
        if not _plain_int(data.get("starts")):
            fixes.append(f"starts {_short(data.get('starts'))} is not a count: taken as a run in progress (resume)")
            data["starts"] = 1
        if not _plain_int(data.get("restarts_total")):
            fixes.append(f"restarts_total {_short(data.get('restarts_total'))} is not a count: recounted as {len(kept)}")
            data["restarts_total"] = len(kept)
        for key, kinds in (("trainer", dict), ("last_exit", dict), ("instance_id", str), ("origin_instance_id", str)):
            value = data.get(key)
            if value is not None and not isinstance(value, kinds):
                fixes.append(f"{key} {_short(value)} is not a {kinds.__name__}: dropped")
                data[key] = None
        if not isinstance(data.get("replans", []), list):
            fixes.append(f"replans {_short(data.get('replans'))} is not a list: dropped")
            data["replans"] = []
        for fix in fixes:
            log.warning("state file %s: %s", self.path, fix)
        return data

    @staticmethod
    def _empty() -> dict[str, Any]:
        return {
            "version": STATE_VERSION,
            "final": None,
            "starts": 0,
            "restarts_total": 0,
            "restart_times": [],
            "last_exit": None,
            "instance_id": None,
            "origin_instance_id": None,
            "updated": None,
        }

    def _save(self) -> None:
        self.data["updated"] = iso_time()
        try:
            write_json_atomic(self.path, self.data)
        except OSError as e:
            # Supervision goes on; a restarted watchdog would miss this decision, so say it loudly
            # (once: the next decision writes the whole state again).
            self.writes.failed(self.path, e, "the old state file is kept; decisions since are in memory only, until "
                                             "a write succeeds")
        else:
            self.writes.succeeded(self.path)

    # -- reading -------------------------------------------------------------------------------

    @property
    def final(self) -> dict[str, Any] | None:
        return self.data["final"]

    @property
    def starts(self) -> int:
        return int(self.data["starts"])

    @property
    def restarts_total(self) -> int:
        return int(self.data["restarts_total"])

    @property
    def restart_times(self) -> list[float]:
        return [float(t) for t in self.data["restart_times"]]

    @property
    def instance_id(self) -> str | None:
        return self.data.get("instance_id")

    # -- writing -------------------------------------------------------------------------------

    @property
    def trainer(self) -> dict[str, Any] | None:
        """The identity of the trainer started last (see TrainerHandle.identity)."""
        return self.data.get("trainer")

    def record_start(self, trainer: dict[str, Any] | None = None) -> int:
        self.data["starts"] += 1
        self.data["trainer"] = trainer
        self._save()
        return self.starts

    def record_restart(self, when: float, window_seconds: float) -> int:
        """Counts a relaunch; forgets relaunches older than the window (the file stays small)."""
        recent = [t for t in self.restart_times if when - t < window_seconds]
        self.data["restart_times"] = [*recent, when]
        self.data["restarts_total"] += 1
        self._save()
        return self.restarts_total

    @property
    def last_exit(self) -> dict[str, Any] | None:
        """How the previous trainer ended (record_exit), also for a restarted watchdog."""
        return self.data.get("last_exit")

    def record_exit(self, exit_code: int, reason: str, **extra: Any) -> None:
        self.data["last_exit"] = {"exit_code": exit_code, "reason": reason, "time": iso_time(), **extra}
        self._save()

    def record_final(self, exit_code: int, reason: str, **extra: Any) -> None:
        plan = {"total_steps": self.total_steps} if self.total_steps is not None else {}
        self.data["final"] = {"exit_code": exit_code, "reason": reason, "time": iso_time(), **plan, **extra}
        self._save()

    def clear_for_replan(self) -> dict[str, Any] | None:
        """A budget stop (76) or a refused launch (78) whose run is now planned with other total
        steps: that decision is set aside (kept under `replans`) so the trainer is launched for the
        new plan, which it judges against the budget itself. Only for that re-plan: a stop of the
        new plan records its own total, and a restart with the same total honours it. Returns the
        decision set aside, None when nothing was cleared."""
        final = self.final
        if (final is None or self.total_steps is None or final.get("exit_code") not in REPLANNABLE_EXIT_CODES
                or final.get("terminated") or not _plain_int(final.get("total_steps"))
                or final["total_steps"] == self.total_steps):
            return None
        record = {**final, "new_total_steps": self.total_steps, "cleared": iso_time()}
        self.data.setdefault("replans", []).append(record)
        self.data["final"] = None
        self._save()
        return record

    def update_final(self, **fields: Any) -> None:
        if self.data["final"] is None:
            raise RuntimeError("no final decision to update")
        self.data["final"].update(fields)
        self._save()

    @property
    def origin_instance_id(self) -> str | None:
        return self.data.get("origin_instance_id")

    def record_instance(self, instance_id: str, origin_instance_id: str) -> None:
        """Provider mode: the instance followed now, and the --instance-id the run began with."""
        self.data["instance_id"] = instance_id
        self.data["origin_instance_id"] = origin_instance_id
        self._save()
