"""gradnorm-curve.png shows the grad norm of every injected or flagged spike step, not only the
log steps' (every 10th): the spike's own norm is what the post-mortem reads."""

from __future__ import annotations

from x1_pretrain.run import plots


def test_gradnorm_curve_includes_injected_and_flagged_spike_steps_grad_norms(tmp_path, monkeypatch) -> None:
    drawn = []
    real_save = plots._save

    def keep(fig, path):
        drawn.append([(list(line.get_xdata()), list(line.get_ydata())) for line in fig.axes[0].get_lines()])
        real_save(fig, path)

    monkeypatch.setattr(plots, "_save", keep)
    log_steps = [(s, 0.8) for s in range(10, 110, 10)]
    spikes = [(43, 17.5), (44, 9.0)]  # between log steps
    plots.gradnorm_curve(tmp_path / "g.png", log_steps, [(s, 50.0) for s, _ in log_steps], clip=1.0, title="t",
                         injection=(43, 47), spikes=spikes)
    assert (tmp_path / "g.png").stat().st_size > 0
    [lines] = drawn
    ys = [y for _, line_y in lines for y in line_y]
    assert 17.5 in ys and 9.0 in ys
    curve_x = max((x for x, _ in lines), key=len)
    assert curve_x == sorted(curve_x) and 43 in curve_x  # one curve through the spike, in step order
