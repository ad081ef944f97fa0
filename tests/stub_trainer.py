"""A small stand-in for the trainer, supervised by the watchdog in its tests.

It is not a fake of any service: it is the supervised child, and it keeps the trainer's side
of the contracts the watchdog relies on — a heartbeat file (x1_common.contracts.Heartbeat),
exit codes (docs/DESIGN.md §3), SIGTERM/SIGINT → save progress → exit 75, and `--resume-from-latest`
continuing from the saved progress — with steps that are sleeps instead of math.

    python tests/stub_trainer.py --heartbeat-file hb.json --progress-file progress.json --steps 5
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from x1_common.contracts import ExitCode
from x1_common.fsutil import write_json_atomic


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--heartbeat-file", type=Path, required=True)
    p.add_argument("--progress-file", type=Path, required=True,
                   help="the stub's checkpoint: {'step': steps done}; read back with --resume-from-latest")
    p.add_argument("--steps", type=int, default=5, help="total steps of the run")
    p.add_argument("--step-seconds", type=float, default=0.2, help="wall time of one step")
    p.add_argument("--startup-seconds", type=float, default=0.0, help="delay before the first heartbeat")
    p.add_argument("--exit-code", type=int, default=0, help="code to exit with once all steps are done")
    p.add_argument("--crash", action="store_true", help="exit 1 after the first step, on every start")
    p.add_argument("--fail-at-startup", action="store_true",
                   help="die with --error after the start-up heartbeat, before the first step, on every start")
    p.add_argument("--error", default=None,
                   help="what --fail-at-startup and --crash die of: a TypeError with this message (a traceback, "
                        "exit 1, then a goodbye line with the time, as a tracking client prints at exit); "
                        "{start} is this start's number (from --starts-file), {addr} an address of this process")
    p.add_argument("--hang-at-step", type=int, default=None,
                   help="in a run that did not resume: at this step stop heartbeating and ignore SIGTERM/SIGINT")
    p.add_argument("--worker-pid-file", type=Path, default=None,
                   help="start a helper process in the stub's process group (as torchrun's workers are) "
                        "and write its pid here")
    p.add_argument("--starts-file", type=Path, default=None,
                   help="append one JSON line per start (pid, argv, the step it starts from, time) and one per "
                        "exit that is not a kill (pid, exit code, step, time)")
    p.add_argument("--resume-from-latest", action="store_true")
    return p.parse_args(argv)


class Stub:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.stop_signal: int | None = None
        self.step = 0

    def beat(self, phase: str) -> None:
        write_json_atomic(
            self.args.heartbeat_file,
            {"step": self.step, "time": time.time(), "pid": os.getpid(), "phase": phase},
            durable=False,
        )

    def save(self) -> None:
        # Atomic (a kill never leaves half a file) but not fsynced: the tests cut no power, and an
        # fsync on a busy disk could look like a stall.
        write_json_atomic(self.args.progress_file, {"step": self.step, "pid": os.getpid()}, durable=False)

    def on_signal(self, signum: int, _frame: object) -> None:
        self.stop_signal = signum

    def sleep(self, seconds: float) -> None:
        """Sleeps in slices so that a SIGTERM is acted on within ~20 ms, as a real trainer should."""
        deadline = time.monotonic() + seconds
        while self.stop_signal is None and time.monotonic() < deadline:
            time.sleep(min(0.02, max(0.0, deadline - time.monotonic())))

    def record(self, fields: dict[str, object]) -> None:
        if self.args.starts_file:
            with open(self.args.starts_file, "a", encoding="utf-8") as f:
                f.write(json.dumps({"pid": os.getpid(), "time": time.time(), **fields}) + "\n")

    def fail(self) -> int:
        if self.args.error is None:
            return 1
        start = len([r for r in _read_lines(self.args.starts_file) if "argv" in r]) if self.args.starts_file else 1
        goodbye = f"stub: tracking client closed at {time.strftime('%Y-%m-%d %H:%M:%S')} (pid {os.getpid()})"
        atexit.register(print, goodbye, file=sys.stderr, flush=True)
        raise TypeError(self.args.error.format(start=start, addr=hex(id(self))))

    def emergency_exit(self) -> int:
        self.beat("checkpointing")
        self.save()
        return ExitCode.PREEMPTED

    def run(self) -> int:
        a = self.args
        signal.signal(signal.SIGTERM, self.on_signal)
        signal.signal(signal.SIGINT, self.on_signal)
        if a.resume_from_latest and a.progress_file.exists():
            self.step = int(json.loads(a.progress_file.read_text())["step"])
        self.record({"argv": sys.argv[1:], "from_step": self.step})
        if a.worker_pid_file:
            worker = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
            write_json_atomic(a.worker_pid_file, {"pid": worker.pid})
        self.sleep(a.startup_seconds)
        if self.stop_signal is not None:
            return self.emergency_exit()
        self.beat("startup")
        if a.fail_at_startup:
            return self.fail()
        while self.step < a.steps:
            if a.hang_at_step is not None and self.step == a.hang_at_step and not a.resume_from_latest:
                signal.signal(signal.SIGTERM, signal.SIG_IGN)
                signal.signal(signal.SIGINT, signal.SIG_IGN)
                time.sleep(3600)  # a hang: no heartbeat, deaf to SIGTERM; only SIGKILL ends it
            self.sleep(a.step_seconds)
            if self.stop_signal is not None:
                return self.emergency_exit()
            self.step += 1
            self.save()
            self.beat("training")
            if a.crash:
                return self.fail()
        self.beat("finished")
        return a.exit_code


def _read_lines(path: Path) -> list[dict[str, object]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def main() -> int:
    stub = Stub(parse_args())
    code = stub.run()
    stub.record({"exit": code, "step": stub.step})
    return code


if __name__ == "__main__":
    sys.exit(main())
