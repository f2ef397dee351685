"""Qwen3: Llama-shaped, plus per-head RMSNorm on queries and keys before RoPE."""

from torch import Tensor, nn

from ridgefill.adapters.base import LlamaAdapter


class Qwen3Adapter(LlamaAdapter):
    architectures = ("Qwen3ForCausalLM",)

    def keys(self, layer: nn.Module, normed: Tensor) -> Tensor:
        return layer.self_attn.k_norm(super().keys(layer, normed))

    def queries(self, layer: nn.Module, normed: Tensor) -> Tensor:
        return layer.self_attn.q_norm(super().queries(layer, normed))
