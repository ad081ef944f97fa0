"""The supervisor: one state machine for process and docker mode (docs/DESIGN.md §3's decision table).

    start ─▶ watch ─▶ exit ─┬─ final code (0, 2, 76-80) ─▶ persist, alert, [terminate], stop
       ▲                    ├─ stop requested (SIGTERM/SIGINT forwarded) ─▶ stop, nothing persisted as final
       │                    ├─ a crash before the first step, with the same error as the launch
       │                    │  before ─▶ startup_failure: persist, alert, stop (exit 81)
       │                    ├─ too many relaunches in the window ─▶ give_up: persist, alert, stop
       └── backoff ◀────────┴─ 75, crash, kill, stall

Each decision is a line in the events file; the final ones also go to the state file, which a
restarted watchdog reads before it launches anything.

A trainer that cannot be reached (docker mode: the Engine's socket or API version) is no
decision: the supervisor reports itself unhealthy (metrics, an alert, an event), keeps the
trainer counted as running, and retries a start with backoff until it succeeds or is stopped.
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from x1_common.contracts import ExitCode, end_reason
from x1_watchdog.handles import TrainerExit, TrainerHandle, TrainerUnreachable
from x1_watchdog.metrics import WatchdogMetrics
from x1_watchdog.policy import LaunchProgress, RestartPolicy, StallDetector, StartupFailure
from x1_watchdog.records import EventLog, StateStore

log = logging.getLogger(__name__)

# Final codes a person must hear about (docs/DESIGN.md §3: "stop, alert"); 0 and 2 only stop.
ALERT_EXIT_CODES = frozenset(
    {ExitCode.BUDGET_PROJECTED, ExitCode.BUDGET_SPENT, ExitCode.LAUNCH_REFUSED, ExitCode.DIVERGED,
     ExitCode.FORECAST_STOP}
)

# How long to wait for a SIGKILLed trainer to be reaped before calling it unkillable.
KILL_WAIT_SECONDS = 30.0


class Alerter(Protocol):
    """x1_common.alerts.AlertSender's shape: send() never raises, returns the channels that delivered."""

    def send(self, kind: str, subject: str, body: str, fields: dict[str, Any] | None = None) -> list[str]: ...


class StopRequest:
    """SIGTERM/SIGINT to the watchdog: remembered here, acted on by the loop (signal handlers
    only set flags). A second signal means "now": the supervisor stops waiting for the trainer's
    emergency checkpoint and kills it."""

    def __init__(self) -> None:
        self._event = threading.Event()
        self.signum: int | None = None
        self.count = 0

    def install(self) -> None:
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._handle)

    def _handle(self, signum: int, _frame: object) -> None:
        self.signum = signum
        self.count += 1
        self._event.set()

    @property
    def requested(self) -> bool:
        return self._event.is_set()

    def wait(self, seconds: float) -> bool:
        """Sleeps up to `seconds`; True as soon as a stop is requested."""
        return self._event.wait(max(0.0, seconds))


class LeaveRunning(Exception):
    """A stop request in a mode that does not forward it (docker): end the watch, not the trainer."""


@dataclass(frozen=True)
class SupervisorSettings:
    term_grace_seconds: float  # SIGTERM → SIGKILL: the trainer's emergency checkpoint must fit
    check_seconds: float  # how often the loop looks at the trainer and the heartbeat
    # A stop of the watchdog stops its trainer (process mode: the trainer is its child). Docker
    # mode leaves the container running: a restarted or upgraded watchdog adopts it, and compose
    # stops the trainer itself when asked to.
    forward_stop: bool = True


@dataclass(frozen=True)
class Outcome:
    exit: TrainerExit
    cause: str | None  # "stall" when the watchdog ended the trainer, else None
    stop_requested: bool  # the watchdog was asked to stop (SIGTERM/SIGINT), and forwarded it

    @property
    def reason(self) -> str:
        return self.cause or self.exit.reason


def exit_fields(ex: TrainerExit) -> dict[str, Any]:
    fields: dict[str, Any] = {"exit_code": ex.code}
    if ex.signal is not None:
        fields["signal"] = ex.signal
    if ex.detail:
        fields["detail"] = ex.detail
    return fields


class Supervisor:
    def __init__(
        self,
        handle: TrainerHandle,
        detector: StallDetector,
        policy: RestartPolicy,
        settings: SupervisorSettings,
        state: StateStore,
        events: EventLog,
        metrics: WatchdogMetrics,
        alerter: Alerter,
        stop: StopRequest,
        on_final: Callable[[int, str], int | None] = lambda code, reason: None,
    ) -> None:
        self.handle = handle
        self.detector = detector
        self.policy = policy
        self.settings = settings
        self.state = state
        self.events = events
        self.metrics = metrics
        self.alerter = alerter
        self.stop = stop
        # After a final decision is persisted: e.g. terminate the instance. A code it returns is the
        # watchdog's exit code instead of the trainer's (82: the terminate was not confirmed).
        self.on_final = on_final
        self.progress = LaunchProgress(detector.heartbeat_file)  # has this launch completed a step?
        self._unreachable_since: float | None = None  # when (monotonic) the trainer became unreachable
        self._unreachable_detail = ""

    # -- the loop ------------------------------------------------------------------------------

    def run(self) -> int:
        """Supervises until a final decision or a stop request; returns the watchdog's exit code."""
        final = self.state.final
        if final is not None:
            log.warning(
                "state file %s holds a final decision (%s, exit code %d at %s): not launching the trainer; "
                "pass --reset-state to start a new run",
                self.state.path, final.get("reason"), final["exit_code"], final.get("time"),
            )
            override = self.on_final(final["exit_code"], str(final.get("reason")))
            return int(final["exit_code"]) if override is None else override

        # A state file with starts but no final decision: a run in progress whose watchdog was
        # restarted (reboot, compose). Its trainer must resume, not start over.
        resume = self.state.starts > 0
        if self.state.trainer is not None:
            self.handle.end_leftover(self.state.trainer, self.settings.term_grace_seconds)
        downtime: float | None = None
        while True:
            if not self._start(resume, downtime):
                log.info("stop requested while the trainer was unreachable; exiting without a decision")
                return 128 + (self.stop.signum or signal.SIGTERM)
            try:
                outcome = self._watch()
            except LeaveRunning:
                log.info("stop requested: leaving %s running for the next watchdog to adopt", self.handle.label)
                self.events.write("leave_running", pid=self.handle.pid, trainer=self.handle.label)
                return 0
            exited_at = time.monotonic()
            self.metrics.set_up(False)
            ex = outcome.exit
            previous = self.state.last_exit or {}
            failure = self._startup_failure(outcome)
            self.state.record_exit(ex.code, outcome.reason,
                                   **({"startup_failure": failure.to_dict()} if failure else {}))
            self.events.write(
                "exit", **exit_fields(ex), reason=outcome.reason, pid=self.handle.pid,
                restart=self.state.restarts_total, runtime_seconds=round(time.time() - self.handle.started_at, 3),
                stop_requested=outcome.stop_requested, progress=self.progress.describe(),
                **({"error": failure.error} if failure else {}),
            )
            if outcome.stop_requested:
                log.info("trainer exited with %d after the forwarded stop; not relaunching", ex.code)
                return ex.code
            if outcome.cause is None and not ex.relaunchable:
                return self._final(ex)
            if failure is not None and failure.same_as(previous.get("startup_failure")):
                return self._startup_failed(failure)

            now = time.time()
            if not self.policy.may_relaunch(self.state.restart_times, now):
                return self._give_up(outcome)
            delay = self.policy.delay_seconds(self.state.restart_times, now)
            log.warning("trainer ended (%s, exit code %d); relaunching in %.1f s", outcome.reason, ex.code, delay)
            if self.stop.wait(delay):
                log.info("stop requested during the backoff; not relaunching")
                return ex.code
            downtime = time.monotonic() - exited_at
            restart = self.state.record_restart(time.time(), self.policy.window_seconds)
            self.metrics.restarted(outcome.reason)
            self.metrics.add_downtime(downtime)
            self.events.write(
                "relaunch", **exit_fields(ex), reason=outcome.reason, restart=restart,
                downtime_seconds=round(downtime, 3), delay_seconds=round(delay, 3),
            )
            resume = True

    def _start(self, resume: bool, downtime: float | None) -> bool:
        """Starts (or adopts) the trainer, retrying an unreachable one with backoff; False when a
        stop was requested before it could be started."""
        delay = max(self.policy.backoff_base_seconds, 0.5)
        while True:
            try:
                self.handle.start(resume)
                break
            except TrainerUnreachable as e:
                self._unreachable(e)
                log.error("cannot start or adopt the trainer: %s; retrying in %.1f s", e, delay)
                if self.stop.wait(delay):
                    return False
                delay = min(delay * 2, max(self.policy.backoff_max_seconds, 1.0))
        self._reachable()
        self.detector.arm(self.handle.started_at)
        self.progress.arm(self.handle.started_at)
        self.state.record_start(self.handle.identity())
        self.metrics.set_up(True)
        self.events.write(
            "start", pid=self.handle.pid, trainer=self.handle.label, resume=resume,
            restart=self.state.restarts_total, downtime_seconds=None if downtime is None else round(downtime, 3),
        )
        return True

    def _poll(self) -> TrainerExit | None:
        """handle.poll(); an unreachable trainer counts as running (the heartbeat still tells a
        stall) and makes the watchdog unhealthy until it answers again."""
        try:
            ex = self.handle.poll()
        except TrainerUnreachable as e:
            self._unreachable(e)
            return None
        self._reachable()
        return ex

    # -- health: can the watchdog see its trainer? ----------------------------------------------

    def _unreachable(self, e: TrainerUnreachable) -> None:
        detail = str(e)
        first = self._unreachable_since is None
        if first:
            self._unreachable_since = time.monotonic()
            self.metrics.set_healthy(False)
        if first or detail != self._unreachable_detail:
            # Once per outage and per new cause, not once per poll.
            log.error("watchdog unhealthy: %s", detail)
            self.events.write("unhealthy", trainer=self.handle.label, detail=detail)
            self.alerter.send(
                "watchdog-unhealthy", f"watchdog cannot supervise {self.handle.label}", detail,
                {"trainer": self.handle.label},
            )
        self._unreachable_detail = detail

    def _reachable(self) -> None:
        if self._unreachable_since is None:
            return
        seconds = round(time.monotonic() - self._unreachable_since, 3)
        log.info("watchdog healthy again: %s answers (unreachable for %.0f s)", self.handle.label, seconds)
        self.events.write("healthy", trainer=self.handle.label, unreachable_seconds=seconds)
        self.alerter.send(
            "watchdog-healthy", f"watchdog supervises {self.handle.label} again",
            f"After {seconds:.0f} s: {self._unreachable_detail}", {"trainer": self.handle.label},
        )
        self.metrics.set_healthy(True)
        self._unreachable_since = None
        self._unreachable_detail = ""

    def _watch(self) -> Outcome:
        while True:
            ex = self._poll()
            if ex is not None:
                return Outcome(ex, cause=None, stop_requested=False)
            self.progress.observe()
            if self.stop.requested:
                if not self.settings.forward_stop:
                    raise LeaveRunning()
                return Outcome(self._forward_stop(), cause=None, stop_requested=True)
            stalled = self.detector.check()
            if stalled:
                log.error("trainer pid %s stalled: %s; terminating it", self.handle.pid, stalled)
                self.events.write(
                    "stall", pid=self.handle.pid, reason="stall", detail=stalled,
                    heartbeat_age_seconds=self.detector.heartbeat_age(), restart=self.state.restarts_total,
                )
                return Outcome(self._terminate(), cause="stall", stop_requested=self.stop.requested)
            self.stop.wait(self.settings.check_seconds)

    # -- ending a trainer ----------------------------------------------------------------------

    def _forward_stop(self) -> TrainerExit:
        sig = self.stop.signum or signal.SIGTERM
        log.info("forwarding %s to the trainer; waiting up to %g s for its emergency checkpoint",
                 signal.Signals(sig).name, self.settings.term_grace_seconds)
        self.handle.signal(sig)
        return self._wait_or_kill(self.settings.term_grace_seconds, impatient=True)

    def _terminate(self) -> TrainerExit:
        """SIGTERM, then SIGCONT (a frozen process acts on its SIGTERM only once continued), grace, SIGKILL."""
        self.handle.signal(signal.SIGTERM)
        self.handle.signal(signal.SIGCONT)
        return self._wait_or_kill(self.settings.term_grace_seconds, impatient=False)

    def _wait_or_kill(self, grace: float, impatient: bool) -> TrainerExit:
        deadline = time.monotonic() + grace
        stops_seen = self.stop.count
        while time.monotonic() < deadline:
            ex = self._poll()
            if ex is not None:
                return ex
            if impatient and self.stop.count > stops_seen:
                log.warning("second stop signal: killing the trainer now")
                break
            time.sleep(min(0.1, self.settings.check_seconds))
        else:
            log.error("trainer pid %s still running %g s after SIGTERM: SIGKILL", self.handle.pid, grace)
        self.handle.kill()
        deadline = time.monotonic() + KILL_WAIT_SECONDS
        while time.monotonic() < deadline:
            ex = self._poll()
            if ex is not None:
                return ex
            time.sleep(0.05)
        raise RuntimeError(f"trainer pid {self.handle.pid} survived SIGKILL for {KILL_WAIT_SECONDS:g} s")

    # -- final decisions -----------------------------------------------------------------------

    def _final(self, ex: TrainerExit) -> int:
        reason = ex.reason
        self.state.record_final(ex.code, reason)
        log.info("trainer exited with %d (%s): final, not relaunching", ex.code, reason)
        if ex.code in ALERT_EXIT_CODES:
            self.alerter.send(
                "watchdog-stop", f"trainer stopped: {reason} (exit {ex.code})",
                f"The trainer exited with code {ex.code} ({reason}). The watchdog will not relaunch it.",
                {"exit_code": ex.code, "reason": reason},
            )
        override = self.on_final(ex.code, reason)
        return ex.code if override is None else override

    def _startup_failure(self, outcome: Outcome) -> StartupFailure | None:
        """The launch as a start-up failure: it crashed (an exit code, not a signal nor 75; not a
        stall; not a requested stop) before completing its first step. Else None: today's rules."""
        ex = outcome.exit
        if outcome.cause is not None or outcome.stop_requested or ex.signal is not None:
            return None
        if ex.code == ExitCode.PREEMPTED or not ex.relaunchable:
            return None
        self.progress.observe()  # its last beat, written just before it exited
        if self.progress.progressed:
            return None
        return StartupFailure.from_output(ex.code, self.handle.output_tail())

    def _startup_failed(self, failure: StartupFailure) -> int:
        """Two launches in a row died before their first step with the same error: a third would
        pay for the same start-up again. Final, persisted, alerted once; exit 81."""
        code = ExitCode.STARTUP_FAILED
        error = failure.error or "(its output was not readable: process mode reads it from --trainer-log)"
        detail = (f"the trainer exited with {failure.exit_code} before completing its first step, on two "
                  f"launches in a row, with the same error: {error}")
        log.error("start-up failure, not relaunching: %s", detail)
        delivered = self.alerter.send(
            "watchdog-startup-failure", f"trainer cannot start: {error[:200]}",
            f"{detail}\nThe watchdog will not relaunch it (exit {int(code)}). Fix the cause, then start a new "
            "run or pass the watchdog --reset-state.",
            {"exit_code": failure.exit_code, "error": error, "watchdog_exit_code": int(code)},
        )
        self.events.write(
            "startup_failure", exit_code=failure.exit_code, error=failure.error, launches=2,
            restart=self.state.restarts_total, alerted=delivered, watchdog_exit_code=int(code),
        )
        reason = end_reason(code)  # startup-failure
        self.state.record_final(int(code), reason, trainer_exit_code=failure.exit_code, error=failure.error)
        override = self.on_final(int(code), reason)
        return int(code) if override is None else override

    def _give_up(self, outcome: Outcome) -> int:
        ex = outcome.exit
        recent = self.policy.recent(self.state.restart_times, time.time())
        detail = (
            f"{recent} relaunches in the last {self.policy.window_seconds:g} s reached --max-restarts "
            f"{self.policy.max_restarts}; last exit: {outcome.reason} (exit code {ex.code})"
        )
        log.error("giving up: %s", detail)
        delivered = self.alerter.send(
            "watchdog-give-up", f"watchdog gave up: {outcome.reason} (exit {ex.code})", detail,
            {"exit_code": ex.code, "reason": outcome.reason, "restarts_in_window": recent},
        )
        self.events.write(
            "give_up", **exit_fields(ex), reason=outcome.reason, restart=self.state.restarts_total,
            restarts_in_window=recent, max_restarts=self.policy.max_restarts,
            window_seconds=self.policy.window_seconds, alerted=delivered, detail=detail,
        )
        self.state.record_final(ex.code, "given-up", last_reason=outcome.reason)
        self.on_final(ex.code, "given-up")
        return ex.code
