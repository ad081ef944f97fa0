"""The fake billing API serves the providers' real shapes, checks bearer auth, fails on demand and
bills time-scaled hours. Most tests drive the app in-process with a hand-moved clock; the last ones
run it as a real process on 127.0.0.1."""

from __future__ import annotations

import json
import time

import pytest
from fastapi.testclient import TestClient

from budget_sidecar.fake_billing import FakeCloud, create_app
from budget_sidecar.testing import FakeBilling, http_json
from x1_common.providers import parse_lambda_instance, parse_runpod_pod

KEY = "fake-key-7f3a9c"
AUTH = {"Authorization": f"Bearer {KEY}"}
POD_QUERY = "query Pod($podId: String!) { pod(input: {podId: $podId}) { id costPerHr desiredStatus runtime { uptimeInSeconds } } }"


class Clock:
    def __init__(self) -> None:
        self.t = 1_000_000.0

    def __call__(self) -> float:
        return self.t


def make(provider: str, *, price: float = 1.10, scale: float = 3600.0) -> tuple[FakeCloud, TestClient, Clock]:
    clock = Clock()
    cloud = FakeCloud(provider, "inst-1", price, scale, boot_seconds=5.0, clock=clock)
    return cloud, TestClient(create_app(cloud, KEY)), clock


def pod(client: TestClient, pod_id: str = "inst-1") -> dict:
    r = client.post("/graphql", json={"query": POD_QUERY, "variables": {"podId": pod_id}}, headers=AUTH)
    assert r.status_code == 200, r.text
    return r.json()


def test_lambda_instance_has_the_documented_shape() -> None:
    _, client, _ = make("lambda")
    r = client.get("/api/v1/instances/inst-1", headers=AUTH)
    assert r.status_code == 200
    data = r.json()["data"]
    assert data["id"] == "inst-1" and data["status"] == "active"
    assert data["instance_type"]["name"] == "gpu_1x_a100_sxm4"
    assert data["instance_type"]["price_cents_per_hour"] == 110 and isinstance(data["instance_type"]["price_cents_per_hour"], int)
    assert data["region"]["name"] == "us-east-1"
    assert "uptime" not in json.dumps(data)  # Lambda reports no uptime: the sidecar measures it
    inst = parse_lambda_instance(data)
    assert (inst.status, inst.price_usd_per_hr) == ("running", 1.10)


def test_lambda_unknown_instance_is_404_in_lambda_error_shape() -> None:
    _, client, _ = make("lambda")
    r = client.get("/api/v1/instances/nope", headers=AUTH)
    assert r.status_code == 404
    assert r.json()["error"]["code"] == "global/object-does-not-exist"


@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer wrong-key"}, {"Authorization": KEY}])
def test_lambda_rejects_a_missing_or_bad_key_with_401(headers: dict) -> None:
    cloud, client, _ = make("lambda")
    r = client.get("/api/v1/instances/inst-1", headers=headers)
    assert r.status_code == 401
    err = r.json()["error"]
    assert err["code"] == "global/invalid-api-key" and err["message"] and err["suggestion"]
    assert KEY not in r.text
    assert cloud.state()["auth_failures"] == 1


def test_runpod_rejects_a_bad_key_with_401_and_a_graphql_error_list() -> None:
    _, client, _ = make("runpod")
    r = client.post("/graphql", json={"query": POD_QUERY, "variables": {"podId": "inst-1"}},
                    headers={"Authorization": "Bearer nope"})
    assert r.status_code == 401
    assert r.json()["errors"][0]["message"]


def test_lambda_instance_types_list_prices_in_cents() -> None:
    cloud, client, _ = make("lambda", price=1.29)
    data = client.get("/api/v1/instance-types", headers=AUTH).json()["data"]
    entry = data["gpu_1x_a100_sxm4"]
    assert entry["instance_type"]["price_cents_per_hour"] == 129
    assert entry["regions_with_capacity_available"][0]["name"] == "us-east-1"
    cloud.control({"price_usd_per_hr": 3.3})
    assert client.get("/api/v1/instance-types", headers=AUTH).json()["data"]["gpu_1x_a100_sxm4"]["instance_type"][
        "price_cents_per_hour"] == 330


def test_runpod_pod_has_the_documented_shape() -> None:
    _, client, clock = make("runpod", scale=1.0)
    clock.t += 90
    p = pod(client)["data"]["pod"]
    assert p["id"] == "inst-1" and p["desiredStatus"] == "RUNNING"
    assert p["costPerHr"] == pytest.approx(1.10)
    assert p["runtime"]["uptimeInSeconds"] == 90


def test_runpod_unknown_pod_answers_errors_with_a_null_pod() -> None:
    _, client, _ = make("runpod")
    body = pod(client, "missing")
    assert body["data"]["pod"] is None and body["errors"]


def test_billing_integrates_the_price_over_time_scaled_hours() -> None:
    cloud, _, clock = make("lambda", price=1.10, scale=3600.0)  # one wall second bills one hour
    clock.t += 2.0
    s = cloud.state()
    assert s["billed_hours"] == pytest.approx(2.0)
    assert s["billed_usd"] == pytest.approx(2.20)
    cloud.control({"price_usd_per_hr": 3.3})
    clock.t += 1.0
    assert cloud.state()["billed_usd"] == pytest.approx(2.20 + 3.30)


@pytest.mark.parametrize("provider", ["lambda", "runpod"])
def test_several_instances_bill_each_its_own_price_and_one_can_vanish_from_the_api(provider: str) -> None:
    clock = Clock()
    cloud = FakeCloud(provider, "inst-a,inst-b", 1.10, 3600.0, clock=clock)
    client = TestClient(create_app(cloud, KEY))
    cloud.control({"price_usd_per_hr": 3.3, "instance_id": "inst-b"})  # inst-b alone
    clock.t += 1.0
    s = cloud.state()["instances"]
    assert {i: (v["price_usd_per_hr"], v["billed_usd"]) for i, v in s.items()} == {
        "inst-a": (1.10, pytest.approx(1.10)), "inst-b": (3.3, pytest.approx(3.3))}
    if provider == "lambda":
        r = client.get("/api/v1/instances/inst-b", headers=AUTH)
        assert parse_lambda_instance(r.json()["data"]).price_usd_per_hr == pytest.approx(3.3)
    else:
        assert parse_runpod_pod(pod(client, "inst-b")["data"]["pod"]).price_usd_per_hr == pytest.approx(3.3)
    cloud.control({"vanish": True, "instance_id": "inst-b"})
    if provider == "lambda":
        assert client.get("/api/v1/instances/inst-b", headers=AUTH).status_code == 404
        assert client.get("/api/v1/instances/inst-a", headers=AUTH).status_code == 200
    else:
        assert pod(client, "inst-b")["data"]["pod"] is None and pod(client, "inst-a")["data"]["pod"]
    assert client.post("/_control", json={"vanish": True}).status_code == 400  # which one, named


def test_fail_mode_500_answers_server_errors_in_the_provider_shape() -> None:
    cloud, client, _ = make("lambda")
    cloud.control({"fail_mode": "500"})
    r = client.get("/api/v1/instances/inst-1", headers=AUTH)
    assert r.status_code == 500 and r.json()["error"]["code"] == "global/unknown"
    cloud.control({"fail_mode": "none"})
    assert client.get("/api/v1/instances/inst-1", headers=AUTH).status_code == 200


def test_fail_mode_500_on_runpod_is_a_graphql_error_list() -> None:
    cloud, client, _ = make("runpod")
    cloud.control({"fail_mode": "500"})
    r = client.post("/graphql", json={"query": POD_QUERY, "variables": {"podId": "inst-1"}}, headers=AUTH)
    assert r.status_code == 500
    assert r.json()["errors"][0]["extensions"]["code"] == "INTERNAL_SERVER_ERROR"


def test_fail_mode_garbage_answers_200_with_a_body_that_is_not_json() -> None:
    cloud, client, _ = make("lambda")
    cloud.control({"fail_mode": "garbage"})
    r = client.get("/api/v1/instances/inst-1", headers=AUTH)
    assert r.status_code == 200
    with pytest.raises(ValueError):
        json.loads(r.text)


def test_preempt_shows_preempted_on_lambda_and_stops_billing() -> None:
    cloud, client, clock = make("lambda")
    clock.t += 1.0
    cloud.control({"preempt": True})
    billed = cloud.state()["billed_usd"]
    clock.t += 5.0
    assert cloud.state()["billed_usd"] == pytest.approx(billed)
    data = client.get("/api/v1/instances/inst-1", headers=AUTH).json()["data"]
    assert data["status"] == "preempted"
    assert parse_lambda_instance(data).status == "preempted"


def test_preempt_on_runpod_is_an_exited_pod_without_runtime_read_as_preempted() -> None:
    cloud, client, _ = make("runpod")
    cloud.control({"preempt": True})
    p = pod(client)["data"]["pod"]
    assert p["desiredStatus"] == "EXITED" and p["runtime"] is None
    assert parse_runpod_pod(p).status == "preempted"


def test_runpod_resume_restarts_the_pod_with_uptime_from_zero() -> None:
    cloud, client, clock = make("runpod", scale=1.0)
    clock.t += 100
    cloud.control({"preempt": True})
    r = client.post("/graphql", headers=AUTH, json={
        "query": "mutation { podResume(input: {podId: \"inst-1\", gpuCount: 1}) { id desiredStatus } }"})
    assert r.json()["data"]["podResume"]["desiredStatus"] == "RUNNING"
    assert pod(client)["data"]["pod"]["runtime"] is None  # still booting
    clock.t += 10
    assert pod(client)["data"]["pod"]["runtime"]["uptimeInSeconds"] == 10
    assert cloud.state()["resume_calls"] == [{"pod_id": "inst-1", "gpu_count": 1}]


def test_terminate_through_the_api_is_recorded_and_stops_billing() -> None:
    cloud, client, clock = make("lambda")
    r = client.post("/api/v1/instance-operations/terminate", headers=AUTH, json={"instance_ids": ["inst-1"]})
    assert r.status_code == 200
    assert r.json()["data"]["terminated_instances"][0]["status"] == "terminated"
    before = cloud.state()["billed_usd"]
    clock.t += 10
    s = cloud.state()
    assert s["terminate_calls"] == ["inst-1"] and s["billed_usd"] == pytest.approx(before)
    assert s["instances"]["inst-1"]["status"] == "terminated"


def test_runpod_pod_terminate_returns_void_and_marks_the_pod_terminated() -> None:
    cloud, client, _ = make("runpod")
    r = client.post("/graphql", headers=AUTH, json={
        "query": "mutation T($podId: String!) { podTerminate(input: {podId: $podId}) }", "variables": {"podId": "inst-1"}})
    assert r.json() == {"data": {"podTerminate": None}}
    assert pod(client)["data"]["pod"]["desiredStatus"] == "TERMINATED"
    assert cloud.state()["terminate_calls"] == ["inst-1"]


def test_lambda_launch_gives_a_new_instance_that_boots_then_becomes_active() -> None:
    cloud, client, clock = make("lambda")
    r = client.post("/api/v1/instance-operations/launch", headers=AUTH, json={
        "region_name": "us-east-1", "instance_type_name": "gpu_1x_a100_sxm4", "ssh_key_names": ["me"]})
    new_id = r.json()["data"]["instance_ids"][0]
    assert new_id != "inst-1"
    assert client.get(f"/api/v1/instances/{new_id}", headers=AUTH).json()["data"]["status"] == "booting"
    clock.t += 6.0
    assert client.get(f"/api/v1/instances/{new_id}", headers=AUTH).json()["data"]["status"] == "active"
    assert cloud.state()["launch_calls"][0]["instance_id"] == new_id


def test_lambda_launch_of_an_unknown_type_is_400_naming_it() -> None:
    _, client, _ = make("lambda")
    r = client.post("/api/v1/instance-operations/launch", headers=AUTH,
                    json={"region_name": "us-east-1", "instance_type_name": "gpu_9x_imaginary"})
    assert r.status_code == 400 and "gpu_9x_imaginary" in r.json()["error"]["message"]


@pytest.mark.parametrize("body, field", [
    ({"fail_mode": "sometimes"}, "fail_mode"),
    ({"price_usd_per_hr": -1}, "price_usd_per_hr"),
    ({"preempt": True, "instance_id": "ghost"}, "instance_id"),
    ({"colour": "blue"}, "colour"),
])
def test_control_rejects_bad_requests_naming_the_field(body: dict, field: str) -> None:
    _, client, _ = make("lambda")
    r = client.post("/_control", json=body)
    assert r.status_code == 400 and field in r.json()["detail"]


# --- as a real process ------------------------------------------------------------------------


@pytest.fixture
def lambda_fake(tmp_path):
    fake = FakeBilling.start(tmp_path, provider="lambda", instance_id="inst-1", api_key=KEY, time_scale=3600.0)
    yield fake
    fake.stop()


def test_fake_process_bills_hours_time_scale_times_faster_than_wall_time(lambda_fake: FakeBilling) -> None:
    s0, t0 = lambda_fake.state(), time.monotonic()
    time.sleep(1.5)
    s1, t1 = lambda_fake.state(), time.monotonic()
    hours = s1["billed_hours"] - s0["billed_hours"]
    # 3600x: each wall second bills an hour (slack for the two HTTP round trips on a busy machine).
    assert 1.4 <= hours <= (t1 - t0) + 0.5
    assert s1["billed_usd"] - s0["billed_usd"] == pytest.approx(hours * 1.10, rel=1e-6)


def test_fake_process_timeout_mode_holds_requests_until_the_outage_ends(lambda_fake: FakeBilling) -> None:
    import urllib.error
    import urllib.request

    lambda_fake.control(fail_mode="timeout")
    req = urllib.request.Request(lambda_fake.url + "/api/v1/instances/inst-1", headers=AUTH)
    t0 = time.monotonic()
    with pytest.raises((TimeoutError, urllib.error.URLError)):
        urllib.request.urlopen(req, timeout=1.0)
    assert time.monotonic() - t0 >= 0.9
    lambda_fake.control(fail_mode="none")
    assert http_json(lambda_fake.url + "/_state")["fail_mode"] == "none"
    with urllib.request.urlopen(req, timeout=10) as resp:
        assert json.loads(resp.read())["data"]["status"] == "active"


# --- misbehaving on demand, as real APIs do ----------------------------------------------------------------

LAUNCH = {"region_name": "us-east-1", "instance_type_name": "gpu_1x_a100_sxm4", "name": "x1-t"}


def test_a_fault_after_the_create_creates_and_loses_the_answer_once() -> None:
    cloud, client, _ = make("lambda")
    cloud.control({"fault": {"mode": "502-html", "on": "create", "when": "after", "count": 1}})
    r = client.post("/api/v1/instance-operations/launch", json=LAUNCH, headers=AUTH)
    assert r.status_code == 502 and r.headers["content-type"].startswith("text/html") and "Bad Gateway" in r.text
    assert len(cloud.launch_calls) == 1 and len(cloud.instances) == 2  # created all the same
    assert client.get("/api/v1/instances/inst-1", headers=AUTH).status_code == 200  # other operations untouched
    assert client.post("/api/v1/instance-operations/launch", json=LAUNCH, headers=AUTH).status_code == 200  # count used
    assert cloud.state()["faults_hit"] == [{"op": "create", "mode": "502-html", "when": "after"}]


def test_a_fault_before_the_operation_does_not_do_it() -> None:
    cloud, client, _ = make("runpod")
    cloud.control({"fault": {"mode": "404-html", "on": "terminate"}})
    r = client.post("/graphql", headers=AUTH, json={
        "query": "mutation T($podId: String!) { podTerminate(input: {podId: $podId}) }", "variables": {"podId": "inst-1"}})
    assert r.status_code == 404 and "<html>" in r.text
    assert cloud.terminate_calls == [] and pod(client)["data"]["pod"]["desiredStatus"] == "RUNNING"


@pytest.mark.parametrize("provider", ["lambda", "runpod"])
def test_a_terminate_answered_ok_can_leave_the_instance_running_or_end_it_later(provider: str) -> None:
    cloud, client, clock = make(provider)
    cloud.control({"terminate_effect": {"mode": "ignore", "count": 1}})
    cloud.request_terminate(cloud.instances["inst-1"])
    assert cloud.state()["instances"]["inst-1"]["billing"]  # answered ok, still running
    cloud.control({"terminate_effect": {"mode": "async", "delay_s": 10}})
    with cloud.lock:
        cloud.request_terminate(cloud.instances["inst-1"])
    assert cloud.state()["instances"]["inst-1"]["status"] == ("terminating" if provider == "lambda" else "RUNNING")
    clock.t += 11
    assert cloud.state()["instances"]["inst-1"]["status"] == ("terminated" if provider == "lambda" else "TERMINATED")


def test_a_misreport_shows_another_id_type_and_price_but_bills_the_real_one() -> None:
    cloud, client, clock = make("lambda")
    cloud.control({"misreport": {"instance_id": "inst-1", "id": "other-9", "instance_type": "gpu_1x_a10",
                                 "price_usd_per_hr": 0.75}})
    data = client.get("/api/v1/instances/inst-1", headers=AUTH).json()["data"]
    assert data["id"] == "other-9" and data["instance_type"]["name"] == "gpu_1x_a10"
    assert data["instance_type"]["price_cents_per_hour"] == 75
    clock.t += 3600 / 3600.0  # one billed hour at the fake's scale
    assert cloud.state()["instances"]["inst-1"]["billed_usd"] == pytest.approx(1.10)
    cloud.control({"reset": True})
    assert cloud.state()["instances"] == {} and cloud.misreports == {}


def test_runpod_lists_the_accounts_pods_and_rents_an_interruptible_one_at_its_bid() -> None:
    cloud, client, _ = make("runpod")
    spec = {"gpuTypeId": "NVIDIA A100 80GB PCIe", "imageName": "runpod/base:1.0.2-ubuntu2204", "name": "x1-i",
            "cloudType": "COMMUNITY", "bidPerGpu": 1.0, "minCudaVersion": "13.0"}
    query = "mutation D($input: PodRentInterruptableInput!) { podRentInterruptable(input: $input) { id } }"
    low = client.post("/graphql", headers=AUTH, json={"query": query, "variables": {"input": spec}}).json()
    assert "under the spot price" in low["errors"][0]["message"]
    spec["bidPerGpu"] = 1.10
    made = client.post("/graphql", headers=AUTH, json={"query": query, "variables": {"input": spec}}).json()
    new = made["data"]["podRentInterruptable"]["id"]
    assert cloud.create_calls[-1]["operation"] == "podRentInterruptable" and cloud.create_calls[-1]["minCudaVersion"] == "13.0"
    pods = client.post("/graphql", headers=AUTH, json={"query": "query { myself { pods { id name } } }"}).json()
    assert {p["id"] for p in pods["data"]["myself"]["pods"]} == {"inst-1", new}
