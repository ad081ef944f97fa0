"""The tokenizer's inputs: the files found, the shard plan, and the readers of each format (parquet,
jsonl, jsonl.zst, txt), each yielding (index in file, text | None | BadRecord, where)."""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import math
import os
import stat
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np

log = logging.getLogger("x1_pretrain.tokenize_data")

FORMATS = {".parquet": "parquet", ".jsonl.zst": "jsonl.zst", ".jsonl": "jsonl", ".txt": "txt"}
TOKENIZERS = ("gpt2",)
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
