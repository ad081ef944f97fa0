"""What the watchdog leaves behind: the events file (one JSON line per decision) and the state
file (the decisions a restarted watchdog must honour).

The events file is for people and the run's export: append-only, one fsync per line, so the
last decision before a power cut is on disk. The state file is for the next watchdog: rewritten
atomically, so a reboot mid-write leaves the old decision or the new one, never half of each.
"""

from __future__ import annotations

import json
import logging
import os
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from x1_common.fsutil import write_json_atomic

log = logging.getLogger(__name__)

STATE_VERSION = 1


def iso_time(t: float | None = None) -> str:
    """UTC with milliseconds: two events in the same second stay ordered for a reader."""
    t = time.time() if t is None else t
    return datetime.fromtimestamp(t, timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%f")[:-3] + "Z"


class EventLog:
    """Appends `{"event": ..., "time": ..., **fields}` lines to a JSON-lines file."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)

    def write(self, event: str, **fields: Any) -> dict[str, Any]:
        record = {"event": event, "time": iso_time(), **fields}
        line = json.dumps(record, sort_keys=False) + "\n"
        try:
            # O_APPEND: one write per line, so a reader tailing the file never sees half a line.
            fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            try:
                os.write(fd, line.encode("utf-8"))
                os.fsync(fd)
            finally:
                os.close(fd)
        except OSError as e:
            # A full disk must not kill the supervisor: an unsupervised trainer is worse than a gap.
            log.error("event not written to %s (%s): %s", self.path, e, line.strip())
        return record


def read_events(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """Every event in the file, oldest first (an empty list when there is no file yet)."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        return []
    return [json.loads(line) for line in text.splitlines() if line.strip()]


class StateError(Exception):
    """The state file exists but cannot be trusted; the message names the file and the problem."""


class StateStore:
    """The watchdog's persistent memory.

    `final` is the run-level decision (finished, budget stop, divergence, bad config, given up):
    once set, no watchdog relaunches anything until a person passes --reset-state. `restart_times`
    are the wall-clock times of relaunches, so the give-up window survives a watchdog restart.
    `instance_id` is the instance being followed in provider mode (a Lambda relaunch gets a new id).
    """

    def __init__(self, path: str | os.PathLike[str], fresh: bool = False) -> None:
        """`fresh` forgets whatever the file held (--reset-state) without reading it."""
        self.path = Path(path)
        if fresh:
            self.data = self._empty()
            self._save()
        else:
            self.data = self._load()

    def _load(self) -> dict[str, Any]:
        try:
            text = self.path.read_text(encoding="utf-8")
        except FileNotFoundError:
            return self._empty()
        except OSError as e:
            raise StateError(f"state file {self.path}: cannot read it ({e})") from e
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise StateError(
                f"state file {self.path}: not JSON ({e}); inspect it, then pass --reset-state to start afresh"
            ) from e
        if not isinstance(data, dict) or data.get("version") != STATE_VERSION:
            raise StateError(
                f"state file {self.path}: not a version-{STATE_VERSION} watchdog state; "
                "pass --reset-state to start afresh"
            )
        for key, kind in (("restart_times", list), ("starts", int), ("restarts_total", int)):
            if not isinstance(data.get(key), kind):
                raise StateError(f"state file {self.path}: field {key!r} missing or not a {kind.__name__}")
        final = data.get("final")
        if final is not None and not (isinstance(final, dict) and isinstance(final.get("exit_code"), int)):
            raise StateError(f"state file {self.path}: field 'final' must hold an integer exit_code")
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
            # Supervision goes on; a restarted watchdog would miss this decision, so say it loudly.
            log.error("state file %s not written (%s); decisions since are in memory only", self.path, e)

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

    def record_exit(self, exit_code: int, reason: str) -> None:
        self.data["last_exit"] = {"exit_code": exit_code, "reason": reason, "time": iso_time()}
        self._save()

    def record_final(self, exit_code: int, reason: str, **extra: Any) -> None:
        self.data["final"] = {"exit_code": exit_code, "reason": reason, "time": iso_time(), **extra}
        self._save()

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
