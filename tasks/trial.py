"""One trial: fit -> RULER/dNLL -> paired TTFT (nested tasks, so each step shows in the run), and the exact
RULER baseline every trial is paired against (cached per weights, settings, engine and inputs)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from prefect import task
from prefect.cache_policies import NO_CACHE

from ridgefill import objectives
from ridgefill.maps import MapSet
from ridgefill.objectives import Evaluation, Timing
from ridgefill.search import Outcome, Params
from ridgefill.steps import fit_trial, shared_model
from ridgefill.study import Study
from tasks import CACHED


@dataclass(frozen=True)
class TrialContext:
    """What every trial of a run shares: the weights' folder, the capture and where map folders go."""

    path: str
    capture: str
    maps: str


@task(cache_policy=NO_CACHE)
def fit(capture_path: str, path: str, dtype: str, device: str, params: Params, out: str) -> MapSet:
    """Fit the trial's split at its lambda and write its map folder with its tail/share defaults: the verified
    maps the trial's later steps share (hashed once, as written)."""
    lm, tok = shared_model(path, dtype, device)
    return fit_trial(lm, tok, capture_path, params, Path(out))


@task(cache_policy=CACHED, persist_result=True, result_serializer="json")
def exact_ruler(
    fingerprint: str, path: str, dtype: str, device: str, ruler: dict, inputs_sha: str, engine: str = "transformers"
) -> dict:
    """The exact baseline's RULER scores and per-sample rows (for pairing), computed once per model weights,
    RULER settings, engine and `inputs_sha` (haystack text and RULER code: `objectives.ruler_inputs_sha`)."""
    from ridgefill.runtime import FillPlan
    from ridgefill.study import Ruler

    lm, tok = shared_model(path, dtype, device)
    out = objectives.run_ruler_plan(lm, tok, FillPlan(), Ruler(**ruler), engine, dtype)
    return {"scores": out["scores"], "samples": out["samples"]}


@task(cache_policy=NO_CACHE)
def evaluate(
    path: str,
    dtype: str,
    device: str,
    params: Params,
    maps: MapSet,
    exact: dict,
    cfg: Study,
    ruler: dict | None = None,
) -> Evaluation:
    """RULER delta paired against the exact baseline (mean and 95% CI) and dNLL of the trial's plan, with
    metric rows (`ruler`: already measured on vLLM)."""
    lm, tok = shared_model(path, dtype, device)
    plan = objectives.plan_for(params, maps, lm, tok)
    return objectives.evaluate_plan(lm, tok, plan, exact, cfg, ruler)


@task(cache_policy=NO_CACHE)
def measure_ttft(path: str, dtype: str, device: str, params: Params, maps: MapSet, cfg: Study) -> Timing:
    """Paired TTFT (exact vs the trial's plan) on the study's engine: speed-up and metric rows."""
    lm, tok = shared_model(path, dtype, device)
    plan = objectives.plan_for(params, maps, lm, tok)
    return Timing.of(objectives.run_ttft(lm, tok, plan, cfg))


@task(cache_policy=NO_CACHE)
def serve_vllm(path: str, dtype: str, device: str, params: Params, maps: MapSet, cfg: Study) -> dict:
    """The trial's RULER (a batch per task x length) and paired TTFT, served by one vLLM engine."""
    lm, tok = shared_model(path, dtype, device)
    return objectives.run_trial_vllm(lm, objectives.plan_for(params, maps, lm, tok), cfg)


@task(cache_policy=NO_CACHE)
def run_trial(number: int, params: Params, ctx: TrialContext, exact: dict, cfg: Study) -> Outcome:
    """fit -> evaluate -> TTFT for one trial."""
    m = (ctx.path, cfg.model.dtype, cfg.hardware.device)
    out = str(Path(ctx.maps) / f"trial-{number:04d}")
    maps = fit(ctx.capture, *m, params, out)  # verified once, as written: passed along, never re-hashed here
    if cfg.engine == "vllm":  # one engine serves the trial's RULER and TTFT
        served = serve_vllm(*m, params, maps, cfg)
        ev = evaluate(*m, params, maps, exact, cfg, served["ruler"])
        tt = Timing.of(served["ttft"])
    else:
        ev = evaluate(*m, params, maps, exact, cfg)
        tt = measure_ttft(*m, params, maps, cfg)
    return Outcome(ev.ruler_delta, tt.speedup, ev.dnll, str(maps.path), ev.rows + tt.rows, ev.ruler_ci)
