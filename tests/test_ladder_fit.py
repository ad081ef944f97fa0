"""The scaling ladder's fit, prediction and files (x1_pretrain.ladder.fit, x1_common.scaling), on
rungs drawn from a known law: no training here (tests/test_ladder_run.py trains a real ladder)."""

from __future__ import annotations

import json
import math
import random
from dataclasses import replace
from pathlib import Path

import pytest

from conftest import run_module
from x1_common.scaling import (
    DeclaredBand,
    LadderFileError,
    Law,
    declare_band,
    load_ladder,
    predict,
    provenance_differences,
)
from x1_pretrain.ladder.fit import RungsError, leave_largest_out, make_ladder, read_points

TRUE = Law(E=1.9, A=420.0, B=1100.0, alpha=0.36, beta=0.31)
SIZES = (4e6, 7e6, 12e6, 20e6)
SAMPLES = 24  # bootstrap resamples: enough to exercise the interval, quick on two cores


def rungs_from(law: Law, noise: float, seed: int = 0, sizes=SIZES, multiples=(10, 20, 40, 80)) -> list[dict]:
    rng = random.Random(seed)
    return [{"name": f"n{n:g}-x{k}", "n_params": n, "n_params_nonembedding": n * 0.2, "tokens": k * n,
             "final_val_loss": law.loss(n, k * n) * math.exp(rng.gauss(0, noise))}
            for n in sizes for k in multiples]


def test_the_fit_recovers_a_known_law_from_points_drawn_from_it_with_noise():
    ladder = make_ladder(rungs_from(TRUE, 0.003), samples=SAMPLES, target={"n_params": 89e6, "tokens": 89e6 * 60})
    assert ladder["fit"]["n_convention"] in ("total", "non-embedding")
    # The law it found predicts far past its rungs (4.5x the largest N, 3x its tokens) within a few hundredths.
    truth = TRUE.loss(89e6, 89e6 * 60)
    p = ladder["prediction"]
    assert abs(p["val_loss"] - truth) < 0.03, (p, truth)
    assert p["low"] <= truth <= p["high"]
    # Unrounded parameters are kept, and the interval's samples are in the file for light readers.
    assert len(ladder["bootstrap"]["samples"]) == SAMPLES
    assert ladder["fit"]["E"] != round(ladder["fit"]["E"], 2)


def test_noiseless_points_give_back_the_law_itself():
    ladder = make_ladder(rungs_from(TRUE, 0.0), samples=4)
    law = Law.from_dict(ladder["fit"])
    for n, d in ((5e6, 1e8), (30e6, 2e9), (89e6, 2.3e10)):
        assert law.loss(n, d) == pytest.approx(TRUE.loss(n, d), abs=2e-3)


def test_the_declared_tolerance_is_at_least_the_leave_largest_out_error_and_grows_with_the_distance():
    rungs = rungs_from(TRUE, 0.004, seed=3)
    ladder = make_ladder(rungs, samples=SAMPLES)
    points, _ = read_points(rungs)
    check = leave_largest_out(points, ladder["fit"]["n_convention"])
    largest = max(abs(e["error"]) for e in check.errors)
    assert ladder["tolerance"]["heldout_error"] == pytest.approx(largest)
    assert ladder["heldout_check"]["max_abs_error"] == pytest.approx(largest)
    near = predict(ladder, 20e6, 20e6 * 80)  # the largest rung itself: the tolerance is the check's error
    far = predict(ladder, 500e6, 500e6 * 200)  # three decades farther out: wider
    assert near.tolerance == pytest.approx(largest)
    assert far.tolerance > near.tolerance >= largest
    assert far.high - far.low > 2 * far.tolerance


def test_n_counted_without_the_embedding_is_kept_when_it_predicts_held_out_rungs_better():
    # A law in the non-embedding count, rungs whose embedding share changes with size (as GPT-2's
    # 50,257-row embedding does): counting every parameter fits the held-out size worse.
    law = Law(E=2.0, A=60.0, B=900.0, alpha=0.30, beta=0.30)
    rungs = []
    for n_ne, emb in ((0.3e6, 4.8e6), (0.8e6, 7.2e6), (2.6e6, 12.0e6), (6.3e6, 19.3e6)):
        for k in (2e6, 4e6, 8e6, 16e6):
            rungs.append({"n_params": n_ne + emb, "n_params_nonembedding": n_ne, "tokens": k,
                          "final_val_loss": law.loss(n_ne, k)})
    ladder = make_ladder(rungs, samples=4)
    conv = ladder["conventions"]
    assert conv["non-embedding"]["heldout_max_abs_error"] < conv["total"]["heldout_max_abs_error"]
    assert ladder["fit"]["n_convention"] == "non-embedding"


def test_predict_reads_the_file_without_numpy_and_refuses_a_missing_non_embedding_count(tmp_path):
    rungs = rungs_from(TRUE, 0.002)
    ladder = make_ladder(rungs, samples=8)
    ladder["fit"]["n_convention"] = "non-embedding"
    path = tmp_path / "ladder.json"
    path.write_text(json.dumps(ladder))
    loaded = load_ladder(path)
    with pytest.raises(LadderFileError, match="non-embedding parameter count"):
        predict(loaded, 89e6, 2e9)
    assert predict(loaded, 89e6, 2e9, nonembedding_params=50e6).val_loss > 0


def test_a_ladder_file_of_the_wrong_shape_is_named_field_by_field(tmp_path):
    path = tmp_path / "ladder.json"
    path.write_text(json.dumps({"fit": {"E": 1.0, "A": 1.0, "B": 1.0, "alpha": "x", "beta": 0.3, "n_convention": "total"}}))
    with pytest.raises(LadderFileError, match="fit.alpha"):
        load_ladder(path)
    with pytest.raises(LadderFileError, match="no such file"):
        load_ladder(tmp_path / "missing.json")


def test_provenance_differences_name_each_mismatch_and_an_unknown_corpus():
    theirs = {"corpus": "aaaa", "tokenizer": "gpt2", "vocab_size": 50257, "seq_len": 1024, "model_family": "f"}
    ours = {**theirs, "corpus": "bbbb", "seq_len": 2048}
    diffs = provenance_differences(theirs, ours)
    assert len(diffs) == 2 and any("corpus" in d for d in diffs) and any("context length" in d for d in diffs)
    assert provenance_differences(theirs, dict(theirs)) == []
    assert any("'unknown'" in d for d in provenance_differences({}, ours))


def test_one_band_per_run_the_ladders_first_then_the_flag_then_the_labs():
    ladder = make_ladder(rungs_from(TRUE, 0.002), samples=4)
    p = predict(ladder, 89e6, 2e9)
    assert declare_band(p, (4.0, 5.0)).source == "ladder"
    assert (declare_band(p, None).low, declare_band(p, None).high) == (p.low, p.high)
    assert declare_band(None, (4.0, 5.0)).as_dict() == {"low": 4.0, "high": 5.0, "source": "flag"}
    assert declare_band(None, None).as_dict() == {"low": 3.2, "high": 3.5, "source": "lab"}


def test_a_band_too_wide_to_fail_a_run_is_said_so_in_dod_and_plan():
    # The GPU's ladder of 2026-12-06 18:42 (rungs of 84-418 steps) declared [0.53, 4.10]; its run's
    # check 2 passed. A band that wide is honest about the ladder and says nothing about the run.
    from x1_pretrain.config import load_config
    from x1_pretrain.run.dod import check_val_loss
    from x1_pretrain.run.plan import make_plan, render

    wide, narrow = DeclaredBand(0.53, 4.10, "ladder", 2.388), DeclaredBand(3.05, 3.45, "ladder", 3.25)
    assert "3.57 nats wide" in wide.width_warning() and "rungs were too short" in wide.width_warning()
    assert narrow.width_warning() is None and declare_band(None, None).width_warning() is None
    assert "as given on the command line" in declare_band(None, (1.0, 9.0)).width_warning()
    manifest = {"final_val_loss": 1.5434, "final_val_loss_step": 2500}
    assert check_val_loss(manifest, wide).ok and "passes almost any run" in check_val_loss(manifest, wide).reason
    assert "passes almost any run" not in check_val_loss({**manifest, "final_val_loss": 3.2}, narrow).reason
    cfg = load_config(Path(__file__).resolve().parents[1] / "configs" / "x1-50m-a100.yaml")
    plan = make_plan(cfg, gpu="a100-80gb", provider="lambda", price_usd_per_hr=1.10, hours=24, budget_usd=35)
    assert "passes almost any run" not in render(plan, cfg)
    band_row = next(x for x in render(replace(plan, dod_band=(0.53, 4.10), band_source="ladder"), cfg).splitlines()
                    if "DoD band" in x)
    assert "[0.53, 4.10]" in band_row and "3.57 nats wide" in band_row


# ---- the command line: fit, predict, report, and bad input ---------------------------------------


def write(path: Path, data) -> Path:
    path.write_text(json.dumps(data))
    return path


def test_fit_takes_a_rungs_file_from_anywhere_with_three_keys_and_writes_ladder_json_report_and_plot(tmp_path):
    rungs = [{k: r[k] for k in ("n_params", "tokens", "final_val_loss")} for r in rungs_from(TRUE, 0.003)]
    rungs.append({"n_params": 7e6, "tokens": 1e8, "final_val_loss": 9.9, "diverged": True, "name": "blew-up"})
    src = write(tmp_path / "older-results.json", rungs)
    out = tmp_path / "made" / "here"
    proc = run_module("x1_pretrain.ladder", "fit", str(src), "--out", str(out), "--bootstrap", "8")
    assert proc.returncode == 0, proc.stderr
    ladder = json.loads((out / "ladder.json").read_text())
    assert ladder["fit"]["n_convention"] == "total"
    assert any("every parameter" in n for n in ladder["notes"])
    assert ladder["provenance"] == {"provenance": "unknown"}
    assert ladder["prediction"] is None and ladder["tolerance"]["heldout_error"] >= 0
    assert "blew-up" in " ".join(ladder["left_out"])
    md = (out / "ladder.md").read_text()
    assert "blew-up" in md and "Tolerance" in md
    assert (out / "ladder.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "tolerance" in proc.stdout


def test_predict_prints_one_json_object_on_one_line(tmp_path):
    ladder_path = write(tmp_path / "ladder.json", make_ladder(rungs_from(TRUE, 0.002), samples=8))
    proc = run_module("x1_pretrain.ladder", "predict", "--ladder", str(ladder_path), "--params", "88.9e6",
                      "--tokens", "2.2e10")
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.strip().splitlines()
    assert len(lines) == 1
    p = json.loads(lines[0])
    assert p["low"] < p["val_loss"] < p["high"]
    assert p["val_loss"] == pytest.approx(predict(load_ladder(ladder_path), 88.9e6, 2.2e10).val_loss)


@pytest.mark.parametrize("change, named", [
    (lambda r: r[3].pop("final_val_loss"), "rung 3: final_val_loss: missing"),
    (lambda r: r[5].update(tokens=-4e7), "rung 5: tokens: -40000000.0 is not a positive finite number"),
    (lambda r: r[2].update(final_val_loss=float("nan")), "rung 2"),
    (lambda r: r[7].update(n_params="big"), "rung 7: n_params: 'big' is not a number"),
    (lambda r: r.__delitem__(slice(6, None)), "too few rungs: 6 usable"),
    (lambda r: [x.update(n_params=4e6) for x in r], "1 size(s)"),
])
def test_bad_rungs_exit_2_naming_the_entry_and_leave_the_earlier_ladder_intact(tmp_path, change, named):
    rungs = [{k: v for k, v in r.items() if k != "name"} for r in rungs_from(TRUE, 0.002)]
    change(rungs)
    src = tmp_path / "rungs.json"
    src.write_text(json.dumps(rungs, allow_nan=True))
    earlier = write(tmp_path / "ladder.json", {"an": "earlier fit"}).read_bytes()
    proc = run_module("x1_pretrain.ladder", "fit", str(src), "--bootstrap", "4")
    assert proc.returncode == 2
    assert named in proc.stderr
    assert (tmp_path / "ladder.json").read_bytes() == earlier
    assert not (tmp_path / "ladder.png").exists()


def test_a_diverged_rung_is_left_out_of_the_fit_and_named():
    rungs = rungs_from(TRUE, 0.002)
    rungs[4].update(diverged=True, final_val_loss=None)  # a diverged rung may have no final loss at all
    ladder = make_ladder(rungs, samples=4)
    assert ladder["fit"]["points"] == len(rungs) - 1
    assert any(x.startswith("rung 4") and "diverged" in x for x in ladder["left_out"])


def test_points_fewer_than_the_law_needs_are_refused_before_any_fit():
    with pytest.raises(RungsError, match="needs at least 2 sizes, 2 budgets and 7 rungs"):
        make_ladder(rungs_from(TRUE, 0.0, sizes=(4e6, 7e6), multiples=(10, 20, 40)), samples=4)


def test_rungs_that_show_no_size_or_a_steep_exponent_are_said_to_be_outside_the_laws_regime():
    grid = [(n, d) for n in SIZES for d in (2e7, 4e7, 8e7)]  # every size on the same budgets
    lawful = make_ladder([{"n_params": n, "n_params_nonembedding": n * 0.2, "tokens": d,
                           "final_val_loss": TRUE.loss(n, d)} for n, d in grid], samples=4)
    assert not any("size does not show" in n or "exponent of 1" in n for n in lawful["notes"])
    # What the GPU showed: at every budget the sizes ended alike, and loss fell faster with each doubling.
    early = [{"n_params": n, "n_params_nonembedding": n * 0.2, "tokens": d,
              "final_val_loss": 6.0 - 0.4 * math.log2(d / 1e7) ** 1.3 + 0.004 * math.log(n)} for n, d in grid]
    notes = make_ladder(early, samples=4)["notes"]
    assert any(n.startswith("at 80,000,000 tokens the 4 sizes ended within") and "not to be trusted" in n
               for n in notes), notes
