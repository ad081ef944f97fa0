"""dod: the six checks of docs/DESIGN.md §8 on the exported tiny run, and on doctored copies of it that
must fail naming the check."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
from PIL import Image
from test_export_run import SpikedRun, flip_byte, spiked_run

from conftest import run_module
from x1_pretrain.run import dod

__all__ = ["spiked_run"]  # the shared session fixture, imported so pytest finds it here

CHECK_NAMES = {1: "manifest complete", 2: "final val loss in band", 3: "final.safetensors round trip",
               4: "spend within cap", 5: "spike post-mortem", 6: "instance terminated"}


@pytest.fixture
def run_copy(spiked_run: SpikedRun, tmp_path: Path) -> Path:
    """A copy of the exported run folder, free to doctor."""
    return Path(shutil.copytree(spiked_run.run_dir, tmp_path / "run"))


def fitted_band(run_dir: Path) -> list[str]:
    """A band around this tiny run's own final val loss (docs/DESIGN.md §8: short runs use their own)."""
    val = json.loads((run_dir / "manifest.json").read_text())["final_val_loss"]
    return ["--band", f"{val - 0.5:.3f}", f"{val + 0.5:.3f}"]


def edit_manifest(run_dir: Path, **changes: object) -> None:
    path = run_dir / "manifest.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))


def test_dod_passes_on_the_spiked_run_with_a_band_fitted_to_it(run_copy: Path) -> None:
    proc = run_module("x1_pretrain.dod", str(run_copy), *fitted_band(run_copy))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "all 6 checks pass" in proc.stdout
    for number, name in CHECK_NAMES.items():
        assert f"{number:>2}  {name}" in proc.stdout and "FAIL" not in proc.stdout
    report = json.loads((run_copy / "dod.json").read_text())
    assert report["passed"] is True and [c["ok"] for c in report["checks"]] == [True] * 6


def _no_postmortem(d: Path) -> list[str]:
    (d / "spike-postmortem.md").unlink()
    return fitted_band(d)


def _spend_over_cap(d: Path) -> list[str]:
    edit_manifest(d, spent_usd=40.0)
    return fitted_band(d)


def _altered_weights(d: Path) -> list[str]:
    flip_byte(d / "final.safetensors")
    return fitted_band(d)


def _no_termination(d: Path) -> list[str]:
    (d / "termination.json").unlink()
    return fitted_band(d)


def _default_band(d: Path) -> list[str]:
    return []  # the 50M band [3.20, 3.50]: a tiny run's val loss (~6) is far above it


@pytest.mark.parametrize(("doctor", "failing", "reason"), [
    (_no_postmortem, 5, "no spike-postmortem.md"),
    (_spend_over_cap, 4, "spent $40.00 is over the cap $35.00"),
    (_default_band, 2, "is outside [3.20, 3.50]"),
    (_altered_weights, 3, "differs from the manifest's"),
    (_no_termination, 6, "no termination.json and no termination.png"),
], ids=["postmortem-missing", "spend-over-cap", "val-loss-out-of-band", "weights-altered", "no-termination-record"])
def test_dod_fails_naming_the_check_a_doctored_copy_breaks(run_copy: Path, doctor: Callable[[Path], list[str]],
                                                           failing: int, reason: str,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    args = doctor(run_copy)
    assert dod.main([str(run_copy), *args]) == 1
    out = capsys.readouterr().out
    line = next(x for x in out.splitlines() if x.startswith(f"{failing:>2}  {CHECK_NAMES[failing]}"))
    assert "FAIL" in line and reason in line, line
    assert f"1 of 6 checks FAIL: {failing} ({CHECK_NAMES[failing]})" in out
    report = json.loads((run_copy / "dod.json").read_text())
    assert report["passed"] is False and [c["number"] for c in report["checks"] if not c["ok"]] == [failing]


def test_unknown_spend_fails_check_4_with_the_exports_reason(run_copy: Path, capsys: pytest.CaptureFixture[str]) -> None:
    edit_manifest(run_copy, spent_usd=None, spent_usd_reason="no budget file (the sidecar writes /workspace/budget.json)")
    assert dod.main([str(run_copy), *fitted_band(run_copy)]) == 1
    assert "total spend unknown: no budget file" in capsys.readouterr().out


def test_cap_comes_from_the_flag_before_the_recorded_cap(run_copy: Path) -> None:
    manifest = json.loads((run_copy / "manifest.json").read_text())
    assert dod.check_spend(run_copy, manifest, None).ok  # $1.37 under the recorded $35
    low = dod.check_spend(run_copy, manifest, 1.0)
    assert not low.ok and "over the cap $1.00 (--cap-usd)" in low.reason


LAMBDA_TERMINATE = {"data": {"terminated_instances": [{"id": "inst-1", "status": "terminating"}]}}
RUNPOD_TERMINATE = {"data": {"podTerminate": None}}


def read_back(provider: str, after: dict, instance_id: str = "inst-1") -> dict:
    """A termination record as the watchdog and `x1 down` write it: the calls, then what was read back."""
    response = LAMBDA_TERMINATE if provider == "lambda" else RUNPOD_TERMINATE
    return {"provider": provider, "instance_id": instance_id, "confirmed": True, "response": response,
            "instance_after": after}


@pytest.mark.parametrize("record", [
    read_back("lambda", {"status": "terminated", "raw_status": "terminated", "raw": {"id": "inst-1", "status": "terminated"}}),
    read_back("lambda", {"status": "not-found", "instance_id": "inst-1", "http_status": 404,
                         "api_error": {"code": "global/object-does-not-exist", "message": "Specified instance does not exist."}}),
    read_back("runpod", {"status": "terminated", "raw_status": "TERMINATED", "raw": {"id": "inst-1", "desiredStatus": "TERMINATED"}}),
    read_back("runpod", {"status": "not-found", "instance_id": "inst-1", "api_error": {"data": {"pod": None}}}),
    read_back("runpod", {"status": "not-found", "instance_id": "inst-1", "api_error": [{"message": "Pod not found"}]}),
], ids=["lambda-read-back-terminated", "lambda-api-not-found", "runpod-read-back-terminated", "runpod-null-pod",
        "runpod-graphql-not-found"])
def test_check_6_passes_on_the_providers_state_read_back_after_the_terminate(tmp_path: Path, record: dict) -> None:
    (tmp_path / "termination.json").write_text(json.dumps(record))
    check = dod.check_termination(tmp_path)
    assert check.ok, check.reason
    assert "read back after the terminate" in check.reason


@pytest.mark.parametrize("record", [
    LAMBDA_TERMINATE,
    RUNPOD_TERMINATE,
    {"provider": "runpod", "instance_id": "inst-1", "response": RUNPOD_TERMINATE},
    {"data": {"id": "inst-1", "status": "terminated"}},
    read_back("runpod", {"status": "running", "raw_status": "RUNNING", "raw": {"id": "inst-1", "desiredStatus": "RUNNING"}}),
    read_back("lambda", {"status": "terminating", "raw_status": "terminating", "raw": {"id": "inst-1"}}),
    read_back("lambda", {"status": "terminated", "raw_status": "terminated", "raw": {"id": "other-9"}}),
    read_back("lambda", {"status": "not-found", "instance_id": "inst-1", "http_status": 404, "api_error": None,
                         "message": "HTTP 404: not the lambda API's own answer (text/html)"}),
    read_back("lambda", {"status": "not-found", "instance_id": "other-9",
                         "api_error": {"code": "global/object-does-not-exist"}}),
    read_back("runpod", {"status": "unread", "instance_id": "inst-1", "error": "timed out"}),
], ids=["lambda-terminate-answer-alone", "runpod-terminate-answer-alone", "runpod-answer-without-read-back",
        "bare-instance-record", "runpod-still-running-after-podTerminate", "lambda-terminating",
        "terminated-record-of-another-id", "a-404-that-is-not-the-apis", "not-found-for-another-id", "unread"])
def test_check_6_fails_without_the_providers_terminated_state_for_that_id(tmp_path: Path, record: dict) -> None:
    (tmp_path / "termination.json").write_text(json.dumps(record))
    check = dod.check_termination(tmp_path)
    assert not check.ok and "shows no terminated instance" in check.reason


def test_a_screenshot_is_accepted_only_when_it_is_a_png_with_a_note_and_says_it_is_not_verified(tmp_path: Path) -> None:
    Image.new("RGB", (64, 48), "white").save(tmp_path / "termination.png")
    alone = dod.check_termination(tmp_path)
    assert not alone.ok and "has no termination-note.txt beside it" in alone.reason
    (tmp_path / "termination-note.txt").write_text("Lambda instance 0920 terminated 2026-12-04 14:02 UTC; dashboard shows it.\n")
    noted = dod.check_termination(tmp_path)
    assert noted.ok and "NOT verified" in noted.reason
    (tmp_path / "termination.png").write_bytes(b"not a picture")
    check = dod.check_termination(tmp_path)
    assert not check.ok and "not a PNG" in check.reason


def test_usage_errors_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert dod.main([str(tmp_path / "missing")]) == 2
    assert "is not a folder" in capsys.readouterr().err
    assert dod.main([str(tmp_path), "--band", "3.5", "3.2"]) == 2
    assert "LO must be below HI" in capsys.readouterr().err
    assert not (tmp_path / "dod.json").exists()


def test_a_folder_that_is_not_a_run_folder_exits_2_and_gets_no_dod_json(tmp_path: Path,
                                                                         capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "notes.txt").write_text("someone's folder\n")
    assert dod.main([str(tmp_path)]) == 2
    assert "is not a run folder (no manifest.json)" in capsys.readouterr().err
    assert [p.name for p in tmp_path.iterdir()] == ["notes.txt"]


def test_on_the_instance_check_6_is_pending_and_a_recheck_after_the_terminate_passes_it(
        run_copy: Path, capsys: pytest.CaptureFixture[str]) -> None:
    record = (run_copy / "termination.json").read_text()
    (run_copy / "termination.json").unlink()
    assert dod.main([str(run_copy), *fitted_band(run_copy), "--termination-pending"]) == dod.EXIT_PENDING
    out = capsys.readouterr().out
    line = next(x for x in out.splitlines() if x.startswith(" 6  instance terminated"))
    assert "PENDING" in line and "FAIL" not in out and "5 of 6 checks pass" in out
    report = json.loads((run_copy / "dod.json").read_text())
    assert report["passed"] is False and report["pending"] == [6]

    assert dod.recheck_termination(run_copy).ok is False  # nothing new: still not terminated
    (run_copy / "termination.json").write_text(record)  # what the watchdog writes after its terminate
    assert dod.recheck_termination(run_copy).ok is True
    report = json.loads((run_copy / "dod.json").read_text())
    assert report["passed"] is True and report["pending"] == [] and "6" in report["rechecked_utc"]

    # Pending never hides a real failure: another failing check still exits 1.
    (run_copy / "termination.json").unlink()
    (run_copy / "spike-postmortem.md").unlink()
    assert dod.main([str(run_copy), *fitted_band(run_copy), "--termination-pending"]) == 1
