"""One shard tokenized into its own train/val token files, in worker processes, with progress."""

from __future__ import annotations

import hashlib
import logging
import multiprocessing as mp
import os
import queue as queue_mod
import signal
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from concurrent.futures.process import BrokenProcessPool
from contextlib import ExitStack
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from x1_common.fsutil import disk_faults_named, write_json_atomic
from x1_pretrain.data.sources import (
    MAX_SKIP_EXAMPLES,
    READ_CHUNK,
    TOKEN_DTYPE,
    BadRecord,
    HashingReader,
    InputError,
    Settings,
    Shard,
    SourceFile,
    open_regular,
    read_jsonl,
    read_parquet,
    read_txt,
)
from x1_pretrain.data.tokenizer import EOT_TOKEN, encode_document_array, get_encoding

log = logging.getLogger("x1_pretrain.tokenize_data")


# --------------------------------------------------------------------------------------------
# One shard: read, tokenize, write its own train/val token files


class TokenFile:
    """Appends documents (EOT + tokens) to a temp file through a buffer; renamed when committed.
    A disk that refuses the bytes raises DiskFaultError naming the shard folder."""

    def __init__(self, path: Path, capacity: int = 1 << 21):
        self.path, self.tmp = path, path.with_name(path.name + ".tmp")
        self.named = lambda: disk_faults_named(path.parent, what=f"the tokens of shard {path.name}")
        with self.named():
            self.f = open(self.tmp, "wb")
        self.buf = np.empty(capacity, dtype=TOKEN_DTYPE)
        self.fill = 0
        self.tokens = 0  # written so far, buffered included

    def add(self, ids: np.ndarray) -> int:
        """Appends one document; returns its token offset in this file."""
        offset, n = self.tokens, len(ids) + 1
        if self.fill + n > len(self.buf):
            self.flush()
        if n > len(self.buf):
            with self.named():
                self.f.write(np.concatenate([[EOT_TOKEN], ids]).astype(TOKEN_DTYPE).tobytes())
        else:
            self.buf[self.fill] = EOT_TOKEN
            self.buf[self.fill + 1 : self.fill + n] = ids  # uint32 → uint16: GPT-2 ids are < 50257
            self.fill += n
        self.tokens += n
        return offset

    def flush(self) -> None:
        if self.fill:
            with self.named():
                self.f.write(self.buf[: self.fill].tobytes())
            self.fill = 0

    def commit(self) -> None:
        self.flush()
        with self.named():
            self.f.flush()
            os.fsync(self.f.fileno())
            self.f.close()
            os.replace(self.tmp, self.path)

    def abort(self) -> None:
        """Drops the temp file; nothing to do once committed. Never raises: it runs while an
        error (a full disk above all, whose buffered bytes the close cannot write) is on its way."""
        try:
            self.f.close()
        except OSError:
            pass
        self.tmp.unlink(missing_ok=True)


@dataclass
class ShardResult:
    key: str
    rel: str
    train_tokens: int = 0
    val_tokens: int = 0
    train_documents: int = 0
    val_documents: int = 0
    skipped: dict[str, int] = field(default_factory=dict)
    skip_examples: list[dict[str, str]] = field(default_factory=list)
    sha256: str | None = None  # the whole source file's, from the shard that read it
    # The train document with the lowest val score: moved to val if no document made it there.
    fallback: tuple[int, int, int, int] | None = None  # (score, doc index, train offset, tokens)
    seconds: float = 0.0


def _count(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def _result_ok(r: ShardResult) -> bool:
    """A finished-shard record of the right shape (one from a crashed or older run may not be)."""
    fb = r.fallback
    return (isinstance(r.key, str) and isinstance(r.rel, str)
            and all(_count(getattr(r, f)) for f in ("train_tokens", "val_tokens", "train_documents", "val_documents"))
            and isinstance(r.skipped, dict) and all(isinstance(k, str) and _count(v) for k, v in r.skipped.items())
            and isinstance(r.skip_examples, list) and all(isinstance(e, dict) for e in r.skip_examples)
            and (r.sha256 is None or isinstance(r.sha256, str))
            and (fb is None or (isinstance(fb, (list, tuple)) and len(fb) == 4 and all(_count(x) for x in fb)))
            and isinstance(r.seconds, (int, float)))


def val_score(seed: int, rel: str, index: int) -> int:
    """A uniform 64-bit number for one document: below the threshold means val."""
    digest = hashlib.blake2b(f"{seed}\0{rel}\0{index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little")


def shard_paths(shard_dir: Path, key: str) -> tuple[Path, Path, Path]:
    return shard_dir / f"{key}.train.bin", shard_dir / f"{key}.val.bin", shard_dir / f"{key}.json"


def tokenize_shard(shard: Shard, settings: Settings, shard_dir: Path, progress: Callable[[int, int, int], None]) -> ShardResult:
    """Tokenizes one shard into its train/val files, then records it as finished (the record last)."""
    started = time.monotonic()
    src = shard.source
    result = ShardResult(shard.key, src.rel)
    skipped: Counter[str] = Counter()
    train_path, val_path, record_path = shard_paths(shard_dir, shard.key)
    threshold = settings.val_threshold()
    pending = [0, 0]  # documents and tokens not yet reported

    def report(nbytes: int) -> None:
        progress(pending[0], pending[1], nbytes)
        pending[0] = pending[1] = 0

    with ExitStack() as stack:
        train, val = TokenFile(train_path), TokenFile(val_path)
        stack.callback(val.abort)  # no-ops once committed
        stack.callback(train.abort)
        raw: HashingReader | None = None
        if src.kind == "parquet":
            if shard.part == 0:
                with open_regular(src.path) as f:  # pyarrow reads by random access: hash in one plain pass
                    result.sha256 = HashingReader(f).finish()
            records: Iterator[tuple[int, Any, str | None]] = read_parquet(shard, settings.skip_bad_records, report)
        else:
            raw = HashingReader(stack.enter_context(open_regular(src.path)))
            records = (read_jsonl if src.kind.startswith("jsonl") else read_txt)(raw, src)
        reported = 0  # raw bytes read and reported
        try:
            for index, text, _ in _checked(records, src, settings.skip_bad_records, skipped, result.skip_examples):
                if isinstance(text, BadRecord) or not text:
                    continue
                ids = encode_document_array(text)
                score = val_score(settings.seed, src.rel, index)
                if score < threshold:
                    val.add(ids)
                    result.val_documents += 1
                else:
                    offset = train.add(ids)
                    result.train_documents += 1
                    if result.fallback is None or score < result.fallback[0]:
                        result.fallback = (score, index, offset, len(ids) + 1)
                pending[0] += 1
                pending[1] += len(ids) + 1
                if raw and raw.count - reported >= READ_CHUNK:
                    report(raw.count - reported)
                    reported = raw.count
        except InputError as e:
            if not settings.skip_bad_records:
                raise
            # A stream that breaks mid-way (truncated zstd): keep what was read, count the rest once.
            skipped["unreadable rest of file"] += 1
            _example(result.skip_examples, src.rel, e.where, e.problem)
        if raw:
            result.sha256 = raw.finish()
            report(raw.count - reported)
        else:
            report(0)
        train.commit()
        val.commit()
    result.train_tokens, result.val_tokens = train.tokens, val.tokens
    result.skipped = dict(sorted(skipped.items()))
    result.seconds = time.monotonic() - started
    write_json_atomic(record_path, asdict(result), durable=True)
    return result


def _checked(records, src: SourceFile, skip_bad: bool, skipped: Counter[str], examples: list[dict[str, str]]):
    """Counts null/empty texts; raises InputError on a bad record unless bad records are skipped."""
    for index, text, where in records:
        if text is None:
            skipped["null text"] += 1
        elif isinstance(text, BadRecord):
            if text.reason != "blank line" and not skip_bad:
                raise InputError(src.path, text.detail, where)
            skipped[text.reason] += 1
            if text.reason != "blank line":
                _example(examples, src.rel, where, text.detail)
        elif not text:
            skipped["empty text"] += 1
        yield index, text, where


def _example(examples: list[dict[str, str]], rel: str, where: str | None, problem: str) -> None:
    if len(examples) < MAX_SKIP_EXAMPLES:
        examples.append({"file": rel, "where": where or "", "problem": problem})


_PROGRESS_QUEUE: Any = None  # set in each worker process by _init_worker


def _init_worker(queue: Any, parent_pid: int) -> None:
    global _PROGRESS_QUEUE
    _PROGRESS_QUEUE = queue
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the main process decides what an interrupt means
    try:
        import pyarrow as pa

        pa.set_cpu_count(1)  # one worker = one core: no thread pools inside
        pa.set_io_thread_count(1)
    except ImportError:
        pass
    get_encoding("gpt2")  # build the BPE ranks now, while the main process plans

    def orphan_watch() -> None:  # a main process killed with SIGKILL must not leave workers behind
        while True:
            time.sleep(1.0)
            if os.getppid() != parent_pid:
                os._exit(1)

    threading.Thread(target=orphan_watch, daemon=True).start()


class _Throttled:
    """Sends progress (docs, tokens, input bytes) to the main process at most every ~0.3 s."""

    def __init__(self, queue: Any):
        self.queue, self.pending, self.last = queue, [0, 0, 0], time.monotonic()

    def __call__(self, docs: int, tokens: int, nbytes: int) -> None:
        self.pending = [self.pending[0] + docs, self.pending[1] + tokens, self.pending[2] + nbytes]
        if time.monotonic() - self.last > 0.3:
            self.flush()

    def flush(self) -> None:
        if any(self.pending):
            self.queue.put(tuple(self.pending))
        self.pending, self.last = [0, 0, 0], time.monotonic()


def _worker_task(shard: Shard, settings: Settings, shard_dir: str) -> ShardResult:
    progress = _Throttled(_PROGRESS_QUEUE)
    try:
        return tokenize_shard(shard, settings, Path(shard_dir), progress)
    finally:
        progress.flush()


# --------------------------------------------------------------------------------------------
# Progress: a bar on a terminal, a log line every 30 s otherwise (docker logs, CI)


class Progress:
    def __init__(self, total_bytes: int, done_docs: int = 0, done_tokens: int = 0):
        from tqdm import tqdm

        self.docs, self.tokens = done_docs, done_tokens
        self.total = total_bytes
        self.done_bytes = 0
        self.started = time.monotonic()
        self.last_log = self.started
        self.bar = tqdm(
            total=total_bytes, unit="B", unit_scale=True, unit_divisor=1000, desc="tokenize",
            file=sys.stderr, disable=not sys.stderr.isatty(), smoothing=0.1, mininterval=0.5,
        )

    def add(self, docs: int, tokens: int, nbytes: int) -> None:
        self.docs += docs
        self.tokens += tokens
        self.done_bytes += nbytes
        self.bar.update(nbytes)
        self.bar.set_postfix_str(f"docs={self.docs:,} tokens={self.tokens:,}", refresh=False)
        now = time.monotonic()
        if self.bar.disable and now - self.last_log >= 30:
            self.last_log = now
            rate = self.done_bytes / max(1e-9, now - self.started)
            eta = (self.total - self.done_bytes) / rate if rate > 0 else float("nan")
            log.info(
                "%s docs, %s tokens, %.0f of %.0f MB (%.1f MB/s), ETA %.0f s",
                f"{self.docs:,}", f"{self.tokens:,}", self.done_bytes / 1e6, self.total / 1e6, rate / 1e6, eta,
            )

    def close(self) -> None:
        self.bar.close()


def run_shards(shards: list[Shard], settings: Settings, shard_dir: Path, workers: int, progress: Progress) -> list[ShardResult]:
    """Tokenizes the shards on `workers` processes (in this one when 1); the first error stops all."""
    if not shards:
        return []
    if workers <= 1:
        return [tokenize_shard(s, settings, shard_dir, progress.add) for s in shards]
    ctx = mp.get_context("spawn")  # no fork: pyarrow's and tiktoken's threads do not survive one
    queue = ctx.Queue()
    pool = ProcessPoolExecutor(workers, mp_context=ctx, initializer=_init_worker, initargs=(queue, os.getpid()))
    results: list[ShardResult] = []
    ok = False
    try:
        # Largest first, so the last shards to finish are small ones and no worker idles long.
        pending = {pool.submit(_worker_task, s, settings, str(shard_dir)) for s in sorted(shards, key=lambda s: -s.input_bytes)}
        while pending:
            finished, pending = wait(pending, timeout=0.2, return_when=FIRST_COMPLETED)
            _drain(queue, progress)
            for future in finished:
                try:
                    results.append(future.result())
                except BrokenProcessPool:
                    raise RuntimeError("a worker process died (out of memory? killed?); rerun to resume") from None
        _drain(queue, progress)
        ok = True
    finally:
        # On an error or an interrupt, in-flight shards stop now; their temp files go at the next run.
        processes = list((getattr(pool, "_processes", None) or {}).values())
        pool.shutdown(wait=ok, cancel_futures=True)
        if not ok:
            for p in processes:
                p.terminate()
            for p in processes:
                p.join()
    return results


def _drain(queue: Any, progress: Progress) -> None:
    try:
        while True:
            progress.add(*queue.get_nowait())
    except queue_mod.Empty:
        pass
