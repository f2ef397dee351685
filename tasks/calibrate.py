"""Calibrate the study's TTFT model (`ridgefill.ttft_model`) on its engine and machine, before any trial."""

from __future__ import annotations

from pathlib import Path

from prefect import task
from prefect.cache_policies import NO_CACHE

from ridgefill import objectives
from ridgefill.steps import shared_model
from ridgefill.study import Study
from ridgefill.ttft_model import TTFTModel


@task(cache_policy=NO_CACHE)  # a timing belongs to the machine and the moment: never cached
def calibrate_ttft(path: str, capture_path: str, cfg: Study, out: str) -> TTFTModel:
    """Paired timings at the search space's corners, fitted and checked: what every trial is ranked by."""
    lm, tok = shared_model(path, cfg.model.dtype, cfg.hardware.device)
    return objectives.calibrate(lm, tok, capture_path, cfg, Path(out))
