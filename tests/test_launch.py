"""`x1 launch` → `x1 status` → an eviction → `x1 down`, over real SSH, against the fake providers.

The "instance" a launch creates is a container on a test network of the real Docker Engine
(tests/launch_instance.py): Debian's openssh-server, the stack's Python packages, a tokenized
corpus on its /workspace, nothing of the project itself until `x1 launch` copies the repository
there. Inside it the stack runs as processes (`python -m x1_pretrain.stack`, the RunPod way); the
Lambda path's `docker compose up` on the instance is not run here (tests/test_docker_compose.py
runs compose itself). The fake provider API (budget_sidecar.fake_billing) runs in this process
on the network's gateway address, so `x1`, the off-host watchdog and the instance's budget sidecar
all reach it; the containers reach nothing but it and each other.

The run (RunPod, tests in order, one instance): launch with the off-host watchdog, status, logs,
a preemption mid-run (the fake stops the container; the watchdog resumes the pod; the stack comes
back by the pod's start command and the trainer resumes from its checkpoint), the finish, `down`
(fetch, terminate, termination.json, dod's six checks) and a second `down`. Then Ctrl-C during a
Lambda launch at each stage.

Where no engine is reachable these tests skip with the reason; under CI=true they fail instead.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from compose_stack import TORCH_IMAGE_VERSION, require_engine, wait_for
from launch_instance import (
    API_KEY,
    INSTANCE_IMAGE,
    X1,
    DockerMachines,
    DockerNetwork,
    FakeProvider,
    build_instance_image,
)

pytestmark = pytest.mark.slow

TOTAL_STEPS = 40
CKPT_EVERY = 10
LOG_EVERY = 5
BAND = ("4.5", "7.5")  # the tiny model's val-loss band after 100 steps (x1_pretrain.demo explains the numbers)


@pytest.fixture(scope="session")
def engine() -> None:
    require_engine("the launch tests", None if shutil.which("ssh") else
                   "no OpenSSH client (ssh) on PATH; .ci/docker-setup installs Debian's openssh-client")


@pytest.fixture(scope="session")
def instance_image(engine: None) -> str:
    seconds = build_instance_image()
    print(f"instance image {INSTANCE_IMAGE} built in {seconds:.0f} s")
    return INSTANCE_IMAGE


@pytest.fixture(scope="session")
def network(engine: None) -> Iterator[DockerNetwork]:
    net = DockerNetwork.create()
    try:
        yield net
    finally:
        net.remove()


@pytest.fixture(scope="session")
def ssh_key(tmp_path_factory: pytest.TempPathFactory) -> Path:
    key = tmp_path_factory.mktemp("ssh") / "id_ed25519"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "x1-launch-test", "-f", str(key)], check=True)
    return key


def run_env(path: Path) -> Path:
    """The user's .env for the tiny run (what `cp .env.example .env` and a few edits give)."""
    path.write_text("\n".join([
        "X1_CONFIG=configs/tiny-cpu.yaml", f"TOTAL_STEPS={TOTAL_STEPS}", f"CKPT_EVERY={CKPT_EVERY}",
        "EVAL_EVERY=20", f"LOG_EVERY={LOG_EVERY}", "BUDGET_POLL_SECONDS=1", "BUDGET_CAP_USD=35",
        "BUDGET_ALERT_USD=30", "PLANNED_HOURS=24", "MAX_PRICE_USD_PER_HR=1.40", "STALL_SECONDS=120",
        "STARTUP_GRACE_SECONDS=300", "MAX_RESTARTS=3", "MLFLOW_WORKERS=1",
        "TRAIN_EXTRA_ARGS=--run-name x1-launch-test --budget-check-every-min 0.25 --planned-rate-usd-per-hr 1.26 "
        "--planned-hours 24",
        # The instance image's torch (the CPU stand-in of the Docker tests, as its Dockerfile build
        # gets): the boot script's venv on the volume keeps it instead of installing the GPU pin.
        f"TORCH_VERSION={TORCH_IMAGE_VERSION}", "TORCH_CUDA=none",
    ]) + "\n", encoding="utf-8")
    return path


@pytest.mark.timeout(2400)
def test_the_instance_image_has_sshd_and_the_stacks_packages_but_not_the_project(instance_image: str):
    def inside(code: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(["docker", "run", "--rm", instance_image, "python3", "-c", code], capture_output=True,
                              text=True, timeout=300)

    proc = subprocess.run(["docker", "run", "--rm", instance_image, "sh", "-c", "test -x /usr/sbin/sshd && sshd -V"],
                          capture_output=True, text=True, timeout=300)
    assert "OpenSSH" in proc.stderr, proc.stderr
    assert inside("import fastapi, mlflow, torch, safetensors, tiktoken").returncode == 0
    # The stack that runs is the copy `x1 launch` puts there, nothing baked into the image.
    assert "ModuleNotFoundError" in inside("import x1_pretrain").stderr


# ---------------------------------------------------------------------------------------------
# One run on RunPod, in order


class Run:
    def __init__(self, fake: FakeProvider, x1: X1, root: Path, env_file: Path) -> None:
        self.fake = fake
        self.x1 = x1
        self.root = root
        self.env_file = env_file
        self.instance_id = ""
        self.t0 = time.monotonic()
        self.notes: dict[str, Any] = {}

    def record(self) -> dict[str, Any]:
        return json.loads((self.root / "state" / "instances" / f"{self.instance_id}.json").read_text())

    def on_instance(self, command: str) -> str:
        return self.fake.machines.exec(self.instance_id, command)

    def status(self) -> dict[str, Any]:
        proc = self.x1("status", "--json", timeout=120, quiet=True)
        return json.loads(proc.stdout)

    def step(self) -> int | None:
        st = self.status().get("stack") or {}
        return (st.get("trainer") or {}).get("step")


@pytest.fixture(scope="module")
def runpod(instance_image: str, network: DockerNetwork, ssh_key: Path,
           tmp_path_factory: pytest.TempPathFactory) -> Iterator[Run]:
    machines = DockerMachines(network, instance_image, authorized_key="")
    fake = FakeProvider.start("runpod", network, machines, price=0.90, time_scale=6.0)
    root = tmp_path_factory.mktemp("x1-runpod")
    x1 = X1(root / "state", "RUNPOD_API_KEY")
    run = Run(fake, x1, root, run_env(root / "run.env"))
    try:
        yield run
    finally:
        for pid in [run.record().get("watchdog_pid")] if run.instance_id else []:
            if pid:
                with __import__("contextlib").suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGTERM)
        for inst in fake.live():
            machines.remove(inst)
        fake.stop()


@pytest.mark.timeout(600)
def test_launch_rents_a_pod_puts_the_run_on_it_and_starts_the_watchdog(runpod: Run, ssh_key: Path):
    proc = runpod.x1("launch", "--provider", "runpod", "--api-url", runpod.fake.url, "--ssh-key", str(ssh_key),
                     "--env-file", str(runpod.env_file), "--image", INSTANCE_IMAGE, "--yes",
                     "--watchdog-poll-seconds", "1", "--boot-timeout", "120", "--start-timeout", "400",
                     timeout=560)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    runpod.notes["launch_s"] = time.monotonic() - runpod.t0
    # the pre-launch sentence at the interruptible (spot) price the create asks for, $0.90, for the
    # .env's own TOTAL_STEPS at plan's tokens/s for this config
    assert ("This will launch 1× A100 PCIe (80 GB) [NVIDIA A100 80GB PCIe] interruptible on RunPod at $0.90/h, "
            "run ~0.8 h including setup = $0.68 (40 steps of .env's TOTAL_STEPS at plan's 8,338,900 tokens/s). "
            "Budget: $35. Confirmed acceptable, $34.32 buffer.") in out
    creates = runpod.fake.state()["create_calls"]
    assert len(creates) == 1 and creates[0]["env_keys"] == ["PUBLIC_KEY"]  # no secret in the pod's env
    runpod.instance_id = creates[0]["instance_id"]
    record = runpod.record()
    assert record["stage"] == "running" and record["host"] and record["port"] == 22
    # SSH: the host key pinned in the instance's own known_hosts on first contact
    known = (runpod.root / "state" / "instances" / runpod.instance_id / "known_hosts").read_text()
    assert len(known.splitlines()) >= 1 and "ssh-ed25519" in known
    host_key = runpod.on_instance("cat /etc/ssh/ssh_host_ed25519_key.pub").split()[1]
    assert host_key in known
    # the .env on the instance: mode 600, with the key; the key nowhere in x1's output or records
    assert runpod.on_instance("stat -c %a /workspace/x1/.env").strip() == "600"
    assert f"RUNPOD_API_KEY={API_KEY}" in runpod.on_instance("cat /workspace/x1/.env")
    assert API_KEY not in out
    assert not any(API_KEY in p.read_text(errors="replace") for p in (runpod.root / "state").rglob("*") if p.is_file())
    # how to watch it, and the off-host watchdog running here
    assert re.search(r"watch it: ssh -N -L \d+:127\.0\.0\.1:\d+ .*UserKnownHostsFile=", out)
    assert "http://127.0.0.1:" in out and "off-host watchdog started on this machine" in out
    assert "launch 7/7: running" in out
    os.kill(record["watchdog_pid"], 0)


@pytest.mark.timeout(300)
def test_status_shows_progress_spend_and_the_watchdogs_on_one_screen(runpod: Run):
    proc = runpod.x1("status")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout
    assert re.search(r"instance  RunPod \w+: running \(RUNNING\), NVIDIA A100 80GB PCIe, \$0\.90/h", out), out
    assert re.search(rf"training  step \d+/{TOTAL_STEPS} \(\d+\.\d% done", out), out
    assert "tok/s" in out and "ETA ~" in out
    assert re.search(r"spend     \$\d+\.\d\d so far, \$\d+\.\d\d projected at finish, against the \$35", out), out
    assert "watchdog  on the instance: started the trainer" in out
    assert "off-host watchdog:" in out


@pytest.mark.timeout(120)
def test_logs_shows_a_services_log(runpod: Run):
    proc = runpod.x1("logs", "-n", "50", "trainer")
    assert proc.returncode == 0, proc.stderr
    assert re.search(rf"step \d+/{TOTAL_STEPS} loss", proc.stdout), proc.stdout
    proc = runpod.x1("logs", "-n", "20", "stack")
    assert proc.returncode == 0 and "budget-sidecar" in proc.stdout


@pytest.mark.timeout(900)
def test_an_eviction_brings_the_pod_back_and_the_run_resumes_without_losing_a_step(runpod: Run):
    # After the second checkpoint, the provider interrupts the spot pod: the whole container stops.
    wait_for(lambda: (runpod.step() or 0) >= 2 * CKPT_EVERY + 2, 300, "step 22")
    checkpointed = int(runpod.on_instance("python3 -c \"import json; print(json.load(open("
                                          "'/workspace/ws/logs/heartbeat.json'))['step'])\"").strip() or 0) \
        // CKPT_EVERY * CKPT_EVERY
    t = time.monotonic()
    runpod.fake.control(preempt=True, instance_id=runpod.instance_id)
    machines = runpod.fake.machines
    wait_for(lambda: ("stop", runpod.instance_id) in machines.done, 60, "the container to stop")
    # The off-host watchdog sees it and resumes the pod; the start command brings the stack back.
    wait_for(lambda: runpod.fake.state()["resume_calls"], 120, "the off-host watchdog's podResume")
    wait_for(lambda: machines.done[-1] == ("start", runpod.instance_id) and machines.running(runpod.instance_id),
             60, "the container to run again")
    proc = runpod.x1("status")
    print(proc.stdout)
    resumed = wait_for(lambda: re.search(r"resuming from \S+ at step (\d+)", runpod.on_instance(
        "cat /workspace/ws/logs/trainer.log")), 300, "the trainer to resume")
    runpod.notes["eviction_to_resume_s"] = time.monotonic() - t
    # from the last checkpoint before the eviction (or a later one), never from the start
    assert int(resumed.group(1)) >= checkpointed >= 2 * CKPT_EVERY, resumed.group(0)
    events = [json.loads(line) for line in (runpod.root / "state" / "instances" / runpod.instance_id /
                                            "watchdog-events.jsonl").read_text().splitlines()]
    assert [e["event"] for e in events if e["event"] in ("exit", "relaunch")][:2] == ["exit", "relaunch"]
    assert any(e["event"] == "relaunch" and e["ok"] and e["reason"] == "instance-preempted" for e in events)
    # Then on to the end: the watchdog on the instance records the finish.
    wait_for(lambda: ((runpod.status().get("stack") or {}).get("watchdog") or {}).get("final"), 600,
             "the run to finish")
    proc = runpod.x1("status")
    assert "final decision: finished (exit 0)" in proc.stdout, proc.stdout
    assert "1 of the instance brought back by the off-host watchdog" in proc.stdout


@pytest.mark.timeout(600)
def test_down_fetches_terminates_and_the_fetched_folder_passes_all_six_checks(runpod: Run):
    out_dir = runpod.root / "fetched"
    proc = runpod.x1("down", "--output", str(out_dir), "--band", *BAND, timeout=500)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    run_dir = out_dir / "run"
    record = json.loads((run_dir / "termination.json").read_text())
    assert record["instance_id"] == runpod.instance_id and record["instance_after"]["status"] == "terminated"
    assert runpod.fake.state()["terminate_calls"] == [runpod.instance_id]
    wait_for(lambda: not runpod.fake.machines.exists(runpod.instance_id), 60, "the container to be removed")
    assert runpod.fake.live() == []
    assert not runpod.record().get("watchdog_pid") or not Path(f"/proc/{runpod.record()['watchdog_pid']}").exists() \
        or b"x1_watchdog" not in Path(f"/proc/{runpod.record()['watchdog_pid']}/cmdline").read_bytes()
    # dod on the fetched folder, as a user runs it: all six checks, the 6th from x1 down's record
    dod = subprocess.run([sys.executable, "-m", "x1_pretrain.dod", str(run_dir), "--band", *BAND],
                         capture_output=True, text=True, timeout=300)
    print(dod.stdout)
    assert dod.returncode == 0, dod.stdout + dod.stderr
    assert re.search(r"6\s+.*PASS", dod.stdout) and "all 6 checks pass" in dod.stdout
    # no step lost across the eviction: every logged step of the run is in its metrics, up to the last
    manifest = json.loads((run_dir / "manifest.json").read_text())
    assert manifest["termination"]["shows_terminated"] is True
    steps = logged_steps(run_dir)
    expected = set(range(LOG_EVERY, TOTAL_STEPS + 1, LOG_EVERY))
    assert expected <= steps, sorted(expected - steps)


def logged_steps(run_dir: Path) -> set[int]:
    """The steps with a training loss in the exported metrics (metrics.csv: step,name,value)."""
    import csv

    with open(run_dir / "metrics.csv", newline="") as f:
        return {int(float(row["step"])) for row in csv.DictReader(f) if row["name"] == "loss"}


@pytest.mark.timeout(120)
def test_a_second_down_is_harmless(runpod: Run):
    proc = runpod.x1("down")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    # the provider's own state read back, not the record's word for it
    assert f"instance {runpod.instance_id} is terminated: read back from the provider (TERMINATED)" in proc.stdout
    assert runpod.fake.state()["terminate_calls"] == [runpod.instance_id]  # no second terminate
    print(f"timings: {runpod.notes}")


# ---------------------------------------------------------------------------------------------
# Ctrl-C during a Lambda launch, at each stage


STAGES = {
    "price": "launch 1/7",
    "booting": "launch 3/7",
    "ssh": "launch 4/7",
    "upload": "launch 5/7",
    "start": "launch 6/7",
}


@pytest.fixture(scope="module")
def lambda_cloud(instance_image: str, network: DockerNetwork, ssh_key: Path) -> Iterator[FakeProvider]:
    machines = DockerMachines(network, instance_image, authorized_key=Path(f"{ssh_key}.pub").read_text().strip())
    fake = FakeProvider.start("lambda", network, machines, price=1.10, time_scale=60.0)
    try:
        yield fake
    finally:
        for inst in fake.live():
            machines.remove(inst)
        fake.stop()


@pytest.mark.timeout(300)
@pytest.mark.parametrize("stage", list(STAGES))
def test_ctrl_c_during_launch_leaves_no_instance_unrecorded(stage: str, lambda_cloud: FakeProvider, ssh_key: Path,
                                                           tmp_path: Path):
    fake = lambda_cloud
    before = set(fake.state()["instances"])
    x1 = X1(tmp_path / "state", "LAMBDA_API_KEY")
    # The price stage is over in a tenth of a second; a price over the ceiling with --wait holds the
    # launch there (re-checking), as it holds a user's, so the Ctrl-C lands in it.
    hold = ["--max-price-usd-per-hr", "0.01", "--wait", "--every-minutes", "5"] if stage == "price" else []
    running = x1.start("launch", "--provider", "lambda", "--api-url", fake.url, "--ssh-key", str(ssh_key),
                       "--ssh-key-name", "laptop", "--ssh-user", "root", "--stack", "processes",
                       "--env-file", str(run_env(tmp_path / "run.env")), "--yes", "--no-watchdog",
                       "--boot-timeout", "120", "--start-timeout", "300", *hold)
    running.wait_for_line(lambda line: STAGES[stage] in line, 200)
    running.proc.send_signal(signal.SIGINT)
    code = running.finish()
    assert code == 130, running.output
    new = set(fake.state()["instances"]) - before
    if stage == "price":
        assert new == set() and "nothing was rented" in running.output
        assert not (tmp_path / "state" / "instances").exists()
        return
    # The instance is known: its id and the command that ends it printed, its record on disk.
    assert len(new) == 1
    (instance_id,) = new
    command = f"x1 down --no-fetch --instance {instance_id}"  # the records' folder is X1_STATE_DIR's
    assert instance_id in running.output and command in running.output
    record = json.loads((tmp_path / "state" / "instances" / f"{instance_id}.json").read_text())
    assert record["instance_id"] == instance_id and not record["terminated"]
    assert fake.state()["instances"][instance_id]["status"] in ("active", "booting")
    # The printed command ends it.
    proc = x1(*command.split()[1:])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert fake.state()["instances"][instance_id]["status"] == "terminated"
    wait_for(lambda: not fake.machines.exists(instance_id), 60, "the container to be removed")
