"""The offline corpus: real English from the standard library's docstrings, FineWeb-Edu schema,
the same bytes on every run, never more than asked for."""

from __future__ import annotations

from pathlib import Path

import pyarrow.parquet as pq

from conftest import run_module
from x1_pretrain.data.corpus import Document, module_document, write_corpus

FINEWEB_EDU_COLUMNS = ["text", "id", "dump", "url", "file_path", "language", "language_score", "token_count",
                       "score", "int_score"]


def test_stdlib_corpus_is_fineweb_edu_parquet_of_real_english_under_the_cap(corpus_dir: Path):
    files = sorted(corpus_dir.glob("*.parquet"))
    assert len(files) >= 2, "more than one file, so workers have something to share"
    table = pq.read_table(files)
    assert table.column_names == FINEWEB_EDU_COLUMNS
    texts = table.column("text").to_pylist()
    size = sum(len(t.encode()) for t in texts)
    assert 1_500_000 < size <= 2_000_000
    assert len(set(table.column("id").to_pylist())) == len(texts) > 300
    words = " ".join(texts[:50]).lower().split()
    assert sum(w in {"the", "of", "a", "is", "to"} for w in words) > 0.05 * len(words), "English prose"
    assert all(c > 0 for c in table.column("token_count").to_pylist())
    assert pq.ParquetFile(files[0]).metadata.num_row_groups > 1, "row groups, as FineWeb's files have"


def test_the_corpus_is_the_same_bytes_on_every_run(tmp_path: Path):
    for name in ("a", "b"):
        proc = run_module("x1_pretrain.corpus", "stdlib-docstrings", "--output", str(tmp_path / name),
                          "--max-mb", "0.3", "--file-mb", "0.1")
        assert proc.returncode == 0, proc.stderr
    a, b = sorted((tmp_path / "a").iterdir()), sorted((tmp_path / "b").iterdir())
    assert [p.name for p in a] == [p.name for p in b] and len(a) >= 2
    assert all(x.read_bytes() == y.read_bytes() for x, y in zip(a, b, strict=True))


def test_a_source_smaller_than_the_cap_is_written_whole_and_said_so(tmp_path: Path):
    docs = [Document(f"id{i}", f"u{i}", f"f{i}", f"Document {i} says something.") for i in range(10)]
    summary = write_corpus(docs, tmp_path, max_bytes=10_000, file_bytes=100)
    assert summary.exhausted and summary.documents == 10 and len(summary.files) == 3
    capped = write_corpus(docs, tmp_path, max_bytes=100, file_bytes=100)
    assert not capped.exhausted and capped.text_bytes <= 100
    assert sorted(p.name for p in tmp_path.glob("*.parquet")) == [p.name for p in capped.files], "stale files removed"


def test_module_document_gathers_module_class_and_function_docstrings_without_importing():
    source = b'''"""Module summary."""
import sys; sys.exit("importing this would exit")
class Thing:
    """A thing."""
    def method(self):
        """Does it."""
def helper():
    pass
'''
    assert module_document(source, "pkg.mod") == (
        "pkg.mod\n\nModule summary.\n\nThing\n\nA thing.\n\nThing.method\n\nDoes it."
    )
    assert module_document(b"print 'python 2'", "old") is None


def test_bad_arguments_exit_2_naming_the_flag(tmp_path: Path):
    proc = run_module("x1_pretrain.corpus", "stdlib-docstrings", "--output", str(tmp_path), "--max-mb", "0")
    assert proc.returncode == 2 and "--max-mb" in proc.stderr
