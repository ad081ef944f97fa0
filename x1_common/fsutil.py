"""Writes that another process may read at any moment: temp file, fsync, rename.

A reader sees the old file or the new one, never a torn one, and a crash at any point leaves one
of the two on disk. (Peers lost runs to checkpoints overwritten in place.)

Modes are the user's: a new file is created 0666 through the process's umask, as `open()` and
`touch` would create it (0644 under the usual 022, 0600 under 077). Other services read these
files, so the umask must let them (compose runs every service as the same user). The umask is
never read with `os.umask(0)`: that sets it for a moment for every thread of the process, and a
file another thread creates in that moment would come out world-writable.
"""

from __future__ import annotations

import hashlib
import json
import os
import secrets
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
    fd, tmp = _create_temp(path)
    try:
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


def _create_temp(path: Path) -> tuple[int, Path]:
    """A new temp file beside `path`, mode 0666 through the umask (mkstemp would force 0600)."""
    for _ in range(100):
        tmp = path.with_name(f".{path.name}.{secrets.token_hex(4)}.tmp")
        try:
            return os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o666), tmp
        except FileExistsError:
            continue
    raise FileExistsError(f"{path.parent}: no free temp name for {path.name}")


def current_umask(folder: str | os.PathLike[str] | None = None) -> int:
    """The process's umask, read without changing it (safe with threads running).

    Linux says it in /proc/self/status; elsewhere a probe file created 0777 in `folder` shows
    which bits the umask took away."""
    try:
        for line in Path("/proc/self/status").read_text(encoding="ascii").splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    probe = Path(folder or ".") / f".x1-umask-{secrets.token_hex(4)}"
    fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o777)
    try:
        return 0o777 & ~os.fstat(fd).st_mode
    finally:
        os.close(fd)
        os.unlink(probe)


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
    root = Path(folder)
    umask = current_umask(root)
    for path in [root, *root.rglob("*")]:
        if path.is_symlink():
            continue
        os.chmod(path, (0o777 if path.is_dir() else 0o666) & ~umask)
