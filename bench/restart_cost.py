"""What a start and a preemption cost: the real trainer under the watchdog, a SIGTERM, a resume.

    python bench/restart_cost.py --data-dir DATA --out DIR [--config configs/x1-50m-h200.yaml]
        [--steps 240] [--sigterm-at 150] [--spike-at 100] [--cache-dir DIR/cache] [--set ...]

Runs `python -m x1_watchdog --mode process -- python -m x1_pretrain.train ...` as a user runs it
on a host without Docker (RunPod), with torch.compile's caches where compose puts them
(TORCHINDUCTOR_CACHE_DIR, TRITON_CACHE_DIR, X1_CUBLASLT_CACHE under the workspace; --cache-dir keeps them between
calls). Once the trainer's heartbeat reaches --sigterm-at, the trainer process gets SIGTERM (a
spot reclaim): emergency checkpoint, exit 75, the watchdog relaunches it with
--resume-from-latest, it finishes at --steps and writes the run folder (--run-dir). Then reports,
from the run folder's manifest (the trainer's MLflow metrics joined with the watchdog's events):

  time to first step   each process: its start -> its first optimizer step done
  preemption downtime  SIGTERM -> the relaunched process's first step done (x1_common.restarts)
  checkpoint           SIGTERM -> exit (the emergency checkpoint)
  floor warnings       each process's "under the floor" lines, and its tokens/s per log interval
  matmul tuning        on a GPU, each process's cuBLASLt line: shapes timed, shapes kept from the file

and prints the log of both trainer processes (one file per process). Writes DIR/restart-cost.json.
Exit 0 when the run finished with one relaunch after the SIGTERM; 1 otherwise; 2 bad input.
Works on CPU with configs/tiny-cpu.yaml (the test suite runs it so).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "trainer")]

from x1_common.restarts import describe as describe_restart  # noqa: E402 - after the path

STEP_LINE = re.compile(r"step (\d+)/\d+ loss \S+ lr \S+ grad \S+ tok/s (\d+)")
FLOOR_LINE = "under the floor"
SIGTERM_EXIT = re.compile(r"preempted at step (\d+): checkpoint in ([\d.]+) s, exit 75")
TUNING_LINE = re.compile(r"(cuBLASLt: \d+ matmul shapes, \d+ timed, .*)$", re.M)  # on a GPU, after the first step


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="bench/restart_cost.py", description=__doc__.split("\n\n", 1)[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__.split("\n\n", 2)[2])
    p.add_argument("--data-dir", type=Path, required=True, help="tokenized data (train.bin, val.bin, meta.json)")
    p.add_argument("--out", type=Path, required=True, help="work folder, wiped first (its cache/ is kept)")
    p.add_argument("--config", type=Path, default=REPO / "configs" / "x1-50m-h200.yaml")
    p.add_argument("--steps", type=int, default=240, help="total steps (default 240)")
    p.add_argument("--sigterm-at", type=int, default=150, help="SIGTERM once the heartbeat reaches this step (150)")
    p.add_argument("--spike-at", type=int, help="--inject-spike-at-step for the trainer (default: none)")
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--eval-every", type=int, help="default: --steps (one eval, at the end)")
    p.add_argument("--ckpt-every", type=int, help="default: --steps (only the emergency and the final checkpoint)")
    p.add_argument("--cache-dir", type=Path, help="compile caches (default OUT/cache: kept when OUT is wiped)")
    p.add_argument("--set", action="append", default=[], metavar="SECTION.FIELD=VALUE", help="trainer --set")
    p.add_argument("--timeout", type=float, default=560.0, help="seconds before everything is stopped (560)")
    args = p.parse_args(argv)
    if not (args.data_dir / "meta.json").is_file():
        p.error(f"--data-dir {args.data_dir}: no meta.json (a tokenize_data output folder)")
    if not 0 < args.sigterm_at < args.steps:
        p.error(f"--sigterm-at must be between 0 and --steps ({args.steps}), got {args.sigterm_at}")
    return args


def heartbeat(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def trainer_command(args: argparse.Namespace, work: Path) -> list[str]:
    log_dir = work / "logs"
    train = [sys.executable, "-m", "x1_pretrain.train", "--config", str(args.config), "--data-dir", str(args.data_dir),
             "--ckpt-dir", str(work / "checkpoints"), "--mlflow-uri", f"file://{work / 'mlruns'}",
             "--total-steps", str(args.steps), "--log-every", str(args.log_every),
             "--eval-every", str(args.eval_every or args.steps), "--ckpt-every", str(args.ckpt_every or args.steps),
             "--metrics-port", "0", "--heartbeat-file", str(log_dir / "heartbeat.json"), "--run-dir", str(work / "run"),
             "--run-name", "restart-cost"]
    if args.spike_at is not None:
        train += ["--inject-spike-at-step", str(args.spike_at)]
    for s in args.set:
        train += ["--set", s]
    # One log per trainer process: the shell becomes the trainer (exec), so its pid names the file.
    # The watchdog appends --resume-from-latest to the relaunch; it lands in "$@".
    return ["sh", "-c", f'exec "$0" "$@" >> "{log_dir}/trainer-$$.log" 2>&1', *train]


def run(args: argparse.Namespace) -> dict:
    work = args.out.resolve()
    cache = (args.cache_dir or work / "cache").resolve()
    if work.exists():
        for child in work.iterdir():
            if child != cache:
                shutil.rmtree(child) if child.is_dir() else child.unlink()
    (work / "logs").mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "TORCHINDUCTOR_CACHE_DIR": str(cache / "inductor"),
           "TRITON_CACHE_DIR": str(cache / "triton"), "X1_CUBLASLT_CACHE": str(cache / "cublaslt.json"),
           "PYTHONPATH": os.pathsep.join([str(REPO), str(REPO / "trainer"), str(REPO / "watchdog"),
                                          str(REPO / "budget-sidecar"), os.environ.get("PYTHONPATH", "")])}
    cached = cache.is_dir() and any(cache.rglob("*"))
    logs = work / "logs"
    watchdog = [sys.executable, "-m", "x1_watchdog", "--mode", "process", "--heartbeat-file", str(logs / "heartbeat.json"),
                "--events-file", str(logs / "watchdog-events.jsonl"), "--state-file", str(logs / "watchdog-state.json"),
                "--port", "0", "--term-grace-seconds", "60", "--backoff-base-seconds", "2",
                "--", *trainer_command(args, work)]
    deadline = time.monotonic() + args.timeout
    with open(logs / "watchdog.log", "wb") as out:
        proc = subprocess.Popen(watchdog, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=REPO, start_new_session=True)
    signalled: dict | None = None
    try:
        while proc.poll() is None:
            if time.monotonic() > deadline:
                raise TimeoutError(f"the run did not end within {args.timeout:g} s")
            beat = heartbeat(logs / "heartbeat.json")
            if signalled is None and beat and beat.get("phase") == "training" and beat.get("step", 0) >= args.sigterm_at:
                os.kill(int(beat["pid"]), signal.SIGTERM)  # the trainer, not the watchdog: a spot reclaim
                signalled = {"pid": int(beat["pid"]), "step": int(beat["step"]), "time": time.time()}
                print(f"SIGTERM to trainer pid {signalled['pid']} at step {signalled['step']}", flush=True)
            time.sleep(0.2)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(90)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
    return summarise(work, proc.returncode, signalled, cached)


def process_logs(logs: Path) -> list[Path]:
    return sorted(logs.glob("trainer-*.log"), key=lambda p: p.stat().st_mtime)


def summarise(work: Path, watchdog_code: int, signalled: dict | None, cached: bool) -> dict:
    events = [json.loads(line) for line in (work / "logs" / "watchdog-events.jsonl").read_text().splitlines() if line]
    manifest_path = work / "run" / "manifest.json"
    manifest = json.loads(manifest_path.read_text()) if manifest_path.is_file() else {}
    cost = manifest.get("restart_cost") or {}
    processes = []
    for path in process_logs(work / "logs"):
        text = path.read_text(errors="replace")
        exit_line = SIGTERM_EXIT.search(text)
        tuning = TUNING_LINE.search(text)
        processes.append({
            "log": path.name,
            "tokens_per_sec": [(int(m[1]), int(m[2])) for m in STEP_LINE.finditer(text)],
            "floor_warnings": [line for line in text.splitlines() if FLOOR_LINE in line],
            "emergency_checkpoint_seconds": float(exit_line[2]) if exit_line else None,
            "matmul_tuning": tuning[1] if tuning else None,
        })
    return {
        "watchdog_exit": watchdog_code,
        "sigterm": signalled,
        "compile_cache_warm_at_start": cached,
        "events": [(e["event"], e.get("exit_code")) for e in events],
        "end": manifest.get("end"),
        "end_detail": manifest.get("end_detail"),
        "starts": cost.get("starts", []),
        "restarts": cost.get("restarts", []),
        "processes": processes,
        "run_folder": str(work / "run") if manifest else None,
    }


def report(summary: dict, work: Path) -> str:
    lines = [f"watchdog exit {summary['watchdog_exit']}; events {summary['events']}; run end {summary['end']} "
             f"({summary['end_detail']}); compile cache warm at the first start: {summary['compile_cache_warm_at_start']}"]
    for i, s in enumerate(summary["starts"], 1):
        lines.append(f"process {i}: first step {s['first_step']} done {s['startup_seconds']:.1f} s after its start")
    for r in summary["restarts"]:
        extra = "" if r.get("downtime_seconds") is None else \
            f" (watchdog backoff {r.get('relaunch_delay_seconds')} s, its startup {r['startup_seconds']:.1f} s)"
        lines.append(describe_restart(r) + extra)
    for i, p in enumerate(summary["processes"], 1):
        tps = ", ".join(f"{s}:{t}" for s, t in p["tokens_per_sec"])
        ckpt = p["emergency_checkpoint_seconds"]
        lines.append(f"process {i} ({p['log']}): {len(p['floor_warnings'])} floor warning(s)"
                     + (f", emergency checkpoint {ckpt:.2f} s" if ckpt is not None else "") + f"; tokens/s by step: {tps}")
        lines += [f"  {w}" for w in p["floor_warnings"]]
        if p["matmul_tuning"]:
            lines.append(f"  {p['matmul_tuning']}")
    for path in process_logs(work / "logs"):
        lines += ["", f"===== {path.name}", path.read_text(errors="replace").rstrip()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        summary = run(args)
    except TimeoutError as e:
        print(f"restart_cost: {e}; logs in {args.out / 'logs'}", file=sys.stderr)
        summary = summarise(args.out.resolve(), -1, None, False)
        summary["error"] = str(e)
    (args.out / "restart-cost.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(report(summary, args.out.resolve()))
    ok = (summary["watchdog_exit"] == 0 and summary["sigterm"] is not None
          and [e for e, _ in summary["events"]].count("relaunch") == 1 and len(summary["starts"]) == 2)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
