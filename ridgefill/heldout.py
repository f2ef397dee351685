"""Held-out fit quality per late layer: how close predicted inputs, and the K/V they write, come to
the exact ones, for the ridge maps and for identity fill (h_l = h_S) on the same rows.

The model runs once per window (`heldout_activations`); scoring maps against those activations
(`score_maps`) needs no model pass, so every lambda of a split is scored on one pass.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from ridgefill.adapters import adapter_for
from ridgefill.capture import layer_inputs
from ridgefill.rows import ROWS


@dataclass(frozen=True)
class HeldOutWindow:
    """One held-out window at one split, rows past the sink: what scoring maps needs (nothing of lambda)."""

    stream: Tensor  # [n, d] the split stream
    inputs: dict[int, Tensor]  # late layer -> its exact input [n, d]
    cos: Tensor  # rope tables of those rows
    sin: Tensor


def rel_error(pred: Tensor, true: Tensor) -> float:
    return float((pred - true).norm() / true.norm())


def mean_cosine(pred: Tensor, true: Tensor) -> float:
    return float(torch.nn.functional.cosine_similarity(pred.flatten(1), true.flatten(1), dim=-1).mean())


@torch.inference_mode()
def heldout_activations(
    model: nn.Module, windows: Tensor, split: int, sink_skip: int = ROWS.sink
) -> list[HeldOutWindow]:
    """Run the model once over each held-out window [w, n] and keep the split stream and late inputs."""
    ad = adapter_for(model)
    device = next(model.parameters()).device
    late = set(range(split, ad.num_layers))
    acts = []
    for i in range(windows.shape[0]):
        ids = windows[i : i + 1].to(device)
        inputs = layer_inputs(model, ids, late)
        x = inputs[split][sink_skip:]
        cos, sin = ad.rotary(x[None], torch.arange(sink_skip, ids.shape[1], device=device))
        acts.append(HeldOutWindow(x, {l: h[sink_skip:] for l, h in inputs.items() if l != split}, cos, sin))
    return acts


@torch.inference_mode()
def score_maps(
    model: nn.Module, acts: list[HeldOutWindow], maps: dict[int, tuple[Tensor, Tensor]]
) -> dict[int, dict[str, dict[str, float]]]:
    """{layer: {"ridge"|"identity": {h_rel, h_cos, k_rel, k_cos, v_rel, v_cos}}}, averaged over windows."""
    ad = adapter_for(model)
    sums: dict[int, dict[str, dict[str, float]]] = {}
    for win in acts:
        x, cos, sin = win.stream, win.cos, win.sin
        for l, (w, b) in maps.items():
            layer, true = ad.layers[l], win.inputs[l]
            k_true, v_true = ad.write_kv(layer, true[None], cos, sin)
            for name, pred in (("ridge", x @ w.to(x) + b.to(x)), ("identity", x)):
                k, v = ad.write_kv(layer, pred[None], cos, sin)
                row = {
                    "h_rel": rel_error(pred, true),
                    "h_cos": mean_cosine(pred, true),
                    "k_rel": rel_error(k, k_true),
                    "k_cos": mean_cosine(k.transpose(1, 2)[0], k_true.transpose(1, 2)[0]),
                    "v_rel": rel_error(v, v_true),
                    "v_cos": mean_cosine(v.transpose(1, 2)[0], v_true.transpose(1, 2)[0]),
                }
                acc = sums.setdefault(l, {}).setdefault(name, {})
                for key, val in row.items():
                    acc[key] = acc.get(key, 0.0) + val / len(acts)
    return sums
