"""`python -m x1_pretrain.train` (and `torchrun -m x1_pretrain.train`): the trainer's command.

A SIGTERM from here until the loop's StopSignal takes over (the imports below: torch alone takes
seconds) is a stop before anything was written: "preempted" to the watchdog (75), not a crash
(143). Only as the program: a process that imports the trainer's modules keeps its own handler.
"""

import os
import signal
import sys


def _preempted_while_starting(signum: int, frame: object) -> None:
    os.write(2, b"SIGTERM during start-up, before anything was written: exit 75 (preempted)\n")
    os._exit(75)  # ExitCode.PREEMPTED; immediate: the imports it interrupts need no unwinding


signal.signal(signal.SIGTERM, _preempted_while_starting)

from x1_pretrain.train.main import main  # noqa: E402 - after the handler, on purpose

sys.exit(main())
