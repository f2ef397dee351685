"""The Hugging Face Hub backend: one model repo per map line, one commit per publish, one tag per study.

Everything goes through `huggingface_hub.HfApi` (create_repo, create_commit, create_tag, snapshot_download),
so proxies, retries, offline mode and test transports (`huggingface_hub.set_client_factory`) apply as usual.
The token is handed to huggingface_hub and never formatted into a message, a log line or a repr.
"""

from __future__ import annotations

import hashlib
import logging
from pathlib import Path

from huggingface_hub import CommitOperationAdd, CommitOperationDelete, HfApi, snapshot_download
from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

from registry.base import CARD, IGNORED, Publication, RegistryError, RepoEntry, check_repo_id, map_files
from ridgefill.maps import MANIFEST

log = logging.getLogger(__name__)
BRANCH = "main"
LIBRARY_TAG = "ridgefill"  # library_name in the card becomes this tag on the Hub


def git_blob_id(data: bytes) -> str:
    """Git's object id of a file's bytes (what the Hub reports as a file's oid)."""
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def _is_map_file(name: str) -> bool:
    return name == MANIFEST or name.endswith(".safetensors")


class HubBackend:
    """Publish to and pull from a Hub (huggingface.co or `endpoint`)."""

    name = "hub"

    def __init__(
        self,
        token: str | None = None,
        endpoint: str | None = None,
        cache_dir: Path | None = None,
        private: bool = True,
    ) -> None:
        self._api = HfApi(endpoint=endpoint, token=token, library_name="ridgefill")
        self._token = token
        self.endpoint = self._api.endpoint
        self.cache_dir = cache_dir
        self.private = private  # for repos this backend creates; an existing repo keeps its visibility

    def __repr__(self) -> str:  # never shows the token
        return f"HubBackend(endpoint={self.endpoint!r})"

    def publish(self, folder: Path, repo_id: str, card: str, *, tag: str | None, message: str) -> Publication:
        """Create the repo if needed, commit the map files + card to main (dropping stale map files), tag it.

        The tag is checked first: a study tag that already holds these maps is the publication (a rerun
        after a crash), one that holds other maps is refused before anything is committed."""
        check_repo_id(repo_id)
        folder = Path(folder)
        names, digest = map_files(folder)
        url = self._api.create_repo(repo_id, repo_type="model", private=self.private, exist_ok=True)
        if tag and (done := self._tagged(repo_id, tag, folder, digest)):
            return done
        log.info("publishing %s to %s", folder, url)
        present = self._files(repo_id)
        ops: list = [CommitOperationAdd(path_in_repo=n, path_or_fileobj=folder / n) for n in names]
        ops.append(CommitOperationAdd(path_in_repo=CARD, path_or_fileobj=card.encode()))
        ops += [CommitOperationDelete(path_in_repo=n) for n in sorted(present) if _is_map_file(n) and n not in names]
        info = self._api.create_commit(repo_id, ops, commit_message=message, revision=BRANCH)
        if tag:
            try:
                self._api.create_tag(repo_id, tag=tag, revision=info.oid, tag_message=message)
            except HfHubHTTPError as e:
                if e.response is not None and e.response.status_code == 409:
                    raise RegistryError(f"{repo_id}: tag {tag!r} already exists; a study tag never moves") from None
                raise
        return Publication(self.name, repo_id, tag or BRANCH, info.oid, info.commit_url, digest)

    def _tagged(self, repo_id: str, tag: str, folder: Path, digest: str) -> Publication | None:
        """The existing publication if `tag` holds this folder's manifest (hence its files); None if no such tag."""
        commit = next((t.target_commit for t in self._api.list_repo_refs(repo_id).tags if t.name == tag), None)
        if commit is None:
            return None
        info = self._api.get_paths_info(repo_id, [MANIFEST], revision=commit)
        if not info or info[0].blob_id != git_blob_id((folder / MANIFEST).read_bytes()):
            raise RegistryError(f"{repo_id}: tag {tag!r} already exists with other maps; a study tag never moves")
        log.info("%s@%s already holds these maps", repo_id, tag)
        return Publication(self.name, repo_id, tag, commit, f"{self.endpoint}/{repo_id}/commit/{commit}", digest)

    def _files(self, repo_id: str) -> set[str]:
        return set(self._api.list_repo_files(repo_id, revision=BRANCH)) - IGNORED

    def download(self, repo_id: str, revision: str | None) -> Path:
        """snapshot_download into the cache (offline mode reads the cache only); the caller verifies."""
        check_repo_id(repo_id)
        try:
            path = snapshot_download(
                repo_id,
                revision=revision or BRANCH,
                cache_dir=self.cache_dir,
                token=self._token,
                endpoint=self.endpoint,
                library_name="ridgefill",
            )
        except LocalEntryNotFoundError as e:
            raise RegistryError(f"{repo_id}@{revision or BRANCH} is not cached and the Hub is unreachable: {e}") from e
        return Path(path)

    def list(self) -> list[RepoEntry]:
        entries = []
        for m in self._api.list_models(filter=LIBRARY_TAG):
            refs = self._api.list_repo_refs(m.id)
            named = {b.name: b.target_commit for b in refs.branches} | {t.name: t.target_commit for t in refs.tags}
            base = next((t.split(":")[-1] for t in (m.tags or []) if t.startswith("base_model:")), None)
            entries.append(RepoEntry(m.id, dict(sorted(named.items())), base))
        return entries

    def find(self, base_model: str) -> list[str]:
        """Map repos whose card names `base_model` (the Hub tags them `base_model:<id>`)."""
        return [m.id for m in self._api.list_models(filter=[LIBRARY_TAG, f"base_model:{base_model}"])]

    def owner(self) -> str:
        """The token's user name (the default namespace for new map repos)."""
        return self._api.whoami()["name"]
