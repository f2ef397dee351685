"""Which prompt rows are protected (run the whole model) and which are bulk (filled from a map).

Shared by every runtime so that they agree row for row: the first `sink` rows, the last `tail` rows,
and the `share` of the remaining rows whose tokens score highest (ties go to the earlier row).
"""

from __future__ import annotations

import torch
from torch import Tensor


def protected_mask(token_ids: Tensor, sink: int, tail: int, share: float, scores: Tensor | None) -> Tensor:
    """Bool [n] for one prompt's token ids [n]."""
    n = token_ids.shape[-1]
    keep = torch.zeros(n, dtype=torch.bool, device=token_ids.device)
    keep[:sink] = True
    keep[max(0, n - tail) :] = True
    bulk = (~keep).nonzero().squeeze(-1)
    k = int(round(share * bulk.numel()))
    if k > 0:
        if scores is None:
            raise ValueError("a share of protected rows needs the token score table of a map folder")
        row_scores = scores.to(token_ids.device)[token_ids[bulk]]
        order = torch.sort(row_scores, descending=True, stable=True).indices
        keep[bulk[order[:k]]] = True
    return keep
