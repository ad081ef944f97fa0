"""Loss spikes: a detector that flags them, and the lab's injection of one (docs/DESIGN.md §5).

`--inject-spike-at-step N` replaces every micro-batch of steps N..N+4 with sequences of rare
tokens (the bottom 1% of the training unigram distribution), which a model trained on real text
finds very surprising. If a natural spike was detected before step N, the injection is skipped
and the post-mortem is written about that one instead (the lab's rule).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from x1_pretrain.data.loader import rare_token_windows

INJECT_STEPS = 5


@dataclass
class SpikeDetector:
    """Flags a loss above `factor` x its running EMA. Spiking steps do not feed the EMA, so the
    baseline stays the pre-spike loss and the recovery can be measured against it."""

    factor: float
    beta: float
    min_observations: int = 20  # the EMA needs history before it is a baseline
    ema: float | None = None
    observations: int = 0
    spikes: list[int] = field(default_factory=list)

    def update(self, step: int, loss: float) -> bool:
        if not math.isfinite(loss):
            return False
        if self.ema is not None and self.observations >= self.min_observations and loss > self.factor * self.ema:
            self.spikes.append(step)
            return True
        self.ema = loss if self.ema is None else self.beta * self.ema + (1 - self.beta) * loss
        self.observations += 1
        return False

    def state(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_state(cls, factor: float, beta: float, state: dict[str, Any]) -> SpikeDetector:
        d = cls(factor=factor, beta=beta)
        d.ema = state.get("ema")
        d.observations = int(state.get("observations", 0))
        d.spikes = list(state.get("spikes", []))
        return d


class SpikeInjector:
    """Whether steps N..N+4 get rare-token batches, and the batches themselves."""

    def __init__(self, at_step: int | None, rare_ids: np.ndarray | None, seed: int, seq_len: int, rank: int):
        self.at_step = at_step
        self.rare_ids = rare_ids
        self.seed, self.seq_len, self.rank = seed, seq_len, rank

    def natural_spike_before(self, detector: SpikeDetector) -> int | None:
        earlier = [s for s in detector.spikes if self.at_step is not None and s < self.at_step]
        return earlier[0] if earlier else None

    def active(self, step: int, detector: SpikeDetector) -> bool:
        # A pure function of the step and the detector's (checkpointed) history: a resume in
        # the middle of the injection carries on injecting.
        return (self.at_step is not None and self.at_step <= step < self.at_step + INJECT_STEPS
                and self.natural_spike_before(detector) is None)

    def announcement(self, step: int, detector: SpikeDetector) -> str | None:
        """The log line for step N, None at any other step."""
        if self.at_step is None or step != self.at_step:
            return None
        natural = self.natural_spike_before(detector)
        if natural is not None:
            return (f"spike injection at step {self.at_step} skipped: a natural spike was detected at step "
                    f"{natural}; write the post-mortem about that one")
        return f"injecting rare-token batches at steps {self.at_step}..{self.at_step + INJECT_STEPS - 1}"

    def windows(self, step: int, micro: int, count: int) -> np.ndarray:
        assert self.rare_ids is not None
        return rare_token_windows(self.rare_ids, self.seed, step, micro, self.rank, count, self.seq_len)
