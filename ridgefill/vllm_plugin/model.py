"""vLLM model classes that serve a RidgeFill map folder (Llama, Qwen2, Qwen3).

Early layers run stock on every row. When a step holds bulk rows, each late layer writes bulk K/V
from the predicted input through the layer's own norm, k/v projections (read raw from the checkpoint:
vLLM repacks the fused CPU weights), k-norm and RoPE, and runs the whole layer on protected rows only,
with attention over all K/V in the paged cache. Steps without bulk rows (decodes, exact tails) run
the stock forward, unless they hold rows of a question prompt (select "question"): those always run
here, to keep what the prompt's last chunk needs or to choose its share (`question.QuestionSelector`).
"""

from __future__ import annotations

import atexit
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor
from vllm.logger import init_logger
from vllm.model_executor.models.llama import LlamaForCausalLM
from vllm.model_executor.models.qwen2 import Qwen2ForCausalLM
from vllm.model_executor.models.qwen3 import Qwen3ForCausalLM

from ridgefill.fingerprint import anchor_names, anchors, compare, fingerprint_from
from ridgefill.maps import MapError, MapSet, load_maps
from ridgefill.rows import RowPolicy, question_attention
from ridgefill.vllm_plugin.backend import attend, write_kv, write_kv_at
from ridgefill.vllm_plugin.batch import RowClassifier, StepRows, bulk_rows
from ridgefill.vllm_plugin.config import maps_path, serve_options, unsupported
from ridgefill.vllm_plugin.patches import PATCHES, log_every
from ridgefill.vllm_plugin.question import Choice, EarlierRows, QuestionSelector, ScoredStep

log = init_logger("vllm.ridgefill")
_KV = re.compile(r"model\.layers\.(\d+)\.self_attn\.([kv])_proj\.(weight|bias)$")


@dataclass
class Counters:
    """What one engine's RidgeFill forward really did: the proof that it is active."""

    bulk_steps: int = 0  # steps that filled bulk rows
    bulk_rows: int = 0  # bulk rows filled (their late-layer K/V written from the prediction)
    protected_rows: int = 0  # protected rows run through the late layers in those steps
    mixed_steps: int = 0  # of those steps, the ones that also held a decoding request
    question_one_step: int = 0  # prompts whose share the question chose, scheduled whole in one step
    question_chunked: int = 0  # prompts whose share the question chose over several steps (chunked prefill)
    question_exact: int = 0  # question prompts run exact (first scheduled past their start, or capped: batch.py)
    question_late_rows: int = 0  # rows of earlier chunks the question chose, run through the late layers later
    kept_prompts: int = 0  # a gauge, not a count: question prompts whose material (`question.Kept`) is held now
    question_capped: int = 0  # chunked question prompts run exact: RIDGEFILL_MAX_KEPT prompts were keeping material

    def as_dict(self) -> dict[str, int]:
        names = ("bulk_steps", "bulk_rows", "protected_rows", "mixed_steps")
        names += ("question_one_step", "question_chunked", "question_exact", "question_late_rows", "kept_prompts")
        names += ("question_capped",)
        return {n: getattr(self, n) for n in names}

    def line(self) -> str:
        return (
            f"RidgeFill counters: {self.bulk_steps} steps with bulk rows, {self.bulk_rows} bulk rows filled, "
            f"{self.protected_rows} protected rows run, {self.kept_prompts} prompts with kept material"
        )


@dataclass
class ServeState:
    """What a RidgeFill model serves: verified maps, the row policy, and raw k/v weights of late layers."""

    maps: MapSet
    mode: str
    classifier: RowClassifier
    kv: dict[tuple[int, str, str], Tensor]
    rows: StepRows | None = None
    enabled: bool = True  # off: serve stock (paired TTFT on one engine); flip only while no request is in flight
    counters: Counters = field(default_factory=Counters)
    refused: str | None = None  # set once the runner hook found it cannot classify: stock for good
    warned_inert: bool = False

    @property
    def split(self) -> int:
        return self.maps.split

    @property
    def question(self) -> QuestionSelector | None:
        """The question selector when the share is picked by the question's attention (select "question")."""
        return self.classifier.selector if self.classifier.question else None

    def release(self, req_id: str) -> None:
        """The runner let a request go (finished or aborted): free what the classifier keeps for it now."""
        self.classifier.release(req_id)
        self._gauge_kept()

    def _gauge_kept(self) -> None:
        """Update the kept-material gauge; with RIDGEFILL_LOG_EVERY=1 log each change, so that a server log's
        last counter line holds the gauge as the server ends (worker processes may die before `atexit`)."""
        kept, was = len(self.classifier.selector.kept), self.counters.kept_prompts
        self.counters.kept_prompts = kept
        if kept != was and log_every() == 1:
            log.info("%s", self.counters.line())

    def refuse(self, why: str) -> None:
        self.refused, self.enabled = why, False

    def record(self, rows: StepRows) -> None:
        """Count a step the RidgeFill forward ran with bulk rows; log the counters every RIDGEFILL_LOG_EVERY
        such steps. (A question prompt's step may hold none: a last chunk of tail rows.)"""
        c = self.counters
        bulk = int((~rows.protected).sum())
        if bulk == 0:
            return
        c.bulk_steps += 1
        c.bulk_rows += bulk
        c.protected_rows += rows.num_tokens - bulk
        c.mixed_steps += int(rows.decodes > 0)
        if c.bulk_steps % log_every() == 0:
            log.info("%s", c.line())

    def count(self, choice: Choice) -> None:
        """Count the prompts whose share the question chose in a step, and the earlier rows it ran again."""
        c = self.counters
        for q in choice.prompts:
            if q.start == 0:
                c.question_one_step += 1
            else:
                c.question_chunked += 1
        c.question_late_rows += choice.late_rows

    def after_step(self) -> None:
        """Warn once if a long prompt ran with zero bulk rows."""
        self.counters.question_exact = self.classifier.selector.exact_prompts
        self.counters.question_capped = self.classifier.selector.capped_prompts
        self._gauge_kept()
        why = self.classifier.inert
        if why and not self.warned_inert:
            self.warned_inert = True
            log.warning("RidgeFill is inert: %s", why)


def _log_at_exit(state: ServeState) -> None:
    log.info("%s (at exit)", state.counters.line())


ATTENTION_IMPLS = ("CPUAttentionBackendImpl", "FlashAttentionImpl")  # backend.py builds their metadata


def kv_shard(t: Tensor, num_kv_heads: int, head_dim: int) -> Tensor:
    """This tensor-parallel rank's rows of a checkpoint k/v weight or bias (QKVParallelLinear's split)."""
    from vllm.distributed import get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size

    tp = get_tensor_model_parallel_world_size()
    if tp == 1:
        return t
    per, replicas = max(1, num_kv_heads // tp), max(1, tp // num_kv_heads)
    start = (get_tensor_model_parallel_rank() // replicas) * per * head_dim
    return t.narrow(0, start, per * head_dim)


@dataclass(frozen=True)
class Pending:
    """What `_ridgefill_setup` accepted, waiting for the weights: the raw k/v weights and the anchors stream by
    in `load_weights`, and only then can `_ridgefill_activate` serve the maps."""

    maps: MapSet  # verified, on the CPU
    fingerprint: dict  # the model's, without the weight anchors
    policy: RowPolicy
    mode: str
    hf_config: Any
    dtype: torch.dtype
    prefix_caching: bool


class RidgeFillMixin:
    """Adds map loading, checkpoint k/v capture and the RidgeFill forward to a vLLM causal LM."""

    def _ridgefill_setup(self, vllm_config) -> None:
        self.ridgefill: ServeState | None = None
        self._rf_pending: Pending | None = _pending(vllm_config)

    def load_weights(self, weights: Iterable[tuple[str, Tensor]]) -> set[str]:
        pending = self._rf_pending
        if pending is None:
            return super().load_weights(weights)
        anchors = set(anchor_names(pending.maps.split, pending.hf_config.num_hidden_layers))
        kept: dict[str, Tensor] = {}

        def tee(items):
            for name, t in items:
                m = _KV.match(name)
                if name in anchors or (m and int(m.group(1)) >= pending.maps.split):
                    kept[name] = t.detach().to("cpu", copy=True)
                yield name, t

        loaded = super().load_weights(tee(weights))
        self._ridgefill_activate(pending, kept)
        return loaded

    def _ridgefill_activate(self, pending: Pending, kept: dict[str, Tensor]) -> None:
        """Serve the maps once the weights are in: warn on anchors that differ, refuse a missing k/v weight or
        an attention backend `backend.py` cannot write."""
        maps, cfg = pending.maps, pending.hf_config
        fp = pending.fingerprint | {"anchors": anchors(kept, maps.split, cfg.num_hidden_layers)}
        for w in compare(maps.manifest["model"], fp)[1]:  # the tokenizer is hashed once, in `_pending`
            log.warning("RidgeFill: %s", w)
        why = self._cannot_serve(pending, kept)
        if why:
            log.warning("RidgeFill: %s; serving stock", why)
            return
        device = next(self.parameters()).device
        kv = _late_kv(pending, kept, device)
        classifier = RowClassifier(pending.policy, maps.scores)
        self.ridgefill = state = ServeState(maps.to(device, pending.dtype), pending.mode, classifier, kv)
        atexit.register(_log_at_exit, state)
        _log_active(pending)

    def _cannot_serve(self, pending: Pending, kept: dict[str, Tensor]) -> str | None:
        """Why the loaded model cannot serve its maps (a late layer's raw k weight missing, or the attention
        backend), or None."""
        split, layers = pending.maps.split, pending.hf_config.num_hidden_layers
        missing = [i for i in range(split, layers) if f"model.layers.{i}.self_attn.k_proj.weight" not in kept]
        if missing:
            return f"no raw k/v weights for layers {missing}"
        impl = type(self.model.layers[split].self_attn.attn.impl).__name__
        return None if impl in ATTENTION_IMPLS else f"attention backend {impl} is not supported"

    def forward(self, input_ids, positions, intermediate_tensors=None, inputs_embeds=None):
        st = self.ridgefill
        rows = st.rows if st is not None else None
        if rows is None or not st.enabled or not (rows.any_bulk or rows.questions) or input_ids is None:
            return super().forward(input_ids, positions, intermediate_tensors, inputs_embeds)
        return self._ridgefill_forward(input_ids, positions, st, rows)

    # --- the RidgeFill forward -----------------------------------------------------------
    def _ridgefill_forward(self, input_ids: Tensor, positions: Tensor, st: ServeState, rows: StepRows) -> Tensor:
        n, selector = rows.num_tokens, st.question if rows.questions else None
        pos = positions[:n]
        scored = range(st.split - selector.policy.score_layers, st.split) if selector else range(0)
        stream, inputs = self._early_layers(input_ids[:n], pos, st.split, scored)
        early = None
        if inputs:  # question prompts: keep their material, or choose their share
            layers = ScoredLayers([self.model.layers[idx] for idx in scored])
            choice = selector.select(ScoredStep(rows, inputs, stream, pos, layers))
            st.count(choice)
            rows, early = choice.rows, choice.earlier
        st.record(rows)
        out = torch.zeros(positions.shape[0], stream.shape[-1], dtype=stream.dtype, device=stream.device)
        prot, x = self._late_layers(st, rows, stream, pos, early)
        if prot.shape[0]:
            out[prot] = self.model.norm(x)
        return out

    def _early_layers(self, input_ids: Tensor, pos: Tensor, split: int, scored: range) -> tuple[Tensor, list[Tensor]]:
        """Layers 0..split-1 on every token: the split stream h_S, and the input stream of each `scored` layer
        (what the question's attention is read from)."""
        h, res = self.model.embed_input_ids(input_ids), None
        inputs = []
        for idx, layer in enumerate(self.model.layers[:split]):
            if idx in scored:
                inputs.append(h.clone() if res is None else h + res)
            h, res = layer(pos, h, res)
        return (h if res is None else h + res), inputs

    def _late_layers(
        self, st: ServeState, rows: StepRows, stream: Tensor, pos: Tensor, early: EarlierRows | None
    ) -> tuple[Tensor, Tensor]:
        """Layers S.. : bulk rows write K/V from their predicted input, protected rows (after the chosen rows of
        earlier chunks, run from their kept h_S) run whole. Returns the protected token indices and their
        final stream."""
        m, n = self.model, rows.num_tokens
        prot, bulk = rows.indices(stream.device)
        x, pos_p, att = stream[prot], pos[prot], rows  # att: the rows attended for, in the order of x
        if early is not None:  # chosen rows of earlier chunks run first, from their kept h_S
            x, pos_p, att = torch.cat([early.x, x]), torch.cat([early.pos, pos_p]), early.rows
        e = x.shape[0] - prot.shape[0]
        split_bulk = stream[bulk]
        x_bulk = split_bulk  # exact bulk stream, advanced only in plumb mode
        has_bulk, some = rows.any_bulk, bool(att.runs)  # (zero-row tensors trip some kernels: skip, not run)
        bulk_runs = bulk_rows(rows) if st.mode == "plumb" and has_bulk else None
        pos_b = pos[bulk]  # gathered once a step, not per layer
        for idx in range(st.split, len(m.layers)):
            layer = m.layers[idx]
            attn = layer.self_attn.attn
            if has_bulk:
                bulk_in = x_bulk if st.mode == "plumb" else self._predict(st, idx, split_bulk)
                key, value = self._write_rows(st, layer, idx, bulk_in, pos_b)
            if some:
                q, k_p, v_p = _qkv(layer, x, pos_p)
                if e:  # their exact K/V overwrite the filled ones before any row of this layer attends
                    write_kv_at(attn, k_p[:e], v_p[:e], early.req, early.host_pos, att.cache)
                k_p, v_p = k_p[e:], v_p[e:]
                if has_bulk:
                    key, value = self._interleave(key, k_p, bulk, prot, n), self._interleave(value, v_p, bulk, prot, n)
                else:
                    key, value = k_p, v_p
            write_kv(attn, key, value)
            if bulk_runs is not None:
                qb, _, _ = _qkv(layer, x_bulk, pos_b)
                x_bulk = self._finish(layer, x_bulk, attend(attn, qb, bulk_runs))
            if some:
                x = self._finish(layer, x, attend(attn, q, att))
        return prot, x[e:]

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
        k = _k_norm(layer.self_attn, k)
        k, _ = layer.self_attn.rotary_emb(pos, k.contiguous(), None)
        return k, v

    @staticmethod
    def _finish(layer, x: Tensor, attn_out: Tensor) -> Tensor:
        o, _ = layer.self_attn.o_proj(attn_out)
        x = x + o
        return x + layer.mlp(layer.post_attention_layernorm(x))


def _qkv(layer, x: Tensor, pos: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """A vLLM layer's roped queries, keys and its values of input rows x at positions pos."""
    attn = layer.self_attn
    qkv, _ = attn.qkv_proj(layer.input_layernorm(x))
    q, k, v = qkv.split([attn.q_size, attn.kv_size, attn.kv_size], dim=-1)
    q, k = _q_norm(attn, q), _k_norm(attn, k)
    q, k = attn.rotary_emb(pos, q.contiguous(), k.contiguous())
    return q, k, v


def _k_norm(attn, k: Tensor) -> Tensor:
    if not hasattr(attn, "k_norm"):
        return k
    return attn.k_norm(k.view(k.shape[0], k.shape[-1] // attn.head_dim, attn.head_dim)).view(k.shape)


def _q_norm(attn, q: Tensor) -> Tensor:
    if not hasattr(attn, "q_norm"):
        return q
    return attn.q_norm(q.view(q.shape[0], q.shape[-1] // attn.head_dim, attn.head_dim)).view(q.shape)


@dataclass(frozen=True)
class ScoredLayers:
    """The exact layers below the split that the question's attention is read in (`question.Scorer`)."""

    layers: list  # vLLM decoder layers, in order

    def keys_queries(self, layer: int, x: Tensor, pos: Tensor) -> tuple[Tensor, Tensor]:
        q, k, _ = _qkv(self.layers[layer], x, pos)
        return k, q

    def attention(self, keys: list[Tensor], queries: list[Tensor]) -> Tensor:
        """Per layer q x n scores of this rank's heads (`rows.question_attention`), summed, then over ranks."""
        total = None
        for layer, k, q in zip(self.layers, keys, queries, strict=True):
            attn = layer.self_attn
            hd, n, nq = attn.head_dim, k.shape[0], q.shape[0]
            a = question_attention(q.view(nq, -1, hd).transpose(0, 1), k.view(n, -1, hd).transpose(0, 1), attn.scaling)
            total = a if total is None else total + a
        return _all_heads(total)


def _all_heads(attention: Tensor) -> Tensor:
    """Sum a per-rank score over tensor-parallel ranks (each rank holds some heads), so all ranks agree."""
    from vllm.distributed import get_tensor_model_parallel_world_size, tensor_model_parallel_all_reduce

    return attention if get_tensor_model_parallel_world_size() == 1 else tensor_model_parallel_all_reduce(attention)


def _pending(vllm_config) -> Pending | None:
    """The map folder this engine is asked to serve, checked against the model's config and tokenizer (weights
    follow in `load_weights`); None, with a warning saying why, when it serves stock."""
    mc = vllm_config.model_config
    cfg = mc.hf_config
    path = maps_path(cfg)
    if not path:
        log.warning("RidgeFill: no map folder given (hf_overrides ridgefill_maps or RIDGEFILL_MAPS); serving stock")
        return None
    why = PATCHES.why_not() or unsupported(vllm_config)
    if why:
        log.warning("RidgeFill: %s; serving stock", why)
        return None
    try:
        from transformers import AutoTokenizer

        maps = load_maps(path, device="cpu")
        tok = AutoTokenizer.from_pretrained(mc.tokenizer, trust_remote_code=mc.trust_remote_code)
        fp = fingerprint_from(cfg, tok, {}, maps.split)  # anchors follow once the weights stream by
        errors, _ = compare(maps.manifest["model"], fp)
        if errors:
            raise MapError("maps do not match this model: " + "; ".join(errors))
        policy, mode = serve_options(cfg, maps.manifest)
    except (MapError, OSError, ValueError) as e:
        log.warning("RidgeFill: refusing map folder %s: %s; serving stock", path, e)
        return None
    caching = bool(vllm_config.cache_config.enable_prefix_caching)
    return Pending(maps, fp, policy, mode, cfg, mc.dtype, caching)


def _late_kv(pending: Pending, kept: dict[str, Tensor], device: torch.device) -> dict[tuple[int, str, str], Tensor]:
    """The raw k/v weights and biases of the late layers, this rank's shard, on the model's device and dtype
    ((layer, "k" | "v", "weight" | "bias") -> tensor)."""
    cfg = pending.hf_config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    kv = {}
    for name, t in kept.items():
        m = _KV.match(name)
        if m:
            shard = kv_shard(t, cfg.num_key_value_heads, head_dim)
            kv[(int(m.group(1)), m.group(2), m.group(3))] = shard.to(device, pending.dtype)
    return kv


def _log_active(pending: Pending) -> None:
    """The one line that says RidgeFill serves this engine, and how."""
    cfg, maps, policy = pending.hf_config, pending.maps, pending.policy
    selector = "rarity"
    if policy.by_question:
        selector = (
            f"question: query {policy.query}, window {policy.window}, "
            f"score_layers {policy.score_layers}, reach {policy.reach}"
        )
    caching = "off"
    if pending.prefix_caching:
        caching = "filled blocks kept apart" if policy.share == 0 else "off for requests with bulk rows"
    log.info(
        "RidgeFill: active on %s (%s): maps %s, split %d, sink %d, tail %d, share %g (%s), mode %s, prefix caching %s",
        cfg.architectures[0],
        getattr(cfg, "name_or_path", ""),
        maps.path,
        maps.split,
        policy.sink,
        policy.tail,
        policy.share,
        selector,
        pending.mode,
        caching,
    )


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
