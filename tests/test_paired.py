"""Paired statistics on inputs whose answers are known by hand."""

from __future__ import annotations

import math

import numpy as np
import pytest

from ridgefill.evals.paired import (
    Estimate,
    bootstrap_mean,
    bootstrap_mean_of_tasks,
    mcnemar_exact,
    pair,
    paired_summary,
    region_breakdown,
    sign_test,
)


def test_mcnemar_by_hand():
    # b=1, c=5: n=6, P(X<=1) = (1 + 6) / 64, two-sided 14/64
    assert mcnemar_exact(1, 5) == pytest.approx(14 / 64)
    assert mcnemar_exact(5, 1) == pytest.approx(14 / 64)
    assert mcnemar_exact(0, 0) == 1.0
    assert mcnemar_exact(3, 3) == 1.0  # symmetric: capped at 1
    assert mcnemar_exact(0, 10) == pytest.approx(2 / 1024)


def test_mcnemar_equals_scipy_binomtest():
    stats = pytest.importorskip("scipy.stats")
    for b, c in [(0, 7), (2, 9), (4, 4), (13, 30), (1, 1)]:
        assert mcnemar_exact(b, c) == pytest.approx(stats.binomtest(c, b + c, 0.5).pvalue, rel=1e-12)


def test_sign_test_counts_only_discordant_pairs():
    exact = [100, 100, 100, 0, 0, 50, 100]
    plan = [0, 100, 100, 0, 100, 25, 0]  # worse: 0, 5, 6 -> 3; better: 4 -> 1
    assert sign_test(plan, exact) == pytest.approx(mcnemar_exact(3, 1))
    assert sign_test(exact, exact) == 1.0


def test_bootstrap_ci_contains_mean_and_is_seeded():
    rng = np.random.default_rng(3)
    d = rng.choice([-100.0, 0.0, 0.0, 100.0], size=40)
    est = bootstrap_mean(d, seed=7)
    assert est.n == 40 and est.mean == pytest.approx(d.mean())
    assert est.lo <= est.mean <= est.hi and est.lo < est.hi
    assert bootstrap_mean(d, seed=7) == est
    # the percentile CI of a mean of 40 draws is close to the normal one, +-1.96 sd/sqrt(n)
    half = 1.96 * d.std(ddof=1) / math.sqrt(d.size)
    assert (est.hi - est.lo) / 2 == pytest.approx(half, rel=0.2)


def test_degenerate_all_equal_gives_zero_width():
    assert bootstrap_mean([0.0] * 12) == Estimate(12, 0.0, 0.0, 0.0)
    assert bootstrap_mean([-100.0] * 5) == Estimate(5, -100.0, -100.0, -100.0)
    with pytest.raises(ValueError, match="non-empty"):
        bootstrap_mean([])


def test_overall_weighs_tasks_equally():
    est = bootstrap_mean_of_tasks([[0.0] * 10, [-100.0, -100.0]])
    assert est.mean == -50.0 and est.lo == est.hi == -50.0 and est.n == 12


def _rows():
    rows = []
    exact = {"a": [100, 100, 0, 100], "b": [100, 0, 100]}
    plan = {"a": [100, 0, 0, 100], "b": [100, 100, 100]}
    region = {"a": ["bulk", "bulk", "tail", "tail"], "b": ["bulk", "tail", "bulk"]}
    for task in exact:
        for i, (e, p) in enumerate(zip(exact[task], plan[task], strict=True)):
            rows.append({"plan": "exact", "task": task, "length": 2048, "index": i, "score": e, "region": "exact"})
            rows.append({"plan": "r", "task": task, "length": 2048, "index": i, "score": p, "region": region[task][i]})
    rows.append({"plan": "r", "task": "a", "length": 2048, "index": 9, "score": 0, "region": "bulk"})  # unpaired
    return rows


def test_pair_and_summary():
    rows = _rows()
    cells = pair(rows, "r")
    assert set(cells) == {("a", 2048), ("b", 2048)}
    p, e = cells[("a", 2048)]
    assert p.tolist() == [100, 0, 0, 100] and e.tolist() == [100, 100, 0, 100]  # index 9 has no exact pair
    s = paired_summary(rows, "r")
    assert s["tasks"][("a", 2048)]["delta"].mean == -25.0
    assert s["tasks"][("b", 2048)]["delta"].mean == pytest.approx(100 / 3)
    assert s["tasks"][("a", 2048)]["p"] == 1.0  # one discordant pair
    overall = s["overall"][2048]
    assert overall["delta"].mean == pytest.approx((-25 + 100 / 3) / 2)
    assert overall["delta"].lo <= overall["delta"].mean <= overall["delta"].hi


def test_region_breakdown():
    out = region_breakdown(_rows(), "r")
    assert out["bulk"] == {"n": 4, "score": 75.0, "reference": 100.0}
    assert out["tail"]["n"] == 3
    assert region_breakdown(_rows(), "r", tasks=["b"])["bulk"]["n"] == 2
