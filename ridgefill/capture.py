"""Calibration capture: float64 sufficient statistics of the ridge problem, streamed over windows.

For each candidate split S and late layer l > S we need, over calibration rows, sum(x), sum(y_l),
X^T X and X^T Y_l, where x is the input of layer S and y_l the input of layer l. One forward pass per
window serves every split. Activations are never held beyond one window. A checkpoint every N windows
lets a crashed capture resume and end bit-identical to an uninterrupted one.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import Tensor, nn
from tqdm import tqdm

from ridgefill.adapters import adapter_for

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
    def zeros(cls, split: int, num_layers: int, d: int) -> SplitStats:
        z = lambda *s: torch.zeros(*s, dtype=torch.float64)  # noqa: E731
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
        out = {"count": torch.tensor([self.count], dtype=torch.int64), "x_sum": self.x_sum, "xx": self.xx}
        for l in self.xy:
            out[f"y_sum.{l}"] = self.y_sum[l]
            out[f"xy.{l}"] = self.xy[l]
        return out

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


def split_file(split: int) -> str:
    return f"split_{split:03d}.safetensors"


@dataclass
class Capture:
    """A finished (or partial) capture on disk: per-split statistics plus token counts."""

    path: Path
    meta: dict

    @property
    def splits(self) -> list[int]:
        return list(self.meta["splits"])

    def stats(self, split: int) -> SplitStats:
        if split not in self.splits:
            raise ValueError(f"split {split} was not captured; captured: {self.splits}")
        return SplitStats.from_tensors(split, load_file(self.path / split_file(split)))

    def token_counts(self) -> Tensor:
        return load_file(self.path / "tokens.safetensors")["token_counts"]


def _save(path: Path, stats: dict[int, SplitStats], token_counts: Tensor, meta: dict) -> None:
    """Checkpoint atomically: tensors first, then the meta that names how many windows they hold."""
    path.mkdir(parents=True, exist_ok=True)
    for s, st in stats.items():
        tmp = path / (split_file(s) + ".tmp")
        save_file(st.tensors(), tmp)
        os.replace(tmp, path / split_file(s))
    tmp = path / "tokens.safetensors.tmp"
    save_file({"token_counts": token_counts}, tmp)
    os.replace(tmp, path / "tokens.safetensors")
    tmp = path / (META + ".tmp")
    tmp.write_text(json.dumps(meta, indent=2) + "\n")
    os.replace(tmp, path / META)


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


@torch.inference_mode()
def capture(
    model: nn.Module,
    windows: Tensor,
    splits: list[int],
    out: Path,
    *,
    sink_skip: int = 4,
    stride: int = 1,
    checkpoint_every: int = 16,
    meta: dict | None = None,
    progress: bool = True,
) -> Capture:
    """Accumulate statistics for every split over `windows` [count, length], resuming from `out`."""
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
    done = 0
    if (out / META).is_file():
        prev = json.loads((out / META).read_text())
        same = {k: prev.get(k) for k in base_meta} == base_meta
        if not same:
            raise ValueError(f"{out} holds a capture with other settings; use another folder")
        done = prev["windows_done"]
        stats = {s: SplitStats.from_tensors(s, load_file(out / split_file(s))) for s in splits}
        token_counts = load_file(out / "tokens.safetensors")["token_counts"]
    else:
        stats = {s: SplitStats.zeros(s, num_layers, d) for s in splits}
        token_counts = torch.zeros(vocab, dtype=torch.int64)
    wanted = set(range(splits[0], num_layers))
    device = next(model.parameters()).device
    for i in tqdm(
        range(done, windows.shape[0]),
        desc="capture",
        unit="win",
        disable=not progress,
        initial=done,
        total=windows.shape[0],
    ):
        ids = windows[i : i + 1].to(device)
        token_counts += torch.bincount(windows[i], minlength=vocab)[:vocab]
        inputs = layer_inputs(model, ids, wanted)
        rows = slice(sink_skip, None, stride)
        for s, st in stats.items():
            st.add(inputs[s][rows].cpu(), {l: inputs[l][rows].cpu() for l in st.xy})
        done = i + 1
        if done % checkpoint_every == 0:
            _save(out, stats, token_counts, {**base_meta, "windows_done": done})
    _save(out, stats, token_counts, {**base_meta, "windows_done": done})
    return Capture(out, {**base_meta, "windows_done": done})


def load_capture(path: Path) -> Capture:
    path = Path(path)
    if not (path / META).is_file():
        raise FileNotFoundError(f"{path} holds no capture ({META} missing)")
    return Capture(path, json.loads((path / META).read_text()))
