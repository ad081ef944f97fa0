"""`python -m x1_watchdog.healthcheck [URL]`: compose's healthcheck of the watchdog.

Exit 0 when the watchdog's /metrics answers and says it can supervise its trainer
(x1_watchdog_healthy 1); 1 otherwise, with the reason on stderr (a failing write: its path and
cause). A watchdog that cannot reach the
Docker Engine stays up and says so here, instead of exiting into a restart loop.
"""

from __future__ import annotations

import sys
import urllib.request

from prometheus_client.parser import text_string_to_metric_families

from x1_common.contracts import M_WATCHDOG_HEALTHY, M_WATCHDOG_WRITE_ERROR, WATCHDOG_METRICS_PORT

DEFAULT_URL = f"http://127.0.0.1:{WATCHDOG_METRICS_PORT}/metrics"


def healthy(url: str, timeout: float = 5.0) -> tuple[bool, str]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            text = resp.read().decode("utf-8")
    except OSError as e:
        return False, f"{url}: {e}"
    value, write_error = None, ""
    for family in text_string_to_metric_families(text):
        if family.name == M_WATCHDOG_HEALTHY:
            value = family.samples[0].value
        elif family.name in (M_WATCHDOG_WRITE_ERROR, M_WATCHDOG_WRITE_ERROR + "_info"):
            write_error = family.samples[0].labels.get("error", "")
    if value is None:
        return False, f"{url} has no {M_WATCHDOG_HEALTHY}"
    return value == 1, f"{M_WATCHDOG_HEALTHY} {value:g}" + (f": {write_error}" if write_error else "")


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if args[:1] in (["-h"], ["--help"]):
        print(__doc__.strip())
        return 0
    ok, why = healthy(args[0] if args else DEFAULT_URL)
    if not ok:
        print(f"watchdog unhealthy: {why}", file=sys.stderr)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
