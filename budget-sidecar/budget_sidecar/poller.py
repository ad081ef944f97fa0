"""One poll: ask the provider, update the ledger, persist it, rewrite budget.json.

A run on several hosts (--instance-id id1,id2, or --nodes N with a static rate) is one budget:
each instance is asked and the ledger counts their sum (ledger.py, "several hosts").

The poll runs on the scheduler's thread; the HTTP endpoints only read `Poller.snapshot()`, so a
slow or hanging provider never blocks /budget, /healthz or /metrics.

A write that fails (a full or read-only disk) is no crash of the poll: the ledger keeps counting in
memory, the snapshot carries the failed write's line from that first failure on (/healthz answers
503 naming the path and the cause), the log says it once, and every next poll tries again. The
old budget.json stays as it was: readers extrapolate it, and its age shows.

Times: budget.json's dates are the wall clock's (its readers compare them with theirs), but the
time charged between two polls of this process is measured on the monotonic clock, so a wall
clock stepped back never skips billed time and one stepped forward never charges time that did
not pass. Only the time the sidecar was down is the wall clock's: nothing else spans a restart.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from budget_sidecar.ledger import Ledger, reading_document
from budget_sidecar.settings import SidecarSettings
from x1_common.contracts import read_budget_file
from x1_common.fsutil import WriteHealth, write_json_atomic
from x1_common.providers import Instance, LambdaClient, ProviderError, RunPodClient

log = logging.getLogger("x1.budget_sidecar")


@dataclass(frozen=True)
class Snapshot:
    """What the endpoints serve: the last budget.json document and the counters behind it."""

    document: dict[str, Any] | None
    stale: bool
    consecutive_failures: int
    poll_failures_total: int
    last_update: float | None  # unix seconds of the last budget.json write
    last_update_mono: float | None = None  # the same moment on the monotonic clock (its age, for /healthz)
    last_error: str | None = None  # the last failed poll's error (never holds the API key)
    last_error_kind: str | None = None  # ProviderError.kind: auth, not-found, server, ...
    write_error: str | None = None  # a failing write of budget.json or the ledger: path and cause


class WrongRecord(Exception):
    """The provider answered for the instance with the record of another id."""


def _wrong(inst: Instance, asked: str) -> str:
    price = "no price" if inst.price_usd_per_hr is None else f"${inst.price_usd_per_hr:.4f}/h"
    return (f"asked for instance {asked}, the provider answered with the record of {inst.id} "
            f"({inst.instance_type or 'type not reported'}, {price})")


class Poller:
    def __init__(
        self,
        settings: SidecarSettings,
        client: LambdaClient | RunPodClient | None,
        clock: Callable[[], float] = time.time,
        monotonic: Callable[[], float] | None = None,
    ) -> None:
        """`clock` dates the readings (wall clock); `monotonic` measures the time between polls (by
        default time.monotonic, or `clock` itself where a test drives one clock for both)."""
        if client is None and settings.provider != "static":
            raise ValueError(f"provider {settings.provider} needs an API client")
        self.settings = settings
        self.client = client
        self.clock = clock
        self.monotonic = monotonic or (time.monotonic if clock is time.time else clock)
        self._lock = threading.Lock()
        self._error_kind: str | None = None
        self.writes = WriteHealth(log)
        self.ledger = Ledger.load(settings.state_path, settings.provider, settings.instance_id, now=clock())
        if self.ledger.first_seen is None:
            self._carry_over_published_spend()
        self.ledger.catch_up(clock(), settings.time_scale)
        self._accrued_mono = self.monotonic()  # the ledger is charged up to here
        self._snapshot = Snapshot(None, True, self.ledger.consecutive_failures, self.ledger.poll_failures_total, None)
        if self.ledger.rate_usd_per_hr is not None:
            # A restart with a known rate can serve (and write) an estimate before the first poll.
            self._publish(self.clock(), source="estimate")

    def _carry_over_published_spend(self) -> None:
        """No ledger (deleted, unreadable) but a budget.json: what it published stays spent, so the
        figure never goes down, whichever provider published it (the budget is the run's). The time since it was written is not charged:
        whether the instance billed meanwhile is unknown."""
        try:
            prev = read_budget_file(self.settings.output)
        except (OSError, ValueError):
            return
        led = self.ledger
        if prev.spent_usd <= led.spent_usd:
            return
        log.warning("no usable ledger, but %s says $%.4f spent over %.3f h: carrying it over",
                    self.settings.output, prev.spent_usd, prev.hours_elapsed)
        led.spent_usd = led.finished_runs_usd = prev.spent_usd
        led.hours_elapsed = led.finished_runs_hours = max(led.hours_elapsed, prev.hours_elapsed)

    def snapshot(self) -> Snapshot:
        with self._lock:
            return self._snapshot

    def _elapsed(self) -> float:
        """Seconds since the ledger was last charged, on the monotonic clock; the mark moves to now."""
        mono = self.monotonic()
        elapsed, self._accrued_mono = max(0.0, mono - self._accrued_mono), mono
        return elapsed

    def poll_once(self) -> None:
        s = self.settings
        missing: dict[str, str] = {}
        wrong: list[str] = []
        changed = False
        try:
            if s.parts:
                inst, missing, wrong, changed = self._poll_group()
            else:
                inst = None if self.client is None else self.client.get_instance(s.instance_id)
                if inst is not None and inst.id != s.instance_id:
                    raise WrongRecord(_wrong(inst, s.instance_id))
            now = self.clock()
            static_rate = None if s.rate_usd_per_hr is None else s.rate_usd_per_hr * s.nodes
            self.ledger.record_success(
                now, inst, time_scale=s.time_scale, static_rate=static_rate, initial_hours=s.initial_hours,
                elapsed_s=self._elapsed(),
                members_changed=changed,
            )
            self.ledger.note_missing_parts(missing)
            if wrong:
                self.ledger.note_wrong_record("; ".join(wrong))
        except WrongRecord as e:
            now = self.clock()
            self._error_kind = "wrong-record"
            self.ledger.record_failure(now, str(e), time_scale=s.time_scale)
            self.ledger.note_wrong_record(str(e))
            log.warning("poll failed (%d in a row): %s", self.ledger.consecutive_failures, e)
            source = "estimate"
        except (ProviderError, ValueError) as e:
            now = self.clock()
            self._error_kind = e.kind if isinstance(e, ProviderError) else "bad-answer"
            self.ledger.record_failure(now, str(e), time_scale=s.time_scale, elapsed_s=self._elapsed())
            log.warning("poll failed (%d in a row): %s", self.ledger.consecutive_failures, e)
            source = "estimate"
        except Exception as e:  # a bug must not stop budget.json: count it as a failed poll
            now = self.clock()
            self._error_kind = "crash"
            self.ledger.record_failure(now, f"{type(e).__name__}: {e}", time_scale=s.time_scale,
                                       elapsed_s=self._elapsed())
            log.exception("poll crashed (%d in a row)", self.ledger.consecutive_failures)
            source = "estimate"
        else:
            self._error_kind = "not-answered" if missing else None
            if missing:
                log.warning("no answer for %s: counted at the last known price (%d in a row)",
                            self.ledger.last_error, self.ledger.consecutive_failures)
            # static has no provider to ask: its figure is an estimate by nature, as is one that
            # counts an unanswered instance at its last price.
            source = "estimate" if s.provider == "static" or missing else "provider-api"
        self._publish(now, source)

    def _poll_group(self) -> tuple[Instance | None, dict[str, str], list[str], bool]:
        """Every instance of a run on several hosts, recorded in the ledger's parts. Returns the
        group as one instance (None for static), the instances the provider did not answer for
        (or answered for with another instance's record: those are also listed in the third
        item), and whether the set of billing instances changed. Raises when none answered: a
        failed poll, as for one host."""
        s = self.settings
        if self.client is None:  # static: the same rate for every node
            rate = float(s.rate_usd_per_hr or 0.0)
            nodes = {n: Instance(id=n, status="running", raw_status="static", price_usd_per_hr=rate,
                                 uptime_seconds=None, instance_type=None, region=None) for n in s.parts}
            self.ledger.update_parts(nodes, {})
            return None, {}, [], False
        answers: dict[str, Instance] = {}
        missing: dict[str, str] = {}
        wrong: list[str] = []
        first_error: Exception | None = None
        for iid in s.instance_ids:
            try:
                inst = self.client.get_instance(iid)
            except ProviderError as e:
                missing[iid] = str(e)
                first_error = first_error or e
                continue
            if inst.id != iid:  # another instance's record: a bad answer, never its price for this one
                missing[iid] = _wrong(inst, iid)
                wrong.append(missing[iid])
                first_error = first_error or WrongRecord(missing[iid])
                continue
            answers[iid] = inst
        if first_error is not None and not answers:
            raise first_error
        group, changed = self.ledger.update_parts(answers, missing)
        return group, missing, wrong, changed

    def _publish(self, now: float, source: str) -> None:
        s = self.settings
        # The ledger first: a crash between the two writes never loses spend. A ledger that cannot
        # be written leaves budget.json as it was too: a restarted sidecar would start from the old
        # ledger, and a published figure above it would then go down.
        if not self._write(s.state_path, lambda: self.ledger.save(s.state_path)):
            self._set_snapshot(self._snapshot.document, now, written=False)
            return
        reading = self.ledger.reading(
            now, cap_usd=s.cap_usd, planned_hours=s.planned_hours, stale_after_failures=s.stale_after_failures,
            source=source,
        )
        doc = None if reading is None else reading_document(reading, self.ledger, s.time_scale)
        written = False
        if doc is not None and reading is not None:
            # Informative: without planned hours the projection has no remaining-time term, and says so.
            doc["projection"] = s.projection_basis
            doc["planned_hours"] = s.planned_hours
            written = self._write(s.output, lambda: write_json_atomic(s.output, doc))
            log.info(
                "%s: spent $%.4f at $%.2f/h over %.3f h, projected $%.2f of $%.2f (%s)%s%s",
                self.ledger.instance_status or "?", reading.spent_usd, reading.rate_usd_per_hr, reading.hours_elapsed,
                reading.projected_total_usd, s.cap_usd, s.projection_basis, " (STALE)" if reading.stale else "",
                "" if written else f" (NOT WRITTEN to {s.output})",
            )
        self._set_snapshot(doc, now, written)

    def _write(self, path: Path, write: Callable[[], None]) -> bool:
        """One file write; a failure is recorded (self.writes) and retried at the next poll."""
        try:
            write()
        except OSError as e:
            self.writes.failed(path, e, "budget.json keeps its last reading (readers extrapolate it); spend is "
                                        "still counted, and the write is retried every poll")
            return False
        self.writes.succeeded(path)
        return True

    def _set_snapshot(self, doc: dict[str, Any] | None, now: float, written: bool) -> None:
        with self._lock:
            self._snapshot = Snapshot(
                document=doc,
                stale=doc is None or bool(doc["stale"]),
                consecutive_failures=self.ledger.consecutive_failures,
                poll_failures_total=self.ledger.poll_failures_total,
                last_update=now if written else self._snapshot.last_update,
                last_update_mono=self.monotonic() if written else self._snapshot.last_update_mono,
                last_error=self.ledger.last_error if self.ledger.consecutive_failures else None,
                last_error_kind=self._error_kind if self.ledger.consecutive_failures else None,
                write_error=self.writes.last_error,
            )
