"""The budget sidecar against the fake billing API, both as real processes on 127.0.0.1: spend at the
provider's price, a price change, an API outage (stale, spend still rising), a restart (spend never
decreases), the endpoints, and the API key kept out of everything it writes or says."""

from __future__ import annotations

import json
import socket
import sys
import time
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from money import assert_fake_holds_nothing_unrecorded
from prometheus_client.parser import text_string_to_metric_families

from budget_sidecar.app import create_app
from budget_sidecar.ledger import Ledger
from budget_sidecar.poller import Poller
from budget_sidecar.settings import SidecarSettings
from budget_sidecar.testing import FakeBilling, Sidecar, wait_until
from x1_common.contracts import BudgetReading, read_budget_file
from x1_common.providers import Instance

KEY = "sk-sidecar-9e1d4c7b2a"
SCALE = 360.0  # one wall second bills 0.1 h
POLL = 0.5


@pytest.fixture
def stack(tmp_path: Path):
    """Factory: start a fake (optional) and a sidecar; everything started is stopped at the end."""
    started: list = []

    def fake(provider: str = "lambda", **kw) -> FakeBilling:
        f = FakeBilling.start(tmp_path / "logs", provider=provider, instance_id="inst-1", api_key=KEY,
                              time_scale=SCALE, **kw)
        started.append(f)
        return f

    def sidecar(provider: str = "lambda", api_url: str | None = None, extra: list[str] | None = None,
                key: str = KEY, **kw) -> Sidecar:
        env = {"LAMBDA_API_KEY": key, "RUNPOD_API_KEY": key}
        s = Sidecar.start(
            tmp_path / "logs", tmp_path / "ws" / "budget.json", provider=provider,
            instance_id="" if provider == "static" else "inst-1", api_url=api_url, poll_seconds=POLL,
            extra_args=["--time-scale", str(SCALE), "--http-timeout", "0.5", *(extra or [])], env=env, **kw,
        )
        started.append(s)
        return s

    yield fake, sidecar
    for proc in reversed(started):
        proc.stop()


def budget_when(sidecar: Sidecar, predicate, timeout: float = 30.0, what: str = "a budget reading") -> dict:
    return wait_until(lambda: (lambda b: b if predicate(b) else None)(sidecar.budget()), timeout, 0.1, what)


def metrics(sidecar: Sidecar) -> dict[str, float]:
    import urllib.request

    with urllib.request.urlopen(sidecar.url + "/metrics", timeout=10) as resp:
        text = resp.read().decode()
    return {s.name: s.value for fam in text_string_to_metric_families(text) for s in fam.samples}


def healthz_status(sidecar: Sidecar) -> int:
    import urllib.error
    import urllib.request

    try:
        with urllib.request.urlopen(sidecar.url + "/healthz", timeout=10) as resp:
            return resp.status
    except urllib.error.HTTPError as e:
        return e.code


# --- against the fake, as processes -----------------------------------------------------------


def test_sidecar_writes_spend_at_the_provider_price(stack) -> None:
    fake, sidecar = stack
    f = fake()
    s = sidecar(api_url=f.url, extra=["--planned-hours", "24"])
    b = budget_when(s, lambda b: b["hours_elapsed"] >= 0.2, what="0.2 billed hours")
    assert b["rate_usd_per_hr"] == pytest.approx(1.10)
    assert b["spent_usd"] == pytest.approx(1.10 * b["hours_elapsed"], rel=1e-3)
    assert b["projected_total_usd"] == pytest.approx(b["spent_usd"] + 1.10 * (24 - b["hours_elapsed"]), rel=1e-3)
    assert b["source"] == "provider-api" and b["stale"] is False
    assert (b["provider"], b["instance_id"], b["cap_usd"]) == ("lambda", "inst-1", 35.0)
    on_disk = read_budget_file(s.output)  # the file is a valid reading for any reader of the contract
    assert isinstance(on_disk, BudgetReading) and on_disk.spent_usd > 0
    # The fake bills from its own start, the sidecar from its first sight: never more than the fake.
    assert b["spent_usd"] <= f.state()["billed_usd"] + 0.01
    assert healthz_status(s) == 200
    m = metrics(s)
    assert m["x1_budget_cap_usd"] == 35.0 and m["x1_budget_rate_usd_per_hour"] == pytest.approx(1.10)
    assert m["x1_budget_spent_usd"] > 0 and m["x1_budget_stale"] == 0.0
    assert m["x1_budget_poll_failures_total"] == 0.0
    assert m["x1_budget_projected_total_usd"] > m["x1_budget_spent_usd"]
    assert abs(m["x1_budget_last_update_timestamp_seconds"] - time.time()) < 30


def test_a_price_change_shows_in_the_rate_and_the_spend(stack) -> None:
    fake, sidecar = stack
    f = fake()
    s = sidecar(api_url=f.url)
    before = budget_when(s, lambda b: b["hours_elapsed"] > 0)
    f.control(price_usd_per_hr=3.3)
    after = budget_when(s, lambda b: b["rate_usd_per_hr"] == pytest.approx(3.3), what="the new price")
    later = budget_when(s, lambda b: b["hours_elapsed"] >= after["hours_elapsed"] + 0.1)
    slope = (later["spent_usd"] - after["spent_usd"]) / (later["hours_elapsed"] - after["hours_elapsed"])
    assert slope == pytest.approx(3.3, rel=1e-3)
    assert after["spent_usd"] >= before["spent_usd"]


@pytest.mark.parametrize("mode", ["500", "timeout", "garbage"])
def test_api_down_for_three_polls_is_stale_and_spend_keeps_rising(stack, mode: str) -> None:
    fake, sidecar = stack
    f = fake()
    s = sidecar(api_url=f.url)
    healthy = budget_when(s, lambda b: b["hours_elapsed"] > 0 and b["source"] == "provider-api")
    f.control(fail_mode=mode)
    down = budget_when(s, lambda b: b["consecutive_failures"] >= 3, timeout=60, what="3 failed polls")
    assert down["stale"] is True and down["source"] == "estimate"
    assert down["spent_usd"] > healthy["spent_usd"]
    assert down["rate_usd_per_hr"] == pytest.approx(1.10)  # the last known rate
    later = budget_when(s, lambda b: b["consecutive_failures"] > down["consecutive_failures"], timeout=60)
    assert later["spent_usd"] > down["spent_usd"]  # still rising while the API is down
    assert healthz_status(s) == 503
    t0 = time.monotonic()
    s.budget()  # served from memory while the poll thread waits on the provider
    assert time.monotonic() - t0 < 2.0
    m = metrics(s)
    assert m["x1_budget_stale"] == 1.0 and m["x1_budget_poll_failures_total"] >= 3
    f.control(fail_mode="none")
    back = budget_when(s, lambda b: b["source"] == "provider-api", timeout=60, what="recovery")
    assert back["stale"] is False and back["spent_usd"] >= later["spent_usd"]
    assert healthz_status(s) == 200


def test_a_restarted_sidecar_never_reports_less_spend(stack) -> None:
    fake, sidecar = stack
    f = fake()
    s1 = sidecar(api_url=f.url)
    last = budget_when(s1, lambda b: b["hours_elapsed"] >= 0.2)
    s1.stop()
    on_disk = json.loads(s1.output.read_text())
    assert on_disk["spent_usd"] >= last["spent_usd"]
    state = json.loads((s1.output.parent / "budget-state.json").read_text())
    assert state["spent_usd"] == pytest.approx(on_disk["spent_usd"], abs=1e-5)
    time.sleep(1.0)  # 0.1 billed hours with the sidecar down: the instance kept billing
    s2 = sidecar(api_url=f.url)
    seen = [on_disk["spent_usd"]]
    deadline = time.monotonic() + 2.5
    while time.monotonic() < deadline:
        b = s2.budget()
        seen.append(b["spent_usd"])
        time.sleep(0.1)
    assert seen == sorted(seen), f"spend decreased: {seen}"
    assert seen[-1] >= on_disk["spent_usd"] + 1.10 * 0.1  # the downtime was charged


def test_runpod_spend_is_cost_times_uptime_and_survives_a_resume(stack) -> None:
    fake, sidecar = stack
    f = fake("runpod", boot_seconds=0.3)
    s = sidecar("runpod", api_url=f.url)
    b = budget_when(s, lambda b: b["hours_elapsed"] >= 0.3 and b["source"] == "provider-api")
    # RunPod reports uptime from the pod's start, so the sidecar sees what the fake billed.
    assert b["spent_usd"] == pytest.approx(f.state()["billed_usd"], abs=1.10 * 0.15)
    f.control(preempt=True)
    stopped = budget_when(s, lambda b: b["instance_status"] == "preempted", what="the preemption")
    import httpx

    resumed = httpx.post(f.url + "/graphql", headers={"Authorization": f"Bearer {KEY}"}, json={
        "query": 'mutation { podResume(input: {podId: "inst-1", gpuCount: 1}) { id } }'}, timeout=10)
    assert resumed.status_code == 200
    # Uptime restarts from 0 after a resume; the sidecar's spend must not.
    after = budget_when(s, lambda b: b["instance_status"] == "running" and b["hours_elapsed"] > stopped["hours_elapsed"] + 0.1)
    assert after["spent_usd"] >= stopped["spent_usd"] + 0.1 * 1.10 - 1e-6


def test_static_provider_bills_its_rate_on_its_own_clock_without_any_key(stack, tmp_path: Path) -> None:
    _, sidecar = stack
    s = sidecar("static", extra=["--rate-usd-per-hr", "0.5"], key="")
    b = budget_when(s, lambda b: b["hours_elapsed"] >= 0.2)
    assert b["rate_usd_per_hr"] == 0.5 and b["spent_usd"] == pytest.approx(0.5 * b["hours_elapsed"], rel=1e-3)
    assert b["provider"] == "static" and b["stale"] is False


def test_sidecar_restarted_with_another_provider_never_lowers_spend(stack) -> None:
    # A switch to `static` to get round a failing API key must not reset the run's spend.
    fake, sidecar = stack
    f = fake()
    s1 = sidecar(api_url=f.url)
    budget_when(s1, lambda b: b["hours_elapsed"] >= 0.3, what="0.3 billed hours on lambda")
    s1.stop()
    before = json.loads(s1.output.read_text())["spent_usd"]
    assert before >= 1.10 * 0.3 * 0.99
    s2 = sidecar("static", extra=["--rate-usd-per-hr", "0.01"], key="")
    seen = [before]
    deadline = time.monotonic() + 2.0
    while time.monotonic() < deadline:
        seen.append(json.loads(s2.output.read_text())["spent_usd"])  # what the trainer reads
        time.sleep(0.1)
    assert seen == sorted(seen), f"spend decreased after the provider change: {seen}"
    after = budget_when(s2, lambda b: b["provider"] == "static" and b["stale"] is False, what="a static reading")
    # Carried over, then counting on at the new rate: 0.01 $/h cannot explain $0.3 in two seconds.
    assert before <= after["spent_usd"] <= before + 0.01 * 0.1 * 30
    assert "provider changed from lambda to static: carrying over" in s2.log_text()
    state = json.loads((s2.output.parent / "budget-state.json").read_text())
    assert state["provider"] == "static" and state["spent_usd"] >= before


def test_second_sidecar_on_one_budget_file_is_refused(stack, tmp_path: Path) -> None:
    import subprocess

    _, sidecar = stack
    first = sidecar("static", extra=["--rate-usd-per-hr", "1.0"], key="")
    budget_when(first, lambda b: b["spent_usd"] > 0)
    # Another rate, HTTP off (a busy port is no refusal): only the shared budget.json can refuse it.
    proc = subprocess.run(
        [sys.executable, "-m", "budget_sidecar", "--provider", "static", "--rate-usd-per-hr", "0.5",
         "--poll-seconds", str(POLL), "--output", str(first.output), "--port", "0"],
        capture_output=True, text=True, timeout=60,
    )
    assert proc.returncode == 2, proc.stderr
    assert f"budget file {first.output} is in use by another budget sidecar" in proc.stderr
    assert f"pid {first.proc.pid}" in proc.stderr and "Traceback" not in proc.stderr
    # The first one kept writing alone: one rate, spend rising.
    seen = []
    deadline = time.monotonic() + 1.5
    while time.monotonic() < deadline:
        seen.append(json.loads(first.output.read_text()))
        time.sleep(0.1)
    spent = [b["spent_usd"] for b in seen]
    assert spent == sorted(spent) and {b["rate_usd_per_hr"] for b in seen} == {1.0}
    assert first.alive()


def test_a_sidecar_after_a_sigkilled_one_takes_its_budget_file_over(stack) -> None:
    import signal

    _, sidecar = stack
    first = sidecar("static", extra=["--rate-usd-per-hr", "1.0"], key="")
    spent = budget_when(first, lambda b: b["spent_usd"] > 0)["spent_usd"]
    first.proc.send_signal(signal.SIGKILL)  # no clean exit: the lease is left behind
    first.proc.wait(10)
    second = sidecar("static", extra=["--rate-usd-per-hr", "1.0"], key="")
    assert budget_when(second, lambda b: b["spent_usd"] >= spent)["stale"] is False
    assert "taken over" in second.log_text()


@pytest.mark.parametrize("umask, mode", [(0o077, 0o600), (0o022, 0o644), (0o002, 0o664)])
def test_atomic_writes_respect_the_umask(tmp_path: Path, umask: int, mode: int) -> None:
    import subprocess

    output = tmp_path / "budget.json"
    proc = subprocess.Popen([sys.executable, "-m", "budget_sidecar", "--provider", "static", "--rate-usd-per-hr", "1",
                             "--poll-seconds", str(POLL), "--output", str(output), "--port", "0"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, umask=umask)
    ledger = tmp_path / "budget-state.json"
    try:
        wait_until(lambda: output.exists() and ledger.exists(), 30, what="budget.json and its ledger")
    finally:
        proc.terminate()
        proc.wait(10)
    # 0666 through the user's umask, as any new file: budget.json and the ledger alike.
    assert {p.name: p.stat().st_mode & 0o777 for p in (output, ledger)} == {output.name: mode, ledger.name: mode}
    assert not list(tmp_path.glob(".*.tmp"))


def test_a_busy_port_is_a_warning_and_budget_json_is_still_written(tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        output = tmp_path / "budget.json"
        from budget_sidecar.testing import ManagedProcess

        p = ManagedProcess([sys.executable, "-m", "budget_sidecar", "--provider", "static", "--rate-usd-per-hr", "1",
                            "--poll-seconds", str(POLL), "--output", str(output), "--port", str(port)],
                           tmp_path / "busy.log")
        try:
            wait_until(lambda: output.exists(), 30, what="budget.json")
            assert p.alive()
            assert "cannot listen" in p.log_text()
        finally:
            p.stop()


def test_the_api_key_never_appears_in_logs_files_or_errors(stack, tmp_path: Path) -> None:
    fake, sidecar = stack
    f = fake()
    s = sidecar(api_url=f.url)
    budget_when(s, lambda b: b["hours_elapsed"] > 0)
    f.control(fail_mode="500")
    budget_when(s, lambda b: b["consecutive_failures"] >= 2)
    f.control(fail_mode="none")
    # A second sidecar with a wrong key: its 401 errors are logged, with neither key in them.
    wrong = "sk-wrong-5f8e2d1c0b"
    other = Sidecar.start(tmp_path / "logs", tmp_path / "ws2" / "budget.json", provider="lambda",
                          instance_id="inst-1", api_url=f.url, poll_seconds=POLL, env={"LAMBDA_API_KEY": wrong})
    try:
        wait_until(lambda: "401" in other.log_text(), 30, what="the 401 in the log")
    finally:
        other.stop()
    s.stop()
    texts = {str(p): p.read_text(errors="replace") for p in tmp_path.rglob("*") if p.is_file()}
    assert any(name.endswith("budget.json") for name in texts) and any(name.endswith("budget-state.json") for name in texts)
    assert any("invalid-api-key" in t for t in texts.values())  # the error itself is reported
    for name, text in texts.items():
        assert KEY not in text, f"API key found in {name}"
        assert wrong not in text, f"API key found in {name}"


# ---------------------------------------------------------------------------------------------
# A run on several hosts: one budget, every instance counted

PAIR = ("inst-a", "inst-b")


@pytest.fixture
def pair(tmp_path: Path):
    """The fake API with two instances (two hosts of one run) and a sidecar counting both."""
    started: list = []

    def start(provider: str = "lambda", extra: list[str] | None = None) -> tuple[FakeBilling, Sidecar]:
        f = FakeBilling.start(tmp_path / "logs", provider=provider, instance_id=",".join(PAIR), api_key=KEY,
                              time_scale=SCALE)
        started.append(f)
        s = Sidecar.start(tmp_path / "logs", tmp_path / "ws" / "budget.json", provider=provider,
                          instance_id=",".join(PAIR), api_url=f.url, poll_seconds=POLL,
                          extra_args=["--time-scale", str(SCALE), "--http-timeout", "0.5", "--nodes", "2", *(extra or [])],
                          env={"LAMBDA_API_KEY": KEY, "RUNPOD_API_KEY": KEY})
        started.append(s)
        return f, s

    yield start
    for proc in reversed(started):
        proc.stop()


def parts(b: dict) -> dict[str, dict]:
    return {p["instance_id"]: p for p in b["instances"]}


@pytest.mark.parametrize("provider", ["lambda", "runpod"])
def test_two_instances_are_priced_each_and_the_spend_is_their_sum(pair, provider: str) -> None:
    f, s = pair(provider)
    b = budget_when(s, lambda b: b["hours_elapsed"] >= 0.3 and b["source"] == "provider-api")
    assert b["nodes"] == 2 and set(parts(b)) == set(PAIR)
    assert b["rate_usd_per_hr"] == pytest.approx(2 * 1.10)
    assert all(p["rate_usd_per_hr"] == pytest.approx(1.10) and p["answered"] for p in b["instances"])
    # The total is the sum of the parts, and twice one host's bill over the same hours.
    assert b["spent_usd"] == pytest.approx(sum(p["spent_usd"] for p in b["instances"]), abs=1e-5)  # each rounded
    assert b["spent_usd"] == pytest.approx(2 * 1.10 * b["hours_elapsed"], rel=1e-3)
    billed = f.state()["billed_usd"]  # the fake's own bill for both, a moment later
    assert b["spent_usd"] <= billed * 1.05
    assert read_budget_file(s.output).spent_usd == pytest.approx(b["spent_usd"], rel=0.05)


def test_one_instance_s_price_change_moves_the_total_by_its_part(pair) -> None:
    f, s = pair()
    before = budget_when(s, lambda b: b["hours_elapsed"] > 0)
    f.control(price_usd_per_hr=3.3, instance_id="inst-b")
    after = budget_when(s, lambda b: b["rate_usd_per_hr"] == pytest.approx(1.10 + 3.3), what="the new price")
    assert {i: p["rate_usd_per_hr"] for i, p in parts(after).items()} == {"inst-a": 1.10, "inst-b": 3.3}
    later = budget_when(s, lambda b: b["hours_elapsed"] >= after["hours_elapsed"] + 0.2)
    slope = (later["spent_usd"] - after["spent_usd"]) / (later["hours_elapsed"] - after["hours_elapsed"])
    assert slope == pytest.approx(1.10 + 3.3, rel=1e-3)
    a_slope = (parts(later)["inst-a"]["spent_usd"] - parts(after)["inst-a"]["spent_usd"]) / (
        later["hours_elapsed"] - after["hours_elapsed"])
    assert a_slope == pytest.approx(1.10, rel=1e-3)
    assert after["spent_usd"] >= before["spent_usd"] and later["stale"] is False
    # A lower price for one instance, same type: suspect, as for one host; the total keeps the
    # trusted sum and says stale.
    f.control(price_usd_per_hr=0.2, instance_id="inst-a")
    low = budget_when(s, lambda b: b.get("rate_note") is not None, what="the suspect sum")
    assert low["rate_usd_per_hr"] == pytest.approx(1.10 + 3.3) and low["stale"] is True


def test_an_instance_missing_from_the_api_is_counted_at_its_last_price_and_goes_stale(pair) -> None:
    f, s = pair()
    healthy = budget_when(s, lambda b: b["hours_elapsed"] >= 0.1 and b["source"] == "provider-api")
    f.control(vanish=True, instance_id="inst-b")
    down = budget_when(s, lambda b: b["consecutive_failures"] >= 2, timeout=30, what="2 polls without inst-b")
    assert down["stale"] is True and down["source"] == "estimate"
    assert down["rate_usd_per_hr"] == pytest.approx(2 * 1.10)  # inst-b still counted, at its last price
    assert parts(down)["inst-b"]["answered"] is False and "not exist" in parts(down)["inst-b"]["error"]
    assert parts(down)["inst-a"]["answered"] is True
    later = budget_when(s, lambda b: b["hours_elapsed"] >= down["hours_elapsed"] + 0.2)
    assert later["spent_usd"] - down["spent_usd"] == pytest.approx(
        2 * 1.10 * (later["hours_elapsed"] - down["hours_elapsed"]), rel=1e-3)
    assert later["spent_usd"] > healthy["spent_usd"]
    assert healthz_status(s) == 503


def test_a_restarted_sidecar_of_two_instances_never_reports_less(pair, tmp_path: Path) -> None:
    f, s = pair()
    first = budget_when(s, lambda b: b["hours_elapsed"] >= 0.2)
    s.stop()
    s2 = Sidecar.start(tmp_path / "logs", tmp_path / "ws" / "budget.json", provider="lambda",
                       instance_id=",".join(PAIR), api_url=f.url, poll_seconds=POLL,
                       extra_args=["--time-scale", str(SCALE), "--nodes", "2"], env={"LAMBDA_API_KEY": KEY})
    try:
        again = budget_when(s2, lambda b: b["last_update_utc"] > first["last_update_utc"])
        assert again["spent_usd"] >= first["spent_usd"]
        assert all(parts(again)[i]["spent_usd"] >= parts(first)[i]["spent_usd"] for i in PAIR)
    finally:
        s2.stop()


def test_static_rate_is_counted_once_per_node(stack) -> None:
    _, sidecar = stack
    s = sidecar("static", extra=["--rate-usd-per-hr", "0.5", "--nodes", "2"], key="")
    b = budget_when(s, lambda b: b["hours_elapsed"] >= 0.2)
    assert b["rate_usd_per_hr"] == 1.0 and b["spent_usd"] == pytest.approx(1.0 * b["hours_elapsed"], rel=1e-3)
    assert b["nodes"] == 2 and [p["instance_id"] for p in b["instances"]] == ["node-1", "node-2"]
    assert all(p["rate_usd_per_hr"] == 0.5 for p in b["instances"])


def test_hours_billed_before_the_first_poll_are_charged_to_every_node(tmp_path: Path) -> None:
    settings = SidecarSettings(provider="static", rate_usd_per_hr=1.10, nodes=2, initial_hours=4.5,
                               output=tmp_path / "budget.json", port=0)
    Poller(settings, None, clock=lambda: 1_000_000.0).poll_once()
    b = json.loads((tmp_path / "budget.json").read_text())
    assert b["spent_usd"] == pytest.approx(2 * 1.10 * 4.5) and b["rate_usd_per_hr"] == pytest.approx(2.2)
    assert [(p["spent_usd"], p["hours_elapsed"]) for p in b["instances"]] == [(pytest.approx(4.95), 4.5)] * 2


@pytest.mark.parametrize("args, env, named", [
    (["--provider", "lambda", "--instance-id", "i-1", "--nodes", "2"], {"LAMBDA_API_KEY": KEY}, "--instance-id"),
    (["--provider", "lambda", "--instance-id", "i-1,,i-2"], {"LAMBDA_API_KEY": KEY}, "--instance-id"),
    (["--provider", "lambda", "--instance-id", "i-1,i-1"], {"LAMBDA_API_KEY": KEY}, "--instance-id"),
    (["--provider", "static", "--rate-usd-per-hr", "1", "--nodes", "0"], {}, "--nodes"),
])
def test_bad_node_settings_exit_2_naming_what_is_wrong(args, env, named, tmp_path: Path, monkeypatch) -> None:
    test_bad_settings_exit_2_naming_what_is_wrong(args, env, named, tmp_path, monkeypatch)


@pytest.mark.parametrize("args, env, named", [
    (["--provider", "lambda", "--instance-id", "i"], {}, "LAMBDA_API_KEY"),
    (["--provider", "runpod"], {"RUNPOD_API_KEY": KEY}, "--instance-id"),
    (["--provider", "static"], {}, "--rate-usd-per-hr"),
    (["--provider", "static", "--rate-usd-per-hr", "1", "--cap-usd", "-3"], {}, "--cap-usd"),
    (["--provider", "lambda", "--instance-id", "i", "--api-url", "ftp://x"], {"LAMBDA_API_KEY": KEY}, "--api-url"),
])
def test_bad_settings_exit_2_naming_what_is_wrong(args, env, named, tmp_path: Path, monkeypatch) -> None:
    import subprocess

    monkeypatch.delenv("LAMBDA_API_KEY", raising=False)
    monkeypatch.delenv("RUNPOD_API_KEY", raising=False)
    import os

    proc = subprocess.run([sys.executable, "-m", "budget_sidecar", *args, "--output", str(tmp_path / "b.json"),
                           "--port", "0"], capture_output=True, text=True, timeout=60, env={**os.environ, **env})
    assert proc.returncode == 2, proc.stderr
    assert named in proc.stderr and KEY not in proc.stderr + proc.stdout


def test_help_explains_the_time_scale_is_for_tests_only() -> None:
    import subprocess

    proc = subprocess.run([sys.executable, "-m", "budget_sidecar", "--help"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and "TESTS AND DEMO ONLY" in proc.stdout and "LAMBDA_API_KEY" in proc.stdout


# --- the app and the ledger in-process ----------------------------------------------------------


class Clock:
    def __init__(self, t: float = 1_800_000_000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def static_settings(tmp_path: Path, **kw) -> SidecarSettings:
    return SidecarSettings(provider="static", rate_usd_per_hr=2.0, output=tmp_path / "budget.json", **kw)


def test_endpoints_before_the_first_reading_say_503(tmp_path: Path) -> None:
    clock = Clock()
    poller = Poller(static_settings(tmp_path), None, clock=clock)
    client = TestClient(create_app(poller.settings, poller))
    assert client.get("/budget").status_code == 503
    assert client.get("/healthz").status_code == 503
    poller.poll_once()
    clock.t += 1800
    poller.poll_once()
    assert client.get("/budget").json()["spent_usd"] == pytest.approx(1.0)
    assert client.get("/healthz").status_code == 200


def test_metrics_parse_as_prometheus_text(tmp_path: Path) -> None:
    clock = Clock()
    poller = Poller(static_settings(tmp_path, planned_hours=10), None, clock=clock)
    poller.poll_once()
    clock.t += 3600
    poller.poll_once()
    text = TestClient(create_app(poller.settings, poller)).get("/metrics").text
    fams = {f.name: f for f in text_string_to_metric_families(text)}
    assert fams["x1_budget_poll_failures"].type == "counter"
    values = {s.name: s.value for f in fams.values() for s in f.samples}
    assert values["x1_budget_spent_usd"] == pytest.approx(2.0)
    assert values["x1_budget_projected_total_usd"] == pytest.approx(2.0 + 2.0 * 9)
    assert values["x1_budget_cap_usd"] == 35.0


def runpod_inst(uptime: float | None, status: str = "running", price: float = 2.0) -> Instance:
    return Instance(id="p", status=status, raw_status="RUNNING", price_usd_per_hr=price, uptime_seconds=uptime,
                    instance_type=None, region=None)


def test_ledger_adds_up_runpod_runs_across_a_resume() -> None:
    led = Ledger(provider="runpod", instance_id="p")
    led.record_success(0, runpod_inst(3600), time_scale=1)
    assert led.spent_usd == pytest.approx(2.0)
    led.record_success(1800, runpod_inst(None, status="preempted"), time_scale=1)
    spent_at_stop = led.spent_usd
    led.record_success(3600, runpod_inst(600), time_scale=1)  # resumed: uptime from 0 again
    assert led.spent_usd >= spent_at_stop
    led.record_success(7200, runpod_inst(4200), time_scale=1)
    assert led.spent_usd == pytest.approx(max(spent_at_stop, 2.0 + 2.0 * 4200 / 3600), rel=1e-6)


def test_ledger_failures_extrapolate_at_the_last_rate_and_mark_stale() -> None:
    led = Ledger(provider="lambda", instance_id="i")
    inst = Instance(id="i", status="running", raw_status="active", price_usd_per_hr=1.0, uptime_seconds=None,
                    instance_type=None, region=None)
    led.record_success(0, inst, time_scale=1)
    led.record_failure(3600, "down", time_scale=1)
    r1 = led.reading(3600, cap_usd=35, planned_hours=None, stale_after_failures=2, source="estimate")
    assert r1 is not None and r1.spent_usd == pytest.approx(1.0) and not r1.stale
    led.record_failure(7200, "down", time_scale=1)
    r2 = led.reading(7200, cap_usd=35, planned_hours=None, stale_after_failures=2, source="estimate")
    assert r2 is not None and r2.spent_usd == pytest.approx(2.0) and r2.stale


def test_ledger_of_a_relaunched_instance_carries_the_spend(tmp_path: Path) -> None:
    path = tmp_path / "budget-state.json"
    Ledger(provider="lambda", instance_id="old", spent_usd=12.5, hours_elapsed=10, rate_usd_per_hr=1.25,
           accrued_until=0).save(path)
    led = Ledger.load(path, "lambda", "new")
    assert (led.instance_id, led.spent_usd, led.hours_elapsed) == ("new", 12.5, 10)


def test_a_lambda_sidecar_never_sees_a_lower_figure_after_a_failure_at_a_lower_price() -> None:
    led = Ledger(provider="lambda", instance_id="i")
    mk = lambda price: Instance(id="i", status="running", raw_status="active", price_usd_per_hr=price,  # noqa: E731
                                uptime_seconds=None, instance_type=None, region=None)
    led.record_success(0, mk(3.0), time_scale=1)
    led.record_success(3600, mk(1.0), time_scale=1)  # price fell at an unknown time: charge the higher
    assert led.spent_usd == pytest.approx(3.0)


def test_a_lost_ledger_falls_back_on_the_published_budget_json(tmp_path: Path) -> None:
    clock = Clock()
    settings = static_settings(tmp_path)
    first = Poller(settings, None, clock=clock)
    first.poll_once()
    clock.t += 3600
    first.poll_once()
    published = first.snapshot().document["spent_usd"]
    settings.state_path.unlink()  # the ledger is lost; budget.json is still there
    second = Poller(settings, None, clock=clock)
    clock.t += 60
    second.poll_once()
    assert second.snapshot().document["spent_usd"] >= published == pytest.approx(2.0)


# --- a price only from the instance itself ---------------------------------------------------


class HandClock:
    def __init__(self) -> None:
        self.t = time.time()

    def __call__(self) -> float:
        return self.t


@pytest.mark.parametrize("provider", ["lambda", "runpod"])
def test_a_price_comes_only_from_the_instances_own_record_and_spend_never_looks_lower(tmp_path: Path, provider: str):
    """Lambda's record for the same id under another type name at a price 100x lower (cents read as
    dollars) is suspect; a record of another id (an A10 at 75 cents) is a bad answer: both counted at
    the last trusted price and marked stale, with the reason in rate_note."""
    from x1_common.providers import make_client

    scale = 1.0 if provider == "lambda" else 18000.0  # RunPod bills the pod's own uptime: 1 wall second = 5 h
    fake = FakeBilling.start(tmp_path / "logs", provider=provider, instance_id="inst-1", api_key=KEY,
                             price_usd_per_hr=1.10, time_scale=scale)
    try:
        clock = HandClock() if provider == "lambda" else time.time
        settings = SidecarSettings(provider=provider, instance_id="inst-1", api_url=fake.url, port=0,
                                   output=tmp_path / "budget.json", time_scale=scale)
        poller = Poller(settings, make_client(provider, fake.url, KEY, timeout=5.0, retries=0), clock)

        def five_hours() -> None:
            if isinstance(clock, HandClock):
                clock.t += 5 * 3600
            else:
                time.sleep(1.0)

        def budget() -> dict:
            return json.loads((tmp_path / "budget.json").read_text())

        poller.poll_once()
        first = budget()
        assert first["rate_usd_per_hr"] == 1.10 and not first["stale"]
        renamed = "gpu_1x_a100_sxm4_v2" if provider == "lambda" else "A100 PCIe (renamed)"
        fake.control(misreport={"instance_id": "inst-1", "instance_type": renamed, "price_usd_per_hr": 0.011})
        five_hours()
        poller.poll_once()
        bill = fake.state()["instances"]["inst-1"]["billed_usd"]
        doc = budget()
        assert doc["stale"] and doc["rate_usd_per_hr"] == 1.10, doc
        assert f"under another instance type ({renamed})" in doc["rate_note"]
        assert "a running instance does not change type" in doc["rate_note"]
        if provider == "lambda":
            assert doc["spent_usd"] == pytest.approx(5.50, rel=1e-3)  # not $0.055
        else:
            assert doc["spent_usd"] >= 0.9 * bill and doc["spent_usd"] > 4.0, (doc, bill)

        fake.control(misreport={"instance_id": "inst-1", "id": "other-9", "instance_type": "gpu_1x_a10",
                                "price_usd_per_hr": 0.75})
        before = doc["spent_usd"]
        five_hours()
        poller.poll_once()
        doc = budget()
        assert doc["stale"] and doc["rate_usd_per_hr"] == 1.10, doc
        assert "the provider answered with the record of other-9" in doc["rate_note"]
        assert doc["spent_usd"] >= before + (5.5 if provider == "lambda" else 0.0) - 1e-6
        assert doc["instance_type"] != "gpu_1x_a10"

        fake.control(misreport=None)  # its own record again: trusted, not stale
        poller.poll_once()
        doc = budget()
        assert not doc["stale"] and doc["rate_usd_per_hr"] == 1.10 and "rate_note" not in doc
        assert doc["spent_usd"] >= before
        fake.control(terminate=True)  # the run's end
        assert_fake_holds_nothing_unrecorded(fake)
    finally:
        fake.stop()
