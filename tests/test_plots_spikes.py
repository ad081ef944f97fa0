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


def test_the_loss_curve_draws_each_evals_forecast_and_the_last_one_with_its_interval(tmp_path, monkeypatch) -> None:
    drawn = {}
    real_save = plots._save

    def keep(fig, path):
        ax = fig.axes[0]
        drawn["lines"] = {line.get_label(): (list(line.get_xdata()), list(line.get_ydata())) for line in ax.get_lines()}
        drawn["legend"] = [t.get_text() for t in ax.get_legend().get_texts()]
        real_save(fig, path)

    monkeypatch.setattr(plots, "_save", keep)
    forecast = [{"step": 100, "value": 3.9, "low": 3.6, "high": 4.2},
                {"step": 200, "value": 3.6, "low": 3.45, "high": 3.75}]
    plots.loss_curve(tmp_path / "loss.png", [(s, 4.0 - s / 1000) for s in range(10, 210, 10)], [(100, 3.95), (200, 3.7)],
                     band=(3.2, 3.5), predicted=None, title="t", forecast=forecast)
    assert (tmp_path / "loss.png").stat().st_size > 0
    steps, values = drawn["lines"]["forecast of the final val loss, as made at each eval"]
    assert steps == [100, 200] and values == [3.9, 3.6]
    assert "its calibrated interval" in drawn["legend"]
    assert "last forecast: 3.600 [3.450, 3.750]" in drawn["legend"]
