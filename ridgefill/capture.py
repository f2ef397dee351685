"""Calibration capture: float64 sufficient statistics of the ridge problem, streamed over windows.

For each candidate split S and late layer l > S we need, over calibration rows, sum(x), sum(y_l),
X^T X and X^T Y_l, where x is the input of layer S and y_l the input of layer l. One forward pass per
window serves every split. Activations are never held beyond one window. A checkpoint every N windows
lets a crashed capture resume and end bit-identical to an uninterrupted one.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import Tensor, nn
from tqdm import tqdm

from ridgefill.adapters import adapter_for
from ridgefill.rows import ROWS

log = logging.getLogger(__name__)
META = "capture.json"


@dataclass
class SplitStats:
    """Sufficient statistics of one split: x is the split stream, ys[l] the input of late layer l."""

    split: int
    count: int
    x_sum: Tensor  # [d]
    xx: Tensor  # [d, d]
    y_sum: dict[int, Tensor]  # l -> [d]
    xy: dict[int, Tensor]  # l -> [d, d]

    @classmethod
    def zeros(cls, split: int, num_layers: int, d: int, device: torch.device | str = "cpu") -> SplitStats:
        z = lambda *s: torch.zeros(*s, dtype=torch.float64, device=device)  # noqa: E731
        late = range(split + 1, num_layers)
        return cls(split, 0, z(d), z(d, d), {l: z(d) for l in late}, {l: z(d, d) for l in late})

    def add(self, x: Tensor, ys: dict[int, Tensor]) -> None:
        """Accumulate rows x [r, d] and ys[l] [r, d] (converted to float64 here)."""
        x = x.double()
        self.count += x.shape[0]
        self.x_sum += x.sum(0)
        self.xx += x.T @ x
        for l, y in ys.items():
            y = y.double()
            self.y_sum[l] += y.sum(0)
            self.xy[l] += x.T @ y

    def tensors(self) -> dict[str, Tensor]:
        """CPU copies for saving (the statistics may live on the model's device)."""
        out = {"count": torch.tensor([self.count], dtype=torch.int64), "x_sum": self.x_sum, "xx": self.xx}
        for l in self.xy:
            out[f"y_sum.{l}"] = self.y_sum[l]
            out[f"xy.{l}"] = self.xy[l]
        return {k: v.cpu() for k, v in out.items()}

    def to(self, device: torch.device) -> SplitStats:
        mv = lambda t: t.to(device)  # noqa: E731
        return SplitStats(
            self.split, self.count, mv(self.x_sum), mv(self.xx),
            {l: mv(v) for l, v in self.y_sum.items()}, {l: mv(v) for l, v in self.xy.items()},
        )  # fmt: skip

    @classmethod
    def from_tensors(cls, split: int, t: dict[str, Tensor]) -> SplitStats:
        late = sorted(int(k.split(".")[1]) for k in t if k.startswith("xy."))
        return cls(
            split,
            int(t["count"][0]),
            t["x_sum"],
            t["xx"],
            {l: t[f"y_sum.{l}"] for l in late},
            {l: t[f"xy.{l}"] for l in late},
        )


def split_file(split: int, done: int) -> str:
    """A split's statistics after `done` windows; the count in the name makes each checkpoint new files."""
    return f"split_{split:03d}.w{done:08d}.safetensors"


def tokens_file(done: int) -> str:
    return f"tokens.w{done:08d}.safetensors"


def _legacy_files(meta: dict) -> dict:
    """File names of a capture written before checkpoints named their files by `windows_done`."""
    return {"tokens": "tokens.safetensors", "splits": {str(s): f"split_{s:03d}.safetensors" for s in meta["splits"]}}


@dataclass
class Capture:
    """A finished (or partial) capture on disk: per-split statistics plus token counts."""

    path: Path
    meta: dict

    @property
    def splits(self) -> list[int]:
        return list(self.meta["splits"])

    @property
    def files(self) -> dict:
        """{"tokens": name, "splits": {split: name}}: the files of the checkpoint capture.json commits to."""
        return self.meta.get("files") or _legacy_files(self.meta)

    def stats(self, split: int) -> SplitStats:
        if split not in self.splits:
            raise ValueError(f"split {split} was not captured; captured: {self.splits}")
        return SplitStats.from_tensors(split, load_file(self.path / self.files["splits"][str(split)]))

    def token_counts(self) -> Tensor:
        return load_file(self.path / self.files["tokens"])["token_counts"]


def _write(path: Path, write: Callable[[Path], object]) -> None:
    """Write one file under a temporary name and rename it: a reader sees all of it or none (the step the
    crash tests interrupt)."""
    tmp = path.with_name(path.name + ".tmp")
    write(tmp)
    os.replace(tmp, path)


def _remove(path: Path) -> None:
    path.unlink(missing_ok=True)


def _prune(path: Path, keep: set[str]) -> None:
    """Remove statistics files and temporaries that the committed capture.json does not name."""
    for f in sorted(path.iterdir()):
        ours = f.name.endswith(".tmp") or (f.suffix == ".safetensors" and f.name.startswith(("split_", "tokens")))
        if ours and f.name not in keep:
            _remove(f)


def _save(path: Path, stats: dict[int, SplitStats], token_counts: Tensor, meta: dict) -> dict:
    """Checkpoint as one unit: new files named by `windows_done`, then capture.json naming them (one rename,
    the commit), then the previous checkpoint's files removed. A kill at any step leaves capture.json
    pointing at a complete, consistent checkpoint. Returns the committed meta."""
    path.mkdir(parents=True, exist_ok=True)
    done = meta["windows_done"]
    files = {"tokens": tokens_file(done), "splits": {str(s): split_file(s, done) for s in stats}}
    for s, st in stats.items():
        tensors = st.tensors()
        _write(path / files["splits"][str(s)], lambda p, t=tensors: save_file(t, p))
    _write(path / files["tokens"], lambda p: save_file({"token_counts": token_counts.cpu()}, p))
    meta = {**meta, "files": files}
    _write(path / META, lambda p: p.write_text(json.dumps(meta, indent=2) + "\n"))
    _prune(path, {files["tokens"], *files["splits"].values()})
    return meta


def _check_counts(out: Path, cap: Capture, stats: dict[int, SplitStats], token_counts: Tensor) -> None:
    """Refuse a checkpoint whose statistics do not hold exactly the windows capture.json says are done."""
    m, done = cap.meta, cap.meta["windows_done"]
    rows = done * len(range(m["sink_skip"], m["window"], m["stride"]))
    for s, st in stats.items():
        if st.count != rows:
            raise ValueError(
                f"{out}: {cap.files['splits'][str(s)]} holds {st.count} rows but capture.json says {done} windows "
                f"({rows} rows); the checkpoint is inconsistent: delete the folder and capture again"
            )
    if int(token_counts.sum()) != done * m["window"]:
        raise ValueError(
            f"{out}: {cap.files['tokens']} counts {int(token_counts.sum())} tokens but capture.json says {done} "
            f"windows of {m['window']}; the checkpoint is inconsistent: delete the folder and capture again"
        )


def _free_bytes(device: torch.device) -> int | None:
    """Free memory on an accelerator (None where torch cannot say)."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    return None


def _has_float64(device: torch.device) -> bool:
    try:
        torch.zeros(1, dtype=torch.float64, device=device)
        return True
    except (TypeError, RuntimeError):  # MPS: "Cannot convert a MPS Tensor to float64"
        return False


def stats_device(model_device: torch.device, need_bytes: int, where: str = "auto") -> tuple[torch.device, str]:
    """(device for the float64 statistics, why): the model's own device, where the activations already are,
    unless it has no float64 or too little free memory (statistics plus half again for activations), then
    the CPU. `where`: auto | device | cpu (device and cpu force a path; tests compare both)."""
    cpu = torch.device("cpu")
    if where not in ("auto", "device", "cpu"):
        raise ValueError(f"stats device must be auto, device or cpu, got {where!r}")
    if where == "cpu":
        return cpu, "cpu (asked)"
    if where == "device" or model_device.type == "cpu":
        return model_device, f"{model_device} (the model's device)"
    if not _has_float64(model_device):
        return cpu, f"cpu: {model_device} has no float64"
    free = _free_bytes(model_device)
    if free is not None and need_bytes * 1.5 > free:
        gib = f"{need_bytes / 2**30:.1f} GiB, {model_device} has {free / 2**30:.1f} GiB free"
        return cpu, f"cpu: the statistics need {gib}"
    return model_device, f"{model_device} (the model's device)"


def stats_bytes(splits: list[int], num_layers: int, d: int) -> int:
    """Bytes of float64 statistics for these splits: per split X^T X and X^T Y_l per late layer, plus sums."""
    return sum((num_layers - s) * (d * d + d) * 8 for s in splits)


def layer_inputs(model: nn.Module, input_ids: Tensor, wanted: set[int]) -> dict[int, Tensor]:
    """Run the base model on one window and return the inputs of the wanted layers ([n, d] each)."""
    ad = adapter_for(model)
    got: dict[int, Tensor] = {}
    last = max(wanted)

    class Stop(Exception):
        pass

    def hook(idx):
        def fn(_module, args, kwargs):
            h = args[0] if args else kwargs["hidden_states"]
            if idx in wanted:
                got[idx] = h[0].detach()
            if idx == last:
                raise Stop

        return fn

    handles = [layer.register_forward_pre_hook(hook(i), with_kwargs=True) for i, layer in enumerate(ad.layers)]
    try:
        model.model(input_ids=input_ids, use_cache=False)
    except Stop:
        pass
    finally:
        for h in handles:
            h.remove()
    return got


@dataclass(frozen=True)
class CaptureOptions:
    """How a capture runs: rows skipped at the start of each window (`sink_skip`) and the row `stride` (both
    part of the capture's identity), seconds between checkpoints (0: after every window), where the statistics
    live (`stats_on`: auto, device or cpu) and the progress bar."""

    sink_skip: int = ROWS.sink
    stride: int = 1
    checkpoint_seconds: float = 300.0
    stats_on: str = "auto"
    progress: bool = True


@torch.inference_mode()
def capture(
    model: nn.Module,
    windows: Tensor,
    splits: list[int],
    out: Path,
    how: CaptureOptions = CaptureOptions(),
    meta: dict | None = None,
) -> Capture:
    """Accumulate statistics for every split over `windows` [count, length], resuming from `out`.

    The statistics live on the model's device when it can hold them (`stats_device`). A checkpoint is
    written when `how.checkpoint_seconds` have passed since the last one (0: after every window) and at the end.
    """
    sink_skip, stride, checkpoint_seconds = how.sink_skip, how.stride, how.checkpoint_seconds
    out = Path(out)
    num_layers = model.config.num_hidden_layers
    splits = sorted(set(splits))
    if not splits or splits[0] < 1 or splits[-1] >= num_layers - 1:
        raise ValueError(f"splits must lie in 1..{num_layers - 2}, got {splits}")
    d, vocab = model.config.hidden_size, model.config.vocab_size
    base_meta = {
        **(meta or {}),
        "splits": splits,
        "sink_skip": sink_skip,
        "stride": stride,
        "window": int(windows.shape[1]),
        "windows_total": int(windows.shape[0]),
    }
    device = next(model.parameters()).device
    sdev, why = stats_device(device, stats_bytes(splits, num_layers, d), how.stats_on)
    log.info("capture statistics (float64) on %s", why)
    done = 0
    if (out / META).is_file():
        prev = load_capture(out)
        if {k: prev.meta.get(k) for k in base_meta} != base_meta:
            raise ValueError(f"{out} holds a capture with other settings; use another folder")
        done = prev.meta["windows_done"]
        stats = {s: prev.stats(s) for s in splits}
        token_counts = prev.token_counts()
        _check_counts(out, prev, stats, token_counts)
        _prune(out, {prev.files["tokens"], *prev.files["splits"].values()})  # an interrupted checkpoint's files
        stats = {s: st.to(sdev) for s, st in stats.items()}
    else:
        stats = {s: SplitStats.zeros(s, num_layers, d, sdev) for s in splits}
        token_counts = torch.zeros(vocab, dtype=torch.int64)
    saved = done if (out / META).is_file() else -1
    wanted = set(range(splits[0], num_layers))
    last = time.monotonic()
    for i in tqdm(
        range(done, windows.shape[0]),
        desc="capture",
        unit="win",
        disable=not how.progress,
        initial=done,
        total=windows.shape[0],
    ):
        ids = windows[i : i + 1].to(device)
        token_counts += torch.bincount(windows[i], minlength=vocab)[:vocab]
        inputs = layer_inputs(model, ids, wanted)
        rows = slice(sink_skip, None, stride)
        for s, st in stats.items():
            st.add(inputs[s][rows].to(sdev), {l: inputs[l][rows].to(sdev) for l in st.xy})
        done = i + 1
        if time.monotonic() - last >= checkpoint_seconds and done < windows.shape[0]:
            _save(out, stats, token_counts, {**base_meta, "windows_done": done, "stats_device": str(sdev)})
            saved, last = done, time.monotonic()
    if saved != done:
        meta_done = {**base_meta, "windows_done": done, "stats_device": str(sdev)}
        return Capture(out, _save(out, stats, token_counts, meta_done))
    return load_capture(out)


def load_capture(path: Path) -> Capture:
    path = Path(path)
    if not (path / META).is_file():
        raise FileNotFoundError(f"{path} holds no capture ({META} missing)")
    return Capture(path, json.loads((path / META).read_text()))
