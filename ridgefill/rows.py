"""Which prompt rows are protected (run the whole model) and which are bulk (filled from a map).

Shared by every runtime so that they agree row for row: the first `sink` rows, the last `tail` rows,
and a `share` of the remaining rows chosen by a selector:
- "rarity": the rows whose tokens score highest in the map folder's token table;
- "question": the rows the question (the last prompt rows) attends to most in exact layers below the
  split, max-pooled over a small window so that a whole fact is kept, not one token of it;
- "random": a seeded random choice, the baseline the other two must beat.
Ties go to the earlier row.

`RowPolicy` is the one home of these settings: their defaults (map folders, the command line, studies and
the vLLM plugin take theirs from `ROWS`) and their checks.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import Tensor

Select = Literal["rarity", "question", "random"]
QUESTION = {"question": True}  # a field that only shapes the "question" selector
SELECTS: tuple[str, ...] = ("rarity", "question", "random")


@dataclass(frozen=True)
class RowPolicy:
    """Which rows a prompt protects: the first `sink`, the last `tail`, and a `share` of the rest by `select`.

    `query`, `window`, `reach` and `score_layers` shape the "question" selector: query rows at the end of the
    prompt, max-pool half-width, how many more rows after a scored row share its score (the value that follows
    a key the question matches), and how many exact layers just below the split are summed.
    """

    sink: int = 4
    tail: int = 256
    share: float = 0.0
    select: Select = "rarity"
    query: int = field(default=32, metadata=QUESTION)
    window: int = field(default=4, metadata=QUESTION)
    score_layers: int = field(default=3, metadata=QUESTION)
    reach: int = field(default=0, metadata=QUESTION)

    def check(self, prefix: str = "") -> RowPolicy:
        """This policy, or ValueError naming the bad setting as the caller spells it (`prefix`, e.g.
        "ridgefill_" for vLLM's hf_overrides)."""
        p = prefix
        if not 0.0 <= self.share <= 1.0:
            raise ValueError(f"{p}share must lie in [0, 1], got {self.share}")
        if self.sink < 0 or self.tail < 1:
            raise ValueError(
                f"{p}sink must be >= 0 and {p}tail >= 1, got {self.sink} and {self.tail} "
                "(the last prompt row is always exact)"
            )
        if self.select not in SELECTS:
            raise ValueError(f"{p}select must be one of {SELECTS}, got {self.select!r}")
        if self.query < 1 or self.window < 0 or self.score_layers < 1 or self.reach < 0:
            raise ValueError(
                f"question rows need {p}query >= 1, {p}window >= 0, {p}score_layers >= 1 and {p}reach >= 0, "
                f"got {self.query}, {self.window}, {self.score_layers} and {self.reach}"
            )
        return self

    @classmethod
    def of(cls, defaults: Mapping[str, Any]) -> RowPolicy:
        """The policy a map folder's `defaults` (or any mapping) names, `ROWS` for what it leaves out."""
        return cls(**{f.name: defaults[f.name] for f in fields(cls) if f.name in defaults})

    def given(self, **values: Any) -> RowPolicy:
        """This policy with the values that are not None (command-line options over a folder's defaults)."""
        return replace(self, **{k: v for k, v in values.items() if v is not None})

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    def options(self) -> dict[str, Any]:
        """The settings that travel with a plan (a map folder's defaults, the vLLM plugin's `ridgefill_<key>`
        overrides): every field, those that only shape the question selector only when it selects."""
        question = self.select == "question"
        return {f.name: getattr(self, f.name) for f in fields(self) if question or not f.metadata.get("question")}

    @classmethod
    def typed(cls, values: Mapping[str, Any]) -> RowPolicy:
        """The policy `values` names, each value cast to its field's type (a folder's JSON, text from a config),
        `ROWS` for what it leaves out; unchecked."""
        return cls(**{f.name: type(getattr(ROWS, f.name))(values[f.name]) for f in fields(cls) if f.name in values})

    @property
    def by_question(self) -> bool:
        """Whether the share is picked by the question's attention in the forward (nothing to pick without one)."""
        return self.select == "question" and self.share > 0

    def protected(self, n: int) -> int:
        """How many rows of an n-row prompt run the whole model: sink, tail and the share of the rest."""
        edge = min(n, self.sink + self.tail)
        return edge + share_count(self.share, n - edge)


ROWS = RowPolicy()  # the defaults


def edge_rows(n: int, sink: int, tail: int, device: torch.device | str = "cpu") -> Tensor:
    """Bool [n]: the first `sink` and the last `tail` rows."""
    keep = torch.zeros(n, dtype=torch.bool, device=device)
    keep[:sink] = True
    keep[max(0, n - tail) :] = True
    return keep


def share_count(share: float, rest: int) -> int:
    """How many of `rest` unprotected rows a share protects (every selector, and the row counts, use it)."""
    return int(round(share * rest))


def protect_top(keep: Tensor, row_scores: Tensor, share: float) -> Tensor:
    """`keep` plus the top `share` of the other rows by `row_scores` [n] (ties: the earlier row)."""
    bulk = (~keep).nonzero().squeeze(-1)
    k = share_count(share, bulk.numel())
    out = keep.clone()
    if k > 0:
        order = torch.sort(row_scores.to(keep.device)[bulk], descending=True, stable=True).indices
        out[bulk[order[:k]]] = True
    return out


def protected_mask(token_ids: Tensor, sink: int, tail: int, share: float, scores: Tensor | None) -> Tensor:
    """Bool [n] for one prompt's token ids [n], the share chosen by token score (the "rarity" selector)."""
    keep = edge_rows(token_ids.shape[-1], sink, tail, token_ids.device)
    if share_count(share, int((~keep).sum())) == 0:
        return keep
    if scores is None:
        raise ValueError("a share of protected rows needs the token score table of a map folder")
    return protect_top(keep, scores.to(token_ids.device)[token_ids], share)


def random_scores(n: int, seed: int = 0) -> Tensor:
    """Float [n] uniform scores from a fixed seed: the same rows for every prompt of length n."""
    return torch.rand(n, generator=torch.Generator().manual_seed(seed))


def pooled(attention: Tensor, keep: Tensor, window: int, reach: int = 0) -> Tensor:
    """Row scores for the "question" selector: attention [n] with `keep` rows zeroed, max-pooled over the
    rows from `window + reach` before to `window` after.

    Zeroing the rows that are protected anyway (sink, question) stops their large self-attention from
    spilling onto neighbouring bulk rows. `reach` lets a scored row lend its score to the rows after it:
    the question matches a fact's key, and the value it must copy follows the key.
    """
    a = attention.float().masked_fill(keep.to(attention.device), 0.0)
    if window <= 0 and reach <= 0:
        return a
    padded = F.pad(a[None, None], (window + reach, window))  # attention >= 0, so zero padding never wins
    return F.max_pool1d(padded, 2 * window + reach + 1, stride=1)[0, 0]


def question_mask(attention: Tensor, sink: int, tail: int, share: float, window: int, reach: int = 0) -> Tensor:
    """Bool [n] for the "question" selector: sink and tail rows, and the top `share` of the rest by the
    question's attention [n], max-pooled over `window + reach` rows before to `window` after (both runtimes
    choose with it)."""
    keep = edge_rows(attention.shape[-1], sink, tail, attention.device)
    return protect_top(keep, pooled(attention, keep, window, reach), share)


def question_attention(queries: Tensor, keys: Tensor, scaling: float) -> Tensor:
    """Attention [n] that the last q rows pay every row, summed over heads and query rows (causal).

    queries [H, q, hd] (roped, the prompt's last q rows), keys [KV, n, hd] (roped, every row; KV divides H).
    Only q x n scores are formed, in float32. Both runtimes score the "question" selector with it.
    """
    keys = keys.repeat_interleave(queries.shape[0] // keys.shape[0], dim=0)
    logits = (queries @ keys.transpose(-1, -2)).float() * scaling  # [H, q, n]
    n, q = keys.shape[1], queries.shape[1]
    future = torch.arange(n, device=keys.device)[None, :] > torch.arange(n - q, n, device=keys.device)[:, None]
    return logits.masked_fill(future, float("-inf")).softmax(-1).sum(dim=(0, 1))
