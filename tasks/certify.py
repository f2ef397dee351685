"""Certify the chosen map on the study's `certify` benchmark (`ridgefill.certify`)."""

from __future__ import annotations

from prefect import task
from prefect.cache_policies import NO_CACHE

from ridgefill.certify import certify_trial
from ridgefill.results import Recorder
from ridgefill.steps import shared_model
from ridgefill.study import Study


@task(cache_policy=NO_CACHE)
def certify_map(
    recorder: Recorder, study_name: str, trial, path: str, inputs_sha: str, exact: dict, cfg: Study
) -> dict:
    """The chosen trial's certificate, paired against `exact` (that benchmark's cached exact run)."""
    lm, tok = shared_model(path, cfg.model.dtype, cfg.hardware.device)
    return certify_trial(recorder, study_name, trial, lm, tok, inputs_sha, exact, cfg)
