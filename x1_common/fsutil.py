"""Writes that another process may read at any moment: temp file, fsync, rename.

A reader sees the old file or the new one, never a torn one, and a crash at any point leaves one
of the two on disk. (Peers lost runs to checkpoints overwritten in place.)

Modes are the user's: a new file is created 0666 through the process's umask, as `open()` and
`touch` would create it (0644 under the usual 022, 0600 under 077). Other services read these
files, so the umask must let them (compose runs every service as the same user). The umask is
never read with `os.umask(0)`: that sets it for a moment for every thread of the process, and a
file another thread creates in that moment would come out world-writable.

A write the disk refuses (full, over quota, read-only) is said in one line where it happens:
`disk_fault` turns the OSError into a DiskFaultError naming the path, the free space and what was
needed, and the atomic writers below raise it themselves. A long-running service keeps the state
of its writes in a WriteHealth: its health endpoint and metrics show the first failed write, its
log says each failure once, not once per retry.
"""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
import secrets
import shutil
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

# The errors of a write that the disk refused, not the data: what a person must fix is the disk.
DISK_FAULTS = {
    errno.ENOSPC: "no space left on device",
    errno.EDQUOT: "disk quota exceeded",
    errno.EROFS: "read-only file system",
}


class DiskFaultError(OSError):
    """A write the disk refused (full, over quota, read-only). `str()` is one line naming the path,
    the free space and what was needed; `errno` is the original one, `filename` the path.
    (Built as OSError(errno, message, path), so it pickles across processes.)"""

    def __str__(self) -> str:
        return str(self.strerror)


def size_text(n: float) -> str:
    """Bytes for a person: GB with two decimals from 10 MB (as the checkpoint store has always
    said it), MB or kB below, bytes under 1 kB."""
    if n >= 1e7:
        return f"{n / 1e9:.2f} GB"
    if n >= 1e5:
        return f"{n / 1e6:.1f} MB"
    if n >= 1e3:
        return f"{n / 1e3:.1f} kB"
    return f"{int(n)} bytes"


def free_bytes(path: str | os.PathLike[str]) -> int | None:
    """Free bytes for this user on the filesystem of `path`, or of its nearest existing parent; None
    when even that cannot be asked."""
    probe = Path(path)
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    try:
        return shutil.disk_usage(probe).free
    except OSError:
        return None


def disk_fault(error: BaseException, path: str | os.PathLike[str] | None = None, *, need: int | None = None,
               what: str | None = None) -> DiskFaultError | None:
    """`error` as a one-line DiskFaultError when it is a write the disk refused (ENOSPC, EDQUOT,
    EROFS), else None (any other error is the caller's to say):

        no space left on device at /workspace/budget.json, need 1.2 kB (0 bytes free)
        no space left on device at /data/tokenized, need 1.20 GB for train.bin and val.bin (0.31 GB free)
        read-only file system at /workspace/logs/watchdog-state.json

    `path` is where the write went (default: the error's own filename); `need` the bytes it
    needed, where known; `what` what it was writing. A DiskFaultError is returned as it is, or
    said again for `path` when that names another place (the folder a person knows, for a
    hidden temp file in it), keeping its `need` and `what` unless new ones are given."""
    if isinstance(error, DiskFaultError):
        if path is None or str(path) == error.filename:
            return error
        need = need if need is not None else getattr(error, "need", None)
        what = what or getattr(error, "what", None)
    elif not isinstance(error, OSError) or error.errno not in DISK_FAULTS:
        return None
    where = Path(path) if path is not None else Path(error.filename) if error.filename else None
    text = DISK_FAULTS[error.errno] + (f" at {where}" if where is not None else "")
    if need is not None:
        text += f", need {size_text(need)}"
    if what:
        text += f" for {what}"
    if error.errno != errno.EROFS and where is not None and (free := free_bytes(where)) is not None:
        text += f" ({size_text(free)} free)"
    fault = DiskFaultError(error.errno, text, str(where) if where is not None else None)
    fault.need, fault.what = need, what  # kept for a caller that says it again for another path
    return fault


@contextmanager
def disk_faults_named(path: str | os.PathLike[str], *, need: int | None = None, what: str | None = None) -> Iterator[None]:
    """Inside, an OSError the disk caused becomes disk_fault(e, path, need=, what=); others pass."""
    try:
        yield
    except OSError as e:
        fault = disk_fault(e, path, need=need, what=what)
        if fault is None or fault is e:
            raise
        raise fault from e


def write_error_text(error: OSError, path: str | os.PathLike[str], *, need: int | None = None,
                     what: str | None = None) -> str:
    """One line for any failed write of `path`: the disk fault's line, else `path: why`."""
    fault = disk_fault(error, path, need=need, what=what)
    if fault is not None:
        return str(fault)
    return f"{path}: {error.strerror or error}"


class WriteHealth:
    """The file writes of a long-running service (the sidecar, the watchdog, the trainer) as its
    health endpoint and metrics show them: from the first failed write on, `last_error` names the
    path and the cause, until that path is written again. A service keeps going and retries at its
    next write; only a person can free space.

    The log says each change once: a path that starts failing (an error), a path failing for
    another cause, a path written again (info); never the same failure once per poll.
    `on_change(last_error)` runs at each such change (metrics); `on_first(message)` once when the
    service goes from no failing write to one (an alert), again only after all writes recovered."""

    def __init__(self, log: logging.Logger, on_change: Callable[[str | None], None] | None = None,
                 on_first: Callable[[str], None] | None = None) -> None:
        self.log = log
        self.on_change = on_change or (lambda last_error: None)
        self.on_first = on_first or (lambda message: None)
        self.failures_total = 0
        self._failing: dict[str, tuple[int | None, str]] = {}  # path -> (errno, message), newest last
        self._lock = threading.Lock()

    @property
    def failing(self) -> bool:
        return bool(self._failing)

    @property
    def last_error(self) -> str | None:
        """The newest failing write's line (path and cause), None while every write succeeds."""
        with self._lock:
            return next(reversed(self._failing.values()))[1] if self._failing else None

    def failed(self, path: str | os.PathLike[str], error: OSError, consequence: str = "", *,
               need: int | None = None, what: str | None = None) -> str:
        """Record a failed write of `path`; returns its line. `consequence` ends the log line: what
        it means and that it is retried."""
        message = write_error_text(error, path, need=need, what=what)
        key = str(path)
        with self._lock:
            before = self._failing.pop(key, None)
            first = not self._failing and before is None
            self._failing[key] = (error.errno, message)
            self.failures_total += 1
        if before is None or before[0] != error.errno:
            self.log.error("%s%s", message, f": {consequence}" if consequence else "")
            self.on_change(message)
            if first:
                self.on_first(message)
        return message

    def succeeded(self, path: str | os.PathLike[str]) -> None:
        """`path` was written: no longer failing (said once, when it was)."""
        with self._lock:
            before = self._failing.pop(str(path), None)
        if before is not None:
            self.log.info("%s written again (it failed: %s)", path, before[1])
            self.on_change(self.last_error)


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
    """`path` replaced by `data`, whole or not at all. A disk that refuses the write raises
    DiskFaultError naming `path` and the bytes needed; the old file is left as it was."""
    path = Path(path)
    with disk_faults_named(path, need=len(data)):
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
