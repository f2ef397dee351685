"""Paired statistics of a plan against exact prefill on the same samples.

A quality claim compares two plans sample by sample (same prompt, same answers), so the unit of
resampling is the sample: the bootstrap draws samples with replacement and takes the mean of their
score deltas. Over several tasks the overall delta is the mean of the per-task deltas (each task
weighs the same, as RULER averages tasks); its bootstrap resamples within each task. Discordance is
tested with McNemar's exact test, generalised to graded scores as the exact sign test on the deltas
(for 0/100 scores the two are the same test).
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass

import numpy as np

Key = tuple[str, int]  # (task, length)


@dataclass(frozen=True)
class Estimate:
    """A mean with its bootstrap confidence interval [lo, hi] over n paired samples."""

    n: int
    mean: float
    lo: float
    hi: float

    def as_dict(self) -> dict:
        return asdict(self)

    def __str__(self) -> str:
        return f"{self.mean:+.1f} [{self.lo:+.1f}, {self.hi:+.1f}]"


def bootstrap_mean(
    deltas: Sequence[float] | np.ndarray, resamples: int = 2000, seed: int = 0, level: float = 0.95
) -> Estimate:
    """Mean of paired deltas with a percentile bootstrap CI (samples drawn with replacement)."""
    return bootstrap_mean_of_tasks([deltas], resamples, seed, level)


def bootstrap_mean_of_tasks(
    groups: Sequence[Sequence[float] | np.ndarray], resamples: int = 2000, seed: int = 0, level: float = 0.95
) -> Estimate:
    """Mean over groups (tasks) of each group's mean delta; the bootstrap resamples within each group."""
    arrays = [np.asarray(g, dtype=np.float64) for g in groups]
    if not arrays or any(a.ndim != 1 or a.size == 0 for a in arrays):
        raise ValueError("need at least one non-empty 1-d group of paired deltas")
    if not 0 < level < 1:
        raise ValueError(f"level must lie in (0, 1), got {level}")
    rng = np.random.default_rng(seed)
    boot = np.zeros(resamples)
    for a in arrays:
        boot += a[rng.integers(0, a.size, size=(resamples, a.size))].mean(axis=1)
    boot /= len(arrays)
    mean = float(np.mean([a.mean() for a in arrays]))
    tail = (1 - level) / 2 * 100
    lo, hi = np.percentile(boot, [tail, 100 - tail])
    n = sum(a.size for a in arrays)
    return Estimate(n, mean, min(float(lo), mean), max(float(hi), mean))


def mcnemar_exact(worse: int, better: int) -> float:
    """Two-sided exact McNemar p-value from the discordant counts (binomial(b + c, 1/2)).

    Equals `scipy.stats.binomtest(better, worse + better, 0.5).pvalue`; 1.0 when nothing is discordant.
    """
    if worse < 0 or better < 0:
        raise ValueError("discordant counts must be >= 0")
    n, k = worse + better, min(worse, better)
    if n == 0:
        return 1.0
    tail = sum(math.comb(n, i) for i in range(k + 1)) / 2**n
    return min(1.0, 2 * tail)


def sign_test(plan: Sequence[float] | np.ndarray, exact: Sequence[float] | np.ndarray) -> float:
    """McNemar's exact p-value on paired scores: samples the plan scores lower vs higher than exact."""
    d = np.asarray(plan, dtype=np.float64) - np.asarray(exact, dtype=np.float64)
    return mcnemar_exact(int((d < 0).sum()), int((d > 0).sum()))


def pair(rows: Iterable[Mapping], plan: str, reference: str = "exact") -> dict[Key, tuple[np.ndarray, np.ndarray]]:
    """{(task, length): (plan scores, reference scores)} over the samples both plans scored, by index.

    `rows` are per-sample records with "plan", "task", "length", "index" and "score" (ruler_run's rows).
    """
    scores: dict[tuple[str, Key], dict[int, float]] = defaultdict(dict)
    for r in rows:
        if r["plan"] in (plan, reference):
            scores[(r["plan"], (r["task"], int(r["length"])))][int(r["index"])] = float(r["score"])
    out = {}
    for key in sorted({k for p, k in scores if p == plan}):
        a, b = scores[(plan, key)], scores.get((reference, key), {})
        common = sorted(set(a) & set(b))
        if common:
            out[key] = (np.array([a[i] for i in common]), np.array([b[i] for i in common]))
    return out


def paired_summary(
    rows: Sequence[Mapping], plan: str, reference: str = "exact", resamples: int = 2000, seed: int = 0
) -> dict:
    """Per-(task, length) and per-length overall paired deltas of `plan` vs `reference`, with CIs and p.

    {"tasks": {(task, length): {"delta": Estimate, "score": mean plan score, "reference": mean reference
    score, "p": McNemar p}}, "overall": {length: {"delta": Estimate, "score", "reference"}}}.
    """
    cells = pair(rows, plan, reference)
    tasks = {
        key: {
            "delta": bootstrap_mean(p - e, resamples, seed),
            "score": float(p.mean()),
            "reference": float(e.mean()),
            "p": sign_test(p, e),
        }
        for key, (p, e) in cells.items()
    }
    overall = {}
    for length in sorted({k[1] for k in cells}):
        group = [cells[k] for k in cells if k[1] == length]
        overall[length] = {
            "delta": bootstrap_mean_of_tasks([p - e for p, e in group], resamples, seed),
            "score": float(np.mean([p.mean() for p, _ in group])),
            "reference": float(np.mean([e.mean() for _, e in group])),
        }
    return {"tasks": tasks, "overall": overall}


def region_breakdown(
    rows: Sequence[Mapping], plan: str, reference: str = "exact", tasks: Iterable[str] | None = None
) -> dict[str, dict]:
    """Per needle region of `plan`'s rows ("bulk" = filled rows, "tail", ...): n, plan and reference means.

    Scores are pooled over samples of the given tasks (default all) and lengths; samples without
    needles (region "none") are one group too.
    """
    wanted = None if tasks is None else set(tasks)
    ref = {(r["task"], int(r["length"]), int(r["index"])): float(r["score"]) for r in rows if r["plan"] == reference}
    groups: dict[str, list[tuple[float, float]]] = defaultdict(list)
    for r in rows:
        key = (r["task"], int(r["length"]), int(r["index"]))
        if r["plan"] == plan and key in ref and (wanted is None or r["task"] in wanted):
            groups[r["region"]].append((float(r["score"]), ref[key]))
    return {
        region: {
            "n": len(pairs),
            "score": float(np.mean([p for p, _ in pairs])),
            "reference": float(np.mean([e for _, e in pairs])),
        }
        for region, pairs in sorted(groups.items())
    }


def mean_delta(rows: Iterable[Mapping], plan: str, reference: str = "exact") -> float | None:
    """Mean over (task, length) cells of the cell's mean paired delta (None: no sample has a partner)."""
    cells = pair(rows, plan, reference)
    return float(np.mean([(p - e).mean() for p, e in cells.values()])) if cells else None


def cannot_pass(rows: Iterable[Mapping], plan: str, max_drop: float, seed: int = 0) -> bool:
    """Whether `plan`'s first samples already lose more than `max_drop` points against exact on average *and*
    on the CI lower bound the constraint judges (bootstrap with `seed`, as the trial's own): such a trial is
    not promoted (its mean is below the bar) and fails the constraint whatever its speed, so the tuner does
    not measure its TTFT or dNLL (multi-fidelity: the seconds go to trials that can pass)."""
    rows = list(rows)
    mean = mean_delta(rows, plan)
    return mean is not None and mean < -max_drop and fails(rows, plan, max_drop, seed)


def fails(rows: Iterable[Mapping], plan: str, max_drop: float, seed: int = 0) -> bool:
    """Whether `plan`'s paired samples fail the constraint: their 95% CI lower bound (bootstrap with `seed`, as
    the trial's own) is below -max_drop (a bound on the limit passes, as `search.feasible` judges)."""
    cells = pair(rows, plan)
    if not cells:
        return False
    return not within(bootstrap_mean_of_tasks([p - e for p, e in cells.values()], seed=seed).lo, max_drop)


def within(low: float, max_drop: float) -> bool:
    """The constraint on a paired delta's CI lower bound (or mean): at least -max_drop; on the limit passes."""
    return low >= -max_drop - 1e-12


def clears(bar: Mapping[str, float], mean: float, speedup: float) -> bool:
    """Whether a trial's cheap first look clears a promotion bar {"mean", "speedup"} (multi-fidelity)."""
    return mean >= bar["mean"] and speedup >= bar["speedup"]


def needs_speed(bar: Mapping[str, float] | None) -> bool:
    """Whether promotion waits for the trial's speed-up (a feasible front exists); else the promoted samples
    come first, and a trial that then fails the constraint is not timed."""
    return bar is not None and bar["speedup"] > 0
