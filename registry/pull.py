"""Pull a published map folder and verify it before anything uses it.

Checks, in order: the manifest reads, its own digest matches its content and it is consistent; given the
digest a publication recorded, the manifest is that one; every file it lists has its sha256; nothing unlisted
sits beside them (README.md is a doc and never hashed, since the Hub rewrites cards); and, given the model to
serve, its fingerprint (geometry + tokenizer) matches. A folder failing any check raises `MapError`; one that
passes is returned as the verified `MapSet`, which later steps pass along instead of checking it again.
"""

from __future__ import annotations

import logging
from dataclasses import replace
from pathlib import Path

import httpx2
from huggingface_hub.errors import HfHubHTTPError, OfflineModeIsEnabled

from registry.base import Backend, Publication, RegistryError
from registry.card import EMBEDDED_BASE
from ridgefill.default_model import DEFAULT_MODEL_NAME
from ridgefill.maps import (
    DIGEST,
    MANIFEST,
    MapError,
    MapSet,
    check_model,
    read_manifest,
    read_verified,
    verify_files,
)  # fmt: skip

log = logging.getLogger(__name__)


def verify_snapshot(path: Path, model=None, tokenizer=None, manifest_sha256: str | None = None) -> dict:
    """The manifest of a pulled folder, once it is the published one (given its digest) and its files (and,
    given a model, its fingerprint) check out."""
    path = Path(path)
    manifest = read_manifest(path)
    if manifest_sha256 and manifest[DIGEST] != manifest_sha256:
        raise MapError(
            f"{path}: {MANIFEST} has {DIGEST} {manifest[DIGEST][:12]}, the publication recorded "
            f"{manifest_sha256[:12]}; pull the published commit, or publish these maps"
        )
    verify_files(path, manifest)  # unlisted files too
    if model is not None:
        if tokenizer is None:
            raise ValueError("checking maps against a model needs its tokenizer too")
        check_model(manifest, model, tokenizer)
    return manifest


def find(backend: Backend, base_model: str) -> list[str]:
    """Repos in the backend whose card names `base_model`; empty when the backend cannot be searched (offline)."""
    try:
        return backend.find(base_model)
    except (OfflineModeIsEnabled, HfHubHTTPError, httpx2.TransportError) as e:
        log.info("cannot search %r for %s (%s); taking it as a repo id", backend, base_model, type(e).__name__)
        return []


def resolve(name: str, backend: Backend) -> str:
    """A repo id from a repo id or a model name ("default" = the embedded SmolLM2's Hub id)."""
    base = EMBEDDED_BASE if name in ("default", DEFAULT_MODEL_NAME) else name
    found = find(backend, base)
    if len(found) > 1:
        raise RegistryError(f"several map repos are for {base}: {', '.join(found)}; pass one of them")
    if found:
        return found[0]
    if "/" not in name:
        raise RegistryError(f"no published maps for {base!r} in {backend!r}")
    return name


def pull(
    repo_id_or_model_name: str,
    revision: str | None = None,
    model=None,
    tokenizer=None,
    *,
    backend: Backend | None = None,
    manifest_sha256: str | None = None,
) -> MapSet:
    """Download (or find in the cache) a map folder and return it verified, as the `MapSet` later steps pass
    along (its files hashed once here; its fingerprint matched to `model` when given); given the
    `manifest_sha256` a publication recorded, the pulled manifest must be that one."""
    return read_verified(*_pull(repo_id_or_model_name, revision, model, tokenizer, backend, manifest_sha256))


def _pull(name: str, revision, model, tokenizer, backend: Backend | None, manifest_sha256) -> tuple[Path, dict]:
    from registry.publish import default_backend

    backend = backend or default_backend()
    repo_id = resolve(name, backend)
    path = backend.download(repo_id, revision)
    manifest = verify_snapshot(path, model, tokenizer, manifest_sha256)
    log.info("pulled %s@%s -> %s (verified)", repo_id, revision or "main", path)
    return path, manifest


def pull_publication(pub: Publication, model=None, tokenizer=None, *, backend: Backend | None = None) -> MapSet:
    """Pull exactly what a publication recorded (its commit, checked against its manifest digest), verified."""
    from registry.publish import default_backend

    backend = backend or default_backend(pub.backend)
    return pull(pub.repo_id, pub.commit_sha, model, tokenizer, backend=backend, manifest_sha256=pub.manifest_sha256)


def serve_check(model, tokenizer, publication: Publication, local_map: str | Path) -> str:
    """Pull a publication back (every check), serve a prompt with it, and make sure it decodes exactly as
    the folder that was measured (each folder verified once)."""
    import torch

    from ridgefill.maps import load_maps
    from ridgefill.rows import RowPolicy
    from ridgefill.runtime import FillPlan, generate

    pulled = pull_publication(publication, model, tokenizer)  # its commit, checked against its digest
    ids = torch.tensor([tokenizer(" ".join(["The pulled map serves this prompt."] * 60))["input_ids"]])
    outs = []
    for ms in (pulled, load_maps(Path(local_map), model, tokenizer)):
        rows = RowPolicy.of(ms.manifest["defaults"])
        plan = FillPlan("ridge", maps=ms, rows=replace(rows, tail=min(rows.tail, 32)))
        outs.append(generate(model, ids.to(model.device), plan, 8)[0].tolist())
    if outs[0] != outs[1]:
        raise RuntimeError(f"the pulled map {pulled.path} decodes differently from the measured one {local_map}")
    return f"{pulled.path} ({len(outs[0])} tokens, identical to the measured map)"
