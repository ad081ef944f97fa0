"""The watchdog's Prometheus metrics (names from x1_common.contracts), served by
prometheus_client's own HTTP server. A busy port is a warning, never a failure: losing the
graphs must not cost the run its supervisor."""

from __future__ import annotations

import logging
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Info, start_http_server

from x1_common.contracts import (
    M_WATCHDOG_DOCKER_ENGINE,
    M_WATCHDOG_DOWNTIME,
    M_WATCHDOG_HEALTHY,
    M_WATCHDOG_LAST_DECISION,
    M_WATCHDOG_RESTARTS,
    M_WATCHDOG_TRAINER_UP,
    M_WATCHDOG_WRITE_ERROR,
    M_WATCHDOG_WRITE_FAILING,
)

log = logging.getLogger(__name__)

# Known relaunch reasons, created at zero so a dashboard shows the series before the first one.
RESTART_REASONS = ("preempted", "crashed", "killed", "stall", "instance-preempted", "instance-stopped")


class WatchdogMetrics:
    def __init__(self) -> None:
        # A registry of our own: no process/platform collectors mixed into the watchdog's page.
        self.registry = CollectorRegistry()
        self._restarts = Counter(
            M_WATCHDOG_RESTARTS, "Trainer (or instance) relaunches, by reason.", ["reason"], registry=self.registry
        )
        self._up = Gauge(
            M_WATCHDOG_TRAINER_UP,
            "1 while the supervised trainer (provider mode: the instance) runs, else 0.",
            registry=self.registry,
        )
        self._downtime = Counter(
            M_WATCHDOG_DOWNTIME,
            "Seconds between a trainer's exit (or an instance's loss) and its relaunch, summed.",
            registry=self.registry,
        )
        # compose's healthcheck reads this (python -m x1_watchdog.healthcheck): 0 is unhealthy.
        self._healthy = Gauge(
            M_WATCHDOG_HEALTHY,
            "1 while the watchdog can supervise its trainer, 0 while it cannot reach it "
            "(docker mode: the Engine socket missing or refused, an unsupported Engine API version) or cannot "
            "write its state or events file (x1_watchdog_write_error_info says why).",
            registry=self.registry,
        )
        self._healthy.set(1)
        self._reachable = True
        self._write_error: str | None = None
        self._write_failing = Gauge(
            M_WATCHDOG_WRITE_FAILING, "1 while the watchdog cannot write its state or events file (a full or read-only "
            "disk); x1_watchdog_healthy is 0 meanwhile.", registry=self.registry)
        self._write_error_info = Info(
            M_WATCHDOG_WRITE_ERROR, "the failing write: the path and the cause (empty while writes succeed).",
            registry=self.registry)
        self._write_error_info.info({"error": ""})
        self._engine = Info(
            M_WATCHDOG_DOCKER_ENGINE, "docker mode: the Engine's release, the API versions it serves, the one spoken.",
            registry=self.registry,
        )
        self._decision = Info(
            M_WATCHDOG_LAST_DECISION, "the watchdog's last decision (its last event): event, exit_code, reason, time.",
            registry=self.registry,
        )
        for reason in RESTART_REASONS:
            self._restarts.labels(reason=reason)

    def last_decision(self, record: dict[str, Any]) -> None:
        """The event just written, as /metrics shows it."""
        self._decision.info({"event": str(record.get("event", "")), "exit_code": str(record.get("exit_code", "")),
                             "reason": str(record.get("reason") or record.get("error") or "")[:200],
                             "time": str(record.get("time", ""))})

    def serve(self, port: int, host: str) -> None:
        """Starts the /metrics server on a daemon thread; port 0 disables it."""
        if port == 0:
            log.info("metrics disabled (--port 0)")
            return
        try:
            start_http_server(port, addr=host, registry=self.registry)
        except OSError as e:
            log.warning("metrics server not started on %s:%d (%s); supervising without it", host, port, e)
            return
        log.info("metrics on http://%s:%d/metrics", host, port)

    def restarted(self, reason: str) -> None:
        self._restarts.labels(reason=reason).inc()

    def add_downtime(self, seconds: float) -> None:
        self._downtime.inc(max(0.0, seconds))

    def set_up(self, up: bool) -> None:
        self._up.set(1 if up else 0)

    def set_healthy(self, healthy: bool) -> None:
        """Whether the watchdog can reach its trainer. Healthy is that, and every write succeeding."""
        self._reachable = healthy
        self._healthy.set(1 if self._reachable and self._write_error is None else 0)

    def write_error(self, error: str | None) -> None:
        """The watchdog's failing write (x1_common.fsutil.WriteHealth.last_error), None once they succeed."""
        self._write_error = error
        self._write_failing.set(0 if error is None else 1)
        self._write_error_info.info({"error": (error or "")[:300]})
        self.set_healthy(self._reachable)

    def docker_engine(self, engine: Any) -> None:
        """docker mode, after each negotiation (an x1_watchdog.docker.Engine)."""
        self._engine.info({
            "version": engine.version or "unknown",
            "api_version": str(engine.api_version),
            "min_api_version": str(engine.min_api_version or "unknown"),
            "speaking": str(engine.speak),
        })
