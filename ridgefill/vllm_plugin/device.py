"""Host tensors onto the model's device, shared by the classifier, the question selector and the backend."""

from __future__ import annotations

import torch
from torch import Tensor


def to_device(t: Tensor, device: torch.device) -> Tensor:
    """A host tensor on `device`; to a GPU through pinned memory so the copy does not wait for the stream."""
    if torch.device(device).type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)
