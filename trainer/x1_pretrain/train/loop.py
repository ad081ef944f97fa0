"""The training loop of `python -m x1_pretrain.train --config configs/x1-50m-a100.yaml ...`
(docs/DESIGN.md §3, §5), and the step.

The loop is `train_loop` below, in the order you would check it at hour 14: learning rate →
forward/backward over the micro-batches → clip → optimizer step → log → eval (and, at a few
shares of the run, a cooldown probe: train/probes.py) → checkpoint → budget → stop. Everything
else is a component built by `setup` (setup.py: data, model, checkpointer, metrics, budget guard;
components.py: what they are); on ranks other than 0 the logging components are no-op objects.
resume.py says where a restarted run picks up, parser.py reads the command line and main.py runs
it all.

Exit codes are the contract with the watchdog (x1_common.contracts.ExitCode): 0 finished, 75
preempted (checkpoint written), 76 budget projection over the cap (checkpoint written), 77 spent
over the cap (no write), 78 launch refused, 79 diverged, 80 the final-loss forecast outside its band
with --stop-when-forecast-misses-band (checkpoint written), 2 bad config or data.
"""

from __future__ import annotations

import logging
import math
import time
from pathlib import Path
from typing import Any

import torch

from x1_common.contracts import (
    END_REASONS,
    MLFLOW_NONFINITE,
    MLFLOW_SPIKE_INJECTED,
    MLFLOW_VAL_LOSS,
    PHASE_CHECKPOINTING,
    PHASE_FINISHED,
    PHASE_STOPPED,
    PHASE_TRAINING,
    ExitCode,
)
from x1_pretrain.checkpoint.store import CheckpointError, capture_rng
from x1_pretrain.data.loader import split_window
from x1_pretrain.train import distributed as D
from x1_pretrain.train.components import Run, log_budget, log_first_step, log_spike_step, log_step
from x1_pretrain.train.resume import write_budget_stop
from x1_pretrain.train.schedule import lr_at

log = logging.getLogger("x1.train")


# MLflow statuses per exit: a stop on purpose is KILLED, a failure FAILED.
MLFLOW_STATUS = {ExitCode.FINISHED: "FINISHED", ExitCode.PREEMPTED: "KILLED", ExitCode.BUDGET_PROJECTED: "KILLED",
                 ExitCode.BUDGET_SPENT: "KILLED", ExitCode.DIVERGED: "FAILED", ExitCode.FORECAST_STOP: "KILLED"}


# ---------------------------------------------------------------------------------------------
# The loop


def train_loop(run: Run) -> int:
    cfg, total = run.cfg, run.cfg.train.total_steps
    step = run.state.step
    while step < total:
        # 1. learning rate
        lr = lr_at(step, cfg.optim, total, run.state.replans[-1] if run.state.replans else None)
        for group in run.optimizer.param_groups:
            group["lr"] = lr
        if (note := run.injector.announcement(step, run.detector)) is not None:
            log.warning(note)
            run.sink.tags({"x1.spike_injection": note})
            run.sink.log(step, {"spike_injection_skipped": float(run.injector.natural_spike_before(run.detector) is not None)})

        # 2. forward/backward over the micro-batches (gradients averaged over the whole step)
        injected = run.injector.active(step, run.detector)
        loss, interrupted = accumulate(run, step)
        if interrupted:  # SIGTERM mid-step: drop the partial gradients, keep the last full step
            return stop_run(run, step, ExitCode.PREEMPTED, "preempted")

        # 3. clip (the norm is taken before clipping, so a spike shows in the log)
        grad_norm = torch.nn.utils.clip_grad_norm_(run.raw_model.parameters(), cfg.optim.grad_clip)
        if hasattr(grad_norm, "full_tensor"):  # FSDP2: a DTensor
            grad_norm = grad_norm.full_tensor()

        # 4. optimizer step, unless the loss or the gradient is not finite
        loss_v, grad_norm_v, finite = step_unless_nonfinite(run.optimizer, run.dist, loss, grad_norm)
        if finite:
            run.state.nonfinite_in_row = 0
        else:
            run.state.nonfinite_in_row += 1
            log.warning("step %d: non-finite loss %s / grad norm %s: optimizer step skipped (%d in a row)",
                        step, loss_v, grad_norm_v, run.state.nonfinite_in_row)
            run.sink.log(step, {MLFLOW_NONFINITE: 1.0})
        # Under CUDA graphs the gradients stay allocated: the first backward of a step would
        # otherwise take the graph's output buffer as .grad, which the next replay overwrites.
        run.optimizer.zero_grad(set_to_none=not run.cudagraphs)
        step += 1
        run.state.step = step
        run.state.tokens_seen += cfg.train.tokens_per_step
        run.throughput.add(cfg.train.tokens_per_step)
        if run.state.nonfinite_in_row >= cfg.train.max_nonfinite_in_row:
            return diverged(run, step)
        flagged = finite and run.detector.update(step, loss_v)
        run.forecast.observe(step, loss_v, flagged or injected)  # flagged steps stay out of its fit
        if flagged or injected:  # the post-mortem's evidence, at the step itself
            log_spike_step(run, step, loss_v, grad_norm_v, flagged)
        if not run.first_step_logged:
            log_first_step(run, step)

        # 5. log
        if step % cfg.train.log_every == 0 or step == total:
            log_step(run, step, loss_v, grad_norm_v, lr)

        # 6. eval on the fixed val windows, and the final val loss the curve so far points to
        forecast_code = 0
        if step % cfg.train.eval_every == 0 or step == total:
            with run.throughput.pause("eval"):
                forecast_code = D.agree(run.dist, judge_forecast(run, step, evaluate(run, step)))
        run.probes.maybe_run(run, step)  # a short cooldown forked from here, evaluated, dropped: the run unchanged

        # 7. checkpoint
        if step % cfg.checkpoint.every == 0 or step == total:
            with run.throughput.pause("checkpoint"):
                save_checkpoint(run, step)

        if forecast_code and step < total:  # asked for with --stop-when-forecast-misses-band
            return stop_run(run, step, ExitCode.FORECAST_STOP, run.forecast.last_alert)

        # 8. budget: spent, and what the steps left need at the run's measured pace (rank 0 reads
        # and logs its decision; it reaches every rank through `agree`)
        budget = run.guard.maybe_check(step)
        if budget.checked:
            log_budget(run, step, budget.projection)

        # 9. stop?
        code = D.agree(run.dist, run.stop.code, budget.exit_code or 0)
        if code:
            if code == budget.exit_code == ExitCode.BUDGET_PROJECTED and run.dist.is_main:
                write_budget_stop(Path(cfg.checkpoint.dir), step, total, budget.fits_steps, budget.reason,
                                  run.state.config_hash)
            return stop_run(run, step, ExitCode(code), budget.reason if budget.exit_code == code else "preempted")
    return finish(run, step)


def step_unless_nonfinite(optimizer: torch.optim.Optimizer, dist: D.Dist, loss: torch.Tensor,
                          grad_norm: torch.Tensor) -> tuple[float, float, bool]:
    """The optimizer's step unless the loss or the gradient norm is not finite: (loss, grad norm,
    whether it stepped), read back in the loop's one CPU-GPU sync per step.

    Fused AdamW can be told on the device to skip (`found_inf`, as a GradScaler tells it). Then the
    two numbers are copied out and the step queued before the CPU waits, and it waits for the copy
    alone: the GPU runs the step while the CPU does the step's bookkeeping. Ranks of a group agree
    on the CPU first, so there the step waits for the sync."""
    vals = torch.stack([loss, grad_norm.float()])
    on_device = bool(optimizer.defaults.get("fused")) and not dist.enabled
    if on_device:
        optimizer.found_inf = (~torch.isfinite(vals)).any().float()
        host = torch.empty(2, pin_memory=vals.is_cuda)
        host.copy_(vals, non_blocking=True)
        copied = torch.cuda.Event() if vals.is_cuda else None
        if copied is not None:
            copied.record()
        optimizer.step()
        if copied is not None:
            copied.synchronize()
        loss_v, grad_norm_v = host.tolist()
    else:
        loss_v, grad_norm_v = vals.tolist()
    finite = D.agree(dist, 0 if math.isfinite(loss_v) and math.isfinite(grad_norm_v) else 1) == 0
    if finite and not on_device:
        optimizer.step()
    return loss_v, grad_norm_v, finite


def accumulate(run: Run, step: int) -> tuple[torch.Tensor, bool]:
    """Forward and backward over grad_accum micro-batches. Returns (mean loss, interrupted)."""
    total = torch.zeros((), device=run.dist.device)
    # d(step loss)/d(micro loss) = 1 / grad_accum, handed to backward as a tensor: compiled autograd
    # (torch 2.11, CUDA) fails on the Python scalar that `(loss / grad_accum).backward()` leaves in
    # the graph. The gradients are the same numbers.
    weight = torch.full((), 1.0 / run.grad_accum, device=run.dist.device)
    copies = run.bf16_weights.refresh() if run.bf16_weights is not None else None  # after the last optimizer step
    for micro in range(run.grad_accum):
        if run.cudagraphs:  # each micro-step is a new replay; the last one's outputs are consumed
            torch.compiler.cudagraph_mark_step_begin()
        s, m, x, y = next(run.batches)
        assert (s, m) == (step, micro), f"batch order broken: got {(s, m)} for {(step, micro)}"
        if run.injector.active(step, run.detector):
            x, y = (t.to(run.dist.device) for t in split_window(run.injector.windows(step, micro, x.size(0))))
        # The backward too runs inside: FSDP2 decides at its end whether to reduce-scatter.
        with D.maybe_no_sync(run.model, sync=micro == run.grad_accum - 1):
            loss = forward_backward(run, run.model, x, y, weight, copies)
        total += loss.detach()
        # A single process can stop between micro-steps; ranks of a group agree once per step
        # (stopping alone mid-accumulation would leave the others waiting in an all-reduce).
        if run.stop.requested and not run.dist.enabled:
            return total, True
    if run.bf16_weights is not None:  # the weight gradients summed in fp32 buffers become .grad
        run.bf16_weights.publish()
    if run.injector.active(step, run.detector):
        run.sink.log(step + 1, {MLFLOW_SPIKE_INJECTED: 1.0})
    return total / run.grad_accum, False


def forward_backward(run: Run, model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor,
                     weight: torch.Tensor, copies: dict[str, Any] | None) -> torch.Tensor:
    """One micro-batch's loss, and its backward scaled by `weight` (1 / grad_accum); `copies`, the
    step's bf16 weights when the run takes them once per step. The warm-up calls this too: the
    same call is the same compiled graph, forward and backward."""
    with run.autocast():
        loss = model(x, y) if copies is None else model(x, y, copies)
    with run.backward_context():
        loss.backward(weight)
    return loss


@torch.no_grad()
def mean_val_loss(run: Run) -> float:
    """Mean loss over the fixed val windows, on the uncompiled model (no recompile for eval)."""
    model = run.raw_model
    model.eval()
    losses = []
    for i in range(0, len(run.val), run.micro_batch):
        w = torch.from_numpy(run.val[i : i + run.micro_batch]).to(run.dist.device)
        with run.autocast():
            losses.append(model(w[:, :-1], w[:, 1:]).float() * w.size(0))
    model.train()
    return (torch.stack(losses).sum() / len(run.val)).item()


def evaluate(run: Run, step: int) -> float:
    """The eval: the val loss, logged to MLflow, /metrics and the log."""
    val_loss = mean_val_loss(run)
    run.sink.log(step, {MLFLOW_VAL_LOSS: val_loss})
    run.sink.prom.val_loss.set(val_loss)
    log.info("step %d val_loss %.4f", step, val_loss)
    return val_loss


def judge_forecast(run: Run, step: int, val_loss: float) -> int:
    """The forecast at this eval: logged, published, alerted on; 80 to stop, else 0."""
    return run.forecast.judge(step, val_loss, run.sink, run.guard.projection(step))


def full_states(run: Run) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Consolidated model and optimizer state on CPU (a collective under FSDP2: every rank calls it)."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
    return (get_model_state_dict(run.raw_model, options=opts),
            get_optimizer_state_dict(run.raw_model, run.optimizer, options=opts))


def save_checkpoint(run: Run, step: int) -> None:
    if run.last_saved_step == step:
        return
    run.sink.heartbeat.beat(step, PHASE_CHECKPOINTING)
    model_state, optim_state = full_states(run)
    if run.dist.is_main:
        run.state.spike = run.detector.state()
        run.state.forecast = run.forecast.state()
        run.state.probes = run.probes.state()
        # Windows are a pure function of (seed, step, sample index): the step is the position.
        run.state.sampler = {"seed": run.cfg.train.seed, "next_step": step}
        run.state.rng = capture_rng()
        run.state.mlflow_run_id = run.sink.run_id or run.state.mlflow_run_id
        run.state.micro_batch_size = run.micro_batch
        run.sink.persist()  # the steps this checkpoint covers are never logged again after a resume
        seconds = run.checkpointer.save(step, model_state, optim_state, run.state)
        run.sink.prom.ckpt_step.set(step)
        run.sink.prom.ckpt_seconds.set(seconds)
        run.sink.log(step, {"checkpoint_seconds": seconds})
        log.info("checkpoint step_%08d written in %.2f s", step, seconds)
    D.barrier(run.dist)
    run.last_saved_step = step
    run.sink.heartbeat.beat(step, PHASE_TRAINING)


def stop_run(run: Run, step: int, code: ExitCode, reason: str) -> int:
    """75, 76 and 80 checkpoint first; 77 exits at once without writing (already over the cap)."""
    if code in (ExitCode.PREEMPTED, ExitCode.BUDGET_PROJECTED, ExitCode.FORECAST_STOP):
        t = time.perf_counter()
        try:
            save_checkpoint(run, step)
            log.warning("%s at step %d: checkpoint in %.2f s, exit %d", END_REASONS[code], step,
                        time.perf_counter() - t, int(code))
        except CheckpointError as e:  # the stop stands (a budget stop above all); the older checkpoints remain
            log.error("%s at step %d: %s; exit %d all the same", END_REASONS[code], step, e, int(code))
    else:
        log.error("%s at step %d: exit %d without a checkpoint write", reason, step, int(code))
    run.sink.tags({"x1.end": END_REASONS[code], "x1.end_reason": reason[:500]})
    # RunPod spot gives 5 s after SIGTERM: the checkpoint comes first, the metrics get what is left
    # (anything unsent is spooled to disk and sent by the next start).
    run.sink.close(MLFLOW_STATUS[int(code)], timeout=3.0 if code == ExitCode.PREEMPTED else 30.0)
    # The stop record the next start measures its downtime from: the SIGTERM's time, else this exit's.
    run.sink.heartbeat.beat(step, PHASE_STOPPED, signal_time=run.stop.at, signal_mono=run.stop.at_mono)
    return int(code)


def diverged(run: Run, step: int) -> int:
    log.error("diverged: %d non-finite steps in a row at step %d. Check the data's token ids, the fp32 master "
              "weights and the learning rate; resume from the last checkpoint with a lower lr to continue.",
              run.state.nonfinite_in_row, step)
    run.sink.tags({"x1.end": END_REASONS[ExitCode.DIVERGED],
                   "x1.end_reason": f"{run.state.nonfinite_in_row} non-finite steps in a row at step {step}"})
    run.sink.close("FAILED", timeout=30.0)
    return int(ExitCode.DIVERGED)


def finish(run: Run, step: int) -> int:
    save_checkpoint(run, step)
    model_state, optim_state = full_states(run)
    if run.dist.is_main:
        run.checkpointer.save_final(model_state, optim_state, step, run.state.config_hash)
        log.info("finished: %s", run.checkpointer.root / "final.safetensors")
    run.sink.heartbeat.beat(step, PHASE_FINISHED)
    # x1.end_reason too: an earlier process of this run may have left "preempted" there.
    run.sink.tags({"x1.end": END_REASONS[ExitCode.FINISHED], "x1.end_reason": f"total steps reached (step {step})"})
    run.sink.close("FINISHED", timeout=60.0)
    return int(ExitCode.FINISHED)

