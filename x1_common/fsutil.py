"""Writes that another process may read at any moment: temp file, fsync, rename.

A reader sees the old file or the new one, never a torn one, and a crash at any point leaves one
of the two on disk. (Peers lost runs to checkpoints overwritten in place.)
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from pathlib import Path
from typing import Any


def fsync_dir(path: str | os.PathLike[str]) -> None:
    """Make a rename or a new entry in `path` durable (POSIX needs the directory fsynced)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass  # some filesystems (and Windows) refuse fsync on directories
    finally:
        os.close(fd)


def write_bytes_atomic(path: str | os.PathLike[str], data: bytes, *, durable: bool = True) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        # mkstemp makes the file 0600; these files are read by other services, which in
        # compose may run as another user (budget.json, the heartbeat, meta.json).
        os.fchmod(fd, 0o644)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            if durable:
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    if durable:
        fsync_dir(path.parent)


def write_text_atomic(path: str | os.PathLike[str], text: str, *, durable: bool = True) -> None:
    write_bytes_atomic(path, text.encode("utf-8"), durable=durable)


def write_json_atomic(path: str | os.PathLike[str], obj: Any, *, durable: bool = True) -> None:
    write_text_atomic(path, json.dumps(obj, indent=2, sort_keys=True) + "\n", durable=durable)


def sha256_file(path: str | os.PathLike[str], chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def make_readable(folder: str | os.PathLike[str]) -> None:
    """Give a folder written for the user, and everything in it, the permissions the umask gives a
    new file (0644/0755 under the usual 022). Temp folders and files start private (mkdtemp 0700,
    mkstemp 0600; safetensors writes 0600 too): renamed into place as they are, they would stay so."""
    umask = os.umask(0)
    os.umask(umask)
    root = Path(folder)
    for path in [root, *root.rglob("*")]:
        if path.is_symlink():
            continue
        os.chmod(path, (0o777 if path.is_dir() else 0o666) & ~umask)
