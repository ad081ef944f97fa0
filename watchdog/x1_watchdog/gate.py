"""`python -m x1_watchdog.gate STATE_FILE [-- TRAINER_ARGS]`: may the trainer train, or has the
watchdog recorded a final decision that holds?

The trainer container's launcher (trainer/entrypoint.sh) asks this before it trains, with its own
arguments after `--`. Compose starts the trainer container on every `docker compose up`, whatever
the watchdog decided; after a finished run, a budget stop, a divergence, a give-up or a start-up
failure, such a start must not train on. So: no state file or no final decision: prints nothing,
exit 0 (train). A final decision: prints its exit code on stdout (the launcher exits with it) and
the reason on stderr, exit 0. A state file that cannot be trusted: the reason on stderr, exit 2
(the watchdog refuses it too).

A bad config (2) or a start-up failure (81) holds only while the trainer is given what it was
refused for: when its arguments, its own variables or its data's meta.json have changed since
(x1_watchdog.inputs), the mistake was corrected and it trains (prints nothing); the watchdog, which
sees the same change in the container compose recreated, sets the decision aside and supervises it.

`python -m x1_watchdog.gate --clear STATE_FILE` sets any final decision aside by hand (kept in the
state file's `cleared` list): the next launch trains, resuming from the latest checkpoint, and a
watchdog holding after that decision supervises it again (compose: `docker compose exec watchdog
python -m x1_watchdog.gate --clear /workspace/logs/watchdog-state.json`).
"""

from __future__ import annotations

import os
import sys

from x1_common.contracts import FIXABLE_EXIT_CODES
from x1_watchdog.inputs import trainer_inputs
from x1_watchdog.records import StateError, StateStore

DEFAULT_STATE_FILE = "/workspace/logs/watchdog-state.json"


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    trainer_args: list[str] | None = None
    if "--" in args:
        i = args.index("--")
        args, trainer_args = args[:i], args[i + 1:]
    if args[:1] in (["-h"], ["--help"]):
        print(__doc__.strip())
        return 0
    clear = args[:1] == ["--clear"]
    args = args[1:] if clear else args
    path = args[0] if args else DEFAULT_STATE_FILE
    try:
        state = StateStore(path)
    except StateError as e:
        print(f"x1-train: {e}", file=sys.stderr)
        return 2
    final = state.final
    if clear:
        if final is None:
            print(f"{path}: no final decision to set aside", file=sys.stderr)
            return 0
        state.clear_final("by hand: python -m x1_watchdog.gate --clear")
        print(f"{path}: the final decision {final.get('reason')} (exit {final['exit_code']}, {final.get('time')}) is "
              "set aside (kept under `cleared`); the next launch of the trainer resumes from its latest checkpoint",
              file=sys.stderr)
        return 0
    if final is None:
        return 0
    if trainer_args is not None and (changed := state.fixed_by(trainer_inputs(trainer_args, os.environ))):
        print(f"x1-train: the watchdog's final decision in {path} ({final.get('reason')}, exit {final['exit_code']} at "
              f"{final.get('time')}) refused other inputs; changed since: {'; '.join(changed)}. Training again, from the "
              "latest checkpoint", file=sys.stderr)
        return 0
    fixable = final["exit_code"] in FIXABLE_EXIT_CODES
    print(f"x1-train: the watchdog recorded a final decision in {path}: {final.get('reason')} "
          f"(exit code {final['exit_code']}, {final.get('time')}); not training again. "
          + ("It is launched again once what it was refused for has changed (.env's trainer settings, the data's "
             "meta.json); " if fixable else "")
          + "`python -m x1_watchdog.gate --clear` sets the decision aside by hand (the run resumes from its latest "
          "checkpoint); a new run needs a new /workspace", file=sys.stderr)
    print(final["exit_code"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
