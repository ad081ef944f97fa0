"""The laptop's record of the instances `x1 launch` rented: one JSON file per instance.

    ~/.x1/instances/<id>.json     provider, id, address, stage, what is on it (written atomically)
    ~/.x1/instances/<id>/         its known_hosts, the off-host watchdog's state, events and log
    ~/.x1/current                 the id `status`, `logs`, `fetch` and `down` use by default

The record is written the moment the provider returns an id, before anything else happens, so
an interrupted launch never leaves an instance nobody knows about. --state-dir or X1_STATE_DIR
choose another folder than ~/.x1. No secret is ever written here.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from x1_common.fsutil import write_json_atomic, write_text_atomic

STATE_DIR_ENV = "X1_STATE_DIR"


class StateError(ValueError):
    """No such instance, or a record that cannot be read; the message says which."""


@dataclass
class InstanceRecord:
    provider: str
    instance_id: str
    api_url: str | None  # None: the real API
    instance_type: str
    region: str | None
    price_usd_per_hr: float | None
    stack: str  # "compose" or "processes"
    ssh_user: str
    ssh_key: str  # the private key file (a path, never its content)
    remote_repo: str  # where the repository lies on the instance
    workspace: str  # the stack's /workspace on the instance
    host: str | None = None
    port: int | None = None
    stage: str = "launched"  # launched, ssh, uploaded, started, running, down
    launched_utc: str = ""
    watchdog_pid: int | None = None
    watchdog_start_ticks: int | None = None
    terminated: bool = False
    fetched_to: str | None = None
    notes: list[str] = field(default_factory=list)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> InstanceRecord:
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in known})


@dataclass(frozen=True)
class StateDir:
    root: Path

    @classmethod
    def choose(cls, option: str | None) -> StateDir:
        text = option or os.environ.get(STATE_DIR_ENV) or str(Path.home() / ".x1")
        return cls(Path(text).expanduser().resolve())

    def record_path(self, instance_id: str) -> Path:
        return self.root / "instances" / f"{instance_id}.json"

    def folder(self, instance_id: str) -> Path:
        """The instance's own files: known_hosts, the off-host watchdog's records."""
        path = self.root / "instances" / instance_id
        path.mkdir(parents=True, exist_ok=True, mode=0o700)
        return path

    def known_hosts(self, instance_id: str) -> Path:
        return self.folder(instance_id) / "known_hosts"

    def save(self, record: InstanceRecord, *, make_current: bool = False) -> None:
        self.root.mkdir(parents=True, exist_ok=True, mode=0o700)
        write_json_atomic(self.record_path(record.instance_id), asdict(record))
        if make_current:
            write_text_atomic(self.root / "current", record.instance_id + "\n")

    def load(self, instance_id: str | None) -> InstanceRecord:
        """The named instance, or the current one."""
        if instance_id is None:
            try:
                instance_id = (self.root / "current").read_text(encoding="utf-8").strip()
            except OSError:
                raise StateError(f"no instance recorded in {self.root}: launch one with `x1 launch`, "
                                 "or name one with --instance") from None
        path = self.record_path(instance_id)
        try:
            return InstanceRecord.from_json(json.loads(path.read_text(encoding="utf-8")))
        except FileNotFoundError:
            known = ", ".join(self.ids()) or "none"
            raise StateError(f"no instance {instance_id!r} recorded in {self.root} (recorded: {known})") from None
        except (OSError, ValueError, TypeError) as e:
            raise StateError(f"{path}: cannot read it ({e})") from None

    def ids(self) -> list[str]:
        folder = self.root / "instances"
        return sorted(p.stem for p in folder.glob("*.json")) if folder.is_dir() else []


def utc_now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
