"""After publishing: pull the map back through the registry and serve it (`registry.serve_check`)."""

from __future__ import annotations

from prefect import task
from prefect.cache_policies import NO_CACHE

from ridgefill.steps import shared_model


@task(cache_policy=NO_CACHE)
def serve_pulled(path: str, dtype: str, device: str, publication, local_map: str) -> str:
    """Pull the published map back (every check), serve a prompt with it, and make sure it decodes exactly
    as the folder that was measured."""
    from registry import serve_check

    lm, tok = shared_model(path, dtype, device)
    return serve_check(lm, tok, publication, local_map)
