"""The method's steps as plain functions: load a model, capture, fit a map folder (and, for the tune flow,
resolve a study's weights and fit one trial).

The CLI and the Prefect tasks call these; nothing here knows about either.
"""

from __future__ import annotations

import functools
import logging
import threading
import weakref
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from torch import Tensor, nn

from ridgefill import corpus as corpus_mod
from ridgefill.capture import Capture, CaptureOptions, capture, load_capture
from ridgefill.default_model import cache_root, default_model_dir
from ridgefill.fingerprint import fingerprint, fingerprint_key
from ridgefill.fit import RidgeSolver
from ridgefill.heldout import HeldOutWindow, heldout_activations, score_maps
from ridgefill.maps import MapInfo, MapSet, write_map_set
from ridgefill.params import Params
from ridgefill.scores import rarity

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


@dataclass(frozen=True)
class CalibrationText:
    """What a capture reads: its `source` cut into windows of `window` tokens, at most `max_windows` of them,
    after holding out the last `heldout` (a study's `calibration` gives all four)."""

    source: str | list[str]
    window: int = 512
    max_windows: int = 128
    heldout: int = 4

    @classmethod
    def of(cls, calibration) -> CalibrationText:
        """A study's `calibration` section (source, window, max_windows, heldout) taken whole."""
        c = calibration
        return cls(c.source, c.window, c.max_windows, c.heldout)


def run_capture(
    model: nn.Module,
    tokenizer,
    text: CalibrationText,
    splits: list[int],
    root: Path | None = None,
    how: CaptureOptions | None = None,
) -> Capture:
    """Capture statistics for `splits`, reusing a finished capture and resuming a partial one."""
    how = how or CaptureOptions()
    source, window, heldout = text.source, text.window, text.heldout
    cal, _, corpus_sha = calibration_windows(tokenizer, source, window, text.max_windows, heldout)
    key = fingerprint_key(fingerprint(model, tokenizer, splits[0]))
    tag = f"n{cal.shape[0]}-s{how.sink_skip}-r{how.stride}"
    out = capture_dir(root or cache_root(), key, corpus_sha, window) / tag
    meta = {
        "corpus_sha256": corpus_sha,
        "source": source if isinstance(source, str) else [str(s) for s in source],
        "fingerprint_key": key,
        "heldout": heldout,
        "max_windows": text.max_windows,
    }
    if (out / "capture.json").is_file():
        done = load_capture(out)
        if done.meta.get("windows_done") == cal.shape[0] and set(splits) <= set(done.splits):
            return done
        if set(splits) != set(done.meta["splits"]):
            out = out.with_name(out.name + "-S" + "_".join(map(str, sorted(splits))))
    return capture(model, cal, splits, out, how, meta)


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


@dataclass(frozen=True)
class Fit:
    """One split fitted at one lambda: float32 maps and their provenance (held-out metrics), with what writing a
    folder needs (the model's fingerprint, the capture's token counts); a ridge and an identity folder share it."""

    model: nn.Module
    tokenizer: object
    cap: Capture
    split: int
    lam: float
    maps: dict[int, tuple[Tensor, Tensor]]
    provenance: dict
    defaults: dict | None = None  # the folder's row-policy defaults (None: `ROWS`')


def fit_report(
    model: nn.Module,
    tokenizer,
    cap: Capture,
    split: int,
    lam: float,
    solver: RidgeSolver | None = None,
    held: HeldOut | int = 4,
) -> Fit:
    """The fit and its held-out report: the work a ridge and an identity folder share. `held` (of this capture
    and split) spares the held-out model pass; a number runs one on that many held-out windows."""
    solver = solver or RidgeSolver.from_stats(cap.stats(split))
    maps = {l: (w.float(), b.float()) for l, (w, b) in solver.solve(lam).items()}
    held = held if isinstance(held, HeldOut) else held_out(model, tokenizer, cap, split, held)
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
    return Fit(model, tokenizer, cap, split, lam, maps, fit)


def build_maps(fit: Fit, out: Path, kind: str = "ridge", defaults: dict | None = None) -> Path:
    """Write a fit as a map folder (kind='identity' writes the baseline) with its row-policy `defaults`."""
    return _write(replace(fit, defaults=defaults) if defaults is not None else fit, Path(out), kind).path


def build_map_pair(fit: Fit, out_ridge: Path, out_identity: Path) -> tuple[Path, Path]:
    """The ridge folder and its identity-fill baseline from one fit and one held-out run."""
    return _write(fit, Path(out_ridge), "ridge").path, _write(fit, Path(out_identity), "identity").path


def _write(fit: Fit, out: Path, kind: str) -> MapSet:
    identity = kind == "identity"
    info = MapInfo(fit.split, kind, None if identity else fit.lam, fit.provenance, fit.defaults)
    scores = rarity(fit.cap.token_counts())
    return write_map_set(out, {} if identity else fit.maps, fingerprint(fit.model, fit.tokenizer, fit.split), info,
                         scores)  # fmt: skip


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
class ModelRef:
    """Which model a task works on: the weights' folder, the dtype and the device. Frozen and plain, so Prefect
    hashes it into a task's cache key; `load()` is the process's one shared copy."""

    path: str
    dtype: str = "float32"
    device: str = "cpu"

    def load(self) -> tuple[nn.Module, object]:
        return shared_model(self.path, self.dtype, self.device)


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
    defaults = params.rows.options()  # vLLM protects (and pools the question's rows) as the trial did
    held = held_out_for(model, tokenizer, capture_path, params.split)
    solver = solver_for(capture_path, params.split)
    fit = fit_report(model, tokenizer, cap, params.split, params.lam, solver, held)
    return _write(replace(fit, defaults=defaults), Path(out), "ridge")
