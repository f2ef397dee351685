"""A registry in a local folder, laid out exactly like the Hugging Face cache.

    <root>/models--<owner>--<name>/blobs/<sha256>              file contents, by hash
    <root>/models--<owner>--<name>/snapshots/<commit>/<file>   symlinks into blobs, one folder per commit
    <root>/models--<owner>--<name>/refs/<branch or tag>        the commit a ref points to

Because the layout is the cache's, pulling is the same `snapshot_download` (with local files only) and the
same verification as for the Hub, and `maps list` is `scan_cache_dir`. Commits are content ids (sha1 of the
parent, the file hashes and the message), so republishing identical maps gives the same commit.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

from huggingface_hub import scan_cache_dir, snapshot_download
from huggingface_hub.errors import CacheNotFound, LocalEntryNotFoundError
from huggingface_hub.file_download import repo_folder_name

from registry.base import CARD, Publication, RegistryError, RepoEntry, check_repo_id, map_files
from registry.card import read_card
from ridgefill import settings
from ridgefill.default_model import cache_root

BRANCH = "main"


def default_root() -> Path:
    return settings.registry_dir() or cache_root() / "registry"


def _commit_id(parent: str | None, files: dict[str, str], message: str) -> str:
    payload = json.dumps({"parent": parent, "files": files, "message": message}, sort_keys=True)
    return hashlib.sha1(payload.encode()).hexdigest()


class LocalBackend:
    """Publish to and pull from a folder; the default when no Hub token or endpoint is configured."""

    name = "local"

    def __init__(self, root: Path | None = None) -> None:
        self.root = Path(root) if root is not None else default_root()

    def __repr__(self) -> str:
        return f"LocalBackend({str(self.root)!r})"

    def storage(self, repo_id: str) -> Path:
        check_repo_id(repo_id)
        return self.root / repo_folder_name(repo_id=repo_id, repo_type="model")

    def ref(self, repo_id: str, ref: str) -> str | None:
        path = self.storage(repo_id) / "refs" / ref
        return path.read_text() if path.is_file() else None

    def publish(self, folder: Path, repo_id: str, card: str, *, tag: str | None, message: str) -> Publication:
        """Store the map files and the card as a new commit on main, and tag it (a tag never moves)."""
        store, folder = self.storage(repo_id), Path(folder)
        if tag and tag == BRANCH:
            raise RegistryError(f"{tag!r} is the branch name, not a study tag")
        names, digest = map_files(folder)
        sources = {name: folder / name for name in names}
        (store / "blobs").mkdir(parents=True, exist_ok=True)
        (store / "refs").mkdir(exist_ok=True)
        digests = {}
        for name, src in sources.items():
            digests[name] = self._blob(store, src.read_bytes())
        digests[CARD] = self._blob(store, card.encode())
        parent = self.ref(repo_id, BRANCH)
        same = parent is not None and self._digests(store, parent) == digests
        commit = parent if same else _commit_id(parent, digests, message)  # like the Hub, no empty commits
        if tag and (taken := self.ref(repo_id, tag)) not in (None, commit):
            raise RegistryError(f"{repo_id}: tag {tag!r} already points to {taken}; a study tag never moves")
        self._snapshot(store, commit, digests)
        (store / "refs" / BRANCH).write_text(commit)  # no newline: the cache reads refs verbatim
        if tag:
            (store / "refs" / tag).write_text(commit)
        url = (store / "snapshots" / commit).as_uri()
        return Publication(self.name, repo_id, tag or BRANCH, commit, url, digest)

    @staticmethod
    def _blob(store: Path, data: bytes) -> str:
        digest = hashlib.sha256(data).hexdigest()
        blob = store / "blobs" / digest
        if not blob.is_file():
            tmp = blob.with_suffix(".incomplete")
            tmp.write_bytes(data)
            os.replace(tmp, blob)
        return digest

    @staticmethod
    def _digests(store: Path, commit: str) -> dict[str, str]:
        snap = store / "snapshots" / commit
        return {p.name: Path(os.readlink(p)).name for p in snap.iterdir() if p.is_symlink()}

    @staticmethod
    def _snapshot(store: Path, commit: str, digests: dict[str, str]) -> None:
        final = store / "snapshots" / commit
        if final.is_dir():
            return
        tmp = store / "snapshots" / f".{commit}.partial"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        for name, digest in digests.items():
            (tmp / name).symlink_to(Path("..", "..", "blobs", digest))
        os.replace(tmp, final)

    def download(self, repo_id: str, revision: str | None) -> Path:
        """The snapshot folder of `revision` (branch, tag or commit), resolved by huggingface_hub's cache code."""
        try:
            return Path(
                snapshot_download(repo_id, revision=revision or BRANCH, cache_dir=self.root, local_files_only=True)
            )
        except LocalEntryNotFoundError:
            raise RegistryError(f"{repo_id}@{revision or BRANCH} is not in the local registry {self.root}") from None

    def list(self) -> list[RepoEntry]:
        try:
            info = scan_cache_dir(self.root)
        except CacheNotFound:
            return []
        entries = []
        for repo in sorted(info.repos, key=lambda r: r.repo_id):
            refs = {ref: rev.commit_hash for rev in repo.revisions for ref in rev.refs}
            main = self.ref(repo.repo_id, BRANCH)
            card = read_card(repo.repo_path / "snapshots" / main) if main else None
            entries.append(RepoEntry(repo.repo_id, dict(sorted(refs.items())), getattr(card, "base_model", None)))
        return entries

    def find(self, base_model: str) -> list[str]:
        return [e.repo_id for e in self.list() if e.base_model == base_model]

    def owner(self) -> str:
        return "local"
