"""`plan` runs where the trainer does not: a laptop with the project's base dependencies only.

The import is checked with torch, numpy and the trainer's other heavy packages blocked (as if not
installed): nothing plan imports, directly or through the config and the accounting, may pull
them in. The package's base dependencies hold what plan needs (pyyaml, pydantic) and no torch.
"""

from __future__ import annotations

import subprocess
import sys

import tomllib

from conftest import CONFIGS, REPO, cli_env

BLOCKED = ("torch", "numpy", "mlflow", "matplotlib", "triton")

BLOCKER = f"""
import importlib.abc, runpy, sys

class Blocked(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {BLOCKED!r}:
            raise ImportError(f"{{name}} is not installed (blocked by the test)")
        return None

sys.meta_path.insert(0, Blocked())
sys.argv = ["plan", *sys.argv[1:]]
runpy.run_module("x1_pretrain.plan", run_name="__main__")
"""


def test_plan_runs_without_torch_installed(tmp_path):
    env_file = tmp_path / ".env"
    env_file.write_text("# mine\nPROVIDER=lambda\nTOTAL_STEPS=84000\nLAMBDA_API_KEY=kept-as-is\n")
    proc = subprocess.run([sys.executable, "-c", BLOCKER, "--config", str(CONFIGS / "x1-50m-a100.yaml"),
                           "--price-usd-per-hr", "1.10", "--write-env", str(env_file)],
                          capture_output=True, text=True, env=cli_env(), cwd=REPO, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("This will launch 1× A100 80GB on-demand on Lambda at $1.10/h")
    proposed = proc.stdout.split("Proposed: --total-steps ")[1].split()[0]
    lines = env_file.read_text().splitlines()
    assert lines[:4] == ["# mine", "PROVIDER=lambda", f"TOTAL_STEPS={proposed}", "LAMBDA_API_KEY=kept-as-is"]
    assert "BUDGET_CAP_USD=35" in lines and "MAX_PRICE_USD_PER_HR=1.4" in lines
    assert not list(tmp_path.glob(".*.tmp-*"))  # no temp file left beside it


def test_the_base_dependencies_are_what_plan_and_x1_need_beyond_the_standard_library():
    # plan reads the YAML config into its typed model; `x1` also runs the off-host watchdog
    # (httpx for the provider's API, prometheus-client for its /metrics).
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    base = {d.split(">")[0].split("=")[0].split("<")[0].strip().lower() for d in project["dependencies"]}
    assert base == {"pyyaml", "pydantic", "httpx", "prometheus-client"}
    assert not any(d.lower().startswith(("torch", "numpy")) for d in project["dependencies"])
