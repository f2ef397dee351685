"""A FLOP model of prefill, to say what speed-up a split can give at best.

Per row and layer, a full layer costs its projections, MLP and attention over the causal prefix;
a bulk row of a late layer costs only its map (none at layer S) and the k/v projections.
"""

from __future__ import annotations


def layer_flops(cfg, ctx: float) -> tuple[float, float, float]:
    """(full row, bulk row with a map, bulk row at the split layer) multiply-adds for one layer."""
    d, i = cfg.hidden_size, cfg.intermediate_size
    hd = getattr(cfg, "head_dim", None) or d // cfg.num_attention_heads
    q = d * cfg.num_attention_heads * hd
    kv = 2 * d * cfg.num_key_value_heads * hd
    attn = 2 * ctx * cfg.num_attention_heads * hd
    full = 2 * q + kv + 3 * d * i + attn
    return full, d * d + kv, kv


def speedup_bound(cfg, n: int, split: int, protected: int) -> float:
    """Exact prefill FLOPs over RidgeFill prefill FLOPs for an n-token prompt (lm_head on one row)."""
    full, bulk, at_split = layer_flops(cfg, ctx=n / 2)
    layers = cfg.num_hidden_layers
    exact = n * layers * full
    late = layers - split
    bulk_rows = n - protected
    ridge = n * split * full + protected * late * full + bulk_rows * (at_split + (late - 1) * bulk)
    return exact / ridge
