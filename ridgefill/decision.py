"""One trial's decision, the same on every engine: what to score, whether to time it, whether to promote it.

Multi-fidelity. A trial scores `samples` RULER samples per task, paired against exact. Then:
- one whose first samples already fail the constraint (`paired.cannot_pass`) stops: no speed-up could make it
  feasible, so it is neither timed nor promoted;
- one whose paired mean is within the limit and whose speed-up could join the front (the `bar`) scores more
  samples, up to `promote`, and its constraint is judged on the CI of all of them;
- it is timed only when its speed can matter: before promotion when a feasible front exists (the bar asks
  for a speed-up), else after, and not at all when it then fails on every sample it scored.
A predicted speed-up (the calibrated TTFT model's, `ridgefill.ttft_model`) replaces the timing.

The transformers trial (`tasks.trial.run_trial`) and the vLLM trial engine (`evals.vllm_trial.run_job`) both
call `decide` with their own `score` and `time`; `cost.py` prices it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar

from ridgefill.evals.paired import cannot_pass, clears, fails, mean_delta, needs_speed

FRONT_MARGIN = 0.02  # speed-ups within 2% of the best are within run-to-run TTFT noise (BENCHMARKS section 8)
SAMPLE_KEYS = ("task", "length", "index", "region", "score")  # what pairing needs of a sample's outcome


class Speed(Protocol):
    speedup: float


S = TypeVar("S", bound=Speed)


@dataclass(frozen=True)
class Gate:
    """What a trial is judged against: the exact baseline's sample rows, the constraint (`max_drop`, judged on a
    bootstrap with `seed`), the first `samples` per task, and the promotion to `promote` samples when it clears
    `bar` ({"mean", "speedup"}; None: nobody is promoted). JSON-ready (`as_dict`) for the vLLM job."""

    exact: Sequence[dict]
    max_drop: float
    seed: int
    samples: int
    promote: int | None = None
    bar: dict | None = None

    @classmethod
    def of(cls, exact: Sequence[dict], max_drop: float, seed: int, samples: int, promote: int | None,
           front: float | None) -> Gate:  # fmt: skip
        """The gate of a trial that starts while `front` is the best feasible speed-up (None: none yet)."""
        bar = None
        if promote:
            bar = {"mean": -max_drop, "speedup": 0.0 if front is None else front * (1 - FRONT_MARGIN)}
        return cls(sample_rows("exact", exact), max_drop, seed, samples, promote, bar)

    def as_dict(self) -> dict:
        return {"exact": list(self.exact), "max_drop": self.max_drop, "seed": self.seed, "samples": self.samples,
                "promote": self.promote, "bar": self.bar}  # fmt: skip

    def paired(self, ruler: dict) -> list[dict]:
        """The trial's sample rows (labelled "trial") beside the exact ones, for `evals.paired`."""
        return sample_rows("trial", ruler["samples"]) + list(self.exact)

    def cannot_pass(self, ruler: dict) -> bool:
        return cannot_pass(self.paired(ruler), "trial", self.max_drop, self.seed)

    def fails(self, ruler: dict) -> bool:
        return fails(self.paired(ruler), "trial", self.max_drop, self.seed)

    def promotes(self, ruler: dict, speedup: float) -> bool:
        """Whether the first samples' paired mean and `speedup` clear the bar."""
        if self.bar is None:
            return False
        mean = mean_delta(self.paired(ruler), "trial")
        return mean is not None and clears(self.bar, mean, speedup)


def sample_rows(plan: str, rows: Sequence[dict]) -> list[dict]:
    """Per-sample outcomes of one plan, trimmed to what pairing needs (no prompts, predictions or answers)."""
    return [{"plan": plan, **{k: r[k] for k in SAMPLE_KEYS}} for r in rows]


@dataclass
class Decision(Generic[S]):
    """What the trial ran: its RULER result (every sample it scored), its timing (None: not timed, either
    predicted or out of reach) and whether it was promoted."""

    ruler: dict
    timing: S | None = None
    promoted: bool = False
    reachable: bool = True  # False: not timed and it fails the constraint whatever its speed (no dNLL needed)


def decide(
    score: Callable[[int, int], dict],
    time: Callable[[], S],
    merge: Callable[[dict, dict], dict],
    gate: Gate,
    predicted: float | None = None,
) -> Decision[S]:
    """Run one trial's steps: `score(first, last)` scores sample indices first..last-1 (`run_ruler_plan`'s
    shape), `time()` times the trial, `merge` joins two scored results; `predicted`: the speed-up is known and
    nothing is timed."""
    ruler = score(0, gate.samples)
    if gate.cannot_pass(ruler):
        return Decision(ruler, reachable=False)
    timing = time() if predicted is None and needs_speed(gate.bar) else None
    speed = predicted if predicted is not None else (timing.speedup if timing is not None else 0.0)
    promoted = gate.promote is not None and gate.promotes(ruler, speed)
    if promoted:
        ruler = merge(ruler, score(gate.samples, gate.promote))
    failed = gate.fails(ruler)
    if predicted is None and timing is None and not failed:
        timing = time()
    return Decision(ruler, timing, promoted, reachable=timing is not None or not failed)
