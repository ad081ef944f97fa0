"""The watchdog against the provider's API, here the fake billing API as a real process:
--terminate-on-finish (the DoD's proof of termination) and provider mode (bring a preempted
instance back: RunPod podResume, Lambda relaunch of the same type, region, user-data and file
system)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from money import assert_fake_holds_nothing_unrecorded
from test_watchdog import Workdir, read_jsonl, scrape, wait_until

from budget_sidecar.testing import FakeBilling
from conftest import REPO, cli_env, free_port
from x1_pretrain.run import dod

API_KEY = "fake-billing-key-5c1e7a"
KEY_ENV = {"lambda": "LAMBDA_API_KEY", "runpod": "RUNPOD_API_KEY"}
TERMINATED = {"lambda": "terminated", "runpod": "TERMINATED"}


@pytest.fixture
def fakes(tmp_path: Path) -> Iterator[Callable[..., FakeBilling]]:
    started: list[FakeBilling] = []

    def start(provider: str, instance_id: str, **kw: Any) -> FakeBilling:
        fake = FakeBilling.start(tmp_path / "fake", provider=provider, instance_id=instance_id, api_key=API_KEY, **kw)
        started.append(fake)
        return fake

    try:
        yield start
    finally:
        for fake in started:
            fake.stop()


@pytest.fixture
def wd(tmp_path: Path) -> Iterator[Workdir]:
    w = Workdir(tmp_path)
    try:
        yield w
    finally:
        w.cleanup()


def provider_env(provider: str) -> dict[str, str]:
    return cli_env(**{KEY_ENV[provider]: API_KEY})


def assert_no_key(*texts: str) -> None:
    for text in texts:
        assert API_KEY not in text


# --------------------------------------------------------------------------------------------
# --terminate-on-finish


@pytest.mark.parametrize("provider", ["lambda", "runpod"])
def test_terminate_on_finish_leaves_the_instance_terminated_and_writes_termination_json(
    wd: Workdir, fakes: Callable[..., FakeBilling], provider: str
):
    fake = fakes(provider, "inst-1")
    termination = wd.root / "logs" / "termination.json"
    rc = wd.run(["--steps", "1", "--step-seconds", "0.05"], "--terminate-on-finish", "--provider", provider,
                "--api-url", fake.url, "--instance-id", "inst-1", "--termination-file", str(termination),
                env=provider_env(provider))
    assert rc == 0, wd.log()

    state = fake.state()
    assert state["instances"]["inst-1"]["status"] == TERMINATED[provider]
    assert state["terminate_calls"] == ["inst-1"]
    record = json.loads(termination.read_text())
    assert record["provider"] == provider and record["instance_id"] == "inst-1" and record["exit_code"] == 0
    assert "data" in record["response"]
    assert record["instance_after"]["status"] == "terminated"
    assert wd.kinds() == ["start", "exit", "terminate"]
    assert wd.events[-1]["ok"] is True
    assert wd.state["final"]["terminated"] is True
    assert_no_key(termination.read_text(), wd.events_file.read_text(), wd.log(), wd.state_file.read_text())


@pytest.mark.parametrize(("code", "terminated"), [(77, True), (78, False)])
def test_budget_stop_terminates_but_a_refused_launch_does_not(
    wd: Workdir, fakes: Callable[..., FakeBilling], code: int, terminated: bool
):
    fake = fakes("runpod", "pod-1")
    rc = wd.run(["--steps", "0", "--exit-code", str(code)], "--terminate-on-finish", "--provider", "runpod",
                "--api-url", fake.url, "--instance-id", "pod-1", "--termination-file", str(wd.root / "t.json"),
                env=provider_env("runpod"))
    assert rc == code, wd.log()
    assert (fake.state()["terminate_calls"] == ["pod-1"]) is terminated
    assert (wd.root / "t.json").exists() is terminated


def test_failed_terminate_is_alerted_and_retried_by_a_restarted_watchdog(wd: Workdir, fakes: Callable[..., FakeBilling]):
    fake = fakes("lambda", "inst-1")
    fake.control(fail_mode="500")
    opts = ["--terminate-on-finish", "--provider", "lambda", "--api-url", fake.url, "--instance-id", "inst-1",
            "--termination-file", str(wd.root / "termination.json"), "--terminate-confirm-seconds", "2"]
    assert wd.run(["--steps", "0"], *opts, env=provider_env("lambda")) == 82, wd.log()
    assert wd.events[-1]["event"] == "terminate" and wd.events[-1]["ok"] is False
    assert "ALERT" in wd.log() and "STILL BILLING" in wd.log() and "x1 down --provider lambda --instance inst-1" in wd.log()
    record = json.loads((wd.root / "termination.json").read_text())
    assert record["confirmed"] is False and record["state"] == "terminate sent, still billing"
    assert wd.state["final"]["terminated"] is False
    assert_fake_holds_nothing_unrecorded(fake, {"inst-1": record})

    fake.control(fail_mode="none")
    assert wd.run(["--steps", "0"], *opts, env=provider_env("lambda")) == 0, wd.log()
    assert fake.state()["instances"]["inst-1"]["status"] == "terminated"
    record = json.loads((wd.root / "termination.json").read_text())
    assert record["instance_id"] == "inst-1" and record["confirmed"] is True
    assert len(wd.starts) == 1  # the finished run was not relaunched to get there
    assert_fake_holds_nothing_unrecorded(fake, {"inst-1": record})


@pytest.mark.parametrize("provider", ["lambda", "runpod"])
def test_a_terminate_answered_ok_that_leaves_the_instance_running_is_still_billing(
    wd: Workdir, fakes: Callable[..., FakeBilling], provider: str, tmp_path: Path
):
    fake = fakes(provider, "inst-1")
    fake.control(terminate_effect={"mode": "ignore"})  # podTerminate / terminate answer ok; it runs on
    termination = wd.root / "logs" / "termination.json"
    opts = ["--terminate-on-finish", "--provider", provider, "--api-url", fake.url, "--instance-id", "inst-1",
            "--termination-file", str(termination), "--terminate-confirm-seconds", "2"]
    assert wd.run(["--steps", "0"], *opts, env=provider_env(provider)) == 82, wd.log()
    assert len(fake.state()["terminate_calls"]) >= 2  # sent again while it was listed running
    assert fake.state()["instances"]["inst-1"]["billing"]
    record = json.loads(termination.read_text())
    assert record["confirmed"] is False and record["state"] == "terminate sent, still billing"
    assert record["instance_after"]["raw_status"] == ("active" if provider == "lambda" else "RUNNING")
    assert wd.events[-1]["event"] == "terminate" and wd.events[-1]["ok"] is False
    assert wd.state["final"]["terminated"] is False
    assert wd.state["final"]["termination_state"] == "terminate sent, still billing"
    assert "instance inst-1 STILL BILLING" in wd.log() and "instance inst-1 terminated" not in wd.log()
    folder = tmp_path / "run"
    folder.mkdir()
    (folder / "termination.json").write_text(termination.read_text())
    assert not dod.check_termination(folder).ok  # the answer "ok" alone never proves it
    assert_fake_holds_nothing_unrecorded(fake, {"inst-1": record})

    # A restarted watchdog reads it back and sends again; the provider ends it asynchronously.
    fake.control(terminate_effect={"mode": "async", "delay_s": 1})
    assert wd.run(["--steps", "0"], *opts[:-2], "--terminate-confirm-seconds", "30", env=provider_env(provider)) == 0
    assert "a terminate was sent before" in wd.log()
    record = json.loads(termination.read_text())
    assert record["confirmed"] is True and record["instance_after"]["raw_status"] == TERMINATED[provider]
    assert wd.state["final"]["terminated"] is True and len(wd.starts) == 1
    (folder / "termination.json").write_text(termination.read_text())
    assert dod.check_termination(folder).ok
    assert_fake_holds_nothing_unrecorded(fake, {"inst-1": record})


@pytest.mark.parametrize("provider", ["lambda", "runpod"])
def test_provider_mode_takes_a_proxys_404_page_for_an_outage_not_for_the_end(
    wd: Workdir, fakes: Callable[..., FakeBilling], provider: str
):
    fake = fakes(provider, "inst-1")
    keeper = Keeper(wd, provider, fake, "inst-1")
    wait_until(lambda: keeper.events("start"), 30, "the instance seen running")
    fake.control(fault={"mode": "404-html", "on": "get"})
    wait_until(lambda: "poll 1 failed" in keeper.log(), 60, "a failed poll")
    assert keeper.proc.poll() is None, keeper.log()  # not "gone": still watching
    assert keeper.events("exit") == [] and "not the" in keeper.log()
    fake.control(fault=None, terminate=True)
    assert keeper.proc.wait(30) == 0, keeper.log()
    assert_fake_holds_nothing_unrecorded(fake)


def instance_volume_with_a_run_folder(root: Path) -> Path:
    """The instance's workspace volume holding the trainer's exported run folder (a manifest and a file)."""
    run = root / "instance-volume" / "run"
    run.mkdir(parents=True)
    (run / "manifest.json").write_text(json.dumps({"format": 1, "end": "finished", "files": {}}))
    (run / "final.safetensors").write_bytes(bytes(range(256)) * 64)
    return run


def test_run_folder_survives_a_terminate_on_finish(wd: Workdir, fakes: Callable[..., FakeBilling]):
    fake = fakes("lambda", "inst-1")
    run = instance_volume_with_a_run_folder(wd.root)
    weights = (run / "final.safetensors").read_bytes()
    persistent = wd.root / "persistent-fs"
    rc = wd.run(["--steps", "1", "--step-seconds", "0.05"], "--terminate-on-finish", "--provider", "lambda",
                "--api-url", fake.url, "--instance-id", "inst-1", "--termination-file", str(wd.root / "t.json"),
                "--run-dir", str(run), "--keep-run-dir", str(persistent), env=provider_env("lambda"))
    assert rc == 0, wd.log()
    assert fake.state()["instances"]["inst-1"]["status"] == "terminated"
    shutil.rmtree(wd.root / "instance-volume")  # what the terminate does to the instance's disk

    kept = persistent / "run-inst-1"
    assert (kept / "final.safetensors").read_bytes() == weights
    assert json.loads((kept / "termination.json").read_text())["instance_id"] == "inst-1"
    assert json.loads((kept / "manifest.json").read_text())["termination"]["instance_id"] == "inst-1"
    assert "copied to" in wd.log() and "every file verified" in wd.log()
    assert [p.name for p in persistent.iterdir()] == ["run-inst-1"]  # no temp folder left


def test_terminate_on_finish_refuses_while_run_folder_is_only_on_the_instance_volume(
        wd: Workdir, fakes: Callable[..., FakeBilling]):
    fake = fakes("lambda", "inst-1")
    run = instance_volume_with_a_run_folder(wd.root)
    rc = wd.run(["--steps", "1", "--step-seconds", "0.05"], "--terminate-on-finish", "--provider", "lambda",
                "--api-url", fake.url, "--instance-id", "inst-1", "--termination-file", str(wd.root / "t.json"),
                "--run-dir", str(run), env=provider_env("lambda"))
    assert rc == 0, wd.log()
    assert fake.state()["terminate_calls"] == []  # the instance, and the folder on it, are still there
    assert fake.state()["instances"]["inst-1"]["status"] != "terminated"
    log = wd.log()
    assert "terminate of instance inst-1 REFUSED" in log and "only on this instance's volume" in log
    assert "RESULTS_DIR" in log and "still billing" in log  # the alert says what to do
    assert wd.events[-1]["event"] == "terminate" and wd.events[-1]["refused"] is True
    assert not (wd.root / "t.json").exists() and (run / "manifest.json").is_file()


# --------------------------------------------------------------------------------------------
# Provider mode


class Keeper:
    """`python -m x1_watchdog --mode provider` as a process, with its files."""

    def __init__(self, wd: Workdir, provider: str, fake: FakeBilling, instance_id: str, *opts: str,
                 port: int = 0) -> None:
        self.wd = wd
        self.log_path = wd.root / f"keeper-{len(wd.logs)}.log"
        wd.logs.append(self.log_path)
        args = [
            sys.executable, "-m", "x1_watchdog", "--mode", "provider", "--provider", provider, "--api-url", fake.url,
            "--instance-id", instance_id, "--poll-seconds", "0.2", "--backoff-base-seconds", "0.05",
            "--events-file", str(wd.events_file), "--state-file", str(wd.state_file), "--port", str(port), *opts,
        ]
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, env=provider_env(provider),
                                         cwd=REPO, start_new_session=True)
        wd.procs.append(self.proc)

    def events(self, kind: str) -> list[dict[str, Any]]:
        return [e for e in read_jsonl(self.wd.events_file) if e["event"] == kind]

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")


def test_provider_mode_resumes_a_preempted_runpod_pod_and_stops_when_it_is_terminated(
    wd: Workdir, fakes: Callable[..., FakeBilling]
):
    fake = fakes("runpod", "pod-1", boot_seconds=0.3)
    port = free_port()
    keeper = Keeper(wd, "runpod", fake, "pod-1", port=port)
    wait_until(lambda: keeper.events("start"), 30, "the pod seen running")

    fake.control(preempt=True)
    relaunch = wait_until(lambda: keeper.events("relaunch"), 30, "the pod brought back")[0]
    assert relaunch["ok"] is True and relaunch["reason"] == "instance-preempted" and relaunch["instance_id"] == "pod-1"
    back = wait_until(lambda: keeper.events("start")[1:], 30, "the pod running again")[0]
    assert back["downtime_seconds"] > 0 and back["restart"] == 1
    assert fake.state()["resume_calls"] == [{"pod_id": "pod-1", "gpu_count": 1}]
    metrics = scrape(port)
    assert metrics[("x1_watchdog_restarts_total", (("reason", "instance-preempted"),))] == 1
    assert metrics[("x1_watchdog_trainer_up", ())] == 1
    assert metrics[("x1_watchdog_downtime_seconds_total", ())] > 0

    fake.control(terminate=True)  # the run's own watchdog (or you) terminated it: done
    assert keeper.proc.wait(30) == 0, keeper.log()
    assert keeper.events("exit")[-1]["reason"] == "instance-terminated"
    assert len(fake.state()["resume_calls"]) == 1
    assert_no_key(keeper.log(), wd.events_file.read_text())

    again = Keeper(wd, "runpod", fake, "pod-1")  # a restarted keeper honours the end
    assert again.proc.wait(30) == 0
    assert "final decision" in again.log()


def test_provider_mode_relaunches_a_preempted_lambda_instance_and_follows_the_new_id(
    wd: Workdir, fakes: Callable[..., FakeBilling]
):
    fake = fakes("lambda", "inst-1", boot_seconds=0.3)
    user_data = wd.root / "cloud-init.yaml"
    user_data.write_text("#cloud-config\nruncmd:\n  - [sh, -c, 'cd /lambda/nfs/x1-fs/x1 && docker compose up -d']\n")
    opts = ["--user-data-file", str(user_data), "--file-system-name", "x1-fs", "--ssh-key-name", "me"]
    keeper = Keeper(wd, "lambda", fake, "inst-1", *opts)
    wait_until(lambda: keeper.events("start"), 30, "the instance seen running")

    fake.control(preempt=True)
    relaunch = wait_until(lambda: keeper.events("relaunch"), 30, "the relaunch")[0]
    launch = fake.state()["launch_calls"][0]
    new_id = launch["instance_id"]
    assert relaunch["ok"] is True and relaunch["instance_id"] == new_id and relaunch["previous_instance_id"] == "inst-1"
    assert launch["instance_type_name"] == "gpu_1x_a100_sxm4" and launch["region_name"] == "us-east-1"
    assert launch["file_system_names"] == ["x1-fs"] and launch["ssh_key_names"] == ["me"]
    assert launch["user_data"] == user_data.read_text()
    back = wait_until(lambda: keeper.events("start")[1:], 30, "the new instance running")[0]
    assert back["instance_id"] == new_id and back["downtime_seconds"] > 0
    assert wd.state["instance_id"] == new_id and wd.state["origin_instance_id"] == "inst-1"

    fake.control(terminate=True, instance_id=new_id)
    assert keeper.proc.wait(30) == 0, keeper.log()
    assert len(fake.state()["launch_calls"]) == 1


def test_provider_api_outage_is_not_mistaken_for_a_preemption(wd: Workdir, fakes: Callable[..., FakeBilling]):
    fake = fakes("runpod", "pod-1")
    keeper = Keeper(wd, "runpod", fake, "pod-1")
    wait_until(lambda: keeper.events("start"), 30, "the pod seen running")
    fake.control(fail_mode="garbage")
    wait_until(lambda: "poll 3 failed" in keeper.log(), 30, "three failed polls")
    assert "ALERT" in keeper.log()  # a person hears that preemptions go unseen
    assert keeper.proc.poll() is None
    assert keeper.events("exit") == [] and keeper.events("relaunch") == []
    fake.control(fail_mode="none", terminate=True)
    assert keeper.proc.wait(30) == 0, keeper.log()
    assert fake.state()["resume_calls"] == []


def test_provider_mode_gives_up_after_max_restarts(wd: Workdir, fakes: Callable[..., FakeBilling]):
    fake = fakes("runpod", "pod-1")
    keeper = Keeper(wd, "runpod", fake, "pod-1", "--max-restarts", "0")
    wait_until(lambda: keeper.events("start"), 30, "the pod seen running")
    fake.control(preempt=True)
    assert keeper.proc.wait(30) == 1, keeper.log()
    assert keeper.events("give_up")[0]["reason"] == "instance-preempted"
    assert fake.state()["resume_calls"] == []
    assert wd.state["final"]["reason"] == "given-up"


# --------------------------------------------------------------------------------------------
# The finish: the trainer's run folder, then the terminate, on the workspace volume


def test_the_finish_leaves_a_run_folder_that_passes_all_six_checks_after_the_terminate(
    wd: Workdir, fakes: Callable[..., FakeBilling], tiny_data: Path
):
    from datetime import timedelta

    from conftest import train_args
    from x1_common.contracts import BudgetReading, utc_now

    fake = fakes("lambda", "inst-1")
    root = wd.root  # the /workspace layout: checkpoints/, logs/, budget.json, run/
    reading = BudgetReading(spent_usd=2.5, rate_usd_per_hr=1.10, hours_elapsed=2.3, projected_total_usd=26.4,
                            last_update_utc=utc_now() - timedelta(minutes=1), cap_usd=35.0, provider="lambda",
                            instance_id="inst-1", source="provider-api")
    (root / "budget.json").write_text(json.dumps(reading.to_dict()))
    run_dir, termination = root / "run", root / "logs" / "termination.json"
    trainer = [sys.executable, "-m", "x1_pretrain.train",
               *train_args(tiny_data, root / "checkpoints", f"sqlite:///{root / 'mlflow.db'}", "--run-dir", str(run_dir),
                           "--inject-spike-at-step", "6", total=16)]
    log_path = root / "watchdog.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "x1_watchdog", "--heartbeat-file", str(root / "checkpoints" / "heartbeat.json"),
             "--events-file", str(wd.events_file), "--state-file", str(wd.state_file), "--port", "0",
             "--terminate-on-finish", "--provider", "lambda", "--api-url", fake.url, "--instance-id", "inst-1",
             "--termination-file", str(termination), "--run-dir", str(run_dir),
             "--keep-run-dir", str(root / "persistent"), "--", *trainer],
            stdout=log, stderr=subprocess.STDOUT, env=provider_env("lambda"), cwd=REPO, start_new_session=True)
    wd.procs.append(proc)
    assert proc.wait(300) == 0, log_path.read_text()[-4000:]
    text = log_path.read_text()

    # One sequence: the trainer's export, post-mortem and dod (check 6 pending), then the terminate.
    assert text.index("1/3 export_run") < text.index("2/3 the spike post-mortem") < text.index("3/3 dod")
    assert text.index("3/3 dod") < text.index("terminating lambda instance inst-1")
    assert "PENDING" in text and fake.state()["instances"]["inst-1"]["status"] == "terminated"
    assert wd.kinds() == ["start", "exit", "terminate"]
    assert wd.events[-1]["run_folder"].startswith(f"termination.json added to {run_dir}; dod check 6 PASS")
    assert "; kept copy: termination.json added to" in wd.events[-1]["run_folder"]

    # The provider's answer is in the run folder, the manifest and dod.json agree with it...
    for name in ("manifest.json", "final.safetensors", "spike-postmortem.md", "dod.json", "termination.json"):
        assert (run_dir / name).is_file(), name
    manifest = json.loads((run_dir / "manifest.json").read_text())
    assert manifest["termination"]["shows_terminated"] is True
    from x1_common.fsutil import sha256_file

    assert manifest["files"]["termination.json"] == sha256_file(run_dir / "termination.json")
    report = json.loads((run_dir / "dod.json").read_text())
    assert report["pending"] == [] and [c["ok"] for c in report["checks"]][5] is True
    assert_no_key(*(p.read_text(errors="replace") for p in run_dir.iterdir() if p.suffix in (".json", ".md")), text)

    # ...so a later dod on the copy kept off the instance passes all six (band: the tiny run's own).
    moved = root / "persistent" / "run-inst-1"
    val = manifest["final_val_loss"]
    proc = subprocess.run([sys.executable, "-m", "x1_pretrain.dod", str(moved), "--band", f"{val - 0.5:.3f}",
                           f"{val + 0.5:.3f}"], capture_output=True, text=True, cwd=REPO, env=cli_env(), timeout=120)
    assert proc.returncode == 0 and "all 6 checks pass" in proc.stdout, proc.stdout + proc.stderr


def test_a_terminate_without_the_trainers_run_folder_is_refused_naming_the_missing_export(
    wd: Workdir, fakes: Callable[..., FakeBilling]
):
    fake = fakes("lambda", "inst-1")
    rc = wd.run(["--steps", "1", "--step-seconds", "0.05"], "--terminate-on-finish", "--provider", "lambda",
                "--api-url", fake.url, "--instance-id", "inst-1", "--termination-file", str(wd.root / "t.json"),
                "--run-dir", str(wd.root / "run"), "--keep-run-dir", str(wd.root / "kept"), env=provider_env("lambda"))
    assert rc == 0, wd.log()
    assert fake.state()["terminate_calls"] == []  # the checkpoints on the instance are all there is of the run
    assert wd.events[-1]["refused"] is True and "has no manifest.json" in wd.events[-1]["error"]
    assert "python -m x1_pretrain.finish --output" in wd.log() and not (wd.root / "kept").exists()


# --------------------------------------------------------------------------------------------
# The repository's cloud-init, as provider mode sends it


CLOUD_INIT = REPO / "cloud-init.yaml"


def cloud_init_script(user_data: str) -> str:
    import yaml

    assert user_data.startswith("#cloud-config\n")
    doc = yaml.safe_load(user_data)
    (script,) = [f["content"] for f in doc["write_files"] if f["path"] == "/usr/local/bin/x1-up"]
    assert any("/usr/local/bin/x1-up" in " ".join(map(str, cmd)) for cmd in doc["runcmd"])
    return script


def test_provider_mode_sends_the_repositorys_cloud_init_and_it_starts_the_stack_as_the_new_instance(
    wd: Workdir, fakes: Callable[..., FakeBilling], tmp_path: Path
):
    fake = fakes("lambda", "inst-1", boot_seconds=0.3)
    keeper = Keeper(wd, "lambda", fake, "inst-1", "--user-data-file", str(CLOUD_INIT), "--file-system-name", "x1-fs")
    wait_until(lambda: keeper.events("start"), 30, "the instance seen running")
    fake.control(preempt=True)
    wait_until(lambda: keeper.events("relaunch"), 30, "the relaunch")
    launch = fake.state()["launch_calls"][0]
    new_id = launch["instance_id"]
    # The file as shipped, with the name of the instance it launches in place of the placeholder.
    assert launch["user_data"] == CLOUD_INIT.read_text().replace("__X1_INSTANCE_NAME__", launch["name"])
    assert launch["file_system_names"] == ["x1-fs"]
    fake.control(terminate=True, instance_id=new_id)
    assert keeper.proc.wait(30) == 0, keeper.log()

    # What that user-data runs on the new instance: the checkout on the persistent file system
    # (here a folder), a `docker` that records what it is asked, the fake's Lambda API for the lookup.
    fake2 = fakes("lambda", "inst-9")
    renamed = fake2.url  # a second fake in which the launched instance is listed under its name
    from x1_common.providers import make_client

    found_id = make_client("lambda", renamed, API_KEY).launch("gpu_1x_a100_sxm4", "us-east-1", name=launch["name"],
                                                              ssh_key_names=(), file_system_names=("x1-fs",),
                                                              user_data=None)
    checkout = tmp_path / "nfs" / "x1"
    checkout.mkdir(parents=True)
    (checkout / ".env").write_text(f"PROVIDER=lambda\nINSTANCE_ID=inst-1\nLAMBDA_API_KEY={API_KEY}\n"
                                   f"PROVIDER_API_URL={renamed}\nX1_WORKSPACE=/lambda/nfs/x1-fs/workspace\n")
    bin_dir, calls = tmp_path / "bin", tmp_path / "docker-calls.txt"
    bin_dir.mkdir()
    (bin_dir / "docker").write_text(f"#!/bin/sh\necho \"$* DOCKER_GID=$DOCKER_GID $(grep ^INSTANCE_ID= .env)\" >> {calls}\n")
    (bin_dir / "docker").chmod(0o755)
    socket_file = tmp_path / "docker.sock"
    socket_file.write_text("")
    script = tmp_path / "x1-up"
    script.write_text(cloud_init_script(launch["user_data"]))
    env = cli_env(X1_DIR=str(checkout), DOCKER_SOCKET=str(socket_file), PATH=f"{bin_dir}:/usr/bin:/bin")
    proc = subprocess.run(["bash", str(script)], capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    gid = socket_file.stat().st_gid
    assert calls.read_text().splitlines() == [f"compose build DOCKER_GID={gid} INSTANCE_ID={found_id}",
                                              f"compose up -d DOCKER_GID={gid} INSTANCE_ID={found_id}"]
    env_text = (checkout / ".env").read_text()
    assert f"INSTANCE_ID={found_id}\n" in env_text and "INSTANCE_ID=inst-1" not in env_text
    assert "X1_WORKSPACE=/lambda/nfs/x1-fs/workspace" in env_text and (checkout / ".env").stat().st_mode & 0o777 == 0o600
    assert API_KEY not in proc.stdout + proc.stderr


def test_the_first_instance_keeps_the_instance_id_of_its_env(tmp_path: Path):
    checkout = tmp_path / "x1"
    checkout.mkdir()
    (checkout / ".env").write_text("INSTANCE_ID=inst-1\n")
    bin_dir, calls = tmp_path / "bin", tmp_path / "calls.txt"
    bin_dir.mkdir()
    (bin_dir / "docker").write_text(f"#!/bin/sh\necho \"$*\" >> {calls}\n")
    (bin_dir / "docker").chmod(0o755)
    (tmp_path / "sock").write_text("")
    script = tmp_path / "x1-up"
    script.write_text(cloud_init_script(CLOUD_INIT.read_text()))  # as the user gives it: no name filled in
    proc = subprocess.run(["bash", str(script)], capture_output=True, text=True, timeout=60,
                          env=cli_env(X1_DIR=str(checkout), DOCKER_SOCKET=str(tmp_path / "sock"),
                                      PATH=f"{bin_dir}:/usr/bin:/bin"))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "first instance: INSTANCE_ID from .env" in proc.stdout
    assert calls.read_text().splitlines() == ["compose build", "compose up -d"]
    assert (checkout / ".env").read_text() == "INSTANCE_ID=inst-1\n"
    missing = subprocess.run(["bash", str(script)], capture_output=True, text=True, timeout=60,
                             env=cli_env(X1_DIR=str(tmp_path / "absent"), WAIT_SECONDS="0"))
    assert missing.returncode == 1 and "is the file system attached" in missing.stdout
