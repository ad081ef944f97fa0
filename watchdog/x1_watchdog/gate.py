"""`python -m x1_watchdog.gate STATE_FILE`: has the watchdog recorded a final decision?

The trainer container's launcher (trainer/entrypoint.sh) asks this before it trains. Compose
starts the trainer container on every `docker compose up`, whatever the watchdog decided; after
a finished run, a budget stop, a divergence, a give-up or a start-up failure, such a start must
not train on. So: no state file or no final decision: prints nothing, exit 0 (train). A final
decision: prints its exit code on stdout (the launcher exits with it) and the reason on stderr,
exit 0. A state file that cannot be trusted: the reason on stderr, exit 2 (the watchdog refuses
it too).
"""

from __future__ import annotations

import sys

from x1_watchdog.records import StateError, StateStore

DEFAULT_STATE_FILE = "/workspace/logs/watchdog-state.json"


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if args[:1] in (["-h"], ["--help"]):
        print(__doc__.strip())
        return 0
    path = args[0] if args else DEFAULT_STATE_FILE
    try:
        final = StateStore(path).final
    except StateError as e:
        print(f"x1-train: {e}", file=sys.stderr)
        return 2
    if final is not None:
        print(f"x1-train: the watchdog recorded a final decision in {path}: {final.get('reason')} "
              f"(exit code {final['exit_code']}, {final.get('time')}); not training again. A new run needs a "
              f"new /workspace, or the watchdog's --reset-state", file=sys.stderr)
        print(final["exit_code"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
