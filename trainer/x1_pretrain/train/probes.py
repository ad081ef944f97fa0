"""Cooldown probes (train.cooldown_probes): at a few shares of the run, a short cooldown forked from
the run's own weights, evaluated on the fixed val windows and dropped. Each is an annealed point at
the run's own size, which the final-loss forecast lacks early on (docs/FORECAST.md): Hägele et al.
2024 (arXiv 2405.18392) find that a cooldown of 10-20% of the tokens so far lands where a whole
schedule of that length would.

The loop calls `run.probes.maybe_run(run, step)` once per step, after the eval; with no probes
configured it is a no-op object (NoProbes).

How the run stays untouched. The probe trains the model the loop trains (compiled, wrapped for DDP
or FSDP2: no second model to compile or wrap) after keeping a copy of its weights and optimizer
state (about 12 bytes a parameter: on the GPU where it has room for it, else in host memory), and
puts the copy back into the same tensors when it ends, however it ends: done, a SIGTERM, a budget
stop, an error. Its batches are the windows of the run's own next steps, fork .. fork + k - 1: the
sampler is a pure function of (seed, step, sample index), so the probe reads, from a prefetcher of
its own, the data the run itself will read next, and the run's sampler and prefetcher are not
touched (a separate seed stream would serve as well; the run's next windows keep one stream of
data and make the probe the cooldown the run would do if it stopped here). Every RNG state
(Python, NumPy, torch CPU and CUDA) is saved before and restored after. On the CPU in fp32 the
run's weights and optimizer state at any later step are bit for bit those of a run without
probes (tests/test_probes.py).

A stop during a probe: the probe is dropped, the run's state put back, and the loop goes on to its
checkpoint and exit at its own step (a SIGTERM: 75; a budget stop found during the probe is handed
to the loop's next budget check). After the resume the probe is retried from the first step after
the checkpoint when that is within 1% of the run of its fork, else skipped; the log says which.
Its time is left out of the throughput meter (like an eval) and counted in the budget guard's
projection (budget_guard.Pace: the probes still ahead).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

import torch

from x1_common.contracts import MLFLOW_PROBE_SECONDS, MLFLOW_PROBE_STEPS, MLFLOW_PROBE_VAL_LOSS, PHASE_TRAINING
from x1_pretrain.checkpoint.store import capture_rng, restore_rng
from x1_pretrain.config import RunConfig
from x1_pretrain.train import distributed as D
from x1_pretrain.train.loop import forward_backward, mean_val_loss, step_unless_nonfinite
from x1_pretrain.train.schedule import lr_at, probe_lr, probe_plan

log = logging.getLogger("x1.train")

RETRY_WITHIN = 0.01  # a dropped probe is retried when the resume is within this share of the run of its fork


@dataclass(frozen=True)
class Probe:
    share: float  # of the run
    fork: int  # the step its cooldown starts from
    steps: int  # its length
    number: int  # 1-based, of `of`
    of: int

    def name(self) -> str:
        return f"cooldown probe {self.number}/{self.of} ({self.share:.3g} of the run)"


class Interrupted(Exception):
    """The probe stopped before its end: a SIGTERM, or a budget stop."""


class NoProbes:
    """train.cooldown_probes empty: nothing to run, nothing to save."""

    def maybe_run(self, run: Any, step: int) -> None:
        pass

    def state(self) -> dict[str, Any]:
        return {}

    def ahead(self) -> list[tuple[int, int]]:
        return []


class CooldownProbes:
    """The probes of one run, which are done, and which were dropped or skipped (its checkpoint state)."""

    def __init__(self, cfg: RunConfig, state: dict[str, Any] | None, start_step: int) -> None:
        t = cfg.train
        plan = probe_plan(t.cooldown_probes, t.cooldown_probe_share, t.total_steps)
        self.total = t.total_steps
        self.floor = cfg.optim.min_lr
        state = state or {}
        self.results: list[dict[str, Any]] = list(state.get("results", []))
        self.dropped: list[dict[str, Any]] = list(state.get("dropped", []))
        self.skipped: list[dict[str, Any]] = list(state.get("skipped", []))
        done = {r["share"] for r in self.results} | {s["share"] for s in self.skipped}
        self.pending: list[Probe] = []
        for i, (share, fork, steps) in enumerate(plan):
            probe = Probe(share, fork, steps, i + 1, len(plan))
            if share in done:
                continue
            if fork < start_step or (fork == start_step and start_step > 0):
                # Forked before this process starts (a resume). Retried from the next step when that is
                # near enough its fork to be the same probe, skipped otherwise.
                behind = start_step - fork
                was = "was dropped by a stop" if any(d["share"] == share for d in self.dropped) else "has not run"
                if behind <= max(RETRY_WITHIN * self.total, 1) and start_step + 1 < self.total:
                    steps = min(max(round(t.cooldown_probe_share * (start_step + 1)), 1), self.total - start_step - 1)
                    probe = Probe(share, start_step + 1, steps, probe.number, probe.of)
                    log.info("%s from step %d %s: retried from step %d", probe.name(), fork, was, start_step + 1)
                else:
                    why = (f"the run resumed at step {start_step}, {behind} steps past its fork (a retry is made "
                           f"within {RETRY_WITHIN:.0%} of the run, before its last step)")
                    self.skipped.append({"share": share, "step": fork, "why": why})
                    log.info("%s from step %d %s: skipped: %s", probe.name(), fork, was, why)
                    continue
            self.pending.append(probe)

    @classmethod
    def for_run(cls, cfg: RunConfig, state: dict[str, Any] | None, start_step: int) -> CooldownProbes | NoProbes:
        return cls(cfg, state, start_step) if cfg.train.cooldown_probes else NoProbes()

    def state(self) -> dict[str, Any]:
        return {"results": self.results, "dropped": self.dropped, "skipped": self.skipped}

    def ahead(self) -> list[tuple[int, int]]:
        """(fork step, steps) of the probes still to run: the budget's projection counts them."""
        return [(p.fork, p.steps) for p in self.pending]

    def maybe_run(self, run: Any, step: int) -> None:
        if not self.pending or self.pending[0].fork != step:
            return
        if D.agree(run.dist, int(run.stop.requested)):  # the run checkpoints now; the probe runs after the resume
            return
        probe = self.pending.pop(0)
        start_lr = lr_at(probe.fork, run.cfg.optim, self.total, run.state.replans[-1] if run.state.replans else None)
        log.info("%s: forked at step %d, %d steps, lr %.2e -> %.2e (1-sqrt)", probe.name(), probe.fork, probe.steps,
                 start_lr, self.floor)
        with run.throughput.pause("probe"):  # left out of the run's rate, like an eval
            t0 = time.perf_counter()
            try:
                val_loss, where = self._run(run, probe, start_lr)
            except Interrupted as e:
                self.dropped.append({"share": probe.share, "step": probe.fork, "why": str(e)})
                log.warning("%s from step %d dropped: %s; the run's weights and optimizer state are as they were "
                            "at step %d", probe.name(), probe.fork, e, step)
                return
            seconds = time.perf_counter() - t0
        self.results.append({"share": probe.share, "step": probe.fork, "steps": probe.steps, "val_loss": val_loss,
                             "seconds": round(seconds, 3), "start_lr": start_lr, "floor": self.floor})
        run.pace.record_probe(probe.steps, seconds)
        run.forecast.add_probe(probe.fork, probe.steps, val_loss)
        run.sink.log(probe.fork, {MLFLOW_PROBE_VAL_LOSS: val_loss, MLFLOW_PROBE_STEPS: float(probe.steps),
                                  MLFLOW_PROBE_SECONDS: seconds})
        log.info("%s: probe_val_loss %.4f in %.1f s (the run's state kept %s); the run goes on from step %d as it was",
                 probe.name(), val_loss, seconds, where, step)

    def _run(self, run: Any, probe: Probe, start_lr: float) -> tuple[float, str]:
        """The cooldown on the run's own model, then its val loss; the run's state put back whatever happens."""
        saved = Saved(run.raw_model, run.optimizer)
        rng = capture_rng()
        batches = run.make_batches(probe.fork, run.micro_batch, run.grad_accum, probe.fork + probe.steps)
        try:
            for j in range(probe.steps):
                lr = probe_lr(j, probe.steps, start_lr, self.floor)
                for group in run.optimizer.param_groups:
                    group["lr"] = lr
                self._step(run, batches, probe, j)
                if (j + 1) % run.cfg.train.log_every == 0:  # the watchdog's stall detector hears from us
                    run.sink.heartbeat.beat(probe.fork, PHASE_TRAINING)
            return mean_val_loss(run), saved.where
        except Interrupted:
            raise
        except (RuntimeError, ValueError) as e:  # out of memory, a broken batch: the probe is lost, not the run
            raise Interrupted(f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}") from None
        finally:
            batches.close()
            run.optimizer.zero_grad(set_to_none=not run.cudagraphs)
            saved.restore()
            restore_rng(rng)

    def _step(self, run: Any, batches: Any, probe: Probe, j: int) -> None:
        """One optimizer step of the probe: the loop's micro-steps, clip and step, without its bookkeeping."""
        weight = torch.full((), 1.0 / run.grad_accum, device=run.dist.device)
        copies = run.bf16_weights.refresh() if run.bf16_weights is not None else None
        total = torch.zeros((), device=run.dist.device)
        for micro in range(run.grad_accum):
            if run.cudagraphs:
                torch.compiler.cudagraph_mark_step_begin()
            s, m, x, y = next(batches)
            assert (s, m) == (probe.fork + j, micro), f"probe batch order broken: got {(s, m)}"
            with D.maybe_no_sync(run.model, sync=micro == run.grad_accum - 1):
                total += forward_backward(run, run.model, x, y, weight, copies).detach()
            if run.stop.requested and not run.dist.enabled:
                raise Interrupted(f"stop signal after {j} of {probe.steps} steps")
        if run.bf16_weights is not None:
            run.bf16_weights.publish()
        grad_norm = torch.nn.utils.clip_grad_norm_(run.raw_model.parameters(), run.cfg.optim.grad_clip)
        if hasattr(grad_norm, "full_tensor"):
            grad_norm = grad_norm.full_tensor()
        loss, _, finite = step_unless_nonfinite(run.optimizer, run.dist, total / run.grad_accum, grad_norm)
        run.optimizer.zero_grad(set_to_none=not run.cudagraphs)
        if not finite:
            raise Interrupted(f"non-finite loss {loss} at its step {j + 1}")
        # Ranks agree once per step on a stop (alone mid-accumulation one would leave the others waiting).
        if D.agree(run.dist, int(run.stop.requested)):
            raise Interrupted(f"stop signal after {j + 1} of {probe.steps} steps")
        budget = run.guard.maybe_check(probe.fork)
        if D.agree(run.dist, budget.exit_code or 0):
            run.guard.hold(budget)  # the loop's next budget check acts on it, at the run's own step
            raise Interrupted(f"budget stop after {j + 1} of {probe.steps} steps: {budget.reason}")


class Saved:
    """The model's parameters and buffers and the optimizer's state and groups, copied; `restore`
    puts the values back into the same tensors (a compiled graph, a fused optimizer and the
    checkpoint code keep their references)."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer = optimizer
        self.tensors = [t for t in [*model.parameters(), *model.buffers()]]
        states = [(p, s) for p, s in optimizer.state.items()]
        need = sum(t.numel() * t.element_size() for t in self.tensors) + sum(
            v.numel() * v.element_size() for _, s in states for v in s.values() if torch.is_tensor(v))
        device = self.tensors[0].device if self.tensors else torch.device("cpu")
        on_gpu = device.type == "cuda" and torch.cuda.mem_get_info(device)[0] > 1.25 * need
        keep = (lambda t: t.detach().clone()) if on_gpu or device.type != "cuda" else (lambda t: t.detach().to("cpu", copy=True))
        self.where = f"{'on the GPU' if on_gpu else 'in host memory' if device.type == 'cuda' else 'in memory'}, {need / 2**30:.2g} GiB"
        with torch.no_grad():
            self.values = [keep(t) for t in self.tensors]
            self.state = {p: {k: keep(v) if torch.is_tensor(v) else v for k, v in s.items()} for p, s in states}
        self.groups = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]

    def restore(self) -> None:
        with torch.no_grad():
            for t, v in zip(self.tensors, self.values, strict=True):
                t.copy_(v)
            for p in list(self.optimizer.state):
                if p not in self.state:  # state the probe's steps created
                    del self.optimizer.state[p]
            for p, s in self.state.items():
                live = self.optimizer.state[p]
                for k in [k for k in live if k not in s]:
                    del live[k]
                for k, v in s.items():
                    if torch.is_tensor(v) and torch.is_tensor(live.get(k)) and live[k].shape == v.shape:
                        live[k].copy_(v)
                    else:
                        live[k] = v.clone() if torch.is_tensor(v) else v
        for group, saved in zip(self.optimizer.param_groups, self.groups, strict=True):
            group.update(saved)

