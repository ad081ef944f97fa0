"""Bad input and faults, the hostile-file class: nothing the project loads runs code from a file.

A pickle can name any function to call while it is read. Each test plants one that would create
a marker file (`exec` of an `open(...)`) in a file the project writes and reads back, with the
completion marker's sha256 updated to match (a checksum beside a file proves it whole, not who
wrote it), then runs every command that reads that kind of file. The marker must never appear;
a command that reads the planted file exits 2 naming it, and a command that does not read it
runs as usual. Each test first shows that the payload is live: an ordinary unpickling runs it.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import pickle
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import REPO, TINY_CONFIG, cli_env, run_module, train_args
from x1_pretrain.checkpoint.store import (
    FINAL_OPTIM,
    MARKER,
    MODEL_FILE,
    OPTIM_FILE,
    STATE_FILE,
    CheckpointRefused,
    load_optimizer_file,
)


class RunsCode:
    """Unpickling this calls exec: whoever reads it with pickle creates `marker`."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return (exec, (f"open({self.marker!r}, 'w').close()",))


def torch_payload(marker: Path) -> bytes:
    """An optimizer.pt as torch.save writes it, with the payload inside a plausible state."""
    path = marker.with_name("payload.pt")
    torch.save({"state": {}, "param_groups": [{"lr": 1e-3, "params": []}], "extra": RunsCode(marker)}, path)
    data = path.read_bytes()
    path.unlink()
    return data


def plant(path: Path, data: bytes) -> None:
    """Replace `path` by `data` and, in a step folder, make the completion marker vouch for it."""
    path.write_bytes(data)
    marker = path.parent / MARKER
    if marker.is_file():
        record = json.loads(marker.read_text())
        record["files"][path.name] = hashlib.sha256(data).hexdigest()
        marker.write_text(json.dumps(record))


def assert_payload_is_live(data: bytes, tmp_path: Path, via: str) -> None:
    """An ordinary unpickling (torch.load without weights_only, or pickle.loads) runs the payload:
    the tests below would see its marker if any reader unpickled the file that way."""
    probe = tmp_path / "liveness"
    (probe / "file").parent.mkdir(exist_ok=True)
    (probe / "file").write_bytes(data)
    code = ("import torch,sys; torch.load(sys.argv[1], weights_only=False)" if via == "torch"
            else "import pickle,sys; pickle.loads(open(sys.argv[1],'rb').read())")
    subprocess.run([sys.executable, "-c", code, str(probe / "file")], capture_output=True, env=cli_env(), cwd=REPO,
                   timeout=120)
    assert MARKER_NAME in {p.name for p in tmp_path.iterdir()}, "the planted payload does not run: the test proves nothing"
    (tmp_path / MARKER_NAME).unlink()


MARKER_NAME = "CODE-RAN"


@pytest.fixture
def run_copy(tmp_path: Path, reference_run: Path) -> Path:
    """A finished tiny run (step folders, final.safetensors, final-optimizer.pt, its MLflow store)."""
    root = tmp_path / "run"
    shutil.copytree(reference_run.parent, root, symlinks=True)
    return root


def resume_args(root: Path, data: Path) -> list[str]:
    return train_args(data, root / "ckpt", f"file://{root}/mlruns", "--resume-from-latest", total=50)


def read_all(root: Path, data: Path, out: Path, capsys: pytest.CaptureFixture[str]) -> dict[str, tuple[int, str]]:
    """What every reader of a checkpoint dir makes of `root`: (exit code, what it printed). The
    trainer's resume is its own `resume_point` with this run's config; the tools are their `main`."""
    from x1_pretrain.checkpoint.store import Checkpointer
    from x1_pretrain.config import load_config
    from x1_pretrain.run import export as export_run
    from x1_pretrain.run import hf_export, sample
    from x1_pretrain.train.components import DataOrConfigError
    from x1_pretrain.train.distributed import Dist
    from x1_pretrain.train.resume import resume_point

    ckpt = root / "ckpt"
    out.mkdir(exist_ok=True)
    results: dict[str, tuple[int, str]] = {}
    cfg = load_config(TINY_CONFIG, overrides={"checkpoint.dir": str(ckpt), "train.total_steps": 50})
    try:
        resume_point(argparse.Namespace(resume_from_latest=True, allow_config_change=True), cfg,
                     Checkpointer(ckpt, 3, cfg.model), Dist(rank=0, world_size=1, local_rank=0,
                                                            device=torch.device("cpu")))
        results["resume"] = (0, "")
    except DataOrConfigError as e:
        results["resume"] = (2, str(e))
    tools = {
        "hf_export": lambda: hf_export.main(["--checkpoint", str(ckpt), "--output", str(out / "hf"), "--no-tokenizer"]),
        "sample": lambda: sample.main(["--checkpoint", str(ckpt), "--max-new-tokens", "2"]),
        "export_run": lambda: export_run.main(["--mlflow-uri", f"file://{root}/mlruns", "--ckpt-dir", str(ckpt),
                                               "--output", str(out / "run")]),
    }
    capsys.readouterr()
    for name, call in tools.items():
        code = int(call())
        printed = capsys.readouterr()
        results[name] = (code, printed.out + printed.err)
    return results


def test_resume_refuses_a_pickle_payload_in_optimizer_state_without_running_it(
        run_copy: Path, tmp_path: Path, tiny_data: Path) -> None:
    marker = tmp_path / MARKER_NAME
    payload = torch_payload(marker)
    assert_payload_is_live(payload, tmp_path, "torch")
    newest = sorted((run_copy / "ckpt").glob("step_*"))[-1]
    plant(newest / OPTIM_FILE, payload)
    before = {p: p.read_bytes() for p in newest.iterdir()}

    proc = run_module("x1_pretrain.train", *resume_args(run_copy, tiny_data), timeout=300)

    assert not marker.exists()
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert f"{newest / OPTIM_FILE}: refused" in proc.stderr, proc.stderr[-3000:]
    assert "Nothing in it was run" in proc.stderr
    # Not skipped for the older folder: the run did not go on from step_00000030.
    assert "resuming from" not in proc.stderr
    assert {p: p.read_bytes() for p in newest.iterdir()} == before


def test_no_reader_runs_a_pickle_payload_in_any_torch_file_of_a_checkpoint_dir(
        run_copy: Path, tmp_path: Path, tiny_data: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """optimizer.pt of every step folder and final-optimizer.pt: resume reads the newest optimizer.pt
    and refuses it; the weights readers never open a .pt file and run as usual."""
    marker = tmp_path / MARKER_NAME
    payload = torch_payload(marker)
    ckpt = run_copy / "ckpt"
    planted = [*(d / OPTIM_FILE for d in ckpt.glob("step_*")), ckpt / FINAL_OPTIM]
    assert len(planted) >= 2
    for path in planted:
        plant(path, payload)
        with pytest.raises(CheckpointRefused, match="refused"):  # the trainer's loader, on each file
            load_optimizer_file(path)
    assert not marker.exists()

    results = read_all(run_copy, tiny_data, tmp_path / "out", capsys)

    assert not marker.exists()
    newest = sorted(ckpt.glob("step_*"))[-1]
    code, message = results.pop("resume")
    assert code == 2 and message.startswith(f"{newest / OPTIM_FILE}: refused"), message
    assert {name: code for name, (code, _) in results.items()} == {"hf_export": 0, "sample": 0, "export_run": 0}, results


@pytest.mark.parametrize("fname", [MODEL_FILE, STATE_FILE, MARKER])
def test_no_reader_runs_a_pickle_planted_as_a_safetensors_or_json_file(
        run_copy: Path, tmp_path: Path, tiny_data: Path, capsys: pytest.CaptureFixture[str], fname: str) -> None:
    """Raw pickle bytes as every step folder's weights, trainer state or completion marker, and as
    final.safetensors: safetensors and JSON parsers never call code, and every reader exits 2
    naming what it could not read."""
    marker = tmp_path / MARKER_NAME
    payload = pickle.dumps(RunsCode(marker))
    assert_payload_is_live(payload, tmp_path, "pickle")
    ckpt = run_copy / "ckpt"
    for d in ckpt.glob("step_*"):
        if fname == MARKER:
            (d / MARKER).write_bytes(payload)
        else:
            plant(d / fname, payload)
    (ckpt / "final.safetensors").write_bytes(payload)

    results = read_all(run_copy, tiny_data, tmp_path / "out", capsys)

    assert not marker.exists()
    named = {MODEL_FILE: MODEL_FILE, STATE_FILE: STATE_FILE, MARKER: "completion marker"}[fname]
    for name, (code, message) in results.items():
        assert code == 2, (name, message)
        assert (named if name == "resume" else "final.safetensors") in message, (name, message)


def test_dod_never_unpickles_the_weights_it_checks(run_copy: Path, tmp_path: Path,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    """The DoD's round trip reads a run folder's final.safetensors: pickle bytes there, vouched for
    by the manifest's sha256, fail check 3 naming the file; nothing runs."""
    marker = tmp_path / MARKER_NAME
    from x1_pretrain.run import dod
    from x1_pretrain.run import export as export_run

    out = tmp_path / "export"
    assert export_run.main(["--mlflow-uri", f"file://{run_copy}/mlruns", "--ckpt-dir", str(run_copy / "ckpt"),
                            "--output", str(out / "run")]) == 0
    payload = pickle.dumps(RunsCode(marker))
    run_dir = out / "run"
    (run_dir / "final.safetensors").write_bytes(payload)
    manifest = json.loads((run_dir / "manifest.json").read_text())
    manifest["final_weights"]["sha256"] = hashlib.sha256(payload).hexdigest()
    (run_dir / "manifest.json").write_text(json.dumps(manifest))

    capsys.readouterr()
    code = dod.main([str(run_dir)])

    assert not marker.exists()
    assert code == 1  # the DoD's "a check failed"
    assert "final.safetensors does not load" in capsys.readouterr().out
