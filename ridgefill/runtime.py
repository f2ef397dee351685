"""The reference RidgeFill runtime on transformers: prefill a prompt with maps, then decode stock.

Layers 0..S-1 run exactly on every row. In each late layer l >= S, bulk rows write K/V from a
predicted input (ridge map of the split stream, identity fill, or, in `plumb` mode, the exact input),
and never run the attention output or the MLP. Protected rows (sink, tail, score-selected share) run
the whole layer against all K/V. The result is an ordinary `DynamicCache`.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Literal

import torch
from torch import Tensor, nn
from transformers import DynamicCache

from ridgefill.adapters import adapter_for
from ridgefill.maps import MapSet
from ridgefill.rows import protected_mask

Mode = Literal["exact", "plumb", "identity", "ridge"]
MODES: tuple[str, ...] = ("exact", "plumb", "identity", "ridge")


@dataclass
class FillPlan:
    """How to prefill: the mode, split and protected-row policy (maps only for `ridge`)."""

    mode: Mode = "exact"
    split: int = 0
    maps: MapSet | None = None
    sink: int = 4
    tail: int = 256
    share: float = 0.0

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {self.mode!r}")
        if self.mode == "ridge" and self.maps is None:
            raise ValueError("ridge mode needs a map folder")
        if self.maps is not None:
            self.split = self.maps.split
        if not 0.0 <= self.share <= 1.0:
            raise ValueError(f"share must lie in [0, 1], got {self.share}")
        if self.sink < 0 or self.tail < 1:
            raise ValueError("sink must be >= 0 and tail >= 1 (the last prompt row is always exact)")


@dataclass
class Prefill:
    cache: DynamicCache
    logits: Tensor  # [vocab] logits of the last prompt row
    protected: Tensor  # [n] bool, True for rows that ran the whole model


def protected_rows(input_ids: Tensor, plan: FillPlan) -> Tensor:
    """Bool [n]: sink rows, the last `tail` rows, and the top `share` of the rest by token score."""
    scores = plan.maps.scores if plan.maps is not None else None
    return protected_mask(input_ids[0], plan.sink, plan.tail, plan.share, scores)


@torch.inference_mode()
def prefill(model: nn.Module, input_ids: Tensor, plan: FillPlan) -> Prefill:
    """Prefill one prompt [1, n] into a fresh cache and return the last row's logits."""
    if input_ids.dim() != 2 or input_ids.shape[0] != 1:
        raise ValueError("prefill takes one prompt shaped [1, n]")
    keep = protected_rows(input_ids, plan)
    if plan.mode == "exact" or bool(keep.all()):
        out = model(input_ids=input_ids, use_cache=True, logits_to_keep=1)
        return Prefill(out.past_key_values, out.logits[0, -1], torch.ones_like(keep))
    return _ridgefill(model, input_ids, plan, keep)


def _ridgefill(model: nn.Module, input_ids: Tensor, plan: FillPlan, keep: Tensor) -> Prefill:
    ad = adapter_for(model)
    if not 0 < plan.split < ad.num_layers:
        raise ValueError(f"split must lie in 1..{ad.num_layers - 1}, got {plan.split}")
    n = input_ids.shape[1]
    pos = torch.arange(n, device=input_ids.device)
    cache = DynamicCache(config=model.config)
    h = ad.embed(input_ids)
    cos, sin = ad.rotary(h, pos)
    for layer in ad.layers[: plan.split]:
        h = layer(h, position_embeddings=(cos, sin), position_ids=pos[None], past_key_values=cache, use_cache=True)

    prot, bulk = keep.nonzero().squeeze(-1), (~keep).nonzero().squeeze(-1)
    x_prot, split_bulk = h[:, prot], h[:, bulk]
    x_bulk = split_bulk  # the exact bulk stream, advanced only in plumb mode
    cos_p, sin_p, cos_b, sin_b = cos[:, prot], sin[:, prot], cos[:, bulk], sin[:, bulk]
    mask_p = prot[:, None] >= pos[None, :]
    mask_b = bulk[:, None] >= pos[None, :] if plan.mode == "plumb" else None
    for idx in range(plan.split, ad.num_layers):
        layer = ad.layers[idx]
        bulk_in = x_bulk if plan.mode == "plumb" else _predict(plan, idx, split_bulk)
        k_b, v_b = ad.write_kv(layer, bulk_in, cos_b, sin_b)
        k_p, v_p = ad.write_kv(layer, x_prot, cos_p, sin_p)
        k, v = _scatter(k_p, k_b, prot, bulk, n), _scatter(v_p, v_b, prot, bulk, n)
        cache.update(k, v, idx)
        if mask_b is not None:
            x_bulk = ad.attend(layer, x_bulk, cos_b, sin_b, k, v, mask_b)
        x_prot = ad.attend(layer, x_prot, cos_p, sin_p, k, v, mask_p)
    logits = ad.logits(x_prot[:, -1:])[0, -1]
    return Prefill(cache, logits, keep)


def _predict(plan: FillPlan, idx: int, split_bulk: Tensor) -> Tensor:
    """The predicted input of late layer idx for bulk rows; layer S's own input is the split stream."""
    if plan.mode == "identity" or idx == plan.split or plan.maps.kind == "identity":
        return split_bulk
    weight, bias = plan.maps.layer(idx)
    return torch.addmm(bias.to(split_bulk.dtype), split_bulk[0], weight.to(split_bulk.dtype))[None]


def _scatter(rows_p: Tensor, rows_b: Tensor, prot: Tensor, bulk: Tensor, n: int) -> Tensor:
    """Interleave protected and bulk K (or V) rows [1, h, *, hd] back into position order."""
    out = rows_p.new_empty(rows_p.shape[0], rows_p.shape[1], n, rows_p.shape[3])
    out[:, :, prot] = rows_p
    out[:, :, bulk] = rows_b
    return out


@torch.inference_mode()
def generate(model: nn.Module, input_ids: Tensor, plan: FillPlan, max_new_tokens: int, **kwargs) -> Tensor:
    """Greedy-decode after a RidgeFill prefill; returns the new token ids [1, m].

    All rows but the last are prefilled with RidgeFill (the last row is protected anyway); the stock
    model then runs the last prompt row over that cache, and every decode step, with `generate`.
    """
    n = input_ids.shape[1]
    if n < 2:
        raise ValueError("a prompt needs at least two tokens")
    head = input_ids[:, :-1]
    plan_head = replace(plan, tail=max(1, plan.tail - 1))
    cache = prefill(model, head, plan_head).cache
    kwargs.setdefault("do_sample", False)
    out = model.generate(
        input_ids=input_ids,
        attention_mask=torch.ones_like(input_ids),
        past_key_values=cache,
        max_new_tokens=max_new_tokens,
        **kwargs,
    )
    return out[:, n:]
