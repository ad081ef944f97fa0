"""How the supervisor reaches the trainer: a small handle with start, poll, signal and kill.

Process mode and docker mode differ only here; the decisions (relaunch or stop, stalls,
backoff, give-up) live in `supervisor.py` and are the same for both.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from x1_common.contracts import end_reason, redact, should_relaunch
from x1_common.procs import proc_start_ticks
from x1_watchdog.inputs import command_inputs
from x1_watchdog.policy import OUTPUT_TAIL_BYTES

log = logging.getLogger(__name__)

RESUME_FLAG = "--resume-from-latest"


@dataclass(frozen=True)
class TrainerExit:
    """How one trainer process ended."""

    code: int  # as a shell reports it: a process killed by signal N is 128 + N
    signal: int | None = None  # the signal that killed it, if one did
    detail: str = ""  # what else is known (docker: "OOMKilled")

    @property
    def reason(self) -> str:
        """preempted, finished, budget-stop, ... (x1_common.contracts.end_reason), or killed."""
        return "killed" if self.signal is not None else end_reason(self.code)

    @property
    def relaunchable(self) -> bool:
        return self.signal is not None or should_relaunch(self.code)

    @classmethod
    def from_returncode(cls, returncode: int) -> TrainerExit:
        """subprocess reports a death by signal N as -N."""
        if returncode < 0:
            return cls(code=128 - returncode, signal=-returncode)
        return cls(code=returncode)


class StartError(Exception):
    """The trainer could not be started at all (missing command, no container): a person must act."""


class TrainerUnreachable(StartError):
    """The trainer cannot be reached or started now (docker mode: the Engine's socket missing or
    not ours, an engine too old, a container the runtime refuses to start). The supervisor stays
    up, reports itself unhealthy, alerts and retries with backoff: exiting would have compose
    restart the watchdog into the same error while the trainer runs unsupervised."""


class TrainerHandle(Protocol):
    label: str  # what the logs call it: the command, or the container name

    @property
    def pid(self) -> int | None: ...

    @property
    def started_at(self) -> float:
        """Wall-clock time the current trainer process started (heartbeats before it are not its own)."""
        ...

    def start(self, resume: bool) -> None:
        """Starts the trainer; `resume` asks it to continue from its latest checkpoint."""
        ...

    def poll(self) -> TrainerExit | None:
        """None while the trainer runs, then how it ended."""
        ...

    def signal(self, sig: int) -> None:
        """Sends `sig` to the trainer's main process (torchrun forwards it to its workers)."""
        ...

    def kill(self) -> None:
        """SIGKILL to everything the trainer started: workers must not outlive it holding the GPU."""
        ...

    def identity(self) -> dict[str, Any] | None:
        """What the state file keeps to recognise this trainer after a watchdog restart."""
        ...

    def inputs(self) -> dict[str, Any] | None:
        """What a launch of the trainer is given now (x1_watchdog.inputs): its arguments, its own
        variables, its config and data files. None when it cannot be seen (an engine out of reach)."""
        ...

    def output_tail(self) -> str | None:
        """The end of what the current trainer printed (its last OUTPUT_TAIL_BYTES), after it
        exited: its error is there. None when the watchdog cannot see its output."""
        ...

    def end_leftover(self, identity: dict[str, Any], grace_seconds: float) -> None:
        """Called by a restarted watchdog with the previous trainer's identity: a trainer that
        outlived its watchdog must not run beside the next one (two writers of one checkpoint dir)."""
        ...


class ProcessHandle:
    """The trainer as a child process, in a process group of its own.

    The group is the point: torchrun's workers and a trainer's helpers share it, so a kill of the
    group leaves nothing behind, and signals from the watchdog's terminal (Ctrl-C) reach the
    trainer only through the watchdog, which forwards them once.
    """

    def __init__(self, command: Sequence[str], resume_flag: str = RESUME_FLAG, log_path: Path | None = None) -> None:
        if not command:
            raise ValueError("empty trainer command")
        self.command = list(command)
        self.resume_flag = resume_flag
        self.log_path = log_path  # the trainer's stdout and stderr, appended; None: the watchdog's own
        self.label = redact(" ".join(self.command))  # what events and logs show; updated at each start
        self._proc: subprocess.Popen[bytes] | None = None
        self._started_at = 0.0
        self._log_offset = 0  # where the current trainer's output begins in log_path

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc else None

    @property
    def started_at(self) -> float:
        return self._started_at

    def argv(self, resume: bool) -> list[str]:
        argv = list(self.command)
        if resume and self.resume_flag not in argv:
            argv.append(self.resume_flag)
        return argv

    def start(self, resume: bool) -> None:
        argv = self.argv(resume)
        self._started_at = time.time()
        try:
            out = open(self.log_path, "ab") if self.log_path is not None else None  # noqa: SIM115 - the child keeps it
        except OSError as e:
            raise StartError(f"cannot open the trainer's log {self.log_path}: {e.strerror}") from e
        self._log_offset = os.fstat(out.fileno()).st_size if out is not None else 0
        try:
            # start_new_session: own session and process group (pgid == pid), no controlling tty.
            self._proc = subprocess.Popen(argv, start_new_session=True, stdout=out, stderr=out)
        except OSError as e:
            raise StartError(f"cannot start the trainer command {argv[0]!r}: {e}") from e
        finally:
            if out is not None:
                out.close()
        self.label = redact(" ".join(argv))
        log.info("started trainer pid %d: %s", self._proc.pid, self.label)

    def poll(self) -> TrainerExit | None:
        if self._proc is None:
            raise RuntimeError("poll() before start()")
        returncode = self._proc.poll()
        if returncode is None:
            return None
        self._kill_group()  # stragglers: workers of a torchrun that died, dataloader helpers
        return TrainerExit.from_returncode(returncode)

    def signal(self, sig: int) -> None:
        if self._proc is None or self._proc.returncode is not None:
            return
        try:
            self._proc.send_signal(sig)
        except ProcessLookupError:
            pass

    def kill(self) -> None:
        self._kill_group()

    def _kill_group(self) -> None:
        if self._proc is not None:
            kill_group(self._proc.pid)

    def identity(self) -> dict[str, Any] | None:
        if self._proc is None:
            return None
        return {"pid": self._proc.pid, "proc_start_ticks": proc_start_ticks(self._proc.pid)}

    def inputs(self) -> dict[str, Any] | None:
        # The child inherits this process's environment, less what an `env -u` prefix removes.
        return command_inputs(self.argv(resume=True), os.environ)

    def output_tail(self) -> str | None:
        """From --trainer-log, what this trainer appended. Without it the output went to the
        watchdog's own stdout and stderr, which it does not read back."""
        if self.log_path is None:
            return None
        try:
            with open(self.log_path, "rb") as f:
                size = f.seek(0, os.SEEK_END)
                begin = self._log_offset if self._log_offset <= size else 0  # a log truncated meanwhile
                f.seek(max(begin, size - OUTPUT_TAIL_BYTES))
                return f.read().decode("utf-8", errors="replace")
        except OSError as e:
            log.warning("cannot read the trainer's log %s: %s", self.log_path, e.strerror)
            return None

    def end_leftover(self, identity: dict[str, Any], grace_seconds: float) -> None:
        pid = identity.get("pid")
        ticks = identity.get("proc_start_ticks")
        # Same pid and same start time: the very process, not a later one that got its pid.
        if not isinstance(pid, int) or ticks is None or proc_start_ticks(pid) != ticks:
            return
        log.warning("trainer pid %d of a previous watchdog is still running: SIGTERM, up to %g s for its "
                    "emergency checkpoint, then SIGKILL", pid, grace_seconds)
        try:
            os.kill(pid, signal.SIGTERM)
            os.kill(pid, signal.SIGCONT)
        except ProcessLookupError:
            return
        deadline = time.monotonic() + grace_seconds
        while time.monotonic() < deadline and proc_start_ticks(pid) == ticks:
            time.sleep(0.1)
        kill_group(pid)  # it, if still there, and whatever it started


def kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass  # the group is already empty
