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
from x1_pretrain.stack.process import Service, mlflow_server, signal_group, wait_until

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


class BasicAuthProxy:
    """A reverse proxy on 127.0.0.1 that asks for basic auth, as one in front of MLflow or the
    sidecar would: /budget (with its own user) serves `budget`, the rest goes to `upstream`.
    Counts what it let through and what it refused."""

    def __init__(self, upstream: str, mlflow_auth: tuple[str, str], budget: Path, budget_auth: tuple[str, str]) -> None:
        import base64
        import threading
        import urllib.error
        import urllib.request
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

        def header(user: str, password: str) -> str:
            return "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()

        self.passed = {"mlflow": 0, "budget": 0}
        self.refused = 0
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: object) -> None:
                pass

            def handle_one(self) -> None:
                route = "budget" if self.path.startswith("/budget") else "mlflow"
                wanted = header(*(budget_auth if route == "budget" else mlflow_auth))
                if self.headers.get("Authorization") != wanted:
                    proxy.refused += 1
                    self.send_response(401)
                    self.send_header("WWW-Authenticate", 'Basic realm="x1"')
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                proxy.passed[route] += 1
                if route == "budget":
                    status, body, ctype = 200, budget.read_bytes(), "application/json"
                else:
                    length = int(self.headers.get("Content-Length") or 0)
                    request = urllib.request.Request(upstream + self.path, data=self.rfile.read(length) if length else None,
                                                     method=self.command)
                    if self.headers.get("Content-Type"):
                        request.add_header("Content-Type", self.headers["Content-Type"])
                    try:
                        with urllib.request.urlopen(request, timeout=30) as resp:
                            status, body, ctype = resp.status, resp.read(), resp.headers.get("Content-Type", "")
                    except urllib.error.HTTPError as e:
                        status, body, ctype = e.code, e.read(), e.headers.get("Content-Type", "")
                self.send_response(status)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            do_GET = do_POST = do_PATCH = do_DELETE = handle_one  # noqa: N815

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def test_password_in_mlflow_uri_never_reaches_params_state_or_log(tmp_path, tiny_data):
    from mlflow.tracking import MlflowClient

    from x1_common.fsutil import write_json_atomic

    secret, budget_secret = "Pa55-mlflow-7c1e9d", "Bud-get-4f0a2b"
    port = free_port()
    server = start_mlflow(tmp_path, port)
    budget = tmp_path / "served-budget.json"
    write_json_atomic(budget, {"spent_usd": 1.0, "rate_usd_per_hr": 1.1, "hours_elapsed": 0.9, "projected_total_usd": 5.0,
                               "last_update_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "stale": False})
    proxy = BasicAuthProxy(f"http://127.0.0.1:{port}", ("x1", secret), budget, ("meter", budget_secret))
    host = proxy.url.removeprefix("http://")
    ckpt = tmp_path / "ckpt"
    try:
        proc = run_module("x1_pretrain.train", *train_args(
            tiny_data, ckpt, f"http://x1:{secret}@{host}", "--budget-cap-usd", "35",
            "--budget-curr-cost-uri", f"http://meter:{budget_secret}@{host}/budget", total=10), timeout=300)
        output = proc.stdout + proc.stderr
        assert proc.returncode == 0, output[-3000:]
        # The credentials did their work, from the environment: MLflow and the budget reads got through.
        assert proxy.passed["mlflow"] > 0 and proxy.passed["budget"] > 0 and proxy.refused == 0
        run_id = json.loads((ckpt / "mlflow-run.json").read_text())["run_id"]
        params = MlflowClient(f"http://127.0.0.1:{port}").get_run(run_id).data.params
        assert params["tracking.mlflow_uri"] == f"http://{host}"
        assert params["budget.curr_cost_uri"] == f"http://{host}/budget"
        assert (ckpt / "latest").is_file() and list(ckpt.glob("step_*/trainer_state.json"))
        # The run folder's tools read the same store with the same URI: through MLflow's variables too.
        before = proxy.passed["mlflow"]
        for tool, out in (("x1_pretrain.export_run", tmp_path / "run"),
                          ("x1_pretrain.postmortem", tmp_path / "run" / "spike-postmortem.md")):
            proc = run_module(tool, "--mlflow-uri", f"http://x1:{secret}@{host}", "--output", str(out), timeout=300)
            output += proc.stdout + proc.stderr
            assert proc.returncode == 0, output[-3000:]
        assert proxy.passed["mlflow"] > before and proxy.refused == 0
        assert json.loads((tmp_path / "run" / "manifest.json").read_text())["mlflow"]["tracking_uri"] == f"http://{host}"
        for text, where in [(output, "the trainer's output")] + [
                (p.read_bytes().decode("utf-8", errors="replace"), str(p)) for p in tmp_path.rglob("*") if p.is_file()]:
            for word in (secret, budget_secret):
                assert word not in text, f"a password in {where}"
    finally:
        proxy.close()
        server.stop()
