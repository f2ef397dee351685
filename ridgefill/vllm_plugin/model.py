"""vLLM model classes that serve a RidgeFill map folder (Llama, Qwen2, Qwen3).

Early layers run stock on every row. When a step holds bulk rows, each late layer writes bulk K/V
from the predicted input through the layer's own norm, k/v projections (read raw from the checkpoint:
vLLM repacks the fused CPU weights), k-norm and RoPE, and runs the whole layer on protected rows only,
with attention over all K/V in the paged cache. Steps without bulk rows (decodes, exact tails) run
the stock forward.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor
from vllm.logger import init_logger
from vllm.model_executor.models.llama import LlamaForCausalLM
from vllm.model_executor.models.qwen2 import Qwen2ForCausalLM
from vllm.model_executor.models.qwen3 import Qwen3ForCausalLM

from ridgefill.fingerprint import anchor_names, anchors, compare, fingerprint_from
from ridgefill.maps import MapError, MapSet, load_maps
from ridgefill.vllm_plugin import prefix_cache
from ridgefill.vllm_plugin.backend import attend, write_kv
from ridgefill.vllm_plugin.batch import RowClassifier, StepRows, bulk_rows

log = init_logger("vllm.ridgefill")
_KV = re.compile(r"model\.layers\.(\d+)\.self_attn\.([kv])_proj\.(weight|bias)$")


@dataclass
class ServeState:
    """What a RidgeFill model serves: verified maps, the row policy, and raw k/v weights of late layers."""

    maps: MapSet
    mode: str
    classifier: RowClassifier
    kv: dict[tuple[int, str, str], Tensor]
    rows: StepRows | None = None
    enabled: bool = True  # off: serve stock (paired TTFT on one engine); flip only while no request is in flight

    @property
    def split(self) -> int:
        return self.maps.split


ATTENTION_IMPLS = ("CPUAttentionBackendImpl", "FlashAttentionImpl")  # backend.py builds their metadata


def unsupported(vllm_config) -> str | None:
    """Why this engine cannot serve maps (then it serves stock), or None."""
    mc, par, cache = vllm_config.model_config, vllm_config.parallel_config, vllm_config.cache_config
    cfg = mc.hf_config
    if mc.quantization:
        return f"quantized checkpoints ({mc.quantization}) are not supported: bulk K/V come from raw k/v weights"
    if par.pipeline_parallel_size > 1:
        return "pipeline parallel serving is not supported"
    if getattr(par, "decode_context_parallel_size", 1) > 1:
        return "decode context parallel serving is not supported"
    if getattr(mc, "runner_type", "generate") != "generate":
        return f"the {mc.runner_type} runner is not supported"
    if getattr(vllm_config, "speculative_config", None) is not None:
        return "speculative decoding is not supported (drafts read every row's hidden state)"
    if getattr(vllm_config, "lora_config", None) is not None:
        return "LoRA is not supported (bulk K/V come from the base k/v weights)"
    if getattr(vllm_config, "kv_transfer_config", None) is not None:
        return "KV connectors are not supported (they would move filled blocks as exact ones)"
    if str(getattr(cache, "cache_dtype", "auto")) != "auto":
        return f"KV cache dtype {cache.cache_dtype} is not supported: serve with the model's dtype"
    if getattr(cfg, "use_sliding_window", False) and getattr(cfg, "sliding_window", None):
        return "sliding-window attention is not supported"
    return None


def maps_path(cfg) -> str | None:
    """The map folder a RidgeFill class of this config serves: `ridgefill_maps` or RIDGEFILL_MAPS."""
    if not any(a.startswith("RidgeFill") for a in cfg.architectures or []) and not os.environ.get("RIDGEFILL_MAPS"):
        return None
    return getattr(cfg, "ridgefill_maps", None) or os.environ.get("RIDGEFILL_MAPS")


def serve_options(cfg, manifest: dict) -> tuple[int, int, float, str]:
    """(sink, tail, share, mode): hf_overrides `ridgefill_*` over the folder's defaults; ValueError if invalid."""
    d = manifest["defaults"]
    sink = _option(cfg, "sink", int(d["sink"]))
    tail = _option(cfg, "tail", int(d["tail"]))
    share = _option(cfg, "share", float(d["share"]))
    mode = _option(cfg, "mode", "ridge")
    if sink < 0 or tail < 1:
        raise ValueError(f"ridgefill_sink must be >= 0 and ridgefill_tail >= 1 (got {sink}, {tail})")
    if not 0.0 <= share <= 1.0:
        raise ValueError(f"ridgefill_share must lie in [0, 1] (got {share})")
    if mode not in ("ridge", "plumb"):
        raise ValueError(f"ridgefill_mode must be 'ridge' or 'plumb' (got {mode!r})")
    return sink, tail, share, mode


def _option(cfg, name: str, default):
    value = getattr(cfg, f"ridgefill_{name}", None)
    if value is None:
        return default
    try:
        return type(default)(value)
    except (TypeError, ValueError):
        raise ValueError(f"ridgefill_{name} must be a {type(default).__name__} (got {value!r})") from None


def kv_shard(t: Tensor, num_kv_heads: int, head_dim: int) -> Tensor:
    """This tensor-parallel rank's rows of a checkpoint k/v weight or bias (QKVParallelLinear's split)."""
    from vllm.distributed import get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size

    tp = get_tensor_model_parallel_world_size()
    if tp == 1:
        return t
    per, replicas = max(1, num_kv_heads // tp), max(1, tp // num_kv_heads)
    start = (get_tensor_model_parallel_rank() // replicas) * per * head_dim
    return t.narrow(0, start, per * head_dim)


class RidgeFillMixin:
    """Adds map loading, checkpoint k/v capture and the RidgeFill forward to a vLLM causal LM."""

    def _ridgefill_setup(self, vllm_config) -> None:
        self.ridgefill: ServeState | None = None
        self._rf_pending: tuple[MapSet, dict] | None = None  # maps and the fingerprint so far
        mc = vllm_config.model_config
        cfg = mc.hf_config
        prefix_cache.model_built_here()
        path = maps_path(cfg)
        if not path:
            log.warning("RidgeFill: no map folder given (hf_overrides ridgefill_maps or RIDGEFILL_MAPS); serving stock")
            return
        why = unsupported(vllm_config)
        if why:
            log.warning("RidgeFill: %s; serving stock", why)
            return
        try:
            from transformers import AutoTokenizer

            maps = load_maps(path, device="cpu")
            tok = AutoTokenizer.from_pretrained(mc.tokenizer, trust_remote_code=mc.trust_remote_code)
            fp = fingerprint_from(cfg, tok, {}, maps.split)  # anchors follow once the weights stream by
            errors, _ = compare(maps.manifest["model"], fp)
            if errors:
                raise MapError("maps do not match this model: " + "; ".join(errors))
            self._rf_options = serve_options(cfg, maps.manifest)
        except (MapError, OSError, ValueError) as e:
            log.warning("RidgeFill: refusing map folder %s: %s; serving stock", path, e)
            return
        graphs = getattr(vllm_config.compilation_config, "cudagraph_mode", None)
        if not mc.enforce_eager and graphs is not None and graphs.name != "NONE":
            log.warning("RidgeFill: CUDA graphs (%s) are untested with RidgeFill; --enforce-eager is safe", graphs.name)
        self._rf_prefix_caching = bool(vllm_config.cache_config.enable_prefix_caching)
        self._rf_pending = (maps, fp)
        self._rf_cfg = cfg
        self._rf_dtype = mc.dtype

    def load_weights(self, weights: Iterable[tuple[str, Tensor]]) -> set[str]:
        if self._rf_pending is None:
            return super().load_weights(weights)
        maps, fp = self._rf_pending
        anchors = set(anchor_names(maps.split, self._rf_cfg.num_hidden_layers))
        kept: dict[str, Tensor] = {}

        def tee(items):
            for name, t in items:
                m = _KV.match(name)
                if name in anchors or (m and int(m.group(1)) >= maps.split):
                    kept[name] = t.detach().to("cpu", copy=True)
                yield name, t

        loaded = super().load_weights(tee(weights))
        self._ridgefill_activate(maps, fp, kept)
        return loaded

    def _ridgefill_activate(self, maps: MapSet, fp: dict, kept: dict[str, Tensor]) -> None:
        cfg = self._rf_cfg
        fp = fp | {"anchors": anchors(kept, maps.split, cfg.num_hidden_layers)}  # the tokenizer is hashed once
        _, warnings = compare(maps.manifest["model"], fp)
        for w in warnings:
            log.warning("RidgeFill: %s", w)
        missing = [
            i
            for i in range(maps.split, cfg.num_hidden_layers)
            if (f"model.layers.{i}.self_attn.k_proj.weight" not in kept)
        ]
        impl = type(self.model.layers[maps.split].self_attn.attn.impl).__name__
        if missing or impl not in ATTENTION_IMPLS:
            why = (
                f"no raw k/v weights for layers {missing}" if missing else f"attention backend {impl} is not supported"
            )
            log.warning("RidgeFill: %s; serving stock", why)
            return
        device = next(self.parameters()).device
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        kv = {}
        for name, t in kept.items():
            m = _KV.match(name)
            if m:
                shard = kv_shard(t, cfg.num_key_value_heads, head_dim)
                kv[(int(m.group(1)), m.group(2), m.group(3))] = shard.to(device, self._rf_dtype)
        sink, tail, share, mode = self._rf_options
        classifier = RowClassifier(sink, tail, share, maps.scores)
        self.ridgefill = state = ServeState(maps.to(device, self._rf_dtype), mode, classifier, kv)
        if self._rf_prefix_caching:  # filled blocks are salted and never reused by protected rows
            prefix_cache.activate(
                prefix_cache.policy_for(maps.manifest, sink, tail, share, mode, lambda: state.enabled)
            )
        log.info(
            "RidgeFill: active on %s (%s): maps %s, split %d, sink %d, tail %d, share %g, mode %s, prefix caching %s",
            cfg.architectures[0],
            getattr(cfg, "name_or_path", ""),
            maps.path,
            maps.split,
            classifier.sink,
            classifier.tail,
            classifier.share,
            mode,
            ("filled blocks kept apart" if classifier.share == 0 else "off for requests with bulk rows")
            if self._rf_prefix_caching
            else "off",
        )

    def forward(self, input_ids, positions, intermediate_tensors=None, inputs_embeds=None):
        st = self.ridgefill
        rows = st.rows if st is not None else None
        if rows is None or not st.enabled or not rows.any_bulk or input_ids is None:
            return super().forward(input_ids, positions, intermediate_tensors, inputs_embeds)
        return self._ridgefill_forward(input_ids, positions, st, rows)

    # --- the RidgeFill forward -----------------------------------------------------------
    def _ridgefill_forward(self, input_ids: Tensor, positions: Tensor, st: ServeState, rows: StepRows) -> Tensor:
        m, n = self.model, rows.num_tokens
        pos = positions[:n]
        h, res = m.embed_input_ids(input_ids[:n]), None
        for layer in m.layers[: st.split]:
            h, res = layer(pos, h, res)
        stream = h if res is None else h + res
        prot, bulk = rows.indices(stream.device)
        x, split_bulk = stream[prot], stream[bulk]
        x_bulk = split_bulk  # exact bulk stream, advanced only in plumb mode
        bulk_runs = bulk_rows(rows) if st.mode == "plumb" else None
        pos_b, pos_p = pos[bulk], pos[prot]  # gathered once a step, not per layer
        some = bool(rows.runs)  # a chunk may hold bulk rows only: it writes K/V and runs nothing else
        for idx in range(st.split, len(m.layers)):
            layer = m.layers[idx]
            bulk_in = x_bulk if st.mode == "plumb" else self._predict(st, idx, split_bulk)
            key, value = self._write_rows(st, layer, idx, bulk_in, pos_b)
            if some:  # (zero-row tensors trip some kernels' reshapes, so protected work is skipped outright)
                q, k_p, v_p = self._qkv(layer, x, pos_p)
                key, value = self._interleave(key, k_p, bulk, prot, n), self._interleave(value, v_p, bulk, prot, n)
            write_kv(layer.self_attn.attn, key, value)
            if bulk_runs is not None:
                qb, _, _ = self._qkv(layer, x_bulk, pos_b)
                x_bulk = self._finish(layer, x_bulk, attend(layer.self_attn.attn, qb, bulk_runs))
            if some:
                x = self._finish(layer, x, attend(layer.self_attn.attn, q, rows))
        out = torch.zeros(positions.shape[0], stream.shape[-1], dtype=stream.dtype, device=stream.device)
        if some:
            out[prot] = m.norm(x)
        return out

    @staticmethod
    def _interleave(rows_b: Tensor, rows_p: Tensor, bulk: Tensor, prot: Tensor, n: int) -> Tensor:
        """Bulk and protected K (or V) rows back into the step's token order."""
        out = rows_b.new_empty(n, rows_b.shape[-1])
        out[bulk], out[prot] = rows_b, rows_p
        return out

    @staticmethod
    def _predict(st: ServeState, idx: int, split_bulk: Tensor) -> Tensor:
        if idx == st.split or st.maps.kind == "identity":
            return split_bulk
        w, b = st.maps.layer(idx)
        return torch.addmm(b, split_bulk, w)

    def _write_rows(self, st: ServeState, layer, idx: int, hidden: Tensor, pos: Tensor) -> tuple[Tensor, Tensor]:
        """The cache writer for bulk rows: input norm -> k/v projections -> (k norm) -> RoPE."""
        normed = layer.input_layernorm(hidden)
        k = F.linear(normed, st.kv[(idx, "k", "weight")], st.kv.get((idx, "k", "bias")))
        v = F.linear(normed, st.kv[(idx, "v", "weight")], st.kv.get((idx, "v", "bias")))
        k = self._k_norm(layer.self_attn, k)
        k, _ = layer.self_attn.rotary_emb(pos, k.contiguous(), None)
        return k, v

    def _qkv(self, layer, x: Tensor, pos: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        attn = layer.self_attn
        qkv, _ = attn.qkv_proj(layer.input_layernorm(x))
        q, k, v = qkv.split([attn.q_size, attn.kv_size, attn.kv_size], dim=-1)
        q, k = self._q_norm(attn, q), self._k_norm(attn, k)
        q, k = attn.rotary_emb(pos, q.contiguous(), k.contiguous())
        return q, k, v

    @staticmethod
    def _finish(layer, x: Tensor, attn_out: Tensor) -> Tensor:
        o, _ = layer.self_attn.o_proj(attn_out)
        x = x + o
        return x + layer.mlp(layer.post_attention_layernorm(x))

    @staticmethod
    def _k_norm(attn, k: Tensor) -> Tensor:
        if not hasattr(attn, "k_norm"):
            return k
        return attn.k_norm(k.view(k.shape[0], k.shape[-1] // attn.head_dim, attn.head_dim)).view(k.shape)

    @staticmethod
    def _q_norm(attn, q: Tensor) -> Tensor:
        if not hasattr(attn, "q_norm"):
            return q
        return attn.q_norm(q.view(q.shape[0], q.shape[-1] // attn.head_dim, attn.head_dim)).view(q.shape)


class RidgeFillLlamaForCausalLM(RidgeFillMixin, LlamaForCausalLM):
    def __init__(self, *, vllm_config, prefix: str = "") -> None:
        super().__init__(vllm_config=vllm_config, prefix=prefix)
        self._ridgefill_setup(vllm_config)


class RidgeFillQwen2ForCausalLM(RidgeFillMixin, Qwen2ForCausalLM):
    def __init__(self, *, vllm_config, prefix: str = "") -> None:
        super().__init__(vllm_config=vllm_config, prefix=prefix)
        self._ridgefill_setup(vllm_config)


class RidgeFillQwen3ForCausalLM(RidgeFillMixin, Qwen3ForCausalLM):
    def __init__(self, *, vllm_config, prefix: str = "") -> None:
        super().__init__(vllm_config=vllm_config, prefix=prefix)
        self._ridgefill_setup(vllm_config)
