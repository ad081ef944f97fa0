"""Bad input and faults, the reader classes: every file another process writes, every timestamp
and every price that comes in.

Each property is tried over generated input (hypothesis): arbitrary bytes, arbitrary JSON,
valid documents with one field replaced by anything, timestamps past / future / huge / NaN /
infinite, prices zero / negative / huge / strings / lower / higher. The contract for a reader:
it returns a valid value or its typed error, never another exception, never hangs (a FIFO,
a folder, a dangling symlink in place of the file), and never makes spend look lower.
"""

from __future__ import annotations

import json
import math
import os
import threading
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from budget_sidecar.ledger import Ledger
from x1_common.contracts import (
    CLOCK_SKEW_S,
    BudgetFormatError,
    BudgetReading,
    Heartbeat,
    UnreadableFileError,
    read_budget_file,
    read_json_file,
)
from x1_common.providers import BILLING_STATUSES, ProviderError, parse_lambda_instance, parse_runpod_pod
from x1_pretrain.config import BudgetConfig
from x1_pretrain.train.budget_guard import BudgetGuard, ReadError, read_source
from x1_watchdog.policy import RestartPolicy, StallDetector
from x1_watchdog.records import StateError, StateStore, read_events

FAST = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])

# ---- generators -----------------------------------------------------------------------------------

json_scalars = st.one_of(
    st.none(), st.booleans(), st.integers(min_value=-(10**30), max_value=10**30),
    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=20),
)
json_values = st.recursive(json_scalars, lambda inner: st.one_of(
    st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=8), inner, max_size=4)), max_leaves=12)


def dump(value: Any) -> bytes:
    """JSON as another process might write it, NaN and Infinity included (json.dumps allows them)."""
    return json.dumps(value).encode()


# Bytes a torn, truncated or foreign writer could leave: random bytes, JSON with bad constants,
# duplicate keys, deep nesting, non-UTF-8.
nasty_bytes = st.one_of(
    st.binary(max_size=200),
    st.sampled_from([b"", b"{", b"null", b"[]", b"NaN", b'{"a": Infinity}', b'{"a": 1, "a": 2}', b"1e999",
                     b"\xff\xfe{}", b"[" * 5000 + b"]" * 5000, '{"é": "\udcff"}'.encode("utf-8", "surrogatepass")]),
)

NOW = time.time()
times = st.one_of(
    st.floats(min_value=-1e12, max_value=1e12), st.just(NOW), st.floats(min_value=NOW - 1e7, max_value=NOW + 1e7),
    st.sampled_from([NOW + CLOCK_SKEW_S + 1, NOW + 365 * 86400, 1e300, -1e300, 0.0]),
)


def iso(t: float) -> str | float:
    try:
        return datetime.fromtimestamp(t, timezone.utc).isoformat().replace("+00:00", "Z")
    except (OverflowError, OSError, ValueError):
        return t  # not representable as a date: the number itself, which a reader must refuse


def budget_doc(spent=10.0, rate=1.1, updated=None, **extra) -> dict[str, Any]:
    return {"spent_usd": spent, "rate_usd_per_hr": rate, "hours_elapsed": 5.0, "projected_total_usd": spent + 5,
            "last_update_utc": iso(NOW if updated is None else updated), "cap_usd": 35.0, "provider": "lambda",
            "instance_id": "i-1", "source": "provider-api", "stale": False, **extra}


@st.composite
def damaged_budget(draw) -> bytes:
    """A valid budget.json with one field (or a new one) replaced by anything, or plain garbage."""
    if draw(st.booleans()):
        return draw(nasty_bytes)
    doc = budget_doc()
    key = draw(st.sampled_from([*doc, "time_scale", "extra"]))
    if draw(st.booleans()):
        doc[key] = draw(json_values)
    else:
        doc.pop(key, None)
    return dump(doc)


# ---- every reader of a file another process writes: a value or a typed error -------------------------

def call_in_thread(fn, timeout: float = 10.0):
    """fn() with a deadline: a reader that blocks (a FIFO opened for reading) fails the test."""
    box: dict[str, Any] = {}

    def target():
        try:
            box["value"] = fn()
        except BaseException as e:  # noqa: BLE001 - handed to the test
            box["error"] = e

    t = threading.Thread(target=target, daemon=True)
    t.start()
    t.join(timeout)
    assert not t.is_alive(), f"{fn} blocked for {timeout} s"
    if "error" in box:
        raise box["error"]
    return box.get("value")


def not_a_file(tmp_path: Path, kind: str) -> Path:
    p = tmp_path / f"{kind}.json"
    if kind == "fifo":
        os.mkfifo(p)
    elif kind == "folder":
        p.mkdir()
    elif kind == "dangling":
        p.symlink_to(tmp_path / "nowhere")
    elif kind == "loop":
        p.symlink_to(p)
    return p


def reader_outcomes(path: Path, now: float = NOW) -> dict[str, Any]:
    """Every reader of these files, run on `path`: each result, or the typed error each may raise."""
    out: dict[str, Any] = {}
    typed = {
        "read_json_file": (lambda: read_json_file(path), (OSError, ValueError)),
        "budget": (lambda: read_budget_file(path), (FileNotFoundError, BudgetFormatError)),
        "guard": (lambda: read_source(str(path)), (ReadError,)),
        "heartbeat": (lambda: Heartbeat.read(path), ()),
        "events": (lambda: read_events(path), (FileNotFoundError, UnreadableFileError)),
        "state": (lambda: StateStore(path), (StateError,)),
        "ledger": (lambda: Ledger.load(path, "lambda", "i-1", now=now), ()),
    }
    for name, (fn, errors) in typed.items():
        try:
            out[name] = call_in_thread(fn)
        except errors as e:
            out[name] = e
    return out


@pytest.mark.parametrize("kind", ["fifo", "folder", "dangling", "loop"])
def test_every_reader_refuses_a_path_that_is_not_a_file_without_blocking(tmp_path: Path, kind: str) -> None:
    path = not_a_file(tmp_path, kind)
    out = reader_outcomes(path)
    assert out["heartbeat"] is None
    assert isinstance(out["ledger"], Ledger) and out["ledger"].spent_usd == 0.0
    assert isinstance(out["guard"], ReadError) and str(path) in str(out["guard"])
    if kind == "dangling":  # a missing file: "nothing written yet", for each reader its own way
        assert out["events"] == [] and isinstance(out["budget"], FileNotFoundError)
        assert isinstance(out["state"], StateStore) and out["state"].final is None
        return
    for name in ("read_json_file", "budget", "events", "state"):
        assert isinstance(out[name], (ValueError, StateError)) and str(path) in str(out[name]), (name, out[name])


@FAST
@given(data=st.one_of(nasty_bytes, json_values.map(dump), damaged_budget()))
def test_every_reader_gives_a_value_or_its_typed_error_for_any_content(tmp_path: Path, data: bytes) -> None:
    path = tmp_path / "file.json"
    path.write_bytes(data)
    out = reader_outcomes(path)
    reading = out["budget"]
    if isinstance(reading, BudgetReading):  # accepted: only finite, non-negative money
        for v in (reading.spent_usd, reading.rate_usd_per_hr, reading.hours_elapsed, reading.projected_total_usd):
            assert math.isfinite(v) and v >= 0
        assert isinstance(out["guard"], tuple) and out["guard"][1] >= 1.0  # a time scale never slows the meter
    beat = out["heartbeat"]
    assert beat is None or (math.isfinite(beat.time) and isinstance(beat.step, int) and isinstance(beat.pid, int))
    assert isinstance(out["events"], (list, UnreadableFileError))
    if isinstance(out["events"], list):
        assert all(isinstance(e, dict) and isinstance(e.get("event"), str) for e in out["events"])
    led = out["ledger"]
    assert isinstance(led, Ledger) and math.isfinite(led.spent_usd) and led.spent_usd >= 0


# ---- the watchdog's state file: damage never crashes, never invents relaunches, never loses a final ----

def state_doc(**over) -> dict[str, Any]:
    return {"version": 1, "final": None, "starts": 3, "restarts_total": 2, "restart_times": [NOW - 60, NOW - 30],
            "last_exit": None, "instance_id": None, "origin_instance_id": None, "updated": None, **over}


@st.composite
def damaged_state(draw) -> tuple[bytes, dict[str, Any] | None]:
    doc = state_doc(final=draw(st.one_of(st.none(), st.just({"exit_code": 76, "reason": "budget-stop"}))))
    key = draw(st.sampled_from(["restart_times", "starts", "restarts_total", "trainer", "instance_id", "final",
                                "last_exit"]))
    if key == "restart_times" and draw(st.booleans()):
        doc[key] = draw(st.lists(st.one_of(times, json_values), max_size=6))
    else:
        doc[key] = draw(json_values)
    return dump(doc), doc


@FAST
@given(case=damaged_state())
def test_a_damaged_state_file_is_repaired_or_refused_and_a_final_decision_survives(tmp_path: Path, case) -> None:
    raw, doc = case
    path = tmp_path / "watchdog-state.json"
    path.write_bytes(raw)
    try:
        store = StateStore(path)
    except StateError as e:  # refused: the watchdog exits 2 and relaunches nothing
        assert str(path) in str(e)
        return
    had_final = isinstance(doc.get("final"), dict) and isinstance(doc["final"].get("exit_code"), int)
    if had_final:
        assert store.final is not None and store.final["exit_code"] == doc["final"]["exit_code"]
    assert store.starts >= 0 and store.restarts_total >= 0
    policy = RestartPolicy(max_restarts=3, window_seconds=3600, backoff_base_seconds=1, backoff_max_seconds=4)
    now = time.time()
    genuine = [t for t in doc["restart_times"] if isinstance(t, (int, float)) and not isinstance(t, bool)
               and math.isfinite(t) and now - 3600 < t <= now + CLOCK_SKEW_S] if isinstance(doc["restart_times"], list) else []
    assert policy.recent(store.restart_times, now) <= len(genuine)  # no relaunch counted that never happened
    assert all(math.isfinite(t) and t <= now + CLOCK_SKEW_S for t in store.restart_times)


def test_state_file_damage_cases_from_the_probe(tmp_path: Path) -> None:
    path = tmp_path / "state.json"
    path.write_bytes(b"\xff\xfe not utf-8")
    with pytest.raises(StateError, match="not UTF-8"):
        StateStore(path)
    path.write_text(json.dumps(state_doc(restart_times=["x", None, {"t": 1}, 1e300, float("nan")])))
    store = StateStore(path)
    assert store.restart_times == []
    policy = RestartPolicy(max_restarts=1, window_seconds=3600, backoff_base_seconds=1, backoff_max_seconds=4)
    assert policy.may_relaunch(store.restart_times, time.time())  # [1e300] no longer gives up after one crash
    assert policy.may_relaunch([1e300], time.time())
    path.write_text(json.dumps(state_doc(final={"exit_code": "76"})))
    with pytest.raises(StateError, match="final"):
        StateStore(path)


# ---- heartbeat times: a frozen trainer is found stalled whatever time its beat claims -----------------

@FAST
@given(beat_time=times, text=st.sampled_from([None, "Infinity", "-Infinity", "NaN", "1e999", '"soon"']))
def test_a_frozen_trainer_is_stalled_whatever_its_heartbeat_says_the_time_is(tmp_path: Path, beat_time: float,
                                                                               text: str | None) -> None:
    hb = tmp_path / "heartbeat.json"
    when = json.dumps(beat_time) if text is None else text
    hb.write_text(f'{{"step": 7, "time": {when}, "pid": 1234, "phase": "training"}}')
    stall_s, started = 60.0, NOW
    clock = [started]
    det = StallDetector(hb, stall_seconds=stall_s, startup_grace_seconds=10.0, clock=lambda: clock[0])
    det.arm(started)
    clock[0] = started + 1.0
    det.check()  # first sight of the beat
    for _ in range(3):  # the beat never changes: the trainer is frozen
        clock[0] += stall_s
        det.check()
    clock[0] += stall_s + CLOCK_SKEW_S + 1.0
    assert det.check() is not None, (beat_time, text)


def test_a_heartbeat_from_the_future_or_infinity_is_a_stall_once_it_stops_changing(tmp_path: Path) -> None:
    hb = tmp_path / "heartbeat.json"
    clock = [NOW]
    det = StallDetector(hb, stall_seconds=30.0, startup_grace_seconds=5.0, clock=lambda: clock[0])
    det.arm(NOW)
    hb.write_text(json.dumps({"step": 3, "time": NOW + 365 * 86400, "pid": 1, "phase": "training"}))
    clock[0] = NOW + 10
    assert det.check() is None  # seen now: young
    clock[0] = NOW + 45
    reason = det.check()
    assert reason is not None and "future" in reason
    hb.write_text('{"step": 3, "time": Infinity, "pid": 1, "phase": "training"}')
    clock[0] = NOW + 46
    assert det.check() is not None  # an unreadable time: no heartbeat at all, past the grace


# ---- budget.json times: spend never looks lower, staleness never hidden ----------------------------------

class Alerts:
    def __init__(self) -> None:
        self.kinds: list[str] = []

    def send(self, kind, subject, body, fields=None):
        self.kinds.append(kind)
        return []

    channels = ()


@FAST
@given(spent=st.floats(0, 30), rate=st.floats(0, 5), offset=st.one_of(st.floats(-1e9, 1e9), st.sampled_from(
    [365 * 86400.0, 5 * 3600.0, CLOCK_SKEW_S + 1, -CLOCK_SKEW_S, 0.0])), hours=st.floats(0, 48),
       scale=json_values)
def test_the_guard_never_judges_spend_below_the_meter_whatever_the_reading_claims(
        tmp_path: Path, spent: float, rate: float, offset: float, hours: float, scale: Any) -> None:
    path = tmp_path / "budget.json"
    doc = budget_doc(spent=spent, rate=rate, updated=NOW + offset, time_scale=scale)
    assume(isinstance(doc["last_update_utc"], str))
    path.write_text(json.dumps(doc))
    os.utime(path, (NOW, NOW))  # written now, whatever date it carries
    clock = [NOW]
    alerts = Alerts()
    guard = BudgetGuard(BudgetConfig(cap_usd=1e9, alert_usd=1e8, curr_cost_uri=str(path)), alerts,  # type: ignore[arg-type]
                        clock=lambda: clock[0])
    guard.check()
    clock[0] = NOW + hours * 3600.0
    decision = guard.check()  # the same file: no new reading for `hours`
    meter = spent + rate * hours  # what the provider billed since the file was written, at least
    assert decision.spent_usd is not None and decision.spent_usd >= meter - 1e-6, (decision, meter)
    if decision.exit_code == 77:
        # Spent over the cap (a time_scale > 1 bills faster): the guard exits at once, before any
        # alert send (docs/DESIGN.md §6 rule 1); the watchdog alerts on the stop.
        assert decision.spent_usd > guard.cap
        return
    if offset > CLOCK_SKEW_S:  # a reading from the future is suspect: the stale alert went out
        assert "stale" in alerts.kinds
    if hours * 60 > 15:  # and an old one is stale however it is dated
        assert "stale" in alerts.kinds


def test_the_probe_case_a_year_ahead_is_judged_like_a_fresh_one_and_alerts(tmp_path: Path) -> None:
    path = tmp_path / "budget.json"
    path.write_text(json.dumps(budget_doc(spent=10.0, rate=1.1, updated=NOW + 365 * 86400)))
    os.utime(path, (NOW, NOW))
    clock = [NOW]
    alerts = Alerts()
    guard = BudgetGuard(BudgetConfig(cap_usd=35.0, curr_cost_uri=str(path)), alerts, clock=lambda: clock[0])  # type: ignore[arg-type]
    guard.check()
    clock[0] = NOW + 10 * 3600
    d = guard.check()
    assert d.spent_usd == pytest.approx(21.0, abs=0.01) and "stale" in alerts.kinds


@pytest.mark.parametrize("scale", [0.0, 1e-9, -5, "fast", None, True, 0.5])
def test_a_time_scale_under_one_never_slows_the_guards_meter(tmp_path: Path, scale: Any) -> None:
    path = tmp_path / "budget.json"
    path.write_text(json.dumps(budget_doc(spent=10.0, rate=1.0, updated=NOW, time_scale=scale)))
    clock = [NOW]
    guard = BudgetGuard(BudgetConfig(cap_usd=35.0, curr_cost_uri=str(path)), Alerts(), clock=lambda: clock[0])  # type: ignore[arg-type]
    guard.check()
    clock[0] = NOW + 3600
    assert guard.check().spent_usd == pytest.approx(11.0)


# ---- provider prices and statuses: the ledger counts at least what was billed -----------------------------

price_values = st.one_of(
    st.none(), st.booleans(), st.integers(-500, 500), st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from(["110", "1.10", "", "free", "nan", "inf", "-3", "0"]), st.floats(0.5, 400.0),
)
# Statuses the provider bills in, or that we do not know (which must count as billing).
billing_statuses = st.one_of(st.sampled_from(["active", "booting", "unhealthy"]), st.text(max_size=8),
                             st.integers(), st.none())


@FAST
@given(polls=st.lists(st.tuples(price_values, billing_statuses, st.floats(60, 7200)), min_size=2, max_size=8))
def test_a_suspect_price_never_makes_the_ledger_count_less_than_the_trusted_rate(polls) -> None:
    led = Ledger(provider="lambda", instance_id="i-1")
    t, trusted_max, spent_before = 0.0, None, 0.0
    for cents, status, gap in polls:
        t += gap
        record = {"id": "i-1", "status": status, "instance_type": {"name": "gpu_1x_a100", "price_cents_per_hour": cents}}
        inst = parse_lambda_instance(record)
        if not (isinstance(status, str) and status in ("terminated", "terminating", "preempted")):
            assert inst.status in BILLING_STATUSES  # an unknown state keeps the meter running
        try:
            led.record_success(t, inst, time_scale=1.0)
        except ValueError:  # no price at all yet: a failed poll, the meter runs at the last rate
            led.record_failure(t, "no usable price", time_scale=1.0)
        if trusted_max is not None:
            expected = spent_before + trusted_max * gap / 3600.0
            assert led.spent_usd >= expected * (1 - 1e-12) - 1e-9
        price = inst.price_usd_per_hr
        if price is not None and price > 0:
            suspect = trusted_max is not None and price < trusted_max
            trusted_max = max(trusted_max or 0.0, price)
        else:
            suspect = trusted_max is not None
        reading = led.reading(t, cap_usd=35.0, planned_hours=None, stale_after_failures=2, source="provider-api")
        if trusted_max is not None:
            assert reading is not None and reading.rate_usd_per_hr == pytest.approx(trusted_max)
            if suspect:  # marked: budget.json says stale, so the guard alerts
                assert reading.stale and led.rate_note
        spent_before = led.spent_usd


def test_a_zero_price_is_suspect_and_a_higher_one_is_taken_at_once() -> None:
    mk = lambda cents: parse_lambda_instance(  # noqa: E731
        {"id": "i", "status": "active", "instance_type": {"name": "a100", "price_cents_per_hour": cents}})
    led = Ledger(provider="lambda", instance_id="i")
    with pytest.raises(ValueError, match="no earlier price"):
        led.record_success(0, mk(0), time_scale=1)  # a first price of $0/h: no budget.json from it
    led.record_success(0, mk(110), time_scale=1)
    led.record_success(3600, mk(0), time_scale=1)  # the probe: $0/h accepted as a good reading
    r = led.reading(3600, cap_usd=35, planned_hours=None, stale_after_failures=2, source="provider-api")
    assert r is not None and r.rate_usd_per_hr == 1.1 and r.stale and r.spent_usd == pytest.approx(1.1)
    led.record_success(7200, mk(200), time_scale=1)
    r = led.reading(7200, cap_usd=35, planned_hours=None, stale_after_failures=2, source="provider-api")
    assert r is not None and r.rate_usd_per_hr == 2.0 and not r.stale and r.spent_usd == pytest.approx(3.1)
    other = parse_lambda_instance({"id": "i", "status": "active", "instance_type": {"name": "a10", "price_cents_per_hour": 75}})
    led.record_success(10800, other, time_scale=1)  # another type under the same id: a running one does not change
    r = led.reading(10800, cap_usd=35, planned_hours=None, stale_after_failures=2, source="provider-api")
    assert r is not None and r.rate_usd_per_hr == 2.0 and r.stale and r.spent_usd == pytest.approx(5.1)
    assert "a running instance does not change type" in (led.rate_note or "") and led.instance_type == "a100"


@FAST
@given(cost=price_values, uptime=st.one_of(json_values, st.floats(-1e6, 1e6)), status=json_values)
def test_runpod_records_parse_to_a_finite_price_and_uptime_or_none(cost, uptime, status) -> None:
    try:
        inst = parse_runpod_pod({"id": "p", "costPerHr": cost, "desiredStatus": status,
                                 "runtime": {"uptimeInSeconds": uptime}})
    except ProviderError:
        return
    assert inst.price_usd_per_hr is None or math.isfinite(inst.price_usd_per_hr)
    assert inst.uptime_seconds is None or (math.isfinite(inst.uptime_seconds) and inst.uptime_seconds >= 0)
    assert isinstance(inst.raw_status, str) and (inst.instance_type is None or isinstance(inst.instance_type, str))


# ---- the ledger file and the sidecar's clock ----------------------------------------------------------------

@FAST
@given(key=st.sampled_from(["spent_usd", "accrued_until", "rate_usd_per_hr", "first_seen", "consecutive_failures",
                            "billing", "instance_type", "provider"]), value=st.one_of(json_values, times))
def test_a_damaged_ledger_never_lowers_the_spend_it_shows(tmp_path: Path, key: str, value: Any) -> None:
    path = tmp_path / "budget-state.json"
    good = Ledger(provider="lambda", instance_id="i-1", first_seen=NOW - 7200, accrued_until=NOW - 60, spent_usd=12.5,
                  hours_elapsed=10, rate_usd_per_hr=1.25, trusted_rate_usd_per_hr=1.25)
    doc = json.loads(json.dumps(good.__dict__))
    doc[key] = value
    path.write_text(json.dumps(doc))
    led = Ledger.load(path, "lambda", "i-1", now=NOW)
    if key == "provider" and isinstance(value, str) and value != "lambda":
        assert led.spent_usd == 0.0  # another provider's ledger: not ours (the poller keeps budget.json's spend)
    elif key == "spent_usd":
        if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value >= 0:
            assert led.spent_usd == pytest.approx(value)  # a usable figure is the ledger's word
        else:  # the figure itself is lost: budget.json's is carried over (the next test)
            assert led.spent_usd >= 0.0
    else:
        assert led.spent_usd >= 12.5 - 1e-9  # damage elsewhere: the spend shown is carried over
    assert led.accrued_until is None or led.accrued_until <= NOW + CLOCK_SKEW_S  # a future time never freezes accrual
    before = led.spent_usd
    led.record_failure(NOW + 3600, "down", time_scale=1.0)
    assert led.spent_usd >= before


def test_a_clock_that_goes_back_charges_time_twice_never_skips_it() -> None:
    led = Ledger(provider="lambda", instance_id="i")
    inst = parse_lambda_instance({"id": "i", "status": "active", "instance_type": {"price_cents_per_hour": 100}})
    led.record_success(10_000, inst, time_scale=1)
    led.record_success(5_000, inst, time_scale=1)  # the clock jumped back an hour and a half
    led.record_success(8_600, inst, time_scale=1)
    assert led.spent_usd == pytest.approx(1.0)  # the hour after the jump is charged


@pytest.mark.parametrize("damage", ['{"spent_usd": "lots"}', "not json", '{"accrued_until": 1e300}', "\udcff"])
def test_a_sidecar_restarted_on_a_damaged_ledger_keeps_what_budget_json_published(tmp_path: Path, damage: str) -> None:
    from budget_sidecar.poller import Poller
    from budget_sidecar.settings import SidecarSettings

    settings_ = SidecarSettings(provider="static", rate_usd_per_hr=2.0, output=tmp_path / "budget.json")
    clock = [NOW]
    first = Poller(settings_, None, clock=lambda: clock[0])
    first.poll_once()
    clock[0] += 3600
    first.poll_once()
    published = first.snapshot().document["spent_usd"]
    good = json.loads(settings_.state_path.read_text())
    if damage.startswith("{"):
        good.update(json.loads(damage))
        settings_.state_path.write_text(json.dumps(good))
    else:
        settings_.state_path.write_bytes(damage.encode("utf-8", "surrogateescape"))
    second = Poller(settings_, None, clock=lambda: clock[0])
    clock[0] += 60
    second.poll_once()
    assert second.snapshot().document["spent_usd"] >= published == pytest.approx(2.0)


# ---- the trainer's own leftovers of an earlier start ------------------------------------------------------

@FAST
@given(data=st.one_of(nasty_bytes, json_values.map(dump)))
def test_the_files_an_earlier_trainer_left_are_read_or_ignored_never_a_crash(tmp_path: Path, data: bytes) -> None:
    from conftest import TINY_CONFIG
    from x1_pretrain.config import load_config
    from x1_pretrain.train.setup import compile_choice, earlier_start

    ckpt = tmp_path / "ck"
    ckpt.mkdir(exist_ok=True)
    cfg = load_config(TINY_CONFIG, ["train.compile=true"], {"checkpoint.dir": str(ckpt)})
    (ckpt / "mlflow-run.json").write_bytes(data)
    (ckpt / "compile-deaths.json").write_bytes(data)
    earlier = earlier_start(cfg)
    assert earlier == {} or isinstance(earlier.get("run_id"), str)
    assert compile_choice(cfg, ckpt, None) in ("default", None)
