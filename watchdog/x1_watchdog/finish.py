"""--terminate-on-finish: after a finished run or a budget/divergence stop, terminate the
instance through the provider's API and keep its answer as the run's proof of termination
(docs/DESIGN.md §8, check 6). An A100 forgotten at $1.10/h is $26 a day.

The end of a run is one sequence, on the workspace volume, before the instance goes:

    trainer (--run-dir DIR): final checkpoint -> export_run -> post-mortem draft -> dod (check 6 pending)
    watchdog (--run-dir DIR): terminate -> the provider's answer into DIR/termination.json, the
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

    def __call__(self, exit_code: int, reason: str) -> None:
        if exit_code not in TERMINATE_EXIT_CODES or reason == "given-up":
            log.info("exit code %d (%s): the instance is left running (--terminate-on-finish acts on 0, 76, 77, 79, 80)",
                     exit_code, reason)
            return
        final = self.state.final or {}
        if final.get("terminated"):
            log.info("instance %s was terminated already (%s)", self.instance_id, self.termination_file)
            return
        kept = self._keep_results()
        if kept is None:
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
        run_folder = self._add_to_run_folder(record, self.run_dir) if self.run_dir is not None else None
        if kept is not True:  # the copy that outlives the instance gets the provider's answer too
            run_folder = f"{run_folder}; kept copy: {self._add_to_run_folder(record, kept)}"
        self.events.write("terminate", ok=True, provider=self.provider, instance_id=self.instance_id,
                          exit_code=exit_code, reason=reason, termination_file=str(self.termination_file),
                          status_after=record["instance_after"].get("status"), run_folder=run_folder)
        log.info("instance %s terminated; the provider's answer is in %s", self.instance_id, self.termination_file)

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
        """The provider's answer beside the trainer's export, so the folder proves check 6 by itself.
        Returns what was done, for the event."""
        manifest_path = run_dir / "manifest.json"
        if not manifest_path.is_file():
            log.error("no run folder at %s (no manifest.json: did the trainer's --run-dir export fail?): the "
                      "provider's answer is only in %s; export with python -m x1_pretrain.finish --output %s",
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
            log.error("could not add the provider's answer to the run folder %s: %s (it is in %s)", run_dir, e,
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
