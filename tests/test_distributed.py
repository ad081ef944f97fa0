"""The same loop under torchrun (CPU, gloo, 2 processes): same math as one process, checkpoints
loadable at another world size, and the launcher's exit code is rank 0's."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import REFERENCE_STEPS, REPO, cli_env, run_module, train_args
from x1_common.contracts import Heartbeat
from x1_pretrain.checkpoint.load import load_weights

TORCHRUN = Path(sys.executable).with_name("torchrun")
pytestmark = pytest.mark.skipif(not TORCHRUN.exists(), reason="torchrun is not installed beside this python")
STEPS = 20


def torchrun(args: list[str], log: Path, nproc: int = 2) -> subprocess.Popen:
    env = cli_env(OMP_NUM_THREADS="1")
    return subprocess.Popen([str(TORCHRUN), "--standalone", f"--nproc_per_node={nproc}", "-m", "x1_pretrain.train", *args],
                            stdout=open(log, "ab"), stderr=subprocess.STDOUT, env=env, cwd=REPO, start_new_session=True)


def max_relative_difference(a: Path, b: Path) -> float:
    wa, _, _ = load_weights(a)
    wb, _, _ = load_weights(b)
    assert wa.keys() == wb.keys()
    return max(((wa[k] - wb[k]).norm() / wa[k].norm()).item() for k in wa)


@pytest.fixture(scope="module")
def one_process_run(tmp_path_factory, tiny_data) -> Path:
    root = tmp_path_factory.mktemp("one-process")
    proc = run_module("x1_pretrain.train", *train_args(tiny_data, root / "ckpt", f"file://{root}/mlruns", total=STEPS),
                      env=cli_env(OMP_NUM_THREADS="1"))
    assert proc.returncode == 0, proc.stderr[-2000:]
    return root / "ckpt" / "final.safetensors"


@pytest.mark.parametrize("mode, tolerance, micro_batch", [("ddp", 1e-5, 2), ("fsdp2", 1e-4, 4)])
def test_two_processes_train_the_same_weights_as_one(tmp_path, tiny_data, one_process_run, mode, tolerance, micro_batch):
    # FSDP2 reduce-scatters in another order than DDP's all-reduce: rounding differs a little more.
    # DDP at micro-batch 2: two micro-steps per process, so the first one skips the gradient sync.
    # FSDP2 stays at one micro-step: with two, a rank once aborted at exit on gloo after finishing.
    ckpt = tmp_path / "ckpt"
    log = tmp_path / "train.log"
    args = train_args(tiny_data, ckpt, f"file://{tmp_path}/mlruns", "--set", f"train.distributed={mode}",
                      "--set", f"train.micro_batch_size={micro_batch}", total=STEPS)
    assert torchrun(args, log).wait(timeout=600) == 0, log.read_text()[-3000:]
    assert max_relative_difference(one_process_run, ckpt / "final.safetensors") < tolerance
    text = log.read_text()
    assert text.count(f"step {STEPS}/{STEPS} loss") == 1  # rank 0 speaks for the group


def test_a_checkpoint_from_two_processes_resumes_in_one(tmp_path, tiny_data, reference_run):
    """Stopped (SIGTERM) under torchrun, resumed as one process: it continues from the checkpoint
    and ends where the uninterrupted one-process run ended (to rounding)."""
    ckpt = tmp_path / "ckpt"
    log = tmp_path / "train.log"
    args = train_args(tiny_data, ckpt, f"file://{tmp_path}/mlruns")
    group = torchrun(args, log)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        hb = Heartbeat.read(ckpt / "heartbeat.json")
        if hb is not None and hb.phase == "training" and hb.step >= 15:
            break
        assert group.poll() is None, log.read_text()[-3000:]
        time.sleep(0.2)
    os.killpg(group.pid, signal.SIGTERM)  # what torchrun's agent and docker stop do
    group.wait(timeout=120)
    stopped = int((ckpt / "latest").read_text().strip().split("_")[1])
    assert 15 <= stopped < REFERENCE_STEPS
    proc = run_module("x1_pretrain.train", *args, "--resume-from-latest", timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert re.search(rf"resuming from .*step_{stopped:08d} at step {stopped}", proc.stderr)
    assert max_relative_difference(reference_run / "final.safetensors", ckpt / "final.safetensors") < 1e-4


def test_a_world_size_that_does_not_divide_the_batch_exits_2_through_the_launcher(tmp_path, tiny_data):
    # 512 tokens per step = micro-batch 4 x 64 tokens x accumulation: 3 processes cannot share it.
    env = cli_env(NPROC="3", OMP_NUM_THREADS="1", PATH=f"{Path(sys.executable).parent}:{os.environ['PATH']}")
    proc = subprocess.run(["bash", str(REPO / "trainer/entrypoint.sh"),
                           *train_args(tiny_data, tmp_path / "ckpt", f"file://{tmp_path}/mlruns", total=STEPS)],
                          capture_output=True, text=True, env=env, cwd=REPO, timeout=300)
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "train.tokens_per_step" in proc.stdout + proc.stderr
