"""The map folder: the unit the pipeline passes around, evaluates, publishes and serves.

    ridgefill.json            manifest: format, model fingerprint, split, defaults, fit provenance,
                              credit, and the sha256 of every file
    layer_019.safetensors     one file per late layer l > S: weight [d, d] and bias [d] (h_l ~ h_S W + b)
    scores.safetensors        per-token sensitivity score (rarity) used to pick the protected share

Loading verifies everything before a tensor is used: every file's sha256, then the fingerprint.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import Tensor

from ridgefill import fingerprint as fp

FORMAT_VERSION = 1
MANIFEST = "ridgefill.json"
SCORES = "scores.safetensors"
DOCS = ("README.md",)  # never hashed: the Hub rewrites model cards
CREDIT = {
    "method": "RidgeFill: closed-form ridge maps fill late-layer K/V caches during prefill",
    "project": "RidgeFill",
    "license": "apache-2.0",
}
log = logging.getLogger(__name__)


class MapError(ValueError):
    """A map folder that must not be served: wrong model, wrong tokenizer, missing or altered files."""


def layer_file(idx: int) -> str:
    return f"layer_{idx:03d}.safetensors"


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


@dataclass
class MapSet:
    """A loaded, verified map folder."""

    manifest: dict
    weights: dict[int, tuple[Tensor, Tensor]] = field(repr=False)
    scores: Tensor | None = field(default=None, repr=False)
    path: Path | None = None

    @property
    def split(self) -> int:
        return int(self.manifest["split"])

    @property
    def kind(self) -> str:
        return self.manifest["kind"]

    def layer(self, idx: int) -> tuple[Tensor, Tensor]:
        return self.weights[idx]

    def to(self, device: torch.device | str, dtype: torch.dtype | None = None) -> MapSet:
        moved = {i: (w.to(device, dtype), b.to(device, dtype)) for i, (w, b) in self.weights.items()}
        scores = None if self.scores is None else self.scores.to(device)
        return MapSet(self.manifest, moved, scores, self.path)


def write_maps(
    out: Path,
    weights: dict[int, tuple[Tensor, Tensor]],
    fingerprint: dict,
    split: int,
    *,
    kind: str,
    lam: float | None,
    fit: dict,
    scores: Tensor | None = None,
    dtype: torch.dtype = torch.float32,
    defaults: dict | None = None,
) -> Path:
    """Write a map folder atomically (a sibling temp folder renamed into place)."""
    out = Path(out)
    tmp = out.with_name(out.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    for idx, (w, b) in sorted(weights.items()):
        save_file({"weight": w.to(dtype).contiguous(), "bias": b.to(dtype).contiguous()}, tmp / layer_file(idx))
    if scores is not None:
        save_file({"token_score": scores.float().contiguous()}, tmp / SCORES)
    files = {p.name: sha256_file(p) for p in sorted(tmp.iterdir()) if p.name not in DOCS}
    manifest = {
        "format_version": FORMAT_VERSION,
        "kind": kind,
        "model": fingerprint,
        "split": split,
        "late_layers": sorted(weights),
        "defaults": {"sink": 4, "tail": 256, "share": 0.0, **(defaults or {})},
        "lambda": lam,
        "dtype": str(dtype).removeprefix("torch."),
        "fit": fit,
        "credit": CREDIT,
        "files": files,
    }
    (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
    if out.exists():
        shutil.rmtree(out)
    os.replace(tmp, out)
    return out


def read_manifest(path: Path) -> dict:
    path = Path(path)
    try:
        manifest = json.loads((path / MANIFEST).read_text())
    except FileNotFoundError:
        raise MapError(f"{path} is not a map folder: {MANIFEST} is missing") from None
    except json.JSONDecodeError as e:
        raise MapError(f"{path / MANIFEST} is not valid JSON: {e}") from None
    if manifest.get("format_version") != FORMAT_VERSION:
        raise MapError(
            f"{path}: format_version {manifest.get('format_version')!r}, this RidgeFill reads {FORMAT_VERSION}"
        )
    return manifest


def verify_files(path: Path, manifest: dict) -> None:
    """Refuse, by file name, anything missing or whose sha256 differs from the manifest."""
    expected = dict(manifest.get("files", {}))
    for idx in manifest.get("late_layers", []):
        if layer_file(idx) not in expected:
            raise MapError(f"{path}: manifest lists late layer {idx} but no hash for {layer_file(idx)}")
    for name, digest in expected.items():
        f = Path(path) / name
        if not f.is_file():
            raise MapError(f"{path}: {name} is missing")
        if sha256_file(f) != digest:
            raise MapError(f"{path}: {name} is corrupt (sha256 differs from the manifest)")


def check_model(manifest: dict, model, tokenizer) -> None:
    """Refuse maps fitted for another model or tokenizer; warn if anchor weights differ."""
    actual = fp.fingerprint(model, tokenizer, int(manifest["split"]))
    errors, warnings = fp.compare(manifest["model"], actual)
    if errors:
        raise MapError("maps do not match this model: " + "; ".join(errors))
    for w in warnings:
        log.warning("RidgeFill: %s", w)


def load_maps(path: Path, model=None, tokenizer=None, device: str | torch.device = "cpu") -> MapSet:
    """Load a map folder after verifying file hashes and, given a model and tokenizer, the fingerprint."""
    path = Path(path)
    manifest = read_manifest(path)
    verify_files(path, manifest)
    if model is not None:
        if tokenizer is None:
            raise ValueError("checking maps against a model needs its tokenizer too")
        check_model(manifest, model, tokenizer)
    weights = {}
    for idx in manifest["late_layers"]:
        t = load_file(path / layer_file(idx), device=str(device))
        weights[int(idx)] = (t["weight"], t["bias"])
    listed = SCORES in manifest["files"]  # verified above; an unlisted scores file is ignored, never trusted
    scores = load_file(path / SCORES, device=str(device))["token_score"] if listed else None
    return MapSet(manifest, weights, scores, path)
