"""The sidecar's HTTP face: GET /budget, GET /healthz, GET /metrics. Thin routes over the Poller."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from datetime import datetime, timezone
from typing import Any

from apscheduler.schedulers.background import BackgroundScheduler
from fastapi import Depends, FastAPI, HTTPException, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from budget_sidecar.poller import Poller, Snapshot
from budget_sidecar.settings import SidecarSettings
from x1_common import contracts
from x1_common.providers import api_key_from_env, make_client

log = logging.getLogger("x1.budget_sidecar")


def build_poller(settings: SidecarSettings) -> Poller:
    """The poller with its provider client; the API key comes from the environment (ValueError naming it)."""
    client = None
    if settings.provider != "static":
        client = make_client(
            settings.provider, settings.api_url, api_key_from_env(settings.provider),
            timeout=settings.http_timeout_s, retries=1, backoff_s=min(1.0, settings.poll_seconds / 4),
        )
    return Poller(settings, client)


def start_scheduler(poller: Poller) -> BackgroundScheduler:
    """Poll now, then every poll_seconds, on a background thread; a slow poll delays the next, never doubles."""
    scheduler = BackgroundScheduler(timezone=timezone.utc)
    scheduler.add_job(
        poller.poll_once, "interval", seconds=poller.settings.poll_seconds, next_run_time=datetime.now(timezone.utc),
        max_instances=1, coalesce=True, misfire_grace_time=None, id="poll",
    )
    scheduler.start()
    return scheduler


def is_stale(snap: Snapshot, settings: SidecarSettings, now_mono: float) -> bool:
    """Stale: failed polls in a row, no reading yet, or no write for 3 poll periods (a stuck poller),
    measured on the monotonic clock (`now_mono`): a wall clock stepped back does not hide a stuck
    poller, nor does one stepped forward make a working one look stuck."""
    if snap.stale or snap.last_update is None or snap.last_update_mono is None:
        return True
    return now_mono - snap.last_update_mono > 3 * settings.poll_seconds + 30


def health(snap: Snapshot, settings: SidecarSettings, now_mono: float) -> tuple[dict[str, Any], int]:
    """/healthz's body and status. Not ok (503) while the reading is stale or a write fails: a
    failing write is said from its first failure, with the path and the cause in `last_error`."""
    stale = is_stale(snap, settings, now_mono)
    failing = snap.write_error is not None
    body = {
        "status": "write-failing" if failing else "stale" if stale else "ok",
        "stale": stale,
        "consecutive_failures": snap.consecutive_failures,
        "last_update_utc": (snap.document or {}).get("last_update_utc"),
        # Why the polls (or the writes) fail, for whoever waits on this sidecar (`stack up` stops
        # waiting on "auth").
        "last_error": snap.write_error or snap.last_error,
        "last_error_kind": "write" if failing else snap.last_error_kind,
        "write_error": snap.write_error,
    }
    return body, 503 if stale or failing else 200


class BudgetCollector:
    """Prometheus metrics read from the poller's snapshot at scrape time."""

    def __init__(self, poller: Poller) -> None:
        self.poller = poller

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        snap, s = self.poller.snapshot(), self.poller.settings
        doc = snap.document or {}
        gauges = [
            (contracts.M_BUDGET_CAP, "the hard cap, USD", s.cap_usd),
            (contracts.M_BUDGET_ALERT, "the alert line, USD (email + Slack once per crossing)", s.alert_usd),
            (contracts.M_BUDGET_SPENT, "spent so far, USD (never decreases)", doc.get("spent_usd")),
            (contracts.M_BUDGET_RATE, "current price, USD per hour", doc.get("rate_usd_per_hr")),
            (contracts.M_BUDGET_PROJECTED, "spent + rate x remaining planned hours (none planned: spent only), USD",
             doc.get("projected_total_usd")),
            (contracts.M_BUDGET_PLANNED_HOURS, "billed hours planned (--planned-hours); 0: none, the projection is "
             "the spend so far and the trainer's guard projects the rest", s.planned_hours or 0.0),
            (contracts.M_BUDGET_LAST_UPDATE, "unix time of the last budget.json write", snap.last_update),
            (contracts.M_BUDGET_STALE, "1 when the reading is stale (failed polls)",
             float(is_stale(snap, s, self.poller.monotonic()))),
            (contracts.M_BUDGET_WRITE_FAILING, "1 while writing budget.json or its ledger fails (a full or read-only "
             "disk: /healthz's last_error names the path)", float(snap.write_error is not None)),
        ]
        for name, doc_text, value in gauges:
            if value is not None:
                yield GaugeMetricFamily(name, doc_text, value=float(value))
        yield CounterMetricFamily(
            contracts.M_BUDGET_POLL_FAILURES, "provider polls that failed (kept across restarts)",
            value=snap.poll_failures_total,
        )


def get_poller(request: Request) -> Poller:
    return request.app.state.poller


def create_app(settings: SidecarSettings, poller: Poller | None = None) -> FastAPI:
    """The app. Without `poller`, builds one from settings and schedules its polls for the app's lifetime."""
    own_poller = poller is None

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        scheduler = start_scheduler(app.state.poller) if own_poller else None
        yield
        if scheduler is not None:
            scheduler.shutdown(wait=False)  # a half-done poll writes atomically: nothing to wait for

    app = FastAPI(title="X1 budget sidecar", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.settings = settings
    app.state.poller = poller or build_poller(settings)
    registry = CollectorRegistry(auto_describe=True)
    registry.register(BudgetCollector(app.state.poller))

    @app.get("/budget")
    def budget(p: Poller = Depends(get_poller)) -> JSONResponse:
        doc = p.snapshot().document
        if doc is None:
            raise HTTPException(503, f"no budget reading yet: waiting for a first answer from {settings.provider}")
        return JSONResponse(doc)

    @app.get("/healthz")
    def healthz(p: Poller = Depends(get_poller)) -> JSONResponse:
        body, status = health(p.snapshot(), settings, p.monotonic())
        return JSONResponse(body, status_code=status)

    @app.get("/metrics")
    def metrics() -> Response:
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    return app
