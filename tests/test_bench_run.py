"""bench/run.py, the GPU calls' one driver, on the CPU: every plan of bench/plans.toml parses and
names only variants and step kinds that are there; a plan or variant that is not there exits 2;
--dry-run prints the commands and runs nothing; a real run of a small plan (a stand-in reference,
the tiny config's step) writes the commands it ran, the table with the ratio, and its exit codes."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import tomllib

from conftest import REPO, TINY_CONFIG, cli_env

DRIVER = REPO / "bench" / "run.py"
PLANS = REPO / "bench" / "plans.toml"
# The plain reference's output as it prints it (bench/report.py parses the table and the peak).
FAKE_REFERENCE = textwrap.dedent("""\
    print("ceilings: matmul 790 TFLOP/s measured (989 datasheet), copy 4.26 TB/s")
    print("| model | micro-batch | tokens/s | TFLOP/s | MFU(measured peak) | MFU(989) | peak GiB | compile s |")
    print("|---|---|---|---|---|---|---|---|")
    print("| ref-50M V=50257 | 32 | 640k | 389 | 0.493 | 0.393 | 18.1 | 3 |")
""")


def driver(*args: str, cwd: Path = REPO) -> subprocess.CompletedProcess[str]:
    env = cli_env()
    for key in ("REFERENCE", "DATA", "OUT"):  # only what a test passes
        env.pop(key, None)
    return subprocess.run([sys.executable, str(DRIVER), *args], capture_output=True, text=True, timeout=600,
                          env=env, cwd=cwd)


def write_plans(tmp_path: Path, plans: str) -> Path:
    path = tmp_path / "plans.toml"
    path.write_text('[variants]\nshipped = []\nuntuned = ["train.cublaslt=off"]\n\n' + textwrap.dedent(plans))
    return path


@pytest.mark.parametrize("plan", sorted(tomllib.loads(PLANS.read_text())["plans"]))
def test_every_plan_checks_and_its_dry_run_prints_its_commands_and_writes_nothing(plan: str, tmp_path: Path):
    out = tmp_path / "out"
    proc = driver(plan, "--dry-run", "--reference", "ref.py", "--data", "data", "--out", str(out))
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() and "Traceback" not in proc.stderr
    assert not out.exists()


def test_the_throughput_dry_run_is_the_reference_beside_the_shipped_step_then_the_table(tmp_path: Path):
    out = tmp_path / "out"
    proc = driver("throughput", "--dry-run", "--reference", ".device/reference_50m.py", "--data", ".device/data",
                  "--out", str(out))
    assert proc.returncode == 0, proc.stderr
    lines = [line for line in proc.stdout.splitlines() if not line.startswith("#")]
    reference = f"{REPO}/.device/reference_50m.py > {out}/reference.txt"
    steps = [next(i for i, line in enumerate(lines) if what in line) for what in (
        reference, "bench/train_throughput.py --variant shipped", f"> {out}/reference-after.txt", "bench/report.py")]
    assert steps == sorted(steps), proc.stdout  # in that order
    step = lines[steps[1]]
    assert f"--data-dir {REPO}/.device/data" in step and "--loop-steps 40" in step and f"--json {out}/ours.jsonl" in step
    assert "--peak-tflops" in step  # the peak the reference measured, in the same call
    assert f"--reference {out}/reference.txt --reference-after {out}/reference-after.txt" in lines[steps[3]]


def test_a_plan_that_is_not_there_exits_2_naming_the_plans_there_are():
    proc = driver("throughput-typo", "--dry-run")
    assert proc.returncode == 2
    assert "no plan 'throughput-typo' in the plans file; there are: throughput, levers" in proc.stderr


def test_a_variant_that_is_not_there_exits_2_before_any_work(tmp_path: Path):
    out = tmp_path / "out"
    proc = driver("throughput", "--variants", "shipped,no-norm-fold", "--reference", __file__, "--data", str(tmp_path),
                  "--out", str(out))
    assert proc.returncode == 2
    assert "no variant 'no-norm-fold' in the plans' [variants]" in proc.stderr
    assert not out.exists()


@pytest.mark.parametrize(("steps", "message"), [
    ('[[plans.p.steps]]\nrun = "variants"\nnames = ["shipped+ce-two-exp"]\n', "no variant 'ce-two-exp'"),
    ('[[plans.p.steps]]\nrun = "torchrun"\nvariant = "fused-ce"\nname = "x"\n', "no variant 'fused-ce'"),
    ('[[plans.p.steps]]\nrun = "benchmark"\n', "plan 'p', step 1: no step kind 'benchmark'"),
    ('[[plans.p.steps]]\nrun = "reference"\npatch = "x1_pretrain.model.A_SWITCH=false"\n',
     "plan 'p', step 1 (reference): unknown key(s) ['patch']"),
    ('[[plans.p.steps]]\nrun = "command"\n', "plan 'p', step 1 (command): no argv"),
], ids=["variant", "torchrun-variant", "kind", "key", "argv"])
def test_a_plan_naming_what_is_not_there_exits_2_naming_it(tmp_path: Path, steps: str, message: str):
    plans = write_plans(tmp_path, '[plans.p]\nabout = "a test"\n\n' + steps)
    proc = driver("p", "--plans", str(plans), "--dry-run")
    assert proc.returncode == 2
    assert message in proc.stderr, proc.stderr


def test_a_plan_that_needs_the_reference_exits_2_without_it(tmp_path: Path):
    proc = driver("throughput", "--data", str(tmp_path), "--out", str(tmp_path / "out"))
    assert proc.returncode == 2
    assert "plan 'throughput' needs --reference (or REFERENCE)" in proc.stderr
    assert not (tmp_path / "out").exists()


def test_a_real_run_writes_each_command_with_its_exit_code_and_the_table_with_the_ratio(tiny_data: Path, tmp_path: Path):
    # The throughput plan's shape, small: a stand-in reference, the tiny config's step, the table;
    # then a command whose exit is not the one it expects, so the driver ends 1 after every step ran.
    (tmp_path / "reference.py").write_text(FAKE_REFERENCE)
    plans = write_plans(tmp_path, f"""\
        [plans.small]
        about = "the reference beside the step, on the CPU"
        needs = ["reference", "data"]

        [[plans.small.steps]]
        run = "reference"

        [[plans.small.steps]]
        run = "variants"
        names = ["shipped"]
        config = "{TINY_CONFIG}"
        steps = 1

        [[plans.small.steps]]
        run = "report"

        [[plans.small.steps]]
        run = "command"
        argv = ["{{python}}", "-c", "import sys; sys.exit(3)"]
        out = "three.txt"
    """)
    out = tmp_path / "out"
    proc = driver("small", "--plans", str(plans), "--reference", str(tmp_path / "reference.py"), "--data", str(tiny_data),
                  "--out", str(out), "--no-wheels")
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    commands = (out / "commands.txt").read_text()
    assert f"reference.py > {out}/reference.txt" in commands
    assert "bench/train_throughput.py --variant shipped" in commands and "--peak-tflops 790" in commands
    assert commands.count("-> exit 0") == 3 and "-> exit 3" in commands
    assert "small: 1 step(s) not as expected" in commands
    table = (out / "table.md").read_text()
    assert "ours shipped" in table and "reference ref-50M V=50257" in table
    assert "ours shipped" in proc.stdout  # the table, printed at the end


def test_no_switch_the_benchmarks_once_flipped_by_monkeypatching_is_left_in_the_code_or_bench():
    # Each is deleted or a config field now (docs/PERFORMANCE.md, "Deleted variants"); a variant is
    # config overrides, so nothing in bench/ sets a module attribute to pick one.
    gone = ("MAX_FIRST", "FUSED_ROPE", "FUSED_SWIGLU", "FUSED_HEAD_GRAD", "FOLD_NORMS", "ROPE_PER_HEAD",
            "cublaslt.ENABLED", "--patch", "set_sdpa")
    files = [*(REPO / "trainer").rglob("*.py"), *(REPO / "bench").rglob("*.py"), *(REPO / "bench").glob("*.toml"),
             *(REPO / "bench").glob("*.sh")]
    left = [f"{f.relative_to(REPO)}: {name}" for f in files for name in gone if name in f.read_text(encoding="utf-8")]
    assert not left
