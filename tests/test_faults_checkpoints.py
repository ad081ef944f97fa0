"""Bad input and faults, the checkpoint class: every way a checkpoint folder can be broken, and
every path that reads one (the trainer's resume, export_run's weights, sample / hf_export's
weights path), plus a full disk during a save and a restart from scratch under the watchdog.

The contract: a reader takes the newest folder that verifies (a broken newer one skipped with a
warning), or, when step folders exist and none verifies, refuses naming each folder and what is
wrong with it; in every case nothing on disk changes (the tree is hashed before and after).
"""

from __future__ import annotations

import argparse
import errno
import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import REPO, TINY_CONFIG, cli_env, run_module, start_trainer, train_args
from x1_common.contracts import ExitCode, Heartbeat
from x1_pretrain.checkpoint import store as ckpt_mod
from x1_pretrain.checkpoint.load import resolve_weights_path
from x1_pretrain.checkpoint.store import (
    MARKER,
    MODEL_FILE,
    OPTIM_FILE,
    STATE_FILE,
    Checkpointer,
    CheckpointSpaceError,
    TrainerState,
    capture_rng,
)
from x1_pretrain.config import ConfigError, load_config
from x1_pretrain.model.transformer import Transformer
from x1_pretrain.run.facts import choose_weights
from x1_pretrain.run.record import ExportError
from x1_pretrain.train import distributed as D
from x1_pretrain.train.components import DataOrConfigError
from x1_pretrain.train.resume import resume_point

STEPS = (10, 20, 30)
# The tiny config with a small vocabulary: checkpoints of ~0.5 MB, so that a hundred cases copy fast.
CFG = load_config(TINY_CONFIG, overrides={"train.total_steps": 40, "model.vocab_size": 512})


def tree_hash(root: Path) -> dict[str, str]:
    """Every entry under root: a file's sha256, or what else it is. Nothing may change."""
    out = {}
    for p in sorted(root.rglob("*")):
        rel = p.relative_to(root).as_posix()
        if p.is_symlink():
            out[rel] = "symlink:" + os.readlink(p)
        elif p.is_fifo():
            out[rel] = "fifo"
        elif p.is_dir():
            out[rel] = "dir"
        else:
            out[rel] = hashlib.sha256(p.read_bytes()).hexdigest()
    return out


@pytest.fixture(scope="module")
def pristine(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Three complete checkpoints of one tiny run (real weights, real AdamW state)."""
    root = tmp_path_factory.mktemp("pristine") / "ckpt"
    torch.manual_seed(0)
    model = Transformer(CFG.model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.zeros(1, 8, dtype=torch.long), torch.zeros(1, 8, dtype=torch.long)).backward()
    opt.step()
    ck = Checkpointer(root, keep_last=5, model_cfg=CFG.model)
    for step in STEPS:
        state = TrainerState(step=step, tokens_seen=step * 512, config_hash=CFG.config_hash(), config=CFG.resolved(),
                             sampler={"seed": 42, "next_step": step}, rng=capture_rng())
        ck.save(step, model.state_dict(), opt.state_dict(), state)
    return root


@pytest.fixture
def run_dir(tmp_path: Path, pristine: Path) -> Path:
    dst = tmp_path / "ckpt"
    shutil.copytree(pristine, dst, symlinks=True)
    return dst


def rehash(folder: Path, fname: str) -> None:
    """Rewrite the marker's sha256 of `fname` to match: damage that the hashes alone cannot see."""
    marker = json.loads((folder / MARKER).read_text())
    marker["files"][fname] = hashlib.sha256((folder / fname).read_bytes()).hexdigest()
    (folder / MARKER).write_text(json.dumps(marker))


def _state_edit(change: Callable[[dict], None]) -> Callable[[Path], None]:
    def apply(folder: Path) -> None:
        state = json.loads((folder / STATE_FILE).read_text())
        change(state)
        (folder / STATE_FILE).write_text(json.dumps(state))
        rehash(folder, STATE_FILE)
    return apply


def _marker(text: str | bytes) -> Callable[[Path], None]:
    def apply(folder: Path) -> None:
        data = text if isinstance(text, bytes) else text.replace("STEP", str(int(folder.name[5:])))
        (folder / MARKER).write_bytes(data if isinstance(data, bytes) else data.encode())
    return apply


def _replace(fname: str, how: str) -> Callable[[Path], None]:
    def apply(folder: Path) -> None:
        f = folder / fname
        if how == "truncate":
            f.write_bytes(f.read_bytes()[: max(1, f.stat().st_size // 3)])
        elif how == "empty":
            f.write_bytes(b"")
        elif how == "flip":
            data = bytearray(f.read_bytes())
            data[len(data) // 2] ^= 0xFF
            f.write_bytes(bytes(data))
        elif how == "delete":
            f.unlink()
        elif how == "folder":
            f.unlink()
            f.mkdir()
        elif how == "fifo":
            f.unlink()
            os.mkfifo(f)
        elif how == "dangling":
            f.unlink()
            f.symlink_to(folder / "nowhere")
    return apply


def _folder_is_a_file(folder: Path) -> None:
    shutil.rmtree(folder)
    folder.write_text("not a checkpoint")


# Each way a folder can be broken. The COMPLETE.json cases are valid JSON of the wrong shape, or
# no JSON at all; the trainer_state cases keep the hashes consistent, so only the content check sees them.
CORRUPTIONS: dict[str, Callable[[Path], None]] = {
    **{f"{f} {how}": _replace(f, how) for f in (MODEL_FILE, OPTIM_FILE, STATE_FILE)
       for how in ("truncate", "empty", "flip", "delete", "folder", "fifo", "dangling")},
    **{f"{MARKER} {how}": _replace(MARKER, how) for how in ("truncate", "empty", "delete", "folder", "fifo")},
    "marker is a list": _marker("[1, 2, 3]"),
    "marker files is a list": _marker('{"step": STEP, "files": ["model.safetensors"]}'),
    "marker files empty": _marker('{"step": STEP, "files": {}}'),
    "marker files a string": _marker('{"step": STEP, "files": "all of them"}'),
    "marker step wrong": lambda f: (_marker(json.dumps({**json.loads((f / MARKER).read_text()), "step": 999})))(f),
    "marker step a string": lambda f: _marker(json.dumps({**json.loads((f / MARKER).read_text()),
                                                          "step": str(int(f.name[5:]))}))(f),
    "marker lists an escaping file": lambda f: _marker(json.dumps({**json.loads((f / MARKER).read_text()), "files": {
        **json.loads((f / MARKER).read_text())["files"], "../../outside": "0" * 64}}))(f),
    "marker hash not hex": lambda f: _marker(json.dumps({**json.loads((f / MARKER).read_text()), "files": {
        **json.loads((f / MARKER).read_text())["files"], MODEL_FILE: 12345}}))(f),
    "marker duplicate key": lambda f: _marker((f / MARKER).read_text().replace('"files"', '"files": {}, "files"', 1))(f),
    "marker NaN": _marker('{"step": NaN, "files": {}}'),
    "marker not UTF-8": _marker(b'{"step": \xff}'),
    "marker nested deep": _marker("[" * 10000 + "]" * 10000),
    "state step mismatch": _state_edit(lambda s: s.update(step=s["step"] + 1)),
    "state step a string": _state_edit(lambda s: s.update(step=str(s["step"]))),
    "state config_hash missing": _state_edit(lambda s: s.pop("config_hash")),
    "state rng a list": _state_edit(lambda s: s.update(rng=[1, 2])),
    "state negative tokens": _state_edit(lambda s: s.update(tokens_seen=-5)),
    "state is a list": lambda f: ((f / STATE_FILE).write_text("[]"), rehash(f, STATE_FILE)),
    "state not UTF-8": lambda f: ((f / STATE_FILE).write_bytes(b"\xff\xfe"), rehash(f, STATE_FILE)),
    "folder is a file": _folder_is_a_file,
}

ARGS = argparse.Namespace(resume_from_latest=True, allow_config_change=False)
ONE = D.Dist(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))


def every_reader(root: Path) -> dict[str, object]:
    """What each checkpoint-reading path makes of `root`: the folder it picked, or its error."""
    ck = Checkpointer(root, keep_last=3, model_cfg=CFG.model)
    out: dict[str, object] = {}
    try:
        loaded = resume_point(ARGS, CFG, ck, ONE)
        out["resume"] = loaded.path.name if loaded else None
    except DataOrConfigError as e:
        out["resume"] = e
    try:
        out["weights"] = resolve_weights_path(root).parent.name  # sample, hf_export
    except (ConfigError, FileNotFoundError) as e:
        out["weights"] = e
    try:
        out["export"] = choose_weights(root, "budget-stop").path.parent.name
    except ExportError as e:
        out["export"] = e
    return out


@pytest.mark.parametrize("kind", sorted(CORRUPTIONS))
def test_a_broken_newest_checkpoint_is_skipped_for_the_older_one_by_every_reader(run_dir: Path, kind: str) -> None:
    CORRUPTIONS[kind](run_dir / "step_00000030")
    before = tree_hash(run_dir)
    out = every_reader(run_dir)
    assert out == {"resume": "step_00000020", "weights": "step_00000020", "export": "step_00000020"}, (kind, out)
    assert tree_hash(run_dir) == before


@pytest.mark.parametrize("kind", sorted(CORRUPTIONS))
def test_when_no_checkpoint_verifies_every_reader_refuses_naming_each_folder(run_dir: Path, kind: str) -> None:
    kinds = sorted(CORRUPTIONS)
    others = [k for k in kinds if k != kind]
    # This kind in the newest folder, two other kinds in the older ones: each must be named with its own reason.
    i = kinds.index(kind)
    for step, how in zip(STEPS, (others[i % len(others)], others[(i + 7) % len(others)], kind), strict=True):
        CORRUPTIONS[how](run_dir / f"step_{step:08d}")
    before = tree_hash(run_dir)
    out = every_reader(run_dir)
    for name in ("resume", "weights", "export"):
        assert isinstance(out[name], Exception), (kind, name, out[name])
    message = str(out["resume"])
    for step in STEPS:
        assert f"step_{step:08d}:" in message, message
    assert "Nothing was moved" in message
    assert tree_hash(run_dir) == before


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(fname=st.sampled_from([MODEL_FILE, OPTIM_FILE, STATE_FILE, MARKER]), where=st.floats(0, 1),
       value=st.integers(0, 255), cut=st.booleans())
def test_any_byte_changed_in_the_newest_checkpoint_falls_back_to_the_older_one(
        tmp_path: Path, pristine: Path, fname: str, where: float, value: int, cut: bool) -> None:
    root = tmp_path / f"ck-{time.monotonic_ns()}"
    shutil.copytree(pristine, root)
    f = root / "step_00000030" / fname
    data = bytearray(f.read_bytes())
    i = min(int(where * len(data)), len(data) - 1)
    if cut:
        data = data[:i]
    elif data[i] == value:
        return  # no change at all
    else:
        data[i] = value
    f.write_bytes(bytes(data))
    before = tree_hash(root)
    ck = Checkpointer(root, keep_last=3, model_cfg=CFG.model)
    loaded = resume_point(ARGS, CFG, ck, ONE)
    # A change inside COMPLETE.json that leaves it equivalent (whitespace) still verifies, rightly.
    assert loaded is not None and loaded.path.name in ("step_00000020", "step_00000030")
    if fname != MARKER:
        assert loaded.path.name == "step_00000020"
    assert tree_hash(root) == before
    shutil.rmtree(root)


def test_total_steps_below_the_resume_step_is_refused_even_with_allow_config_change(run_dir: Path) -> None:
    cfg = load_config(TINY_CONFIG, overrides={"train.total_steps": 25, "model.vocab_size": 512})
    args = argparse.Namespace(resume_from_latest=True, allow_config_change=True)
    with pytest.raises(DataOrConfigError, match=r"train.total_steps: 25 is below step 30.*--total-steps 30 or more"):
        resume_point(args, cfg, Checkpointer(run_dir, 3, cfg.model), ONE)


# ---- a full disk during a save ---------------------------------------------------------------------------

def test_a_save_that_runs_out_of_space_removes_its_partial_folder_and_says_how_much_it_needs(
        run_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """ENOSPC injected at the write layer (the real full filesystem is the next test's)."""
    real = ckpt_mod._write_durable

    def full_disk(path: Path, data: bytes) -> None:
        if path.name == OPTIM_FILE:
            raise OSError(errno.ENOSPC, "No space left on device", str(path))
        real(path, data)

    monkeypatch.setattr(ckpt_mod, "_write_durable", full_disk)
    before = tree_hash(run_dir)
    ck = Checkpointer(run_dir, keep_last=3, model_cfg=CFG.model)
    model = Transformer(CFG.model)
    state = TrainerState(step=40, tokens_seen=0, config_hash=CFG.config_hash(), config={}, sampler={})
    with pytest.raises(CheckpointSpaceError, match=rf"no space left on device at {re.escape(str(run_dir))}, need "
                       r"\d+\.\d+ (GB|MB|kB) for checkpoint step_00000040 \(\d+\.\d+ (GB|MB|kB) free\)"):
        ck.save(40, model.state_dict(), {}, state)
    assert not list(run_dir.glob(".tmp-step_*"))
    assert tree_hash(run_dir) == before


def _mount_tmpfs(path: Path, size_mb: int) -> bool:
    path.mkdir(parents=True, exist_ok=True)
    if os.geteuid() != 0 or shutil.which("mount") is None:
        return False
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_mb}m", "tmpfs", str(path)],
                          capture_output=True, text=True)
    return proc.returncode == 0


@pytest.fixture
def small_disk(tmp_path: Path):
    """A 60 MB tmpfs: room for one tiny checkpoint (40 MB), not two."""
    mnt = tmp_path / "small-disk"
    if not _mount_tmpfs(mnt, 60):
        pytest.skip("a real full filesystem needs root and mount (tmpfs); the ENOSPC-injection test covers the logic")
    yield mnt
    subprocess.run(["umount", "-l", str(mnt)], check=False)


@pytest.mark.slow
def test_a_full_disk_stops_the_trainer_cleanly_and_the_watchdog_gives_up_on_the_relaunch_loop(
        tmp_path: Path, tiny_data: Path, small_disk: Path) -> None:
    ckpt = small_disk / "ckpt"
    args = train_args(tiny_data, ckpt, f"file://{tmp_path}/mlruns", "--resume-from-latest", total=40)
    args[args.index("--heartbeat-file") + 1] = str(tmp_path / "heartbeat.json")
    proc = run_module("x1_pretrain.train", *args, timeout=300)
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert f"no space left on device at {ckpt}, need 0.04 GB" in proc.stderr, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    assert [p.name for p in ckpt.iterdir() if p.name.startswith(("step_", ".tmp-"))] == ["step_00000010"]
    assert Checkpointer(ckpt, 3, CFG.model).verify(ckpt / "step_00000010") is None
    kept = tree_hash(ckpt / "step_00000010")

    # Under the watchdog, as compose runs it: each relaunch fails at start-up, in seconds, with the
    # same error: the second such launch is a start-up failure, final (exit 81), not a loop.
    logs = tmp_path / "logs"
    wd = subprocess.run(
        [sys.executable, "-m", "x1_watchdog", "--mode", "process", "--heartbeat-file", str(tmp_path / "heartbeat.json"),
         "--events-file", str(logs / "events.jsonl"), "--state-file", str(logs / "state.json"), "--port", "0",
         "--check-seconds", "0.2", "--max-restarts", "2", "--backoff-base-seconds", "0.2", "--backoff-max-seconds", "1",
         "--", sys.executable, "-m", "x1_pretrain.train", *args],
        capture_output=True, text=True, timeout=400, env=cli_env(), cwd=REPO)
    events = [json.loads(line) for line in (logs / "events.jsonl").read_text().splitlines()]
    kinds = [e["event"] for e in events]
    assert kinds == ["start", "exit", "relaunch", "start", "exit", "startup_failure"], (kinds, wd.stderr[-3000:])
    assert wd.returncode == ExitCode.STARTUP_FAILED
    assert wd.stderr.count("no space left on device at") >= 2
    final = json.loads((logs / "state.json").read_text())["final"]
    assert final["reason"] == "startup-failure" and final["trainer_exit_code"] == 1
    assert not list(ckpt.glob(".tmp-step_*")) and tree_hash(ckpt / "step_00000010") == kept


# ---- a restart from scratch under the watchdog ------------------------------------------------------------

def checkpoint_files(root: Path) -> dict[str, str]:
    """The run's checkpoint artifacts only (the heartbeat and logs may be written by a start)."""
    return {k: v for k, v in tree_hash(root).items()
            if k.startswith(("step_", ".tmp-")) or k in ("latest", "final.safetensors", "final-optimizer.pt")}


@pytest.mark.slow
def test_every_checkpoint_corrupt_under_the_watchdog_stops_with_exit_2_naming_the_folders(
        tmp_path: Path, tiny_data: Path) -> None:
    ckpt = tmp_path / "ckpt"
    args = train_args(tiny_data, ckpt, f"file://{tmp_path}/mlruns", "--resume-from-latest", total=40)
    trainer = start_trainer(args, tmp_path / "train.log")
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline and trainer.poll() is None:
        hb = Heartbeat.read(ckpt / "heartbeat.json")
        if hb is not None and hb.phase == "training" and hb.step >= 22:
            break
        time.sleep(0.05)
    trainer.send_signal(signal.SIGTERM)  # a preemption: emergency checkpoint, exit 75
    assert trainer.wait(120) == 75, (tmp_path / "train.log").read_text()[-3000:]
    folders = sorted(p.name for p in ckpt.glob("step_*"))
    assert len(folders) >= 3, folders
    # One bad disk event: every folder damaged, each in its own way.
    damage = [CORRUPTIONS[f"{MODEL_FILE} truncate"], CORRUPTIONS["marker is a list"], CORRUPTIONS[f"{OPTIM_FILE} delete"],
              CORRUPTIONS["state step mismatch"]]
    for i, name in enumerate(folders):
        damage[i % len(damage)](ckpt / name)
    before = checkpoint_files(ckpt)

    logs = tmp_path / "logs"
    wd = subprocess.run(
        [sys.executable, "-m", "x1_watchdog", "--mode", "process", "--heartbeat-file", str(ckpt / "heartbeat.json"),
         "--events-file", str(logs / "events.jsonl"), "--state-file", str(logs / "state.json"), "--port", "0",
         "--check-seconds", "0.2", "--backoff-base-seconds", "0.2", "--",
         sys.executable, "-m", "x1_pretrain.train", *args],
        capture_output=True, text=True, timeout=300, env=cli_env(), cwd=REPO)
    events = [json.loads(line) for line in (logs / "events.jsonl").read_text().splitlines()]
    assert wd.returncode == 2, wd.stderr[-3000:]
    assert [e["event"] for e in events] == ["start", "exit"] and events[1]["exit_code"] == 2, events
    assert json.loads((logs / "state.json").read_text())["final"]["exit_code"] == 2  # final: no relaunch, ever
    for name in folders:
        assert f"{name}:" in wd.stderr, wd.stderr[-3000:]
    assert "none of its" in wd.stderr and "Nothing was moved, overwritten or deleted" in wd.stderr
    assert checkpoint_files(ckpt) == before  # nothing overwritten, nothing new
