"""postmortem: the spike post-mortem draft, from the tiny run with an injected spike and from
runs logged to MLflow with known losses (so the recovery count can be worked out by hand)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from test_export_run import SPIKE_AT, TOTAL_STEPS, SpikedRun, assert_png, mlflow_histories, new_run, spiked_run

from x1_pretrain.run import postmortem
from x1_pretrain.run.dod import check_postmortem

__all__ = ["spiked_run"]  # the shared session fixture, imported so pytest finds it here


def section(text: str, title: str) -> str:
    """The body of `## title`, up to the next heading."""
    body = text.split(f"## {title}\n", 1)[1]
    return body.split("\n## ", 1)[0].strip()


def row(text: str, name: str) -> str:
    match = re.search(rf"^\| {re.escape(name)} \| (.*) \|$", text, re.M)
    assert match, f"no row {name!r} in:\n{text}"
    return match.group(1)


def assert_only_prompts(text: str) -> None:
    """Cause, Response and Lessons hold one marked prompt each, nothing written in the person's place."""
    for title in ("Cause", "Response", "Lessons"):
        body = section(text, title)
        assert body.startswith("> TODO(person): ") and "\n" not in body, (title, body)


def write(uri: str, output: Path, *extra: str) -> int:
    return postmortem.main(["--mlflow-uri", uri, "--output", str(output), *extra])


def test_postmortem_names_the_injected_step_and_its_recovery(spiked_run: SpikedRun) -> None:
    text = (spiked_run.run_dir / "spike-postmortem.md").read_text()
    assert f"## Spike 1: injected at step {SPIKE_AT} (MLflow steps {SPIKE_AT + 1}–{SPIKE_AT + 5})" in text
    assert f"`--inject-spike-at-step {SPIKE_AT}`" in text
    recovery = row(text, "recovery")
    steps = int(re.match(r"(\d+) steps: the loss EMA was back within 2% of [\d.]+ at step (\d+)", recovery).group(1))
    assert 0 < steps <= TOTAL_STEPS - SPIKE_AT

    histories = mlflow_histories(spiked_run.uri, spiked_run.run_id)
    loss = {m.step: m.value for m in histories.get("spike_loss", [])}  # flagged steps between log steps
    loss.update({m.step: m.value for m in histories["loss"]})
    assert row(text, "loss before") == f"{loss[SPIKE_AT]:.4f} (step {SPIKE_AT})"
    peak_step = max((s for s in loss if SPIKE_AT < s <= SPIKE_AT + 5), key=loss.get)
    assert row(text, "peak loss") == f"{loss[peak_step]:.4f} (step {peak_step})"
    assert loss[peak_step] > 1.5 * loss[SPIKE_AT]  # the rare-token batches show plainly in the logged loss
    assert row(text, "clipping fired").startswith(("yes", "no"))
    assert "threshold 1)" in row(text, "grad norm")

    plot = spiked_run.run_dir / f"spike-postmortem-step-{SPIKE_AT + 1}.png"
    assert f"]({plot.name})" in text
    assert_png(plot)
    assert_only_prompts(text)


def evidence_rows(text: str) -> dict[int, list[str]]:
    """The per-step table of a spike section: step -> [role, loss, grad norm, clipped]."""
    rows = re.findall(r"^\| (\d+) \| ([^|]+) \| ([^|]+) \| ([^|]+) \| ([^|]+) \|$", text, re.M)
    return {int(r[0]): [c.strip() for c in r[1:]] for r in rows}


def test_each_flagged_and_injected_step_shows_its_grad_norm_and_whether_clipping_fired(spiked_run: SpikedRun) -> None:
    text = (spiked_run.run_dir / "spike-postmortem.md").read_text()
    histories = mlflow_histories(spiked_run.uri, spiked_run.run_id)
    injected = {m.step for m in histories["spike_injected"] if m.value >= 0.5}
    flagged = {m.step for m in histories.get("spike", []) if m.value >= 0.5}
    assert injected == set(range(SPIKE_AT + 1, SPIKE_AT + 6))
    grads = {m.step: m.value for m in histories["spike_grad_norm"]}
    decisions = {m.step: m.value for m in histories["spike_clipped"]}
    assert set(grads) == set(decisions) == injected | flagged  # the trainer logged every one of them
    rows = evidence_rows(text)
    for step in sorted(injected | flagged):
        role, _, grad, clipped = rows[step]
        assert ("injected" in role) == (step in injected) and ("flagged" in role) == (step in flagged), role
        assert grad == f"{grads[step]:.4g}", (step, grad)
        assert clipped == ("yes" if grads[step] > 1.0 else "no"), (step, clipped)
        assert decisions[step] == float(grads[step] > 1.0)
    fired = sorted(s for s in grads if grads[s] > 1.0)
    summary = row(text, "clipping fired")
    assert summary.startswith(f"yes: clipped at step(s) {', '.join(map(str, fired))}" if fired else "no: ")
    assert "not measured" not in summary and "not measured" not in row(text, "grad norm")


def test_a_run_that_logged_no_grad_norm_in_the_spike_says_not_measured_and_concludes_nothing(
        spiked_run: SpikedRun, tmp_path: Path) -> None:
    # A trainer of before this evidence: losses every 10 steps, no grad norm at the spike's steps
    # nor at the log step after it, and no grad clip among its params.
    metrics = [("loss", 12.0 if s == 110 else 4.0, s * 1000, s) for s in range(10, 201, 10)]
    metrics += [("grad_norm", 0.5, s * 1000, s) for s in range(10, 101, 10)]  # only before the spike
    metrics += [("spike_injected", 1.0, 101_000 + i, 101 + i) for i in range(5)]
    uri = f"sqlite:///{tmp_path / 'old.db'}"
    run_id = new_run(uri, spiked_run, metrics, params={"train.log_every": "10"})
    from mlflow.tracking import MlflowClient

    client = MlflowClient(uri)
    client.delete_tag(run_id, "x1.config_name")
    out = tmp_path / "spike-postmortem.md"
    assert write(uri, out, "--run-id", run_id) == 0
    text = out.read_text()
    assert row(text, "grad norm").startswith("not measured: no grad norm was logged at step(s) 101, 102, 103, 104, "
                                             "105, 110")
    clipping = row(text, "clipping fired")
    assert clipping.startswith("not measured") and "no conclusion" in clipping
    assert not re.search(r"\b(yes|no):", clipping)
    for step in (101, 102, 103, 104, 105, 110):
        assert evidence_rows(text)[step][2:] == ["not measured", "not measured"], step
    assert evidence_rows(text)[110][1] == "12.0000"  # what was logged is still reported


def test_a_run_without_its_clip_threshold_or_losses_before_the_spike_draws_no_conclusion_from_them(
        spiked_run: SpikedRun, tmp_path: Path) -> None:
    metrics = [("loss", 9.0 if s == 10 else 4.0, s * 1000, s) for s in range(10, 101, 10)]
    metrics += [("spike_grad_norm", 3.0, 10_000, 10), ("spike", 1.0, 10_000, 10)]
    uri = f"sqlite:///{tmp_path / 'noclip.db'}"
    from mlflow.tracking import MlflowClient

    src = MlflowClient(spiked_run.uri).get_run(spiked_run.run_id)
    run_id = new_run(uri, spiked_run, metrics)
    client = MlflowClient(uri)
    # Params cannot be deleted: a fresh run holds only the ones we choose.
    exp = client.get_run(run_id).info.experiment_id
    bare = client.create_run(exp, tags=src.data.tags)
    from mlflow.entities import Metric

    client.log_batch(bare.info.run_id, metrics=[Metric(k, v, ts, st) for k, v, ts, st in metrics])
    client.set_terminated(bare.info.run_id)
    out = tmp_path / "spike-postmortem.md"
    assert write(uri, out, "--run-id", bare.info.run_id) == 0
    text = out.read_text()
    assert "grad clip not measured" in text and "lack optim.grad_clip" in text
    assert row(text, "grad norm") == "3 at step 10, the largest of 1 measured, before clipping (clip threshold not logged)"
    assert row(text, "clipping fired").startswith("not measured")  # 3.0 against an unknown threshold: no verdict
    assert row(text, "loss before") == "not measured"
    assert row(text, "recovery") == "not measured: no loss was logged before the spike"
    assert "the logged losses are 10 steps apart" in text


# Known losses: flat at 4.0, logged every 10 steps; the injection covers MLflow steps 101..105 and
# the log at step 110 reads 12.0. With beta 0.98 a 10-step gap weighs w = 0.98**10 = 0.81707, so
# the EMA at 110 is 4 + (1 - w) * 8 = 5.4634 and its excess over 4.0 shrinks by w per log:
# 1.4634 * w**k <= 2% of 4.0 = 0.08 first at k = 15, i.e. step 260, 160 steps after step 101.
FLAT = 4.0


def known_run(uri: str, like: SpikedRun, after: float) -> str:
    metrics = []
    for s in range(10, 401, 10):
        value = 12.0 if s == 110 else (FLAT if s < 110 else after)
        metrics += [("loss", value, s * 1000, s), ("grad_norm", 7.0 if s == 110 else 0.5, s * 1000, s),
                    ("clipped", 1.0 if s == 110 else 0.0, s * 1000, s), ("lr", 1e-3, s * 1000, s)]
    metrics += [("val_loss", 4.1, 100_000, 100), ("val_loss", 4.2, 200_000, 200)]
    metrics += [("spike_injected", 1.0, 101_000 + i, 101 + i) for i in range(5)]
    metrics += [("spike", 1.0, 101_000, 101)]
    return new_run(uri, like, metrics, params={"train.log_every": "10", "train.spike_ema_beta": "0.98",
                                               "optim.grad_clip": "1.0", "train.total_steps": "400"})


def test_recovery_counts_steps_until_the_loss_ema_is_within_two_percent(spiked_run: SpikedRun, tmp_path: Path) -> None:
    uri = f"sqlite:///{tmp_path / 'known.db'}"
    known_run(uri, spiked_run, after=FLAT)
    out = tmp_path / "spike-postmortem.md"
    assert write(uri, out) == 0
    text = out.read_text()
    assert "## Spike 1: injected at step 100 (MLflow steps 101–105)" in text
    assert row(text, "recovery") == "160 steps: the loss EMA was back within 2% of 4.0000 at step 260"
    assert row(text, "loss before") == "4.0000 (step 100)"
    assert row(text, "peak loss") == "12.0000 (step 110)"
    assert row(text, "loss after") == "4.0000 (step 120)"
    # The injected steps' own grad norms were not logged (no spike_grad_norm in this run): said so.
    assert row(text, "grad norm") == ("7 at step 110, the largest of 1 measured, before clipping (threshold 1); "
                                      "not measured at step(s) 101, 102, 103, 104, 105")
    assert row(text, "clipping fired") == ("yes: clipped at step(s) 110; not measured at step(s) 101, 102, 103, 104, "
                                           "105: no conclusion for those")
    assert row(text, "learning rate") == "1.000e-03 (step 110)"
    assert row(text, "val loss") == "4.1000 (step 100) before, 4.2000 (step 200) after"
    assert_png(tmp_path / "spike-postmortem-step-101.png")


def test_a_spike_that_never_settles_is_reported_as_not_recovered(spiked_run: SpikedRun, tmp_path: Path) -> None:
    uri = f"sqlite:///{tmp_path / 'stuck.db'}"
    known_run(uri, spiked_run, after=6.0)  # the loss stays 50% above its old level
    out = tmp_path / "spike-postmortem.md"
    assert write(uri, out) == 0
    assert row(out.read_text(), "recovery").startswith("not recovered within the logged steps")


def test_a_run_without_spikes_still_gets_a_postmortem_saying_so(spiked_run: SpikedRun, tmp_path: Path) -> None:
    uri = f"sqlite:///{tmp_path / 'calm.db'}"
    new_run(uri, spiked_run, [("loss", 5.0 - s / 100, s * 1000, s) for s in range(5, 101, 5)])
    out = tmp_path / "spike-postmortem.md"
    assert write(uri, out) == 0
    text = out.read_text()
    assert "## No spike was seen" in text and "## Spike 1" not in text
    assert not list(tmp_path.glob("*.png"))
    assert_only_prompts(text)
    assert check_postmortem(tmp_path).ok  # the DoD's check 5 is about the file existing


def test_a_skipped_injection_gives_the_postmortem_of_the_natural_spike(spiked_run: SpikedRun, tmp_path: Path) -> None:
    uri = f"sqlite:///{tmp_path / 'natural.db'}"
    note = "spike injection at step 50 skipped: a natural spike was detected at step 31; write the post-mortem about that one"
    metrics = [("loss", 9.0 if s == 40 else 4.0, s * 1000, s) for s in range(10, 101, 10)]
    metrics += [("spike", 1.0, 31_000, 31), ("spike_injection_skipped", 1.0, 50_000, 50)]
    new_run(uri, spiked_run, metrics, tags={"x1.spike_injection": note}, params={"train.log_every": "10"})
    out = tmp_path / "spike-postmortem.md"
    assert write(uri, out) == 0
    text = out.read_text()
    assert "## Spike 1: detected at step 31" in text and "injected at step" not in text
    assert "the injection at step 50 was **skipped**" in text and note in text
    assert row(text, "peak loss") == "9.0000 (step 40)"
    assert row(text, "kind") == "detected (not injected): the detector flagged MLflow step(s) 31"


def test_an_existing_postmortem_is_kept_unless_forced(spiked_run: SpikedRun, tmp_path: Path,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "spike-postmortem.md"
    out.write_text("# what the person wrote\n")
    assert write(spiked_run.uri, out) == 2
    assert "pass --force" in capsys.readouterr().err
    assert out.read_text() == "# what the person wrote\n"
    assert write(spiked_run.uri, out, "--force") == 0
    assert "## Spike 1: injected at step" in out.read_text()
