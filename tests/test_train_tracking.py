"""The trainer's MLflow logging against a real tracking server (HTTP) and a sqlite store: every
logged metric arrives, also when the server goes away mid-run and comes back."""

from __future__ import annotations

import json
import signal
import subprocess
import time
from pathlib import Path

from conftest import cli_env, free_port, run_module, start_trainer, train_args
from x1_common.contracts import Heartbeat
from x1_pretrain.stack import Service, mlflow_server, signal_group, wait_until

STEPS = 60  # logs every 5 steps (train_args), evals every 20


def start_mlflow(root: Path, port: int) -> Service:
    server = mlflow_server(root / "mlflow.db", root / "artifacts", port, root / f"mlflow-{port}.log", cli_env())
    wait_until(server.healthy, 120, "mlflow server /health")
    return server


def stop(trainer: subprocess.Popen) -> None:
    if trainer.poll() is None:
        signal_group(trainer.pid, signal.SIGTERM)
        try:
            trainer.wait(timeout=30)
        except subprocess.TimeoutExpired:
            signal_group(trainer.pid, signal.SIGKILL)
            trainer.wait()


def heartbeat_step(ckpt: Path) -> int:
    hb = Heartbeat.read(ckpt / "heartbeat.json")
    return hb.step if hb is not None and hb.phase == "training" else -1


def wait_step(ckpt: Path, proc: subprocess.Popen, step: int, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while heartbeat_step(ckpt) < step:
        assert proc.poll() is None and time.monotonic() < deadline
        time.sleep(0.2)


def logged_steps(uri: str, key: str) -> list[int]:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(uri)
    exp = client.get_experiment_by_name("x1-pretraining")
    (run,) = client.search_runs([exp.experiment_id])
    return sorted({m.step for m in client.get_metric_history(run.info.run_id, key)})


def test_metrics_survive_a_tracking_server_restart_mid_run(tmp_path, tiny_data):
    port = free_port()
    server = start_mlflow(tmp_path, port)
    ckpt = tmp_path / "ckpt"
    uri = f"http://127.0.0.1:{port}"
    trainer = start_trainer(train_args(tiny_data, ckpt, uri, total=STEPS), tmp_path / "train.log")
    try:
        wait_step(ckpt, trainer, 15)
        server.stop()  # the server goes away; training must not notice
        down_at = heartbeat_step(ckpt)
        wait_step(ckpt, trainer, down_at + 15)
        server = start_mlflow(tmp_path, port)
        assert trainer.wait(timeout=300) == 0, (tmp_path / "train.log").read_text()[-3000:]
        text = (tmp_path / "train.log").read_text()
        assert "not reachable" in text  # it noticed, logged, and carried on
        expected = list(range(5, STEPS + 1, 5))
        for key in ("loss", "lr", "grad_norm", "param_norm", "tokens_per_sec", "mfu", "tokens_seen"):
            assert logged_steps(uri, key) == expected, key
        assert logged_steps(uri, "val_loss") == [20, 40, 60]
    finally:
        stop(trainer)
        server.stop()


def test_a_sqlite_tracking_uri_records_the_run_with_its_config_and_tags(tmp_path, tiny_data):
    from mlflow.tracking import MlflowClient

    uri = f"sqlite:///{tmp_path}/mlflow.db"
    proc = run_module("x1_pretrain.train", *train_args(tiny_data, tmp_path / "ckpt", uri, total=10), timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    client = MlflowClient(uri)
    (run,) = client.search_runs([client.get_experiment_by_name("x1-pretraining").experiment_id])
    assert run.info.status == "FINISHED"
    assert run.data.params["model.n_layer"] == "2" and run.data.params["optim.lr"] == "0.003"
    tags = run.data.tags
    assert len(tags["x1.config_hash"]) == 64 and tags["x1.end"] == "finished"
    assert tags["x1.version.torch"] and "x1.preflight.vcpus" in tags
    assert json.loads((tmp_path / "ckpt" / "mlflow-run.json").read_text())["run_id"] == run.info.run_id
    assert logged_steps(uri, "loss") == [5, 10]
