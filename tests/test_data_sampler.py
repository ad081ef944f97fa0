"""The trainer's data: validated memory maps, windows as a pure function of (seed, step, global
index), fixed val windows, the prefetcher, and the rare-token sequences of the injected spike."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import REPO, cli_env
from x1_pretrain.data.loader import (
    CHECK_CACHE,
    DataError,
    Prefetcher,
    WindowSampler,
    micro_batch_indices,
    open_token_data,
    rare_token_ids,
    rare_token_windows,
    val_windows,
)

VOCAB = 50257


@pytest.fixture
def data_copy(tiny_data: Path, tmp_path: Path) -> Path:
    """A private copy of the session's token files, to damage."""
    for name in ("train.bin", "val.bin", "meta.json"):
        shutil.copy2(tiny_data / name, tmp_path / name)
    return tmp_path


def step_windows(sampler: WindowSampler, step: int, micro_batch: int, world_size: int) -> dict[int, list[int]]:
    """Global index → window, gathered the way `world_size` ranks with gradient accumulation read them."""
    accum = sampler.samples_per_step // (micro_batch * world_size)
    seen: dict[int, list[int]] = {}
    for micro in range(accum):
        for rank in range(world_size):
            idx = micro_batch_indices(micro, rank, micro_batch, world_size)
            for i, w in zip(idx, sampler.windows(step, idx), strict=True):
                assert i not in seen, f"global index {i} drawn twice"
                seen[i] = w.tolist()
    return seen


# --------------------------------------------------------------------------------------------
# Opening


def test_open_token_data_maps_the_files_and_caches_the_id_check(data_copy: Path):
    data = open_token_data(data_copy, VOCAB)
    meta = json.loads((data_copy / "meta.json").read_text())
    assert isinstance(data.train, np.memmap) and data.train.dtype == np.dtype("<u2")
    assert (len(data.train), len(data.val)) == (meta["train_tokens"], meta["val_tokens"])
    cache = json.loads((data_copy / CHECK_CACHE).read_text())
    assert cache["train.bin"]["size"] == meta["train_tokens"] * 2 and cache["train.bin"]["max_id"] < VOCAB


def test_a_token_id_outside_the_vocab_is_named_with_its_file_and_offset(data_copy: Path):
    open_token_data(data_copy, VOCAB)  # a clean verdict is cached first: it must not hide the change
    tokens = np.memmap(data_copy / "train.bin", dtype="<u2", mode="r+")
    tokens[12_345] = 60_000
    tokens.flush()
    del tokens
    st = os.stat(data_copy / "train.bin")
    os.utime(data_copy / "train.bin", ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))
    with pytest.raises(DataError) as e:
        open_token_data(data_copy, VOCAB)
    message = str(e.value)
    assert str(data_copy / "train.bin") in message and "token id 60000" in message and "offset 12,345" in message


def test_a_vocab_smaller_than_the_data_is_refused(data_copy: Path):
    with pytest.raises(DataError, match=r"meta.json: the data's vocab_size 50257 is larger than the model's vocab_size 1000"):
        open_token_data(data_copy, 1000)


def test_a_train_file_that_does_not_match_meta_is_refused(data_copy: Path):
    with open(data_copy / "train.bin", "r+b") as f:
        f.truncate(f.seek(0, os.SEEK_END) - 2)
    with pytest.raises(DataError, match=r"train.bin: \d+ bytes, but meta.json says \d+ tokens"):
        open_token_data(data_copy, VOCAB)


def test_missing_meta_says_how_to_make_it(tmp_path: Path):
    with pytest.raises(DataError, match="meta.json: missing; tokenize first"):
        open_token_data(tmp_path, VOCAB)


# --------------------------------------------------------------------------------------------
# Training windows


def test_micro_batch_indices_count_samples_across_micro_steps_and_ranks():
    assert micro_batch_indices(0, 0, 4, 1) == range(0, 4)
    assert micro_batch_indices(1, 0, 4, 2) == range(8, 12)
    assert micro_batch_indices(1, 1, 4, 2) == range(12, 16)


_FRESH = """
import hashlib, sys, numpy as np
from x1_pretrain.data.loader import WindowSampler, open_token_data
data = open_token_data(sys.argv[1], 50257)
w = WindowSampler(data.train, 64, 42, 16).windows(7, [3, 11, 0])
print(hashlib.sha256(w.tobytes()).hexdigest())
"""


def test_the_same_seed_step_and_index_give_the_same_windows_in_a_fresh_process(tiny_data: Path):
    data = open_token_data(tiny_data, VOCAB)
    here = WindowSampler(data.train, 64, 42, 16).windows(7, [3, 11, 0])
    proc = subprocess.run([sys.executable, "-c", _FRESH, str(tiny_data)], capture_output=True, text=True,
                          env=cli_env(), cwd=REPO, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == hashlib.sha256(here.tobytes()).hexdigest()
    other_step = WindowSampler(data.train, 64, 42, 16).windows(8, [3, 11, 0])
    other_seed = WindowSampler(data.train, 64, 43, 16).windows(7, [3, 11, 0])
    assert not np.array_equal(here, other_step) and not np.array_equal(here, other_seed)


def test_a_step_sees_the_same_windows_at_world_size_1_and_2(tiny_data: Path):
    sampler = WindowSampler(open_token_data(tiny_data, VOCAB).train, 64, 42, samples_per_step=16)
    for step in (0, 1, 999):
        one = step_windows(sampler, step, micro_batch=4, world_size=1)  # 4 micro-steps
        two = step_windows(sampler, step, micro_batch=4, world_size=2)  # 2 micro-steps per rank
        assert sorted(one) == sorted(two) == list(range(16))
        assert one == two


def test_a_window_does_not_depend_on_how_many_samples_a_step_draws():
    tokens = np.arange(10_000, dtype=np.uint16)
    small, large = WindowSampler(tokens, 32, 5, 8), WindowSampler(tokens, 32, 5, 512)
    assert np.array_equal(small.starts(3), large.starts(3)[:8])
    assert np.array_equal(small.windows(3, [7, 2]), large.windows(3, [7, 2]))


def test_windows_are_contiguous_token_runs_and_never_read_past_the_end(tmp_path: Path):
    n, seq_len = 300, 16
    np.arange(n, dtype="<u2").tofile(tmp_path / "t.bin")
    tokens = np.memmap(tmp_path / "t.bin", dtype="<u2", mode="r")
    sampler = WindowSampler(tokens, seq_len, seed=1, samples_per_step=64)
    starts = np.concatenate([sampler.starts(step) for step in range(200)])
    assert starts.min() >= 0 and starts.max() == n - seq_len - 1, "the last start is reachable, none beyond it"
    w = sampler.windows(5, range(64))
    assert w.shape == (64, seq_len + 1) and w.dtype == np.int64
    assert np.array_equal(w, sampler.starts(5)[:, None] + np.arange(seq_len + 1))
    with pytest.raises(DataError, match="fewer than one window"):
        WindowSampler(tokens[:seq_len], seq_len, seed=1, samples_per_step=4)


def test_val_windows_are_the_same_fixed_disjoint_set_at_every_call():
    val = np.arange(1000, dtype=np.uint16)
    a, b = val_windows(val, 9, 20, seed=42), val_windows(val, 9, 20, seed=42)
    assert a.shape == (20, 10) and np.array_equal(a, b)
    assert len(np.unique(a)) == a.size, "windows overlap"
    assert val_windows(val, 9, 500, seed=42).shape == (100, 10), "a short val gives all the windows it holds"
    with pytest.raises(DataError, match="fewer than one window"):
        val_windows(val[:9], 9, 4, seed=42)


# --------------------------------------------------------------------------------------------
# Prefetch


def _source(step: int, micro: int) -> np.ndarray:
    return np.full((2, 5), step * 10 + micro, dtype=np.int64) + np.arange(5)


@pytest.mark.parametrize("depth", [0, 3])
def test_prefetcher_yields_every_key_in_order_with_inputs_and_shifted_targets(depth: int):
    keys = [(s, m) for s in range(3) for m in range(2)]
    with Prefetcher(_source, keys, torch.device("cpu"), depth=depth) as batches:
        got = list(batches)
    assert [(s, m) for s, m, _, _ in got] == keys
    for s, m, x, y in got:
        w = torch.from_numpy(_source(s, m))
        assert x.dtype == torch.int64 and torch.equal(x, w[:, :-1]) and torch.equal(y, w[:, 1:])


def test_prefetcher_raises_the_source_error_in_the_consumer():
    def failing(step: int, micro: int) -> np.ndarray:
        if step == 2:
            raise DataError("window source broke at step 2")
        return _source(step, micro)

    with Prefetcher(failing, [(s, 0) for s in range(5)], torch.device("cpu"), depth=2) as batches:
        it = iter(batches)
        assert [next(it)[0], next(it)[0]] == [0, 1]
        with pytest.raises(DataError, match="broke at step 2"):
            next(it)


def test_prefetcher_close_stops_the_thread_when_the_consumer_stops_early():
    def endless():
        step = 0
        while True:
            yield step, 0
            step += 1

    before = threading.active_count()
    p = Prefetcher(_source, endless(), torch.device("cpu"), depth=2)
    for step, _, _, _ in p:
        if step == 3:
            break
    started = time.monotonic()
    p.close()
    assert time.monotonic() - started < 5
    assert threading.active_count() == before


# --------------------------------------------------------------------------------------------
# Rare tokens (the injected spike)


def test_rare_token_ids_are_the_least_frequent_seen_ids():
    tokens = np.repeat(np.arange(100, dtype=np.uint16), np.arange(1, 101))  # id k appears k + 1 times
    assert rare_token_ids(tokens, 200, fraction=0.05).tolist() == [0, 1, 2, 3, 4]
    assert rare_token_ids(tokens, 200, fraction=0.0001).tolist() == [0], "at least one id"


def test_rare_token_windows_are_deterministic_and_use_only_rare_ids():
    rare = np.array([7, 11, 13])
    a = rare_token_windows(rare, 42, step=5, micro_step=1, rank=0, count=4, seq_len=8)
    assert a.shape == (4, 9) and a.dtype == np.int64 and set(np.unique(a)) <= {7, 11, 13}
    assert np.array_equal(a, rare_token_windows(rare, 42, 5, 1, 0, 4, 8))
    assert not np.array_equal(a, rare_token_windows(rare, 42, 6, 1, 0, 4, 8))
