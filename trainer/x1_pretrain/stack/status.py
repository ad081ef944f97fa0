"""`python -m x1_pretrain.stack status`: what the stack is doing, read from the workspace's files.

Each process is looked at itself, never through the runner alone: a runner that died (a kill, an
OOM) leaves its services and the trainer running, and status says so. A service is running while
its recorded pid runs with its recorded start time (this host, this boot); the trainer while a
live trainer holds the lease on the checkpoint folder (x1_common.lease: its lock, or its
heartbeat on another host), whoever started it."""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import time
from pathlib import Path
from typing import Any

from x1_common import restarts
from x1_common.contracts import Heartbeat, boot_id
from x1_pretrain.stack import services as S
from x1_pretrain.stack.process import http_status
from x1_pretrain.stack.workspace import Workspace, read_events, read_json, trainer_pid
from x1_pretrain.train import lease as L

log = logging.getLogger("x1.stack")


# ---------------------------------------------------------------------------------------------
# status


STEP_LINE = re.compile(r"\bstep (\d+)/(\d+) loss (\S+) lr \S+ grad \S+ tok/s (\d+)")
# The trainer's budget line: the billed hours its steps left need, and the projection it judges.
BUDGET_LINE = re.compile(r"budget: [^\n]*?= ([\d.e+]+) h billed[^\n]*?projected \$([\d.]+) of \$([\d.]+)")
# The trainer's forecast line at each eval (x1_pretrain.forecast): the final val loss and its interval.
FORECAST_LINE = re.compile(r"forecast: (final val loss [\d.]+ \[[\d.]+, [\d.]+\] at step \d+, made at step \d+"
                           r"|not enough points yet at step \d+/\d+)")


def latest_checkpoint(ws: Workspace) -> str | None:
    try:
        return (ws.checkpoints / "latest").read_text(encoding="utf-8").strip() or None
    except OSError:
        return None


def last_step_line(path: Path, chars: int = 20000, pattern: re.Pattern[str] = STEP_LINE) -> re.Match[str] | None:
    try:
        with open(path, "rb") as f:
            f.seek(max(0, f.seek(0, os.SEEK_END) - chars))
            text = f.read().decode("utf-8", errors="replace")
    except OSError:
        return None
    found = None
    for found in pattern.finditer(text):  # noqa: B007 - the last one
        pass
    return found


def at_a_glance(trainer: dict[str, Any], budget: dict[str, Any], judged: re.Match[str] | None,
                state: dict[str, Any], last_event: dict[str, Any] | None) -> dict[str, Any]:
    """What a person checking a paid run wants first: % done, ETA, spend so far, projected spend at
    the finish, restarts, the last decision. None where it is not known yet."""
    step, total = trainer.get("step"), trainer.get("total_steps")
    scale = budget.get("time_scale") if isinstance(budget.get("time_scale"), (int, float)) else 1.0
    eta_h = float(judged[1]) / max(float(scale), 1.0) if judged else None  # billed hours -> wall hours
    final = state.get("final")
    return {
        "percent_done": round(100.0 * step / total, 1) if step is not None and total else None,
        "eta_hours": None if final else eta_h,
        "spent_usd": budget.get("spent_usd"),
        # once the run has ended its spend is final; the sidecar's figure would still count planned hours
        "projected_at_finish_usd": (budget.get("spent_usd") if final else float(judged[2]) if judged
                                    else budget.get("projected_total_usd")),
        "projection_source": "the trainer's, at its measured pace" if judged else "the sidecar's" if budget else None,
        "restarts": state.get("restarts_total"),
        "last_decision": describe_decision(last_event),
    }


def trainer_running(ws: Workspace) -> tuple[bool, int | None]:
    """(whether a trainer trains on this workspace's checkpoints, its pid where it is ours to see).
    The trainer's own lease says, not the runner: a trainer outlives a runner that died."""
    lease = L.probe(ws.checkpoints)
    alive = lease.owner is not None and lease.alive and lease.owner.kind == L.LeaseKind.TRAINER.owner_word
    pid = trainer_pid(ws)
    if pid is None and alive and lease.local and lease.owner is not None:
        pid = lease.owner.pid
    return alive or pid is not None, pid


def heartbeat_age(beat: Heartbeat) -> float:
    """Seconds since the beat: on the monotonic clock where it was written on this boot (a stepped
    wall clock shows no false age), else by the wall clocks."""
    if beat.mono is not None and beat.boot_id is not None and beat.boot_id == boot_id():
        return max(0.0, time.monotonic() - beat.mono)
    return time.time() - beat.time


def collect_status(ws: Workspace) -> dict[str, Any]:
    seen = L.probe(ws.root)
    record = read_json(ws.stack_file) or {}
    running = seen.owner is not None and seen.alive
    runner = record.get("runner") or {}
    # The recorded pids can be checked where the runner ran: this kernel, this pid namespace.
    here = runner.get("boot_id") == L.boot_id() and runner.get("pid_ns") == L.pid_namespace()
    services: dict[str, Any] = {}
    recorded = record.get("services") or {}
    for name in [n for n in S.START_ORDER if n in recorded]:
        info = recorded[name]
        pid, ticks = info.get("pid"), info.get("start_ticks")
        alive = here and isinstance(pid, int) and ticks is not None and L.proc_start_ticks(pid) == ticks
        health = None
        if alive and info.get("url") and info.get("health_path"):
            code = http_status(info["url"] + info["health_path"], timeout=3.0)
            health = "healthy" if code is not None and 200 <= code < 300 else f"unhealthy ({code or 'no answer'})"
        services[name] = {"pid": pid, "running": alive, "health": health if alive else None,
                          "url": info.get("url"), "restarts": info.get("restarts", 0), "log": info.get("log")}
    beat = Heartbeat.read(ws.heartbeat)
    trains, tpid = trainer_running(ws)
    step = last_step_line(ws.log("trainer"))
    trainer: dict[str, Any] = {"pid": tpid, "running": trains,
                               "step": beat.step if beat else None, "phase": beat.phase if beat else None,
                               "heartbeat_age_s": round(heartbeat_age(beat), 1) if beat else None,
                               "total_steps": int(step[2]) if step else None,
                               "loss": float(step[3]) if step else None,
                               "tokens_per_s": int(step[4]) if step else None,
                               "latest_checkpoint": latest_checkpoint(ws)}
    budget = read_json(ws.budget_file) or {}
    events = read_events(ws)
    state = read_json(ws.state_file) or {}
    return {
        "workspace": str(ws.root),
        "running": running,
        # What a runner that died left running: nobody restarts these, and `down` stops them.
        "orphaned": [] if running else [*(n for n, svc in services.items() if svc["running"]),
                                        *(["trainer"] if trains else [])],
        "runner": {"pid": seen.owner.pid if seen.owner else None, "host": seen.owner.host if seen.owner else None,
                   "since": seen.owner.since if seen.owner else None, "why": seen.why,
                   "state": record.get("state")},
        "services": services,
        "trainer": trainer,
        "budget": {k: budget.get(k) for k in ("spent_usd", "cap_usd", "projected_total_usd", "rate_usd_per_hr",
                                              "last_update_utc", "stale", "source", "provider")},
        "watchdog": {"last_event": events[-1] if events else None, "final": state.get("final"),
                     "restarts_total": state.get("restarts_total")},
        "at_a_glance": at_a_glance(trainer, budget, last_step_line(ws.log("trainer"), pattern=BUDGET_LINE), state,
                                   events[-1] if events else None),
        "forecast": forecast[1] if (forecast := last_step_line(ws.log("trainer"), pattern=FORECAST_LINE)) else None,
        "restarts": run_restarts(ws, events),
    }


def run_restarts(ws: Workspace, events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each restart with its downtime, as the manifest will have it (x1_common.restarts): the
    trainer's start records in trainer.log joined with the watchdog's events."""
    try:
        with open(ws.log("trainer"), encoding="utf-8", errors="replace") as f:
            starts = restarts.starts_in_log(f)
    except OSError:
        starts = []
    return restarts.restarts(starts, events)


def describe_decision(e: dict[str, Any] | None) -> str:
    if not e:
        return "none yet"
    kind = e.get("event")
    if kind == "start":
        return f"started the trainer (pid {e.get('pid')}, {'resuming' if e.get('resume') else 'fresh'}) at {e.get('time')}"
    if kind == "exit":
        how = "stop requested" if e.get("stop_requested") else e.get("reason")
        return f"trainer exited {e.get('exit_code')} ({how}) at {e.get('time')}"
    if kind == "relaunch":
        return f"relaunch #{e.get('restart')} after {e.get('reason')} (exit {e.get('exit_code')}) at {e.get('time')}"
    if kind == "startup_failure":
        return (f"start-up failure: the trainer exited {e.get('exit_code')} before its first step twice in a row "
                f"with the same error, not relaunched (watchdog exit {e.get('watchdog_exit_code')}) at {e.get('time')}")
    if kind == "terminate":
        done = "terminated" if e.get("ok") else f"terminate FAILED ({e.get('error')})"
        return f"{done} the {e.get('provider')} instance {e.get('instance_id')} after {e.get('reason')} at {e.get('time')}"
    return f"{kind}: {e.get('reason') or e.get('detail') or ''} at {e.get('time')}".rstrip()


def render_status(st: dict[str, Any]) -> str:
    r = st["runner"]
    lines = []
    orphaned = st.get("orphaned") or []
    if st["running"]:
        since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(r["since"])) if r["since"] else "?"
        lines.append(f"stack in {st['workspace']}: running (runner pid {r['pid']} on {r['host']}, since {since})")
    elif orphaned:
        lines.append(f"stack in {st['workspace']}: its runner is gone, but {', '.join(orphaned)} still run"
                     f"{'s' if len(orphaned) == 1 else ''}, unsupervised by it: `python -m x1_pretrain.stack down "
                     f"--workspace {st['workspace']}` stops them in order (the trainer first, with its checkpoint)")
    else:
        lines.append(f"stack in {st['workspace']}: not running" + (f" (last state: {r['state']})" if r["state"] else ""))
    for name, svc in st["services"].items():
        if not st["running"] and not svc["running"]:
            continue
        state = svc["health"] or ("running" if svc["running"] else "NOT RUNNING")
        restarted = f", restarted {svc['restarts']}x" if svc["restarts"] else ""
        lines.append(f"  {name:15s} {state:24s} pid {svc['pid']}{restarted}  {svc['url'] or ''}")
    g = st.get("at_a_glance") or {}
    if g:
        def money(v: Any) -> str:
            return f"${v:.2f}" if isinstance(v, (int, float)) else "?"

        done = f"{g['percent_done']:.1f}% done" if g["percent_done"] is not None else "% done: ?"
        eta = (f"ETA {g['eta_hours']:.2f} h" if g["eta_hours"] is not None else
               "ETA: none (stopped)" if st["watchdog"]["final"] else "ETA: ? (no pace yet)")
        lines.append(f"  at a glance: {done}, {eta}, spent {money(g['spent_usd'])}, projected "
                     f"{money(g['projected_at_finish_usd'])} at the finish"
                     + (f" ({g['projection_source']})" if g["projection_source"] else "")
                     + f", restarts {g['restarts'] if g['restarts'] is not None else 0}; last decision: {g['last_decision']}")
    if st.get("forecast"):
        lines.append(f"  forecast: {st['forecast']}")
    t = st["trainer"]
    if t["step"] is not None:
        of = f"/{t['total_steps']}" if t["total_steps"] else ""
        speed = f", {t['tokens_per_s']:,} tok/s, loss {t['loss']:.4f}" if t["tokens_per_s"] is not None else ""
        who = (f"pid {t['pid']}" if t["pid"] is not None else "running (on another host)") if t["running"] \
            else "not running"
        lines.append(f"  {'trainer':15s} {who}: step {t['step']}{of} ({t['phase']}, heartbeat {t['heartbeat_age_s']:.0f} s "
                     f"ago){speed}; latest checkpoint {t['latest_checkpoint'] or 'none'}")
    else:
        lines.append(f"  {'trainer':15s} no heartbeat yet")
    b = st["budget"]
    if b.get("spent_usd") is not None:
        stale = ", STALE" if b.get("stale") else ""
        lines.append(f"  spend: ${b['spent_usd']:.2f} of the ${b['cap_usd']:g} cap (projected ${b['projected_total_usd']:.2f}, "
                     f"${b['rate_usd_per_hr']:g}/h, {b['provider']}, reading {b['last_update_utc']}{stale})")
    else:
        lines.append("  spend: no budget reading yet")
    lines += [f"  {restarts.describe(r)}" for r in st.get("restarts", [])]
    w = st["watchdog"]
    lines.append(f"  watchdog's last decision: {describe_decision(w['last_event'])}")
    if w["final"]:
        f = w["final"]
        lines.append(f"  final decision: {f.get('reason')} (exit {f.get('exit_code')} at {f.get('time')}): "
                     "the trainer is not launched again")
        if f.get("error"):
            lines.append(f"  the trainer's error: {f['error']}")
    return "\n".join(lines)


def cmd_status(args: argparse.Namespace) -> int:
    st = collect_status(args.workspace)
    print(json.dumps(st, indent=2) if args.json else render_status(st))
    if not st["running"]:
        return 1
    healthy = all(s["running"] and s["health"] in (None, "healthy") for s in st["services"].values())
    return 0 if healthy else 1
