"""The two judgements the supervisor makes on a clock: is the trainer stalled, and may (and when
may) it be relaunched. Plain objects over numbers, so the rules read in one place."""

from __future__ import annotations

import logging
import math
import os
from dataclasses import dataclass
from pathlib import Path

from x1_common.contracts import CLOCK_SKEW_S, Heartbeat

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


class StallDetector:
    """A trainer is stalled when, after its startup grace, its newest heartbeat is older than
    `stall_seconds` — or it has never written one.

    A heartbeat counts only if it was written after the current trainer started: the previous
    process's last heartbeat must not vouch for a new one that hangs in its imports. The grace
    covers start-up only (imports, data checks, a long `torch.compile`: phases "startup" and
    "compiling"); once the trainer has beaten from its loop, a stale heartbeat is a stall at once.

    A heartbeat's `time` is the trainer's word, and a beat dated in the future (a wrong clock, a
    damaged file) would otherwise never age: such a beat is aged from the moment this watchdog
    first saw it, so a trainer that froze after writing it is still found stalled. (A time that
    is not a finite number makes the beat unreadable: no heartbeat at all.)
    """

    def __init__(self, heartbeat_file: str | os.PathLike[str], stall_seconds: float, startup_grace_seconds: float):
        self.heartbeat_file = Path(heartbeat_file)
        self.stall_seconds = stall_seconds  # 0 disables stall detection
        self.startup_grace_seconds = startup_grace_seconds
        self._started_at = 0.0
        self._future_beat: Heartbeat | None = None  # the last future-dated beat seen, and when
        self._future_seen_at = 0.0

    def arm(self, started_at: float) -> None:
        """Called at each trainer start, with the wall-clock start time."""
        self._started_at = started_at
        self._future_beat = None

    def own_heartbeat(self) -> Heartbeat | None:
        beat = Heartbeat.read(self.heartbeat_file)
        return beat if beat is not None and beat.time >= self._started_at else None

    def beat_time(self, beat: Heartbeat, now: float) -> float:
        """When `beat` counts as written: its own time, or for a beat dated past `now` (beyond the
        clock skew) when first seen, the time this watchdog first saw that very beat."""
        if beat == self._future_beat:  # seen in the future once: aged from then, even after the clock catches up
            return self._future_seen_at
        if beat.time <= now + CLOCK_SKEW_S:
            return beat.time
        if beat != self._future_beat:
            self._future_beat, self._future_seen_at = beat, now
            log.warning("heartbeat %s is dated %.0f s in the future (step %d, phase %s): aging it from now",
                        self.heartbeat_file, beat.time - now, beat.step, beat.phase)
        return self._future_seen_at

    def check(self, now: float) -> str | None:
        """None while healthy, else a sentence saying why the trainer counts as stalled."""
        if self.stall_seconds <= 0:
            return None
        beat = self.own_heartbeat()
        starting = beat is None or beat.phase in ("startup", "compiling")
        if starting and now - self._started_at <= self.startup_grace_seconds:
            return None
        if beat is None:
            return f"no heartbeat in {self.heartbeat_file} within the {self.startup_grace_seconds:g} s startup grace"
        age = now - self.beat_time(beat, now)
        if age > self.stall_seconds:
            future = " (dated in the future: aged from when it was first seen)" if beat == self._future_beat else ""
            return (
                f"last heartbeat {age:.0f} s ago{future} (step {beat.step}, phase {beat.phase}), "
                f"over the {self.stall_seconds:g} s stall limit"
            )
        return None

    def heartbeat_age(self, now: float) -> float | None:
        beat = self.own_heartbeat()
        return None if beat is None else round(now - self.beat_time(beat, now), 3)
