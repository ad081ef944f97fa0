"""What the trainer reads: validated memory maps of train.bin / val.bin, training windows drawn as
a pure function of (seed, step, global sample index), a fixed set of val windows, and a
background prefetcher that keeps the GPU fed.

The global sample index counts the samples of one optimizer step across micro-steps and ranks
(`micro_batch_indices`), so
- resuming needs only the step: nothing about the data order is stored but the seed;
- a step sees the same set of windows on 1 GPU with 16 micro-steps or on 2 GPUs with 8 each.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from x1_common.contracts import read_json_file
from x1_common.fsutil import write_json_atomic

if TYPE_CHECKING:
    import torch

log = logging.getLogger("x1_pretrain.data")

TOKEN_DTYPE = np.dtype("<u2")  # train.bin / val.bin: flat little-endian uint16
KNOWN_TOKENIZERS = ("gpt2",)
# The verdict of the last id scan, keyed by what a change to the file always changes: size, inode
# and ctime as well as mtime. mtime alone can be put back (`touch -r`, `rsync -a`, a tool that
# restores it after an in-place edit); ctime cannot be set and moves on every write and utime, and
# a copy is a new inode. A key that differs means the ids are scanned again.
CHECK_CACHE = ".token-check.json"
# File times come from a coarse kernel clock (a few ms): a write in the same tick as the scan
# leaves ctime as the scan saw it. A verdict is trusted only for a file unchanged for this long
# before its scan began; a file scanned while it was still being written is scanned again.
SETTLED_NS = 2_000_000_000
SCAN_CHUNK = 1 << 26  # tokens per step of the id scan (128 MB)
SCAN_BAR_ABOVE = 1 << 28  # tokens; a scan this long shows a progress bar


class DataError(ValueError):
    """Token data that cannot be trained on; the message names the file and the problem. Exit 2."""


@dataclass(frozen=True)
class TokenData:
    train: np.ndarray  # np.memmap uint16
    val: np.ndarray  # np.memmap uint16 (may be empty)
    meta: dict


# --------------------------------------------------------------------------------------------
# Opening and validating


def open_token_data(data_dir: str | os.PathLike[str], vocab_size: int) -> TokenData:
    """Memory-maps train.bin and val.bin after checking them against meta.json and the model's vocab.

    Every token id is checked to be < vocab_size: an out-of-range id indexes past the embedding
    (an error on GPU, or garbage and NaN losses). The scan reads each file once; its verdict is
    cached beside the data, so a relaunch does not rescan 20 GB.
    """
    data_dir = Path(data_dir)
    meta = _read_meta(data_dir / "meta.json", vocab_size)
    files = {}
    for split in ("train", "val"):
        files[split] = _map_tokens(data_dir / f"{split}.bin", meta[f"{split}_tokens"])
    if len(files["train"]) == 0:
        raise DataError(f"{data_dir / 'train.bin'}: no tokens")
    check_token_ids(data_dir, files, vocab_size)
    return TokenData(train=files["train"], val=files["val"], meta=meta)


def _read_meta(path: Path, vocab_size: int) -> dict[str, Any]:
    try:
        meta = read_json_file(path)
    except FileNotFoundError:
        raise DataError(
            f"{path}: missing; tokenize first: python -m x1_pretrain.tokenize_data --input-dir ... --output-dir {path.parent}"
        ) from None
    except (OSError, ValueError) as e:
        raise DataError(f"{path}: not readable JSON ({e})") from None
    if not isinstance(meta, dict):
        raise DataError(f"{path}: expected a JSON object")
    for key in ("tokenizer", "dtype", "vocab_size", "train_tokens", "val_tokens"):
        if key not in meta:
            raise DataError(f"{path}: no '{key}' field")
    if meta["tokenizer"] not in KNOWN_TOKENIZERS:
        raise DataError(f"{path}: tokenizer {meta['tokenizer']!r} is not one this trainer knows ({', '.join(KNOWN_TOKENIZERS)})")
    if meta["dtype"] != "uint16" or meta.get("byte_order", "little") != "little":
        raise DataError(f"{path}: dtype {meta['dtype']!r} ({meta.get('byte_order', 'little')}-endian); expected little-endian uint16")
    for key in ("vocab_size", "train_tokens", "val_tokens"):
        if isinstance(meta[key], bool) or not isinstance(meta[key], int) or meta[key] < 0:
            raise DataError(f"{path}: {key} must be a non-negative integer, got {meta[key]!r}")
    if meta["vocab_size"] > vocab_size:
        raise DataError(
            f"{path}: the data's vocab_size {meta['vocab_size']} is larger than the model's vocab_size {vocab_size}"
        )
    return meta


def _map_tokens(path: Path, tokens: int) -> np.ndarray:
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        raise DataError(f"{path}: missing (meta.json lists {tokens} tokens)") from None
    if size != tokens * TOKEN_DTYPE.itemsize:
        raise DataError(
            f"{path}: {size} bytes, but meta.json says {tokens} tokens = {tokens * TOKEN_DTYPE.itemsize} bytes "
            "(incomplete copy, or files from different runs); re-run tokenize_data or copy again"
        )
    if tokens == 0:
        return np.zeros(0, dtype=TOKEN_DTYPE)  # mmap refuses empty files
    return np.memmap(path, dtype=TOKEN_DTYPE, mode="r")


def check_token_ids(data_dir: Path, files: dict[str, np.ndarray], vocab_size: int) -> None:
    """Raises DataError naming the file, the first id >= vocab_size and its offset."""
    cache_path = data_dir / CHECK_CACHE
    try:
        cache = read_json_file(cache_path)
    except (OSError, ValueError):
        cache = {}
    if not isinstance(cache, dict):
        cache = {}
    changed = False
    for split, tokens in files.items():
        path = data_dir / f"{split}.bin"
        name = path.name
        st = path.stat()
        stamp = {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "ctime_ns": st.st_ctime_ns, "inode": st.st_ino}
        entry = cache.get(name)
        max_seen = entry.get("max_id") if isinstance(entry, dict) else None
        settled = isinstance(entry, dict) and isinstance(entry.get("scanned_ns"), int) and \
            entry["scanned_ns"] - st.st_ctime_ns > SETTLED_NS
        if (isinstance(max_seen, int) and not isinstance(max_seen, bool) and max_seen < vocab_size and settled
                and {k: entry.get(k) for k in stamp} == stamp):
            continue
        scanned_ns = time.time_ns()  # before the read: a write after it moves ctime past this
        max_id = _scan_max_id(path, tokens, vocab_size)
        cache[name] = {**stamp, "scanned_ns": scanned_ns, "max_id": max_id}
        changed = True
    if changed:
        try:
            write_json_atomic(cache_path, cache)
        except OSError as e:  # a read-only data folder: the check simply reruns next launch
            log.warning("could not cache the token id check in %s (%s)", cache_path, e)


def _scan_max_id(path: Path, tokens: np.ndarray, vocab_size: int) -> int:
    n = len(tokens)
    if n == 0:
        return -1
    log.info("checking the %s token ids in %s against vocab_size %d (once; cached in %s)", f"{n:,}", path, vocab_size, CHECK_CACHE)
    bar = None
    if n > SCAN_BAR_ABOVE:
        from tqdm import tqdm

        bar = tqdm(total=n, unit="tok", unit_scale=True, desc=f"check {path.name}", mininterval=1.0)
    max_id = 0
    try:
        for start in range(0, n, SCAN_CHUNK):
            chunk = tokens[start : start + SCAN_CHUNK]
            m = int(chunk.max())
            if m >= vocab_size:
                bad = int(np.argmax(chunk >= vocab_size))
                raise DataError(
                    f"{path}: token id {int(chunk[bad])} at token offset {start + bad:,} (byte {2 * (start + bad):,}) is >= "
                    f"vocab_size {vocab_size}: data from another tokenizer, or corrupt; a model fed such ids produces "
                    "garbage and NaN losses. Re-tokenize it with tokenize_data."
                )
            max_id = max(max_id, m)
            if bar is not None:
                bar.update(len(chunk))
    finally:
        if bar is not None:
            bar.close()
    return max_id


# --------------------------------------------------------------------------------------------
# Training windows


def micro_batch_indices(micro_step: int, rank: int, micro_batch: int, world_size: int) -> range:
    """Global sample indices, within one optimizer step, of one rank's micro-batch."""
    start = micro_step * world_size * micro_batch + rank * micro_batch
    return range(start, start + micro_batch)


_GOLDEN = 0x9E3779B97F4A7C15
_MASK64 = (1 << 64) - 1


def _splitmix64(x: np.ndarray) -> np.ndarray:
    """SplitMix64's output function (Steele et al. 2014) on uint64 arrays; wraps mod 2^64."""
    with np.errstate(over="ignore"):
        z = x.astype(np.uint64, copy=True)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return z ^ (z >> np.uint64(31))


def _key(*parts: int) -> int:
    """One 64-bit key from non-negative integers (seed, step, ...)."""
    k = 0
    for p in parts:
        k = int(_splitmix64(np.array([((k ^ (p & _MASK64)) + _GOLDEN) & _MASK64], dtype=np.uint64))[0])
    return k


def _stream(key: int, indices: np.ndarray) -> np.ndarray:
    """The indices-th outputs of a SplitMix64 stream seeded with key: counter-based, so one
    output never depends on how many others are drawn."""
    with np.errstate(over="ignore"):
        state = np.uint64(key) + (indices.astype(np.uint64) + np.uint64(1)) * np.uint64(_GOLDEN)
    return _splitmix64(state)


class WindowSampler:
    """Random windows of seq_len + 1 tokens; window i of step s depends only on (seed, s, i)."""

    def __init__(self, tokens: np.ndarray, seq_len: int, seed: int, samples_per_step: int):
        if seq_len < 1 or samples_per_step < 1:
            raise ValueError(f"seq_len {seq_len} and samples_per_step {samples_per_step} must be >= 1")
        if len(tokens) < seq_len + 1:
            name = getattr(tokens, "filename", None) or "train tokens"
            raise DataError(f"{name}: {len(tokens)} tokens, fewer than one window of seq_len + 1 = {seq_len + 1}")
        self.tokens, self.seq_len, self.seed = tokens, seq_len, seed
        self.samples_per_step = samples_per_step
        self.n_starts = len(tokens) - seq_len  # a start s reads tokens[s : s + seq_len + 1]
        self._offsets = np.arange(seq_len + 1, dtype=np.int64)

    def _starts(self, step: int, indices: np.ndarray) -> np.ndarray:
        if len(indices) and (indices.min() < 0 or indices.max() >= self.samples_per_step):
            raise ValueError(f"sample indices must be in [0, {self.samples_per_step}), got {indices.min()}..{indices.max()}")
        # Modulo bias is below n_starts / 2^64: ~1e-9 for 10B tokens.
        return (_stream(_key(self.seed, step), indices) % np.uint64(self.n_starts)).astype(np.int64)

    def starts(self, step: int) -> np.ndarray:
        """(samples_per_step,) int64 window starts of one step, each in [0, len(tokens) - seq_len - 1]."""
        return self._starts(step, np.arange(self.samples_per_step, dtype=np.int64))

    def windows(self, step: int, indices: Iterable[int]) -> np.ndarray:
        """(len(indices), seq_len + 1) int64 windows for those global sample indices of `step`."""
        starts = self._starts(step, np.fromiter(indices, dtype=np.int64))
        # One gather from the memmap: (B, T+1) indices, no Python loop over tokens.
        return self.tokens[starts[:, None] + self._offsets].astype(np.int64)


def val_windows(val_tokens: np.ndarray, seq_len: int, n_windows: int, seed: int) -> np.ndarray:
    """(n, seq_len + 1) int64: the same fixed, non-overlapping val windows at every call.

    n = n_windows when val holds that many disjoint windows, else all it holds (at least 1).
    """
    width = seq_len + 1
    slots = len(val_tokens) // width
    if slots == 0:
        name = getattr(val_tokens, "filename", None) or "val.bin"
        raise DataError(
            f"{name}: {len(val_tokens)} val tokens, fewer than one window of seq_len + 1 = {width}; "
            "re-tokenize with a larger --val-fraction"
        )
    if n_windows >= slots:
        chosen = np.arange(slots, dtype=np.int64)
    else:
        chosen = np.sort(np.random.default_rng(np.random.SeedSequence([seed, 0x7A1])).choice(slots, n_windows, replace=False))
    starts = chosen.astype(np.int64) * width
    return np.asarray(val_tokens[starts[:, None] + np.arange(width)], dtype=np.int64)


# --------------------------------------------------------------------------------------------
# Rare-token sequences (the injected loss spike)


def rare_token_ids(tokens: np.ndarray, vocab_size: int, fraction: float = 0.01, sample_tokens: int = 50_000_000) -> np.ndarray:
    """Ids in the bottom `fraction` of the unigram distribution among ids seen at least once.

    Counted on up to sample_tokens tokens read as 1000 evenly spaced contiguous blocks: a strided
    read of single tokens would touch every page of a 20 GB file.
    """
    n = len(tokens)
    if n == 0:
        raise DataError("rare_token_ids: no tokens to count")
    counts = np.zeros(vocab_size, dtype=np.int64)
    if n <= sample_tokens:
        counts += np.bincount(np.asarray(tokens), minlength=vocab_size)[:vocab_size]
    else:
        blocks = 1000
        block = sample_tokens // blocks
        for start in np.linspace(0, n - block, blocks).astype(np.int64):
            counts += np.bincount(np.asarray(tokens[start : start + block]), minlength=vocab_size)[:vocab_size]
    seen = np.flatnonzero(counts)
    k = max(1, int(round(fraction * len(seen))))
    order = np.lexsort((seen, counts[seen]))  # by count, ties by id: deterministic
    return np.sort(seen[order[:k]]).astype(np.int64)


def rare_token_windows(rare_ids: np.ndarray, seed: int, step: int, micro_step: int, rank: int, count: int, seq_len: int) -> np.ndarray:
    """(count, seq_len + 1) int64 sequences of rare ids, the same for the same arguments."""
    if len(rare_ids) == 0:
        raise DataError("rare_token_windows: no rare ids to draw from")
    rng = np.random.default_rng(np.random.SeedSequence([seed, step, micro_step, rank, 0x5B1CE]))
    return rng.choice(np.asarray(rare_ids, dtype=np.int64), size=(count, seq_len + 1))


# --------------------------------------------------------------------------------------------
# Prefetch


class _Failure:
    def __init__(self, exc: BaseException):
        self.exc = exc


_END = object()


def split_window(w: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, T+1) windows -> inputs and targets, (B, T) int64 each, contiguous.

    Every batch the compiled model sees comes through here (the loop's, the warm-up's, the
    injected spike's): torch.compile guards on strides, and a (B, T) view of a (B, T+1) tensor
    has other strides than a contiguous one, so one odd batch recompiles the whole graph.
    """
    import torch

    x = torch.from_numpy(np.ascontiguousarray(w[:, :-1], dtype=np.int64))
    y = torch.from_numpy(np.ascontiguousarray(w[:, 1:], dtype=np.int64))
    return x, y


class Prefetcher:
    """Prepares micro-batches on a background thread and copies them to the device ahead of use.

    On CUDA the host tensors are pinned and copied non_blocking on a side stream; the consumer's
    stream waits on an event, so the copy overlaps the previous micro-batch's compute. An
    exception in the thread is raised in the consumer. depth 0 = synchronous, no thread.
    """

    def __init__(
        self,
        source: Callable[[int, int], np.ndarray],
        keys: Iterable[tuple[int, int]],
        device: torch.device,
        depth: int = 4,
        pin_memory: bool = True,
    ):
        import torch

        self.source, self.keys = source, iter(keys)
        self.device = torch.device(device)
        self.depth = depth
        self.cuda = self.device.type == "cuda"
        self.pin = pin_memory and self.cuda
        self._stream = torch.cuda.Stream(self.device) if self.cuda and depth > 0 else None
        self._stop = threading.Event()
        self._queue: queue.Queue[Any] = queue.Queue(maxsize=max(1, depth))
        self._thread: threading.Thread | None = None
        if depth > 0:
            self._thread = threading.Thread(target=self._run, name="x1-prefetch", daemon=True)
            self._thread.start()

    def _prepare(self, step: int, micro: int) -> tuple[int, int, Any, Any, Any]:
        import torch

        x, y = split_window(self.source(step, micro))
        if not self.cuda:
            return step, micro, x.to(self.device), y.to(self.device), None
        if self.pin:
            x, y = x.pin_memory(), y.pin_memory()
        if self._stream is None:  # synchronous: the current stream orders the copy before use
            return step, micro, x.to(self.device, non_blocking=self.pin), y.to(self.device, non_blocking=self.pin), None
        with torch.cuda.stream(self._stream):
            x = x.to(self.device, non_blocking=self.pin)
            y = y.to(self.device, non_blocking=self.pin)
            ready = torch.cuda.Event()
            ready.record(self._stream)
        return step, micro, x, y, ready

    def _put(self, item: Any) -> bool:
        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def _run(self) -> None:
        try:
            for step, micro in self.keys:
                if self._stop.is_set() or not self._put(self._prepare(step, micro)):
                    return
            self._put(_END)
        except BaseException as e:  # handed to the consumer, raised there
            self._put(_Failure(e))

    def _ready(self, item: tuple[int, int, Any, Any, Any]) -> tuple[int, int, torch.Tensor, torch.Tensor]:
        step, micro, x, y, ready = item
        if ready is not None:
            import torch

            current = torch.cuda.current_stream(self.device)
            current.wait_event(ready)
            x.record_stream(current)  # allocated on the side stream, used and freed on this one
            y.record_stream(current)
        return step, micro, x, y

    def __iter__(self) -> Iterator[tuple[int, int, torch.Tensor, torch.Tensor]]:
        if self._thread is None:
            for step, micro in self.keys:
                if self._stop.is_set():
                    return
                yield self._ready(self._prepare(step, micro))
            return
        while True:
            try:
                item = self._queue.get(timeout=0.1)
            except queue.Empty:
                if self._stop.is_set():
                    return
                continue
            if item is _END:
                return
            if isinstance(item, _Failure):
                raise item.exc
            yield self._ready(item)

    def close(self) -> None:
        """Stops the thread promptly, also when the consumer stopped early (SIGTERM)."""
        self._stop.set()
        try:
            while True:
                self._queue.get_nowait()
        except queue.Empty:
            pass
        if self._thread is not None:
            self._thread.join(timeout=10)

    def __enter__(self) -> Prefetcher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
