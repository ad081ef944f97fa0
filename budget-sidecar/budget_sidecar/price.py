"""The seed's price rule: launch only when the price is at or under the max ($1.40/h); otherwise wait
4 hours and re-check (RunPod community is the fallback).

    LAMBDA_API_KEY=... python -m budget_sidecar.price --provider lambda --instance-type gpu_1x_a100_sxm4 \\
        --max-usd-per-hr 1.40 [--wait --every-hours 4]

Exit 0: the price is acceptable, launch. Exit 78: it is not (or it could not be read), do not
launch. Exit 2: bad usage, an unknown instance type, a missing API key.
"""

from __future__ import annotations

import argparse
import logging
import math
import sys
import time
from collections.abc import Callable

from x1_common.contracts import ExitCode
from x1_common.logs import setup_logging
from x1_common.providers import LambdaClient, ProviderError, RunPodClient, api_key_from_env, make_client

log = logging.getLogger("x1.price")

FALLBACK_HINT = "the seed's fallback: RunPod community (python -m budget_sidecar.price --provider runpod --market community)"


class UnknownInstanceType(ValueError):
    pass


def current_price(client: LambdaClient | RunPodClient, instance_type: str, market: str = "lowest") -> float:
    """$/h of `instance_type` now; UnknownInstanceType lists the types the provider knows."""
    if isinstance(client, LambdaClient):
        prices = client.instance_type_prices()
    else:
        prices = client.gpu_type_prices(market)
    if instance_type not in prices:
        known = ", ".join(sorted(prices)[:20])
        raise UnknownInstanceType(f"--instance-type: {instance_type!r} is not offered (known: {known})")
    return prices[instance_type]


def check_until_acceptable(
    read_price: Callable[[], float],
    max_usd_per_hr: float,
    *,
    wait: bool,
    every_s: float,
    max_wait_s: float | None,
    out: Callable[[str], None] = print,
    sleep: Callable[[float], None] = time.sleep,
    clock: Callable[[], float] = time.monotonic,
) -> int:
    """Check once, or with `wait` until the price is acceptable (or max_wait_s passes). Returns the exit code."""
    start = clock()
    while True:
        try:
            price = read_price()
        except ProviderError as e:
            out(f"cannot read the price: {e}")
            verdict = None
        else:
            if price <= max_usd_per_hr:
                out(f"price ${price:.2f}/h is within the max ${max_usd_per_hr:.2f}/h: launch")
                return ExitCode.FINISHED
            out(f"price ${price:.2f}/h is over the max ${max_usd_per_hr:.2f}/h: do not launch")
            verdict = price
        waited = clock() - start
        if not wait or (max_wait_s is not None and waited + every_s > max_wait_s):
            if verdict is not None:
                out(FALLBACK_HINT)
            return ExitCode.LAUNCH_REFUSED
        out(f"re-checking in {every_s / 3600:.4g} h")
        sleep(every_s)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m budget_sidecar.price",
        description=(
            "Reads the provider's current price for an instance type and applies the seed's rule: exit 0 when it "
            "is at or under --max-usd-per-hr (launch), 78 when it is over or cannot be read (do not launch). "
            "With --wait, re-checks every --every-hours until the price is acceptable. The API key comes from "
            "LAMBDA_API_KEY or RUNPOD_API_KEY."
        ),
    )
    p.add_argument("--provider", choices=["lambda", "runpod"], required=True)
    p.add_argument("--instance-type", required=True,
                   help="Lambda instance type (gpu_1x_a100_sxm4) or RunPod GPU type id/name (NVIDIA A100 80GB PCIe)")
    p.add_argument("--max-usd-per-hr", type=float, default=1.40, help="the price ceiling, $/h (1.40)")
    p.add_argument("--wait", action="store_true", help="re-check until the price is acceptable instead of refusing")
    p.add_argument("--every-hours", type=float, default=4.0, help="hours between re-checks with --wait (4)")
    p.add_argument("--max-wait-hours", type=float, help="with --wait: give up (exit 78) after this many hours")
    p.add_argument("--market", choices=["lowest", "spot", "community", "secure"], default="lowest",
                   help="RunPod only: which price to read (lowest: the cheapest market now)")
    p.add_argument("--api-url", help="provider base URL without the API path (default: the real API)")
    p.add_argument("--http-timeout", type=float, default=10.0, help="seconds per provider request (10)")
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    for name in ("max_usd_per_hr", "every_hours", "max_wait_hours", "http_timeout"):
        value = getattr(args, name)
        if value is not None and (not math.isfinite(value) or value <= 0):
            parser.error(f"--{name.replace('_', '-')} must be a positive number, got {value}")
    setup_logging()
    try:
        client = make_client(args.provider, args.api_url, api_key_from_env(args.provider), timeout=args.http_timeout)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return ExitCode.USAGE

    def say(line: str) -> None:
        print(f"{args.provider} {args.instance_type}: {line}", flush=True)

    try:
        return check_until_acceptable(
            lambda: current_price(client, args.instance_type, args.market),
            args.max_usd_per_hr,
            wait=args.wait,
            every_s=args.every_hours * 3600.0,
            max_wait_s=None if args.max_wait_hours is None else args.max_wait_hours * 3600.0,
            out=say,
        )
    except UnknownInstanceType as e:
        print(f"error: {e}", file=sys.stderr)
        return ExitCode.USAGE
    except KeyboardInterrupt:
        return ExitCode.LAUNCH_REFUSED


if __name__ == "__main__":
    sys.exit(main())
