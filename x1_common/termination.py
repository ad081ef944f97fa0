"""Ending an instance: "terminated" is the provider's state read back, never the terminate call's answer.

    ending = end_instance(client, "runpod", "abc123", within_s=900)
    ending.confirmed          # True once the provider lists it terminated, or answers its own not-found
    ending.instance_after     # what was last observed: the provider's record, or its not-found answer
    ending.calls              # every terminate sent, with its answer or its error

A terminate's answer says only that the request arrived: RunPod's podTerminate answers null for a
pod that goes on running, Lambda's lists the instance as "terminating". So the terminate is sent,
the instance is read back until the provider shows it terminated (Lambda "terminated", RunPod
"TERMINATED") or answers that it does not know the id in its own error shape (a 404 page of a
proxy is not that: x1_common.providers makes it a "server" error), and the terminate is sent again
every `resend_every_s` while it is not, for `within_s`. Until then the instance is "terminate
sent, still billing", and every caller says so with the instance's full id.

The `x1` command (down) and the watchdog (--terminate-on-finish) use this one loop.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from x1_common.contracts import TERMINATED_RAW_STATUS
from x1_common.providers import Instance, ProviderError

# What a terminate that is not confirmed leaves: the words every caller uses.
STILL_BILLING = "terminate sent, still billing"


class Terminable(Protocol):
    def get_instance(self, instance_id: str) -> Instance: ...

    def terminate(self, instance_id: str) -> dict[str, Any]: ...


def utc_now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


@dataclass
class Observation:
    """One read of the instance: `state` is "terminated", "gone" (the API's own not-found),
    "billing" (listed in any other state) or "unread" (no usable answer)."""

    state: str
    record: dict[str, Any]
    instance: Instance | None = None  # the provider's record, when it answered with one for this id

    @property
    def ended(self) -> bool:
        return self.state in ("terminated", "gone")


def observe(client: Terminable, provider: str, instance_id: str) -> Observation:
    """The instance as the provider shows it now. Auth errors are raised: no reading helps them."""
    try:
        inst = client.get_instance(instance_id)
    except ProviderError as e:
        if e.kind == "auth":
            raise
        if e.kind == "not-found":
            return Observation("gone", {"status": "not-found", "instance_id": instance_id, "observed_utc": utc_now(),
                                        "raw_status": "not listed: the API's own not-found",
                                        "http_status": e.status_code, "api_error": e.api_error, "message": str(e)})
        return Observation("unread", {"status": "unread", "instance_id": instance_id, "observed_utc": utc_now(),
                                      "error": str(e), "error_kind": e.kind})
    record = {"status": inst.status, "raw_status": inst.raw_status, "instance_id": inst.id,
              "observed_utc": utc_now(), "raw": inst.raw}
    if inst.id != instance_id:
        # An answer about another instance says nothing about this one.
        return Observation("unread", {**record, "status": "unread", "instance_id": instance_id,
                                      "error": f"the provider answered with the record of {inst.id}"})
    if inst.status == "terminated" and inst.raw_status == TERMINATED_RAW_STATUS.get(provider, inst.raw_status):
        return Observation("terminated", record, inst)
    return Observation("billing", record, inst)


@dataclass
class Ending:
    provider: str
    instance_id: str
    confirmed: bool
    instance_after: dict[str, Any]
    calls: list[dict[str, Any]] = field(default_factory=list)  # each terminate: time, answer or error
    reads: int = 0
    seconds: float = 0.0

    @property
    def how(self) -> str:
        """What was observed, in words."""
        after = self.instance_after
        if after.get("status") == "not-found":
            return "the provider no longer knows it (its own not-found answer)"
        if after.get("status") == "unread":
            return f"the provider could not be read ({after.get('error')})"
        return f"the provider lists it {after.get('raw_status') or after.get('status')}"

    @property
    def last_response(self) -> Any:
        answered = [c["response"] for c in self.calls if "response" in c]
        return answered[-1] if answered else None

    def record(self, **extra: Any) -> dict[str, Any]:
        """termination.json's content: what was sent and what was observed after."""
        return {"provider": self.provider, "instance_id": self.instance_id, "time": utc_now(),
                "confirmed": self.confirmed, "state": "terminated" if self.confirmed else STILL_BILLING,
                "observed": self.how, **extra, "response": self.last_response, "terminate_calls": self.calls,
                "instance_after": self.instance_after}


def end_instance(
    client: Terminable,
    provider: str,
    instance_id: str,
    *,
    within_s: float,
    resend_every_s: float = 60.0,
    read_every_s: float = 5.0,
    send_first: bool = True,
    on_progress: Callable[[str], None] = lambda line: None,
    sleep: Callable[[float], None] = time.sleep,
    clock: Callable[[], float] = time.monotonic,
) -> Ending:
    """Terminate and read back until the provider shows the instance ended or `within_s` passes
    (then `confirmed` is False: still billing). `send_first` False reads before sending (a later
    check of an instance a terminate was sent to earlier). Raises ProviderError only for a refused key."""
    start = clock()
    calls: list[dict[str, Any]] = []
    reads = 0
    next_send = start if send_first else None
    last = Observation("unread", {"status": "unread", "instance_id": instance_id, "error": "not read yet"})
    while True:
        if next_send is not None and clock() >= next_send:
            try:
                calls.append({"time": utc_now(), "response": client.terminate(instance_id)})
                on_progress(f"terminate sent to {provider} for instance {instance_id} (call {len(calls)})")
            except ProviderError as e:
                if e.kind == "auth":
                    raise
                calls.append({"time": utc_now(), "error": str(e), "error_kind": e.kind, "api_error": e.api_error})
                on_progress(f"terminate of instance {instance_id} answered with an error: {e}")
            next_send = clock() + resend_every_s
        last = observe(client, provider, instance_id)
        reads += 1
        if last.ended:
            return Ending(provider, instance_id, True, last.record, calls, reads, clock() - start)
        if clock() - start >= within_s:
            return Ending(provider, instance_id, False, last.record, calls, reads, clock() - start)
        if next_send is None:
            next_send = clock()  # read first: it is not ended, so send now
            continue
        sleep(max(0.0, min(read_every_s, within_s - (clock() - start))))
