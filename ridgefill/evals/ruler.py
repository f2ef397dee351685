"""RULER (NVIDIA/RULER) synthetic long-context tasks, fitted to a model's own token budget, and their scoring.

Why: RidgeFill approximates attention rows, and RULER is the standard probe of whether a long-context model
still retrieves and aggregates. The generators keep RULER's task templates, answer prefixes, needle formats,
key/value types, depths, counts (`scripts/synthetic.yaml`), generation lengths and metrics, but measure
length in the given tokenizer's tokens *including its chat template*, and record where each needle lies in
`input_ids` so results can be split by the region of rows (sink / bulk / tail) a needle falls in.

Prompt = chat template (user turn = RULER input, generation prompt) + RULER answer prefix. RULER's length rule
is kept: len(input_ids) + max_new_tokens <= length, as close as the haystack unit allows.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ridgefill.evals.ruler_common import (
    TEMPLATES,
    DatasetSource,
    Draft,
    Haystack,
    Job,
    Setup,
    TaskUnavailable,
    char_spans,
    encode,
    largest_fitting,
    load_haystack,
    render,
    token_span,
)
from ridgefill.evals.ruler_niah import prepare_niah, prepare_vt
from ridgefill.evals.ruler_other import QAData, load_qa, prepare_cwe, prepare_fwe, prepare_qa

__all__ = [
    "SPECS",
    "TASKS",
    "DatasetSource",
    "Haystack",
    "QAData",
    "Sample",
    "TaskSpec",
    "TaskUnavailable",
    "load_haystack",
    "load_qa",
    "make_samples",
    "region_of",
    "sample_score",
    "score",
    "string_match_all",
    "string_match_part",
]


@dataclass(frozen=True)
class TaskSpec:
    """A RULER task: its generator script (`family`) and its arguments from `scripts/synthetic.yaml`."""

    name: str
    family: str
    args: Mapping[str, Any]

    @property
    def max_new_tokens(self) -> int:
        """RULER's tokens_to_generate for the family."""
        return TEMPLATES[self.family]["tokens_to_generate"]

    @property
    def metric(self) -> str:
        """RULER's `scripts/eval/synthetic/constants.py` metric: qa matches any answer, the rest all."""
        return "string_match_part" if self.family == "qa" else "string_match_all"


def _niah(haystack: str, k: str, v: str, num_k: int = 1, num_v: int = 1, num_q: int = 1) -> dict[str, Any]:
    return {
        "type_haystack": haystack,
        "type_needle_k": k,
        "type_needle_v": v,
        "num_needle_k": num_k,
        "num_needle_v": num_v,
        "num_needle_q": num_q,
    }


# scripts/synthetic.yaml
SPECS: dict[str, TaskSpec] = {
    s.name: s
    for s in [
        TaskSpec("niah_single_1", "niah", _niah("noise", "words", "numbers")),
        TaskSpec("niah_single_2", "niah", _niah("essay", "words", "numbers")),
        TaskSpec("niah_single_3", "niah", _niah("essay", "words", "uuids")),
        TaskSpec("niah_multikey_1", "niah", _niah("essay", "words", "numbers", num_k=4)),
        TaskSpec("niah_multikey_2", "niah", _niah("needle", "words", "numbers")),
        TaskSpec("niah_multikey_3", "niah", _niah("needle", "uuids", "uuids")),
        TaskSpec("niah_multivalue", "niah", _niah("essay", "words", "numbers", num_v=4)),
        TaskSpec("niah_multiquery", "niah", _niah("essay", "words", "numbers", num_q=4)),
        TaskSpec("vt", "variable_tracking", {"type_haystack": "noise", "num_chains": 1, "num_hops": 4}),
        TaskSpec("cwe", "common_words_extraction", {"freq_cw": 30, "freq_ucw": 3, "num_cw": 10}),
        TaskSpec("fwe", "freq_words_extraction", {"alpha": 2.0}),
        TaskSpec("qa_1", "qa", {"dataset": "squad"}),
        TaskSpec("qa_2", "qa", {"dataset": "hotpotqa"}),
    ]
}
TASKS: tuple[str, ...] = tuple(SPECS)

_PREPARE: dict[str, Callable[[Setup], Callable[[int], Job]]] = {
    "niah": prepare_niah,
    "variable_tracking": prepare_vt,
    "common_words_extraction": prepare_cwe,
    "freq_words_extraction": prepare_fwe,
    "qa": prepare_qa,
}


@dataclass
class Sample:
    """One fitted RULER prompt.

    `depths` are RULER depths in percent (share of haystack units before the needle), aligned with
    `needle_spans`: token ranges [start, end) in `input_ids` of the answer-bearing needles (niah), the chain
    statements (vt) or the gold documents (qa); empty for cwe / fwe. `distractor_spans` are inserted needles
    whose keys are not asked (the three other keys of niah_multikey_1).
    """

    task: str
    index: int
    seed: int
    length: int
    prompt: str
    input_ids: list[int]
    answers: list[str]
    max_new_tokens: int
    answer_prefix: str
    depths: list[float] = field(default_factory=list)
    needle_spans: list[tuple[int, int]] = field(default_factory=list)
    distractor_spans: list[tuple[int, int]] = field(default_factory=list)


def make_samples(
    task: str,
    tokenizer: Any,
    length: int,
    haystack: Haystack | QAData | None = None,
    n: int = 1,
    seed: int = 0,
) -> list[Sample]:
    """Generate `n` samples of `task` whose prompt plus max_new_tokens fits `length` tokens of `tokenizer`.

    `haystack` is the essay text for tasks RULER runs on essays (noise / needle tasks ignore it); for qa_1 /
    qa_2 it may be a `QAData`, else SQuAD / HotpotQA are loaded offline (TaskUnavailable if missing).
    Deterministic in (task, tokenizer, length, haystack, seed): sample i does not depend on `n`.
    """
    spec = SPECS.get(task)
    if spec is None:
        raise ValueError(f"unknown RULER task {task!r}; known: {', '.join(TASKS)}")
    if not getattr(tokenizer, "is_fast", False):
        raise TypeError("needle spans need a fast (Rust) tokenizer with offset mappings")
    jobs = _PREPARE[spec.family](Setup(task, spec.args, tokenizer, length, haystack, seed))
    samples: list[Sample] = []
    start: int | None = None
    for index in range(n):
        sample, start = _realize(spec, jobs(index), tokenizer, length, seed, index, start)
        samples.append(sample)
    return samples


def _realize(
    spec: TaskSpec, job: Job, tokenizer: Any, length: int, seed: int, index: int, start: int | None
) -> tuple[Sample, int]:
    """Fit the haystack size of one sample (largest that fits the budget), then locate its needles."""
    budget = length - spec.max_new_tokens
    cache: dict[int, int] = {}

    def n_tokens(size: int) -> int:
        if size not in cache:
            draft = job.build(size)
            prompt = render(tokenizer, draft.user, draft.answer_prefix)
            cache[size] = len(encode(tokenizer, prompt)["input_ids"])
        return cache[size]

    if start is None:
        start = _estimate(n_tokens, job, budget)
    size = largest_fitting(lambda s: n_tokens(s) <= budget, start, job.floor)
    draft = job.build(size)
    return _sample(spec, draft, tokenizer, length, seed, index), size


def _estimate(n_tokens: Callable[[int], int], job: Job, budget: int) -> int:
    """Linear guess of the fitting size from two probes, as RULER estimates tokens per haystack unit."""
    p1 = max(job.floor, job.probe)
    p2 = 2 * p1
    t1, t2 = n_tokens(p1), n_tokens(p2)
    per_unit = max((t2 - t1) / (p2 - p1), 1e-3)
    return max(job.floor, int(p2 + (budget - t2) / per_unit))


def _sample(spec: TaskSpec, draft: Draft, tokenizer: Any, length: int, seed: int, index: int) -> Sample:
    prompt = render(tokenizer, draft.user, draft.answer_prefix)
    enc = encode(tokenizer, prompt, offsets=True)
    offsets = [tuple(o) for o in enc["offset_mapping"]]
    needles = [token_span(offsets, s, e) for s, e in char_spans(prompt, draft.needles)]
    distractors = [token_span(offsets, s, e) for s, e in char_spans(prompt, draft.distractors)]
    return Sample(
        task=spec.name,
        index=index,
        seed=seed,
        length=length,
        prompt=prompt,
        input_ids=list(enc["input_ids"]),
        answers=list(draft.answers),
        max_new_tokens=spec.max_new_tokens,
        answer_prefix=draft.answer_prefix,
        depths=list(draft.depths),
        needle_spans=needles,
        distractor_spans=distractors,
    )


# --- scoring: scripts/eval/evaluate.py postprocess_pred and scripts/eval/synthetic/constants.py --------


def postprocess_pred(prediction: str) -> str:
    """RULER's postprocess_pred: strip, control characters to newlines, strip."""
    return re.sub(r"[\x00-\x1f]", "\n", prediction.strip()).strip()


def string_match_all(preds: Sequence[str], refs: Sequence[Sequence[str]]) -> float:
    """Mean over samples of the share of references found (case-insensitive substring), x100, 2 decimals."""
    score = (
        sum(
            sum(1.0 if r.lower() in p.lower() else 0.0 for r in ref) / len(ref)
            for p, ref in zip(preds, refs, strict=True)
        )
        / len(preds)
        * 100
    )
    return round(score, 2)


def string_match_part(preds: Sequence[str], refs: Sequence[Sequence[str]]) -> float:
    """Mean over samples of whether any reference is found (case-insensitive substring), x100, 2 decimals."""
    pairs = zip(preds, refs, strict=True)
    found = [max(1.0 if r.lower() in p.lower() else 0.0 for r in ref) for p, ref in pairs]
    return round(sum(found) / len(preds) * 100, 2)


_METRICS = {"string_match_all": string_match_all, "string_match_part": string_match_part}


def score(task: str, predictions: Sequence[str], answers: Sequence[Sequence[str]]) -> float:
    """RULER's task score (0-100) of raw model outputs against each sample's `answers`."""
    if len(predictions) != len(answers) or not predictions:
        raise ValueError("need one answer list per prediction, and at least one prediction")
    metric = _METRICS[SPECS[task].metric]
    return metric([postprocess_pred(p) for p in predictions], answers)


def sample_score(task: str, prediction: str, answers: Sequence[str]) -> float:
    """RULER's score (0-100) of one prediction: share of answers found (niah/vt/cwe/fwe), any found (qa)."""
    return score(task, [prediction], [answers])


def region_of(spans: Sequence[tuple[int, int]], n_tokens: int, sink: int, tail: int) -> str:
    """Label where needle spans lie relative to the rows an attention approximation keeps exact.

    Rows [0, sink) are sink rows, rows [n_tokens - tail, n_tokens) tail rows, every other row is a filled
    ("bulk") row. Returns "bulk" if any span touches a bulk row; otherwise "sink" if all spans lie in sink
    rows, "tail" if all lie in tail rows, "sink+tail" if they are split between the two; "none" without spans.
    """
    edge = n_tokens - tail
    for start, end in spans:
        if not 0 <= start < end <= n_tokens:
            raise ValueError(f"span {(start, end)} outside [0, {n_tokens})")
    if not spans:
        return "none"
    if any(max(start, sink) < min(end, edge) for start, end in spans):
        return "bulk"
    if all(end <= sink for _, end in spans):
        return "sink"
    if all(start >= edge for start, _ in spans):
        return "tail"
    return "sink+tail"
