"""After publishing: pull the map back through the registry and serve it (`registry.serve_check`)."""

from __future__ import annotations

from prefect import task
from prefect.cache_policies import NO_CACHE

from ridgefill.steps import ModelRef


@task(cache_policy=NO_CACHE)
def serve_pulled(m: ModelRef, publication, local_map: str) -> str:
    """Pull the published map back (every check), serve a prompt with it, and make sure it decodes exactly
    as the folder that was measured."""
    from registry import serve_check

    lm, tok = m.load()
    return serve_check(lm, tok, publication, local_map)
