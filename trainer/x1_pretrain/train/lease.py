"""The trainer's lease on its checkpoint folder. The machinery (x1_common.lease) is shared with
the stack's workspace lease, the budget sidecar's and the watchdog's."""

from __future__ import annotations

import logging
import os

from x1_common.contracts import ExitCode
from x1_common.lease import *  # noqa: F403  (this module is the trainer's name for it)
from x1_common.lease import Lease, LeaseError, LeaseHeld, LeaseKind

log = logging.getLogger("x1.lease")


def take_trainer_lease(ckpt_dir: str | os.PathLike[str]) -> int:
    """train.setup's call: 0 with the lease held until the process exits, or 2 (ExitCode.USAGE)
    with the reason logged, naming the live owner."""
    try:
        Lease(ckpt_dir, LeaseKind.TRAINER).acquire()
    except (LeaseHeld, LeaseError) as e:
        log.error("%s", e)
        return int(ExitCode.USAGE)
    return 0
