"""A restart's downtime, defined once (x1_common.restarts): which stop it counts from, how a
relaunch is paired with the start that followed it, and how `stack status` reads the trainer's
start records back from trainer.log."""

from __future__ import annotations

import json
import time

from x1_common import restarts as R
from x1_pretrain.stack.status import collect_status, render_status
from x1_pretrain.stack.workspace import Workspace
from x1_watchdog.records import iso_time

T0 = 1_800_000_000.0


def test_the_stop_is_the_sigterm_else_the_exit_else_the_last_heartbeat():
    sigterm = R.previous_stop("stopped", T0 + 9, 40, signal_time=T0 + 5)
    assert sigterm == R.Stop(T0 + 5, "SIGTERM", 40)
    assert R.stop_moment(sigterm, watchdog_exit_unix=T0 + 10) == sigterm  # the checkpoint and exit are downtime
    own_exit = R.previous_stop("stopped", T0 + 9, 40, signal_time=None)  # a budget stop: no signal
    assert R.stop_moment(own_exit, T0 + 10) == R.Stop(T0 + 9, "exit", 40)
    killed = R.previous_stop("training", T0 + 2, 38, signal_time=None)  # its last sign of life
    assert R.stop_moment(killed, T0 + 10) == R.Stop(T0 + 10, "exit", 38)  # the watchdog saw the exit
    assert R.stop_moment(killed, None) == R.Stop(T0 + 2, "last heartbeat", 38)  # no watchdog: an upper bound
    assert R.downtime_seconds(sigterm, T0 + 26.04) == 21.0 and R.downtime_seconds(None, T0) is None


def test_each_relaunch_is_one_restart_paired_with_the_first_step_after_its_exit():
    events = [{"event": "exit", "exit_code": 75, "reason": "preempted", "time": iso_time(T0 + 10)},
              {"event": "relaunch", "exit_code": 75, "reason": "preempted", "downtime_seconds": 1.0,
               "time": iso_time(T0 + 11)},
              {"event": "exit", "exit_code": 137, "reason": "killed", "time": iso_time(T0 + 60)},
              {"event": "relaunch", "exit_code": 137, "reason": "killed", "downtime_seconds": 1.0,
               "time": iso_time(T0 + 61)}]
    starts = [R.Start(1, T0 - 50, 8.0),
              R.Start(41, T0 + 30, 12.0, R.Stop(T0 + 5, "SIGTERM", 40)),
              # resumed from the same checkpoint: the second process's last beat is older than its kill
              R.Start(41, T0 + 90, 12.0, R.Stop(T0 + 55, "last heartbeat", 45))]
    one, two = R.restarts(starts, events)
    assert (one["restart"], one["cause"], one["stopped_by"], one["stopped_at_step"], one["resumed_first_step"],
            one["downtime_seconds"]) == (1, "preempted", "SIGTERM", 40, 41, 25.0)
    assert (two["restart"], two["cause"], two["stopped_by"], two["stopped_at_step"], two["downtime_seconds"]) == \
        (2, "killed", "exit", 45, 30.0)
    assert R.label(two) == "restart 2: 30.0 s"
    assert R.describe(one) == f"restart 1: 25.0 s down (preempted, exit 75): SIGTERM at step 40 {R.utc(T0 + 5)} -> step 41 done"
    # A relaunched process that never reached its first step: no figure, and why.
    (lost,) = R.restarts(starts[:2], events[2:])
    assert lost["downtime_seconds"] is None and lost["why"].startswith("not measured")


def test_without_watchdog_events_every_resumed_start_is_a_restart():
    starts = [R.Start(1, T0, 8.0), R.Start(41, T0 + 30, 12.0, R.Stop(T0 + 5, "SIGTERM", 40))]
    (only,) = R.restarts(starts)
    assert only["downtime_seconds"] == 25.0 and only["cause"] is None and "(" not in R.describe(only).split(":")[1]


def test_stack_status_reads_the_restarts_from_the_trainers_start_records(tmp_path):
    ws = Workspace(tmp_path)
    ws.logs.mkdir(parents=True)
    first, second = R.Start(1, T0, 8.25), R.Start(41, T0 + 30.123456, 12.5, R.Stop(T0 + 5.5, "SIGTERM", 40))
    (ws.logs / "trainer.log").write_text("".join(f"12:00:00 INFO x1.train: {R.start_line(s)}\n" for s in (first, second))
                                         + "12:00:01 INFO x1.train: step 41/50 loss 3.7000 lr 3.00e-04 grad 0.300 tok/s 100\n"
                                         + '12:00:02 INFO x1.train: a torn line: start record {"first_step": \n')
    ws.heartbeat.write_text(json.dumps({"step": 41, "time": time.time(), "pid": 1, "phase": "training"}))
    events = [{"event": "exit", "exit_code": 75, "reason": "preempted", "time": iso_time(T0 + 9)},
              {"event": "relaunch", "exit_code": 75, "reason": "preempted", "time": iso_time(T0 + 10)}]
    ws.events_file.write_text("".join(json.dumps(e) + "\n" for e in events))
    st = collect_status(ws)
    (r,) = st["restarts"]
    assert r == R.restarts([first, second], events)[0] and r["downtime_seconds"] == 24.6
    assert f"  restart 1: 24.6 s down (preempted, exit 75): SIGTERM at step 40 {R.utc(T0 + 5.5)} -> step 41 done" \
        in render_status(st).splitlines()
    assert "24.6 s since the previous process's SIGTERM at step 40" in R.start_line(second)
