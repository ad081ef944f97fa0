"""What a newcomer reads and looks at: the README's words defined before they are used, check 1's
machine in plain words, `x1 launch --help` naming each default once, and the run folder's plots
readable at any run length (the legend beside the data, log ticks that do not crowd, the time axis
in the unit that fits the run, the 50M run's expectations only on the 50M model)."""

from __future__ import annotations

import re
import subprocess
import sys
from itertools import combinations
from pathlib import Path

import pytest

from conftest import CONFIGS, REPO
from x1_pretrain.config import load_config
from x1_pretrain.run import plots
from x1_pretrain.run.dod import check_manifest, machine

README = (REPO / "README.md").read_text(encoding="utf-8")


# ---------------------------------------------------------------------------------------------
# Words


def glossary() -> tuple[int, str]:
    start = README.index("### Words used here")
    end = README.index("\n#", start + 1)
    return start, README[start:end]


@pytest.mark.parametrize(("term", "used_as"), [
    ("**The lab**", "the lab's"), ("**Definition of done (DoD)**", "definition-of-done"), ("**band**", "band"),
    ("**MFU**", "MFU"), ("**Levers**", "levers"), ("**The forecast law**", "lr-annealing"), ("**R580**", "R580"),
    ("**The run folder**", "run folder"),
])
def test_the_readme_defines_each_term_before_it_uses_it(term, used_as):
    start, words = glossary()
    assert term in words
    rest = README[:start] + README[start + len(words):]
    first_use = rest.lower().find(used_as.lower())
    assert first_use == -1 or first_use >= start, f"{used_as!r} is used before the glossary defines it"


def test_the_readme_lists_the_six_checks_of_the_definition_of_done():
    _, words = glossary()
    checks = re.findall(r"^  (\d)\. ", words, re.M)
    assert checks == ["1", "2", "3", "4", "5", "6"]
    for what in ("manifest.json", "band", "final.safetensors", "cap", "spike-postmortem.md", "terminated"):
        assert what in words


def test_check_1_names_the_machine_in_words_never_0x_none():
    cpu = {"gpu_name": "none", "gpu_count": 0, "cpu": "2 vCPUs", "provider": "lambda"}
    assert machine(cpu) == "no GPU (CPU, 2 vCPUs) on lambda"
    assert machine({"gpu_name": "NVIDIA A100-SXM4-80GB", "gpu_count": 1.0, "provider": "runpod"}) == \
        "1x NVIDIA A100-SXM4-80GB on runpod"
    manifest = {"seed": 42, "versions": {p: "1.0" for p in ("torch", "flash-attn", "transformers", "numpy")},
                "config_sha256": "ab" * 32, "cluster": cpu, "spent_usd": 0.4}
    check = check_manifest(manifest, "")
    assert check.ok and "no GPU (CPU, 2 vCPUs) on lambda" in check.reason and "0x none" not in check.reason


def test_x1_launch_help_names_each_default_once():
    proc = subprocess.run([str(Path(sys.executable).parent / "x1"), "launch", "--help"], capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 0
    options = re.split(r"\n  (?=-)", proc.stdout.split("options:", 1)[1])
    assert len(options) > 20
    for option in options:
        text = " ".join(option.split())
        assert text.count("default") <= 1, text
        assert "(default: None)" not in text and "(default: False)" not in text
    assert "(default: 100)" in " ".join(proc.stdout.split())  # a default no help names is still shown


# ---------------------------------------------------------------------------------------------
# Pictures


@pytest.fixture()
def drawn(monkeypatch):
    """The figure each plot function draws, rendered, instead of a PNG."""
    figures = []

    def keep(fig, path):
        fig.canvas.draw()
        figures.append(fig)

    monkeypatch.setattr(plots, "_save", keep)
    return figures


def outside(fig) -> None:
    """Every legend of `fig` lies right of every axes' data area: it hides no curve, no marker."""
    legends = [ax.get_legend() for ax in fig.axes if ax.get_legend() is not None]
    assert legends
    right = max(ax.get_window_extent().x1 for ax in fig.axes)
    for legend in legends:
        assert legend.get_window_extent().x0 >= right - 1


def test_the_legend_sits_beside_the_data_never_over_a_spike(tmp_path, drawn):
    train = [(s, 4.0 - s / 1000) for s in range(10, 210, 10)]
    plots.loss_curve(tmp_path / "l.png", train, [(100, 3.95), (200, 3.7)], band=(3.2, 3.5), predicted=3.0, title="t",
                     spikes=[(43, 6.5)], injection=(43, 47))
    plots.gradnorm_curve(tmp_path / "g.png", [(s, 0.8) for s in range(10, 210, 10)], [(s, 50.0) for s in range(10, 210, 10)],
                         clip=1.0, title="t", spikes=[(43, 17.5)])
    plots.throughput_curve(tmp_path / "t.png", [[(0.0, 1000.0), (0.01, 1100.0)], [(0.02, 1050.0)]],
                           gaps=[(0.011, 0.019, "restart 1: 29 s down")], mfu=[[(0.0, 0.3), (0.01, 0.31)]], title="t")
    for fig in drawn:
        outside(fig)


def test_a_tiny_runs_loss_curve_leaves_out_the_50m_runs_expectations(tmp_path, drawn):
    assert plots.is_lab_model(load_config(str(CONFIGS / "x1-50m-a100.yaml"), []).resolved()["model"])
    assert not plots.is_lab_model(load_config(str(CONFIGS / "tiny-cpu.yaml"), []).resolved()["model"])
    train = [(s, 10.8 - s / 100) for s in range(0, 60, 2)]
    for lab in (True, False):
        plots.loss_curve(tmp_path / "l.png", train, [(60, 10.3)], band=(4.5, 7.0), predicted=None, title="t",
                         lab_expected=lab)
    labels = [[t.get_text() for t in fig.axes[0].get_legend().get_texts()] for fig in drawn]
    assert any("the lab's expectation" in label for label in labels[0])
    assert not any("the lab's expectation" in label for label in labels[1])


@pytest.mark.parametrize("values", [[0.3 + 0.1 * i for i in range(20)] + [40.0], [0.8, 0.9, 1.1, 1.4]])
def test_the_gradnorm_log_ticks_do_not_overlap(tmp_path, drawn, values):
    plots.gradnorm_curve(tmp_path / "g.png", list(enumerate(values, start=1)), [(i, 50.0) for i in range(1, 5)],
                         clip=1.0, title="t")
    (fig,) = drawn
    top = fig.axes[0]
    ticks = [*top.yaxis.get_major_ticks(), *top.yaxis.get_minor_ticks()]
    lo, hi = top.get_ylim()
    boxes = [t.label1.get_window_extent() for t in ticks
             if t.label1.get_visible() and t.label1.get_text() and lo <= t.get_loc() <= hi]
    assert len(boxes) >= 2  # readable numbers on the axis
    for a, b in combinations(boxes, 2):
        assert a.y1 <= b.y0 or b.y1 <= a.y0, "two grad-norm tick labels overlap"


@pytest.mark.parametrize(("hours", "unit"), [(100 / 3600, "seconds"), (2.5 / 60, "minutes"), (1.5, "minutes"),
                                              (3.0, "hours"), (24.0, "hours")])
def test_the_throughput_time_axis_is_in_the_unit_that_fits_the_run(tmp_path, drawn, hours, unit):
    points = [(hours * i / 10, 5000.0) for i in range(11)]
    plots.throughput_curve(tmp_path / "t.png", [points], title="t")
    (fig,) = drawn
    ax = fig.axes[0]
    assert ax.get_xlabel() == f"wall-clock {unit} since the run began"
    factor = {"seconds": 3600, "minutes": 60, "hours": 1}[unit]
    assert max(ax.get_lines()[0].get_xdata()) == pytest.approx(hours * factor)
