"""Where the numbers go: MLflow (batched, off the training thread), Prometheus, the heartbeat file.

The training loop calls `sink.log(step, {...})` and never waits on the network. A tracking
server that goes away mid-run costs nothing: metrics stay buffered and arrive when it is back;
what is still unsent at exit is spooled to disk and replayed by the next start of the same run.
On ranks other than 0 every sink is a no-op object, so the loop never asks "am I rank 0?".

The heartbeat and the spool are written to disk; a write that fails (a full or read-only disk)
costs no training step: one WriteHealth shows it from the first failure on (/metrics:
x1_train_write_failing, x1_train_write_error_info naming the path and the cause), the log says it
once, an alert goes out once, and the next beat or spool tries again. (A checkpoint that cannot
be written stops the run: x1_pretrain.checkpoint.store.)
"""

from __future__ import annotations

import json
import logging
import os
import queue
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from x1_common import contracts as C
from x1_common.contracts import redact
from x1_common.fsutil import WriteHealth, disk_fault, write_json_atomic, write_text_atomic

log = logging.getLogger("x1.tracking")

# Our own thread retries; MLflow's client must fail fast instead of sleeping through its own
# backoff (7 retries by default) while the buffer fills.
os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "10")
# docs/DESIGN.md §3 keeps the lab's file:///workspace/mlruns working; MLflow 3 calls that store legacy.
os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")

_BATCH = 1000  # MLflow's log_batch limit for metrics
_PARAM_BATCH = 100


class MlflowLogger:
    """One MLflow run, fed through a queue by the training loop and written by a daemon thread."""

    def __init__(
        self,
        uri: str,
        experiment: str,
        *,
        run_id: str | None,
        run_name: str,
        params: dict[str, str],
        tags: dict[str, str],
        spool_path: Path,
        on_run_id: Callable[[str], None] = lambda run_id: None,
        flush_seconds: float = 2.0,
        writes: WriteHealth | None = None,
    ):
        self.uri, self.experiment, self.run_name = uri, experiment, run_name
        self.run_id = run_id
        self._resumed = run_id is not None  # an existing run: mark it RUNNING again at first contact
        self._params, self._tags = params, dict(tags)
        self._spool = spool_path
        self.writes = writes or WriteHealth(log)
        self._on_run_id = on_run_id
        self._flush_seconds = flush_seconds
        self._queue: queue.Queue[tuple[str, Any]] = queue.Queue()
        self._pending: list[tuple[str, float, int, int]] = []  # (key, value, timestamp ms, step)
        self._pending_tags: dict[str, str] = {}
        self._lock = threading.Lock()  # _pending is appended here and sent by the thread
        self._status: str | None = None
        self._stop = threading.Event()
        self._idle = threading.Event()
        self._failures = 0
        self._thread = threading.Thread(target=self._run, name="mlflow-logger", daemon=True)
        self._replay_spool()

    # -- called from the training loop (never blocks on the network) --

    def start(self) -> None:
        self._thread.start()

    def log(self, step: int, metrics: dict[str, float]) -> None:
        ts = int(time.time() * 1000)
        self._queue.put(("metrics", [(k, float(v), ts, step) for k, v in metrics.items()]))

    def set_tags(self, tags: dict[str, str]) -> None:
        self._queue.put(("tags", dict(tags)))

    def persist(self) -> None:
        """Put what is not yet sent on local disk (the spool) now. Called before each checkpoint:
        a resumed run starts after the checkpoint and never logs those steps again, so a kill
        between the checkpoint and the next network flush must not lose them."""
        self._drain_queue()
        if self._pending or self._pending_tags:
            self._write_spool()

    def close(self, status: str, timeout: float) -> bool:
        """Flush for at most `timeout` seconds; spool what is left. True when everything was sent.

        What is unsent goes to the spool on local disk first: a preemption may kill the process
        (SIGKILL after a grace of seconds) in the middle of the network flush below, and the steps
        logged since the last flush must reach MLflow from the next start all the same."""
        self._queue.put(("status", status))
        self.persist()
        self._stop.set()
        self._thread.join(timeout=timeout)
        self._drain_queue()
        sent = not self._pending and not self._pending_tags and self._status is None
        if sent:
            self._spool.unlink(missing_ok=True)
        elif self._write_spool():
            log.warning("MLflow unreachable at exit: %d metrics spooled to %s; the next start of this run sends them",
                        len(self._pending), self._spool)
        return sent

    # -- the thread --

    def _run(self) -> None:
        from mlflow.tracking import MlflowClient

        client = MlflowClient(tracking_uri=self.uri)
        backoff = 1.0
        last_flush = 0.0
        while True:
            stopping = self._stop.is_set()
            self._drain_queue(block_seconds=0.0 if stopping else 0.2)
            due = stopping or time.monotonic() - last_flush >= self._flush_seconds or len(self._pending) >= _BATCH
            if due:
                try:
                    self._ensure_run(client)
                    self._flush(client)
                    last_flush, backoff = time.monotonic(), 1.0
                    if self._failures:
                        log.info("MLflow reachable again; buffered metrics sent")
                    self._failures = 0
                    if (store := local_store(self.uri)) is not None:
                        self.writes.succeeded(store)
                except Exception as e:  # noqa: BLE001 - any tracking failure: keep training, keep buffering
                    self._failures += 1
                    store, refused = local_store(self.uri), disk_refusal(e)
                    if store is not None and refused is not None:  # a local store on a refused disk: not "unreachable"
                        self.writes.failed(store, refused, f"{len(self._pending)} metrics stay buffered in memory "
                                                           "(spooled at each checkpoint) and are sent once it can be written")
                    elif self._failures in (1, 10) or self._failures % 100 == 0:
                        log.warning("MLflow at %s not reachable (%s); %d metrics buffered, retrying",
                                    redact(self.uri), redact(str(e))[:200], len(self._pending))
                    if stopping:
                        return
                    self._stop.wait(backoff)
                    backoff = min(backoff * 2, 30.0)
                    continue
            if stopping and not self._pending and not self._pending_tags and self._status is None:
                return

    def _drain_queue(self, block_seconds: float = 0.0) -> None:
        try:
            item = self._queue.get(timeout=block_seconds) if block_seconds else self._queue.get_nowait()
        except queue.Empty:
            return
        while True:
            kind, payload = item
            with self._lock:
                if kind == "metrics":
                    self._pending.extend(payload)
                elif kind == "tags":
                    self._pending_tags.update(payload)
                else:
                    self._status = payload
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                return

    def _ensure_run(self, client) -> None:
        from mlflow.entities import Param, RunTag

        if self.run_id is not None:
            if self._resumed:
                client.update_run(self.run_id, status="RUNNING")
                self._resumed = False
            return
        exp = client.get_experiment_by_name(self.experiment)
        exp_id = exp.experiment_id if exp is not None else client.create_experiment(self.experiment)
        run = client.create_run(exp_id, run_name=self.run_name, tags=self._tags)
        params = [Param(k, v) for k, v in self._params.items()]
        for i in range(0, len(params), _PARAM_BATCH):
            client.log_batch(run.info.run_id, params=params[i : i + _PARAM_BATCH])
        client.log_batch(run.info.run_id, tags=[RunTag(k, v) for k, v in self._tags.items()][:_PARAM_BATCH])
        self.run_id = run.info.run_id
        self._on_run_id(self.run_id)

    def _flush(self, client) -> None:
        from mlflow.entities import Metric, RunTag

        while True:
            with self._lock:
                chunk = self._pending[:_BATCH]
            if not chunk:
                break
            client.log_batch(self.run_id, metrics=[Metric(k, v, ts, step) for k, v, ts, step in chunk])
            with self._lock:
                del self._pending[: len(chunk)]
        with self._lock:
            tags, self._pending_tags = self._pending_tags, {}
        try:
            items = [RunTag(k, v) for k, v in tags.items()]
            for i in range(0, len(items), _PARAM_BATCH):
                client.log_batch(self.run_id, tags=items[i : i + _PARAM_BATCH])
        except Exception:
            with self._lock:
                self._pending_tags = {**tags, **self._pending_tags}
            raise
        if self._status is not None:
            client.set_terminated(self.run_id, status=self._status)
            self._status = None
        with self._lock:  # close() may be spooling newer metrics at this moment: keep that spool
            if not self._pending and not self._pending_tags:
                self._spool.unlink(missing_ok=True)

    # -- the spool: metrics that outlived their process --

    def _write_spool(self) -> bool:
        """The unsent metrics to the spool, replacing it; False (said once, see WriteHealth) when the
        disk refuses: they stay in memory and go to MLflow when it answers, lost only if the process
        ends first. The spool already there is kept as it was."""
        with self._lock:
            lines = [json.dumps({"k": k, "v": v, "t": t, "s": s}) for k, v, t, s in self._pending]
            header = json.dumps({"run_id": self.run_id, "tags": self._pending_tags})
        try:
            write_text_atomic(self._spool, "\n".join([header, *lines]) + "\n")
        except OSError as e:
            self.writes.failed(self._spool, e, f"{len(lines)} unsent metrics are kept in memory only (sent when MLflow "
                                               "answers); retried at the next checkpoint")
            return False
        self.writes.succeeded(self._spool)
        return True

    def _replay_spool(self) -> None:
        if not self._spool.is_file():
            return
        try:
            header, *rows = self._spool.read_text().splitlines()
            meta = json.loads(header)
            if meta.get("run_id") not in (None, self.run_id):
                return
            entries = [(r["k"], r["v"], r["t"], r["s"]) for r in map(json.loads, rows)]
            # A spool from another process is checked before any of it reaches MLflow's log_batch.
            if not all(isinstance(k, str) and isinstance(v, (int, float)) and not isinstance(v, bool)
                       and isinstance(t, int) and isinstance(st, int) for k, v, t, st in entries):
                raise ValueError("an entry is not (name, number, time, step)")
            tags = meta.get("tags") or {}
            if not (isinstance(tags, dict) and all(isinstance(k, str) and isinstance(v, str) for k, v in tags.items())):
                raise ValueError("its tags are not strings")
            self._pending.extend(entries)
            self._pending_tags.update(tags)
            log.info("replaying %d spooled metrics from %s", len(rows), self._spool)
        except (OSError, ValueError, KeyError, TypeError, AttributeError, RecursionError) as e:
            log.warning("ignoring unreadable metrics spool %s: %s", self._spool, e)


def disk_refusal(e: BaseException | None) -> OSError | None:
    """The OSError of a disk that refused a write, in `e` or what it wraps (MLflow wraps its store's)."""
    while e is not None:
        if isinstance(e, OSError) and disk_fault(e) is not None:
            return e
        e = e.__cause__ or e.__context__
    return None


def local_store(uri: str) -> Path | None:
    """The file or folder a file:// or sqlite:/// tracking URI writes to; None for a server."""
    if uri.startswith("file://"):
        return Path(uri.removeprefix("file://"))
    if uri.startswith("sqlite:///"):
        return Path(uri.removeprefix("sqlite:///"))
    return None


class PrometheusMetrics:
    """The trainer's /metrics. A busy port is a warning, never a failed run."""

    def __init__(self, port: int, host: str = "127.0.0.1"):
        from prometheus_client import CollectorRegistry, Counter, Gauge, Info, start_http_server

        self.registry = CollectorRegistry()
        g = lambda name, doc: Gauge(name, doc, registry=self.registry)  # noqa: E731
        self.step = g(C.M_TRAIN_STEP, "optimizer steps completed")
        self.tokens = Counter(C.M_TRAIN_TOKENS, "tokens trained on (counts from the resumed total)", registry=self.registry)
        self.tps = g(C.M_TRAIN_TOKENS_PER_SECOND, "training throughput over the last log interval")
        self.mfu = Gauge(C.M_TRAIN_MFU, "model FLOPs utilization (PaLM FLOPs) vs the bf16 peak named by the labels: "
                         "peak=datasheet or measured, peak_tflops", ["peak", "peak_tflops"], registry=self.registry)
        self.loss = g(C.M_TRAIN_LOSS, "training loss, nats/token")
        self.val_loss = g(C.M_TRAIN_VAL_LOSS, "validation loss at the last eval, nats/token")
        self.grad_norm = g(C.M_TRAIN_GRAD_NORM, "global grad norm before clipping")
        self.lr = g(C.M_TRAIN_LR, "learning rate")
        # NaN until the forecast has enough points: a gap in Grafana, not a number
        self.forecast = g(C.M_TRAIN_FORECAST, "final val loss the run's curve so far points to, nats/token")
        self.forecast_low = g(C.M_TRAIN_FORECAST_LOW, "low end of the forecast's calibrated interval, nats/token")
        self.forecast_high = g(C.M_TRAIN_FORECAST_HIGH, "high end of the forecast's calibrated interval, nats/token")
        for gauge in (self.forecast, self.forecast_low, self.forecast_high):
            gauge.set(float("nan"))
        self.node = Gauge(C.M_TRAIN_NODE_INFO, "1, labelled with the host this trainer (global rank 0) runs on: "
                          "node_rank, nnodes, hostname", ["node_rank", "nnodes", "hostname"], registry=self.registry)
        self.spent = g(C.M_TRAIN_SPENT, "budget spent as the trainer last judged it (extrapolated), USD")
        self.projected = g(C.M_TRAIN_PROJECTED, "projected total the budget guard judges: the larger of its own and "
                           "the sidecar's, USD")
        self.projected_own = g(C.M_TRAIN_PROJECTED_OWN, "the trainer's own projection: spent + rate x billed hours its "
                               "remaining steps need at its measured pace, + overheads and margin, USD")
        self.projected_sidecar = g(C.M_TRAIN_PROJECTED_SIDECAR, "the sidecar's projected_total_usd as the guard "
                                   "extrapolates it, USD")
        self.hours_needed = g(C.M_TRAIN_HOURS_NEEDED, "billed hours the remaining steps need at the measured pace "
                              "(evals, checkpoints, restarts included; margin not)")
        self.progress = g(C.M_TRAIN_PROGRESS, "optimizer steps completed / total steps (0..1)")
        self.total_steps = g(C.M_TRAIN_TOTAL_STEPS, "the run's total steps (after any re-plan)")
        self.eta = g(C.M_TRAIN_ETA, "wall seconds the remaining steps need at the measured pace (evals, checkpoints, "
                     "restarts included); NaN before any pace")
        self.restarts = g(C.M_TRAIN_RESTARTS, "resumed starts of this run so far (preemptions, crashes, re-plans)")
        self.ckpt_step = g(C.M_CHECKPOINT_LAST_STEP, "step of the last complete checkpoint")
        self.ckpt_seconds = g(C.M_CHECKPOINT_SAVE_SECONDS, "seconds the last checkpoint save took")
        self.write_failing = g(C.M_TRAIN_WRITE_FAILING, "1 while the trainer cannot write its heartbeat or metrics "
                               "spool (a full or read-only disk: x1_train_write_error_info names the path)")
        self.write_error_info = Info(C.M_TRAIN_WRITE_ERROR, "the trainer's failing write: the path and the cause (empty "
                                     "while its writes succeed)", registry=self.registry)
        self.write_error_info.info({"error": ""})
        self.port = 0
        if port:
            try:
                start_http_server(port, addr=host, registry=self.registry)
                self.port = port
            except OSError as e:
                log.warning("metrics port %d unavailable (%s): training continues without /metrics", port, e)

    def write_error(self, error: str | None) -> None:
        """The trainer's failing write (WriteHealth.last_error), None once its writes succeed."""
        self.write_failing.set(0 if error is None else 1)
        self.write_error_info.info({"error": (error or "")[:300]})


class Heartbeat:
    """{"step", "time", "pid", "phase"} rewritten atomically; the watchdog reads its age. `node`
    (several hosts) adds which host wrote it: {"rank", "node_rank", "nnodes", "hostname"}."""

    def __init__(self, path: str | os.PathLike[str], node: dict[str, Any] | None = None,
                 writes: WriteHealth | None = None):
        self.path = Path(path)
        self.node = node or {}
        self.writes = writes or WriteHealth(log)
        self.boot_id = C.boot_id()  # "mono" compares across processes under this boot only

    def beat(self, step: int, phase: str, signal_time: float | None = None, signal_mono: float | None = None) -> None:
        extra = {"signal_time": signal_time} if signal_time is not None else {}
        if signal_mono is not None:
            extra["signal_mono"] = signal_mono
        try:
            write_json_atomic(self.path, {"step": step, "time": time.time(), "mono": time.monotonic(),
                                          "boot_id": self.boot_id, "pid": os.getpid(), "phase": phase,
                                          **extra, **self.node}, durable=False)
        except OSError as e:
            self.writes.failed(self.path, e, "the watchdog sees the last beat that was written, ageing (a stall "
                                             "after its --stall-seconds); every beat tries again")
        else:
            self.writes.succeeded(self.path)

    def previous(self) -> C.Heartbeat | None:
        return C.Heartbeat.read(self.path)


class MetricsSink:
    """What the loop talks to: MLflow + Prometheus + heartbeat on rank 0."""

    def __init__(self, mlflow: MlflowLogger, prom: PrometheusMetrics, heartbeat: Heartbeat,
                 writes: WriteHealth | None = None):
        self.mlflow, self.prom, self.heartbeat = mlflow, prom, heartbeat
        self.writes = writes or WriteHealth(log)  # the heartbeat's and the spool's, as /metrics shows them

    @property
    def run_id(self) -> str | None:
        return self.mlflow.run_id

    def log(self, step: int, metrics: dict[str, float]) -> None:
        self.mlflow.log(step, metrics)

    def tags(self, tags: dict[str, str]) -> None:
        self.mlflow.set_tags(tags)

    def persist(self) -> None:
        self.mlflow.persist()

    def close(self, status: str, timeout: float) -> None:
        self.mlflow.close(status, timeout)


class NullSink:
    """Ranks other than 0: the same calls, nothing happens; except, given one, the heartbeat (the
    first process of each other host beats for its own host's watchdog)."""

    run_id = None

    def __init__(self, heartbeat: Heartbeat | None = None) -> None:
        self.prom = _NullProm()
        self.heartbeat = heartbeat or _NullHeartbeat()

    def log(self, step: int, metrics: dict[str, float]) -> None:
        pass

    def tags(self, tags: dict[str, str]) -> None:
        pass

    def persist(self) -> None:
        pass

    def close(self, status: str, timeout: float) -> None:
        pass


class _Nothing:
    def __getattr__(self, name: str) -> _Nothing:
        return self

    def __call__(self, *args: Any, **kwargs: Any) -> _Nothing:
        return self


class _NullProm(_Nothing):
    pass


class _NullHeartbeat:
    def beat(self, step: int, phase: str, signal_time: float | None = None, signal_mono: float | None = None) -> None:
        pass

    def previous(self) -> None:
        return None
