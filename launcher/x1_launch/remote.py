"""What `x1` does on the instance, over SSH: the repository and `.env` put there, the stack started,
its status, logs and run folder read back, the stack stopped.

Layout on a RunPod pod (`--remote-dir`, `--remote-workspace`; on Lambda ~/x1 and ~/x1-workspace),
all on the pod's persistent volume:

    /workspace/x1/          the repository (its tracked files), .env (mode 600)
    /workspace/x1-boot.sh   starts the stack; a RunPod pod runs it again at every resume (cloud.BOOT_SCRIPT)
    /workspace/venv/        the stack's Python with the measured torch (TORCH_VERSION, TORCH_CUDA of
                            .env: 2.11.0, CUDA 13.0), made once: a resumed pod finds it in place
    /workspace/ws/          data/, checkpoints/, mlruns/, logs/, budget.json, run/

Two ways to run the stack, as docs/DEPLOY.md describes: `processes` (`python -m x1_pretrain.stack`,
the RunPod way: a pod is itself a container) and `compose` (Docker Compose on a Lambda VM).
"""

from __future__ import annotations

import json
import posixpath
import shlex
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from x1_launch.ssh import Remote, SSHError

STACKS = ("processes", "compose")
# The torch the trainer image pins and every GPU figure was measured on (compose.yaml's
# TORCH_VERSION and TORCH_CUDA defaults); .env's values, when set, win.
TORCH_PIN = ("2.11.0", "13.0")
SERVICES = ("trainer", "watchdog", "budget-sidecar", "mlflow-server", "prometheus", "stack", "boot")
# Folders never copied: environments, caches, local runs.
SKIP_DIRS = {".git", ".venv", "venv", "__pycache__", ".pytest_cache", ".ruff_cache", "node_modules",
             "demo-workspace", ".mypy_cache", "build", "dist", ".eggs"}


def repo_files(repo: Path) -> list[str]:
    """The repository's files as git tracks them (plus new files not ignored); without git, every
    file outside SKIP_DIRS. Never .env: the instance gets its own, written by `x1 launch`."""
    try:
        proc = subprocess.run(["git", "-C", str(repo), "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                              capture_output=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        proc = None
    if proc is not None and proc.returncode == 0 and proc.stdout:
        names = [n for n in proc.stdout.decode().split("\0") if n]
    else:
        names = [str(p.relative_to(repo)) for p in sorted(repo.rglob("*"))
                 if p.is_file() and not SKIP_DIRS.intersection(p.relative_to(repo).parts)]
    return [n for n in names if Path(n).name != ".env" and (repo / n).is_file() and not (repo / n).is_symlink()]


@dataclass(frozen=True)
class Layout:
    repo: str  # the repository on the instance
    workspace: str  # the stack's workspace on the instance
    stack: str  # processes or compose

    @property
    def env_file(self) -> str:
        return posixpath.join(self.repo, ".env")

    @property
    def boot_script(self) -> str:
        """Beside the repository: on RunPod /workspace/x1-boot.sh, which the pod's start command runs."""
        return posixpath.join(posixpath.dirname(self.repo.rstrip("/")), "x1-boot.sh")

    @property
    def logs(self) -> str:
        return posixpath.join(self.workspace, "logs")

    @property
    def venv(self) -> str:
        """The stack's virtual environment (processes): on the volume beside the repository, so the
        container disk a pod stop wipes holds none of it (docs/DEPLOY.md section 9: /workspace/venv)."""
        return posixpath.join(posixpath.dirname(self.repo.rstrip("/")), "venv")

    @property
    def interpreter(self) -> str:
        return posixpath.join(self.venv, "bin", "python") if self.stack == "processes" else "python3"

    def python(self, module_args: str) -> str:
        """A module of the project run from the copied source tree (its folders on PYTHONPATH)."""
        path = ":".join(posixpath.join(self.repo, d) for d in ("", "trainer", "budget-sidecar", "watchdog"))
        return (f"cd {shlex.quote(self.repo)} && PYTHONPATH={shlex.quote(path.replace('/:', ':'))} "
                f"{shlex.quote(self.interpreter)} -m {module_args}")


def boot_script(layout: Layout, torch: tuple[str, str] = TORCH_PIN) -> str:
    """The stack's start, as a script: `x1 launch` runs it, and a resumed RunPod pod again (its
    start command). Processes: makes the virtual environment on the volume once, with torch at
    `torch` (release, CUDA: .env's TORCH_VERSION and TORCH_CUDA, the trainer image's pin, checked
    by trainer/torch_pin.py as the image build does) and the stack's packages, prepares the data
    once, then starts the stack detached. Its output goes to WS/logs/boot.log, its exit code to
    WS/logs/boot.exit."""
    ws, repo = shlex.quote(layout.workspace), shlex.quote(layout.repo)
    if layout.stack == "compose":
        start = (f"cd {repo} && docker compose --env-file .env build && (test -f {ws}/data/tokenized/meta.json || "
                 "docker compose --env-file .env run --rm prepare) && docker compose --env-file .env up -d")
        install = "true"
        prepare = "true"
    else:
        # The launch runs this script, and a pod's start command too when the pod starts (or
        # resumes) with the script in place: a stack already running is this boot done.
        running = (layout.python(f"x1_pretrain.stack status --json --workspace {ws}") + " 2>/dev/null | python3 -c "
                   "\"import json, sys; sys.exit(0 if json.load(sys.stdin).get('running') else 1)\"")
        start = (f"({running}) && echo 'boot: the stack is already running' || ("
                 + layout.python(f"x1_pretrain.stack up -d --env-file .env --workspace {ws}") + ")")
        venv, py = shlex.quote(layout.venv), shlex.quote(layout.interpreter)
        version, cuda = (shlex.quote(x) for x in torch)
        pin = f"{py} {repo}/trainer/torch_pin.py --version {version} --cuda {cuda}"
        # The image's own packages are seen (--system-site-packages) where they already fit; the
        # rest goes into the venv on the volume, once: a resume finds it all in place.
        install = (f"(test -x {py} || python3 -m venv --system-site-packages {venv}) && "
                   f"({pin} || ({py} -m pip install -q torch=={version} && {pin})) && "
                   f"({py} -c 'import fastapi, httpx, mlflow, prometheus_client, safetensors, tiktoken, yaml' "
                   f"2>/dev/null || (cd {repo} && {py} -m pip install -q '.[trainer,sidecar,watchdog,mlflow]'))")
        prepare = (f"test -f {ws}/data/tokenized/meta.json || ("
                   + layout.python(f"x1_pretrain.stack prepare --env-file .env --workspace {ws}") + ")")
    return f"""#!/bin/bash
# Written by `x1 launch`: starts the X1 stack on this instance (again after a pod resume).
set -u
mkdir -p {ws}/logs
# One boot at a time: the launch's and the pod start command's may meet; the second leaves it to the first.
exec 9>>{ws}/logs/boot.lock
if ! flock -n 9; then
  echo "boot: $(date -u +%FT%TZ) another boot of this instance is running: leaving the start to it" >> {ws}/logs/boot.log
  exit 0
fi
rm -f {ws}/logs/boot.exit
{{
  echo "boot: $(date -u +%FT%TZ)"
  ({install}) && ({prepare}) && ({start})
}} >> {ws}/logs/boot.log 2>&1
code=$?
echo "$code" > {ws}/logs/boot.exit
exit "$code"
"""


def put_boot_script(remote: Remote, layout: Layout, torch: tuple[str, str] = TORCH_PIN) -> None:
    path = shlex.quote(layout.boot_script)
    remote.run(f"cat > {path}.tmp && chmod 755 {path}.tmp && mv -f {path}.tmp {path}",
               input=boot_script(layout, torch).encode())


def start_stack(remote: Remote, layout: Layout) -> None:
    """The boot script in the background, in its own session: the launch's SSH link may drop."""
    remote.run(f"setsid nohup bash {shlex.quote(layout.boot_script)} > /dev/null 2>&1 < /dev/null &", timeout=60)


def boot_result(remote: Remote, layout: Layout) -> tuple[int | None, str]:
    """The boot script's exit code (None while it runs) and the end of its log."""
    out = remote.text(f"cat {layout.logs}/boot.exit 2>/dev/null; echo ---; tail -c 3000 {layout.logs}/boot.log "
                      "2>/dev/null", timeout=60)
    code_text, _, tail = out.partition("---\n")
    code = int(code_text.strip()) if code_text.strip().lstrip("-").isdigit() else None
    return code, tail


def stack_status(remote: Remote, layout: Layout, timeout: float = 60) -> dict[str, Any]:
    """`python -m x1_pretrain.stack status --json` on the instance (it reads the workspace's files;
    under compose its `running` is false and the services are compose's)."""
    proc = remote.run(layout.python(f"x1_pretrain.stack status --json --workspace {shlex.quote(layout.workspace)}"),
                      timeout=timeout, check=False)
    try:
        st = json.loads(proc.stdout.decode("utf-8", errors="replace"))
    except ValueError:
        raise SSHError(f"ssh {remote.target}: stack status gave no JSON (exit {proc.returncode}): "
                       f"{proc.stderr.decode(errors='replace').strip()[-800:]}") from None
    if layout.stack == "compose":
        st["services"] = compose_services(remote, layout)
        st["running"] = any(s["running"] for s in st["services"].values())
    return st


def compose_services(remote: Remote, layout: Layout) -> dict[str, Any]:
    """`docker compose ps` as the process stack's services: running, and the healthcheck's word."""
    out = remote.text(f"cd {shlex.quote(layout.repo)} && docker compose --env-file .env ps --format json", timeout=60)
    text = out.strip()
    # Compose prints a JSON array (up to v2.20) or one object per line (later).
    items = json.loads(text) if text.startswith("[") else [json.loads(line) for line in text.splitlines() if line.strip()]
    return {i.get("Service", "?"): {"running": i.get("State") == "running", "health": i.get("Health") or None,
                                   "url": None, "restarts": 0} for i in items if isinstance(i, dict)}


def stop_stack(remote: Remote, layout: Layout, timeout: float = 400) -> str:
    """The stack stopped, the trainer first with its emergency checkpoint; returns what it said."""
    if layout.stack == "compose":
        command = f"cd {shlex.quote(layout.repo)} && docker compose --env-file .env stop -t 120"
    else:
        command = layout.python(f"x1_pretrain.stack down --workspace {shlex.quote(layout.workspace)}")
    return remote.text(command, timeout=timeout).strip()


def log_command(layout: Layout, service: str, follow: bool, lines: int) -> str:
    if layout.stack == "compose" and service not in ("stack", "boot"):
        name = {"trainer": "trainer", "watchdog": "watchdog"}.get(service, service)
        return (f"cd {shlex.quote(layout.repo)} && docker compose --env-file .env logs --no-color --tail {lines} "
                f"{'-f ' if follow else ''}{shlex.quote(name)}")
    path = posixpath.join(layout.logs, f"{service}.log")
    return f"tail -n {lines} {'-F ' if follow else ''}{shlex.quote(path)}"
