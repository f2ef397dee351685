"""`tune(study)`: tune RidgeFill for one model end to end and leave the best map ready to publish.

The study is named per weights (`<spec>-<weights hash>`, `search.run_name`): a new model release starts
a fresh search and publishes under its own tag, a rerun on the same weights resumes.

Order: resolve the model -> capture (cached) -> exact RULER baseline (cached) -> Optuna trials
(fit -> RULER -> paired TTFT -> more RULER samples for a trial that could join the front -> dNLL; each
recorded in DuckDB as it finishes) -> Pareto front and the
chosen map (best speed-up inside the RULER-drop constraint) recorded and attached as artifacts ->
certification of the chosen map on the study's `certify` benchmark (recorded, pass or fail) -> publish
through `registry.publish_best`, only when it passed.

Run without a server (Prefect's ephemeral mode): `python -m flows.tune studies/smollm2-135m.yaml`.
The whole study is checked first (`study.preflight`: fields, the model's config.json, the files it names),
so a bad study stops before any model loads. The run logs one line per stage and one per trial.

Test hook: `evaluator="module:function"` replaces the trial task's function (`tasks.trial.run_trial`'s signature,
returning a `search.Outcome`), e.g. fast fake objectives or a barrier before the real trial. Users never
need it.
"""

from __future__ import annotations

import argparse
import base64
import importlib
import json
import os
import re
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]  # the checkout (studies/ lives there)
# an entry point: Prefect's own settings, set before Prefect is imported (library code never writes os.environ)
os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "180")  # a busy 2-core machine
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")

from prefect import flow, get_run_logger, task  # noqa: E402
from prefect.artifacts import create_markdown_artifact  # noqa: E402
from prefect.cache_policies import NO_CACHE  # noqa: E402

from ridgefill import certify, cost, objectives, report, search, settings  # noqa: E402
from ridgefill.inputs import model_config  # noqa: E402
from ridgefill.results import Recorder, default_db, default_work  # noqa: E402
from ridgefill.steps import Weights, shared_model  # noqa: E402
from ridgefill.study import Study, check_model, find_study, preflight  # noqa: E402
from tasks.calibrate import calibrate_ttft  # noqa: E402
from tasks.capture import capture, corpus_sha  # noqa: E402
from tasks.certify import certify_map  # noqa: E402
from tasks.model import resolve_model  # noqa: E402
from tasks.publish import serve_pulled  # noqa: E402
from tasks.record import record_baseline, record_trial, select_best  # noqa: E402
from tasks.trial import TrialContext, exact_ruler, run_trial  # noqa: E402

STAGES = 7


def study_path(study: str) -> Path:
    """A study file as given, else relative to the checkout, else by name under studies/."""
    return find_study(study, ROOT)


def trial_task(evaluator: str | None):
    """`tasks.trial.run_trial`, or the test hook's `module:function` as the same task."""
    if not evaluator:
        return run_trial
    module, _, name = evaluator.partition(":")
    return task(name="run_trial", cache_policy=NO_CACHE)(getattr(importlib.import_module(module), name))


def _key(name: str) -> str:
    return re.sub(r"[^a-z0-9-]+", "-", name.lower())


def _outcome(future):
    try:
        return future.result()
    except Exception as e:  # a failed trial is told to Optuna as FAIL, not raised
        return e


def _publish(cfg: Study, best: report.Selection, db: Path, model_path: str, log) -> str | None:
    """Publish the chosen map through `registry.publish_best`, which records the publication in the same results
    file (its `publications` table, the one record; the `best_map` view shows it)."""
    import registry

    try:
        where = registry.publish_best(db=db, study=cfg.name, map_path=best.best_map)
    except Exception as e:  # the study and its results stand; the map can be published later
        log.error(
            "publishing failed (%s: %s); the chosen map stays at %s: `ridgefill publish --db %s --study %s`",
            type(e).__name__, e, best.best_map, db, cfg.name,
        )  # fmt: skip
        return None
    log.info("[7/%d] publish: %s", STAGES, where)
    served = serve_pulled(model_path, cfg.model.dtype, cfg.hardware.device, where, best.best_map)
    log.info("pulled back and served: %s", served)
    return str(where)


def _within_budget(cfg: Study, force: bool, log, model=None, path: str | None = None) -> None:
    """Log the study's cost estimate and refuse it when over `budget.hours` (unless `force`)."""
    est, plan = cost.plan(cfg, model=model, path=path)
    log.info("%s", plan)
    cost.check_budget(cfg, est, force)


def _certify_inputs(cfg: Study, res: Weights) -> str | None:
    """The certification's inputs hash, once its prompts are built: a certify task that cannot be built at its
    length fails before any trial runs. Its exact side runs only once a map is chosen (`_certify`)."""
    if cfg.certify is None:
        return None
    from ridgefill.evals.ruler import load_haystack
    from ridgefill.evals.ruler_run import sample_cells

    spec = cfg.certify.ruler()
    tok = shared_model(res.path, cfg.model.dtype, cfg.hardware.device)[1]
    sample_cells(tok, spec.tasks, spec.lengths, load_haystack(spec.haystack), 1, spec.seed)
    return objectives.ruler_inputs_sha(spec)


def _certify(
    rec: Recorder, ostudy, cfg: Study, best: report.Selection, res: Weights, inputs: str | None, log
) -> dict | None:
    """The chosen map's certificate (the exact side cached per weights), or None without a certify section."""
    if inputs is None:
        log.warning("study %s has no certify section: its chosen map is not certified", cfg.name)
        return None
    spec, m = cfg.certify.ruler(), (cfg.model.dtype, cfg.hardware.device)
    exact = exact_ruler(res.fingerprint, res.path, *m, spec.model_dump(), inputs, cfg.engine)
    trial = next(t for t in ostudy.get_trials(deepcopy=False) if t.number == best.chosen)
    return certify_map(rec, cfg.name, trial, res.path, inputs, exact, cfg)


@flow(name="tune", log_prints=True)
def tune(
    study: str = "studies/smollm2-135m.yaml",
    overrides: dict | None = None,
    db: str | None = None,
    work: str | None = None,
    storage: str | None = None,
    publish: bool = True,
    evaluator: str | None = None,
    force: bool = False,
) -> dict:
    """Tune one study; `overrides` deep-merge into the study file (e.g. a tiny budget for CI); `evaluator`
    is the test hook of the module docstring. A study with `budget.hours` is refused before the capture
    when its estimate (`ridgefill.cost`) exceeds it, unless `force`."""
    log = get_run_logger()
    cfg = preflight(study_path(study), overrides)
    if cfg.hardware.threads:
        import torch

        torch.set_num_threads(cfg.hardware.threads)
    objectives.check_engine(cfg.engine)
    work_dir = Path(work) if work else default_work()
    db_path = Path(db) if db else default_db(work_dir)
    storage = storage or settings.get("RIDGEFILL_OPTUNA_STORAGE")
    m = (cfg.model.dtype, cfg.hardware.device)
    cal = cfg.calibration

    checked = cfg.budget.hours is not None and m[1] == "cuda" and cost.has_shape(cfg)
    if checked:  # a GPU study's estimate needs only its shape: refuse before any download
        _within_budget(cfg, force, log)
    res = resolve_model(cfg)
    if cfg.model.shape:  # preflight may have checked the study's declared shape: now the model's own config
        check_model(cfg, model_config(res.path), study)
    spec = cfg.name
    cfg = cfg.model_copy(update={"name": search.run_name(spec, res.fingerprint)})  # per weights
    log.info("[1/%d] model: %s at %s (%s), study %s", STAGES, cfg.model.repo, res.revision, res.path, cfg.name)
    if cfg.budget.hours is not None and not checked:  # before the capture: a study that will not fit stops
        _within_budget(cfg, force, log, shared_model(res.path, *m)[0] if m[1] == "cpu" else None, res.path)
    corpus = corpus_sha(cal.source)
    cap_args = (res.fingerprint, corpus, sorted(cfg.search.splits), res.path, *m, cal.source)
    cap_kw = dict(window=cal.window, max_windows=cal.max_windows, heldout=cal.heldout, root=str(work_dir / "captures"))
    cap = capture(*cap_args, **cap_kw)
    if not Path(cap, "capture.json").is_file():  # the cached result points at a capture deleted since
        cap = capture.with_options(refresh_cache=True)(*cap_args, **cap_kw)
    log.info("[2/%d] capture: %s (%s, splits %s)", STAGES, cap, cal.source, sorted(cfg.search.splits))
    ruler = cfg.objectives.ruler
    exact = exact_ruler(
        res.fingerprint, res.path, *m, ruler.model_dump(), objectives.ruler_inputs_sha(ruler), cfg.engine
    )
    cells = [c["all"] for lengths in exact["scores"].values() for c in lengths.values()]
    log.info(
        "[3/%d] exact RULER baseline (%s): %s at %s tokens, %d samples each (a promoted trial's): mean %.1f",
        STAGES, cfg.engine, ",".join(ruler.tasks), ruler.lengths, ruler.most, sum(cells) / max(1, len(cells)),
    )  # fmt: skip
    cinputs = _certify_inputs(cfg, res)
    ttft = None if cfg.objectives.ttft.per_trial else calibrate_ttft(res.path, cap, cfg, str(work_dir / cfg.name))
    log.info("%s", report.calibration_line(ttft))

    with Recorder(db_path) as rec:
        rec.study(cfg.name, cfg.model.repo, res.revision, res.fingerprint, cfg.engine,
                  cfg.constraints.max_ruler_drop, cfg.model_dump(), spec)  # fmt: skip
        record_baseline(rec, cfg.name, exact)
        if ttft is not None:
            rec.calibration(cfg.name, ttft.as_dict())
        shared = bool(storage and "://" in storage)
        ostudy = search.open_study(cfg, search.storage(storage, work_dir, cfg.name), os.getpid() if shared else 0)
        search.enqueue_first(ostudy, cfg)
        max_drop = cfg.constraints.max_ruler_drop
        before = search.sync(rec, ostudy, max_drop)  # trials finished by earlier (crashed) runs
        budget = cfg.budget.trials
        where = "the shared RDB storage" if shared else storage or work_dir / "optuna" / f"{cfg.name}.journal"
        log.info("[4/%d] search: %d trials in %s; %d finished before", STAGES, budget, where, before)
        ctx = TrialContext(res.path, cap, str(work_dir / cfg.name / "maps"), ttft=ttft)
        trial = trial_task(evaluator)

        def evaluate(batch):
            now = replace(ctx, front=search.best_feasible_speedup(ostudy, max_drop))  # who gets promoted
            futures = [trial.submit(n, p, now, exact, cfg) for n, p in batch]
            return [_outcome(f) for f in futures]

        def on_trial(t):
            record_trial(rec, cfg.name, t, max_drop)
            log.info(report.progress_line(t, search.completed(ostudy), budget, max_drop))

        ran = search.optimize(ostudy, cfg, evaluate, on_trial=on_trial)
        if shared:  # trials other workers finished (this one's are recorded), once they are done
            if running := search.settle(ostudy):
                log.warning("%d trials of other workers still run; syncing without them", running)
            synced = search.sync(rec, ostudy, max_drop)
            log.info("synced the whole shared study (%d finished trials) into %s", synced, db_path)
        best = select_best(rec, ostudy, cfg, str(work_dir / cfg.name))
        log.info(
            "[5/%d] select: Pareto front %s, chosen trial %s, map %s", STAGES, best.front, best.chosen,
            best.best_map,
        )  # fmt: skip
        cert = None
        if best.best_map:
            log.info("[6/%d] certify: trial %s on the study's certify benchmark", STAGES, best.chosen)
            cert = _certify(rec, ostudy, cfg, best, res, cinputs, log)
        else:
            log.info("[6/%d] certify: skipped (no feasible trial)", STAGES)
        go = (lambda: _publish(cfg, best, db_path, res.path, log)) if publish else (lambda: None)
        if not (publish and best.best_map):
            why = "publish is off" if best.best_map else "no feasible trial"
            log.info("[7/%d] publish: skipped (%s)", STAGES, why)
            published = None
        else:  # the certificate is recorded pass or fail; only a map that passed is published
            published = go() if cert is None else certify.gate(rec, cert, go, log)

    png = base64.b64encode(Path(best.png).read_bytes()).decode()
    create_markdown_artifact(key=f"{_key(cfg.name)}-pareto", markdown=best.table, description="trials")
    create_markdown_artifact(
        key=f"{_key(cfg.name)}-pareto-plot", markdown=f"![Pareto front](data:image/png;base64,{png})"
    )
    summary = {
        "table": best.table,
        "study": cfg.name,
        "spec": spec,
        "trials_run": ran,
        "front": best.front,
        "chosen": best.chosen,
        "best_map": best.best_map,
        "results": str(db_path),
        "report": str(Path(best.png).parent),
        "certified": None if cert is None else {k: cert[k] for k in ("passed", "delta", "ci_lo", "ci_hi", "n")},
        "published": published,
    }
    print(best.table)
    print(f"results: {db_path}\nbest map: {best.best_map}\nreport: {summary['report']}")
    return summary


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description="Run the tune flow (ephemeral Prefect without PREFECT_API_URL).")
    ap.add_argument("study", nargs="?", default="studies/smollm2-135m.yaml")
    ap.add_argument("--db")
    ap.add_argument("--work")
    ap.add_argument("--storage", help="Optuna storage: a .journal path or an RDB URL (postgresql://...)")
    ap.add_argument("--overrides", type=json.loads, help="JSON deep-merged into the study (a smaller budget...)")
    ap.add_argument("--no-publish", action="store_true")
    ap.add_argument("--force", action="store_true", help="start even if the estimate exceeds budget.hours")
    a = ap.parse_args(argv)
    out = tune(a.study, a.overrides, a.db, a.work, a.storage, not a.no_publish, force=a.force)
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
