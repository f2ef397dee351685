"""The search: an Optuna multi-objective study over (split, lambda, tail, share).

Objectives, both maximised: RULER delta vs exact (points, <= 0 in practice) and TTFT speed-up vs exact.
The RULER delta is paired: each sample's score minus exact's on the same sample, averaged per task and
then over tasks x lengths. Constraint (`trial.set_constraint`): the 95% bootstrap CI lower bound of that
paired delta stays within the study's maximum drop, so a few lucky samples cannot pass a lossy map. The study lives
in real storage (a journal file by default, or an RDB URL such as PostgreSQL shared by several
machines) and is driven with ask/tell so a caller (the Prefect flow, a test) supplies the evaluation.
A trial left RUNNING by a dead process of this host is failed and its parameters re-enqueued on resume.

The objectives of a trial are measured in `ridgefill.objectives`; the Pareto front, the chosen trial and
the reports are in `ridgefill.report`.
"""

from __future__ import annotations

import logging
import math
import os
import socket
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import optuna
from optuna.trial import FrozenTrial, TrialState

from ridgefill.evals.paired import within
from ridgefill.params import Params
from ridgefill.results import Recorder, TrialRecord
from ridgefill.rows import ROWS
from ridgefill.study import Search, Study

log = logging.getLogger(__name__)
DIRECTIONS = ("maximize", "maximize")  # RULER delta vs exact, TTFT speed-up
FINISHED = (TrialState.COMPLETE, TrialState.FAIL)


@dataclass
class Outcome:
    """What evaluating one trial gives: both objectives, dNLL, the map folder and metric rows."""

    ruler_delta: float
    speedup: float
    dnll: float | None = None
    map_path: str | None = None
    metrics: list[tuple] = field(default_factory=list)  # (kind, plan, task, length, region, value, n)
    ruler_ci: dict | None = None  # {"lo", "hi", "n"} of the paired delta's 95% CI; None: judged on the mean
    speedup_measured: bool = True  # False: not timed; `speedup` is the prediction (or, without a model, the FLOP bound)
    speedup_predicted: float | None = None  # the calibrated TTFT model's speed-up (`ridgefill.ttft_model`)
    speedup_bound: float | None = None  # the FLOP bound at the TTFT lengths
    speedup_invalid: bool = False  # per-trial timing above its FLOP bound twice: recorded, never used


Evaluate = Callable[[list[tuple[int, Params]]], list[Outcome | BaseException]]


# --- storage and study -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Store:
    """Where a study's Optuna trials live: a journal file under `root` by default, a `*.journal` path as given, or
    an RDB URL (postgresql://, sqlite://) that several workers share."""

    url: str | None
    root: Path
    name: str

    @property
    def shared(self) -> bool:
        """An RDB URL: other workers may add trials, so this run settles and syncs them at its end."""
        return bool(self.url and "://" in self.url)

    @property
    def journal(self) -> Path:
        return Path(self.url) if self.url else Path(self.root) / "optuna" / f"{self.name}.journal"

    def open(self) -> optuna.storages.BaseStorage:
        from optuna.storages.journal import JournalFileBackend, JournalStorage

        if self.shared:
            return _rdb(self.url)
        self.journal.parent.mkdir(parents=True, exist_ok=True)
        return JournalStorage(JournalFileBackend(str(self.journal)))

    def __str__(self) -> str:
        return "the shared RDB storage" if self.shared else str(self.journal)


def storage(url: str | None, root: Path, name: str) -> optuna.storages.BaseStorage:
    """A journal file under `root` by default; `*.journal` paths or RDB URLs (postgresql://, sqlite://) as given."""
    return Store(url, root, name).open()


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
    with S, so the front lies between the ends; a budget of 3 tries 3 splits, a larger one up to half of it.
    The share starts at its smallest value, or, with the question selector (which only acts through a
    share), at the middle of its range; a searched pooling window at its middle width."""
    lam = math.sqrt(search.lam[0] * search.lam[1])
    n = max(1, min(len(search.splits), max(min(budget, 3), budget // 2)))
    splits = bracket(sorted(set(search.splits)))[:n]
    share = sum(search.share) / 2 if search.select == "question" else search.share[0]
    start = {"lam": lam, "tail": max(search.tails), "share": share}
    if len(search.windows) > 1:  # searched: start at the middle width
        start["window"] = sorted(search.windows)[len(search.windows) // 2]
    return [{"split": s, **start} for s in splits]


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
    windows = list(search.windows)
    rows = ROWS.given(
        sink=search.sink, tail=int(trial.suggest_categorical("tail", list(search.tails))), share=float(share),
        select=search.select, reach=search.reach,
        window=int(trial.suggest_categorical("window", windows)) if len(windows) > 1 else windows[0],
    )  # fmt: skip
    return Params(int(trial.suggest_categorical("split", list(search.splits))), float(lam), rows)


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
    if not out.speedup_measured:
        trial.set_user_attr("speedup_measured", False)
    for name in ("speedup_predicted", "speedup_bound"):
        if getattr(out, name) is not None:
            trial.set_user_attr(name, float(getattr(out, name)))
    if out.speedup_invalid:
        trial.set_user_attr("speedup_invalid", True)
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


# --- feasibility and records -----------------------------------------------------------------------------


def ruler_low(delta: float, ci: dict | None) -> float:
    """What the constraint judges: the CI lower bound of the paired delta (the mean for trials without one)."""
    return float(ci["lo"]) if ci and ci.get("lo") is not None else float(delta)


def feasible(t: FrozenTrial, max_drop: float) -> bool:
    """Complete and inside the RULER-drop limit given now (a trial's stored constraint used the limit of its
    day): the paired delta's CI lower bound is >= -max_drop."""
    if t.state != TrialState.COMPLETE:
        return False
    return within(ruler_low(t.values[0], t.user_attrs.get("ruler_ci")), max_drop)


def best_feasible_speedup(study: optuna.Study, max_drop: float) -> float | None:
    """The front's fastest point so far (None: no feasible trial yet): what a new trial must come near to be
    promoted to more RULER samples (`decision.Gate.promotes`)."""
    done = study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
    ups = [t.values[1] for t in done if feasible(t, max_drop) and usable(t)]
    return max(ups) if ups else None


def speedup_source(t: FrozenTrial) -> str | None:
    """Where a complete trial's speed-up objective comes from: "predicted" (the calibrated TTFT model),
    "measured" (per-trial timing), "invalid" (a timing above its FLOP bound: never used) or None (not timed:
    the FLOP bound stands in, it steers nothing)."""
    if t.state != TrialState.COMPLETE:
        return None
    a = t.user_attrs
    if a.get("speedup_invalid"):
        return "invalid"
    if a.get("speedup_measured") is not False:
        return "measured"
    return "predicted" if a.get("speedup_predicted") is not None else None


def usable(t: FrozenTrial) -> bool:
    """A trial whose speed-up may rank it: predicted or measured, never an invalid timing."""
    return speedup_source(t) != "invalid"


def ranked_speedup(t: FrozenTrial) -> float | None:
    """The speed-up a trial is ranked and shown by: predicted or measured (None: not timed, or invalid)."""
    return t.values[1] if speedup_source(t) in ("predicted", "measured") else None


def measured_speedup(t: FrozenTrial) -> float | None:
    """A complete trial's measured TTFT speed-up (None: not complete, or not timed because it could not pass)."""
    return t.values[1] if speedup_source(t) == "measured" else None


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
        speedup=ranked_speedup(t),
        dnll=t.user_attrs.get("dnll"),
        feasible=feasible(t, max_drop) if done else None,
        map_path=t.user_attrs.get("map_path"),
        seconds=t.user_attrs.get("seconds"),
        metrics=metrics,
        ruler_ci=t.user_attrs.get("ruler_ci"),
        speedup_predicted=t.user_attrs.get("speedup_predicted"),
        speedup_bound=t.user_attrs.get("speedup_bound"),
        speedup_source=speedup_source(t),
    )


def sync(recorder: Recorder, study: optuna.Study, max_drop: float) -> int:
    """Upsert every finished trial of the study (whoever ran it) into DuckDB; returns how many."""
    done = study.get_trials(deepcopy=False, states=FINISHED)
    recorder.trials([record_of(study.study_name, t, max_drop) for t in done])
    return len(done)
