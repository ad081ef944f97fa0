"""One writer per folder or file: a lease file that names its owner, kept alive by a heartbeat.

    lease = Lease(ckpt_dir, LeaseKind.TRAINER).acquire()   # LeaseHeld while a live owner holds it
    ...                                                     # a thread renews it; released at exit
    Lease.for_file(budget_json, LeaseKind.BUDGET_SIDECAR).acquire()   # one writer of one file

The trainer takes one on its checkpoint folder (nothing stops a second trainer otherwise: a
`docker compose run trainer` by mistake, a second stack, a provider-mode relaunch on a shared
filesystem while the old instance still runs); `python -m x1_pretrain.stack up` takes one on its
workspace; the budget sidecar on its budget.json (two sidecars on one file would publish two
different spends in turn); the watchdog on its state file (a second watchdog would judge the
first one's trainer an orphan). A file's lease is `.<name>.x1-lease.json` beside it, so it never
meets the folder's own lease. Two files, beside what they guard:

    .x1-lease.json            the owner's record: host, pid, since, boot id, pid namespace, token.
                              Created whole (a temp file hard-linked into place: atomic on local
                              filesystems and on NFS), never rewritten; its mtime is the heartbeat.
    .x1-lease-<token>.lock    a POSIX lock the owner holds for as long as it lives.

Identity is a random token per process, never host + pid: a restarted container keeps its
hostname and often its pid, and the watchdog's relaunch after a crash, a SIGKILL or an exit 75
must never find "itself" holding the folder.

Is the owner alive?
- On this kernel (same boot id: this host, any container on it): alive while its lock is held.
  The kernel drops a POSIX lock the moment its process dies (SIGKILL included), so a dead owner
  is dead at once. Where the filesystem has no locks, the pid and its start time decide, if the
  owner is in our pid namespace.
- On another host (a shared filesystem), or this host without a usable lock: alive while its
  heartbeat moves. The owner touches the lease every `stale_seconds / 6` (10 s by default); it
  is dead when the heartbeat is older than `stale_seconds` (60 s by default; X1_LEASE_STALE_SECONDS)
  and has not moved for a further 40% of that while we watched (so a clock skew between the
  hosts cannot make a live owner look dead), or has not moved for `stale_seconds` of our own
  watching. A moving heartbeat is a live owner: refused at once.
The lock is not the whole answer because on NFS a lock held by a host that died can outlive it
(NLM has no lease of its own), and some filesystems have none; a lock is only ever consulted by
a process on the owner's own kernel, and each owner locks a file of its own, so a lock stuck on
a dead host never blocks the next owner.

A dead owner's lease is taken over (logged, naming the owner and why it counts as dead) by
renaming it aside: of two candidates only one rename succeeds, and a candidate that finds it
moved a live lease puts it back. Every read opens the file (NFS revalidates attributes on open,
close-to-open consistency, where a plain stat() may answer from a cache up to 60 s old).

An owner that finds its lease gone or replaced (it was judged dead: frozen, or cut off from the
filesystem for longer than the stale time) calls `on_lost`: the trainer exits at once, 2, without
writing anything more into a folder that is no longer its own.
"""

from __future__ import annotations

import atexit
import contextlib
import enum
import errno
import fcntl
import json
import logging
import os
import secrets
import socket
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from pathlib import Path

from x1_common.contracts import ExitCode, redact
from x1_common.procs import proc_start_ticks

log = logging.getLogger("x1.lease")

LEASE_FILE = ".x1-lease.json"
STALE_SECONDS_DEFAULT = 60.0
STALE_SECONDS_ENV = "X1_LEASE_STALE_SECONDS"
RECORD_VERSION = 1
# Filesystems without POSIX locks answer with one of these: the pid or the heartbeat decides.
NO_LOCKS = (errno.ENOLCK, errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS)


class LeaseKind(enum.Enum):
    """What holds the lease, as the messages name it."""

    TRAINER = ("trainer", "checkpoint folder")
    STACK = ("stack", "workspace")
    BUDGET_SIDECAR = ("budget sidecar", "budget file")
    WATCHDOG = ("watchdog", "state file")
    LADDER = ("ladder", "ladder folder")

    @property
    def owner_word(self) -> str:
        return self.value[0]

    @property
    def folder_word(self) -> str:
        return self.value[1]


class LeaseHeld(Exception):
    """A live owner holds the folder; the message names it (host, pid, since when)."""

    def __init__(self, message: str, owner: Owner | None) -> None:
        super().__init__(message)
        self.owner = owner


class LeaseError(Exception):
    """The lease cannot be taken for another reason (unreadable folder, a foreign file in the way)."""


def stale_seconds_from_env() -> float:
    text = os.environ.get(STALE_SECONDS_ENV, "").strip()
    if not text:
        return STALE_SECONDS_DEFAULT
    try:
        value = float(text)
    except ValueError:
        raise LeaseError(f"{STALE_SECONDS_ENV}={text!r} is not a number of seconds") from None
    if not 0 < value < 86400:
        raise LeaseError(f"{STALE_SECONDS_ENV}={text!r} must be between 0 and 86400 seconds")
    return value


# ---------------------------------------------------------------------------------------------
# Who we are


def boot_id() -> str | None:
    """This kernel's boot id: shared by every container on the host, new after each reboot."""
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text(encoding="ascii").strip() or None
    except OSError:
        return None


def pid_namespace() -> str | None:
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return None


def iso(t: float) -> str:
    return datetime.fromtimestamp(t, timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


@dataclass(frozen=True)
class Owner:
    """The lease record: who holds the folder."""

    token: str
    kind: str  # "trainer" or "stack"
    host: str
    pid: int
    since: float  # unix time the lease was taken
    boot_id: str | None
    pid_ns: str | None
    start_ticks: int | None
    heartbeat_seconds: float  # how often the owner touches the lease
    lock_file: str | None  # the owner's lock, beside the lease; None where the filesystem has none
    command: str
    version: int = RECORD_VERSION

    def describe(self) -> str:
        return f"host {self.host}, pid {self.pid}, since {iso(self.since)}"

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2, sort_keys=True) + "\n"

    @classmethod
    def from_json(cls, text: str) -> Owner:
        data = json.loads(text)
        if not isinstance(data, dict) or data.get("version") != RECORD_VERSION:
            raise ValueError("not a version-1 lease record")
        fields = {k: data[k] for k in cls.__dataclass_fields__ if k in data}
        owner = cls(**fields)
        if not (isinstance(owner.token, str) and isinstance(owner.pid, int) and isinstance(owner.since, (int, float))
                and isinstance(owner.heartbeat_seconds, (int, float)) and owner.heartbeat_seconds > 0):
            raise ValueError("a field has the wrong type")
        return owner


@dataclass(frozen=True)
class Seen:
    """One read of the lease file."""

    owner: Owner
    ident: tuple[int, int]  # (st_dev, st_ino): which file, whatever its name now
    mtime: float  # the heartbeat


@dataclass(frozen=True)
class Verdict:
    alive: bool
    why: str
    changed: bool = False  # the lease changed hands while we judged it: read it again


# ---------------------------------------------------------------------------------------------
# The lease


class Lease:
    """The lease on one folder. `acquire()` once; `release()` (also at interpreter exit)."""

    def __init__(self, folder: str | os.PathLike[str], kind: LeaseKind = LeaseKind.TRAINER,
                 stale_seconds: float | None = None, on_lost: Callable[[str], None] | None = None,
                 name: str = LEASE_FILE, guarded: str | os.PathLike[str] | None = None) -> None:
        self.folder = Path(folder)
        self.kind = kind
        self.stale_seconds = stale_seconds_from_env() if stale_seconds is None else float(stale_seconds)
        self.heartbeat_seconds = self.stale_seconds / 6
        self.path = self.folder / name
        self.guarded = Path(guarded) if guarded is not None else self.folder  # what the messages name
        self.on_lost = on_lost or self.exit_on_lost
        self.owner: Owner | None = None
        self._fd: int | None = None  # the lease file, open: its inode is our identity, futimens our heartbeat
        self._lock_fd: int | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._created_folder = False

    @classmethod
    def for_file(cls, path: str | os.PathLike[str], kind: LeaseKind, **kwargs: object) -> Lease:
        """The lease on one file (it need not exist yet): `.<name>.x1-lease.json` beside it."""
        path = Path(path)
        return cls(path.parent, kind, name=file_lease_name(path), guarded=path, **kwargs)  # type: ignore[arg-type]

    # -- taking it -----------------------------------------------------------------------------

    def acquire(self, attempts: int = 8) -> Lease:
        """Takes the lease, taking over a dead owner's; raises LeaseHeld naming a live one."""
        try:
            # A folder this lease creates goes again at release when nothing was written into it:
            # a launch refused before its first write (bad data, a busy port) leaves no trace.
            self._created_folder = not self.folder.exists()
            self.folder.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise LeaseError(f"{self.kind.folder_word} {self.guarded}: cannot create {self.folder} ({e.strerror})") from e
        token = secrets.token_hex(8)
        lock_name = self._lock(token)
        me = Owner(token=token, kind=self.kind.owner_word, host=socket.gethostname(), pid=os.getpid(),
                   since=time.time(), boot_id=boot_id(), pid_ns=pid_namespace(), start_ticks=proc_start_ticks(os.getpid()),
                   heartbeat_seconds=self.heartbeat_seconds, lock_file=lock_name,
                   command=redact(" ".join(sys.argv))[:300])
        tmp = self.folder / f".x1-lease-{token}.tmp"
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            try:
                os.write(fd, me.to_json().encode("utf-8"))
                os.fsync(fd)
            finally:
                os.close(fd)
            for _ in range(attempts):
                if self._link(tmp):
                    self._own(me)
                    return self
                self._judge_and_clear()
            raise LeaseHeld(f"{self.kind.folder_word} {self.guarded}: the lease kept changing hands over "
                            f"{attempts} attempts; another {self.kind.owner_word} is starting there", None)
        except BaseException:
            self._unlock()
            raise
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)

    def _lock(self, token: str) -> str | None:
        """Our own lock file, locked before the record that names it exists."""
        name = f".x1-lease-{token}.lock"
        try:
            fd = os.open(self.folder / name, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as e:  # a read-only folder, one we may not write in: said, not a traceback
            raise LeaseError(f"{self.kind.folder_word} {self.guarded}: cannot write in {self.folder} "
                             f"({e.strerror})") from e
        try:
            fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            os.close(fd)
            with contextlib.suppress(OSError):
                os.unlink(self.folder / name)
            if e.errno in NO_LOCKS:
                log.info("%s has no POSIX locks (%s): the lease relies on pid and heartbeat", self.folder, e.strerror)
                return None
            raise
        self._lock_fd = fd
        return name

    def _unlock(self) -> None:
        if self._lock_fd is not None:
            os.close(self._lock_fd)  # drops the lock
            self._lock_fd = None

    def _link(self, tmp: Path) -> bool:
        """The atomic step: our complete record appears under the lease's name, or nothing does."""
        try:
            os.link(tmp, self.path)
        except FileExistsError:
            # NFS: a retransmitted LINK whose first reply was lost answers EEXIST though it worked.
            if os.stat(tmp).st_nlink != 2:
                return False
        except OSError as e:
            raise LeaseError(f"{self.kind.folder_word} {self.guarded}: cannot create {self.path} ({e.strerror})") from e
        return True

    def _own(self, me: Owner) -> None:
        fd = os.open(self.path, os.O_RDONLY)
        seen = self._read()
        if seen is None or seen.owner.token != me.token:  # re-read after write: it must be ours
            os.close(fd)
            raise LeaseError(f"{self.path}: our lease record did not read back as written")
        self._fd, self.owner = fd, me
        self._thread = threading.Thread(target=self._heartbeat, name="x1-lease", daemon=True)
        self._thread.start()
        atexit.register(self.release)
        log.info("lease on %s %s taken (%s)", self.kind.folder_word, self.guarded, me.describe())

    # -- judging the current owner -------------------------------------------------------------

    def _read(self) -> Seen | None:
        """The lease as it is now (None: no lease file). Opened, never just stat()ed: see the module doc."""
        try:
            fd = os.open(self.path, os.O_RDONLY)
        except FileNotFoundError:
            return None
        try:
            st = os.fstat(fd)
            text = os.read(fd, 1 << 16).decode("utf-8", errors="replace")
        finally:
            os.close(fd)
        try:
            owner = Owner.from_json(text)
        except (ValueError, TypeError) as e:
            raise LeaseError(f"{self.path} is not a lease record ({e}); if no {self.kind.owner_word} runs on "
                             f"this {self.kind.folder_word}, remove the file") from None
        return Seen(owner, (st.st_dev, st.st_ino), st.st_mtime)

    def _judge_and_clear(self) -> None:
        """Raises LeaseHeld for a live owner; moves a dead owner's lease aside (then the caller retries)."""
        seen = self._read()
        if seen is None:
            return  # released meanwhile: link again
        verdict = self._verdict(seen)
        if verdict.changed:
            return
        if verdict.alive:
            raise LeaseHeld(self._held_message(seen, verdict), seen.owner)
        aside = self.folder / f".x1-lease-{seen.owner.token}.dead-{secrets.token_hex(4)}"
        try:
            os.rename(self.path, aside)
        except FileNotFoundError:
            return  # another candidate moved it first
        moved = self._read_file(aside)
        if moved is None or moved.owner.token != seen.owner.token:
            # Between our read and our rename the lease changed hands: that one may be alive. Put it back.
            try:
                os.link(aside, self.path)
            except FileExistsError:
                pass  # a third candidate got in; the one we moved will notice and stop
            os.unlink(aside)
            return
        os.unlink(aside)
        if seen.owner.lock_file:
            with contextlib.suppress(OSError):
                os.unlink(self.folder / seen.owner.lock_file)
        log.warning("lease on %s %s taken over from %s %s: %s", self.kind.folder_word, self.guarded,
                    seen.owner.kind, seen.owner.describe(), verdict.why)

    def _read_file(self, path: Path) -> Seen | None:
        saved, self.path = self.path, path
        try:
            return self._read()
        except LeaseError:
            return None
        finally:
            self.path = saved

    def _verdict(self, seen: Seen) -> Verdict:
        return local_verdict(self.folder, seen.owner) or self._watch(seen)

    def _watch(self, seen: Seen) -> Verdict:
        """Another host's owner (or one we cannot see): alive while its heartbeat moves."""
        # The owner's own interval, if slower than ours: a live owner must not look stale to us.
        stale = max(self.stale_seconds, 6 * seen.owner.heartbeat_seconds)
        confirm = 0.4 * stale  # > 2 heartbeats: a live owner moves while we watch
        started = time.monotonic()
        announced = False
        while True:
            now = self._read()
            if now is None or now.owner.token != seen.owner.token:
                return Verdict(False, "its lease changed while we watched", changed=True)
            if now.mtime != seen.mtime:
                return Verdict(True, f"its heartbeat moved while we watched (every {seen.owner.heartbeat_seconds:g} s)")
            age = time.time() - now.mtime
            watched = time.monotonic() - started
            if (age >= stale and watched >= confirm) or watched >= stale:
                return Verdict(False, f"its heartbeat is {age:.0f} s old (over {stale:g} s) and did not move "
                                      f"for {watched:.0f} s")
            if not announced:
                log.warning("%s %s is held by %s %s on another host (its heartbeat is %.0f s old): watching it for "
                            "up to %.0f s; a heartbeat older than %g s that does not move is a dead owner",
                            self.kind.folder_word, self.guarded, seen.owner.kind, seen.owner.describe(), max(age, 0),
                            max(stale - age, confirm), stale)
                announced = True
            time.sleep(min(1.0, seen.owner.heartbeat_seconds / 4))

    def _held_message(self, seen: Seen, verdict: Verdict) -> str:
        owner = seen.owner
        age = max(0.0, time.time() - seen.mtime)
        return (f"{self.kind.folder_word} {self.guarded} is in use by another {owner.kind}: {owner.describe()} "
                f"(heartbeat {age:.0f} s ago; alive: {verdict.why}). Stop that one first, or use another "
                f"{self.kind.folder_word}. Its lease: {self.path}")

    # -- holding it ----------------------------------------------------------------------------

    def _heartbeat(self) -> None:
        while not self._stop.wait(self.heartbeat_seconds):
            problem = self.check()
            if problem is not None:
                if self._stop.is_set():
                    return
                self.on_lost(problem)
                return
            try:
                os.utime(self._fd)  # type: ignore[arg-type]  # futimens(NULL): now, by the server's clock on NFS
            except OSError as e:
                log.warning("lease heartbeat on %s failed (%s); retrying", self.path, e.strerror)

    def check(self) -> str | None:
        """None while the lease file is still ours; else what happened to it."""
        if self._fd is None:
            return "not held"
        mine = os.fstat(self._fd)
        try:
            fd = os.open(self.path, os.O_RDONLY)
        except FileNotFoundError:
            return f"{self.path} was removed"
        except OSError as e:
            return None if e.errno in (errno.EIO, errno.ETIMEDOUT) else f"{self.path}: {e.strerror}"
        try:
            st = os.fstat(fd)
        finally:
            os.close(fd)
        if (st.st_dev, st.st_ino) != (mine.st_dev, mine.st_ino):
            return f"{self.path} now belongs to another {self.kind.owner_word}"
        return None

    def exit_on_lost(self, problem: str) -> None:
        """The default reaction to a lost lease: stop at once, writing nothing more (exit 2)."""
        log.error("lease lost: %s. Another %s owns this %s now; exiting without writing", problem,
                  self.kind.owner_word, self.kind.folder_word)
        logging.shutdown()
        os._exit(int(ExitCode.USAGE))

    def release(self) -> None:
        """Gives the folder up (only if the lease is still ours). Safe to call twice."""
        if self._fd is None:
            return
        self._stop.set()
        mine = os.fstat(self._fd)
        aside = self.folder / f".x1-lease-{self.owner.token if self.owner else 'x'}.released"
        try:
            os.rename(self.path, aside)
            st = os.stat(aside)
            if (st.st_dev, st.st_ino) != (mine.st_dev, mine.st_ino):  # not ours any more: put it back
                with contextlib.suppress(FileExistsError):
                    os.link(aside, self.path)
        except OSError:
            aside = None  # type: ignore[assignment]
        os.close(self._fd)
        self._fd = None
        if aside is not None:
            with contextlib.suppress(OSError):
                os.unlink(aside)
        if self.owner is not None and self.owner.lock_file:
            self._unlock()
            with contextlib.suppress(OSError):
                os.unlink(self.folder / self.owner.lock_file)
        if self._created_folder:
            with contextlib.suppress(OSError):  # not empty: the run wrote something there, keep it
                self.folder.rmdir()
        with contextlib.suppress(ValueError):
            atexit.unregister(self.release)


def local_verdict(folder: Path, owner: Owner) -> Verdict | None:
    """Alive or dead at once, for an owner on this kernel; None when only its heartbeat can tell."""
    if owner.boot_id is None or owner.boot_id != boot_id():
        return None
    held = lock_held(folder / owner.lock_file) if owner.lock_file else None
    if held is True:
        return Verdict(True, "it holds its lock on this host")
    if held is False:
        return Verdict(False, "it is not running on this host (its lock is free)")
    if owner.pid_ns is not None and owner.pid_ns == pid_namespace():
        if proc_start_ticks(owner.pid) == owner.start_ticks:
            return Verdict(True, f"pid {owner.pid} is running on this host")
        return Verdict(False, f"pid {owner.pid} is not running on this host")
    return None


@dataclass(frozen=True)
class Probe:
    """What `probe` sees: the recorded owner (None: no lease) and whether it looks alive."""

    owner: Owner | None
    alive: bool
    why: str
    local: bool  # judged on this kernel (certain) rather than by the heartbeat's age


def file_lease_name(path: str | os.PathLike[str]) -> str:
    """The name of the lease on the file `path`, in the file's folder."""
    return f".{Path(path).name}.x1-lease.json"


def probe(folder: str | os.PathLike[str], stale_seconds: float | None = None, name: str = LEASE_FILE) -> Probe:
    """The owner of `folder` (or of the file whose lease is `name` there) and a judgement made at
    once, without waiting (for `status`, and to refuse early); taking the lease still goes through
    Lease.acquire, which watches a foreign one."""
    folder = Path(folder)
    path = folder / name
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return Probe(None, False, "no lease", True)
    try:
        mtime = os.fstat(fd).st_mtime
        owner = Owner.from_json(os.read(fd, 1 << 16).decode("utf-8", errors="replace"))
    except (ValueError, TypeError):
        return Probe(None, False, f"{path} is not a lease record", True)
    finally:
        os.close(fd)
    verdict = local_verdict(folder, owner)
    if verdict is not None:
        return Probe(owner, verdict.alive, verdict.why, True)
    stale = max(stale_seconds_from_env() if stale_seconds is None else stale_seconds, 6 * owner.heartbeat_seconds)
    age = time.time() - mtime
    if age < stale:
        return Probe(owner, True, f"its heartbeat is {max(age, 0):.0f} s old (on another host)", False)
    return Probe(owner, False, f"its heartbeat is {age:.0f} s old, over {stale:g} s (on another host)", False)


def lock_held(path: Path) -> bool | None:
    """True while some process holds a POSIX lock on `path`; None when that cannot be told (no
    such file, no locks on this filesystem). Never creates the file: a new inode would be free."""
    try:
        fd = os.open(path, os.O_RDWR)
    except OSError:
        return None
    try:
        fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
        if e.errno in (errno.EAGAIN, errno.EACCES):
            return True
        return None
    else:
        return False
    finally:
        os.close(fd)  # also drops the lock we may have just taken


def read_owner(folder: str | os.PathLike[str]) -> Owner | None:
    """The recorded owner of `folder`, if any (for `status`); does not judge it."""
    try:
        return Owner.from_json((Path(folder) / LEASE_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError, TypeError):
        return None


