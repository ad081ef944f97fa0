"""`python -m x1_pretrain.prepare`: download the pretraining text and tokenize it, in one command.

    python -m x1_pretrain.prepare --output-dir /workspace/data [--source fineweb-edu|pile-cc]
        [--max-shards N] [--workers 16] [--val-fraction 0.001] [--seed 42] [--no-fallback] [--force]

The lab's data recipe as one step (compose runs it as the one-shot `prepare` service):
1. FineWeb-Edu `sample/10BT/*.parquet` from the Hugging Face hub into `<output-dir>/fineweb-edu/`;
2. the lab's shard-count check (`ls sample/10BT/ | wc -l`, ~96 files);
3. when the hub refuses (gated, bad token, rate limit), the lab's fallback: the Pile
   (`monology/pile-uncopyrighted`, `test/*.jsonl.zst`) into `<output-dir>/pile-cc/`;
4. `x1_pretrain.tokenize_data` into `<output-dir>/tokenized` (train.bin, val.bin, meta.json).

Every step resumes: files already downloaded are not fetched again and shards already tokenized
are not redone, so after an interruption the same command continues. HF_TOKEN (read-only is
enough) comes from the environment and is never printed.

Exit codes: 0 done, 1 download or shard check failed, 2 usage; the tokenizer's own code otherwise.
"""

from __future__ import annotations

import argparse
import fnmatch
import logging
import os
import shutil
import subprocess
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from x1_common.contracts import ExitCode
from x1_common.fsutil import disk_fault
from x1_common.logs import setup_logging

log = logging.getLogger("x1.prepare")

FAILED = 1


@dataclass(frozen=True)
class Source:
    """One dataset on the hub: which files to fetch and where they land."""

    name: str  # also the folder under --output-dir
    repo_id: str
    pattern: str  # files to fetch, relative to the repo root (fnmatch, as the hub's allow_patterns)
    seed_shards: int | None  # how many files the lab expects from a full download

    def local_dir(self, output_dir: Path) -> Path:
        return output_dir / self.name

    def shard_dir(self, output_dir: Path) -> Path:
        """The folder the pattern's files land in: the tokenizer's --input-dir."""
        return self.local_dir(output_dir) / Path(self.pattern).parent

    def shards(self, output_dir: Path) -> list[Path]:
        folder = self.shard_dir(output_dir)
        return sorted(p for p in folder.glob(Path(self.pattern).name) if p.is_file())


FINEWEB_EDU = Source("fineweb-edu", "HuggingFaceFW/fineweb-edu", "sample/10BT/*.parquet", seed_shards=96)
# The lab's Option B: same shape (documents with a `text` field), lower quality, far fewer tokens.
PILE_CC = Source("pile-cc", "monology/pile-uncopyrighted", "test/*.jsonl.zst", seed_shards=None)
SOURCES = {s.name: s for s in (FINEWEB_EDU, PILE_CC)}
FALLBACK = {FINEWEB_EDU.name: PILE_CC}

# Downloads the shards of `source` into its local folder (at most `max_shards`, None = all) and
# returns how many shards the hub lists for the pattern. Tests inject their own.
Fetch = Callable[[Source, Path, int | None], int]
# Runs the tokenizer with these arguments and returns its exit code. Tests inject their own.
Tokenize = Callable[[Sequence[str]], int]


def hub_token() -> str | None:
    return os.environ.get("HF_TOKEN") or None


def hub_fetch(source: Source, local_dir: Path, max_shards: int | None) -> int:
    """The real download, through huggingface_hub (imported here: only this step needs it)."""
    from huggingface_hub import HfApi, snapshot_download
    from huggingface_hub.hf_api import RepoFile

    token = hub_token()
    folder = str(Path(source.pattern).parent)
    # Listing only the sample's folder: the repo holds thousands of other files.
    entries = HfApi(token=token).list_repo_tree(source.repo_id, path_in_repo=folder, repo_type="dataset")
    listed = sorted((e for e in entries if isinstance(e, RepoFile) and fnmatch.fnmatch(e.path, source.pattern)),
                    key=lambda e: e.path)
    wanted = listed[:max_shards] if max_shards else listed
    need_bytes = sum(e.size or 0 for e in wanted)
    log.info("%s: the hub lists %d shards under %s; fetching %d (%.1f GB)",
             source.repo_id, len(listed), source.pattern, len(wanted), need_bytes / 1e9)
    local_dir.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(local_dir).free
    # The tokenized copy is about as large as the parquet (2 bytes a token), so ask for twice.
    if free < 2 * need_bytes:
        log.warning("only %.1f GB free under %s for %.1f GB of shards plus their tokens",
                    free / 1e9, local_dir, need_bytes / 1e9)
    if wanted:
        snapshot_download(source.repo_id, repo_type="dataset", allow_patterns=[e.path for e in wanted],
                          local_dir=local_dir, token=token)
    return len(listed)


def run_tokenizer(args: Sequence[str]) -> int:
    # A child process: the tokenizer's worker pool and memory go away with it.
    return subprocess.run([sys.executable, "-m", "x1_pretrain.tokenize_data", *args], check=False).returncode


def hub_refused(err: BaseException) -> bool:
    """True when the hub answered no (bad token, gated repo, rate limit): another repo may still work.

    A network that is down is not a refusal: the fallback lives on the same hub.
    """
    status = getattr(getattr(err, "response", None), "status_code", None)
    if status in (401, 403, 429):
        return True
    try:
        from huggingface_hub.errors import HfHubHTTPError
    except ImportError:
        return False
    return isinstance(err, HfHubHTTPError)


@dataclass(frozen=True)
class ShardCheck:
    ok: bool
    message: str
    warning: str | None = None


def check_shards(found: int, listed: int, max_shards: int | None, seed_shards: int | None) -> ShardCheck:
    """The lab's `ls sample/10BT/ | wc -l`, against what the hub lists (the authority) and the lab's ~96."""
    wanted = min(listed, max_shards) if max_shards else listed
    if found == 0 or found < wanted:
        return ShardCheck(False, f"{found} of {wanted} shards on disk; run the same command again to resume the download")
    warning = None
    if max_shards is None and seed_shards and found < seed_shards:
        warning = (f"{found} shards, fewer than the lab's ~{seed_shards}: the hub lists {listed}, "
                   f"so the dataset's layout changed; check the token count in meta.json against the plan")
    return ShardCheck(True, f"{found} of {wanted} shards on disk", warning)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m x1_pretrain.prepare",
        description="Download FineWeb-Edu sample/10BT (the Pile as fallback) and tokenize it with GPT-2 BPE.",
    )
    p.add_argument("--output-dir", type=Path, required=True,
                   help="data root: downloads go to <dir>/fineweb-edu or <dir>/pile-cc, tokens to <dir>/tokenized")
    p.add_argument("--source", default=FINEWEB_EDU.name, choices=list(SOURCES),
                   help="fineweb-edu (default; the Pile when the hub refuses it) or pile-cc")
    p.add_argument("--max-shards", type=int, default=0, help="fetch only the first N shards (0 = all, the default)")
    p.add_argument("--workers", type=int, default=16, help="tokenizer processes (the lab's 16)")
    p.add_argument("--val-fraction", type=float, default=0.001, help="share of documents held out for val.bin")
    p.add_argument("--seed", type=int, default=42, help="seed of the train/val split")
    p.add_argument("--no-fallback", action="store_true", help="fail instead of falling back to the Pile")
    p.add_argument("--force", action="store_true", help="run even when <dir>/tokenized/meta.json exists")
    return p


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.max_shards < 0:
        parser.error(f"--max-shards must be >= 0 (0 = all), got {args.max_shards}")
    if args.workers < 1:
        parser.error(f"--workers must be >= 1, got {args.workers}")
    if not 0.0 < args.val_fraction < 1.0:
        parser.error(f"--val-fraction must be between 0 and 1 (exclusive), got {args.val_fraction}")
    return args


def prepare(args: argparse.Namespace, fetch: Fetch, tokenize: Tokenize) -> int:
    out: Path = args.output_dir
    tokenized = out / "tokenized"
    if (tokenized / "meta.json").exists() and not args.force:
        log.info("%s is complete (meta.json present); nothing to do (--force to redo)", tokenized)
        return 0
    log.info("HF_TOKEN is %s", "set" if hub_token() else "not set: anonymous downloads are rate-limited sooner")

    max_shards = args.max_shards or None
    candidates = [SOURCES[args.source]]
    if not args.no_fallback and args.source in FALLBACK:
        candidates.append(FALLBACK[args.source])
    for i, source in enumerate(candidates):
        try:
            listed = fetch(source, source.local_dir(out), max_shards)
        except Exception as e:  # the command's edge: any failure becomes one clear line and exit 1
            if hub_refused(e) and i + 1 < len(candidates):
                log.warning("the hub refused %s (%s); falling back to %s", source.repo_id, e, candidates[i + 1].repo_id)
                continue
            fault = disk_fault(e, source.local_dir(out), what=f"{source.repo_id}'s shards")
            log.error("download of %s failed: %s", source.repo_id, fault or f"{type(e).__name__}: {e}")
            return FAILED
        break

    shards = source.shards(out)
    check = check_shards(len(shards), listed, max_shards, source.seed_shards)
    if not check.ok:
        log.error("%s: %s", source.shard_dir(out), check.message)
        return FAILED
    if check.warning:
        log.warning("%s", check.warning)
    size_gb = sum(p.stat().st_size for p in shards) / 1e9
    log.info("%s: %s, %.1f GB in %s", source.name, check.message, size_gb, source.shard_dir(out))

    return tokenize([
        "--input-dir", str(source.shard_dir(out)),
        "--output-dir", str(tokenized),
        "--tokenizer", "gpt2",
        "--val-fraction", str(args.val_fraction),
        "--workers", str(args.workers),
        "--seed", str(args.seed),
    ])


def main(argv: Sequence[str] | None = None, *, fetch: Fetch = hub_fetch, tokenize: Tokenize = run_tokenizer) -> int:
    setup_logging()
    try:
        args = parse_args(argv)
    except SystemExit as e:  # argparse has printed the message naming the flag
        return int(e.code) if isinstance(e.code, int) else ExitCode.USAGE
    return prepare(args, fetch, tokenize)


if __name__ == "__main__":
    sys.exit(main())
