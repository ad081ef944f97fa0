"""Bad input and faults, the config / command-line class and tokenize_data's input walk.

Config: every numeric field of every section refuses .inf / -.inf / .nan naming the field; a key
repeated in a mapping, a file that is not UTF-8, a folder or a FIFO given as the config, and the
cross-field rules are refused naming what is wrong; arbitrary text is a config or a ConfigError.
The trainer's command line ends every such case with exit 2 and one clear line, no traceback.
tokenize_data: symlink loops, dangling symlinks, FIFOs, sockets and devices named like inputs are
refused naming each (skipped with --skip-bad-records), never opened, so nothing hangs.
"""

from __future__ import annotations

import json
import os
import socket
import typing
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import BaseModel

from conftest import TINY_CONFIG, run_module, train_args
from x1_pretrain.checkpoint.store import Checkpointer, TrainerState, capture_rng
from x1_pretrain.config import ConfigError, RunConfig, load_config
from x1_pretrain.data import tokenize as tokenize_data
from x1_pretrain.data.sources import find_inputs
from x1_pretrain.model.transformer import Transformer

# ---- every numeric field is finite --------------------------------------------------------------------


def numeric_fields(model: type[BaseModel] = RunConfig, prefix: str = "") -> list[str]:
    out = []
    for name, field in model.model_fields.items():
        ann = field.annotation
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            out += numeric_fields(ann, f"{prefix}{name}.")
            continue
        kinds = set(typing.get_args(ann)) or {ann}
        if kinds & {int, float} and bool not in kinds:
            out.append(prefix + name)
    return out


NUMERIC = numeric_fields()


def test_the_walk_finds_the_fields_that_matter() -> None:
    assert {"optim.lr", "optim.eps", "train.total_steps", "budget.cap_usd", "model.rope_base",
            "tracking.metrics_port"} <= set(NUMERIC)


@pytest.mark.parametrize("field", NUMERIC)
@pytest.mark.parametrize("value", [".inf", "-.inf", ".nan", "1e999"])
def test_every_numeric_field_refuses_a_value_that_is_not_finite(field: str, value: str) -> None:
    with pytest.raises(ConfigError, match=rf"^{field}: "):
        load_config(TINY_CONFIG, [f"{field}={value}"])


# ---- the config file -------------------------------------------------------------------------------------

BAD_FILES = {
    "a section repeated": (b"optim:\n  lr: 3.0e-3\ntrain:\n  total_steps: 100\noptim:\n  lr: 1.0\n", "key 'optim' appears twice"),
    "a key repeated in a section": (b"optim:\n  lr: 3.0e-3\n  lr: 1.0\n", "key 'lr' appears twice"),
    "not UTF-8": (b"optim:\n  lr: 3.0e-3 # caf\xe9\n", "not UTF-8 text (byte 0xe9"),
    "a list at the top": (b"- optim\n- train\n", "top level must be a mapping"),
    "a python tag": (b"optim: !!python/object:os.system {}\n", "not valid YAML"),
    "warmup past the end": (b"optim:\n  warmup_steps: 500\ntrain:\n  total_steps: 100\n",
                            "optim.warmup_steps: 500 is more than train.total_steps=100"),
    "min_lr over lr": (b"optim:\n  lr: 1.0e-4\n  min_lr: 1.0e-3\n", "optim.min_lr"),
    "lr infinite": (b"optim:\n  lr: .inf\n", "optim.lr: Input should be a finite number"),
    "an unknown key": (b"optim:\n  learning_rate: 1.0e-3\n", "optim.learning_rate"),
    "nested too deep": (b"a: " + b"[" * 3000 + b"]" * 3000 + b"\n", "config file"),
}


@pytest.mark.parametrize("case", sorted(BAD_FILES))
def test_a_bad_config_file_is_a_config_error_naming_the_problem(tmp_path: Path, case: str) -> None:
    text, expected = BAD_FILES[case]
    path = tmp_path / "bad.yaml"
    path.write_bytes(text)
    with pytest.raises(ConfigError) as e:
        load_config(path)
    assert expected in str(e.value)


@pytest.mark.parametrize("kind", ["folder", "fifo", "missing"])
@pytest.mark.timeout(30)
def test_a_config_path_that_is_not_a_file_is_named_without_blocking(tmp_path: Path, kind: str) -> None:
    path = tmp_path / "cfg.yaml"
    if kind == "folder":
        path.mkdir()
    elif kind == "fifo":
        os.mkfifo(path)
    with pytest.raises(ConfigError, match=f"config file {path}"):
        load_config(path)


@settings(max_examples=80, deadline=None)
@given(text=st.one_of(st.text(max_size=200), st.binary(max_size=200).map(lambda b: b.decode("latin-1")),
                      st.dictionaries(st.sampled_from(["optim", "train", "model", "budget", "x"]),
                                      st.dictionaries(st.text(max_size=12), st.one_of(
                                          st.floats(allow_nan=True, allow_infinity=True), st.integers(),
                                          st.text(max_size=5), st.none(), st.booleans()), max_size=3),
                                      max_size=3).map(json.dumps)))
def test_any_text_is_a_config_or_a_config_error(tmp_path_factory: pytest.TempPathFactory, text: str) -> None:
    path = tmp_path_factory.mktemp("cfg") / "c.yaml"
    path.write_text(text, encoding="utf-8", errors="surrogateescape")
    try:
        cfg = load_config(path)
    except ConfigError:
        return
    assert isinstance(cfg, RunConfig) and cfg.optim.warmup_steps <= cfg.train.total_steps


# ---- the trainer's command line: exit 2, one clear line, no traceback ------------------------------------

def _cuda_case(tmp_path: Path) -> list[str]:
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU: train.device=cuda is valid here")
    return ["--set", "train.device=cuda"]


def _file_as(flag: str, kind: str):
    def make(tmp_path: Path) -> list[str]:
        p = tmp_path / f"given{flag}"
        if kind == "file":
            p.write_text("a file")
        else:
            p.mkdir()
        return [flag, str(p)]
    return make


def _config_bytes(text: bytes):
    def make(tmp_path: Path) -> list[str]:
        p = tmp_path / "cfg.yaml"
        p.write_bytes(TINY_CONFIG.read_bytes() + text)
        return ["--config", str(p)]
    return make


CLI_CASES = {
    "train.device=cuda without a GPU": (_cuda_case, "train.device: cuda, but no CUDA GPU"),
    "--ckpt-dir a regular file": (_file_as("--ckpt-dir", "file"), "exists and is not a folder"),
    "--heartbeat-file a folder": (_file_as("--heartbeat-file", "dir"), "is a folder, expected a file"),
    "--data-dir a regular file": (_file_as("--data-dir", "file"), "data.dir (--data-dir)"),
    "a config that is not UTF-8": (_config_bytes(b"# \xff\xfe\n"), "not UTF-8 text"),
    "a section repeated": (_config_bytes(b"optim:\n  lr: 1.0\n"), "key 'optim' appears twice"),
    "optim.lr=.inf": (lambda tmp: ["--set", "optim.lr=.inf"], "optim.lr: Input should be a finite number"),
    "warmup past the end": (lambda tmp: ["--set", "optim.warmup_steps=500"], "optim.warmup_steps: 500 is more than"),
    "--budget-cap-usd nan": (lambda tmp: ["--budget-cap-usd", "nan"], "budget.cap_usd"),
}


@pytest.mark.parametrize("case", sorted(CLI_CASES))
def test_a_bad_command_line_exits_2_with_one_clear_line(tmp_path: Path, tiny_data: Path, case: str) -> None:
    make, expected = CLI_CASES[case]
    args = train_args(tiny_data, tmp_path / "ckpt", f"file://{tmp_path}/mlruns", total=40)
    extra = make(tmp_path)
    for flag in ("--ckpt-dir", "--heartbeat-file", "--data-dir", "--config"):
        if flag in extra:  # the case's value replaces the default one
            i = args.index(flag)
            del args[i:i + 2]
    proc = run_module("x1_pretrain.train", *args, *extra, timeout=300)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert expected in proc.stderr and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert not (tmp_path / "ckpt" / "step_00000010").exists()


def test_total_steps_below_the_resume_step_never_rewrites_the_final_weights(tmp_path: Path, tiny_data: Path) -> None:
    """The probe: --total-steps below the checkpoint's step with --allow-config-change rewrote
    final.safetensors. Now: exit 2, naming both steps, and final.safetensors untouched."""
    cfg = load_config(TINY_CONFIG, overrides={"train.total_steps": 40})
    ckpt = tmp_path / "ckpt"
    model = Transformer(cfg.model)
    state = TrainerState(step=30, tokens_seen=30 * 512, config_hash=cfg.config_hash(), config=cfg.resolved(),
                         sampler={"seed": 42, "next_step": 30}, rng=capture_rng())
    Checkpointer(ckpt, 3, cfg.model).save(30, model.state_dict(), {}, state)
    final = ckpt / "final.safetensors"
    final.write_bytes(b"the weights of an earlier finish")
    args = train_args(tiny_data, ckpt, f"file://{tmp_path}/mlruns", "--resume-from-latest", "--allow-config-change",
                      "--set", "optim.warmup_steps=2", total=5)
    proc = run_module("x1_pretrain.train", *args, timeout=300)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "train.total_steps: 5 is below step 30" in proc.stderr and "Traceback" not in proc.stderr
    assert final.read_bytes() == b"the weights of an earlier finish"


# ---- tokenize_data: what the input walk meets ---------------------------------------------------------------

def _bad_entry(kind: str, d: Path) -> Path:
    p = d / f"{kind}.txt"
    if kind == "loop":
        p.symlink_to(p.name)
    elif kind == "dangling":
        p.symlink_to(d / "gone.txt")
    elif kind == "fifo":
        os.mkfifo(p)
    elif kind == "socket":
        s = socket.socket(socket.AF_UNIX)
        s.bind(str(p))
        s.close()
    elif kind == "device":
        p.symlink_to("/dev/zero")  # reading it would never end
    elif kind == "parquet-fifo":
        p = d / "fifo.parquet"
        os.mkfifo(p)
    return p


ENTRY_KINDS = ["loop", "dangling", "fifo", "socket", "device", "parquet-fifo"]


@pytest.mark.parametrize("kind", ENTRY_KINDS)
@pytest.mark.timeout(120)
def test_an_input_that_is_not_a_regular_file_is_named_never_opened(tmp_path: Path, kind: str,
                                                                     capsys: pytest.CaptureFixture) -> None:
    inp = tmp_path / "in"
    inp.mkdir()
    (inp / "good.txt").write_text("A small document of plain English text, for the tokenizer.\n")
    bad = _bad_entry(kind, inp)
    common = ["--input-dir", str(inp), "--workers", "1", "--val-fraction", "0"]
    assert tokenize_data.main([*common, "--output-dir", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert str(bad) in err and "Traceback" not in err
    assert not (tmp_path / "out").exists()  # nothing written
    assert tokenize_data.main([*common, "--output-dir", str(tmp_path / "out2"), "--skip-bad-records"]) == 0
    meta = json.loads((tmp_path / "out2" / "meta.json").read_text())
    assert [f["path"] for f in meta["skipped_files"]] == [bad.name] and meta["documents"] == 1


@pytest.mark.parametrize("where", ["a file", "under a file"])
def test_an_output_dir_that_cannot_be_a_folder_exits_2_naming_it(tmp_path: Path, where: str,
                                                                   capsys: pytest.CaptureFixture) -> None:
    inp = tmp_path / "in"
    inp.mkdir()
    (inp / "good.txt").write_text("A document.\n")
    (tmp_path / "f").write_text("a file")
    out = tmp_path / "f" if where == "a file" else tmp_path / "f" / "out"
    assert tokenize_data.main(["--input-dir", str(inp), "--output-dir", str(out), "--workers", "1"]) == 2
    err = capsys.readouterr().err
    assert f"{out}: --output-dir" in err and "Traceback" not in err
    assert (tmp_path / "f").read_text() == "a file"


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(kinds=st.lists(st.sampled_from(ENTRY_KINDS[:4]), min_size=1, max_size=4, unique=True))
def test_any_mix_of_bad_entries_is_refused_listing_every_one(tmp_path_factory: pytest.TempPathFactory,
                                                            kinds: list[str]) -> None:
    d = tmp_path_factory.mktemp("walk")
    (d / "good.txt").write_text("text")
    bad = sorted(str(_bad_entry(k, d)) for k in kinds)
    sources, _, found = find_inputs(d, exclude=[])
    assert [s.rel for s in sources] == ["good.txt"]
    assert sorted(b.path for b in found) == bad
