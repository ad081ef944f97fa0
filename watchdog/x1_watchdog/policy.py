"""The judgements the supervisor makes: is the trainer stalled, may (and when may) it be
relaunched, and did it fail at start-up (no step completed, the same error as the launch before).
Plain objects over numbers and text, so the rules read in one place."""

from __future__ import annotations

import logging
import math
import os
import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from x1_common.contracts import CLOCK_SKEW_S, STARTUP_PHASES, Heartbeat, redact

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RestartPolicy:
    """Exponential backoff, and a give-up after `max_restarts` relaunches inside a sliding window.

    Every relaunch counts, preemptions too: ten preemptions in an hour means the instance is
    not worth feeding, and a person should look.
    """

    max_restarts: int  # relaunches allowed inside the window before giving up
    window_seconds: float  # the window: relaunches older than this are forgiven
    backoff_base_seconds: float  # delay before the first relaunch in the window; doubles after
    backoff_max_seconds: float  # the cap on that delay

    def recent(self, restart_times: list[float], now: float) -> int:
        """Relaunches inside the window. A time that is not a finite number, or that lies ahead
        of `now` (beyond the clock skew), is no relaunch this watchdog made: it never counts, so
        a damaged state file cannot make the watchdog give up on relaunches that never happened."""
        return sum(
            1 for t in restart_times
            if isinstance(t, (int, float)) and math.isfinite(t) and -CLOCK_SKEW_S <= now - t < self.window_seconds
        )

    def may_relaunch(self, restart_times: list[float], now: float) -> bool:
        return self.recent(restart_times, now) < self.max_restarts

    def delay_seconds(self, restart_times: list[float], now: float) -> float:
        # 2 s, 4 s, 8 s, ... for the 1st, 2nd, 3rd relaunch in the window (base 2), capped.
        exponent = min(self.recent(restart_times, now), 30)  # 2**30 already exceeds any cap
        return min(self.backoff_base_seconds * 2**exponent, self.backoff_max_seconds)


class OwnBeats:
    """Which heartbeats are the current trainer's, told without trusting the wall clock.

    The previous process's last beat must not vouch for a new one that hangs in its imports. A
    beat is the current trainer's when it is not the beat that was on disk at the start (`arm`),
    or when it is dated at or after the trainer's wall-clock start (a trainer adopted in docker
    mode beat before the watchdog came). A wall clock stepped back makes the new trainer's beats
    older than its start: they still count, being new."""

    def __init__(self, heartbeat_file: str | os.PathLike[str]) -> None:
        self.heartbeat_file = Path(heartbeat_file)
        self._started_at = 0.0
        self._before: Heartbeat | None = None  # the beat on disk at the start

    def arm(self, started_at: float) -> None:
        """Called at each trainer start, with the wall-clock start time."""
        self._started_at = started_at
        self._before = Heartbeat.read(self.heartbeat_file)

    def read(self) -> Heartbeat | None:
        beat = Heartbeat.read(self.heartbeat_file)
        if beat is None or (beat == self._before and beat.time < self._started_at):
            return None
        return beat


class StallDetector:
    """A trainer is stalled when, after its startup grace, its heartbeat has not changed for
    `stall_seconds` — or it has never written one.

    Every duration here is measured on `clock`, the monotonic clock: the grace from the moment the
    trainer was started (`arm`), a beat's age from the moment this watchdog first saw that beat.
    A beat's own `time` is the trainer's word and its wall clock's, and a wall clock stepped back
    or forward (NTP, a suspended VM) must neither switch stall detection off nor stall a healthy
    trainer; a beat dated in the future (a wrong clock, a damaged file) ages like any other. The
    trainer beats at every log step and checkpoint, and the watchdog reads the file every
    --check-seconds, so "first seen" is within a check of "written". (A time that is not a finite
    number makes the beat unreadable: no heartbeat at all.)

    The grace covers start-up only (imports, data checks, a long `torch.compile`: phases "startup"
    and "compiling"); once the trainer has beaten from its loop, a beat older than the limit is a
    stall at once. Only the current trainer's beats count (OwnBeats).
    """

    def __init__(self, heartbeat_file: str | os.PathLike[str], stall_seconds: float, startup_grace_seconds: float,
                 clock: Callable[[], float] = time.monotonic, wall: Callable[[], float] = time.time):
        self.heartbeat_file = Path(heartbeat_file)
        self.stall_seconds = stall_seconds  # 0 disables stall detection
        self.startup_grace_seconds = startup_grace_seconds
        self.clock = clock
        self.wall = wall  # only to say that a beat is dated in the future
        self.own = OwnBeats(heartbeat_file)
        self._armed_at = clock()
        self._beat: Heartbeat | None = None  # the last beat seen, and when (on `clock`) it was first seen
        self._seen_at = 0.0

    def arm(self, started_at: float) -> None:
        """Called at each trainer start, with the wall-clock start time (OwnBeats)."""
        self.own.arm(started_at)
        self._armed_at = self.clock()
        self._beat = None

    def own_heartbeat(self) -> Heartbeat | None:
        return self.own.read()

    def _age(self, beat: Heartbeat, now: float) -> float:
        if beat != self._beat:
            self._beat, self._seen_at = beat, now
            if beat.time > self.wall() + CLOCK_SKEW_S:
                log.warning("heartbeat %s is dated %.0f s in the future (step %d, phase %s): aged from now, as any beat",
                            self.heartbeat_file, beat.time - self.wall(), beat.step, beat.phase)
        return now - self._seen_at

    def check(self) -> str | None:
        """None while healthy, else a sentence saying why the trainer counts as stalled."""
        if self.stall_seconds <= 0:
            return None
        now = self.clock()
        beat = self.own_heartbeat()
        starting = beat is None or beat.phase in STARTUP_PHASES
        if starting and now - self._armed_at <= self.startup_grace_seconds:
            if beat is not None:
                self._age(beat, now)  # seen now: a beat first seen later would look younger than it is
            return None
        if beat is None:
            return f"no heartbeat in {self.heartbeat_file} within the {self.startup_grace_seconds:g} s startup grace"
        age = self._age(beat, now)
        if age > self.stall_seconds:
            future = " (dated in the future by its writer's clock)" if beat.time > self.wall() + CLOCK_SKEW_S else ""
            return (
                f"heartbeat unchanged for {age:.0f} s{future} (step {beat.step}, phase {beat.phase}), "
                f"over the {self.stall_seconds:g} s stall limit"
            )
        return None

    def heartbeat_age(self) -> float | None:
        """Seconds (monotonic) since the current beat was first seen; None without one."""
        beat = self.own_heartbeat()
        return None if beat is None else round(self._age(beat, self.clock()), 3)


class LaunchProgress:
    """Has the current launch completed a step? Its heartbeat says.

    A trainer's first beats are in a start-up phase ("startup", "compiling") and name the step it
    starts from (0, or the checkpoint it resumed); a later beat at a higher step is progress. A
    launch that died before beating at all made none. The trainer beats at its log steps and
    checkpoints, so "its first step" is the first step it reports. The watchdog reads the file once
    a check (and once more after the exit); a launch whose start-up beat it never saw, only later
    ones, may have started lower than it can tell: that counts as progress, so in doubt today's
    rules apply. Which beats are this launch's: OwnBeats (no wall-clock comparison alone).
    """

    def __init__(self, heartbeat_file: str | os.PathLike[str]) -> None:
        self.heartbeat_file = Path(heartbeat_file)
        self.own = OwnBeats(heartbeat_file)
        self._start_step: int | None = None  # the lowest step this launch beat in a start-up phase
        self._high: int | None = None  # the highest step this launch beat

    def arm(self, started_at: float) -> None:
        """Called at each trainer start, with the wall-clock start time."""
        self.own.arm(started_at)
        self._start_step = self._high = None
        self.observe()  # an adopted trainer (docker mode) may have beaten already

    def observe(self) -> None:
        beat = self.own.read()
        if beat is None:  # none yet, or the previous trainer's
            return
        if beat.phase in STARTUP_PHASES:
            self._start_step = beat.step if self._start_step is None else min(self._start_step, beat.step)
        self._high = beat.step if self._high is None else max(self._high, beat.step)

    @property
    def progressed(self) -> bool:
        if self._high is None:
            return False  # died before its first beat
        return self._start_step is None or self._high > self._start_step

    def describe(self) -> str:
        if self._high is None:
            return "no heartbeat"
        if self._start_step is None:
            return f"at step {self._high} (its start-up beat not seen)"
        return f"from step {self._start_step} to step {self._high}" if self.progressed else f"still at step {self._start_step}"


# What differs between two runs of the same failure: times, addresses, process ids.
_VOLATILE = (
    (re.compile(r"\d{4}-\d{2}-\d{2}[T ]\d{2}:\d{2}:\d{2}(?:[.,]\d+)?(?:Z|[+-]\d{2}:?\d{2})?"), "<time>"),
    (re.compile(r"\b0x[0-9a-fA-F]+\b"), "<addr>"),
    (re.compile(r"\b(pid|PID)([:= ]\s*)\d+"), r"\1\2<pid>"),
)
_ERROR_WORD = re.compile(r"(?i:\b(?:error|critical|fatal)\b)|\w(?:Error|Exception)\b")
OUTPUT_TAIL_BYTES = 64 << 10  # how much of a trainer's output is read back for its error


def error_line(output: str) -> str:
    """The line that names why a trainer died: the exception line of its last Python traceback,
    else its last line that says error, else its last line ("" for no output). Lines written after
    the traceback (a logger's shutdown, a tracking client's goodbye) must not hide it."""
    lines = [line.rstrip() for line in output.splitlines() if line.strip()]
    for i in range(len(lines) - 1, -1, -1):
        if lines[i].startswith("Traceback (most recent call last)"):
            for line in lines[i + 1:]:
                if not line[:1].isspace():
                    return line.strip()
    for line in reversed(lines):
        if _ERROR_WORD.search(line):
            return line.strip()
    return lines[-1].strip() if lines else ""


def error_key(line: str) -> str:
    """`line` with what changes between two runs of one failure (times, addresses, pids) masked."""
    for pattern, mask in _VOLATILE:
        line = pattern.sub(mask, line)
    return " ".join(line.split())


@dataclass(frozen=True)
class StartupFailure:
    """A launch that crashed (an exit code other than 75, not a signal) before its first step."""

    exit_code: int
    error: str  # the error's last line as the trainer printed it (secrets masked); "" when unseen
    key: str  # what "the same error" compares: the exit code and the masked line

    @classmethod
    def from_output(cls, exit_code: int, output: str | None) -> StartupFailure:
        line = redact(error_line(output or ""))[:1000]
        return cls(exit_code=exit_code, error=line, key=f"{exit_code} {error_key(line)}")

    def same_as(self, previous: object) -> bool:
        return isinstance(previous, dict) and previous.get("key") == self.key

    def to_dict(self) -> dict[str, object]:
        return {"exit_code": self.exit_code, "error": self.error, "key": self.key}
