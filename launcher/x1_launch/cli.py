"""`x1`: the command line from a laptop to a terminated instance and a run folder on disk.

    x1 plan ...                                   today's plan (python -m x1_pretrain.plan)
    x1 launch --provider runpod --ssh-key ~/.ssh/id_ed25519 --env-file .env
    x1 status                                     one screen: instance, step, ETA, spend, watchdog
    x1 logs [-f] [service]
    x1 fetch                                      the run folder home, verified
    x1 down                                       stop, fetch, terminate, prove it (check 6)

API keys come from LAMBDA_API_KEY / RUNPOD_API_KEY only; no message, log line or file of `x1`
contains them (the instance's `.env`, mode 600, is written over SSH from stdin).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import posixpath
import shlex
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from budget_sidecar.price import check_until_acceptable
from x1_common.contracts import ExitCode
from x1_common.procs import proc_start_ticks
from x1_common.providers import (
    API_KEY_ENV,
    PROVIDERS,
    Instance,
    LambdaClient,
    ProviderError,
    RunPodClient,
    api_key_from_env,
    make_client,
)
from x1_common.restarts import describe as describe_restart
from x1_launch import cloud, remote, verify
from x1_launch.remote import STACKS, Layout
from x1_launch.ssh import Remote, SSHError
from x1_launch.state import InstanceRecord, StateDir, StateError, utc_now
from x1_pretrain.run.plan import main as plan_main
from x1_pretrain.stack.services import DEFAULTS, SettingsError, load_env_file
from x1_pretrain.stack.status import describe_decision

PROVIDER_DISPLAY = {"lambda": "Lambda", "runpod": "RunPod"}
INTERRUPTED = 130


class UsageError(Exception):
    """Bad input: exit 2, nothing started."""


class KeyRefused(Exception):
    """The provider refused the API key while the price was read (carried past the price rule's retries)."""

    def __init__(self, error: ProviderError) -> None:
        super().__init__(str(error))
        self.error = error


class Console:
    """`x1`'s own lines, with the seconds since the command began."""

    def __init__(self) -> None:
        self.t0 = time.monotonic()

    def say(self, text: str) -> None:
        print(f"[{time.monotonic() - self.t0:6.1f}s] {text}", flush=True)


# ---------------------------------------------------------------------------------------------
# Shared pieces


def client_for(provider: str, api_url: str | None, http_timeout: float = 15.0) -> LambdaClient | RunPodClient:
    try:
        key = api_key_from_env(provider)
    except ValueError as e:
        raise UsageError(str(e)) from None
    return make_client(provider, api_url, key, timeout=http_timeout)


def explain(e: ProviderError, provider: str) -> str:
    """A provider error in the user's words (the key itself is never in it)."""
    if e.kind == "auth":
        return (f"the {PROVIDER_DISPLAY[provider]} API refused the key in {API_KEY_ENV[provider]} ({e}); "
                "check the key in your environment")
    return str(e)


def remote_for(state: StateDir, rec: InstanceRecord) -> Remote:
    if rec.host is None or rec.port is None:
        raise SSHError(f"instance {rec.instance_id} has no SSH address recorded yet (stage {rec.stage})")
    return Remote(rec.host, rec.port, rec.ssh_user, Path(rec.ssh_key), state.known_hosts(rec.instance_id))


def layout_of(rec: InstanceRecord) -> Layout:
    return Layout(rec.remote_repo, rec.workspace, rec.stack)


def tunnel_command(state: StateDir, rec: InstanceRecord, ports: dict[str, int]) -> str:
    r = remote_for(state, rec)
    forwards = [x for port in ports.values() for x in ("-L", f"{port}:127.0.0.1:{port}")]
    return shlex.join(["ssh", "-N", *forwards, "-p", str(r.port), "-i", str(r.key), "-o",
                       f"UserKnownHostsFile={r.known_hosts}", f"{r.user}@{r.host}"])


def x1_command(args: argparse.Namespace, *words: str) -> str:
    """An `x1` command line for the user, with --state-dir when one was given."""
    extra = ["--state-dir", str(args.state_dir)] if getattr(args, "state_dir", None) else []
    return shlex.join(["x1", *words, *extra])


@contextlib.contextmanager
def sigint_held() -> Iterator[list[int]]:
    """Ctrl-C waits until the block ends (the provider's answer recorded), then takes effect."""
    caught: list[int] = []
    previous = signal.signal(signal.SIGINT, lambda signum, frame: caught.append(signum))
    try:
        yield caught
    finally:
        signal.signal(signal.SIGINT, previous)
    if caught:
        raise KeyboardInterrupt


# ---------------------------------------------------------------------------------------------
# The off-host watchdog (provider mode), on this machine


def watchdog_argv(rec: InstanceRecord, folder: Path, poll_seconds: float, repo: Path | None) -> list[str]:
    argv = [sys.executable, "-m", "x1_watchdog", "--mode", "provider", "--provider", rec.provider,
            "--instance-id", rec.instance_id, "--poll-seconds", f"{poll_seconds:g}", "--port", "0",
            "--state-file", str(folder / "watchdog-state.json"), "--events-file", str(folder / "watchdog-events.jsonl")]
    if rec.api_url:
        argv += ["--api-url", rec.api_url]
    if rec.provider == "lambda" and repo is not None:
        argv += ["--user-data-file", str(repo / "cloud-init.yaml")]
    return argv


def watchdog_alive(rec: InstanceRecord) -> bool:
    return (rec.watchdog_pid is not None and rec.watchdog_start_ticks is not None
            and proc_start_ticks(rec.watchdog_pid) == rec.watchdog_start_ticks)


def start_watchdog(rec: InstanceRecord, folder: Path, poll_seconds: float, repo: Path | None) -> subprocess.Popen[bytes]:
    with open(folder / "watchdog.log", "ab") as out:
        proc = subprocess.Popen(watchdog_argv(rec, folder, poll_seconds, repo), stdout=out, stderr=out,
                                stdin=subprocess.DEVNULL, start_new_session=True)
    rec.watchdog_pid, rec.watchdog_start_ticks = proc.pid, proc_start_ticks(proc.pid)
    return proc


def stop_watchdog(rec: InstanceRecord, timeout: float = 30.0) -> bool:
    """SIGTERM to the recorded watchdog, when it is still that process. True when one was stopped."""
    if not watchdog_alive(rec):
        return False
    assert rec.watchdog_pid is not None
    with contextlib.suppress(ProcessLookupError):
        os.kill(rec.watchdog_pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    while watchdog_alive(rec) and time.monotonic() < deadline:
        with contextlib.suppress(ChildProcessError):
            os.waitpid(rec.watchdog_pid, os.WNOHANG)
        time.sleep(0.2)
    return True


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except OSError:
        return []
    out = []
    for line in lines:
        with contextlib.suppress(ValueError):
            item = json.loads(line)
            if isinstance(item, dict):
                out.append(item)
    return out


# ---------------------------------------------------------------------------------------------
# x1 launch


def user_settings(env_file: Path | None) -> dict[str, str]:
    """The .env's values, checked as the stack and compose check them: a key X1 does not read (and
    the nearest it does) or a value of the wrong type is refused before anything is rented."""
    if env_file is None:
        return {}
    try:
        values, warnings = load_env_file(env_file)
    except SettingsError as e:
        raise UsageError(str(e)) from None
    for warning in warnings:
        print(f"warning: {env_file}: {warning}", file=sys.stderr)
    return values


def setting(values: dict[str, str], name: str) -> str:
    return values.get(name) or DEFAULTS[name]


def positive(values: dict[str, str], name: str) -> float:
    text = setting(values, name)
    try:
        x = float(text)
    except ValueError:
        raise UsageError(f"{name}={text!r} is not a number") from None
    if not math.isfinite(x) or x <= 0:
        raise UsageError(f"{name}={text!r} must be a positive number")
    return x


def instance_env(values: dict[str, str], rec: InstanceRecord, api_key: str, extra: dict[str, str]) -> bytes:
    """The instance's .env: the user's settings, then what this launch decided (its provider, id,
    key, and for compose the host's Docker group and workspace folder). The API key is written here
    and nowhere else."""
    merged = dict(values)
    merged.update({"PROVIDER": rec.provider, "INSTANCE_ID": rec.instance_id, API_KEY_ENV[rec.provider]: api_key,
                   **extra})
    if rec.api_url:
        merged["PROVIDER_API_URL"] = rec.api_url
    merged.pop("RATE_USD_PER_HR", None)  # the provider's own price is read
    lines = ["# written by `x1 launch` for this instance; mode 600"]
    for key, value in merged.items():
        if "\n" in value:
            raise UsageError(f"{key}: a value of several lines cannot go into .env")
        lines.append(f"{key}={json.dumps(value) if value != value.strip() or '#' in value else value}")
    return ("\n".join(lines) + "\n").encode()


def sentence(provider: str, instance_type: str, price: float, hours: float, cap: float) -> tuple[str, bool]:
    cost = price * hours
    buffer = cap - cost
    verdict = (f"Confirmed acceptable, ${buffer:.2f} buffer." if buffer >= 0
               else f"Over the budget by ${-buffer:.2f}: not launched.")
    return (f"This will launch 1× {instance_type} on {PROVIDER_DISPLAY[provider]} at ${price:.2f}/h, run ~{hours:g} h "
            f"including setup = ${cost:.2f}. Budget: ${cap:g}. {verdict}"), buffer >= 0


def confirm(args: argparse.Namespace) -> bool:
    if args.yes:
        return True
    if not sys.stdin.isatty():
        raise UsageError("no terminal to ask for confirmation: pass --yes to launch from a script")
    return input("Launch it? [y/N] ").strip().lower() in ("y", "yes")


def resolve_repo(option: Path | None) -> Path:
    """The repository to put on the instance: --repo, else the source tree this x1 runs from, else
    the current folder."""
    candidates = [option] if option else [Path(__file__).resolve().parents[2], Path.cwd()]
    for repo in candidates:
        if (repo / "pyproject.toml").is_file() and (repo / "trainer" / "x1_pretrain").is_dir():
            return repo.resolve()
    raise UsageError(f"{candidates[0]} is not the X1 repository (no pyproject.toml and trainer/x1_pretrain): "
                     "pass --repo with the repository's folder")


def cmd_launch(args: argparse.Namespace) -> int:
    con = Console()
    state = StateDir.choose(args.state_dir)
    values = user_settings(args.env_file)
    repo = resolve_repo(args.repo)
    key_path = args.ssh_key.expanduser().resolve()
    if not key_path.is_file():
        raise UsageError(f"--ssh-key {args.ssh_key}: no such file (the private key the instance will accept)")
    public_key = None
    if args.provider == "runpod":
        pub = Path(str(key_path) + ".pub")
        if not pub.is_file():
            raise UsageError(f"--ssh-key: {pub} is missing (RunPod gets the public key to authorize)")
        public_key = pub.read_text(encoding="utf-8").strip()
    elif not args.ssh_key_name:
        raise UsageError("--ssh-key-name is required for Lambda: the name of the SSH key you added in its dashboard")
    instance_type = args.instance_type or cloud.DEFAULT_TYPE[args.provider]
    ceiling = args.max_price_usd_per_hr if args.max_price_usd_per_hr is not None else positive(values, "MAX_PRICE_USD_PER_HR")
    cap = positive(values, "BUDGET_CAP_USD")
    hours = args.hours if args.hours is not None else (
        positive(values, "PLANNED_HOURS") if values.get("PLANNED_HOURS") else 24.0)
    client = client_for(args.provider, args.api_url)
    key = api_key_from_env(args.provider)

    # 1. the price against the ceiling (the budget_sidecar.price rule)
    con.say(f"launch 1/7: the price of {instance_type} on {PROVIDER_DISPLAY[args.provider]} (ceiling ${ceiling:.2f}/h)")
    seen: list[float] = []

    def read_price() -> float:
        try:
            seen.append(cloud.price_now(client, instance_type))
        except ProviderError as e:
            if e.kind == "auth":  # no waiting helps a refused key
                raise KeyRefused(e) from None
            raise
        return seen[-1]

    try:
        code = check_until_acceptable(read_price, ceiling, wait=args.wait, every_s=args.every_minutes * 60.0,
                                      max_wait_s=None, out=lambda line: con.say(f"  {line}"))
    except ValueError as e:
        raise UsageError(str(e)) from None
    except KeyRefused as e:
        raise e.error from None
    if code != ExitCode.FINISHED:
        con.say("not launched: nothing was rented")
        return int(ExitCode.LAUNCH_REFUSED)
    price = seen[-1]
    text, acceptable = sentence(args.provider, instance_type, price, hours, cap)
    print(text, flush=True)
    if not acceptable:
        return int(ExitCode.LAUNCH_REFUSED)
    if not confirm(args):
        con.say("not launched: nothing was rented")
        return 1

    # 2. the instance; its record is on disk before anything else can interrupt
    name = f"x1-{time.strftime('%Y%m%d-%H%M%S')}"
    user = args.ssh_user or cloud.DEFAULT_USER[args.provider]
    # RunPod: the pod's network volume, /workspace. Lambda: the login's home (a persistent file
    # system, when attached, is mounted under /lambda/nfs: --remote-dir and --remote-workspace there).
    base = "/workspace" if args.provider == "runpod" else ("/root" if user == "root" else f"/home/{user}")
    rec = InstanceRecord(
        provider=args.provider, instance_id="", api_url=args.api_url, instance_type=instance_type,
        region=args.region or cloud.DEFAULT_REGION[args.provider], price_usd_per_hr=price, stack=args.stack or (
            "compose" if args.provider == "lambda" else "processes"),
        ssh_user=user, ssh_key=str(key_path), remote_repo=args.remote_dir or posixpath.join(base, "x1"),
        workspace=args.remote_workspace or posixpath.join(base, "x1-workspace" if args.provider == "lambda" else "ws"),
        launched_utc=utc_now())
    if rec.provider == "runpod" and layout_of(rec).boot_script != cloud.BOOT_SCRIPT:
        raise UsageError(f"--remote-dir {rec.remote_repo}: on RunPod it must be a folder directly in /workspace (the "
                         f"pod's start command runs {cloud.BOOT_SCRIPT} at every resume)")
    con.say(f"launch 2/7: renting it ({name})")
    try:
        with sigint_held():  # a Ctrl-C now waits until the provider's answer is on disk
            rec.instance_id = cloud.launch(client, cloud.LaunchRequest(
                provider=args.provider, instance_type=instance_type, region=rec.region, name=name,
                ssh_key_name=args.ssh_key_name, public_key=public_key, image=args.image, volume_gb=args.volume_gb))
            state.save(rec, make_current=True)
        con.say(f"  instance {rec.instance_id}: billing from now; recorded in {state.record_path(rec.instance_id)}")
        return launch_rest(args, con, state, rec, client, values, key, repo)
    except KeyboardInterrupt:
        if not rec.instance_id:
            print("\ninterrupted before the provider answered: nothing was rented", file=sys.stderr, flush=True)
            return INTERRUPTED
        print(f"\ninterrupted at stage {rec.stage}: {PROVIDER_DISPLAY[rec.provider]} instance {rec.instance_id} is "
              f"still running and billing. It is recorded in {state.record_path(rec.instance_id)}; end it with:\n"
              f"  {x1_command(args, 'down', '--no-fetch', '--instance', rec.instance_id)}", file=sys.stderr, flush=True)
        return INTERRUPTED
    except (ProviderError, SSHError, subprocess.TimeoutExpired) as e:
        if not rec.instance_id:
            raise
        print(f"error: {explain(e, rec.provider) if isinstance(e, ProviderError) else e}\n"
              f"instance {rec.instance_id} is still running and billing (recorded at stage {rec.stage}); look with "
              f"`{x1_command(args, 'logs', 'boot')}`, end it with "
              f"`{x1_command(args, 'down', '--no-fetch', '--instance', rec.instance_id)}`", file=sys.stderr, flush=True)
        return 1


def launch_rest(args: argparse.Namespace, con: Console, state: StateDir, rec: InstanceRecord,
                client: LambdaClient | RunPodClient, values: dict[str, str], key: str, repo: Path) -> int:
    def stage(name: str) -> None:
        rec.stage = name
        state.save(rec)

    # 3. booting, then SSH, its host key pinned into the instance's own known_hosts
    stage("booting")
    con.say(f"launch 3/7: waiting for the instance to boot and show its SSH address (up to {args.boot_timeout:g} s)")
    inst, (host, port) = cloud.wait_for_address(client, rec.instance_id, args.boot_timeout)
    rec.host, rec.port = host, port
    stage("ssh")
    r = remote_for(state, rec)
    con.say(f"launch 4/7: waiting for SSH on {r.target} (host key pinned in {r.known_hosts})")
    r.wait(args.boot_timeout)

    # 4. the repository and the .env
    stage("upload")
    layout = layout_of(rec)
    files = remote.repo_files(repo)
    con.say(f"launch 5/7: putting {len(files)} files of {repo} and .env (mode 600) in {layout.repo}")
    sent = r.put_files(repo, files, layout.repo)
    extra = {}
    if rec.stack == "compose":
        # compose.yaml needs the socket's group for the watchdog, and /workspace on the host's disk
        # (uid 1000, as every X1 container runs) so that `x1 fetch` finds the run folder there.
        extra["DOCKER_GID"] = r.text("stat -c %g /var/run/docker.sock").strip()
        extra["X1_WORKSPACE"] = layout.workspace
        r.run(f"mkdir -p {shlex.quote(layout.workspace)}")
    r.put_secret(instance_env(values, rec, key, extra), layout.env_file)
    con.say(f"  {sent / 1e6:.1f} MB sent")

    # 5. the stack
    stage("start")
    remote.put_boot_script(r, layout)
    remote.start_stack(r, layout)
    con.say(f"launch 6/7: starting the stack ({rec.stack}); waiting until every service is healthy and the first "
            f"step is logged (up to {args.start_timeout:g} s)")
    st = wait_started(r, layout, args.start_timeout, con)
    stage("running")

    # 6. how to watch it, and the watchdog that brings it back after an eviction
    ports = {name: svc_port for name, svc_port in stack_ports(st).items()}
    con.say("launch 7/7: running")
    print(render_status(rec, inst, st, state), flush=True)
    print(f"\nwatch it: {tunnel_command(state, rec, ports)}", flush=True)
    for name, p in ports.items():
        print(f"  {name:14s} http://127.0.0.1:{p}", flush=True)
    folder = state.folder(rec.instance_id)
    command = shlex.join(watchdog_argv(rec, folder, args.watchdog_poll_seconds, repo))
    if args.no_watchdog:
        print(f"\nthe off-host watchdog (brings the instance back after an eviction) is not started; run it on an "
              f"always-on machine with {API_KEY_ENV[rec.provider]} set:\n  {command}", flush=True)
    else:
        start_watchdog(rec, folder, args.watchdog_poll_seconds, repo)
        state.save(rec)
        print(f"\noff-host watchdog started on this machine (pid {rec.watchdog_pid}, log {folder / 'watchdog.log'}); "
              "it brings the instance back after an eviction while this machine is on. Its command, for an "
              f"always-on machine instead:\n  {command}", flush=True)
    print(f"\nnext: {x1_command(args, 'status')}  |  {x1_command(args, 'logs', '-f')}  |  "
          f"{x1_command(args, 'down')}", flush=True)
    return 0


def stack_ports(st: dict[str, Any]) -> dict[str, int]:
    ports = {}
    for name, svc in (st.get("services") or {}).items():
        url = svc.get("url") or ""
        if url.startswith("http://127.0.0.1:"):
            with contextlib.suppress(ValueError):
                ports[name] = int(url.rsplit(":", 1)[1].split("/")[0])
    return ports


def wait_started(r: Remote, layout: Layout, timeout: float, con: Console) -> dict[str, Any]:
    """Until every service is healthy and the trainer has logged a step; a failed boot script ends it."""
    deadline = time.monotonic() + timeout
    last = ""
    while True:
        code, tail = remote.boot_result(r, layout)
        if code not in (None, 0):
            raise SSHError(f"the stack did not start on {r.target} (boot script exit {code}); the end of "
                           f"{layout.logs}/boot.log:\n{tail}")
        st = remote.stack_status(r, layout) if code == 0 or layout.stack == "compose" else {}
        services = st.get("services") or {}
        healthy = bool(services) and all(s.get("running") and s.get("health") in (None, "healthy")
                                         for s in services.values())
        trainer = st.get("trainer") or {}
        if healthy and trainer.get("total_steps") is not None:
            return st
        health = ", ".join(f"{n}: {s.get('health') or s.get('running')}" for n, s in services.items())
        now = (f"services {health}" if services else "boot script running") + f"; trainer step {trainer.get('step')}"
        if now != last:
            con.say(f"  {now}")
            last = now
        if time.monotonic() > deadline:
            raise SSHError(f"the stack on {r.target} is not up after {timeout:g} s ({now}); the end of the boot log:\n"
                           f"{tail}")
        time.sleep(2.0)


# ---------------------------------------------------------------------------------------------
# x1 status


def render_status(rec: InstanceRecord, inst: Instance | None, st: dict[str, Any] | None, state: StateDir,
                  problem: str | None = None) -> str:
    lines = []
    if inst is not None:
        price = f"${inst.price_usd_per_hr:.2f}/h" if inst.price_usd_per_hr is not None else "price not shown"
        lines.append(f"instance  {PROVIDER_DISPLAY[rec.provider]} {rec.instance_id}: {inst.status} ({inst.raw_status}), "
                     f"{rec.instance_type}, {price}" + (f", ssh {rec.ssh_user}@{rec.host}:{rec.port}" if rec.host else ""))
    else:
        lines.append(f"instance  {PROVIDER_DISPLAY[rec.provider]} {rec.instance_id}: "
                     + ("terminated (recorded)" if rec.terminated else "state unknown"))
    if problem:
        lines.append(f"          ({problem})")
    if st:
        t = st.get("trainer") or {}
        step, total = t.get("step"), t.get("total_steps")
        if step is not None and total:
            done = 100.0 * step / total
            eta = ""
            since = (st.get("runner") or {}).get("since")
            if since and step > 0 and st.get("running"):
                left = (time.time() - since) / step * (total - step)
                eta = f", ETA ~{left / 3600:.1f} h" if left >= 3600 else f", ETA ~{left / 60:.0f} min"
            speed = f", {t['tokens_per_s']:,} tok/s" if t.get("tokens_per_s") is not None else ""
            loss = f", loss {t['loss']:.4f}" if t.get("loss") is not None else ""
            lines.append(f"training  step {step}/{total} ({done:.1f}% done{eta}){speed}{loss}; "
                         f"{'running' if t.get('running') else 'trainer not running'}; latest checkpoint "
                         f"{t.get('latest_checkpoint') or 'none'}")
        else:
            lines.append(f"training  {'step ' + str(step) if step is not None else 'no step logged yet'}")
        b = st.get("budget") or {}
        glance = st.get("at_a_glance") or {}
        if b.get("spent_usd") is not None:
            # `stack status`'s own projection (the trainer's measured pace; the spend itself once the
            # run has ended), so both commands show one number
            projected = glance.get("projected_at_finish_usd")
            projected = b.get("projected_total_usd") if projected is None else projected
            lines.append(f"spend     ${b['spent_usd']:.2f} so far, ${projected or 0:.2f} projected at "
                         f"finish, against the ${b.get('cap_usd') or 0:g} cap" + (" (reading STALE)" if b.get("stale") else ""))
        else:
            lines.append("spend     no budget reading yet")
        forecast = st.get("forecast")
        if forecast:
            lines.append(f"forecast  {forecast}")
        services = st.get("services") or {}
        if services:
            lines.append("services  " + ", ".join(f"{n} {s.get('health') or ('up' if s.get('running') else 'DOWN')}"
                                                  for n, s in services.items()))
        w = st.get("watchdog") or {}
        lines.append(f"restarts  {w.get('restarts_total') or 0} of the trainer on the instance"
                     + restart_summary(state, rec))
        lines += [f"          {describe_restart(r)}" for r in st.get("restarts") or []]
        lines.append(f"watchdog  on the instance: {describe_decision(w.get('last_event'))}")
        if w.get("final"):
            f = w["final"]
            lines.append(f"          final decision: {f.get('reason')} (exit {f.get('exit_code')}): "
                         + ("the run is done; `x1 down` fetches it and terminates the instance"
                            if f.get("exit_code") == 0 else "the trainer is not launched again"))
    else:
        lines.append("restarts  " + restart_summary(state, rec).lstrip(", ") if restart_summary(state, rec) else
                     "restarts  none recorded here")
    events = read_jsonl(state.folder(rec.instance_id) / "watchdog-events.jsonl")
    if events:
        e = events[-1]
        lines.append(f"          off-host watchdog: {e.get('event')} {e.get('reason') or ''} at {e.get('time')}"
                     f" ({'running' if watchdog_alive(rec) else 'not running'})")
    else:
        lines.append(f"          off-host watchdog: {'running, no decision yet' if watchdog_alive(rec) else 'not running'}")
    return "\n".join(lines)


def restart_summary(state: StateDir, rec: InstanceRecord) -> str:
    events = read_jsonl(state.folder(rec.instance_id) / "watchdog-events.jsonl")
    back = [e for e in events if e.get("event") == "relaunch" and e.get("ok")]
    down = sum(float(e.get("downtime_seconds") or 0) for e in events if e.get("event") == "start")
    if not back:
        return ""
    # The instance's time away (lost -> running again), not a restart's downtime: that ends at the
    # trainer's first step, and the stack's restarts lines give it.
    return f", {len(back)} of the instance brought back by the off-host watchdog ({down:.0f} s until it was back)"


def cmd_status(args: argparse.Namespace) -> int:
    state = StateDir.choose(args.state_dir)
    rec = state.load(args.instance)
    inst, st, problem = None, None, None
    if not rec.terminated:
        try:
            inst = client_for(rec.provider, rec.api_url).get_instance(rec.instance_id)
        except ProviderError as e:
            if e.kind == "auth":
                raise
            problem = f"the provider did not answer: {e}"
        if inst is not None and inst.status == "running" and rec.host:
            try:
                st = remote.stack_status(remote_for(state, rec), layout_of(rec), timeout=60)
            except (SSHError, subprocess.TimeoutExpired) as e:
                problem = f"the stack's status could not be read: {e}"
        elif inst is not None:
            problem = f"the instance is {inst.status}: nothing to read on it now"
    if args.json:
        print(json.dumps({"instance": None if inst is None else {"status": inst.status, "raw_status": inst.raw_status,
                                                                 "price_usd_per_hr": inst.price_usd_per_hr},
                          "record": rec.__dict__, "stack": st, "problem": problem,
                          "offhost_events": read_jsonl(state.folder(rec.instance_id) / "watchdog-events.jsonl")},
                         indent=2, default=str))
    else:
        print(render_status(rec, inst, st, state, problem))
    return 0 if st is not None else 1


# ---------------------------------------------------------------------------------------------
# x1 logs


def cmd_logs(args: argparse.Namespace) -> int:
    state = StateDir.choose(args.state_dir)
    rec = state.load(args.instance)
    r = remote_for(state, rec)
    command = remote.log_command(layout_of(rec), args.service, args.follow, args.lines)
    # The terminal's Ctrl-C ends `-f`; ssh's own exit code is ours.
    try:
        return subprocess.call([*r.argv(), command])
    except KeyboardInterrupt:
        return 0


# ---------------------------------------------------------------------------------------------
# x1 fetch, x1 down


def default_output(rec: InstanceRecord) -> Path:
    return Path("x1-runs") / rec.instance_id


def fetch(r: Remote, rec: InstanceRecord, output: Path, con: Console) -> Path:
    """WS/run into OUTPUT/run (an earlier copy replaced only once the new one is complete)."""
    output = output.resolve()
    partial = output / ".run.partial"
    if partial.exists():
        shutil.rmtree(partial)
    r.get_dir(rec.workspace, "run", partial)
    target = output / "run"
    if target.exists():
        shutil.rmtree(target)
    (partial / "run").rename(target)
    partial.rmdir()
    con.say(f"fetched {rec.workspace}/run to {target} ({sum(p.stat().st_size for p in target.rglob('*') if p.is_file()) / 1e6:.1f} MB)")
    return target


def cmd_fetch(args: argparse.Namespace) -> int:
    con = Console()
    state = StateDir.choose(args.state_dir)
    rec = state.load(args.instance)
    target = fetch(remote_for(state, rec), rec, args.output or default_output(rec), con)
    rec.fetched_to = str(target)
    state.save(rec)
    result = verify.verify_run(target, band=args.band, termination_pending=not rec.terminated)
    print(result.text, flush=True)
    return 0 if result.ok else 1


def cmd_down(args: argparse.Namespace) -> int:
    con = Console()
    state = StateDir.choose(args.state_dir)
    rec = state.load(args.instance)
    client = client_for(rec.provider, rec.api_url)
    if rec.terminated:
        try:
            inst = client.get_instance(rec.instance_id)
            now = f"the provider shows it {inst.raw_status}"
            gone = inst.status == "terminated"
        except ProviderError as e:
            if e.kind != "not-found":
                raise
            now, gone = "the provider no longer lists it", True
        con.say(f"instance {rec.instance_id} was terminated already ({now}); nothing to do")
        return 0 if gone else 1

    try:
        inst = client.get_instance(rec.instance_id)
    except ProviderError as e:
        if e.kind != "not-found":
            raise
        inst = None
    if inst is None or inst.status == "terminated":
        # Ended elsewhere (its own watchdog's --terminate-on-finish, the dashboard): recorded, nothing to fetch.
        stop_watchdog(rec)
        rec.terminated, rec.stage = True, "down"
        state.save(rec)
        con.say(f"instance {rec.instance_id} is terminated already ("
                + ("no longer listed" if inst is None else inst.raw_status) + "); recorded, nothing fetched")
        return 0
    con.say(f"down: {PROVIDER_DISPLAY[rec.provider]} instance {rec.instance_id} is {inst.status} ({inst.raw_status})")
    if stop_watchdog(rec):
        con.say("  the off-host watchdog stopped (it would bring the instance back)")
        state.save(rec)
    target = None
    reachable = inst.status == "running" and rec.host is not None and rec.stage not in ("launched", "booting")
    if reachable:
        r = remote_for(state, rec)
        try:
            said = remote.stop_stack(r, layout_of(rec))
            con.say("  stack stopped: " + " / ".join(said.splitlines()[-3:]))
        except (SSHError, subprocess.TimeoutExpired) as e:
            if not args.no_fetch:
                print(f"error: could not stop the stack: {e}\nnothing terminated; --no-fetch terminates without the "
                      "copy (the run folder on the instance is lost then)", file=sys.stderr)
                return 1
            con.say(f"  the stack could not be stopped ({e}); terminating anyway (--no-fetch)")
        if not args.no_fetch:
            try:
                target = fetch(r, rec, args.output or default_output(rec), con)
            except (SSHError, subprocess.TimeoutExpired, OSError) as e:
                print(f"error: the fetch failed, so the instance is NOT terminated: {e}\n"
                      f"try again, or end it without the copy: {x1_command(args, 'down', '--no-fetch')}",
                      file=sys.stderr)
                return 1
            rec.fetched_to = str(target)
            state.save(rec)
    elif not args.no_fetch:
        print(f"error: instance {rec.instance_id} is {inst.status}: its run folder cannot be fetched now, so it is NOT "
              f"terminated. Bring it back and run `x1 down` again, or end it without the copy: "
              f"{x1_command(args, 'down', '--no-fetch')}", file=sys.stderr)
        return 1

    response = client.terminate(rec.instance_id)
    con.say(f"  terminate sent to {PROVIDER_DISPLAY[rec.provider]}")
    after = confirm_gone(client, rec.instance_id, args.confirm_timeout)
    record = {"provider": rec.provider, "instance_id": rec.instance_id, "time": utc_now(), "reason": "x1 down",
              "response": response, "instance_after": after}
    rec.terminated = after.get("status") == "terminated"
    rec.stage = "down"
    state.save(rec)
    con.say(f"  the API shows instance {rec.instance_id} {after.get('raw_status') or after.get('status')}")
    if target is not None:
        check = verify.add_termination(target, record)
        con.say(f"  termination.json written into {target}; {check}")
        result = verify.verify_run(target, band=args.band, termination_pending=False)
        print(result.text, flush=True)
        if not result.ok:
            return 1
    return 0 if rec.terminated else 1


def confirm_gone(client: LambdaClient | RunPodClient, instance_id: str, timeout: float) -> dict[str, Any]:
    """The instance record once the API shows it terminated (or no longer lists it)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            inst = client.get_instance(instance_id)
        except ProviderError as e:
            if e.kind == "not-found":
                return {"status": "terminated", "raw_status": "not listed any more", "error": str(e)}
            raise
        if inst.status == "terminated" or time.monotonic() > deadline:
            return {"status": inst.status, "raw_status": inst.raw_status, "raw": inst.raw}
        time.sleep(2.0)


# ---------------------------------------------------------------------------------------------
# x1 plan


def cmd_plan(args: argparse.Namespace) -> int:
    return int(plan_main(args.plan_args) or 0)


# ---------------------------------------------------------------------------------------------


DESCRIPTION = """\
From a laptop to a terminated instance and a run folder on disk, for the X1 run on one rented GPU:

  x1 plan      today's plan: what the budget buys (python -m x1_pretrain.plan; --help there)
  x1 launch    the price against the ceiling, the pre-launch sentence, your confirmation, the
               instance (Lambda or RunPod API), the repository and .env on it over SSH, the stack
               started and watched until the first step, and the off-host watchdog started here
  x1 status    one screen: instance, step/total, ETA, tokens/s, spend vs cap, restarts, watchdog
  x1 logs      a service's log (-f to follow)
  x1 fetch     the run folder copied here and verified (dod's checks, final.safetensors' sha256)
  x1 down      the stack stopped, the run folder fetched, the instance terminated and the
               provider's answer kept as termination.json in the fetched folder (check 6)

The API key comes from LAMBDA_API_KEY or RUNPOD_API_KEY and is never printed nor logged. Local
records: ~/.x1 (--state-dir, X1_STATE_DIR). Exit codes: 0 done; 1 failed (the message says what,
and which instance is left running); 2 bad input; 78 launch refused (price or budget); 130
interrupted (the instance and the command that ends it are printed).
"""


class DefaultsOnce(argparse.ArgumentDefaultsHelpFormatter):
    """Each option's default in the help once: argparse's `(default: X)` only where the help does not
    name its default itself and there is one to name."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if "default" in (action.help or "") or action.default in (None, False, argparse.SUPPRESS):
            return action.help
        return super()._get_help_string(action)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="x1", description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True, metavar="{plan,launch,status,logs,fetch,down}")

    def common(sp: argparse.ArgumentParser, instance: bool = True) -> None:
        sp.add_argument("--state-dir", type=Path, help="where x1 keeps its records (default ~/.x1, or $X1_STATE_DIR)")
        if instance:
            sp.add_argument("--instance", help="the instance id (default: the one launched last)")

    sub.add_parser("plan", help="today's plan: python -m x1_pretrain.plan's options (x1 plan --help)", add_help=False)

    sp = sub.add_parser("launch", help="rent the instance and start the run on it", formatter_class=DefaultsOnce)
    common(sp, instance=False)
    sp.add_argument("--provider", choices=PROVIDERS, required=True)
    sp.add_argument("--env-file", type=Path, help="your .env (budget, steps, config; cp .env.example .env); the "
                    "instance gets it with its provider, id and API key added")
    sp.add_argument("--ssh-key", type=Path, required=True, help="your SSH private key (RunPod: KEY.pub is authorized)")
    sp.add_argument("--ssh-key-name", help="Lambda: the name of that key in Lambda's dashboard")
    sp.add_argument("--instance-type", help="Lambda instance type or RunPod GPU type id (default: the A100 80GB)")
    sp.add_argument("--region", help="Lambda region (default us-east-1)")
    sp.add_argument("--image", default=cloud.DEFAULT_RUNPOD_IMAGE, help="RunPod: the pod's image")
    sp.add_argument("--volume-gb", type=int, default=100, help="RunPod: the /workspace volume's size")
    sp.add_argument("--max-price-usd-per-hr", type=float, help="the price ceiling (default: MAX_PRICE_USD_PER_HR of .env, 1.40)")
    sp.add_argument("--hours", type=float, help="planned hours for the sentence (default: PLANNED_HOURS of .env, or 24)")
    sp.add_argument("--wait", action="store_true", help="over the ceiling: re-check until it is not, instead of refusing")
    sp.add_argument("--every-minutes", type=float, default=240.0, help="with --wait: minutes between price checks")
    sp.add_argument("-y", "--yes", action="store_true", help="launch without asking (scripts)")
    sp.add_argument("--api-url", help="the provider's base URL (default: the real API)")
    sp.add_argument("--stack", choices=STACKS, help="how the stack runs there (default: compose on Lambda, "
                    "processes on RunPod)")
    sp.add_argument("--ssh-user", help="login (default: ubuntu on Lambda, root on RunPod)")
    sp.add_argument("--repo", type=Path, help="the repository to put there (default: the one x1 runs from)")
    sp.add_argument("--remote-dir", help="where the repository goes on the instance (default: /workspace/x1 on RunPod, "
                    "~/x1 on Lambda)")
    sp.add_argument("--remote-workspace", help="the stack's workspace on the instance (default: /workspace/ws on RunPod, "
                    "~/x1-workspace on Lambda)")
    sp.add_argument("--boot-timeout", type=float, default=900.0, help="seconds for the instance to boot and answer SSH")
    sp.add_argument("--start-timeout", type=float, default=3600.0,
                    help="seconds for the stack to be healthy and log its first step (data preparation included)")
    sp.add_argument("--no-watchdog", action="store_true", help="do not start the off-host watchdog here; print its command")
    sp.add_argument("--watchdog-poll-seconds", type=float, default=20.0, help="the off-host watchdog's poll period")

    sp = sub.add_parser("status", help="one screen: instance, progress, spend, restarts, watchdog")
    common(sp)
    sp.add_argument("--json", action="store_true", help="the same as JSON")

    sp = sub.add_parser("logs", help="a service's log on the instance")
    common(sp)
    sp.add_argument("service", nargs="?", default="trainer", choices=remote.SERVICES)
    sp.add_argument("-f", "--follow", action="store_true", help="keep following (Ctrl-C ends)")
    sp.add_argument("-n", "--lines", type=int, default=100, help="lines to show first (default 100)")

    for name, text in (("fetch", "copy the run folder here and verify it"),
                       ("down", "stop, fetch, terminate, record termination.json")):
        sp = sub.add_parser(name, help=text)
        common(sp)
        sp.add_argument("--output", type=Path, help="where the run folder goes: OUTPUT/run (default x1-runs/<instance>)")
        sp.add_argument("--band", type=float, nargs=2, metavar=("LO", "HI"),
                        help="the DoD's val-loss band (default: the one the run recorded in dod.json)")
        if name == "down":
            sp.add_argument("--no-fetch", action="store_true", help="terminate without copying the run folder")
            sp.add_argument("--confirm-timeout", type=float, default=120.0,
                            help="seconds to wait for the API to show the instance terminated")
    return p


COMMANDS: dict[str, Callable[[argparse.Namespace], int]] = {
    "plan": cmd_plan, "launch": cmd_launch, "status": cmd_status, "logs": cmd_logs, "fetch": cmd_fetch,
    "down": cmd_down,
}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["plan"]:  # every option after `plan` is the plan's own (its --help included)
        return cmd_plan(argparse.Namespace(plan_args=argv[1:]))
    parser = build_parser()
    args = parser.parse_args(argv)
    for name in ("max_price_usd_per_hr", "hours", "every_minutes", "boot_timeout", "start_timeout", "watchdog_poll_seconds",
                 "confirm_timeout"):
        value = getattr(args, name, None)
        if value is not None and (not math.isfinite(value) or value <= 0):
            parser.error(f"--{name.replace('_', '-')} must be a positive number, got {value}")
    if getattr(args, "band", None) is not None and not args.band[0] < args.band[1]:
        parser.error(f"--band: LO must be below HI, got {args.band[0]:g} {args.band[1]:g}")
    if getattr(args, "env_file", None) is not None and not args.env_file.is_file():
        parser.error(f"--env-file {args.env_file}: no such file (cp .env.example .env)")
    try:
        return COMMANDS[args.command](args)
    except (UsageError, StateError) as e:
        print(f"error: {e}", file=sys.stderr)
        return int(ExitCode.USAGE)
    except ProviderError as e:
        provider = getattr(args, "provider", None) or ("lambda" if "lambda" in str(e) else "runpod")
        print(f"error: {explain(e, provider)}", file=sys.stderr)
        return int(ExitCode.USAGE) if e.kind == "auth" else 1
    except (SSHError, subprocess.TimeoutExpired) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        # `launch` handles an interrupt after the rental itself: one that reaches here came before it.
        print("\ninterrupted" + (": nothing was rented" if args.command == "launch" else ""), file=sys.stderr)
        return INTERRUPTED


if __name__ == "__main__":
    sys.exit(main())
