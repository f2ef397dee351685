"""bench/ruler_suite.py's plumbing, no model: how a plan is named in OUT.jsonl (its rows pair only with rows of
the same settings) and which haystack a run reads (a report set must not be the half that chose settings)."""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from ridgefill.rows import RowPolicy
from ridgefill.runtime import FillPlan

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

import ruler_suite  # noqa: E402


def test_a_plan_is_named_by_every_row_setting():
    rows = RowPolicy(sink=4, tail=256, share=0.15, select="question", window=8, reach=16)
    assert ruler_suite.plan_config(FillPlan("identity", split=18, rows=rows), "vllm") == {
        "mode": "identity", "split": 18, "sink": 4, "tail": 256, "share": 0.15, "select": "question",
        "query": 32, "window": 8, "score_layers": 3, "reach": 16, "engine": "vllm",
    }  # fmt: skip
    assert "reach" not in ruler_suite.plan_config(FillPlan())  # reach 0: rows scored before reach existed pair


def test_the_haystack_is_a_named_source_or_one_half_of_a_folder(tmp_path):
    for name in ("d", "a", "c", "b"):
        (tmp_path / f"{name}.txt").write_text(name)
    args = SimpleNamespace(haystack=str(tmp_path), half="evaluation")
    assert [Path(f).name for f in ruler_suite.haystack_source(args)] == ["c.txt", "d.txt"]
    args.half = "calibration"
    assert [Path(f).name for f in ruler_suite.haystack_source(args)] == ["a.txt", "b.txt"]
    assert ruler_suite.haystack_source(SimpleNamespace(haystack="prose", half="calibration")) == "prose"
    with pytest.raises(SystemExit, match="fewer than two"):
        ruler_suite.haystack_source(SimpleNamespace(haystack=str(tmp_path / "a.txt.d"), half="evaluation"))
