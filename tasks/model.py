"""Resolve a study's weights (retried: the Hub can fail transiently)."""

from __future__ import annotations

import hashlib
import json

from prefect import task
from prefect.cache_policies import NO_CACHE

from ridgefill.default_model import default_model_dir
from ridgefill.fingerprint import fingerprint, fingerprint_key
from ridgefill.steps import ModelRef, Weights, hub_snapshot, shared_model
from ridgefill.study import Study


@task(retries=3, retry_delay_seconds=[5, 30, 120], cache_policy=NO_CACHE)
def resolve_model(cfg: Study) -> Weights:
    """Where the weights are, their revision and fingerprint."""
    return resolve_weights(cfg)


def resolve_weights(cfg: Study) -> Weights:
    """A study's weights: its local folder (or the embedded default), else a Hub snapshot; fingerprinted at
    every candidate split, so a new release (other anchors) gets another fingerprint."""
    m = cfg.model
    if m.local:
        path = str(default_model_dir()) if m.local == "default" else m.local
        revision = m.revision if m.local != "default" else "embedded"
    else:
        path, revision = hub_snapshot(m.repo, m.revision)
    lm, tok = shared_model(path, m.dtype, cfg.hardware.device)
    fps = [fingerprint(lm, tok, s) for s in sorted(cfg.search.splits)]
    weights = hashlib.sha256(json.dumps([fp["anchors"] for fp in fps], sort_keys=True).encode()).hexdigest()[:16]
    return Weights(path, revision, f"{fingerprint_key(fps[0])}-{weights}")


def model_ref(cfg: Study, weights: Weights) -> ModelRef:
    """The study's model at its resolved weights, with the study's dtype and device."""
    return ModelRef(weights.path, cfg.model.dtype, cfg.hardware.device)
