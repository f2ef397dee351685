"""The reference RidgeFill runtime on transformers: prefill a prompt with maps, then decode stock.

Layers 0..S-1 run exactly on every row. In each late layer l >= S, bulk rows write K/V from a
predicted input (ridge map of the split stream, identity fill, or, in `plumb` mode, the exact input),
and never run the attention output or the MLP. Protected rows (sink, tail, a selected share) run
the whole layer against all K/V. The result is an ordinary `DynamicCache`.

Because the whole prompt is prefilled in one pass, layers 0..S-1 are exact for every row before any
late layer runs, so the question at the end of the prompt can choose the protected share (select
"question"): the attention its last `query` rows pay each row in the `score_layers` layers below the
split, computed for those query rows only.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Literal

import torch
from torch import Tensor, nn
from transformers import DynamicCache

from ridgefill.adapters import adapter_for
from ridgefill.adapters.base import LlamaAdapter
from ridgefill.maps import MapSet
from ridgefill.rows import (
    ROWS,
    RowPolicy,
    edge_rows,
    protect_top,
    protected_mask,
    question_attention,
    question_mask,
    random_scores,
)

Mode = Literal["exact", "plumb", "identity", "ridge"]
MODES: tuple[str, ...] = ("exact", "plumb", "identity", "ridge")


@dataclass
class FillPlan:
    """How to prefill: the mode, split, maps (only for `ridge`) and which rows are protected (`rows`)."""

    mode: Mode = "exact"
    split: int = 0
    maps: MapSet | None = None
    rows: RowPolicy = ROWS

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {self.mode!r}")
        if self.mode == "ridge" and self.maps is None:
            raise ValueError("ridge mode needs a map folder")
        if self.maps is not None:
            self.split = self.maps.split
        self.rows.check()


@dataclass
class EarlyPass:
    """Layers 0..S-1 of one prompt, shared by plans of the same split (they are exact in every plan)."""

    split: int
    hidden: Tensor  # [1, n, d] the split stream
    kv: list[tuple[Tensor, Tensor]]  # K, V of layers 0..S-1
    cos: Tensor
    sin: Tensor
    inputs_q: dict[int, Tensor]  # layer -> its input rows [1, q_max, d] at the end of the prompt
    input_ids: Tensor


@dataclass
class Prefill:
    cache: DynamicCache
    logits: Tensor  # [vocab] logits of the last prompt row
    protected: Tensor  # [n] bool, True for rows that ran the whole model


def protected_rows(input_ids: Tensor, plan: FillPlan, attention: Tensor | None = None) -> Tensor:
    """Bool [n]: sink rows, the last `tail` rows, and the top `share` of the rest by the plan's selector.

    The "question" selector needs `attention` [n], the question's attention to each row from the exact
    early layers (`prefill` computes it in its own pass).
    """
    ids = input_ids[0]
    if plan.rows.select == "rarity":
        scores = plan.maps.scores if plan.maps is not None else None
        return protected_mask(ids, plan.rows.sink, plan.rows.tail, plan.rows.share, scores)
    if plan.rows.by_question:
        if attention is None:
            raise ValueError("question-aware rows need the early layers' attention; call prefill")
        return question_mask(
            attention, plan.rows.sink, plan.rows.tail, plan.rows.share, plan.rows.window, plan.rows.reach
        )
    keep = edge_rows(ids.shape[-1], plan.rows.sink, plan.rows.tail, ids.device)
    return keep if plan.rows.share == 0 else protect_top(keep, random_scores(ids.shape[-1]), plan.rows.share)


@torch.inference_mode()
def prefill(model: nn.Module, input_ids: Tensor, plan: FillPlan, early: EarlyPass | None = None) -> Prefill:
    """Prefill one prompt [1, n] into a fresh cache and return the last row's logits.

    `early` (from `early_pass` on the same prompt and split) skips re-running the exact early layers.
    """
    if input_ids.dim() != 2 or input_ids.shape[0] != 1:
        raise ValueError("prefill takes one prompt shaped [1, n]")
    late_choice = plan.rows.by_question
    keep = (
        edge_rows(input_ids.shape[1], plan.rows.sink, plan.rows.tail)
        if late_choice
        else protected_rows(input_ids, plan)
    )
    if plan.mode == "exact" or bool(keep.all()):
        out = model(input_ids=input_ids, use_cache=True, logits_to_keep=1)
        return Prefill(out.past_key_values, out.logits[0, -1], torch.ones_like(keep))
    return _ridgefill(adapter_for(model), input_ids, plan, None if late_choice else keep, early)


@torch.inference_mode()
def early_pass(model: nn.Module, input_ids: Tensor, split: int, query: int = 64, score_layers: int = 6) -> EarlyPass:
    """Run layers 0..split-1 on every row of one prompt [1, n]; keep what late layers and selectors need.

    Plans of this split (and `query` / `score_layers` no larger than given) can then prefill from it
    with `prefill(..., early=...)`, paying the early layers once (e.g. when several plans are compared).
    """
    return _early_pass(adapter_for(model), input_ids, split, query, score_layers)


def _early_pass(ad: LlamaAdapter, input_ids: Tensor, split: int, query: int, score_layers: int) -> EarlyPass:
    """`early_pass` on the model's adapter (looked up once per prefill by its caller)."""
    if not 0 < split < ad.num_layers:
        raise ValueError(f"split must lie in 1..{ad.num_layers - 1}, got {split}")
    n = input_ids.shape[1]
    pos = torch.arange(n, device=input_ids.device)
    cache = DynamicCache(config=ad.config)
    h = ad.embed(input_ids)
    cos, sin = ad.rotary(h, pos)
    q = min(query, n)
    inputs_q = {}
    for idx, layer in enumerate(ad.layers[:split]):
        if idx >= split - score_layers:
            inputs_q[idx] = h[:, n - q :]
        h = layer(h, position_embeddings=(cos, sin), position_ids=pos[None], past_key_values=cache, use_cache=True)
    kv = [(cache.layers[i].keys, cache.layers[i].values) for i in range(split)]
    return EarlyPass(split, h, kv, cos, sin, inputs_q, input_ids)


def _ridgefill(
    ad: LlamaAdapter, input_ids: Tensor, plan: FillPlan, keep: Tensor | None, early: EarlyPass | None = None
) -> Prefill:
    """RidgeFill prefill; `keep` None means: choose the protected rows from the early pass's attention."""
    n = input_ids.shape[1]
    pos = torch.arange(n, device=input_ids.device)
    if early is None:
        early = _early_pass(ad, input_ids, plan.split, plan.rows.query if keep is None else 1, plan.rows.score_layers)
    elif early.split != plan.split or not torch.equal(early.input_ids, input_ids):
        raise ValueError("the early pass is of another prompt or split")
    cache = DynamicCache(config=ad.config)
    for idx, (k, v) in enumerate(early.kv):
        cache.update(k, v, idx)  # shared tensors: the cache only ever concatenates onto them
    h, cos, sin = early.hidden, early.cos, early.sin
    if keep is None:
        keep = protected_rows(input_ids, plan, question_scores(ad, early, plan))

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


@torch.inference_mode()
def question_scores(ad: LlamaAdapter, early: EarlyPass, plan: FillPlan) -> Tensor:
    """Attention [n] that the prompt's last `plan.rows.query` rows pay each row, summed over heads, query rows and
    the `plan.rows.score_layers` exact layers below the split (the "question" selector's scores, before pooling).
    `ad`: the model's adapter (`adapter_for`), passed so that a prefill looks it up once."""
    n = early.input_ids.shape[1]
    attention = torch.zeros(n, device=early.input_ids.device)
    for idx in range(plan.split - plan.rows.score_layers, plan.split):
        h_in = early.inputs_q.get(idx)
        if h_in is None or h_in.shape[1] < min(plan.rows.query, n):
            raise ValueError("the early pass kept too few query rows or layers for this plan")
        h_q = h_in[:, h_in.shape[1] - min(plan.rows.query, n) :]
        q = h_q.shape[1]
        cos_q, sin_q = early.cos[:, n - q :], early.sin[:, n - q :]
        attention += _question_attention(ad, ad.layers[idx], h_q, cos_q, sin_q, early.kv[idx][0])
    return attention


def _question_attention(
    ad: LlamaAdapter, layer: nn.Module, h_q: Tensor, cos_q: Tensor, sin_q: Tensor, k: Tensor
) -> Tensor:
    """Attention [n] that query rows h_q [1, q, d] (the last q prompt rows) pay every row, summed over
    heads and query rows; k [1, kv_heads, n, hd] are the layer's roped keys. Only q x n scores are formed.
    """
    qh = ad.roped_queries(layer, h_q, cos_q, sin_q)  # [1, H, q, hd]
    return question_attention(qh[0], k[0], ad.scaling(layer))


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
def generate(
    model: nn.Module,
    input_ids: Tensor,
    plan: FillPlan,
    max_new_tokens: int,
    on_prefill: Callable[[Prefill], None] | None = None,
    early: EarlyPass | None = None,
    **kwargs,
) -> Tensor:
    """Greedy-decode after a RidgeFill prefill; returns the new token ids [1, m].

    All rows but the last are prefilled with RidgeFill (the last row is protected anyway); the stock
    model then runs the last prompt row over that cache, and every decode step, with `generate`.
    `on_prefill` sees the prefill of those rows (e.g. to record which rows were protected); `early` is
    an `early_pass` of those rows (`input_ids[:, :-1]`), shared between plans of one split.
    """
    n = input_ids.shape[1]
    if n < 2:
        raise ValueError("a prompt needs at least two tokens")
    head = input_ids[:, :-1]
    plan_head = replace(plan, rows=plan.rows.given(tail=max(1, plan.rows.tail - 1)))
    pre = prefill(model, head, plan_head, early)
    if on_prefill is not None:
        on_prefill(pre)
    cache = pre.cache
    kwargs.setdefault("do_sample", False)
    out = model.generate(
        input_ids=input_ids,
        attention_mask=torch.ones_like(input_ids),
        past_key_values=cache,
        max_new_tokens=max_new_tokens,
        **kwargs,
    )
    return out[:, n:]
