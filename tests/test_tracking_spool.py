"""The MLflow logger's spool: metrics logged before a hard kill during the exit flush are on disk."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

from conftest import wait_for

LOGGER = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    from x1_pretrain.train.tracking import MlflowLogger

    logger = MlflowLogger(sys.argv[1], "spool-test", run_id="0123abcd", run_name="r", params={}, tags={},
                          spool_path=Path(sys.argv[2]), flush_seconds=3600.0)
    logger.start()
    for step in (5, 10, 15):
        logger.log(step, {"loss": 10.0 - step / 10})
    print("closing", flush=True)
    logger.close("KILLED", timeout=120.0)  # the server never answers: the flush hangs here
""")


def test_metrics_logged_before_a_kill_during_the_exit_flush_are_in_the_spool(tmp_path: Path) -> None:
    # A tracking server that accepts the connection and never answers, like one whose container
    # is being stopped by the same preemption.
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(8)
    spool = tmp_path / "mlflow-spool.jsonl"
    env = {**os.environ, "MLFLOW_HTTP_REQUEST_TIMEOUT": "300"}
    proc = subprocess.Popen([sys.executable, "-c", LOGGER, f"http://127.0.0.1:{server.getsockname()[1]}",
                             str(spool)], stdout=subprocess.PIPE, text=True, env=env)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "closing"
        wait_for(spool.is_file, 30, "the spool before the flush")
        time.sleep(0.5)
        proc.send_signal(signal.SIGKILL)  # a preemption's grace period ends mid-flush
        proc.wait(timeout=30)
    finally:
        proc.kill()
        server.close()
    header, *rows = spool.read_text().splitlines()
    assert json.loads(header)["run_id"] == "0123abcd"
    assert sorted((r["s"], r["k"], r["v"]) for r in map(json.loads, rows)) == [
        (5, "loss", 9.5), (10, "loss", 9.0), (15, "loss", 8.5)]


def test_a_checkpoint_puts_the_unsent_metrics_of_its_steps_on_disk_first(tmp_path: Path) -> None:
    from x1_pretrain.train.tracking import MlflowLogger

    spool = tmp_path / "mlflow-spool.jsonl"
    # never started: nothing is sent, as when the server is slow and the process dies before a flush
    logger = MlflowLogger("http://127.0.0.1:9", "spool-test", run_id="0123abcd", run_name="r", params={},
                          tags={}, spool_path=spool)
    logger.log(30, {"loss": 7.25})
    logger.persist()
    rows = [json.loads(line) for line in spool.read_text().splitlines()[1:]]
    assert [(r["s"], r["k"], r["v"]) for r in rows] == [(30, "loss", 7.25)]
    # the next process of the same run sends them
    again = MlflowLogger("http://127.0.0.1:9", "spool-test", run_id="0123abcd", run_name="r", params={},
                         tags={}, spool_path=spool)
    assert [(k, v, s) for k, v, _, s in again._pending] == [("loss", 7.25, 30)]
