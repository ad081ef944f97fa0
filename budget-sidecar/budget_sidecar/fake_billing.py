"""A stand-in for the Lambda Cloud and RunPod APIs, for `make test` and `make demo` (docs/DESIGN.md §7).

    python -m budget_sidecar.fake_billing --host 127.0.0.1 --port 8790 --provider lambda \\
        --instance-id i-0001 --price-usd-per-hr 1.10 --time-scale 360 --api-key test-key

It serves the request and response shapes the real APIs document (Lambda Cloud v1 REST, RunPod
GraphQL) behind bearer auth, so `x1_common.providers` talks to it exactly as it talks to the real
thing, plus an unauthenticated test control plane meant for 127.0.0.1 only:

    POST /_control {"price_usd_per_hr": 3.3}        the price from now on (with "instance_id": that
                                                    instance's own price; the others keep theirs)
                   {"vanish": true, "instance_id": "i-2"}  the API forgets the instance (404, no pod)
                   {"fail_mode": "none"|"500"|"timeout"|"garbage"}
                   {"preempt": true}  {"terminate": true}   (optionally with "instance_id")
    GET  /_state   billed hours and dollars, statuses, the terminate / launch / resume calls received

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
DEFAULT_TYPES = {"lambda": "gpu_1x_a100_sxm4", "runpod": "NVIDIA A100 80GB PCIe"}

# Other instance types the Lambda listing shows beside the fake instance's own (fixed prices).
LAMBDA_OTHER_TYPES = {
    "gpu_1x_h100_sxm5": ("1x H100 (80 GB SXM5)", 329, 26, 225),
    "gpu_1x_a10": ("1x A10 (24 GB PCIe)", 75, 30, 200),
    "gpu_8x_a100_80gb_sxm4": ("8x A100 (80 GB SXM4)", 1432, 240, 1800),
}
# RunPod's markets against spot (the fake's price): what runpod_gpu_types lists and a created pod bills.
RUNPOD_MARKET_FACTOR = {"COMMUNITY": 1.4, "SECURE": 1.7, "ALL": 1.4}
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
        return inst.status in ("active", "booting", "unhealthy", "RUNNING")

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
        known = {"price_usd_per_hr", "fail_mode", "preempt", "terminate", "vanish", "instance_id", "time_scale"}
        unknown = set(body) - known
        if unknown:
            raise ValueError(f"unknown control field(s): {', '.join(sorted(unknown))} (known: {', '.join(sorted(known))})")
        with self.lock:
            self.advance()
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
                        "status": i.status,
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
            }

    # --- Lambda -----------------------------------------------------------------------------
    def lambda_type(self, name: str, price: float | None = None) -> dict[str, Any]:
        """The type's record; `price`: an instance's own price for its type (default the cloud's)."""
        if name == self.instance_type:
            cents, desc, vcpus, mem = round((self.price if price is None else price) * 100), "1x A100 (80 GB SXM4)", 30, 200
        else:
            desc, cents, vcpus, mem = LAMBDA_OTHER_TYPES[name]
        gpus = int(desc.split("x", 1)[0])
        return {
            "name": name,
            "description": desc,
            "gpu_description": desc.split(" ", 1)[1].strip("()") if " " in desc else desc,
            "price_cents_per_hour": cents,  # an integer, as Lambda sends it
            "specs": {"vcpus": vcpus, "memory_gib": mem, "storage_gib": 512, "gpus": gpus},
        }

    def lambda_instance(self, inst: FakeInstance) -> dict[str, Any]:
        address = self.address(inst) if inst.status == "active" else None
        record = {
            "id": inst.id,
            "name": inst.name,
            "private_ip": "10.0.0.10",
            "status": inst.status,
            "hostname": f"{inst.id[:8]}.cloud.example",
            "ssh_key_names": inst.ssh_key_names,
            "file_system_names": inst.file_system_names,
            "region": {"name": inst.region, "description": "Virginia, USA"},
            "instance_type": self.lambda_type(inst.instance_type, self.price_of(inst)),
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
        return {
            "id": inst.id,
            "name": inst.name,
            "costPerHr": round(self.price_of(inst), 4),
            "desiredStatus": inst.status,
            "lastStatusChange": inst.last_status_change,
            "gpuCount": 1,
            "imageName": "nvcr.io/nvidia/pytorch:24.10-py3",
            "machineId": "m-fake",
            "machine": {"gpuDisplayName": "A100 PCIe", "podHostId": f"{inst.id}-host"},
            # No runtime while the container starts or when the pod is not running (as RunPod does).
            "runtime": {"uptimeInSeconds": int(inst.uptime_s), "ports": ports, "gpus": [{"id": "GPU-0"}]} if running else None,
        }

    def runpod_create(self, spec: Any) -> FakeInstance:
        """podFindAndDeployOnDemand: a new pod of `gpuTypeId`, RUNNING (its container starting)."""
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
        env = {}
        for item in spec.get("env") or []:
            if isinstance(item, dict) and isinstance(item.get("key"), str):
                env[item["key"]] = str(item.get("value", ""))
        now = self.clock()
        new = FakeInstance(
            id=uuid.uuid4().hex[:14], name=str(spec.get("name") or "x1"), instance_type=spec["gpuTypeId"],
            region=self.region, status="RUNNING", last_wall=now, boot_until=now + self.boot_seconds,
            last_status_change=f"Rented by User: {time.ctime(now)}", price_factor=RUNPOD_MARKET_FACTOR[market],
        )
        self.instances[new.id] = new
        # The record of the call, without the env's values (a pod's env may carry keys).
        self.create_calls.append({**{k: v for k, v in spec.items() if k != "env"}, "env_keys": sorted(env),
                                  "instance_id": new.id})
        self.machine("create", new, env, spec.get("dockerArgs") or None)
        return new

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


def runpod_graphql(cloud: FakeCloud, query: str, variables: dict[str, Any]) -> dict[str, Any]:
    """The response body of one GraphQL request (always HTTP 200, as GraphQL servers do)."""
    with cloud.lock:
        cloud.advance()
        pod_id = _arg(_POD_ID, query, variables)
        inst = cloud.instances.get(pod_id) if pod_id else None
        if "podTerminate" in query:
            if inst is None:
                return {**_graphql_error("Pod not found"), "data": {"podTerminate": None}}
            cloud.terminate_calls.append(inst.id)
            cloud._terminate(inst)
            return {"data": {"podTerminate": None}}  # the mutation returns Void
        if "podResume" in query or "podStop" in query:
            op = "podResume" if "podResume" in query else "podStop"
            if inst is None or inst.status == "TERMINATED":
                return {**_graphql_error("Pod not found"), "data": {op: None}}
            if op == "podStop":
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
            return {"data": {op: cloud.runpod_pod(inst)}}
        if "podFindAndDeployOnDemand" in query:
            try:
                new = cloud.runpod_create(variables.get("input"))
            except ValueError as e:
                return {**_graphql_error(str(e)), "data": {"podFindAndDeployOnDemand": None}}
            return {"data": {"podFindAndDeployOnDemand": cloud.runpod_pod(new)}}
        if "gpuTypes" in query:
            return {"data": {"gpuTypes": cloud.runpod_gpu_types()}}
        if re.search(r"\bpod\s*\(", query):
            if inst is None:
                return {**_graphql_error(f"Pod {pod_id} not found"), "data": {"pod": None}}
            return {"data": {"pod": cloud.runpod_pod(inst)}}
        if "myself" in query:
            running = [i for i in cloud.instances.values() if i.status == "RUNNING"]
            spent = sum(i.billed_usd for i in cloud.instances.values())
            return {"data": {"myself": {
                "clientBalance": round(100.0 - spent, 4), "currentSpendPerHr": cloud.price * len(running),
            }}}
        return _graphql_error("Cannot query this field on the fake billing API", "GRAPHQL_VALIDATION_FAILED")


# --------------------------------------------------------------------------------------------
# HTTP


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

    async def gate(request: Request) -> Response | None:
        """The fail mode, then bearer auth: what every provider route passes first."""
        with cloud.lock:
            cloud.requests += 1
            mode = cloud.fail_mode
        if mode == "timeout":
            # Hold the request until the client gives up (or the test ends the outage).
            deadline = time.monotonic() + 60.0
            while cloud.fail_mode == "timeout" and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            return provider_error(504, "global/timeout", "Gateway timeout")
        if mode == "500":
            if cloud.provider == "lambda":
                return provider_error(500, "global/unknown", "Unknown error.")
            return provider_error(500, "INTERNAL_SERVER_ERROR", "Something went wrong. Please try again later or contact support.")
        if mode == "garbage":
            return Response('{"data": {"id": "i-', media_type="application/json")  # cut short
        if request.headers.get("authorization", "") != f"Bearer {api_key}":
            with cloud.lock:
                cloud.auth_failures += 1
            if cloud.provider == "lambda":
                return provider_error(401, "global/invalid-api-key", "API key was invalid, expired, or deleted.")
            return provider_error(401, "UNAUTHENTICATED", "Unauthorized: invalid API key")
        return None

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
            with cloud.lock:
                cloud.advance()
                inst = cloud.instances.get(instance_id)
                if inst is None:
                    return provider_error(404, "global/object-does-not-exist", "Specified instance does not exist.")
                return JSONResponse({"data": cloud.lambda_instance(inst)})

        @app.get("/api/v1/instances")
        async def lambda_list_instances(request: Request) -> Response:
            if (failed := await gate(request)) is not None:
                return failed
            with cloud.lock:
                cloud.advance()
                live = [cloud.lambda_instance(i) for i in cloud.instances.values() if i.status != "terminated"]
                return JSONResponse({"data": live})

        @app.get("/api/v1/instance-types")
        async def lambda_instance_types(request: Request) -> Response:
            if (failed := await gate(request)) is not None:
                return failed
            with cloud.lock:
                return JSONResponse({"data": cloud.lambda_instance_types()})

        @app.post("/api/v1/instance-operations/terminate")
        async def lambda_terminate(request: Request) -> Response:
            if (failed := await gate(request)) is not None:
                return failed
            body = await json_body(request)
            ids = body.get("instance_ids") if body else None
            if not isinstance(ids, list) or not ids:
                return provider_error(400, "global/invalid-parameters", "instance_ids must be a non-empty list")
            with cloud.lock:
                cloud.advance()
                missing = [i for i in ids if i not in cloud.instances]
                if missing:
                    return provider_error(404, "global/object-does-not-exist", f"Instance {missing[0]} does not exist.")
                done = []
                for i in ids:
                    cloud.terminate_calls.append(i)
                    cloud._terminate(cloud.instances[i])
                    done.append(cloud.lambda_instance(cloud.instances[i]))
                return JSONResponse({"data": {"terminated_instances": done}})

        @app.post("/api/v1/instance-operations/launch")
        async def lambda_launch(request: Request) -> Response:
            if (failed := await gate(request)) is not None:
                return failed
            body = await json_body(request)
            if body is None:
                return provider_error(400, "global/invalid-parameters", "body must be a JSON object")
            with cloud.lock:
                cloud.advance()
                try:
                    new_id = cloud.lambda_launch(body)
                except ValueError as e:
                    return provider_error(400, "global/invalid-parameters", str(e))
            return JSONResponse({"data": {"instance_ids": [new_id]}})

    else:

        @app.post("/graphql")
        async def graphql(request: Request) -> Response:
            if (failed := await gate(request)) is not None:
                return failed
            body = await json_body(request)
            if body is None or not isinstance(body.get("query"), str):
                return JSONResponse(_graphql_error("Must provide query string.", "BAD_USER_INPUT"), status_code=400)
            variables = body.get("variables") if isinstance(body.get("variables"), dict) else {}
            return JSONResponse(runpod_graphql(cloud, body["query"], variables))

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
    uvicorn.run(create_app(cloud, api_key), host=args.host, port=args.port, log_level="warning")
    return 0


if __name__ == "__main__":
    sys.exit(main())
