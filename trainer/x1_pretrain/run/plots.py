"""The run folder's figures: loss curve, grad/param norm, throughput, and a spike's close-up.

Used by `export_run` and `postmortem`. Every function takes plain (step, value) series, draws
with matplotlib's Agg backend (no display needed on a GPU host) and writes one PNG atomically,
so a figure in the run folder is either complete or absent.
"""

from __future__ import annotations

import io
import os
from collections.abc import Sequence
from dataclasses import dataclass

import matplotlib

matplotlib.use("Agg")  # before pyplot: a headless host has no display

import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter  # noqa: E402

from x1_common.fsutil import write_bytes_atomic  # noqa: E402
from x1_pretrain.config import ModelConfig  # noqa: E402

Series = Sequence[tuple[int, float]]  # (step, value), ascending steps

DPI = 110


@dataclass(frozen=True)
class LabPoint:
    """One row of the lab's "expected loss curve" table (50M config, 1x A100, ~24 h)."""

    hour: float
    step: int
    tokens: float
    train_loss: float
    val_loss: float | None


LAB_EXPECTED = (
    LabPoint(0, 0, 0.0, 10.8, None),
    LabPoint(1, 3_500, 1.8e9, 5.1, 5.2),
    LabPoint(6, 21_000, 11e9, 3.9, 3.95),
    LabPoint(12, 42_000, 21e9, 3.5, 3.55),
    LabPoint(18, 63_000, 32e9, 3.4, 3.42),
    LabPoint(24, 84_000, 43e9, 3.32, 3.35),
)


# The lab's model: its expected curve (LAB_EXPECTED) is drawn only on a run of this model.
LAB_MODEL_FIELDS = ("n_layer", "d_model", "n_head", "n_kv_head", "d_ff", "seq_len", "vocab_size")


def is_lab_model(model: dict | None) -> bool:
    """True when `model` (a resolved config's `model` section) is the lab's 50M model."""
    lab = ModelConfig()
    return isinstance(model, dict) and all(model.get(k) == getattr(lab, k) for k in LAB_MODEL_FIELDS)


def legend_outside(ax: plt.Axes, handles: list | None = None, labels: list | None = None) -> None:
    """The legend beside the axes, right of them, never over a curve or a spike's marker (the
    figure grows to hold it: _save crops to what is drawn)."""
    if handles is None:
        handles, labels = ax.get_legend_handles_labels()
    if handles:
        ax.legend(handles, labels, fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0)


def log_ticks(ax: plt.Axes, values: Sequence[float]) -> None:
    """A log y axis whose labels do not crowd: plain numbers (0.5, not 5x10^-1) at the decades,
    and at 2 and 5 within them only while the data spans less than two decades."""
    plain = FuncFormatter(lambda v, _: f"{v:g}")
    ax.set_yscale("log")
    ax.yaxis.set_major_locator(LogLocator(base=10))
    ax.yaxis.set_major_formatter(plain)
    positive = [v for v in values if v > 0]
    if positive and max(positive) / min(positive) < 100:
        ax.yaxis.set_minor_locator(LogLocator(base=10, subs=(2.0, 5.0)))
        ax.yaxis.set_minor_formatter(plain)
    else:
        ax.yaxis.set_minor_formatter(NullFormatter())


def time_unit(hours: float) -> tuple[float, str]:
    """(factor from hours, unit) for an axis spanning `hours`: seconds under 2 minutes, minutes
    under 2 hours, hours beyond; a 2-minute demo is not drawn in hundredths of an hour."""
    if hours < 2 / 60:
        return 3600.0, "seconds"
    if hours < 2:
        return 60.0, "minutes"
    return 1.0, "hours"


def _save(fig: plt.Figure, path: str | os.PathLike[str]) -> None:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=DPI, bbox_inches="tight")
    plt.close(fig)
    write_bytes_atomic(path, buf.getvalue(), durable=False)


def _xy(series: Series) -> tuple[list[int], list[float]]:
    return [s for s, _ in series], [v for _, v in series]


def _shade_window(ax: plt.Axes, window: tuple[int, int] | None, label: str | None) -> None:
    if window is not None:
        ax.axvspan(window[0] - 0.5, window[1] + 0.5, color="tab:orange", alpha=0.18, label=label, lw=0)


def loss_curve(
    path: str | os.PathLike[str],
    train: Series,
    val: Series,
    *,
    band: tuple[float, float],
    predicted: float | None,
    title: str,
    injection: tuple[int, int] | None = None,
    spikes: Series = (),
    forecast: Sequence[dict[str, float]] = (),
    lab_expected: bool = True,
    band_label: str = "",
    ladder_prediction: float | None = None,
) -> None:
    """Train and val loss vs step, the lab's expected points where the steps overlap (only on a
    run of the lab's model: `lab_expected`), the band the run declared shaded (`band_label` says
    whose), and a scaling ladder's prediction where the band is the ladder's."""
    fig, ax = plt.subplots(figsize=(9, 5))
    if train:
        ax.plot(*_xy(train), color="tab:blue", lw=1.2, label="train loss")
    if spikes:  # flagged steps fall between log steps: their own losses, or the spike stays invisible
        ax.plot(*_xy(spikes), "x", color="tab:red", ms=7, mew=1.5, label="loss at a detected spike")
    if val:
        ax.plot(*_xy(val), "o-", color="tab:green", ms=4, lw=1.2, label="val loss")
    last_step = max([s for s, _ in train] + [s for s, _ in val] + [0])
    lab = [p for p in LAB_EXPECTED if p.step <= last_step] if lab_expected else []
    if lab:
        # The lab's table is for the 50M run: on a short or tiny run only its first rows overlap.
        ax.plot([p.step for p in lab], [p.train_loss for p in lab], "x", color="black", ms=8, mew=2,
                label="the lab's expectation for the 50M run: train")
        lab_val = [p for p in lab if p.val_loss is not None]
        if lab_val:
            ax.plot([p.step for p in lab_val], [p.val_loss for p in lab_val], "o", mfc="none", color="black",
                    ms=8, label="the lab's expectation for the 50M run: val")
    ax.axhspan(band[0], band[1], color="tab:green", alpha=0.12, lw=0,
               label=f"final val loss band [{band[0]:.2f}, {band[1]:.2f}]" + (f" ({band_label})" if band_label else ""))
    if ladder_prediction is not None:
        ax.axhline(ladder_prediction, color="tab:green", ls="-.", lw=1.2,
                   label=f"the scaling ladder's prediction: {ladder_prediction:.3f}")
    if predicted is not None:
        label = f"Chinchilla fit at the run's tokens: {predicted:.2f} (other corpus and tokenizer)"
        top = max([v for _, v in train] + [v for _, v in val] + [band[1]])
        if predicted <= 1.2 * top:
            ax.axhline(predicted, color="tab:purple", ls="--", lw=1, label=label)
        else:  # a tiny run's prediction is far above its curve: say it, do not squash the curve for it
            ax.plot([], [], " ", label=label + ", off the chart")
    if forecast:  # each eval's forecast of the final val loss, drawn at the step it was made
        steps = [h["step"] for h in forecast]
        ax.plot(steps, [h["value"] for h in forecast], "--", color="tab:red", lw=1,
                label="forecast of the final val loss, as made at each eval")
        ax.fill_between(steps, [h["low"] for h in forecast], [h["high"] for h in forecast], color="tab:red",
                        alpha=0.12, lw=0, label="its calibrated interval")
        last = forecast[-1]
        ax.errorbar([last["step"]], [last["value"]], yerr=[[last["value"] - last["low"]], [last["high"] - last["value"]]],
                    fmt="D", color="tab:red", ms=5, capsize=3,
                    label=f"last forecast: {last['value']:.3f} [{last['low']:.3f}, {last['high']:.3f}]")
    _shade_window(ax, injection, "injected spike")
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats/token)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    legend_outside(ax)
    _save(fig, path)


def gradnorm_curve(
    path: str | os.PathLike[str],
    grad_norm: Series,
    param_norm: Series,
    *,
    clip: float | None,
    title: str,
    injection: tuple[int, int] | None = None,
    spikes: Series = (),
) -> None:
    """Grad norm (before clipping, log scale, the clip threshold drawn) above param norm. `spikes`:
    the grad norms of the injected and flagged steps, logged at the step itself; the log steps
    (every log_every) rarely fall on them, so without these the spike would not show."""
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(9, 6), sharex=True)
    if spikes:
        top.plot(*_xy(spikes), "x", color="black", ms=7, mew=1.5, label="grad norm at an injected or flagged step")
    if grad_norm or spikes:
        top.plot(*_xy(sorted([*grad_norm, *spikes])), color="tab:red", lw=1)
        if all(v > 0 for _, v in [*grad_norm, *spikes]):
            log_ticks(top, [v for _, v in [*grad_norm, *spikes]])  # a spike can be 100x the usual norm
    if clip is not None:
        top.axhline(clip, color="black", ls="--", lw=1, label=f"clip threshold {clip:g}")
    legend_outside(top)
    _shade_window(top, injection, None)
    top.set_ylabel("grad norm (before clip)")
    top.grid(alpha=0.3)
    top.set_title(title)
    if param_norm:
        bottom.plot(*_xy(param_norm), color="tab:blue", lw=1)
    _shade_window(bottom, injection, None)
    bottom.set_ylabel("param norm")
    bottom.set_xlabel("step")
    bottom.grid(alpha=0.3)
    _save(fig, path)


def _joined(segments: Sequence[Sequence[tuple[float, float]]]) -> tuple[list[float], list[float]]:
    """One x/y pair of lists, a NaN between segments: matplotlib draws no line across a NaN."""
    xs: list[float] = []
    ys: list[float] = []
    for i, seg in enumerate(segments):
        if i:
            xs.append(float("nan"))
            ys.append(float("nan"))
        xs += [h for h, _ in seg]
        ys += [v for _, v in seg]
    return xs, ys


def throughput_curve(
    path: str | os.PathLike[str],
    segments: Sequence[Sequence[tuple[float, float]]],
    *,
    gaps: Sequence[tuple[float, float, str]] = (),
    mfu: Sequence[Sequence[tuple[float, float]]] = (),
    title: str,
) -> None:
    """Tokens/s against wall-clock time since the run began (`segments`, `gaps` and `mfu` in hours;
    drawn in the unit that fits the run's length), one line per trainer process: a restart is a gap,
    shaded and labelled with its downtime, never a line drawn through it."""
    span = max([h for seg in [*segments, *mfu] for h, _ in seg] + [h1 for _, h1, _ in gaps] + [0.0])
    factor, unit = time_unit(span)

    def scaled(segs: Sequence[Sequence[tuple[float, float]]]) -> list[list[tuple[float, float]]]:
        return [[(h * factor, v) for h, v in seg] for seg in segs]

    fig, ax = plt.subplots(figsize=(9, 4.5))
    if any(segments):
        ax.plot(*_joined(scaled(segments)), color="tab:blue", lw=1,
                marker="." if max(map(len, segments)) < 30 else None, label="tokens/s")
    for h0, h1, label in gaps:
        ax.axvspan(h0 * factor, h1 * factor, color="tab:red", alpha=0.15, lw=0, label=label)
    ax.set_xlabel(f"wall-clock {unit} since the run began")
    ax.set_ylabel("tokens/s")
    ax.grid(alpha=0.3)
    ax.set_title(title)
    handles, labels = ax.get_legend_handles_labels()
    if any(v > 0 for seg in mfu for _, v in seg):  # on CPU the MFU is 0: no second axis for a flat line
        right = ax.twinx()
        right.plot(*_joined(scaled(mfu)), color="tab:gray", lw=0.8, alpha=0.7, label="MFU")
        right.set_ylabel("MFU")
        h2, l2 = right.get_legend_handles_labels()
        handles, labels = handles + h2, labels + l2
        # beyond the MFU axis's labels
        if handles:
            ax.legend(handles, labels, fontsize=8, loc="upper left", bbox_to_anchor=(1.12, 1.0), borderaxespad=0.0)
    else:
        legend_outside(ax, handles, labels)
    _save(fig, path)


def spike_zoom(
    path: str | os.PathLike[str],
    *,
    loss: Series,
    ema: Series,
    grad_norm: Series,
    val: Series,
    window: tuple[int, int],
    injection: tuple[int, int] | None,
    detected: Sequence[int],
    recovery_line: float | None,
    recovered_at: int | None,
    clip: float | None,
    clipped_steps: Sequence[int],
    title: str,
) -> None:
    """Loss (with the EMA the recovery is measured on) and grad norm around one spike."""
    lo, hi = window

    def inside(series: Series) -> Series:
        return [(s, v) for s, v in series if lo <= s <= hi]

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(9, 6), sharex=True)
    if inside(loss):
        top.plot(*_xy(inside(loss)), "o-", color="tab:blue", ms=3, lw=1, label="train loss (logged steps)")
    if inside(ema):
        top.plot(*_xy(inside(ema)), color="tab:purple", lw=1.2, label="loss EMA")
    if inside(val):
        top.plot(*_xy(inside(val)), "s", color="tab:green", ms=5, label="val loss")
    if recovery_line is not None:
        top.axhline(recovery_line, color="tab:purple", ls=":", lw=1, label="pre-spike EMA + 2%")
    if recovered_at is not None:
        top.axvline(recovered_at, color="tab:green", ls="--", lw=1, label=f"recovered (step {recovered_at})")
    for i, s in enumerate(detected):
        top.axvline(s, color="tab:red", lw=0.8, alpha=0.6, label="detector flag" if i == 0 else None)
    _shade_window(top, injection, "injected batches")
    top.set_ylabel("loss (nats/token)")
    top.set_title(title)
    top.grid(alpha=0.3)
    legend_outside(top)
    if inside(grad_norm):
        bottom.plot(*_xy(inside(grad_norm)), "o-", color="tab:red", ms=3, lw=1, label="grad norm (before clip)")
    clipped_set = set(clipped_steps)
    clipped = [(s, v) for s, v in inside(grad_norm) if s in clipped_set]
    if clipped:
        bottom.plot(*_xy(clipped), "o", mfc="none", mec="black", ms=7, label="clipped")
    if clip is not None:
        bottom.axhline(clip, color="black", ls="--", lw=1, label=f"clip threshold {clip:g}")
    _shade_window(bottom, injection, None)
    bottom.set_ylabel("grad norm")
    bottom.set_xlabel("step")
    bottom.set_xlim(lo - 0.5, hi + 0.5)
    bottom.grid(alpha=0.3)
    legend_outside(bottom)
    _save(fig, path)
