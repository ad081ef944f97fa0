"""The fetched run folder checked on the laptop: dod's six checks, and the termination record added.

Check 3 (final.safetensors round trip) loads the weights with torch. Where torch is not installed
(`pip install .` alone), the file's sha256 is still compared with the manifest's, and the round
trip's result is the one the instance recorded in dod.json, said so in the reason.
"""

from __future__ import annotations

import importlib.util
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from x1_common.contracts import scrub_record
from x1_common.fsutil import sha256_file, write_json_atomic
from x1_pretrain.run import dod
from x1_pretrain.run.dod import termination_facts


@dataclass(frozen=True)
class Verdict:
    ok: bool
    text: str


def recorded_band(run_dir: Path) -> tuple[float, float] | None:
    """The band dod used on the instance, for a folder whose manifest declares none (older runs)."""
    try:
        band = json.loads((run_dir / "dod.json").read_text(encoding="utf-8"))["band"]
        return float(band[0]), float(band[1])
    except (OSError, ValueError, KeyError, TypeError, IndexError):
        return None


def weights_check(run_dir: Path, manifest: dict[str, Any] | None) -> dod.Check:
    if importlib.util.find_spec("torch") is not None:
        return dod.check_weights(run_dir, manifest)
    name = "final.safetensors round trip"
    path = run_dir / "final.safetensors"
    expected = ((manifest or {}).get("final_weights") or {}).get("sha256")
    if not path.is_file() or not expected:
        return dod.Check(3, name, False, "no final.safetensors or no sha256 for it in the manifest")
    actual = sha256_file(path)
    if actual != expected:
        return dod.Check(3, name, False, f"sha256 {actual[:12]} differs from the manifest's {expected[:12]}")
    try:
        saved = json.loads((run_dir / "dod.json").read_text(encoding="utf-8"))
        there = next(c for c in saved["checks"] if c["number"] == 3)
    except (OSError, ValueError, KeyError, StopIteration):
        there = None
    if there is None or not there.get("ok"):
        return dod.Check(3, name, False, f"sha256 {actual[:12]} matches, but no passing round trip is recorded and "
                         "torch is not installed here to do it")
    return dod.Check(3, name, True, f"sha256 {actual[:12]} matches the manifest; the round trip passed on the "
                     "instance (torch is not installed here)")


def verify_run(run_dir: Path, band: tuple[float, float] | list[float] | None, termination_pending: bool) -> Verdict:
    """dod's checks on the folder; with `termination_pending`, check 6 may be pending (exit 3)."""
    flag = (float(band[0]), float(band[1])) if band is not None else recorded_band(run_dir)
    manifest, problem = dod._load_manifest(run_dir)
    judged, note = dod.judged_band(manifest, flag)
    checks = [
        dod.check_manifest(manifest, problem),
        dod.check_val_loss(manifest, judged, note),
        weights_check(run_dir, manifest),
        dod.check_spend(run_dir, manifest, None),
        dod.check_postmortem(run_dir),
        dod.check_termination(run_dir),
    ]
    if termination_pending:
        checks = [dod.mark_pending(c) if c.number == dod.TERMINATION_CHECK else c for c in checks]
    ok = all(c.ok or c.pending for c in checks)
    return Verdict(ok, f"dod on {run_dir} (band {judged.low:g}-{judged.high:g}, {judged.source}):\n{dod.render(checks)}")


def add_termination(run_dir: Path, record: dict[str, Any]) -> str:
    """The provider's answer as run_dir/termination.json, the manifest's `termination` and dod.json's
    check 6 updated (what the watchdog's --terminate-on-finish does on the instance)."""
    target = run_dir / "termination.json"
    write_json_atomic(target, scrub_record(record))
    manifest_path = run_dir / "manifest.json"
    if manifest_path.is_file():
        manifest = json.loads(manifest_path.read_text(encoding="utf-8"))
        manifest["termination"] = {**(termination_facts(target) or {}), "added_by": "x1 down, after the fetch"}
        manifest.setdefault("files", {})["termination.json"] = sha256_file(target)
        write_json_atomic(manifest_path, manifest)
    check = dod.recheck_termination(run_dir)
    if check is None:
        check = dod.check_termination(run_dir)
    return f"check 6 {'PASS' if check.ok else 'FAIL'}: {check.reason}"
