"""Certify a chosen map before it is published: a fuller RULER run, paired against exact on the same samples.

Why: the tuner sees few samples of few tasks per trial, so the map it chooses is the best of many noisy
looks. The study's `certify` section (tasks, lengths, samples, haystack, seed) scores that one map and the
exact baseline on the same prompts; the map passes when the 95% bootstrap CI lower bound of its mean paired
delta (per task and length, then averaged, as RULER averages tasks) is >= -max_drop. The certificate, pass
or fail, is recorded in DuckDB; only a passing map goes on to the registry, and its card carries the
certified numbers with n, CI and what was run.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

from ridgefill.engines import ENGINES, serving_engine
from ridgefill.study import Certify, Study

if TYPE_CHECKING:
    from ridgefill.steps import ModelRef

log = logging.getLogger(__name__)
T = TypeVar("T")
MAP, EXACT = "map", "exact"
TOL = 1e-12  # a bound that lands on the limit (a mean of whole-sample losses) passes, whatever the rounding


def rule(max_drop: float) -> str:
    return f"95% bootstrap CI lower bound of the mean paired RULER delta vs exact >= -{max_drop:g} points"


def haystack_label(source: str | list[str], words_sha: str) -> str:
    """What the card may say about the haystack: its name (never a local path) and its words' hash."""
    if source == "pydoc":
        name = "pydoc (Python's own documentation)"
    elif source == "prose":
        name = "prose (the installed packages' README prose)"
    else:
        files = [source] if isinstance(source, str) else source
        name = ", ".join(Path(f).name for f in files)
    return f"{name}, words sha256 {words_sha[:12]}"


def key_of(spec: Certify, max_drop: float, inputs_sha: str, manifest_sha: str | None) -> str:
    """What a certificate depends on: the map, the benchmark settings, their inputs and the limit."""
    blob = json.dumps([spec.ruler().model_dump(), max_drop, inputs_sha, manifest_sha], sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()


def certificate(
    study: str,
    trial: int,
    spec: Certify,
    max_drop: float,
    map_rows: Sequence[dict],
    exact_rows: Sequence[dict],
    haystack: str,
) -> dict:
    """Judge one map on per-sample rows (task, length, index, region, score) of it and of exact.

    Returns the certificate: pass/fail, the rule, the overall paired delta with its CI and n, the per-task
    deltas (CI, McNemar p), the filled-region breakdown, and the tasks, lengths, samples, haystack and seed; the
    caller stamps its `engine`, `key` and `seconds`.
    """
    from ridgefill.evals.paired import bootstrap_mean_of_tasks, pair, paired_summary, region_breakdown
    from ridgefill.objectives import sample_rows

    rows = sample_rows(MAP, map_rows) + sample_rows(EXACT, exact_rows)
    cells = pair(rows, MAP, EXACT)
    if not cells:
        raise ValueError("certification: no sample of the map has an exact partner (different settings?)")
    overall = bootstrap_mean_of_tasks([p - e for p, e in cells.values()], seed=spec.seed)
    summary = paired_summary(rows, MAP, EXACT, seed=spec.seed)
    per_task = [
        {"task": task, "length": length, **_est(c["delta"]), "score": c["score"], "exact": c["reference"], "p": c["p"]}
        for (task, length), c in sorted(summary["tasks"].items())
    ]
    per_length = {
        str(length): {**_est(c["delta"]), "score": c["score"], "exact": c["reference"]}
        for length, c in summary["overall"].items()
    }
    return {
        "study": study,
        "trial": trial,
        "passed": bool(overall.lo >= -max_drop - TOL),
        "rule": rule(max_drop),
        "max_drop": max_drop,
        "delta": overall.mean,
        "ci_lo": overall.lo,
        "ci_hi": overall.hi,
        "n": overall.n,
        "score": float(sum(p.mean() for p, _ in cells.values()) / len(cells)),
        "exact": float(sum(e.mean() for _, e in cells.values()) / len(cells)),
        "tasks": sorted({t for t, _ in cells}),
        "lengths": sorted({n for _, n in cells}),
        "samples": spec.samples,
        "haystack": haystack,
        "seed": spec.seed,
        "engine": "transformers",
        "per_task": per_task,
        "per_length": per_length,
        "regions": region_breakdown(rows, MAP, EXACT),
        "key": "",
        "seconds": None,
    }


def _est(e) -> dict:
    return {"delta": e.mean, "ci_lo": e.lo, "ci_hi": e.hi, "n": e.n}


def metric_rows(cert: dict) -> list[tuple]:
    """Metric rows (kind 'certify', plan, task, length, region, value, n) of a certificate."""
    rows = []
    for c in cert["per_task"]:
        rows += [
            ("certify", MAP, c["task"], c["length"], "all", c["score"], c["n"]),
            ("certify", EXACT, c["task"], c["length"], "all", c["exact"], c["n"]),
            ("certify", "delta", c["task"], c["length"], "all", c["delta"], c["n"]),
            ("certify", "delta", c["task"], c["length"], "ci_lo", c["ci_lo"], c["n"]),
            ("certify", "delta", c["task"], c["length"], "ci_hi", c["ci_hi"], c["n"]),
            ("certify", "delta", c["task"], c["length"], "mcnemar_p", c["p"], c["n"]),
        ]
    for region, r in cert["regions"].items():
        rows += [
            ("certify", MAP, "all", 0, region, r["score"], r["n"]),
            ("certify", EXACT, "all", 0, region, r["reference"], r["n"]),
        ]
    return rows


def summary_line(cert: dict) -> str:
    verdict = "passed" if cert["passed"] else "FAILED"
    return (
        f"certification {verdict}: {cert['study']} trial {cert['trial']}: RULER delta {cert['delta']:+.1f} "
        f"[{cert['ci_lo']:+.1f}, {cert['ci_hi']:+.1f}] (n={cert['n']}; {', '.join(cert['tasks'])} at "
        f"{', '.join(map(str, cert['lengths']))}; haystack {cert['haystack']}); rule: {cert['rule']}"
    )


def passed(recorder, cert: dict, logger: logging.Logger | None = None) -> bool:
    """Record the certificate (pass or fail) and log it: whether its map may be published."""
    logger = logger or log
    recorder.certification(cert, metric_rows(cert))
    if not cert["passed"]:
        logger.error("%s; not published", summary_line(cert))
        return False
    logger.info("%s", summary_line(cert))
    if cert.get("ttft"):
        logger.info("%s", ttft_line(cert["ttft"]))
    return True


def gate(recorder, cert: dict, publish: Callable[[], T], logger: logging.Logger | None = None) -> T | None:
    """Record the certificate (pass or fail), then publish only a map that passed; returns what `publish` gave."""
    return publish() if passed(recorder, cert, logger) else None


def certify_trial(recorder, study: str, trial, m: ModelRef, inputs_sha: str, exact: dict, cfg: Study) -> dict:
    """A study's chosen trial on its `certify` benchmark, paired against `exact` (that benchmark's exact run on
    the same engine): its certificate, for `gate` to record. It runs on the serving engine (vLLM when installed,
    `engines.serving_engine`), whatever engine the trials used: what ships is judged as it is served, and a
    batch per task x length affords the samples a CI needs. One already recorded for the same map, settings,
    inputs and limit is reused, so a rerun does not pay for it again."""
    import time

    from ridgefill.evals.ruler import load_haystack
    from ridgefill.maps import sha256_file
    from ridgefill.objectives import VllmJob, certified_ttft, plan_for, ruler_result, run_ruler_plan, run_vllm_job
    from ridgefill.search import Params, params_of

    model, tokenizer = m.load()
    spec, drop, engine = cfg.certify, cfg.certify_drop, serving_engine(cfg)
    mp = trial.user_attrs["map_path"]
    timing = json.dumps(cfg.objectives.ttft.model_dump(exclude={"per_trial"}), sort_keys=True)  # the certified TTFT
    key = key_of(spec, drop, f"{inputs_sha}:{engine}:{timing}", sha256_file(Path(mp) / "ridgefill.json"))
    if (old := recorder.certified(study, trial.number)) is not None and old.get("key") == key:
        return old
    t0 = time.time()
    params = Params.of(params_of(trial))
    plan = plan_for(params, mp, model, tokenizer)
    if ENGINES[engine].serving:  # as served: one engine, a batch per task x length
        run = ruler_result(run_vllm_job(VllmJob.of(model, cfg.model.dtype, plan).scoring(spec.ruler()))["ruler"])
    else:
        run = run_ruler_plan(model, tokenizer, plan, spec.ruler())
    words = hashlib.sha256("\n".join(load_haystack(spec.haystack).words).encode()).hexdigest()
    hay = haystack_label(spec.haystack, words)
    cert = certificate(study, trial.number, spec, drop, run["samples"], exact["samples"], hay)
    cert |= {"engine": engine, "key": key, "seconds": 0.0}
    ttft = certified_ttft(model, tokenizer, params, mp, cfg, trial.user_attrs.get("speedup_predicted"))
    cert["seconds"] = time.time() - t0
    return with_ttft(cert, ttft)


def with_ttft(cert: dict, ttft: dict) -> dict:
    """The certificate with the map's certified TTFT; a timing above its FLOP bound fails the certificate (a
    speed no map can have is never published)."""
    out = cert | {"ttft": ttft}
    if not ttft["valid"]:
        out["passed"] = False
        out["rule"] = cert["rule"] + "; and a certified TTFT at or under its FLOP bound"
        log.error("%s", ttft_line(ttft))
    return out


def ttft_line(t: dict) -> str:
    """The certified TTFT in one line: figure, CI, rounds, engine and the FLOP bound beside it."""
    verdict = "" if t["valid"] else "INVALID (above its FLOP bound: the timing is wrong) "
    return (
        f"certified TTFT {verdict}{t['speedup']:.3f}x [{t['lo']:.3f}, {t['hi']:.3f}] ({t['rounds']} paired rounds, "
        f"{t['engine']} {t['dtype']} on {t['device']}, {', '.join(map(str, t['lengths']))} tokens; FLOP bound "
        f"{t['bound']:.3f}x"
        + ("" if t.get("predicted") is None else f", predicted {t['predicted']:.3f}x")
        + ")"
        + (f"; {t['note']}" if t.get("note") else "")
        + ("; remeasured with twice the rounds: the first estimate lay above the bound" if t.get("remeasured") else "")
    )
