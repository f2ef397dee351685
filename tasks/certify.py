"""Certify the chosen map on the study's `certify` benchmark (`ridgefill.certify`)."""

from __future__ import annotations

from prefect import task
from prefect.cache_policies import NO_CACHE

from ridgefill.certify import certify_trial
from ridgefill.results import Recorder
from ridgefill.steps import ModelRef
from ridgefill.study import Study


@task(cache_policy=NO_CACHE)
def certify_map(
    recorder: Recorder, study_name: str, trial, m: ModelRef, inputs_sha: str, exact: dict, cfg: Study
) -> dict:
    """The chosen trial's certificate, paired against `exact` (that benchmark's cached exact run)."""
    return certify_trial(recorder, study_name, trial, m, inputs_sha, exact, cfg)
