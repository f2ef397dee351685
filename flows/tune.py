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

`tune` is the list of its stages, each a function returning a small value: `resolve` (the checked study, its
budget and weights: `Run`), `baseline` (capture, exact RULER, certification inputs, TTFT model: `Baseline`),
`run_search` (trials and the selection: `Searched`), `certify_chosen` and `publish_chosen`; `Stages` numbers
their log lines.

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
from dataclasses import dataclass, replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]  # the checkout (studies/ lives there)
# an entry point: Prefect's own settings, set before Prefect is imported (library code never writes os.environ)
os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "180")  # a busy 2-core machine
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")

from prefect import flow, get_run_logger, task  # noqa: E402
from prefect.artifacts import create_markdown_artifact  # noqa: E402
from prefect.cache_policies import NO_CACHE  # noqa: E402
from pydantic import BaseModel  # noqa: E402

from ridgefill import certify, cost, objectives, report, search, settings  # noqa: E402
from ridgefill.engines import serving_engine  # noqa: E402
from ridgefill.inputs import model_config  # noqa: E402
from ridgefill.results import Recorder, StudyRun, default_db, default_work  # noqa: E402
from ridgefill.steps import ModelRef, Weights  # noqa: E402
from ridgefill.study import Study, check_model, find_study, preflight  # noqa: E402
from ridgefill.ttft_model import TTFTModel  # noqa: E402
from tasks.calibrate import calibrate_ttft  # noqa: E402
from tasks.capture import capture, corpus_sha  # noqa: E402
from tasks.certify import certify_map  # noqa: E402
from tasks.model import model_ref, resolve_model  # noqa: E402
from tasks.publish import serve_pulled  # noqa: E402
from tasks.record import record_baseline, record_trial, select_best  # noqa: E402
from tasks.trial import TrialContext, exact_ruler, run_trial  # noqa: E402

STAGES = ("model", "capture", "exact RULER baseline", "search", "select", "certify", "publish")


class Where(BaseModel):
    """Where a run keeps its things: the results file, the work folder (captures, maps, journal, reports) and the
    Optuna storage (a .journal path or an RDB URL); None: the defaults (`RIDGEFILL_*` settings, the cache)."""

    db: str | None = None
    work: str | None = None
    storage: str | None = None


class Stages:
    """The run's stage log: each call is the next stage (`STAGES`, in order), numbered `[k/7]` here, never by
    hand; `log` is the run's logger for the lines between stages."""

    def __init__(self, log) -> None:
        self.log, self.done = log, 0

    def __call__(self, fmt: str, *args) -> None:
        self.done += 1
        self.log.info(f"[{self.done}/{len(STAGES)}] " + fmt, *args)


@dataclass(frozen=True)
class Run:
    """The study as this run tunes it (named per weights), its model and where things go."""

    cfg: Study
    spec: str
    weights: Weights
    model: ModelRef
    work: Path
    db: Path
    store: search.Store


@dataclass(frozen=True)
class Baseline:
    """What every trial is judged against: the capture, the exact RULER run, the certification's inputs hash and
    the calibrated TTFT model (None: each trial is timed)."""

    capture: str
    exact: dict
    cert_inputs: str | None
    ttft: TTFTModel | None


@dataclass(frozen=True)
class Searched:
    """The search's result: trials run here, the Optuna study and the selection."""

    ran: int
    ostudy: object
    best: report.Selection


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


def _within_budget(cfg: Study, force: bool, log, model=None, path: str | None = None) -> None:
    """Log the study's cost estimate and refuse it when over `budget.hours` (unless `force`)."""
    est, plan = cost.plan(cfg, model=model, path=path)
    log.info("%s", plan)
    cost.check_budget(cfg, est, force)


def resolve(study: str, overrides: dict | None, where: Where, force: bool, stage: Stages) -> Run:
    """The checked study, its budget (before any download for a GPU study with a known shape, else before the
    capture), its weights and the run's places; the study is renamed per weights (`search.run_name`)."""
    cfg = preflight(study_path(study), overrides)
    if cfg.hardware.threads:
        import torch

        torch.set_num_threads(cfg.hardware.threads)
    objectives.check_engine(cfg.engine)
    checked = cfg.budget.hours is not None and cfg.hardware.device == "cuda" and cost.has_shape(cfg)
    if checked:  # a GPU study's estimate needs only its shape: refuse before any download
        _within_budget(cfg, force, stage.log)
    res = resolve_model(cfg)
    if cfg.model.shape:  # preflight may have checked the study's declared shape: now the model's own config
        check_model(cfg, model_config(res.path), study)
    spec, ref = cfg.name, model_ref(cfg, res)
    cfg = cfg.model_copy(update={"name": search.run_name(spec, res.fingerprint)})  # per weights
    stage("model: %s at %s (%s), study %s", cfg.model.repo, res.revision, res.path, cfg.name)
    if cfg.budget.hours is not None and not checked:  # before the capture: a study that will not fit stops
        cpu = ref.device == "cpu"
        _within_budget(cfg, force, stage.log, ref.load()[0] if cpu else None, res.path)
    work = Path(where.work) if where.work else default_work()
    db = Path(where.db) if where.db else default_db(work)
    store = search.Store(where.storage or settings.get("RIDGEFILL_OPTUNA_STORAGE"), work, cfg.name)
    return Run(cfg, spec, res, ref, work, db, store)


def baseline(run: Run, stage: Stages) -> Baseline:
    """The capture (cached; recaptured when its folder was deleted since), the exact RULER baseline (cached), the
    certification's prompts (built now: a certify task that cannot be built fails before any trial) and the TTFT
    model's calibration."""
    cfg, cal = run.cfg, run.cfg.calibration
    args = (run.weights.fingerprint, corpus_sha(cal.source), sorted(cfg.search.splits), run.model, cal)
    cap = capture(*args, str(run.work / "captures"))
    if not Path(cap, "capture.json").is_file():  # the cached result points at a capture deleted since
        cap = capture.with_options(refresh_cache=True)(*args, str(run.work / "captures"))
    stage("capture: %s (%s, splits %s)", cap, cal.source, sorted(cfg.search.splits))
    ruler = cfg.objectives.ruler
    exact = exact_ruler(run.weights.fingerprint, run.model, ruler.model_dump(), objectives.ruler_inputs_sha(ruler),
                        cfg.engine)  # fmt: skip
    cells = [c["all"] for lengths in exact["scores"].values() for c in lengths.values()]
    stage(
        "exact RULER baseline (%s): %s at %s tokens, %d samples each (a promoted trial's): mean %.1f",
        cfg.engine, ",".join(ruler.tasks), ruler.lengths, ruler.most, sum(cells) / max(1, len(cells)),
    )  # fmt: skip
    inputs = _certify_inputs(cfg, run.model)
    ttft = None if cfg.objectives.ttft.per_trial else calibrate_ttft(run.model.path, cap, cfg, str(run.work / cfg.name))
    stage.log.info("%s", report.calibration_line(ttft))
    return Baseline(cap, exact, inputs, ttft)


def _certify_inputs(cfg: Study, ref: ModelRef) -> str | None:
    """The certification's inputs hash, once its prompts are built: a certify task that cannot be built at its
    length fails before any trial runs. Its exact side runs only once a map is chosen (`certify_chosen`)."""
    if cfg.certify is None:
        return None
    from ridgefill.evals.ruler import load_haystack
    from ridgefill.evals.ruler_run import sample_cells

    spec = cfg.certify.ruler()
    sample_cells(ref.load()[1], spec.tasks, spec.lengths, load_haystack(spec.haystack), 1, spec.seed)
    return objectives.ruler_inputs_sha(spec)


def record_start(rec: Recorder, run: Run, base: Baseline) -> None:
    """The run's `studies` row, its exact baseline and the TTFT model it ranks by, before any trial."""
    cfg, w = run.cfg, run.weights
    drop = cfg.constraints.max_ruler_drop
    rec.study(
        StudyRun(cfg.name, cfg.model.repo, w.revision, w.fingerprint, cfg.engine, drop, cfg.model_dump(), run.spec)
    )
    record_baseline(rec, cfg.name, base.exact)
    if base.ttft is not None:
        rec.calibration(cfg.name, base.ttft.as_dict())


def run_search(rec: Recorder, run: Run, base: Baseline, evaluator: str | None, stage: Stages) -> Searched:
    """The Optuna trials (each recorded as it finishes; a shared study's other workers' trials synced at the end)
    and the selection: the Pareto front and the chosen map."""
    cfg, max_drop, budget = run.cfg, run.cfg.constraints.max_ruler_drop, run.cfg.budget.trials
    ostudy = search.open_study(cfg, run.store.open(), os.getpid() if run.store.shared else 0)
    search.enqueue_first(ostudy, cfg)
    before = search.sync(rec, ostudy, max_drop)  # trials finished by earlier (crashed) runs
    stage("search: %d trials in %s; %d finished before", budget, run.store, before)
    ctx = TrialContext(run.model.path, base.capture, str(run.work / cfg.name / "maps"), ttft=base.ttft)
    trial = trial_task(evaluator)

    def evaluate(batch):
        now = replace(ctx, front=search.best_feasible_speedup(ostudy, max_drop))  # who gets promoted
        return [_outcome(f) for f in [trial.submit(n, p, now, base.exact, cfg) for n, p in batch]]

    def on_trial(t):
        record_trial(rec, cfg.name, t, max_drop)
        stage.log.info(report.progress_line(t, search.completed(ostudy), budget, max_drop))

    ran = search.optimize(ostudy, cfg, evaluate, on_trial=on_trial)
    if run.store.shared:  # trials other workers finished (this one's are recorded), once they are done
        if running := search.settle(ostudy):
            stage.log.warning("%d trials of other workers still run; syncing without them", running)
        synced = search.sync(rec, ostudy, max_drop)
        stage.log.info("synced the whole shared study (%d finished trials) into %s", synced, run.db)
    best = select_best(rec, ostudy, cfg, str(run.work / cfg.name))
    stage("select: Pareto front %s, chosen trial %s, map %s", best.front, best.chosen, best.best_map)
    return Searched(ran, ostudy, best)


def certify_chosen(rec: Recorder, run: Run, base: Baseline, found: Searched, stage: Stages) -> dict | None:
    """The chosen map's certificate (the exact side cached per weights), or None without a chosen map or a certify
    section; recorded pass or fail."""
    cfg, best = run.cfg, found.best
    if not best.best_map:
        stage("certify: skipped (no feasible trial)")
        return None
    stage("certify: trial %s on the study's certify benchmark", best.chosen)
    if base.cert_inputs is None:
        stage.log.warning("study %s has no certify section: its chosen map is not certified", cfg.name)
        return None
    spec = cfg.certify.ruler()
    exact = exact_ruler(run.weights.fingerprint, run.model, spec.model_dump(), base.cert_inputs, serving_engine(cfg))
    trial = next(t for t in found.ostudy.get_trials(deepcopy=False) if t.number == best.chosen)
    return certify_map(rec, cfg.name, trial, run.model, base.cert_inputs, exact, cfg)


def publish_chosen(rec: Recorder, run: Run, best: report.Selection, cert: dict | None, on: bool, stage: Stages):
    """Publish the chosen map through `registry.publish_best` (which records the publication in the results
    file's `publications` table), only when publishing is `on`, a map was chosen and its certificate (recorded
    here, pass or fail) passed; then pull it back and serve it. The publication, or None."""
    if not (on and best.best_map):
        stage("publish: skipped (%s)", "publish is off" if best.best_map else "no feasible trial")
        return None
    if cert is not None and not certify.passed(rec, cert, stage.log):
        return None
    import registry

    try:
        where = registry.publish_best(run.db, run.cfg.name, map_path=best.best_map)
    except Exception as e:  # the study and its results stand; the map can be published later
        stage.log.error(
            "publishing failed (%s: %s); the chosen map stays at %s: `ridgefill publish --db %s --study %s`",
            type(e).__name__, e, best.best_map, run.db, run.cfg.name,
        )  # fmt: skip
        return None
    stage("publish: %s", where)
    stage.log.info("pulled back and served: %s", serve_pulled(run.model, where, best.best_map))
    return str(where)


def summary(run: Run, found: Searched, cert: dict | None, published: str | None) -> dict:
    """The run's artifacts (trial table, Pareto plot) and its summary."""
    best, name = found.best, run.cfg.name
    png = base64.b64encode(Path(best.png).read_bytes()).decode()
    create_markdown_artifact(key=f"{_key(name)}-pareto", markdown=best.table, description="trials")
    create_markdown_artifact(key=f"{_key(name)}-pareto-plot", markdown=f"![Pareto front](data:image/png;base64,{png})")
    out = {
        "table": best.table, "study": name, "spec": run.spec, "trials_run": found.ran, "front": best.front,
        "chosen": best.chosen, "best_map": best.best_map, "results": str(run.db), "report": str(Path(best.png).parent),
        "certified": None if cert is None else {k: cert[k] for k in ("passed", "delta", "ci_lo", "ci_hi", "n")},
        "published": published,
    }  # fmt: skip
    print(best.table)
    print(f"results: {run.db}\nbest map: {best.best_map}\nreport: {out['report']}")
    return out


@flow(name="tune", log_prints=True)
def tune(
    study: str = "studies/smollm2-135m.yaml",
    overrides: dict | None = None,
    where: Where | None = None,
    publish: bool = True,
    evaluator: str | None = None,
    force: bool = False,
) -> dict:
    """Tune one study; `overrides` deep-merge into the study file (e.g. a tiny budget for CI); `where` says where
    results, work and the Optuna storage go; `evaluator` is the test hook of the module docstring. A study with
    `budget.hours` is refused before the capture when its estimate (`ridgefill.cost`) exceeds it, unless `force`."""
    stage = Stages(get_run_logger())
    run = resolve(study, overrides, where or Where(), force, stage)
    base = baseline(run, stage)
    with Recorder(run.db) as rec:
        record_start(rec, run, base)
        found = run_search(rec, run, base, evaluator, stage)
        cert = certify_chosen(rec, run, base, found, stage)
        published = publish_chosen(rec, run, found.best, cert, publish, stage)
    return summary(run, found, cert, published)


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
    where = Where(db=a.db, work=a.work, storage=a.storage)
    out = tune(a.study, a.overrides, where, not a.no_publish, force=a.force)
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
