"""bench/train_throughput.py on the CPU with the tiny config: the dry run the GPU calls rely on.
The GPU numbers it prints live in docs/PERFORMANCE.md; here it must build the run, profile the
steps it is asked for, and hand the loop the batches that follow them."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from conftest import REPO, TINY_CONFIG, cli_env

BENCH = REPO / "bench" / "train_throughput.py"


def bench(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(BENCH), *args], capture_output=True, text=True, timeout=300,
                          env=cli_env(), cwd=REPO)


def calls_in_profile(table: str, op: str) -> int:
    """The '# of Calls' column of the profiler's table for `op`."""
    row = next(line for line in table.splitlines() if line.strip().startswith(op + " "))
    return int(row.split()[-1])


def test_profile_steps_profiles_that_many_steps_and_the_loop_resumes_after_them(tiny_data: Path, tmp_path: Path):
    results = []
    for n in (1, 2):
        out = tmp_path / f"profile-{n}.jsonl"
        # --loop-steps 11 logs one interval at step 10: the loop ran on the batches after the
        # profiled steps (a batch out of order fails the trainer's own assertion).
        proc = bench("--config", str(TINY_CONFIG), "--data-dir", str(tiny_data), "--steps", "1", "--loop-steps", "11",
                     "--profile", "--profile-steps", str(n), "--json", str(out))
        assert proc.returncode == 0, proc.stderr[-3000:]
        results.append(json.loads(out.read_text()))
        # The optimizer's step is a named region of the profile, once per profiled step.
        assert calls_in_profile(proc.stdout, "Optimizer.step#AdamW.step") == n
    for r in results:
        assert r["gpu"] == "cpu" and r["bare_tokens_per_sec"] > 0
        assert r["loop_tokens_per_sec"] > 0 and len(r["loop_intervals"]) == 1 and r["bare_after_tokens_per_sec"] > 0


def test_profile_steps_below_one_is_refused_with_exit_2_before_any_work(tmp_path: Path):
    out = tmp_path / "out.jsonl"
    proc = bench("--data-dir", str(tmp_path / "nowhere"), "--profile", "--profile-steps", "0", "--json", str(out))
    assert proc.returncode == 2
    assert "--profile-steps must be at least 1, got 0" in proc.stderr
    assert not out.exists()


def bench_module():
    """bench/train_throughput.py imported as a module (it is a script, not a package member)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("train_throughput", BENCH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_named_variant_is_a_valid_config_on_top_of_the_benchs_default():
    # A variant whose overrides the config refuses would fail only on the GPU, minutes into a call.
    from x1_pretrain.config import load_config

    module = bench_module()
    default = REPO / "configs" / "x1-50m-a100.yaml"  # the bench's --config default
    assert "shipped" in module.VARIANTS and module.VARIANTS["shipped"] == []
    for name in module.VARIANTS:
        load_config(default, module.resolve_variant(name))  # raises ConfigError if refused


def test_combined_variants_add_their_overrides_in_order():
    module = bench_module()
    assert module.resolve_variant("untuned-matmuls+float8") == ["train.cublaslt=off", "train.float8=tensorwise"]


def test_a_variant_not_in_the_table_is_refused_with_exit_2_naming_it_before_any_work(tmp_path: Path):
    out = tmp_path / "out.jsonl"
    proc = bench("--data-dir", str(tmp_path / "nowhere"), "--variant", "shipped+no-norm-fold", "--json", str(out))
    assert proc.returncode == 2
    assert "no variant 'no-norm-fold' in plans.toml [variants]" in proc.stderr
    assert not out.exists()


def test_an_override_naming_a_field_that_is_not_there_is_refused_with_exit_2_before_any_work(tmp_path: Path):
    # The old module switches are gone: a variant is config, and config that names nothing fails.
    out = tmp_path / "out.jsonl"
    proc = bench("--data-dir", str(tmp_path / "nowhere"), "--set", "model.fold_norms=false", "--json", str(out))
    assert proc.returncode == 2
    assert "fold_norms" in proc.stderr and "Traceback" not in proc.stderr
    assert not out.exists()


def test_the_kernel_table_counts_every_kernel_copy_and_memset_of_the_trace_and_no_operator(tmp_path: Path):
    events = [{"cat": "kernel", "name": "gemm_a", "ts": 0, "dur": 3000}, {"cat": "kernel", "name": "gemm_a", "ts": 5000, "dur": 1000},
              {"cat": "gpu_memset", "name": "Memset (Device)", "ts": 7000, "dur": 200},
              {"cat": "kernel", "name": "rope", "ts": 8000, "dur": 500},
              {"cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 90000}]  # an operator: not a kernel
    trace = tmp_path / "trace.json"
    trace.write_text(json.dumps({"traceEvents": events}))
    module = bench_module()
    lines = module.kernel_table(module.gpu_work(trace), top=2).splitlines()
    assert lines[1].split() == ["gemm_a", "4.000", "2", "2000.0"]
    assert lines[2].split() == ["rope", "0.500", "1", "500.0"]
    # the memset counts in the total though not listed; the operator's 90 ms count nowhere
    assert lines[-1] == "kernels listed: 4.5 ms of 4.7 ms in 3 kernels"
