"""Model adapters: where a family keeps its decoder layers, and how a layer writes its K/V cache.

Adding a family is one small file that subclasses `LlamaAdapter` and registers its architectures.
"""

from __future__ import annotations

from torch import nn

from ridgefill.adapters.base import LlamaAdapter
from ridgefill.adapters.qwen2 import Qwen2Adapter
from ridgefill.adapters.qwen3 import Qwen3Adapter

ADAPTERS: dict[str, type[LlamaAdapter]] = {}
for _cls in (LlamaAdapter, Qwen2Adapter, Qwen3Adapter):
    for _arch in _cls.architectures:
        ADAPTERS[_arch] = _cls


def adapter_for(model: nn.Module) -> LlamaAdapter:
    """Return the adapter for a transformers causal LM, refusing families RidgeFill does not know."""
    archs = list(getattr(model.config, "architectures", None) or [])
    for arch in archs:
        if arch in ADAPTERS:
            return ADAPTERS[arch](model)
    known = ", ".join(sorted(ADAPTERS))
    raise ValueError(f"RidgeFill has no adapter for architecture {archs or model.config.model_type!r}; known: {known}")


__all__ = ["ADAPTERS", "LlamaAdapter", "adapter_for"]
