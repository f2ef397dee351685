"""Row classes for one vLLM step: which scheduled tokens are bulk and which are protected.

The model forward sees only token ids and positions, so the model runner is patched (once, in every
vLLM process) to hand the model each step's requests: their prompt lengths, prompt token ids and
where their tokens sit in the flattened batch. Classification is by absolute position, so it holds
for any chunk size, for several requests and for decodes in one batch (a decode row is never bulk).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch
from torch import Tensor

from ridgefill.rows import protected_mask


@dataclass
class StepRows:
    """One step's classification; `runs` are contiguous protected rows of one request."""

    num_tokens: int
    protected: Tensor  # [num_tokens] bool
    req_of_token: Tensor  # [num_tokens] long, request index within the step
    positions: Tensor  # [num_tokens] long, on the CPU
    runs: list[tuple[int, int, int]] = field(default_factory=list)  # (first token, end token, request index)
    cache: dict = field(default_factory=dict)  # per-step metadata shared by the late layers

    @property
    def any_bulk(self) -> bool:
        return bool((~self.protected).any())


class RowClassifier:
    """Keeps each request's prompt mask (computed once per request) and classifies steps."""

    def __init__(self, sink: int, tail: int, share: float, scores: Tensor | None) -> None:
        self.sink, self.tail, self.share, self.scores = sink, tail, share, scores
        self.masks: dict[str, Tensor] = {}

    def prompt_mask(self, req_id: str, prompt_ids: np.ndarray) -> Tensor:
        if req_id not in self.masks:
            ids = torch.from_numpy(np.asarray(prompt_ids, dtype=np.int64))
            self.masks[req_id] = protected_mask(ids, self.sink, self.tail, self.share, self.scores)
        return self.masks[req_id]

    def classify(
        self, req_ids: list[str], query_start_loc: np.ndarray, prompt_lens: np.ndarray, prompt_ids, positions: Tensor
    ) -> StepRows:
        """positions: [>= num_tokens] absolute positions of the flattened batch (padding is protected)."""
        num_tokens = int(query_start_loc[-1])
        pos = positions[:num_tokens].cpu().long()
        protected = torch.ones(positions.shape[0], dtype=torch.bool)
        req_of_token = torch.zeros(positions.shape[0], dtype=torch.long)
        for r, req_id in enumerate(req_ids):
            a, b = int(query_start_loc[r]), int(query_start_loc[r + 1])
            req_of_token[a:b] = r
            p, plen = pos[a:b], int(prompt_lens[r])
            in_prompt = p < plen
            if bool(in_prompt.any()):
                mask = self.prompt_mask(req_id, prompt_ids(r, plen))
                protected[a:b] = torch.where(in_prompt, mask[p.clamp_max(plen - 1)], True)
        for stale in set(self.masks) - set(req_ids):
            del self.masks[stale]
        runs = _runs(protected[:num_tokens], req_of_token, pos)
        return StepRows(num_tokens, protected, req_of_token, pos, runs)


def _runs(protected: Tensor, req_of_token: Tensor, positions: Tensor) -> list[tuple[int, int, int]]:
    """Maximal runs of protected tokens that are consecutive in the batch, in one request and in position."""
    idx = protected.nonzero().squeeze(-1).tolist()
    pos = positions.tolist()
    runs: list[tuple[int, int, int]] = []
    for t in idx:
        r = int(req_of_token[t])
        if runs and runs[-1][1] == t and runs[-1][2] == r and pos[t] == pos[t - 1] + 1:
            runs[-1] = (runs[-1][0], t + 1, r)
        else:
            runs.append((t, t + 1, r))
    return runs


_PATCHED = False


def patch_model_runner() -> None:
    """Wrap GPUModelRunner._model_forward (the CPU runner inherits it) to classify each step's rows."""
    global _PATCHED
    if _PATCHED:
        return
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    original = GPUModelRunner._model_forward

    def _model_forward(self, input_ids=None, positions=None, *args, **kwargs):
        model = self.get_model()
        state = getattr(model, "ridgefill", None)
        if state is None or not state.enabled or positions is None:
            return original(self, input_ids, positions, *args, **kwargs)
        batch = self.input_batch
        n = batch.num_reqs
        state.rows = state.classifier.classify(
            list(batch.req_ids[:n]),
            self.query_start_loc.np[: n + 1],
            batch.num_prompt_tokens[:n],
            lambda r, plen: batch.token_ids_cpu[r, :plen],
            positions,
        )
        try:
            return original(self, input_ids, positions, *args, **kwargs)
        finally:
            state.rows = None

    GPUModelRunner._model_forward = _model_forward
    _PATCHED = True


def bulk_rows(rows: StepRows) -> StepRows:
    """The bulk rows of a step as their own runs (plumb mode runs the whole layer for them too)."""
    bulk = ~rows.protected[: rows.num_tokens]
    return StepRows(
        rows.num_tokens, bulk, rows.req_of_token, rows.positions, _runs(bulk, rows.req_of_token, rows.positions)
    )
