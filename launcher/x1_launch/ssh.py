"""SSH to the instance with the system's OpenSSH client (`ssh`), and files both ways as tar streams.

The host key is accepted on first contact and then pinned, in a known_hosts file of the instance's
own (StrictHostKeyChecking=accept-new, UserKnownHostsFile=<that file>): the `.env` with the API
key travels over this link, so checking is never switched off, and a key that changes later is
refused. BatchMode: no password prompt ever blocks a script.
"""

from __future__ import annotations

import contextlib
import shlex
import subprocess
import tarfile
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import IO


class SSHError(RuntimeError):
    """ssh failed; the message names the host and quotes ssh's own words."""


@dataclass(frozen=True)
class Remote:
    host: str
    port: int
    user: str
    key: Path
    known_hosts: Path
    connect_timeout: int = 10

    def argv(self, *extra: str) -> list[str]:
        return [
            "ssh", "-p", str(self.port), "-i", str(self.key),
            "-o", "IdentitiesOnly=yes", "-o", "BatchMode=yes",
            "-o", "StrictHostKeyChecking=accept-new",
            "-o", f"UserKnownHostsFile={self.known_hosts}", "-o", "GlobalKnownHostsFile=/dev/null",
            "-o", f"ConnectTimeout={self.connect_timeout}", "-o", "ServerAliveInterval=15",
            "-o", "LogLevel=ERROR", *extra, f"{self.user}@{self.host}",
        ]

    @property
    def target(self) -> str:
        return f"{self.user}@{self.host}:{self.port}"

    def run(self, command: str, *, input: bytes | None = None, timeout: float | None = 120,
            check: bool = True) -> subprocess.CompletedProcess[bytes]:
        """`command` in the remote login shell; stdout and stderr captured."""
        proc = subprocess.run([*self.argv(), command], input=input, capture_output=True, timeout=timeout,
                              stdin=None if input is not None else subprocess.DEVNULL)
        if check and proc.returncode != 0:
            raise SSHError(f"ssh {self.target}: `{command[:120]}` exited {proc.returncode}: "
                           f"{proc.stderr.decode(errors='replace').strip()[-1500:]}")
        return proc

    def text(self, command: str, timeout: float | None = 120) -> str:
        return self.run(command, timeout=timeout).stdout.decode("utf-8", errors="replace")

    def reachable(self) -> bool:
        try:
            return self.run("true", timeout=self.connect_timeout + 10, check=False).returncode == 0
        except subprocess.TimeoutExpired:
            return False

    def wait(self, timeout: float, every: float = 2.0) -> None:
        deadline = time.monotonic() + timeout
        while not self.reachable():
            left = deadline - time.monotonic()
            if left <= 0:
                raise SSHError(f"ssh {self.target}: no answer after {timeout:g} s")
            time.sleep(min(every, left))

    def put_files(self, root: Path, names: Iterable[str], remote_dir: str, timeout: float = 600) -> int:
        """The files `names` (relative to `root`) into `remote_dir`, as one tar stream; returns bytes sent."""
        command = f"mkdir -p {shlex.quote(remote_dir)} && tar -x -f - -C {shlex.quote(remote_dir)}"
        proc = subprocess.Popen([*self.argv(), command], stdin=subprocess.PIPE, stdout=subprocess.DEVNULL,
                                stderr=subprocess.PIPE)
        assert proc.stdin is not None
        counter = _Counting(proc.stdin)
        try:
            with tarfile.open(fileobj=counter, mode="w|") as tar:  # type: ignore[call-overload]
                for name in names:
                    tar.add(root / name, arcname=name, recursive=False)
            proc.stdin.close()
        except BrokenPipeError:
            pass  # the remote tar ended early: its exit code and message say why
        with contextlib.suppress(OSError, ValueError):
            proc.stdin.close()
        err = proc.stderr.read() if proc.stderr else b""
        proc.wait(timeout=timeout)
        if proc.returncode != 0:
            raise SSHError(f"ssh {self.target}: copying into {remote_dir} failed (exit {proc.returncode}): "
                           f"{err.decode(errors='replace').strip()[-1500:]}")
        return counter.count

    def put_secret(self, data: bytes, remote_path: str) -> None:
        """A file only its owner can read (mode 600), written whole (temp + rename), from stdin:
        the content is on no command line and in no log."""
        q = shlex.quote(remote_path)
        self.run(f"umask 077 && cat > {q}.tmp && chmod 600 {q}.tmp && mv -f {q}.tmp {q}", input=data)

    def get_dir(self, remote_parent: str, name: str, local_parent: Path, timeout: float = 1800) -> None:
        """remote_parent/name -> local_parent/name (tar stream, extracted with the data filter)."""
        command = f"tar -c -f - -C {shlex.quote(remote_parent)} {shlex.quote(name)}"
        proc = subprocess.Popen([*self.argv(), command], stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE)
        assert proc.stdout is not None
        local_parent.mkdir(parents=True, exist_ok=True)
        try:
            with tarfile.open(fileobj=proc.stdout, mode="r|") as tar:  # type: ignore[call-overload]
                for member in tar:
                    if not (member.isfile() or member.isdir()):
                        continue  # links and devices from a remote host are not followed
                    if member.name != name and not member.name.startswith(name + "/"):
                        raise SSHError(f"ssh {self.target}: the copy of {name} holds {member.name!r}")
                    tar.extract(member, local_parent, filter="data")
        except tarfile.TarError as e:
            proc.kill()
            proc.wait()
            raise SSHError(f"ssh {self.target}: the copy of {remote_parent}/{name} is broken: {e}") from None
        err = proc.stderr.read() if proc.stderr else b""
        if proc.wait(timeout=timeout) != 0:
            raise SSHError(f"ssh {self.target}: copying {remote_parent}/{name} failed (exit {proc.returncode}): "
                           f"{err.decode(errors='replace').strip()[-1500:]}")


class _Counting:
    """A write-only stream that counts what passes through."""

    def __init__(self, out: IO[bytes]) -> None:
        self.out = out
        self.count = 0

    def write(self, data: bytes) -> int:
        self.out.write(data)
        self.count += len(data)
        return len(data)

    def flush(self) -> None:
        self.out.flush()
