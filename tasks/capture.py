"""The calibration corpus's hash and the capture of every candidate split (cached across processes)."""

from __future__ import annotations

from pathlib import Path

from prefect import task
from prefect.cache_policies import NO_CACHE

from ridgefill.capture import CaptureOptions
from ridgefill.steps import CalibrationText, ModelRef, shared_model
from ridgefill.study import Calibration
from tasks import CACHED


@task(cache_policy=NO_CACHE)
def corpus_sha(source: str | list[str]) -> str:
    from ridgefill.corpus import load_corpus

    return load_corpus(source).sha256


@task(retries=1, cache_policy=CACHED, persist_result=True, result_serializer="json")
def capture(fingerprint: str, corpus: str, splits: list[int], m: ModelRef, cal: Calibration, root: str) -> str:
    """Capture statistics for every candidate split in one pass; a retry resumes from the checkpoint. Keyed by the
    weights' fingerprint, the corpus hash, the splits and the study's `calibration` section, taken whole."""
    from ridgefill.steps import run_capture

    lm, tok = shared_model(m.path, m.dtype, m.device)
    text = CalibrationText.of(cal)
    cap = run_capture(lm, tok, text, sorted(splits), Path(root) / fingerprint, CaptureOptions(progress=False))
    return str(cap.path)
