"""Model fingerprints: what a map folder was fitted on, so that it is never served on another model.

Geometry and the tokenizer's vocabulary must match exactly; weight anchors (sha256 of a few weights
near the split) only warn, since a re-quantised or re-cast copy of the same model is still usable.
"""

from __future__ import annotations

import hashlib
import json
import weakref
from pathlib import Path

import torch
from torch import nn

GEOMETRY_FIELDS = (
    "architecture",
    "num_layers",
    "hidden_size",
    "num_heads",
    "num_kv_heads",
    "head_dim",
    "vocab_size",
    "tokenizer_sha256",
)


_VOCAB_HASHES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # tokenizer -> (size, hash)


def tokenizer_hash(tokenizer) -> str:
    """sha256 of the vocabulary (token -> id), which is what decides whether token ids mean the same; hashed
    once per tokenizer object (again only if its size changes, e.g. after `add_tokens`)."""
    try:
        size = len(tokenizer)
        hit = _VOCAB_HASHES.get(tokenizer)
    except TypeError:  # an object without len() or weak references: hash it every time
        size = hit = None
    if hit is not None and hit[0] == size:
        return hit[1]
    vocab = sorted(tokenizer.get_vocab().items(), key=lambda item: item[1])
    digest = hashlib.sha256(json.dumps(vocab, ensure_ascii=False).encode()).hexdigest()
    if size is not None:
        try:
            _VOCAB_HASHES[tokenizer] = (size, digest)
        except TypeError:
            pass
    return digest


def tensor_hash(t: torch.Tensor) -> str:
    return hashlib.sha256(t.detach().to("cpu", torch.float32).contiguous().numpy().tobytes()).hexdigest()


def portable_name(name: str) -> str:
    """What a manifest may record of where a model or file came from: a repo id (`owner/name`) as it is,
    a local path only as its last component, never a local absolute path (manifests are published)."""
    if not name:
        return name
    path = Path(name).expanduser()
    if path.is_absolute() or name.startswith((".", "~")) or path.exists():
        return path.resolve().name
    return name


def anchor_names(split: int, num_layers: int) -> list[str]:
    """A few weights around the split: the norms and k projection of the layers on either side."""
    layers = sorted({max(0, split - 1), min(split, num_layers - 1)})
    names = []
    for i in layers:
        names += [f"model.layers.{i}.input_layernorm.weight", f"model.layers.{i}.self_attn.k_proj.weight"]
    return names


def fingerprint(model: nn.Module, tokenizer, split: int) -> dict:
    """The fingerprint of a transformers causal LM and its tokenizer, with anchors around `split`."""
    return fingerprint_from(model.config, tokenizer, dict(model.named_parameters()), split, type(model).__name__)


def anchors(params: dict[str, torch.Tensor], split: int, num_layers: int) -> dict[str, str]:
    """sha256 of the anchor weights present in `params` (checkpoint names)."""
    return {name: tensor_hash(params[name]) for name in anchor_names(split, num_layers) if name in params}


def fingerprint_from(cfg, tokenizer, params: dict[str, torch.Tensor], split: int, default_arch: str = "") -> dict:
    """The same fingerprint from a config, a tokenizer and weights by checkpoint name (as vLLM loads them)."""
    archs = list(getattr(cfg, "architectures", None) or [default_arch])
    num_layers = cfg.num_hidden_layers
    return {
        "architecture": archs[0].removeprefix("RidgeFill"),
        "num_layers": num_layers,
        "hidden_size": cfg.hidden_size,
        "num_heads": cfg.num_attention_heads,
        "num_kv_heads": cfg.num_key_value_heads,
        "head_dim": getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads,
        "vocab_size": cfg.vocab_size,
        "tokenizer_sha256": tokenizer_hash(tokenizer),
        "anchors": anchors(params, split, num_layers),
        "name_or_path": portable_name(str(getattr(cfg, "name_or_path", ""))),
        "revision": getattr(cfg, "_commit_hash", None),  # the Hub commit when loaded from the Hub, else None
    }


def fingerprint_key(fp: dict) -> str:
    """A short stable key of the geometry and tokenizer, used to name captures."""
    core = {k: fp[k] for k in GEOMETRY_FIELDS}
    return hashlib.sha256(json.dumps(core, sort_keys=True).encode()).hexdigest()[:16]


def compare(expected: dict, actual: dict) -> tuple[list[str], list[str]]:
    """(errors, warnings): geometry/tokenizer differences are errors, anchor differences warnings."""
    errors = [
        f"{k}: maps are for {expected.get(k)!r}, model has {actual.get(k)!r}"
        for k in GEOMETRY_FIELDS
        if expected.get(k) != actual.get(k)
    ]
    warnings = [
        f"weight {name} differs from the one the maps were fitted on"
        for name, digest in expected.get("anchors", {}).items()
        if actual.get("anchors", {}).get(name) not in (None, digest)
    ]
    return errors, warnings
