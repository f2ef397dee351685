"""bench/maps_dtype.py (issue 25: maps in bf16 against float32) runs its core on a tiny Llama: a real capture and fit,
every condition scored, float32 agreeing with ridgefill's own held-out scorer, bf16 errors finite."""

from __future__ import annotations

import copy
import math
import sys
from pathlib import Path

import pytest
import torch

from ridgefill.corpus import Corpus, token_stream
from ridgefill.evals.nll import documents
from ridgefill.heldout import heldout_activations, score_maps
from ridgefill.rows import RowPolicy
from ridgefill.steps import CalibrationText
from tests.conftest import prose_text

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

import maps_dtype  # noqa: E402

STUDY = Path(__file__).resolve().parents[1] / "studies" / "smollm2-135m.yaml"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, tiny_models, tokenizer):
    """The tiny Llama in float32 and a bf16 copy, maps at split 2 fitted on the first pydoc windows, and three
    held-out windows from far later in the text."""
    model32 = tiny_models["llama"]
    model16 = copy.deepcopy(model32).to(torch.bfloat16)
    text = CalibrationText("pydoc", window=128, max_windows=12, heldout=2)
    maps = maps_dtype.fit_map_set(model32, tokenizer, text, 2, 1e-3, tmp_path_factory.mktemp("maps_dtype"))
    held = prose_text()[200000:230000]
    wins = documents(token_stream(Corpus("held", [held]), tokenizer), 160, 3)
    return model32, model16, maps, wins


def test_report_structure_and_bf16_finite(tiny):
    model32, model16, maps, wins = tiny
    report = maps_dtype.measure(model32, model16, maps, wins, RowPolicy(tail=8), scored=16)
    assert report["split"] == 2 and report["layers"] == [3, 4, 5] and report["windows"] == 3
    assert set(report["quality"]) == set(maps_dtype.CONDITIONS)
    for cond in maps_dtype.CONDITIONS:
        assert set(report["quality"][cond]) == {"3", "4", "5"}
        for fill in maps_dtype.FILLS:
            m = report["overall"][cond][fill]
            assert set(m) == set(maps_dtype.METRICS) and all(math.isfinite(v) for v in m.values()), (cond, fill, m)
            assert m["k_rel"] > 0 and m["v_rel"] > 0
    assert all(math.isfinite(v) for v in report["bf16_exact_vs_f32"]["overall"].values())
    # the bf16 model's own exact K/V differ from the float32 model's (what the bf16-model row is measured against)
    assert report["bf16_exact_vs_f32"]["overall"]["k_rel"] > 0
    # float32 maps beat identity fill on the tiny fit (test_maps.py makes this claim on the late layers' K/V)
    f32 = report["overall"]["f32"]
    assert f32["ridge"]["k_rel"] + f32["ridge"]["v_rel"] < 0.95 * (f32["identity"]["k_rel"] + f32["identity"]["v_rel"])
    for name in ("f32", "bf16"):
        assert len(report["dnll"][name]) == 3 and all(math.isfinite(d["dnll"]) for d in report["dnll"][name])
    paired = report["dnll_paired"]
    assert paired["n"] == 3 and paired["diff_ci95"][0] <= paired["diff"] <= paired["diff_ci95"][1]
    pairs = {f"{c}:{k}" for c in ("bf16-maps", "bf16-model") for k in ("k_rel", "v_rel")}
    assert set(report["kv_ratio_vs_f32"]) == pairs
    md = maps_dtype.table(report)
    assert "| f32 | ridge |" in md and "| bf16-model | identity |" in md and "bf16 - f32" in md


def test_float32_condition_is_ridgefills_heldout_score(tiny):
    """The f32 condition is what `heldout.score_maps` reports for the same window (the bench adds only dtypes)."""
    model32, model16, maps, wins = tiny
    quality, _ = maps_dtype.window_quality(model32, model16, wins[0][None], maps.weights)
    ref = score_maps(model32, heldout_activations(model32, wins[0][None], 2), maps.weights)
    for layer, by_fill in ref.items():
        for fill, metrics in by_fill.items():
            for key in maps_dtype.METRICS:
                assert quality["f32"][layer][fill][key] == pytest.approx(metrics[key], rel=1e-4, abs=1e-5)


def test_paired_difference():
    a, b = [1.0, 2.0, 3.0, 4.0], [1.2, 2.1, 3.5, 4.2]
    p = maps_dtype.paired_difference(a, b)
    assert p["n"] == 4 and p["diff"] == pytest.approx(0.25) and p["ratio"] == pytest.approx(11.0 / 10.0)
    assert p["diff_ci95"][0] < 0.25 < p["diff_ci95"][1] and p["ratio_ci95"][0] <= 1.1 <= p["ratio_ci95"][1]
    assert maps_dtype.mean_ci([0.5, 0.5])["ci95"] == [0.5, 0.5]


def test_refuses_the_calibration_text_as_held_out():
    with pytest.raises(SystemExit):
        maps_dtype.main([str(STUDY), "--source", "pydoc"])
