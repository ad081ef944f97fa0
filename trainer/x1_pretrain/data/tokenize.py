"""Text corpus → nanoGPT token files: `train.bin`, `val.bin` (flat little-endian uint16) and `meta.json`.

    python -m x1_pretrain.tokenize_data --input-dir D --output-dir O --tokenizer gpt2 \\
        --val-fraction 0.001 --workers 16 [--seed 42]

Inputs, by extension, anywhere under D (hidden folders skipped): FineWeb-Edu `*.parquet` (column
`text`), Pile-style `*.jsonl.zst` and `*.jsonl` (field `text`), `*.txt` (one document per file).
Every document is preceded by EOT (50256); a literal "<|endoftext|>" in a text stays ordinary text.

How it scales to the lab's ~96 parquet files of ~230 MB (~10B tokens):
- The work is cut into shards: a parquet file by runs of row groups (so 16 workers stay busy
  with few files), a jsonl/txt file whole (a zstd stream cannot be entered mid-way). Workers
  stream their shard (record batches, zstd chunks: never a whole file in memory) and write the
  shard's own train/val token files; the main process concatenates them in input order. The
  bytes therefore do not depend on the number of workers or on how the work was cut.
- Val is chosen per document by a hash of (seed, file path under D, document index in the
  file): the same documents whatever the workers, the shards or the resumes.
- Finished shards are recorded in O/.tokenize-work (the resume manifest, keyed by each input's
  path, size and mtime): a rerun after a kill redoes only unfinished shards and writes the same
  bytes. train.bin, val.bin and meta.json appear only complete (temp file + fsync + rename).
- Bad input (corrupt parquet, missing `text`, malformed JSON, non-UTF-8, no input at all) stops
  with exit 2 and a message naming the file, the line or row, and the problem; previous complete
  outputs are left as they were. `--skip-bad-records` skips and counts such records instead.
"""

from __future__ import annotations

import argparse
import errno
import fcntl
import hashlib
import json
import logging
import math
import multiprocessing as mp
import os
import queue as queue_mod
import shutil
import signal
import stat
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
from typing import Any, BinaryIO

import numpy as np

from x1_common.contracts import ExitCode, format_utc, read_json_file, utc_now
from x1_common.fsutil import fsync_dir, write_json_atomic
from x1_common.logs import setup_logging
from x1_pretrain.data.tokenizer import EOT_TOKEN, VOCAB_SIZE, encode_document_array, get_encoding

log = logging.getLogger("x1_pretrain.tokenize_data")

FORMATS = {".parquet": "parquet", ".jsonl.zst": "jsonl.zst", ".jsonl": "jsonl", ".txt": "txt"}
TOKENIZERS = ("gpt2",)
WORK_DIR = ".tokenize-work"
WORK_VERSION = 1  # bump when a shard's on-disk format changes: old work is then discarded
TOKEN_DTYPE = np.dtype("<u2")  # little-endian uint16 on any host
PARQUET_BATCH_ROWS = 512  # FineWeb-Edu rows average ~5 KB: a batch holds a few MB of text
READ_CHUNK = 1 << 20
MAX_SKIP_EXAMPLES = 20


class InputError(Exception):
    """A bad input: names the file, where in it, and what is wrong. Exit 2."""

    def __init__(self, path: str, problem: str, where: str | None = None, skippable: bool = True):
        super().__init__(path, problem, where, skippable)  # all in args, so it pickles across processes
        self.path, self.problem, self.where = path, problem, where
        self.skippable = skippable  # whether --skip-bad-records would have gone past it

    def __str__(self) -> str:
        return f"{self.path}: {self.where}: {self.problem}" if self.where else f"{self.path}: {self.problem}"


@dataclass(frozen=True)
class Settings:
    """What decides the output bytes besides the inputs; work done under other settings is discarded."""

    tokenizer: str
    seed: int
    val_fraction: float
    skip_bad_records: bool

    def val_threshold(self) -> int:
        return math.floor(self.val_fraction * 2**64)


# --------------------------------------------------------------------------------------------
# Inputs and the shard plan


@dataclass(frozen=True)
class SourceFile:
    rel: str  # posix path under the input dir: the file's identity for the val split
    path: str
    kind: str  # a value of FORMATS
    size: int
    mtime_ns: int


@dataclass(frozen=True)
class Shard:
    source: SourceFile
    part: int  # 0 for the shard that also hashes the file
    row_groups: tuple[int, int] = (0, 0)  # parquet: [first, last) row group
    first_row: int = 0  # parquet: index in the file of the shard's first row
    input_bytes: int = 0  # for progress and ETA

    @property
    def key(self) -> str:
        s = self.source
        ident = json.dumps([s.rel, s.kind, s.size, s.mtime_ns, self.part, list(self.row_groups)])
        return hashlib.sha1(ident.encode()).hexdigest()[:20]


@dataclass(frozen=True)
class UnreadableFile:
    source: SourceFile
    problem: str


def input_kind(name: str) -> str | None:
    for ext, kind in FORMATS.items():
        if name.endswith(ext):
            return kind
    return None


@dataclass(frozen=True)
class BadEntry:
    """A name under the input dir that looks like an input but cannot be read as a file: a
    dangling symlink, a symlink loop, a FIFO, a socket, a device, an unreadable folder."""

    path: str
    problem: str


def find_inputs(input_dir: Path, exclude: list[Path]) -> tuple[list[SourceFile], int, list[BadEntry]]:
    """Supported files under input_dir in path order, how many other files were ignored, and the
    entries that look like inputs but are not regular files (nothing here ever opens them, so a
    FIFO cannot hang the walk). Symlinked folders are not followed (no loops)."""
    sources, ignored, bad = [], 0, []
    excluded = [e.resolve() for e in exclude]

    def walk_error(e: OSError) -> None:
        bad.append(BadEntry(str(e.filename or input_dir), f"folder not readable ({e.strerror or e})"))

    for root, dirs, files in os.walk(input_dir, onerror=walk_error):
        here = Path(root)
        dirs[:] = [d for d in dirs if not d.startswith(".") and (here / d).resolve() not in excluded]
        for name in files:
            kind = input_kind(name)
            if name.startswith(".") or kind is None:
                ignored += not name.startswith(".")
                continue
            path = here / name
            try:
                st = path.stat()  # follows a symlink to what it names
            except OSError as e:
                bad.append(BadEntry(str(path), _stat_problem(path, e)))
                continue
            if not stat.S_ISREG(st.st_mode):
                bad.append(BadEntry(str(path), f"not a regular file but {_entry_kind(st.st_mode)}: it cannot be "
                                               "tokenized (and reading it could block forever)"))
                continue
            sources.append(SourceFile(path.relative_to(input_dir).as_posix(), str(path), kind, st.st_size, st.st_mtime_ns))
    sources.sort(key=lambda s: s.rel)
    return sources, ignored, sorted(bad, key=lambda b: b.path)


def _stat_problem(path: Path, e: OSError) -> str:
    if path.is_symlink():
        if e.errno == errno.ELOOP:
            return "a symlink loop (it never reaches a file)"
        if e.errno == errno.ENOENT:
            return f"a dangling symlink (its target {os.readlink(path)!r} does not exist)"
    return f"cannot be read ({e.strerror or e})"


def _entry_kind(mode: int) -> str:
    for test, word in ((stat.S_ISDIR, "a folder"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket"),
                       (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device")):
        if test(mode):
            return word
    return "something else"


def open_regular(path: str) -> BinaryIO:
    """`path` opened for reading only if it is a regular file, without ever blocking in the open
    (a FIFO put in place of a file after the walk): InputError otherwise."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except OSError as e:
        raise InputError(path, f"cannot be opened ({e.strerror or e})") from None
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        raise InputError(path, f"not a regular file but {_entry_kind(st.st_mode)}")
    os.set_blocking(fd, True)
    return os.fdopen(fd, "rb")


def _open_parquet(source: SourceFile):  # -> pq.ParquetFile
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        pf = pq.ParquetFile(source.path)
    except (pa.ArrowException, OSError) as e:
        raise InputError(source.path, f"not a readable parquet file ({e})") from None
    names = pf.schema_arrow.names
    if "text" not in names:
        raise InputError(source.path, f"no column 'text' (columns: {', '.join(names) or 'none'})")
    kind = pf.schema_arrow.field("text").type
    if not (pa.types.is_string(kind) or pa.types.is_large_string(kind) or pa.types.is_null(kind)):
        raise InputError(source.path, f"column 'text' has type {kind}, expected string")
    return pf


def _compressed_size(rg) -> int:
    """Bytes a row group occupies in the file (progress and ETA are in input bytes)."""
    return sum(rg.column(j).total_compressed_size for j in range(rg.num_columns))


def plan_shards(sources: list[SourceFile], shard_bytes: int, skip_bad: bool) -> tuple[list[Shard], list[UnreadableFile]]:
    """Shards in output order. A parquet file is cut between row groups every ~shard_bytes of data."""
    shards: list[Shard] = []
    unreadable: list[UnreadableFile] = []
    for src in sources:
        if src.kind != "parquet":
            shards.append(Shard(src, 0, input_bytes=src.size))
            continue
        try:
            meta = _open_parquet(src).metadata
        except InputError as e:
            if not skip_bad:
                raise
            unreadable.append(UnreadableFile(src, e.problem))
            continue
        part, start, row, first_row, acc, acc_in = 0, 0, 0, 0, 0, 0
        for i in range(meta.num_row_groups):
            rg = meta.row_group(i)
            acc += rg.total_byte_size
            acc_in += _compressed_size(rg)
            row += rg.num_rows
            if acc >= shard_bytes:
                shards.append(Shard(src, part, (start, i + 1), first_row, acc_in))
                part, start, first_row, acc, acc_in = part + 1, i + 1, row, 0, 0
        if start < meta.num_row_groups or part == 0:
            shards.append(Shard(src, part, (start, meta.num_row_groups), first_row, acc_in))
    return shards, unreadable


# --------------------------------------------------------------------------------------------
# Reading records: each reader yields (index in file, text | None | BadRecord, where)


@dataclass(frozen=True)
class BadRecord:
    reason: str  # short, for counting: "malformed JSON"
    detail: str  # for the message


class HashingReader:
    """A binary file read once, front to back, hashing (sha256) what passes through."""

    def __init__(self, f: BinaryIO):
        self.f, self.sha = f, hashlib.sha256()
        self.count = 0

    def read(self, n: int = READ_CHUNK) -> bytes:
        data = self.f.read(n)
        self.sha.update(data)
        self.count += len(data)
        return data

    def finish(self) -> str:
        while self.read():
            pass
        return self.sha.hexdigest()


def _zstd_chunks(raw: HashingReader, path: str) -> Iterator[bytes]:
    import zstandard

    dctx = zstandard.ZstdDecompressor()
    dobj, fed = dctx.decompressobj(), False
    try:
        while chunk := raw.read(READ_CHUNK // 4):
            while chunk:
                fed = True
                out = dobj.decompress(chunk)
                if out:
                    yield out
                if dobj.eof:  # a file may hold several frames (pzstd)
                    chunk, dobj, fed = dobj.unused_data, dctx.decompressobj(), False
                else:
                    chunk = b""
    except zstandard.ZstdError as e:
        raise InputError(path, f"corrupt zstd stream ({e})", f"byte {raw.count}") from None
    if fed and not dobj.eof:
        raise InputError(path, "truncated zstd stream (the last frame has no end)")


def _lines(chunks: Iterator[bytes]) -> Iterator[bytes]:
    carry = bytearray()
    for chunk in chunks:
        start = 0
        while (end := chunk.find(b"\n", start)) >= 0:
            if carry:
                carry += chunk[start:end]
                yield bytes(carry)
                carry.clear()
            else:
                yield chunk[start:end]
            start = end + 1
        carry += chunk[start:]
    if carry:
        yield bytes(carry)


def read_jsonl(raw: HashingReader, source: SourceFile) -> Iterator[tuple[int, Any, str]]:
    chunks = _zstd_chunks(raw, source.path) if source.kind == "jsonl.zst" else iter(lambda: raw.read(), b"")
    for i, line in enumerate(_lines(chunks)):
        where = f"line {i + 1}"
        if not line.strip():
            yield i, BadRecord("blank line", "blank line"), where
            continue
        try:
            obj = json.loads(line)
        except UnicodeDecodeError as e:
            yield i, BadRecord("not UTF-8", f"not UTF-8 ({e.reason} at byte {e.start})"), where
            continue
        except ValueError as e:
            yield i, BadRecord("malformed JSON", f"malformed JSON ({e})"), where
            continue
        if not isinstance(obj, dict) or "text" not in obj:
            yield i, BadRecord("no text field", "no 'text' field"), where
            continue
        text = obj["text"]
        if text is not None and not isinstance(text, str):
            yield i, BadRecord("text not a string", f"'text' is {type(text).__name__}, not a string"), where
            continue
        yield i, text, where


def read_txt(raw: HashingReader, source: SourceFile) -> Iterator[tuple[int, Any, str | None]]:
    data = b"".join(iter(lambda: raw.read(), b""))  # one document per file: the file is the document
    try:
        yield 0, data.decode("utf-8-sig"), None
    except UnicodeDecodeError as e:
        line = data.count(b"\n", 0, e.start) + 1
        yield 0, BadRecord("not UTF-8", f"not UTF-8 ({e.reason} at byte {e.start})"), f"line {line}"


def read_parquet(shard: Shard, skip_bad: bool, progress: Callable[[int], None]) -> Iterator[tuple[int, Any, str]]:
    """Rows of the shard's row groups, in record batches. A row group that fails to decode raises
    InputError (or, under --skip-bad-records, yields one BadRecord per row it lost)."""
    import pyarrow as pa

    src = shard.source
    pf = _open_parquet(src)
    meta = pf.metadata
    row = shard.first_row
    for g in range(*shard.row_groups):
        rg_rows = meta.row_group(g).num_rows
        rg_bytes = max(1, _compressed_size(meta.row_group(g)))
        done = 0
        try:
            for batch in pf.iter_batches(batch_size=PARQUET_BATCH_ROWS, row_groups=[g], columns=["text"], use_threads=False):
                column = batch.column(0)
                try:
                    texts = column.to_pylist()
                except UnicodeDecodeError:
                    texts = [_decode_cell(column, k) for k in range(len(column))]
                for k, text in enumerate(texts):
                    yield row + done + k, text, f"row {row + done + k}"
                done += len(texts)
                progress(rg_bytes * len(texts) // max(1, rg_rows))
        except (pa.ArrowException, OSError) as e:
            bad = BadRecord("unreadable parquet row group", f"row group {g} does not decode ({e})")
            if not skip_bad:
                raise InputError(src.path, bad.detail, f"rows {row + done}-{row + rg_rows - 1}") from None
            for k in range(done, rg_rows):
                yield row + k, bad, f"row {row + k}"
        row += rg_rows


def _decode_cell(column, k: int) -> Any:
    try:
        return column[k].as_py()
    except UnicodeDecodeError as e:
        return BadRecord("not UTF-8", f"not UTF-8 ({e.reason} at byte {e.start})")


# --------------------------------------------------------------------------------------------
# One shard: read, tokenize, write its own train/val token files


class TokenFile:
    """Appends documents (EOT + tokens) to a temp file through a buffer; renamed when committed."""

    def __init__(self, path: Path, capacity: int = 1 << 21):
        self.path, self.tmp = path, path.with_name(path.name + ".tmp")
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
            self.f.write(np.concatenate([[EOT_TOKEN], ids]).astype(TOKEN_DTYPE).tobytes())
        else:
            self.buf[self.fill] = EOT_TOKEN
            self.buf[self.fill + 1 : self.fill + n] = ids  # uint32 → uint16: GPT-2 ids are < 50257
            self.fill += n
        self.tokens += n
        return offset

    def flush(self) -> None:
        if self.fill:
            self.f.write(self.buf[: self.fill].tobytes())
            self.fill = 0

    def commit(self) -> None:
        self.flush()
        self.f.flush()
        os.fsync(self.f.fileno())
        self.f.close()
        os.replace(self.tmp, self.path)

    def abort(self) -> None:
        """Drops the temp file; nothing to do once committed."""
        self.f.close()
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


# --------------------------------------------------------------------------------------------
# Worker processes


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


# --------------------------------------------------------------------------------------------
# The work folder: settings, finished shards, a lock


class WorkDir:
    def __init__(self, output_dir: Path):
        self.path = output_dir / WORK_DIR
        self.shards = self.path / "shards"
        self._lock: BinaryIO | None = None

    def open(self, settings: Settings) -> None:
        self.shards.mkdir(parents=True, exist_ok=True)
        self._lock = open(self.path / "lock", "wb")
        try:
            fcntl.flock(self._lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise InputError(str(self.path), "another tokenize_data run is writing to this output folder", skippable=False) from None
        wanted = {"version": WORK_VERSION, **asdict(settings)}
        settings_file = self.path / "settings.json"
        try:
            previous = read_json_file(settings_file)
        except (OSError, ValueError):
            previous = None
        if previous != wanted:
            if previous is not None:
                log.info("settings differ from the unfinished run in %s: starting over", self.path)
            shutil.rmtree(self.shards)
            self.shards.mkdir()
            write_json_atomic(settings_file, wanted)

    def finished(self, shards: list[Shard]) -> dict[str, ShardResult]:
        """Results of shards finished earlier whose files are intact; removes everything else."""
        done: dict[str, ShardResult] = {}
        for shard in shards:
            train, val, record = shard_paths(self.shards, shard.key)
            try:
                r = ShardResult(**read_json_file(record))
                if not _result_ok(r):
                    continue
                r.fallback = tuple(r.fallback) if r.fallback else None  # type: ignore[assignment]
            except (OSError, ValueError, TypeError):
                continue
            sizes_ok = (
                train.exists() and val.exists()
                and train.stat().st_size == r.train_tokens * 2 and val.stat().st_size == r.val_tokens * 2
            )
            if sizes_ok:
                done[shard.key] = r
        keep = {f"{k}{suffix}" for k in done for suffix in (".train.bin", ".val.bin", ".json")}
        for leftover in self.shards.iterdir():  # temps of a killed run, shards of changed inputs
            if leftover.name not in keep:
                if leftover.is_dir() and not leftover.is_symlink():
                    shutil.rmtree(leftover)
                else:
                    leftover.unlink()
        return done

    def remove(self) -> None:
        shutil.rmtree(self.path, ignore_errors=True)


# --------------------------------------------------------------------------------------------
# Assembly: shard files → train.bin / val.bin / meta.json, all appearing at once


def _append(dst: BinaryIO, src_path: Path, start: int = 0, end: int | None = None) -> None:
    """Copies src[start:end) (bytes) onto dst; the kernel does it (copy_file_range) where it can."""
    with open(src_path, "rb") as src:
        end = os.fstat(src.fileno()).st_size if end is None else end
        src.seek(start)
        remaining = end - start
        dst.flush()
        try:
            while remaining > 0:
                n = os.copy_file_range(src.fileno(), dst.fileno(), min(remaining, 1 << 30))
                if n == 0:
                    break
                remaining -= n
        except (AttributeError, OSError):
            pass
        while remaining > 0:
            block = src.read(min(remaining, 8 << 20))
            if not block:
                raise OSError(f"{src_path}: shorter than recorded")
            dst.write(block)
            remaining -= len(block)
        dst.seek(0, os.SEEK_END)


def assemble(
    output_dir: Path, work: WorkDir, shards: list[Shard], results: dict[str, ShardResult], meta: dict[str, Any],
    fallback_key: str | None,
) -> None:
    tmp = {name: output_dir / f".{name}.tmp" for name in ("train.bin", "val.bin")}
    try:
        with open(tmp["train.bin"], "wb") as train, open(tmp["val.bin"], "wb") as val:
            moved = None
            for shard in shards:
                r = results[shard.key]
                train_path, val_path, _ = shard_paths(work.shards, shard.key)
                _append(val, val_path)
                if shard.key == fallback_key and r.fallback:
                    _, _, offset, n = r.fallback
                    moved = (train_path, offset * 2, (offset + n) * 2)
                    _append(train, train_path, 0, moved[1])
                    _append(train, train_path, moved[2])
                else:
                    _append(train, train_path)
            if moved:
                _append(val, moved[0], moved[1], moved[2])
            for f in (train, val):
                f.flush()
                os.fsync(f.fileno())
        for name, path in tmp.items():
            expected = meta["train_tokens" if name == "train.bin" else "val_tokens"] * 2
            if path.stat().st_size != expected:
                raise OSError(f"{path}: {path.stat().st_size} bytes, expected {expected}")
        # A reader checks the .bin sizes against meta.json: take the old meta away first, so old and
        # new files are never paired; the new meta.json appears last.
        (output_dir / "meta.json").unlink(missing_ok=True)
        for name, path in tmp.items():
            os.replace(path, output_dir / name)
        write_json_atomic(output_dir / "meta.json", meta)
        fsync_dir(output_dir)
    finally:
        for path in tmp.values():
            path.unlink(missing_ok=True)


def build_meta(
    settings: Settings, input_dir: Path, sources: list[SourceFile], unreadable: list[UnreadableFile],
    shards: list[Shard], results: dict[str, ShardResult], fallback_key: str | None,
) -> dict[str, Any]:
    per_source: dict[str, dict[str, Any]] = {}
    for s in sources:
        per_source[s.rel] = {
            "path": s.rel, "format": s.kind, "bytes": s.size, "mtime_ns": s.mtime_ns, "sha256": None,
            "documents": 0, "tokens": 0, "skipped": 0,
        }
    skipped: Counter[str] = Counter()
    examples: list[dict[str, str]] = []
    totals = Counter()
    for shard in shards:
        r = results[shard.key]
        entry = per_source[r.rel]
        entry["sha256"] = entry["sha256"] or r.sha256
        entry["documents"] += r.train_documents + r.val_documents
        entry["tokens"] += r.train_tokens + r.val_tokens
        entry["skipped"] += sum(r.skipped.values())
        skipped.update(r.skipped)
        examples.extend(r.skip_examples[: MAX_SKIP_EXAMPLES - len(examples)])
        totals.update(train_tokens=r.train_tokens, val_tokens=r.val_tokens, train_documents=r.train_documents,
                      val_documents=r.val_documents)
    if fallback_key:
        _, _, _, n = results[fallback_key].fallback  # type: ignore[misc]
        totals.update(train_tokens=-n, val_tokens=n, train_documents=-1, val_documents=1)
    skipped_files = []
    for u in unreadable:
        skipped_files.append({"path": u.source.rel, "problem": u.problem})
        per_source[u.source.rel]["error"] = u.problem
        per_source[u.source.rel]["sha256"] = _sha256(u.source.path)
        skipped["unreadable file"] += 1
    meta: dict[str, Any] = {
        "tokenizer": settings.tokenizer,
        "vocab_size": VOCAB_SIZE,
        "eot_token": EOT_TOKEN,
        "eot_position": "before each document",
        "dtype": "uint16",
        "byte_order": "little",
        "train_tokens": totals["train_tokens"],
        "val_tokens": totals["val_tokens"],
        "documents": totals["train_documents"] + totals["val_documents"],
        "train_documents": totals["train_documents"],
        "val_documents": totals["val_documents"],
        "val_fraction": settings.val_fraction,
        "seed": settings.seed,
        "skipped_documents": sum(v for k, v in skipped.items() if k != "unreadable file"),
        "skipped": dict(sorted(skipped.items())),
        "skipped_examples": examples,
        "skipped_files": skipped_files,
        "skip_bad_records": settings.skip_bad_records,
        "input_dir": str(input_dir),
        "sources": [per_source[s.rel] for s in sources],
        "created_utc": format_utc(utc_now()),
    }
    if settings.val_fraction == 0:
        meta["val_note"] = "--val-fraction 0: val.bin is empty"
    elif fallback_key:
        meta["val_note"] = "no document hashed into val: the one with the lowest score was moved there"
    return meta


def _sha256(path: str) -> str | None:
    try:
        with open(path, "rb") as f:
            return HashingReader(f).finish()
    except OSError:
        return None


def pick_fallback(settings: Settings, shards: list[Shard], results: dict[str, ShardResult]) -> str | None:
    """The shard whose lowest-score train document moves to val, when val would otherwise be empty."""
    if settings.val_fraction == 0 or any(r.val_documents for r in results.values()):
        return None
    candidates = [(r.fallback[0], r.rel, r.fallback[1], s.key) for s in shards if (r := results[s.key]).fallback]
    return min(candidates)[3] if candidates else None


def up_to_date(output_dir: Path, settings: Settings, sources: list[SourceFile]) -> bool:
    """True when meta.json says the outputs came from these very inputs and settings."""
    try:
        meta = read_json_file(output_dir / "meta.json")
        same_inputs = [(s["path"], s["bytes"], s["mtime_ns"]) for s in meta["sources"]] == [
            (s.rel, s.size, s.mtime_ns) for s in sources
        ]
        same_settings = (meta["tokenizer"], meta["seed"], meta["val_fraction"], meta["skip_bad_records"]) == (
            settings.tokenizer, settings.seed, settings.val_fraction, settings.skip_bad_records,
        )
        sizes = all(
            (output_dir / f"{split}.bin").stat().st_size == meta[f"{split}_tokens"] * 2 for split in ("train", "val")
        )
        return same_inputs and same_settings and sizes
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return False


# --------------------------------------------------------------------------------------------
# Command line


def default_workers() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m x1_pretrain.tokenize_data",
        description=(
            "Tokenize a text corpus (FineWeb-Edu parquet, Pile-style jsonl.zst, jsonl, txt) with GPT-2 BPE into "
            "train.bin / val.bin (flat little-endian uint16, EOT 50256 before every document) and meta.json. "
            "Parallel, resumable after a kill (rerun the same command), outputs appear only when complete. "
            "Exit 2 on bad input, naming the file and the problem."
        ),
        epilog=(
            "Formats by extension: *.parquet (column text, FineWeb-Edu), *.jsonl.zst and *.jsonl (field text, one "
            "JSON object a line), *.txt (one document a file). Null and empty texts are skipped and counted in "
            f"meta.json. Work in progress lives in OUTPUT/{WORK_DIR} and is removed once the outputs are complete; "
            "a rerun with the same inputs and settings continues from it, or does nothing when the outputs are up "
            "to date."
        ),
    )
    p.add_argument("--input-dir", required=True, type=Path, help="folder searched recursively for input files")
    p.add_argument("--output-dir", required=True, type=Path, help="gets train.bin, val.bin, meta.json (created)")
    p.add_argument("--tokenizer", default="gpt2", help="only gpt2 (GPT-2 BPE via tiktoken, offline)")
    p.add_argument(
        "--val-fraction", type=float, default=0.001,
        help="share of documents (whole documents) for val.bin; 0 = empty val.bin; >0 puts at least one there",
    )
    p.add_argument("--workers", type=int, default=default_workers(), help="processes (default: usable CPUs)")
    p.add_argument("--seed", type=int, default=42, help="decides which documents go to val (default 42)")
    p.add_argument(
        "--skip-bad-records", action="store_true",
        help="skip (and count in meta.json) malformed records and unreadable files instead of stopping with exit 2",
    )
    p.add_argument(
        "--shard-mb", type=float, default=64.0,
        help="parquet files are cut into shards of about this much text, so few files still feed many workers "
             "(default 64; does not change the output bytes)",
    )
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    setup_logging()
    if not (0 <= args.val_fraction < 1):
        parser.error(f"--val-fraction must be in [0, 1), got {args.val_fraction}")
    if args.workers < 1:
        parser.error(f"--workers must be >= 1, got {args.workers}")
    if not (args.shard_mb > 0 and math.isfinite(args.shard_mb)):
        parser.error(f"--shard-mb must be a finite number > 0, got {args.shard_mb}")
    if args.seed < 0:
        parser.error(f"--seed must be >= 0, got {args.seed}")
    if args.tokenizer not in TOKENIZERS:  # checked by name: building the BPE here would only delay the workers
        parser.error(f"--tokenizer {args.tokenizer!r}: only {', '.join(TOKENIZERS)} (GPT-2 BPE) is supported")
    settings = Settings(args.tokenizer, args.seed, args.val_fraction, args.skip_bad_records)
    signal.signal(signal.SIGTERM, _raise_terminated)  # `docker stop`: tear the worker pool down too
    try:
        return run(args.input_dir, args.output_dir, settings, args.workers, int(args.shard_mb * 1e6))
    except InputError as e:
        print(f"error: {e}", file=sys.stderr)
        hint = "; --skip-bad-records skips bad records instead" if e.skippable and not args.skip_bad_records else ""
        print(f"error: nothing written to {args.output_dir}{hint}", file=sys.stderr)
        return ExitCode.USAGE
    except KeyboardInterrupt:
        print("interrupted: rerun the same command to resume; finished shards are kept", file=sys.stderr)
        return 130
    except Terminated:
        print("terminated: rerun the same command to resume; finished shards are kept", file=sys.stderr)
        return 128 + signal.SIGTERM


class Terminated(BaseException):
    """SIGTERM, raised in the main thread so the worker pool is torn down on the way out."""


def _raise_terminated(signum: int, frame: Any) -> None:
    raise Terminated


def run(input_dir: Path, output_dir: Path, settings: Settings, workers: int, shard_bytes: int) -> int:
    started = time.monotonic()
    if not input_dir.is_dir():
        raise InputError(str(input_dir), "--input-dir is not a folder", skippable=False)
    if (output_dir.exists() or output_dir.is_symlink()) and not output_dir.is_dir():
        raise InputError(str(output_dir), "--output-dir exists and is not a folder", skippable=False)
    sources, ignored, bad = find_inputs(input_dir, exclude=[output_dir])
    if bad and not settings.skip_bad_records:
        listed = "; ".join(f"{b.path}: {b.problem}" for b in bad[:10]) + (f"; and {len(bad) - 10} more" if len(bad) > 10 else "")
        raise InputError(str(input_dir), f"{len(bad)} input name(s) are not readable files: {listed}")
    for b in bad:
        log.warning("skipping %s: %s", b.path, b.problem)
    if not sources:
        formats = ", ".join("*" + e for e in FORMATS)
        raise InputError(str(input_dir), f"no input files ({formats}) in this folder", skippable=False)
    if ignored:
        log.info("ignoring %d file(s) with other extensions under %s", ignored, input_dir)
    if up_to_date(output_dir, settings, sources):
        print(f"{output_dir}: up to date with {len(sources)} input file(s); nothing to do")
        return 0
    try:
        output_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:  # a parent that is a file, no permission, a read-only mount
        raise InputError(str(output_dir), f"--output-dir cannot be created ({e.strerror or e})", skippable=False) from None
    work = WorkDir(output_dir)
    work.open(settings)
    shards, unreadable = plan_shards(sources, shard_bytes, settings.skip_bad_records)
    for u in unreadable:
        log.warning("skipping %s: %s", u.source.path, u.problem)
    done = work.finished(shards)
    todo = [s for s in shards if s.key not in done]
    log.info(
        "%d input file(s), %.1f MB, in %d shard(s): %d finished earlier, %d to do on %d worker(s)",
        len(sources), sum(s.size for s in sources) / 1e6, len(shards), len(done), len(todo), min(workers, len(todo)),
    )
    progress = Progress(sum(s.input_bytes for s in todo))
    t_tok = time.monotonic()
    try:
        for r in run_shards(todo, settings, work.shards, min(workers, len(todo)), progress):
            done[r.key] = r
    finally:
        progress.close()
    tokenize_s = time.monotonic() - t_tok
    for s in sources:  # an input rewritten while we read it would mix two versions
        st = os.stat(s.path)
        if (st.st_size, st.st_mtime_ns) != (s.size, s.mtime_ns):
            raise InputError(s.path, "changed while being tokenized; rerun", skippable=False)
    fallback_key = pick_fallback(settings, shards, done)
    meta = build_meta(settings, input_dir, sources, unreadable, shards, done, fallback_key)
    for b in bad:  # --skip-bad-records: counted with the unreadable files
        meta["skipped_files"].append({"path": Path(b.path).relative_to(input_dir).as_posix()
                                      if Path(b.path).is_relative_to(input_dir) else b.path, "problem": b.problem})
        meta["skipped"]["unreadable file"] = meta["skipped"].get("unreadable file", 0) + 1
    if meta["train_tokens"] == 0:
        problem = (
            f"all {meta['documents']} document(s) went to val.bin, none is left for train.bin: lower --val-fraction"
            if meta["documents"] else "no documents: every text was empty, null or skipped"
        )
        raise InputError(str(input_dir), problem, skippable=False)
    t_asm = time.monotonic()
    assemble(output_dir, work, shards, done, meta, fallback_key)
    work.remove()
    elapsed = time.monotonic() - started
    tokens = meta["train_tokens"] + meta["val_tokens"]
    log.info(
        "tokenized %s documents, %s tokens in %.1f s (tokenize %.1f s, assemble %.1f s); skipped: %s",
        f"{meta['documents']:,}", f"{tokens:,}", elapsed, tokenize_s, time.monotonic() - t_asm,
        ", ".join(f"{n} {reason}" for reason, n in meta["skipped"].items()) or "none",
    )
    if "val_note" in meta:
        log.info("val: %s", meta["val_note"])
    print(
        f"wrote {output_dir / 'train.bin'} ({meta['train_tokens']:,} tokens), {output_dir / 'val.bin'} "
        f"({meta['val_tokens']:,} tokens, {meta['val_documents']} documents), {output_dir / 'meta.json'}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
