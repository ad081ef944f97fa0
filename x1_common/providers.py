"""Clients for the two GPU clouds X1 rents from: Lambda Cloud (REST v1) and RunPod (GraphQL).

    client = make_client("lambda", api_url=None, api_key=api_key_from_env("lambda"))
    inst = client.get_instance("0920582c7ff041399e34823a0be62549")
    inst.status, inst.price_usd_per_hr        # "running", 1.1

Used by the budget sidecar (price and uptime), the price check, and the watchdog's provider mode
(is the instance preempted? relaunch or resume it; terminate it at the end). Both clients retry
429, 5xx, timeouts and connection errors a bounded number of times with exponential backoff, and
Lambda's client never sends more than one request per second (its documented rate limit).

`api_url` is the provider's base URL without the API path, so the fake billing API of the tests
(`python -m budget_sidecar.fake_billing`) is addressed exactly like the real one. The API key
travels only in the Authorization header: no message, log line or exception built here contains it.
"""

from __future__ import annotations

import logging
import math
import os
import re
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import httpx

from x1_common.contracts import LAMBDA_NOT_FOUND_CODE

log = logging.getLogger("x1.providers")

LAMBDA_API_URL = "https://cloud.lambda.ai"
RUNPOD_API_URL = "https://api.runpod.io"
PROVIDERS = ("lambda", "runpod")
API_KEY_ENV = {"lambda": "LAMBDA_API_KEY", "runpod": "RUNPOD_API_KEY"}

# Normalized instance states, the same words for both clouds.
STATUSES = ("running", "booting", "preempted", "terminating", "terminated", "stopped", "unhealthy", "unknown")
# States in which the provider bills (or may bill) the GPU by the hour. "terminating" is Lambda's
# word for a terminate under way: the instance is not gone until the provider says "terminated".
BILLING_STATUSES = frozenset({"running", "booting", "unhealthy", "terminating", "unknown"})

_LAMBDA_STATUS = {
    "active": "running",
    "booting": "booting",
    "unhealthy": "unhealthy",
    "terminating": "terminating",
    "terminated": "terminated",
    "preempted": "preempted",
}


class ProviderError(Exception):
    """A provider call that did not give a usable answer. Never contains the API key.

    `kind` is one of: auth, not-found, bad-request, rate-limit, server, timeout, network, garbage.
    "not-found" is only ever the API's own answer, recognized by the provider's error shape
    (Lambda's {"error": {"code": "global/object-does-not-exist", ...}}, RunPod's GraphQL errors or
    a null pod): a 404 page from a proxy or a load balancer is "server", an answer that says nothing.
    `api_error` keeps that answer's error object (never the key) for records that must show it.
    """

    def __init__(
        self, message: str, *, kind: str, status_code: int | None = None, retry_after: float | None = None,
        api_error: Any = None,
    ) -> None:
        super().__init__(message)
        self.kind = kind
        self.status_code = status_code
        self.retry_after = retry_after  # seconds, from a 429's Retry-After header
        self.api_error = api_error

    @property
    def retryable(self) -> bool:
        return self.kind in ("rate-limit", "server", "timeout", "network")

    @property
    def unclear(self) -> bool:
        """After such an error a request that changes something may or may not have taken effect
        (the answer was lost, cut short, or not the API's): look before assuming either."""
        return self.kind in ("server", "timeout", "network", "garbage")


@dataclass(frozen=True)
class Instance:
    id: str
    status: str  # normalized, one of STATUSES
    raw_status: str  # as the provider said it
    price_usd_per_hr: float | None
    uptime_seconds: float | None  # RunPod reports it; Lambda does not (None)
    instance_type: str | None
    region: str | None
    raw: dict[str, Any] = field(default_factory=dict, compare=False)  # the provider's record (no secrets)

    @property
    def billing(self) -> bool:
        """True while the provider charges for the GPU."""
        return self.status in BILLING_STATUSES


def api_key_from_env(provider: str, environ: Mapping[str, str] | None = None) -> str:
    """LAMBDA_API_KEY or RUNPOD_API_KEY; ValueError naming the variable when it is unset or empty."""
    env = os.environ if environ is None else environ
    if provider not in API_KEY_ENV:
        raise ValueError(f"provider: {provider!r} has no API key (known: {', '.join(API_KEY_ENV)})")
    name = API_KEY_ENV[provider]
    key = env.get(name, "").strip()
    if not key:
        raise ValueError(f"{name} is not set: the {provider} API key comes from this environment variable")
    return key


def make_client(
    provider: str, api_url: str | None, api_key: str, timeout: float = 10.0, **kw: Any
) -> LambdaClient | RunPodClient:
    """The client for `provider`; `api_url` None means the real API. kw: retries, backoff_s, min_interval_s."""
    if provider == "lambda":
        return LambdaClient(api_url or LAMBDA_API_URL, api_key, timeout=timeout, **kw)
    if provider == "runpod":
        return RunPodClient(api_url or RUNPOD_API_URL, api_key, timeout=timeout, **kw)
    raise ValueError(f"provider: {provider!r} is not one of {', '.join(PROVIDERS)}")


def _number(value: Any) -> float | None:
    """A finite float from a number or a numeric string (RunPod sends costPerHr both ways)."""
    if isinstance(value, bool) or value is None:
        return None
    try:
        x = float(value)
    except (TypeError, ValueError):
        return None
    return x if math.isfinite(x) else None


def _text(value: Any) -> str | None:
    """A non-empty string, or None (a name of another type is not guessed at)."""
    return value if isinstance(value, str) and value else None


class _HttpClient:
    """Bounded retries with backoff, a minimum spacing between requests, and key-free errors."""

    provider = ""

    def __init__(
        self,
        api_url: str,
        api_key: str,
        timeout: float = 10.0,
        *,
        retries: int = 2,
        backoff_s: float = 1.0,
        min_interval_s: float = 0.0,
    ) -> None:
        if not api_url.startswith(("http://", "https://")):
            raise ValueError(f"api_url: {api_url!r} must start with http:// or https://")
        self.api_url = api_url.rstrip("/")
        self._api_key = api_key
        self.timeout = timeout
        self.retries = max(0, retries)
        self.backoff_s = backoff_s
        self.min_interval_s = min_interval_s
        self._last_request = 0.0
        self._spacing = threading.Lock()

    def _scrub(self, text: str) -> str:
        return text.replace(self._api_key, "***") if len(self._api_key) >= 4 else text

    def _wait_turn(self) -> None:
        with self._spacing:
            wait = self._last_request + self.min_interval_s - time.monotonic()
            if wait > 0:
                time.sleep(wait)
            self._last_request = time.monotonic()

    def _once(self, method: str, path: str, body: Any | None) -> Any:
        self._wait_turn()
        url = self.api_url + path
        headers = {"Authorization": f"Bearer {self._api_key}", "Accept": "application/json"}
        try:
            resp = httpx.request(method, url, json=body, headers=headers, timeout=self.timeout)
        except httpx.TimeoutException:
            raise ProviderError(f"{self.provider}: {method} {path} timed out after {self.timeout:g} s", kind="timeout") from None
        except httpx.HTTPError as e:
            raise ProviderError(
                f"{self.provider}: {method} {path} failed: {type(e).__name__}: {self._scrub(str(e))}", kind="network"
            ) from None
        try:
            data = resp.json()
        except ValueError:
            data = None
        if resp.status_code >= 400:
            api_error = self._api_error(data)
            kind = {401: "auth", 403: "auth", 404: "not-found", 429: "rate-limit"}.get(
                resp.status_code, "server" if resp.status_code >= 500 else "bad-request"
            )
            what = self._scrub(self._error_text(data, resp))
            if api_error is None:  # a page of something in between: one line of it
                what = " ".join(what.split())[:200]
            if kind == "not-found" and not self._is_not_found(api_error):
                # Not the API's own "no such thing": a proxy's page, a wrong route. It says nothing
                # about the instance, so it must never read as "gone".
                kind = "server"
                what = (f"not the {self.provider} API's own answer ({resp.headers.get('content-type', 'no content-type')}): "
                        + what[:160])
            raise ProviderError(
                f"{self.provider}: {method} {path} -> HTTP {resp.status_code}: {what}",
                kind=kind,
                status_code=resp.status_code,
                retry_after=_number(resp.headers.get("Retry-After")),
                api_error=api_error,
            )
        if data is None:
            raise ProviderError(
                f"{self.provider}: {method} {path} -> HTTP {resp.status_code} but the body is not JSON "
                f"({resp.headers.get('content-type', 'no content-type')}, {len(resp.content)} bytes)",
                kind="garbage",
                status_code=resp.status_code,
            )
        return data

    def _error_text(self, data: Any, resp: httpx.Response) -> str:
        return resp.text[:200]

    def _api_error(self, data: Any) -> Any:
        """The error object in the provider's own shape, or None when the body is not one."""
        return None

    def _is_not_found(self, api_error: Any) -> bool:
        """True when `api_error` is the API's own "no such object"."""
        return False

    def _request(self, method: str, path: str, body: Any | None = None, *, idempotent: bool = True) -> Any:
        """One call, retried on 429 always and on 5xx / timeouts / network errors when `idempotent`."""
        for attempt in range(self.retries + 1):
            try:
                return self._once(method, path, body)
            except ProviderError as e:
                retry = e.kind == "rate-limit" or (idempotent and e.retryable)
                if not retry or attempt == self.retries:
                    raise
                delay = self.backoff_s * 2**attempt
                if e.retry_after is not None:
                    delay = max(delay, min(e.retry_after, 30.0))
                log.warning("%s (attempt %d of %d); retrying in %.1f s", e, attempt + 1, self.retries + 1, delay)
                time.sleep(delay)
        raise AssertionError("unreachable")


class LambdaClient(_HttpClient):
    """Lambda Cloud API v1 (https://cloud.lambda.ai/api/v1): bearer key, 1 request/s."""

    provider = "lambda"

    def __init__(self, api_url: str = LAMBDA_API_URL, api_key: str = "", timeout: float = 10.0, **kw: Any) -> None:
        kw.setdefault("min_interval_s", 1.0)
        super().__init__(api_url, api_key, timeout, **kw)

    def _error_text(self, data: Any, resp: httpx.Response) -> str:
        # Lambda's errors: {"error": {"code": "global/...", "message": "...", "suggestion": "..."}}
        if isinstance(data, dict) and isinstance(data.get("error"), dict):
            e = data["error"]
            return f"{e.get('code', '?')}: {e.get('message', '')}"
        return resp.text[:200]

    def _api_error(self, data: Any) -> Any:
        e = data.get("error") if isinstance(data, dict) else None
        if isinstance(e, dict) and isinstance(e.get("code"), str):
            return {k: e[k] for k in ("code", "message", "suggestion") if isinstance(e.get(k), str)}
        return None

    def _is_not_found(self, api_error: Any) -> bool:
        return isinstance(api_error, dict) and api_error.get("code") == LAMBDA_NOT_FOUND_CODE

    def _data(self, payload: Any, path: str) -> Any:
        if not isinstance(payload, dict) or "data" not in payload:
            raise ProviderError(f"lambda: {path} answered JSON without a 'data' field", kind="garbage")
        return payload["data"]

    def get_instance(self, instance_id: str) -> Instance:
        path = f"/api/v1/instances/{instance_id}"
        return parse_lambda_instance(self._data(self._request("GET", path), path))

    def list_instances(self) -> list[Instance]:
        """Every instance of the account the API lists (each with its name in `raw["name"]`)."""
        data = self._data(self._request("GET", "/api/v1/instances"), "/api/v1/instances")
        if not isinstance(data, list):
            raise ProviderError("lambda: /api/v1/instances 'data' is not a list", kind="garbage")
        return [parse_lambda_instance(d) for d in data]

    def terminate(self, instance_id: str) -> dict[str, Any]:
        path = "/api/v1/instance-operations/terminate"
        payload = self._request("POST", path, {"instance_ids": [instance_id]})
        self._data(payload, path)
        return payload

    def launch(
        self,
        instance_type: str,
        region: str,
        name: str | None = None,
        ssh_key_names: tuple[str, ...] | list[str] = (),
        file_system_names: tuple[str, ...] | list[str] = (),
        user_data: str | None = None,
    ) -> str:
        """Launch one instance; returns its id. Only a 429 is retried: after a 5xx or a timeout the
        launch may have happened, and a blind retry could rent two GPUs."""
        path = "/api/v1/instance-operations/launch"
        body: dict[str, Any] = {
            "region_name": region,
            "instance_type_name": instance_type,
            "ssh_key_names": list(ssh_key_names),
            "file_system_names": list(file_system_names),
            "quantity": 1,
        }
        if name:
            body["name"] = name
        if user_data:
            body["user_data"] = user_data
        data = self._data(self._request("POST", path, body, idempotent=False), path)
        ids = data.get("instance_ids") if isinstance(data, dict) else None
        if not ids or not isinstance(ids, list):
            raise ProviderError("lambda: launch answered without instance_ids", kind="garbage")
        return str(ids[0])

    def instance_types(self) -> dict[str, GpuOffer]:
        """What Lambda offers, per instance type name, from GET /api/v1/instance-types: the price,
        the GPUs and Lambda's own description of them ("1x A100 (40 GB SXM4)")."""
        path = "/api/v1/instance-types"
        data = self._data(self._request("GET", path), path)
        if not isinstance(data, dict):
            raise ProviderError("lambda: instance-types 'data' is not an object", kind="garbage")
        offers = {}
        for name, entry in data.items():
            it = entry.get("instance_type") if isinstance(entry, dict) else None
            cents = _number(it.get("price_cents_per_hour")) if isinstance(it, dict) else None
            if cents is None or not isinstance(it, dict):
                continue
            specs = it.get("specs") if isinstance(it.get("specs"), dict) else {}
            gpus = specs.get("gpus")
            key = str(it.get("name") or name)
            offers[key] = GpuOffer(
                name=key, price_usd_per_hr=cents / 100.0, gpus=gpus if isinstance(gpus, int) else None,
                description=_text(it.get("description")) or key,
                gpu_description=_text(it.get("gpu_description")) or _text(it.get("description")) or key,
                memory_gb=_memory_gb(_text(it.get("gpu_description")) or _text(it.get("description")) or ""))
        return offers

    def instance_type_prices(self) -> dict[str, float]:
        """$/h per instance type name, from GET /api/v1/instance-types."""
        return {name: offer.price_usd_per_hr for name, offer in self.instance_types().items()}


@dataclass(frozen=True)
class GpuOffer:
    """One instance type (Lambda) or GPU type (RunPod) as the provider describes it."""

    name: str  # the API's name: Lambda's instance type, RunPod's GPU type id
    price_usd_per_hr: float
    gpus: int | None  # GPUs in one instance (Lambda); RunPod prices one GPU
    description: str  # the provider's words: "1x A100 (40 GB SXM4)", "A100 PCIe"
    gpu_description: str  # of one GPU: "A100 (40 GB SXM4)"
    memory_gb: float | None  # of one GPU, from the provider's description or its memoryInGb


def _memory_gb(text: str) -> float | None:
    """The GB figure in a GPU description ("A100 (40 GB SXM4)", "A100 80GB PCIe"), or None."""
    m = re.search(r"(\d+(?:\.\d+)?)\s*GB", text, re.IGNORECASE)
    return float(m.group(1)) if m else None


def parse_lambda_instance(d: Any) -> Instance:
    if not isinstance(d, dict) or "id" not in d or "status" not in d:
        raise ProviderError("lambda: instance record lacks id or status", kind="garbage")
    it = d.get("instance_type") if isinstance(d.get("instance_type"), dict) else {}
    cents = _number(it.get("price_cents_per_hour"))
    region = d.get("region")
    # A status we do not know (or not a string at all) is "unknown", which counts as billing:
    # only a state the provider names as stopped may stop the meter.
    raw_status = d["status"] if isinstance(d["status"], str) else repr(d["status"])[:80]
    return Instance(
        id=str(d["id"]),
        status=_LAMBDA_STATUS.get(raw_status, "unknown"),
        raw_status=raw_status,
        # The price as reported (None when missing or not a finite number); whether it can be
        # trusted (zero, negative, a drop) is the ledger's call, which knows the earlier prices.
        price_usd_per_hr=None if cents is None else cents / 100.0,
        uptime_seconds=None,  # Lambda reports no launch time nor uptime
        instance_type=_text(it.get("name")),
        region=_text(region.get("name")) if isinstance(region, dict) else _text(region),
        raw=d,
    )


_POD_FIELDS = ("id name costPerHr desiredStatus lastStatusChange gpuCount machine { gpuDisplayName } "
               "runtime { uptimeInSeconds ports { ip isIpPublic privatePort publicPort type } }")


class RunPodClient(_HttpClient):
    """RunPod GraphQL API (https://api.runpod.io/graphql): bearer key."""

    provider = "runpod"

    def __init__(self, api_url: str = RUNPOD_API_URL, api_key: str = "", timeout: float = 10.0, **kw: Any) -> None:
        super().__init__(api_url, api_key, timeout, **kw)

    def _error_text(self, data: Any, resp: httpx.Response) -> str:
        return _graphql_errors(data) or resp.text[:200]

    def _api_error(self, data: Any) -> Any:
        errors = data.get("errors") if isinstance(data, dict) else None
        return errors if isinstance(errors, list) and errors else None

    def _is_not_found(self, api_error: Any) -> bool:
        return isinstance(api_error, list) and "not found" in _graphql_errors({"errors": api_error}).lower()

    def graphql(self, query: str, variables: dict[str, Any] | None = None) -> dict[str, Any]:
        payload = self._request("POST", "/graphql", {"query": query, "variables": variables or {}})
        if not isinstance(payload, dict):
            raise ProviderError("runpod: /graphql answered JSON that is not an object", kind="garbage")
        errors = _graphql_errors(payload)
        if errors:
            # GraphQL reports failures with HTTP 200 and an "errors" list.
            lowered = errors.lower()
            kind = "auth" if "unauthori" in lowered else "not-found" if "not found" in lowered else "bad-request"
            raise ProviderError(f"runpod: {self._scrub(errors)}", kind=kind, api_error=self._api_error(payload))
        data = payload.get("data")
        if not isinstance(data, dict):
            raise ProviderError("runpod: /graphql answered without a 'data' object", kind="garbage")
        return data

    def get_instance(self, instance_id: str) -> Instance:
        data = self.graphql(f"query Pod($podId: String!) {{ pod(input: {{podId: $podId}}) {{ {_POD_FIELDS} }} }}", {"podId": instance_id})
        if "pod" in data and data["pod"] is None:
            # The GraphQL API's own answer for an id it does not know (a terminated pod is soon one).
            raise ProviderError(f"runpod: pod {instance_id} not found", kind="not-found",
                                api_error={"data": {"pod": None}})
        return parse_runpod_pod(data.get("pod"))

    def list_instances(self) -> list[Instance]:
        """Every pod of the account (myself { pods }), each with its name in `raw["name"]`."""
        data = self.graphql(f"query Pods {{ myself {{ pods {{ {_POD_FIELDS} }} }} }}")
        myself = data.get("myself")
        pods = myself.get("pods") if isinstance(myself, dict) else None
        if not isinstance(pods, list):
            raise ProviderError("runpod: myself.pods is not a list", kind="garbage")
        return [parse_runpod_pod(p) for p in pods]

    def terminate(self, instance_id: str) -> dict[str, Any]:
        data = self.graphql("mutation Terminate($podId: String!) { podTerminate(input: {podId: $podId}) }", {"podId": instance_id})
        return {"data": data}

    def stop(self, instance_id: str) -> dict[str, Any]:
        data = self.graphql(
            "mutation Stop($podId: String!) { podStop(input: {podId: $podId}) { id desiredStatus } }", {"podId": instance_id}
        )
        return {"data": data}

    def resume(self, instance_id: str, gpu_count: int = 1) -> dict[str, Any]:
        """podResume: restarts a stopped or interrupted pod on its machine (uptime starts again from 0)."""
        data = self.graphql(
            "mutation Resume($podId: String!, $gpuCount: Int!) "
            "{ podResume(input: {podId: $podId, gpuCount: $gpuCount}) { id desiredStatus costPerHr } }",
            {"podId": instance_id, "gpuCount": gpu_count},
        )
        return {"data": data}

    def create(
        self,
        gpu_type_id: str,
        image_name: str,
        *,
        name: str | None = None,
        cloud_type: str = "ALL",
        gpu_count: int = 1,
        volume_gb: int = 50,
        container_disk_gb: int = 40,
        ports: str = "22/tcp",
        env: Mapping[str, str] | None = None,
        docker_args: str | None = None,
        bid_per_gpu: float | None = None,
        min_cuda_version: str | None = None,
    ) -> Instance:
        """One pod of `gpu_type_id` running `image_name`, with a volume at /workspace: on demand
        (podFindAndDeployOnDemand), or interruptible at `bid_per_gpu` $/h (podRentInterruptable,
        RunPod's spot market). `min_cuda_version` keeps it to hosts whose driver runs that CUDA.
        Like Lambda's launch it is never retried after a 5xx or a timeout (the pod may exist).
        `env` reaches the pod's container (PUBLIC_KEY: the SSH key RunPod's images authorize); its
        values never appear in an error."""
        spec: dict[str, Any] = {
            "cloudType": cloud_type,
            "gpuCount": gpu_count,
            "gpuTypeId": gpu_type_id,
            "imageName": image_name,
            "volumeInGb": volume_gb,
            "containerDiskInGb": container_disk_gb,
            "volumeMountPath": "/workspace",
            "ports": ports,
            "startSsh": True,
            "env": [{"key": k, "value": v} for k, v in (env or {}).items()],
        }
        if name:
            spec["name"] = name
        if docker_args:
            spec["dockerArgs"] = docker_args
        if min_cuda_version:
            spec["minCudaVersion"] = min_cuda_version
        if bid_per_gpu is not None:
            spec["bidPerGpu"] = bid_per_gpu
            operation, input_type = "podRentInterruptable", "PodRentInterruptableInput"
        else:
            operation, input_type = "podFindAndDeployOnDemand", "PodFindAndDeployOnDemandInput"
        payload = self._request(
            "POST", "/graphql",
            {"query": f"mutation Deploy($input: {input_type}!) {{ {operation}(input: $input) "
                      f"{{ {_POD_FIELDS} }} }}",
             "variables": {"input": spec}},
            idempotent=False,
        )
        errors = _graphql_errors(payload)
        if errors:
            lowered = errors.lower()
            kind_ = "auth" if "unauthori" in lowered else "bad-request"
            raise ProviderError(f"runpod: {self._scrub(errors)}", kind=kind_, api_error=self._api_error(payload))
        data = payload.get("data") if isinstance(payload, dict) else None
        pod = data.get(operation) if isinstance(data, dict) else None
        if not isinstance(pod, dict):
            raise ProviderError(f"runpod: {operation} answered without a pod", kind="garbage")
        return parse_runpod_pod(pod)

    def gpu_type_prices(self, market: str = "lowest") -> dict[str, float]:
        """$/h for one GPU, per GPU type id (and display name).

        market: "spot" (community or secure spot, the cheaper), "community", "secure", or "lowest"
        (the cheapest way to rent it now, any market).
        """
        fields = {
            "spot": ("communitySpotPrice", "secureSpotPrice"),
            "community": ("communityPrice",),
            "secure": ("securePrice",),
            "lowest": ("communitySpotPrice", "secureSpotPrice", "communityPrice", "securePrice"),
        }
        if market not in fields:
            raise ValueError(f"market: {market!r} is not one of {', '.join(fields)}")
        prices: dict[str, float] = {}
        for t in self._gpu_types():
            # 0 or null means "not offered in that market now".
            offered = [p for p in (_number(t.get(f)) for f in fields[market]) if p is not None and p > 0]
            if offered:
                for name in (t.get("id"), t.get("displayName")):
                    if name:
                        prices[str(name)] = min(offered)
        return prices

    def gpu_offers(self, price_field: str) -> dict[str, GpuOffer]:
        """Each GPU type id offered at `price_field` (communityPrice, communitySpotPrice, ...), with
        RunPod's own description of it (displayName, memoryInGb)."""
        offers = {}
        for t in self._gpu_types():
            price = _number(t.get(price_field))
            if not t.get("id") or price is None or price <= 0:
                continue
            memory = _number(t.get("memoryInGb"))
            display = _text(t.get("displayName")) or str(t["id"])
            offers[str(t["id"])] = GpuOffer(
                name=str(t["id"]), price_usd_per_hr=price, gpus=1, description=display,
                gpu_description=f"{display} ({memory:g} GB)" if memory else display, memory_gb=memory)
        return offers

    def _gpu_types(self) -> list[dict[str, Any]]:
        data = self.graphql(
            "query GpuTypes { gpuTypes { id displayName memoryInGb securePrice communityPrice "
            "secureSpotPrice communitySpotPrice } }"
        )
        types = data.get("gpuTypes")
        if not isinstance(types, list):
            raise ProviderError("runpod: gpuTypes is not a list", kind="garbage")
        return [t for t in types if isinstance(t, dict)]


def ssh_address(inst: Instance) -> tuple[str, int] | None:
    """Where the instance's SSH server answers, from its record: Lambda's `ip` (port 22), RunPod's
    public TCP mapping of port 22 in `runtime.ports`. None while the provider shows none yet."""
    raw = inst.raw
    if isinstance(raw.get("ip"), str) and raw["ip"]:
        return raw["ip"], 22
    runtime = raw.get("runtime") if isinstance(raw.get("runtime"), dict) else None
    for port in (runtime or {}).get("ports") or []:
        if (isinstance(port, dict) and port.get("privatePort") == 22 and port.get("isIpPublic")
                and isinstance(port.get("ip"), str) and isinstance(port.get("publicPort"), int)):
            return port["ip"], port["publicPort"]
    return None


def _graphql_errors(data: Any) -> str:
    if isinstance(data, dict) and isinstance(data.get("errors"), list):
        return "; ".join(str(e.get("message", e)) if isinstance(e, dict) else str(e) for e in data["errors"])
    return ""


def parse_runpod_pod(d: Any) -> Instance:
    if not isinstance(d, dict) or "id" not in d:
        raise ProviderError("runpod: pod record lacks id", kind="garbage")
    raw_status = d.get("desiredStatus") if isinstance(d.get("desiredStatus"), str) else ""
    runtime = d.get("runtime") if isinstance(d.get("runtime"), dict) else None
    uptime = _number(runtime.get("uptimeInSeconds")) if runtime else None
    if uptime is not None and uptime < 0:
        uptime = None  # not an uptime: the ledger then bills on its own clock
    if raw_status == "RUNNING":
        # desiredStatus says what RunPod aims for; no runtime yet means the container is starting.
        status = "running" if runtime else "booting"
    elif raw_status == "EXITED":
        # RunPod documents no "preempted" state: an interrupted spot pod shows EXITED, and the
        # reason is only in lastStatusChange ("... interrupted ..."); a pod stopped by its owner
        # shows EXITED too.
        reason = (_text(d.get("lastStatusChange")) or "").lower()
        status = "preempted" if ("interrupt" in reason or "preempt" in reason or "spot" in reason) else "stopped"
    elif raw_status in ("TERMINATED", "DEAD"):
        status = "terminated"
    elif raw_status in ("CREATED", "RESTARTING"):
        status = "booting"
    else:
        status = "unknown"
    machine = d.get("machine") if isinstance(d.get("machine"), dict) else {}
    return Instance(
        id=str(d["id"]),
        status=status,
        raw_status=raw_status,
        price_usd_per_hr=_number(d.get("costPerHr")),
        uptime_seconds=uptime,
        instance_type=_text(machine.get("gpuDisplayName")) or _text(d.get("gpuTypeId")),
        region=None,
        raw=d,
    )
