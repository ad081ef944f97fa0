"""The package's shape, pinned: the import contracts of pyproject.toml ([tool.importlinter]) kept,
no import cycle, the project's own modules imported at the top of files only, no module of the
trainer package over 800 lines and the loop file at most 450."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import grimp
import pytest

from conftest import REPO

PACKAGES = {
    "x1_common": REPO / "x1_common",
    "x1_pretrain": REPO / "trainer" / "x1_pretrain",
    "budget_sidecar": REPO / "budget-sidecar" / "budget_sidecar",
    "x1_watchdog": REPO / "watchdog" / "x1_watchdog",
    "x1_launch": REPO / "launcher" / "x1_launch",
}
LOOP_FILE = PACKAGES["x1_pretrain"] / "train" / "loop.py"
# Where a project module may be imported inside a function: it needs a package the place it runs
# may not have. (file, module imported) -> why.
LAZY_ALLOWED = {
    ("trainer/x1_pretrain/run/dod.py", "x1_pretrain.checkpoint.load"): "torch: dod runs where torch is not installed",
    ("trainer/x1_pretrain/run/dod.py", "x1_pretrain.checkpoint.weights"): "torch, as above",
    ("watchdog/x1_watchdog/cli.py", "x1_watchdog.docker"): "the Docker SDK: only docker mode installs it",
}


def python_files(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*.py") if "__pycache__" not in p.parts)


def test_lint_imports_keeps_every_contract() -> None:
    lint_imports = Path(sys.executable).with_name("lint-imports")
    proc = subprocess.run([str(lint_imports), "--no-cache"], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "0 broken" in proc.stdout


def test_no_import_cycle_between_the_projects_modules() -> None:
    graph = grimp.build_graph(*PACKAGES, include_external_packages=False)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def strongconnect(v: str) -> None:  # Tarjan: every strongly connected group of 2+ modules is a cycle
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.find_modules_directly_imported_by(v):
            if w not in index:
                strongconnect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                cycles.append(sorted(group))

    for module in sorted(graph.modules):
        if module not in index:
            strongconnect(module)
    assert cycles == []


def function_level_project_imports(path: Path) -> list[tuple[int, str]]:
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        for inner in ast.walk(node):
            if isinstance(inner, ast.ImportFrom) and inner.module and inner.level == 0:
                names = [inner.module]
            elif isinstance(inner, ast.ImportFrom) and inner.level > 0:
                names = ["." * inner.level + (inner.module or "")]
            elif isinstance(inner, ast.Import):
                names = [a.name for a in inner.names]
            else:
                continue
            found += [(inner.lineno, n) for n in names if n.startswith(".") or n.split(".")[0] in PACKAGES]
    return sorted(set(found))


@pytest.mark.parametrize("package", sorted(PACKAGES))
def test_the_projects_own_modules_are_imported_at_the_top_of_files_only(package: str) -> None:
    late = []
    for path in python_files(PACKAGES[package]):
        rel = path.relative_to(REPO).as_posix()
        late += [f"{rel}:{line} imports {name}" for line, name in function_level_project_imports(path)
                 if (rel, name) not in LAZY_ALLOWED]
    assert late == []


def test_no_module_of_the_trainer_package_is_over_800_lines() -> None:
    lengths = {p.relative_to(REPO).as_posix(): len(p.read_text(encoding="utf-8").splitlines())
               for p in python_files(PACKAGES["x1_pretrain"])}
    assert {name: n for name, n in lengths.items() if n > 800} == {}


def test_the_loop_file_holds_train_loop_at_module_level_in_at_most_450_lines() -> None:
    tree = ast.parse(LOOP_FILE.read_text(encoding="utf-8"))
    assert "train_loop" in {n.name for n in tree.body if isinstance(n, ast.FunctionDef)}
    assert len(LOOP_FILE.read_text(encoding="utf-8").splitlines()) <= 450


def test_every_mlflow_name_of_the_contracts_is_used_by_the_code_that_writes_or_reads_it() -> None:
    from x1_common import contracts

    names = [n for n in vars(contracts) if n.startswith("MLFLOW_") and isinstance(getattr(contracts, n), (str, tuple))
             and not n.startswith("MLFLOW_TRACKING")]
    code = "\n".join(p.read_text(encoding="utf-8") for package, root in PACKAGES.items() if package != "x1_common"
                     for p in python_files(root))
    assert [n for n in names if not re.search(rf"\b{n}\b", code)] == []


def test_the_heartbeat_phases_are_one_list_the_writer_and_the_readers_share() -> None:
    from x1_common.contracts import HEARTBEAT_PHASES, STARTUP_PHASES

    assert "stopped" in HEARTBEAT_PHASES and set(STARTUP_PHASES) <= set(HEARTBEAT_PHASES)
    train = PACKAGES["x1_pretrain"] / "train"
    written = set()
    for path in python_files(train):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "beat":
                assert not any(isinstance(a, ast.Constant) for a in node.args[1:]), f"{path}: a phase as a literal"
                written |= {n.id for n in ast.walk(node.args[1]) if isinstance(n, ast.Name) and n.id.isupper()}
    assert written and all(n.startswith("PHASE_") for n in written)
    compose = (REPO / "compose.yaml").read_text(encoding="utf-8")
    healthcheck_phases = re.findall(r"'(\w+)'", compose.split("h['phase'] in (", 1)[1].split(")", 1)[0])
    assert healthcheck_phases and set(healthcheck_phases) <= set(HEARTBEAT_PHASES)
