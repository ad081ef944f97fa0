"""python -m budget_sidecar: poll the cloud's API, keep /workspace/budget.json current, serve it.

    LAMBDA_API_KEY=... python -m budget_sidecar --provider lambda --instance-id ID \\
        --poll-seconds 300 --output /workspace/budget.json --cap-usd 35 --alert-usd 30 --port 9792
"""

from __future__ import annotations

import argparse
import logging
import signal
import socket
import sys
import threading
from typing import Any

from pydantic import ValidationError

from budget_sidecar.app import build_poller, create_app, start_scheduler
from budget_sidecar.settings import SidecarSettings
from x1_common.contracts import SIDECAR_PORT, ExitCode
from x1_common.lease import Lease, LeaseError, LeaseHeld, LeaseKind
from x1_common.logs import setup_logging

log = logging.getLogger("x1.budget_sidecar")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m budget_sidecar",
        description=(
            "Polls the provider's API (Lambda, RunPod; or a fixed rate for on-prem) and rewrites budget.json "
            "atomically after every poll: spent, rate, hours, projection, staleness. Serves GET /budget, "
            "GET /healthz (503 when stale, or from the first failed write of budget.json or its ledger on a full or "
            "read-only disk: last_error names the path and the free space; every poll retries) and GET /metrics. "
            "Spend never goes down: failed polls keep it "
            "rising at the last known rate (after 2 in a row the reading is marked stale), and a ledger "
            "next to budget.json (budget-state.json) carries it across restarts, instance relaunches and a change "
            "of provider. A run on several hosts is one budget: budget.json shows the total and each instance's "
            "part. One budget.json has one sidecar: a second one on the same file is refused (exit 2). "
            "The API key is read from LAMBDA_API_KEY or RUNPOD_API_KEY, never from the command line."
        ),
        epilog="Every flag can also come from the environment as X1_BUDGET_<FLAG> (e.g. X1_BUDGET_CAP_USD=35).",
    )
    p.add_argument("--provider", choices=["lambda", "runpod", "static"], help="where spend comes from")
    p.add_argument("--api-url", help="provider base URL without the API path "
                   "(default https://cloud.lambda.ai or https://api.runpod.io; the fake billing API in tests)")
    p.add_argument("--instance-id", help="Lambda instance id / RunPod pod id; a run on several hosts: every host's, "
                   "comma-separated (id1,id2), each priced every poll and the spend their sum")
    p.add_argument("--nodes", type=int, help="hosts the run bills (NNODES, 1). static: --rate-usd-per-hr is one host's, "
                   "counted this many times; lambda/runpod: must match the number of instance ids")
    p.add_argument("--poll-seconds", type=float, help="seconds between polls (300)")
    p.add_argument("--output", help="budget.json path (/workspace/budget.json)")
    p.add_argument("--cap-usd", type=float, help="the hard cap (35)")
    p.add_argument("--alert-usd", type=float, help="the alert line (30)")
    p.add_argument("--planned-hours", type=float, help="billed hours planned; projected = spent + rate x hours left")
    p.add_argument("--rate-usd-per-hr", type=float, help="static provider: the hourly rate of one host")
    p.add_argument("--initial-hours", type=float,
                   help="hours already billed before the first poll (Lambda reports no launch time), default 0")
    p.add_argument("--time-scale", type=float,
                   help="TESTS AND DEMO ONLY: billed time runs this many times faster than wall time (1)")
    p.add_argument("--stale-after-failures", type=int, help="failed polls in a row that make the reading stale (2)")
    p.add_argument("--http-timeout", dest="http_timeout_s", type=float, help="seconds per provider request (10)")
    p.add_argument("--host", help="bind address (127.0.0.1; 0.0.0.0 inside a container)")
    p.add_argument("--port", type=int, help=f"HTTP port ({SIDECAR_PORT}); 0 = no HTTP. A busy port is a warning: "
                   "budget.json is still written")
    return p


def settings_from_args(args: argparse.Namespace) -> SidecarSettings:
    given: dict[str, Any] = {k: v for k, v in vars(args).items() if v is not None}
    return SidecarSettings(**given)


def describe_validation_error(e: ValidationError) -> str:
    parts = []
    for err in e.errors():
        loc = ".".join(str(x) for x in err["loc"])
        msg = err["msg"].removeprefix("Value error, ")
        head, sep, rest = msg.partition(": ")
        if sep and " " not in head:
            loc, msg = head, rest
        parts.append(f"--{loc.replace('_', '-')}: {msg}" if loc else msg)
    return "; ".join(parts)


def bind(host: str, port: int) -> socket.socket | None:
    """The listening socket, or None (with a warning) when the port is taken."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        log.warning("cannot listen on %s:%d (%s): no HTTP endpoints, budget.json is still written", host, port, e.strerror)
        return None
    sock.listen(64)
    sock.set_inheritable(True)
    return sock


def run_without_http(poller: Any) -> None:
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    scheduler = start_scheduler(poller)
    stop.wait()
    scheduler.shutdown(wait=False)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    setup_logging()
    try:
        settings = settings_from_args(args)
    except ValidationError as e:
        print(f"error: {describe_validation_error(e)}", file=sys.stderr)
        return ExitCode.USAGE

    try:
        # One writer per budget.json (and its ledger): two sidecars would publish two spends in
        # turn, and the lower one would pass for the run's. Held until this process exits.
        Lease.for_file(settings.output, LeaseKind.BUDGET_SIDECAR).acquire()
    except (LeaseHeld, LeaseError) as e:
        print(f"error: {e}", file=sys.stderr)
        return ExitCode.USAGE
    try:
        poller = build_poller(settings)
    except ValueError as e:  # a missing API key, named
        print(f"error: {e}", file=sys.stderr)
        return ExitCode.USAGE
    log.info(
        "budget sidecar: %s %s, poll every %gs, cap $%.2f, writing %s%s",
        settings.provider, settings.instance_id or f"at ${settings.rate_usd_per_hr}/h", settings.poll_seconds,
        settings.cap_usd, settings.output, f", TIME SCALE {settings.time_scale:g}x" if settings.time_scale != 1 else "",
    )
    if settings.planned_hours is None:
        log.warning("no --planned-hours (PLANNED_HOURS): projected_total_usd is the spend so far, with no "
                    "remaining-time term (budget.json: \"projection\": \"%s\"). The trainer's budget guard "
                    "projects the remaining time from its own steps and measured throughput; set --planned-hours to "
                    "plan's hours to see the plan in Grafana's projected total too", settings.projection_basis)
    sock = bind(settings.host, settings.port) if settings.port else None
    if sock is None:
        run_without_http(poller)
        return 0
    import uvicorn

    app = create_app(settings, poller)
    # create_app with a given poller leaves scheduling to us: one scheduler whatever the HTTP mode.

    scheduler = start_scheduler(poller)
    try:
        server = uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False))
        server.run(sockets=[sock])
    finally:
        scheduler.shutdown(wait=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
