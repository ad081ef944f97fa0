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
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from budget_sidecar.price import check_until_acceptable
from x1_common.contracts import ExitCode
from x1_common.procs import proc_start_ticks
from x1_common.providers import (
    API_KEY_ENV,
    PROVIDERS,
    GpuOffer,
    Instance,
    LambdaClient,
    ProviderError,
    RunPodClient,
    api_key_from_env,
    make_client,
)
from x1_common.restarts import describe as describe_restart
from x1_common.termination import STILL_BILLING
from x1_launch import cloud, lifecycle, remote, verify
from x1_launch.remote import STACKS, Layout
from x1_launch.ssh import Remote, SSHError
from x1_launch.state import InstanceRecord, StateDir, StateError, utc_now
from x1_pretrain.config import ConfigError, RunConfig
from x1_pretrain.run.launch_check import LaunchCheck, launch_check
from x1_pretrain.run.plan import main as plan_main
from x1_pretrain.stack import services
from x1_pretrain.stack.services import DEFAULTS, Settings, SettingsError, read_env_file
from x1_pretrain.stack.status import describe_decision
from x1_pretrain.train import parser as train_parser

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
    if env_file is None:
        return {}
    try:
        return read_env_file(env_file)
    except SettingsError as e:
        raise UsageError(str(e)) from None


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


def trainer_config(values: dict[str, str], repo: Path) -> RunConfig:
    """The trainer's config as the stack would start it from this .env: compose's trainer command
    (services.trainer: TOTAL_STEPS, BUDGET_CAP_USD, MAX_PRICE_USD_PER_HR, ...) and TRAIN_EXTRA_ARGS,
    read by the trainer's own argument parser, so the check below judges what the instance would run."""
    settings = Settings(values)
    svc = services.trainer(settings, services.COMPOSE)
    config = Path(settings["X1_CONFIG"])
    argv = [f"--config={config if config.is_absolute() else repo / config}" if a.startswith("--config=") else a
            for a in svc.argv[1:]] + svc.env["X1_TRAIN_EXTRA_ARGS"].split()
    parser = train_parser.build_parser()

    def refuse(message: str) -> None:
        raise UsageError(f"the trainer would refuse this .env's command line (exit 2): {message}")

    parser.error = refuse  # type: ignore[method-assign,assignment]
    try:
        return train_parser.config_from_args(parser.parse_args(argv))
    except ConfigError as e:
        raise UsageError(f"the trainer would refuse this .env (exit 2): {e}") from None


@dataclass(frozen=True)
class StillBilling:
    """An instance recorded here that the provider does not show ended (or could not be asked about)."""

    rec: InstanceRecord
    state: str  # what the provider said, in words
    rate: float
    spent: float  # estimated: the recorded price since the record was written

    def line(self, hours: float) -> str:
        return (f"{PROVIDER_DISPLAY[self.rec.provider]} instance {self.rec.label} ({self.rec.name or 'no name'}, "
                f"{self.state}): ~${self.spent:.2f} so far at ${self.rate:.2f}/h, ${self.rate * hours:.2f} more over "
                f"these {hours:.1f} h unless ended")


def still_billing(state: StateDir, con: Console, http_timeout: float) -> list[StillBilling]:
    """The instances recorded here and not confirmed ended, each asked at its provider first: one the
    provider shows ended is recorded so and left out; one it cannot be asked about stays in."""
    out = []
    for rec in state.open_records():
        words = "not asked"
        try:
            client = client_for(rec.provider, rec.api_url, http_timeout)
            if not rec.instance_id:
                found = lifecycle.find_by_name(client, state, rec, settle_s=0.0)
                if found.outcome == "absent":
                    rec.set_phase("not-created")
                    rec.observe("not-listed", None, found.detail)
                    state.save(rec)
                    continue
                words = found.detail
            if rec.instance_id:
                obs = lifecycle.look(client, state, rec)
                if obs.ended:
                    continue
                words = (f"the provider lists it {obs.record.get('raw_status')}" if obs.state == "billing"
                         else f"the provider could not be read: {obs.record.get('error')}")
        except UsageError as e:
            words = f"not asked: {e}"
        except ProviderError as e:
            words = f"not asked: {e}"
        rate = rec.price_usd_per_hr or 0.0
        since = _hours_since(rec.launched_utc)
        out.append(StillBilling(rec, words, rate, rate * since))
    return out


def _hours_since(utc: str) -> float:
    try:
        t = time.mktime(time.strptime(utc, "%Y-%m-%dT%H:%M:%SZ")) - time.timezone
    except (ValueError, OverflowError):
        return 0.0
    return max(0.0, (time.time() - t) / 3600.0)


def launch_sentence(provider: str, market: str, offer: GpuOffer, price: float, check: LaunchCheck, cap: float,
                    others: list[StillBilling], why_type: str, alongside: bool = False) -> tuple[str, bool]:
    """The pre-launch sentence, from the trainer's own launch check (the .env's steps at plan's
    speed for this GPU, the price read now), with what earlier launches still bill. And whether the
    money allows the launch (the trainer's check and the cap)."""
    hours = check.hours or 0.0
    cost = check.cost_usd or 0.0
    memory = "" if "gb" in offer.gpu_description.lower() else (
        f", {offer.memory_gb:g} GB" if offer.memory_gb else ", memory not stated")
    text = (f"This will launch 1× {offer.gpu_description} [{offer.name}{memory}] {market} on "
            f"{PROVIDER_DISPLAY[provider]} at ${price:.2f}/h, run ~{hours:.1f} h including setup = ${cost:.2f} "
            f"({check.total_steps:,} steps of .env's TOTAL_STEPS at plan's {check.tokens_per_sec or 0:,.0f} tokens/s).")
    if why_type:
        text += f" {why_type}."
    extra = sum(o.spent + o.rate * hours for o in others)
    for o in others:
        text += f" Still billing: {o.line(hours)}."
    total = cost + extra
    text += f" Budget: ${cap:g}."
    if not check.ok:
        head = check.reason.split("; --total-steps")[0].split(". spent ")[0].removesuffix(": launch refused")
        fits = f"; {check.fits_steps:,} steps fit" if check.fits_steps else ""
        return text + f" Refused by the trainer's launch check: {head}{fits}.", False
    if total > cap:
        return text + f" Over the budget by ${total - cap:.2f}: not launched.", False
    if others and not alongside:
        return text + (f" Refused while {'it bills' if len(others) == 1 else 'they bill'} (below); with it counted, "
                       f"${cap - total:.2f} would be left."), False
    return text + f" Confirmed acceptable, ${cap - total:.2f} buffer.", True


def fix_command(args: argparse.Namespace, values: dict[str, str], gpu: str | None, market: str, price: float,
                cap: float) -> str:
    """The plan that fits, written into the .env: what makes the trainer's check pass."""
    words = ["x1", "plan", "--config", setting(values, "X1_CONFIG"), "--gpu", gpu or "a100-80gb", "--provider",
             args.provider]
    if args.provider == "runpod":
        words += ["--market", market]
    words += ["--price-usd-per-hr", f"{price:g}", "--budget-usd", f"{cap:g}", "--write-env", str(args.env_file)]
    return shlex.join(words)


def unique_name(state: StateDir) -> str:
    """x1-<UTC time>: the name the instance gets at the provider, and its record's until it has an id."""
    name = f"x1-{time.strftime('%Y%m%d-%H%M%S', time.gmtime())}"
    taken = {r.name for r in state.records()}
    n, candidate = 2, name
    while candidate in taken or state.record_path(candidate).exists():
        candidate, n = f"{name}-{n}", n + 1
    return candidate


ENV_FILE_MISSING = ("x1 launch needs your .env (--env-file .env): the run's steps, budget and price ceiling come "
                    "from it, and the trainer on the instance reads it. Make one:\n"
                    "  cp .env.example .env && chmod 600 .env\n"
                    "  x1 plan --config configs/x1-50m-a100.yaml --gpu a100-80gb --provider {provider} "
                    "--price-usd-per-hr PRICE --write-env .env\n"
                    "then: x1 launch --provider {provider} --env-file .env ...")


def cmd_launch(args: argparse.Namespace) -> int:
    # A `kill` or a closed terminal says what it leaves, as Ctrl-C does.
    previous = {s: signal.signal(s, lifecycle.raise_interrupted) for s in (signal.SIGTERM, signal.SIGHUP)}
    try:
        return launch(args)
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


def launch(args: argparse.Namespace) -> int:
    con = Console()
    state = StateDir.choose(args.state_dir)
    if args.env_file is None:
        raise UsageError(ENV_FILE_MISSING.format(provider=args.provider))
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
    market = args.market or cloud.MARKETS[args.provider][0]
    if market not in cloud.MARKETS[args.provider]:
        raise UsageError(f"--market {market}: {PROVIDER_DISPLAY[args.provider]} sells "
                         f"{' or '.join(cloud.MARKETS[args.provider])} instances")
    ceiling = args.max_price_usd_per_hr if args.max_price_usd_per_hr is not None else positive(values, "MAX_PRICE_USD_PER_HR")
    cap = positive(values, "BUDGET_CAP_USD")
    cfg = trainer_config(values, repo)
    client = client_for(args.provider, args.api_url, args.http_timeout)
    key = api_key_from_env(args.provider)

    # 0. what earlier launches recorded here still bill
    others = still_billing(state, con, args.http_timeout)

    # 1. the GPU as the provider describes it, and its price against the ceiling (the price rule)
    why_type = ""
    listing: dict[str, GpuOffer] = {}
    try:
        listing = cloud.offers(client, market)
        instance_type = args.instance_type or cloud.DEFAULT_TYPE[args.provider]
        if instance_type is None:
            instance_type, why_type = cloud.preferred_lambda_type(listing)
    except ValueError as e:
        raise UsageError(str(e)) from None
    except ProviderError as e:
        if e.kind == "auth":
            raise
        instance_type = args.instance_type or cloud.DEFAULT_TYPE[args.provider] or "gpu_1x_a100_sxm4"
    con.say(f"launch 1/7: the price of {instance_type} ({market}) on {PROVIDER_DISPLAY[args.provider]} "
            f"(ceiling ${ceiling:.2f}/h)")
    seen: list[GpuOffer] = []
    first = [listing] if listing else []  # the listing just read is the first price check's

    def read_price() -> float:
        try:
            now = first.pop() if first else cloud.offers(client, market)
        except ProviderError as e:
            if e.kind == "auth":  # no waiting helps a refused key
                raise KeyRefused(e) from None
            raise
        if instance_type not in now:
            raise ValueError(f"--instance-type: {instance_type!r} is not offered (offered: {', '.join(sorted(now))})")
        seen.append(now[instance_type])
        return seen[-1].price_usd_per_hr

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
    offer, price = seen[-1], seen[-1].price_usd_per_hr

    # 2. the trainer's own launch check, here, before any money: the .env's steps at plan's speed
    gpu = cloud.plan_gpu_key(offer)
    check = launch_check(cfg, gpu=gpu, price_usd_per_hr=price, setup_hours=args.setup_hours, provider=args.provider)
    text, acceptable = launch_sentence(args.provider, market, offer, price, check, cap, others, why_type,
                                       args.alongside_running)
    print(text, flush=True)
    if not check.ok:
        fits = f" (or set TOTAL_STEPS={check.fits_steps} in {args.env_file})" if check.fits_steps else ""
        numbers = check.reason.split(". spent ", 1)
        print(f"The trainer on the instance would refuse this run (exit {check.exit_code})"
              + (f": spent {numbers[1]}" if len(numbers) == 2 else f": {check.reason}") + "\n"
              f"not launched: nothing was rented. Plan what fits and write it into the .env:\n"
              f"  {fix_command(args, values, gpu, market, price, cap)}{fits}", flush=True)
        return int(ExitCode.LAUNCH_REFUSED)
    if others and not args.alongside_running:
        names = ", ".join(o.rec.label for o in others)
        ends = "; ".join(f"`{x1_command(args, 'down', '--instance', o.rec.key)}`" for o in others)
        print(f"Refused: {len(others)} instance(s) recorded in {state.root} may still bill: {names}. End "
              f"{'it' if len(others) == 1 else 'them'} with {ends}, or launch beside "
              f"{'it' if len(others) == 1 else 'them'} with --alongside-running (the spend counts against the same "
              "budget).\nnot launched: nothing was rented", flush=True)
        return int(ExitCode.LAUNCH_REFUSED)
    if not acceptable:
        con.say("not launched: nothing was rented")
        return int(ExitCode.LAUNCH_REFUSED)
    if not confirm(args):
        con.say("not launched: nothing was rented")
        return 1

    # 3. the instance, on record before the create call; its id from the answer or by its name
    name = unique_name(state)
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
        launched_utc=utc_now(), name=name, phase="creating", stage="creating", market=market,
        gpu_description=offer.gpu_description)
    if rec.provider == "runpod" and layout_of(rec).boot_script != cloud.BOOT_SCRIPT:
        raise UsageError(f"--remote-dir {rec.remote_repo}: on RunPod it must be a folder directly in /workspace (the "
                         f"pod's start command runs {cloud.BOOT_SCRIPT} at every resume)")
    state.save(rec, make_current=True)
    con.say(f"launch 2/7: renting it ({name}); on record before the create call: {state.record_path(name)}")
    request = cloud.LaunchRequest(
        provider=args.provider, instance_type=instance_type, region=rec.region, name=name,
        ssh_key_name=args.ssh_key_name, public_key=public_key, image=args.image, volume_gb=args.volume_gb,
        market=market, price_usd_per_hr=price)
    with lifecycle.signals_held() as caught:  # Ctrl-C, SIGTERM, SIGHUP: after the answer is on disk
        outcome = create(args, con, client, state, rec, request, caught)
    if caught:
        return interrupted(args, state, rec, caught[0])
    if outcome is not None:
        return outcome
    try:
        con.say(f"  instance {rec.instance_id}: billing from now; recorded in {state.record_path(rec.instance_id)}")
        return launch_rest(args, con, state, rec, client, values, key, repo)
    except KeyboardInterrupt:
        return interrupted(args, state, rec, signal.SIGINT)
    except lifecycle.Interrupted as e:
        return interrupted(args, state, rec, e.signum)
    except (ProviderError, SSHError, subprocess.TimeoutExpired) as e:
        print(f"error: {explain(e, rec.provider) if isinstance(e, ProviderError) else e}\n"
              f"instance {rec.instance_id} is still running and billing (recorded at stage {rec.stage}); look with "
              f"`{x1_command(args, 'logs', 'boot')}`, end it with "
              f"`{x1_command(args, 'down', '--no-fetch', '--instance', rec.instance_id)}`", file=sys.stderr, flush=True)
        return 1


def create(args: argparse.Namespace, con: Console, client: LambdaClient | RunPodClient, state: StateDir,
           rec: InstanceRecord, request: cloud.LaunchRequest, caught: list[int]) -> int | None:
    """The create call; after an answer that does not say (lost, late, not the API's, cut short),
    the instance is looked up by its name until the provider says whether it exists. None when
    the record has its id; else the exit code, the message printed."""
    try:
        rec.instance_id = cloud.launch(client, request)
    except ValueError as e:
        rec.set_phase("not-created")
        state.save(rec)
        raise UsageError(str(e)) from None
    except ProviderError as e:
        refused = not e.unclear and e.api_error is not None
        if e.kind == "auth" or refused:
            # The API's own refusal (in its error shape): nothing was created. One look by the name all the same.
            try:
                found = lifecycle.find_by_name(client, state, rec, settle_s=0.0)
            except ProviderError:
                found = lifecycle.Found("absent", "not listed")
            if found.outcome != "found":
                rec.set_phase("not-created")
                rec.observe("refused", None, f"the create was refused: {e}")
                state.save(rec)
                print(f"error: {explain(e, rec.provider)}\nthe provider refused the create: nothing was rented "
                      f"(recorded as not created in {state.record_path(rec.key)})", file=sys.stderr, flush=True)
                return int(ExitCode.USAGE) if e.kind == "auth" else 1
        else:
            con.say(f"  the create's answer was lost ({e}): asking {PROVIDER_DISPLAY[rec.provider]} for {rec.name}")
            found = lifecycle.find_by_name(client, state, rec, settle_s=args.create_settle_seconds,
                                           give_up=lambda: bool(caught), say=con.say)
        if found.outcome == "found":
            con.say(f"  found it: {found.detail}")
        elif found.outcome == "absent":
            rec.set_phase("not-created")
            rec.observe("not-listed", None, found.detail)
            state.save(rec)
            if caught:
                return None
            print(f"error: the create's answer was lost ({e}), and {found.detail}: nothing appears to be rented. "
                  f"Recorded as not created in {state.record_path(rec.key)}; should one appear later, "
                  f"`{x1_command(args, 'status', '--provider', rec.provider)}` lists it and "
                  f"`{x1_command(args, 'down', '--provider', rec.provider, '--instance', 'ID')}` ends it",
                  file=sys.stderr, flush=True)
            return 1
        else:
            rec.observe("unread", None, found.detail)
            state.save(rec)
            if caught:
                return None
            print(f"error: the create's answer was lost ({e}), and {found.detail}: an instance named {rec.name} MAY "
                  f"exist and bill. It is on record in {state.record_path(rec.key)}: "
                  f"`{x1_command(args, 'status')}` asks again, `{x1_command(args, 'down')}` finds it by its name and "
                  "ends it", file=sys.stderr, flush=True)
            return 1
    if rec.phase == "creating":
        rec.set_phase("created")
        rec.stage = "launched"
        rec.observe("created", None, "the provider's answer to the create")
    state.save(rec, make_current=True)
    return None


def interrupted(args: argparse.Namespace, state: StateDir, rec: InstanceRecord, signum: int) -> int:
    """What a signal leaves, said with the command that ends it; exit 128 + the signal."""
    sig = signal.Signals(signum).name
    if rec.instance_id:
        print(f"\ninterrupted ({sig}) at stage {rec.stage}: {PROVIDER_DISPLAY[rec.provider]} instance "
              f"{rec.instance_id} is running and billing. It is recorded in {state.record_path(rec.instance_id)}; "
              f"end it with:\n  {x1_command(args, 'down', '--no-fetch', '--instance', rec.instance_id)}",
              file=sys.stderr, flush=True)
    elif rec.phase == "not-created":
        print(f"\ninterrupted ({sig}): {PROVIDER_DISPLAY[rec.provider]} lists no instance named {rec.name}: nothing "
              f"was rented (recorded as not created in {state.record_path(rec.key)})", file=sys.stderr, flush=True)
    else:
        print(f"\ninterrupted ({sig}) before the provider's answer was known: an instance named {rec.name} MAY exist "
              f"and bill. It is on record in {state.record_path(rec.key)}; `{x1_command(args, 'down')}` finds it by "
              f"its name and ends it", file=sys.stderr, flush=True)
    return 128 + signum


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
    remote.put_boot_script(r, layout, (values.get("TORCH_VERSION") or remote.TORCH_PIN[0],
                                       values.get("TORCH_CUDA") or remote.TORCH_PIN[1]))
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
        seen = rec.observed or {}
        now = {"terminated": f"terminated: {seen.get('how')} ({seen.get('time')})",
               "not-created": f"not created: {seen.get('how')}"}.get(rec.phase, "state unknown")
        lines.append(f"instance  {PROVIDER_DISPLAY[rec.provider]} {rec.label}: {now}")
    if rec.phase == "terminate-sent":
        lines.append(f"          {STILL_BILLING}: a terminate was sent at {', '.join(rec.terminate_sent_utc[-3:])}; "
                     "`x1 down` sends it again and waits for the provider to show it terminated")
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
    if args.provider:
        return status_of_account(args, state)
    rec = state.load(args.instance)
    client = client_for(rec.provider, rec.api_url, args.http_timeout)
    inst, st, problem = None, None, None
    try:
        if not rec.instance_id and rec.open:
            # Launched and never answered (a lost answer, a killed launch): the provider, by its name.
            found = lifecycle.find_by_name(client, state, rec, settle_s=_settle_left(args, rec))
            if found.outcome == "absent":
                rec.set_phase("not-created")
                rec.observe("not-listed", None, found.detail)
                state.save(rec)
            elif found.outcome == "unknown":
                problem = f"{found.detail}; an instance named {rec.name} MAY exist and bill"
        if rec.instance_id:
            obs = lifecycle.look(client, state, rec)  # the provider's word, never the record's
            inst = obs.instance if obs.state == "billing" else None
            if obs.state == "unread":
                problem = f"the provider did not answer: {obs.record.get('error')}"
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
    others = [r for r in state.open_records() if r.key != rec.key]
    if args.json:
        print(json.dumps({"instance": None if inst is None else {"status": inst.status, "raw_status": inst.raw_status,
                                                                 "price_usd_per_hr": inst.price_usd_per_hr},
                          "record": asdict(rec), "stack": st, "problem": problem,
                          "other_open_records": [asdict(r) for r in others],
                          "offhost_events": read_jsonl(state.folder(rec.instance_id) / "watchdog-events.jsonl")
                          if rec.instance_id else []},
                         indent=2, default=str))
    else:
        print(render_status(rec, inst, st, state, problem))
        for other in others:
            print(f"also      {PROVIDER_DISPLAY[other.provider]} {other.label} ({other.name or 'no name'}): recorded "
                  f"{other.phase}, not confirmed ended: `{x1_command(args, 'status', '--instance', other.key)}`")
    return 0 if st is not None else 1


def _settle_left(args: argparse.Namespace, rec: InstanceRecord) -> float:
    """How long a listing without the name must be watched before "not created": the launch's own
    settle time, counted from the record's creation (0 for an old record)."""
    return max(0.0, getattr(args, "create_settle_seconds", 60.0) - _hours_since(rec.launched_utc) * 3600.0)


def status_of_account(args: argparse.Namespace, state: StateDir) -> int:
    """Every instance the account runs that x1 named (x1-...), with or without a record here."""
    client = client_for(args.provider, args.api_url, args.http_timeout)
    listed = [i for i in client.list_instances() if str(i.raw.get("name") or "").startswith("x1-")]
    records = state.records()
    by_id = {r.instance_id: r for r in records if r.instance_id}
    by_name = {r.name: r for r in records if r.name and not r.instance_id}
    print(f"{PROVIDER_DISPLAY[args.provider]} instances named by x1 (x1-*), as the API lists them now: {len(listed)}")
    unrecorded = 0
    for inst in listed:
        name = inst.raw.get("name")
        rec = by_id.get(inst.id) or by_name.get(name) or next((r for r in records if r.name == name and
                                                                 r.phase == "not-created"), None)
        if rec is not None and rec.instance_id != inst.id:
            lifecycle.adopt(state, rec, inst, how=f"listed under its name {name} by `x1 status --provider`")
        price = f"${inst.price_usd_per_hr:.2f}/h" if inst.price_usd_per_hr is not None else "price not shown"
        where = (f"recorded in {state.record_path(rec.key)} ({rec.phase})" if rec is not None else
                 f"NO RECORD HERE: end it with `{x1_command(args, 'down', '--provider', args.provider, '--instance', inst.id)}`")
        unrecorded += rec is None
        print(f"  {inst.id}  {name}  {inst.raw_status} ({inst.status})  {inst.instance_type or '?'}  {price}  {where}")
    return 0 if not unrecorded else 1


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


NOTHING_TO_FETCH_STAGES = ("creating", "launched", "booting", "ssh", "upload")


def down_record(args: argparse.Namespace, state: StateDir) -> InstanceRecord:
    """The record `down` ends: the named or current one; with --provider, the instance the account
    runs whether or not it is recorded here (a record is made for it)."""
    if not args.provider:
        return state.load(args.instance)
    if not args.instance:
        raise UsageError(f"--provider needs --instance ID: "
                         f"`{x1_command(args, 'status', '--provider', args.provider)}` lists the instances x1 named")
    for rec in state.records():
        if rec.provider == args.provider and args.instance in (rec.instance_id, rec.name):
            return rec
    rec = InstanceRecord(provider=args.provider, instance_id=args.instance, api_url=args.api_url, instance_type="?",
                         region=None, price_usd_per_hr=None, stack="processes", ssh_user="root", ssh_key="",
                         remote_repo="", workspace="", stage="down", launched_utc=utc_now(), phase="created",
                         notes=["no record here before: ended with `x1 down --provider --instance`"])
    return rec


def cmd_down(args: argparse.Namespace) -> int:
    con = Console()
    state = StateDir.choose(args.state_dir)
    rec = down_record(args, state)
    client = client_for(rec.provider, rec.api_url, args.http_timeout)
    if not rec.instance_id:
        # A launch that never learnt the id (its answer lost, or killed mid-create): by the name.
        found = lifecycle.find_by_name(client, state, rec, settle_s=_settle_left(args, rec))
        if found.outcome == "absent":
            rec.set_phase("not-created")
            rec.observe("not-listed", None, found.detail)
            state.save(rec)
            con.say(f"{found.detail}: nothing of that launch bills; recorded as not created")
            return 0
        if found.outcome == "unknown":
            print(f"error: {found.detail}: an instance named {rec.name} MAY exist and bill; nothing was sent. "
                  f"Try again: {x1_command(args, 'down')}", file=sys.stderr)
            return 1
        con.say(f"found {rec.name}: {found.detail}; recorded as instance {rec.instance_id}")
    elif args.provider and not state.record_path(rec.key).exists():
        state.save(rec)  # the end of an instance found at the provider is on record too

    obs = lifecycle.look(client, state, rec)
    if obs.state == "unread":
        print(f"error: {PROVIDER_DISPLAY[rec.provider]} instance {rec.instance_id} could not be read "
              f"({obs.record.get('error')}): nothing was sent, and it may still bill. Try again: "
              f"{x1_command(args, 'down', *(['--instance', rec.key] if args.instance else []))}", file=sys.stderr)
        return 1
    if obs.ended:
        # Ended elsewhere (its own watchdog's --terminate-on-finish, the dashboard, an earlier down).
        stop_watchdog(rec)
        rec.stage = "down"
        state.save(rec)
        con.say(f"instance {rec.instance_id} is terminated: {rec.observed.get('how') if rec.observed else ''} "
                f"({obs.record.get('raw_status')}); recorded, nothing to do")
        return 0
    inst = obs.instance
    assert inst is not None
    con.say(f"down: {PROVIDER_DISPLAY[rec.provider]} instance {rec.instance_id} is {inst.status} ({inst.raw_status})"
            + ("; a terminate was sent earlier and it still bills" if rec.terminate_sent_utc else ""))
    if stop_watchdog(rec):
        con.say("  the off-host watchdog stopped (it would bring the instance back)")
        state.save(rec)
    target = None
    started = rec.stage not in NOTHING_TO_FETCH_STAGES and rec.host is not None
    if args.provider and not rec.host:
        con.say("  no launch of this laptop started anything on it: terminating without a fetch")
    elif not started:
        con.say(f"  nothing was started on it (stage {rec.stage}): no run folder to fetch")
    elif rec.phase == "terminate-sent" and rec.fetched_to and Path(rec.fetched_to).is_dir():
        target = Path(rec.fetched_to)
        con.say(f"  its run folder was fetched to {target} before the first terminate")
    elif inst.status == "running" and not args.no_fetch:
        r = remote_for(state, rec)
        try:
            said = remote.stop_stack(r, layout_of(rec))
            con.say("  stack stopped: " + " / ".join(said.splitlines()[-3:]))
        except (SSHError, subprocess.TimeoutExpired) as e:
            print(f"error: could not stop the stack: {e}\nnothing terminated: instance {rec.instance_id} still bills; "
                  f"--no-fetch terminates without the copy: {x1_command(args, 'down', '--no-fetch')}", file=sys.stderr)
            return 1
        try:
            target = fetch(r, rec, args.output or default_output(rec), con)
        except (SSHError, subprocess.TimeoutExpired, OSError) as e:
            print(f"error: the fetch failed, so instance {rec.instance_id} is NOT terminated and still bills: {e}\n"
                  f"try again, or end it without the copy: {x1_command(args, 'down', '--no-fetch')}",
                  file=sys.stderr)
            return 1
        rec.fetched_to = str(target)
        state.save(rec)
    elif not args.no_fetch:
        print(f"error: instance {rec.instance_id} is {inst.status}: its run folder cannot be fetched now, so it is NOT "
              f"terminated and still bills. Bring it back and run `x1 down` again, or end it without the copy: "
              f"{x1_command(args, 'down', '--no-fetch')}", file=sys.stderr)
        return 1
    elif inst.status == "running" and rec.host is not None:
        with contextlib.suppress(SSHError, subprocess.TimeoutExpired):
            remote.stop_stack(remote_for(state, rec), layout_of(rec))

    ending = lifecycle.end(client, state, rec, within_s=args.confirm_timeout, say=con.say)
    if not ending.confirmed:
        print(f"error: terminate sent to {PROVIDER_DISPLAY[rec.provider]} {len(ending.calls)} time(s) over "
              f"{ending.seconds:.0f} s, but {ending.how}: instance {rec.instance_id} is STILL BILLING "
              f"({STILL_BILLING}). Recorded in {state.record_path(rec.key)}. End it with: "
              f"{x1_command(args, 'down', '--no-fetch', '--instance', rec.instance_id)} "
              f"(or in {PROVIDER_DISPLAY[rec.provider]}'s dashboard)", file=sys.stderr, flush=True)
        return 1
    rec.stage = "down"
    state.save(rec)
    con.say(f"  instance {rec.instance_id} terminated: {ending.how}; recorded")
    if target is not None:
        check = verify.add_termination(target, ending.record(reason="x1 down"))
        con.say(f"  termination.json written into {target}; {check}")
        result = verify.verify_run(target, band=args.band, termination_pending=False)
        print(result.text, flush=True)
        if not result.ok:
            return 1
    return 0


# ---------------------------------------------------------------------------------------------
# x1 plan


def cmd_plan(args: argparse.Namespace) -> int:
    return int(plan_main(args.plan_args) or 0)


# ---------------------------------------------------------------------------------------------
# x1 ladder: the scaling ladder on the instance, from here (this machine has neither torch nor SciPy)

LADDER_HELP = """x1 ladder [--instance ID] [--state-dir DIR] COMMAND [ARGS]

The scaling ladder of the run on the instance (python -m x1_pretrain.ladder there, over SSH). With
LADDER=1 in .env the stack runs it by itself after the data is prepared and before the main run,
under the same watchdog and budget; these follow and use it:

  x1 ladder status             rungs done, ETA and dollars, as the ladder's own progress line
  x1 ladder report             ladder.md (and ladder.png there) from the fitted law
  x1 ladder predict --params N --tokens D     the law's val loss and interval, one JSON line
  x1 ladder fetch [--output DIR]              the ladder's folder copied here (default x1-runs/<instance>/ladder)
  x1 ladder plan|run|fit ...   the ladder's own commands, run there (python -m x1_pretrain.ladder --help)

The ladder's folder there is the workspace's ladder/; --dir and --ladder default to it.
"""


def cmd_ladder(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="x1 ladder", usage=LADDER_HELP, add_help=False)
    p.add_argument("--instance")
    p.add_argument("--state-dir", type=Path)
    p.add_argument("--output", type=Path)
    p.add_argument("-h", "--help", action="store_true")
    args, rest = p.parse_known_args(argv)
    if args.help or not rest:
        print(LADDER_HELP)
        return 0 if args.help else int(ExitCode.USAGE)
    state = StateDir.choose(args.state_dir)
    rec = state.load(args.instance)
    r = remote_for(state, rec)
    layout = layout_of(rec)
    folder = f"{rec.workspace.rstrip('/')}/ladder"
    command, rest = rest[0], rest[1:]
    if command == "fetch":
        output = (args.output or default_output(rec) / "ladder").resolve()
        output.parent.mkdir(parents=True, exist_ok=True)
        r.get_dir(rec.workspace, "ladder", output.parent)
        print(f"fetched {folder} to {output.parent / 'ladder'}")
        return 0
    defaults: list[str] = []
    if command in ("status", "run", "step") and "--dir" not in rest:
        defaults = ["--dir", folder]
    elif command in ("predict", "report") and "--ladder" not in rest:
        defaults = ["--ladder", f"{folder}/ladder.json"]
    elif command == "plan" and "--out" not in rest:
        defaults = ["--out", folder]
    words = " ".join(shlex.quote(w) for w in [command, *defaults, *rest])
    try:
        return subprocess.call([*r.argv(), layout.python(f"x1_pretrain.ladder {words}")])
    except KeyboardInterrupt:
        return 130


# ---------------------------------------------------------------------------------------------


DESCRIPTION = """\
From a laptop to a terminated instance and a run folder on disk, for the X1 run on one rented GPU:

  x1 plan      today's plan: what the budget buys (python -m x1_pretrain.plan; --help there)
  x1 launch    the trainer's own launch check on your .env (its steps at plan's speed, the price
               read now, the cap), the pre-launch sentence, your confirmation, the instance
               (Lambda or RunPod API; on record here before it is created), the repository and
               .env on it over SSH, the stack started and watched until the first step, and the
               off-host watchdog started here
  x1 status    one screen: instance (as the provider shows it now), step/total, ETA, tokens/s,
               spend vs cap, restarts, watchdog; --provider P: every instance x1 named on the account
  x1 logs      a service's log (-f to follow)
  x1 fetch     the run folder copied here and verified (dod's checks, final.safetensors' sha256)
  x1 down      the stack stopped, the run folder fetched, the instance terminated and read back
               until the provider shows it terminated, kept as termination.json in the fetched
               folder (check 6); --provider P --instance ID: an instance with no record here
  x1 ladder    the run's scaling ladder on the instance: status, report, predict, fetch (x1 ladder --help)

The API key comes from LAMBDA_API_KEY or RUNPOD_API_KEY and is never printed nor logged. Local
records: ~/.x1 (--state-dir, X1_STATE_DIR); a launch writes its record before the create call, so
`x1 status` and `x1 down` find what it created even after it was killed. Exit codes: 0 done; 1
failed (the message says what, and names any instance left billing by its full id); 2 bad input;
78 launch refused (price, the trainer's launch check, the budget, or an earlier instance still
billing); 128+N after signal N (130 Ctrl-C, 143 SIGTERM, 129 SIGHUP: what is left running and the
command that ends it are printed).
"""


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="x1", description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True, metavar="{plan,launch,status,logs,fetch,down,ladder}")

    def common(sp: argparse.ArgumentParser, instance: bool = True) -> None:
        sp.add_argument("--state-dir", type=Path, help="where x1 keeps its records (default ~/.x1, or $X1_STATE_DIR)")
        if instance:
            sp.add_argument("--instance", help="the instance id, or the name x1 gave it (default: the one launched last)")

    def api(sp: argparse.ArgumentParser, account: str | None) -> None:
        sp.add_argument("--http-timeout", type=float, default=15.0, help="seconds one provider API request may take")
        if account:
            sp.add_argument("--provider", choices=PROVIDERS, help=account)
            sp.add_argument("--api-url", help="with --provider: its base URL (default: the real API)")

    sub.add_parser("plan", help="today's plan: python -m x1_pretrain.plan's options (x1 plan --help)", add_help=False)
    sub.add_parser("ladder", help="the run's scaling ladder on the instance (x1 ladder --help)", add_help=False)

    sp = sub.add_parser("launch", help="rent the instance and start the run on it",
                        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    common(sp, instance=False)
    sp.add_argument("--provider", choices=PROVIDERS, required=True)
    sp.add_argument("--env-file", type=Path, help="your .env (budget, steps, config; cp .env.example .env); the "
                    "instance gets it with its provider, id and API key added")
    sp.add_argument("--ssh-key", type=Path, required=True, help="your SSH private key (RunPod: KEY.pub is authorized)")
    sp.add_argument("--ssh-key-name", help="Lambda: the name of that key in Lambda's dashboard")
    sp.add_argument("--instance-type", help="Lambda instance type or RunPod GPU type id (default: RunPod's A100 80GB; "
                    "Lambda's single A100, the 40 GB card where it offers no single 80 GB one)")
    sp.add_argument("--market", choices=("interruptible", "on-demand"),
                    help="RunPod: interruptible (the default, as `x1 plan` plans it; the off-host watchdog resumes "
                         "it after an interruption) or on-demand; Lambda sells on-demand only")
    sp.add_argument("--region", help="Lambda region (default us-east-1)")
    sp.add_argument("--image", default=cloud.DEFAULT_RUNPOD_IMAGE, help="RunPod: the pod's image")
    sp.add_argument("--volume-gb", type=int, default=100, help="RunPod: the /workspace volume's size")
    sp.add_argument("--max-price-usd-per-hr", type=float, help="the price ceiling (default: MAX_PRICE_USD_PER_HR of .env, 1.40)")
    sp.add_argument("--setup-hours", type=float, default=0.75,
                    help="hours billed before the trainer's first step (image, data, compile), as `x1 plan` counts them")
    sp.add_argument("--alongside-running", action="store_true",
                    help="launch although an instance recorded here may still bill (its spend counts in the sentence)")
    sp.add_argument("--create-settle-seconds", type=float, default=60.0,
                    help="after a lost answer to the create: how long the provider's listing must show no instance of "
                         "the launch's name before it counts as not created")
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
    api(sp, None)

    sp = sub.add_parser("status", help="one screen: instance, progress, spend, restarts, watchdog")
    common(sp)
    sp.add_argument("--json", action="store_true", help="the same as JSON")
    api(sp, "list every instance of this provider's account that x1 named (x1-...), recorded here or not")
    sp.set_defaults(create_settle_seconds=60.0)

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
                            help="seconds to read the instance back (and send the terminate again) until the "
                                 "provider shows it terminated; after that it is reported still billing (exit 1)")
            api(sp, "end the instance --instance of this provider's account, recorded here or not")
            sp.set_defaults(create_settle_seconds=60.0)
    return p


COMMANDS: dict[str, Callable[[argparse.Namespace], int]] = {
    "plan": cmd_plan, "launch": cmd_launch, "status": cmd_status, "logs": cmd_logs, "fetch": cmd_fetch,
    "down": cmd_down,
}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["plan"]:  # every option after `plan` is the plan's own (its --help included)
        return cmd_plan(argparse.Namespace(plan_args=argv[1:]))
    if argv[:1] == ["ladder"]:  # the ladder's own commands, run on the instance
        try:
            return cmd_ladder(argv[1:])
        except (UsageError, StateError) as e:
            print(f"error: {e}", file=sys.stderr)
            return int(ExitCode.USAGE)
        except (SSHError, subprocess.TimeoutExpired) as e:
            print(f"error: {e}", file=sys.stderr)
            return 1
    parser = build_parser()
    args = parser.parse_args(argv)
    for name in ("max_price_usd_per_hr", "every_minutes", "boot_timeout", "start_timeout", "watchdog_poll_seconds",
                 "confirm_timeout", "http_timeout", "create_settle_seconds", "setup_hours"):
        value = getattr(args, name, None)
        if value is not None and (not math.isfinite(value) or value < 0 or (value == 0 and name != "create_settle_seconds")):
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
        # `launch` handles an interrupt from its record on: one that reaches here came before it.
        print("\ninterrupted" + (": nothing was rented" if args.command == "launch" else ""), file=sys.stderr)
        return INTERRUPTED
    except lifecycle.Interrupted as e:
        print(f"\ninterrupted ({signal.Signals(e.signum).name})" + (": nothing was rented" if args.command == "launch"
                                                                     else ""), file=sys.stderr)
        return 128 + e.signum


if __name__ == "__main__":
    sys.exit(main())
