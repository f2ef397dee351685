"""One trial: fit -> the trial's decision (`ridgefill.decision.decide`: RULER, paired TTFT when it can matter,
more RULER samples when promoted) -> paired delta and dNLL (nested tasks, so each step shows in the run), and
the exact RULER baseline every trial is paired against (cached per weights, settings, engine and inputs).

On transformers each step is a task here; on vLLM one engine runs the same decision on itself
(`evals.vllm_trial`). With the study's calibrated TTFT model the speed-up is its prediction and nothing is
timed."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from prefect import task
from prefect.cache_policies import NO_CACHE

from ridgefill import objectives
from ridgefill.decision import Decision, Gate, decide
from ridgefill.maps import MapSet
from ridgefill.objectives import Evaluation, Timing
from ridgefill.search import Outcome, Params
from ridgefill.steps import fit_trial, shared_model
from ridgefill.study import Study
from ridgefill.ttft_model import TTFTModel
from tasks import CACHED


@dataclass(frozen=True)
class TrialContext:
    """What every trial of a run shares: the weights' folder, the capture and where map folders go."""

    path: str
    capture: str
    maps: str
    front: float | None = None  # the best feasible speed-up when the trial starts (None: none feasible yet)
    ttft: TTFTModel | None = None  # the study's calibrated TTFT model; None (or `ttft.per_trial`): time each trial


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
    from ridgefill.study import Ruler

    lm, tok = shared_model(path, dtype, device)
    out = objectives.exact_baseline(lm, tok, Ruler(**ruler), engine, dtype)
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
    nll: bool = True,
) -> Evaluation:
    """RULER delta paired against the exact baseline (mean and 95% CI) and dNLL of the trial's plan, with
    metric rows (`ruler`: already measured on vLLM; `nll` False: no dNLL, the trial cannot pass)."""
    lm, tok = shared_model(path, dtype, device)
    plan = objectives.plan_for(params, maps, lm, tok)
    return objectives.evaluate_plan(lm, tok, plan, exact, cfg, ruler, nll)


@task(cache_policy=NO_CACHE)
def measure_ruler(
    path: str, dtype: str, device: str, params: Params, maps: MapSet, cfg: Study, first: int, samples: int
) -> dict:
    """The trial plan's RULER on sample indices first..samples-1 (transformers: one `generate` a sample;
    vLLM: one engine, a batch per task x length)."""
    lm, tok = shared_model(path, dtype, device)
    plan = objectives.plan_for(params, maps, lm, tok)
    if cfg.engine == "vllm":
        return objectives.run_ruler_vllm_plan(lm, plan, cfg, first, samples)
    return objectives.run_ruler_plan(lm, tok, plan, cfg.objectives.ruler, first=first, samples=samples)


@task(cache_policy=NO_CACHE)
def measure_ttft(path: str, dtype: str, device: str, params: Params, maps: MapSet, cfg: Study) -> Timing:
    """Paired TTFT (exact vs the trial's plan) on the study's engine: speed-up and metric rows."""
    lm, tok = shared_model(path, dtype, device)
    plan = objectives.plan_for(params, maps, lm, tok)
    return Timing.of(objectives.run_ttft(lm, tok, plan, cfg))


@task(cache_policy=NO_CACHE)
def serve_vllm(
    path: str, dtype: str, device: str, params: Params, maps: MapSet, cfg: Study, gate: Gate,
    speedup: float | None = None,
) -> dict:  # fmt: skip
    """The trial's whole decision on one vLLM engine: RULER (a batch per task x length), paired TTFT when it can
    matter (none when `speedup` is predicted) and a promoted trial's further samples."""
    lm, tok = shared_model(path, dtype, device)
    return objectives.run_trial_vllm(lm, objectives.plan_for(params, maps, lm, tok), cfg, gate, speedup)


@task(cache_policy=NO_CACHE)
def run_trial(number: int, params: Params, ctx: TrialContext, exact: dict, cfg: Study) -> Outcome:
    """fit -> the trial's decision -> paired delta and dNLL, for one trial."""
    m = (ctx.path, cfg.model.dtype, cfg.hardware.device)
    out = str(Path(ctx.maps) / f"trial-{number:04d}")
    maps = fit(ctx.capture, *m, params, out)  # verified once, as written: passed along, never re-hashed here
    r = cfg.objectives.ruler
    gate = Gate.of(exact["samples"], cfg.constraints.max_ruler_drop, r.seed, r.samples, r.promote, ctx.front)
    pred = None
    if ctx.ttft is not None and not cfg.objectives.ttft.per_trial:
        pred = objectives.predicted(ctx.ttft, params, cfg.objectives.ttft.lengths)
    if cfg.engine == "vllm":  # one engine serves the trial's RULER, TTFT and, promoted, its further samples
        served = serve_vllm(*m, params, maps, cfg, gate, pred.speedup if pred else None)
        first = Timing.of(served["ttft"]) if served["ttft"] else None
        d = Decision(served["ruler"], first and timed(m, params, maps, cfg, first), served["promoted"],
                     served["reachable"])  # fmt: skip
    else:
        d = decide(
            lambda first, last: measure_ruler(*m, params, maps, cfg, first, last),
            lambda: timed(m, params, maps, cfg), objectives.merged, gate, pred.speedup if pred else None,
        )  # fmt: skip
    tt = pred or d.timing or bound(m, params, cfg)  # not timed: out of reach, its FLOP bound steers nothing
    ev = evaluate(*m, params, maps, exact, cfg, d.ruler, nll=d.reachable)  # no dNLL for a trial out of reach
    ci = ev.ruler_ci | {"promoted": d.promoted}  # n says how many pairs the constraint judged
    return Outcome(
        ev.ruler_delta, tt.speedup, ev.dnll, str(maps.path), ev.rows + tt.rows, ci, tt.measured, tt.predicted,
        tt.flop_bound, tt.invalid,
    )  # fmt: skip


def timed(m: tuple, params: Params, maps: MapSet, cfg: Study, first: Timing | None = None) -> Timing:
    """A per-trial timing checked against its FLOP bound: one whose CI lies wholly above the bound is measured
    once more, and if still above it is recorded as invalid (speed-up 1.0: it ranks nothing)."""
    config = shared_model(*m)[0].config
    tt = (first or measure_ttft(*m, params, maps, cfg)).checked(config, params)
    if tt.invalid:
        tt = measure_ttft(*m, params, maps, cfg).checked(config, params)
    if tt.invalid:
        return Timing(1.0, tt.rows, True, None, tt.flop_bound, True)
    return tt


def bound(m: tuple, params: Params, cfg: Study) -> Timing:
    """An infeasible trial's speed-up: the FLOP bound at the TTFT lengths, recorded as not measured."""
    return Timing.bound(shared_model(*m)[0].config, params, cfg.objectives.ttft.lengths)
