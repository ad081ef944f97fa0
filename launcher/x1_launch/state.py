"""The laptop's record of the instances `x1 launch` rented: one JSON file per instance.

    ~/.x1/instances/<id>.json     provider, id, name, phase, what was last observed, address, stage
    ~/.x1/instances/<name>.json   the same before the provider has given an id (phase "creating")
    ~/.x1/instances/<id>/         its known_hosts, the off-host watchdog's state, events and log
    ~/.x1/current                 the record `status`, `logs`, `fetch` and `down` use by default

A record exists before the instance does: `x1 launch` writes it (durably: temp file, fsync,
rename, fsync of the folder) with the instance's name, type and price before it asks the provider
to create anything, so a launch killed at any moment (SIGKILL included) leaves a record by which
`x1 status` and `x1 down` find what was created, by its name at the provider. Its phase:

    creating        written before the create call; no id yet
    created         the provider gave the id (in its answer, or listed under the name)
    not-created     the provider refused the create, or lists nothing under the name
    terminate-sent  a terminate went out; the provider still listed it billing when last read
    terminated      read back from the provider: its terminated state, or its own not-found

Every phase but "terminated" and "not-created" is open: an instance that may bill. --state-dir
or X1_STATE_DIR choose another folder than ~/.x1. No secret is ever written here.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from x1_common.fsutil import fsync_dir, write_json_atomic, write_text_atomic

STATE_DIR_ENV = "X1_STATE_DIR"
PHASES = ("creating", "created", "not-created", "terminate-sent", "terminated")
CLOSED_PHASES = ("not-created", "terminated")


class StateError(ValueError):
    """No such instance, or a record that cannot be read; the message says which."""


@dataclass
class InstanceRecord:
    provider: str
    instance_id: str  # "" until the provider has given one
    api_url: str | None  # None: the real API
    instance_type: str
    region: str | None
    price_usd_per_hr: float | None
    stack: str  # "compose" or "processes"
    ssh_user: str
    ssh_key: str  # the private key file (a path, never its content)
    remote_repo: str  # where the repository lies on the instance
    workspace: str  # the stack's workspace on the instance
    host: str | None = None
    port: int | None = None
    stage: str = "launched"  # creating, launched, booting, ssh, upload, start, running, down
    launched_utc: str = ""  # when the record was written, before the create call
    watchdog_pid: int | None = None
    watchdog_start_ticks: int | None = None
    terminated: bool = False  # phase == "terminated", kept for older readers
    fetched_to: str | None = None
    notes: list[str] = field(default_factory=list)
    name: str = ""  # the name x1 gave it at the provider (x1-<time>): how it is found without an id
    phase: str = ""  # see the module's docstring ("" in a record written before phases: from `terminated`)
    market: str | None = None  # on-demand or interruptible
    gpu_description: str | None = None  # the provider's words for its GPU
    observed: dict[str, Any] | None = None  # the provider's state when last read: time, status, raw_status, how
    terminate_sent_utc: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.phase:
            self.phase = "terminated" if self.terminated else ("created" if self.instance_id else "creating")

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> InstanceRecord:
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in known})

    @property
    def key(self) -> str:
        """The record's file name: the id once known, the name before."""
        return self.instance_id or self.name

    @property
    def open(self) -> bool:
        """May it bill? Everything but a confirmed end or a create that did not happen."""
        return self.phase not in CLOSED_PHASES

    @property
    def label(self) -> str:
        """The instance in words: its full id, or its name while the id is not known."""
        return self.instance_id if self.instance_id else f"named {self.name} (id not known yet)"

    def observe(self, status: str, raw_status: str | None, how: str) -> None:
        self.observed = {"time": utc_now(), "status": status, "raw_status": raw_status, "how": how}

    def set_phase(self, phase: str) -> None:
        if phase not in PHASES:
            raise ValueError(f"phase {phase!r} is not one of {', '.join(PHASES)}")
        self.phase = phase
        self.terminated = phase == "terminated"


@dataclass(frozen=True)
class StateDir:
    root: Path

    @classmethod
    def choose(cls, option: str | None) -> StateDir:
        text = option or os.environ.get(STATE_DIR_ENV) or str(Path.home() / ".x1")
        return cls(Path(text).expanduser().resolve())

    def record_path(self, key: str) -> Path:
        return self.root / "instances" / f"{key}.json"

    def folder(self, instance_id: str) -> Path:
        """The instance's own files: known_hosts, the off-host watchdog's records."""
        path = self.root / "instances" / instance_id
        path.mkdir(parents=True, exist_ok=True, mode=0o700)
        return path

    def known_hosts(self, instance_id: str) -> Path:
        return self.folder(instance_id) / "known_hosts"

    def save(self, record: InstanceRecord, *, make_current: bool = False) -> None:
        """The record on disk, durably (it may be all that is left of a launch killed a moment later).
        Once the id is known, the record written under the name alone is removed, after the new one."""
        if not record.key:
            raise ValueError("a record needs an instance id or a name")
        (self.root / "instances").mkdir(parents=True, exist_ok=True, mode=0o700)
        write_json_atomic(self.record_path(record.key), asdict(record))
        if make_current:
            write_text_atomic(self.root / "current", record.key + "\n")
        if record.instance_id and record.name and record.name != record.instance_id:
            pending = self.record_path(record.name)
            if pending.exists():
                if self._current_key() == record.name:
                    write_text_atomic(self.root / "current", record.instance_id + "\n")
                pending.unlink()
                fsync_dir(pending.parent)

    def _current_key(self) -> str | None:
        try:
            return (self.root / "current").read_text(encoding="utf-8").strip() or None
        except OSError:
            return None

    def load(self, key: str | None) -> InstanceRecord:
        """The record named by an id or a name, or the current one."""
        if key is None:
            key = self._current_key()
            if key is None:
                raise StateError(f"no instance recorded in {self.root}: launch one with `x1 launch`, "
                                 "or name one with --instance") from None
        path = self.record_path(key)
        try:
            return self._read(path)
        except FileNotFoundError:
            pass
        # A name whose record now carries the id (the id became known after `current` was read).
        for rec in self.records():
            if key in (rec.instance_id, rec.name):
                return rec
        known = ", ".join(self.keys()) or "none"
        raise StateError(f"no instance {key!r} recorded in {self.root} (recorded: {known})")

    def _read(self, path: Path) -> InstanceRecord:
        try:
            return InstanceRecord.from_json(json.loads(path.read_text(encoding="utf-8")))
        except FileNotFoundError:
            raise
        except (OSError, ValueError, TypeError) as e:
            raise StateError(f"{path}: cannot read it ({e})") from None

    def keys(self) -> list[str]:
        folder = self.root / "instances"
        return sorted(p.stem for p in folder.glob("*.json")) if folder.is_dir() else []

    def ids(self) -> list[str]:
        return self.keys()

    def records(self) -> list[InstanceRecord]:
        """Every readable record, oldest launch first. A record under a name whose id-record also
        exists (a launch stopped between the two writes) is left out."""
        out = []
        for key in self.keys():
            with contextlib.suppress(StateError, FileNotFoundError):
                out.append(self._read(self.record_path(key)))
        named = {r.name for r in out if r.instance_id}
        out = [r for r in out if r.instance_id or r.name not in named]
        return sorted(out, key=lambda r: (r.launched_utc, r.key))

    def open_records(self) -> list[InstanceRecord]:
        return [r for r in self.records() if r.open]


def utc_now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
