"""The check every money test ends with: nothing the fake provider holds bills without a local
record that says it may.

    assert_fake_holds_nothing_unrecorded(fake, state_dir)                  # x1's records
    assert_fake_holds_nothing_unrecorded(fake, {"inst-1": termination})    # the watchdog's termination.json

It asks the fake provider (budget_sidecar.fake_billing, through its /_state) for every instance it
holds. Each one still billing must be named by a record that leaves it open: an x1 record (by its
id, or by its name while the id was never learnt) in any phase but "terminated" or "not-created",
or a termination record that is not `confirmed`. A record that says "terminated" for an instance
the provider bills for, or no record at all, fails with what the fake holds and what the records say.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

CLOSED_PHASES = ("terminated", "not-created")


def x1_records(state_dir: Path) -> list[dict[str, Any]]:
    folder = Path(state_dir) / "instances"
    return [json.loads(p.read_text()) for p in sorted(folder.glob("*.json"))] if folder.is_dir() else []


def _open(record: dict[str, Any]) -> bool:
    if "confirmed" in record:  # a termination record (the watchdog's or x1 down's)
        return record["confirmed"] is not True
    phase = record.get("phase") or ("terminated" if record.get("terminated") else "created")
    return phase not in CLOSED_PHASES


def assert_fake_holds_nothing_unrecorded(fake: Any, *sources: Path | dict[str, dict[str, Any]]) -> None:
    records: list[dict[str, Any]] = []
    for source in sources:
        if isinstance(source, dict):
            records += [{**r, "instance_id": r.get("instance_id", iid)} for iid, r in source.items()]
        else:
            records += x1_records(source)
    open_ids = {r.get("instance_id") for r in records if _open(r) and r.get("instance_id")}
    open_names = {r.get("name") for r in records if _open(r) and not r.get("instance_id") and r.get("name")}
    held = fake.state()["instances"]
    unrecorded = {iid: inst for iid, inst in held.items()
                  if inst["billing"] and iid not in open_ids and inst.get("name") not in open_names}
    shown = [{k: r.get(k) for k in ("instance_id", "name", "phase", "confirmed", "terminated")} for r in records]
    assert not unrecorded, (f"the provider bills for {sorted(unrecorded)} ({unrecorded}) with no local record saying so; "
                            f"the records: {shown}")
