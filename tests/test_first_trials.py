"""A small trial budget brackets the split range first (issue 13): the ends, then S bisected."""

from __future__ import annotations

from pathlib import Path

import pytest

from ridgefill import search
from ridgefill.study import Search, load_study

STUDY = Path(__file__).resolve().parents[1] / "studies" / "smollm2-135m.yaml"


@pytest.mark.parametrize(
    ("splits", "order"),
    [
        ([15, 18, 20, 22], [22, 15, 18, 20]),
        ([12, 16, 20], [20, 12, 16]),
        ([18, 22, 26, 30], [30, 18, 26, 22]),  # 22 and 26 tie around 24: the larger, safer one first
        ([1, 2, 3, 4, 5, 6, 7, 8, 9], [9, 1, 5, 7, 3, 8, 6, 4, 2]),
        ([3, 9], [9, 3]),
        ([7], [7]),
    ],
)
def test_bracket_order(splits, order):
    assert search.bracket(splits) == order


@pytest.mark.parametrize(("budget", "want"), [(1, [20]), (2, [20, 12]), (3, [20, 12, 16]), (8, [20, 12, 16])])
def test_first_trials_cover_the_splits_a_small_budget_allows(budget, want):
    space = load_study(STUDY, {"search": {"splits": [12, 16, 20]}}).search
    starts = search.first_trials(space, budget)
    assert [s["split"] for s in starts] == want
    mid = (space.lam[0] * space.lam[1]) ** 0.5  # the middle lambda on the log scale
    assert all(s["tail"] == max(space.tails) and s["lam"] == pytest.approx(mid) for s in starts)


def test_three_splits_three_trials_every_split_is_tried(tmp_path):
    """The issue's case: 3 candidate splits, a budget of 3 on a new model; every split runs once."""
    cfg = load_study(STUDY, {"budget": {"trials": 3}, "search": {"splits": [12, 16, 20]}})
    study = search.open_study(cfg, search.storage(None, tmp_path, cfg.name))
    assert search.enqueue_first(study, cfg) == 3

    def evaluate(batch):
        return [search.Outcome(-(20 - p.split) * 2.0, 1.0 + (30 - p.split) / 10) for _, p in batch]

    assert search.optimize(study, cfg, evaluate) == 3
    assert sorted(t.params["split"] for t in study.trials) == [12, 16, 20]


def test_with_the_question_selector_the_first_trials_start_mid_share():
    space = Search(splits=[15, 18, 22], tails=[64, 256], share=(0.0, 0.2), select="question")
    assert {p["share"] for p in search.first_trials(space, 3)} == {0.1}
    assert {p["share"] for p in search.first_trials(space.model_copy(update={"select": "rarity"}), 3)} == {0.0}
