"""--terminate-on-finish: after a finished run or a budget/divergence stop, terminate the
instance through the provider's API, read it back until the provider shows it terminated, and
keep what was sent and what was observed as the run's proof of termination (docs/DESIGN.md §8,
check 6). An A100 forgotten at $1.10/h is $26 a day.

"Terminated" is the provider's state read back, never the terminate call's answer (a pod can
answer podTerminate and run on): the terminate is sent again every minute while the provider
lists the instance otherwise, for --terminate-confirm-seconds (15 min by default). Until then the
record says "terminate sent, still billing"; after it, the watchdog alerts (terminate-unconfirmed,
naming the instance and the command that ends it) and exits 82, and a restarted watchdog reads the
instance back again (and sends again) rather than trusting anything recorded before.

The end of a run is one sequence, on the workspace volume, before the instance goes:

    trainer (--run-dir DIR): final checkpoint -> export_run -> post-mortem draft -> dod (check 6 pending)
    watchdog (--run-dir DIR): terminate, read back -> DIR/termination.json, the
                              manifest's `termination` and dod.json's check 6 updated

so that `dod DIR`, run later wherever the folder is read, passes all six checks.

The results come first: the workspace volume of an instance (a Lambda instance's disk, a RunPod
pod's volume disk) dies with it. With --run-dir, the terminate waits until the run folder is
copied to --keep-run-dir (storage that outlives the instance: a Lambda persistent filesystem, a
RunPod network volume), every file read back and compared; without --keep-run-dir, or when the
copy fails, the terminate is refused (alerted; the instance keeps billing until a person copies
the folder off and terminates it).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from pathlib import Path
from typing import Any, Protocol

from x1_common.contracts import ExitCode, scrub_record
from x1_common.fsutil import sha256_file, write_json_atomic
from x1_common.providers import Instance, ProviderError
from x1_common.termination import STILL_BILLING, end_instance
from x1_pretrain.run.dod import recheck_termination, termination_facts
from x1_watchdog.records import EventLog, StateStore, iso_time
from x1_watchdog.supervisor import Alerter

log = logging.getLogger(__name__)

# After these nothing more will run on the instance: finished, or stopped for money or
# divergence. Not after 2 (a person fixes the config and relaunches on the same machine) nor 78
# (the launch was refused; the person decides), nor after a give-up.
TERMINATE_EXIT_CODES = frozenset(
    {ExitCode.FINISHED, ExitCode.BUDGET_PROJECTED, ExitCode.BUDGET_SPENT, ExitCode.DIVERGED, ExitCode.FORECAST_STOP}
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
        run_dir: str | os.PathLike[str] | None = None,
        keep_dir: str | os.PathLike[str] | None = None,
        confirm_seconds: float = 900.0,
        resend_every_s: float = 60.0,
        read_every_s: float = 5.0,
    ) -> None:
        self.client = client
        self.provider = provider
        self.instance_id = instance_id
        self.termination_file = Path(termination_file)
        self.state = state
        self.events = events
        self.alerter = alerter
        self.run_dir = Path(run_dir) if run_dir is not None else None
        self.keep_dir = Path(keep_dir) if keep_dir is not None else None
        self.confirm_seconds = confirm_seconds
        self.resend_every_s = resend_every_s
        self.read_every_s = read_every_s

    def __call__(self, exit_code: int, reason: str) -> int | None:
        """None when nothing is left billing by this watchdog's doing (terminated, or not to be
        terminated); ExitCode.TERMINATE_UNCONFIRMED when the terminate was sent and the provider
        still lists the instance after the confirm time."""
        if exit_code not in TERMINATE_EXIT_CODES or reason == "given-up":
            log.info("exit code %d (%s): the instance is left running (--terminate-on-finish acts on 0, 76, 77, 79, 80)",
                     exit_code, reason)
            return None
        final = self.state.final or {}
        if final.get("terminated"):
            log.info("instance %s was terminated already: the provider showed it (%s)", self.instance_id,
                     self.termination_file)
            return None
        if final.get("termination_state"):
            log.warning("instance %s: a terminate was sent before (%s) and not confirmed; reading it back and sending "
                        "it again", self.instance_id, final.get("termination_state"))
        kept = self._keep_results()
        if kept is None:
            return None
        log.info("terminating %s instance %s; reading it back until the provider shows it terminated (up to %g s)",
                 self.provider, self.instance_id, self.confirm_seconds)
        self.state.update_final(termination_state=STILL_BILLING, terminate_started=iso_time())
        try:
            ending = end_instance(self.client, self.provider, self.instance_id, within_s=self.confirm_seconds,
                                  resend_every_s=self.resend_every_s, read_every_s=self.read_every_s,
                                  on_progress=lambda line: log.info("%s", line))
        except ProviderError as e:  # the key refused: nothing can be sent or read
            log.error("terminate of instance %s failed: %s", self.instance_id, e)
            self.events.write("terminate", ok=False, confirmed=False, provider=self.provider,
                              instance_id=self.instance_id, exit_code=exit_code, reason=reason, error=str(e))
            self._alert_still_billing(reason, f"the {self.provider} API refused the key: {e}")
            return int(ExitCode.TERMINATE_UNCONFIRMED)
        record = ending.record(exit_code=exit_code, reason=reason)
        # The instance record can carry secrets of its own (Lambda's jupyter_token): masked.
        write_json_atomic(self.termination_file, scrub_record(record))
        state = "terminated" if ending.confirmed else STILL_BILLING
        self.state.update_final(terminated=ending.confirmed, termination_state=state, observed=ending.how,
                                terminate_calls=len(ending.calls), termination_file=str(self.termination_file))
        run_folder = self._add_to_run_folder(record, self.run_dir) if self.run_dir is not None else None
        if kept is not True:  # the copy that outlives the instance gets the record too
            run_folder = f"{run_folder}; kept copy: {self._add_to_run_folder(record, kept)}"
        self.events.write("terminate", ok=ending.confirmed, confirmed=ending.confirmed, provider=self.provider,
                          instance_id=self.instance_id, exit_code=exit_code, reason=reason,
                          termination_file=str(self.termination_file), terminate_calls=len(ending.calls),
                          status_after=ending.instance_after.get("status"),
                          raw_status_after=ending.instance_after.get("raw_status"), observed=ending.how,
                          run_folder=run_folder, **({} if ending.confirmed else {"error": f"{STILL_BILLING}: {ending.how}"}))
        if ending.confirmed:
            log.info("instance %s terminated: %s (%d terminate call(s)); recorded in %s", self.instance_id, ending.how,
                     len(ending.calls), self.termination_file)
            return None
        log.error("instance %s: %s: terminate sent %d time(s) over %.0f s and %s", self.instance_id, STILL_BILLING,
                  len(ending.calls), ending.seconds, ending.how)
        self._alert_still_billing(reason, f"terminate sent {len(ending.calls)} time(s) over {ending.seconds:.0f} s, "
                                          f"and {ending.how}")
        return int(ExitCode.TERMINATE_UNCONFIRMED)

    def _alert_still_billing(self, reason: str, what: str) -> None:
        self.alerter.send(
            "terminate-unconfirmed", f"instance {self.instance_id} STILL BILLING: terminate not confirmed",
            f"The run ended ({reason}); {what}. The {self.provider} instance {self.instance_id} is still billing. "
            f"End it: `x1 down --provider {self.provider} --instance {self.instance_id} --no-fetch` from a laptop, or "
            f"the provider's dashboard. A restarted watchdog reads it back and sends the terminate again.",
            {"instance_id": self.instance_id, "provider": self.provider},
        )

    def _keep_results(self) -> Path | bool | None:
        """The run folder copied off the instance's volume before the terminate: the copy's path;
        True when there is no run folder to keep (no --run-dir); None when the terminate is refused
        (said in the log, the events and an alert)."""
        if self.run_dir is None:
            return True
        why = None
        if not (self.run_dir / "manifest.json").is_file():
            why = (f"the run folder {self.run_dir} has no manifest.json (did the trainer's export fail?): export it "
                   f"with python -m x1_pretrain.finish --output {self.run_dir}, copy it off the instance")
        elif self.keep_dir is None:
            why = (f"the run folder {self.run_dir} is only on this instance's volume, which dies with the instance: "
                   "set RESULTS_DIR (--keep-run-dir) to storage that outlives it (a Lambda persistent filesystem, "
                   "a RunPod network volume), or copy the folder off the host (rsync/scp)")
        else:
            try:
                return copy_verified(self.run_dir, self.keep_dir / f"{self.run_dir.name}-{self.instance_id}")
            except OSError as e:
                why = f"copying the run folder {self.run_dir} to {self.keep_dir} failed ({e})"
        log.error("terminate of instance %s REFUSED: %s; then terminate the instance by hand", self.instance_id, why)
        self.events.write("terminate", ok=False, refused=True, provider=self.provider, instance_id=self.instance_id,
                          error=why)
        self.alerter.send(
            "terminate-refused", f"terminate of instance {self.instance_id} REFUSED: results not safe",
            f"The run ended but its results are not safe off the instance: {why}. Then terminate the {self.provider} "
            f"instance {self.instance_id} by hand. It is still billing.",
            {"instance_id": self.instance_id, "provider": self.provider},
        )
        return None

    def _add_to_run_folder(self, record: dict[str, Any], run_dir: Path) -> str:
        """The termination record beside the trainer's export, so the folder proves check 6 by itself.
        Returns what was done, for the event."""
        manifest_path = run_dir / "manifest.json"
        if not manifest_path.is_file():
            log.error("no run folder at %s (no manifest.json: did the trainer's --run-dir export fail?): the "
                      "termination record is only in %s; export with python -m x1_pretrain.finish --output %s",
                      run_dir, self.termination_file, run_dir)
            return f"missing: no manifest.json in {run_dir}"
        try:
            target = run_dir / "termination.json"
            write_json_atomic(target, scrub_record(record))
            manifest = json.loads(manifest_path.read_text(encoding="utf-8"))
            manifest["termination"] = {**termination_facts(target), "source": str(self.termination_file),
                                       "added_by": "watchdog --terminate-on-finish, after the export"}
            manifest.setdefault("files", {})["termination.json"] = sha256_file(target)
            write_json_atomic(manifest_path, manifest)
            check = recheck_termination(run_dir)
        except Exception as e:  # noqa: BLE001 - the instance is gone already: report, never crash the watchdog
            log.error("could not add the termination record to the run folder %s: %s (it is in %s)", run_dir, e,
                      self.termination_file)
            return f"failed: {e}"
        verdict = "no dod.json to update" if check is None else f"dod check 6 {'PASS' if check.ok else 'FAIL'}: {check.reason}"
        log.info("run folder %s: termination.json added; %s", run_dir, verdict)
        return f"termination.json added to {run_dir}; {verdict}"


def copy_verified(src: Path, dst: Path) -> Path:
    """`src` copied to `dst`, every file read back and compared by SHA-256 before the copy takes
    its name (a temp folder renamed: a half copy never looks like a kept run folder). An earlier
    copy at `dst` is replaced. OSError when any of it fails."""
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = dst.with_name(f".tmp-{dst.name}")
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(src, tmp)
    for f in (p for p in src.rglob("*") if p.is_file()):
        copy = tmp / f.relative_to(src)
        with open(copy, "rb") as handle:
            os.fsync(handle.fileno())  # on the persistent disk, not in this instance's page cache
        if sha256_file(copy) != sha256_file(f):
            raise OSError(f"{copy} differs from {f} after the copy")
    old = dst.with_name(f".old-{dst.name}")
    if dst.exists():
        shutil.rmtree(old, ignore_errors=True)
        dst.rename(old)
    tmp.rename(dst)
    shutil.rmtree(old, ignore_errors=True)
    fd = os.open(dst.parent, os.O_RDONLY)
    try:
        os.fsync(fd)  # the rename on disk before the instance goes
    finally:
        os.close(fd)
    log.info("run folder %s copied to %s (every file verified)", src, dst)
    return dst
