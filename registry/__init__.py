"""RidgeFill registry: publish map folders with a model card to the Hugging Face Hub or a local folder,
and pull them back verified (file hashes, then the model fingerprint) before anything serves them."""

from registry.base import Publication, RegistryError, RepoEntry
from registry.hub import HubBackend
from registry.local import LocalBackend
from registry.publish import default_backend, publish, publish_best, publish_studies
from registry.pull import pull, pull_publication, serve_check, verify_snapshot

__all__ = [
    "HubBackend",
    "LocalBackend",
    "Publication",
    "RegistryError",
    "RepoEntry",
    "default_backend",
    "publish",
    "publish_best",
    "publish_studies",
    "pull",
    "pull_publication",
    "serve_check",
    "verify_snapshot",
]
