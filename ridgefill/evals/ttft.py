"""Paired time-to-first-token: exact vs RidgeFill on the same engine, in the same process.

A and B alternate after a warm-up so that drift (thermal, other load) hits both alike; the result is
each side's median and the ratio exact/RidgeFill with a bootstrap 95% CI over the paired repeats.
Engines are callables `ttft(input_ids, plan) -> seconds`: the transformers runtime here, vLLM later.
"""

from __future__ import annotations

import math
import random
import statistics
import time
from collections.abc import Callable

import torch
from torch import nn

from ridgefill.runtime import FillPlan, prefill

Engine = Callable[[torch.Tensor, FillPlan], float]


def random_prompt(vocab_size: int, n: int) -> torch.Tensor:
    """The TTFT prompt of length n: random ids (above the special tokens), seeded by n so runs compare."""
    return torch.randint(100, vocab_size, (1, n), generator=torch.Generator().manual_seed(n))


def transformers_engine(model: nn.Module) -> Engine:
    """TTFT on the transformers runtime: the prefill, which ends with the first token's logits."""

    def run(ids: torch.Tensor, plan: FillPlan) -> float:
        if torch.cuda.is_available() and ids.is_cuda:
            torch.cuda.synchronize()
        t = time.perf_counter()
        out = prefill(model, ids, plan)
        int(out.logits.argmax())  # the first token itself (synchronises a GPU)
        return time.perf_counter() - t

    return run


def speedup_over_lengths(results: dict) -> float:
    """Geometric mean of the paired speed-ups of `paired_ttft` results keyed by length."""
    ups = [r["speedup"] for r in results.values()]
    return math.exp(sum(math.log(u) for u in ups) / len(ups))


def ratio_ci(exact: list[float], fill: list[float], reps: int = 2000, seed: int = 0) -> tuple[float, float]:
    """Bootstrap 95% CI of median(exact)/median(fill), resampling paired repeats. Standard library, not
    scipy.stats.bootstrap: bench/gpu_lent_check.py runs `paired_ttft` on the lent GPU machine, which has no scipy."""
    rng = random.Random(seed)
    pairs = list(zip(exact, fill, strict=True))
    ratios = []
    for _ in range(reps):
        pick = rng.choices(pairs, k=len(pairs))
        ratios.append(statistics.median(a for a, _ in pick) / statistics.median(b for _, b in pick))
    ratios.sort()
    return ratios[int(0.025 * reps)], ratios[int(0.975 * reps) - 1]


def paired_ttft(engine: Engine, ids: torch.Tensor, plan: FillPlan, repeats: int = 5, warmup: int = 1) -> dict:
    """Alternate exact and `plan` on the same prompt; medians, ratio and its CI (seconds)."""
    for _ in range(warmup):
        engine(ids, FillPlan())
        engine(ids, plan)
    exact, fill = [], []
    for _ in range(repeats):
        exact.append(engine(ids, FillPlan()))
        fill.append(engine(ids, plan))
    lo, hi = ratio_ci(exact, fill)
    return {
        "tokens": int(ids.shape[1]),
        "repeats": repeats,
        "exact_median_s": statistics.median(exact),
        "fill_median_s": statistics.median(fill),
        "speedup": statistics.median(exact) / statistics.median(fill),
        "speedup_ci95": [lo, hi],
        "exact_s": exact,
        "fill_s": fill,
    }


def plan_of(point, maps) -> FillPlan:
    """The FillPlan of a `ttft_model.Point`: exact, or ridge with the point's split's maps (`maps[split]`)."""
    if point.split is None:
        return FillPlan()
    return FillPlan("ridge", point.split, maps[point.split], rows=point.rows)


def point_timer(engine: Engine, maps, vocab_size: int, device: torch.device | str = "cpu"):
    """A `ttft_model.Timer` on an engine: the TTFT of `random_prompt(n)` under a point (maps: split -> MapSet)."""
    prompts: dict[int, torch.Tensor] = {}

    def timer(point, n: int) -> float:
        ids = prompts.setdefault(n, random_prompt(vocab_size, n).to(device))
        return engine(ids, plan_of(point, maps))

    return timer
