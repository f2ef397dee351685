"""Thin Prefect tasks over ridgefill's plain functions: resolve, capture, fit, evaluate, TTFT, record, select.

Tasks run inside the flow's process (thread task runner), so a model is loaded once per process and
the DuckDB recorder is the single writer. Captures and exact baselines are cached across processes
(`INPUTS + TASK_SOURCE`, persisted results) keyed by the weights fingerprint, corpus hash and splits,
so neither a re-run nor a new lambda recaptures; run_capture's own on-disk reuse is the second guard.
"""

from __future__ import annotations

import functools
import hashlib
import json
import threading
from pathlib import Path

import torch
from prefect import task
from prefect.cache_policies import INPUTS, NO_CACHE, TASK_SOURCE

from ridgefill import objectives, report, search
from ridgefill.results import BASELINE, Recorder
from ridgefill.study import Study

CACHED = INPUTS + TASK_SOURCE
_load_lock = threading.Lock()
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@functools.cache
def _loaded(path: str, dtype: str, device: str):
    from ridgefill.steps import load_model

    return load_model(path, DTYPES[dtype], device)


def model(path: str, dtype: str = "float32", device: str = "cpu"):
    """(model, tokenizer), loaded once per process."""
    with _load_lock:
        return _loaded(path, dtype, device)


def _snapshot(repo: str, revision: str) -> tuple[str, str]:
    """Download (or find in the HF cache) a model's safetensors snapshot: (local dir, commit sha)."""
    from huggingface_hub import model_info, snapshot_download

    sha = model_info(repo, revision=revision).sha or revision
    path = snapshot_download(repo, revision=sha, allow_patterns=["*.json", "*.safetensors", "tokenizer*", "*.txt"])
    return path, sha


@task(retries=3, retry_delay_seconds=[5, 30, 120], cache_policy=NO_CACHE)
def resolve_model(cfg: Study) -> dict:
    """Where the weights are, their revision and fingerprint (retried: the hub can fail transiently)."""
    from ridgefill.default_model import default_model_dir
    from ridgefill.fingerprint import fingerprint, fingerprint_key

    m = cfg.model
    if m.local:
        path = str(default_model_dir()) if m.local == "default" else m.local
        revision = m.revision if m.local != "default" else "embedded"
    else:
        path, revision = _snapshot(m.repo, m.revision)
    lm, tok = model(path, m.dtype, cfg.hardware.device)
    fps = [fingerprint(lm, tok, s) for s in sorted(cfg.search.splits)]
    weights = hashlib.sha256(json.dumps([fp["anchors"] for fp in fps], sort_keys=True).encode()).hexdigest()[:16]
    return {"path": path, "revision": revision, "fingerprint": f"{fingerprint_key(fps[0])}-{weights}"}


@task(cache_policy=NO_CACHE)
def corpus_sha(source: str | list[str]) -> str:
    from ridgefill.corpus import load_corpus

    return load_corpus(source).sha256


@task(retries=1, cache_policy=CACHED, persist_result=True, result_serializer="json")
def capture(
    fingerprint: str,
    corpus: str,
    splits: list[int],
    path: str,
    dtype: str,
    device: str,
    source: str | list[str],
    window: int,
    max_windows: int,
    heldout: int,
    root: str,
) -> str:
    """Capture statistics for every candidate split in one pass; a retry resumes from the checkpoint."""
    from ridgefill.steps import run_capture

    lm, tok = model(path, dtype, device)
    cap = run_capture(
        lm, tok, source, sorted(splits), window=window, max_windows=max_windows, heldout=heldout,
        root=Path(root) / fingerprint, progress=False,
    )  # fmt: skip
    return str(cap.path)


@functools.cache
def _solver(capture_path: str, split: int):
    """One eigendecomposition per split serves every lambda of the path."""
    from ridgefill.capture import load_capture
    from ridgefill.fit import RidgeSolver

    return RidgeSolver.from_stats(load_capture(Path(capture_path)).stats(split))


@task(cache_policy=NO_CACHE)
def fit(capture_path: str, path: str, dtype: str, device: str, params: dict, out: str) -> str:
    """Fit the trial's split at its lambda and write a verified map folder with its tail/share defaults."""
    from ridgefill.capture import load_capture
    from ridgefill.steps import build_maps

    lm, tok = model(path, dtype, device)
    p = search.Params(**params)
    defaults = {"tail": p.tail, "sink": p.sink, "share": p.share}
    folder = build_maps(
        lm, tok, load_capture(Path(capture_path)), p.split, p.lam, Path(out), defaults=defaults,
        solver=_solver(capture_path, p.split),
    )  # fmt: skip
    return str(folder)


@task(cache_policy=CACHED, persist_result=True, result_serializer="json")
def exact_ruler(
    fingerprint: str, path: str, dtype: str, device: str, ruler: dict, inputs_sha: str, engine: str = "transformers"
) -> dict:
    """The exact baseline's RULER scores and per-sample rows (for pairing), computed once per model weights,
    RULER settings, engine and `inputs_sha` (haystack text and RULER code: `objectives.ruler_inputs_sha`)."""
    from ridgefill.runtime import FillPlan
    from ridgefill.study import Ruler

    lm, tok = model(path, dtype, device)
    out = objectives.run_ruler_plan(lm, tok, FillPlan(), Ruler(**ruler), engine, dtype)
    return {"scores": out["scores"], "samples": out["samples"]}


@task(cache_policy=NO_CACHE)
def evaluate(
    path: str, dtype: str, device: str, params: dict, map_path: str, exact: dict, cfg: Study, ruler: dict | None = None
) -> dict:
    """RULER delta paired against the exact baseline (mean and 95% CI) and dNLL of the trial's plan, with
    metric rows (`ruler`: already measured on vLLM, `run_ruler_plan`'s shape; dNLL stays on transformers)."""
    lm, tok = model(path, dtype, device)
    plan = objectives.plan_for(search.Params(**params), map_path, lm, tok)
    if ruler is None:
        ruler = objectives.run_ruler_plan(lm, tok, plan, cfg.objectives.ruler)
    paired = objectives.paired_delta(ruler["samples"], exact["samples"], cfg.objectives.ruler.seed)
    dnll, nll_rows = objectives.run_nll(lm, tok, plan, cfg)
    return {
        "ruler_delta": paired["mean"],
        "ruler_ci": {k: paired[k] for k in ("lo", "hi", "n")},
        "dnll": dnll,
        "rows": objectives.ruler_rows("trial", ruler["scores"]) + nll_rows,
    }


@task(cache_policy=NO_CACHE)
def measure_ttft(path: str, dtype: str, device: str, params: dict, map_path: str, cfg: Study) -> dict:
    """Paired TTFT (exact vs the trial's plan) on the study's engine: speed-up and metric rows."""
    lm, tok = model(path, dtype, device)
    plan = objectives.plan_for(search.Params(**params), map_path, lm, tok)
    res = objectives.run_ttft(lm, tok, plan, cfg)
    return {"speedup": objectives.ttft_speedup(res), "rows": objectives.ttft_rows(res)}


@task(cache_policy=NO_CACHE)
def serve_vllm(path: str, dtype: str, device: str, params: dict, map_path: str, cfg: Study) -> dict:
    """The trial's RULER (a batch per task x length) and paired TTFT, served by one vLLM engine."""
    lm, tok = model(path, dtype, device)
    return objectives.run_trial_vllm(lm, objectives.plan_for(search.Params(**params), map_path, lm, tok), cfg)


@task(cache_policy=NO_CACHE)
def run_trial(number: int, params: dict, ctx: dict, exact: dict, cfg: Study) -> search.Outcome:
    """fit -> evaluate -> TTFT for one trial (nested tasks, so each step shows in the run)."""
    m = (ctx["path"], cfg.model.dtype, cfg.hardware.device)
    out = str(Path(ctx["maps"]) / f"trial-{number:04d}")
    folder = fit(ctx["capture"], *m, params, out)
    if cfg.engine == "vllm":  # one engine serves the trial's RULER and TTFT
        served = serve_vllm(*m, params, folder, cfg)
        ev = evaluate(*m, params, folder, exact, cfg, served["ruler"])
        tt = {"speedup": objectives.ttft_speedup(served["ttft"]), "rows": objectives.ttft_rows(served["ttft"])}
    else:
        ev = evaluate(*m, params, folder, exact, cfg)
        tt = measure_ttft(*m, params, folder, cfg)
    return search.Outcome(ev["ruler_delta"], tt["speedup"], ev["dnll"], folder, ev["rows"] + tt["rows"], ev["ruler_ci"])


@task(cache_policy=NO_CACHE)
def record_trial(recorder: Recorder, study_name: str, trial, max_drop: float) -> None:
    """Write one finished trial (parameters, objectives, metric rows) as one DuckDB transaction."""
    recorder.trials([search.record_of(study_name, trial, max_drop)])


@task(cache_policy=NO_CACHE)
def select_best(recorder: Recorder, study, cfg: Study, report_dir: str) -> dict:
    """Pareto front and chosen map into DuckDB; markdown table and PNG written beside the results."""
    from ridgefill.maps import MANIFEST, read_manifest

    trials = study.get_trials(deepcopy=False)
    max_drop = cfg.constraints.max_ruler_drop  # today's limit, also for trials run under another
    fr, best = report.front(trials, max_drop), report.choose(trials, max_drop)
    keep = {t.number: t for t in fr} | ({best.number: best} if best else {})
    rows = []
    for t in keep.values():
        mp = t.user_attrs.get("map_path")
        sha = read_manifest(Path(mp))["manifest_sha256"] if mp and Path(mp, MANIFEST).is_file() else None
        p = search.params_of(t)
        rows.append(
            (cfg.name, t.number, cfg.model.repo, mp, sha, p.get("split"), p.get("lam"), p.get("tail"),
             p.get("share"), t.values[0], t.values[1])
        )  # fmt: skip
    recorder.maps(rows, cfg.name, best.number if best else None)
    md = report.table(trials, best, cfg.constraints.max_ruler_drop)
    out = Path(report_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "pareto.md").write_text(md + "\n")
    png = report.pareto_png(trials, best, cfg.constraints.max_ruler_drop, out / "pareto.png")
    return {
        "front": [t.number for t in fr],
        "chosen": best.number if best else None,
        "best_map": best.user_attrs.get("map_path") if best else None,
        "table": md,
        "png": str(png),
    }


@task(cache_policy=NO_CACHE)
def record_baseline(recorder: Recorder, study_name: str, exact: dict) -> None:
    recorder.baseline(study_name, objectives.ruler_rows("exact", exact["scores"]))


@task(cache_policy=NO_CACHE)
def certify_map(recorder: Recorder, study_name: str, trial, ctx: dict, exact: dict, cfg: Study) -> dict:
    """The chosen map on the study's `certify` benchmark, paired against `exact` (that benchmark's cached
    exact run): its certificate, for `certify.gate` to record. One already recorded for the same map,
    settings, inputs and limit is reused, so a rerun does not pay for it again."""
    import time

    from ridgefill import certify
    from ridgefill.evals.ruler import load_haystack
    from ridgefill.maps import sha256_file

    spec, drop = cfg.certify, cfg.certify_drop
    mp = trial.user_attrs["map_path"]
    key = certify.key_of(spec, drop, ctx["certify_inputs"], sha256_file(Path(mp) / "ridgefill.json"))
    if (old := recorder.certified(study_name, trial.number)) is not None and old.get("key") == key:
        return old
    lm, tok = model(ctx["path"], cfg.model.dtype, cfg.hardware.device)
    t0 = time.time()
    plan = objectives.plan_for(search.Params(**search.params_of(trial)), mp, lm, tok)
    run = objectives.run_ruler_plan(lm, tok, plan, spec.ruler())
    words = hashlib.sha256("\n".join(load_haystack(spec.haystack).words).encode()).hexdigest()
    hay = certify.haystack_label(spec.haystack, words)
    return certify.certificate(
        study_name, trial.number, spec, drop, run["samples"], exact["samples"], hay, key, time.time() - t0
    )


__all__ = [
    "BASELINE",
    "capture",
    "certify_map",
    "corpus_sha",
    "evaluate",
    "exact_ruler",
    "fit",
    "measure_ttft",
    "model",
    "record_baseline",
    "record_trial",
    "resolve_model",
    "run_trial",
    "select_best",
    "serve_vllm",
]


@task(cache_policy=NO_CACHE)
def serve_pulled(path: str, dtype: str, device: str, publication, local_map: str) -> str:
    """Pull the published map back through the registry (every check), serve a prompt with it, and make
    sure it decodes exactly as the folder that was measured."""
    from registry import pull_publication
    from ridgefill.maps import load_maps
    from ridgefill.runtime import FillPlan, generate

    lm, tok = model(path, dtype, device)
    pulled = pull_publication(publication, lm, tok)  # its commit, checked against its manifest digest
    ids = torch.tensor([tok(" ".join(["The pulled map serves this prompt."] * 60))["input_ids"]])
    outs = []
    for folder in (pulled, local_map):
        ms = load_maps(folder, lm, tok)
        d = ms.manifest["defaults"]
        plan = FillPlan("ridge", maps=ms, sink=d["sink"], tail=min(d["tail"], 32), share=d["share"])
        outs.append(generate(lm, ids.to(lm.device), plan, 8)[0].tolist())
    if outs[0] != outs[1]:
        raise RuntimeError(f"the pulled map {pulled} decodes differently from the measured one {local_map}")
    return f"{pulled} ({len(outs[0])} tokens, identical to the measured map)"
