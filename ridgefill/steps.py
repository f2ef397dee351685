"""The method's steps as plain functions: load a model, capture, fit a map folder (and, for the tune flow,
resolve a study's weights and fit one trial).

The CLI and the Prefect tasks call these; nothing here knows about either.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import threading
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import Tensor, nn

from ridgefill import corpus as corpus_mod
from ridgefill.capture import Capture, capture, load_capture
from ridgefill.default_model import cache_root, default_model_dir
from ridgefill.fingerprint import fingerprint, fingerprint_key
from ridgefill.fit import RidgeSolver
from ridgefill.heldout import HeldOutWindow, heldout_activations, score_maps
from ridgefill.maps import MapSet, write_map_set
from ridgefill.rows import ROWS
from ridgefill.scores import rarity

if TYPE_CHECKING:
    from ridgefill.search import Params
    from ridgefill.study import Study

log = logging.getLogger(__name__)
DEFAULT = "default"


def load_model(
    model: str | Path = DEFAULT,
    dtype: torch.dtype = torch.float32,
    device: str = "cpu",
    trust_remote_code: bool = False,
) -> tuple[nn.Module, object]:
    """A causal LM and its tokenizer; `default` is the embedded SmolLM2-135M-Instruct."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = model_path(model)
    tok = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
    lm = AutoModelForCausalLM.from_pretrained(
        path, dtype=dtype, trust_remote_code=trust_remote_code, attn_implementation="sdpa"
    )
    return lm.to(device).eval(), tok


def model_path(model: str | Path) -> str | Path:
    """`default` is the embedded SmolLM2 (converted on first use); anything else is passed through."""
    return default_model_dir() if str(model) == DEFAULT else model


def calibration_windows(
    tokenizer, source: str | list[str], window: int, max_windows: int, heldout: int
) -> tuple[Tensor, Tensor, str]:
    """(calibration windows, held-out windows, corpus sha256); the held-out ones come last in the stream."""
    corpus = corpus_mod.load_corpus(source)
    wins = corpus_mod.windows(corpus_mod.token_stream(corpus, tokenizer), window)
    if wins.shape[0] <= heldout:
        raise ValueError(f"the corpus gives {wins.shape[0]} windows of {window}; need more than {heldout} held out")
    cal, held = wins[: wins.shape[0] - heldout], wins[wins.shape[0] - heldout :]
    return cal[:max_windows], held, corpus.sha256


def capture_dir(root: Path, fp_key: str, corpus_sha: str, window: int) -> Path:
    """Captures are keyed by model fingerprint + corpus hash (+ window); each split is a file inside."""
    return Path(root) / "captures" / f"{fp_key}-{corpus_sha[:16]}-w{window}"


def run_capture(
    model: nn.Module,
    tokenizer,
    source: str | list[str],
    splits: list[int],
    *,
    window: int = 512,
    max_windows: int = 128,
    heldout: int = 4,
    root: Path | None = None,
    checkpoint_seconds: float = 300.0,
    sink_skip: int = ROWS.sink,
    stride: int = 1,
    progress: bool = True,
) -> Capture:
    """Capture statistics for `splits`, reusing a finished capture and resuming a partial one."""
    cal, _, corpus_sha = calibration_windows(tokenizer, source, window, max_windows, heldout)
    key = fingerprint_key(fingerprint(model, tokenizer, splits[0]))
    out = capture_dir(root or cache_root(), key, corpus_sha, window) / f"n{cal.shape[0]}-s{sink_skip}-r{stride}"
    meta = {
        "corpus_sha256": corpus_sha,
        "source": source if isinstance(source, str) else [str(s) for s in source],
        "fingerprint_key": key,
        "heldout": heldout,
        "max_windows": max_windows,
    }
    if (out / "capture.json").is_file():
        done = load_capture(out)
        if done.meta.get("windows_done") == cal.shape[0] and set(splits) <= set(done.splits):
            return done
        if set(splits) != set(done.meta["splits"]):
            out = out.with_name(out.name + "-S" + "_".join(map(str, sorted(splits))))
    return capture(
        model,
        cal,
        splits,
        out,
        sink_skip=sink_skip,
        stride=stride,
        checkpoint_seconds=checkpoint_seconds,
        meta=meta,
        progress=progress,
    )


@dataclass(frozen=True)
class HeldOut:
    """A capture's held-out windows at one split, run through the model once; every lambda is scored on it."""

    corpus_sha256: str
    windows: int
    acts: list[HeldOutWindow]


def held_out(model: nn.Module, tokenizer, cap: Capture, split: int, heldout_windows: int = 4) -> HeldOut:
    """The capture's last `heldout_windows` held-out windows (its corpus re-read and checked) at `split`."""
    _, held, corpus_sha = calibration_windows(
        tokenizer, cap.meta["source"], cap.meta["window"], cap.meta["max_windows"], cap.meta["heldout"]
    )
    if corpus_sha != cap.meta["corpus_sha256"]:
        raise ValueError("the calibration corpus changed since this capture was taken")
    held = held[:heldout_windows]
    return HeldOut(corpus_sha, int(held.shape[0]), heldout_activations(model, held, split))


def fit_report(
    model: nn.Module,
    tokenizer,
    cap: Capture,
    split: int,
    lam: float,
    solver: RidgeSolver,
    heldout_windows: int = 4,
    held: HeldOut | None = None,
) -> tuple[dict[int, tuple[Tensor, Tensor]], dict]:
    """(float32 maps, fit provenance with held-out metrics): the work a ridge and an identity folder share.
    `held` (of this capture and split) spares the held-out model pass; without it, one is run."""
    maps = {l: (w.float(), b.float()) for l, (w, b) in solver.solve(lam).items()}
    held = held or held_out(model, tokenizer, cap, split, heldout_windows)
    metrics = score_maps(model, held.acts, maps)
    fit = {
        "corpus_sha256": held.corpus_sha256,
        "source": cap.meta["source"],
        "tokens": cap.meta["windows_done"] * cap.meta["window"],
        "rows": solver.count,
        "window": cap.meta["window"],
        "heldout_windows": held.windows,
        "absolute_lambda": solver.absolute_lambda(lam),
        "heldout": {str(l): m for l, m in metrics.items()},
    }
    return maps, fit


def build_maps(
    model: nn.Module,
    tokenizer,
    cap: Capture,
    split: int,
    lam: float,
    out: Path,
    *,
    heldout_windows: int = 4,
    kind: str = "ridge",
    dtype: torch.dtype = torch.float32,
    defaults: dict | None = None,
    solver: RidgeSolver | None = None,
) -> Path:
    """Fit, measure on held-out windows and write a map folder (kind='identity' writes the baseline)."""
    solver = solver or RidgeSolver.from_stats(cap.stats(split))
    maps, fit = fit_report(model, tokenizer, cap, split, lam, solver, heldout_windows)
    return _write(model, tokenizer, cap, split, lam, out, kind, maps, fit, dtype, defaults).path


def build_map_pair(
    model: nn.Module,
    tokenizer,
    cap: Capture,
    split: int,
    lam: float,
    out_ridge: Path,
    out_identity: Path,
    *,
    heldout_windows: int = 4,
    dtype: torch.dtype = torch.float32,
    defaults: dict | None = None,
) -> tuple[Path, Path]:
    """The ridge folder and its identity-fill baseline from one fit and one held-out run."""
    solver = RidgeSolver.from_stats(cap.stats(split))
    maps, fit = fit_report(model, tokenizer, cap, split, lam, solver, heldout_windows)
    return (
        _write(model, tokenizer, cap, split, lam, out_ridge, "ridge", maps, fit, dtype, defaults).path,
        _write(model, tokenizer, cap, split, lam, out_identity, "identity", maps, fit, dtype, defaults).path,
    )


def _write(model, tokenizer, cap: Capture, split: int, lam: float, out: Path, kind: str, maps, fit: dict,
           dtype: torch.dtype, defaults: dict | None) -> MapSet:  # fmt: skip
    return write_map_set(
        out,
        {} if kind == "identity" else maps,
        fingerprint(model, tokenizer, split),
        split,
        kind=kind,
        lam=None if kind == "identity" else lam,
        fit=fit,
        scores=rarity(cap.token_counts()),
        dtype=dtype,
        defaults=defaults,
    )


# --- what the tune flow's tasks share in one process -----------------------------------------------------

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_load_lock = threading.Lock()


@functools.cache
def _loaded(path: str, dtype: str, device: str):
    return load_model(path, DTYPES[dtype], device)


def shared_model(path: str, dtype: str = "float32", device: str = "cpu"):
    """(model, tokenizer), loaded once per process (the flow's tasks run in its threads and share it)."""
    with _load_lock:
        return _loaded(path, dtype, device)


@dataclass(frozen=True)
class Weights:
    """Where a study's weights are, their revision and fingerprint (`fingerprint_key` + anchors hash)."""

    path: str
    revision: str
    fingerprint: str


def hub_snapshot(repo: str, revision: str) -> tuple[str, str]:
    """Download (or find in the HF cache) a model's safetensors snapshot: (local dir, commit sha)."""
    from huggingface_hub import model_info, snapshot_download

    sha = model_info(repo, revision=revision).sha or revision
    files = ["*.json", "*.safetensors", "tokenizer*", "*.txt", "*.jinja"]  # chat_template.jinja: the template
    path = snapshot_download(repo, revision=sha, allow_patterns=files)
    return path, sha


def resolve_weights(cfg: Study) -> Weights:
    """A study's weights: its local folder (or the embedded default), else a Hub snapshot; fingerprinted at
    every candidate split, so a new release (other anchors) gets another fingerprint."""
    m = cfg.model
    if m.local:
        path = str(default_model_dir()) if m.local == "default" else m.local
        revision = m.revision if m.local != "default" else "embedded"
    else:
        path, revision = hub_snapshot(m.repo, m.revision)
    lm, tok = shared_model(path, m.dtype, cfg.hardware.device)
    fps = [fingerprint(lm, tok, s) for s in sorted(cfg.search.splits)]
    weights = hashlib.sha256(json.dumps([fp["anchors"] for fp in fps], sort_keys=True).encode()).hexdigest()[:16]
    return Weights(path, revision, f"{fingerprint_key(fps[0])}-{weights}")


@functools.cache
def solver_for(capture_path: str, split: int) -> RidgeSolver:
    """One eigendecomposition per capture and split serves every lambda of a study."""
    return RidgeSolver.from_stats(load_capture(Path(capture_path)).stats(split))


_held: weakref.WeakKeyDictionary[nn.Module, dict[tuple[str, int], HeldOut]] = weakref.WeakKeyDictionary()
_held_lock = threading.Lock()


def held_out_for(model: nn.Module, tokenizer, capture_path: str, split: int) -> HeldOut:
    """One held-out pass per model, capture and split serves every lambda of a study (kept for the process,
    on the model's device: about windows x window x late layers x hidden size values per split)."""
    with _held_lock:
        per_model = _held.setdefault(model, {})
        if (capture_path, split) not in per_model:
            per_model[capture_path, split] = held_out(model, tokenizer, load_capture(Path(capture_path)), split)
        return per_model[capture_path, split]


def fit_trial(model: nn.Module, tokenizer, capture_path: str, params: Params, out: Path) -> MapSet:
    """Fit a trial's split at its lambda and write its map folder with its row-policy defaults: the verified
    `MapSet` that the trial's later steps pass along (its files hashed once, as they were written)."""
    cap = load_capture(Path(capture_path))
    r = params.rows
    defaults = {"tail": r.tail, "sink": r.sink, "share": r.share, "select": r.select}
    if r.select == "question":
        defaults |= {"window": r.window, "reach": r.reach}  # vLLM pools the question's rows as the trial did
    held = held_out_for(model, tokenizer, capture_path, params.split)
    solver = solver_for(capture_path, params.split)
    maps, fit = fit_report(model, tokenizer, cap, params.split, params.lam, solver, held=held)
    return _write(
        model, tokenizer, cap, params.split, params.lam, Path(out), "ridge", maps, fit, torch.float32, defaults
    )
