"""The map folder: the unit the pipeline passes around, evaluates, publishes and serves.

    ridgefill.json            manifest: format, model fingerprint, split, defaults, fit provenance,
                              credit, the sha256 of every file, and `manifest_sha256`: the sha256 of
                              the manifest's own canonical JSON (sorted keys, no spaces, without that field)
    layer_019.safetensors     one file per late layer l > S: weight [d, d] and bias [d] (h_l ~ h_S W + b)
    scores.safetensors        per-token sensitivity score (rarity) used to pick the protected share

Reading verifies the manifest first: its own digest (any edit, to `kind`, `split`, `defaults` or anything
else, is refused by name like an edited data file), then that it is consistent (`kind` matches the layer
files it lists, `late_layers` are exactly the layers after the split, the fingerprint's weight anchors sit
at the split). Loading then checks every file's sha256, then, given a model, the fingerprint.

Format 1 folders (written before the manifest carried its digest) are refused with the fix: refit them
(`ridgefill fit`, or `ridgefill demo` for the embedded default). Their manifests were never protected, so
re-sealing one as it stands would bless whatever edit it may hold.

Nothing in a manifest is a local path: `model.name_or_path` and `fit.source` keep only a repo id or a
folder/file name, because manifests are published with the maps.
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
from ridgefill.fingerprint import portable_name
from ridgefill.rows import ROWS

FORMAT_VERSION = 2  # 2: the manifest carries its own digest
MANIFEST = "ridgefill.json"
SCORES = "scores.safetensors"
DIGEST = "manifest_sha256"
KINDS = ("ridge", "identity")
DOCS = ("README.md",)  # never hashed: the Hub rewrites model cards
HUB_FILES = {".gitattributes", ".gitignore"}  # added or kept by the Hub itself; never part of a map
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


@dataclass(frozen=True)
class MapInfo:
    """What a map folder's manifest says of its fit: the split, the kind (ridge or identity), lambda (None for
    identity), the fit's provenance and the row-policy defaults (over `ROWS`' sink, tail and share)."""

    split: int
    kind: str = "ridge"
    lam: float | None = None
    fit: dict = field(default_factory=dict)
    defaults: dict | None = None


def write_maps(out: Path, *args, **kwargs) -> Path:
    """Write a map folder atomically (a sibling temp folder renamed into place); `write_map_set`'s arguments."""
    return write_map_set(out, *args, **kwargs).path


def write_map_set(
    out: Path,
    weights: dict[int, tuple[Tensor, Tensor]],
    fingerprint: dict,
    info: MapInfo,
    scores: Tensor | None = None,
    dtype: torch.dtype = torch.float32,
) -> MapSet:
    """Write a map folder atomically (a sibling temp folder renamed into place) and return it as a verified
    `MapSet`: the tensors just written (on the CPU, as `load_maps` gives them), the sealed manifest and the
    folder. Each file is hashed once, as it is written; the fingerprint is the writing model's own, so later
    steps pass this value along instead of re-verifying."""
    kind, split, lam, fit, defaults = info.kind, info.split, info.lam, info.fit, info.defaults
    out = Path(out)
    tmp = out.with_name(out.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    written = {
        int(i): (w.to("cpu", dtype).contiguous(), b.to("cpu", dtype).contiguous()) for i, (w, b) in weights.items()
    }
    for idx, (w, b) in sorted(written.items()):
        save_file({"weight": w, "bias": b}, tmp / layer_file(idx))
    score = None if scores is None else scores.to("cpu", torch.float32).contiguous()
    if score is not None:
        save_file({"token_score": score}, tmp / SCORES)
    files = {p.name: sha256_file(p) for p in sorted(tmp.iterdir()) if p.name not in DOCS}
    manifest = {
        "format_version": FORMAT_VERSION,
        "kind": kind,
        "model": {**fingerprint, "name_or_path": portable_name(fingerprint.get("name_or_path", ""))},
        "split": split,
        "late_layers": sorted(weights),
        "defaults": {"sink": ROWS.sink, "tail": ROWS.tail, "share": ROWS.share, **(defaults or {})},
        "lambda": lam,
        "dtype": str(dtype).removeprefix("torch."),
        "fit": _portable_fit(fit),
        "credit": CREDIT,
        "files": files,
    }
    try:
        sealed = write_manifest(tmp, manifest)
    except MapError as e:  # a writer's bug, found before anything replaces `out`
        shutil.rmtree(tmp, ignore_errors=True)
        raise ValueError(f"refusing to write maps to {out}: {e}") from None
    if out.exists():
        shutil.rmtree(out)
    os.replace(tmp, out)
    return MapSet(sealed, written, score, out)


def _portable_fit(fit: dict) -> dict:
    """Fit provenance with its calibration source reduced to names (a local file becomes its file name)."""
    if "source" not in fit:
        return fit
    src = fit["source"]
    names = portable_name(src) if isinstance(src, str) else [portable_name(str(s)) for s in src]
    return {**fit, "source": names}


def manifest_digest(manifest: dict) -> str:
    """sha256 of the manifest's canonical JSON (sorted keys, compact, UTF-8) without its own digest field."""
    body = {k: v for k, v in manifest.items() if k != DIGEST}
    canonical = json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(canonical.encode()).hexdigest()


def _local_paths(value, where: str = "") -> list[str]:
    """Fields of a manifest that hold a local absolute path (never published)."""
    if isinstance(value, dict):
        return [p for k, v in value.items() for p in _local_paths(v, f"{where}.{k}" if where else str(k))]
    if isinstance(value, list):
        return [p for i, v in enumerate(value) for p in _local_paths(v, f"{where}[{i}]")]
    if isinstance(value, str) and (value.startswith(("/", "~", "file:")) or value[1:3] in (":\\", ":/")):
        return [where]
    return []


def check_manifest(manifest: dict, files: dict | None = None) -> None:
    """Refuse a manifest that contradicts itself (raises MapError naming the field)."""
    for key in ("kind", "model", "split", "late_layers", "defaults", "files"):
        if key not in manifest:
            raise MapError(f"{MANIFEST} has no {key!r}; refit the maps")
    kind, split, late = manifest["kind"], manifest["split"], manifest["late_layers"]
    num_layers = manifest["model"].get("num_layers")
    if kind not in KINDS:
        raise MapError(f"{MANIFEST}: kind {kind!r} is not one of {', '.join(KINDS)}")
    if not isinstance(split, int) or not isinstance(num_layers, int) or not 0 < split < num_layers - 1:
        raise MapError(f"{MANIFEST}: split {split!r} does not lie in 1..{num_layers - 2} for {num_layers!r} layers")
    listed = sorted(n for n in (files if files is not None else manifest["files"]) if n.startswith("layer_"))
    want = list(range(split + 1, num_layers)) if kind == "ridge" else []
    if late != want:
        raise MapError(f"{MANIFEST}: {kind} maps at split {split} have late_layers {want}, the manifest says {late}")
    if listed != [layer_file(i) for i in want]:
        found = ", ".join(listed) or "none"
        raise MapError(f"{MANIFEST}: {kind} maps at split {split} need layer files for {want}, it lists {found}")
    if kind == "identity" and manifest.get("lambda") is not None:
        raise MapError(f"{MANIFEST}: identity maps have no lambda, the manifest says {manifest['lambda']!r}")
    anchors = set(manifest["model"].get("anchors", {}))
    if not anchors or not anchors <= set(fp.anchor_names(split, num_layers)):
        raise MapError(f"{MANIFEST}: the fingerprint's weight anchors are not those of split {split}")


def write_manifest(folder: Path, manifest: dict) -> dict:
    """Check a manifest, seal it with its digest and write it into `folder` (the one manifest writer)."""
    manifest = {k: v for k, v in manifest.items() if k != DIGEST}
    check_manifest(manifest)
    if leaks := _local_paths(manifest):
        raise MapError(f"{MANIFEST}: {', '.join(leaks)} holds a local absolute path; record a repo id or name")
    sealed = {**manifest, DIGEST: manifest_digest(manifest)}
    (Path(folder) / MANIFEST).write_text(json.dumps(sealed, indent=2) + "\n")
    return sealed


def read_manifest(path: Path) -> dict:
    """The manifest of a map folder, refused unless its digest matches its content and it is consistent."""
    path = Path(path)
    try:
        manifest = json.loads((path / MANIFEST).read_text())
    except FileNotFoundError:
        raise MapError(f"{path} is not a map folder: {MANIFEST} is missing") from None
    except json.JSONDecodeError as e:
        raise MapError(f"{path / MANIFEST} is not valid JSON: {e}") from None
    if not isinstance(manifest, dict):
        raise MapError(f"{path / MANIFEST} is not a manifest (a JSON object)")
    version = manifest.get("format_version")
    if version != FORMAT_VERSION:
        old = isinstance(version, int) and version < FORMAT_VERSION
        fix = "refit it with this RidgeFill (`ridgefill fit`, or `ridgefill demo`)" if old else "upgrade RidgeFill"
        raise MapError(f"{path}: map format {version!r}, this RidgeFill reads format {FORMAT_VERSION}; {fix}")
    if DIGEST not in manifest:
        raise MapError(f"{path}: {MANIFEST} has no {DIGEST}; refit the maps rather than editing the manifest")
    if manifest[DIGEST] != manifest_digest(manifest):
        raise MapError(f"{path}: {MANIFEST} was edited ({DIGEST} differs from its content); refit or re-pull the maps")
    try:
        check_manifest(manifest)
    except MapError as e:
        raise MapError(f"{path}: {e}") from None
    return manifest


def verify_files(path: Path, manifest: dict) -> None:
    """Refuse, by file name, anything missing, whose sha256 differs from the manifest, or that the manifest does
    not list (a stray `evil.pkl` beside the layers is never loaded, but a folder that holds one is not the one
    published): every reader (`load_maps`, `inspect`, `pull`, the vLLM plugin) goes through here."""
    expected = dict(manifest.get("files", {}))
    extra = sorted({f.name for f in Path(path).iterdir()} - set(expected) - {MANIFEST} - set(DOCS) - HUB_FILES)
    if extra:
        raise MapError(
            f"{path}: files not listed in the manifest: {', '.join(extra)}; remove them, or write the folder anew"
        )
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
    return read_verified(path, manifest, device)


def read_verified(path: Path, manifest: dict, device: str | torch.device = "cpu") -> MapSet:
    """The tensors of a folder whose `manifest` its caller has just verified (`load_maps`, `registry.pull`)."""
    path = Path(path)
    weights = {}
    for idx in manifest["late_layers"]:
        t = load_file(path / layer_file(idx), device=str(device))
        weights[int(idx)] = (t["weight"], t["bias"])
    listed = SCORES in manifest["files"]  # verified above; an unlisted scores file is ignored, never trusted
    scores = load_file(path / SCORES, device=str(device))["token_score"] if listed else None
    return MapSet(manifest, weights, scores, path)
