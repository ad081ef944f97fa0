"""Provider mode: keep the instance alive through whole-instance preemptions.

A spot preemption kills everything on the host, the watchdog beside the trainer included, so
this runs elsewhere (your machine, a small always-on VM) and watches the instance through the
provider's API:

    running ─▶ preempted / stopped ─▶ backoff ─▶ bring back ─▶ booting ─▶ running ─▶ ...
                                                                         terminated ─▶ done (exit 0)

Bringing back, per provider:
  - RunPod: podResume of the same pod. Its network volume (or container disk) still holds
    /workspace; the pod's start command runs the stack, and the trainer resumes.
  - Lambda: a preempted instance does not come back. A new instance of the same type and region
    is launched with the same persistent file system and the same cloud-init user-data (whose
    job is `docker compose up` on that file system); the keeper then follows the new id, which it
    records in the state file so that a restarted keeper follows it too.
Where the provider cannot (no capacity, a pod whose machine has no free GPU), the keeper says
so in the log, the events and an alert, and tries again after the backoff until --max-restarts.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any, Protocol

from x1_common.contracts import ExitCode
from x1_common.providers import Instance, ProviderError
from x1_watchdog.metrics import WatchdogMetrics
from x1_watchdog.policy import RestartPolicy
from x1_watchdog.records import EventLog, StateStore
from x1_watchdog.supervisor import Alerter, StopRequest

log = logging.getLogger(__name__)

GAVE_UP = 1  # provider mode's exit code after a give-up (documented in --help)
# In the user-data, replaced by the name the keeper gives the instance it launches: the instance
# finds its own id by that name (the repository's cloud-init.yaml does).
INSTANCE_NAME_PLACEHOLDER = "__X1_INSTANCE_NAME__"
DOWN_STATUSES = ("preempted", "stopped")
# After a bring-back, a "down" status this soon is the provider not having caught up yet.
SETTLE_SECONDS = 60.0
# Consecutive failed polls before a person hears about it (a 20 s poll: a minute of silence).
ALERT_AFTER_FAILED_POLLS = 3


class InstanceAPI(Protocol):
    """What the keeper uses of x1_common.providers' clients (launch is Lambda's, resume RunPod's)."""

    def get_instance(self, instance_id: str) -> Instance: ...


@dataclass(frozen=True)
class LaunchSpec:
    """How to bring an instance back. Lambda fields left None come from the lost instance's record."""

    instance_type: str | None = None
    region: str | None = None
    user_data: str | None = None  # cloud-init; Lambda does not report an instance's user-data
    ssh_key_names: tuple[str, ...] = ()
    file_system_names: tuple[str, ...] = ()
    gpu_count: int = 1  # RunPod podResume


def user_data_for(user_data: str | None, name: str) -> str | None:
    """The user-data as sent with the launch of the instance called `name`."""
    return None if user_data is None else user_data.replace(INSTANCE_NAME_PLACEHOLDER, name)


class CannotRecover(Exception):
    """The provider refused to bring the instance back; the message says why and what to do."""


class InstanceKeeper:
    def __init__(
        self,
        client: Any,
        provider: str,
        instance_id: str,
        launch: LaunchSpec,
        policy: RestartPolicy,
        poll_seconds: float,
        state: StateStore,
        events: EventLog,
        metrics: WatchdogMetrics,
        alerter: Alerter,
        stop: StopRequest,
        recover_timeout_seconds: float = 900.0,
    ) -> None:
        self.client = client
        self.provider = provider
        self.origin_id = instance_id
        self.launch = launch
        self.policy = policy
        self.poll_seconds = poll_seconds
        self.state = state
        self.events = events
        self.metrics = metrics
        self.alerter = alerter
        self.stop = stop
        # A brought-back instance not running after this long is worth an alert (never a second launch).
        self.recover_timeout_seconds = recover_timeout_seconds
        self.instance_id = state.instance_id or instance_id
        self.up = False
        self.seen = False  # the current instance has answered at least once
        self.down_since: float | None = None  # monotonic time the instance was seen lost
        self.recovering_since: float | None = None  # monotonic time of the last bring-back call
        self.overdue_alerted = False
        self.failed_polls = 0

    # -- the loop ------------------------------------------------------------------------------

    def run(self) -> int:
        final = self.state.final
        if final is not None:
            log.warning("state file %s holds a final decision (%s at %s): not watching; --reset-state starts afresh",
                        self.state.path, final.get("reason"), final.get("time"))
            return int(final["exit_code"])
        origin = self.state.origin_instance_id
        if origin is not None and origin != self.origin_id:
            log.error("state file %s belongs to the run that began on instance %s, not %s: "
                      "pass --reset-state to watch a new run", self.state.path, origin, self.origin_id)
            return ExitCode.USAGE
        if self.instance_id != self.origin_id:
            log.info("following instance %s (brought back in place of %s, from the state file)",
                     self.instance_id, self.origin_id)
        self.state.record_instance(self.instance_id, self.origin_id)
        if self.provider == "lambda" and not self.launch.user_data:
            log.warning("no --user-data-file: an instance launched after a preemption will boot without "
                        "starting the job (its cloud-init must run `docker compose up`)")
        log.info("watching %s instance %s every %g s", self.provider, self.instance_id, self.poll_seconds)
        while True:
            code = self.poll_once()
            if code is not None:
                return code
            if self.stop.wait(self.poll_seconds):
                log.info("stop requested; instance %s is left as it is", self.instance_id)
                return ExitCode.FINISHED

    def poll_once(self) -> int | None:
        """One look at the instance and what follows from it; an exit code once done."""
        try:
            inst = self.client.get_instance(self.instance_id)
        except ProviderError as e:
            return self._poll_failed(e)
        if self.failed_polls >= ALERT_AFTER_FAILED_POLLS:
            log.info("provider API answers again after %d failed polls", self.failed_polls)
        self.failed_polls = 0
        self.seen = True

        if inst.status == "terminated":
            return self._terminated(inst.raw_status)
        if inst.status == "running":
            self._running()
            return None
        if inst.status in DOWN_STATUSES:
            if self._settling():
                return None  # brought back a moment ago; the provider's status has not caught up
            return self._lost(inst)
        # booting, unhealthy, unknown: wait. Never a second launch while one may still come up:
        # two instances bill twice.
        if inst.status != "booting":
            log.warning("instance %s is %s (%s); waiting", self.instance_id, inst.status, inst.raw_status)
        self._check_overdue(inst)
        return None

    # -- transitions ---------------------------------------------------------------------------

    def _running(self) -> None:
        if self.up:
            return
        self.up = True
        self.recovering_since = None
        self.metrics.set_up(True)
        downtime = None
        if self.down_since is not None:
            downtime = time.monotonic() - self.down_since
            self.metrics.add_downtime(downtime)
            self.down_since = None
        self.state.record_start()
        self.events.write("start", instance_id=self.instance_id, provider=self.provider,
                          restart=self.state.restarts_total,
                          downtime_seconds=None if downtime is None else round(downtime, 3))
        log.info("instance %s is running%s", self.instance_id,
                 "" if downtime is None else f" again after {downtime:.0f} s down")

    def _lost(self, inst: Instance) -> int | None:
        reason = f"instance-{inst.status}"
        if self.up or self.recovering_since is not None or self.down_since is None:
            self.events.write("exit", instance_id=self.instance_id, provider=self.provider, reason=reason,
                              raw_status=inst.raw_status, exit_code=None, restart=self.state.restarts_total)
        self.up = False
        self.recovering_since = None
        self.metrics.set_up(False)
        if self.down_since is None:
            self.down_since = time.monotonic()
        self.state.record_exit(-1, reason)

        now = time.time()
        if not self.policy.may_relaunch(self.state.restart_times, now):
            return self._give_up(reason)
        delay = self.policy.delay_seconds(self.state.restart_times, now)
        log.warning("instance %s is %s (%s); bringing it back in %g s", self.instance_id, inst.status,
                    inst.raw_status, delay)
        if self.stop.wait(delay):
            return None  # the loop sees the stop at its next wait
        restart = self.state.record_restart(time.time(), self.policy.window_seconds)
        self.metrics.restarted(reason)
        previous = self.instance_id
        try:
            new_id, response = self._bring_back(inst)
        except (CannotRecover, ProviderError) as e:
            log.error("cannot bring instance %s back: %s", previous, e)
            self.events.write("relaunch", ok=False, instance_id=previous, provider=self.provider, reason=reason,
                              restart=restart, delay_seconds=round(delay, 3), error=str(e))
            self.alerter.send("watchdog-recover-failed", f"cannot bring instance {previous} back",
                              f"The {self.provider} instance {previous} is {inst.raw_status} and could not be "
                              f"brought back: {e}. The watchdog retries after its backoff.",
                              {"instance_id": previous, "provider": self.provider})
            return None  # still down: the next poll tries again (and counts toward the give-up)
        if new_id != previous:
            self.instance_id = new_id
            self.state.record_instance(new_id, self.origin_id)
            self.seen = False
        self.recovering_since = time.monotonic()
        self.overdue_alerted = False
        self.events.write("relaunch", ok=True, instance_id=new_id, previous_instance_id=previous,
                          provider=self.provider, reason=reason, restart=restart, delay_seconds=round(delay, 3),
                          downtime_seconds=round(time.monotonic() - self.down_since, 3), response=response)
        log.info("brought back: %s instance %s (was %s)", self.provider, new_id, previous)
        return None

    def _bring_back(self, inst: Instance) -> tuple[str, Any]:
        if self.provider == "runpod":
            return inst.id, self.client.resume(inst.id, gpu_count=self.launch.gpu_count)
        if self.provider == "lambda":
            return self._lambda_relaunch(inst)
        raise CannotRecover(f"provider {self.provider!r} has no way to bring an instance back")

    def _lambda_relaunch(self, inst: Instance) -> tuple[str, Any]:
        raw = inst.raw
        instance_type = self.launch.instance_type or inst.instance_type
        region = self.launch.region or inst.region
        if not instance_type or not region:
            raise CannotRecover("the lost instance's record names no type or region: pass --instance-type and --region")
        file_systems = self.launch.file_system_names or tuple(raw.get("file_system_names") or ())
        if not file_systems:
            log.warning("no persistent file system (--file-system-name): the new instance starts without "
                        "the checkpoints, i.e. from step 0")
        ssh_keys = self.launch.ssh_key_names or tuple(raw.get("ssh_key_names") or ())
        # A name per attempt: if the launch answer is lost (timeout), the instance can still be found.
        name = f"x1-{self.origin_id[:12]}-r{self.state.restarts_total}"
        try:
            new_id = self.client.launch(instance_type, region, name=name, ssh_key_names=ssh_keys,
                                        file_system_names=file_systems, user_data=user_data_for(self.launch.user_data, name))
        except ProviderError as e:
            if not e.unclear:  # the API's own refusal: nothing was launched
                raise
            found = self._find_launched(name)
            if found is None:
                raise
            log.warning("launch answered %s, but instance %s named %s exists: following it", e, found, name)
            new_id = found
        return new_id, {"launched_instance_id": new_id, "name": name, "instance_type": instance_type,
                        "region": region, "file_system_names": list(file_systems)}

    def _find_launched(self, name: str) -> str | None:
        try:
            for candidate in self.client.list_instances():
                if candidate.raw.get("name") == name:
                    return candidate.id
        except ProviderError as e:
            log.warning("could not list instances to look for %s: %s", name, e)
        return None

    def _settling(self) -> bool:
        return self.recovering_since is not None and time.monotonic() - self.recovering_since < SETTLE_SECONDS

    def _check_overdue(self, inst: Instance) -> None:
        if (self.recovering_since is None or self.overdue_alerted
                or time.monotonic() - self.recovering_since < self.recover_timeout_seconds):
            return
        self.overdue_alerted = True
        detail = (f"instance {self.instance_id} is still {inst.raw_status} {self.recover_timeout_seconds:g} s after "
                  "being brought back; it may be billing without running the job")
        log.error("%s", detail)
        self.alerter.send("watchdog-recover-overdue", f"instance {self.instance_id} not running", detail,
                          {"instance_id": self.instance_id, "provider": self.provider})

    def _terminated(self, raw_status: str) -> int:
        log.info("instance %s is %s: the run is over (terminated by its watchdog or by you)",
                 self.instance_id, raw_status)
        self.metrics.set_up(False)
        self.events.write("exit", instance_id=self.instance_id, provider=self.provider,
                          reason="instance-terminated", raw_status=raw_status, exit_code=ExitCode.FINISHED,
                          restart=self.state.restarts_total)
        self.state.record_final(ExitCode.FINISHED, "instance-terminated", instance_id=self.instance_id)
        return ExitCode.FINISHED

    def _give_up(self, reason: str) -> int:
        recent = self.policy.recent(self.state.restart_times, time.time())
        detail = (f"{recent} bring-backs in the last {self.policy.window_seconds:g} s reached --max-restarts "
                  f"{self.policy.max_restarts}; instance {self.instance_id} is left {reason}")
        log.error("giving up: %s", detail)
        delivered = self.alerter.send("watchdog-give-up", f"watchdog gave up on instance {self.instance_id}",
                                   detail, {"instance_id": self.instance_id, "reason": reason})
        self.events.write("give_up", instance_id=self.instance_id, provider=self.provider, reason=reason,
                          exit_code=GAVE_UP, restart=self.state.restarts_total, restarts_in_window=recent,
                          max_restarts=self.policy.max_restarts, alerted=delivered, detail=detail)
        self.state.record_final(GAVE_UP, "given-up", last_reason=reason, instance_id=self.instance_id)
        return GAVE_UP

    def _poll_failed(self, e: ProviderError) -> int | None:
        self.failed_polls += 1
        if e.kind == "not-found" and self.seen:
            # Providers forget terminated instances after a while: gone is as good as terminated.
            return self._terminated("gone")
        if e.kind == "not-found" and self.recovering_since is not None:
            log.warning("instance %s launched a moment ago is not listed yet: %s", self.instance_id, e)
            return None
        if e.kind in ("auth", "not-found"):
            what = "the API key was refused" if e.kind == "auth" else f"no instance {self.instance_id}"
            log.error("%s: %s", what, e)
            self.alerter.send("watchdog-provider-error", f"watchdog stopped: {what}", str(e),
                              {"instance_id": self.instance_id, "provider": self.provider})
            return ExitCode.USAGE
        log.warning("poll %d failed: %s", self.failed_polls, e)
        if self.failed_polls == ALERT_AFTER_FAILED_POLLS:
            self.alerter.send("watchdog-provider-error", "watchdog cannot read the instance status",
                              f"{self.failed_polls} polls in a row failed; last: {e}. Preemptions go unseen meanwhile.",
                              {"instance_id": self.instance_id, "provider": self.provider})
        return None
