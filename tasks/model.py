"""Resolve a study's weights (retried: the Hub can fail transiently)."""

from __future__ import annotations

from prefect import task
from prefect.cache_policies import NO_CACHE

from ridgefill.steps import Weights, resolve_weights
from ridgefill.study import Study


@task(retries=3, retry_delay_seconds=[5, 30, 120], cache_policy=NO_CACHE)
def resolve_model(cfg: Study) -> Weights:
    """Where the weights are, their revision and fingerprint."""
    return resolve_weights(cfg)
