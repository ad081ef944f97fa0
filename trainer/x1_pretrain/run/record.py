"""A run as MLflow recorded it: the run found, its parameters, tags and each metric's surviving
value per step (a restart's replayed steps resolved). Read by the export and the post-mortem."""

from __future__ import annotations

import logging
import os
import re
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from x1_common.contracts import MLFLOW_RESTART, MLFLOW_WALL_HOURS, redact, scrub_record

# The export is run by a person waiting at a prompt: MLflow's own client would retry an
# unreachable server 7 times with backoff; we retry a few times ourselves and say so.
os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "30")
os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")  # the lab's file:///workspace/mlruns

log = logging.getLogger("x1.export_run")
CONNECT_DELAYS_S = (1.0, 2.0, 4.0)  # a server that is just starting gets ~7 s


class ExportError(Exception):
    """Bad input a person must fix (exit 2); the message names what is missing."""


Series = list[tuple[int, float]]  # (step, value), ascending steps, one value per step
RAW_KEYS = (MLFLOW_RESTART, "startup_seconds", "first_step_unix", "downtime_seconds", "stopped_unix", "stopped_by",
            "stopped_step", MLFLOW_WALL_HOURS)

# ---------------------------------------------------------------------------------------------
# Reading a run from MLflow


@dataclass
class RunRecord:
    """One MLflow run as the artifacts need it: metadata, params, tags and metric series."""

    uri: str  # as given; may hold credentials, so never written anywhere (see safe_uri)
    run_id: str
    experiment_id: str
    experiment_name: str
    run_name: str
    status: str
    start_ms: int | None
    end_ms: int | None
    params: dict[str, str]
    tags: dict[str, str]
    series: dict[str, Series]  # the surviving value per (step, name)
    logged: dict[str, int] = field(default_factory=dict)  # raw entries per name, duplicates included
    # Every entry, duplicates included, of the metrics logged once per process start (RAW_KEYS):
    # two starts that resume from one checkpoint log them at the same step.
    raw: dict[str, list[tuple[int, int, float]]] = field(default_factory=dict)  # (step, timestamp ms, value)

    def get(self, name: str) -> Series:
        return self.series.get(name, [])

    def last(self, name: str) -> tuple[int, float] | None:
        s = self.series.get(name)
        return s[-1] if s else None

    def flagged(self, name: str) -> list[int]:
        """Steps where an event metric (spike, spike_injected, restart...) was logged as 1.0."""
        return [s for s, v in self.get(name) if v >= 0.5]

    @property
    def last_step(self) -> int:
        return max((s[-1][0] for s in self.series.values() if s), default=0)


def safe_uri(uri: str) -> str:
    """The tracking URI with any user:password removed and secret env values masked."""
    parts = urlsplit(uri)
    if parts.username or parts.password:
        host = parts.hostname or ""
        netloc = f"***@{host}" + (f":{parts.port}" if parts.port else "")
        uri = urlunsplit((parts.scheme, netloc, parts.path, parts.query, parts.fragment))
    return redact(uri)


_URI = re.compile(r"^[a-z][a-z0-9+.-]*://", re.I)


def scrub(obj: Any) -> Any:
    """`obj` with no secret left in it: credentials in URIs, secret env values, and the values of
    secret-named keys (contracts.scrub_record)."""
    if isinstance(obj, dict):
        return {k: scrub(v) for k, v in scrub_record(obj).items()}
    if isinstance(obj, list):
        return [scrub(v) for v in obj]
    if isinstance(obj, str):
        return safe_uri(obj) if _URI.match(obj) else redact(obj)
    return obj


def _local_store_problem(uri: str) -> str | None:
    """For sqlite:// and file:// URIs, what is missing on disk. MLflow would silently create an
    empty store at a mistyped path; an export must say the path is wrong instead."""
    scheme = urlsplit(uri).scheme
    if scheme == "sqlite":
        path = uri[len("sqlite:///"):] if uri.startswith("sqlite:///") else ""
        if path and path != ":memory:" and not Path(path).is_file():
            return f"no MLflow database at {path} (from --mlflow-uri {safe_uri(uri)})"
    elif scheme in ("file", ""):
        path = urlsplit(uri).path if scheme == "file" else uri
        if not Path(path).is_dir():
            return f"no MLflow file store at {path} (from --mlflow-uri {safe_uri(uri)})"
    return None


def connect(uri: str):
    """An MlflowClient that has answered once; ExportError when the store is missing or the
    server does not answer after a short retry."""
    from mlflow.tracking import MlflowClient

    delays = CONNECT_DELAYS_S
    problem = _local_store_problem(uri)
    if problem:
        raise ExportError(problem)
    client = MlflowClient(tracking_uri=uri)
    for attempt in range(len(delays) + 1):
        try:
            client.search_experiments(max_results=1)
            return client
        except Exception as e:  # noqa: BLE001 - connection refused, DNS, HTTP 5xx, bad store: all "cannot read"
            if attempt == len(delays):
                first = redact(str(e)).splitlines()[0][:300] if str(e) else type(e).__name__
                raise ExportError(f"cannot read the MLflow tracking store at {safe_uri(uri)} after "
                                  f"{attempt + 1} tries: {first}") from None
            time.sleep(delays[attempt])
    raise AssertionError("unreachable")


def find_run(client, uri: str, run_id: str | None, experiment: str | None):
    """The run asked for, or the newest X1 run (tag x1.config_hash) of the experiment(s)."""
    from mlflow.exceptions import MlflowException

    if run_id:
        try:
            return client.get_run(run_id)
        except MlflowException:
            raise ExportError(f"no run with id {run_id!r} at {safe_uri(uri)}") from None
    if experiment:
        exp = client.get_experiment_by_name(experiment)
        if exp is None:
            names = ", ".join(e.name for e in client.search_experiments()) or "none"
            raise ExportError(f"no experiment named {experiment!r} at {safe_uri(uri)} (there are: {names})")
        exp_ids = [exp.experiment_id]
    else:
        exp_ids = [e.experiment_id for e in client.search_experiments()]
    runs = client.search_runs(exp_ids, order_by=["attributes.start_time DESC"], max_results=50) if exp_ids else []
    if not runs:
        where = f"experiment {experiment!r}" if experiment else "any experiment"
        raise ExportError(f"no runs in {where} at {safe_uri(uri)}: has the trainer logged to this URI?")
    # Prefer a run the trainer made over anything else someone logged to the same server.
    return next((r for r in runs if "x1.config_hash" in r.data.tags), runs[0])


def surviving(history: list[Any]) -> Series:
    """One value per step: the one logged last. After a resume the steps between the checkpoint
    and the kill were logged twice; the resumed process's values are the ones the run kept."""
    best: dict[int, tuple[int, int, float]] = {}
    for order, m in enumerate(history):
        rank = (int(m.timestamp), order)  # ties in the same millisecond: the later row wins
        if m.step not in best or rank >= best[m.step][:2]:
            best[m.step] = (*rank, float(m.value))
    return [(step, v) for step, (_, _, v) in sorted(best.items())]


def read_histories(client, uri: str, run_id: str, keys: list[str]) -> dict[str, list[Any]]:
    """Every logged value of every key. get_metric_history pages through the store itself."""
    def one(key: str) -> list[Any]:
        return list(client.get_metric_history(run_id, key))

    if urlsplit(uri).scheme in ("http", "https"):
        # Network-bound: a few requests in flight at once. (A local sqlite store is CPU-bound in
        # the ORM and is read one key at a time.)
        with ThreadPoolExecutor(max_workers=4) as pool:
            return dict(zip(keys, pool.map(one, keys), strict=True))
    return {key: one(key) for key in keys}


def load_run(uri: str, run_id: str | None = None, experiment: str | None = None) -> RunRecord:
    client = connect(uri)
    run = find_run(client, uri, run_id, experiment)
    exp = client.get_experiment(run.info.experiment_id)
    keys = sorted(run.data.metrics)
    histories = read_histories(client, uri, run.info.run_id, keys)
    return RunRecord(
        uri=uri,
        run_id=run.info.run_id,
        experiment_id=run.info.experiment_id,
        experiment_name=exp.name if exp is not None else "",
        run_name=run.info.run_name or "",
        status=run.info.status,
        start_ms=run.info.start_time,
        end_ms=run.info.end_time,
        params=dict(run.data.params),
        tags=dict(run.data.tags),
        series={k: surviving(h) for k, h in histories.items()},
        logged={k: len(h) for k, h in histories.items()},
        raw={k: [(int(m.step), int(m.timestamp), float(m.value)) for m in histories[k]] for k in RAW_KEYS if k in histories},
    )
