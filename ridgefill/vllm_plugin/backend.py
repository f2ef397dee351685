"""The only attention-backend-specific code: write K/V for every row, attend for protected rows only.

Protected rows are grouped into runs of consecutive positions of one request; each run becomes a
pseudo-request whose queries are the run and whose keys are its request's blocks up to the run's last
position. The paged cache already holds every row's K/V (bulk rows' from the prediction), so causal
attention over it is exact for the run. Rows of earlier chunks that a question's last step runs again
are written at their own slots (`write_kv_at`), looked up in the step's block table.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import Tensor
from vllm.model_executor.layers.attention.attention import get_attention_context

from ridgefill.vllm_plugin.batch import StepRows
from ridgefill.vllm_plugin.device import to_device


def write_kv(attn, key: Tensor, value: Tensor) -> None:
    """Write K/V rows [num_tokens, kv_heads * head_dim] into the paged cache with the step's slot mapping."""
    _, layer, kv_cache, slots = get_attention_context(attn.layer_name)
    n = key.shape[0]
    layer.impl.do_kv_cache_update(
        layer, key.view(n, -1, layer.head_size), value.view(n, -1, layer.head_size), kv_cache, slots[:n]
    )


def write_kv_at(attn, key: Tensor, value: Tensor, req: Tensor, positions: Tensor, cache: dict) -> None:
    """Write K/V rows [e, kv_heads * head_dim] of rows outside the step (request index [e], position [e], on
    the host) at their paged-cache slots; the slots are found once a step (`cache`) in the block table of
    the step's metadata. Both layouts served ([blocks, kv_heads, block_size, 2 * head_dim] on the CPU and
    in FlashAttention) have the block size at dim 2."""
    meta, layer, kv_cache, slot_mapping = get_attention_context(attn.layer_name)
    slots = cache.get("slots")
    if slots is None:
        size, table = kv_cache.shape[2], meta.block_table
        req, positions = to_device(req, table.device), to_device(positions, table.device)
        slots = table[req, positions // size].to(slot_mapping.dtype) * size + positions % size
        cache["slots"] = slots
    e = key.shape[0]
    layer.impl.do_kv_cache_update(
        layer, key.view(e, -1, layer.head_size), value.view(e, -1, layer.head_size), kv_cache, slots
    )


def attend(attn, query: Tensor, rows: StepRows) -> Tensor:
    """Attention output [p, heads * head_dim] for the protected rows' queries [p, heads * head_dim]."""
    meta, layer, kv_cache, _ = get_attention_context(attn.layer_name)
    return attend_runs(meta, layer, kv_cache, query, rows)


def attend_runs(meta, layer, kv_cache: Tensor, query: Tensor, rows: StepRows) -> Tensor:
    """`attend` on explicit step metadata: one pseudo-request per run of `rows` (the metadata is built once a step)."""
    sub = rows.cache.get("meta")
    if sub is None:
        sub = rows.cache["meta"] = _subset_metadata(meta, layer, rows, query.dtype)
    p = query.shape[0]
    out = torch.empty(p, layer.num_heads, layer.head_size, dtype=query.dtype, device=query.device)
    q = query.view(p, -1, layer.head_size)
    layer.impl.forward(layer, q, q[:, : layer.num_kv_heads], q[:, : layer.num_kv_heads], kv_cache, sub, output=out)
    return out.view(p, -1)


def _run_tensors(meta, rows: StepRows) -> dict:
    runs = torch.tensor(rows.runs, dtype=torch.long)  # [R, 3]: first token, end token, request index
    qlens = (runs[:, 1] - runs[:, 0]).to(torch.int32)
    starts = torch.zeros(len(qlens) + 1, dtype=torch.int32)
    starts[1:] = qlens.cumsum(0)
    seq_lens = (rows.positions[runs[:, 1] - 1] + 1).to(torch.int32)  # a run sees its request up to its last row
    return {
        "num_actual_tokens": int(starts[-1]),
        "max_query_len": int(qlens.max()),
        "query_start_loc": to_device(starts, meta.query_start_loc.device),
        "max_seq_len": int(seq_lens.max()),
        "seq_lens": to_device(seq_lens, meta.seq_lens.device),
        "block_table": meta.block_table.index_select(0, to_device(runs[:, 2], meta.block_table.device)),
    }


def _subset_metadata(meta, layer, rows: StepRows, dtype: torch.dtype):
    fields = _run_tensors(meta, rows)
    name = type(meta).__name__
    if name == "CPUAttentionMetadata":
        from vllm import _custom_ops as ops
        from vllm import envs

        fields["scheduler_metadata"] = ops.cpu_attn_get_scheduler_metadata(
            num_reqs=len(rows.runs),
            num_heads=layer.num_heads,
            num_kv_heads=layer.num_kv_heads,
            head_dim=layer.head_size,
            seq_lens=fields["seq_lens"],
            dtype=dtype,
            query_start_loc=fields["query_start_loc"],
            causal=True,
            sliding_window_size=-1,
            isa=layer.isa,
            enable_kv_split=envs.VLLM_CPU_ATTN_SPLIT_KV,
            kv_cache_dtype=layer.impl.kv_cache_dtype,
        )
        return dataclasses.replace(meta, causal=True, dynamic_causal=None, **fields)
    if name == "FlashAttentionMetadata":  # CUDA; CI runs vLLM's FlashAttentionImpl with a torch kernel
        # no AOT schedule (it describes the whole batch) and no split-KV hint; FA schedules the runs itself
        return dataclasses.replace(meta, causal=True, scheduler_metadata=None, max_num_splits=0, **fields)
    raise NotImplementedError(
        f"RidgeFill has no subset attention for {name}; serve with the CPU or FlashAttention backend"
    )
