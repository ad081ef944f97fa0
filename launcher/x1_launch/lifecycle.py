"""An instance's life on the laptop's record: created only after it is on record, found by its name
when the provider's answer is lost, and ended only when the provider shows it ended.

    rec = pending_record(...); state.save(rec)         # phase "creating": on disk before the create call
    create(client, state, rec, request)                # the id from the answer, or looked up by name
    look(client, state, rec)                           # the provider's state now, into the record
    end(client, state, rec, within_s=120)              # terminate, read back, again: "terminated" or still billing

The record's phases are described in x1_launch.state. Nothing here ever concludes "nothing was
rented" from a lost answer: only the provider's own refusal of the create, or its listing of the
account without the name for a while, does.
"""

from __future__ import annotations

import contextlib
import signal
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from typing import Any

from x1_common.providers import Instance, LambdaClient, ProviderError, RunPodClient
from x1_common.termination import Ending, Observation, end_instance, observe
from x1_launch import cloud
from x1_launch.state import InstanceRecord, StateDir

Client = LambdaClient | RunPodClient
DISPLAY = {"lambda": "Lambda", "runpod": "RunPod"}
# The signals a create waits out: Ctrl-C, a `kill`, a closed terminal. Each takes effect once the
# provider's answer (or what the provider lists under the name) is on disk.
HELD_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


class Interrupted(Exception):
    """A SIGTERM or SIGHUP, raised where the launch can say what it leaves (like KeyboardInterrupt)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def raise_interrupted(signum: int, frame: Any) -> None:
    raise Interrupted(signum)


@contextlib.contextmanager
def signals_held() -> Iterator[list[int]]:
    """Within the block, SIGINT, SIGTERM and SIGHUP are only noted (the list the block gets); the
    handlers before it come back at its end. The caller acts on what was noted."""
    caught: list[int] = []
    previous = {s: signal.signal(s, lambda signum, frame: caught.append(signum)) for s in HELD_SIGNALS}
    try:
        yield caught
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


@dataclass(frozen=True)
class Found:
    """What the provider lists under a record's name: `outcome` is "found" (the record has its id
    now), "absent" (listings answered without it for the settle time) or "unknown" (no listing
    answered); `detail` says what was seen."""

    outcome: str
    detail: str


def find_by_name(client: Client, state: StateDir, rec: InstanceRecord, *, settle_s: float, every_s: float = 2.0,
                 give_up: Callable[[], bool] = lambda: False, say: Callable[[str], None] = lambda line: None,
                 sleep: Callable[[float], None] = time.sleep) -> Found:
    """Asks the provider for the instances named like `rec` until one is listed ("found": the id
    is recorded, and a second one under the same name gets its own record), or the listings have
    shown none for `settle_s` ("absent"), or no listing has answered by then ("unknown").
    `give_up` ends the asking early (a signal is waiting) once one listing was tried."""
    start = time.monotonic()
    last_error = ""
    answered = 0
    while True:
        try:
            listed = cloud.named(client, rec.name)
            answered += 1
        except ProviderError as e:
            if e.kind == "auth":
                raise
            listed, last_error = None, str(e)
        if listed:
            first, *more = listed
            adopt(state, rec, first, how=f"listed under its name {rec.name}")
            for extra in more:  # never an instance nobody knows about, however it came to be
                twin = replace(rec, instance_id="", notes=[*rec.notes, f"a second instance named {rec.name}"])
                adopt(state, twin, extra, how=f"listed under the name {rec.name} (a second one)")
                say(f"  a second instance is listed under {rec.name}: {extra.id}; recorded too")
            return Found("found", f"{DISPLAY[client.provider]} lists {first.id} under {rec.name} ({first.raw_status})")
        waited = time.monotonic() - start
        if waited >= settle_s or give_up():
            if answered:
                return Found("absent", f"{DISPLAY[client.provider]} listed no instance named {rec.name} "
                                       f"({answered} listing(s) over {waited:.0f} s)")
            return Found("unknown", f"{DISPLAY[client.provider]} could not be asked for {rec.name}: {last_error}")
        sleep(min(every_s, max(0.0, settle_s - waited)))


def adopt(state: StateDir, rec: InstanceRecord, inst: Instance, how: str) -> None:
    """`inst` is the record's instance: its id and state on disk."""
    rec.instance_id = inst.id
    rec.set_phase("created" if inst.status != "terminated" else "terminated")
    if rec.stage == "creating":
        rec.stage = "launched"
    rec.observe(inst.status, inst.raw_status, how)
    state.save(rec)


def look(client: Client, state: StateDir, rec: InstanceRecord) -> Observation:
    """The instance as the provider shows it now, written into the record: a recorded end the
    provider contradicts (it lists the instance billing) is reopened, never trusted."""
    obs = observe(client, rec.provider, rec.instance_id)
    after = obs.record
    if obs.ended:
        rec.set_phase("terminated")
        rec.observe(after["status"], after.get("raw_status"), "read back from the provider")
    elif obs.state == "billing":
        if not rec.open or rec.phase == "creating":
            rec.set_phase("terminate-sent" if rec.terminate_sent_utc else "created")
        rec.observe(after["status"], after.get("raw_status"), "read back from the provider")
    else:  # unread: the record keeps its phase, and says the provider did not answer
        rec.observe("unread", None, str(after.get("error")))
    state.save(rec)
    return obs


def end(client: Client, state: StateDir, rec: InstanceRecord, *, within_s: float, say: Callable[[str], None],
        send_first: bool = True) -> Ending:
    """Terminate, read back, send again, until the provider shows the instance ended or `within_s`
    passes. The record says "terminate-sent" before the first call and what was observed after."""
    rec.set_phase("terminate-sent")
    state.save(rec)
    ending = end_instance(client, rec.provider, rec.instance_id, within_s=within_s, resend_every_s=30.0,
                          read_every_s=2.0, send_first=send_first, on_progress=lambda line: say(f"  {line}"))
    after = ending.instance_after
    if ending.confirmed:
        rec.set_phase("terminated")
        rec.observe(after["status"], after.get("raw_status"), ending.how)
    else:
        rec.observe(after.get("status", "unread"), after.get("raw_status"), ending.how)
    rec.terminate_sent_utc.extend(c["time"] for c in ending.calls)
    state.save(rec)
    return ending
