"""The calibration corpus's hash and the capture of every candidate split (cached across processes)."""

from __future__ import annotations

from pathlib import Path

from prefect import task
from prefect.cache_policies import NO_CACHE

from ridgefill.steps import shared_model
from tasks import CACHED


@task(cache_policy=NO_CACHE)
def corpus_sha(source: str | list[str]) -> str:
    from ridgefill.corpus import load_corpus

    return load_corpus(source).sha256


@task(retries=1, cache_policy=CACHED, persist_result=True, result_serializer="json")
def capture(
    fingerprint: str,
    corpus: str,
    splits: list[int],
    path: str,
    dtype: str,
    device: str,
    source: str | list[str],
    window: int,
    max_windows: int,
    heldout: int,
    root: str,
) -> str:
    """Capture statistics for every candidate split in one pass; a retry resumes from the checkpoint."""
    from ridgefill.steps import run_capture

    lm, tok = shared_model(path, dtype, device)
    cap = run_capture(
        lm, tok, source, sorted(splits), window=window, max_windows=max_windows, heldout=heldout,
        root=Path(root) / fingerprint, progress=False,
    )  # fmt: skip
    return str(cap.path)
