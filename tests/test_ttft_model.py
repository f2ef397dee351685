"""The calibrated TTFT model (`ridgefill.ttft_model`): it recovers known costs, its choice of trial survives timing
noise that steers a per-trial timing, it refuses timings above the FLOP bound, and the card names what was timed."""

from __future__ import annotations

import math
import random

import numpy as np
import pytest
from optuna.trial import TrialState, create_trial

from ridgefill import report, search
from ridgefill.cost import Shape
from ridgefill.rows import ROWS
from ridgefill.ttft_model import (
    EXACT,
    CalibrationError,
    Point,
    Ratio,
    checked,
    corners,
    features,
    fit,
    measure,
    ratio_ci,
)

SMOL = Shape(576, 1536, 30, 9, 3, 64, 49152)  # SmolLM2-135M's geometry
# s per multiply-add: dense, protected, protected attention, bulk; s per row scored; s per request
TRUE = np.array([2.0e-11, 3.5e-11, 1.5e-11, 2.5e-11, 4.0e-5, 0.04])
ROWS_Q = ROWS.given(sink=4, select="question", window=8, reach=16)
SPLITS, TAILS, SHARE = [15, 18, 20, 22], [64, 128, 256], [0.05, 0.25]


def true_seconds(n: int, point: Point) -> float:
    return float(features(SMOL, n, point) @ TRUE)


def noisy_timer(spread: float, seed: int):
    """A fake engine: the true cost, each timing off by up to +-spread (uniform), as a loaded machine is."""
    rng = random.Random(seed)
    return lambda point, n: true_seconds(n, point) * (1 + rng.uniform(-spread, spread))


def points() -> list[Point]:
    return [*corners(SPLITS, TAILS, SHARE, ROWS_Q), Point(18, ROWS_Q.given(tail=128, share=0.15))]


def test_the_fit_recovers_known_costs_from_synthetic_timings():
    """Timings from known per-class costs, two lengths: without noise every coefficient comes back; with 1% noise
    the predictions at held-out configs stay within 1%. (Fails if a row class is dropped from FEATURES or the
    at-split layer is costed as a mapped one.)"""
    exact = measure(noisy_timer(0.0, 0), points(), [2048, 4096], min_rounds=2, max_rounds=2, warmup=0)
    assert np.array(fit(SMOL, exact, "fake", "cpu", "float32").coef) == pytest.approx(TRUE, rel=1e-4)
    ratios = measure(noisy_timer(0.01, 0), points(), [2048, 4096], min_rounds=5, max_rounds=5, warmup=0)
    model = checked(fit(SMOL, ratios, "fake", "cpu", "float32"))
    for p in (Point(20, ROWS_Q.given(tail=64, share=0.1)), Point(15, ROWS_Q.given(tail=256, share=0.2))):
        for n in (2048, 4096, 3000):
            truth = true_seconds(n, EXACT) / true_seconds(n, p)
            assert model.ratio(n, p) == pytest.approx(truth, rel=0.01)
    assert all(abs(r["error"]) < 0.01 for r in model.table())


def test_a_noisy_point_pulls_the_fit_by_its_own_weight():
    """One corner timed 15% slow with a CI of +-20% (a busy machine) beside tight ones: weighted by its CI it
    moves the predictions at held-out configs by under 2%; counted as tight it would move them by more."""
    clean = measure(noisy_timer(0.0, 0), points(), [2048], min_rounds=2, max_rounds=2, warmup=0)
    off = Point(15, ROWS_Q.given(tail=256, share=0.25))
    bad = [Ratio(m.point, m.length, m.ratio / 1.15, m.ratio / 1.15 * 0.8, m.ratio / 1.15 * 1.2, 6, m.exact_s,
                 m.point_s * 1.15) if m.point == off else m for m in clean]  # fmt: skip
    tight = [Ratio(m.point, m.length, m.ratio, m.ratio * 0.99, m.ratio * 1.01, 6, m.exact_s, m.point_s) for m in bad]
    held = (Point(15, ROWS_Q.given(tail=64, share=0.2)), Point(20, ROWS_Q.given(tail=128, share=0.1)))

    def worst(ratios: list[Ratio]) -> float:
        model = fit(SMOL, ratios, "fake", "cpu", "float32")
        truth = [true_seconds(2048, EXACT) / true_seconds(2048, p) for p in held]
        return max(abs(model.ratio(2048, p) / t - 1) for p, t in zip(held, truth, strict=True))

    assert worst(bad) < 0.02 < worst(tight)


def _trials(speed) -> list:
    """Eight trials over the search space with fixed RULER deltas; their speed-up from `speed(params)`."""
    grid = [(15, 256, 0.25, -14.0), (15, 64, 0.05, -30.0), (18, 256, 0.15, -6.0), (18, 128, 0.20, -9.0),
            (20, 64, 0.05, -8.0), (20, 256, 0.25, -2.0), (22, 128, 0.10, -1.0), (18, 64, 0.25, -11.0)]  # fmt: skip
    out = []
    for i, (split, tail, share, delta) in enumerate(grid):
        p = search.Params(
            split, 1e-2, ROWS.given(tail=tail, share=share, sink=4, select="question", window=8, reach=16)
        )
        t = create_trial(state=TrialState.COMPLETE, values=[delta, speed(p)], user_attrs={"params": p.as_dict()})
        t.number = i
        out.append(t)
    return out


def _predicted_choice(spread: float, seed: int) -> int:
    ratios = measure(noisy_timer(spread, seed), points(), [2048], min_rounds=3, max_rounds=30, warmup=0)
    model = fit(SMOL, ratios, "fake", "cpu", "float32")
    return report.choose(_trials(lambda p: model.speedup(Point(p.split, p.rows), [2048])), 10.0).number


def _timed_choice(spread: float, seed: int) -> int:
    """What per-trial timing (3 paired repeats, the median ratio) would choose under the same noise."""
    timer = noisy_timer(spread, seed)

    def speed(p):
        pt = Point(p.split, p.rows)
        ex = sorted(timer(EXACT, 2048) for _ in range(3))[1]
        return ex / sorted(timer(pt, 2048) for _ in range(3))[1]

    return report.choose(_trials(speed), 10.0).number


def test_timing_noise_cannot_change_the_choice():
    """+-40% on every timing of a fake engine: the trial chosen by the calibrated model's prediction is the one
    the noise-free costs choose, for every noise seed; choosing by per-trial timings under the same noise does
    not (the test would fail if trials were ranked by their own timings). The feasible runner-up is 7% slower
    than the best: a gap a 2-core machine's load easily hides from a 3-repeat timing (20 of 20 seeds right by
    prediction, 4 of 20 by timing, checked when written)."""
    truth = report.choose(_trials(lambda p: true_seconds(2048, EXACT) / true_seconds(2048, Point(p.split, p.rows))),
                          10.0)  # fmt: skip
    assert truth.number == 4  # S=20, few protected rows: the fastest within the limit
    assert {_predicted_choice(0.4, seed) for seed in range(6)} == {truth.number}
    assert {_timed_choice(0.4, seed) for seed in range(6)} != {truth.number}


def test_a_timing_above_its_flop_bound_is_refused():
    """A calibration point whose whole CI lies above the FLOP bound is physically impossible: the fit refuses it
    with one line naming the point; a point inside its bound fits."""
    p = Point(22, ROWS_Q.given(tail=256, share=0.15))
    exact = true_seconds(2048, EXACT)
    fake = Ratio(p, 2048, 1.405, 1.39, 1.42, 3, exact, exact / 1.405)  # the 1.405x of a 1.21x bound
    with pytest.raises(CalibrationError, match=r"S=22 .* above its FLOP bound 1\.2"):
        fit(SMOL, [fake], "fake", "cpu", "float32")


def test_the_model_refuses_to_miss_its_own_calibration_points():
    """An engine whose time is not linear in the row classes (here: a point 30% slower than its cost, measured
    tightly) leaves a calibration point outside its CI: `checked` names it instead of ranking trials by it."""
    slow = Point(15, ROWS_Q.given(tail=64, share=0.0))

    def timer(point, n):
        return true_seconds(n, point) * (1.3 if point == slow else 1.0)

    ratios = measure(timer, points(), [2048], min_rounds=3, max_rounds=3, warmup=0)
    with pytest.raises(CalibrationError, match="misses its own calibration points"):
        checked(fit(SMOL, ratios, "fake", "cpu", "float32"))


def test_paired_rounds_stop_at_the_target_or_the_cap():
    """Rounds go on until every ratio's CI half-width is within the target, else stop at the cap, and each
    ratio's CI is the t-interval of the paired log ratios."""
    quiet = measure(noisy_timer(0.001, 1), points()[:2], [1024], min_rounds=3, max_rounds=12, warmup=0)
    assert all(r.rounds == 3 and r.half_width <= 0.03 for r in quiet)
    loud = measure(noisy_timer(0.4, 1), points()[:2], [1024], min_rounds=3, max_rounds=7, warmup=0)
    assert all(r.rounds == 7 for r in loud)
    r, lo, hi = ratio_ci([2.0, 2.2, 1.8], [1.0, 1.0, 1.0])
    logs = np.log([2.0, 2.2, 1.8])
    assert r == pytest.approx(math.exp(logs.mean())) and lo < r < hi
