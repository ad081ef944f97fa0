"""The trainer across two hosts: two containers, each in its own network namespace on a test network
of the real Docker Engine, joined only by that network and by a named volume for the checkpoints
(tests/multinode_cluster.py). Each node runs the image's `x1-train` with NNODES=2, RDZV_ENDPOINT
and RDZV_ID, as a deployment does: torchrun's c10d rendezvous, gloo on the CPU, one process per node.

In the lost-node tests each node also has its host's watchdog (`python -m x1_watchdog --mode
docker`, from the same image, in a container of its own with the Engine's socket), as compose's
watchdog service runs beside each host's trainer: the watchdogs and torchrun restart what the kill
ends; the test starts nothing again.

The hosts are `a` and `b`, and the rendezvous endpoint is on `b`: the rendezvous ranks the nodes
by name, so global rank 0 (the one writer) runs on `a`, the host that is not the endpoint.

Where no engine is reachable these tests skip with the reason; under CI=true they fail instead.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from compose_stack import TORCH_IMAGE, TORCH_IMAGE_VERSION, ca_bundle, docker_problem, require_engine, run
from multinode_cluster import PREFIX, SHARED, Cluster

from budget_sidecar.poller import Poller
from budget_sidecar.settings import SidecarSettings
from conftest import REPO, cli_env, run_module, wait_for
from conftest import train_args as one_host_train_args
from x1_pretrain.checkpoint.load import load_weights

pytestmark = pytest.mark.slow

STEPS = 20
CKPT_EVERY = 5
ENDPOINT_HOST = "b"  # the c10d store lives in b's torchrun agent
HOSTS = ("a", "b")
# Short on purpose, to test them: a frozen peer ends a collective after DIST_TIMEOUT_S, and a node
# waits JOIN_TIMEOUT_S for the others to (re)join before it exits 1.
DIST_TIMEOUT_S = 20
JOIN_TIMEOUT_S = 40
WATCHDOG_MAX_RESTARTS = 10  # compose.yaml's MAX_RESTARTS default


@pytest.fixture(scope="session")
def multinode_engine() -> None:
    require_engine("the multi-node tests")


@pytest.fixture(scope="session")
def node_image(multinode_engine: None) -> Iterator[str]:
    """The trainer image on the local CPU torch base, built once for every test here."""
    image = f"{PREFIX}-trainer:{uuid.uuid4().hex[:8]}"
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": os.environ.get("HOME", "/root"),
           "X1_MULTINODE_IMAGE": image, "X1_TEST_TRAINER_BASE_IMAGE": TORCH_IMAGE,
           "X1_TEST_TORCH_VERSION": TORCH_IMAGE_VERSION, "BUILD_CA_BUNDLE": ca_bundle() or ""}
    run(["docker", "compose", "-p", f"{PREFIX.replace('-', '')}build", "-f", "tests/docker/compose.multinode-build.yaml",
         "build"], timeout=1800, env=env, cwd=REPO)
    try:
        yield image
    finally:
        run(["docker", "image", "rm", "-f", image, f"{image}-watchdog"], check=False)


@pytest.fixture(scope="session")
def cluster(node_image: str, tiny_data: Path) -> Iterator[Cluster]:
    c = Cluster(node_image)
    try:
        c.put(tiny_data, "data")
        yield c
    finally:
        c.remove()


def train_args(run_name: str, host: str, *extra: str, total: int = STEPS) -> list[str]:
    """The tiny run writing under /shared/<run_name>; each host's heartbeat is its own file."""
    root = f"{SHARED}/{run_name}"
    return ["--config", "configs/tiny-cpu.yaml", "--data-dir", f"{SHARED}/data", "--ckpt-dir", f"{root}/ckpt",
            "--mlflow-uri", f"file://{root}/mlruns", "--total-steps", str(total), "--ckpt-every", str(CKPT_EVERY),
            "--eval-every", str(total), "--log-every", "5", "--metrics-port", "9791", "--metrics-host", "0.0.0.0",
            "--heartbeat-file", f"{root}/{host}.heartbeat.json", "--resume-from-latest", *extra]


def start_group(c: Cluster, run_name: str, *extra: str, total: int = STEPS, watchdogs: bool = False,
                **env: str) -> None:
    """Both nodes of one run: the endpoint's host first (its agent hosts the rendezvous store). With
    `watchdogs`, each node also gets its host's watchdog, which adopts the running node as compose's
    watchdog service adopts the trainer that `docker compose up` started."""
    settings = {"NNODES": "2", "RDZV_ENDPOINT": f"{ENDPOINT_HOST}:29400", "RDZV_ID": f"{run_name}-{uuid.uuid4().hex[:6]}",
                "X1_DIST_TIMEOUT_SECONDS": str(DIST_TIMEOUT_S), "RDZV_JOIN_TIMEOUT": str(JOIN_TIMEOUT_S), **env}
    for host in sorted(HOSTS, key=lambda h: h != ENDPOINT_HOST):
        records = f"{SHARED}/{run_name}/{host}."
        # The state file the launcher's gate reads, as compose's trainer and watchdog share it.
        c.node(host, train_args(run_name, host, *extra, total=total), X1_WATCHDOG_STATE_FILE=f"{records}watchdog-state.json",
               **settings)
        if watchdogs:
            c.watchdog(host, records, "--total-steps", str(total), "--check-seconds", "0.5",
                       "--max-restarts", str(WATCHDOG_MAX_RESTARTS))


def heartbeat(c: Cluster, run_name: str, host: str) -> dict | None:
    return c.read_json(f"{run_name}/{host}.heartbeat.json")


def latest_step(c: Cluster, run_name: str) -> int:
    proc = run(["docker", "run", "--rm", "-v", f"{c.volume}:{SHARED}:ro", c.image, "cat",
                f"{SHARED}/{run_name}/ckpt/latest"], check=False)
    return int(proc.stdout.strip().split("_")[1]) if proc.returncode == 0 else -1


def max_abs_difference(a: Path, b: Path) -> float:
    wa, _, _ = load_weights(a)
    wb, _, _ = load_weights(b)
    assert wa.keys() == wb.keys()
    return max((wa[k] - wb[k]).abs().max().item() for k in wa)


@pytest.fixture(scope="session")
def uninterrupted(cluster: Cluster, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """One process (its own container) and the two-node group, run side by side over the same
    STEPS with the same global batch: 8 sequences a step, accumulated over 2 micro-batches in one
    process, 1 micro-batch on each of 2 nodes."""
    out = tmp_path_factory.mktemp("multinode-uninterrupted")
    cluster.node("ref", train_args("one", "ref"))
    start_group(cluster, "two")
    t = time.monotonic()
    codes = {name: cluster.wait(name, timeout=900) for name in ("ref", *HOSTS)}
    assert codes == {"ref": 0, "a": 0, "b": 0}, cluster.all_logs()
    print(f"{STEPS} steps: one process and two nodes side by side in {time.monotonic() - t:.0f} s")
    return {"one": cluster.fetch("one/ckpt/final.safetensors", out), "two": cluster.fetch("two/ckpt/final.safetensors", out),
            "logs": {h: cluster.logs(h, tail=400) for h in HOSTS},
            "heartbeats": {h: heartbeat(cluster, "two", h) for h in HOSTS},
            "lease_dir": cluster.fetch("two/ckpt", out)}


# ---------------------------------------------------------------------------------------------
# 1. Two hosts for real


@pytest.mark.timeout(2400)
def test_two_hosts_train_bit_identical_weights_to_one_process(uninterrupted):
    diff = max_abs_difference(uninterrupted["one"], uninterrupted["two"])
    print(f"two nodes vs one process after {STEPS} steps: max |difference| = {diff}")
    assert diff == 0.0


# ---------------------------------------------------------------------------------------------
# 2. Who writes what


def test_global_rank_0_alone_writes_and_each_host_heartbeat_names_its_node(uninterrupted):
    beats = uninterrupted["heartbeats"]
    # The rendezvous put rank 0 on `a`, not on the endpoint's host; each host's first process beats.
    assert {h: (b["hostname"], b["node_rank"], b["rank"], b["nnodes"], b["phase"]) for h, b in beats.items()} == {
        "a": ("a", 0, 0, 2, "finished"), "b": ("b", 1, 1, 2, "finished")}
    logs = uninterrupted["logs"]
    written = [f"checkpoint step_{s:08d} written" for s in range(CKPT_EVERY, STEPS + 1, CKPT_EVERY)]
    assert all(line in logs["a"] for line in written), logs["a"][-3000:]
    assert "checkpoint step_" not in logs["b"] and "x1.lease" not in logs["b"] and f"step {STEPS}/{STEPS}" not in logs["b"]
    ckpt = uninterrupted["lease_dir"]
    assert sorted(p.name for p in ckpt.glob("step_*")) == [f"step_{s:08d}" for s in (10, 15, 20)]  # keep_last 3
    assert json.loads((ckpt / "mlflow-run.json").read_text())["run_id"]
    # The lease was given back at the exit, and no lock or record of either node was left behind.
    assert not list(ckpt.glob(".x1-lease*"))


@pytest.mark.timeout(1200)
def test_a_budget_stop_on_rank_0_exits_76_on_every_node_after_one_checkpoint(cluster, tmp_path):
    # Spend $9.90 of $35, and a projection the run's measured pace cannot meet: 2M steps at a CPU's
    # pace. The plan's pace (--expected-tokens-per-sec) lets the launch through; the first steady
    # interval makes rank 0's guard stop the run, and every node must stop with it. budget.json is
    # the sidecar's own, for two nodes (4.5 h billed at $1.10/h each: the total and both parts).
    doc = tmp_path / "budget.json"
    Poller(SidecarSettings(provider="static", rate_usd_per_hr=1.10, nodes=2, initial_hours=4.5, output=doc, port=0),
           None).poll_once()
    assert json.loads(doc.read_text())["nodes"] == 2
    cluster.write("budget/budget.json", doc.read_text())
    start_group(cluster, "budget", "--budget-cap-usd", "35", "--budget-curr-cost-uri", f"{SHARED}/budget/budget.json",
                # The price ceiling is the run's, both hosts together, as DEPLOY section 10 says.
                "--max-price-usd-per-hr", "2.40", "--expected-tokens-per-sec", "1e9", "--ckpt-every", "100000",
                "--log-every", "2", "--eval-every", "100000", total=2_000_000)
    codes = {h: cluster.wait(h, timeout=600) for h in HOSTS}
    assert codes == {"a": 76, "b": 76}, cluster.all_logs()
    logs = {h: cluster.logs(h, tail=400) for h in HOSTS}
    stopped = latest_step(cluster, "budget")
    assert stopped > 0, logs["a"][-3000:]
    assert f"checkpoint step_{stopped:08d} written" in logs["a"]
    assert logs["a"].count(" written in ") == 1  # the stop's checkpoint, the only one
    assert f"budget-stop at step {stopped}: checkpoint in" in logs["a"]
    beats = {h: heartbeat(cluster, "budget", h) for h in HOSTS}
    assert {h: (b["phase"], b["step"]) for h, b in beats.items()} == {"a": ("stopped", stopped), "b": ("stopped", stopped)}


# ---------------------------------------------------------------------------------------------
# 3. A node lost


def watchdogs_finish(c: Cluster, timeout: float) -> dict[str, int]:
    """Wait for both hosts' watchdogs to exit (they exit with the trainer's final code); the
    harness itself starts nothing again. Returns each watchdog's exit code."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        states = {h: c.state(f"{h}-watchdog") for h in HOSTS}
        if not any(s["Running"] for s in states.values()):
            return {h: s["ExitCode"] for h, s in states.items()}
        time.sleep(1)
    raise AssertionError(f"the watchdogs did not finish within {timeout:g} s\n{c.all_logs()}")


def node_info(c: Cluster, host: str) -> list[dict[str, str]]:
    """The x1_train_node_info samples of the /metrics served on `host` (from inside its container)."""
    from prometheus_client.parser import text_string_to_metric_families

    proc = run(["docker", "exec", c.nodes[host], "python", "-c",
                "import urllib.request; print(urllib.request.urlopen('http://127.0.0.1:9791/metrics', timeout=10)"
                ".read().decode())"])
    return [s.labels for f in text_string_to_metric_families(proc.stdout) for s in f.samples
            if s.name == "x1_train_node_info" and s.value == 1]


@pytest.mark.timeout(1500)
@pytest.mark.parametrize("victim", ["b", "a"], ids=["the-endpoint-host-lost", "the-rank-0-host-lost"])
def test_a_node_killed_mid_run_is_relaunched_by_its_watchdog_and_resumes_bit_identical(cluster, uninterrupted, tmp_path,
                                                                                       victim):
    """Each node beside its host's watchdog (x1_watchdog in docker mode, as compose.yaml's watchdog
    service): the killed node's watchdog relaunches it, torchrun's rendezvous re-forms the group
    (--max-restarts), and the run resumes from the last checkpoint. Nothing here starts a node."""
    run_name = f"lost-{victim}"
    start_group(cluster, run_name, "--run-dir", f"{SHARED}/{run_name}/run", watchdogs=True)
    wait_for(lambda: latest_step(cluster, run_name) >= 2 * CKPT_EVERY, 600, "a checkpoint at step 10")
    # /metrics (rank 0's) says which host it is.
    assert node_info(cluster, "a") == [{"node_rank": "0", "nnodes": "2", "hostname": "a"}]
    killed_at = cluster.kill(victim)
    resumed_at = latest_step(cluster, run_name)  # no rank is left to write one after the kill
    codes = watchdogs_finish(cluster, timeout=900)
    lost = time.time() - killed_at
    assert codes == {"a": 0, "b": 0}, cluster.all_logs()
    assert {h: cluster.state(h)["ExitCode"] for h in HOSTS} == {"a": 0, "b": 0}
    final = cluster.fetch(f"{run_name}/ckpt/final.safetensors", tmp_path)
    diff = max_abs_difference(uninterrupted["one"], final)
    log = cluster.logs("a", tail=400)
    relaunches = {h: [e for e in cluster.events(f"{SHARED}/{run_name}/{h}.") if e["event"] == "relaunch"] for h in HOSTS}
    print(f"{victim} killed after step {resumed_at}'s checkpoint: relaunched by the watchdogs "
          f"{ {h: [(e['reason'], e['exit_code']) for e in r] for h, r in relaunches.items()} }, "
          f"finished {lost:.0f} s after the kill; max |difference| to one process = {diff}")
    assert diff == 0.0
    assert f"resuming from {SHARED}/{run_name}/ckpt/step_{resumed_at:08d} at step {resumed_at}" in log, log[-3000:]
    # The victim's own watchdog relaunched it after the kill (SIGKILL: 137).
    assert relaunches[victim] and relaunches[victim][0]["exit_code"] == 137, relaunches
    if victim == "a":
        # b's torchrun kept the rendezvous (its agent hosts the store) and restarted its own
        # worker when `a` rejoined: b's container never stopped and its watchdog did nothing.
        assert relaunches["b"] == []
    else:
        # The store went down with b: a's torchrun cannot rendezvous again and exits 1 at once;
        # a's watchdog relaunches it, as a crash.
        assert relaunches["a"] and relaunches["a"][0]["exit_code"] == 1, relaunches
    # The restart, with its downtime, in the run folder's manifest (rank 0 wrote it at the finish).
    manifest = cluster.read_json(f"{run_name}/run/manifest.json")
    restarts = manifest["restart_cost"]["restarts"]
    assert manifest["restarts"] == 1 and len(restarts) == 1, manifest["restart_cost"]
    assert restarts[0]["resumed_first_step"] == resumed_at + 1
    print(f"manifest: downtime {restarts[0]['downtime_seconds']} s, resumed at step {restarts[0]['resumed_first_step']}")
    assert 0 < restarts[0]["downtime_seconds"] < lost, restarts[0]


@pytest.mark.timeout(900)
@pytest.mark.parametrize("lost, how, bound_s", [
    # Frozen (or cut off): its sockets stay open and answer nothing. b's all-reduce gives up after
    # the collective timeout, then b's torchrun waits JOIN_TIMEOUT_S for it to rejoin, then exits 1.
    ("a", "pause", DIST_TIMEOUT_S + JOIN_TIMEOUT_S + 60),
    # Gone with the rendezvous store: a's torchrun cannot rendezvous again and exits 1 at once.
    ("b", "kill", 30),
], ids=["rank-0-host-frozen", "endpoint-host-gone"])
def test_a_node_that_never_returns_stops_the_survivor_cleanly_within_its_timeouts(cluster, lost, how, bound_s):
    run_name = f"never-{lost}"
    survivor = next(h for h in HOSTS if h != lost)
    start_group(cluster, run_name, total=2000)
    wait_for(lambda: (heartbeat(cluster, run_name, "a") or {}).get("step", 0) >= 3, 600, "step 3")
    lost_at = cluster.pause(lost) if how == "pause" else cluster.kill(lost)
    code = cluster.wait(survivor, timeout=bound_s + 120)
    took = time.time() - lost_at
    log = cluster.logs(survivor, tail=300)
    print(f"{lost} {'paused' if how == 'pause' else 'killed'}: {survivor} exited {code} after {took:.0f} s (bound {bound_s} s)")
    assert code == 1, log[-3000:]  # a crash for its watchdog: relaunched with backoff, then given up
    assert took < bound_s, log[-3000:]
    expected = "RendezvousTimeoutError" if how == "pause" else "RendezvousConnectionError"
    assert expected in log, log[-3000:]
    run(["docker", "rm", "-f", cluster.nodes[lost]])


# ---------------------------------------------------------------------------------------------
# 4. How a user runs it


def sidecar_settings(service: dict, tmp_path: Path) -> SidecarSettings:
    """The settings the sidecar's command line gives it: its `sh -c` script run (compose's `$$`
    unescaped) with a stand-in `python` that writes down its arguments, then parsed by the sidecar."""
    from budget_sidecar.__main__ import build_parser, settings_from_args

    stand_in = tmp_path / "bin" / "python"
    stand_in.parent.mkdir(exist_ok=True)
    stand_in.write_text("#!/bin/sh\nprintf '%s\\0' \"$@\" > \"$ARGV_FILE\"\n")
    stand_in.chmod(0o755)
    argv_file = tmp_path / "sidecar-argv"
    command = [part.replace("$$", "$") for part in service["command"]]
    env = {k: "" if v is None else str(v) for k, v in service["environment"].items()}
    subprocess.run(command, env={**env, "PATH": f"{stand_in.parent}:/usr/bin:/bin", "ARGV_FILE": str(argv_file)},
                   check=True, timeout=30)
    argv = argv_file.read_text().split("\0")[:-1]
    assert argv[:2] == ["-m", "budget_sidecar"], argv
    return settings_from_args(build_parser().parse_args(argv[2:]))


def test_the_multinode_override_starts_one_node_from_nnodes_rdzv_endpoint_and_rdzv_id(tmp_path):
    """compose.multinode.yaml over compose.yaml, as Compose renders it: the trainer on the host's
    network with the rendezvous settings of .env, and the trainer's effective flags (compose's
    command, then X1_TRAIN_EXTRA_ARGS, last one wins) putting everything rank 0 writes on the
    shared filesystem."""
    import shlex

    from x1_pretrain.train.parser import build_parser

    if docker_problem() is not None and os.environ.get("CI") != "true":
        pytest.skip(docker_problem())
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": os.environ.get("HOME", "/root"), "DOCKER_GID": "999",
           "X1_SHARED": "/lambda/nfs/x1-fs/shared", "NNODES": "2", "NPROC": "8",
           "RDZV_ENDPOINT": "10.19.0.5:29400", "RDZV_ID": "x1-run-1",
           "INSTANCE_ID": "i-first", "INSTANCE_IDS": "i-first,i-second"}
    proc = run(["docker", "compose", "-p", "x1i44config", "-f", "compose.yaml", "-f", "compose.multinode.yaml",
                "config", "--format", "json"], env=env, cwd=REPO)
    services = json.loads(proc.stdout)["services"]
    trainer = services["trainer"]
    assert trainer["network_mode"] == "host" and not trainer.get("ports")
    assert {k: trainer["environment"][k] for k in ("NNODES", "NPROC", "RDZV_ENDPOINT", "RDZV_ID")} == {
        "NNODES": "2", "NPROC": "8", "RDZV_ENDPOINT": "10.19.0.5:29400", "RDZV_ID": "x1-run-1"}
    mounts = {v["target"]: v["source"] for s in ("trainer", "budget-sidecar", "mlflow-server")
              for v in services[s]["volumes"] if s == "trainer" or v["target"] in ("/workspace", "/shared")}
    assert mounts["/shared"] == "/lambda/nfs/x1-fs/shared"
    assert services["budget-sidecar"]["volumes"][0]["source"] == "/lambda/nfs/x1-fs/shared"  # budget.json there
    # One sidecar counts both instances: every host's id and the node count reach it.
    assert {k: services["budget-sidecar"]["environment"][k] for k in ("INSTANCE_IDS", "NNODES")} == {
        "INSTANCE_IDS": "i-first,i-second", "NNODES": "2"}
    assert sidecar_settings(services["budget-sidecar"], tmp_path).instance_ids == ["i-first", "i-second"]
    assert sidecar_settings(services["budget-sidecar"], tmp_path).nodes == 2
    args = build_parser().parse_args([*trainer["command"][1:], *shlex.split(trainer["environment"]["X1_TRAIN_EXTRA_ARGS"])])
    assert (args.ckpt_dir, args.budget_curr_cost_uri, args.mlflow_uri, args.run_dir) == (
        "/shared/checkpoints", "/shared/budget.json", "file:///shared/mlflow", "/shared/run")
    assert "--backend-store-uri=file:///shared/mlflow" in services["mlflow-server"]["command"]
    # A node without its rendezvous settings is refused by the launcher, naming what is missing.
    launcher = subprocess.run(["bash", str(REPO / "trainer/entrypoint.sh"), "--config", "c.yaml"],
                              env={**env, "RDZV_ENDPOINT": "", "X1_WATCHDOG_STATE_FILE": str(tmp_path / "none")},
                              capture_output=True, text=True, timeout=60)
    assert launcher.returncode == 2 and "RDZV_ENDPOINT" in launcher.stderr


def test_a_collective_timeout_that_is_not_seconds_is_refused_naming_it(tmp_path, tiny_data):
    for bad in ("soon", "0", "-5"):
        proc = run_module("x1_pretrain.train", *one_host_train_args(tiny_data, tmp_path / "ckpt", f"file://{tmp_path}/mlruns"),
                          env=cli_env(X1_DIST_TIMEOUT_SECONDS=bad))
        assert proc.returncode == 2, proc.stderr[-2000:]
        assert f"X1_DIST_TIMEOUT_SECONDS={bad!r}" in proc.stderr
        assert not (tmp_path / "ckpt").exists()  # refused before anything was written
