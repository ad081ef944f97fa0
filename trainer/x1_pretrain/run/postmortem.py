"""`python -m x1_pretrain.postmortem --mlflow-uri U --output RUN_DIR/spike-postmortem.md`: a draft.

For every injected or detected loss spike of the run: its steps, the loss before / at its peak /
after, each flagged or injected step's own grad norm and whether clipping fired, the learning
rate, and how many steps the loss EMA took to come back within 2% of its pre-spike value; a
zoomed plot of each spike sits next to the file. The numbers are measured: where the run did not
log one, the line says "not measured" and draws no conclusion from its absence. The Cause,
Response and Lessons sections are prompts marked `TODO(person)` for the person who ran it: this
tool never writes a cause it cannot know.

Steps are MLflow's: they count completed optimizer steps, so the batches of step N (the lab's
`--inject-spike-at-step N`) are logged at MLflow step N+1.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from dataclasses import dataclass
from pathlib import Path

from x1_common.contracts import (
    MLFLOW_CLIPPED,
    MLFLOW_GRAD_NORM,
    MLFLOW_LOSS,
    MLFLOW_LR,
    MLFLOW_NONFINITE,
    MLFLOW_SPIKE,
    MLFLOW_SPIKE_INJECTED,
    MLFLOW_VAL_LOSS,
    ExitCode,
    format_utc,
    move_uri_credentials_to_env,
    utc_now,
)
from x1_common.fsutil import current_umask, write_text_atomic
from x1_pretrain.run import plots
from x1_pretrain.run.record import ExportError, RunRecord, Series, load_run, safe_uri
from x1_pretrain.train.spikes import SpikeDetector

RECOVERY_TOLERANCE = 0.02  # "back within 2% of the pre-spike EMA"
MAX_PLOTS = 20  # a run that flags dozens of spikes gets the first ones drawn, and says so
# The analysis's own constants when the run did not log them: the detector's defaults. They shape
# how this tool groups and smooths, never a measured fact about the run (the clip threshold is not
# among them: a clip decision needs the run's own).
DEFAULTS = {"train.spike_ema_beta": 0.98, "train.spike_factor": 1.5}
NOT_MEASURED = "not measured"


def loss_ema(loss: Series, beta: float) -> Series:
    """The EMA of the logged losses, each standing for the steps since the previous log
    (weight beta**gap), so its time constant in steps is the trainer detector's. Unlike the
    detector's EMA it takes the spike's own values in: it measures how long a spike weighs on
    the smoothed loss."""
    out: Series = []
    ema, prev = None, None
    for step, value in loss:
        if not math.isfinite(value):
            continue
        if ema is None or prev is None:
            ema = value
        else:
            w = beta ** max(step - prev, 1)
            ema = w * ema + (1 - w) * value
        out.append((step, ema))
        prev = step
    return out


@dataclass
class Spike:
    start: int  # first flagged MLflow step
    end: int  # last flagged MLflow step
    injected: list[int]
    detected: list[int]


def group_spikes(injected: list[int], detected: list[int], gap: int) -> list[Spike]:
    """Flags closer than `gap` steps belong to one spike (an injection spans 5 steps; the
    detector may flag several of them)."""
    spikes: list[Spike] = []
    for step in sorted(set(injected) | set(detected)):
        if spikes and step - spikes[-1].end <= gap:
            spikes[-1].end = step
        else:
            spikes.append(Spike(step, step, [], []))
        (spikes[-1].injected if step in injected else spikes[-1].detected).append(step)
        if step in injected and step in detected:
            spikes[-1].detected.append(step)
    return spikes


@dataclass
class StepEvidence:
    """What the run logged about one step of a spike; None where it logged nothing."""

    step: int
    role: str  # "injected", "flagged", "injected, flagged" or "log step"
    loss: float | None
    grad_norm: float | None  # before clipping
    clipped: bool | None  # None: not measured (no decision logged, and no grad norm and clip to derive it)
    clip_source: str  # how `clipped` is known
    nonfinite: bool


@dataclass
class SpikeFacts:
    spike: Spike
    covering: list[int]  # logged steps that fall in the spike (up to the first log at or after its end)
    loss_before: tuple[int, float] | None
    peak: tuple[int, float] | None
    loss_after: tuple[int, float] | None
    evidence: list[StepEvidence]  # every flagged, injected or covering log step
    lr: tuple[int, float] | None
    lr_note: str
    ema_before: tuple[int, float] | None
    recovered_at: int | None
    recovery_steps: int | None
    val_before: tuple[int, float] | None
    val_after: tuple[int, float] | None
    last_logged: int | None = None  # the run's last logged loss step


def _before(series: Series, step: int) -> tuple[int, float] | None:
    earlier = [(s, v) for s, v in series if s < step]
    return earlier[-1] if earlier else None


def losses(record: RunRecord) -> Series:
    """The logged losses, with the loss of every flagged or injected step between two log steps
    added (the trainer logs it as `spike_loss`): a spike's peak is rarely on a log step."""
    return _merged(record, MLFLOW_LOSS, "spike_loss")


def _merged(record: RunRecord, every_log: str, at_spikes: str) -> Series:
    merged = dict(record.get(at_spikes))
    merged.update(dict(record.get(every_log)))
    return sorted(merged.items())


def step_evidence(spike: Spike, record: RunRecord, clip: float | None, covering: list[int]) -> list[StepEvidence]:
    """The flagged and injected steps, and the log steps that cover the spike (up to the first log
    at or after its end: the loss a spike leaves may peak there)."""
    loss, grad = dict(losses(record)), dict(_merged(record, MLFLOW_GRAD_NORM, "spike_grad_norm"))
    decided = dict(_merged(record, MLFLOW_CLIPPED, "spike_clipped"))
    nonfinite = set(record.flagged(MLFLOW_NONFINITE))
    steps = sorted({*spike.injected, *spike.detected, *covering})
    out = []
    for step in steps:
        roles = [r for r, steps_of in (("injected", spike.injected), ("flagged", spike.detected)) if step in steps_of]
        norm = grad.get(step)
        if step in decided:
            clipped, source = decided[step] >= 0.5, "logged"
        elif norm is not None and clip is not None:
            clipped, source = norm > clip, f"grad norm vs clip {clip:g}"
        else:
            clipped, source = None, NOT_MEASURED
        out.append(StepEvidence(step, ", ".join(roles) or "log step", loss.get(step), norm, clipped, source,
                                step in nonfinite))
    return out


def analyse(spike: Spike, record: RunRecord, beta: float, clip: float | None = None) -> SpikeFacts:
    loss = losses(record)
    logged = [s for s, _ in loss]
    first_after_end = next((s for s in logged if s >= spike.end), None)
    last = first_after_end if first_after_end is not None else spike.end
    covering = [s for s in logged if spike.start <= s <= last]
    in_spike = [(s, v) for s, v in loss if s in covering and math.isfinite(v)]
    peak = max(in_spike, key=lambda p: p[1]) if in_spike else None
    after_from = max(covering) if covering else spike.end
    loss_after = next(((s, v) for s, v in loss if s > after_from), None)
    ema = loss_ema(loss, beta)
    ema_before = _before(ema, spike.start)
    recovered_at = None
    if ema_before is not None:
        line = ema_before[1] * (1 + RECOVERY_TOLERANCE)
        recovered_at = next((s for s, v in ema if s >= last and v <= line), None)
    lr_in_spike = [(s, v) for s, v in record.get(MLFLOW_LR) if s in covering]
    lr_before = _before(record.get(MLFLOW_LR), spike.start)
    lr_note = "" if lr_in_spike or not lr_before else "the last one logged before the spike"
    val = record.get(MLFLOW_VAL_LOSS)
    return SpikeFacts(
        spike=spike,
        covering=covering,
        loss_before=_before(loss, spike.start),
        peak=peak,
        loss_after=loss_after,
        evidence=step_evidence(spike, record, clip, covering),
        lr=lr_in_spike[0] if lr_in_spike else lr_before,
        lr_note=lr_note,
        ema_before=ema_before,
        recovered_at=recovered_at,
        recovery_steps=None if recovered_at is None else recovered_at - spike.start + 1,
        val_before=_before(val, spike.start),
        val_after=next(((s, v) for s, v in val if s > after_from), None),
        last_logged=logged[-1] if logged else None,
    )


# ---------------------------------------------------------------------------------------------
# The document


def _at(point: tuple[int, float] | None, fmt: str = ".4f") -> str:
    return NOT_MEASURED if point is None else f"{point[1]:{fmt}} (step {point[0]})"


def _steps(steps: list[int]) -> str:
    return ", ".join(str(s) for s in steps) if steps else "none"


def grad_summary(f: SpikeFacts, clip: float | None) -> str:
    measured = [e for e in f.evidence if e.grad_norm is not None]
    missing = [e.step for e in f.evidence if e.grad_norm is None]
    if not measured:
        return (f"{NOT_MEASURED}: no grad norm was logged at step(s) {_steps(missing)} (a trainer that logs it "
                "only at its log steps); no conclusion")
    top = max(measured, key=lambda e: e.grad_norm)  # type: ignore[arg-type, return-value]
    text = f"{top.grad_norm:.4g} at step {top.step}, the largest of {len(measured)} measured, before clipping"
    text += f" (threshold {clip:g})" if clip is not None else " (clip threshold not logged)"
    return text + (f"; {NOT_MEASURED} at step(s) {_steps(missing)}" if missing else "")


def clip_summary(f: SpikeFacts, clip: float | None) -> str:
    """Whether the clip caught the spike, from the steps where it is known; silent on the others."""
    fired = [e.step for e in f.evidence if e.clipped]
    held = [e.step for e in f.evidence if e.clipped is False]
    unknown = [e.step for e in f.evidence if e.clipped is None]
    unknown_note = f"; {NOT_MEASURED} at step(s) {_steps(unknown)}: no conclusion for those" if unknown else ""
    if fired:
        return f"yes: clipped at step(s) {_steps(fired)}" + unknown_note
    if held:
        bound = f"{clip:g}" if clip is not None else "the clip threshold"
        scope = "every step of the spike" if not unknown else "the measured step(s)"
        return f"no: the grad norm stayed within {bound} at {scope} ({_steps(held)})" + unknown_note
    return (f"{NOT_MEASURED}: no clip decision nor grad norm was logged at step(s) {_steps(unknown)}; no "
            "conclusion")


def evidence_table(f: SpikeFacts) -> list[str]:
    def num(v: float | None, fmt: str) -> str:
        return NOT_MEASURED if v is None else f"{v:{fmt}}"

    def decision(e: StepEvidence) -> str:
        if e.nonfinite:
            return "no optimizer step (non-finite loss or grad norm)"
        if e.clipped is None:
            return NOT_MEASURED
        return ("yes" if e.clipped else "no") + (f" ({e.clip_source})" if e.clip_source != "logged" else "")

    lines = ["| step | | loss | grad norm (before clip) | clipped |", "|---|---|---|---|---|"]
    lines += [f"| {e.step} | {e.role} | {num(e.loss, '.4f')} | {num(e.grad_norm, '.4g')} | {decision(e)} |"
              for e in f.evidence]
    return lines


def spike_section(n: int, f: SpikeFacts, clip: float | None, log_every: int | None, plot: str | None) -> list[str]:
    s = f.spike
    if s.injected:
        title = f"Spike {n}: injected at step {s.injected[0] - 1} (MLflow steps {s.injected[0]}–{s.injected[-1]})"
        kind = (f"injected: rare-token batches replaced steps {s.injected[0] - 1}..{s.injected[-1] - 1}; the detector "
                f"flagged MLflow step(s) {_steps(s.detected)}")
    else:
        title = f"Spike {n}: detected at step {s.start}" + (f"–{s.end}" if s.end != s.start else "")
        kind = f"detected (not injected): the detector flagged MLflow step(s) {_steps(s.detected)}"
    if f.ema_before is None:
        recovery = f"{NOT_MEASURED}: no loss was logged before the spike"
    elif f.recovered_at is None:
        recovery = (f"not recovered within the logged steps: the EMA stayed above {f.ema_before[1]:.4f} + 2% "
                    f"up to the last logged step ({f.last_logged})")
    else:
        recovery = (f"{f.recovery_steps} steps: the loss EMA was back within 2% of {f.ema_before[1]:.4f} at step "
                    f"{f.recovered_at}")
    lr = _at(f.lr, ".3e") + (f", {f.lr_note}" if f.lr_note else "")
    lines = [
        f"## {title}",
        "",
        "| | |",
        "|---|---|",
        f"| kind | {kind} |",
        f"| loss before | {_at(f.loss_before)} |",
        f"| peak loss | {_at(f.peak)} |",
        f"| loss after | {_at(f.loss_after)} |",
        f"| grad norm | {grad_summary(f, clip)} |",
        f"| clipping fired | {clip_summary(f, clip)} |",
        f"| learning rate | {lr} |",
        f"| loss EMA before | {_at(f.ema_before)} |",
        f"| recovery | {recovery} |",
        f"| val loss | {_at(f.val_before)} before, {_at(f.val_after)} after |",
        "",
        "Each step of the spike, as the run logged it:",
        "",
        *evidence_table(f),
        "",
    ]
    if plot:
        lines += [f"![loss and grad norm around step {s.start}]({plot})", ""]
    every = f"one every {log_every} steps" if log_every else "at the run's log steps"
    lines += [
        f"Losses are MLflow's logged values, {every}, plus the loss, grad norm and clip decision of every step "
        "the detector flagged or the injection replaced (`spike_loss`, `spike_grad_norm`, `spike_clipped`); "
        "the recovery count has the resolution of the logged steps.",
        "",
    ]
    return lines


def prompts(beta2: str, any_spike: bool) -> list[str]:
    """The person's sections: prompts only, never content."""
    if not any_spike:
        return [
            "## Cause", "",
            "> TODO(person): no spike was seen. Was that expected (was an injection planned, did the detector run "
            "with its usual threshold)? Did the loss come close anywhere?", "",
            "## Response", "",
            "> TODO(person): nothing to respond to, or something you did that kept the run calm (a lower learning "
            "rate, data filtering)?", "",
            "## Lessons", "",
            "> TODO(person): anything to change before the next run (inject a spike to test the response, a "
            "different detector threshold)?", "",
        ]
    return [
        "## Cause", "",
        "> TODO(person): what made the loss jump? For an injected spike: does the jump look like what rare-token "
        "batches should do? For a natural one: look at the data windows of those steps, the learning rate and the "
        "grad norm before it. Write what you checked, not only what you believe.", "",
        "## Response", "",
        f"> TODO(person): what did the run do by itself (gradient clipping, AdamW β2 = {beta2}) and what did you "
        "do (nothing, a restart from a checkpoint, a lower learning rate)? Was it enough, and how do the numbers "
        "above show it?", "",
        "## Lessons", "",
        "> TODO(person): what would you change before the next run (detector threshold, clip, learning rate, data "
        "filtering), and what did the spike cost in steps, hours and dollars?", "",
    ]


def _param(record: RunRecord, key: str, notes: list[str]) -> float:
    """One of the analysis's constants: the run's own, else the detector's default, said so."""
    value = _logged_param(record, key)
    if value is None:
        notes.append(f"MLflow params lack {key}: this analysis uses the detector's default {DEFAULTS[key]:g}")
        return DEFAULTS[key]
    return value


def _logged_param(record: RunRecord, key: str) -> float | None:
    try:
        return float(record.params[key])
    except (KeyError, ValueError):
        return None


def _log_every(record: RunRecord, notes: list[str]) -> int | None:
    """The run's log interval: its param, else the usual gap between its logged losses (said so)."""
    value = _logged_param(record, "train.log_every")
    if value is not None:
        return int(value)
    steps = [s for s, _ in record.get(MLFLOW_LOSS)]
    gaps = [b - a for a, b in zip(steps, steps[1:], strict=False)]
    if not gaps:
        notes.append(f"MLflow params lack train.log_every and the run logged too few losses to tell: {NOT_MEASURED}")
        return None
    usual = max(set(gaps), key=gaps.count)
    notes.append(f"MLflow params lack train.log_every: the logged losses are {usual} steps apart")
    return usual


def write_postmortem(record: RunRecord, output: Path) -> tuple[str, list[Path]]:
    """The markdown text and the plots written beside it."""
    notes: list[str] = []
    beta = _param(record, "train.spike_ema_beta", notes)
    factor = _param(record, "train.spike_factor", notes)
    log_every = _log_every(record, notes)
    clip = _logged_param(record, "optim.grad_clip")
    if clip is None:
        notes.append(f"MLflow params lack optim.grad_clip: the clip threshold is {NOT_MEASURED}; clip decisions come "
                     "only from the logged ones (`clipped`, `spike_clipped`)")
    injected, detected = record.flagged(MLFLOW_SPIKE_INJECTED), record.flagged(MLFLOW_SPIKE)
    skipped = record.flagged("spike_injection_skipped")
    spikes = group_spikes(injected, detected, gap=max(5, log_every or 0))
    note = record.tags.get("x1.spike_injection")
    history = SpikeDetector(factor=factor, beta=beta).min_observations

    if injected:
        injection = (f"`--inject-spike-at-step {injected[0] - 1}`: rare-token batches replaced steps "
                     f"{injected[0] - 1}..{injected[-1] - 1} (MLflow steps {injected[0]}–{injected[-1]}).")
    elif skipped:
        injection = (f"the injection at step {skipped[0]} was **skipped**: a natural spike came first, and this "
                     f"post-mortem is about it. The trainer said: \"{note or 'injection skipped'}\"")
    else:
        injection = "none logged (the run has no `spike_injected` metric: it ran without `--inject-spike-at-step`)."
    total = record.params.get("train.total_steps")
    planned = f"{total} steps planned" if total else f"steps planned {NOT_MEASURED} (no train.total_steps param)"
    every = f"metrics every {log_every} steps" if log_every else f"log interval {NOT_MEASURED}"
    clip_text = f"grad clip {clip:g}" if clip is not None else f"grad clip {NOT_MEASURED}"
    lines = [
        f"# Spike post-mortem: {record.run_name or record.run_id}",
        "",
        f"> Draft written by `python -m x1_pretrain.postmortem` on {format_utc(utc_now())} from MLflow run "
        f"`{record.run_id}` ({safe_uri(record.uri)}). The numbers are measured; the sections **Cause**, "
        "**Response** and **Lessons** are for the person who ran it: every `TODO(person)` is a prompt, not a finding.",
        "",
        f"- Run: config {record.tags.get('x1.config_name', record.params.get('name', NOT_MEASURED))}, {planned}, "
        f"last logged step {record.last_step}, {every}, {clip_text}.",
        f"- Detector: a loss over {factor:g} × its EMA (β {beta:g}) after {history} steps of history is logged as "
        "`spike`.",
        f"- Injection: {injection}",
        "- Steps are MLflow's: they count completed steps, so the batches of step N are logged at step N+1.",
        f"- Recovery: steps from the spike's first step until the loss EMA (rebuilt from the logged losses with "
        f"β {beta:g}, spike values included) is back within 2% of its value just before the spike.",
        *[f"- Note: {n}" for n in notes],
        "",
    ]
    written: list[Path] = []
    if not spikes:
        lines += [
            "## No spike was seen",
            "",
            "The run logged no detector flag (`spike`) and no injected batch (`spike_injected`): there is no spike "
            "to take apart. "
            + ("The injection was skipped (see above), yet no spike was logged: check the trainer's log. "
               if skipped else "")
            + "This file still answers check 5 of the definition of done; say below whether that was expected.",
            "",
        ]
    loss = losses(record)
    first, last_step = (loss[0][0], loss[-1][0]) if loss else (0, record.last_step)
    for n, spike in enumerate(spikes, 1):
        facts = analyse(spike, record, beta, clip)
        plot_name = None
        if n <= MAX_PLOTS:
            plot_path = output.with_name(f"{output.stem}-step-{spike.start}.png")
            margin = 10 * (log_every or 10)
            right = max(spike.end, facts.recovered_at or spike.end) + margin
            line = None if facts.ema_before is None else facts.ema_before[1] * (1 + RECOVERY_TOLERANCE)
            plots.spike_zoom(
                plot_path, loss=loss, ema=loss_ema(loss, beta), grad_norm=_merged(record, MLFLOW_GRAD_NORM, "spike_grad_norm"),
                val=record.get(MLFLOW_VAL_LOSS), window=(max(first, spike.start - margin), min(last_step, right)),
                injection=(spike.injected[0], spike.injected[-1]) if spike.injected else None,
                detected=spike.detected, recovery_line=line, recovered_at=facts.recovered_at, clip=clip,
                clipped_steps=[e.step for e in facts.evidence if e.clipped], title=f"{record.run_name or record.run_id[:8]}: spike at step {spike.start}",
            )
            written.append(plot_path)
            plot_name = plot_path.name
        lines += spike_section(n, facts, clip, log_every, plot_name)
    if len(spikes) > MAX_PLOTS:
        lines += [f"Only the first {MAX_PLOTS} of {len(spikes)} spikes have a plot.", ""]
    lines += prompts(record.params.get("optim.beta2", "?"), bool(spikes))
    return "\n".join(lines), written


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m x1_pretrain.postmortem",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description=__doc__.split("\n\n", 1)[1],
        epilog="Exit codes: 0 written; 2 bad input (no such run, tracking store unreachable, output exists "
               "without --force).",
    )
    p.add_argument("--mlflow-uri", required=True, help="tracking URI: sqlite:///..., http://host:5000 or file:///...")
    p.add_argument("--run-id", help="MLflow run id (default: the newest run the trainer logged)")
    p.add_argument("--experiment", help="look for the newest run only in this experiment (default: all)")
    p.add_argument("--output", required=True, metavar="FILE",
                   help="the markdown file, e.g. RUN_DIR/spike-postmortem.md; plots go beside it")
    p.add_argument("--force", action="store_true",
                   help="overwrite an existing post-mortem (it may hold what a person wrote: off by default)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    output = Path(args.output)
    try:
        # user:password in the URI go to MLflow's own variables: never into a message or a file
        args.mlflow_uri = move_uri_credentials_to_env(args.mlflow_uri, "MLFLOW_TRACKING_USERNAME",
                                                      "MLFLOW_TRACKING_PASSWORD", "--mlflow-uri")
        if output.exists() and not args.force:
            raise ExportError(f"--output {output} exists (it may hold what a person wrote): pass --force to replace it")
        if output.suffix.lower() != ".md":
            raise ExportError(f"--output {output}: expected a .md file")
        if not output.parent.is_dir():
            raise ExportError(f"--output {output}: folder {output.parent} does not exist (run export_run first)")
        record = load_run(args.mlflow_uri, args.run_id, args.experiment)
    except (ExportError, ValueError) as e:
        print(f"postmortem: error: {e}", file=sys.stderr)
        return int(ExitCode.USAGE)
    text, plots_written = write_postmortem(record, output)
    write_text_atomic(output, text)  # after the plots: the file never points at a missing picture
    umask = current_umask(output.parent)
    for path in (output, *plots_written):
        os.chmod(path, 0o666 & ~umask)  # for reading, like every file a person gets from us
    print(f"wrote {output}" + (f" and {', '.join(p.name for p in plots_written)}" if plots_written else "")
          + ": fill in the TODO(person) prompts")
    return 0


if __name__ == "__main__":
    sys.exit(main())
