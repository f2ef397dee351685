"""Publish a map folder with its card, and publish the best map of a finished study from DuckDB.

`publish_best` reads the study's chosen row of the pipeline's `maps` table (`ridgefill/results.py` owns that
schema), with its trial's dNLL and its rows of `metrics`, publishes the map, and records the repo, revision
(the study's tag), commit sha and manifest digest in the `publications` table (the one record of a
publication; its schema is `ridgefill/results.py`'s, and the `best_map` view shows it). The results file is opened
for each read and written once, in one transaction, after every upload, so a long upload never holds the
single-writer lock that the tuner needs.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from datetime import UTC, datetime
from pathlib import Path

from huggingface_hub import get_token

from registry.base import Backend, Publication, RegistryError, tag_for
from registry.card import CERTIFIED, EMBEDDED_BASE, GROUPS, make_card
from registry.hub import HubBackend
from registry.local import LocalBackend
from ridgefill import settings
from ridgefill.maps import read_manifest

log = logging.getLogger(__name__)
PUBLICATION_COLS = (
    "study", "repo_id", "revision", "commit_sha", "backend", "url", "map_path", "published_at", "manifest_sha256",
)  # fmt: skip


def default_backend(kind: str | None = None, root: Path | None = None) -> Backend:
    """`hub` when a Hub token or endpoint is configured (or asked for), else the local folder registry."""
    kind = kind or settings.get("RIDGEFILL_REGISTRY_BACKEND")
    if kind == "local":
        return LocalBackend(root)
    if kind == "hub":
        return HubBackend()
    if kind != "auto":
        raise RegistryError(f"unknown registry backend {kind!r} (auto | local | hub)")
    if settings.get("HF_ENDPOINT") or get_token():
        return HubBackend()
    return LocalBackend(root)


def publish(
    folder: Path,
    repo_id: str,
    results: Mapping | None = None,
    *,
    study: str | None = None,
    backend: Backend | None = None,
    **card: str | None,
) -> Publication:
    """Publish a verified map folder with a generated card (`card`: its `base_model`, `base_revision` and
    `license`, as `make_card` takes them); a study gets its own tag."""
    folder = Path(folder)
    manifest = read_manifest(folder)
    backend = backend or default_backend()
    card = make_card(manifest, results or {}, repo_id, study=study, **card)
    tag = tag_for(study) if study else None
    message = f"RidgeFill {manifest['kind']} maps, S={manifest['split']}" + (f", study {study}" if study else "")
    pub = backend.publish(folder, repo_id, str(card), tag=tag, message=message)
    log.info("published %s as %s@%s (commit %s)", folder, pub.repo_id, pub.revision, pub.commit_sha)
    return pub


def results_of(row: Mapping) -> dict:
    """The card's results from a `maps` row: RULER delta and the trial's mean dNLL. No search-time TTFT: the card's
    speed is the certified one (`registry.card.certified_ttft`), measured on the serving engine with its CI."""
    found = {"ruler": ("delta", row.get("ruler_delta")), "dnll": ("mean", row.get("dnll_mean"))}
    return {g: {name: value} for g, (name, value) in found.items() if value is not None}


def _metric_rows(con, study: str, trial: int) -> dict:
    """RULER / TTFT / NLL rows of the pipeline's `metrics` table for one trial, nested for the card."""
    rows = con.execute(
        "SELECT kind, task, length, region, value FROM metrics WHERE study = ? AND trial = ? AND plan <> 'exact'",
        [study, trial],
    ).fetchall()
    out: dict = {g: {} for g in GROUPS}
    for kind, task, length, region, value in rows:
        group = {"nll": "dnll"}.get(kind, kind)
        if group not in GROUPS or group == "ttft" or value is None:  # search-time timings stay off the card
            continue
        leaf = out[group].setdefault(task, {})
        if region in (None, "all") and group != "ruler":
            leaf[str(length)] = value
        else:
            leaf.setdefault(str(length), {})[region] = value
    return out


def study_map(con, study: str, map_path: str | None = None) -> tuple[Path, dict, dict]:
    """(map folder, results, row) of a study's best map: its chosen row of `maps` (or the row of `map_path`),
    with its trial's dNLL and its rows of `metrics`."""
    sql = "SELECT m.*, t.dnll AS dnll_mean FROM maps m LEFT JOIN trials t USING (study, trial) WHERE m.study = ?"
    cur = con.execute(sql + (" AND m.path = ?" if map_path else " AND m.chosen"), [study, *filter(None, [map_path])])
    names, rows = [d[0] for d in cur.description], cur.fetchall()
    if not rows:
        raise RegistryError(f"study {study!r} has no best map recorded (is it finished?)")
    if len(rows) > 1:
        raise RegistryError(f"study {study!r} has {len(rows)} best-map rows; expected one")
    row = dict(zip(names, rows[0], strict=True))
    results = results_of(row)
    if row.get("trial") is not None:
        for group, values in _metric_rows(con, study, row["trial"]).items():
            results[group] = {**values, **results.get(group, {})}
    tables = {r[0] for r in con.execute("SELECT table_name FROM information_schema.tables").fetchall()}
    if "certifications" in tables and row.get("trial") is not None:  # results files from before certification
        results[CERTIFIED] = _certificate(con, study, row["trial"])
    return Path(map_path or row["path"]), {g: v for g, v in results.items() if v}, row


def _certificate(con, study: str, trial: int) -> dict | None:
    """The map's recorded certificate; a map that failed its certification is refused here, before any upload."""
    found = con.execute("SELECT passed, detail FROM certifications WHERE study = ? AND trial = ?", [study, trial])
    row = found.fetchone()
    if row is None:
        return None
    if not row[0]:
        raise RegistryError(f"study {study!r} trial {trial}: the map failed its certification; it is not published")
    return json.loads(row[1])


def _connect(db_path: Path):
    """The results file through the pipeline's `connect`: the same configuration as its Recorder, and the
    same wait while another process holds the file."""
    from ridgefill.results import connect

    return connect(db_path)


def record_publications(db_path: Path, rows: list[tuple[str, Publication, Path]]) -> None:
    """Record publications in one transaction with one batched INSERT (keyed by repo and revision)."""
    from ridgefill.results import insert_rows

    now = datetime.now(UTC)
    values = [
        (s, p.repo_id, p.revision, p.commit_sha, p.backend, p.url, str(m), now, p.manifest_sha256) for s, p, m in rows
    ]
    with _connect(db_path) as con:
        con.execute("BEGIN TRANSACTION")
        try:
            insert_rows(con, "publications", PUBLICATION_COLS, values)
            con.execute("COMMIT")
        except Exception:
            con.execute("ROLLBACK")
            raise


def base_of(db_path: Path, study: str, row: Mapping) -> dict:
    """Card defaults from the results file: the base model (a Hub id) and its revision from `studies`."""
    with _connect(db_path) as con:
        found = con.execute("SELECT model, revision FROM studies WHERE study = ?", [study]).fetchall()
    model, revision = found[0] if found else (row.get("model"), None)
    return {"base_model": model, "base_revision": revision} if model and "/" in str(model) else {}


def default_repo(backend: Backend, base_model: str | None) -> str:
    """`$RIDGEFILL_REPO`, else `<owner>/<base model name>-ridgefill` (owner: "local", or the token's user)."""
    if repo := settings.get("RIDGEFILL_REPO"):
        return repo
    name = (base_model or EMBEDDED_BASE).split("/")[-1].lower()
    return f"{backend.owner()}/{name}-ridgefill"


def publish_best(
    db: Path | str,
    study: str,
    repo_id: str | None = None,
    backend: Backend | None = None,
    *,
    map_path: str | None = None,
    **card: str | None,
) -> Publication:
    """Publish the best map of a finished study (the results file `db`) under the study's tag and record it in
    `publications`; `map_path` picks the study's row of that map instead of its chosen one."""
    if not db or not study:
        raise RegistryError("publish_best needs the results file and the study name")
    return _publish_rows(Path(db), [(study, map_path)], repo_id, backend, card)[0]


def publish_studies(
    db_path: Path,
    studies: list[str],
    repo_id: str | None = None,
    backend: Backend | None = None,
    **card: str | None,
) -> list[Publication]:
    """Publish the best map of each study (one tag each), then record them all in one batch insert."""
    return _publish_rows(Path(db_path), [(s, None) for s in studies], repo_id, backend, card)


def _publish_rows(db_path, wanted, repo_id, backend, card) -> list[Publication]:
    backend = backend or default_backend()
    done = []
    for study, map_path in wanted:
        with _connect(db_path) as con:
            folder, results, row = study_map(con, study, map_path)
        kw = {**base_of(db_path, study, row), **{k: v for k, v in card.items() if v is not None}}
        repo = repo_id or default_repo(backend, kw.get("base_model"))
        done.append((study, publish(folder, repo, results, study=study, backend=backend, **kw), folder))
    record_publications(db_path, done)  # after every upload: the write lock is never held across the network
    return [p for _, p, _ in done]
