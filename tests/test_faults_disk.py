"""A disk that refuses a write (full, over quota, read-only) is said for what it is, where it
happens: one line naming the path, the free space and what was needed; the command's exit code for
an environment fault (1), never the bad-input 2 nor a traceback; nothing already safe lost. The
long-running services (sidecar, watchdog, trainer) say it on their health endpoint and metrics
from the first failed write, alert once, log it once and keep trying.

The faults are injected at the write call (OSError(ENOSPC) / OSError(EROFS)), which any CI can do;
the sidecar also runs as a real process over a real socket on a small tmpfs filled to the brim,
where this machine can mount one (root).
"""

from __future__ import annotations

import builtins
import errno
import json
import logging
import os
import re
import shutil
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families
from test_export_run import SpikedRun, export_main, spiked_run  # noqa: F401  (the session's tiny trained run)
from test_prepare import FakeHub
from test_tokenize_data import _good_parquet

import x1_common.fsutil as fsutil
from budget_sidecar import ledger as ledger_mod
from budget_sidecar import poller as poller_mod
from budget_sidecar.app import create_app, health
from budget_sidecar.poller import Poller
from budget_sidecar.settings import SidecarSettings
from budget_sidecar.testing import Sidecar, wait_until
from conftest import free_port
from x1_common.contracts import ExitCode, Heartbeat
from x1_common.fsutil import DiskFaultError, WriteHealth, disk_fault, write_json_atomic
from x1_pretrain.data import prepare as prepare_mod
from x1_pretrain.data import shards as shards_mod
from x1_pretrain.data import tokenize as tokenize_mod
from x1_pretrain.run import export as export_mod
from x1_pretrain.train import tracking
from x1_watchdog import healthcheck
from x1_watchdog import records as records_mod
from x1_watchdog.metrics import WatchdogMetrics
from x1_watchdog.records import EventLog, StateStore

FREE = r"\(\d+(\.\d+)? (GB|MB|kB|bytes) free\)"


def refusing(code: int):
    """A write call that the disk refuses with `code` (ENOSPC, EROFS), wherever it is put."""

    def refuse(*args, **kwargs):
        raise OSError(code, os.strerror(code))

    return refuse


def metric_values(text: str) -> dict[str, object]:
    """name -> value, and for an info metric name -> its labels."""
    out: dict[str, object] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out[sample.name] = sample.labels if sample.name.endswith("_info") else sample.value
    return out


# ---- the one helper ------------------------------------------------------------------------------


@pytest.mark.parametrize(("code", "line"), [
    (errno.ENOSPC, r"no space left on device at {path}, need 2\.0 kB " + FREE),
    (errno.EDQUOT, r"disk quota exceeded at {path}, need 2\.0 kB " + FREE),
    (errno.EROFS, r"read-only file system at {path}, need 2\.0 kB$"),
], ids=["ENOSPC", "EDQUOT", "EROFS"])
def test_an_atomic_write_the_disk_refuses_is_one_line_naming_the_path_the_free_space_and_the_need(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, code: int, line: str) -> None:
    path = tmp_path / "budget.json"
    write_json_atomic(path, {"spent_usd": 1.0})
    before = path.read_bytes()
    monkeypatch.setattr(fsutil, "_create_temp", refusing(code))
    with pytest.raises(DiskFaultError) as e:
        fsutil.write_bytes_atomic(path, b"x" * 2000)
    assert re.fullmatch(line.format(path=re.escape(str(path))), str(e.value)), str(e.value)
    assert e.value.errno == code and e.value.filename == str(path)
    assert path.read_bytes() == before and sorted(p.name for p in tmp_path.iterdir()) == ["budget.json"]


def test_other_errors_are_not_called_a_disk_fault_and_free_space_is_the_nearest_existing_parents(tmp_path: Path) -> None:
    assert disk_fault(OSError(errno.EACCES, "Permission denied"), tmp_path) is None
    assert disk_fault(ValueError("no"), tmp_path) is None
    fault = disk_fault(OSError(errno.ENOSPC, "No space left on device"), tmp_path / "not" / "yet" / "there")
    free = shutil.disk_usage(tmp_path).free
    assert fault is not None and fsutil.size_text(free) in str(fault)
    # Said again for the folder a person knows, keeping what it needed.
    again = disk_fault(fault, tmp_path, what="the run folder")
    assert str(again).startswith(f"no space left on device at {tmp_path} for the run folder")


def test_write_health_says_each_change_once_and_calls_the_alert_once_per_episode(caplog: pytest.LogCaptureFixture) -> None:
    changes: list[str | None] = []
    alerts: list[str] = []
    log = logging.getLogger("x1.test-writes")
    writes = WriteHealth(log, on_change=changes.append, on_first=alerts.append)
    full = OSError(errno.ENOSPC, "No space left on device")
    with caplog.at_level(logging.INFO, logger=log.name):
        for _ in range(5):  # five polls on a full disk
            writes.failed("/ws/budget.json", full, "retried every poll")
        writes.failed("/ws/budget.json", OSError(errno.EROFS, "Read-only file system"))  # another cause: said
        writes.succeeded("/ws/budget.json")
        writes.succeeded("/ws/budget.json")
        writes.failed("/ws/budget.json", full)  # a new episode: said and alerted again
    lines = [r.getMessage() for r in caplog.records]
    assert [line.split(" at ")[0] for line in lines] == [
        "no space left on device", "read-only file system", "/ws/budget.json written again (it failed: read-only file system",
        "no space left on device"], lines
    assert lines[0].endswith(": retried every poll")
    assert len(alerts) == 2 and changes[-1] is not None and changes[2] is None
    assert writes.failures_total == 7 and writes.last_error and writes.last_error.startswith("no space left on device at /ws")


# ---- the budget sidecar -----------------------------------------------------------------------------


class Clock:
    def __init__(self) -> None:
        self.t = 1_750_000_000.0

    def __call__(self) -> float:
        return self.t


def test_the_sidecars_health_turns_not_ok_at_the_first_failed_write_naming_the_path_and_budget_json_stays(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    settings = SidecarSettings(provider="static", rate_usd_per_hr=2.0, output=tmp_path / "budget.json", poll_seconds=300)
    clock = Clock()
    poller = Poller(settings, None, clock=clock)
    client = TestClient(create_app(settings, poller))
    poller.poll_once()
    clock.t += 600
    poller.poll_once()
    assert client.get("/healthz").json()["status"] == "ok"
    published = settings.output.read_bytes()
    spent_before = json.loads(published)["spent_usd"]

    monkeypatch.setattr(ledger_mod, "write_json_atomic", refusing(errno.ENOSPC))  # the ledger goes first
    with caplog.at_level(logging.INFO, logger="x1.budget_sidecar"):
        clock.t += 300
        poller.poll_once()  # the first failed write
        body = client.get("/healthz")
        assert body.status_code == 503
        health_now = body.json()
        assert health_now["status"] == "write-failing" and health_now["last_error_kind"] == "write"
        assert re.fullmatch(rf"no space left on device at {re.escape(str(settings.state_path))} " + FREE,
                            health_now["last_error"]), health_now
        assert health_now["consecutive_failures"] == 0  # the provider answered: only the disk is at fault
        values = metric_values(client.get("/metrics").text)
        assert values["x1_budget_write_failing"] == 1.0
        for _ in range(3):  # it keeps trying, and says it once
            clock.t += 300
            poller.poll_once()
    assert settings.output.read_bytes() == published  # the old budget.json, as it was
    said = [r for r in caplog.records if "no space left on device" in r.getMessage()]
    assert len(said) == 1 and said[0].levelno == logging.ERROR
    assert not [r for r in caplog.records if r.exc_info]  # no traceback

    monkeypatch.undo()  # space again: the next poll writes both, with all the time since counted
    clock.t += 300
    poller.poll_once()
    again = client.get("/healthz").json()
    assert again["status"] == "ok" and again["write_error"] is None and again["last_error"] is None
    assert metric_values(client.get("/metrics").text)["x1_budget_write_failing"] == 0.0
    assert json.loads(settings.output.read_text())["spent_usd"] == pytest.approx(spent_before + 2.0 * 5 * 300 / 3600)


def test_a_read_only_budget_json_keeps_the_ledger_counting_and_says_so_on_healthz(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    settings = SidecarSettings(provider="static", rate_usd_per_hr=2.0, output=tmp_path / "budget.json")
    poller = Poller(settings, None, clock=Clock())
    poller.poll_once()
    real = poller_mod.write_json_atomic

    def budget_json_read_only(path, obj, **kw):
        if Path(path) == settings.output:
            raise OSError(errno.EROFS, os.strerror(errno.EROFS))
        real(path, obj, **kw)

    monkeypatch.setattr(poller_mod, "write_json_atomic", budget_json_read_only)
    poller.clock.t += 300
    poller.poll_once()
    body, status = health(poller.snapshot(), settings, poller.monotonic())
    assert status == 503 and body["status"] == "write-failing"
    assert body["last_error"] == body["write_error"] == f"read-only file system at {settings.output}"
    ledger = json.loads(settings.state_path.read_text())  # the ledger itself was written: spend counted
    assert ledger["spent_usd"] == pytest.approx(2.0 * 300 / 3600)


def _mount_tmpfs(path: Path, size_kb: int) -> bool:
    path.mkdir(parents=True, exist_ok=True)
    if os.geteuid() != 0 or shutil.which("mount") is None:
        return False
    return subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_kb}k", "tmpfs", str(path)],
                          capture_output=True).returncode == 0


def _fill(folder: Path) -> Path:
    """Fill the filesystem of `folder` to the last byte."""
    filler = folder / "filler"
    with open(filler, "wb", buffering=0) as f:
        try:
            while True:
                f.write(b"\0" * 4096)
        except OSError as e:
            assert e.errno == errno.ENOSPC
    return filler


def test_a_real_sidecar_on_a_full_disk_answers_503_naming_budget_json_at_once_and_recovers(tmp_path: Path) -> None:
    disk = tmp_path / "small-disk"
    if not _mount_tmpfs(disk, 256):
        pytest.skip("a real full filesystem needs root and mount (tmpfs); the injected ENOSPC tests cover the logic")
    try:
        sidecar = Sidecar.start(tmp_path / "logs", disk / "budget.json", provider="static", poll_seconds=0.5,
                                extra_args=["--rate-usd-per-hr", "1.10"], port=free_port())
        try:
            wait_until(lambda: urllib.request.urlopen(sidecar.url + "/healthz", timeout=5).status == 200, 30,
                       what="a first reading")
            published = (disk / "budget.json").read_bytes()
            filler = _fill(disk)

            def healthz() -> dict:
                try:
                    with urllib.request.urlopen(sidecar.url + "/healthz", timeout=5) as r:
                        return {"code": r.status, **json.loads(r.read())}
                except urllib.error.HTTPError as e:
                    return {"code": e.code, **json.loads(e.read())}

            # At the next poll's write (0.5 s), not 3 polls and 30 s later.
            failing = wait_until(lambda: (h := healthz())["status"] == "write-failing" and h, 5, 0.1,
                                 "/healthz to say write-failing")
            assert failing["code"] == 503
            assert re.match(rf"no space left on device at {re.escape(str(disk))}/budget(-state)?\.json, need ",
                            failing["last_error"]), failing
            metrics = urllib.request.urlopen(sidecar.url + "/metrics", timeout=5).read().decode()
            assert metric_values(metrics)["x1_budget_write_failing"] == 1.0
            time.sleep(2.0)  # four more polls on the full disk
            assert healthz()["status"] == "write-failing"
            assert (disk / "budget.json").read_bytes() == published  # the old reading, whole
            log = sidecar.log_text()
            assert log.count("no space left on device at") == 1, log[-3000:]
            assert "Traceback" not in log and "raised an exception" not in log

            filler.unlink()  # space again
            wait_until(lambda: healthz()["status"] == "ok", 5, 0.1, "/healthz ok again")
            assert json.loads((disk / "budget.json").read_text())["spent_usd"] >= json.loads(published)["spent_usd"]
            assert "written again" in sidecar.log_text()
        finally:
            sidecar.stop()
    finally:
        subprocess.run(["umount", "-l", str(disk)], check=False)


# ---- the watchdog -------------------------------------------------------------------------------------


def test_the_watchdogs_state_and_events_on_a_full_disk_make_it_unhealthy_naming_the_path_and_alert_once(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    alerts: list[str] = []
    metrics = WatchdogMetrics()
    writes = WriteHealth(logging.getLogger("x1_watchdog"), on_change=metrics.write_error, on_first=alerts.append)
    state = StateStore(tmp_path / "state.json", writes=writes)
    events = EventLog(tmp_path / "events.jsonl", writes=writes)
    state.record_start({"pid": 1})
    events.write("start", pid=1)
    kept_state, kept_events = (tmp_path / "state.json").read_bytes(), (tmp_path / "events.jsonl").read_bytes()
    port = free_port()
    metrics.serve(port, "127.0.0.1")
    url = f"http://127.0.0.1:{port}/metrics"
    assert healthcheck.healthy(url) == (True, "x1_watchdog_healthy 1")

    monkeypatch.setattr(fsutil, "_create_temp", refusing(errno.ENOSPC))  # the state file's atomic write
    monkeypatch.setattr(records_mod, "append_line", refusing(errno.ENOSPC))  # the events file's append
    with caplog.at_level(logging.INFO, logger="x1_watchdog"):
        state.record_exit(75, "preempted")  # the first failed write
        ok, why = healthcheck.healthy(url)
        assert not ok and re.fullmatch(
            rf"x1_watchdog_healthy 0: no space left on device at {re.escape(str(tmp_path / 'state.json'))}, need .*",
            why), why
        for n in range(3):  # supervision goes on; decisions keep coming; each is tried again
            events.write("relaunch", restart=n)
            state.record_restart(1e9 + n, 3600)
    assert (tmp_path / "state.json").read_bytes() == kept_state  # the old decision, whole
    assert (tmp_path / "events.jsonl").read_bytes() == kept_events
    assert state.data["restarts_total"] == 3  # in memory meanwhile
    assert len(alerts) == 1 and alerts[0].startswith(f"no space left on device at {tmp_path / 'state.json'}")
    disk_lines = [r.getMessage() for r in caplog.records if "no space left on device" in r.getMessage()]
    assert len(disk_lines) == 2, disk_lines  # once for the state file, once for the events file
    assert all(r.getMessage().startswith("event not written to") for r in caplog.records
               if r.levelno == logging.WARNING)  # each lost event is still in the log, with its content

    monkeypatch.undo()
    state.record_exit(0, "finished")
    events.write("exit", exit_code=0)
    assert healthcheck.healthy(url) == (True, "x1_watchdog_healthy 1")
    assert json.loads((tmp_path / "state.json").read_text())["restarts_total"] == 3


# ---- the trainer's heartbeat and metrics spool --------------------------------------------------------


def test_the_trainers_heartbeat_and_spool_on_a_full_disk_cost_no_step_and_show_on_its_metrics(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    prom = tracking.PrometheusMetrics(0)
    writes = WriteHealth(logging.getLogger("x1.tracking"), on_change=prom.write_error)
    beat = tracking.Heartbeat(tmp_path / "heartbeat.json", writes=writes)
    beat.beat(10, "training")
    kept = (tmp_path / "heartbeat.json").read_bytes()
    spool = tmp_path / "mlflow-spool.jsonl"
    mlflow = tracking.MlflowLogger(f"file://{tmp_path}/mlruns", "x", run_id=None, run_name="r", params={}, tags={},
                                   spool_path=spool, writes=writes)
    mlflow.log(10, {"loss": 3.5})
    mlflow.persist()
    spooled = spool.read_bytes()

    def refused(path: Path):  # at the atomic writer's temp file: the heartbeat's disk full, the spool's read-only
        raise OSError(errno.ENOSPC if path.name == "heartbeat.json" else errno.EROFS, "refused")

    monkeypatch.setattr(fsutil, "_create_temp", refused)
    with caplog.at_level(logging.INFO, logger="x1.tracking"):
        for step in range(11, 16):
            beat.beat(step, "training")  # never raises: training goes on
            mlflow.log(step, {"loss": 3.4})
            mlflow.persist()  # before each checkpoint: never raises either
    assert (tmp_path / "heartbeat.json").read_bytes() == kept and Heartbeat.read(tmp_path / "heartbeat.json").step == 10
    assert spool.read_bytes() == spooled  # the spool already there, as it was
    assert len(mlflow._pending) == 6  # nothing unsent dropped
    values = metric_values(generate_latest(prom.registry).decode())
    assert values["x1_train_write_failing"] == 1.0
    assert values["x1_train_write_error_info"]["error"].startswith(f"read-only file system at {spool}")
    said = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert len(said) == 2 and said[0].startswith(f"no space left on device at {tmp_path / 'heartbeat.json'}, need ")
    assert said[1].startswith(f"read-only file system at {spool}, need ")

    monkeypatch.undo()
    beat.beat(16, "training")
    mlflow.persist()
    assert Heartbeat.read(tmp_path / "heartbeat.json").step == 16 and len(spool.read_text().splitlines()) == 7
    assert metric_values(generate_latest(prom.registry).decode())["x1_train_write_failing"] == 0.0


def test_a_local_mlflow_store_on_a_full_disk_is_named_not_called_unreachable(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    from mlflow.tracking import MlflowClient

    monkeypatch.setattr(MlflowClient, "log_batch", refusing(errno.ENOSPC))  # the file store's writes
    writes = WriteHealth(logging.getLogger("x1.tracking"))
    store = tmp_path / "mlruns"
    mlflow = tracking.MlflowLogger(f"file://{store}", "x", run_id=None, run_name="r", params={}, tags={"a": "b"},
                                   spool_path=tmp_path / "spool.jsonl", writes=writes, flush_seconds=0.1)
    with caplog.at_level(logging.INFO, logger="x1.tracking"):
        mlflow.start()
        mlflow.log(1, {"loss": 3.0})
        wait_until(lambda: writes.failing, 120, what="the store's first refused write")
        mlflow.close("FINISHED", timeout=5)
    assert writes.last_error is not None and writes.last_error.startswith(f"no space left on device at {store} ")
    assert not [r for r in caplog.records if "not reachable" in r.getMessage()]
    assert json.loads((tmp_path / "spool.jsonl").read_text().splitlines()[1])["k"] == "loss"  # kept for the next start


# ---- tokenize_data ------------------------------------------------------------------------------------


class RefusingFile:
    """A file opened for writing whose writes the disk refuses (ENOSPC)."""

    def __init__(self, f) -> None:
        self.f = f

    def write(self, data) -> int:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    def __getattr__(self, name: str):
        return getattr(self.f, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.f.close()


def open_refusing_writes(path, mode="r", *args, **kwargs):
    f = builtins.open(path, mode, *args, **kwargs)
    return RefusingFile(f) if "w" in mode else f


@pytest.fixture
def root_logging():
    """tokenize_data's main sets the root logger up for a command: put it back afterwards."""
    root = logging.getLogger()
    saved = root.handlers[:], root.level
    yield
    root.handlers[:] = saved[0]
    root.setLevel(saved[1])


def tokenize_main(src: Path, out: Path) -> int:
    return tokenize_mod.main(["--input-dir", str(src), "--output-dir", str(out), "--workers", "1", "--val-fraction",
                              "0.02"])


@pytest.mark.parametrize("where", ["shard", "assembly"])
def test_tokenize_on_a_full_disk_exits_1_naming_the_folder_and_the_free_space_and_keeps_the_earlier_output(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture, root_logging, where: str) -> None:
    src, out = tmp_path / "in", tmp_path / "out"
    src.mkdir()
    _good_parquet(src)
    assert tokenize_main(src, out) == 0
    before = {name: (out / name).read_bytes() for name in ("train.bin", "val.bin", "meta.json")}
    (src / "more.txt").write_text("another document, so the outputs are not up to date")
    capsys.readouterr()
    if where == "shard":
        monkeypatch.setattr(shards_mod, "open", open_refusing_writes, raising=False)
    else:
        monkeypatch.setattr(tokenize_mod, "open", open_refusing_writes, raising=False)
        monkeypatch.setattr(os, "copy_file_range", refusing(errno.ENOSPC))  # the kernel's copy, refused too
    assert tokenize_main(src, out) == ExitCode.ENVIRONMENT == 1
    err = capsys.readouterr().err
    first = next(line for line in err.splitlines() if line.startswith("error: "))
    if where == "shard":
        assert re.fullmatch(rf"error: no space left on device at {re.escape(str(out))} "
                            rf"for the tokens of shard \w+\.(train|val)\.bin " + FREE, first), err
    else:
        assert re.fullmatch(rf"error: no space left on device at {re.escape(str(out))}, need \d+(\.\d)? (kB|bytes|MB) "
                            rf"for train\.bin and val\.bin " + FREE, first), err
    assert f"no output in {out} was replaced" in err and "Traceback" not in err
    assert {name: (out / name).read_bytes() for name in before} == before
    assert not [p.name for p in out.iterdir() if p.name.endswith((".tmp", ".new"))]
    monkeypatch.undo()
    assert tokenize_main(src, out) == 0  # the same command, once there is room


def test_a_download_onto_a_full_disk_exits_1_naming_the_shard_folder(tmp_path: Path, capsys: pytest.CaptureFixture,
                                                                     root_logging) -> None:
    hub = FakeHub(errors={"fineweb-edu": OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))})
    assert prepare_mod.main(["--output-dir", str(tmp_path)], fetch=hub, tokenize=lambda argv: 0) == 1
    err = capsys.readouterr().err
    assert re.search(rf"download of HuggingFaceFW/fineweb-edu failed: no space left on device at "
                     rf"{re.escape(str(tmp_path / 'fineweb-edu'))} for HuggingFaceFW/fineweb-edu's shards " + FREE, err), err
    assert [name for name, _ in hub.calls] == ["fineweb-edu"]  # a full disk is no refusal: no fallback to fill it more


# ---- export_run ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(("where", "line"), [
    ("copy", r"no space left on device at {out}, need \d+\.\d+ (GB|MB|kB) for final\.safetensors " + FREE),
    ("folder", r"read-only file system at {out}"),
], ids=["full-at-the-weights", "read-only-folder"])
def test_export_on_a_full_or_read_only_disk_exits_1_naming_the_folder_not_a_running_trainer(
        spiked_run: SpikedRun, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture,  # noqa: F811
        where: str, line: str) -> None:
    out = tmp_path / "run"
    shutil.copytree(spiked_run.run_dir, out)  # an earlier export, to be left as it was
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    if where == "copy":
        monkeypatch.setattr(export_mod.shutil, "copyfile", refusing(errno.ENOSPC))
    else:
        monkeypatch.setattr(export_mod.tempfile, "mkdtemp", refusing(errno.EROFS))
    code = export_main("--mlflow-uri", spiked_run.uri, "--run-id", spiked_run.run_id, "--output", str(out),
                       "--ckpt-dir", str(spiked_run.ckpt), "--force")
    err = capsys.readouterr().err
    assert code == ExitCode.ENVIRONMENT == 1, err
    assert re.match("export_run: error: " + line.format(out=re.escape(str(out))), err), err
    assert f"nothing exported, {out} is as it was" in err
    assert "changed while it was copied" not in err and "trainer still running" not in err and "Traceback" not in err
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".run.export-")]
