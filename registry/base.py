"""What every registry backend shares: the published files of a map folder, a publication record, errors."""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Protocol

from ridgefill.maps import DIGEST, DOCS, HUB_FILES, MANIFEST, read_manifest, verify_files

CARD = "README.md"
IGNORED = HUB_FILES  # added or kept by the Hub itself; never part of a map


class RegistryError(RuntimeError):
    """A publish or pull that must not go ahead (bad name, tag taken, nothing found)."""


@dataclass(frozen=True)
class Publication:
    """Where a map folder went: enough to pull exactly it again."""

    backend: str
    repo_id: str
    revision: str  # the study's tag (or the branch when no tag was asked for)
    commit_sha: str
    url: str
    manifest_sha256: str = ""  # the published manifest's own digest: `pull` checks it when given

    def as_dict(self) -> dict:
        return asdict(self)

    def __str__(self) -> str:
        return f"{self.backend}:{self.repo_id}@{self.revision}#{self.commit_sha}"


@dataclass(frozen=True)
class RepoEntry:
    """One map repo as `maps list` shows it."""

    repo_id: str
    refs: dict[str, str]  # branch/tag -> commit sha
    base_model: str | None = None


class Backend(Protocol):
    name: str

    def publish(self, folder: Path, repo_id: str, card: str, *, tag: str | None, message: str) -> Publication: ...

    def download(self, repo_id: str, revision: str | None) -> Path: ...

    def list(self) -> list[RepoEntry]: ...

    def find(self, base_model: str) -> list[str]: ...

    def owner(self) -> str: ...


def map_files(folder: Path) -> tuple[list[str], str]:
    """(files to publish, manifest digest) of a verified map folder: the manifest and every file it hashes
    (not its docs), and the digest the publication records."""
    folder = Path(folder)
    manifest = read_manifest(folder)
    verify_files(folder, manifest)
    names = sorted(n for n in manifest["files"] if n not in DOCS)
    return [MANIFEST, *names], manifest[DIGEST]


_REF = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,95}$")


def tag_for(study: str) -> str:
    """A git-safe tag for a study name (one tag per study)."""
    tag = re.sub(r"[^A-Za-z0-9._-]+", "-", study).strip("-.")
    tag = re.sub(r"\.{2,}", ".", tag).removesuffix(".lock")
    if not _REF.match(tag):
        raise RegistryError(f"study name {study!r} gives no usable tag")
    return tag


def check_repo_id(repo_id: str) -> tuple[str, str]:
    parts = repo_id.split("/")
    if len(parts) != 2 or not all(_REF.match(p) for p in parts):
        raise RegistryError(f"repo id must be 'owner/name', got {repo_id!r}")
    return parts[0], parts[1]
