"""How an export tool puts its finished files into `--output`: a new folder appears whole; an
existing one (`--force`) has only the tool's own files replaced, and everything else in it kept.

A tool builds its files in a temp folder beside `--output`. When `--output` does not exist (or is
an empty folder) the temp folder is renamed to it: it appears complete or not at all. When it
exists, `--force` means "replace what this tool wrote there before", never "replace the folder":
an `--output` that happens to be the workspace keeps its checkpoints, its tracking database and
everything else. Each file is moved in by an atomic rename, the tool's completion file last.
A name the tool writes that already exists and is not the tool's own (the caller decides by the
record the earlier run left) is refused before anything moves, naming it.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterable
from pathlib import Path

from x1_common.fsutil import fsync_dir


class NotOurFiles(ValueError):
    """--output holds files of the names the tool writes that the tool did not write. Exit 2."""


def foreign_names(out: Path, writes: Iterable[str], ours: Iterable[str]) -> list[str]:
    """The names in `writes` that exist in `out` but are not among `ours` (what an earlier run of
    the tool recorded writing there), sorted."""
    ours = set(ours)
    return sorted(n for n in set(writes) if (os.path.lexists(out / n)) and n not in ours)


def place(tmp: Path, out: Path, *, last: str, ours: Iterable[str], what: str) -> None:
    """Move the files of the finished folder `tmp` into `out`, `last` (the completion file) last.

    `ours`: the names an earlier run of the tool left in `out` (they may be replaced, and those the
    new run does not write are removed as stale). Any other name the new run writes that exists in
    `out` raises NotOurFiles before anything changes; `tmp` is then the caller's to remove."""
    if out.is_dir() and not any(out.iterdir()):
        out.rmdir()
    if not out.exists():
        os.rename(tmp, out)
        fsync_dir(out.parent)
        return
    writes = sorted(p.name for p in tmp.iterdir())
    ours = set(ours)
    foreign = foreign_names(out, writes, ours)
    folders = [n for n in writes if (out / n).is_dir() and not (out / n).is_symlink()]
    if foreign or folders:
        names = ", ".join(sorted(set(foreign) | set(folders)))
        raise NotOurFiles(
            f"--output {out} holds {names}, which {what} did not write there: nothing was replaced. "
            "Give a new or empty folder as --output (--force replaces only files an earlier export wrote)")
    for name in sorted(writes, key=lambda n: n == last):
        os.replace(tmp / name, out / name)
    for name in sorted(ours - set(writes)):  # the earlier run's files this one does not write
        if (out / name).is_file() or (out / name).is_symlink():
            (out / name).unlink()
    fsync_dir(out)
    shutil.rmtree(tmp, ignore_errors=True)
