"""The budget contract end to end, with the real trainer (docs/DESIGN.md §6, §7).

First the guard inside a running trainer, driven by budget.json files the test writes: a projection
over the cap stops with 76 and a new complete checkpoint, spend over the cap stops with 77 and
writes nothing, a stale file extrapolated past the cap stops the run, and crossing the alert line
sends exactly one webhook POST and one email (to a local receiver and a local SMTP server).

Then the whole chain — fake billing API (time-scaled) → sidecar → budget.json or /budget → the
trainer's guard — at a normal price, a tripled price, an API outage and a sidecar restart; and
the trainer's own projection (the sidecar started as the default .env starts it, with no planned
hours, so that its projection is the spend alone): the default TOTAL_STEPS refused at launch with
the steps that fit, a run measured too slow stopped with a checkpoint, a run planned by `plan`
finishing. Every file those runs leave (logs, budget.json, the sidecar's ledger, checkpoints, the
MLflow store) is searched for the provider API key.

Last, the throughput floor in a running trainer: no warning from the first interval after a start
or a resume, nor from one holding an eval or a checkpoint; a warning from the first steady one.

Real processes, sockets and files throughout; the fake billing API is the only stand-in.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
from collections.abc import Callable, Iterator
from datetime import datetime, timedelta, timezone
from itertools import pairwise
from pathlib import Path
from typing import Any

import pytest
from aiosmtpd.controller import Controller

from budget_sidecar.testing import FakeBilling, ManagedProcess, ProcessExited, Sidecar, wait_until
from conftest import CONFIGS, REPO, TINY_CONFIG, cli_env, free_port, run_module, start_trainer, train_args
from receivers import Inbox, WebhookReceiver
from x1_common.contracts import Heartbeat

pytestmark = pytest.mark.slow

KEY = "sk-live-e2e-7d41c0f9b2a6"  # the provider API key: must never show up anywhere
CAP = 35.0
SCALE = 360.0  # fake billing and sidecar: one wall second bills 0.1 h
CHECK_EVERY_MIN = "0.002"  # the guard reads at every optimizer step (a step takes longer than 0.12 s)
RUN_TIMEOUT = 300.0  # generous: two shared CPU cores


@pytest.fixture(autouse=True)
def mlflow_file_store_readable(monkeypatch: pytest.MonkeyPatch) -> None:
    """The runs log to MLflow's file store (the lab's file:///workspace/mlruns); MLflow >= 3.7 lets a
    client read it only when asked to, as the trainer and export_run ask."""
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")


# --- processes --------------------------------------------------------------------------------------


class Trainer:
    """`python -m x1_pretrain.train` in its own process group, its output in `log`."""

    def __init__(self, args: list[str], root: Path, env: dict[str, str] | None = None) -> None:
        self.ckpt = Path(args[args.index("--ckpt-dir") + 1])
        self.mlflow_uri = args[args.index("--mlflow-uri") + 1]
        self.log = root / f"trainer-{len(list(root.glob('trainer-*.log')))}.log"
        self.proc = start_trainer(args, self.log, env=env)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def text(self) -> str:
        return self.log.read_text(errors="replace")

    def heartbeat(self) -> Heartbeat | None:
        hb = Heartbeat.read(self.ckpt / "heartbeat.json")
        return hb if hb is not None and hb.pid == self.pid else None

    def wait_for_step(self, step: int, timeout: float = RUN_TIMEOUT) -> Heartbeat:
        """The first heartbeat of this process in phase training at `step` or later."""

        def reached() -> Heartbeat | None:
            if self.proc.poll() is not None:
                raise ProcessExited(f"trainer exited {self.proc.returncode} before step {step}:\n{self.text()[-3000:]}")
            hb = self.heartbeat()
            return hb if hb is not None and hb.phase == "training" and hb.step >= step else None

        return wait_until(reached, timeout, 0.05, f"trainer step {step}")

    def wait(self, timeout: float = RUN_TIMEOUT) -> int:
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"trainer still running after {timeout:g} s:\n{self.text()[-3000:]}") from None

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)  # emergency checkpoint, exit 75
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)


@pytest.fixture
def started() -> Iterator[Callable[[Any], Any]]:
    """Register every process a test starts; all are stopped at the end, pass or fail."""
    procs: list[Trainer | ManagedProcess] = []

    def add(p: Any) -> Any:
        procs.append(p)
        return p

    yield add
    for p in reversed(procs):
        p.stop()


def guarded_args(data: Path, root: Path, uri: str | Path, *extra: str, total: int = 400) -> list[str]:
    """The tiny run with the guard on (cap $35) reading `uri` at every step, a heartbeat and MLflow
    metrics (spend included) at every step; MLflow's file store under root/mlruns."""
    return train_args(data, root / "ckpt", f"file://{root}/mlruns", "--log-every", "1", "--budget-cap-usd",
                      str(CAP), "--budget-curr-cost-uri", str(uri), "--budget-check-every-min", CHECK_EVERY_MIN,
                      *extra, total=total)


# --- budget.json, checkpoints, MLflow -----------------------------------------------------------------


def write_reading(path: Path, *, spent: float, projected: float, rate: float = 1.10, age_s: float = 0.0,
                  stale: bool = False) -> None:
    """A budget.json as the sidecar writes it, atomically (temp file + rename)."""
    updated = datetime.now(timezone.utc) - timedelta(seconds=age_s)
    doc = {
        "spent_usd": spent, "rate_usd_per_hr": rate, "hours_elapsed": spent / rate,
        "projected_total_usd": projected, "last_update_utc": updated.isoformat().replace("+00:00", "Z"),
        "cap_usd": CAP, "provider": "lambda", "instance_id": "inst-1",
        "source": "estimate" if stale else "provider-api", "stale": stale,
    }
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(doc))
    os.replace(tmp, path)


def checkpoint_files(ckpt: Path) -> dict[str, tuple[int, int]]:
    """Every checkpoint entry (step folders and their files, temp folders, latest, final files)
    with its mtime and size: two snapshots are equal only if nothing was written in between."""
    out: dict[str, tuple[int, int]] = {}
    for p in sorted(ckpt.iterdir()):
        if p.name.startswith(("step_", ".tmp-step_", "latest", "final")):
            for q in [p, *sorted(p.rglob("*"))] if p.is_dir() else [p]:
                st = q.stat()
                out[str(q.relative_to(ckpt))] = (st.st_mtime_ns, st.st_size)
    return out


def verified_latest(ckpt: Path) -> tuple[Path, dict[str, Any]]:
    """The checkpoint `latest` points at, checked the way a resume checks it; and its trainer state."""
    from x1_pretrain.checkpoint.store import Checkpointer
    from x1_pretrain.config import load_config

    path = ckpt / (ckpt / "latest").read_text().strip()
    problem = Checkpointer(ckpt, 3, load_config(TINY_CONFIG).model).verify(path)
    assert problem is None, problem
    return path, json.loads((path / "trainer_state.json").read_text())


def mlflow_run(ckpt: Path, uri: str) -> tuple[Any, str]:
    from mlflow.tracking import MlflowClient

    run_id = json.loads((ckpt / "mlflow-run.json").read_text())["run_id"]
    return MlflowClient(tracking_uri=uri), run_id


def spent_history(ckpt: Path, uri: str) -> list[float]:
    """The spend the trainer logged to MLflow, in step order (then time order within a step)."""
    client, run_id = mlflow_run(ckpt, uri)
    history = client.get_metric_history(run_id, "spent_usd")
    return [m.value for m in sorted(history, key=lambda m: (m.step, m.timestamp))]


def assert_key_nowhere(root: Path) -> None:
    """The API key is in no file under `root`: process logs (what each said, errors included),
    budget.json, the sidecar's ledger, checkpoints, the MLflow store."""
    searched = [p for p in root.rglob("*") if p.is_file()]
    names = {p.name for p in searched}
    assert {"budget.json", "budget-state.json", "spent_usd", "meta.yaml"} <= names, names  # MLflow: metrics, run
    assert any(n.startswith("sidecar-") for n in names) and any(n.startswith("trainer-") for n in names), names
    for p in searched:
        try:
            data = p.read_bytes()
        except FileNotFoundError:  # a temp file renamed meanwhile: its new name is searched too
            continue
        assert KEY.encode() not in data, f"the API key is in {p}"


# --- alert channels -----------------------------------------------------------------------------------


@pytest.fixture
def alert_channels() -> Iterator[tuple[dict[str, str], WebhookReceiver, Inbox]]:
    """A webhook receiver and an SMTP server on 127.0.0.1, and the environment that points at them."""
    webhook, inbox = WebhookReceiver(path="/services/T0/B0/e2e-hook"), Inbox()
    smtpd = Controller(inbox, hostname="127.0.0.1", port=free_port())
    smtpd.start()
    env = {"SLACK_WEBHOOK_URL": webhook.url, "SMTP_HOST": "127.0.0.1", "SMTP_PORT": str(smtpd.port),
           "SMTP_FROM": "x1@example.org", "SMTP_TO": "ops@example.org"}
    try:
        yield env, webhook, inbox
    finally:
        smtpd.stop()
        webhook.close()


# =====================================================================================================
# The guard in a running trainer, driven by budget.json files written here


def test_a_projection_over_the_cap_writes_a_new_checkpoint_and_exits_76(tmp_path, tiny_data, started) -> None:
    budget = tmp_path / "budget.json"
    write_reading(budget, spent=10.0, projected=20.0)
    # No periodic checkpoints: any checkpoint in the folder is the budget stop's.
    t = started(Trainer(guarded_args(tiny_data, tmp_path, budget, "--ckpt-every", "1000"), tmp_path))
    reached = t.wait_for_step(2)
    assert checkpoint_files(t.ckpt) == {}
    write_reading(budget, spent=12.0, projected=36.5)
    assert t.wait() == 76, t.text()[-3000:]

    path, state = verified_latest(t.ckpt)
    assert [p.name for p in t.ckpt.glob("step_*")] == [path.name]  # the one written by the stop
    assert state["step"] > reached.step
    assert Heartbeat.read(t.ckpt / "heartbeat.json").step == state["step"]  # the step it stopped at
    assert not (t.ckpt / "final.safetensors").exists()
    log = t.text()
    assert "projected total $36.50 is over the cap $35" in log and f"budget-stop at step {state['step']}" in log
    client, run_id = mlflow_run(t.ckpt, t.mlflow_uri)
    assert client.get_run(run_id).data.tags["x1.end"] == "budget-stop"


def test_spend_over_the_cap_exits_77_and_writes_no_checkpoint_after_the_reading(tmp_path, tiny_data,
                                                                                 started) -> None:
    budget = tmp_path / "budget.json"
    write_reading(budget, spent=10.0, projected=20.0)
    t = started(Trainer(guarded_args(tiny_data, tmp_path, budget), tmp_path))  # checkpoints every 10 steps
    t.wait_for_step(11)  # step_00000010 is complete, the next periodic one is 9 steps away
    before = checkpoint_files(t.ckpt)
    assert any(name.startswith("step_00000010/") for name in before), before
    write_reading(budget, spent=35.5, projected=36.0)
    assert t.wait() == 77, t.text()[-3000:]

    assert checkpoint_files(t.ckpt) == before  # nothing new, nothing touched
    log = t.text()
    assert "spent $35.50" in log and "exiting now without a checkpoint" in log and "exit 77" in log
    client, run_id = mlflow_run(t.ckpt, t.mlflow_uri)
    assert client.get_run(run_id).data.tags["x1.end"] == "budget-overspent"


def test_a_stale_file_whose_extrapolation_passes_the_cap_stops_the_run(tmp_path, tiny_data, started) -> None:
    budget = tmp_path / "budget.json"
    write_reading(budget, spent=10.0, projected=20.0)
    t = started(Trainer(guarded_args(tiny_data, tmp_path, budget), tmp_path))
    t.wait_for_step(2)
    # The sidecar's last word, 2 h ago: $33 at $1.10/h, marked stale. Every figure in the file is
    # under the cap; extrapolated to now it is $35.20.
    write_reading(budget, spent=33.0, projected=33.0, age_s=2 * 3600, stale=True)
    assert t.wait() == 77, t.text()[-3000:]
    assert "spent $35.20 (extrapolated from a reading 120 min old) is over the cap $35" in t.text()


def test_crossing_the_alert_line_sends_one_webhook_post_and_one_email(tmp_path, tiny_data, started,
                                                                      alert_channels) -> None:
    env, webhook, inbox = alert_channels
    budget = tmp_path / "budget.json"
    write_reading(budget, spent=29.0, projected=34.0)
    t = started(Trainer(guarded_args(tiny_data, tmp_path, budget, total=12), tmp_path, env=cli_env(**env)))
    t.wait_for_step(3)
    write_reading(budget, spent=30.4, projected=34.0)  # crosses the $30 line
    t.wait_for_step(6)
    write_reading(budget, spent=30.9, projected=34.0)  # still over it: no second alert
    assert t.wait() == 0, t.text()[-3000:]  # an alert is no action: the run finishes

    log = t.text()
    assert log.count("budget: continue: spent $30.90") >= 3  # the guard judged the later reading repeatedly
    assert len(webhook.posts) == 1, webhook.posts
    assert "$30.40" in webhook.posts[0]["text"] and "alert line" in webhook.posts[0]["text"]
    assert len(inbox.messages) == 1, [m["Subject"] for m in inbox.messages]
    message = inbox.messages[0]
    assert "alert line" in message["Subject"] and message["To"] == "ops@example.org"
    assert "$30.40" in message.get_payload()


# =====================================================================================================
# Fake billing API → sidecar → trainer


@pytest.fixture
def billing(tmp_path: Path, started):
    """Factory: the fake billing API and the sidecar, both time-scaled, both holding the API key."""

    def start(*, price: float = 1.10, scale: float = SCALE, cap: float = CAP, alert: float = 30.0,
              planned_hours: float | None = 24.0, port: int | None = None) -> tuple[FakeBilling, Sidecar]:
        fake = started(FakeBilling.start(tmp_path / "logs", provider="lambda", instance_id="inst-1", api_key=KEY,
                                         price_usd_per_hr=price, time_scale=scale))
        sidecar = start_sidecar(fake, scale=scale, cap=cap, alert=alert, planned_hours=planned_hours, port=port)
        return fake, sidecar

    def start_sidecar(fake: FakeBilling, *, scale: float = SCALE, cap: float = CAP, alert: float = 30.0,
                      planned_hours: float | None = 24.0, port: int | None = None) -> Sidecar:
        extra = ["--time-scale", str(scale), "--http-timeout", "0.5"]
        if planned_hours is not None:
            extra += ["--planned-hours", str(planned_hours)]
        sidecar = started(Sidecar.start(tmp_path / "logs", tmp_path / "ws" / "budget.json", provider="lambda",
                                        instance_id="inst-1", api_url=fake.url, poll_seconds=1.0, cap_usd=cap,
                                        alert_usd=alert, extra_args=extra, env={"LAMBDA_API_KEY": KEY}, port=port))
        wait_until(lambda: sidecar.output.is_file(), 60, 0.1, "the first budget.json")
        return sidecar

    start.sidecar = start_sidecar  # type: ignore[attr-defined]
    return start


def trainer_env(**extra: str) -> dict[str, str]:
    # The key sits in the trainer's environment too, as it would with one shared .env file: the
    # trainer must not carry it into its logs, checkpoints or MLflow either.
    return cli_env(LAMBDA_API_KEY=KEY, **extra)


def budget_when(sidecar: Sidecar, predicate: Callable[[dict[str, Any]], bool], what: str,
                timeout: float = 60.0) -> dict[str, Any]:
    return wait_until(lambda: (lambda b: b if predicate(b) else None)(sidecar.budget()), timeout, 0.1, what)


def budget_lines(t: Trainer, words: str) -> list[str]:
    """The guard's log lines (one per budget check) that contain `words`."""
    return [line for line in t.text().splitlines() if "x1.budget_guard" in line and words in line]


def own_usd(line: str) -> float:
    """The trainer's own projection in a budget line ("... -> own $29.71; ...")."""
    return float(line.split("-> own $")[1].split(";")[0])


def test_at_the_normal_price_the_run_finishes_under_the_cap(tmp_path, tiny_data, billing, started) -> None:
    fake, sidecar = billing()
    args = guarded_args(tiny_data, tmp_path, sidecar.output, "--planned-rate-usd-per-hr", "1.10",
                        "--planned-hours", "24", total=12)
    t = started(Trainer(args, tmp_path, env=trainer_env()))
    assert t.wait() == 0, t.text()[-3000:]

    assert (t.ckpt / "final.safetensors").is_file()
    log = t.text()
    assert "Confirmed acceptable, $8.60 buffer." in log  # the lab's pre-launch sentence
    assert "launch accepted" in log and "ALERT" not in log
    spent = spent_history(t.ckpt, t.mlflow_uri)
    assert len(spent) >= 4 and 0 < spent[0]
    assert all(a <= b for a, b in pairwise(spent)), spent
    final = sidecar.budget()
    assert spent[-1] <= final["spent_usd"] + 0.01 and final["spent_usd"] < CAP
    assert final["projected_total_usd"] < CAP and final["stale"] is False
    assert_key_nowhere(tmp_path)


TRIPLED_STEPS = 400
# A throughput at which the 400 steps need 12 billed hours at SCALE: $14.50 of the $35 at $1.10/h with
# the 10% margin, $43.60 at $3.30/h. The run logs only every 100 steps, so the price triples before it
# has measured its own pace: the projection that stops it is the plan's, whatever this CPU's speed.
TRIPLED_TOKENS_PER_SEC = TRIPLED_STEPS * 512 * SCALE / (12 * 3600)


@pytest.fixture(scope="module")
def tripled_price_run(tmp_path_factory, tiny_data) -> Iterator[dict[str, Any]]:
    """One run, shared by the two tests below: planned at $1.10/h, the sidecar with no planned hours
    (the default .env: its projection is the spend so far), the provider's price tripled once
    training is under way. Alerts go to a local webhook."""
    root = tmp_path_factory.mktemp("tripled")
    webhook = WebhookReceiver(path="/services/T0/B0/e2e-hook")
    procs: list[Any] = []
    try:
        fake = FakeBilling.start(root / "logs", provider="lambda", instance_id="inst-1", api_key=KEY,
                                 time_scale=SCALE)
        procs.append(fake)
        sidecar = Sidecar.start(root / "logs", root / "ws" / "budget.json", provider="lambda", instance_id="inst-1",
                                api_url=fake.url, poll_seconds=1.0, env={"LAMBDA_API_KEY": KEY},
                                extra_args=["--time-scale", str(SCALE), "--http-timeout", "0.5"])
        procs.append(sidecar)
        wait_until(lambda: sidecar.output.is_file(), 60, 0.1, "the first budget.json")
        args = guarded_args(tiny_data, root, sidecar.output, "--planned-rate-usd-per-hr", "1.10", "--ckpt-every",
                            "1000", "--log-every", "100", "--expected-tokens-per-sec", f"{TRIPLED_TOKENS_PER_SEC:.1f}",
                            total=TRIPLED_STEPS)
        t = Trainer(args, root, env=trainer_env(SLACK_WEBHOOK_URL=webhook.url))
        procs.append(t)
        reached = t.wait_for_step(0)  # training (the heartbeat moves only every 100 steps here)
        accepted = budget_lines(t, "launch accepted")[0]
        fake.control(price_usd_per_hr=3.30)
        code = t.wait()
        yield {"trainer": t, "code": code, "reached": reached, "webhook": webhook, "root": root,
               "budget": sidecar.budget(), "accepted": accepted}
    finally:
        for p in reversed(procs):
            p.stop()
        webhook.close()


def test_a_tripled_price_moves_the_trainers_projection_and_stops_with_76_and_a_checkpoint(tripled_price_run) -> None:
    run = tripled_price_run
    t: Trainer = run["trainer"]
    assert run["code"] == 76, t.text()[-3000:]
    budget = run["budget"]
    assert budget["rate_usd_per_hr"] == pytest.approx(3.30)
    # The sidecar has no planned hours: its projection is the spend, under the cap; the trainer's own stopped it.
    assert budget["projection"] == "spent only: no planned hours"
    assert budget["projected_total_usd"] == pytest.approx(budget["spent_usd"]) and budget["spent_usd"] < CAP
    before, stop = own_usd(run["accepted"]), own_usd(budget_lines(t, "is over the cap")[0])
    assert before < CAP < stop
    stop_line = budget_lines(t, "is over the cap")[0]
    assert "at $3.30/h" in stop_line and "(plan: " in stop_line
    path, state = verified_latest(t.ckpt)
    assert state["step"] > run["reached"].step
    assert f"budget-stop at step {state['step']}" in t.text()
    assert_key_nowhere(run["root"])


def test_a_tripled_price_sends_the_rate_warning_before_the_stop(tripled_price_run) -> None:
    run = tripled_price_run
    assert run["code"] == 76
    texts = [p["text"] for p in run["webhook"].posts]
    assert any("over 1.2x the plan" in text for text in texts), texts


def test_with_the_api_down_the_reading_goes_stale_spend_keeps_rising_and_the_guard_still_stops(
        tmp_path, tiny_data, billing, started) -> None:
    # The trainer starts at a token price (its start-up time on a loaded machine then costs next to
    # nothing), the price goes to $1.10/h, then the API fails: at 720x, $0.22 per wall second.
    cap = 4.0
    fake, sidecar = billing(price=0.05, scale=720.0, cap=cap, alert=3.0, planned_hours=None)
    # An eval at every step: no log interval is steady, so the trainer never measures its own pace and
    # the guard judges the sidecar's figures alone (as before a first steady interval on a CPU). With its
    # pace, the trainer would stop this run (76) as soon as the price rose: the steps cannot fit $4.
    args = guarded_args(tiny_data, tmp_path, sidecar.output, "--planned-rate-usd-per-hr", "1.10",
                        "--eval-every", "1")
    args[args.index("--budget-cap-usd") + 1] = str(cap)
    t = started(Trainer(args + ["--budget-alert-usd", "3"], tmp_path, env=trainer_env()))
    t.wait_for_step(1)
    fake.control(price_usd_per_hr=1.10)
    budget_when(sidecar, lambda b: b["rate_usd_per_hr"] == pytest.approx(1.10), "the new price")
    fake.control(fail_mode="500")

    seen = [budget_when(sidecar, lambda b: b["consecutive_failures"] >= 1, "a failed poll")]
    for n in (2, 3):
        seen.append(budget_when(sidecar, lambda b, n=n: b["consecutive_failures"] >= n, f"{n} failed polls"))
    assert t.proc.poll() is None, "stopped before the API had been down for 3 polls: " + t.text()[-2000:]
    assert seen[-1]["stale"] is True and seen[-1]["source"] == "estimate"
    assert seen[-1]["rate_usd_per_hr"] == pytest.approx(1.10)  # the last known rate
    assert seen[-1]["spent_usd"] < cap
    spends = [b["spent_usd"] for b in seen]
    assert spends == sorted(spends) and spends[0] < spends[-1]  # still rising while the API is down

    assert t.wait() == 77, t.text()[-3000:]
    assert fake.state()["fail_mode"] == "500"  # the API never came back
    assert "own projection: no pace yet" in t.text()
    log = t.text()
    assert "ALERT [stale]" in log and "marked stale by the sidecar" in log
    assert f"is over the cap ${cap:.0f}: exiting now without a checkpoint" in log
    last = sidecar.budget()
    assert last["stale"] is True and last["consecutive_failures"] >= 3
    assert_key_nowhere(tmp_path)


def test_a_sidecar_restarted_mid_run_never_shows_less_spend(tmp_path, tiny_data, billing, started) -> None:
    port = free_port()
    fake, sidecar = billing(port=port)
    url = f"http://127.0.0.1:{port}/budget"  # the guard reads the sidecar over HTTP here
    args = guarded_args(tiny_data, tmp_path, url, total=16)
    t = started(Trainer(args, tmp_path, env=trainer_env()))
    t.wait_for_step(4)
    before = sidecar.budget()
    sidecar.stop()
    # The guard notices: no new reading, the last one keeps being extrapolated.
    wait_until(lambda: t.text().count(f"no new budget reading ({url}") >= 3, 120, 0.1, "failed reads by the guard")
    restarted = billing.sidecar(fake, port=port)
    after = restarted.budget()
    assert after["spent_usd"] > before["spent_usd"]  # the time it was down is charged, not lost
    assert t.wait() == 0, t.text()[-3000:]
    assert "budget: continue" in t.text().split("no new budget reading")[-1]  # it read the new sidecar

    spent = spent_history(t.ckpt, t.mlflow_uri)
    assert len(spent) >= 14
    # budget.json carries 6 decimals: allow that rounding, nothing more.
    drops = [(i, a, b) for i, (a, b) in enumerate(pairwise(spent)) if b < a - 1e-6]
    assert not drops, drops
    assert spent[-1] > before["spent_usd"]
    assert restarted.budget()["spent_usd"] >= after["spent_usd"]
    assert_key_nowhere(tmp_path)


# =====================================================================================================
# The trainer's own projection: the sidecar as the default .env starts it (no planned hours)


def env_example_value(name: str) -> str:
    for line in (REPO / ".env.example").read_text(encoding="utf-8").splitlines():
        if line.startswith(f"{name}="):
            return line.split("=", 1)[1].strip()
    raise AssertionError(f".env.example has no {name}")


def a100_args(data: Path, root: Path, uri: Path, total: int, ckpt: str = "ckpt") -> list[str]:
    """The lab's 50M config as compose runs it, on this CPU: refused or accepted before the model is built."""
    from x1_pretrain.train.accounting import tokens_per_sec_table

    args = guarded_args(data, root, uri, "--set", "train.device=cpu", "--set", "train.compile=false",
                        # plan's figure for an A100 80GB, stated: a CPU has none of its own
                        "--expected-tokens-per-sec", str(tokens_per_sec_table()["a100-80gb"].tokens_per_sec),
                        "--ckpt-every", env_example_value("CKPT_EVERY"), "--eval-every", env_example_value("EVAL_EVERY"),
                        total=total)
    args[args.index("--config") + 1] = str(CONFIGS / "x1-50m-a100.yaml")
    args[args.index("--ckpt-dir") + 1] = str(root / ckpt)
    return args


def test_the_default_env_total_steps_on_an_a100_priced_instance_are_refused_at_launch_naming_the_steps_that_fit(
        tmp_path, tiny_data, billing, started) -> None:
    # Lambda's A100 price, billed in real time (the A100's steps are real seconds); .env's empty PLANNED_HOURS
    fake, sidecar = billing(price=1.10, scale=1.0, planned_hours=None)
    assert env_example_value("PLANNED_HOURS") == ""
    assert "no --planned-hours" in sidecar.log_text() and "no remaining-time term" in sidecar.log_text()
    total = int(env_example_value("TOTAL_STEPS"))
    assert total == 84_000

    t = started(Trainer(a100_args(tiny_data, tmp_path, sidecar.output, total), tmp_path, env=trainer_env()))
    assert t.wait() == 78, t.text()[-3000:]
    refusal = budget_lines(t, "launch refused")[0]
    from x1_pretrain.train.accounting import fmt_count, tokens_per_sec_table

    a100 = fmt_count(tokens_per_sec_table()["a100-80gb"].tokens_per_sec)
    assert f"(plan: {a100} tokens/s" in refusal and own_usd(refusal) > 50  # ~45 h at $1.10/h
    fits = int(refusal.split("--total-steps ")[1].split()[0])
    assert 40_000 < fits < total
    assert not list(t.ckpt.glob("step_*")) and not (t.ckpt / "final.safetensors").exists()

    # The steps it names are accepted (killed once accepted: a 50M model would train for days on a CPU).
    again = started(Trainer(a100_args(tiny_data, tmp_path, sidecar.output, fits, ckpt="ckpt2"), tmp_path,
                            env=trainer_env()))
    wait_until(lambda: budget_lines(again, "launch accepted") or again.proc.poll() is not None, RUN_TIMEOUT, 0.1,
               "the relaunch's decision")
    if again.proc.poll() is None:
        os.killpg(again.pid, signal.SIGKILL)
    again.proc.wait(30)
    accepted = budget_lines(again, "launch accepted")
    assert accepted and own_usd(accepted[0]) <= CAP, again.text()[-3000:]
    for path in tmp_path.rglob("*"):  # no MLflow run yet (the launch comes first): the logs and budget files
        assert not path.is_file() or KEY.encode() not in path.read_bytes(), f"the API key is in {path}"


def test_a_run_measured_too_slow_for_the_cap_stops_with_76_and_a_complete_checkpoint_before_the_cap(
        tmp_path, tiny_data, billing, started) -> None:
    fake, sidecar = billing(planned_hours=None)
    # The plan's throughput given is far beyond this CPU's: the launch fits, the first measure does not.
    args = guarded_args(tiny_data, tmp_path, sidecar.output, "--expected-tokens-per-sec", "1e7", total=100_000)
    t = started(Trainer(args, tmp_path, env=trainer_env()))
    assert t.wait() == 76, t.text()[-3000:]

    accepted = budget_lines(t, "launch accepted")[0]
    assert "(plan: 10.0M tokens/s" in accepted and own_usd(accepted) < CAP
    stop = budget_lines(t, "is over the cap")[0]
    assert "(measured: the first steady interval)" in stop and "--total-steps" in stop
    spent_at_stop = float(stop.split("spent $")[1].split(")")[0])
    assert spent_at_stop < CAP  # stopped on the projection, long before the spend gets there
    path, state = verified_latest(t.ckpt)
    assert [p.name for p in t.ckpt.glob("step_*")] == [path.name] and state["step"] < 10  # the stop's checkpoint
    assert f"budget-stop at step {state['step']}" in t.text()
    assert sidecar.budget()["spent_usd"] < CAP


def test_a_run_planned_by_plan_finishes_with_no_budget_stop_and_no_floor_warning(
        tmp_path, tiny_data, billing, started) -> None:
    fake, sidecar = billing(planned_hours=None)
    # This CPU stands in for the GPU: plan is told a throughput well under what it does, in tokens per
    # billed second (the fake bills SCALE seconds per wall second), and the trainer the same per wall second.
    wall_tokens_per_sec = 30.0
    proc = run_module("x1_pretrain.plan", "--config", str(TINY_CONFIG), "--price-usd-per-hr", "1.10",
                      "--budget-usd", str(CAP), "--tokens-per-sec", str(wall_tokens_per_sec / SCALE), "--json")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    steps = json.loads(proc.stdout)["proposed_total_steps"]
    assert 8 <= steps <= 30, steps
    args = guarded_args(tiny_data, tmp_path, sidecar.output, "--log-every", "2", "--expected-tokens-per-sec",
                        str(wall_tokens_per_sec), total=steps)
    t = started(Trainer(args, tmp_path, env=trainer_env()))
    assert t.wait() == 0, t.text()[-3000:]

    log = t.text()
    assert (t.ckpt / "final.safetensors").is_file()
    assert "throughput floor: 18 tokens/s (0.6 x the expected 30 tokens/s)" in log
    assert "under the floor" not in log and "budget-stop" not in log and "over the cap" not in log
    measured = budget_lines(t, "(measured: ")
    assert measured and all(own_usd(line) < CAP for line in measured)
    assert sidecar.budget()["spent_usd"] < CAP
    client, run_id = mlflow_run(t.ckpt, t.mlflow_uri)
    metrics = client.get_run(run_id).data.metrics
    assert metrics["projected_usd"] >= metrics["projected_own_usd"] > 0 and metrics["projected_sidecar_usd"] > 0
    assert metrics["hours_needed"] >= 0


# =====================================================================================================
# The throughput floor in a running trainer


def floor_args(data: Path, root: Path, *extra: str) -> list[str]:
    """The tiny run with a floor no CPU reaches: every steady interval is under it, so which interval
    warns shows which intervals are judged."""
    return train_args(data, root / "ckpt", f"file://{root}/mlruns", "--log-every", "2",
                      "--set", "train.min_tokens_per_sec=1e9", *extra, total=100)


def floor_warnings(t: Trainer) -> list[str]:
    return [line for line in t.text().splitlines() if "under the floor" in line]


def step_line(t: Trainer, step: int) -> str:
    return next(line for line in t.text().splitlines() if f" step {step}/100 " in line)


def test_the_floor_judges_the_first_steady_interval_not_a_start_a_resume_an_eval_or_a_checkpoint(
        tmp_path, tiny_data, started) -> None:
    # First process: (0, 2] holds the start, (2, 4] the eval at step 3, (4, 6] is steady.
    t = started(Trainer(floor_args(tiny_data, tmp_path, "--eval-every", "3", "--ckpt-every", "1000"), tmp_path))
    wait_until(lambda: floor_warnings(t) or t.proc.poll() is not None, RUN_TIMEOUT, 0.1, "a floor warning")
    t.stop()
    assert t.proc.returncode == 75, t.text()[-3000:]
    assert "(not steady: start)" in step_line(t, 2) and "(not steady: eval)" in step_line(t, 4)
    assert [w.split("x1.train: ")[1].split(":")[0] for w in floor_warnings(t)] == ["step 6"]

    # Second process, resumed at the emergency checkpoint's step s: the first interval holds the resume,
    # the next one a checkpoint (every first + 1 steps), the one after is steady.
    _, state = verified_latest(t.ckpt)
    first = state["step"] - state["step"] % 2 + 2
    r = started(Trainer(floor_args(tiny_data, tmp_path, "--resume-from-latest", "--eval-every", "1000",
                                   "--ckpt-every", str(first + 1)), tmp_path))
    wait_until(lambda: floor_warnings(r) or r.proc.poll() is not None, RUN_TIMEOUT, 0.1, "a floor warning")
    r.stop()
    assert "(not steady: resume)" in step_line(r, first) and "(not steady: checkpoint)" in step_line(r, first + 2)
    assert [w.split("x1.train: ")[1].split(":")[0] for w in floor_warnings(r)] == [f"step {first + 4}"]
