"""`ladder report`: ladder.png (each size's final val loss against tokens, the fitted law through
them, the target's prediction with its interval) and ladder.md (the same in words and a table)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from x1_common.fsutil import write_bytes_atomic
from x1_common.scaling import N_TOTAL, Law, law_of
from x1_pretrain.train.accounting import fmt_count


def _n(rung: dict[str, Any], convention: str) -> float:
    return float(rung["n_params"] if convention == N_TOTAL else rung["n_params_nonembedding"])


def _usable(r: Any) -> bool:
    return isinstance(r, dict) and not r.get("diverged") and isinstance(r.get("final_val_loss"), (int, float))


def draw(ladder: dict[str, Any], path: Path) -> None:
    import io

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    law: Law = law_of(ladder)
    conv = ladder["fit"]["n_convention"]
    rungs = [r for r in ladder["rungs"] if _usable(r)]
    sizes = sorted({r["n_params"] for r in rungs})
    pred = ladder.get("prediction")
    fig, ax = plt.subplots(figsize=(8.5, 5.2))
    cmap = plt.get_cmap("viridis")
    t_min = min(r["tokens"] for r in rungs)
    t_max = max([r["tokens"] for r in rungs] + ([pred["tokens"]] if pred else []))
    xs = [t_min * 0.7 * (t_max * 1.4 / (t_min * 0.7)) ** (i / 99) for i in range(100)]
    for i, n in enumerate(sizes):
        color = cmap(i / max(1, len(sizes)))
        pts = sorted((r["tokens"], r["final_val_loss"]) for r in rungs if r["n_params"] == n)
        n_law = _n(next(r for r in rungs if r["n_params"] == n), conv)
        ax.plot(xs, [law.loss(n_law, x) for x in xs], color=color, lw=1, alpha=0.8)
        ax.scatter([p[0] for p in pts], [p[1] for p in pts], color=color, s=28, zorder=3,
                   label=f"{fmt_count(n)} parameters")
    for r in ladder["rungs"]:
        if isinstance(r, dict) and r.get("diverged") and isinstance(r.get("final_val_loss"), (int, float)):
            ax.scatter([r["tokens"]], [r["final_val_loss"]], marker="x", color="red", zorder=3)
    held = ladder.get("heldout_check", {}).get("errors", [])
    if held:
        ax.scatter([e["tokens"] for e in held], [e["predicted"] for e in held], marker="_", s=200, color="black",
                   zorder=4, label="largest size, predicted without it")
    if pred:
        n_t = pred["n_params"]
        ax.errorbar([pred["tokens"]], [pred["val_loss"]],
                    yerr=[[pred["val_loss"] - pred["low"]], [pred["high"] - pred["val_loss"]]], fmt="*", ms=12,
                    color="crimson", capsize=5, zorder=5,
                    label=f"target {fmt_count(n_t)}: {pred['val_loss']:.3f} [{pred['low']:.3f}, {pred['high']:.3f}]")
    ax.set_xscale("log")
    ax.set_xlabel("training tokens")
    ax.set_ylabel("final val loss (nats/token)")
    f = ladder["fit"]
    ax.set_title(f"L = {f['E']:.3f} + {f['A']:.3g}/N^{f['alpha']:.3f} + {f['B']:.3g}/D^{f['beta']:.3f}  (N: {conv})",
                 fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, frameon=False)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110)
    plt.close(fig)
    write_bytes_atomic(path, buf.getvalue())


def markdown(ladder: dict[str, Any]) -> str:
    f, tol, chk = ladder["fit"], ladder["tolerance"], ladder["heldout_check"]
    conv = f["n_convention"]
    law = law_of(ladder)
    lines = ["# Scaling ladder", "",
             f"Law: L(N, D) = {f['E']:.4f} + {f['A']:.5g} / N^{f['alpha']:.4f} + {f['B']:.5g} / D^{f['beta']:.4f}, "
             f"N counting {conv} parameters, fitted on {f['points']} rungs ({f['method']}).", ""]
    for c, v in ladder.get("conventions", {}).items():
        lines.append(f"- N as {c} parameters: the fit without the largest size misses it by "
                     f"{v['heldout_max_abs_error']:.4f} nats" + (" (kept)" if c == conv else ""))
    lines += ["", f"Tolerance: {tol['heldout_error']:.4f} nats, the largest miss of the fit without the largest size "
              f"on that size's rungs, an extrapolation over {chk['reach']:.2f} decades of compute; a target farther out "
              "gets it scaled by its own distance over that.", ""]
    p = ladder.get("prediction")
    if p:
        lines += [f"Prediction for the run ({fmt_count(p['n_params'])} parameters, {fmt_count(p['tokens'])} tokens): "
                  f"**{p['val_loss']:.3f}** in [{p['low']:.3f}, {p['high']:.3f}] (tolerance {p['tolerance']:.3f})."
                  + (f" {p['note']}." if p.get("note") else ""), ""]
    lines += ["| rung | parameters | tokens | final val loss | the law | error |", "|---|---|---|---|---|---|"]
    for r in ladder["rungs"]:
        if not _usable(r):
            continue
        fitted = law.loss(_n(r, conv), r["tokens"])
        lines.append(f"| {r.get('name', '')} | {fmt_count(r['n_params'])} | {fmt_count(r['tokens'])} | "
                     f"{r['final_val_loss']:.4f} | {fitted:.4f} | {fitted - r['final_val_loss']:+.4f} |")
    if ladder.get("left_out"):
        lines += ["", "Left out of the fit:", *[f"- {x}" for x in ladder["left_out"]]]
    sweep = ladder.get("lr_sweep") or []
    if sweep:
        lines += ["", "Learning-rate check on the smallest size (the rule's lr times the factor):", ""]
        same = [r for r in ladder["rungs"] if _usable(r) and sweep and r.get("n_params") == sweep[0].get("n_params")
                and r.get("tokens") == sweep[0].get("tokens")]
        rows = [(1.0, s["final_val_loss"]) for s in same] + [(s.get("lr_scale"), s.get("final_val_loss")) for s in sweep]
        for scale, loss in sorted(rows, key=lambda x: x[0] or 0):
            lines.append(f"- x{scale:g}: " + (f"{loss:.4f}" if isinstance(loss, (int, float)) and math.isfinite(loss)
                                              else "no final loss"))
    for note in ladder.get("notes", []):
        lines += ["", f"Note: {note}"]
    return "\n".join(lines) + "\n"


def write_report(ladder: dict[str, Any], out: Path) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    png, md = out / "ladder.png", out / "ladder.md"
    draw(ladder, png)
    write_bytes_atomic(md, markdown(ladder).encode())
    return [png, md]
