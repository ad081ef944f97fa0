"""--terminate-on-finish: after a finished run or a budget/divergence stop, terminate the
instance through the provider's API and keep its answer as the run's proof of termination
(SPEC §8, check 6). An A100 forgotten at $1.10/h is $26 a day.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any, Protocol

from x1_common.contracts import ExitCode, scrub_record
from x1_common.fsutil import write_json_atomic
from x1_common.providers import Instance, ProviderError
from x1_watchdog.records import EventLog, StateStore, iso_time
from x1_watchdog.supervisor import Alerter

log = logging.getLogger(__name__)

# After these nothing more will run on the instance: finished, or stopped for money or
# divergence. Not after 2 (a person fixes the config and relaunches on the same machine) nor 78
# (the launch was refused; the person decides), nor after a give-up.
TERMINATE_EXIT_CODES = frozenset(
    {ExitCode.FINISHED, ExitCode.BUDGET_PROJECTED, ExitCode.BUDGET_SPENT, ExitCode.DIVERGED}
)


class InstanceClient(Protocol):
    """The part of x1_common.providers' clients the watchdog uses."""

    def get_instance(self, instance_id: str) -> Instance: ...

    def terminate(self, instance_id: str) -> dict[str, Any]: ...


class Terminator:
    """Called once a final decision is persisted; also by a restarted watchdog, so a terminate
    that failed (API down) is tried again rather than forgotten."""

    def __init__(
        self,
        client: InstanceClient,
        provider: str,
        instance_id: str,
        termination_file: str | os.PathLike[str],
        state: StateStore,
        events: EventLog,
        alerter: Alerter,
    ) -> None:
        self.client = client
        self.provider = provider
        self.instance_id = instance_id
        self.termination_file = Path(termination_file)
        self.state = state
        self.events = events
        self.alerter = alerter

    def __call__(self, exit_code: int, reason: str) -> None:
        if exit_code not in TERMINATE_EXIT_CODES or reason == "given-up":
            log.info("exit code %d (%s): the instance is left running (--terminate-on-finish acts on 0, 76, 77, 79)",
                     exit_code, reason)
            return
        final = self.state.final or {}
        if final.get("terminated"):
            log.info("instance %s was terminated already (%s)", self.instance_id, self.termination_file)
            return
        log.info("terminating %s instance %s", self.provider, self.instance_id)
        try:
            response = self.client.terminate(self.instance_id)
        except ProviderError as e:
            log.error("terminate of instance %s failed: %s", self.instance_id, e)
            self.events.write("terminate", ok=False, provider=self.provider, instance_id=self.instance_id,
                              exit_code=exit_code, reason=reason, error=str(e))
            self.alerter.send(
                "terminate-failed", f"terminate of instance {self.instance_id} FAILED",
                f"The run ended ({reason}) but the {self.provider} API refused to terminate instance "
                f"{self.instance_id}: {e}. It is still billing: terminate it by hand.",
                {"instance_id": self.instance_id, "provider": self.provider},
            )
            return
        record: dict[str, Any] = {
            "provider": self.provider,
            "instance_id": self.instance_id,
            "time": iso_time(),
            "exit_code": exit_code,
            "reason": reason,
            "response": response,
        }
        # Ask again: the DoD accepts either the terminate answer or a record showing it terminated.
        try:
            after = self.client.get_instance(self.instance_id)
            record["instance_after"] = {"status": after.status, "raw_status": after.raw_status, "raw": after.raw}
        except ProviderError as e:
            record["instance_after"] = {"error": str(e)}
        # The instance record can carry secrets of its own (Lambda's jupyter_token): masked.
        write_json_atomic(self.termination_file, scrub_record(record))
        self.state.update_final(terminated=True, termination_file=str(self.termination_file))
        self.events.write("terminate", ok=True, provider=self.provider, instance_id=self.instance_id,
                          exit_code=exit_code, reason=reason, termination_file=str(self.termination_file),
                          status_after=record["instance_after"].get("status"))
        log.info("instance %s terminated; the provider's answer is in %s", self.instance_id, self.termination_file)
