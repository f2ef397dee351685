"""`tune(study)`: tune RidgeFill for one model end to end and leave the best map ready to publish.

The study is named per weights (`<spec>-<weights hash>`, `tuning.run_name`): a new model release starts
a fresh search and publishes under its own tag, a rerun on the same weights resumes.

Order: resolve the model -> capture (cached) -> exact RULER baseline (cached) -> Optuna trials
(fit -> RULER/dNLL -> paired TTFT; each recorded in DuckDB as it finishes) -> Pareto front and the
chosen map (best speed-up inside the RULER-drop constraint) recorded and attached as artifacts ->
certification of the chosen map on the study's `certify` benchmark (recorded, pass or fail) -> publish
through `registry.publish_best`, only when it passed.

Run without a server (Prefect's ephemeral mode): `python flows/tune.py studies/smollm2-135m.yaml`.
"""

from __future__ import annotations

import argparse
import base64
import json
import logging
import os
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # `tasks/` lives in the checkout, beside this folder
    sys.path.insert(0, str(ROOT))
os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "180")  # a busy 2-core machine
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")

from prefect import flow, get_run_logger  # noqa: E402
from prefect.artifacts import create_markdown_artifact  # noqa: E402

import tasks  # noqa: E402
from ridgefill import certify, tuning  # noqa: E402
from ridgefill.results import Recorder, default_db, default_work  # noqa: E402
from ridgefill.study import Study, load_study  # noqa: E402


def study_path(study: str) -> Path:
    """A study file as given, else relative to the checkout, else by name under studies/."""
    for p in (Path(study), ROOT / study, ROOT / "studies" / f"{study}.yaml"):
        if p.is_file():
            return p
    raise FileNotFoundError(f"no study file {study!r} (looked in ., {ROOT} and {ROOT / 'studies'})")


def _key(name: str) -> str:
    return re.sub(r"[^a-z0-9-]+", "-", name.lower())


def _outcome(future):
    try:
        return future.result()
    except Exception as e:  # a failed trial is told to Optuna as FAIL, not raised
        return e


def _publish(cfg: Study, best: dict, db: Path, model_path: str, log) -> str | None:
    """Publish the chosen map through `registry.publish_best` (the registry records the publication in the
    same results file)."""
    import registry

    try:
        where = registry.publish_best(db=db, study=cfg.name, map_path=best["best_map"])
    except Exception as e:  # the study and its results stand; the map can be published later
        log.error(
            "publishing failed (%s: %s); the chosen map stays at %s: `ridgefill publish --db %s --study %s`",
            type(e).__name__, e, best["best_map"], db, cfg.name,
        )  # fmt: skip
        return None
    with Recorder(db) as rec:
        rec.published(cfg.name, best["chosen"], str(where))
    log.info("published the chosen map: %s", where)
    served = tasks.serve_pulled(model_path, cfg.model.dtype, cfg.hardware.device, where, best["best_map"])
    log.info("pulled back and served: %s", served)
    return str(where)


def _certify_exact(cfg: Study, res: dict) -> dict | None:
    """The exact side of the certification (cached per weights), run before the search so that a certify
    task that cannot be built at its length fails before any trial runs."""
    if cfg.certify is None:
        return None
    spec = cfg.certify.ruler()
    inputs = tuning.ruler_inputs_sha(spec)
    m = (cfg.model.dtype, cfg.hardware.device)
    exact = tasks.exact_ruler(res["fingerprint"], res["path"], *m, spec.model_dump(), inputs)
    return {"exact": exact, "inputs": inputs}


def _certify(rec: Recorder, ostudy, cfg: Study, best: dict, res: dict, cexact: dict | None, log) -> dict | None:
    """The chosen map's certificate, or None when the study has no certify section."""
    if cexact is None:
        log.warning("study %s has no certify section: its chosen map is not certified", cfg.name)
        return None
    trial = next(t for t in ostudy.get_trials(deepcopy=False) if t.number == best["chosen"])
    ctx = {"path": res["path"], "certify_inputs": cexact["inputs"]}
    return tasks.certify_map(rec, cfg.name, trial, ctx, cexact["exact"], cfg)


@flow(name="tune", log_prints=True)
def tune(
    study: str = "studies/smollm2-135m.yaml",
    overrides: dict | None = None,
    db: str | None = None,
    work: str | None = None,
    storage: str | None = None,
    publish: bool = True,
) -> dict:
    """Tune one study; `overrides` deep-merge into the study file (e.g. a tiny budget for CI)."""
    log = get_run_logger()
    cfg = load_study(study_path(study), overrides)
    if cfg.hardware.threads:
        import torch

        torch.set_num_threads(cfg.hardware.threads)
    tuning.check_engine(cfg.engine)
    work_dir = Path(work) if work else default_work()
    db_path = Path(db) if db else default_db(work_dir)
    storage = storage or os.environ.get("RIDGEFILL_OPTUNA_STORAGE")
    m = (cfg.model.dtype, cfg.hardware.device)
    cal = cfg.calibration

    res = tasks.resolve_model(cfg)
    spec = cfg.name
    cfg = cfg.model_copy(update={"name": tuning.run_name(spec, res["fingerprint"])})  # per weights
    log.info("study %s: %s at %s", cfg.name, cfg.model.repo, res["revision"])
    corpus = tasks.corpus_sha(cal.source)
    cap_args = (res["fingerprint"], corpus, sorted(cfg.search.splits), res["path"], *m, cal.source)
    cap_kw = dict(window=cal.window, max_windows=cal.max_windows, heldout=cal.heldout, root=str(work_dir / "captures"))
    cap = tasks.capture(*cap_args, **cap_kw)
    if not Path(cap, "capture.json").is_file():  # the cached result points at a capture deleted since
        cap = tasks.capture.with_options(refresh_cache=True)(*cap_args, **cap_kw)
    ruler = cfg.objectives.ruler
    exact = tasks.exact_ruler(res["fingerprint"], res["path"], *m, ruler.model_dump(), tuning.ruler_inputs_sha(ruler))
    cexact = _certify_exact(cfg, res)

    with Recorder(db_path) as rec:
        rec.study(cfg.name, cfg.model.repo, res["revision"], res["fingerprint"], cfg.engine,
                  cfg.constraints.max_ruler_drop, cfg.model_dump(), spec)  # fmt: skip
        tasks.record_baseline(rec, cfg.name, exact)
        shared = bool(storage and "://" in storage)
        ostudy = tuning.open_study(cfg, tuning.storage(storage, work_dir, cfg.name), os.getpid() if shared else 0)
        tuning.enqueue_first(ostudy, cfg)
        max_drop = cfg.constraints.max_ruler_drop
        tuning.sync(rec, ostudy, max_drop)  # trials finished by earlier (crashed) runs
        ctx = {"path": res["path"], "capture": cap, "maps": str(work_dir / cfg.name / "maps")}

        def evaluate(batch):
            futures = [tasks.run_trial.submit(n, p.as_dict(), ctx, exact, cfg) for n, p in batch]
            return [_outcome(f) for f in futures]

        ran = tuning.optimize(ostudy, cfg, evaluate, on_trial=lambda t: tasks.record_trial(rec, cfg.name, t, max_drop))
        if shared:
            tuning.sync(rec, ostudy, max_drop)  # trials other workers finished (this one's are recorded)
        best = tasks.select_best(rec, ostudy, cfg, str(work_dir / cfg.name))
        cert = _certify(rec, ostudy, cfg, best, res, cexact, log) if best["best_map"] else None
        go = (lambda: _publish(cfg, best, db_path, res["path"], log)) if publish else (lambda: None)
        if not best["best_map"]:
            published = None
        else:  # the certificate is recorded pass or fail; only a map that passed is published
            published = go() if cert is None else certify.gate(rec, cert, go, log)

    png = base64.b64encode(Path(best["png"]).read_bytes()).decode()
    create_markdown_artifact(key=f"{_key(cfg.name)}-pareto", markdown=best["table"], description="trials")
    create_markdown_artifact(
        key=f"{_key(cfg.name)}-pareto-plot", markdown=f"![Pareto front](data:image/png;base64,{png})"
    )
    summary = {
        "study": cfg.name,
        "spec": spec,
        "trials_run": ran,
        "front": best["front"],
        "chosen": best["chosen"],
        "best_map": best["best_map"],
        "results": str(db_path),
        "report": str(Path(best["png"]).parent),
        "certified": None if cert is None else {k: cert[k] for k in ("passed", "delta", "ci_lo", "ci_hi", "n")},
        "published": published,
    }
    print(best["table"])
    print(f"results: {db_path}\nbest map: {best['best_map']}\nreport: {summary['report']}")
    return summary


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description="Run the tune flow (ephemeral Prefect without PREFECT_API_URL).")
    ap.add_argument("study", nargs="?", default="studies/smollm2-135m.yaml")
    ap.add_argument("--db")
    ap.add_argument("--work")
    ap.add_argument("--storage", help="Optuna storage: a .journal path or an RDB URL (postgresql://...)")
    ap.add_argument("--overrides", type=json.loads, help="JSON deep-merged into the study (a smaller budget...)")
    ap.add_argument("--no-publish", action="store_true")
    a = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO)
    out = tune(a.study, a.overrides, a.db, a.work, a.storage, not a.no_publish)
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
