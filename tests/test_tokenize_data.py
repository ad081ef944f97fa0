"""`tokenize_data`: every document comes back from train.bin + val.bin, the bytes do not depend on
workers, shards or a kill, and bad input stops with exit 2 naming the file and writing nothing."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import zstandard

from conftest import REPO, cli_env, run_module
from x1_common.fsutil import sha256_file
from x1_pretrain.data.tokenizer import EOT_TOKEN, encode_document

OUTPUTS = ("train.bin", "val.bin", "meta.json")


def tokenize(input_dir: Path, output_dir: Path, *extra: str, workers: int = 2, val: str = "0.02"):
    return run_module(
        "x1_pretrain.tokenize_data", "--input-dir", str(input_dir), "--output-dir", str(output_dir),
        "--tokenizer", "gpt2", "--val-fraction", val, "--workers", str(workers), "--seed", "42", *extra,
        timeout=240,
    )


def read_tokens(path: Path) -> np.ndarray:
    return np.fromfile(path, dtype="<u2")


def split_at_eot(tokens: np.ndarray) -> list[list[int]]:
    """Documents of a token file: each starts with EOT, and EOT appears nowhere else."""
    if len(tokens) == 0:
        return []
    starts = np.flatnonzero(tokens == EOT_TOKEN)
    assert starts[0] == 0, "the file does not start with EOT"
    ends = [*starts[1:], len(tokens)]
    return [tokens[a + 1 : b].tolist() for a, b in zip(starts, ends, strict=True)]


def assert_round_trip(expected_docs: list[list[int]], output_dir: Path) -> tuple[int, int]:
    """Every input document, in input order, is the next train or the next val document."""
    train, val = split_at_eot(read_tokens(output_dir / "train.bin")), split_at_eot(read_tokens(output_dir / "val.bin"))
    ti = vi = 0
    for i, doc in enumerate(expected_docs):
        if ti < len(train) and train[ti] == doc:
            ti += 1
        elif vi < len(val) and val[vi] == doc:
            vi += 1
        else:
            raise AssertionError(f"input document {i} is neither the next train nor the next val document")
    assert (ti, vi) == (len(train), len(val)), "train/val hold documents that are not in the input"
    return ti, vi


def parquet_texts(corpus: Path) -> list[str | None]:
    texts: list[str | None] = []
    for path in sorted(corpus.glob("*.parquet")):
        texts.extend(pq.read_table(path, columns=["text"]).column("text").to_pylist())
    return texts


def write_jsonl_zst(path: Path, lines: list[bytes]) -> None:
    path.write_bytes(zstandard.ZstdCompressor().compress(b"\n".join(lines) + b"\n"))


def write_parquet(path: Path, texts: list[str | None], column: str = "text", row_group_size: int = 3) -> None:
    pq.write_table(pa.table({column: pa.array(texts, type=pa.string())}), path, row_group_size=row_group_size)


def meta_without_time(path: Path) -> dict:
    meta = json.loads(path.read_text())
    meta.pop("created_utc")
    meta.pop("input_dir")
    return meta


# --------------------------------------------------------------------------------------------


def test_round_trip_splitting_train_and_val_at_eot_gives_back_the_input_documents(corpus_dir: Path, tiny_data: Path):
    texts = parquet_texts(corpus_dir)
    expected = [encode_document(t) for t in texts if t]
    n_train, n_val = assert_round_trip(expected, tiny_data)
    meta = json.loads((tiny_data / "meta.json").read_text())
    assert (meta["train_documents"], meta["val_documents"], meta["documents"]) == (n_train, n_val, len(expected))
    assert n_val >= 1
    assert meta["train_tokens"] == len(read_tokens(tiny_data / "train.bin"))
    assert meta["val_tokens"] == len(read_tokens(tiny_data / "val.bin"))
    assert (meta["tokenizer"], meta["vocab_size"], meta["eot_token"], meta["dtype"]) == ("gpt2", 50257, 50256, "uint16")
    for source in meta["sources"]:
        assert source["sha256"] == sha256_file(corpus_dir / source["path"])
    assert sum(s["tokens"] for s in meta["sources"]) == meta["train_tokens"] + meta["val_tokens"]
    assert not (tiny_data / ".tokenize-work").exists(), "the work folder is removed once the outputs are complete"


def test_all_formats_round_trip_and_a_literal_endoftext_stays_ordinary_text(tmp_path: Path):
    src, out = tmp_path / "in", tmp_path / "out"
    src.mkdir()
    literal = "A document that mentions <|endoftext|> in its text, which is ordinary text here."
    write_parquet(src / "a.parquet", ["First parquet document.", None, "", literal, "Fourth, with ümlauts and 日本語."])
    write_jsonl_zst(src / "b.jsonl.zst", [
        json.dumps({"text": "From a zstd stream.", "meta": {"pile_set_name": "Pile-CC"}}).encode(),
        json.dumps({"text": None}).encode(),
        json.dumps({"text": "A lone surrogate \ud800 survives."}).encode(),
    ])
    (src / "c.txt").write_text("A plain text file is one document.\nEven with two lines.\n", encoding="utf-8")
    (src / "d.jsonl").write_bytes(json.dumps({"text": "Plain jsonl too."}).encode() + b"\n")
    (src / "notes.md").write_text("not an input format: ignored")
    proc = tokenize(src, out, val="0.3")
    assert proc.returncode == 0, proc.stderr
    docs = ["First parquet document.", literal, "Fourth, with ümlauts and 日本語.", "From a zstd stream.",
            "A lone surrogate \ud800 survives.", "A plain text file is one document.\nEven with two lines.\n",
            "Plain jsonl too."]
    assert_round_trip([encode_document(d) for d in docs], out)
    everything = np.concatenate([read_tokens(out / "train.bin"), read_tokens(out / "val.bin")])
    assert int((everything == EOT_TOKEN).sum()) == len(docs), "EOT appears once per document, never from the text"
    meta = json.loads((out / "meta.json").read_text())
    assert meta["skipped"] == {"empty text": 1, "null text": 2}
    assert meta["skipped_documents"] == 3
    assert [s["path"] for s in meta["sources"]] == ["a.parquet", "b.jsonl.zst", "c.txt", "d.jsonl"]
    assert [s["documents"] for s in meta["sources"]] == [3, 2, 1, 1]
    for source in meta["sources"]:
        assert source["sha256"] == sha256_file(src / source["path"]), source["path"]


def test_output_is_identical_for_one_and_two_workers_and_any_shard_size(corpus_dir: Path, tiny_data: Path, tmp_path: Path):
    # tiny_data: 2 workers, default shards (one per file); here: 1 worker, ~25 shards.
    proc = tokenize(corpus_dir, tmp_path, "--shard-mb", "0.05", workers=1)
    assert proc.returncode == 0, proc.stderr
    assert re.search(r"in (\d+) shard", proc.stderr) and int(re.search(r"in (\d+) shard", proc.stderr)[1]) > 10
    for name in ("train.bin", "val.bin"):
        assert (tmp_path / name).read_bytes() == (tiny_data / name).read_bytes(), name
    assert meta_without_time(tmp_path / "meta.json") == meta_without_time(tiny_data / "meta.json")


def test_resume_after_a_kill_mid_run_redoes_no_finished_shard_and_gives_identical_bytes(
    corpus_dir: Path, tiny_data: Path, tmp_path: Path
):
    out = tmp_path / "out"
    args = ["--input-dir", str(corpus_dir), "--output-dir", str(out), "--tokenizer", "gpt2", "--val-fraction", "0.02",
            "--workers", "2", "--seed", "42", "--shard-mb", "0.02"]
    # Its own process group, so the kill takes the workers too (as `docker kill` or a preemption would).
    proc = subprocess.Popen([sys.executable, "-m", "x1_pretrain.tokenize_data", *args], cwd=REPO, env=cli_env(),
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    records = out / ".tokenize-work" / "shards"
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and proc.poll() is None:
            if records.is_dir() and len(list(records.glob("*.json"))) >= 3:
                break
            time.sleep(0.005)
        finished_at_kill = len(list(records.glob("*.json")))
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    assert proc.returncode == -signal.SIGKILL, "the run ended before it could be killed mid-way"
    assert finished_at_kill >= 3
    assert not any((out / name).exists() for name in OUTPUTS), "a killed run left a partial output"

    rerun = run_module("x1_pretrain.tokenize_data", *args, timeout=240)
    assert rerun.returncode == 0, rerun.stderr
    done, todo = map(int, re.search(r"(\d+) finished earlier, (\d+) to do", rerun.stderr).groups())
    assert done >= finished_at_kill and todo > 0
    for name in ("train.bin", "val.bin"):
        assert (out / name).read_bytes() == (tiny_data / name).read_bytes(), name
    assert meta_without_time(out / "meta.json") == meta_without_time(tiny_data / "meta.json")

    again = run_module("x1_pretrain.tokenize_data", *args, timeout=240)
    assert again.returncode == 0 and "up to date" in again.stdout


def _good_parquet(d: Path) -> None:
    write_parquet(d / "00-good.parquet", ["A good document.", "Another good one."])


def _truncated_parquet(d: Path) -> str:
    write_parquet(d / "bad.parquet", [f"Document {i} with some words." for i in range(50)])
    data = (d / "bad.parquet").read_bytes()
    (d / "bad.parquet").write_bytes(data[: len(data) // 2])
    return "bad.parquet"


def _missing_text_column(d: Path) -> str:
    write_parquet(d / "bad.parquet", ["text under another name"], column="content")
    return "bad.parquet"


def _malformed_json_line(d: Path) -> str:
    write_jsonl_zst(d / "bad.jsonl.zst", [b'{"text": "fine"}', b'{"text": "fine too"}', b'{"text": "no closing brace'])
    return "bad.jsonl.zst"


def _truncated_zstd(d: Path) -> str:
    lines = [json.dumps({"text": f"line {i} " * 20}).encode() for i in range(300)]
    write_jsonl_zst(d / "bad.jsonl.zst", lines)
    data = (d / "bad.jsonl.zst").read_bytes()
    (d / "bad.jsonl.zst").write_bytes(data[:-8])
    return "bad.jsonl.zst"


def _not_utf8_text(d: Path) -> str:
    (d / "bad.txt").write_bytes(b"caf\xe9 latin-1, not UTF-8\n")
    return "bad.txt"


@pytest.mark.parametrize(
    ("make_bad", "expected"),
    [
        (_truncated_parquet, "not a readable parquet file"),
        (_missing_text_column, "no column 'text' (columns: content)"),
        (_malformed_json_line, "line 3: malformed JSON"),
        (_truncated_zstd, "truncated zstd stream"),
        (_not_utf8_text, "not UTF-8"),
    ],
    ids=["truncated-parquet", "missing-text-column", "malformed-json-line", "truncated-zstd", "non-utf8-txt"],
)
def test_bad_input_exits_2_naming_the_file_and_the_problem_and_writes_no_output(tmp_path: Path, make_bad, expected: str):
    src, out = tmp_path / "in", tmp_path / "out"
    src.mkdir()
    _good_parquet(src)
    bad_name = make_bad(src)
    proc = tokenize(src, out)
    assert proc.returncode == 2, proc.stderr
    error = next(line for line in proc.stderr.splitlines() if line.startswith("error:"))
    assert str(src / bad_name) in error and expected in error, error
    assert "Traceback" not in proc.stderr
    assert not any((out / name).exists() for name in OUTPUTS)


def test_an_empty_input_dir_exits_2_naming_it(tmp_path: Path):
    (tmp_path / "in").mkdir()
    proc = tokenize(tmp_path / "in", tmp_path / "out")
    assert proc.returncode == 2
    assert f"error: {tmp_path / 'in'}: no input files" in proc.stderr
    assert not any((tmp_path / "out" / name).exists() for name in OUTPUTS)


def test_a_failed_run_leaves_the_previous_complete_output_untouched(tmp_path: Path):
    src, out = tmp_path / "in", tmp_path / "out"
    src.mkdir()
    _good_parquet(src)
    assert tokenize(src, out).returncode == 0
    before = {name: (out / name).read_bytes() for name in OUTPUTS}
    _malformed_json_line(src)
    assert tokenize(src, out).returncode == 2
    assert {name: (out / name).read_bytes() for name in OUTPUTS} == before


def test_skip_bad_records_skips_and_counts_them_in_meta(tmp_path: Path):
    src, out = tmp_path / "in", tmp_path / "out"
    src.mkdir()
    _good_parquet(src)
    _malformed_json_line(src)
    _truncated_parquet(src)
    proc = tokenize(src, out, "--skip-bad-records")
    assert proc.returncode == 0, proc.stderr
    meta = json.loads((out / "meta.json").read_text())
    assert meta["skipped"] == {"malformed JSON": 1, "unreadable file": 1}
    assert meta["skipped_files"][0]["path"] == "bad.parquet"
    assert meta["skipped_examples"][0]["where"] == "line 3"
    assert meta["documents"] == 4  # two good parquet rows + the two good JSON lines
    assert_round_trip([encode_document(t) for t in ["A good document.", "Another good one.", "fine", "fine too"]], out)


def test_val_fraction_zero_writes_an_empty_val_and_says_so(tmp_path: Path):
    src = tmp_path / "in"
    src.mkdir()
    _good_parquet(src)
    proc = tokenize(src, tmp_path / "out", val="0")
    assert proc.returncode == 0, proc.stderr
    meta = json.loads((tmp_path / "out" / "meta.json").read_text())
    assert (tmp_path / "out" / "val.bin").stat().st_size == 0
    assert meta["val_tokens"] == 0 and "val.bin is empty" in meta["val_note"]


def test_a_tiny_val_fraction_still_puts_one_whole_document_in_val(tmp_path: Path):
    src = tmp_path / "in"
    src.mkdir()
    write_parquet(src / "a.parquet", [f"Document number {i}." for i in range(40)])
    proc = tokenize(src, tmp_path / "out", val="1e-12")
    assert proc.returncode == 0, proc.stderr
    meta = json.loads((tmp_path / "out" / "meta.json").read_text())
    assert meta["val_documents"] == 1 and meta["train_documents"] == 39
    assert_round_trip([encode_document(f"Document number {i}.") for i in range(40)], tmp_path / "out")


def test_bad_arguments_exit_2_naming_the_flag(tmp_path: Path):
    proc = tokenize(tmp_path, tmp_path / "out", val="1.5")
    assert proc.returncode == 2 and "--val-fraction" in proc.stderr
    proc = tokenize(tmp_path, tmp_path / "out", "--tokenizer", "cl100k")
    assert proc.returncode == 2 and "--tokenizer" in proc.stderr


def test_a_changed_input_is_tokenized_again(tmp_path: Path):
    src, out = tmp_path / "in", tmp_path / "out"
    src.mkdir()
    _good_parquet(src)
    write_parquet(src / "01-more.parquet", ["Version one of this file."])
    assert tokenize(src, out, val="0").returncode == 0
    write_parquet(src / "01-more.parquet", ["Version two, rewritten after the first run."])
    proc = tokenize(src, out, val="0")
    assert proc.returncode == 0 and "up to date" not in proc.stdout
    texts = ["A good document.", "Another good one.", "Version two, rewritten after the first run."]
    assert_round_trip([encode_document(t) for t in texts], out)


def live_processes_in_group(pgid: int) -> list[int]:
    """Pids of the process group that are not zombies (an exited child waits for init to reap it)."""
    live = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            live.append(int(stat.parent.name))
    return live


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads process groups from /proc (Linux)")
def test_sigterm_stops_the_run_and_its_workers_and_keeps_finished_shards(corpus_dir: Path, tmp_path: Path):
    out = tmp_path / "out"
    proc = subprocess.Popen(
        [sys.executable, "-m", "x1_pretrain.tokenize_data", "--input-dir", str(corpus_dir), "--output-dir", str(out),
         "--val-fraction", "0.02", "--workers", "2", "--shard-mb", "0.02"],
        cwd=REPO, env=cli_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True,
    )
    records = out / ".tokenize-work" / "shards"
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and proc.poll() is None and len(list(records.glob("*.json"))) < 2:
            time.sleep(0.005)
        proc.send_signal(signal.SIGTERM)  # the main process only, as `docker stop` does
        _, stderr = proc.communicate(timeout=60)
        assert proc.returncode == 128 + signal.SIGTERM, stderr
        assert "rerun the same command to resume" in stderr
        deadline = time.monotonic() + 10
        while live_processes_in_group(proc.pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert live_processes_in_group(proc.pid) == [], "a worker outlived the main process"
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    assert len(list(records.glob("*.json"))) >= 2
    assert not any((out / name).exists() for name in OUTPUTS)
