"""Per-token sensitivity scores that pick the protected share of bulk rows.

Rare tokens (digits, names, code) carry the facts a prompt is asked about and are the rows a linear
fill reproduces worst, so the default score is rarity: -log of the add-one smoothed calibration
frequency of the token.
"""

import torch
from torch import Tensor


def rarity(token_counts: Tensor) -> Tensor:
    """-log p(token) under add-one smoothing; a token never seen scores highest."""
    counts = token_counts.double()
    return -torch.log((counts + 1) / (counts.sum() + counts.numel())).float()
