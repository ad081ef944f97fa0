"""The provider clients against the fake billing API as a real process on 127.0.0.1: what they read,
what they send, how they retry, and that no error they raise carries the API key."""

from __future__ import annotations

import threading
import time

import pytest

from budget_sidecar.testing import FakeBilling
from x1_common.providers import (
    LambdaClient,
    ProviderError,
    RunPodClient,
    api_key_from_env,
    make_client,
    parse_lambda_instance,
    parse_runpod_pod,
    ssh_address,
)

KEY = "prov-key-51c0de"


@pytest.fixture(scope="module")
def lambda_fake(tmp_path_factory):
    fake = FakeBilling.start(tmp_path_factory.mktemp("lambda"), provider="lambda", instance_id="i-main",
                             api_key=KEY, boot_seconds=0.5)
    yield fake
    fake.stop()


@pytest.fixture(scope="module")
def runpod_fake(tmp_path_factory):
    fake = FakeBilling.start(tmp_path_factory.mktemp("runpod"), provider="runpod", instance_id="pod-main",
                             api_key=KEY, time_scale=60.0, boot_seconds=0.5)
    yield fake
    fake.stop()


@pytest.fixture(autouse=True)
def healthy(request):
    """Every test starts with the fakes up, at the default price, without a fail mode."""
    for name in ("lambda_fake", "runpod_fake"):
        if name in request.fixturenames:
            request.getfixturevalue(name).control(fail_mode="none", price_usd_per_hr=1.10)


def fast(client):
    client.min_interval_s = 0.0  # tests do not need Lambda's 1 request/s spacing
    client.backoff_s = 0.2
    return client


def test_lambda_client_reads_status_and_price(lambda_fake: FakeBilling) -> None:
    client = fast(make_client("lambda", lambda_fake.url, KEY))
    assert isinstance(client, LambdaClient)
    inst = client.get_instance("i-main")
    assert (inst.id, inst.status, inst.raw_status) == ("i-main", "running", "active")
    assert inst.price_usd_per_hr == pytest.approx(1.10)
    assert inst.uptime_seconds is None and inst.billing
    assert (inst.instance_type, inst.region) == ("gpu_1x_a100_sxm4", "us-east-1")
    lambda_fake.control(price_usd_per_hr=3.3)
    assert client.get_instance("i-main").price_usd_per_hr == pytest.approx(3.3)


def test_lambda_instance_type_prices_are_dollars_per_hour(lambda_fake: FakeBilling) -> None:
    prices = fast(LambdaClient(lambda_fake.url, KEY)).instance_type_prices()
    assert prices["gpu_1x_a100_sxm4"] == pytest.approx(1.10)
    assert prices["gpu_1x_h100_sxm5"] == pytest.approx(3.29)


def test_lambda_launch_returns_a_new_id_that_boots_then_runs_and_terminate_is_recorded(lambda_fake: FakeBilling) -> None:
    client = fast(LambdaClient(lambda_fake.url, KEY))
    new_id = client.launch("gpu_1x_a100_sxm4", "us-east-1", name="x1-relaunch", ssh_key_names=["me"],
                           file_system_names=["x1-fs"])
    assert new_id != "i-main"
    assert client.get_instance(new_id).status == "booting"
    time.sleep(0.7)
    assert client.get_instance(new_id).status == "running"
    reply = client.terminate(new_id)
    assert reply["data"]["terminated_instances"][0]["id"] == new_id
    assert client.get_instance(new_id).status == "terminated"
    state = lambda_fake.state()
    assert state["terminate_calls"][-1] == new_id
    launch = state["launch_calls"][-1]
    assert launch["file_system_names"] == ["x1-fs"] and launch["name"] == "x1-relaunch"


def test_lambda_preempted_instance_is_reported_preempted_and_not_billing(tmp_path) -> None:
    fake = FakeBilling.start(tmp_path, provider="lambda", instance_id="i-p", api_key=KEY)
    try:
        fake.control(preempt=True)
        inst = fast(LambdaClient(fake.url, KEY)).get_instance("i-p")
        assert inst.status == "preempted" and not inst.billing
    finally:
        fake.stop()


def test_runpod_client_reads_cost_and_uptime(runpod_fake: FakeBilling) -> None:
    client = fast(make_client("runpod", runpod_fake.url, KEY))
    assert isinstance(client, RunPodClient)
    inst = client.get_instance("pod-main")
    assert inst.status == "running" and inst.raw_status == "RUNNING"
    assert inst.price_usd_per_hr == pytest.approx(1.10)
    assert inst.uptime_seconds is not None and inst.uptime_seconds >= 0


def test_runpod_gpu_type_prices_by_market(runpod_fake: FakeBilling) -> None:
    client = fast(RunPodClient(runpod_fake.url, KEY))
    assert client.gpu_type_prices()["NVIDIA A100 80GB PCIe"] == pytest.approx(1.10)  # lowest = spot here
    assert client.gpu_type_prices("secure")["A100 PCIe"] == pytest.approx(1.87)
    with pytest.raises(ValueError, match="market"):
        client.gpu_type_prices("moon")


def test_runpod_interrupted_pod_reads_preempted_and_resume_brings_it_back(runpod_fake: FakeBilling) -> None:
    client = fast(RunPodClient(runpod_fake.url, KEY))
    runpod_fake.control(preempt=True)
    inst = client.get_instance("pod-main")
    assert inst.status == "preempted" and inst.uptime_seconds is None
    reply = client.resume("pod-main", gpu_count=1)
    assert reply["data"]["podResume"]["desiredStatus"] == "RUNNING"
    assert client.get_instance("pod-main").status == "booting"
    time.sleep(0.7)
    assert client.get_instance("pod-main").status == "running"
    assert runpod_fake.state()["resume_calls"][-1] == {"pod_id": "pod-main", "gpu_count": 1}


def test_runpod_terminate_is_recorded_and_the_pod_reads_terminated(tmp_path) -> None:
    fake = FakeBilling.start(tmp_path, provider="runpod", instance_id="pod-t", api_key=KEY)
    try:
        client = fast(RunPodClient(fake.url, KEY))
        assert client.terminate("pod-t") == {"data": {"podTerminate": None}}
        assert client.get_instance("pod-t").status == "terminated"
        assert fake.state()["terminate_calls"] == ["pod-t"]
    finally:
        fake.stop()


def test_runpod_unknown_pod_is_a_not_found_error(runpod_fake: FakeBilling) -> None:
    with pytest.raises(ProviderError) as e:
        fast(RunPodClient(runpod_fake.url, KEY)).get_instance("pod-ghost")
    assert e.value.kind == "not-found"


@pytest.mark.parametrize("provider", ["lambda", "runpod"])
def test_a_wrong_key_is_an_auth_error_that_carries_no_key(provider, lambda_fake, runpod_fake) -> None:
    fake = lambda_fake if provider == "lambda" else runpod_fake
    wrong = "wrong-key-0b5e55ed"
    client = fast(make_client(provider, fake.url, wrong))
    with pytest.raises(ProviderError) as e:
        client.get_instance("i-main" if provider == "lambda" else "pod-main")
    assert e.value.kind == "auth" and e.value.status_code == 401
    assert wrong not in str(e.value) and KEY not in str(e.value) and "401" in str(e.value)


def test_server_errors_are_retried_with_backoff_until_the_api_answers(lambda_fake: FakeBilling) -> None:
    lambda_fake.control(fail_mode="500")
    before = lambda_fake.state()["requests"]
    threading.Timer(0.5, lambda: lambda_fake.control(fail_mode="none")).start()
    client = fast(LambdaClient(lambda_fake.url, KEY, retries=4))
    assert client.get_instance("i-main").status == "running"
    assert lambda_fake.state()["requests"] - before >= 2


def test_server_errors_give_up_after_the_bounded_retries(lambda_fake: FakeBilling) -> None:
    lambda_fake.control(fail_mode="500")
    before = lambda_fake.state()["requests"]
    with pytest.raises(ProviderError) as e:
        fast(LambdaClient(lambda_fake.url, KEY, retries=2)).get_instance("i-main")
    assert e.value.kind == "server" and e.value.status_code == 500
    assert lambda_fake.state()["requests"] - before == 3


def test_a_hanging_api_is_a_timeout_error(lambda_fake: FakeBilling) -> None:
    lambda_fake.control(fail_mode="timeout")
    t0 = time.monotonic()
    with pytest.raises(ProviderError) as e:
        fast(LambdaClient(lambda_fake.url, KEY, timeout=0.5, retries=0)).get_instance("i-main")
    assert e.value.kind == "timeout" and time.monotonic() - t0 < 5


@pytest.mark.parametrize("provider", ["lambda", "runpod"])
def test_garbage_answers_are_errors_not_numbers(provider, lambda_fake, runpod_fake) -> None:
    fake = lambda_fake if provider == "lambda" else runpod_fake
    fake.control(fail_mode="garbage")
    with pytest.raises(ProviderError) as e:
        fast(make_client(provider, fake.url, KEY, retries=0)).get_instance("i-main")
    assert e.value.kind == "garbage"


def test_lambda_client_spaces_its_requests(lambda_fake: FakeBilling) -> None:
    client = LambdaClient(lambda_fake.url, KEY, min_interval_s=0.4)
    t0 = time.monotonic()
    client.get_instance("i-main")
    client.get_instance("i-main")
    assert time.monotonic() - t0 >= 0.4


def test_runpod_cost_may_arrive_as_a_string() -> None:
    inst = parse_runpod_pod({"id": "p", "costPerHr": "0.79", "desiredStatus": "RUNNING", "runtime": {"uptimeInSeconds": 3600}})
    assert inst.price_usd_per_hr == pytest.approx(0.79) and inst.uptime_seconds == 3600


@pytest.mark.parametrize("raw, reason, status", [
    ("RUNNING", "", "running"),
    ("EXITED", "Exited by User", "stopped"),
    ("EXITED", "Exited by RunPod: spot instance interrupted", "preempted"),
    ("TERMINATED", "", "terminated"),
    ("SOMETHING_NEW", "", "unknown"),
])
def test_runpod_statuses_are_normalized(raw: str, reason: str, status: str) -> None:
    runtime = {"uptimeInSeconds": 5} if raw == "RUNNING" else None
    pod = {"id": "p", "desiredStatus": raw, "lastStatusChange": reason, "runtime": runtime}
    assert parse_runpod_pod(pod).status == status


@pytest.mark.parametrize("raw, status", [("active", "running"), ("booting", "booting"), ("terminating", "terminating"),
                                         ("preempted", "preempted"), ("unhealthy", "unhealthy"), ("weird", "unknown")])
def test_lambda_statuses_are_normalized(raw: str, status: str) -> None:
    assert parse_lambda_instance({"id": "i", "status": raw}).status == status


def test_api_key_from_env_names_the_missing_variable() -> None:
    assert api_key_from_env("runpod", {"RUNPOD_API_KEY": "k-123"}) == "k-123"
    with pytest.raises(ValueError, match="LAMBDA_API_KEY"):
        api_key_from_env("lambda", {"LAMBDA_API_KEY": " "})
    with pytest.raises(ValueError, match="provider"):
        make_client("aws", None, "k")


def test_runpod_create_deploys_a_pod_that_boots_then_shows_its_ssh_port(runpod_fake: FakeBilling) -> None:
    client = fast(RunPodClient(runpod_fake.url, KEY))
    pod = client.create("NVIDIA A100 80GB PCIe", "runpod/pytorch:2.4.0", name="x1-new",
                        env={"PUBLIC_KEY": "ssh-ed25519 AAAA... me"}, docker_args="bash -c 'sleep infinity'")
    assert pod.id != "pod-main" and pod.status == "booting"  # RUNNING without a runtime: the container starts
    assert ssh_address(pod) is None
    time.sleep(0.7)
    up = client.get_instance(pod.id)
    assert up.status == "running" and ssh_address(up) == ("192.0.2.10", 22)
    create = runpod_fake.state()["create_calls"][-1]
    assert create["instance_id"] == pod.id and create["gpuTypeId"] == "NVIDIA A100 80GB PCIe"
    assert create["volumeMountPath"] == "/workspace" and create["dockerArgs"] == "bash -c 'sleep infinity'"
    assert create["env_keys"] == ["PUBLIC_KEY"] and "env" not in create  # the fake keeps no env value
    client.terminate(pod.id)


def test_runpod_create_of_a_gpu_not_offered_is_a_clear_error(runpod_fake: FakeBilling) -> None:
    with pytest.raises(ProviderError) as e:
        fast(RunPodClient(runpod_fake.url, KEY)).create("NVIDIA B300", "img")
    assert e.value.kind == "bad-request" and "no longer any instances available" in str(e.value)


def test_lambda_ssh_address_is_the_ip_of_a_running_instance(lambda_fake: FakeBilling) -> None:
    client = fast(LambdaClient(lambda_fake.url, KEY))
    new_id = client.launch("gpu_1x_a100_sxm4", "us-east-1", name="x1-ip")
    assert ssh_address(client.get_instance(new_id)) is None  # booting: no IP shown yet
    time.sleep(0.7)
    assert ssh_address(client.get_instance(new_id)) == ("192.0.2.10", 22)
    client.terminate(new_id)


@pytest.mark.parametrize("provider", ["lambda", "runpod"])
def test_a_404_page_that_is_not_the_apis_own_answer_is_never_not_found(provider, lambda_fake, runpod_fake) -> None:
    fake = lambda_fake if provider == "lambda" else runpod_fake
    client = fast(make_client(provider, fake.url, KEY, timeout=5.0, retries=0))
    instance_id = "i-main" if provider == "lambda" else "pod-main"
    fake.control(fault={"mode": "404-html", "on": "get"})
    try:
        with pytest.raises(ProviderError) as e:
            client.get_instance(instance_id)
        assert e.value.kind == "server" and e.value.api_error is None and e.value.unclear
        assert f"not the {provider} API's own answer (text/html" in str(e.value)
    finally:
        fake.control(fault=None)
    with pytest.raises(ProviderError) as e:  # the API's own: its error shape, kept for the record
        client.get_instance("no-such-id")
    assert e.value.kind == "not-found" and not e.value.unclear
    if provider == "lambda":
        assert e.value.api_error["code"] == "global/object-does-not-exist"
    else:
        assert "not found" in str(e.value.api_error).lower()


@pytest.mark.parametrize("provider", ["lambda", "runpod"])
def test_the_accounts_instances_are_listed_with_the_names_x1_gave_them(provider, lambda_fake, runpod_fake) -> None:
    fake = lambda_fake if provider == "lambda" else runpod_fake
    client = fast(make_client(provider, fake.url, KEY, timeout=5.0))
    if provider == "lambda":
        new_id = client.launch("gpu_1x_a100_sxm4", "us-east-1", name="x1-listed")
    else:
        new_id = client.create("NVIDIA A100 80GB PCIe", "img", name="x1-listed", cloud_type="COMMUNITY",
                               bid_per_gpu=1.10, min_cuda_version="13.0").id
    listed = {i.id: i.raw.get("name") for i in client.list_instances()}
    assert listed[new_id] == "x1-listed"
    client.terminate(new_id)
    assert new_id not in {i.id for i in client.list_instances()}  # a terminated one is not listed as running


def test_the_providers_own_description_of_a_gpu_names_its_memory(lambda_fake, runpod_fake) -> None:
    lam = fast(make_client("lambda", lambda_fake.url, KEY, timeout=5.0)).instance_types()
    assert lam["gpu_1x_a100_sxm4"].gpu_description == "A100 (40 GB SXM4)" and lam["gpu_1x_a100_sxm4"].memory_gb == 40
    assert lam["gpu_1x_a100_sxm4"].gpus == 1 and lam["gpu_8x_a100_80gb_sxm4"].gpus == 8
    pods = make_client("runpod", runpod_fake.url, KEY, timeout=5.0).gpu_offers("communitySpotPrice")
    assert pods["NVIDIA A100 80GB PCIe"].memory_gb == 80 and pods["NVIDIA A100 80GB PCIe"].price_usd_per_hr == 1.10
