"""Bad input and faults, the resume class: a relaunch that finds something changed says what, by
name, and exits 2; it never goes on silently nor dies in a traceback the watchdog would relaunch.

- a checkpoint's optimizer state or weights from a model of another width: the tensor named with
  both shapes;
- token ids changed in place with the mtime put back, or a copy with the same size and mtime:
  scanned again (the check is keyed by ctime and inode, which neither can restore);
- a SIGTERM while the trainer is still importing: preempted (75), as a minute later;
- an alert line above the cap, which the budget sidecar refuses too;
- a resume on another corpus, against another tracking server, or from a step folder of another
  run: refused naming what changed, unless the matching --allow flag says so (then recorded).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import REPO, TINY_CONFIG, cli_env, run_module, train_args, wait_for
from x1_pretrain.checkpoint.store import MARKER, OPTIM_FILE
from x1_pretrain.config import load_config
from x1_pretrain.data import loader as data_mod
from x1_pretrain.data.loader import CHECK_CACHE, DataError, open_token_data
from x1_pretrain.model.transformer import Transformer

VOCAB = 50257  # the tiny config's vocab_size: ids from 50257 up index past the embedding's real rows


@pytest.fixture
def run_copy(tmp_path: Path, reference_run: Path) -> Path:
    """A finished tiny run of 40 steps (step folders, final, its MLflow file store)."""
    root = tmp_path / "run"
    shutil.copytree(reference_run.parent, root, symlinks=True)
    return root


def resume(root: Path, data: Path, *extra: str, uri: str | None = None, total: int = 40) -> subprocess.CompletedProcess:
    args = train_args(data, root / "ckpt", uri or f"file://{root}/mlruns", "--resume-from-latest", *extra, total=total)
    return run_module("x1_pretrain.train", *args, timeout=300)


def rehash(path: Path) -> None:
    marker = json.loads((path.parent / MARKER).read_text())
    marker["files"][path.name] = hashlib.sha256(path.read_bytes()).hexdigest()
    (path.parent / MARKER).write_text(json.dumps(marker))


# ---- shapes --------------------------------------------------------------------------------


def test_an_optimizer_state_of_another_width_exits_2_naming_the_tensor_and_both_shapes(
        run_copy: Path, tiny_data: Path) -> None:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    wide = load_config(TINY_CONFIG, overrides={"model.d_model": 128}).model
    model = Transformer(wide)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.zeros(1, 8, dtype=torch.long), torch.zeros(1, 8, dtype=torch.long)).backward()
    opt.step()
    newest = sorted((run_copy / "ckpt").glob("step_*"))[-1]
    torch.save(get_optimizer_state_dict(model, opt, options=StateDictOptions(full_state_dict=True)),
               newest / OPTIM_FILE)
    rehash(newest / OPTIM_FILE)

    proc = resume(run_copy, tiny_data)

    assert proc.returncode == 2, proc.stderr[-3000:]
    assert f"{newest / OPTIM_FILE}: the optimizer state does not fit" in proc.stderr, proc.stderr[-3000:]
    assert "exp_avg of tok_emb.weight: shape (50304, 128) in the file, (50304, 64) in this model" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_weights_of_another_width_exit_2_naming_the_tensor_and_both_shapes(run_copy: Path, tiny_data: Path) -> None:
    """--allow-config-change lets a resume go on with another config; weights that cannot fit it
    are named tensor by tensor, not cut off after "Error(s) in loading state_dict"."""
    proc = resume(run_copy, tiny_data, "--set", "model.d_model=128", "--allow-config-change")

    assert proc.returncode == 2, proc.stderr[-3000:]
    newest = sorted((run_copy / "ckpt").glob("step_*"))[-1]
    assert f"{newest / 'model.safetensors'}: the weights do not fit this config's model" in proc.stderr
    assert "tok_emb.weight: shape (50304, 64) in the file, (50304, 128) in this model" in proc.stderr, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr


# ---- token ids ----------------------------------------------------------------------------


@pytest.fixture
def data_copy(tiny_data: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The tiny corpus, copied, its id check cached and trusted. The check trusts a verdict only for
    a file left alone for SETTLED_NS before the scan: shortened here, with sleeps of more than it."""
    monkeypatch.setattr(data_mod, "SETTLED_NS", 20_000_000)
    out = tmp_path / "data"
    out.mkdir()
    for name in ("train.bin", "val.bin", "meta.json"):
        shutil.copy2(tiny_data / name, out / name)
    time.sleep(0.1)
    open_token_data(out, VOCAB)
    return out


def scans(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    seen: list[str] = []
    real = data_mod._scan_max_id

    def counting(path, tokens, vocab_size):
        seen.append(path.name)
        return real(path, tokens, vocab_size)

    monkeypatch.setattr(data_mod, "_scan_max_id", counting)
    return seen


def test_an_unchanged_corpus_is_not_scanned_again(data_copy: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    seen = scans(monkeypatch)
    open_token_data(data_copy, VOCAB)
    assert seen == []


def test_token_ids_changed_in_place_with_the_mtime_put_back_are_scanned_and_named(
        data_copy: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = data_copy / "train.bin"
    st = path.stat()
    tokens = np.memmap(path, dtype="<u2", mode="r+")
    tokens[777] = 50300  # a bit flip's worth: inside uint16, outside the vocab
    tokens.flush()
    del tokens
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))  # rsync -a, touch -r: the mtime is as before
    assert (path.stat().st_mtime_ns, path.stat().st_size) == (st.st_mtime_ns, st.st_size)
    seen = scans(monkeypatch)

    with pytest.raises(DataError) as e:
        open_token_data(data_copy, VOCAB)

    assert seen == ["train.bin"]
    assert str(path) in str(e.value) and "token id 50300 at token offset 777" in str(e.value)


def test_a_copied_in_token_file_with_the_same_size_and_mtime_is_scanned_and_named(
        data_copy: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = data_copy / "train.bin"
    st = path.stat()
    bad = np.fromfile(path, dtype="<u2")
    bad[5] = 65000
    other = data_copy / "incoming.bin"
    bad.tofile(other)
    os.utime(other, ns=(st.st_atime_ns, st.st_mtime_ns))
    os.replace(other, path)  # what cp -p / rsync -a leave: another inode, the old size and mtime
    seen = scans(monkeypatch)

    with pytest.raises(DataError, match="token id 65000 at token offset 5"):
        open_token_data(data_copy, VOCAB)
    assert seen == ["train.bin"]
    cache = json.loads((data_copy / CHECK_CACHE).read_text())
    assert cache["train.bin"]["inode"] != path.stat().st_ino  # the clean verdict of the old file stays its own


def test_a_corpus_changed_in_place_stops_the_trainer_with_exit_2_naming_the_file(
        tmp_path: Path, tiny_data: Path) -> None:
    data = tmp_path / "data"
    shutil.copytree(tiny_data, data)
    proc = run_module("x1_pretrain.train", *train_args(data, tmp_path / "ck", f"file://{tmp_path}/mlruns", total=10))
    assert proc.returncode == 0, proc.stderr[-3000:]
    path = data / "train.bin"
    st = path.stat()
    with open(path, "r+b") as f:
        f.seek(2 * 1000)
        f.write((50300).to_bytes(2, "little"))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))

    proc = run_module("x1_pretrain.train", *train_args(data, tmp_path / "ck", f"file://{tmp_path}/mlruns",
                                                       "--resume-from-latest", total=10))

    assert proc.returncode == 2, proc.stderr[-3000:]
    assert f"{path}: token id 50300 at token offset 1,000" in proc.stderr
    assert "IndexError" not in proc.stderr and "Traceback" not in proc.stderr


# ---- signals and validation ---------------------------------------------------------------


def catches_sigterm(pid: int) -> bool:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("SigCgt:"):
            return bool(int(line.split()[1], 16) & (1 << (signal.SIGTERM - 1)))
    return False


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads a process's signal mask from /proc (Linux)")
def test_sigterm_during_start_up_imports_exits_75_not_143(tmp_path: Path, tiny_data: Path) -> None:
    """The signal lands as soon as the process catches SIGTERM at all: during its imports, long
    before the trainer's own handler or anything written."""
    proc = subprocess.Popen([sys.executable, "-m", "x1_pretrain.train",
                             *train_args(tiny_data, tmp_path / "ck", f"file://{tmp_path}/mlruns")],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=cli_env(), cwd=REPO)
    try:
        wait_for(lambda: catches_sigterm(proc.pid), timeout=60, what="the trainer to catch SIGTERM", interval=0.005)
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 75, err.decode(errors="replace")[-3000:]
    assert b"SIGTERM during start-up" in err
    assert not (tmp_path / "ck").exists()  # nothing was written


def test_an_alert_line_above_the_cap_is_refused_naming_both(tmp_path: Path, tiny_data: Path) -> None:
    proc = run_module("x1_pretrain.train", *train_args(tiny_data, tmp_path / "ck", f"file://{tmp_path}/mlruns",
                                                       "--budget-cap-usd", "10", "--budget-alert-usd", "12"))
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "budget.alert_usd: 12 is above budget.cap_usd=10" in proc.stderr
    assert not (tmp_path / "ck").exists()


# ---- provenance: the same run, corpus and tracking server -----------------------------------


def rewind(root: Path) -> Path:
    """The run as it was at step 30 (steps 31-40 still to do); returns the newest step folder."""
    ckpt = root / "ckpt"
    shutil.rmtree(ckpt / "step_00000040")
    for name in ("final.safetensors", "final-optimizer.pt", "latest"):
        (ckpt / name).unlink(missing_ok=True)
    return ckpt / "step_00000030"


def state_of(folder: Path) -> dict:
    return json.loads((folder / "trainer_state.json").read_text())


def edit_state(folder: Path, **fields) -> None:
    state = state_of(folder)
    state.update(fields)
    (folder / "trainer_state.json").write_text(json.dumps(state))
    rehash(folder / "trainer_state.json")


def step_folders(ckpt: Path) -> dict[str, str]:
    return {p.relative_to(ckpt).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(ckpt.glob("step_*/*"))}


def mlflow_runs(uri: str) -> list:
    from mlflow.tracking import MlflowClient

    import x1_pretrain.train.tracking  # noqa: F401 - lets MLflow's client read the file store, as the trainer does

    client = MlflowClient(uri)
    experiment = client.get_experiment_by_name("x1-pretraining")
    return client.search_runs([experiment.experiment_id]) if experiment else []


def another_corpus(tiny_data: Path, where: Path) -> Path:
    """The tiny corpus less its last 1000 training tokens: another corpus, as the trainer sees it."""
    shutil.copytree(tiny_data, where)
    (where / CHECK_CACHE).unlink(missing_ok=True)
    meta = json.loads((where / "meta.json").read_text())
    meta["train_tokens"] -= 1000
    with open(where / "train.bin", "r+b") as f:
        f.truncate(meta["train_tokens"] * 2)
    (where / "meta.json").write_text(json.dumps(meta))
    return where


def test_the_same_source_files_fetched_again_are_the_same_corpus_and_other_bytes_are_not(tmp_path: Path) -> None:
    # A new instance that fetches and tokenizes the same files again writes new modification times
    # into meta.json: the corpus is the one the checkpoints trained on, and the ladder's.
    from x1_pretrain.train.provenance import ProvenanceError, check_corpus, corpus_identity

    source = {"path": "part-0.parquet", "bytes": 1000, "sha256": "ab" * 32, "tokens": 500, "mtime_ns": 1}
    meta = {"train_tokens": 500, "val_tokens": 10, "created_utc": "2026-12-06T18:42:00Z", "sources": [source]}
    here = corpus_identity(tmp_path, meta)
    again = corpus_identity(tmp_path, {**meta, "created_utc": "2026-12-06T19:06:00Z",
                                       "sources": [{**source, "mtime_ns": 2}]})
    other = corpus_identity(tmp_path, {**meta, "sources": [{**source, "sha256": "cd" * 32}]})
    assert again["fingerprint"] == here["fingerprint"] != other["fingerprint"]
    assert check_corpus(tmp_path, here, again, 30, allow=False) is None
    # A checkpoint written before the times were left out recorded the fingerprint with them.
    earlier = {**here, "fingerprint": here["fingerprint_with_file_times"]}
    assert check_corpus(tmp_path, earlier, here, 30, allow=False) is None
    with pytest.raises(ProvenanceError, match="holds another"):
        check_corpus(tmp_path, here, other, 30, allow=False)


def test_resume_on_another_corpus_is_refused_naming_both(run_copy: Path, tiny_data: Path, tmp_path: Path) -> None:
    newest = rewind(run_copy)
    other = another_corpus(tiny_data, tmp_path / "other-corpus")
    before = step_folders(run_copy / "ckpt")

    proc = resume(run_copy, other)

    assert proc.returncode == 2, proc.stderr[-3000:]
    assert f"{newest}: trained on the corpus in {tiny_data.resolve()}" in proc.stderr, proc.stderr[-3000:]
    assert f"--data-dir {other.resolve()} holds another" in proc.stderr and "--allow-data-change" in proc.stderr
    assert step_folders(run_copy / "ckpt") == before


def test_resume_on_another_corpus_with_allow_data_change_is_recorded(
        run_copy: Path, tiny_data: Path, tmp_path: Path) -> None:
    newest = rewind(run_copy)
    other = another_corpus(tiny_data, tmp_path / "other-corpus")

    proc = resume(run_copy, other, "--allow-data-change")

    assert proc.returncode == 0, proc.stderr[-3000:]
    state = state_of(run_copy / "ckpt" / "step_00000040")
    (change,) = state["changes"]
    assert change["what"] == "data" and change["at_step"] == 30
    assert change["from"]["dir"] == str(tiny_data.resolve()) and change["to"]["dir"] == str(other.resolve())
    assert state["corpus"] == change["to"] and state_of(newest)["corpus"] == change["from"]
    (run,) = mlflow_runs(f"file://{run_copy}/mlruns")
    assert run.info.run_id == state["mlflow_run_id"]
    assert json.loads(run.data.tags["x1.provenance_changes"]) == state["changes"]
    assert run.data.tags["x1.data_dir"] == str(other.resolve())


def test_resume_against_another_tracking_server_is_refused_naming_both(
        run_copy: Path, tiny_data: Path, tmp_path: Path) -> None:
    newest = rewind(run_copy)
    old_run = state_of(newest)["mlflow_run_id"]
    elsewhere = f"file://{tmp_path}/elsewhere"

    proc = resume(run_copy, tiny_data, uri=elsewhere)

    assert proc.returncode == 2, proc.stderr[-3000:]
    old_uri = state_of(newest)["config"]["tracking"]["mlflow_uri"]  # where the run was trained
    assert f"{newest}: its MLflow run {old_run} is at {old_uri}" in proc.stderr, proc.stderr[-3000:]
    assert f"this start's --mlflow-uri is {elsewhere}" in proc.stderr and "--allow-tracking-change" in proc.stderr
    assert not (tmp_path / "elsewhere").exists() and mlflow_runs(elsewhere) == []

    # Accepted with the flag: a new run on the new server, tagged with the old one; the old store untouched.
    proc = resume(run_copy, tiny_data, "--allow-tracking-change", uri=elsewhere)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (new_run,) = mlflow_runs(elsewhere)
    state = state_of(run_copy / "ckpt" / "step_00000040")
    assert state["mlflow_run_id"] == new_run.info.run_id != old_run
    assert new_run.data.tags["x1.previous_mlflow_run"] == f"{old_uri} {old_run}"
    assert [c["what"] for c in state["changes"]] == ["tracking"]
    (old,) = mlflow_runs(f"file://{run_copy}/mlruns")
    assert old.info.run_id == old_run


def test_a_step_folder_copied_in_from_another_run_is_refused_naming_both_runs(
        run_copy: Path, tiny_data: Path) -> None:
    ckpt = run_copy / "ckpt"
    ours = json.loads((ckpt / "run-identity.json").read_text())["run_id"]
    newest = sorted(ckpt.glob("step_*"))[-1]
    assert state_of(newest)["run_id"] == ours
    theirs = "f" * 32
    edit_state(newest, run_id=theirs)  # what a folder of another run's checkpoint dir carries
    before = step_folders(ckpt)

    proc = resume(run_copy, tiny_data)

    assert proc.returncode == 2, proc.stderr[-3000:]
    assert f"{newest}: a step folder of another run (run {theirs[:12]}" in proc.stderr, proc.stderr[-3000:]
    assert f"which holds run {ours[:12]}" in proc.stderr
    assert step_folders(ckpt) == before and "resuming from" not in proc.stderr


def test_a_checkpoint_saved_before_mlflow_answered_resumes_into_the_same_mlflow_run(
        run_copy: Path, tiny_data: Path) -> None:
    """The first checkpoint landed before MLflow's first answer: its state says mlflow_run_id null,
    while mlflow-run.json beside it names the run that answer created. The resume continues that
    run: one MLflow run holds every step."""
    newest = rewind(run_copy)
    uri = f"file://{run_copy}/mlruns"
    (run,) = mlflow_runs(uri)
    edit_state(newest, mlflow_run_id=None)
    record = json.loads((run_copy / "ckpt" / "mlflow-run.json").read_text())
    assert record["run_id"] == run.info.run_id
    record["uri"] = uri  # the copy's store, as the run would have written it had it run here
    (run_copy / "ckpt" / "mlflow-run.json").write_text(json.dumps(record))

    proc = resume(run_copy, tiny_data)

    assert proc.returncode == 0, proc.stderr[-3000:]
    (after,) = mlflow_runs(f"file://{run_copy}/mlruns")
    assert after.info.run_id == run.info.run_id
    assert state_of(run_copy / "ckpt" / "step_00000040")["mlflow_run_id"] == run.info.run_id
    from mlflow.tracking import MlflowClient

    steps = {m.step for m in MlflowClient(f"file://{run_copy}/mlruns").get_metric_history(run.info.run_id, "loss")}
    assert min(steps) < 30 < max(steps)  # before the checkpoint and after the resume, in one run
