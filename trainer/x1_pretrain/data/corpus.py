"""Real text without a download: the docstrings (or the whole source) of installed Python code,
written as FineWeb-Edu-schema parquet for demos, tests and the benchmarks.

    python -m x1_pretrain.corpus stdlib-docstrings --output DIR [--max-mb 25]
    python -m x1_pretrain.corpus installed-docstrings --output DIR --max-mb 25
    python -m x1_pretrain.corpus installed-source --output DIR --max-mb 800

`stdlib-docstrings` reads the standard library's source files with `ast` (importing them could
have side effects) plus the language-reference topics shipped as `pydoc_data`: one document per
module (its docstring and those of its classes and functions) and one per topic. That is ~3 MB
of text on CPython 3.11; asking for more writes all there is and says so. `installed-docstrings`
continues into site-packages for corpora of tens of MB (the benchmark). Nothing is copied into
the repository, and the same interpreter and packages give the same bytes on every run.
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import math
import os
import sys
import sysconfig
import time
import uuid
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

from x1_common.contracts import ExitCode
from x1_common.fsutil import fsync_dir
from x1_pretrain.data.tokenizer import encode_document_array

MB = 1_000_000  # sizes here are MB of UTF-8 text, 10^6 bytes
FILE_PREFIX = "docstrings"


@dataclass(frozen=True)
class Document:
    doc_id: str
    url: str
    file_path: str
    text: str


@dataclass(frozen=True)
class CorpusSummary:
    files: list[Path]
    documents: int
    text_bytes: int
    exhausted: bool  # the source ran out before the size cap


# --------------------------------------------------------------------------------------------
# Sources


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def site_package_roots() -> list[Path]:
    roots = {Path(sysconfig.get_paths()[k]) for k in ("purelib", "platlib")}
    return sorted(r for r in roots if r.is_dir())


def python_files(root: Path, *, skip_dirs: Iterable[str] = ()) -> Iterator[tuple[str, Path]]:
    """(posix path relative to root, path) of every .py file under root, in sorted order."""
    skip = set(skip_dirs)
    found = []
    for path in root.rglob("*.py"):
        rel = path.relative_to(root)
        if skip.intersection(rel.parts[:-1]) or any(p.startswith(".") for p in rel.parts):
            continue
        if not path.is_file():  # a FIFO, socket or dangling symlink named *.py: never opened (it could block)
            continue
        found.append((rel.as_posix(), path))
    yield from sorted(found)


def _docstring_sections(tree: ast.Module) -> Iterator[tuple[str, str]]:
    """(qualified name, cleaned docstring) for the module, its classes and functions, in source order."""
    doc = ast.get_docstring(tree)
    if doc:
        yield "", doc
    # Only statement bodies hold docstrings: walking them is much cheaper than ast.walk.
    stack: list[tuple[str, list[ast.stmt]]] = [("", tree.body)]
    while stack:
        prefix, body = stack.pop()
        nested = []
        for node in body:
            if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                name = f"{prefix}{node.name}"
                doc = ast.get_docstring(node)
                if doc:
                    yield name, doc
                nested.append((f"{name}.", node.body))
        stack.extend(reversed(nested))


def module_document(source: bytes, module: str) -> str | None:
    """The module's docstrings as one text, pydoc-like; None if it has none or does not parse."""
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):  # Python 2 files in test data, bad encodings
        return None
    parts = []
    for name, doc in _docstring_sections(tree):
        parts.append(doc if not name else f"{name}\n\n{doc}")
    if not parts:
        return None
    return f"{module}\n\n" + "\n\n".join(parts)


def module_name(rel: str) -> str:
    name = rel[: -len(".py")].replace("/", ".")
    return name[: -len(".__init__")] if name.endswith(".__init__") else name


def pydoc_topic_documents(version: str) -> Iterator[Document]:
    try:
        from pydoc_data.topics import topics  # a plain dict of strings: no side effects
    except ImportError:  # some distributions strip pydoc_data
        return
    for key in sorted(topics):
        text = topics[key].strip()
        if text:
            url = f"python-{version}-pydoc-topic://{key}"
            yield Document(_doc_id(url), url, f"pydoc_data/topics.py#{key}", text)


def _doc_id(url: str) -> str:
    return f"<urn:uuid:{uuid.uuid5(uuid.NAMESPACE_URL, url)}>"


def code_documents(root: Path, label: str, *, skip_dirs: Iterable[str] = ()) -> Iterator[Document]:
    for rel, path in python_files(root, skip_dirs=skip_dirs):
        try:
            source = path.read_bytes()
        except OSError:
            continue
        text = module_document(source, module_name(rel))
        if text:
            url = f"{label}:///{rel}"
            yield Document(_doc_id(url), url, rel, text)


def whole_source_documents(roots: Iterable[tuple[Path, str]]) -> Iterator[Document]:
    """Every .py file as it is, code and docstrings, one document each; a file whose bytes were
    already seen (vendored and copied modules are common) only once."""
    seen: set[bytes] = set()
    for root, label in roots:
        for rel, path in python_files(root):
            try:
                source = path.read_bytes()
            except OSError:
                continue
            digest = hashlib.sha256(source).digest()
            if digest in seen or not source.strip():
                continue
            seen.add(digest)
            text = source.decode("utf-8", errors="replace")
            url = f"{label}:///{rel}"
            yield Document(_doc_id(url), url, rel, text)


def source_documents(source: str) -> Iterator[Document]:
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    stdlib_label = f"python-{version}-stdlib"
    if source == "installed-source":
        yield from whole_source_documents([(stdlib_root(), stdlib_label),
                                           *((r, "site-packages") for r in site_package_roots())])
        return
    yield from pydoc_topic_documents(version)
    yield from code_documents(stdlib_root(), stdlib_label, skip_dirs=("site-packages", "dist-packages"))
    if source == "installed-docstrings":
        for root in site_package_roots():
            yield from code_documents(root, "site-packages")


SOURCES = {
    "stdlib-docstrings": "the standard library's docstrings and pydoc topics (~3 MB on CPython 3.11)",
    "installed-docstrings": "stdlib-docstrings, then the docstrings of everything in site-packages (tens of MB)",
    "installed-source": "every .py file of the standard library and site-packages, code and all, each distinct "
                        "file once (hundreds of MB where big packages are installed: the GPU benchmarks' corpus)",
}

# --------------------------------------------------------------------------------------------
# FineWeb-Edu schema parquet


def fineweb_schema():  # -> pa.Schema; pyarrow is imported lazily so --help stays instant
    import pyarrow as pa

    # FineWeb-Edu's columns. The classifier scores and language id do not apply here: null.
    return pa.schema(
        [
            ("text", pa.string()),
            ("id", pa.string()),
            ("dump", pa.string()),
            ("url", pa.string()),
            ("file_path", pa.string()),
            ("language", pa.string()),
            ("language_score", pa.float64()),
            ("token_count", pa.int64()),
            ("score", pa.float64()),
            ("int_score", pa.int64()),
        ]
    )


def _write_parquet_file(path: Path, docs: list[Document], dump: str, row_group_rows: int) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    n = len(docs)
    table = pa.table(
        {
            "text": [d.text for d in docs],
            "id": [d.doc_id for d in docs],
            "dump": [dump] * n,
            "url": [d.url for d in docs],
            "file_path": [d.file_path for d in docs],
            "language": ["en"] * n,
            "language_score": [None] * n,
            "token_count": [len(encode_document_array(d.text)) for d in docs],  # GPT-2 tokens, as FineWeb's
            "score": [None] * n,
            "int_score": [None] * n,
        },
        schema=fineweb_schema(),
    )
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "wb") as f:
        pq.write_table(table, f, row_group_size=row_group_rows, compression="zstd")
        f.flush()
        os.fsync(f.fileno())
    tmp.replace(path)


def write_corpus(
    docs: Iterable[Document],
    output: Path,
    *,
    max_bytes: int,
    file_bytes: int,
    row_group_rows: int = 64,
    dump: str = "",
) -> CorpusSummary:
    """Parquet files of ~file_bytes of text each, until the next document would pass max_bytes.

    Files from an earlier build in `output` (same prefix) are replaced, extra ones removed.
    """
    output.mkdir(parents=True, exist_ok=True)
    written: list[Path] = []
    batch: list[Document] = []
    batch_bytes = total = count = 0
    exhausted = True

    def flush() -> None:
        nonlocal batch, batch_bytes
        if batch:
            path = output / f"{FILE_PREFIX}-{len(written):05d}.parquet"
            _write_parquet_file(path, batch, dump, row_group_rows)
            written.append(path)
        batch, batch_bytes = [], 0

    for doc in docs:
        size = len(doc.text.encode("utf-8"))
        if total + size > max_bytes:
            exhausted = False
            break
        batch.append(doc)
        batch_bytes += size
        total += size
        count += 1
        if batch_bytes >= file_bytes:
            flush()
    flush()
    keep = {p.name for p in written}
    for stale in output.glob(f"{FILE_PREFIX}-*.parquet"):
        if stale.name not in keep:
            stale.unlink()
    fsync_dir(output)
    return CorpusSummary(files=written, documents=count, text_bytes=total, exhausted=exhausted)


# --------------------------------------------------------------------------------------------
# Command line


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m x1_pretrain.corpus",
        description=(
            "Write a small real-English corpus as FineWeb-Edu-schema parquet (column `text`), from the "
            "docstrings of installed Python code: no download, deterministic for a given interpreter."
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="sources:\n" + "\n".join(f"  {k:22s}{v}" for k, v in SOURCES.items()),
    )
    p.add_argument("source", choices=sorted(SOURCES), help="where the text comes from (see below)")
    p.add_argument("--output", required=True, type=Path, help="folder for the parquet files (created)")
    p.add_argument(
        "--max-mb", type=float, default=25.0,
        help="cap on the UTF-8 text written, MB = 10^6 bytes (default 25; a smaller source writes all it has)",
    )
    p.add_argument("--file-mb", type=float, default=1.0, help="text per parquet file, MB (default 1)")
    p.add_argument("--row-group-rows", type=int, default=64, help="documents per parquet row group (default 64)")
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    for name in ("max_mb", "file_mb"):
        value = getattr(args, name)
        if not (value > 0 and math.isfinite(value)):
            parser.error(f"--{name.replace('_', '-')} must be a positive, finite number of MB, got {value}")
    if args.row_group_rows < 1:
        parser.error(f"--row-group-rows must be >= 1, got {args.row_group_rows}")
    if args.output.exists() and not args.output.is_dir():
        parser.error(f"--output {args.output}: exists and is not a folder")
    try:
        args.output.mkdir(parents=True, exist_ok=True)
    except OSError as e:  # a parent that is a file, no permission
        parser.error(f"--output {args.output}: cannot be created ({e.strerror or e})")
    started = time.monotonic()
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    summary = write_corpus(
        source_documents(args.source),
        args.output,
        max_bytes=int(args.max_mb * MB),
        file_bytes=int(args.file_mb * MB),
        row_group_rows=args.row_group_rows,
        dump=f"python-{version}-{args.source}",
    )
    mb = summary.text_bytes / MB
    print(
        f"{args.source}: wrote {summary.documents} documents, {mb:.2f} MB of text, in {len(summary.files)} "
        f"parquet file(s) under {args.output} ({time.monotonic() - started:.1f} s)"
    )
    if summary.exhausted and mb < args.max_mb:
        print(
            f"{args.source}: the source has only {mb:.2f} MB of text, less than --max-mb {args.max_mb:g}; "
            "wrote all of it (nothing repeated)"
        )
    if summary.documents == 0:
        print(f"error: {args.source}: no documents found", file=sys.stderr)
        return ExitCode.USAGE
    return 0


if __name__ == "__main__":
    sys.exit(main())
