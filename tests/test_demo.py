"""`make demo` end to end: `python -m x1_pretrain.demo`, the entry point the Makefile runs, on a
short run (--steps 60) in a temporary workspace.

- the whole stack comes up as processes through `python -m x1_pretrain.stack up -d` from the
  demo's .env (the path a RunPod pod runs), the simulated preemption is relaunched by the
  watchdog, the (fake) instance is terminated, the run is exported, every DoD line passes, and
  `stack down` stops it all;
- the provider API key made up for the session (read here from the fake billing API's own
  environment) is on no command line, in no file of the workspace and not in the output;
- Ctrl-C stops every process the demo started, and a busy default port is reported and avoided.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from test_export_run import spiked_run

from conftest import REPO, cli_env, sigint_as_in_a_terminal
from x1_common.contracts import SIDECAR_PORT

__all__ = ["spiked_run"]  # the shared session fixture, imported so pytest finds it here

pytestmark = pytest.mark.slow

RUN_FILES = ("manifest.json", "metrics.csv", "loss-curve.png", "gradnorm-curve.png", "throughput.png",
             "final.safetensors", "mlflow-run-uri.txt", "spike-postmortem.md", "dod.json")
PORTS_LINE = re.compile(r"ports: mlflow (\d+), trainer (\d+), sidecar (\d+), watchdog (\d+), prometheus (\d+), "
                        r"fake billing (\d+)")


def start_demo(workspace: Path, out: Path, *args: str, env: dict[str, str] | None = None) -> subprocess.Popen:
    # A session of its own, as a terminal's job would be: the signals we send reach the demo only;
    # SIGINT as a terminal's job has it.
    return subprocess.Popen(
        [sys.executable, "-m", "x1_pretrain.demo", "--workspace", str(workspace), *args],
        stdout=open(out, "wb"), stderr=subprocess.STDOUT, env=env or cli_env(), cwd=REPO, start_new_session=True,
        preexec_fn=sigint_as_in_a_terminal,
    )


def wait_for(predicate: Callable[[], object], timeout: float, what: str, proc: subprocess.Popen, out: Path) -> object:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        if proc.poll() is not None:
            pytest.fail(f"demo exited with {proc.returncode} before {what}:\n{out.read_text()[-4000:]}")
        time.sleep(0.3)
    pytest.fail(f"timed out after {timeout:g} s waiting for {what}:\n{out.read_text()[-4000:]}")


def ports_of(out: Path) -> dict[str, int] | None:
    m = PORTS_LINE.search(out.read_text(errors="replace"))
    return dict(zip(("mlflow", "trainer", "sidecar", "watchdog", "prometheus", "fake_billing"),
                    map(int, m.groups()), strict=True)) if m else None


def processes() -> dict[int, tuple[bytes, bytes]]:
    """pid -> (command line, environment) of every process we can read."""
    out = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                out[int(entry.name)] = ((entry / "cmdline").read_bytes(), (entry / "environ").read_bytes())
            except OSError:
                continue
    return out


def fake_billing_key(port: int) -> str | None:
    """The bearer key the demo gave its fake billing API, from that process's environment."""
    for cmdline, environ in processes().values():
        args = cmdline.split(b"\0")
        if b"budget_sidecar.fake_billing" in args and str(port).encode() in args:
            for var in environ.split(b"\0"):
                if var.startswith(b"BILLING_API_KEY="):
                    return var.split(b"=", 1)[1].decode()
    return None


def listening(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(1)
        return s.connect_ex(("127.0.0.1", port)) == 0


def events(workspace: Path) -> list[dict]:
    return [json.loads(line) for line in (workspace / "logs" / "watchdog-events.jsonl").read_text().splitlines()]


def test_demo_runs_the_stack_through_a_preemption_and_passes_every_dod_check(tmp_path):
    ws, out = tmp_path / "demo-workspace", tmp_path / "demo.out"
    proc = start_demo(ws, out, "--steps", "60", "--free-ports")
    try:
        ports = wait_for(lambda: ports_of(out), 60, "the ports line", proc, out)
        key = wait_for(lambda: fake_billing_key(ports["fake_billing"]), 60, "the fake billing API", proc, out)
        # While the services run: the key is in their environment, on no command line (`ps` shows those).
        wait_for(lambda: "Training under the watchdog" in out.read_text(), 120, "training", proc, out)
        assert not [pid for pid, (cmdline, _) in processes().items() if key.encode() in cmdline]
        code = proc.wait(timeout=420)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGINT)
            proc.wait(60)
    text = out.read_text()
    assert code == 0, text[-5000:]

    run = ws / "run"
    for name in RUN_FILES:
        assert (run / name).is_file() and (run / name).stat().st_size > 0, name
    dod = json.loads((run / "dod.json").read_text())
    assert dod["passed"] is True and len(dod["checks"]) == 6 and all(c["ok"] for c in dod["checks"]), dod
    assert "all 6 checks pass" in text and "All DoD checks pass." in text
    assert re.search(r"step\s+60/60\s+loss", text)  # live progress, a line per log step

    # The preemption: SIGTERM to the trainer -> 75 -> relaunch with --resume-from-latest -> finished.
    ev = events(ws)
    kinds = [(e["event"], e.get("exit_code")) for e in ev]
    assert kinds == [("start", None), ("exit", 75), ("relaunch", 75), ("start", None), ("exit", 0),
                     ("terminate", 0)], kinds
    assert ev[1]["reason"] == "preempted" and ev[1]["stop_requested"] is False
    assert ev[3]["resume"] is True and "--resume-from-latest" in ev[3]["trainer"].split()
    assert "simulated preemption: SIGTERM to trainer pid" in text
    assert "$ python -m x1_pretrain.stack up -d --env-file" in text and "$ python -m x1_pretrain.stack down" in text
    assert "final decision: finished (exit 0" in text  # `stack status` after the run
    assert re.search(r"step \d+/60 loss", (ws / "logs" / "trainer.log").read_text())  # the trainer's own log
    assert json.loads((ws / "logs" / "stack.json").read_text())["state"] == "stopped"

    termination = json.loads((ws / "logs" / "termination.json").read_text())
    assert termination["instance_after"]["status"] == "terminated"
    assert json.loads((run / "termination.json").read_text()) == termination
    manifest = json.loads((run / "manifest.json").read_text())
    assert manifest["end"] == "finished" and 0 < manifest["spent_usd"] <= 35
    # The demo's band everywhere: the manifest (and the plots drawn from it) and the dod that passed.
    from x1_pretrain.stack.demo import BAND

    assert manifest["loss_curve_band"] == list(BAND) and dod["band"] == list(BAND), (manifest, dod)
    # Declared by the run before its first step, so `dod` on the folder as the README shows it
    # (no --band) judges against it and passes, as the demo's own dod did.
    assert manifest["declared_band"]["source"] == "flag"
    assert (manifest["declared_band"]["low"], manifest["declared_band"]["high"]) == BAND
    again = subprocess.run([sys.executable, "-m", "x1_pretrain.dod", str(run)], capture_output=True, text=True,
                           env=cli_env(), cwd=REPO)
    assert again.returncode == 0, again.stdout + again.stderr
    assert f"[{BAND[0]:.2f}, {BAND[1]:.2f}] (given on the command line)" in again.stdout
    # One figure for the preemption: the manifest's, `stack status`'s (printed before the export,
    # from trainer.log and the watchdog's events) and the demo's own line say the same.
    from x1_common.restarts import describe

    (restart,) = manifest["restart_cost"]["restarts"]
    assert (restart["cause"], restart["stopped_by"]) == ("preempted", "SIGTERM") and restart["downtime_seconds"] > 0
    status_part, _, after = text.partition("== Export, post-mortem, definition of done")
    assert f"  {describe(restart)}" in status_part and describe(restart) in after, (restart, text[-6000:])
    assert f"finish (export_run, post-mortem, dod with the band {BAND[0]:g}-{BAND[1]:g}): exit 0" in text

    # The key: in no file of the workspace (the MLflow database and the logs included), not printed.
    assert key not in text
    leaks = [str(f) for f in ws.rglob("*") if f.is_file() and key.encode() in f.read_bytes()]
    assert not leaks, leaks


def test_a_rerun_starts_clean_reports_a_busy_port_and_ctrl_c_stops_every_process(tmp_path, tiny_data):
    ws, out = tmp_path / "demo-workspace", tmp_path / "demo.out"
    # The workspace of an earlier run: its tokens are reused (straight to the services), the rest
    # must go - a checkpoint left there would make the fresh trainer refuse to start (exit 2).
    (ws / "data").mkdir(parents=True)
    shutil.copytree(tiny_data, ws / "data" / "tokenized")
    (ws / ".x1-demo-workspace").write_text("")
    (ws / "checkpoints" / "step_00000999").mkdir(parents=True)
    (ws / "logs").mkdir()
    (ws / "logs" / "watchdog-events.jsonl").write_text('{"event": "exit", "exit_code": 0, "pid": 1}\n')
    # Every process the demo starts inherits its environment: this marker finds them all.
    marker = f"X1_DEMO_TEST_MARKER={os.getpid()}-{time.monotonic_ns()}"
    env = cli_env(**dict([marker.split("=", 1)]))

    busy = socket.socket()
    busy.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        busy.bind(("127.0.0.1", SIDECAR_PORT))
        busy.listen()
    except OSError:
        pass  # already taken by something else: busy either way
    try:
        proc = start_demo(ws, out, env=env)
        try:
            ports = wait_for(lambda: ports_of(out), 60, "the ports line", proc, out)
            assert ports["sidecar"] != SIDECAR_PORT
            assert f"port {SIDECAR_PORT} (sidecar) is busy: using {ports['sidecar']} instead" in out.read_text()
            wait_for(lambda: re.search(r"step\s+10/200\s+loss", out.read_text()), 180, "training steps", proc, out)
            assert "data: reusing" in out.read_text()
            assert not (ws / "checkpoints" / "step_00000999").exists()
            mine = [pid for pid, (_, environ) in processes().items() if marker.encode() in environ.split(b"\0")]
            assert len(mine) >= 6  # the demo, fake billing, the stack runner, sidecar, MLflow, watchdog, trainer
            os.killpg(proc.pid, signal.SIGINT)
            code = proc.wait(timeout=90)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(30)
    finally:
        busy.close()
    text = out.read_text()
    assert code == 130, text[-4000:]
    assert "interrupted: every process the demo started has been stopped" in text
    left = [pid for pid, (_, environ) in processes().items() if marker.encode() in environ.split(b"\0")]
    assert not left, [processes().get(pid, (b"",))[0] for pid in left]
    assert not [name for name, port in ports.items() if listening(port)]
    # The trainer got the stop through the watchdog and wrote its emergency checkpoint.
    assert [(e["event"], e.get("exit_code"), e.get("stop_requested")) for e in events(ws)] == [
        ("start", None, None), ("exit", 75, True)]


def test_demo_exits_nonzero_when_a_step_fails(spiked_run, tmp_path):
    """The demo's last steps: `finish` (the run folder with the demo's band) and `dod`. A failing
    `finish` (here: no MLflow server where the run's metrics should be) fails the demo even though
    `dod`, on the folder the trainer left, passes."""
    from x1_pretrain.stack.demo import Console, OneShots, finish_run
    from x1_pretrain.stack.workspace import Workspace

    ws = Workspace(tmp_path / "ws")
    ws.logs.mkdir(parents=True)
    shutil.copytree(spiked_run.run_dir, ws.run_dir)
    val = json.loads((ws.run_dir / "manifest.json").read_text())["final_val_loss"]
    band = (val - 0.5, val + 0.5)
    dod = subprocess.run([sys.executable, "-m", "x1_pretrain.dod", str(ws.run_dir), "--band", f"{band[0]:g}",
                          f"{band[1]:g}", "--cap-usd", "35"], capture_output=True, text=True, env=cli_env(), cwd=REPO)
    assert dod.returncode == 0, dod.stdout + dod.stderr  # the folder itself passes
    said: list[str] = []
    console = Console()
    console.say = said.append  # type: ignore[method-assign]
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{s.getsockname()[1]}"
    code = finish_run(ws, OneShots(ws), dead, console, band)
    assert code != 0
    assert any(line.startswith("finish (export_run, post-mortem, dod") and "exit 2" in line for line in said), said
