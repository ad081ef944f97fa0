"""The band a run is judged on: declared before its first step (a ladder's prediction ± tolerance,
else --band, else the lab's), kept by every resume, read by export and dod; the stack's ladder step
before the trainer (trainer/entrypoint.sh with X1_LADDER=1)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO, TINY_CONFIG, cli_env, run_module, start_trainer, train_args, wait_for
from x1_common.scaling import Law
from x1_pretrain.config import load_config
from x1_pretrain.ladder.cli import provenance
from x1_pretrain.ladder.fit import make_ladder


def a_ladder_for(data: Path, **provenance_changes) -> dict:
    """A fitted ladder made for the tiny config on `data` (from rungs drawn from a law: fitting is
    tests/test_ladder_fit.py's subject; here the file's use)."""
    law = Law(E=2.0, A=60.0, B=90.0, alpha=0.3, beta=0.3)
    rungs = [{"n_params": n, "tokens": k * n, "final_val_loss": law.loss(n, k * n) * (1.01 if k == 2 else 1.0)}
             for n in (1e6, 1.5e6, 2e6, 3e6) for k in (1, 2, 4)]
    prov = {k: v for k, v in provenance(load_config(TINY_CONFIG), str(data)).items() if k != "corpus_train_tokens"}
    return make_ladder(rungs, samples=8, provenance={**prov, **provenance_changes})


def test_the_stacks_ladder_step_gives_the_trainer_its_band_and_export_and_dod_judge_against_it(tmp_path, tiny_data):
    ladder_dir = tmp_path / "ladder"
    ladder_dir.mkdir()
    ladder = a_ladder_for(tiny_data)
    (ladder_dir / "ladder.json").write_text(json.dumps(ladder))
    args = train_args(tiny_data, tmp_path / "ckpt", f"sqlite:///{tmp_path}/mlflow.db", "--run-dir", str(tmp_path / "run"),
                      total=20)
    env = cli_env(X1_LADDER="1", X1_LADDER_DIR=str(ladder_dir), X1_PYTHON=sys.executable)
    proc = subprocess.run(["bash", str(REPO / "trainer" / "entrypoint.sh"), *args], capture_output=True, text=True,
                          env=env, cwd=REPO, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    out = proc.stdout + proc.stderr
    assert "ladder.json is there" in out
    assert "declared before the first step" in out and "the ladder's prediction" in out
    manifest = json.loads((tmp_path / "run" / "manifest.json").read_text())
    band = manifest["declared_band"]
    assert band["source"] == "ladder" and band["ladder"] == str(ladder_dir / "ladder.json")
    assert band["low"] < band["prediction"] < band["high"]
    assert manifest["loss_curve_band"] == [band["low"], band["high"]]
    # dod judges check 2 against the declared band, the lab's beside it; --band cannot move it.
    check = run_module("x1_pretrain.dod", str(tmp_path / "run"), "--band", "0", "20")
    line = next(x for x in check.stdout.splitlines() if "final val loss in band" in x)
    assert f"[{band['low']:.2f}, {band['high']:.2f}]" in line and "the ladder's prediction" in line
    assert "the lab's [3.20, 3.50]" in line and "--band 0 20 not used" in line


def test_a_ladder_made_for_another_run_is_refused_with_exit_2_naming_the_difference(tmp_path, tiny_data):
    path = tmp_path / "other.json"
    path.write_text(json.dumps(a_ladder_for(tiny_data, seq_len=1024, corpus="0123456789abcdef")))
    proc = run_module("x1_pretrain.train", *train_args(tiny_data, tmp_path / "ckpt", f"sqlite:///{tmp_path}/m.db",
                                                       "--ladder", str(path), total=10))
    assert proc.returncode == 2
    err = proc.stdout + proc.stderr
    assert "made for another run" in err and "context length: the ladder's is '1024', the run's '64'" in err
    assert "corpus" in err
    assert not (tmp_path / "ckpt" / "latest").exists()


def test_a_ladder_that_recorded_its_corpus_with_the_files_times_still_declares_this_runs_band(tmp_path, tiny_data):
    # Ladders made before the corpus fingerprint left out the source files' modification times
    # recorded it with them: the same corpus, still accepted; another fingerprint is still refused.
    from x1_pretrain.train.band import BandError, ladder_prediction
    from x1_pretrain.train.provenance import corpus_identity

    meta = json.loads((tiny_data / "meta.json").read_text())
    cfg = load_config(TINY_CONFIG, [f"data.dir={tiny_data}"])
    identity = corpus_identity(tiny_data, meta)
    assert identity["fingerprint_with_file_times"] != identity["fingerprint"]
    path = tmp_path / "ladder.json"
    path.write_text(json.dumps(a_ladder_for(tiny_data, corpus=identity["fingerprint_with_file_times"])))
    ladder, prediction = ladder_prediction(str(path), cfg, meta)
    assert prediction.low < prediction.val_loss < prediction.high
    path.write_text(json.dumps(a_ladder_for(tiny_data, corpus="0123456789abcdef")))
    with pytest.raises(BandError, match="made for another run: corpus"):
        ladder_prediction(str(path), cfg, meta)


def test_a_resume_keeps_the_band_declared_at_the_start_whatever_its_flags_say(tmp_path, tiny_data):
    ckpt = tmp_path / "ckpt"
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    log = tmp_path / "first.log"
    first = start_trainer(train_args(tiny_data, ckpt, uri, "--band", "4", "9", total=40), log)
    try:
        wait_for(lambda: (ckpt / "latest").exists(), timeout=300, what="a first checkpoint")
    finally:
        os.killpg(first.pid, signal.SIGTERM)
        assert first.wait(timeout=120) == 75
    proc = run_module("x1_pretrain.train", *train_args(tiny_data, ckpt, uri, "--band", "5", "6", "--resume-from-latest",
                                                       "--run-dir", str(tmp_path / "run"), total=40))
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout + proc.stderr
    assert "--band 5 6 is not used for the band: this run declared [4.00, 9.00]" in out
    assert "band [4.00, 9.00] (given on the command line) kept from the run's start" in out
    assert "this band is 5.00 nats wide, more than twice the lab's 0.30: it passes almost any run" in out
    manifest = json.loads((tmp_path / "run" / "manifest.json").read_text())
    assert (manifest["declared_band"]["low"], manifest["declared_band"]["high"]) == (4.0, 9.0)
