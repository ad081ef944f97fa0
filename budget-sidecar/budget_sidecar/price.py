"""The price rule: launch only when the price is at or under the max ($1.40/h); otherwise wait
4 hours and re-check (RunPod community is the fallback).

    LAMBDA_API_KEY=... python -m budget_sidecar.price --provider lambda --instance-type gpu_1x_a100_sxm4 \\
        --max-price-usd-per-hr 1.40 [--wait --every-hours 4]
    RUNPOD_API_KEY=... python -m budget_sidecar.price --provider runpod --market community --list

Exit 0: the price is acceptable, launch. Exit 78: it is not (or it could not be read), do not
launch. Exit 2: bad usage, an unknown instance type, a missing API key.
"""

from __future__ import annotations

import argparse
import logging
import math
import shlex
import sys
import time
from collections.abc import Callable

from x1_common.contracts import ExitCode
from x1_common.logs import setup_logging
from x1_common.providers import LambdaClient, ProviderError, RunPodClient, api_key_from_env, make_client

log = logging.getLogger("x1.price")

# The same GPU on RunPod, by the family in a Lambda instance type's name (gpu_1x_a100_sxm4 -> a100).
RUNPOD_SAME_GPU = {"h200": "NVIDIA H200", "h100": "NVIDIA H100 80GB HBM3", "a100": "NVIDIA A100 80GB PCIe"}


def fallback_hint(provider: str, instance_type: str, max_usd_per_hr: float, market: str) -> str:
    """The fallback as a command that runs as shown: RunPod community, same GPU."""
    if provider == "runpod" and market == "community":
        return ("RunPod community is the fallback, and this is it: --wait re-checks every 4 h, or list the "
                "other GPUs: " + shlex.join(["python", "-m", "budget_sidecar.price", "--provider", "runpod",
                                              "--market", "community", "--list"]))
    same = instance_type if provider == "runpod" else next(
        (gpu for family, gpu in RUNPOD_SAME_GPU.items() if family in instance_type.lower()), None)
    cmd = ["python", "-m", "budget_sidecar.price", "--provider", "runpod", "--market", "community"]
    if same is None:
        return (f"the fallback: RunPod community; {instance_type!r} has no RunPod equivalent known here, "
                f"list its GPU types and prices: {shlex.join([*cmd, '--list'])}")
    return ("the fallback: RunPod community (RUNPOD_API_KEY): "
            + shlex.join([*cmd, "--instance-type", same, "--max-price-usd-per-hr", f"{max_usd_per_hr:g}"]))


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
    hint: str = "",
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
            if verdict is not None and hint:
                out(hint)
            return ExitCode.LAUNCH_REFUSED
        out(f"re-checking in {every_s / 3600:.4g} h")
        sleep(every_s)


def list_prices(client: LambdaClient | RunPodClient, provider: str, market: str, max_usd_per_hr: float) -> int:
    try:
        prices = client.instance_type_prices() if isinstance(client, LambdaClient) else client.gpu_type_prices(market)
    except ProviderError as e:
        print(f"cannot read the prices: {e}", file=sys.stderr)
        return ExitCode.LAUNCH_REFUSED
    where = provider if provider == "lambda" else f"runpod ({market})"
    for name, price in sorted(prices.items(), key=lambda kv: (kv[1], kv[0])):
        print(f"{where} {name}: ${price:.2f}/h" + ("" if price <= max_usd_per_hr else f" (over the max ${max_usd_per_hr:.2f}/h)"))
    return ExitCode.FINISHED


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m budget_sidecar.price",
        description=(
            "Reads the provider's current price for an instance type and applies the price rule: exit 0 when it "
            "is at or under --max-price-usd-per-hr (launch), 78 when it is over or cannot be read (do not launch). "
            "With --wait, re-checks every --every-hours until the price is acceptable. The API key comes from "
            "LAMBDA_API_KEY or RUNPOD_API_KEY."
        ),
    )
    p.add_argument("--provider", choices=["lambda", "runpod"], required=True)
    p.add_argument("--instance-type",
                   help="Lambda instance type (gpu_1x_a100_sxm4) or RunPod GPU type id/name (NVIDIA A100 80GB PCIe); "
                        "required unless --list")
    p.add_argument("--list", action="store_true", help="print every offered type and its price now, then exit 0")
    p.add_argument("--max-price-usd-per-hr", dest="max_usd_per_hr", type=float, default=1.40,
                   help="the price ceiling, $/h (1.40: the A100 80GB's; plan prints each GPU's)")
    # The earlier spelling, kept working for scripts that use it; the name is the one plan and train take.
    p.add_argument("--max-usd-per-hr", dest="max_usd_per_hr", type=float, help=argparse.SUPPRESS)
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
            flag = "--max-price-usd-per-hr" if name == "max_usd_per_hr" else f"--{name.replace('_', '-')}"
            parser.error(f"{flag} must be a positive number, got {value}")
    if not args.list and not args.instance_type:
        parser.error("--instance-type is required (or --list to see the offered types)")
    setup_logging()
    try:
        client = make_client(args.provider, args.api_url, api_key_from_env(args.provider), timeout=args.http_timeout)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return ExitCode.USAGE

    if args.list:
        return list_prices(client, args.provider, args.market, args.max_usd_per_hr)

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
            hint=fallback_hint(args.provider, args.instance_type, args.max_usd_per_hr, args.market),
        )
    except UnknownInstanceType as e:
        print(f"error: {e}", file=sys.stderr)
        return ExitCode.USAGE
    except KeyboardInterrupt:
        return ExitCode.LAUNCH_REFUSED


if __name__ == "__main__":
    sys.exit(main())
