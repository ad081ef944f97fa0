"""A stand-in for the Lambda Cloud and RunPod APIs, for `make test` and `make demo` (docs/DESIGN.md §7).

    python -m budget_sidecar.fake_billing --host 127.0.0.1 --port 8790 --provider lambda \\
        --instance-id i-0001 --price-usd-per-hr 1.10 --time-scale 360 --api-key test-key

It serves the request and response shapes the real APIs document (Lambda Cloud v1 REST, RunPod
GraphQL) behind bearer auth, so `x1_common.providers` talks to it exactly as it talks to the real
thing, plus an unauthenticated test control plane meant for 127.0.0.1 only:

    POST /_control {"price_usd_per_hr": 3.3}        the price from now on (with "instance_id": that
                                                    instance's own price; the others keep theirs)
                   {"vanish": true, "instance_id": "i-2"}  the API forgets the instance (404, no pod)
                   {"fail_mode": "none"|"500"|"timeout"|"garbage"}   every request, until "none"
                   {"preempt": true}  {"terminate": true}   (optionally with "instance_id")
                   {"fault": {...}}  {"terminate_effect": {...}}  {"misreport": {...}}  {"reset": true}
    GET  /_state   billed hours and dollars, statuses, the terminate / launch / resume calls received

The API misbehaves as real ones do, on demand:

    {"fault": {"mode": M, "on": OP, "when": "before"|"after", "count": N, "hold_s": S}}
        M: "timeout" (no answer for hold_s, 30 s by default: past the client's timeout), "slow" (the
        real answer, hold_s late), "500" (the
        API's own 5xx), "502-html" / "404-html" (a proxy's HTML page), "garbage" (a body cut short),
        "close" (the connection closed mid-answer). OP: create, terminate, get, list, types,
        resume, stop or any. "after": the operation is DONE, then its answer is lost that way (a
        create that rented although the client saw an error). N requests (default: until
        {"fault": null}).
    {"terminate_effect": {"mode": "now"|"ignore"|"async"|"gone", "delay_s": S, "count": N}}
        how a terminate answered "ok" takes effect: at once; not at all for N calls (the instance
        keeps running and billing); after delay_s (Lambda shows "terminating" meanwhile, RunPod
        RUNNING); or at once, the instance then forgotten (RunPod soon answers a null pod).
    {"misreport": {"instance_id": "i-1", "id": "other-9", "instance_type": "gpu_1x_a10",
                   "price_usd_per_hr": 0.75}}
        the API's record of i-1 shows these fields instead (another id, another type name, a
        wrong price); its bill is unchanged. {"misreport": null} ends it.
    {"reset": true}   every instance, call record, fault and effect forgotten (a test's fresh cloud)

`--instance-id i-1,i-2` starts several instances (the nodes of a multi-node run), all at the
starting price. Lambda's launch and RunPod's podFindAndDeployOnDemand create instances (booting, then running).
A test may hand `FakeCloud` a `Machines` backend (tests/launch_instance.py runs one container per
instance): the instance's machine is then created, stopped, started and removed with it, a
record shows the machine's address (Lambda `ip`, RunPod `runtime.ports`), and a RunPod pod has a
runtime only while its machine runs.

Billed time runs `--time-scale` times faster than wall time (360: one wall second bills 0.1 h),
and the price is integrated over it, so a test can watch a day's bill build up in seconds.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import queue
import re
import sys
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from x1_common.logs import setup_logging

FAIL_MODES = ("none", "500", "timeout", "garbage")
FAULT_MODES = ("timeout", "slow", "500", "502-html", "404-html", "garbage", "close")
FAULT_OPS = ("any", "create", "terminate", "get", "list", "types", "resume", "stop")
TERMINATE_EFFECTS = ("now", "ignore", "async", "gone")
DEFAULT_TYPES = {"lambda": "gpu_1x_a100_sxm4", "runpod": "NVIDIA A100 80GB PCIe"}
# Lambda's single A100 is the 40 GB SXM4 card (its 80 GB A100s come eight to an instance).
LAMBDA_OWN_TYPE_DESCRIPTION = "1x A100 (40 GB SXM4)"

# Other instance types the Lambda listing shows beside the fake instance's own (fixed prices).
LAMBDA_OTHER_TYPES = {
    "gpu_1x_h100_sxm5": ("1x H100 (80 GB SXM5)", 329, 26, 225),
    "gpu_1x_a10": ("1x A10 (24 GB PCIe)", 75, 30, 200),
    "gpu_8x_a100_80gb_sxm4": ("8x A100 (80 GB SXM4)", 1432, 240, 1800),
}

@dataclass
class Fault:
    """One misbehaviour of the API (see the module's docstring)."""

    mode: str
    on: str = "any"
    when: str = "before"
    count: int | None = None  # requests left; None: until cleared
    hold_s: float = 30.0

    @classmethod
    def parse(cls, body: Any) -> Fault:
        if not isinstance(body, dict):
            raise ValueError("fault must be an object or null")
        unknown = set(body) - {"mode", "on", "when", "count", "hold_s"}
        if unknown:
            raise ValueError(f"fault: unknown field(s) {', '.join(sorted(unknown))}")
        fault = cls(mode=body.get("mode"), on=body.get("on", "any"), when=body.get("when", "before"),
                    count=body.get("count"), hold_s=body.get("hold_s", 30.0))
        if fault.mode not in FAULT_MODES:
            raise ValueError(f"fault.mode must be one of {', '.join(FAULT_MODES)}, got {fault.mode!r}")
        if fault.on not in FAULT_OPS:
            raise ValueError(f"fault.on must be one of {', '.join(FAULT_OPS)}, got {fault.on!r}")
        if fault.when not in ("before", "after"):
            raise ValueError(f"fault.when must be before or after, got {fault.when!r}")
        if fault.count is not None and (isinstance(fault.count, bool) or not isinstance(fault.count, int)
                                        or fault.count < 1):
            raise ValueError(f"fault.count must be a positive integer, got {fault.count!r}")
        if isinstance(fault.hold_s, bool) or not isinstance(fault.hold_s, (int, float)) or fault.hold_s < 0:
            raise ValueError(f"fault.hold_s must be a number >= 0, got {fault.hold_s!r}")
        return fault
# RunPod's markets against spot (the fake's price): what runpod_gpu_types lists and a created pod bills.
RUNPOD_MARKET_FACTOR = {"COMMUNITY": 1.4, "SECURE": 1.7, "ALL": 1.4}
RUNPOD_SPOT_FACTOR = {"COMMUNITY": 1.0, "SECURE": 1.2, "ALL": 1.0}
RUNPOD_OTHER_TYPES = {"NVIDIA H100 80GB HBM3": ("H100 SXM", 80, 2.69), "NVIDIA GeForce RTX 4090": ("RTX 4090", 24, 0.34)}


class Machines(Protocol):
    """What stands behind a fake instance: its machine. Calls come from one worker thread, in order."""

    def create(self, instance_id: str, env: dict[str, str], command: str | None) -> None: ...

    def stop(self, instance_id: str) -> None: ...

    def start(self, instance_id: str) -> None: ...

    def remove(self, instance_id: str) -> None: ...

    def address(self, instance_id: str) -> tuple[str, int] | None:
        """(ip, ssh port) while the machine runs, else None."""
        ...


class MachineWorker:
    """Runs the machine operations in order on one thread, so an API answer never waits for a
    container to stop (a preemption's kill takes seconds) and a start never overtakes a stop."""

    def __init__(self, machines: Machines) -> None:
        self.machines = machines
        self.jobs: queue.Queue[tuple[str, str, tuple[Any, ...]]] = queue.Queue()
        self.pending = 0
        self.errors: list[str] = []
        self.lock = threading.Lock()
        threading.Thread(target=self._work, name="fake-machines", daemon=True).start()

    def submit(self, op: str, instance_id: str, *args: Any) -> None:
        with self.lock:
            self.pending += 1
        self.jobs.put((op, instance_id, args))

    def idle(self) -> bool:
        with self.lock:
            return self.pending == 0

    def _work(self) -> None:
        while True:
            op, instance_id, args = self.jobs.get()
            try:
                getattr(self.machines, op)(instance_id, *args)
            except Exception as e:  # noqa: BLE001 - reported in /_state; the fake keeps serving
                logging.getLogger("x1.fake_billing").error("machine %s of %s failed: %s", op, instance_id, e)
                self.errors.append(f"{op} {instance_id}: {e}")
            finally:
                with self.lock:
                    self.pending -= 1


@dataclass
class FakeInstance:
    id: str
    name: str
    instance_type: str
    region: str
    status: str  # in the provider's own words: Lambda "active", RunPod "RUNNING", ...
    last_wall: float  # wall time up to which billing has been added
    boot_until: float = 0.0  # wall time when booting ends
    uptime_s: float = 0.0  # billed seconds in the current run (RunPod resets it on resume)
    billed_s: float = 0.0
    billed_usd: float = 0.0
    last_status_change: str = ""
    ssh_key_names: list[str] = field(default_factory=list)
    file_system_names: list[str] = field(default_factory=list)
    price_factor: float = 1.0  # a RunPod pod created on demand bills its market's price (RUNPOD_MARKET_FACTOR)
    own_price: float | None = None  # set by /_control for this instance alone; None: the cloud's price
    terminate_at: float | None = None  # an asynchronous terminate: wall time it takes effect
    forget_on_terminate: bool = False  # terminate_effect "gone": the API forgets it once terminated


class FakeCloud:
    """The fake's state and rules, independent of HTTP. Thread-safe; the clock is injectable."""

    def __init__(
        self,
        provider: str,
        instance_id: str,
        price_usd_per_hr: float,
        time_scale: float = 1.0,
        *,
        instance_type: str | None = None,
        region: str = "us-east-1",
        boot_seconds: float = 1.0,
        clock: Callable[[], float] = time.time,
        machines: Machines | None = None,
        start_with_instance: bool = True,
    ) -> None:
        if provider not in DEFAULT_TYPES:
            raise ValueError(f"provider: {provider!r} is not lambda or runpod")
        self.provider = provider
        self.price = price_usd_per_hr
        self.time_scale = time_scale
        self.boot_seconds = boot_seconds
        self.fail_mode = "none"
        self.instance_type = instance_type or DEFAULT_TYPES[provider]
        self.region = region
        self.clock = clock
        self.lock = threading.Lock()
        self.instances: dict[str, FakeInstance] = {}
        self.terminate_calls: list[str] = []
        self.launch_calls: list[dict[str, Any]] = []
        self.resume_calls: list[dict[str, Any]] = []
        self.create_calls: list[dict[str, Any]] = []
        self.requests = 0
        self.auth_failures = 0
        self.faults: list[Fault] = []
        self.terminate_effect = "now"
        self.terminate_delay_s = 0.0
        self.terminate_effect_count: int | None = None  # terminates the effect applies to; None: all
        self.misreports: dict[str, dict[str, Any]] = {}
        self.faulted: list[dict[str, Any]] = []  # each request a fault hit: op, mode, when
        self.machines = MachineWorker(machines) if machines is not None else None
        now = clock()
        if start_with_instance:
            for one in instance_id.split(","):
                self.instances[one] = FakeInstance(
                    id=one, name="x1", instance_type=self.instance_type, region=region,
                    status=self._running, last_wall=now, last_status_change=f"Rented by User: {time.ctime(now)}",
                )

    # --- words of each provider -------------------------------------------------------------
    @property
    def _running(self) -> str:
        return "active" if self.provider == "lambda" else "RUNNING"

    @property
    def _booting(self) -> str:
        # RunPod has no booting state: the pod is RUNNING with no runtime until the container is up.
        return "booting" if self.provider == "lambda" else "RUNNING"

    def price_of(self, inst: FakeInstance) -> float:
        """$/h the instance bills: its own price if one was set, else the cloud's, times its market's factor."""
        return (self.price if inst.own_price is None else inst.own_price) * inst.price_factor

    def _billing(self, inst: FakeInstance) -> bool:
        return inst.status in ("active", "booting", "unhealthy", "terminating", "RUNNING")

    # --- time -------------------------------------------------------------------------------
    def advance(self) -> None:
        """Bring every instance's bill up to now (call with the lock held)."""
        now = self.clock()
        for inst in self.instances.values():
            dt = max(0.0, now - inst.last_wall) * self.time_scale
            if self._billing(inst):
                inst.uptime_s += dt
                inst.billed_s += dt
                inst.billed_usd += self.price_of(inst) * dt / 3600.0
            inst.last_wall = now
            if inst.status == "booting" and now >= inst.boot_until:
                inst.status = "active"
        for inst in list(self.instances.values()):
            if inst.terminate_at is not None and now >= inst.terminate_at:
                inst.terminate_at = None
                self._terminate(inst)

    def booting(self, inst: FakeInstance) -> bool:
        return self.clock() < inst.boot_until

    # --- the machines behind the instances (when a test gives some) --------------------------
    def machine(self, op: str, inst: FakeInstance, *args: Any) -> None:
        if self.machines is not None:
            self.machines.submit(op, inst.id, *args)

    def address(self, inst: FakeInstance) -> tuple[str, int] | None:
        """Where the instance's SSH server is: its machine's address once it runs (and none of its
        operations is still queued), else a documentation address (no machines)."""
        if self.machines is None:
            return ("192.0.2.10", 22)
        if not self.machines.idle():
            return None
        return self.machines.machines.address(inst.id)

    # --- control plane ----------------------------------------------------------------------
    def control(self, body: dict[str, Any]) -> None:
        """Apply one /_control request; ValueError names a bad field."""
        known = {"price_usd_per_hr", "fail_mode", "preempt", "terminate", "vanish", "instance_id", "time_scale",
                 "fault", "terminate_effect", "misreport", "reset"}
        unknown = set(body) - known
        if unknown:
            raise ValueError(f"unknown control field(s): {', '.join(sorted(unknown))} (known: {', '.join(sorted(known))})")
        with self.lock:
            self.advance()
            if body.get("reset"):
                self._reset()
            if "fault" in body:
                self.faults = [] if body["fault"] is None else [Fault.parse(body["fault"])]
            if "terminate_effect" in body:
                self._set_terminate_effect(body["terminate_effect"])
            if "misreport" in body:
                self._set_misreport(body["misreport"])
            targets = self._targets(body.get("instance_id"))
            if "price_usd_per_hr" in body:
                price = body["price_usd_per_hr"]
                if isinstance(price, bool) or not isinstance(price, (int, float)) or price <= 0:
                    raise ValueError(f"price_usd_per_hr must be a positive number, got {price!r}")
                if body.get("instance_id") is None:
                    self.price = float(price)
                else:
                    for inst in targets:
                        inst.own_price = float(price)
            if "time_scale" in body:
                scale = body["time_scale"]
                if isinstance(scale, bool) or not isinstance(scale, (int, float)) or scale <= 0:
                    raise ValueError(f"time_scale must be a positive number, got {scale!r}")
                self.time_scale = float(scale)
            if "fail_mode" in body:
                if body["fail_mode"] not in FAIL_MODES:
                    raise ValueError(f"fail_mode must be one of {', '.join(FAIL_MODES)}, got {body['fail_mode']!r}")
                self.fail_mode = body["fail_mode"]
            if body.get("preempt"):
                for inst in targets:
                    # Lambda shows "preempted". RunPod documents no such state: an interrupted spot
                    # pod goes to EXITED and says why in lastStatusChange (our reading of the API).
                    inst.status = "preempted" if self.provider == "lambda" else "EXITED"
                    inst.last_status_change = f"Exited by RunPod: spot instance interrupted {time.ctime()}"
                    self.machine("stop", inst)
            if body.get("terminate"):
                for inst in targets:
                    self._terminate(inst)
            if body.get("vanish"):
                if body.get("instance_id") is None:
                    raise ValueError("vanish needs an instance_id")
                for inst in targets:
                    del self.instances[inst.id]

    def _reset(self) -> None:
        self.instances.clear()
        for calls in (self.terminate_calls, self.launch_calls, self.resume_calls, self.create_calls, self.faulted):
            calls.clear()
        self.faults, self.misreports, self.fail_mode = [], {}, "none"
        self.terminate_effect, self.terminate_delay_s, self.terminate_effect_count = "now", 0.0, None
        self.requests = self.auth_failures = 0

    def _set_terminate_effect(self, body: Any) -> None:
        if body is None:
            body = {"mode": "now"}
        if not isinstance(body, dict) or body.get("mode") not in TERMINATE_EFFECTS:
            raise ValueError(f"terminate_effect.mode must be one of {', '.join(TERMINATE_EFFECTS)}")
        delay, count = body.get("delay_s", 0.0), body.get("count")
        if isinstance(delay, bool) or not isinstance(delay, (int, float)) or delay < 0:
            raise ValueError(f"terminate_effect.delay_s must be a number >= 0, got {delay!r}")
        if count is not None and (isinstance(count, bool) or not isinstance(count, int) or count < 1):
            raise ValueError(f"terminate_effect.count must be a positive integer, got {count!r}")
        self.terminate_effect, self.terminate_delay_s, self.terminate_effect_count = body["mode"], float(delay), count

    def _set_misreport(self, body: Any) -> None:
        if body is None:
            self.misreports = {}
            return
        if not isinstance(body, dict) or not isinstance(body.get("instance_id"), str):
            raise ValueError("misreport needs an instance_id")
        unknown = set(body) - {"instance_id", "id", "instance_type", "price_usd_per_hr"}
        if unknown:
            raise ValueError(f"misreport: unknown field(s) {', '.join(sorted(unknown))}")
        self.misreports[body["instance_id"]] = {k: v for k, v in body.items() if k != "instance_id"}

    def take_fault(self, op: str) -> Fault | None:
        """The fault this request meets, if any (its count used up by one). Call with the lock held."""
        for fault in self.faults:
            if fault.on in ("any", op):
                if fault.count is not None:
                    fault.count -= 1
                    if fault.count <= 0:
                        self.faults.remove(fault)
                self.faulted.append({"op": op, "mode": fault.mode, "when": fault.when})
                return fault
        return None

    def request_terminate(self, inst: FakeInstance) -> None:
        """A terminate the API answers "ok": its effect as terminate_effect says. Lock held."""
        self.terminate_calls.append(inst.id)
        effect = self.terminate_effect
        if self.terminate_effect_count is not None:
            self.terminate_effect_count -= 1
            if self.terminate_effect_count <= 0:
                self.terminate_effect, self.terminate_effect_count = "now", None
        if inst.status in ("terminated", "TERMINATED"):
            return
        if effect == "ignore":
            return  # answered ok; the instance runs on, billing
        if effect == "async":
            if inst.terminate_at is None:
                inst.terminate_at = self.clock() + self.terminate_delay_s
                if self.provider == "lambda":
                    inst.status = "terminating"
            return
        inst.forget_on_terminate = effect == "gone"
        self._terminate(inst)

    def _targets(self, instance_id: str | None) -> list[FakeInstance]:
        if instance_id is None:
            return list(self.instances.values())
        if instance_id not in self.instances:
            raise ValueError(f"instance_id: no instance {instance_id!r}")
        return [self.instances[instance_id]]

    def _terminate(self, inst: FakeInstance) -> None:
        if inst.status not in ("terminated", "TERMINATED"):
            self.machine("remove", inst)
        inst.status = "terminated" if self.provider == "lambda" else "TERMINATED"
        inst.last_status_change = f"Terminated by User: {time.ctime()}"
        if inst.forget_on_terminate:
            self.instances.pop(inst.id, None)

    def state(self) -> dict[str, Any]:
        with self.lock:
            self.advance()
            return {
                "provider": self.provider,
                "price_usd_per_hr": self.price,
                "time_scale": self.time_scale,
                "fail_mode": self.fail_mode,
                "instances": {
                    i.id: {
                        "name": i.name,
                        "status": i.status,
                        "billing": self._billing(i),
                        "instance_type": i.instance_type,
                        "price_usd_per_hr": self.price_of(i),
                        "billed_hours": i.billed_s / 3600.0,
                        "billed_usd": i.billed_usd,
                        "uptime_seconds": i.uptime_s,
                    }
                    for i in self.instances.values()
                },
                "billed_hours": sum(i.billed_s for i in self.instances.values()) / 3600.0,
                "billed_usd": sum(i.billed_usd for i in self.instances.values()),
                "terminate_calls": list(self.terminate_calls),
                "launch_calls": list(self.launch_calls),
                "create_calls": list(self.create_calls),
                "resume_calls": list(self.resume_calls),
                "machines_idle": self.machines is None or self.machines.idle(),
                "machine_errors": [] if self.machines is None else list(self.machines.errors),
                "requests": self.requests,
                "auth_failures": self.auth_failures,
                "faults_hit": list(self.faulted),
                "faults_left": [vars(f).copy() for f in self.faults],
            }

    # --- Lambda -----------------------------------------------------------------------------
    def lambda_type(self, name: str, price: float | None = None) -> dict[str, Any]:
        """The type's record; `price`: an instance's own price for its type (default the cloud's)."""
        if name == self.instance_type:
            own = LAMBDA_OWN_TYPE_DESCRIPTION if name == DEFAULT_TYPES["lambda"] else f"1x {name}"
            cents, desc, vcpus, mem = round((self.price if price is None else price) * 100), own, 30, 200
        elif name in LAMBDA_OTHER_TYPES:
            desc, cents, vcpus, mem = LAMBDA_OTHER_TYPES[name]
            if price is not None:
                cents = round(price * 100)
        else:  # a name the API made up (a misreport): the price given
            desc, cents, vcpus, mem = f"1x {name}", round((price or 0.0) * 100), 0, 0
        gpus = int(desc.split("x", 1)[0])
        return {
            "name": name,
            "description": desc,
            "gpu_description": desc.split(" ", 1)[1] if " " in desc else desc,
            "price_cents_per_hour": cents,  # an integer, as Lambda sends it
            "specs": {"vcpus": vcpus, "memory_gib": mem, "storage_gib": 512, "gpus": gpus},
        }

    def lambda_instance(self, inst: FakeInstance) -> dict[str, Any]:
        address = self.address(inst) if inst.status == "active" else None
        wrong = self.misreports.get(inst.id, {})
        record = {
            "id": wrong.get("id", inst.id),
            "name": inst.name,
            "private_ip": "10.0.0.10",
            "status": inst.status,
            "hostname": f"{inst.id[:8]}.cloud.example",
            "ssh_key_names": inst.ssh_key_names,
            "file_system_names": inst.file_system_names,
            "region": {"name": inst.region, "description": "Virginia, USA"},
            "instance_type": self.lambda_type(wrong.get("instance_type", inst.instance_type),
                                              wrong.get("price_usd_per_hr", self.price_of(inst))),
            "is_reserved": False,
        }
        if address is not None:
            record["ip"] = address[0]  # Lambda shows the public IP once the instance is up; SSH on 22
        return record

    def lambda_instance_types(self) -> dict[str, Any]:
        names = [self.instance_type, *(n for n in LAMBDA_OTHER_TYPES if n != self.instance_type)]
        region = {"name": self.region, "description": "Virginia, USA"}
        return {n: {"instance_type": self.lambda_type(n), "regions_with_capacity_available": [region]} for n in names}

    def lambda_launch(self, body: dict[str, Any]) -> str:
        for key in ("region_name", "instance_type_name"):
            if not isinstance(body.get(key), str) or not body[key]:
                raise ValueError(f"{key} is required")
        if body["instance_type_name"] not in (self.instance_type, *LAMBDA_OTHER_TYPES):
            raise ValueError(f"instance type {body['instance_type_name']!r} does not exist")
        now = self.clock()
        new = FakeInstance(
            id=uuid.uuid4().hex, name=str(body.get("name") or "x1"), instance_type=body["instance_type_name"],
            region=body["region_name"], status="booting", last_wall=now, boot_until=now + self.boot_seconds,
            ssh_key_names=list(body.get("ssh_key_names") or []), file_system_names=list(body.get("file_system_names") or []),
        )
        self.instances[new.id] = new
        # The launch as asked, user data included (it holds no secret by design: tests check what it says)
        self.launch_calls.append({**body, "instance_id": new.id, "user_data_bytes": len(body.get("user_data") or "")})
        self.machine("create", new, {}, None)
        return new.id

    # --- RunPod -----------------------------------------------------------------------------
    def runpod_pod(self, inst: FakeInstance) -> dict[str, Any]:
        running = inst.status == "RUNNING" and not self.booting(inst)
        address = self.address(inst) if running else None
        if self.machines is not None and address is None:
            running = False  # the container is not up (yet): no runtime, as RunPod shows it
        ports = [] if address is None else [
            {"ip": address[0], "isIpPublic": True, "privatePort": 22, "publicPort": address[1], "type": "tcp"}]
        wrong = self.misreports.get(inst.id, {})
        return {
            "id": wrong.get("id", inst.id),
            "name": inst.name,
            "costPerHr": round(wrong.get("price_usd_per_hr", self.price_of(inst)), 4),
            "desiredStatus": inst.status,
            "lastStatusChange": inst.last_status_change,
            "gpuCount": 1,
            "imageName": "nvcr.io/nvidia/pytorch:24.10-py3",
            "machineId": "m-fake",
            "machine": {"gpuDisplayName": wrong.get("instance_type", self.runpod_display(inst.instance_type)),
                        "podHostId": f"{inst.id}-host"},
            # No runtime while the container starts or when the pod is not running (as RunPod does).
            "runtime": {"uptimeInSeconds": int(inst.uptime_s), "ports": ports, "gpus": [{"id": "GPU-0"}]} if running else None,
        }

    def runpod_display(self, gpu_type_id: str) -> str:
        if gpu_type_id == self.instance_type:
            return "A100 PCIe"
        return RUNPOD_OTHER_TYPES.get(gpu_type_id, (gpu_type_id,))[0]

    def runpod_create(self, spec: Any, interruptible: bool = False) -> FakeInstance:
        """podFindAndDeployOnDemand (or podRentInterruptable): a new pod of `gpuTypeId`, RUNNING
        (its container starting), billed at its market's price (spot: the bid must reach it)."""
        if not isinstance(spec, dict):
            raise ValueError("input is required")
        for key in ("gpuTypeId", "imageName"):
            if not isinstance(spec.get(key), str) or not spec[key]:
                raise ValueError(f"input.{key} is required")
        if spec["gpuTypeId"] not in (self.instance_type, *RUNPOD_OTHER_TYPES):
            raise ValueError(f"There are no longer any instances available with the requested specifications "
                             f"({spec['gpuTypeId']!r}).")
        market = spec.get("cloudType") or "ALL"
        if market not in RUNPOD_MARKET_FACTOR:
            raise ValueError(f"input.cloudType {market!r} is not one of {', '.join(RUNPOD_MARKET_FACTOR)}")
        factor = RUNPOD_MARKET_FACTOR[market]
        if interruptible:
            factor = RUNPOD_SPOT_FACTOR[market]
            spot = self.runpod_base_price(spec["gpuTypeId"]) * factor
            bid = spec.get("bidPerGpu")
            if isinstance(bid, bool) or not isinstance(bid, (int, float)) or bid < round(spot, 2):
                raise ValueError(f"input.bidPerGpu {bid!r} is under the spot price ${spot:.2f}/h")
        env = {}
        for item in spec.get("env") or []:
            if isinstance(item, dict) and isinstance(item.get("key"), str):
                env[item["key"]] = str(item.get("value", ""))
        now = self.clock()
        new = FakeInstance(
            id=uuid.uuid4().hex[:14], name=str(spec.get("name") or "x1"), instance_type=spec["gpuTypeId"],
            region=self.region, status="RUNNING", last_wall=now, boot_until=now + self.boot_seconds,
            last_status_change=f"Rented by User: {time.ctime(now)}", price_factor=factor,
        )
        if spec["gpuTypeId"] != self.instance_type:
            new.own_price = self.runpod_base_price(spec["gpuTypeId"])
        self.instances[new.id] = new
        # The record of the call, without the env's values (a pod's env may carry keys).
        self.create_calls.append({**{k: v for k, v in spec.items() if k != "env"}, "env_keys": sorted(env),
                                  "operation": "podRentInterruptable" if interruptible else "podFindAndDeployOnDemand",
                                  "instance_id": new.id})
        self.machine("create", new, env, spec.get("dockerArgs") or None)
        return new

    def runpod_base_price(self, gpu_type_id: str) -> float:
        """The community spot price of a GPU type (the fake's price for its own type)."""
        return self.price if gpu_type_id == self.instance_type else RUNPOD_OTHER_TYPES[gpu_type_id][2]

    def runpod_gpu_types(self) -> list[dict[str, Any]]:
        p = self.price
        types = [{
            "id": self.instance_type, "displayName": "A100 PCIe", "memoryInGb": 80,
            # Spot is the fake's price; the other markets cost more, as they do on RunPod.
            "communitySpotPrice": p, "secureSpotPrice": round(p * 1.2, 2),
            "communityPrice": round(p * RUNPOD_MARKET_FACTOR["COMMUNITY"], 2),
            "securePrice": round(p * RUNPOD_MARKET_FACTOR["SECURE"], 2),
        }]
        for gid, (display, mem, price) in RUNPOD_OTHER_TYPES.items():
            types.append({
                "id": gid, "displayName": display, "memoryInGb": mem, "communitySpotPrice": price,
                "secureSpotPrice": round(price * 1.2, 2), "communityPrice": round(price * 1.4, 2),
                "securePrice": round(price * 1.7, 2),
            })
        return types


# --------------------------------------------------------------------------------------------
# GraphQL, just enough: the operations x1_common.providers sends (and the same with literals).

_POD_ID = re.compile(r'podId\s*:\s*(?:"([^"]*)"|\$(\w+))')
_GPU_COUNT = re.compile(r"gpuCount\s*:\s*(?:(\d+)|\$(\w+))")


def _arg(pattern: re.Pattern[str], query: str, variables: dict[str, Any]) -> Any:
    m = pattern.search(query)
    if not m:
        return None
    return m.group(1) if m.group(1) is not None else variables.get(m.group(2))


def _graphql_error(message: str, code: str | None = None) -> dict[str, Any]:
    err: dict[str, Any] = {"message": message}
    if code:
        err["extensions"] = {"code": code}
    return {"errors": [err]}


def runpod_op(query: str) -> str:
    """What a GraphQL request does, in the words of the fault control."""
    for word, op in (("podTerminate", "terminate"), ("podResume", "resume"), ("podStop", "stop"),
                     ("podFindAndDeployOnDemand", "create"), ("podRentInterruptable", "create"), ("gpuTypes", "types")):
        if word in query:
            return op
    if re.search(r"\bpod\s*\(", query):
        return "get"
    if re.search(r"\bpods\b", query):
        return "list"
    return "other"


def runpod_graphql(cloud: FakeCloud, query: str, variables: dict[str, Any]) -> dict[str, Any]:
    """The response body of one GraphQL request (always HTTP 200, as GraphQL servers do)."""
    with cloud.lock:
        cloud.advance()
        pod_id = _arg(_POD_ID, query, variables)
        inst = cloud.instances.get(pod_id) if pod_id else None
        op = runpod_op(query)
        if op == "terminate":
            if inst is None:
                return {**_graphql_error("Pod not found"), "data": {"podTerminate": None}}
            cloud.request_terminate(inst)
            return {"data": {"podTerminate": None}}  # the mutation returns Void
        if op in ("resume", "stop"):
            name = "podResume" if op == "resume" else "podStop"
            if inst is None or inst.status == "TERMINATED":
                return {**_graphql_error("Pod not found"), "data": {name: None}}
            if op == "stop":
                if inst.status == "RUNNING":
                    cloud.machine("stop", inst)
                inst.status = "EXITED"
                inst.last_status_change = f"Exited by User: {time.ctime()}"
            else:
                gpu_count = _arg(_GPU_COUNT, query, variables) or 1
                cloud.resume_calls.append({"pod_id": inst.id, "gpu_count": int(gpu_count)})
                if inst.status != "RUNNING":
                    inst.status = "RUNNING"
                    inst.uptime_s = 0.0
                    inst.boot_until = cloud.clock() + cloud.boot_seconds
                    inst.last_status_change = f"Resumed by User: {time.ctime()}"
                    cloud.machine("start", inst)
            return {"data": {name: cloud.runpod_pod(inst)}}
        if op == "create":
            name = "podRentInterruptable" if "podRentInterruptable" in query else "podFindAndDeployOnDemand"
            try:
                new = cloud.runpod_create(variables.get("input"), interruptible=name == "podRentInterruptable")
            except ValueError as e:
                return {**_graphql_error(str(e)), "data": {name: None}}
            return {"data": {name: cloud.runpod_pod(new)}}
        if op == "types":
            return {"data": {"gpuTypes": cloud.runpod_gpu_types()}}
        if op == "get":
            if inst is None:
                return {**_graphql_error(f"Pod {pod_id} not found"), "data": {"pod": None}}
            return {"data": {"pod": cloud.runpod_pod(inst)}}
        if op == "list":  # myself { pods }: the account's pods; a terminated one is no longer listed
            return {"data": {"myself": {"pods": [cloud.runpod_pod(i) for i in cloud.instances.values()
                                                 if i.status != "TERMINATED"]}}}
        if "myself" in query:
            running = [i for i in cloud.instances.values() if i.status == "RUNNING"]
            spent = sum(i.billed_usd for i in cloud.instances.values())
            return {"data": {"myself": {
                "clientBalance": round(100.0 - spent, 4), "currentSpendPerHr": cloud.price * len(running),
            }}}
        return _graphql_error("Cannot query this field on the fake billing API", "GRAPHQL_VALIDATION_FAILED")


# --------------------------------------------------------------------------------------------
# HTTP

_PROXY_PAGES = {
    "502-html": (502, "<html>\r\n<head><title>502 Bad Gateway</title></head>\r\n<body>\r\n<center><h1>502 Bad Gateway"
                      "</h1></center>\r\n<hr><center>nginx</center>\r\n</body>\r\n</html>\r\n"),
    "404-html": (404, "<html>\r\n<head><title>404 Not Found</title></head>\r\n<body>\r\n<center><h1>404 Not Found"
                      "</h1></center>\r\n<hr><center>nginx</center>\r\n</body>\r\n</html>\r\n"),
}


class _CutShort(Response):
    """An answer that starts and never finishes: the connection is closed mid-body."""

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", b"4096")]})
        await send({"type": "http.response.body", "body": b'{"data": {"id": "', "more_body": True})
        raise ConnectionAbortedError("fake billing: connection closed mid-answer (fault mode close)")


def create_app(cloud: FakeCloud, api_key: str) -> FastAPI:
    app = FastAPI(title="X1 fake billing API", docs_url=None, redoc_url=None)

    def provider_error(status: int, code: str, message: str) -> JSONResponse:
        if cloud.provider == "lambda":
            body: dict[str, Any] = {"error": {"code": code, "message": message}}
            if status == 401:
                body["error"]["suggestion"] = "Check your API key or create a new one, then try again."
        else:
            # RunPod: GraphQL-style error list, whatever the status.
            body = _graphql_error(message, code)
        return JSONResponse(body, status_code=status)

    def server_error() -> JSONResponse:
        if cloud.provider == "lambda":
            return provider_error(500, "global/unknown", "Unknown error.")
        return provider_error(500, "INTERNAL_SERVER_ERROR", "Something went wrong. Please try again later or contact support.")

    async def hold(seconds: float, still: Callable[[], bool] = lambda: True) -> None:
        deadline = time.monotonic() + seconds
        while still() and time.monotonic() < deadline:
            await asyncio.sleep(0.05)

    async def gate(request: Request) -> Response | None:
        """The fail mode, then bearer auth: what every provider route passes first."""
        with cloud.lock:
            cloud.requests += 1
            mode = cloud.fail_mode
        if mode == "timeout":
            # Hold the request until the client gives up (or the test ends the outage).
            await hold(60.0, lambda: cloud.fail_mode == "timeout")
            return provider_error(504, "global/timeout", "Gateway timeout")
        if mode == "500":
            return server_error()
        if mode == "garbage":
            return Response('{"data": {"id": "i-', media_type="application/json")  # cut short
        if request.headers.get("authorization", "") != f"Bearer {api_key}":
            with cloud.lock:
                cloud.auth_failures += 1
            if cloud.provider == "lambda":
                return provider_error(401, "global/invalid-api-key", "API key was invalid, expired, or deleted.")
            return provider_error(401, "UNAUTHENTICATED", "Unauthorized: invalid API key")
        return None

    async def fault_answer(fault: Fault) -> Response:
        if fault.mode == "timeout":
            await hold(fault.hold_s)
            return provider_error(504, "global/timeout", "Gateway timeout")
        if fault.mode == "500":
            return server_error()
        if fault.mode in _PROXY_PAGES:
            status, page = _PROXY_PAGES[fault.mode]
            return Response(page, status_code=status, media_type="text/html")
        if fault.mode == "garbage":
            return Response('{"data": {"id": "i-', media_type="application/json")  # cut short
        return _CutShort()

    async def serve(op: str, work: Callable[[], Response]) -> Response:
        """The operation, with the fault it meets before it (not done) or after it (done, answer lost)."""
        with cloud.lock:
            fault = cloud.take_fault(op)
        if fault is not None and fault.mode == "slow":  # the real answer, late: the operation before or after the wait
            if fault.when == "before":
                await hold(fault.hold_s)
                return work()
            response = work()
            await hold(fault.hold_s)
            return response
        if fault is not None and fault.when == "before":
            return await fault_answer(fault)
        response = work()
        if fault is not None:
            return await fault_answer(fault)
        return response

    async def json_body(request: Request) -> dict[str, Any] | None:
        try:
            body = await request.json()
        except ValueError:
            return None
        return body if isinstance(body, dict) else None

    @app.post("/_control")
    async def control(request: Request) -> Response:
        body = await json_body(request)
        if body is None:
            return JSONResponse({"detail": "body must be a JSON object"}, status_code=400)
        try:
            cloud.control(body)
        except ValueError as e:
            return JSONResponse({"detail": str(e)}, status_code=400)
        return JSONResponse(cloud.state())

    @app.get("/_state")
    async def state() -> dict[str, Any]:
        return cloud.state()

    if cloud.provider == "lambda":

        @app.get("/api/v1/instances/{instance_id}")
        async def lambda_get_instance(instance_id: str, request: Request) -> Response:
            if (failed := await gate(request)) is not None:
                return failed

            def work() -> Response:
                with cloud.lock:
                    cloud.advance()
                    inst = cloud.instances.get(instance_id)
                    if inst is None:
                        return provider_error(404, "global/object-does-not-exist", "Specified instance does not exist.")
                    return JSONResponse({"data": cloud.lambda_instance(inst)})

            return await serve("get", work)

        @app.get("/api/v1/instances")
        async def lambda_list_instances(request: Request) -> Response:
            if (failed := await gate(request)) is not None:
                return failed

            def work() -> Response:
                with cloud.lock:
                    cloud.advance()
                    live = [cloud.lambda_instance(i) for i in cloud.instances.values() if i.status != "terminated"]
                    return JSONResponse({"data": live})

            return await serve("list", work)

        @app.get("/api/v1/instance-types")
        async def lambda_instance_types(request: Request) -> Response:
            if (failed := await gate(request)) is not None:
                return failed

            def work() -> Response:
                with cloud.lock:
                    return JSONResponse({"data": cloud.lambda_instance_types()})

            return await serve("types", work)

        @app.post("/api/v1/instance-operations/terminate")
        async def lambda_terminate(request: Request) -> Response:
            if (failed := await gate(request)) is not None:
                return failed
            body = await json_body(request)
            ids = body.get("instance_ids") if body else None
            if not isinstance(ids, list) or not ids:
                return provider_error(400, "global/invalid-parameters", "instance_ids must be a non-empty list")

            def work() -> Response:
                with cloud.lock:
                    cloud.advance()
                    missing = [i for i in ids if i not in cloud.instances]
                    if missing:
                        return provider_error(404, "global/object-does-not-exist", f"Instance {missing[0]} does not exist.")
                    done = []
                    for i in ids:
                        inst = cloud.instances[i]
                        cloud.request_terminate(inst)
                        # Lambda answers with the instances it accepted to terminate, as they are now.
                        shown = cloud.lambda_instance(inst)
                        if shown["status"] == "active":
                            shown["status"] = "terminating"
                        done.append(shown)
                    return JSONResponse({"data": {"terminated_instances": done}})

            return await serve("terminate", work)

        @app.post("/api/v1/instance-operations/launch")
        async def lambda_launch(request: Request) -> Response:
            if (failed := await gate(request)) is not None:
                return failed
            body = await json_body(request)
            if body is None:
                return provider_error(400, "global/invalid-parameters", "body must be a JSON object")

            def work() -> Response:
                with cloud.lock:
                    cloud.advance()
                    try:
                        new_id = cloud.lambda_launch(body)
                    except ValueError as e:
                        return provider_error(400, "global/invalid-parameters", str(e))
                return JSONResponse({"data": {"instance_ids": [new_id]}})

            return await serve("create", work)

    else:

        @app.post("/graphql")
        async def graphql(request: Request) -> Response:
            if (failed := await gate(request)) is not None:
                return failed
            body = await json_body(request)
            if body is None or not isinstance(body.get("query"), str):
                return JSONResponse(_graphql_error("Must provide query string.", "BAD_USER_INPUT"), status_code=400)
            variables = body.get("variables") if isinstance(body.get("variables"), dict) else {}
            query = body["query"]
            return await serve(runpod_op(query), lambda: JSONResponse(runpod_graphql(cloud, query, variables)))

    return app


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m budget_sidecar.fake_billing",
        description=(
            "A fake Lambda Cloud / RunPod API for tests and the demo: the real shapes behind bearer auth, "
            "plus POST /_control (price, fail mode, preempt, terminate) and GET /_state, both unauthenticated: "
            "bind it to 127.0.0.1 only."
        ),
    )
    p.add_argument("--host", default="127.0.0.1", help="bind address (127.0.0.1: the control plane has no auth)")
    p.add_argument("--port", type=int, required=True, help="TCP port")
    p.add_argument("--provider", choices=sorted(DEFAULT_TYPES), required=True, help="which API to imitate")
    p.add_argument("--instance-id", required=True,
                   help="id of the instance (pod) the fake starts with, running; several comma-separated: i-1,i-2")
    p.add_argument("--instance-type", help="its type (default: gpu_1x_a100_sxm4 / NVIDIA A100 80GB PCIe)")
    p.add_argument("--price-usd-per-hr", type=float, default=1.10, help="starting price, $/h (1.10)")
    p.add_argument("--time-scale", type=float, default=1.0, help="billed hours pass this many times faster than wall time")
    p.add_argument("--boot-seconds", type=float, default=1.0, help="wall seconds a launched or resumed instance boots")
    p.add_argument("--api-key", help="the bearer key clients must send (default: $BILLING_API_KEY)")
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    api_key = args.api_key or os.environ.get("BILLING_API_KEY", "")
    if not api_key:
        parser.error("--api-key (or BILLING_API_KEY) is required: the fake checks bearer auth like the real API")
    for name in ("price_usd_per_hr", "time_scale"):
        if not getattr(args, name) > 0:
            parser.error(f"--{name.replace('_', '-')} must be positive, got {getattr(args, name)}")
    if not 0 <= args.port <= 65535:
        parser.error(f"--port must be 0..65535, got {args.port}")
    import uvicorn

    setup_logging()
    cloud = FakeCloud(
        args.provider, args.instance_id, args.price_usd_per_hr, args.time_scale,
        instance_type=args.instance_type, boot_seconds=args.boot_seconds,
    )
    logging.getLogger("x1.fake_billing").info(
        "fake %s billing API on http://%s:%d: instance %s at $%.2f/h, time scale %g",
        args.provider, args.host, args.port, args.instance_id, args.price_usd_per_hr, args.time_scale,
    )
    # A held request (fault "timeout") must not hold the shutdown up for long.
    uvicorn.run(create_app(cloud, api_key), host=args.host, port=args.port, log_level="warning",
                timeout_graceful_shutdown=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
