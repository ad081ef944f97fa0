"""The sidecar's bookkeeping: what has been spent, kept so that it never goes down.

Spend comes from the provider where the provider can say it, and from the sidecar's own clock
where it cannot:

- Lambda has no billing endpoint and no launch time: spend = price × billed time, measured by the
  sidecar from its first sight of the instance (plus `initial_hours` for what came before).
- RunPod: costPerHr × runtime.uptimeInSeconds. Uptime restarts from 0 when a pod is resumed, so
  finished runs are added up separately.
- static (on-prem): a fixed rate on the sidecar's own clock.

A failed poll never lowers the spend: it keeps growing at the last known rate and, after
`stale_after_failures` failures in a row, the reading says `stale`.

A price is the provider's word about this instance, and a wrong one must never make spend look
lower. Only a record whose id is the instance's is read at all: a record of another id (another
instance's price, an A10 at 75 cents) is a bad answer, counted as a failed poll at the last
trusted price and marked stale at once, never a new rate. A price that is missing, not a finite
number, zero or negative, or lower than the last trusted price, is suspect: a running instance
does not change its type, so a lower price under another type name (cents read as dollars, a
renamed type) is as suspect as one under the same name. The ledger counts at the last trusted
price (the larger of the two) and keeps the trusted type, says why in `rate_note`, and the reading
is marked `stale`, which makes the trainer's guard raise its stale-data alert. It stays so until
the provider reports a price at or above the trusted one. With no trusted price yet, a suspect
one is a failed poll (no budget.json until a good price comes, so the trainer's pre-launch check
refuses to start). A higher price is taken at once, with a warning; the guard alerts when it is
over 1.2x the plan. On several hosts the sum may fall when a host stops billing (the set of
billing instances changed); a lower sum from the same hosts is suspect like a lower price. The static provider's rate is the operator's setting and
is taken as it is. The ledger is persisted next
to budget.json after every poll, so a restarted sidecar carries on from where it was, and charges
the time it was down at the last known rate.

A run on several hosts is billed as one: every instance is asked each poll, and the ledger counts
the sum of the prices of those billing (a host left out of the poll would be money not counted).
An instance the provider does not answer for is counted at its last price, as a failed poll of its
own: after `stale_after_failures` misses in a row the reading is stale. Each instance's own figures
are kept in `parts` for budget.json; the total is what the trainer's guard reads.
"""

from __future__ import annotations

import logging
import math
from dataclasses import asdict, dataclass, field, fields
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from x1_common.contracts import CLOCK_SKEW_S, BudgetReading, finite_number, format_utc, read_json_file
from x1_common.fsutil import write_json_atomic
from x1_common.providers import BILLING_STATUSES, Instance

log = logging.getLogger("x1.budget_sidecar")


@dataclass
class Ledger:
    """Everything the sidecar must remember across a restart. Times are unix seconds (wall clock);
    the time charged between two polls of one process is the monotonic clock's (Poller)."""

    provider: str
    instance_id: str
    first_seen: float | None = None  # first successful poll
    accrued_until: float | None = None  # wall time up to which spend has been added
    spent_usd: float = 0.0  # never decreases
    hours_elapsed: float = 0.0  # billed hours
    rate_usd_per_hr: float | None = None  # last known
    billing: bool = True  # was the instance billing at the last poll
    instance_status: str | None = None
    instance_type: str | None = None  # informative, for the run's manifest
    consecutive_failures: int = 0
    poll_failures_total: int = 0
    last_success: float | None = None
    last_error: str | None = None
    # RunPod: money and hours of the pod's finished runs (before its last resume).
    finished_runs_usd: float = 0.0
    finished_runs_hours: float = 0.0
    run_usd: float = 0.0  # current run as RunPod reports it
    run_hours: float = 0.0
    last_uptime_s: float = 0.0
    trusted_rate_usd_per_hr: float | None = None  # the last price not found suspect
    rate_note: str | None = None  # why the price counted now is not the provider's (None: it is)
    # Several hosts: each instance's figures by id (node-N for static). Keys: rate_usd_per_hr,
    # interval_rate (the higher of the last two prices: what the time since the last poll costs),
    # billing, billed_interval, status, instance_type, spent_usd, hours_elapsed, consecutive_failures,
    # last_error. Informative: the totals above are the ones counted.
    parts: dict[str, dict[str, Any]] = field(default_factory=dict)

    # --- persistence ------------------------------------------------------------------------
    @classmethod
    def load(cls, path: Path, provider: str, instance_id: str, now: float | None = None) -> Ledger:
        """The persisted ledger, or a fresh one. A ledger of another instance (a relaunch gives a new
        id) or another provider keeps its spend: the budget is for the run, not the instance.

        The file is the previous sidecar's: a damaged one (not JSON, a field of the wrong type or
        not a finite number, a time ahead of `now`) is not trusted as a whole, but the spend it
        still shows is carried over (spend never goes down; the poller also carries over what
        budget.json published)."""
        fresh = cls(provider=provider, instance_id=instance_id)
        try:
            data = read_json_file(path, finite=False)  # a non-finite field is named below, the others kept
        except FileNotFoundError:
            return fresh
        except ValueError as e:
            # Refusing to start would stop budget.json altogether; starting from zero would hide spend.
            # Keep going, loudly: budget.json's published spend is carried over by the poller.
            log.error("cannot read the ledger %s (%s): starting a new one from what budget.json published", path, e)
            return fresh
        problems = _ledger_problems(data, now)
        if problems:
            carried = _carried_spend(data)
            log.error("the ledger %s is damaged (%s): starting a new one, carrying over $%.4f and %.3f h; "
                      "budget.json's published spend is kept too", path, "; ".join(problems), *carried)
            fresh.spent_usd = fresh.finished_runs_usd = carried[0]
            fresh.hours_elapsed = fresh.finished_runs_hours = carried[1]
            return fresh
        known = {f.name for f in fields(cls)}
        old = cls(**{k: v for k, v in data.items() if k in known})
        if old.trusted_rate_usd_per_hr is None and old.rate_note is None and (old.rate_usd_per_hr or 0) > 0:
            old.trusted_rate_usd_per_hr = old.rate_usd_per_hr  # a ledger written before prices were checked
        if old.provider != provider or old.instance_id != instance_id:
            # The budget is the run's, whatever the sidecar is restarted with: a relaunched
            # instance, or another provider (a switch to static to get round a failing API key)
            # starts counting anew on top of what was spent, never from zero.
            what = (f"provider changed from {old.provider} to {provider}" if old.provider != provider
                    else f"instance changed from {old.instance_id} to {instance_id}")
            log.warning("%s: carrying over $%.2f and %.2f h already spent", what, old.spent_usd, old.hours_elapsed)
            same_provider = old.provider == provider
            # The old instance is gone (preempted or terminated); its downtime is not billed. Another
            # provider's prices say nothing about this one's: no trusted price carried across.
            return cls(
                provider=provider, instance_id=instance_id, first_seen=old.first_seen, spent_usd=old.spent_usd,
                hours_elapsed=old.hours_elapsed, rate_usd_per_hr=old.rate_usd_per_hr if same_provider else None,
                poll_failures_total=old.poll_failures_total, finished_runs_usd=old.spent_usd,
                finished_runs_hours=old.hours_elapsed,
                trusted_rate_usd_per_hr=old.trusted_rate_usd_per_hr if same_provider else None,
            )
        log.info("resuming the ledger %s: $%.4f spent over %.3f h", path, old.spent_usd, old.hours_elapsed)
        return old

    def save(self, path: Path) -> None:
        write_json_atomic(path, asdict(self))

    # --- accounting -------------------------------------------------------------------------
    def _accrue(self, now: float, time_scale: float, rate: float | None, billing: bool,
                elapsed_s: float | None = None) -> None:
        """Charge the time since `accrued_until` at `rate`, on the (scaled) billed clock.

        `elapsed_s` is that time as the poller measured it on the monotonic clock, which no step of
        the wall clock moves; without it (a restart: nothing else spans one), the wall clock's.
        A wall clock that went back (or an `accrued_until` ahead of it) is re-based on `now`."""
        if self.accrued_until is not None and rate is not None and billing:
            seconds = max(0.0, now - self.accrued_until) if elapsed_s is None else elapsed_s
            hours = seconds * time_scale / 3600.0
            self.spent_usd += rate * hours
            self.hours_elapsed += hours
            for part in self.parts.values():
                if part.get("billed_interval") and part.get("interval_rate") is not None:
                    part["spent_usd"] += part["interval_rate"] * hours
                    part["hours_elapsed"] += hours
        for part in self.parts.values():
            part["interval_rate"], part["billed_interval"] = part.get("rate_usd_per_hr"), part.get("billing", True)
        self.accrued_until = now

    # --- several hosts ----------------------------------------------------------------------
    def update_parts(self, answers: dict[str, Instance], missing: dict[str, str]) -> tuple[Instance, bool]:
        """Record one poll of every instance of a run on several hosts (before record_success) and
        return the group as one instance: the sum of the billing instances' prices, a missing one
        at its last price; and whether the set of billing instances changed (a lower sum is then
        taken, not suspected). ValueError when a missing instance has never been priced."""
        unknown = [f"{iid}: {why}" for iid, why in missing.items() if iid not in self.parts]
        if unknown:
            raise ValueError(f"no price known yet for instance {'; '.join(unknown)}")
        billing_before = {iid for iid, p in self.parts.items() if p.get("billing")}
        for iid, inst in answers.items():
            part = self.parts.setdefault(iid, {"spent_usd": 0.0, "hours_elapsed": 0.0, "rate_usd_per_hr": None,
                                                "billing": False})
            price = inst.price_usd_per_hr
            previous = part["rate_usd_per_hr"]
            part.update(
                rate_usd_per_hr=price, status=inst.status, instance_type=inst.instance_type,
                interval_rate=price if previous is None or price is None else max(previous, price),
                billed_interval=part["billing"] or inst.billing, billing=inst.billing, consecutive_failures=0,
                last_error=None,
            )
        for iid, why in missing.items():
            part = self.parts[iid]
            part["consecutive_failures"] = part.get("consecutive_failures", 0) + 1
            part["last_error"] = why
        parts = [self.parts[iid] for iid in (*answers, *missing)]
        billing = [p for p in parts if p["billing"]]
        prices = [p["rate_usd_per_hr"] for p in (billing or parts)]
        # One unusable price makes the sum unusable: the ledger's price checks then name it.
        bad = next((x for x in prices if x is None or not math.isfinite(x) or x <= 0), False)
        first = billing[0] if billing else parts[0]
        billing_now = {iid for iid, p in self.parts.items() if p.get("billing")}
        return Instance(
            id=",".join(self.parts), status=first["status"], raw_status=first["status"],
            price_usd_per_hr=sum(prices) if bad is False else bad, uptime_seconds=None,
            instance_type="+".join(str(p["instance_type"]) for p in (billing or parts)), region=None,
        ), bool(self.first_seen is not None and billing_before != billing_now)

    def note_missing_parts(self, missing: dict[str, str]) -> None:
        """After record_success: instances the provider did not answer for count as failed polls."""
        if not missing:
            return
        self.consecutive_failures = max(self.parts[iid]["consecutive_failures"] for iid in missing)
        self.poll_failures_total += 1
        self.last_error = "; ".join(f"instance {iid}: {why}" for iid, why in missing.items())

    def note_wrong_record(self, what: str) -> None:
        """A poll answered with a record that is not this instance's (another id): a failed poll,
        already counted, and stale at once. Call after record_failure (or note_missing_parts)."""
        trusted = self.trusted_rate_usd_per_hr
        note = f"{what}: a bad answer, not this instance's price" + (
            f"; counting at the last trusted ${trusted:.4f}/h" if trusted is not None else "")
        if note != self.rate_note:
            log.error("%s; budget.json says stale until the instance's own record comes", note)
        self.rate_note = note

    def _price(self, inst: Instance | None, static_rate: float | None, members_changed: bool = False) -> float:
        """The rate to count at for this poll, and the bookkeeping of the trusted price (see the
        module docstring). ValueError when there is no price to count at all."""
        if inst is None:  # static: the operator's setting
            if static_rate is None or not math.isfinite(static_rate) or static_rate <= 0:
                raise ValueError(f"the static rate {static_rate!r} is not a positive number")
            self.trusted_rate_usd_per_hr, self.rate_note = static_rate, None
            return static_rate
        reported = inst.price_usd_per_hr
        trusted = self.trusted_rate_usd_per_hr
        new_type = bool(inst.instance_type and self.instance_type and inst.instance_type != self.instance_type)
        if reported is None or not math.isfinite(reported):
            problem = "no usable price"
        elif reported <= 0:
            problem = f"a price of ${reported:.4f}/h"
        elif trusted is not None and reported < trusted and new_type and not members_changed:
            problem = (f"${reported:.4f}/h under another instance type ({inst.instance_type}), lower than the last "
                       f"trusted ${trusted:.4f}/h of {self.instance_type}: a running instance does not change type")
        elif trusted is not None and reported < trusted and not members_changed:
            problem = (f"${reported:.4f}/h, lower than the last trusted ${trusted:.4f}/h with no change of "
                       f"instance type ({self.instance_type or 'not reported'})")
        else:
            if trusted is not None and reported > trusted:
                log.warning("the provider's price rose from $%.4f/h to $%.4f/h: counting at the new price now",
                            trusted, reported)
            elif trusted is not None and reported < trusted:
                log.warning("the instances billing changed (%s to %s): their price $%.4f/h is taken",
                            self.instance_type, inst.instance_type, reported)
            self.trusted_rate_usd_per_hr, self.rate_note = reported, None
            return reported
        if trusted is None:
            raise ValueError(f"the provider gave {problem} and no earlier price is known")
        note = f"the provider reported {problem}: counting at the last trusted ${trusted:.4f}/h"
        if note != self.rate_note:
            log.error("suspect price: %s; budget.json says stale until a trustworthy price comes", note)
        self.rate_note = note
        return trusted

    def record_success(self, now: float, inst: Instance | None, *, time_scale: float, static_rate: float | None = None,
                       initial_hours: float = 0.0, elapsed_s: float | None = None,
                       members_changed: bool = False) -> None:
        """A poll that answered. `inst` None means the static provider (rate `static_rate`);
        `elapsed_s` the monotonic seconds since the last charge (see _accrue); `members_changed`:
        several hosts, and the set of billing instances is not the last poll's."""
        rate = self._price(inst, static_rate, members_changed)
        billing_now = True if inst is None else inst.status in BILLING_STATUSES
        if self.first_seen is None:
            self.first_seen = now
            if initial_hours:
                self.spent_usd += rate * initial_hours
                self.hours_elapsed += initial_hours
                for part in self.parts.values():
                    if part.get("billing") and part.get("rate_usd_per_hr") is not None:
                        part["spent_usd"] += part["rate_usd_per_hr"] * initial_hours
                        part["hours_elapsed"] += initial_hours
        # For the time since the last poll we know neither when the price changed nor when the
        # instance stopped: charge the higher of the two rates, and bill if it billed at either end.
        interval_rate = rate if self.rate_usd_per_hr is None else max(rate, self.rate_usd_per_hr)
        if self.provider == "runpod" and inst is not None:
            if inst.uptime_seconds is not None:
                self._accrue_runpod(now, inst, rate)
            else:
                # A pod without runtime (starting, stopped, interrupted): its run, if any, is over.
                self._close_runpod_run()
                self._accrue(now, time_scale, interval_rate, self.billing, elapsed_s)
        else:
            self._accrue(now, time_scale, interval_rate, self.billing or billing_now, elapsed_s)
        self.rate_usd_per_hr = rate
        self.billing = billing_now
        self.instance_status = "running" if inst is None else inst.status
        if inst is not None and inst.instance_type and self.rate_note is None:
            self.instance_type = inst.instance_type  # a suspect reading keeps the trusted type
        self.consecutive_failures = 0
        self.last_success = now
        self.last_error = None

    def _close_runpod_run(self) -> None:
        if self.run_usd or self.run_hours:
            self.finished_runs_usd += self.run_usd
            self.finished_runs_hours += self.run_hours
        self.run_usd = self.run_hours = self.last_uptime_s = 0.0

    def _accrue_runpod(self, now: float, inst: Instance, rate: float) -> None:
        uptime = float(inst.uptime_seconds or 0.0)
        if uptime + 1.0 < self.last_uptime_s:
            self._close_runpod_run()  # resumed: uptime started again from 0
        self.last_uptime_s = uptime
        self.run_usd = rate * uptime / 3600.0
        self.run_hours = uptime / 3600.0
        # The provider's figure wins when it is higher; an estimate made during an outage that
        # overshot is kept (spend never goes down) until the provider's figure passes it.
        self.spent_usd = max(self.spent_usd, self.finished_runs_usd + self.run_usd)
        self.hours_elapsed = max(self.hours_elapsed, self.finished_runs_hours + self.run_hours)
        self.accrued_until = now

    def record_failure(self, now: float, error: str, *, time_scale: float, elapsed_s: float | None = None) -> None:
        """A poll that did not answer: spend keeps rising at the last known rate."""
        self._accrue(now, time_scale, self.rate_usd_per_hr, self.billing, elapsed_s)
        self.consecutive_failures += 1
        self.poll_failures_total += 1
        self.last_error = error

    def catch_up(self, now: float, time_scale: float) -> None:
        """At start-up: charge the time the sidecar was down (the instance kept billing)."""
        if self.accrued_until is not None and self.rate_usd_per_hr is not None:
            down_h = max(0.0, now - self.accrued_until) * time_scale / 3600.0
            if down_h > 0:
                log.info("charging %.3f billed hours while the sidecar was down, at $%.2f/h", down_h, self.rate_usd_per_hr)
            self._accrue(now, time_scale, self.rate_usd_per_hr, self.billing)

    # --- the reading ------------------------------------------------------------------------
    def reading(self, now: float, *, cap_usd: float, planned_hours: float | None, stale_after_failures: int,
                source: str) -> BudgetReading | None:
        """budget.json's content, or None while no rate has ever been known."""
        if self.rate_usd_per_hr is None:
            return None
        rest_h = max(planned_hours - self.hours_elapsed, 0.0) if planned_hours else 0.0
        return BudgetReading(
            spent_usd=round(self.spent_usd, 6),
            rate_usd_per_hr=self.rate_usd_per_hr,
            hours_elapsed=round(self.hours_elapsed, 6),
            projected_total_usd=round(self.spent_usd + self.rate_usd_per_hr * rest_h, 6),
            last_update_utc=datetime.fromtimestamp(now, timezone.utc),
            cap_usd=cap_usd,
            provider=self.provider,
            instance_id=self.instance_id or None,
            source=source,
            stale=self.consecutive_failures >= stale_after_failures or self.rate_note is not None,
        )


def reading_document(reading: BudgetReading, ledger: Ledger, time_scale: float) -> dict[str, Any]:
    """budget.json: the lab's five keys, ours, and a few informative ones (never a secret)."""
    doc = reading.to_dict()
    # Sub-second precision: at a test's time scale a second is minutes of billing.
    doc["last_update_utc"] = format_utc(reading.last_update_utc).replace(
        "Z", f".{reading.last_update_utc.microsecond:06d}Z"
    )
    doc["instance_status"] = ledger.instance_status
    doc["instance_type"] = ledger.instance_type
    doc["consecutive_failures"] = ledger.consecutive_failures
    if ledger.parts:
        # A run on several hosts: the total above, and what each instance adds to it.
        doc["nodes"] = len(ledger.parts)
        doc["instances"] = [
            {"instance_id": iid, "status": p.get("status"), "instance_type": p.get("instance_type"),
             "rate_usd_per_hr": p["rate_usd_per_hr"], "spent_usd": round(p["spent_usd"], 6),
             "hours_elapsed": round(p["hours_elapsed"], 6), "answered": not p.get("consecutive_failures"),
             **({"error": p["last_error"]} if p.get("last_error") else {})}
            for iid, p in ledger.parts.items()
        ]
    if ledger.rate_note:
        doc["rate_note"] = ledger.rate_note  # why the rate counted is not the provider's last price
    if time_scale != 1.0:
        doc["time_scale"] = time_scale  # tests and demo: readers extrapolate age x time_scale
    return doc


_LEDGER_TIMES = ("first_seen", "accrued_until", "last_success")
_LEDGER_AMOUNTS = ("spent_usd", "hours_elapsed", "finished_runs_usd", "finished_runs_hours", "run_usd", "run_hours",
                   "last_uptime_s")
_LEDGER_RATES = ("rate_usd_per_hr", "trusted_rate_usd_per_hr")
_LEDGER_COUNTS = ("consecutive_failures", "poll_failures_total")
_LEDGER_TEXTS = ("instance_status", "instance_type", "last_error", "rate_note")


def _ledger_problems(data: Any, now: float | None) -> list[str]:
    """What is wrong with a persisted ledger, in words; [] when every field is usable."""
    if not isinstance(data, dict):
        return [f"not a JSON object but {type(data).__name__}"]
    problems = []
    for key in ("provider", "instance_id"):
        if not isinstance(data.get(key), str):
            problems.append(f"{key} is not a string")
    for key in _LEDGER_AMOUNTS:
        x = finite_number(data.get(key, 0.0))
        if x is None or x < 0:
            problems.append(f"{key} {data.get(key)!r} is not a finite number >= 0")
    for key in _LEDGER_RATES + _LEDGER_TIMES:
        if data.get(key) is None:
            continue
        x = finite_number(data[key])
        if x is None or x < 0:
            problems.append(f"{key} {data[key]!r} is not a finite number >= 0")
        elif key in _LEDGER_TIMES and now is not None and x > now + CLOCK_SKEW_S:
            problems.append(f"{key} {x:.0f} is {x - now:.0f} s in the future")
    for key in _LEDGER_COUNTS:
        v = data.get(key, 0)
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            problems.append(f"{key} {v!r} is not a count")
    for key in _LEDGER_TEXTS:
        if data.get(key) is not None and not isinstance(data[key], str):
            problems.append(f"{key} is not a string")
    if not isinstance(data.get("billing", True), bool):
        problems.append("billing is not true or false")
    parts = data.get("parts", {})
    part_keys = ("rate_usd_per_hr", "interval_rate", "spent_usd", "hours_elapsed")
    if not isinstance(parts, dict) or not all(
            isinstance(p, dict) and all(p.get(k) is None or finite_number(p[k]) is not None for k in part_keys)
            and finite_number(p.get("spent_usd")) is not None and finite_number(p.get("hours_elapsed")) is not None
            for p in parts.values()):
        problems.append("parts is not an object of instances with finite figures")
    return problems


def _carried_spend(data: Any) -> tuple[float, float]:
    """(spent, hours) a damaged ledger still shows: the largest usable figure of each."""
    if not isinstance(data, dict):
        return 0.0, 0.0

    def usable(key: str) -> float:
        x = finite_number(data.get(key))
        return x if x is not None and x >= 0 else 0.0

    spent = max(usable("spent_usd"), usable("finished_runs_usd") + usable("run_usd"))
    hours = max(usable("hours_elapsed"), usable("finished_runs_hours") + usable("run_hours"))
    return spent, hours
