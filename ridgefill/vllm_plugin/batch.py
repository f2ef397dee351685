"""Row classes for one vLLM step: which scheduled tokens are bulk and which are protected.

The model forward sees only token ids and positions, so the model runner is patched (once, in every
vLLM process) to hand the model each step's requests: their prompt lengths, prompt token ids and
where their tokens sit in the flattened batch (`step_rows`; the patch is in `patches.py`). Classification
is by absolute position, so it holds for any chunk size, for several requests and for decodes in one
batch (a decode row is never bulk).

With the question selector a prompt's share is known only once its question (its last rows) has run
layers 0..S-1: the classifier lists each step of a question prompt (`Question`) and protects what
`question.QuestionSelector.admit` says; the forward then chooses, into a new `StepRows`
(`StepRows.with_protected`, `StepRows.with_rows_before`).
"""

from __future__ import annotations

from collections.abc import Callable, Container
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import Tensor

from ridgefill.rows import RowPolicy, protected_mask
from ridgefill.vllm_plugin.device import to_device
from ridgefill.vllm_plugin.question import Kept, QuestionSelector


@dataclass(frozen=True)
class Question:
    """One question prompt's tokens in a step (select "question"): batch tokens first..end, at positions
    start.., of request `req` (index within the step) whose prompt has `plen` rows; `last`: this step ends
    the prompt, so its share is chosen here (start 0 and last: the prompt is scheduled whole)."""

    first: int
    end: int
    req: int
    req_id: str
    plen: int
    start: int
    last: bool

    @property
    def key(self) -> tuple[str, int]:
        return (self.req_id, self.plen)


@dataclass
class StepRows:
    """One step's classification; `runs` are contiguous protected rows of one request."""

    num_tokens: int  # scheduled tokens, without the runner's padding
    protected: Tensor  # [num_tokens] bool, on the CPU
    req_of_token: Tensor  # [num_tokens] long, request index within the step
    positions: Tensor  # [num_tokens] long, absolute positions
    runs: list[tuple[int, int, int]] = field(default_factory=list)  # (first token, end token, request index)
    cache: dict = field(default_factory=dict)  # per-step metadata shared by the late layers
    decodes: int = 0  # requests of the step past their prompt (decoding or recomputing outputs)
    questions: list[Question] = field(default_factory=list)  # prompts (or chunks of them) whose protected
    # share the question picks in the forward, or keeps material for (select "question")

    @property
    def any_bulk(self) -> bool:
        return bool((~self.protected).any())

    def indices(self, device: torch.device) -> tuple[Tensor, Tensor]:
        """(protected, bulk) token indices on `device`, copied once a step without a device sync."""
        if "indices" not in self.cache:
            keep = self.protected.numpy()
            host = (torch.from_numpy(np.flatnonzero(keep)), torch.from_numpy(np.flatnonzero(~keep)))
            self.cache["indices"] = tuple(to_device(t, device) for t in host)
        return self.cache["indices"]

    def with_protected(self, protected: Tensor) -> StepRows:
        """This step with another protected mask (the question's choice): new runs, no stale metadata."""
        runs = _runs(protected.numpy(), self.req_of_token.numpy(), self.positions.numpy())
        rows = (self.num_tokens, protected, self.req_of_token, self.positions, runs)
        return StepRows(*rows, decodes=self.decodes, questions=self.questions)

    def with_rows_before(self, req: Tensor, positions: Tensor) -> StepRows:
        """This step with protected rows of earlier chunks (request index [e], position [e]) placed before its
        tokens: the rows a question's last step attends for (its choice among earlier chunks, then its own)."""
        protected = torch.cat([torch.ones(req.shape[0], dtype=torch.bool), self.protected])
        req_of_token = torch.cat([req, self.req_of_token])
        positions = torch.cat([positions, self.positions])
        runs = _runs(protected.numpy(), req_of_token.numpy(), positions.numpy())
        return StepRows(self.num_tokens + req.shape[0], protected, req_of_token, positions, runs)


class RowClassifier:
    """Keeps each prefilling request's prompt mask (computed once per request) and classifies steps; with the
    question selector, asks it (`selector`) which of a question prompt's rows a step protects."""

    def __init__(self, policy: RowPolicy, scores: Tensor | None, max_kept: int | None = None) -> None:
        self.policy, self.scores = policy, scores
        self.question = policy.by_question  # the share is picked in the forward, from the question's attention
        self.selector = QuestionSelector(policy, max_kept)  # idle unless `question`
        self.masks: dict[tuple[str, int], np.ndarray] = {}  # (request, prompt length): a prompt may grow
        self.fill: dict[tuple[str, int], list[int]] = {}  # per prompt: [rows run between sink and tail, bulk]
        self.inert: str | None = None  # why a long prompt ran with zero bulk rows (first such prompt)

    # the selector's state, read through the classifier (the gauge, the counters, the tests)
    @property
    def kept(self) -> dict[tuple[str, int], Kept]:
        return self.selector.kept

    @property
    def max_kept(self) -> int:
        return self.selector.max_kept

    @property
    def exact_prompts(self) -> int:
        return self.selector.exact_prompts

    @property
    def capped_prompts(self) -> int:
        return self.selector.capped_prompts

    def prompt_mask(self, req_id: str, prompt_ids: np.ndarray) -> np.ndarray:
        key = (req_id, len(prompt_ids))
        if key not in self.masks:
            ids = torch.from_numpy(np.asarray(prompt_ids, dtype=np.int64))
            share, scores = (0.0, None) if self.question else (self.policy.share, self.scores)
            self.masks[key] = protected_mask(ids, self.policy.sink, self.policy.tail, share, scores).numpy()
        return self.masks[key]

    def classify(
        self,
        req_ids: list[str],
        query_start_loc: np.ndarray,
        num_computed: np.ndarray,
        prompt_lens: np.ndarray,
        prompt_ids: Callable[[int, int], np.ndarray],
        stock: Container[str] = (),
        held: Container[str] | None = None,
    ) -> StepRows | None:
        """Classify a step from host-side batch state only (no device sync).

        Request r's scheduled tokens sit at query_start_loc[r]:query_start_loc[r+1] of the flattened
        batch, at positions num_computed[r].. . Requests in `stock` (those asking for prompt logprobs,
        which need every row's logits) are all protected. Returns None for a step with no prompt row to
        fill (decodes only), which then runs stock at the cost of a few vector ops.

        With the question selector, every step of a question prompt is listed in `questions`: the share is
        picked in the forward of its last step, once layers 0..S-1 have run on every row. Its earlier chunks
        protect only the sink: a tail row run there would attend filled K/V of rows the question may choose
        later, so the last step runs it again anyway. A prompt first seen past its start without kept
        material (its earlier chunks ran stock, or it grew: a streamed prompt) runs exact from there.
        What a chunked prompt keeps lives while its request is `held` (`QuestionSelector.forget`).
        """
        n = len(req_ids)
        qsl = np.asarray(query_start_loc[: n + 1], dtype=np.int64)
        counts = np.diff(qsl)
        computed = np.asarray(num_computed[:n], dtype=np.int64)
        plens = np.asarray(prompt_lens[:n], dtype=np.int64)
        prefilling = [r for r in np.flatnonzero((counts > 0) & (computed < plens)).tolist() if req_ids[r] not in stock]
        self._forget({(req_ids[r], int(plens[r])) for r in range(n)}, held)
        if not prefilling:
            return None
        num_tokens = int(qsl[-1])
        pos = np.repeat(computed - qsl[:-1], counts) + np.arange(num_tokens)
        req_of_token = np.repeat(np.arange(n), counts)
        protected = np.ones(num_tokens, dtype=bool)
        questions = []
        for r in prefilling:
            a, b, plen = int(qsl[r]), int(qsl[r + 1]), int(plens[r])
            mask = self.prompt_mask(req_ids[r], prompt_ids(r, plen))
            p = pos[a:b]
            protected[a:b] = np.where(p < plen, mask[np.minimum(p, plen - 1)], True)
            if self.question and plen > self.policy.sink + self.policy.tail:
                q = Question(a, b, r, req_ids[r], plen, int(computed[r]), int(p[-1]) >= plen - 1)
                protected[a:b] = self.selector.admit(q, p, protected[a:b])
                if self.selector.listed(q):
                    questions.append(q)
            self._track(req_ids[r], plen, p, protected[a:b])
        runs = _runs(protected, req_of_token, pos)
        decodes = int(((counts > 0) & (computed >= plens)).sum())
        return StepRows(
            num_tokens,
            torch.from_numpy(protected),
            torch.from_numpy(req_of_token),
            torch.from_numpy(pos),
            runs,
            decodes=decodes,
            questions=questions,
        )

    def _forget(self, live: set[tuple[str, int]], held: Container[str] | None) -> None:
        """Drop what is kept for prompts no longer under way (`live`: this step's batch; see classify)."""
        for stale in [k for k in self.masks if k not in live]:
            del self.masks[stale]
        for stale in [k for k in self.fill if k not in live]:
            del self.fill[stale]
        self.selector.forget(live, held)

    def release(self, req_id: str) -> None:
        """Drop all that is kept for a request the runner let go (finished or aborted) at once: the next step
        that runs the model, where `_forget` would drop it, may be long in coming on an idle server."""
        for kept in (self.masks, self.fill):
            for key in [k for k in kept if k[0] == req_id]:
                del kept[key]
        self.selector.release(req_id)

    def _track(self, req_id: str, plen: int, pos: np.ndarray, protected: np.ndarray) -> None:
        """Note a prompt that ran rows between its sink and tail with none of them bulk (once its prompt is done)."""
        if plen <= self.policy.sink + self.policy.tail:
            return
        seen = self.fill.setdefault((req_id, plen), [0, 0])
        zone = (pos >= self.policy.sink) & (pos < plen - self.policy.tail)
        seen[0] += int(zone.sum())
        seen[1] += int((~protected).sum())
        if pos[-1] >= plen - 1 and seen[0] > 0 and seen[1] == 0 and self.inert is None:
            why = "and the classifier protected them all"
            if self.policy.share >= 1:
                why = "with share 1 (every row protected)"
            else:
                why = self.selector.why_exact((req_id, plen)) or why
            edges = f"sink {self.policy.sink} and tail {self.policy.tail}"
            self.inert = f"a {plen}-token prompt ran {seen[0]} rows between {edges} {why}"


def _runs(protected: np.ndarray, req_of_token: np.ndarray, positions: np.ndarray) -> list[tuple[int, int, int]]:
    """Maximal runs of protected tokens that are consecutive in the batch, in one request and in position."""
    idx = np.flatnonzero(protected)
    if idx.size == 0:
        return []
    req, pos = req_of_token[idx], positions[idx]
    first = np.ones(idx.size, dtype=bool)
    first[1:] = (np.diff(idx) != 1) | (np.diff(req) != 0) | (np.diff(pos) != 1)
    starts = np.flatnonzero(first)
    ends = np.append(starts[1:], idx.size)
    return [(int(idx[s]), int(idx[e - 1]) + 1, int(req[s])) for s, e in zip(starts, ends, strict=True)]


class PromptLogprobRequests:
    """Requests that asked for prompt logprobs, for their whole life (the runner's own dict empties once
    their prompt is done, but a preempted request recomputes its prompt)."""

    def __init__(self, requests: dict) -> None:
        self.requests = requests

    def __contains__(self, req_id: object) -> bool:
        state = self.requests.get(req_id)
        params = getattr(state, "sampling_params", None)
        return params is not None and params.prompt_logprobs is not None


def step_rows(runner, classifier: RowClassifier) -> StepRows | None:
    """The runner glue: classify the step a V1 model runner is about to run, from its host-side state.

    `input_batch` rows 0..num_reqs-1 are the step's requests in batch order; `query_start_loc.np` gives
    where each one's scheduled tokens sit in the flattened batch, `num_computed_tokens_cpu` the position of
    its first scheduled token, `num_prompt_tokens` and `token_ids_cpu` its prompt.
    """
    batch = runner.input_batch
    n = batch.num_reqs
    return classifier.classify(
        batch.req_ids[:n],
        runner.query_start_loc.np[: n + 1],
        batch.num_computed_tokens_cpu[:n],
        batch.num_prompt_tokens[:n],
        lambda r, plen: batch.token_ids_cpu[r, :plen],
        stock=PromptLogprobRequests(runner.requests),
        held=runner.requests,
    )


def bulk_rows(rows: StepRows) -> StepRows:
    """The bulk rows of a step as their own runs (plumb mode runs the whole layer for them too)."""
    bulk = ~rows.protected
    runs = _runs(bulk.numpy(), rows.req_of_token.numpy(), rows.positions.numpy())
    return StepRows(rows.num_tokens, bulk, rows.req_of_token, rows.positions, runs)
