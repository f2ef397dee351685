"""The Llama-family adapter. Qwen2 is the same shape (biases live inside the projections)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn


class LlamaAdapter:
    """Views a Llama-shaped transformers model as the parts RidgeFill needs.

    The *cache writer* of a layer is input norm -> k/v projections -> (k norm) -> RoPE; RidgeFill runs
    only it on bulk rows of late layers.
    """

    architectures: tuple[str, ...] = ("LlamaForCausalLM",)

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.config = model.config
        if getattr(self.config, "sliding_window", None) and getattr(self.config, "use_sliding_window", False):
            raise ValueError("RidgeFill does not support sliding-window attention yet.")
        self.layers: nn.ModuleList = model.model.layers
        self.num_layers = len(self.layers)
        attn = self.layers[0].self_attn
        self.head_dim: int = attn.head_dim
        self.num_kv_heads: int = self.config.num_key_value_heads
        self.num_heads: int = self.config.num_attention_heads

    # --- whole-model pieces -------------------------------------------------------------
    def embed(self, input_ids: Tensor) -> Tensor:
        return self.model.model.embed_tokens(input_ids)

    def rotary(self, hidden: Tensor, positions: Tensor) -> tuple[Tensor, Tensor]:
        """cos/sin for the given positions ([n]), shaped [1, n, head_dim]."""
        return self.model.model.rotary_emb(hidden, positions[None])

    def logits(self, hidden: Tensor) -> Tensor:
        return self.model.lm_head(self.model.model.norm(hidden))

    # --- one layer ----------------------------------------------------------------------
    def _heads(self, x: Tensor) -> Tensor:
        """[1, n, h*hd] -> [1, n, h, hd]."""
        return x.view(*x.shape[:-1], -1, self.head_dim)

    def keys(self, layer: nn.Module, normed: Tensor) -> Tensor:
        return self._heads(layer.self_attn.k_proj(normed))

    def queries(self, layer: nn.Module, normed: Tensor) -> Tensor:
        return self._heads(layer.self_attn.q_proj(normed))

    def roped_queries(self, layer: nn.Module, hidden: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        """A layer's queries of its input rows [1, n, d] (norm, projection, RoPE): [1, heads, n, head_dim]."""
        return rope(self.queries(layer, layer.input_layernorm(hidden)).transpose(1, 2), cos, sin)

    def scaling(self, layer: nn.Module) -> float:
        """The scale a layer's attention applies to q.k (the family's, e.g. 1/sqrt(head_dim))."""
        return layer.self_attn.scaling

    def write_kv(self, layer: nn.Module, hidden: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
        """The cache writer: a layer's input rows [1, n, d] -> K, V shaped [1, kv_heads, n, head_dim]."""
        normed = layer.input_layernorm(hidden)
        k = self.keys(layer, normed).transpose(1, 2)
        v = self._heads(layer.self_attn.v_proj(normed)).transpose(1, 2)
        return rope(k, cos, sin), v

    def attend(
        self, layer: nn.Module, hidden: Tensor, cos: Tensor, sin: Tensor, k: Tensor, v: Tensor, mask: Tensor
    ) -> Tensor:
        """Run the whole layer on some rows [1, p, d] against all K/V; mask [p, n] is True where allowed."""
        q = self.roped_queries(layer, hidden, cos, sin)
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, scale=self.scaling(layer), enable_gqa=self.num_heads != self.num_kv_heads
        )
        out = out.transpose(1, 2).reshape(*hidden.shape[:-1], -1)
        hidden = hidden + layer.self_attn.o_proj(out)
        return hidden + layer.mlp(layer.post_attention_layernorm(hidden))


def rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotary embedding of x [1, heads, n, hd] with cos/sin [1, n, hd], as transformers computes it."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None] + rotated * sin[:, None]
