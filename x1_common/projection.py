"""The one projection of what a run will have cost at its finish, for everything that shows one:
`stack status` and `x1 status` (at a glance), the forecast alert (`$X more to finish`), and the run
folder's budget.json after the end.

Three figures exist while a run goes on, and this picks the one to show:

    the run has ended         its spend: nothing more is billed for it
    the trainer's own         spent + rate x the hours its steps left need at its measured pace
                              (+ its margin): it knows the run's length
    the sidecar's             spent + rate x the planned hours left (PLANNED_HOURS): a guess at
                              the length, the spend alone without one

The budget guard still judges the larger of the trainer's and the sidecar's before it lets a run
go on (rule 2: a stop errs on the side of the cap); its `budget:` log line shows both. What a person
is told the run will cost is this one figure, with where it comes from.
"""

from __future__ import annotations

from dataclasses import dataclass

ENDED = "the spend: the run has ended"
TRAINERS = "the trainer's, at its measured pace"
SIDECARS = "the sidecar's: spent + rate x the planned hours left"


@dataclass(frozen=True)
class AtFinish:
    usd: float  # the run's cost at its finish
    source: str  # where it comes from: ENDED, TRAINERS or SIDECARS
    more_usd: float  # beyond the spend so far: what finishing costs (the forecast alert's figure)


def at_finish(spent_usd: float | None, *, trainer_usd: float | None = None, sidecar_usd: float | None = None,
              ended: bool = False) -> AtFinish | None:
    """The projection at the finish (see the module's doc); None before any spend is known."""
    if spent_usd is None:
        return None
    if ended:
        value, source = spent_usd, ENDED
    elif trainer_usd is not None:
        value, source = trainer_usd, TRAINERS
    elif sidecar_usd is not None:
        value, source = sidecar_usd, SIDECARS
    else:
        return None
    value = max(value, spent_usd)  # spend never shrinks: a projection under it is stale
    return AtFinish(value, source, max(value - spent_usd, 0.0))
