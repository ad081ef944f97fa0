"""`python -m x1_watchdog`: the command line, its checks, and the wiring of the pieces."""

from __future__ import annotations

import argparse
import logging
import math
import os
import sys
from collections.abc import Callable
from pathlib import Path

from x1_common.alerts import AlertSender
from x1_common.contracts import WATCHDOG_METRICS_PORT, ExitCode
from x1_common.fsutil import WriteHealth
from x1_common.lease import Lease, LeaseError, LeaseHeld, LeaseKind
from x1_common.logs import setup_logging
from x1_common.providers import PROVIDERS, api_key_from_env, make_client
from x1_watchdog.finish import Terminator
from x1_watchdog.handles import ProcessHandle, StartError, TrainerHandle
from x1_watchdog.metrics import WatchdogMetrics
from x1_watchdog.policy import RestartPolicy, StallDetector
from x1_watchdog.provider import InstanceKeeper, LaunchSpec
from x1_watchdog.records import EventLog, StateError, StateStore
from x1_watchdog.supervisor import StopRequest, Supervisor, SupervisorSettings

log = logging.getLogger("x1_watchdog")

DESCRIPTION = """\
Supervises the X1 trainer and acts on its exit code (docs/DESIGN.md §3): a preemption (75), a crash, a
kill or a stall is relaunched with --resume-from-latest after an exponential backoff, and given up
(with an alert) after --max-restarts relaunches inside --restart-window-seconds; a finished run
(0), a bad config (2), a budget stop (76, 77), a refused launch (78), a divergence (79) or a forecast stop (80) is never
relaunched, also not by a restarted watchdog: final decisions are kept in --state-file. The
watchdog exits with the trainer's final exit code (a trainer killed by signal N: 128+N).

A start-up failure is not a preemption: a trainer that crashes (an exit code other than 75, not
a signal nor a stall) before completing its first step, on two launches in a row, with the same
error (the line naming it in its output: a traceback's last line; times, addresses and pids
masked) is not launched a third time. The watchdog alerts once with that line, records the
decision and exits 81. "Its first step" is the first step its heartbeat reports past the one its
start-up beat named. The output is read from --trainer-log (process mode; without it only the
exit codes are compared) or the container's log (docker mode).

modes:
  process   runs the trainer command given after `--` as a child in its own process group;
            SIGTERM/SIGINT to the watchdog are forwarded to it, and the watchdog waits up to
            --term-grace-seconds for its emergency checkpoint, then exits with its code (75)
            without relaunching (a second signal kills it at once). To stop a run, stop the
            watchdog: a trainer that exits 75 on its own is relaunched, as after a preemption.
  docker    drives the trainer container (--container) through the Docker Engine API on the
            mounted socket: inspect, start, kill. The API version is negotiated with the engine
            (Engine 20.10 / API 1.41 and newer), again when an upgraded engine refuses it. The
            container's own command carries --resume-from-latest. An engine it cannot use (no
            socket, no permission, too old) is reported, not exited on: the watchdog stays up,
            unhealthy (x1_watchdog_healthy 0; `python -m x1_watchdog.healthcheck`), alerts, and
            retries with backoff. SIGTERM/SIGINT end the watchdog only: the trainer container
            keeps running and the next watchdog adopts it (`docker compose restart watchdog`);
            stop the trainer itself with `docker compose stop trainer`. The Docker socket is
            root-equivalent; only this service should get it.
  provider  runs off the GPU host (your machine or a small always-on VM): polls the instance
            through the provider's API and brings it back after a preemption (RunPod podResume
            of the same pod; Lambda a new instance of the same type and region with the same
            user-data and file system, whose cloud-init runs `docker compose up`), then follows
            it; stops when the instance is terminated or a final decision is recorded. A pod
            you stop yourself is resumed too: stop the keeper first.

Every decision is a JSON line in --events-file ("event": start, exit, relaunch, stall, give_up,
startup_failure, terminate, unhealthy, healthy). Prometheus on --port: x1_watchdog_restarts_total{reason},
x1_watchdog_trainer_up, x1_watchdog_downtime_seconds_total, x1_watchdog_healthy,
x1_watchdog_docker_engine_info, x1_watchdog_write_failing, x1_watchdog_write_error_info. A state or
events file that cannot be written (a full or read-only disk) stops nothing: from its first failed
write the watchdog is unhealthy, naming the path and the cause, alerts once, and writes again at
its next decision. Stall detection runs on the monotonic clock: a heartbeat's age is the time since
the watchdog first saw it, so a wall clock stepped back or forward neither hides a stall nor makes
one. Provider API keys come from LAMBDA_API_KEY / RUNPOD_API_KEY; alerts from SLACK_WEBHOOK_URL /
SMTP_* (x1_common.alerts); none of them is ever logged.

example (process mode):
  python -m x1_watchdog --mode process --heartbeat-file /workspace/logs/heartbeat.json \\
      --events-file /workspace/logs/watchdog-events.jsonl --state-file /workspace/logs/watchdog-state.json \\
      -- python -m x1_pretrain.train --config configs/x1-50m-a100.yaml ...

example (provider mode, on your machine; LAMBDA_API_KEY in the environment):
  python -m x1_watchdog --mode provider --provider lambda --instance-id 0920582c7ff041399e34823a0be62549 \
      --user-data-file cloud-init.yaml --file-system-name x1-fs
"""

EPILOG = """\
exit codes: the trainer's final code (0 finished, 2 bad config, 76/77 budget stop, 80 forecast stop, 78 launch
refused, 79 diverged); after a give-up, the last trainer code; 81 after a start-up failure (the
same error twice before the first step); 82 when --terminate-on-finish sent the terminate and the
provider still listed the instance as not terminated after --terminate-confirm-seconds (it is
still billing: alerted; a restarted watchdog reads it back and sends again); 75 after a forwarded
SIGTERM; 2 for a usage error of the watchdog itself. Provider mode: 0 once the instance is terminated
(or on SIGTERM/SIGINT), 1 after a give-up (bring-backs that keep failing count too), 2 when
the API key is refused or the instance does not exist.
"""


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m x1_watchdog",
        usage="%(prog)s [options] [-- TRAINER COMMAND ...]",
        description=DESCRIPTION,
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--mode", choices=("process", "docker", "provider"), default="process")

    g = p.add_argument_group("the trainer (process and docker modes)")
    g.add_argument("--container", help="docker mode: the trainer container's name or id")
    g.add_argument("--docker-socket", default="/var/run/docker.sock", help="docker mode: the Engine API socket")
    g.add_argument("--heartbeat-file", type=Path, help="the trainer's heartbeat (JSON: step, time, pid, phase)")
    g.add_argument("--stall-seconds", type=float, default=600.0,
                   help="a heartbeat older than this (after the startup grace) is a stall; 0 disables (default 600)")
    g.add_argument("--startup-grace-seconds", type=float, default=600.0,
                   help="time a new trainer gets to write its first heartbeat; covers torch.compile (default 600)")
    g.add_argument("--term-grace-seconds", type=float, default=60.0,
                   help="SIGTERM to SIGKILL: room for the emergency checkpoint (default 60)")
    g.add_argument("--hold-after-final", action="store_true",
                   help="after a final decision, stay up (serving /metrics) until SIGTERM/SIGINT, then exit with "
                        "the final code; for a restart-always policy such as compose's unless-stopped")
    g.add_argument("--check-seconds", type=float, default=1.0, help="how often the trainer is looked at (default 1)")
    g.add_argument("--trainer-log", type=Path,
                   help="process mode: append the trainer's output to this file (default: the watchdog's own output); "
                        "a start-up failure's error is read back from it")

    g = p.add_argument_group("relaunch policy")
    g.add_argument("--max-restarts", type=int, default=10,
                   help="relaunches allowed inside the window before giving up (default 10)")
    g.add_argument("--restart-window-seconds", type=float, default=3600.0, help="the give-up window (default 3600)")
    g.add_argument("--backoff-base-seconds", type=float, default=2.0,
                   help="delay before the first relaunch in the window, doubled for each next one (default 2)")
    g.add_argument("--backoff-max-seconds", type=float, default=60.0, help="cap on the backoff delay (default 60)")

    g = p.add_argument_group("records and metrics")
    g.add_argument("--events-file", type=Path,
                   help="JSON lines, one per decision (default /workspace/logs/watchdog-events.jsonl; "
                        "provider mode: ./watchdog-provider-events.jsonl)")
    g.add_argument("--state-file", type=Path,
                   help="the decisions a restarted watchdog honours (default /workspace/logs/watchdog-state.json; "
                        "provider mode: ./watchdog-provider-state.json)")
    g.add_argument("--total-steps", type=int, metavar="N",
                   help="the run's planned total steps (the trainer's --total-steps), kept with a final decision. A "
                        "budget stop (76) or a refused launch (78) recorded for another total is set aside for this "
                        "re-plan: the trainer is launched again and judges the new plan against the budget")
    g.add_argument("--reset-state", action="store_true",
                   help="forget the recorded decisions (a final stop included) and start a new run")
    g.add_argument("--port", type=int, default=WATCHDOG_METRICS_PORT,
                   help=f"Prometheus /metrics port, 0 disables (default {WATCHDOG_METRICS_PORT})")
    g.add_argument("--metrics-host", default="127.0.0.1",
                   help="address /metrics listens on (default 127.0.0.1; 0.0.0.0 inside a container)")

    g = p.add_argument_group("provider (--terminate-on-finish and provider mode)")
    g.add_argument("--terminate-on-finish", action="store_true",
                   help="after exit 0, 76, 77, 79 or 80: terminate the instance, read it back until the provider shows it "
                        "terminated, and write what was sent and observed to --termination-file")
    g.add_argument("--terminate-confirm-seconds", type=float, default=900.0,
                   help="--terminate-on-finish: how long to read the instance back (and send the terminate again every "
                        "minute) before it is reported still billing and the watchdog exits 82 (default 900)")
    g.add_argument("--provider", choices=PROVIDERS)
    g.add_argument("--api-url", help="the provider's base URL (default: the real API)")
    g.add_argument("--instance-id", help="the instance (Lambda) or pod (RunPod) id")
    g.add_argument("--termination-file", type=Path, default=Path("/workspace/logs/termination.json"),
                   help="where --terminate-on-finish writes what it sent and observed (default %(default)s)")
    g.add_argument("--keep-run-dir", type=Path, metavar="DIR",
                   help="--terminate-on-finish: storage that outlives the instance (a Lambda persistent filesystem, "
                        "a RunPod network volume). The run folder is copied there and verified before the terminate; "
                        "with --run-dir and without this, the terminate is refused (the folder would die with the "
                        "instance)")
    g.add_argument("--run-dir", type=Path,
                   help="--terminate-on-finish: the run folder the trainer exported (its --run-dir); the provider's "
                        "answer is added to it as termination.json, with its manifest and dod.json updated")
    g.add_argument("--poll-seconds", type=float, default=20.0, help="provider mode: status poll period (default 20)")
    g.add_argument("--instance-type", help="provider mode, Lambda: type to relaunch (default: the preempted one's)")
    g.add_argument("--region", help="provider mode, Lambda: region to relaunch in (default: the preempted one's)")
    g.add_argument("--user-data-file", type=Path,
                   help="provider mode, Lambda: cloud-init user-data for the relaunch (runs `docker compose up`)")
    g.add_argument("--ssh-key-name", action="append", default=[],
                   help="provider mode, Lambda: repeatable (default: the preempted one's)")
    g.add_argument("--file-system-name", action="append", default=[],
                   help="provider mode, Lambda: the persistent file system holding /workspace; repeatable "
                        "(default: the preempted one's)")
    g.add_argument("--gpu-count", type=int, default=1, help="provider mode, RunPod: GPUs for podResume (default 1)")
    g.add_argument("--recover-timeout-seconds", type=float, default=900.0,
                   help="provider mode: alert when a brought-back instance is not running after this long (default 900)")
    return p


# Beside the trainer, the records live on the shared volume; off the GPU host (provider mode),
# in the directory the keeper runs from.
DEFAULT_FILES = {
    "events_file": (Path("/workspace/logs/watchdog-events.jsonl"), Path("watchdog-provider-events.jsonl")),
    "state_file": (Path("/workspace/logs/watchdog-state.json"), Path("watchdog-provider-state.json")),
}


def split_command(argv: list[str]) -> tuple[list[str], list[str]]:
    """The watchdog's own options, and the trainer command after the first `--`."""
    if "--" in argv:
        i = argv.index("--")
        return argv[:i], argv[i + 1:]
    return argv, []


def check_args(p: argparse.ArgumentParser, args: argparse.Namespace, command: list[str]) -> None:
    """Usage errors exit 2 naming the option (argparse's error())."""
    for name in ("stall_seconds", "startup_grace_seconds", "term_grace_seconds", "restart_window_seconds",
                 "backoff_base_seconds", "backoff_max_seconds"):
        value = getattr(args, name)
        if not math.isfinite(value) or value < 0:
            p.error(f"--{name.replace('_', '-')} must be a finite number >= 0, got {value}")
    for name in ("check_seconds", "poll_seconds", "recover_timeout_seconds", "terminate_confirm_seconds"):
        value = getattr(args, name)
        if not math.isfinite(value) or value <= 0:
            p.error(f"--{name.replace('_', '-')} must be a positive number, got {value}")
    if args.max_restarts < 0:
        p.error(f"--max-restarts must be >= 0, got {args.max_restarts}")
    if args.total_steps is not None and args.total_steps < 1:
        p.error(f"--total-steps must be >= 1, got {args.total_steps}")
    if args.gpu_count < 1:
        p.error(f"--gpu-count must be >= 1, got {args.gpu_count}")
    if not 0 <= args.port <= 65535:
        p.error(f"--port must be in 0..65535, got {args.port}")

    if args.mode == "process":
        if not command:
            p.error("process mode needs the trainer command after `--`")
    elif command:
        p.error(f"{args.mode} mode takes no trainer command after `--` (got {' '.join(command)!r})")
    if args.mode in ("process", "docker") and args.heartbeat_file is None:
        p.error(f"--heartbeat-file is required in {args.mode} mode (stall detection reads it)")
    if args.mode == "docker" and not args.container:
        p.error("--container is required in docker mode")
    if args.trainer_log is not None and args.mode != "process":
        p.error(f"--trainer-log is for process mode (in {args.mode} mode the trainer's output is its container's)")

    for name, (beside_trainer, off_host) in DEFAULT_FILES.items():
        if getattr(args, name) is None:
            setattr(args, name, off_host if args.mode == "provider" else beside_trainer)

    needs_provider = args.mode == "provider" or args.terminate_on_finish
    if needs_provider:
        what = "provider mode" if args.mode == "provider" else "--terminate-on-finish"
        for name in ("provider", "instance_id"):
            if not getattr(args, name):
                p.error(f"{what} needs --{name.replace('_', '-')}")
        try:
            api_key_from_env(args.provider)
        except ValueError as e:
            p.error(f"{what}: {e}")
    if args.user_data_file is not None and not args.user_data_file.is_file():
        p.error(f"--user-data-file {args.user_data_file}: no such file")
    if args.terminate_on_finish and args.mode == "provider":
        p.error("--terminate-on-finish belongs to the watchdog beside the trainer (process or docker mode)")
    if args.run_dir is not None and not args.terminate_on_finish:
        p.error("--run-dir is used only with --terminate-on-finish (the trainer writes the folder itself)")


def ensure_writable_dir(path: Path, option: str) -> None:
    """Records that cannot be written are found at start, not at the first decision."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise OSError(f"{option} {path}: cannot create its directory {path.parent} ({e.strerror})") from e
    if not os.access(path.parent, os.W_OK):
        raise OSError(f"{option} {path}: directory {path.parent} is not writable")


def make_handle(args: argparse.Namespace, command: list[str], metrics: WatchdogMetrics) -> TrainerHandle:
    if args.mode == "docker":
        from x1_watchdog.docker import DockerHandle  # the Docker SDK: only docker mode installs it

        return DockerHandle(args.container, socket_path=args.docker_socket, on_engine=metrics.docker_engine)
    return ProcessHandle(command, log_path=args.trainer_log)


def main(argv: list[str] | None = None) -> int:
    own, command = split_command(list(sys.argv[1:] if argv is None else argv))
    parser = build_parser()
    args = parser.parse_args(own)
    check_args(parser, args, command)
    try:
        alerter = AlertSender.from_env(source="X1 watchdog")
    except ValueError as e:
        parser.error(f"alert settings: {e}")
    setup_logging()
    # Both record files report their failed writes here; /metrics and the alert are wired below.
    writes = WriteHealth(log)

    try:
        ensure_writable_dir(args.state_file, "--state-file")
        ensure_writable_dir(args.events_file, "--events-file")
        if args.trainer_log is not None:
            ensure_writable_dir(args.trainer_log, "--trainer-log")
        if args.terminate_on_finish:
            ensure_writable_dir(args.termination_file, "--termination-file")
        # One state file, one watchdog: a second one would take the first one's live trainer for a
        # previous watchdog's leftover and stop it. Taken before the file is read (or reset), held
        # until this process exits.
        Lease.for_file(args.state_file, LeaseKind.WATCHDOG).acquire()
        state = StateStore(args.state_file, fresh=args.reset_state, total_steps=args.total_steps, writes=writes)
        events = EventLog(args.events_file, writes=writes)
    except (StateError, OSError, LeaseHeld, LeaseError) as e:
        log.error("%s", e)
        return ExitCode.USAGE
    if args.reset_state:
        log.warning("--reset-state: previous decisions in %s forgotten", args.state_file)
    if (cleared := state.clear_for_replan()) is not None:
        log.warning("re-plan: the final decision %s (exit %s at %s, for %s total steps) is set aside for --total-steps "
                    "%d; launching the trainer to continue from its latest checkpoint", cleared.get("reason"),
                    cleared.get("exit_code"), cleared.get("time"), cleared.get("total_steps"), args.total_steps)
        events.write("replan", exit_code=cleared.get("exit_code"), reason=cleared.get("reason"),
                     old_total_steps=cleared.get("total_steps"), new_total_steps=args.total_steps)
    metrics = WatchdogMetrics()
    events.on_write = metrics.last_decision
    writes.on_change = metrics.write_error
    writes.on_first = lambda error: alerter.send(
        "watchdog-write-failing", f"watchdog cannot write its records: {error[:200]}",
        f"{error}\nThe watchdog goes on supervising the trainer and writes again at its next decision; its "
        "decisions since are in its log only. Free space (or remount read-write) on that disk.", {"error": error})
    metrics.write_error(writes.last_error)  # a write that failed before /metrics existed
    if state.final is not None:  # a decision taken by an earlier watchdog: shown until a new one
        metrics.last_decision({"event": "final", **state.final})
    metrics.serve(args.port, args.metrics_host)
    stop = StopRequest()
    stop.install()
    policy = RestartPolicy(
        max_restarts=args.max_restarts,
        window_seconds=args.restart_window_seconds,
        backoff_base_seconds=args.backoff_base_seconds,
        backoff_max_seconds=args.backoff_max_seconds,
    )

    if args.mode == "provider":
        client = make_client(args.provider, args.api_url, api_key_from_env(args.provider))
        launch = LaunchSpec(
            instance_type=args.instance_type,
            region=args.region,
            user_data=args.user_data_file.read_text(encoding="utf-8") if args.user_data_file else None,
            ssh_key_names=tuple(args.ssh_key_name),
            file_system_names=tuple(args.file_system_name),
            gpu_count=args.gpu_count,
        )
        keeper = InstanceKeeper(client, args.provider, args.instance_id, launch, policy, args.poll_seconds,
                                state, events, metrics, alerter, stop, args.recover_timeout_seconds)
        return keeper.run()

    on_final: Callable[[int, str], int | None] = lambda code, reason: None  # noqa: E731
    if args.terminate_on_finish:
        client = make_client(args.provider, args.api_url, api_key_from_env(args.provider))
        confirm = args.terminate_confirm_seconds
        on_final = Terminator(client, args.provider, args.instance_id, args.termination_file, state, events, alerter,
                              run_dir=args.run_dir, keep_dir=args.keep_run_dir, confirm_seconds=confirm,
                              resend_every_s=min(60.0, confirm / 4), read_every_s=min(5.0, confirm / 20))
        if args.run_dir is not None and args.keep_run_dir is None:
            log.warning("--terminate-on-finish without --keep-run-dir: the run folder %s would die with the instance, "
                        "so the terminate at the end will be refused (set RESULTS_DIR)", args.run_dir)
    try:
        handle = make_handle(args, command, metrics)
    except StartError as e:
        log.error("%s", e)
        return ExitCode.USAGE
    supervisor = Supervisor(
        handle,
        StallDetector(args.heartbeat_file, args.stall_seconds, args.startup_grace_seconds),
        policy,
        SupervisorSettings(term_grace_seconds=args.term_grace_seconds, check_seconds=args.check_seconds,
                           forward_stop=args.mode != "docker"),
        state, events, metrics, alerter, stop, on_final,
    )
    try:
        code = supervisor.run()
    except StartError as e:
        log.error("%s", e)
        return ExitCode.USAGE
    if code == ExitCode.TERMINATE_UNCONFIRMED:
        # Not held: the restart that follows (compose's unless-stopped, the stack's runner) reads the
        # instance back and sends the terminate again.
        log.error("exiting %d: the instance %s may still bill (see the alert and %s)", code, args.instance_id,
                  args.termination_file)
        return code
    if args.hold_after_final and state.final is not None:
        hold(stop, code)
    return code


def hold(stop: StopRequest, code: int) -> None:
    """Stays up after a final decision until asked to stop. Under a restart-always policy
    (compose's `unless-stopped`), a watchdog that exits is started again only to exit again."""
    log.info("final decision (exit code %d) taken; holding until SIGTERM/SIGINT (--hold-after-final)", code)
    while not stop.wait(3600):
        pass


if __name__ == "__main__":
    sys.exit(main())
