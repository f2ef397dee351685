"""bench/gpu_vllm_smoke.py on a machine without a usable vLLM, and its bf16-tolerant plumb comparison."""

from __future__ import annotations

import json
import sys
import types
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

import gpu_vllm_smoke  # noqa: E402


def _no_build(*_args, **_kwargs):
    raise AssertionError("the smoke built something before checking vLLM")


@pytest.mark.parametrize(
    ("vllm_module", "words"),
    [(None, "vllm is not importable"), (types.SimpleNamespace(__version__="0.31.2"), "outside the plugin's")],
    ids=["no-vllm", "other-version"],
)
def test_smoke_skips_before_building_anything(tmp_path, monkeypatch, vllm_module, words):
    monkeypatch.setitem(sys.modules, "vllm", vllm_module)  # None: `import vllm` raises ImportError
    monkeypatch.setattr(gpu_vllm_smoke, "tiny_model_and_maps", _no_build)
    monkeypatch.setattr(gpu_vllm_smoke, "run_engine", _no_build)
    out = tmp_path / "smoke.json"
    report = gpu_vllm_smoke.main(["--out", str(out)])
    assert set(report) == {"skipped"} and words in report["skipped"]
    assert json.loads(out.read_text()) == report


def _result(tokens, tops):
    return {"tokens": tokens, "top": [{str(t): lp for t, lp in top.items()} for top in tops]}


def test_plumb_comparison_reports_flips_and_tolerates_only_near_ties():
    stock = [_result([1, 2], [{1: -0.50, 3: -0.52}, {2: -0.1}]), _result([5], [{5: -0.2, 6: -3.0}])]
    same = [_result([1, 2], [{1: -0.51, 3: -0.52}, {2: -0.1}]), _result([5], [{5: -0.2, 6: -3.0}])]
    cmp = gpu_vllm_smoke.topk_compare(stock, same, tol=0.05)
    assert cmp["passed"] and cmp["flips"] == [] and cmp["max_topk_gap"] == pytest.approx(0.01)
    near = [_result([3, 9], [{3: -0.49, 1: -0.52}, {9: -0.1}]), same[1]]  # 3 vs 1: stock 0.02 apart
    cmp = gpu_vllm_smoke.topk_compare(stock, near, tol=0.05)
    assert cmp["passed"] and cmp["flips"] == [{"request": 0, "step": 0, "near_tie": True}]
    far = [same[0], _result([6], [{6: -0.1, 5: -0.3}])]  # 6 vs 5: stock 2.8 apart
    cmp = gpu_vllm_smoke.topk_compare(stock, far, tol=0.05)
    assert not cmp["passed"] and cmp["flips"] == [{"request": 1, "step": 0, "near_tie": False}]
    drift = [_result([1, 2], [{1: -0.7, 3: -0.52}, {2: -0.1}]), same[1]]  # no flip, a gap over tol
    assert not gpu_vllm_smoke.topk_compare(stock, drift, tol=0.05)["passed"]
