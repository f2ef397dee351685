"""Plugin parts checked without an engine: the FlashAttention (CUDA) path run on the CPU, the engines the
plugin refuses, and the tensor-parallel split of checkpoint k/v weights.

CI has no GPU, so this drives vLLM's own `FlashAttentionImpl.forward` with RidgeFill's rebuilt metadata
and swaps only the CUDA kernel for a torch reference of its documented contract (paged K/V, varlen
queries, causal aligned to the end of each key range). The outputs must equal dense causal attention of
every protected row over its request's whole K/V, for a batch of a prefill chunk with cached context, a
fresh prompt and a decode.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch

pytest.importorskip("vllm")

from vllm.v1.attention.backends import flash_attn as fa  # noqa: E402

from ridgefill.rows import RowPolicy  # noqa: E402
from ridgefill.vllm_plugin.backend import attend_runs  # noqa: E402
from ridgefill.vllm_plugin.batch import RowClassifier  # noqa: E402
from ridgefill.vllm_plugin.config import serve_options  # noqa: E402

HEADS, KV_HEADS, HEAD, BLOCK = 4, 2, 16, 16


def reference_varlen(*, q, k, v, out, cu_seqlens_q, seqused_k, block_table, causal, softmax_scale, **kw):
    """flash_attn_varlen_func's contract for paged K/V; refuses options RidgeFill must not pass."""
    assert causal is True and kw["window_size"] == [-1, -1] and kw["scheduler_metadata"] is None
    assert kw["alibi_slopes"] is None and kw["dynamic_causal"] is None and kw["mask_mod"] is None
    assert kw["max_seqlen_q"] == int((cu_seqlens_q[1:] - cu_seqlens_q[:-1]).max())
    assert kw["max_seqlen_k"] == int(seqused_k.max())
    assert block_table.shape[0] == seqused_k.shape[0] == cu_seqlens_q.shape[0] - 1
    for i in range(seqused_k.shape[0]):
        a, b, n = int(cu_seqlens_q[i]), int(cu_seqlens_q[i + 1]), int(seqused_k[i])
        blocks = block_table[i, : math.ceil(n / BLOCK)]
        keys = k[blocks].reshape(-1, KV_HEADS, HEAD)[:n]
        values = v[blocks].reshape(-1, KV_HEADS, HEAD)[:n]
        out[a:b] = dense(q[a:b], keys, values, first_pos=n - (b - a), scale=softmax_scale)
    return out


def dense(q, keys, values, first_pos: int, scale: float):
    """Causal attention of queries at positions first_pos.. over keys at positions 0.. (GQA)."""
    rep = HEADS // KV_HEADS
    keys, values = keys.repeat_interleave(rep, 1), values.repeat_interleave(rep, 1)
    scores = torch.einsum("qhd,khd->hqk", q, keys) * scale
    qpos = torch.arange(q.shape[0])[:, None] + first_pos
    scores = scores.masked_fill(torch.arange(keys.shape[0])[None, :] > qpos, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), values)


def test_flash_attention_path_equals_dense_attention(monkeypatch):
    monkeypatch.setattr(fa, "get_flash_attn_version", lambda **_: 3, raising=False)
    monkeypatch.setattr(fa, "flash_attn_supports_quant_query_input", lambda: False, raising=False)
    monkeypatch.setattr(fa, "flash_attn_varlen_func", reference_varlen, raising=False)
    impl = fa.FlashAttentionImpl(HEADS, HEAD, HEAD**-0.5, KV_HEADS, None, None, "auto")
    one = torch.ones(1)
    layer = SimpleNamespace(num_heads=HEADS, num_kv_heads=KV_HEADS, head_size=HEAD, impl=impl)
    layer._q_scale = layer._k_scale = layer._v_scale = one

    # one step: request a's second chunk (positions 36..99 of a 100-token prompt), request b's whole
    # 40-token prompt, and request c decoding at position 57 (its prompt had 50 tokens)
    g = torch.Generator().manual_seed(0)
    reqs = {"a": (100, 36, 100), "b": (40, 0, 40), "c": (50, 57, 58)}  # prompt len, first pos, end pos
    prompts = {r: torch.randint(0, 1000, (plen,), generator=g).numpy() for r, (plen, _, _) in reqs.items()}
    classifier = RowClassifier(RowPolicy(4, 16, 0.25), torch.rand(1000, generator=g))
    qlens = [end - first for _, first, end in reqs.values()]
    qsl = np.concatenate([[0], np.cumsum(qlens)]).astype(np.int32)
    names = list(reqs)
    computed = np.array([first for _, first, _ in reqs.values()])
    plens = np.array([p for p, _, _ in reqs.values()])
    rows = classifier.classify(names, qsl, computed, plens, lambda r, n: prompts[names[r]][:n])
    assert rows.any_bulk and len(rows.runs) > 3  # sink, share and tail runs, and the decode

    # a paged cache holding every position of every request, in shuffled blocks
    lens = [end for _, _, end in reqs.values()]
    need = [math.ceil(n / BLOCK) for n in lens]
    perm = torch.randperm(sum(need) + 3, generator=g)
    block_table = torch.zeros(len(reqs), max(need), dtype=torch.int32)
    kv = {r: torch.randn(2, n, KV_HEADS, HEAD, generator=g) for r, n in zip(names, lens, strict=True)}
    kv_cache = torch.zeros(sum(need) + 3, KV_HEADS, BLOCK, 2 * HEAD)
    used = 0
    for i, r in enumerate(names):
        block_table[i, : need[i]] = perm[used : used + need[i]]
        used += need[i]
        for pos in range(lens[i]):
            blk, off = int(block_table[i, pos // BLOCK]), pos % BLOCK
            kv_cache[blk, :, off] = torch.cat([kv[r][0, pos], kv[r][1, pos]], -1)

    meta = fa.FlashAttentionMetadata(
        num_actual_tokens=int(qsl[-1]),
        max_query_len=max(qlens),
        query_start_loc=torch.from_numpy(qsl),
        max_seq_len=max(lens),
        seq_lens=torch.tensor(lens, dtype=torch.int32),
        block_table=block_table,
        slot_mapping=torch.zeros(int(qsl[-1]), dtype=torch.long),
        scheduler_metadata=torch.zeros(8, dtype=torch.int32),  # the whole batch's schedule: must be dropped
        max_num_splits=4,
    )
    prot = rows.protected[: rows.num_tokens].nonzero().squeeze(-1)
    query = torch.randn(prot.numel(), HEADS * HEAD, generator=g)
    got = attend_runs(meta, layer, kv_cache, query, rows).view(-1, HEADS, HEAD)

    for j, t in enumerate(prot.tolist()):
        r, pos = names[int(rows.req_of_token[t])], int(rows.positions[t])
        k, v = kv[r][0, : pos + 1], kv[r][1, : pos + 1]
        want = dense(query[j].view(1, HEADS, HEAD), k, v, first_pos=pos, scale=HEAD**-0.5)
        torch.testing.assert_close(got[j], want[0], rtol=1e-5, atol=1e-5)
    assert "meta" in rows.cache  # built once, shared by the step's late layers


def test_engines_it_cannot_serve_are_named():
    from ridgefill.vllm_plugin.model import unsupported

    def config(quantization=None, tp=1, pp=1, cache_dtype="auto", sliding=False, **engine):
        hf = SimpleNamespace(use_sliding_window=sliding, sliding_window=4096)
        return SimpleNamespace(
            model_config=SimpleNamespace(quantization=quantization, runner_type="generate", hf_config=hf),
            parallel_config=SimpleNamespace(tensor_parallel_size=tp, pipeline_parallel_size=pp),
            cache_config=SimpleNamespace(cache_dtype=cache_dtype),
            **engine,
        )

    assert unsupported(config()) is None
    assert unsupported(config(tp=2)) is None
    assert "awq" in unsupported(config(quantization="awq"))
    assert "pipeline" in unsupported(config(pp=2))
    assert "speculative" in unsupported(config(speculative_config=object()))
    assert "LoRA" in unsupported(config(lora_config=object()))
    assert "KV connectors" in unsupported(config(kv_transfer_config=object()))
    assert "fp8" in unsupported(config(cache_dtype="fp8"))
    assert "sliding-window" in unsupported(config(sliding=True))


def test_question_rows_options_are_validated():
    manifest = {"defaults": {"sink": 4, "tail": 256, "share": 0.15}, "split": 18}
    assert not serve_options(SimpleNamespace(), manifest)[0].by_question  # rarity, as before
    no_share = SimpleNamespace(ridgefill_select="question", ridgefill_share=0.0)
    assert not serve_options(no_share, manifest)[0].by_question  # nothing to choose
    cfg = SimpleNamespace(ridgefill_select="question", ridgefill_window="8")
    assert serve_options(cfg, manifest) == (RowPolicy(4, 256, 0.15, "question", 32, 8, 3, 0), "ridge")
    reach = {"defaults": manifest["defaults"] | {"reach": 12}, "split": 18}  # a map folder's default
    assert serve_options(SimpleNamespace(ridgefill_select="question"), reach)[0].reach == 12
    for bad, share, word in [
        ({"ridgefill_select": "random"}, 0.1, "select"),
        ({"ridgefill_select": "question"}, 1.0, "share"),
        ({"ridgefill_select": "question", "ridgefill_score_layers": 19}, 0.1, "score_layers"),
        ({"ridgefill_select": "question", "ridgefill_query": 0}, 0.1, "query"),
        ({"ridgefill_select": "question", "ridgefill_reach": -1}, 0.1, "reach"),
    ]:
        with pytest.raises(ValueError, match=word):
            serve_options(SimpleNamespace(**bad, ridgefill_share=share), manifest)


def test_serve_options_are_validated():
    manifest = {"defaults": {"sink": 4, "tail": 256, "share": 0.0}}
    assert serve_options(SimpleNamespace(), manifest) == (RowPolicy(4, 256, 0.0), "ridge")
    plumb = SimpleNamespace(ridgefill_tail="64", ridgefill_mode="plumb")
    assert serve_options(plumb, manifest) == (RowPolicy(4, 64, 0.0), "plumb")
    for bad, word in [
        ({"ridgefill_tail": 0}, "tail"),
        ({"ridgefill_share": 1.5}, "share"),
        ({"ridgefill_mode": "identity"}, "mode"),
        ({"ridgefill_sink": "many"}, "sink"),
    ]:
        with pytest.raises(ValueError, match=word):
            serve_options(SimpleNamespace(**bad), manifest)


@pytest.mark.parametrize(
    ("kv_heads", "tp", "heads_of_rank"),
    [
        (8, 1, [[*range(8)]]),
        (8, 2, [[0, 1, 2, 3], [4, 5, 6, 7]]),
        (2, 4, [[0], [0], [1], [1]]),
        (3, 3, [[0], [1], [2]]),
    ],
)
def test_kv_shard_follows_qkv_parallel_linear(monkeypatch, kv_heads, tp, heads_of_rank):
    """Rank r keeps the k/v heads vLLM's QKVParallelLinear gives it (replicated when heads < ranks)."""
    import vllm.distributed as dist

    from ridgefill.vllm_plugin.model import kv_shard

    head_dim = 4
    weight = torch.arange(kv_heads * head_dim)[:, None].expand(-1, 3)  # row i belongs to head i // head_dim
    monkeypatch.setattr(dist, "get_tensor_model_parallel_world_size", lambda: tp)
    for rank, heads in enumerate(heads_of_rank):
        monkeypatch.setattr(dist, "get_tensor_model_parallel_rank", lambda rank=rank: rank)
        got = kv_shard(weight, kv_heads, head_dim)
        assert sorted({int(i) // head_dim for i in got[:, 0]}) == heads
        assert got.shape == (len(heads) * head_dim, 3)
