"""The question selector on vLLM (select "question"), as one object that owns a question prompt's state.

A prompt's share is known only once its question (its last rows) has run layers 0..S-1. A prompt scheduled
whole is chosen in its one step. A prompt chunked over several steps is filled in its earlier chunks (every
row past the sink bulk) while the selector keeps what its last chunk needs (`Kept`); the last chunk chooses
the share over the whole prompt, and the chosen rows of earlier chunks run the late layers again, exactly,
from their kept split stream (`EarlierRows`).

`QuestionSelector` is asked twice a step: by the classifier on the host (`admit`: which of a prompt's rows
the step protects before the choice; `forget` / `release`: what goes when a prompt leaves), and by the
forward once layers 0..S-1 have run (`select`: `observe` each prompt's rows, `choose` the share of those
whose last step it is). The model's own layers score (`Scorer`, model.py).
"""

from __future__ import annotations

from collections.abc import Container
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import numpy as np
import torch
from torch import Tensor

from ridgefill import settings
from ridgefill.rows import RowPolicy, question_mask
from ridgefill.vllm_plugin.device import to_device

if TYPE_CHECKING:
    from ridgefill.vllm_plugin.batch import Question, StepRows

Key = tuple[str, int]  # (request id, prompt length): a prompt may grow
CHOSEN_RECORD = 256  # prompts whose chosen rows are remembered (for the tests and the curious)


@dataclass
class Kept:
    """What the earlier chunks of a chunked question prompt leave for its last chunk, on the model's device.

    `split`: the split stream h_S of every row so far, from which a row the question chooses later runs its
    late layers exactly. `keys` / `queries`: per scored layer, the roped keys of those rows and the roped
    queries of the question rows among them. Keys rather than layer inputs: the scoring needs nothing else
    of an earlier row, they are no wider than the input (kv heads x head dim), and they are the very values
    the unchunked path computes, so nothing is run twice; the paged cache holds them too, but in a
    backend's layout. Freed when the prompt's last chunk has run or the request leaves the batch.
    """

    next: int = 0  # the position the next chunk starts at
    split: list[Tensor] = field(default_factory=list)  # [rows, d] per chunk
    keys: list[list[Tensor]] = field(default_factory=list)  # [layer][chunk] -> [rows, kv heads * head dim]
    queries: list[list[Tensor]] = field(default_factory=list)  # [layer][chunk] -> [question rows, heads * hd]


class Scorer(Protocol):
    """The served model's scored layers (the `score_layers` exact layers below the split), as the selector
    reads the question's attention in them."""

    def keys_queries(self, layer: int, x: Tensor, pos: Tensor) -> tuple[Tensor, Tensor]:
        """Roped keys and queries of input rows x at positions pos in the scored layer `layer` (0-based)."""
        ...

    def attention(self, keys: list[Tensor], queries: list[Tensor]) -> Tensor:
        """Attention [n] the question rows pay every row, summed over heads and the scored layers."""
        ...


@dataclass
class ScoredStep:
    """One step's forward as the selector sees it, once layers 0..S-1 have run on every token."""

    rows: StepRows  # as classified on the host
    inputs: list[Tensor]  # per scored layer, its input stream for every token of the step
    stream: Tensor  # the split stream h_S, every token
    pos: Tensor  # positions, on the model's device
    scorer: Scorer


@dataclass
class EarlierRows:
    """Rows of earlier chunks that a question's last step runs through the late layers, ahead of its own."""

    x: Tensor  # [e, d] their split streams h_S, on the model's device
    pos: Tensor  # [e] their positions, on the model's device
    req: Tensor  # [e] their request index within the step (host)
    host_pos: Tensor  # [e] their positions (host)
    rows: StepRows  # the step's rows with these before them: the rows the late layers attend for


@dataclass
class Choice:
    """What the selector decided in one step's forward."""

    rows: StepRows  # the step's rows with the chosen share protected (a new object; the classified one is kept)
    earlier: EarlierRows | None  # chosen rows of earlier chunks, run first; None when there are none
    prompts: list[Question]  # the prompts whose share was chosen in this step

    @property
    def late_rows(self) -> int:
        return 0 if self.earlier is None else self.earlier.req.shape[0]


class QuestionSelector:
    """The question selector's state across steps: what chunked prompts keep, which prompts run exact (and why),
    the rows chosen, and the counts the engine's counters report."""

    def __init__(self, policy: RowPolicy, max_kept: int | None = None) -> None:
        self.policy = policy
        self.max_kept = settings.max_kept() if max_kept is None else max_kept  # chunked prompts keeping material
        self.kept: dict[Key, Kept] = {}  # question prompts under way over several steps
        self.exact: set[Key] = set()  # question prompts that run exact (see `admit`)
        self.capped: set[Key] = set()  # of those, the ones run exact because max_kept were under way
        self.exact_prompts = 0  # question prompts run exact, counted as their prompt ends
        self.capped_prompts = 0  # capped prompts, counted once each as their first chunk is classified
        self.chosen: dict[str, list[int]] = {}  # request -> its question-protected positions (the latest few)

    # --- on the host, as a step is classified -------------------------------------------------------------
    def admit(self, q: Question, pos: np.ndarray, mask: np.ndarray) -> np.ndarray:
        """The protected rows of a question prompt's tokens in this step, before the forward's choice: all for
        a prompt that runs exact; its edge rows (`mask`) in its last step; only the sink in earlier chunks (a
        tail row run there would attend filled K/V of rows the question may choose later)."""
        if q.start == 0:  # a new prompt, or one recomputed from its start (preemption): start afresh
            self._start(q)
        elif q.key not in self.kept and q.key not in self.exact:
            self.exact.add(q.key)  # first seen past its start without kept material: its earlier chunks ran stock
        if q.key in self.exact:
            self.exact_prompts += int(q.last)
            return np.ones_like(mask)
        return mask if q.last else pos < self.policy.sink

    def _start(self, q: Question) -> None:
        """A prompt scheduled from its start: room kept for it unless it is scheduled whole, or exact when
        `max_kept` prompts keep material already."""
        self.exact.discard(q.key)
        self.capped.discard(q.key)
        self.kept.pop(q.key, None)
        if q.last:
            return
        if len(self.kept) >= self.max_kept:
            self.exact.add(q.key)
            self.capped.add(q.key)
            self.capped_prompts += 1
        else:
            self.kept[q.key] = Kept()

    def listed(self, q: Question) -> bool:
        """Whether the forward sees this prompt's step (a prompt that runs exact needs nothing of it)."""
        return q.key not in self.exact

    def why_exact(self, key: Key) -> str | None:
        """Why a prompt ran exact, for the inert warning; None when it did not."""
        if key in self.capped:
            return f"exactly: a chunked question prompt past the kept-material cap ({self.max_kept} under way)"
        if key in self.exact:
            return "exactly: a question prompt first scheduled past its start, without its earlier chunks' rows"
        return None

    def forget(self, live: set[Key], held: Container[str] | None) -> None:
        """Drop what is kept for prompts no longer under way (`live`: this step's batch). Kept material lives
        while its request is `held` (the runner's requests: V1 drops a running request from its batch for a
        step it does not schedule, and a prompt must survive that); without `held`, while it is in the batch."""
        ids = {req_id for req_id, _ in live}
        held = ids if held is None else held
        for stale in [k for k in self.kept if k not in live and (k[0] in ids or k[0] not in held)]:
            del self.kept[stale]  # a request that ended (or was aborted) mid-prompt, or a prompt that grew
        self.exact &= live
        self.capped &= live

    def release(self, req_id: str) -> None:
        """Drop all that is kept for a request the runner let go (finished or aborted), at once."""
        for key in [k for k in self.kept if k[0] == req_id]:
            del self.kept[key]
        self.exact = {k for k in self.exact if k[0] != req_id}

    # --- in the forward, once layers 0..S-1 have run -----------------------------------------------------
    def select(self, step: ScoredStep) -> Choice:
        """Each listed prompt's part of the step: exact if its earlier chunks ran stock, its material kept,
        and in its last step the share chosen, with the chosen rows of earlier chunks (past the sink, which ran
        exact in its own step) to run the late layers again before this step's rows."""
        protected, chosen, earlier = step.rows.protected.clone(), [], []
        for q in step.rows.questions:
            kept = self.observe(q, step)
            if kept is None:
                protected[q.first : q.end] = True
            elif q.last:
                mask = self.choose(q, kept, step.scorer)
                protected[q.first : q.first + q.plen - 1 - q.start] = mask[q.start :]
                chosen.append(q)
                earlier.append(self._earlier(q, kept, mask))
        rows = step.rows.with_protected(protected)
        return Choice(rows, _earlier_rows(rows, [e for e in earlier if e is not None], step.stream.device), chosen)

    def observe(self, q: Question, step: ScoredStep) -> Kept | None:
        """Add this step's rows of a question prompt to what it keeps: per scored layer the keys of its rows
        in the head (the prompt without its last row, as the transformers runtime scores it) and the queries
        of its question rows (the head's last `query`); h_S of its rows unless this step ends the prompt.
        None when the prompt runs exact from here on (nothing kept for it past its start)."""
        kept = self.kept.get(q.key) if q.start > 0 or not q.last else Kept()
        if kept is None or kept.next != q.start:
            self._run_exact(q)
            return None
        n = q.plen - 1
        head = min(q.end - q.first, n - q.start)  # this step's rows in the head
        if not kept.keys:
            kept.keys, kept.queries = [[] for _ in step.inputs], [[] for _ in step.inputs]
        if head > 0:
            self._keep_scoring(q, kept, step, head)
        if not q.last:
            kept.split.append(step.stream[q.first : q.end].clone())
        kept.next = q.start + q.end - q.first
        if q.last:
            self.kept.pop(q.key, None)
        return kept

    def _keep_scoring(self, q: Question, kept: Kept, step: ScoredStep, head: int) -> None:
        """Keys of this step's head rows and queries of its question rows, per scored layer."""
        n = q.plen - 1
        rows, first = slice(q.first, q.first + head), max(0, n - min(self.policy.query, n) - q.start)
        for i, x in enumerate(step.inputs):
            keys, queries = step.scorer.keys_queries(i, x[rows], step.pos[rows])
            kept.keys[i].append(keys)
            if first < head:
                kept.queries[i].append(queries[first:].clone())

    def _run_exact(self, q: Question) -> None:
        """A question prompt past its start with nothing kept (its earlier chunks ran stock): exact from here on
        (`select` protects this step's rows)."""
        self.kept.pop(q.key, None)
        self.exact.add(q.key)
        self.exact_prompts += int(q.last)

    def choose(self, q: Question, kept: Kept, scorer: Scorer) -> Tensor:
        """Bool [n] (host) over a prompt's head: sink, tail and the share the question's attention picks.

        The last `query` head rows score every head row, summed over heads and the scored layers, max-pooled.
        """
        p, n = self.policy, q.plen - 1
        keys, queries = [torch.cat(k) for k in kept.keys], [torch.cat(x) for x in kept.queries]
        for k, x in zip(keys, queries, strict=True):
            if k.shape[0] != n or x.shape[0] != min(p.query, n):
                raise RuntimeError(f"question rows: kept {k.shape[0]} keys and {x.shape[0]} queries of {n}")
        attention = scorer.attention(keys, queries)
        mask = question_mask(attention, p.sink, max(1, p.tail - 1), p.share, p.window, p.reach).cpu()
        self.chosen[q.req_id] = mask.nonzero().squeeze(-1).tolist()
        if len(self.chosen) > CHOSEN_RECORD:  # a record, not a log of every request
            self.chosen.pop(next(iter(self.chosen)))
        return mask

    def _earlier(self, q: Question, kept: Kept, mask: Tensor) -> tuple[Tensor, Tensor, Tensor] | None:
        """(h_S, positions, request index) of the chosen rows of a prompt's earlier chunks past the sink."""
        pos = mask[: q.start].nonzero().squeeze(-1)
        pos = pos[pos >= self.policy.sink]
        if not pos.shape[0]:
            return None
        return torch.cat(kept.split)[to_device(pos, kept.split[0].device)], pos, torch.full_like(pos, q.req)


def _earlier_rows(rows: StepRows, parts: list[tuple[Tensor, Tensor, Tensor]], device) -> EarlierRows | None:
    """The chosen rows of earlier chunks of every prompt of the step, ahead of the step's own rows."""
    if not parts:
        return None
    x, host_pos, req = (torch.cat(t) for t in zip(*parts, strict=True))
    return EarlierRows(x, to_device(host_pos, device), req, host_pos, rows.with_rows_before(req, host_pos))
