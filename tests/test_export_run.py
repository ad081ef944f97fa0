"""export_run: the run folder of a tiny CPU run with an injected spike, read from real MLflow
(sqlite and a real `mlflow server`); stopped runs, resumed runs, bad input, a day's worth of metrics.

`spiked_run` (session-wide, shared with test_dod.py and test_postmortem.py) trains the tiny config
for 70 steps with `--inject-spike-at-step 50` in a /workspace-like layout (checkpoints/,
budget.json, logs/termination.json), exports it and writes its post-mortem, all through the CLIs.
"""

from __future__ import annotations

import csv
import io
import json
import math
import os
import shutil
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from datetime import timedelta
from pathlib import Path

import pytest
from PIL import Image

from conftest import cli_env, free_port, run_module, train_args
from x1_common.contracts import BudgetReading, utc_now
from x1_common.fsutil import sha256_file
from x1_pretrain.stack.process import mlflow_server, wait_until

SPIKE_AT = 50
TOTAL_STEPS = 70
TOKENS_PER_STEP = 512  # tiny-cpu.yaml
SPENT_USD = 1.37
PNGS = ("loss-curve.png", "gradnorm-curve.png", "throughput.png")
JUPYTER_TOKEN = "jt-5f0c1d2e3b4a"  # Lambda's instance record carries one; it must not reach the run folder


@dataclass(frozen=True)
class SpikedRun:
    root: Path  # the workspace: checkpoints/, budget.json, logs/, run/
    db: Path
    run_id: str

    @property
    def uri(self) -> str:
        return f"sqlite:///{self.db}"

    @property
    def ckpt(self) -> Path:
        return self.root / "checkpoints"

    @property
    def run_dir(self) -> Path:
        return self.root / "run"


def write_workspace_records(root: Path, spent_usd: float = SPENT_USD) -> None:
    """budget.json as the sidecar writes it and termination.json as the watchdog writes it (a
    Lambda terminate answer, then the instance record asked for again)."""
    reading = BudgetReading(spent_usd=spent_usd, rate_usd_per_hr=1.10, hours_elapsed=1.25, projected_total_usd=26.4,
                            last_update_utc=utc_now() - timedelta(minutes=2), cap_usd=35.0, provider="lambda",
                            instance_id="inst-1", source="provider-api")
    (root / "budget.json").write_text(json.dumps(reading.to_dict()))
    instance = {"id": "inst-1", "name": "x1", "status": "terminated", "jupyter_token": JUPYTER_TOKEN,
                "instance_type": {"name": "gpu_1x_a100_sxm4", "price_cents_per_hour": 110}}
    record = {"provider": "lambda", "instance_id": "inst-1", "time": "2026-05-24T15:42:01.000Z", "exit_code": 0,
              "reason": "finished", "response": {"data": {"terminated_instances": [instance]}},
              "instance_after": {"status": "terminated", "raw_status": "terminated", "raw": instance}}
    (root / "logs").mkdir(exist_ok=True)
    (root / "logs" / "termination.json").write_text(json.dumps(record))


def build_spiked_run(root: Path, data: Path) -> SpikedRun:
    db = root / "mlflow.db"
    uri = f"sqlite:///{db}"
    train = run_module("x1_pretrain.train", *train_args(data, root / "checkpoints", uri, "--inject-spike-at-step",
                                                        str(SPIKE_AT), total=TOTAL_STEPS), timeout=900)
    assert train.returncode == 0, train.stderr[-3000:]
    write_workspace_records(root)
    # No --budget-file / --termination-file: the export finds them beside the checkpoints.
    export = run_module("x1_pretrain.export_run", "--mlflow-uri", uri, "--output", str(root / "run"))
    assert export.returncode == 0, export.stderr[-3000:]
    post = run_module("x1_pretrain.postmortem", "--mlflow-uri", uri, "--output", str(root / "run" / "spike-postmortem.md"))
    assert post.returncode == 0, post.stderr[-3000:]
    run_id = json.loads((root / "run" / "manifest.json").read_text())["mlflow"]["run_id"]
    return SpikedRun(root, db, run_id)


@pytest.fixture(scope="session")
def spiked_run(tmp_path_factory: pytest.TempPathFactory, tiny_data: Path) -> SpikedRun:
    # Imported by test_dod.py and test_postmortem.py too: each module gets its own copy of this
    # fixture, so the run is cached on disk and built once per session.
    root = tmp_path_factory.getbasetemp() / "spiked-run"
    ready = root / "READY.json"
    if ready.is_file():
        saved = json.loads(ready.read_text())
        return SpikedRun(Path(saved["root"]), Path(saved["db"]), saved["run_id"])
    if root.exists():  # another module's copy of this fixture tried and failed: say so, do not retrain
        pytest.fail(f"building the spiked run failed earlier in this session (see {root})")
    root.mkdir()
    run = build_spiked_run(root, tiny_data)
    ready.write_text(json.dumps({k: str(v) for k, v in asdict(run).items()}))
    return run


def mlflow_histories(uri: str, run_id: str) -> dict[str, list]:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(uri)
    return {k: client.get_metric_history(run_id, k) for k in client.get_run(run_id).data.metrics}


def read_csv_rows(path: Path) -> list[tuple[int, str, float]]:
    reader = csv.DictReader(io.StringIO(path.read_text()))
    assert reader.fieldnames == ["step", "name", "value"]
    return [(int(r["step"]), r["name"], float(r["value"])) for r in reader]


def assert_png(path: Path) -> None:
    with Image.open(path) as im:
        im.verify()
    with Image.open(path) as im:
        assert im.format == "PNG" and im.size[0] > 300 and im.size[1] > 200


@contextmanager
def real_mlflow_server(db: Path, workdir: Path) -> Iterator[str]:
    """A real `mlflow server` on a free port of 127.0.0.1, over a sqlite backend."""
    server = mlflow_server(db, workdir / "artifacts", free_port(), workdir / "mlflow-server.log", cli_env())
    try:
        wait_until(server.healthy, 120, "mlflow server /health")
        yield server.url
    finally:
        server.stop(grace=15)


def new_run(uri: str, like: SpikedRun, metrics: list[tuple[str, float, int, int]], tags: dict[str, str] | None = None,
            params: dict[str, str] | None = None) -> str:
    """A run in a fresh store with the spiked run's params and tags (overridden by `params`,
    `tags`) and the given metrics (name, value, timestamp ms, step), logged in that order."""
    from mlflow.entities import Metric, Param
    from mlflow.tracking import MlflowClient

    src = MlflowClient(like.uri).get_run(like.run_id)
    client = MlflowClient(uri)
    exp = client.create_experiment("x1-pretraining")
    run = client.create_run(exp, tags={**src.data.tags, **(tags or {})})
    params = [Param(k, v) for k, v in {**src.data.params, **(params or {})}.items()]
    for i in range(0, len(params), 100):
        client.log_batch(run.info.run_id, params=params[i : i + 100])
    batch = [Metric(k, v, ts, s) for k, v, ts, s in metrics]
    for i in range(0, len(batch), 1000):
        client.log_batch(run.info.run_id, metrics=batch[i : i + 1000])
    client.set_terminated(run.info.run_id, "FINISHED")
    return run.info.run_id


def flip_byte(path: Path) -> None:
    """Invert one byte in the middle of the file (tensor data, past the safetensors header)."""
    with open(path, "r+b") as f:
        f.seek(path.stat().st_size // 2)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0xFF]))


def export_main(*args: str) -> int:
    from x1_pretrain.run import export as export_run

    return export_run.main(list(args))


# ---------------------------------------------------------------------------------------------


def test_export_writes_every_artifact_and_each_is_valid(spiked_run: SpikedRun) -> None:
    run_dir = spiked_run.run_dir
    for name in ("manifest.json", "metrics.csv", *PNGS, "final.safetensors", "mlflow-run-uri.txt",
                 "budget.json", "termination.json"):
        assert (run_dir / name).is_file(), name
    for name in PNGS:
        assert_png(run_dir / name)

    # metrics.csv: one row per (step, name), the values MLflow holds (no resume: one value each).
    rows = read_csv_rows(run_dir / "metrics.csv")
    assert len({(s, n) for s, n, _ in rows}) == len(rows)
    histories = mlflow_histories(spiked_run.uri, spiked_run.run_id)
    assert {(s, n, v) for s, n, v in rows} == {(m.step, k, m.value) for k, h in histories.items() for m in h}
    names = {n for _, n, _ in rows}
    assert {"loss", "val_loss", "grad_norm", "param_norm", "tokens_per_sec", "lr", "spike_injected"} <= names

    # final.safetensors: the trainer's final weights, as recorded, and it round-trips.
    from x1_pretrain.checkpoint.load import load_weights
    from x1_pretrain.checkpoint.weights import weights_bytes

    manifest = json.loads((run_dir / "manifest.json").read_text())
    final = run_dir / "final.safetensors"
    assert final.read_bytes() == (spiked_run.ckpt / "final.safetensors").read_bytes()
    assert manifest["final_weights"]["sha256"] == sha256_file(final)
    state, cfg, meta = load_weights(final)
    assert weights_bytes(state, cfg, {k: v for k, v in meta.items() if k not in ("format", "model_config")}) == final.read_bytes()

    # manifest.json: every field, each matching where it comes from.
    from mlflow.tracking import MlflowClient

    tags = MlflowClient(spiked_run.uri).get_run(spiked_run.run_id).data.tags
    loss = sorted((m.step, m.value) for m in histories["loss"])
    val = sorted((m.step, m.value) for m in histories["val_loss"])
    assert manifest["seed"] == 42
    for pkg in ("torch", "flash-attn", "transformers", "numpy", "tiktoken", "mlflow"):
        assert manifest["versions"][pkg] == tags[f"x1.version.{pkg}"], pkg
    assert manifest["config_sha256"] == tags["x1.config_hash"]
    assert manifest["config"]["train"]["total_steps"] == TOTAL_STEPS and manifest["config"]["model"]["d_model"] == 64
    cluster = manifest["cluster"]
    assert cluster["gpu_name"] == "none" and cluster["gpu_count"] == 0 and cluster["vcpus"] == os.cpu_count()
    assert cluster["ram_gb"] > 0 and "driver" in cluster
    assert (cluster["provider"], cluster["instance_id"], cluster["instance_type"]) == ("lambda", "inst-1", "gpu_1x_a100_sxm4")
    assert manifest["spent_usd"] == SPENT_USD and manifest["cap_usd"] == 35.0
    assert manifest["end"] == "finished"
    assert manifest["steps"] == TOTAL_STEPS and manifest["tokens_seen"] == TOTAL_STEPS * TOKENS_PER_STEP
    assert manifest["wall_hours"] == max(m.value for m in histories["wall_hours"]) > 0
    assert (manifest["final_train_loss_step"], manifest["final_train_loss"]) == loss[-1]
    assert (manifest["final_val_loss_step"], manifest["final_val_loss"]) == val[-1] and val[-1][0] == TOTAL_STEPS
    assert math.isfinite(manifest["predicted_val_loss"]) and math.isfinite(manifest["planned_val_loss"]["value"])
    assert manifest["restarts"] == 0
    assert manifest["git_sha"] == tags["x1.git_sha"]
    assert manifest["spikes"]["injected_at_step"] == SPIKE_AT
    assert manifest["final_weights"]["step"] == TOTAL_STEPS
    assert set(manifest["files"]) >= {"metrics.csv", "final.safetensors", *PNGS, "termination.json"}

    assert spiked_run.run_id in (run_dir / "mlflow-run-uri.txt").read_text()
    # The watchdog's record is copied with the provider's secret fields masked.
    copied = (run_dir / "termination.json").read_text()
    assert JUPYTER_TOKEN not in copied and json.loads(copied)["instance_after"]["status"] == "terminated"


def test_export_through_a_real_mlflow_server_matches_sqlite_and_hides_credentials(spiked_run: SpikedRun,
                                                                                   tmp_path: Path) -> None:
    db = tmp_path / "served.db"
    shutil.copyfile(spiked_run.db, db)
    password = "pw-9b3e71c4"
    with real_mlflow_server(db, tmp_path) as url:
        uri = url.replace("http://", f"http://x1user:{password}@")
        proc = run_module("x1_pretrain.export_run", "--mlflow-uri", uri, "--output", str(tmp_path / "run"),
                          "--ckpt-dir", str(spiked_run.ckpt))
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = tmp_path / "run"
    assert (out / "metrics.csv").read_bytes() == (spiked_run.run_dir / "metrics.csv").read_bytes()
    served, local = (json.loads((d / "manifest.json").read_text()) for d in (out, spiked_run.run_dir))
    for key in ("seed", "versions", "config_sha256", "config", "end", "final_val_loss", "tokens_seen", "spent_usd",
                "final_weights", "cluster", "spikes"):
        assert served[key] == local[key], key
    # the credentials left the URI for MLflow's own environment variables before any use
    assert served["mlflow"]["tracking_uri"] == url
    assert (out / "mlflow-run-uri.txt").read_text().startswith(f"{url}/#/experiments/")
    for path in out.iterdir():
        assert password.encode() not in path.read_bytes(), path.name
    assert password not in proc.stdout + proc.stderr


def test_a_run_stopped_early_exports_its_newest_verified_checkpoint(spiked_run: SpikedRun, tmp_path: Path) -> None:
    from mlflow.tracking import MlflowClient

    db = tmp_path / "stopped.db"
    shutil.copyfile(spiked_run.db, db)
    MlflowClient(f"sqlite:///{db}").set_tag(spiked_run.run_id, "x1.end", "budget-stop")
    ckpt = tmp_path / "checkpoints"
    shutil.copytree(spiked_run.ckpt, ckpt)
    (ckpt / "final.safetensors").unlink()
    newest, older = sorted(ckpt.glob("step_*"))[-1], sorted(ckpt.glob("step_*"))[-2]
    flip_byte(newest / "model.safetensors")  # bit rot: the newest no longer matches its recorded sha256

    assert export_main("--mlflow-uri", f"sqlite:///{db}", "--output", str(tmp_path / "run"), "--ckpt-dir", str(ckpt)) == 0
    manifest = json.loads((tmp_path / "run" / "manifest.json").read_text())
    assert (tmp_path / "run" / "final.safetensors").read_bytes() == (older / "model.safetensors").read_bytes()
    assert manifest["end"] == "budget-stop"
    assert manifest["final_weights"]["step"] == int(older.name.split("_")[1])
    why = manifest["final_weights"]["why"]
    assert "budget-stop" in why and older.name in why and f"skipped {newest.name}" in why


def test_after_a_resume_the_value_logged_last_survives(spiked_run: SpikedRun, tmp_path: Path) -> None:
    # A first process logs steps 5..20 and dies after 20; its checkpoint was at 10. The resumed
    # process logs `restart` at 10, then 15 and 20 again with its own values, later in time.
    first = [("loss", 9.0, 1_000, 5), ("loss", 8.0, 2_000, 10), ("loss", 7.5, 3_000, 15), ("loss", 7.0, 4_000, 20)]
    resumed = [("restart", 1.0, 9_000, 10), ("loss", 7.4, 10_000, 15), ("loss", 6.9, 11_000, 20), ("loss", 6.5, 12_000, 25)]
    uri = f"sqlite:///{tmp_path / 'resumed.db'}"
    new_run(uri, spiked_run, first + resumed)

    assert export_main("--mlflow-uri", uri, "--output", str(tmp_path / "run"), "--ckpt-dir", str(spiked_run.ckpt)) == 0
    rows = read_csv_rows(tmp_path / "run" / "metrics.csv")
    assert [(s, v) for s, n, v in rows if n == "loss"] == [(5, 9.0), (10, 8.0), (15, 7.4), (20, 6.9), (25, 6.5)]
    assert [(s, n, v) for s, n, v in rows if n == "restart"] == [(10, "restart", 1.0)]
    manifest = json.loads((tmp_path / "run" / "manifest.json").read_text())
    assert manifest["restarts"] == 1 and manifest["final_train_loss"] == 6.5


def test_restarts_come_from_the_watchdog_events_when_given(spiked_run: SpikedRun, tmp_path: Path) -> None:
    events = tmp_path / "watchdog-events.jsonl"
    lines = [{"event": "start"}, {"event": "exit", "exit_code": -9}, {"event": "relaunch", "exit_code": -9},
             {"event": "start"}, {"event": "exit", "exit_code": 75}, {"event": "relaunch", "exit_code": 75},
             {"event": "start"}, {"event": "exit", "exit_code": 0}]
    events.write_text("".join(json.dumps(e) + "\n" for e in lines))
    assert export_main("--mlflow-uri", spiked_run.uri, "--output", str(tmp_path / "run"), "--events-file", str(events)) == 0
    manifest = json.loads((tmp_path / "run" / "manifest.json").read_text())
    assert manifest["restarts"] == 2 and str(events) in manifest["restarts_source"]


def test_missing_budget_and_termination_files_are_left_out_with_their_reasons(spiked_run: SpikedRun,
                                                                             tmp_path: Path) -> None:
    ckpt = tmp_path / "elsewhere" / "checkpoints"  # no budget.json nor logs/ beside it
    shutil.copytree(spiked_run.ckpt, ckpt)
    assert export_main("--mlflow-uri", spiked_run.uri, "--output", str(tmp_path / "run"), "--ckpt-dir", str(ckpt)) == 0
    manifest = json.loads((tmp_path / "run" / "manifest.json").read_text())
    assert manifest["spent_usd"] is None and "no budget file" in manifest["spent_usd_reason"]
    assert manifest["termination"] is None and not (tmp_path / "run" / "budget.json").exists()

    # Named but absent (the sidecar never wrote, the terminate never happened): noted, not fatal.
    gone = tmp_path / "gone"
    assert export_main("--mlflow-uri", spiked_run.uri, "--output", str(tmp_path / "run2"), "--ckpt-dir", str(ckpt),
                       "--budget-file", str(gone / "budget.json"), "--termination-file", str(gone / "t.json")) == 0
    manifest = json.loads((tmp_path / "run2" / "manifest.json").read_text())
    assert manifest["spent_usd_reason"] == f"--budget-file {gone / 'budget.json'}: no such file"
    assert f"--termination-file {gone / 't.json'}: no such file, left out" in manifest["notes"]
    assert not (tmp_path / "run2" / "termination.json").exists()


def test_force_replaces_the_export_and_keeps_the_persons_files(spiked_run: SpikedRun, tmp_path: Path) -> None:
    out = tmp_path / "run"
    shutil.copytree(spiked_run.run_dir, out)
    (out / "spike-postmortem.md").write_text("# written by a person\n")
    (out / "metrics.csv").write_text("stale\n")
    assert export_main("--mlflow-uri", spiked_run.uri, "--output", str(out), "--force") == 0
    assert (out / "spike-postmortem.md").read_text() == "# written by a person\n"
    assert (out / "metrics.csv").read_bytes() == (spiked_run.run_dir / "metrics.csv").read_bytes()
    assert [p.name for p in tmp_path.iterdir()] == ["run"]  # no temp or replaced folder left behind


def test_export_run_force_into_the_workspace_replaces_nothing_it_did_not_write(
        spiked_run: SpikedRun, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """--output the workspace itself: its budget.json (the sidecar's) has a name the export writes
    but no earlier export wrote it, so the export is refused naming it, and the workspace, the
    checkpoints and budget.json included, is unchanged byte for byte."""
    workspace = tmp_path / "workspace"
    shutil.copytree(spiked_run.root, workspace, ignore=shutil.ignore_patterns("run", "READY.json"))
    assert (workspace / "budget.json").is_file() and (workspace / "checkpoints").is_dir()

    def tree() -> dict[str, str]:
        return {p.relative_to(workspace).as_posix(): sha256_file(p) if p.is_file() else "dir"
                for p in sorted(workspace.rglob("*"))}

    before = tree()
    capsys.readouterr()
    assert export_main("--mlflow-uri", spiked_run.uri, "--ckpt-dir", str(workspace / "checkpoints"),
                       "--output", str(workspace), "--force") == 2
    err = capsys.readouterr().err
    assert "budget.json" in err and "nothing was replaced" in err, err
    assert tree() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["workspace"]  # no temp folder left


def test_bad_input_exits_2_naming_the_problem_and_writes_nothing(spiked_run: SpikedRun, tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    from mlflow.tracking import MlflowClient

    from x1_pretrain.run import record

    monkeypatch.setattr(record, "CONNECT_DELAYS_S", (0.2,))
    empty_db = tmp_path / "empty.db"
    MlflowClient(f"sqlite:///{empty_db}").create_experiment("x1-pretraining")
    (tmp_path / "no-weights").mkdir()
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "keep.txt").write_text("x")
    cases = [
        (["--mlflow-uri", spiked_run.uri, "--run-id", "0123456789abcdef"], "no run with id '0123456789abcdef'"),
        (["--mlflow-uri", f"sqlite:///{tmp_path / 'missing.db'}"], f"no MLflow database at {tmp_path / 'missing.db'}"),
        (["--mlflow-uri", f"sqlite:///{empty_db}"], "no runs in any experiment"),
        (["--mlflow-uri", f"http://127.0.0.1:{free_port()}"], "cannot read the MLflow tracking store"),
        (["--mlflow-uri", spiked_run.uri, "--ckpt-dir", str(tmp_path / "no-weights")], "no weights in"),
        (["--mlflow-uri", spiked_run.uri, "--ckpt-dir", str(tmp_path / "nowhere")], "does not exist"),
        (["--mlflow-uri", spiked_run.uri, "--budget-file", str(spiked_run.run_dir / "manifest.json")],
         "lacks rate_usd_per_hr"),
    ]
    for args, message in cases:
        assert export_main(*args, "--output", str(tmp_path / "out")) == 2, args
        err = capsys.readouterr().err
        assert message in err, (args, err)
        assert not (tmp_path / "out").exists(), args
    assert not (tmp_path / "missing.db").exists()  # MLflow would have created an empty store there
    assert export_main("--mlflow-uri", spiked_run.uri, "--output", str(tmp_path / "full")) == 2
    assert "not empty" in capsys.readouterr().err
    assert [p.name for p in (tmp_path / "full").iterdir()] == ["keep.txt"]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temp folder left

    proc = run_module("x1_pretrain.export_run", "--mlflow-uri", spiked_run.uri, "--run-id", "feedface",
                      "--output", str(tmp_path / "out"))
    assert proc.returncode == 2 and "no run with id 'feedface'" in proc.stderr and not (tmp_path / "out").exists()


def test_a_day_of_metrics_exports_in_seconds(spiked_run: SpikedRun, tmp_path: Path) -> None:
    # 84,000 steps logged every 10: 8,400 log steps x 10 metrics = 84k points.
    names = ["loss", "lr", "grad_norm", "param_norm", "tokens_per_sec", "mfu", "tokens_seen", "wall_hours", "clipped",
             "spent_usd"]
    metrics = [(n, 3.3 + 7 * math.exp(-s / 20_000) if n == "loss" else s / 1000, s * 1000, s)
               for s in range(10, 84_001, 10) for n in names]
    uri = f"sqlite:///{tmp_path / 'day.db'}"
    new_run(uri, spiked_run, metrics)
    t = time.perf_counter()
    assert export_main("--mlflow-uri", uri, "--output", str(tmp_path / "run"), "--ckpt-dir", str(spiked_run.ckpt)) == 0
    seconds = time.perf_counter() - t
    rows = read_csv_rows(tmp_path / "run" / "metrics.csv")
    assert len(rows) == len(metrics)
    assert seconds < 20, f"export of 84k points took {seconds:.1f} s"  # ~4 s on 2 busy cores


def test_a_preempted_then_finished_run_ends_finished_without_the_preemption_as_its_detail(spiked_run: SpikedRun,
                                                                                          tmp_path: Path) -> None:
    # A trainer of before the fix left the preemption's x1.end_reason beside the finish's x1.end.
    uri = f"sqlite:///{tmp_path / 'stale.db'}"
    new_run(uri, spiked_run, [("loss", 5.0, 1000, 10)], tags={"x1.end": "finished", "x1.end_reason": "preempted"})
    assert export_main("--mlflow-uri", uri, "--output", str(tmp_path / "run"), "--ckpt-dir", str(spiked_run.ckpt)) == 0
    manifest = json.loads((tmp_path / "run" / "manifest.json").read_text())
    assert manifest["end"] == "finished"
    assert manifest["end_detail"].startswith("tag x1.end; MLflow status FINISHED")
    assert "left by an earlier exit" in manifest["end_detail"]
    # The trainer's own detail, when consistent, is kept as it is.
    uri2 = f"sqlite:///{tmp_path / 'fresh.db'}"
    new_run(uri2, spiked_run, [("loss", 5.0, 1000, 10)],
            tags={"x1.end": "finished", "x1.end_reason": "total steps reached (step 70)"})
    assert export_main("--mlflow-uri", uri2, "--output", str(tmp_path / "run2"), "--ckpt-dir", str(spiked_run.ckpt)) == 0
    assert json.loads((tmp_path / "run2" / "manifest.json").read_text())["end_detail"] == "total steps reached (step 70)"


def test_the_predicted_val_loss_is_never_worse_than_a_uniform_guess(spiked_run: SpikedRun) -> None:
    manifest = json.loads((spiked_run.run_dir / "manifest.json").read_text())
    uniform = math.log(50257)
    basis = manifest["predicted_val_loss_basis"]
    assert basis["fit_value"] > uniform  # the tiny run: 3.3M parameters, 36k tokens, far outside the fit
    assert manifest["predicted_val_loss"] == round(uniform, 4) and basis["in_fit_range"] is False
    assert "worse than a uniform guess" in basis["note"] and "outside the fit's" in basis["note"]
    assert manifest["planned_val_loss"]["value"] <= uniform
    from x1_pretrain.train.accounting import chinchilla_loss, predicted_loss

    seed = predicted_loss(88.9e6, 84_000 * 524_288, 50257)  # the lab's 50M run: inside the fit, unchanged
    assert seed.in_fit_range and seed.note is None and seed.value == chinchilla_loss(88.9e6, 84_000 * 524_288) < 3.5


def test_restart_cost_without_watchdog_events_comes_from_the_trainers_metrics(spiked_run: SpikedRun,
                                                                               tmp_path: Path) -> None:
    # Two starts: the first logs steps 5..20, the second resumes from step 10 (a kill at 22).
    t0 = 1_800_000_000.0
    first = [("startup_seconds", 12.5, 1_000, 1), ("first_step_unix", t0 + 12.5, 1_000, 1)]
    first += [("loss", 9.0 - s / 10, 1_000 + s * 100, s) for s in (5, 10, 15, 20)]
    second = [("restart", 1.0, 9_000, 10), ("startup_seconds", 8.0, 9_500, 11), ("first_step_unix", t0 + 40.0, 9_500, 11),
              ("downtime_seconds", 21.0, 9_500, 11)]
    second += [("loss", 8.0 - s / 10, 9_500 + s * 100, s) for s in (15, 20, 25)]
    uri = f"sqlite:///{tmp_path / 'starts.db'}"
    new_run(uri, spiked_run, first + second)
    assert export_main("--mlflow-uri", uri, "--output", str(tmp_path / "run"), "--ckpt-dir", str(spiked_run.ckpt)) == 0
    cost = json.loads((tmp_path / "run" / "manifest.json").read_text())["restart_cost"]
    assert [(s["first_step"], s["startup_seconds"]) for s in cost["starts"]] == [(1, 12.5), (11, 8.0)]
    # A run from before the stop records: its trainer logged the downtime from the last heartbeat.
    (restart,) = cost["restarts"]
    assert (restart["restart"], restart["resumed_first_step"], restart["startup_seconds"], restart["downtime_seconds"],
            restart["stopped_by"], restart["cause"]) == (1, 11, 8.0, 21.0, "last heartbeat", None)
    assert cost["downtime_seconds_total"] == 21.0 and "SIGTERM" in cost["downtime_note"]


def test_restart_cost_with_events_is_the_exit_to_the_relaunched_first_step_and_a_gap_without_one_is_not_measured(
        spiked_run: SpikedRun, tmp_path: Path) -> None:
    from x1_watchdog.records import iso_time

    t0 = 1_800_000_000.0
    metrics = [("startup_seconds", 10.0, 1_000, 1), ("first_step_unix", t0 + 10.0, 1_000, 1),
               ("restart", 1.0, 60_000, 10), ("startup_seconds", 6.0, 60_000, 11), ("first_step_unix", t0 + 60.0, 60_000, 11)]
    events = [{"event": "start", "time": iso_time(t0)},
              {"event": "exit", "exit_code": 75, "time": iso_time(t0 + 50.0)},
              {"event": "relaunch", "exit_code": 75, "reason": "preempted", "downtime_seconds": 2.0,
               "time": iso_time(t0 + 52.0)},
              {"event": "start", "time": iso_time(t0 + 52.0)},
              {"event": "exit", "exit_code": 137, "time": iso_time(t0 + 100.0)},  # killed
              {"event": "relaunch", "exit_code": 137, "reason": "killed", "downtime_seconds": 4.0,
               "time": iso_time(t0 + 104.0)},
              {"event": "start", "time": iso_time(t0 + 104.0)},
              {"event": "exit", "exit_code": 1, "time": iso_time(t0 + 106.0)}]  # died before its first step
    path = tmp_path / "events.jsonl"
    path.write_text("".join(json.dumps(e) + "\n" for e in events))
    uri = f"sqlite:///{tmp_path / 'events.db'}"
    new_run(uri, spiked_run, metrics)
    assert export_main("--mlflow-uri", uri, "--output", str(tmp_path / "run"), "--ckpt-dir", str(spiked_run.ckpt),
                       "--events-file", str(path)) == 0
    manifest = json.loads((tmp_path / "run" / "manifest.json").read_text())
    one, two = manifest["restart_cost"]["restarts"]
    assert (one["cause"], one["downtime_seconds"], one["relaunch_delay_seconds"], one["startup_seconds"]) == \
        ("preempted", 10.0, 2.0, 6.0)
    assert one["stopped_by"] == "exit"  # no stop record from that trainer: the watchdog's exit event
    assert two["cause"] == "killed" and two["downtime_seconds"] is None and two["why"].startswith("not measured")
    assert manifest["restart_cost"]["downtime_seconds_total"] is None and manifest["restarts"] == 2


def test_each_restart_is_its_own_band_from_its_stop_to_the_next_step_with_no_throughput_point_inside(
        spiked_run: SpikedRun, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two restarts resumed from the same checkpoint (step 12): a SIGTERM, then a kill of the
    relaunched process. Each gets its own band and its own figure; the point the first process
    logged after its SIGTERM is inside the first band and is not drawn."""
    from x1_pretrain.run import plots
    from x1_watchdog.records import iso_time

    t0 = 1_800_000_000.0

    def at(name: str, value: float, secs: float, step: int) -> tuple[str, float, int, int]:
        return (name, value, int((t0 + secs) * 1000), step)

    def point(secs: float, step: int, tps: float) -> list[tuple[str, float, int, int]]:
        return [at("tokens_per_sec", tps, secs, step), at("wall_hours", secs / 3600, secs, step)]

    metrics = [at("startup_seconds", 10.0, 10, 1), at("first_step_unix", t0 + 10, 10, 1)]
    metrics += point(20, 5, 100.0) + point(30, 10, 110.0) + point(34, 12, 105.0)  # 12: logged after the SIGTERM (33)
    # The second process: the first's SIGTERM record; logs step 15, then is killed (no stop record).
    second = {"startup_seconds": 13.0, "first_step_unix": t0 + 50, "stopped_unix": t0 + 33, "stopped_by": 0.0,
              "stopped_step": 12.0, "downtime_seconds": 17.0}
    metrics += [at(k, v, 50, 13) for k, v in second.items()] + point(55, 15, 90.0)
    # The third: resumed from step 12 again; the second's last heartbeat (step 15) is all it knew.
    third = {"startup_seconds": 16.0, "first_step_unix": t0 + 80, "stopped_unix": t0 + 55, "stopped_by": 2.0,
             "stopped_step": 15.0}
    metrics += [at(k, v, 80, 13) for k, v in third.items()] + point(80, 13, 95.0) + point(95, 20, 120.0)
    events = [{"event": "start", "time": iso_time(t0)},
              {"event": "exit", "exit_code": 75, "reason": "preempted", "time": iso_time(t0 + 35)},
              {"event": "relaunch", "exit_code": 75, "reason": "preempted", "downtime_seconds": 2.0,
               "time": iso_time(t0 + 37)},
              {"event": "start", "time": iso_time(t0 + 37)},
              {"event": "exit", "exit_code": 137, "reason": "killed", "time": iso_time(t0 + 60)},
              {"event": "relaunch", "exit_code": 137, "reason": "killed", "downtime_seconds": 4.0,
               "time": iso_time(t0 + 64)},
              {"event": "start", "time": iso_time(t0 + 64)},
              {"event": "exit", "exit_code": 0, "reason": "finished", "time": iso_time(t0 + 100)}]
    path = tmp_path / "events.jsonl"
    path.write_text("".join(json.dumps(e) + "\n" for e in events))
    uri = f"sqlite:///{tmp_path / 'bands.db'}"
    new_run(uri, spiked_run, metrics)
    drawn: dict = {}
    real = plots.throughput_curve

    def capture(out, segments, **kw):
        drawn.update(segments=segments, **kw)
        real(out, segments, **kw)

    monkeypatch.setattr(plots, "throughput_curve", capture)
    assert export_main("--mlflow-uri", uri, "--output", str(tmp_path / "run"), "--ckpt-dir", str(spiked_run.ckpt),
                       "--events-file", str(path)) == 0

    one, two = json.loads((tmp_path / "run" / "manifest.json").read_text())["restart_cost"]["restarts"]
    assert (one["stopped_by"], one["stopped_at_step"], one["resumed_first_step"], one["downtime_seconds"], one["cause"]) \
        == ("SIGTERM", 12, 13, 17.0, "preempted")
    # The kill left no stop record: the watchdog's exit event (60), not the last heartbeat (55).
    assert (two["stopped_by"], two["stopped_at_step"], two["downtime_seconds"], two["cause"]) == ("exit", 15, 20.0, "killed")

    bands = drawn["gaps"]
    assert [label for _, _, label in bands] == ["restart 1: 17.0 s", "restart 2: 20.0 s"]
    assert [(round(lo * 3600, 3), round(hi * 3600, 3)) for lo, hi, _ in bands] == [(33.0, 50.0), (60.0, 80.0)]
    plotted = [(round(h * 3600, 3), v) for seg in drawn["segments"] for h, v in seg]
    assert plotted == [(20.0, 100.0), (30.0, 110.0), (55.0, 90.0), (80.0, 95.0), (95.0, 120.0)]
    assert not [h for h, _ in plotted for lo, hi, _ in bands if lo * 3600 <= h < hi * 3600]
    assert len(drawn["segments"]) == 3  # a line never crosses a band
    assert (tmp_path / "run" / "throughput.png").stat().st_size > 0
