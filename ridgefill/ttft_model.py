"""A calibrated TTFT model: what the tuner ranks trials by, so that no single noisy timing picks the split.

Why: a 3-repeat wall-clock speed-up per trial moves by tens of percent between runs on a busy machine (one
trial measured 1.405x against a FLOP bound of 1.21x, and the search followed it). RidgeFill's cost is
predictable: every row class has a known FLOP count (`ridgefill.flops`), so a few coefficients per engine and
machine, fitted once per study on paired timings at the corners of its search space, predict every trial.

The model: TTFT(n, config) = sum_k c_k * x_k, with the row classes
- `dense`: FLOPs of layers that run every row (all layers for exact, 0..S-1 for RidgeFill);
- `protected`: FLOPs of the protected rows in the late layers but their attention (gathered rows: their own
  efficiency);
- `protected_attention`: those rows' attention, counted over all n keys: the transformers runtime computes it
  masked over the whole prompt, vLLM causally up to each row (about half for rows spread through the prompt);
  its own coefficient says which, and it grows with n faster than the rest (the 8K held-out configs missed by
  up to 6.8% while it was counted at n/2 inside `protected`: docs/BENCHMARKS.md 12f);
- `bulk`: FLOPs of bulk rows at and after the split (k/v projections, the maps);
- `score`: rows the question selector scores (its pass over the early layers' keys), else 0;
- `overhead`: 1 per request.
Calibration measures exact and each corner paired and alternating (one round = exact, then every corner), per
TTFT length, until each ratio's 95% CI half-width is at most `target` or `max_rounds` is reached. Each corner's
time is taken as exact's median divided by its paired ratio, so drift between rounds (and between the engines
of a vLLM calibration, one per split) cancels.
The coefficients are a non-negative least-squares fit (`scipy.optimize.nnls`) of relative error, each point
weighted by the inverse of its CI half-width: a corner timed noisily (at 2K on two busy cores one CI spanned
+-17%) would otherwise pull a coefficient as hard as a tight one (the transformers 2K held-out config missed by
7.4% unweighted, 4.4% weighted on the same timings: docs/BENCHMARKS.md 12h).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field

import numpy as np
from scipy import optimize, stats

from ridgefill.flops import layer_flops, speedup_bound
from ridgefill.rows import RowPolicy

FEATURES = ("dense", "protected", "protected_attention", "bulk", "score", "overhead")
TARGET = 0.03  # each ratio's 95% CI half-width, relative
MAX_ROUNDS = 12


class CalibrationError(RuntimeError):
    """The TTFT model does not explain its own calibration points, or a timing breaks its FLOP bound."""


@dataclass(frozen=True)
class Point:
    """A configuration timed against exact: a split and a row policy (split None: exact itself)."""

    split: int | None
    rows: RowPolicy = field(default_factory=RowPolicy)

    def label(self) -> str:
        if self.split is None:
            return "exact"
        r = self.rows
        return f"S={self.split} tail {r.tail} share {r.share:g} {r.select}"


EXACT = Point(None)


def features(shape, n: int, point: Point) -> np.ndarray:
    """The row-class amounts (FEATURES) of one n-token prompt under `point` on a model of `shape`."""
    full, bulk_map, bulk_split = layer_flops(shape, ctx=n / 2)
    linear = layer_flops(shape, ctx=0)[0]  # a full row but its attention
    attention = layer_flops(shape, ctx=n)[0] - linear  # one row's attention over all n keys
    layers = shape.num_hidden_layers
    if point.split is None:
        return np.array([n * layers * full, 0.0, 0.0, 0.0, 0.0, 1.0])
    s, rows = point.split, point.rows
    late = layers - s
    protected = rows.protected(n)
    bulk = (n - protected) * (bulk_split + (late - 1) * bulk_map)
    score = float(n) if rows.by_question and protected < n else 0.0
    if protected >= n:  # a prompt no longer than its protected rows runs stock
        return features(shape, n, EXACT)
    return np.array([n * s * full, protected * late * linear, protected * late * attention, bulk, score, 1.0])


def bound(shape, n: int, point: Point) -> float:
    """The FLOP bound of `point` at n tokens (`flops.speedup_bound`)."""
    return speedup_bound(shape, n, point.split, point.rows.protected(n))


def above(lo: float, limit: float) -> bool:
    """Whether a measured ratio's CI lies wholly above its FLOP bound: a timing no configuration can have."""
    return lo > limit * (1 + 1e-6)


def geomean(values) -> float:
    v = list(values)
    return math.exp(sum(math.log(x) for x in v) / len(v))


# --- paired measurement -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Ratio:
    """A paired measurement of one point at one length: exact/point median ratio and its 95% CI over rounds."""

    point: Point
    length: int
    ratio: float
    lo: float
    hi: float
    rounds: int
    exact_s: float  # exact's median over the whole run at this length
    point_s: float  # exact_s / ratio

    @property
    def half_width(self) -> float:
        return (self.hi - self.lo) / 2 / self.ratio


def ratio_ci(exact: Sequence[float], fill: Sequence[float]) -> tuple[float, float, float]:
    """(ratio, lo, hi): the geometric mean of the paired ratios exact/fill and its 95% t-interval (log scale)."""
    logs = np.log(np.asarray(exact, dtype=float) / np.asarray(fill, dtype=float))
    mean = float(logs.mean())
    if len(logs) < 2 or float(logs.std()) == 0.0:
        return math.exp(mean), math.exp(mean), math.exp(mean)
    lo, hi = stats.t.interval(0.95, len(logs) - 1, loc=mean, scale=stats.sem(logs))
    return math.exp(mean), math.exp(lo), math.exp(hi)


Timer = Callable[[Point, int], float]  # seconds to the first token of an n-token prompt under a point


def measure(
    timer: Timer, points: Sequence[Point], lengths: Sequence[int], *, min_rounds: int = 3,
    max_rounds: int = MAX_ROUNDS, target: float = TARGET, warmup: int = 1,
) -> list[Ratio]:  # fmt: skip
    """Paired, alternating timings of every point against exact at every length, round after round, until every
    ratio's CI half-width is within `target` or `max_rounds` (whichever first; `Ratio.rounds` says which)."""
    out = []
    for n in lengths:
        for _ in range(warmup):
            for p in (EXACT, *points):
                timer(p, n)
        exact: list[float] = []
        fill: dict[Point, list[float]] = {p: [] for p in points}
        while len(exact) < max_rounds:
            exact.append(timer(EXACT, n))
            for p in points:
                fill[p].append(timer(p, n))
            if len(exact) >= min_rounds and all(_half(exact, fill[p]) <= target for p in points):
                break
        out += [_ratio(p, n, exact, fill[p]) for p in points]
    return out


def _half(exact: Sequence[float], fill: Sequence[float]) -> float:
    r, lo, hi = ratio_ci(exact, fill)
    return (hi - lo) / 2 / r


def _ratio(point: Point, n: int, exact: Sequence[float], fill: Sequence[float]) -> Ratio:
    r, lo, hi = ratio_ci(exact, fill)
    e = float(np.median(exact))
    return Ratio(point, n, r, lo, hi, len(exact), e, e / r)


# --- the model ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TTFTModel:
    """Seconds per unit of each row class (FEATURES) on one engine and machine, with the points it was fitted
    on; `speedup` is what every trial's TTFT objective is."""

    engine: str
    device: str
    dtype: str
    shape: object  # `ridgefill.cost.Shape`
    coef: tuple[float, ...]
    points: tuple[Ratio, ...] = ()
    conditions: dict = field(default_factory=dict)  # threads, load average: how the calibration ran

    def seconds(self, n: int, point: Point) -> float:
        return float(features(self.shape, n, point) @ np.asarray(self.coef))

    def ratio(self, n: int, point: Point) -> float:
        """Predicted exact/point TTFT ratio at n tokens."""
        return self.seconds(n, EXACT) / self.seconds(n, point)

    def speedup(self, point: Point, lengths: Sequence[int]) -> float:
        """Predicted speed-up: the geometric mean over the TTFT lengths (as the measured objective was)."""
        return geomean([self.ratio(n, point) for n in lengths])

    def misses(self) -> list[tuple[Ratio, float]]:
        """Calibration points whose predicted ratio lies outside the measured 95% CI."""
        out = []
        for m in self.points:
            pred = self.ratio(m.length, m.point)
            if not m.lo - 1e-9 <= pred <= m.hi + 1e-9:
                out.append((m, pred))
        return out

    def table(self) -> list[dict]:
        """One row per calibration point: measured ratio and CI, rounds, prediction, error and FLOP bound."""
        return [self.row(m) for m in self.points]

    def row(self, m: Ratio, label: str = "") -> dict:
        """A measured point against this model's prediction (`label` before the point's own, e.g. "held-out")."""
        pred = self.ratio(m.length, m.point)
        return {
            "point": " ".join(filter(None, (label, m.point.label()))), "length": m.length, "measured": m.ratio,
            "lo": m.lo, "hi": m.hi, "rounds": m.rounds, "predicted": pred, "error": pred / m.ratio - 1,
            "bound": bound(self.shape, m.length, m.point), "exact_s": m.exact_s,
        }  # fmt: skip

    def as_dict(self) -> dict:
        return {
            "engine": self.engine, "device": self.device, "dtype": self.dtype, "features": list(FEATURES),
            "coef": list(self.coef), "conditions": self.conditions, "points": self.table(),
            "shape": asdict(self.shape),
        }  # fmt: skip


def fit(
    shape, ratios: Sequence[Ratio], engine: str, device: str, dtype: str, conditions: dict | None = None
) -> TTFTModel:
    """Non-negative least squares on relative error over every calibration point (each point's time, and
    exact's at each length), weighted by 1 / each point's CI half-width (exact's: its length's tightest);
    raises CalibrationError when a measured ratio breaks its FLOP bound."""
    for m in ratios:
        b = bound(shape, m.length, m.point)
        if above(m.lo, b):
            raise CalibrationError(
                f"{m.point.label()} at {m.length} tokens measured {m.ratio:.3f}x [{m.lo:.3f}, {m.hi:.3f}], above its "
                f"FLOP bound {b:.3f}x: the timing is wrong (another load on the machine?); rerun the calibration"
            )
    rows, times, spread, exact = [], [], [], {}
    for n in sorted({m.length for m in ratios}):  # one exact time per length: the runs' (one per vLLM engine) mean
        exact[n] = float(np.exp(np.mean(np.log(sorted({m.exact_s for m in ratios if m.length == n})))))
        rows.append(features(shape, n, EXACT))
        times.append(exact[n])
        spread.append(min(m.half_width for m in ratios if m.length == n))
    for m in ratios:  # each point as its paired ratio says, against that common exact time
        rows.append(features(shape, m.length, m.point))
        times.append(exact[m.length] / m.ratio)
        spread.append(m.half_width)
    a, t = np.array(rows), np.array(times)
    sigma = np.maximum(np.array(spread), 1e-3)  # a noise-free (synthetic) timing: equal weights
    scale = a.max(axis=0)
    scale[scale == 0] = 1.0
    w = (a / scale) / (t * sigma)[:, None]  # relative error over its CI: each row divided by time and half-width
    coef, _ = optimize.nnls(w, 1.0 / sigma)
    return TTFTModel(engine, device, dtype, shape, tuple(float(c) for c in coef / scale), tuple(ratios),
                     conditions or {})  # fmt: skip


def from_rate(shape, rate: float, engine: str, device: str, dtype: str) -> TTFTModel:
    """An uncalibrated model from a prefill rate (FLOP/s): every multiply-add of every class at that rate, no
    overhead. What `ridgefill tune --plan` estimates with before any calibration has run."""
    per = 2.0 / rate  # layer_flops counts multiply-adds
    return TTFTModel(
        engine, device, dtype, shape, (per, per, per, per, 0.0, 0.0), (), {"source": "rates (uncalibrated)"}
    )


def checked(model: TTFTModel) -> TTFTModel:
    """The model, or CalibrationError naming every calibration point it misses by more than that point's CI."""
    missed = model.misses()
    if missed:
        what = "; ".join(
            f"{m.point.label()} at {m.length}: measured {m.ratio:.3f}x [{m.lo:.3f}, {m.hi:.3f}], predicted {p:.3f}x"
            for m, p in missed
        )
        raise CalibrationError(
            f"the TTFT model misses its own calibration points ({what}); rerun on an idle machine, or time each "
            "trial instead (objectives.ttft.per_trial: true)"
        )
    return model


def corners(splits: Sequence[int], tails: Sequence[int], share: Sequence[float], rows: RowPolicy) -> list[Point]:
    """The calibration points of a search space: the lowest and highest split, each with the fewest protected
    rows (smallest tail, share 0) and the most (largest tail, largest share), with the study's selector."""
    few = rows.given(tail=min(tails), share=0.0)
    most = rows.given(tail=max(tails), share=max(share))
    return [Point(s, r) for s in sorted({min(splits), max(splits)}) for r in (few, most)]


def conditions() -> dict:
    """How a timing ran: torch threads and the machine's load average (another job on the cores shows here)."""
    import os

    import torch

    load = os.getloadavg() if hasattr(os, "getloadavg") else (float("nan"),) * 3
    return {"threads": torch.get_num_threads(), "cpus": os.cpu_count(), "load_1m": round(load[0], 2)}
