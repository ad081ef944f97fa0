"""One writer per checkpoint folder (x1_pretrain.lease), with real processes and real files.

- a live owner is refused by name (host, pid, since when); one killed by SIGKILL is dead at once,
  also when it ran in another pid namespace (a container of the same host), and its lease is
  taken over with a log line that says so;
- an owner on another host is judged by its heartbeat: refused while it moves, taken over only
  once it is older than the stated time; racing candidates end with exactly one owner;
- the trainer: a second one on the same folder (--resume-from-latest) exits 2 naming the first;
  SIGKILLed under the watchdog and relaunched at once, it takes its own dead lease over.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from conftest import REPO, cli_env, run_module, train_args, wait_for
from x1_common import lease as L
from x1_common.procs import stat_fields

HOLDER = """
import sys, time, logging
logging.basicConfig(level=logging.INFO, stream=sys.stderr)
from x1_common.lease import Lease, LeaseHeld
try:
    Lease(sys.argv[1], stale_seconds=float(sys.argv[2])).acquire()
except LeaseHeld as e:
    print("HELD", e, flush=True)
    sys.exit(2)
print("OWNER", flush=True)
time.sleep(float(sys.argv[3]))
"""


def holder(folder: Path, stale: float = 60.0, hold: float = 120.0, prefix: tuple[str, ...] = ()) -> subprocess.Popen:
    """A process that takes the lease on `folder` and keeps it for `hold` seconds."""
    proc = subprocess.Popen([*prefix, sys.executable, "-c", HOLDER, str(folder), str(stale), str(hold)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=cli_env(), cwd=REPO,
                            start_new_session=True)
    line = proc.stdout.readline()
    assert line.startswith("OWNER"), (line, proc.stderr.read() if proc.poll() is not None else "")
    return proc


def kill(proc: subprocess.Popen) -> None:
    """SIGKILL the holder's whole group and wait until every process of it is gone: under
    `unshare -f` the lease's owner is unshare's child, still exiting (its lock still held) when
    unshare itself has already been reaped."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(10)

    def group_gone() -> bool:  # no live member left (a zombie nobody reaps yet holds no lock)
        for entry in Path("/proc").glob("[0-9]*"):
            fields = stat_fields(int(entry.name))  # None: ended while we looked
            if fields is not None and int(fields[2]) == proc.pid and fields[0] not in ("Z", "X"):
                return False
        return True

    wait_for(group_gone, 10, "the holder's process group to be gone", interval=0.01)


def foreign_record(folder: Path, heartbeat_age: float, heartbeat_seconds: float = 1.0) -> Path:
    """The lease a trainer on another host left on a shared folder, its heartbeat `heartbeat_age` s old."""
    folder.mkdir(parents=True, exist_ok=True)
    owner = L.Owner(token="feedfacecafebeef", kind="trainer", host="gpu-host-b", pid=4242, since=time.time() - 3600,
                    boot_id="00000000-0000-4000-8000-000000000000", pid_ns="pid:[4026531836]", start_ticks=1234,
                    heartbeat_seconds=heartbeat_seconds, lock_file=None, command="python -m x1_pretrain.train")
    path = folder / L.LEASE_FILE
    path.write_text(owner.to_json())
    t = time.time() - heartbeat_age
    os.utime(path, (t, t))
    return path


# ---------------------------------------------------------------------------------------------
# The same host


def test_a_live_owner_is_refused_by_host_pid_and_since(tmp_path):
    owner = holder(tmp_path)
    try:
        with pytest.raises(L.LeaseHeld) as e:
            L.Lease(tmp_path).acquire()
        text = str(e.value)
        assert f"host {socket.gethostname()}, pid {owner.pid}, since 20" in text
        assert "holds its lock" in text and str(tmp_path / L.LEASE_FILE) in text
        assert owner.poll() is None  # untouched
        assert L.read_owner(tmp_path).pid == owner.pid
    finally:
        kill(owner)


def test_an_owner_killed_by_sigkill_is_dead_at_once_and_the_takeover_is_logged(tmp_path, caplog):
    owner = holder(tmp_path)
    kill(owner)  # no release: the lease file and its lock file stay behind
    assert (tmp_path / L.LEASE_FILE).is_file()
    caplog.set_level(logging.INFO, logger="x1.lease")
    t = time.monotonic()
    lease = L.Lease(tmp_path).acquire()
    try:
        assert time.monotonic() - t < 2
        assert re.search(rf"taken over from trainer host \S+, pid {owner.pid}, since .*not running on this host",
                         caplog.text), caplog.text
        assert L.read_owner(tmp_path).pid == os.getpid()
        # The dead owner's lock file is cleaned up; ours is the only one.
        assert [p.name for p in tmp_path.glob(".x1-lease-*.lock")] == [lease.owner.lock_file]
    finally:
        lease.release()
    assert not list(tmp_path.iterdir())  # released: nothing left behind


def unshare_prefix() -> tuple[str, ...] | None:
    exe = shutil.which("unshare")
    if exe is None:
        return None
    probe = subprocess.run([exe, "-Urpf", "--mount-proc", "true"], capture_output=True, timeout=30)
    return (exe, "-Urpf", "--mount-proc") if probe.returncode == 0 else None


def test_an_owner_in_another_pid_namespace_of_this_host_is_judged_by_its_lock(tmp_path):
    """A container on the same host (docker compose run trainer, or the trainer container started
    again by the watchdog): other pids, same kernel. Its pid says nothing to us; its lock does."""
    prefix = unshare_prefix()
    if prefix is None:
        pytest.skip("cannot make a pid namespace here (unshare -Urpf not permitted)")
    owner = holder(tmp_path, prefix=prefix)
    try:
        record = L.read_owner(tmp_path)
        assert record.pid_ns != L.pid_namespace() and record.boot_id == L.boot_id()
        with pytest.raises(L.LeaseHeld, match="holds its lock on this host"):
            L.Lease(tmp_path).acquire()
    finally:
        kill(owner)
    t = time.monotonic()
    L.Lease(tmp_path).acquire().release()
    assert time.monotonic() - t < 2  # dead at once, no heartbeat wait


def test_where_the_filesystem_has_no_locks_the_pid_and_its_start_time_decide(tmp_path, monkeypatch):
    owner = holder(tmp_path)
    monkeypatch.setattr(L, "lock_held", lambda path: None)  # what a lock-less filesystem answers
    try:
        with pytest.raises(L.LeaseHeld, match=f"pid {owner.pid} is running on this host"):
            L.Lease(tmp_path).acquire()
    finally:
        kill(owner)
    L.Lease(tmp_path).acquire().release()


def test_racing_candidates_for_a_dead_lease_end_with_exactly_one_owner(tmp_path):
    kill(holder(tmp_path))
    procs = [subprocess.Popen([sys.executable, "-c", HOLDER, str(tmp_path), "60", "8"], stdout=subprocess.PIPE,
                              stderr=subprocess.DEVNULL, text=True, env=cli_env(), cwd=REPO) for _ in range(4)]
    try:
        firsts = [p.stdout.readline().split()[0] for p in procs]
    finally:
        for p in procs:
            p.kill()
            p.wait(10)
    assert sorted(firsts) == ["HELD", "HELD", "HELD", "OWNER"], firsts


def test_a_record_that_is_not_a_lease_is_refused_naming_the_file(tmp_path):
    (tmp_path / L.LEASE_FILE).write_text("{not json")
    with pytest.raises(L.LeaseError, match=r"\.x1-lease\.json is not a lease record.*remove the file"):
        L.Lease(tmp_path).acquire()


# ---------------------------------------------------------------------------------------------
# Another host (a shared filesystem)


def test_a_lease_left_by_another_host_is_taken_over_only_after_the_stated_time(tmp_path, caplog):
    stale = 4.0
    foreign_record(tmp_path, heartbeat_age=stale - 2.5, heartbeat_seconds=stale / 6)  # dead, its heartbeat still young
    caplog.set_level(logging.INFO, logger="x1.lease")
    t = time.monotonic()
    lease = L.Lease(tmp_path, stale_seconds=stale).acquire()
    waited = time.monotonic() - t
    lease.release()
    assert waited >= 2.4, waited  # not before the heartbeat was `stale` seconds old
    assert waited < stale + 2, waited
    assert "on another host" in caplog.text and "watching it" in caplog.text
    assert re.search(r"taken over from trainer host gpu-host-b, pid 4242, since .*heartbeat is \d+ s old "
                     r"\(over 4 s\) and did not move", caplog.text), caplog.text


def test_an_old_heartbeat_from_another_host_is_still_watched_before_the_takeover(tmp_path):
    """Clocks of two hosts may disagree: an old-looking heartbeat must also stand still while we watch."""
    stale = 4.0
    foreign_record(tmp_path, heartbeat_age=3600, heartbeat_seconds=stale / 6)
    t = time.monotonic()
    L.Lease(tmp_path, stale_seconds=stale).acquire().release()
    assert 0.4 * stale - 0.1 <= time.monotonic() - t < stale


def test_an_owner_on_another_host_whose_heartbeat_moves_is_refused(tmp_path):
    path = foreign_record(tmp_path, heartbeat_age=3600, heartbeat_seconds=0.5)  # its clock may be far behind ours
    stop = threading.Event()

    def remote_heartbeat() -> None:
        while not stop.wait(0.5):
            os.utime(path)

    beat = threading.Thread(target=remote_heartbeat, daemon=True)
    beat.start()
    try:
        t = time.monotonic()
        with pytest.raises(L.LeaseHeld, match=r"host gpu-host-b, pid 4242.*its heartbeat moved"):
            L.Lease(tmp_path, stale_seconds=30).acquire()
        assert time.monotonic() - t < 5
    finally:
        stop.set()
        beat.join()


# ---------------------------------------------------------------------------------------------
# The owner's side


def test_the_owner_beats_and_stops_when_its_lease_is_taken_from_it(tmp_path):
    lost: list[str] = []
    lease = L.Lease(tmp_path, stale_seconds=0.6, on_lost=lost.append).acquire()
    try:
        path = tmp_path / L.LEASE_FILE
        first = path.stat().st_mtime_ns
        deadline = time.monotonic() + 5
        while path.stat().st_mtime_ns == first and time.monotonic() < deadline:
            time.sleep(0.05)
        assert path.stat().st_mtime_ns != first, "no heartbeat"
        assert lease.check() is None
        # Another candidate judged us dead (frozen, cut off) and put its own lease in place.
        foreign_record(tmp_path / "other", heartbeat_age=0).rename(path)
        deadline = time.monotonic() + 5
        while not lost and time.monotonic() < deadline:
            time.sleep(0.05)
        assert lost and "belongs to another trainer" in lost[0]
    finally:
        lease.release()
    assert L.read_owner(tmp_path).host == "gpu-host-b"  # release leaves the new owner's lease alone


def test_the_stale_time_comes_from_the_environment_and_bad_values_are_named(monkeypatch):
    monkeypatch.setenv(L.STALE_SECONDS_ENV, "12")
    assert L.Lease("/tmp/unused").stale_seconds == 12.0
    monkeypatch.setenv(L.STALE_SECONDS_ENV, "soon")
    with pytest.raises(L.LeaseError, match="X1_LEASE_STALE_SECONDS='soon' is not a number"):
        L.Lease("/tmp/unused")


# ---------------------------------------------------------------------------------------------
# The trainer


def heartbeat_step(path: Path) -> int | None:
    try:
        beat = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return beat["step"] if beat.get("phase") == "training" else None


def events(path: Path) -> list[dict]:
    try:
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    except OSError:
        return []


@pytest.mark.slow
def test_a_second_trainer_is_refused_and_a_sigkilled_one_relaunched_at_once_takes_its_lease_over(tmp_path, tiny_data):
    ckpt, logs = tmp_path / "ckpt", tmp_path / "logs"
    logs.mkdir()
    args = train_args(tiny_data, ckpt, f"file://{tmp_path}/mlruns", "--resume-from-latest", total=100000)
    heartbeat = ckpt / "heartbeat.json"
    events_file = logs / "events.jsonl"
    env = cli_env(OMP_NUM_THREADS="1")
    watchdog = subprocess.Popen(
        [sys.executable, "-m", "x1_watchdog", "--mode", "process", "--heartbeat-file", str(heartbeat),
         "--events-file", str(events_file), "--state-file", str(logs / "state.json"), "--port", "0",
         "--backoff-base-seconds", "0", "--term-grace-seconds", "30", "--trainer-log", str(logs / "trainer.log"),
         "--", sys.executable, "-m", "x1_pretrain.train", *args],
        stdout=open(logs / "watchdog.log", "wb"), stderr=subprocess.STDOUT, env=env, cwd=REPO, start_new_session=True)
    try:
        wait_for(lambda: (heartbeat_step(heartbeat) or 0) >= 5, 180, "the first trainer's steps")
        first = next(e["pid"] for e in events(events_file) if e["event"] == "start")

        # A second trainer on the same folder, as `docker compose run trainer` would start it.
        second = run_module("x1_pretrain.train", *args, timeout=120, env=env)
        assert second.returncode == 2, second.stderr[-3000:]
        assert re.search(rf"checkpoint folder {re.escape(str(ckpt))} is in use by another trainer: host "
                         rf"{re.escape(socket.gethostname())}, pid {first}, since \d{{4}}-\d\d-\d\dT", second.stderr), \
            second.stderr[-3000:]
        assert L.read_owner(ckpt).pid == first and watchdog.poll() is None
        assert [e["event"] for e in events(events_file)] == ["start"]  # the first one runs on, unaware

        # SIGKILL: no emergency checkpoint, no release. The watchdog relaunches at once.
        # The heartbeat names a step only while training (not mid-checkpoint or eval).
        step_before = wait_for(lambda: heartbeat_step(heartbeat), 60, "a training heartbeat")
        os.kill(first, signal.SIGKILL)
        starts = wait_for(lambda: [e for e in events(events_file) if e["event"] == "start"][1:], 60, "the relaunch")
        relaunched = starts[0]["pid"]
        wait_for(lambda: (heartbeat_step(heartbeat) or 0) > step_before, 180, "the relaunched trainer's steps")
        log = (logs / "trainer.log").read_text()
        assert re.search(rf"taken over from trainer host \S+, pid {first}, since .*not running on this host", log), log[-3000:]
        assert "is in use by another trainer" not in log
        kinds = [(e["event"], e.get("reason")) for e in events(events_file)]
        assert kinds == [("start", None), ("exit", "killed"), ("relaunch", "killed"), ("start", None)], kinds
        assert L.read_owner(ckpt).pid == relaunched
    finally:
        watchdog.send_signal(signal.SIGTERM)
        try:
            watchdog.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(watchdog.pid, signal.SIGKILL)
            watchdog.wait(10)
    assert not ckpt.joinpath(L.LEASE_FILE).exists()  # the relaunched trainer released it on its way out (75)


def test_a_trainer_refused_by_the_lease_has_written_nothing(tmp_path, tiny_data):
    ckpt = tmp_path / "ckpt"
    owner = holder(ckpt)
    try:
        proc = run_module("x1_pretrain.train", *train_args(tiny_data, ckpt, f"file://{tmp_path}/mlruns",
                                                           "--resume-from-latest"), timeout=120)
    finally:
        kill(owner)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert f"pid {owner.pid}" in proc.stderr
    assert sorted(p.name for p in ckpt.iterdir() if not p.name.startswith(".x1-lease")) == []
    assert not (tmp_path / "mlruns").exists()


def test_a_launch_refused_before_its_first_write_leaves_no_checkpoint_folder(tmp_path):
    ckpt = tmp_path / "new" / "ckpt"
    proc = run_module("x1_pretrain.train", *train_args(tmp_path / "no-data", ckpt, f"file://{tmp_path}/mlruns"),
                      timeout=120)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "meta.json: missing" in proc.stderr
    assert not ckpt.exists()  # the lease made the folder, and took it away again unused
