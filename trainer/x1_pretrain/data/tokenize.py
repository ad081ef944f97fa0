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
- A disk that refuses the output (full, over quota, read-only) is no bad input: exit 1 and one line
  naming the folder, its free space and what was needed (x1_common.fsutil.disk_fault). Every new
  byte is written before any earlier output is replaced, so those stay as they were; finished
  shards are kept for the rerun.
"""

from __future__ import annotations

import argparse
import fcntl
import logging
import math
import os
import shutil
import signal
import sys
import time
from collections import Counter
from dataclasses import asdict
from pathlib import Path
from typing import Any, BinaryIO

from x1_common.contracts import ExitCode, format_utc, read_json_file, utc_now
from x1_common.fsutil import disk_fault, disk_faults_named, fsync_dir, write_json_atomic
from x1_common.logs import setup_logging
from x1_pretrain.data.shards import Progress, ShardResult, _result_ok, run_shards, shard_paths
from x1_pretrain.data.sources import (
    FORMATS,
    MAX_SKIP_EXAMPLES,
    TOKENIZERS,
    WORK_VERSION,
    HashingReader,
    InputError,
    Settings,
    Shard,
    SourceFile,
    UnreadableFile,
    find_inputs,
    plan_shards,
)
from x1_pretrain.data.tokenizer import EOT_TOKEN, VOCAB_SIZE

log = logging.getLogger("x1_pretrain.tokenize_data")
WORK_DIR = ".tokenize-work"


# --------------------------------------------------------------------------------------------
# Worker processes


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

    def close(self) -> None:
        """Let go of the folder's lock (the process's exit does too; a caller that goes on, a test,
        must not find its own lock held by a run that ended)."""
        if self._lock is not None:
            self._lock.close()
            self._lock = None


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
    new_meta = output_dir / ".meta.json.new"
    need = (meta["train_tokens"] + meta["val_tokens"]) * 2
    try:
        with disk_faults_named(output_dir, need=need, what="train.bin and val.bin"), \
                open(tmp["train.bin"], "wb") as train, open(tmp["val.bin"], "wb") as val:
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
        # Every byte is on disk before an earlier output goes: a full disk stops here, with the
        # earlier train.bin, val.bin and meta.json as they were.
        write_json_atomic(new_meta, meta)
        # A reader checks the .bin sizes against meta.json: take the old meta away first, so old and
        # new files are never paired; the new meta.json appears last (renames take no space).
        (output_dir / "meta.json").unlink(missing_ok=True)
        for name, path in tmp.items():
            os.replace(path, output_dir / name)
        os.replace(new_meta, output_dir / "meta.json")
        fsync_dir(output_dir)
    finally:
        for path in (*tmp.values(), new_meta):
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
            "Exit 2 on bad input, naming the file and the problem; exit 1 when the disk refuses the output (full, "
            "over quota, read-only), naming the folder, its free space and what was needed: earlier outputs are "
            "left as they were and finished shards are kept, so the same command continues once there is room."
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
    except OSError as e:
        fault = disk_fault(e, args.output_dir)
        if fault is None:
            raise
        # The environment, not the input: said in a line, with the command's exit code for it.
        print(f"error: {fault}", file=sys.stderr)
        print(f"error: no output in {args.output_dir} was replaced; free some space (or remount it read-write), then "
              "rerun the same command: finished shards are kept", file=sys.stderr)
        return ExitCode.ENVIRONMENT
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
    try:
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
    finally:
        work.close()
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
