"""Records into DuckDB (the flow's one recorder): each finished trial, the exact baseline, the selection."""

from __future__ import annotations

from pathlib import Path

from prefect import task
from prefect.cache_policies import NO_CACHE

from ridgefill import objectives, report, search
from ridgefill.results import Recorder
from ridgefill.study import Study


@task(cache_policy=NO_CACHE)
def record_trial(recorder: Recorder, study_name: str, trial, max_drop: float) -> None:
    """Write one finished trial (parameters, objectives, metric rows) as one DuckDB transaction."""
    recorder.trials([search.record_of(study_name, trial, max_drop)])


@task(cache_policy=NO_CACHE)
def record_baseline(recorder: Recorder, study_name: str, exact: dict) -> None:
    recorder.baseline(study_name, objectives.ruler_rows("exact", exact["scores"]))


@task(cache_policy=NO_CACHE)
def select_best(recorder: Recorder, study, cfg: Study, report_dir: str) -> report.Selection:
    """Pareto front and chosen map into DuckDB; markdown table and PNG written beside the results."""
    return report.select(recorder, study.get_trials(deepcopy=False), cfg, Path(report_dir))
