"""Where a checkpoint comes from, checked before a resume takes a step: the same run, the same
corpus, the same tracking server. Anything else is refused (exit 2) naming what changed, or, for
the corpus and the tracking server, accepted with an explicit flag and then recorded.

- The run: a fresh start writes `K/run-identity.json` (a random run id and the start time) and
  every checkpoint carries the same id in trainer_state.json. A step folder whose id (or, for a
  folder written before ids existed, whose start time) is another run's was copied in: refused.
- The corpus: every checkpoint records the corpus it trained on by a fingerprint of meta.json
  (without its creation time, input path and source files' modification times, so a moved or
  re-fetched corpus is the same corpus). Another fingerprint is refused unless --allow-data-change.
- The tracking server: a run's MLflow run lives on one server. Resuming against another would
  spool every metric for a run that is not there; refused unless --allow-tracking-change, which
  opens a new MLflow run there, tagged with the old one.

Accepted changes are appended to trainer_state.json's `changes` and tagged on the MLflow run
(`x1.provenance_changes`), so the record says what the checkpoints went through.
"""

from __future__ import annotations

import hashlib
import json
import uuid
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlsplit, urlunsplit

import x1_pretrain.train.tracking  # noqa: F401 - MLflow's client settings: no retries, a 10 s timeout
from x1_common.contracts import format_utc, read_json_file, utc_now
from x1_common.fsutil import write_json_atomic

RUN_FILE = "run-identity.json"
# meta.json fields that say when and from where a corpus was tokenized, not what it holds.
_NOT_CONTENT = ("created_utc", "input_dir")


class ProvenanceError(ValueError):
    """A resume whose checkpoint is not this run's, or was made on another corpus or tracking server. Exit 2."""


def new_run_id() -> str:
    return uuid.uuid4().hex


def _fingerprint(content: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(content, sort_keys=True).encode()).hexdigest()[:16]


def corpus_identity(data_dir: str | Path, meta: dict[str, Any]) -> dict[str, Any]:
    """What a checkpoint records of the corpus it trained on. The fingerprint leaves out the source
    files' modification times: the same files fetched again on a new instance are the same corpus
    (their sha256 says so). `fingerprint_with_file_times` is the form checkpoints and ladders made
    before recorded, still accepted for them."""
    content = {k: v for k, v in meta.items() if k not in _NOT_CONTENT}
    timeless = dict(content)
    if isinstance(content.get("sources"), list):  # each source file's mtime_ns stays in meta.json: tokenize's resume reads it
        timeless["sources"] = [{k: v for k, v in src.items() if k != "mtime_ns"} if isinstance(src, dict) else src
                               for src in content["sources"]]
    return {"dir": str(Path(data_dir).resolve()), "fingerprint": _fingerprint(timeless),
            "fingerprint_with_file_times": _fingerprint(content),
            "train_tokens": meta.get("train_tokens"), "val_tokens": meta.get("val_tokens")}


def same_corpus(recorded_fingerprint: Any, corpus: dict[str, Any]) -> bool:
    """Whether a recorded fingerprint (of either form) is this corpus's."""
    return recorded_fingerprint is not None and recorded_fingerprint in (corpus["fingerprint"],
                                                                         corpus.get("fingerprint_with_file_times"))


def server(uri: str) -> str:
    """A tracking URI without the credentials it may carry: what is compared, and what is printed."""
    parts = urlsplit(uri)
    if "@" in parts.netloc:
        parts = parts._replace(netloc=parts.netloc.rsplit("@", 1)[1])
    return urlunsplit(parts)


def check_run(ckpt_root: Path, folder: Path, run_id: str, run_started: float) -> None:
    """ProvenanceError when `folder` (its state's run id and start) is not the run of `ckpt_root`."""
    path = ckpt_root / RUN_FILE
    try:
        recorded = read_json_file(path, max_bytes=1 << 16)
    except FileNotFoundError:
        return  # a checkpoint dir from before run ids: this resume records its run
    except (OSError, ValueError) as e:
        raise ProvenanceError(f"{path}: unreadable ({e}): it says which run this checkpoint dir holds") from None
    theirs = recorded.get("run_id") if isinstance(recorded, dict) else None
    started = recorded.get("started") if isinstance(recorded, dict) else None
    if not isinstance(theirs, str):
        raise ProvenanceError(f"{path}: no run_id string in it: it says which run this checkpoint dir holds")
    foreign = (run_id != theirs) if run_id else (
        isinstance(started, (int, float)) and bool(run_started) and started != run_started)
    if foreign:
        raise ProvenanceError(
            f"{folder}: a step folder of another run (run {run_id[:12] or 'without an id'}, started "
            f"{_utc(run_started)}) in {ckpt_root}, which holds run {theirs[:12]} (started {_utc(started)}, "
            f"{RUN_FILE}): it was copied in. Move it away, then relaunch (nothing was changed)")


def recorded_run_id(ckpt_root: Path, run_started: float) -> str | None:
    """The run id `K/run-identity.json` records for the run that started at `run_started`, if any."""
    try:
        recorded = read_json_file(ckpt_root / RUN_FILE, max_bytes=1 << 16)
    except (OSError, ValueError):
        return None
    if not isinstance(recorded, dict) or recorded.get("started") != run_started:
        return None
    return recorded.get("run_id") if isinstance(recorded.get("run_id"), str) else None


def remember_run(ckpt_root: Path, run_id: str, run_started: float) -> None:
    write_json_atomic(ckpt_root / RUN_FILE, {"run_id": run_id, "started": run_started})


def check_corpus(folder: Path, recorded: dict[str, Any], corpus: dict[str, Any], step: int,
                 allow: bool) -> dict[str, Any] | None:
    """None when the corpus is the one `folder` trained on (or it recorded none); the change to
    record when `allow`; else ProvenanceError naming both."""
    if not recorded or same_corpus(recorded.get("fingerprint"), corpus):
        return None
    what = (f"{folder}: trained on the corpus in {recorded.get('dir')} ({_tokens(recorded)}, fingerprint "
            f"{recorded.get('fingerprint')}); --data-dir {corpus['dir']} holds another ({_tokens(corpus)}, "
            f"fingerprint {corpus['fingerprint']})")
    if not allow:
        raise ProvenanceError(f"{what}: give back that --data-dir, or pass --allow-data-change to go on with "
                              "this one (recorded in the checkpoints and on the MLflow run)")
    return {"what": "data", "at_step": step, "from": recorded, "to": corpus, "utc": format_utc(utc_now())}


def check_tracking(folder: Path, old_uri: Any, run_id: str | None, uri: str, step: int,
                   allow: bool) -> dict[str, Any] | None:
    """None when the MLflow run `folder` names lives at `uri` (or it names none); the change to
    record when `allow`; else ProvenanceError naming both servers.

    Another URI that holds the run is the same store (a workspace moved to another disk, a server
    given another name): asked only when the URIs differ."""
    if run_id is None or not isinstance(old_uri, str) or server(old_uri) == server(uri):
        return None
    holds = run_exists(uri, run_id)
    if holds:
        return None
    why = "which does not hold it" if holds is False else "which could not be asked whether it holds it"
    what = (f"{folder}: its MLflow run {run_id} is at {server(old_uri)}; this start's --mlflow-uri is "
            f"{server(uri)}, {why} (its metrics would wait for a run that never comes)")
    if not allow:
        raise ProvenanceError(f"{what}: give back --mlflow-uri {server(old_uri)}, or pass --allow-tracking-change "
                              "to open a new MLflow run there (tagged with the old one)")
    return {"what": "tracking", "at_step": step, "from": server(old_uri), "to": server(uri),
            "previous_run_id": run_id, "utc": format_utc(utc_now())}


def run_exists(uri: str, run_id: str) -> bool | None:
    """Whether the tracking store at `uri` holds `run_id`; None when it cannot be asked. A local
    store that does not exist holds nothing, and is not created by asking."""
    parts = urlsplit(uri)
    local = unquote(parts.path[1:] if parts.scheme == "sqlite" else parts.path)  # sqlite:///rel.db, sqlite:////abs.db
    if parts.scheme in ("file", "sqlite", "") and not Path(local or ".").exists():
        return False
    from mlflow.exceptions import MlflowException
    from mlflow.tracking import MlflowClient

    try:
        MlflowClient(tracking_uri=uri).get_run(run_id)
        return True
    except MlflowException as e:
        return False if e.error_code == "RESOURCE_DOES_NOT_EXIST" else None
    except Exception:  # noqa: BLE001 - a server that is down or answers garbage: unknown
        return None


def _tokens(corpus: dict[str, Any]) -> str:
    n = corpus.get("train_tokens")
    return f"{n:,} train tokens" if isinstance(n, int) else "train tokens unknown"


def _utc(t: Any) -> str:
    from datetime import datetime, timezone

    if not isinstance(t, (int, float)) or isinstance(t, bool) or not t:
        return "at an unknown time"
    return format_utc(datetime.fromtimestamp(t, timezone.utc))
