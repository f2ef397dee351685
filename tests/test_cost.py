"""The study cost model's arithmetic on the shipped study files, the budget refusal, and `tune --plan`
offline (no weights, no network)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from typer.testing import CliRunner

from ridgefill import cost, objectives
from ridgefill.capture import stats_bytes
from ridgefill.cli import app
from ridgefill.evals.ruler import SPECS
from ridgefill.study import load_study
from ridgefill.ttft_model import EXACT, features

STUDIES = Path(__file__).resolve().parents[1] / "studies"
# a round-number machine, so the expected seconds below can be worked by hand
FLAT = cost.Rates("flat", prefill=1e11, prefill_hf=5e10, f64=1e10, host_f64=1e10, bandwidth=1e10, disk=1e9)


@pytest.fixture(autouse=True)
def _offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


def qwen3():
    return load_study(STUDIES / "qwen3-8b.yaml")


def test_prefill_flops_by_hand():
    # Qwen3-8B, one 4096-token prompt: per row and layer q+o 2*4096*32*128, k+v 2*4096*8*128,
    # MLP 3*4096*12288, attention over 2048 rows on average 2*2048*32*128 multiply-adds; lm head on one row
    sh = cost.shape_of(qwen3())
    per_row = 2 * 4096 * 4096 + 2 * 4096 * 1024 + 3 * 4096 * 12288 + 2 * 2048 * 4096
    assert cost.prefill_flops(sh, 4096) == 2 * (4096 * 36 * per_row + 151936 * 4096)
    assert sh.params == 36 * (2 * 4096 * 4096 + 2 * 4096 * 1024 + 3 * 4096 * 12288) + 151936 * 4096


def test_qwen3_8b_capture_and_statistics_arithmetic():
    st = qwen3()
    sh = cost.shape_of(st)
    e = cost.estimate(st, sh, FLAT)
    # 1M tokens = 256 windows of 4096; 48 = (36-18)+(36-22)+(36-26)+(36-30) d x d products of 4092 rows
    forward = 256 * cost.prefill_flops(sh, 4096) / 5e10
    stats = 256 * 2 * 4092 * 4096**2 * 48 / 1e10
    assert stats * 1e10 == pytest.approx(1.6875e15, rel=1e-3)  # the "about 1.7 PFLOP"
    ckpt = 48 * (4096 * 4096 + 4096) * 8 / 1e9
    writes = 1 + int((forward + stats) // 300)
    assert e.phases["capture"] == pytest.approx(forward + stats + writes * ckpt)


def test_qwen3_8b_ruler_is_batched_on_vllm():
    st = qwen3()
    sh = cost.shape_of(st)
    e = cost.estimate(st, sh, FLAT)
    new = 128 + 128 + 128 + 30 + 120  # max_new_tokens of niah x3, vt, cwe
    step = {n: cost.decode_step_s(sh, FLAT, 40, n, 2) for n in (4096, 16384)}
    pre = sum(5 * 40 * cost.prefill_flops(sh, n) / 1e11 for n in (4096, 16384))
    assert e.phases["exact baseline"] == pytest.approx(pre + new * (step[4096] + step[16384]))
    # one decode step of 40 sequences reads the weights once and each sequence's K/V (bf16)
    kv = 36 * 2 * 8 * 128 * 2
    assert step[16384] == pytest.approx((sh.params * 2 + 40 * 16384 * kv) / 1e10)
    # the transformers engine runs the same samples one at a time: 40x the decode steps
    one = cost.estimate(load_study(STUDIES / "qwen3-8b.yaml", {"engine": "transformers"}), sh, FLAT)
    pre_hf = sum(5 * 40 * cost.prefill_flops(sh, n) / 5e10 for n in (4096, 16384))
    dec_hf = 40 * new * sum(cost.decode_step_s(sh, FLAT, 1, n, 2) for n in (4096, 16384))
    assert one.phases["exact baseline"] == pytest.approx(pre_hf + dec_hf)


def test_qwen3_8b_trial_and_total():
    st = qwen3()
    sh = cost.shape_of(st)
    e = cost.estimate(st, sh, cost.GPU_RATES["h100"])
    assert set(e.trial) == {"fit", "engine start", "RULER", "dNLL", "TTFT"}
    assert e.trial["engine start"] == 60.0
    # dNLL: 16 documents of 8192 tokens, an exact and a filled pass each, on the transformers runtime
    assert e.trial["dNLL"] == pytest.approx(16 * 2 * cost.prefill_flops(sh, 8192) / (0.25 * 989e12))
    # trial RULER prefill is cheaper than the exact baseline's by the FLOP bound at S=18, tail 1024, share 0.15
    assert e.trial["RULER"] < e.phases["exact baseline"]
    assert e.total == pytest.approx(sum(e.phases.values()) + 16 * e.per_trial)
    # the shipped sizing: under the study's 2 hours on one H100 and one H200, with 40 samples per cell
    assert st.objectives.ruler.samples == 40 and st.budget.hours == 2.0
    for gpu in ("h100", "h200"):
        assert cost.plan(st, gpu)[0].total < 2 * 3600
    llama = load_study(STUDIES / "llama-3.1-8b.yaml")
    assert cost.plan(llama, "h100")[0].total < 2 * 3600


def test_parallel_trials_divide_the_trial_time():
    sh = cost.shape_of(qwen3())
    one = cost.estimate(qwen3(), sh, FLAT)
    two = cost.estimate(load_study(STUDIES / "qwen3-8b.yaml", {"budget": {"parallel": 2}}), sh, FLAT)
    assert two.total == pytest.approx(sum(one.phases.values()) + math.ceil(16 / 2) * one.per_trial)


def test_smollm2_study_arithmetic():
    st = load_study(STUDIES / "smollm2-135m.yaml")
    sh = cost.shape_of(st)  # the embedded model's config in the cache
    assert (sh.num_hidden_layers, sh.hidden_size) == (30, 576)
    e = cost.estimate(st, sh, FLAT)
    # capture: 64 windows of 512 on transformers, 45 = 15+12+10+8 products of 508 rows
    forward = 64 * cost.prefill_flops(sh, 512) / 5e10
    stats = 64 * 2 * 508 * 576**2 * 45 / 1e10
    writes = 1 + int((forward + stats) // 300)
    assert e.phases["capture"] == pytest.approx(forward + stats + writes * stats_bytes([15, 18, 20, 22], 30, 576) / 1e9)
    # RULER: every task's samples at 1K, one at a time, each task's max_new_tokens, float32
    r = st.objectives.ruler
    assert list(r.lengths) == [1024]
    speedup = cost.speedup_bound(sh, 1024, 15, 4 + 256 + int(st.search.share[1] * 1024))
    step = cost.decode_step_s(sh, FLAT, 1, 1024, 4)

    def ruler_s(samples: int, up: float) -> float:  # prefill at the bound + one decode step per new token
        pre = len(r.tasks) * samples * cost.prefill_flops(sh, 1024) / 5e10
        return pre / up + samples * sum(SPECS[t].max_new_tokens for t in r.tasks) * step

    assert (r.samples, r.promote) == (2, 6)  # multi-fidelity: the exact side covers a promoted trial's 6
    assert e.phases["exact baseline"] == pytest.approx(ruler_s(6, 1.0))
    assert e.trial["RULER"] == pytest.approx(ruler_s(2, speedup))
    assert e.trial["RULER promoted"] == pytest.approx(cost.PROMOTED_SHARE * ruler_s(4, speedup))
    # exact + the chosen map on the certify tasks at 2K, each bounded by exact's cost, on the serving engine (vLLM
    # where it is installed: an engine start each, a task's samples in one batch)
    c, served = st.certify, objectives.serving_engine(st)
    vllm = served == "vllm"
    step2k = cost.decode_step_s(sh, FLAT, c.samples if vllm else 1, 2048, 4)
    one = len(c.tasks) * c.samples * cost.prefill_flops(sh, 2048) / (FLAT.prefill if vllm else 5e10)
    one += (1 if vllm else c.samples) * sum(SPECS[t].max_new_tokens for t in c.tasks) * step2k
    assert e.phases["certification"] == pytest.approx(2 * (one + (FLAT.engine_start if vllm else 0.0)))
    assert e.trial["engine start"] == 0.0  # the transformers engine starts nothing
    # TTFT timed per trial (ttft.per_trial): (1 warm-up + 3 repeats) x (exact + fill at the least-saving corner
    # S=22, tail 64) at 2K
    timed = cost.estimate(load_study(STUDIES / "smollm2-135m.yaml", {"objectives": {"ttft": {"per_trial": True}}}),
                          sh, FLAT)  # fmt: skip
    fill = cost.speedup_bound(sh, 2048, 22, 4 + 64)
    assert timed.trial["TTFT"] == pytest.approx(4 * cost.prefill_flops(sh, 2048) * (1 + 1 / fill) / 5e10)
    assert "TTFT calibration" not in timed.phases
    # calibrated (the default): trials time nothing; exact and the 5 calibration points, (warm-up + max_repeats)
    # rounds at 2K, every multiply-add at the transformers rate; the certified TTFT times exact + one map
    tt = st.objectives.ttft
    pts = objectives.calibration_points(st)
    secs = [2 * float(features(sh, 2048, p)[:4].sum()) / 5e10 for p in (EXACT, *pts)]  # every FLOP class
    assert e.trial["TTFT"] == 0.0 and len(pts) == 5
    assert e.phases["TTFT calibration"] == pytest.approx((tt.warmup + tt.max_repeats) * sum(secs))
    serving = objectives.serving_engine(st)  # vLLM where it is installed
    rate, start = (FLAT.prefill, FLAT.engine_start) if serving == "vllm" else (FLAT.prefill_hf, 0.0)
    exact = secs[0] * 5e10 / rate
    assert exact < (e.phases["certified TTFT"] - start) / (tt.warmup + tt.max_repeats) < 2 * exact


def test_warm_up_measures_rates_on_a_tiny_model(tiny_models):
    r = cost.measure_rates(tiny_models["llama"], "float32", "transformers", seconds=0.5, n=64)
    assert r.prefill > 0 and r.f64 > 0 and r.bandwidth > 0 and r.engine_start == 0.0
    assert r.source.startswith("measured on this machine")


def test_budget_refused_unless_forced():
    st = load_study(STUDIES / "qwen3-8b.yaml", {"budget": {"hours": 0.5}})
    e, text = cost.plan(st, "h100")
    assert "budget: 0.5 h -- OVER" in text
    with pytest.raises(cost.CostError, match=r"estimated 1\.\d\d h exceeds budget.hours 0.5; .* --force"):
        cost.check_budget(st, e)
    cost.check_budget(st, e, force=True)
    cost.check_budget(qwen3(), cost.plan(qwen3(), "h100")[0])  # the shipped study fits


def test_no_shape_offline_is_one_line():
    st = load_study(STUDIES / "qwen3-8b.yaml", {"model": {"repo": "nobody/not-cached", "shape": None}})
    with pytest.raises(cost.CostError, match="no shape for nobody/not-cached offline; add model.shape") as e:
        cost.shape_of(st)
    assert "\n" not in str(e.value)


def test_tune_plan_cli_offline():
    out = CliRunner().invoke(app, ["tune", "--plan", str(STUDIES / "qwen3-8b.yaml")])
    assert out.exit_code == 0, out.output
    lines = out.output.splitlines()
    assert lines[0] == "plan for study qwen3-8b (Qwen/Qwen3-8B, engine vllm) -- ESTIMATE"
    for phase in ("capture", "exact baseline", "each trial", "total"):
        assert any(line.strip().startswith(f"{phase}:") for line in lines), phase
    assert "RULER" in out.output and "dNLL" in out.output and "TTFT" in out.output
    assert lines[-1].strip() == "budget: 2.0 h -- within"
    bad = CliRunner().invoke(app, ["tune", "--plan", "no-such-study"])
    assert bad.exit_code == 2 and "no study file 'no-such-study'" in bad.output


@pytest.mark.slow
def test_tune_flow_refuses_an_over_budget_study_before_any_work(tmp_path):
    """The real flow (Prefect's ephemeral server) stops a GPU study whose estimate exceeds budget.hours
    before resolving (downloading) the model: nothing is written to the work folder."""
    import os
    import subprocess
    import sys

    root = STUDIES.parent
    over = '{"budget": {"hours": 1}}'
    cmd = [sys.executable, "-m", "flows.tune", str(STUDIES / "qwen3-8b.yaml"), "--no-publish",
           "--work", str(tmp_path / "w"), "--db", str(tmp_path / "r.duckdb"), "--overrides", over]  # fmt: skip
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(root)}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0
    hours = cost.plan(qwen3(), "h100")[0].total / 3600  # the flow prices this GPU-free machine as an H100
    assert hours > 1 and f"estimated {hours:.2f} h exceeds budget.hours 1.0" in out and "--force" in out
    assert "budget: 1.0 h -- OVER" in out  # the plan was logged first
    assert not (tmp_path / "w").exists() or not any((tmp_path / "w").rglob("capture.json"))
