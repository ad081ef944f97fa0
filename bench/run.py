"""The GPU benchmarks' one driver: runs a plan of bench/plans.toml on the GPU machine.

    python3 bench/run.py PLAN [--reference PATH] [--data DIR] [--out DIR] [--variants a,b] [--dry-run]
    python3 bench/run.py --list

Run from the repo root of a checkout on the GPU machine. REFERENCE (the plain reference script,
e.g. .device/reference_50m.py), DATA (tokenized data, `bash bench/device_data.sh`) and OUT (where
the outputs go, default bench-out) come from the flags or the environment. Wheels the machine
lacks (pydantic, mlflow-skinny, ...: it has no network) are installed from .whl/ (or --wheels)
into a folder of their own first, which every command finds on PYTHONPATH with the repo's
packages. Each step's output goes to its file under OUT; OUT/commands.txt lists every command
run, with its exit code and seconds; the plan's table (OUT/table.md) is printed at the end.

--dry-run checks the plan and prints the commands it would run, and runs nothing. A plan, step
kind or variant that is not there, or a step key the kind does not take, exits 2 naming it.
Exit 0 when every step ended with the code it expects, 1 otherwise (every step still runs).
The driver itself needs only Python 3.11+ (tomllib), no package: it runs before the wheels are in.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import tomllib

REPO = Path(__file__).resolve().parents[1]
PLANS = REPO / "bench" / "plans.toml"
SITE = Path("/tmp/x1-site")  # the carried wheels, installed here
PEAK_LINE = re.compile(r"ceilings: matmul (\d+) TFLOP")  # the reference's measured matmul peak
PATHS = ("", "trainer", "budget-sidecar", "watchdog")  # the repo's packages, as the images put them

# Each step kind and the keys it takes beyond `run`, `timeout`, `gpus` and `about`.
KINDS: dict[str, set[str]] = {
    "gpu-info": set(),
    "versions": set(),
    "tests": {"files", "select", "out"},
    "reference": {"out"},
    "variants": {"names", "name", "steps", "loop", "loop_steps", "profile", "config"},
    "torchrun": {"nproc", "variant", "sets", "name", "steps"},
    "command": {"argv", "out", "expect", "fresh"},
    "copy": {"files"},
    "report": set(),
    "scaling": {"base", "runs"},
}
COMMON = {"run", "timeout", "gpus", "about"}
PLAN_KEYS = {"about", "needs", "smi", "steps", "deadline"}


class PlanError(Exception):
    """A plan that cannot run as written: exit 2."""


def load(path: Path = PLANS) -> tuple[dict[str, list[str]], dict[str, dict]]:
    try:
        data = tomllib.loads(path.read_text())
    except (OSError, tomllib.TOMLDecodeError) as e:
        raise PlanError(f"{path}: {e}") from None
    return data.get("variants", {}), data.get("plans", {})


def variant_sets(variants: dict[str, list[str]], name: str) -> list[str]:
    """A variant's overrides ('a+b': both). One not in [variants] is refused."""
    sets: list[str] = []
    for part in name.split("+"):
        if part not in variants:
            raise PlanError(f"no variant {part!r} in the plans' [variants]; there are: {', '.join(variants)}")
        sets += variants[part]
    return sets


def check_plan(name: str, plans: dict[str, dict], variants: dict[str, list[str]]) -> dict:
    """The plan named, every step's kind, keys and variants checked."""
    if name not in plans:
        raise PlanError(f"no plan {name!r} in the plans file; there are: {', '.join(plans)}")
    plan = plans[name]
    if extra := set(plan) - PLAN_KEYS:
        raise PlanError(f"plan {name!r}: unknown key(s) {sorted(extra)}; a plan takes {sorted(PLAN_KEYS)}")
    for i, step in enumerate(plan.get("steps", []), 1):
        kind = step.get("run")
        if kind not in KINDS:
            raise PlanError(f"plan {name!r}, step {i}: no step kind {kind!r}; there are: {', '.join(KINDS)}")
        if extra := set(step) - KINDS[kind] - COMMON:
            raise PlanError(f"plan {name!r}, step {i} ({kind}): unknown key(s) {sorted(extra)}; "
                            f"it takes {sorted(KINDS[kind] | COMMON)}")
        for v in step.get("names", []) + ([step["variant"]] if "variant" in step else []):
            variant_sets(variants, v)
        if kind == "command" and not step.get("argv"):
            raise PlanError(f"plan {name!r}, step {i} (command): no argv")
    return plan


class Driver:
    def __init__(self, args: argparse.Namespace, plan: dict, variants: dict[str, list[str]]):
        self.args, self.plan, self.variants = args, plan, variants
        self.out = Path(args.out)
        self.dry = args.dry_run
        self.peak: str | None = None
        self.failed: list[str] = []
        self.start = time.monotonic()
        self.env = dict(os.environ, PYTHONUNBUFFERED="1",
                        # NVLink multicast off: the device's GPUs do not offer it to NCCL
                        NCCL_NVLS_ENABLE="0", TORCH_SYMM_MEM_DISABLE_MULTICAST="1", NVSHMEM_DISABLE_NVLS="1")
        paths = [str(REPO / p) if p else str(REPO) for p in PATHS]
        wheels = self.wheels()
        if wheels:
            paths.append(str(SITE))
        self.env["PYTHONPATH"] = os.pathsep.join(paths + ([os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH") else []))
        self.wheel_dir = wheels

    def wheels(self) -> Path | None:
        if self.args.no_wheels:
            return None
        if self.args.wheels:
            return Path(self.args.wheels)
        return next((p for p in (REPO / ".whl", REPO / ".device" / "whl") if p.is_dir() and any(p.glob("*.whl"))), None)

    # -- running one command ---------------------------------------------------------------------

    def say(self, line: str) -> None:
        print(line, flush=True)

    def log(self, line: str) -> None:
        if not self.dry:
            with open(self.out / "commands.txt", "a") as f:
                f.write(line + "\n")

    def sub(self, text: str) -> str:
        return (text.replace("{python}", sys.executable).replace("{repo}", str(REPO)).replace("{out}", str(self.out))
                .replace("{data}", self.args.data or "{data}").replace("{reference}", self.args.reference or "{reference}"))

    def run(self, argv: list[str], out: str | None, step: dict, append: bool = False, expect: int = 0) -> int | None:
        """argv with stdout and stderr to OUT/out; its exit code (None in a dry run or on timeout)."""
        env_note = f"CUDA_VISIBLE_DEVICES={step['gpus']} " if "gpus" in step else ""
        timeout = step.get("timeout")
        line = f"{env_note}{shlex.join(argv)}" + (f" {'>>' if append else '>'} {self.out / out}" if out else "") + \
            (f"  # timeout {timeout} s" if timeout else "") + (f", expects exit {expect}" if expect else "")
        if self.dry:
            self.say(line)
            return None
        env = dict(self.env, **({"CUDA_VISIBLE_DEVICES": str(step["gpus"])} if "gpus" in step else {}))
        t0 = time.monotonic()
        sink = open(self.out / out, "a" if append else "w") if out else None  # noqa: SIM115 - closed below
        code: int | None = None
        try:
            proc = subprocess.Popen(argv, cwd=REPO, env=env, stdout=sink or subprocess.DEVNULL, stderr=subprocess.STDOUT,
                                    start_new_session=True)
            try:
                code = proc.wait(timeout=timeout)
                verdict = f"exit {code}"
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)  # the command and its children (torchrun's workers)
                proc.wait()
                verdict = f"timed out after {timeout} s"
        except OSError as e:  # not there to run (torchrun, nvidia-smi on a machine without them)
            verdict = f"did not start: {e}"
        finally:
            if sink:
                sink.close()
        took = time.monotonic() - t0
        self.log(f"[{time.monotonic() - self.start:6.0f} s] {line}\n    -> {verdict} in {took:.0f} s")
        self.say(f"[{time.monotonic() - self.start:4.0f} s] {verdict} ({took:.0f} s): {shlex.join(argv)[:150]}")
        if code != expect:
            self.failed.append(f"{shlex.join(argv)[:200]}: {verdict}, expected {expect}")
        return code

    def past_deadline(self) -> bool:
        deadline = self.args.deadline or self.plan.get("deadline")
        return bool(deadline) and not self.dry and time.monotonic() - self.start > deadline

    # -- the step kinds --------------------------------------------------------------------------

    def step_gpu_info(self, step: dict) -> None:
        if self.dry or shutil.which("nvidia-smi"):
            self.run(["nvidia-smi", "--query-gpu=index,name,driver_version,memory.total,clocks.max.sm", "--format=csv"],
                     "gpu.txt", step)

    def step_versions(self, step: dict) -> None:
        self.run([sys.executable, "bench/versions.py"], "versions.txt", step)

    def step_tests(self, step: dict) -> None:
        argv = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *step["files"]]
        if step.get("select"):
            argv += ["-k", step["select"]]
        self.run(argv, step.get("out", "tests.txt"), step)

    def step_reference(self, step: dict) -> None:
        out = step.get("out", "reference.txt")
        self.run([sys.executable, self.args.reference or "{reference}"], out, step)
        if not self.dry and (self.out / out).exists():
            text = (self.out / out).read_text(errors="replace")
            self.say("    " + "\n    ".join(text.strip().splitlines()[-2:]))
            m = PEAK_LINE.search(text)
            self.peak = self.peak or (m.group(1) if m else None)

    def throughput_argv(self, variant: str, step: dict) -> list[str]:
        argv = ["bench/train_throughput.py", "--variant", variant, "--data-dir", self.args.data or "{data}",
                "--steps", str(step.get("steps", 8))]
        if step.get("config"):
            argv += ["--config", step["config"]]
        if self.peak or self.dry:  # the peak the reference measured; else the script measures its own
            argv += ["--peak-tflops", self.peak or "{peak from reference.txt, if measured}"]
        return argv + ["--json", str(self.out / "ours.jsonl")]

    def step_variants(self, step: dict) -> None:
        names = self.args.variants.split(",") if self.args.variants else step["names"]
        for v in names:
            if self.past_deadline():
                self.say(f"skipped {v}: past the plan's deadline")
                self.log(f"skipped {v}: past the deadline")
                continue
            argv = [sys.executable, *self.throughput_argv(v, step)]
            argv += ["--loop-steps", str(step.get("loop_steps", 30) if v in step.get("loop", []) else 0)]
            if v in step.get("profile", []):
                argv.append("--profile")
            if step.get("name"):
                argv += ["--name", step["name"]]
            before = len(self.rows())
            self.run(argv, "variants.txt", step, append=True)
            self.show_result(before)

    def rows(self) -> list[str]:
        path = self.out / "ours.jsonl"
        return path.read_text().splitlines() if not self.dry and path.exists() else []

    def show_result(self, before: int) -> None:
        """The row the last command added to ours.jsonl, if it added one, in one line."""
        rows = self.rows()
        if len(rows) <= before:
            return
        r = json.loads(rows[-1])
        self.say(f"    {r['name']}: bare {r['bare_tokens_per_sec']} tokens/s, MFU {r['bare_mfu_measured']} of "
                 f"{r['matmul_peak_tflops']} TFLOP/s, loop {r['loop_tokens_per_sec']}, {r['peak_mem_gib']} GiB")

    def step_torchrun(self, step: dict) -> None:
        argv = ["torchrun", "--standalone", f"--nproc_per_node={step.get('nproc', 2)}",
                *self.throughput_argv(step["variant"], step), "--loop-steps", "0", "--name", step["name"]]
        for s in step.get("sets", []):
            argv += ["--set", s]
        before = len(self.rows())
        self.run(argv, "variants.txt", step, append=True)
        self.show_result(before)

    def step_command(self, step: dict) -> None:
        for folder in step.get("fresh", []):  # a work folder a previous call on this machine may have left
            if self.dry:
                self.say(f"rm -rf {folder}")
            else:
                shutil.rmtree(folder, ignore_errors=True)
                self.log(f"removed {folder}")
        self.run([self.sub(a) for a in step["argv"]], step.get("out"), step, expect=step.get("expect", 0))

    def step_copy(self, step: dict) -> None:
        for pattern in step["files"]:
            if self.dry:
                self.say(f"cp {pattern} {self.out}/  # where it exists")
                continue
            for f in glob.glob(self.sub(pattern)):
                shutil.copy(f, self.out / Path(f).name)
                self.log(f"copied {f}")

    def step_report(self, step: dict) -> None:
        argv = [sys.executable, "bench/report.py", "--ours", str(self.out / "ours.jsonl")]
        for flag, name in (("--reference", "reference.txt"), ("--reference-after", "reference-after.txt"),
                           ("--smi", "smi.csv")):
            if self.dry or (self.out / name).exists():
                argv += [flag, str(self.out / name)]
        self.run(argv, "table.md", step)

    def step_scaling(self, step: dict) -> None:
        if self.dry:
            self.say(f"# then: {', '.join(step['runs'])} over {step['base']} (tokens/s of ours.jsonl) >> table.md")
            return
        runs = {}
        if (self.out / "ours.jsonl").exists():
            runs = {r["name"]: r["bare_tokens_per_sec"] for r in map(json.loads, (self.out / "ours.jsonl").open())}
        lines = [f"{name}: {runs[name] / runs[step['base']]:.3f} of {step['base']}" for name in step["runs"]
                 if name in runs and step["base"] in runs]
        with open(self.out / "table.md", "a") as f:
            f.write("\n" + "\n".join(lines or ["scaling: no runs to compare"]) + "\n")

    # -- the plan --------------------------------------------------------------------------------

    def install_wheels(self) -> None:
        if not self.wheel_dir:
            self.say("# no wheels installed (none in .whl/ or .device/whl/, or --no-wheels)")
            return
        files = sorted(str(p) for p in self.wheel_dir.glob("*.whl"))
        argv = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile", "--no-cache-dir",
                "--upgrade", "--target", str(SITE), *files]
        if self.dry:
            self.say(f"{sys.executable} -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade "
                     f"--target {SITE} {self.wheel_dir}/*.whl > {self.out / 'pip.txt'}  # {len(files)} wheels")
            return
        self.run(argv, "pip.txt", {"timeout": 300})

    def main(self) -> int:
        if not self.dry:
            self.out.mkdir(parents=True, exist_ok=True)
            (self.out / "commands.txt").write_text(
                f"# bench/run.py {self.args.plan}, {time.strftime('%Y-%m-%d %H:%M:%S UTC', time.gmtime())}, "
                f"PYTHONPATH={self.env['PYTHONPATH']}\n")
        self.install_wheels()
        smi = None
        if self.plan.get("smi") and (self.dry or shutil.which("nvidia-smi")):
            # the clock and power every second: under its power cap the GPU runs below its maximum clock
            argv = ["nvidia-smi", "--query-gpu=timestamp,clocks.sm,clocks.mem,power.draw,power.limit,temperature.gpu,"
                    "clocks_event_reasons.active", "--format=csv,noheader", "-lms", "1000"]
            if self.dry:
                self.say(f"{shlex.join(argv)} > {self.out / 'smi.csv'} &  # through the plan")
            else:
                smi = subprocess.Popen(argv, stdout=open(self.out / "smi.csv", "w"), stderr=subprocess.STDOUT)  # noqa: SIM115
                self.log(f"{shlex.join(argv)} > {self.out / 'smi.csv'} &")
        try:
            for step in self.plan.get("steps", []):
                if step.get("about"):
                    self.say(f"# {step['about']}")
                getattr(self, "step_" + step["run"].replace("-", "_"))(step)
        finally:
            if smi:
                smi.terminate()
                smi.wait()
        if self.dry:
            return 0
        table = self.out / "table.md"
        if table.exists():
            print(table.read_text(), flush=True)
        summary = f"{self.args.plan}: {len(self.failed)} step(s) not as expected, {time.monotonic() - self.start:.0f} s"
        self.log(summary + "".join(f"\n    {f}" for f in self.failed))
        self.say(summary + "".join(f"\n  {f}" for f in self.failed))
        return 1 if self.failed else 0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="bench/run.py", description=__doc__.split("\n\n", 1)[0],
                                epilog=__doc__.split("\n\n", 1)[1], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("plan", nargs="?", help="a plan of bench/plans.toml (--list names them)")
    p.add_argument("--list", action="store_true", help="the plans, with what each runs, and the variants")
    p.add_argument("--reference", default=os.environ.get("REFERENCE"), help="the plain reference script (env REFERENCE)")
    p.add_argument("--data", default=os.environ.get("DATA"), help="tokenized data: train.bin, val.bin (env DATA)")
    p.add_argument("--out", default=os.environ.get("OUT") or "bench-out", help="the outputs' folder (env OUT; bench-out)")
    p.add_argument("--variants", help="comma-separated variants instead of the plan's (its variants steps)")
    p.add_argument("--deadline", type=float, help="seconds after the start past which no further variant starts")
    p.add_argument("--wheels", help="wheels to install first (default .whl/ or .device/whl/ where there)")
    p.add_argument("--no-wheels", action="store_true", help="install no wheels: the machine has every package")
    p.add_argument("--dry-run", action="store_true", help="print the commands, run nothing")
    p.add_argument("--plans", type=Path, default=PLANS, help="the plans file (default bench/plans.toml)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    # Commands run from the repo root: paths given relative to where this was started are made whole.
    for key in ("reference", "data", "out", "wheels"):
        if getattr(args, key):
            setattr(args, key, str(Path(getattr(args, key)).absolute()))
    try:
        variants, plans = load(args.plans)
        if args.list:
            for name, plan in plans.items():
                print(f"{name:14s} {plan.get('about', '')}")
            print("\nvariants (config overrides on configs/x1-50m-a100.yaml):")
            for name, sets in variants.items():
                print(f"  {name:22s} {' '.join(sets) or '(the config as shipped)'}")
            return 0
        if not args.plan:
            raise PlanError("name a plan (bench/run.py --list names them)")
        plan = check_plan(args.plan, plans, variants)
        for v in args.variants.split(",") if args.variants else []:
            variant_sets(variants, v)
        missing = [need for need in plan.get("needs", []) if not getattr(args, need)]
        if missing and not args.dry_run:
            raise PlanError(f"plan {args.plan!r} needs " + " and ".join(f"--{m} (or {m.upper()})" for m in missing))
        if args.wheels and not args.dry_run and not any(Path(args.wheels).glob("*.whl")):
            raise PlanError(f"--wheels {args.wheels}: no .whl files there")
        for need in plan.get("needs", []):
            path = getattr(args, need)
            if path and not args.dry_run and not Path(path).exists():
                raise PlanError(f"--{need} {path}: not there")
    except PlanError as e:
        print(f"bench/run.py: {e}", file=sys.stderr)
        return 2
    return Driver(args, plan, variants).main()


if __name__ == "__main__":
    sys.exit(main())
