"""`docker compose up` for real: the stack built and run on a real Docker Engine, every scenario
through containers (tests/compose_stack.py has the harness).

The images are built once for the session. Two compose projects share them: `run`, one training
run taken through what a run lives through, in order (prepare, up, monitoring, a preemption, a
watchdog restart, a kill, the finish, a second `up`, export and DoD), and `budget`, a run stopped
by its budget. Both use compose.cpu.yaml (no GPU) and the fake billing API as a container on the
compose network (tests/docker/compose.fake-billing.yaml).

Where no engine is reachable these tests skip with the reason; under CI=true they fail instead:
.ci/run sets the engine up, so a skip there would hide a broken setup.
"""

from __future__ import annotations

import hashlib
import json
import math
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from compose_stack import PYTHON_IMAGE, TORCH_IMAGE, X1_IMAGES, ComposeStack, require_engine, run, wait_for

pytestmark = pytest.mark.slow

TOTAL_STEPS = 150  # ~1 s a step on a busy 2-core machine; the val loss ends near 6.26, well inside BAND
BAND = ("4.5", "7.0")  # the tiny model's DoD band (x1_pretrain.demo explains it)


@pytest.fixture(scope="session")
def engine() -> None:
    require_engine("the Docker tests")


@pytest.fixture(scope="session")
def images(engine: None, tmp_path_factory: pytest.TempPathFactory) -> dict[str, float]:
    """`docker compose build` once for every scenario (and the monitoring profile's Prometheus)."""
    stack = ComposeStack(tmp_path_factory.mktemp("docker-build"), "build")
    t = time.monotonic()
    stack.compose("build", timeout=1800)
    stack.compose("build", "prometheus", profiles=["monitoring"], timeout=900)
    return {"build_seconds": time.monotonic() - t}


def new_events(stack: ComposeStack, since: int, kind: str | None = None) -> list[dict[str, Any]]:
    events = stack.events()[since:]
    return [e for e in events if kind is None or e["event"] == kind]


def trainer_state(stack: ComposeStack) -> dict[str, Any]:
    return stack.container("trainer")["State"]


def logged_steps(stack: ComposeStack) -> list[int]:
    return [step for step, _ in stack.metric_history("loss")]


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


# ---------------------------------------------------------------------------------------------
# The build


@pytest.mark.timeout(2400)
def test_images_build_on_the_selected_base_images(images):
    for image in X1_IMAGES:
        config = json.loads(run(["docker", "image", "inspect", image]).stdout)[0]["Config"]
        assert config["User"] == "1000:1000", f"{image} runs as {config['User']!r}"
    # The trainer is built on the base the build argument selected: the local CPU torch image's torch.
    proc = run(["docker", "run", "--rm", "x1-trainer:0.1.0", "python", "-c",
                "import torch, x1_pretrain; print(torch.__version__)"])
    expected = run(["docker", "run", "--rm", TORCH_IMAGE, "python", "-c", "import torch; print(torch.__version__)"])
    assert proc.stdout.strip() == expected.stdout.strip() == "2.13.0+cpu"
    # The Python services on PYTHON_IMAGE: Debian's python3 there, as in the base.
    base_py = run(["docker", "run", "--rm", PYTHON_IMAGE, "python", "--version"]).stdout.strip()
    assert run(["docker", "run", "--rm", "x1-watchdog:0.1.0", "python", "--version"]).stdout.strip() == base_py
    # The CA bundle was a build secret: no layer and no history line holds it.
    for image in X1_IMAGES:
        history = run(["docker", "history", "--no-trunc", "--format", "{{.CreatedBy}}", image]).stdout
        assert "BEGIN CERTIFICATE" not in history
    print(f"images built in {images['build_seconds']:.0f} s")


@pytest.mark.timeout(900)
def test_a_trainer_image_whose_torch_drifts_from_the_pin_fails_its_build(images, tmp_path_factory):
    # The stand-in base carries the CPU build of torch: asked to pin the CUDA build (as the GPU
    # image does), the check after the install fails the build, naming what is installed.
    stack = ComposeStack(tmp_path_factory.mktemp("docker-drift"), "drift", X1_TEST_TORCH_CUDA="13.0")
    proc = stack.compose("build", "trainer", timeout=900, check=False)
    assert proc.returncode != 0
    assert "x1-torch-pin: torch 2.13.0+cpu is built for CUDA none (CPU build), the image pins CUDA 13.0" in \
        proc.stdout + proc.stderr


# ---------------------------------------------------------------------------------------------
# One run, from prepare to DoD


@pytest.fixture(scope="module")
def stack(images, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ComposeStack]:
    root = tmp_path_factory.mktemp("docker-run")
    results = root / "results"  # storage that outlives the instance: the run folder is copied here first
    results.mkdir()
    results.chmod(0o777)  # the watchdog's image runs as uid 1000
    s = ComposeStack(root, "run",
                     TOTAL_STEPS=str(TOTAL_STEPS), CKPT_EVERY="20", EVAL_EVERY="50",
                     TRAIN_EXTRA_ARGS="--inject-spike-at-step 100", TERMINATE_ON_FINISH="1",
                     RESULTS_DIR=str(results), X1_TEST_PRICE_USD_PER_HR="0.50")
    try:
        yield s
    finally:
        s.down()


@pytest.mark.timeout(900)
def test_prepare_container_tokenizes_real_text(stack):
    # Real English: the docstrings of the container's own Python standard library.
    stack.compose("run", "--rm", "--no-deps", "prepare", "sh", "-c",
                  "python -m x1_pretrain.corpus stdlib-docstrings --output /workspace/data/raw --max-mb 2 && "
                  "python -m x1_pretrain.tokenize_data --input-dir /workspace/data/raw "
                  "--output-dir /workspace/data/tokenized --tokenizer gpt2 --val-fraction 0.05 --workers 2",
                  timeout=600)
    meta = json.loads(stack.path("data/tokenized/meta.json").read_text())
    assert meta["tokenizer"] == "gpt2" and meta["documents"] > 100
    assert meta["train_tokens"] > 200_000 and meta["val_tokens"] > 1_000
    assert stack.path("data/tokenized/train.bin").stat().st_size == 2 * meta["train_tokens"]  # uint16


@pytest.mark.timeout(900)
def test_up_brings_every_service_to_healthy(stack):
    stack.compose("up", "-d", timeout=600)
    for service in ("trainer", "budget-sidecar", "watchdog", "mlflow-server", "fake-billing"):
        wait_for(lambda s=service: stack.health(s) == "healthy", 300, f"{service} healthy", diagnose=stack.logs)
    assert trainer_state(stack)["Running"]
    assert stack.http_json("SIDECAR_HOST_PORT", "/healthz")["status"] == "ok"


@pytest.mark.timeout(600)
def test_monitoring_profile_scrapes_the_three_services_by_name_and_answers_tokens_and_spend(stack):
    stack.compose("up", "-d", "prometheus", profiles=["monitoring"], timeout=300)
    wait_for(lambda: stack.health("prometheus") == "healthy", 120, "prometheus healthy", diagnose=stack.logs)

    def targets_up() -> dict[str, str]:
        doc = stack.http_json("PROMETHEUS_HOST_PORT", "/api/v1/targets")
        up = {t["labels"]["job"]: t["scrapeUrl"] for t in doc["data"]["activeTargets"] if t["health"] == "up"}
        return up if len(up) == 3 else {}

    up = wait_for(targets_up, 180, "the three scrape targets up", every=2, diagnose=stack.logs)
    assert up == {"trainer": "http://trainer:9791/metrics", "budget-sidecar": "http://budget-sidecar:9792/metrics",
                  "watchdog": "http://watchdog:9793/metrics"}

    def query(expr: str) -> list[dict[str, Any]]:
        return stack.http_json("PROMETHEUS_HOST_PORT", "/api/v1/query", query=expr)["data"]["result"]

    tokens = wait_for(lambda: [r for r in query("x1_train_tokens_per_second") if float(r["value"][1]) > 0], 180,
                      "a tokens/s sample above 0", every=2, diagnose=stack.logs)
    assert tokens[0]["metric"]["job"] == "trainer"
    spend = wait_for(lambda: query("x1_budget_spent_usd"), 60, "a spend sample", every=2)
    assert spend[0]["metric"]["job"] == "budget-sidecar" and 0 <= float(spend[0]["value"][1]) < 35
    assert float(query("x1_watchdog_healthy")[0]["value"][1]) == 1


@pytest.mark.timeout(600)
def test_trainer_trains_and_logs_to_mlflow(stack):
    history = wait_for(lambda: (h := stack.metric_history("loss")) and len(h) >= 2 and h, 300,
                       "two loss points in MLflow", every=2, diagnose=stack.logs)
    assert [step for step, _ in history][:2] == [10, 20]
    assert all(math.isfinite(v) for _, v in history) and history[-1][1] < history[0][1] + 1.0
    assert 0 < stack.heartbeat()["step"] < TOTAL_STEPS


def test_every_port_is_published_on_127_0_0_1_only(stack):
    published = {}
    for c in stack.ps():
        service = c["Config"]["Labels"]["com.docker.compose.service"]
        for port, bindings in (c["NetworkSettings"]["Ports"] or {}).items():
            for b in bindings or []:
                assert b["HostIp"] == "127.0.0.1", f"{service}: {port} published on {b['HostIp']}"
                published[service] = int(b["HostPort"])
    assert published == {
        "trainer": int(stack.ports["TRAINER_METRICS_HOST_PORT"]),
        "budget-sidecar": int(stack.ports["SIDECAR_HOST_PORT"]),
        "watchdog": int(stack.ports["WATCHDOG_METRICS_HOST_PORT"]),
        "mlflow-server": int(stack.ports["MLFLOW_HOST_PORT"]),
        "prometheus": int(stack.ports["PROMETHEUS_HOST_PORT"]),
    }  # the fake billing API, with its unauthenticated control plane, is published nowhere


@pytest.mark.timeout(900)
def test_sigterm_to_the_trainer_exits_75_and_is_resumed_with_no_step_lost_or_repeated(stack):
    wait_for(lambda: stack.latest_checkpoint(), 300, "a first checkpoint", diagnose=stack.logs)
    n = len(stack.events())
    run(["docker", "kill", "--signal", "TERM", stack.trainer_name])
    exits = wait_for(lambda: new_events(stack, n, "exit"), 180, "the trainer's exit", diagnose=stack.logs)
    assert exits[0]["exit_code"] == 75 and exits[0]["reason"] == "preempted"
    wait_for(lambda: new_events(stack, n, "start"), 120, "the relaunch", diagnose=stack.logs)
    relaunch = new_events(stack, n, "relaunch")
    assert len(relaunch) == 1 and relaunch[0]["reason"] == "preempted"
    resumed_at = stack.heartbeat()["step"]
    # The relaunched trainer logs on: every 10th step exactly once, from 10 to wherever it is.
    steps = wait_for(lambda: (s := logged_steps(stack)) and s[-1] >= resumed_at + 20 and s, 600,
                     "two logged steps after the resume", every=2, diagnose=stack.logs)
    assert steps == list(range(10, steps[-1] + 1, 10)), f"lost or repeated steps: {steps}"
    assert trainer_state(stack)["Running"]


@pytest.mark.timeout(600)
def test_restarted_watchdog_adopts_the_running_trainer_and_starts_no_second_one(stack):
    before = stack.container("trainer")
    assert before["State"]["Running"]
    n = len(stack.events())
    stack.compose("restart", "watchdog", timeout=180)
    started = wait_for(lambda: new_events(stack, n, "start"), 120, "the new watchdog's start", diagnose=stack.logs)
    after = stack.container("trainer")
    # The same container, the same process: adopted, neither restarted nor doubled.
    assert after["Id"] == before["Id"] and after["State"]["StartedAt"] == before["State"]["StartedAt"]
    assert after["State"]["Pid"] == before["State"]["Pid"] == started[0]["pid"]
    assert [e["event"] for e in new_events(stack, n)] == ["leave_running", "start"]
    trainers = [c for c in stack.ps() if c["Config"]["Labels"]["com.docker.compose.service"] == "trainer"]
    assert len(trainers) == 1
    top = run(["docker", "top", stack.trainer_name, "-o", "pid,args"]).stdout
    assert sum("x1_pretrain.train" in line for line in top.splitlines()) == 1, top
    wait_for(lambda: stack.health("watchdog") == "healthy", 120, "the new watchdog healthy")


@pytest.mark.timeout(900)
def test_sigkill_to_the_trainer_is_relaunched(stack):
    step = stack.heartbeat()["step"]
    assert step < TOTAL_STEPS - 20, f"the run is at step {step}: too near its end to kill it"
    started_at = trainer_state(stack)["StartedAt"]
    n = len(stack.events())
    run(["docker", "kill", "--signal", "KILL", stack.trainer_name])
    exits = wait_for(lambda: new_events(stack, n, "exit"), 120, "the trainer's exit", diagnose=stack.logs)
    assert exits[0]["exit_code"] == 137 and exits[0]["reason"] == "killed"
    wait_for(lambda: new_events(stack, n, "start"), 120, "the relaunch", diagnose=stack.logs)
    assert new_events(stack, n, "relaunch")[0]["reason"] == "killed"
    wait_for(lambda: trainer_state(stack)["Running"] and trainer_state(stack)["StartedAt"] != started_at, 60,
             "the trainer running again")
    # Resumed from its newest checkpoint, it trains on past where it was killed.
    wait_for(lambda: stack.heartbeat()["step"] > step, 600, "training past the kill", diagnose=stack.logs)


@pytest.mark.timeout(1800)
def test_finished_run_is_not_retrained_by_a_second_compose_up(stack):
    final = wait_for(lambda: stack.state().get("final"), 1500, "the run's end", every=2, diagnose=stack.logs)
    assert final["exit_code"] == 0 and final["reason"] == "finished"
    state = trainer_state(stack)
    assert not state["Running"] and state["ExitCode"] == 0
    weights = stack.path("checkpoints/final.safetensors")
    digest, latest, steps = sha256(weights), stack.latest_checkpoint(), logged_steps(stack)
    assert steps[-1] == TOTAL_STEPS
    # TERMINATE_ON_FINISH=1: the watchdog terminates the instance (the fake billing API's) after the
    # decision. Its "terminate" event comes last, after termination.json and the run folder's update:
    # the events are counted once it is in, or it would count as the second up's.
    wait_for(lambda: any(e["event"] == "terminate" for e in stack.events()), 120, "the watchdog's terminate event",
             diagnose=stack.logs)
    assert stack.path("logs/termination.json").exists()
    kept = stack.root / "results" / f"run-{stack.instance_id}"
    assert (kept / "final.safetensors").is_file() and (kept / "termination.json").is_file(), list(kept.parent.iterdir())
    n = len(stack.events())

    stack.compose("up", "-d", timeout=600)  # compose starts the trainer container again ...
    wait_for(lambda: trainer_state(stack)["StartedAt"] != state["StartedAt"] and not trainer_state(stack)["Running"],
             180, "the trainer container started and ended", diagnose=stack.logs)
    again = trainer_state(stack)
    assert again["ExitCode"] == 0  # ... and it ends at once with the recorded decision, training nothing
    assert sha256(weights) == digest and stack.latest_checkpoint() == latest and logged_steps(stack) == steps
    time.sleep(5)
    assert [e["event"] for e in new_events(stack, n)] == []  # the watchdog relaunched nothing


@pytest.mark.timeout(900)
def test_the_trainers_finish_leaves_a_complete_run_folder_and_finish_and_dod_pass_through_compose_run(stack):
    run_dir = stack.path("run")
    # The trainer wrote the run folder itself after its final exit (--run-dir), and the terminating
    # watchdog added the provider's answer (DEPLOY §7): complete before anyone runs a command.
    for name in ("manifest.json", "metrics.csv", "loss-curve.png", "final.safetensors", "termination.json",
                 "spike-postmortem.md", "dod.json"):
        assert (run_dir / name).is_file(), name
    # What a person wrote into the post-mortem survives the documented `finish` that writes it again.
    postmortem = run_dir / "spike-postmortem.md"
    postmortem.write_text(postmortem.read_text() + "\nWritten by the operator.\n")

    def in_prepare(*argv: str) -> None:
        stack.compose("run", "--rm", "--no-deps", "prepare", *argv, timeout=600)

    in_prepare("python", "-m", "x1_pretrain.finish", "--mlflow-uri", "http://mlflow-server:5000",
               "--output", "/workspace/run", "--band", *BAND)
    in_prepare("python", "-m", "x1_pretrain.dod", "/workspace/run", "--band", *BAND)  # exit 0: all six pass
    assert postmortem.read_text().endswith("Written by the operator.\n")
    manifest = json.loads((run_dir / "manifest.json").read_text())
    assert manifest["end"] == "finished"
    assert sha256(run_dir / "final.safetensors") == sha256(stack.path("checkpoints/final.safetensors"))
    assert all(c["ok"] for c in json.loads((run_dir / "dod.json").read_text())["checks"])


# ---------------------------------------------------------------------------------------------
# A run stopped by its budget


@pytest.fixture(scope="module")
def budget_stack(images, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ComposeStack]:
    # The guard reads the budget every 3 s; the sidecar polls the fake billing API every 2 s and
    # projects spent + rate x the 24 planned hours: $1.10/h passes the launch check ($26.40 of $35).
    s = ComposeStack(tmp_path_factory.mktemp("docker-budget"), "budget",
                     TOTAL_STEPS="2000", CKPT_EVERY="20", EVAL_EVERY="1000",
                     TRAIN_EXTRA_ARGS="--budget-check-every-min 0.05", X1_TEST_PRICE_USD_PER_HR="1.10")
    try:
        s.compose("run", "--rm", "--no-deps", "prepare", "sh", "-c",
                  "python -m x1_pretrain.corpus stdlib-docstrings --output /workspace/data/raw --max-mb 1 && "
                  "python -m x1_pretrain.tokenize_data --input-dir /workspace/data/raw "
                  "--output-dir /workspace/data/tokenized --tokenizer gpt2 --val-fraction 0.05 --workers 2",
                  timeout=600)
        s.compose("up", "-d", timeout=600)
        yield s
    finally:
        s.down()


@pytest.mark.timeout(900)
def test_budget_stop_exits_76_and_is_not_relaunched(budget_stack):
    s = budget_stack
    wait_for(lambda: s.latest_checkpoint(), 600, "the trainer's first checkpoint", every=1, diagnose=s.logs)
    s.fake_billing({"price_usd_per_hr": 2.00})  # projected: 2.00 x 24 h = $48 > the $35 cap
    exits = wait_for(lambda: new_events(s, 0, "exit"), 300, "the budget stop", diagnose=s.logs)
    assert exits[0]["exit_code"] == 76 and exits[0]["reason"] == "budget-stop"
    assert s.state()["final"]["exit_code"] == 76
    stopped = trainer_state(s)
    assert not stopped["Running"] and stopped["ExitCode"] == 76
    time.sleep(10)  # longer than any backoff the watchdog would wait before a relaunch
    assert [e["event"] for e in s.events()] == ["start", "exit"]
    assert trainer_state(s)["StartedAt"] == stopped["StartedAt"]


@pytest.mark.timeout(900)
def test_second_compose_up_after_a_budget_stop_trains_nothing(budget_stack):
    s = budget_stack
    before = trainer_state(s)
    assert before["ExitCode"] == 76
    latest, steps, n = s.latest_checkpoint(), logged_steps(s), len(s.events())
    s.compose("up", "-d", timeout=600)
    wait_for(lambda: trainer_state(s)["StartedAt"] != before["StartedAt"] and not trainer_state(s)["Running"],
             180, "the trainer container started and ended", diagnose=s.logs)
    assert trainer_state(s)["ExitCode"] == 76  # the recorded decision, again
    time.sleep(5)
    assert s.latest_checkpoint() == latest and logged_steps(s) == steps
    assert new_events(s, n) == [] and s.state()["final"]["exit_code"] == 76
