"""Trials needed to reach the front: the bracketing start (`search.first_trials`) against the previous one.

A replay, not a new study: each trial is scored by a stand-in built from the smollm2 study's recorded
trials (docs/BENCHMARKS.md section 8: RULER delta 0 for S >= 18 and -50 at S=15; TTFT speed-up by split at
tail 256 and share 0, lowered by the protected share as trials 4-6 measured). The sampler, storage, seeds
and enqueueing are the tuner's own (`open_study`, `optimize`); only fit + RULER + TTFT are replaced.

"Reached the front" = the first trial whose speed-up lies within `--tol` (default 2%: the run-to-run noise
of the recorded speed-ups) of the best feasible speed-up of the stand-in. Reported for each budget and split
set, for seed 0 (the study's) and over `--seeds` seeds.

    python bench/first_trials.py --seeds 20
"""

from __future__ import annotations

import argparse
import math
import statistics
import tempfile
from pathlib import Path

import optuna

from ridgefill import search
from ridgefill.rows import ROWS
from ridgefill.study import Search, load_study

STUDY = Path(__file__).resolve().parents[1] / "studies" / "smollm2-135m.yaml"
SPEEDUP = {22: 1.211, 20: 1.308, 18: 1.365, 15: 1.605}  # recorded, tail 256, share 0
SHARE_COST = (1.365 - 1.237) / 0.169  # speed-up lost per unit of protected share (trial 4 vs trial 2)


def speedup_of(split: int) -> float:
    """Recorded splits as measured; others interpolated linearly in S (the FLOP bound is linear in S)."""
    if split in SPEEDUP:
        return SPEEDUP[split]
    xs = sorted(SPEEDUP)
    lo = max([x for x in xs if x <= split], default=xs[0])
    hi = min([x for x in xs if x >= split], default=xs[-1])
    if lo == hi:
        return SPEEDUP[lo] + (SPEEDUP[xs[0]] - SPEEDUP[xs[-1]]) / (xs[-1] - xs[0]) * (lo - split)
    return SPEEDUP[lo] + (SPEEDUP[hi] - SPEEDUP[lo]) * (split - lo) / (hi - lo)


def stand_in(p: search.Params) -> search.Outcome:
    delta = 0.0 if p.split >= 18 else -50.0
    return search.Outcome(
        delta, speedup_of(p.split) * (1 - SHARE_COST / 1.365 * p.rows.share) * (1 + 1e-5 * (256 - p.rows.tail))
    )


def previous_first_trials(search: Search, budget: int) -> list[dict]:
    """The start before issue 13: the largest splits at the middle lambda, at most budget // 2 of them."""
    lam = math.sqrt(search.lam[0] * search.lam[1])
    n = max(1, min(len(search.splits), budget // 2))
    splits = sorted(search.splits, reverse=True)[:n]
    return [{"split": s, "lam": lam, "tail": max(search.tails), "share": search.share[0]} for s in splits]


def replay(splits: list[int], budget: int, seed: int, start, tol: float) -> int | None:
    """1-based number of the first trial on the front, or None if the budget ran out first."""
    cfg = load_study(STUDY, {"budget": {"trials": budget, "seed": seed}, "search": {"splits": splits}})
    best = max(
        stand_in(search.Params(s, 1e-3, ROWS.given(tail=min(cfg.search.tails), share=0.0, sink=4))).speedup
        for s in splits
        if s >= 18
    )
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    with tempfile.TemporaryDirectory() as tmp:
        study = search.open_study(cfg, search.storage(None, Path(tmp), cfg.name))
        for p in start(cfg.search, budget):
            study.enqueue_trial(p, skip_if_exists=True)
        search.optimize(study, cfg, lambda batch: [stand_in(p) for _, p in batch])
        for t in sorted(study.trials, key=lambda t: t.number):
            if t.values[0] >= -cfg.constraints.max_ruler_drop and t.values[1] >= best * (1 - tol):
                return t.number + 1
    return None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, default=20)
    ap.add_argument("--tol", type=float, default=0.02)
    a = ap.parse_args()
    print("| splits | budget | start | seed 0: trials to the front | reached (of seeds) | median trials |")
    print("|---|---|---|---|---|---|")
    for splits in ([15, 18, 20, 22], [15, 18, 22]):
        for budget in (3, 4, 8):
            for name, start in (("previous", previous_first_trials), ("bracketing", search.first_trials)):
                got = [replay(splits, budget, seed, start, a.tol) for seed in range(a.seeds)]
                hit = [g for g in got if g is not None]
                med = f"{statistics.median(hit):g}" if hit else "-"
                print(
                    f"| {splits} | {budget} | {name} | {got[0] if got[0] else 'not reached'} | "
                    f"{len(hit)}/{a.seeds} | {med} |"
                )


if __name__ == "__main__":
    main()
