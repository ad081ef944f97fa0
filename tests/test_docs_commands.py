"""Every command README.md and docs/DEPLOY.md show runs as shown, wherever a CPU machine can run it.

The commands are read from the markdown itself: the lines of its ```sh blocks (backslash
continuations joined, comments dropped) and the inline `python -m ...` (and `docker`, `make`,
`curl`, `torchrun`) spans of its prose and of README's command table. So a command added to, or
changed in, either page is tested here without touching this file, and one this file cannot
place fails `test_every_command_the_docs_show_is_run_or_skipped_for_a_stated_reason`.

They run against a tiny run's outputs in the /workspace layout: the session's `spiked_run`
(tests/test_export_run.py: the tiny config the demo trains, checkpoints/, budget.json,
logs/termination.json, an MLflow store and the exported run/), copied, so no second training run
and no second demo. Placeholders are filled in (U the MLflow URI, K the checkpoint dir, DIR a run
folder, D and O data folders, C the tiny config, `...` the local flags a CPU run needs);
`/workspace` is the copy; `http://mlflow-server:5000` is a real `mlflow server` over the copy's
store; `docker compose run --rm --no-deps prepare CMD` runs CMD (the prepare image is the trainer's
code). A command passes when it exits with a code it documents for a verdict (0, or dod's 1 for a
failing check, plan's and price's 78), never 2 (usage) and never with a traceback.

SKIPPED (the rules below, each with its reason): Docker and compose commands (no Docker engine
here; compose.yaml is checked by tests/test_static_checks.py), nvidia-smi (a GPU), ssh and the
running stack's curl (a cloud instance), sudo on the persistent disk (root on the GPU host),
torchrun with the trainer's elided flags (tests/test_distributed.py runs torchrun on CPU), provider
mode against Lambda's real API (tests/test_watchdog_provider.py runs it against the fake),
`make demo` and `make test` (tests/test_demo.py runs the demo; this is the suite).
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import stat
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import pytest
from test_export_run import SpikedRun, real_mlflow_server, spiked_run, write_workspace_records

from conftest import REPO, TINY_CONFIG, cli_env

__all__ = ["spiked_run"]  # the shared session fixture, imported so pytest finds it here

pytestmark = pytest.mark.slow

DOCS = (REPO / "README.md", REPO / "docs" / "DEPLOY.md")
INLINE_COMMAND = re.compile(r"^(python -m |make |docker |torchrun |curl |LAMBDA_API_KEY=\S+ python )")
API_KEY = "docs-test-key-41c9"


# ---------------------------------------------------------------------------------------------
# Reading the commands from the markdown


@dataclass(frozen=True)
class DocCommand:
    doc: str
    text: str


def doc_commands() -> list[DocCommand]:
    out: list[DocCommand] = []
    for doc in DOCS:
        text = doc.read_text(encoding="utf-8")
        for block in re.findall(r"```sh\n(.*?)```", text, re.S):
            pending = ""  # a command whose single quote is still open goes on over the next line (sh -c '...')
            for line in block.replace("\\\n", " ").splitlines():
                line = re.split(r"(?:^|\s+)#(?:\s|$)", line, maxsplit=1)[0].strip() if not pending else line.strip()
                pending = f"{pending} {line}".strip()
                if pending and re.sub(r"<[^<>]*>", "", pending).count("'") % 2 == 0:  # <the pod's id> is prose
                    out.append(DocCommand(doc.name, re.sub(r"\s+", " ", pending)))
                    pending = ""
            assert not pending, f"{doc.name}: an unclosed quote in a sh block: {pending}"
        prose = re.sub(r"```.*?```", "", text, flags=re.S)
        for span in re.findall(r"`([^`]+)`", prose):
            span = re.sub(r"\s+", " ", span).strip()
            if INLINE_COMMAND.match(span):
                out.append(DocCommand(doc.name, span))
    seen: set[str] = set()
    return [c for c in out if not (c.text in seen or seen.add(c.text))]  # type: ignore[func-returns-value]


# ---------------------------------------------------------------------------------------------
# What is skipped, and why (first match wins)

SKIPS: tuple[tuple[str, str], ...] = (
    (r"^make (demo|test)$", "the demo and the suite themselves: tests/test_demo.py runs the demo, this is the suite"),
    (r"^(\S+=\S+ )*docker (?!compose run --rm --no-deps prepare python -m )",
     "Docker Engine on the GPU host (tests/test_docker_compose.py runs the stack on a real engine; compose.yaml is "
     "checked by tests/test_static_checks.py)"),
    (r"^bash -c 'if \[ -x /workspace/venv/bin/python \]",
     "the pod's start command: tests/test_stack.py runs it against a scratch volume, set up and not"),
    (r"^cd /workspace && git clone ", "a clone of this repository onto the pod's network volume"),
    (r"^python3? -m (venv|pip) |^/workspace/venv/bin/pip ",
     "the pod's one-time virtual environment on its volume (torch 2.11.0 with CUDA 13.0 from PyPI, a GPU build: "
     "tests/test_levers.py runs its check, trainer/torch_pin.py); make install builds this suite's"),
    (r"^(/workspace/venv/bin/)?python -m x1_pretrain\.stack (up|prepare)\b",
     "the whole stack, or FineWeb-Edu's download: tests/test_stack.py runs `stack up` (foreground and -d), status and "
     "down on a tiny .env; tests/test_demo.py runs the demo's `up -d`"),
    (r"^tail -f ", "follows a log until interrupted"),
    (r"^nvidia-smi", "a GPU"),
    (r"^ssh ", "a cloud instance to tunnel to"),
    (r"^stat -c %g /var/run/docker\.sock", "the Docker socket of the GPU host"),
    (r"^sudo ", "root on the GPU host's persistent disk (/lambda/nfs)"),
    (r"^curl -s localhost:9792", "the running stack's sidecar"),
    (r"^torchrun ", "the trainer's flags elided ('...'); tests/test_distributed.py runs the trainer under torchrun on CPU"),
    (r"^x1 (launch|status|logs|fetch|down)\b",
     "a rented instance over SSH: tests/test_launch.py runs them against the fake providers and SSH containers"),
    (r"^x1 plan ", "python -m x1_pretrain.plan under another name: the plan commands above run it"),
    (r"^python -m x1_pretrain\.dod x1-runs/<id>/run$",
     "the run folder `x1 down` fetched: tests/test_launch.py runs dod on it (all six checks pass)"),
    (r"^pip install \.$", "installs the project into the laptop's Python: make install does the same for this suite"),
    (r"^(LAMBDA|RUNPOD)_API_KEY=\.\.\. python -m x1_watchdog --mode provider ",
     "the provider's real API and instances; tests/test_watchdog_provider.py runs provider mode against the fake"),
)


def skip_reason(text: str) -> str | None:
    return next((reason for pattern, reason in SKIPS if re.search(pattern, text)), None)


# ---------------------------------------------------------------------------------------------
# Running one


@dataclass
class Workspace:
    root: Path  # /workspace
    uri: str  # U: the copy's sqlite store
    http_uri: str  # http://mlflow-server:5000: a real server over another copy of it
    data: Path  # the tiny run's tokens
    corpus: Path  # parquet, for tokenize_data
    billing_url: str  # the fake billing API, for the price command

    @property
    def ckpt(self) -> Path:
        return self.root / "checkpoints"


MENTION = re.compile(r"^python -m [\w.]+( --mode \w+)?$")  # a module named in prose or the table, no arguments
# Exit codes each command documents for a verdict rather than a usage error.
VERDICTS = {"x1_pretrain.dod": {0, 1}, "x1_pretrain.finish": {0, 1}, "x1_pretrain.plan": {0, 78},
            "budget_sidecar.price": {0, 78}, "x1_pretrain.stack": {0, 1}}  # stack status: 1 when nothing runs
# The pod's own values for the <...> the RunPod section leaves to the reader.
ANGLE_PLACEHOLDERS = {"<the pod's price>": "0.89"}
POD_PYTHON = "/workspace/venv/bin/python "  # the pod's venv: this suite's interpreter here


def placeholders(module: str, ws: Workspace) -> dict[str, str]:
    run = ws.root / "docs-run"
    common = {"U": ws.uri, "K": str(ws.ckpt), "C": str(TINY_CONFIG), "TEXT": "The meaning of life is"}
    per_module = {
        "x1_pretrain.tokenize_data": {"D": str(ws.corpus), "O": str(ws.root / "docs-tokenized")},
        "x1_pretrain.train": {"D": str(ws.data)},
        "x1_pretrain.hf_export": {"DIR": str(ws.root / "docs-hf")},
    }
    return {**common, "DIR": str(run), **per_module.get(module, {})}


def fill(argv: list[str], module: str, ws: Workspace) -> list[str]:
    values = placeholders(module, ws)
    out: list[str] = []
    for token in argv:
        if token == "...":  # the table's "and the rest": what a CPU run here needs
            # --total-steps 70: the copied checkpoints' run, so the resume continues it.
            out += ["--total-steps", "70", "--metrics-port", "0", "--heartbeat-file", str(ws.root / "logs" / "heartbeat.json")]
            continue
        head, sep, tail = token.partition("/")
        if head in values:  # a whole placeholder, or one followed by a path ("DIR/spike-postmortem.md")
            token = values[head] + sep + tail
        token = token.replace("http://mlflow-server:5000", ws.http_uri).replace("http://127.0.0.1:5000", ws.http_uri)
        if token.startswith("/workspace"):
            token = str(ws.root) + token[len("/workspace"):]
        elif "=/workspace" in token:
            token = token.replace("=/workspace", f"={ws.root}")
        out.append(token)
    if module == "budget_sidecar.price":
        out += ["--api-url", ws.billing_url]  # the fake billing API stands in for Lambda's
    return out


@dataclass
class Outcome:
    command: DocCommand
    argv: list[str]
    code: int
    allowed: set[int]
    output: str

    @property
    def ok(self) -> bool:
        return self.code in self.allowed and "Traceback (most recent call last)" not in self.output


def run_one(cmd: DocCommand, ws: Workspace, scratch: Path) -> Outcome:
    text = cmd.text.removeprefix("docker compose run --rm --no-deps prepare ")
    if text.startswith(POD_PYTHON):
        text = "python " + text.removeprefix(POD_PYTHON)
    for placeholder, value in ANGLE_PLACEHOLDERS.items():
        text = text.replace(placeholder, value)
    env = cli_env(LAMBDA_API_KEY=API_KEY, RUNPOD_API_KEY=API_KEY)
    if not text.startswith("python -m "):  # shell lines: host checks and .env set-up, in a scratch folder
        shutil.copy(REPO / ".env.example", scratch / ".env.example")
        proc = subprocess.run(["bash", "-c", text], cwd=scratch, capture_output=True, text=True, timeout=60, env=env)
        return Outcome(cmd, ["bash", "-c", text], proc.returncode, {0}, proc.stdout + proc.stderr)
    argv = shlex.split(text)
    module = argv[2]
    if MENTION.match(text):  # a name, not an invocation: its entry point must exist and explain itself
        argv = [*argv[:3], "--help"]
    else:
        argv = fill(argv, module, ws)
    proc = subprocess.run([sys.executable, *argv[1:]], cwd=REPO, capture_output=True, text=True, timeout=600, env=env)
    return Outcome(cmd, argv, proc.returncode, VERDICTS.get(module, {0}), proc.stdout + proc.stderr)


# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def workspace(spiked_run: SpikedRun, tiny_data: Path, corpus_dir: Path,
              tmp_path_factory: pytest.TempPathFactory) -> Iterator[Workspace]:
    from budget_sidecar.testing import FakeBilling
    from x1_common.contracts import BudgetReading, utc_now

    root = Path(shutil.copytree(spiked_run.root, tmp_path_factory.mktemp("docs") / "workspace"))
    write_workspace_records(root)  # a fresh budget reading: the trainer's guard judges its age
    reading = BudgetReading(spent_usd=1.37, rate_usd_per_hr=1.10, hours_elapsed=1.25, projected_total_usd=26.4,
                            last_update_utc=utc_now() - timedelta(seconds=30), cap_usd=35.0, provider="lambda",
                            instance_id="inst-1", source="provider-api")
    (root / "budget.json").write_text(json.dumps(reading.to_dict()))
    served = root / "served.db"
    shutil.copyfile(root / "mlflow.db", served)
    fake = FakeBilling.start(root.parent / "fake", provider="lambda", instance_id="inst-1", api_key=API_KEY)
    try:
        with real_mlflow_server(served, root.parent / "mlflow-server") as url:
            yield Workspace(root, f"sqlite:///{root / 'mlflow.db'}", url, tiny_data, corpus_dir, fake.url)
    finally:
        fake.stop()


def test_every_command_the_docs_show_is_run_or_skipped_for_a_stated_reason() -> None:
    commands = doc_commands()
    texts = [c.text for c in commands]
    # The extraction finds what the pages show (a sample of each kind), so an empty list cannot pass.
    for expected in ("python -m x1_pretrain.sample --checkpoint K --prompt TEXT", "df -h /",
                     "docker compose run --rm --no-deps prepare python -m x1_pretrain.dod /workspace/run",
                     "python -m budget_sidecar.price --provider lambda --instance-type gpu_1x_a100_sxm4 --wait"):
        assert expected in texts, expected
    unplaced = [c for c in commands if skip_reason(c.text) is None and not c.text.startswith(
        ("python -m ", POD_PYTHON + "-m ", "docker compose run --rm --no-deps prepare python -m ", "cp ", "echo ", "df "))]
    assert not unplaced, f"commands in the docs this test neither runs nor skips (add a rule): {unplaced}"


def test_every_cpu_runnable_command_of_the_readme_and_deploy_runs_as_shown(workspace: Workspace, tmp_path: Path,
                                                                          capsys: pytest.CaptureFixture[str]) -> None:
    outcomes, skipped = [], []
    for cmd in doc_commands():
        reason = skip_reason(cmd.text)
        if reason is not None:
            skipped.append(f"{cmd.doc}: {cmd.text}  -- skipped: {reason}")
            continue
        outcomes.append(run_one(cmd, workspace, tmp_path))
    with capsys.disabled():  # the list of what was run and what was skipped, for whoever reads the log
        print("\n" + "\n".join([f"{o.command.doc}: {o.command.text}  -- exit {o.code}" for o in outcomes] + skipped))
    failed = [f"{o.command.doc}: {o.command.text}\n  ran: {shlex.join(o.argv)}\n  exit {o.code} (allowed "
              f"{sorted(o.allowed)})\n  {o.output[-1500:]}" for o in outcomes if not o.ok]
    assert not failed, "\n\n".join(failed)
    ran = {o.command.text for o in outcomes}
    assert len(ran) >= 15 and any("x1_pretrain.sample" in t for t in ran)

    # What they wrote for the user is readable by the user's group and others (the umask's permissions).
    umask = os.umask(0)
    os.umask(umask)
    want_file, want_dir = 0o666 & ~umask, 0o777 & ~umask
    for folder in ("docs-run", "docs-hf", "docs-tokenized", "run"):
        for path in [workspace.root / folder, *(workspace.root / folder).rglob("*")]:
            mode = stat.S_IMODE(path.stat().st_mode)
            want = want_dir if path.is_dir() else want_file
            assert mode & want == want, f"{path}: {oct(mode)}, expected at least {oct(want)}"


def test_the_placeholders_are_whole_words_only() -> None:
    ws = Workspace(Path("/ws"), "sqlite:///u.db", "http://127.0.0.1:1", Path("/d"), Path("/c"), "http://f")
    filled = fill(["--output", "DIR/spike-postmortem.md", "--prompt", "TEXT", "--tokenizer", "gpt2", "DIRT",
                   "--budget-curr-cost-uri", "/workspace/budget.json"], "x1_pretrain.postmortem", ws)
    assert filled == ["--output", "/ws/docs-run/spike-postmortem.md", "--prompt", "The meaning of life is",
                      "--tokenizer", "gpt2", "DIRT", "--budget-curr-cost-uri", "/ws/budget.json"]
