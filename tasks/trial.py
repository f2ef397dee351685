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
from ridgefill.engines import ENGINES
from ridgefill.maps import MapSet
from ridgefill.objectives import Evaluation, Timing
from ridgefill.params import Params
from ridgefill.search import Outcome
from ridgefill.steps import ModelRef, fit_trial, shared_model
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


def _load(m: ModelRef):
    """The process's shared (model, tokenizer) of `m`."""
    return shared_model(m.path, m.dtype, m.device)


def _plan(m: ModelRef, params: Params, maps: MapSet):
    lm, tok = _load(m)
    return objectives.plan_for(params, maps, lm, tok)


@task(cache_policy=NO_CACHE)
def fit(m: ModelRef, capture_path: str, params: Params, out: str) -> MapSet:
    """Fit the trial's split at its lambda and write its map folder with its tail/share defaults: the verified
    maps the trial's later steps share (hashed once, as written)."""
    lm, tok = _load(m)
    return fit_trial(lm, tok, capture_path, params, Path(out))


@task(cache_policy=CACHED, persist_result=True, result_serializer="json")
def exact_ruler(fingerprint: str, m: ModelRef, ruler: dict, inputs_sha: str, engine: str = "transformers") -> dict:
    """The exact baseline's RULER scores and per-sample rows (for pairing), computed once per model weights,
    RULER settings, engine and `inputs_sha` (haystack text and RULER code: `objectives.ruler_inputs_sha`)."""
    from ridgefill.study import Ruler

    lm, tok = _load(m)
    out = objectives.exact_baseline(lm, tok, Ruler(**ruler), engine, m.dtype)
    return {"scores": out["scores"], "samples": out["samples"]}


@task(cache_policy=NO_CACHE)
def evaluate(
    m: ModelRef, params: Params, maps: MapSet, exact: dict, cfg: Study, ruler: dict | None = None, nll: bool = True
) -> Evaluation:
    """RULER delta paired against the exact baseline (mean and 95% CI) and dNLL of the trial's plan, with
    metric rows (`ruler`: already measured on vLLM; `nll` False: no dNLL, the trial cannot pass)."""
    lm, tok = _load(m)
    return objectives.evaluate_plan(lm, tok, _plan(m, params, maps), exact, cfg, ruler, nll)


@task(cache_policy=NO_CACHE)
def measure_ruler(m: ModelRef, params: Params, maps: MapSet, cfg: Study, first: int, samples: int) -> dict:
    """The trial plan's RULER on sample indices first..samples-1 on transformers, one `generate` a sample."""
    lm, tok = _load(m)
    return objectives.run_ruler_plan(
        lm, tok, _plan(m, params, maps), cfg.objectives.ruler, indices=range(first, samples)
    )


@task(cache_policy=NO_CACHE)
def measure_ttft(m: ModelRef, params: Params, maps: MapSet, cfg: Study) -> Timing:
    """Paired TTFT (exact vs the trial's plan) on the study's engine: speed-up and metric rows."""
    lm, tok = _load(m)
    return Timing.of(objectives.run_ttft(lm, tok, _plan(m, params, maps), cfg))


@task(cache_policy=NO_CACHE)
def serve_vllm(m: ModelRef, params: Params, maps: MapSet, cfg: Study, gate: Gate, speedup: float | None = None) -> dict:
    """The trial's whole decision on one vLLM engine: RULER (a batch per task x length), paired TTFT when it can
    matter (none when `speedup` is predicted) and a promoted trial's further samples."""
    return objectives.run_trial_vllm(_load(m)[0], _plan(m, params, maps), cfg, gate, speedup)


@dataclass(frozen=True)
class Trial:
    """One trial's fixed inputs on its way through the decision: the model, its parameters, maps and study."""

    m: ModelRef
    params: Params
    maps: MapSet
    cfg: Study


def decide_here(t: Trial, gate: Gate, speedup: float | None) -> Decision:
    """The decision in this process, each step a task: RULER samples, TTFT when it can matter, more samples."""
    return decide(
        lambda first, last: measure_ruler(t.m, t.params, t.maps, t.cfg, first, last),
        lambda: timed(t), objectives.merged, gate, speedup,
    )  # fmt: skip


def decide_served(t: Trial, gate: Gate, speedup: float | None) -> Decision:
    """The same decision on one serving engine (its own process): its first timing is checked here."""
    served = serve_vllm(t.m, t.params, t.maps, t.cfg, gate, speedup)
    first = Timing.of(served["ttft"]) if served["ttft"] else None
    return Decision(served["ruler"], first and timed(t, first), served["promoted"], served["reachable"])


DECIDE = {False: decide_here, True: decide_served}  # by `Engine.serving`: where the one decision runs


@task(cache_policy=NO_CACHE)
def run_trial(number: int, params: Params, ctx: TrialContext, exact: dict, cfg: Study) -> Outcome:
    """fit -> the trial's decision -> paired delta and dNLL, for one trial."""
    m = ModelRef(ctx.path, cfg.model.dtype, cfg.hardware.device)
    out = str(Path(ctx.maps) / f"trial-{number:04d}")
    maps = fit(m, ctx.capture, params, out)  # verified once, as written: passed along, never re-hashed here
    r = cfg.objectives.ruler
    gate = Gate.of(exact["samples"], cfg.constraints.max_ruler_drop, r.seed, r.samples, r.promote, ctx.front)
    pred = None
    if ctx.ttft is not None and not cfg.objectives.ttft.per_trial:
        pred = objectives.predicted(ctx.ttft, params, cfg.objectives.ttft.lengths)
    t = Trial(m, params, maps, cfg)
    d = DECIDE[ENGINES[cfg.engine].serving](t, gate, pred.speedup if pred else None)
    tt = pred or d.timing or bound(t)  # not timed: out of reach, its FLOP bound steers nothing
    ev = evaluate(m, params, maps, exact, cfg, d.ruler, nll=d.reachable)  # no dNLL for a trial out of reach
    ci = ev.ruler_ci | {"promoted": d.promoted}  # n says how many pairs the constraint judged
    return Outcome(
        ev.ruler_delta, tt.speedup, ev.dnll, str(maps.path), ev.rows + tt.rows, ci, tt.measured, tt.predicted,
        tt.flop_bound, tt.invalid,
    )  # fmt: skip


def timed(t: Trial, first: Timing | None = None) -> Timing:
    """A per-trial timing checked against its FLOP bound: one whose CI lies wholly above the bound is measured
    once more, and if still above it is recorded as invalid (speed-up 1.0: it ranks nothing)."""
    config = _load(t.m)[0].config
    tt = (first or measure_ttft(t.m, t.params, t.maps, t.cfg)).checked(config, t.params)
    if tt.invalid:
        tt = measure_ttft(t.m, t.params, t.maps, t.cfg).checked(config, t.params)
    if tt.invalid:
        return Timing(1.0, tt.rows, True, None, tt.flop_bound, True)
    return tt


def bound(t: Trial) -> Timing:
    """An infeasible trial's speed-up: the FLOP bound at the TTFT lengths, recorded as not measured."""
    return Timing.bound(_load(t.m)[0].config, t.params, t.cfg.objectives.ttft.lengths)
