"""`python -m x1_pretrain.prepare`: flags, the shard-count check, the Pile fallback, and HF_TOKEN
kept out of the output. The hub is replaced by an injected fetch function (no network); the
tokenizer by an injected function that records its arguments."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
from huggingface_hub.errors import HfHubHTTPError

from conftest import run_module
from x1_pretrain.data import prepare
from x1_pretrain.data.prepare import FINEWEB_EDU, PILE_CC, Source, check_shards

TOKEN = "hf_notARealTokenButLongEnough123"


def hub_error(status: int) -> HfHubHTTPError:
    response = SimpleNamespace(status_code=status, headers={}, request=None)
    return HfHubHTTPError(f"{status} Client Error for url https://huggingface.co/api/datasets", response=response)


class FakeHub:
    """Writes `shards` files per source (or raises the error given for it); reports `listed` shards."""

    def __init__(self, shards: int = 3, listed: int | None = None, errors: dict[str, BaseException] | None = None):
        self.shards, self.listed, self.errors = shards, listed, errors or {}
        self.calls: list[tuple[str, int | None]] = []
        self.max_tokens: list[float | None] = []

    def __call__(self, source: Source, local_dir: Path, max_shards: int | None, max_tokens: float | None = None) -> int:
        self.calls.append((source.name, max_shards))
        self.max_tokens.append(max_tokens)
        if source.name in self.errors:
            raise self.errors[source.name]
        folder = local_dir / Path(source.pattern).parent
        folder.mkdir(parents=True, exist_ok=True)
        suffix = Path(source.pattern).name.lstrip("*")
        count = min(self.shards, max_shards) if max_shards else self.shards
        for i in range(count):
            (folder / f"{i:03d}_00000{suffix}").write_bytes(b"x" * 10)
        return self.shards if self.listed is None else self.listed


class RecordingTokenizer:
    def __init__(self, rc: int = 0):
        self.rc, self.argv = rc, None

    def __call__(self, argv):
        self.argv = list(argv)
        return self.rc


def run(tmp_path: Path, *flags: str, hub: FakeHub, tokenizer: RecordingTokenizer | None = None) -> int:
    return prepare.main(["--output-dir", str(tmp_path), *flags], fetch=hub, tokenize=tokenizer or RecordingTokenizer())


def test_downloads_then_tokenizes_the_fineweb_shards_into_tokenized(tmp_path):
    hub, tok = FakeHub(shards=96), RecordingTokenizer()
    assert run(tmp_path, "--workers", "4", "--val-fraction", "0.01", hub=hub, tokenizer=tok) == 0
    assert hub.calls == [("fineweb-edu", None)]
    assert tok.argv == [
        "--input-dir", str(tmp_path / "fineweb-edu" / "sample" / "10BT"),
        "--output-dir", str(tmp_path / "tokenized"),
        "--tokenizer", "gpt2", "--val-fraction", "0.01", "--workers", "4", "--seed", "42",
    ]


def test_tokenizer_exit_code_is_the_commands_exit_code(tmp_path):
    assert run(tmp_path, hub=FakeHub(shards=96), tokenizer=RecordingTokenizer(rc=2)) == 2


@pytest.mark.parametrize("status", [401, 403, 429])
def test_hub_refusal_falls_back_to_the_pile(tmp_path, status, capsys):
    hub, tok = FakeHub(shards=2, errors={"fineweb-edu": hub_error(status)}), RecordingTokenizer()
    assert run(tmp_path, hub=hub, tokenizer=tok) == 0
    assert [name for name, _ in hub.calls] == ["fineweb-edu", "pile-cc"]
    assert tok.argv[tok.argv.index("--input-dir") + 1] == str(tmp_path / "pile-cc" / "test")
    assert "falling back to monology/pile-uncopyrighted" in capsys.readouterr().err


def test_network_failure_does_not_fall_back(tmp_path, capsys):
    hub = FakeHub(errors={"fineweb-edu": ConnectionError("Name or service not known")})
    assert run(tmp_path, hub=hub) == 1
    assert hub.calls == [("fineweb-edu", None)]
    assert "download of HuggingFaceFW/fineweb-edu failed" in capsys.readouterr().err


def test_no_fallback_flag_fails_on_refusal(tmp_path):
    hub = FakeHub(errors={"fineweb-edu": hub_error(429)})
    assert run(tmp_path, "--no-fallback", hub=hub) == 1
    assert hub.calls == [("fineweb-edu", None)]


def test_refusal_of_the_fallback_itself_fails(tmp_path):
    hub = FakeHub(errors={"fineweb-edu": hub_error(429), "pile-cc": hub_error(429)})
    assert run(tmp_path, hub=hub) == 1


def test_source_pile_cc_goes_straight_to_the_pile(tmp_path):
    hub = FakeHub(shards=1)
    assert run(tmp_path, "--source", "pile-cc", hub=hub) == 0
    assert hub.calls == [("pile-cc", None)]


def test_fewer_shards_on_disk_than_the_hub_lists_fails_naming_the_counts(tmp_path, capsys):
    hub, tok = FakeHub(shards=3, listed=96), RecordingTokenizer()
    assert run(tmp_path, hub=hub, tokenizer=tok) == 1
    assert "3 of 96 shards on disk" in capsys.readouterr().err
    assert tok.argv is None  # never tokenizes a partial download


def test_max_shards_limits_the_download_and_the_check(tmp_path):
    hub, tok = FakeHub(shards=96), RecordingTokenizer()
    assert run(tmp_path, "--max-shards", "2", hub=hub, tokenizer=tok) == 0
    assert hub.calls == [("fineweb-edu", 2)]
    assert len(FINEWEB_EDU.shards(tmp_path)) == 2


def test_max_tokens_fetches_the_first_shards_of_the_larger_sample_that_hold_them(tmp_path, capsys):
    # The hub's listing: 100 shards of sample/100BT, even sizes. 23B tokens of its 100B: 24 of them
    # (23.5 with the 2% slack for the val split and uneven shards, rounded up).
    assert prepare.shards_for_tokens([2_000_000_000] * 100, 100e9, 23e9) == 24
    assert prepare.shards_for_tokens([5, 1, 1, 1, 1, 1], 10.0, 4.0) == 1  # bytes, not shard counts
    assert prepare.shards_for_tokens([1] * 10, 10e9, 50e9) == 10  # more than the sample: all of it

    class TokenHub(FakeHub):
        def __call__(self, source, local_dir, max_shards, max_tokens=None):
            count = prepare.shards_for_tokens([1] * self.shards, source.tokens, max_tokens) if max_tokens else None
            super().__call__(source, local_dir, count)
            self.max_tokens[-1] = max_tokens  # what prepare asked for
            return count or self.shards

    hub, tok = TokenHub(shards=100), RecordingTokenizer()
    assert run(tmp_path, "--source", "fineweb-edu-100bt", "--max-tokens", "23B", hub=hub, tokenizer=tok) == 0
    assert hub.calls == [("fineweb-edu-100bt", 24)] and hub.max_tokens == [23e9]
    assert len(prepare.FINEWEB_EDU_100BT.shards(tmp_path)) == 24
    assert tok.argv[tok.argv.index("--input-dir") + 1] == str(tmp_path / "fineweb-edu-100bt" / "sample" / "100BT")
    assert "fewer than the lab's" not in capsys.readouterr().err
    for bad in ("lots", "0"):
        assert run(tmp_path, "--max-tokens", bad, hub=FakeHub()) == 2


def test_fewer_than_the_labs_96_warns_but_trusts_the_hub_listing(tmp_path, capsys):
    assert run(tmp_path, hub=FakeHub(shards=14)) == 0
    assert "fewer than the lab's ~96" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("found", "listed", "max_shards", "ok", "warns"),
    [
        (96, 96, None, True, False),
        (95, 96, None, False, False),
        (0, 0, None, False, False),  # an empty listing is never a finished download
        (14, 14, None, True, True),  # the hub is the authority; the lab's ~96 only warns
        (5, 96, 5, True, False),
        (4, 96, 5, False, False),
        (3, 3, 5, True, False),  # asked for more than exist: all of them is enough
    ],
)
def test_check_shards(found, listed, max_shards, ok, warns):
    check = check_shards(found, listed, max_shards, seed_shards=96)
    assert check.ok is ok
    assert (check.warning is not None) is warns


def test_pile_has_no_lab_count_to_warn_about():
    assert check_shards(1, 1, None, PILE_CC.seed_shards).warning is None


def test_finished_data_is_not_prepared_again(tmp_path):
    (tmp_path / "tokenized").mkdir()
    (tmp_path / "tokenized" / "meta.json").write_text("{}")
    hub = FakeHub()
    assert run(tmp_path, hub=hub) == 0
    assert hub.calls == []
    assert run(tmp_path, "--force", "--max-shards", "3", hub=hub) == 0
    assert hub.calls == [("fineweb-edu", 3)]


def test_hf_token_never_reaches_the_output(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    # The worst case: the hub's error message carries the token back.
    refused = hub_error(401)
    refused.args = (f"401 Unauthorized: invalid token {TOKEN}",)
    assert run(tmp_path, hub=FakeHub(errors={"fineweb-edu": refused})) == 0
    out = capsys.readouterr()
    assert "HF_TOKEN is set" in out.err
    assert TOKEN not in out.out + out.err


@pytest.mark.parametrize(
    ("flags", "named"),
    [
        (["--max-shards", "-1"], "--max-shards"),
        (["--max-shards", "many"], "--max-shards"),
        (["--workers", "0"], "--workers"),
        (["--val-fraction", "1.5"], "--val-fraction"),
        (["--source", "wikipedia"], "--source"),
        (["--bogus"], "--bogus"),
    ],
)
def test_bad_flag_exits_2_naming_it(tmp_path, flags, named):
    proc = run_module("x1_pretrain.prepare", "--output-dir", str(tmp_path), *flags, timeout=60)
    assert proc.returncode == 2
    assert named in proc.stderr


def test_missing_output_dir_exits_2_naming_it():
    proc = run_module("x1_pretrain.prepare", timeout=60)
    assert proc.returncode == 2
    assert "--output-dir" in proc.stderr
