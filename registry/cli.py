"""`ridgefill publish`, `ridgefill pull`, `ridgefill maps list|demo`, added to the main typer app by `register`.

The Hub token is never a command-line option (it would land in shell history and `ps`): huggingface_hub
reads it from HF_TOKEN or its token file, and nothing here prints it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, NoReturn

import typer
from huggingface_hub.errors import HfHubHTTPError

from registry.base import Backend, RegistryError
from registry.hub import HubBackend
from registry.local import LocalBackend
from ridgefill.maps import MapError

maps_app = typer.Typer(help="Published map folders: list them, or run the local publish -> pull -> serve demo.")
BackendOpt = Annotated[str, typer.Option("--backend", help="auto (hub if a token/endpoint is set) | local | hub")]
RegistryOpt = Annotated[Path | None, typer.Option("--registry", help="local registry folder")]
EndpointOpt = Annotated[str | None, typer.Option("--endpoint", help="Hub endpoint (default: HF_ENDPOINT or hf.co)")]


def _backend(kind: str, registry: Path | None, endpoint: str | None, private: bool = True) -> Backend:
    from registry.publish import default_backend

    if kind == "hub" or (kind == "auto" and endpoint):
        return HubBackend(endpoint=endpoint, private=private)
    if kind == "local":
        return LocalBackend(registry)
    return default_backend(kind, registry)


def _fail(e: Exception) -> NoReturn:
    raise e  # `ridgefill` prints it as one line with exit status 2 (with `-v`, the traceback too)


def publish_cmd(
    repo: Annotated[str, typer.Option("--repo", help="owner/name of the map repo")],
    folder: Annotated[Path | None, typer.Argument(help="map folder (or use --db and --study)")] = None,
    study: Annotated[str | None, typer.Option(help="study name; its tag on the repo")] = None,
    results: Annotated[Path | None, typer.Option(help='JSON {"ruler":..,"ttft":..,"dnll":..} for the card')] = None,
    db: Annotated[Path | None, typer.Option(help="results file: publish the study's chosen map")] = None,
    base_model: Annotated[str | None, typer.Option(help="Hub id of the base model (default: from manifest)")] = None,
    base_revision: Annotated[str | None, typer.Option(help="revision of the base model")] = None,
    license: Annotated[str | None, typer.Option(help="card license (default: the maps' credit)")] = None,
    private: Annotated[bool, typer.Option("--private/--public", help="visibility of a Hub repo it creates")] = True,
    backend: BackendOpt = "auto",
    registry: RegistryOpt = None,
    endpoint: EndpointOpt = None,
) -> None:
    """Publish a map folder (or a study's best map from DuckDB) with a generated model card."""
    from registry.publish import publish, publish_best

    target = _backend(backend, registry, endpoint, private)
    card = {"base_model": base_model, "base_revision": base_revision, "license": license}
    try:
        if db is not None:
            if not study:
                raise RegistryError("--db needs --study")
            pub = publish_best(db, study, repo, target, **card)
        elif folder is None:
            raise RegistryError("give a map folder, or --db and --study")
        else:
            res = json.loads(results.read_text()) if results else {}
            pub = publish(folder, repo, res, study=study, backend=target, **card)
    except (RegistryError, MapError, HfHubHTTPError) as e:
        _fail(e)
    typer.echo(json.dumps(pub.as_dict(), indent=2))


def pull_cmd(
    name: Annotated[str, typer.Argument(help="repo id (owner/name) or base model name ('default' = SmolLM2)")],
    revision: Annotated[str | None, typer.Option(help="study tag, branch or commit (default: main)")] = None,
    model: Annotated[str, typer.Option(help="model to check the fingerprint against; 'none' skips it")] = "default",
    manifest_sha256: Annotated[
        str | None, typer.Option(help="the manifest digest a publication recorded; any other manifest is refused")
    ] = None,
    backend: BackendOpt = "auto",
    registry: RegistryOpt = None,
    endpoint: EndpointOpt = None,
) -> None:
    """Pull a map folder, verify its manifest, every file's sha256 and the model fingerprint; print its path."""
    from registry.pull import pull
    from ridgefill import steps

    lm, tok = (None, None) if model == "none" else steps.load_model(model)
    try:
        target = _backend(backend, registry, endpoint)
        pulled = pull(name, revision, lm, tok, backend=target, manifest_sha256=manifest_sha256)
    except (RegistryError, MapError, HfHubHTTPError, OSError) as e:
        _fail(e)
    typer.echo(str(pulled.path))


@maps_app.command("list")
def list_cmd(backend: BackendOpt = "auto", registry: RegistryOpt = None, endpoint: EndpointOpt = None) -> None:
    """List published map repos with their base model and refs (branch and study tags)."""
    target = _backend(backend, registry, endpoint)
    entries = target.list()
    if not entries:
        typer.echo(f"no published maps in {target!r}")
    for e in entries:
        typer.echo(f"{e.repo_id}  (base {e.base_model or '?'})")
        for ref, sha in e.refs.items():
            typer.echo(f"    {ref:<24} {sha}")


@maps_app.command("demo")
def demo_cmd(
    maps: Annotated[Path | None, typer.Option(help="map folder (default: `ridgefill demo`'s S=18 ridge maps)")] = None,
    registry: RegistryOpt = None,
    repo: str = "local/smollm2-ridgefill",
    prompt: str = "Explain in one sentence what a key-value cache is, and why long prompts make it costly.",
    tail: Annotated[int, typer.Option(help="protected tail rows (small, so the short prompt uses the maps)")] = 4,
    model: Annotated[str, typer.Option(help="model the maps are for; 'default' = embedded SmolLM2")] = "default",
    max_new_tokens: int = 24,
) -> None:
    """Publish a map folder to the local registry, pull it back verified, and generate with it."""
    from registry.publish import publish
    from registry.pull import pull
    from ridgefill import steps
    from ridgefill.default_model import cache_root
    from ridgefill.rows import RowPolicy
    from ridgefill.runtime import FillPlan, generate

    folder = maps or cache_root() / "maps" / "smollm2-S18-ridge"
    target = LocalBackend(registry)
    lm, tok = steps.load_model(model)
    try:
        pub = publish(folder, repo, study="demo", backend=target)
        ms = pull(repo, pub.revision, lm, tok, backend=target)
    except (RegistryError, MapError) as e:
        _fail(e)
    typer.echo(f"published {pub.repo_id}@{pub.revision} ({pub.commit_sha}); pulled and verified: {ms.path}")
    rows = RowPolicy.of(ms.manifest["defaults"]).given(tail=tail)
    chat = [{"role": "user", "content": prompt}]
    ids = tok.apply_chat_template(chat, add_generation_prompt=True, return_tensors="pt", return_dict=True)["input_ids"]
    plan = FillPlan("ridge", ms.split, ms, rows=rows)
    new = generate(lm, ids, plan, max_new_tokens)
    typer.echo(tok.decode(new[0], skip_special_tokens=True))
    bulk = max(0, ids.shape[1] - rows.sink - rows.tail)
    typer.echo(f"[{ids.shape[1]} prompt tokens: {bulk} filled from the pulled maps above layer {ms.split}]", err=True)


def register(app: typer.Typer) -> None:
    """Add the registry commands to the `ridgefill` app."""
    app.command("publish")(publish_cmd)
    app.command("pull")(pull_cmd)
    app.add_typer(maps_app, name="maps")
