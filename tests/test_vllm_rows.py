"""Row classes of a vLLM step agree with the reference runtime's `protected_mask`, whatever the chunking."""

from __future__ import annotations

import numpy as np
import torch

from ridgefill.rows import RowPolicy, protected_mask
from ridgefill.vllm_plugin.batch import RowClassifier, bulk_rows

SINK, TAIL, SHARE = 4, 32, 0.2


def _classifier(seed: int = 0) -> RowClassifier:
    return RowClassifier(RowPolicy(SINK, TAIL, SHARE), torch.rand(500, generator=torch.Generator().manual_seed(seed)))


def _step(reqs: list[tuple[str, np.ndarray, int, int]], classifier: RowClassifier, stock=(), held=None):
    """reqs: (id, prompt ids, computed before the step, tokens scheduled)."""
    qsl = np.concatenate([[0], np.cumsum([c for *_, c in reqs])]).astype(np.int32)
    ids = [r for r, *_ in reqs]
    prompts = [p for _, p, _, _ in reqs]
    return classifier.classify(
        ids,
        qsl,
        np.array([done for _, _, done, _ in reqs]),
        np.array([len(p) for p in prompts]),
        lambda r, n: prompts[r][:n],
        stock=stock,
        held=held,
    )


def test_any_chunking_gives_the_reference_mask():
    g = np.random.default_rng(0)
    prompts = {name: g.integers(0, 500, size=n) for name, n in [("a", 300), ("b", 170), ("c", 41)]}
    for chunk in (1, 7, 64, 1000):
        classifier = _classifier()
        got = {name: [] for name in prompts}
        done = dict.fromkeys(prompts, 0)
        while any(done[k] < len(p) for k, p in prompts.items()):
            budget, reqs = chunk, []  # vLLM-style: fill the step's token budget request by request
            for name, p in prompts.items():
                take = min(len(p) - done[name], budget)
                if take > 0:
                    reqs.append((name, p, done[name], take))
                    budget -= take
            rows = _step(reqs, classifier)
            for r, (name, _, start, take) in enumerate(reqs):
                mine = rows.req_of_token == r
                assert rows.positions[mine].tolist() == list(range(start, start + take))
                got[name] += rows.protected[mine].tolist()
                done[name] += take
        for name, p in prompts.items():
            want = protected_mask(torch.from_numpy(p), SINK, TAIL, SHARE, classifier.scores)
            assert got[name] == want.tolist(), (chunk, name)


def test_decodes_are_protected_and_decode_only_steps_are_not_classified():
    classifier = _classifier()
    prompt = np.arange(100)
    assert _step([("a", prompt, 100, 1), ("b", prompt, 140, 1)], classifier) is None
    rows = _step([("a", prompt, 100, 1), ("b", prompt, 0, 64), ("c", prompt, 120, 1)], classifier)
    assert rows.protected[0] and rows.protected[-1] and rows.positions[-1] == 120
    assert not rows.protected[1 + SINK : 1 + 64].all()  # the prefill chunk holds bulk rows
    assert rows.runs[0] == (0, 1, 0) and rows.runs[-1] == (65, 66, 2)
    assert set(classifier.masks) == {("b", 100)}  # masks only for requests that prefilled


def test_runs_are_maximal_and_split_at_request_and_position_breaks():
    classifier = RowClassifier(RowPolicy(2, 3, 0.0), None)
    p = np.arange(10)
    # a: positions 5..9 (bulk 5,6; tail 7,8,9) then b: positions 0..9 (sink 0,1; bulk 2..6; tail 7,8,9)
    rows = _step([("a", p, 5, 5), ("b", p, 0, 10)], classifier)
    assert rows.protected.tolist() == [False, False, True, True, True] + [True, True] + [False] * 5 + [True] * 3
    assert rows.runs == [(2, 5, 0), (5, 7, 1), (12, 15, 1)]
    bulk = bulk_rows(rows)
    assert bulk.runs == [(0, 2, 0), (7, 12, 1)]
    # stale masks go when their request leaves the batch
    _step([("c", p, 0, 10)], classifier)
    assert set(classifier.masks) == {("c", 10)}


def test_requests_in_stock_are_all_protected():
    classifier = _classifier()
    prompt = np.arange(200)
    assert _step([("a", prompt, 0, 200)], classifier, stock={"a"}) is None
    rows = _step([("a", prompt, 0, 200), ("b", prompt, 0, 200)], classifier, stock={"a"})
    assert rows.protected[:200].all() and not rows.protected[200:].all()


def test_a_growing_prompt_is_classified_by_its_current_length():
    """Streamed input keeps the request id while its prompt grows: the tail moves with the prompt's end."""
    classifier = RowClassifier(RowPolicy(2, 4, 0.0), None)
    p = np.arange(40)
    first = _step([("s", p[:20], 0, 20)], classifier)
    assert first.protected.tolist() == [True] * 2 + [False] * 14 + [True] * 4
    grown = _step([("s", p, 20, 20)], classifier)  # positions 20..39 of a 40-token prompt
    assert grown.protected.tolist() == [False] * 16 + [True] * 4
    assert set(classifier.masks) == {("s", 40)}


def test_prompt_logprob_requests_stay_stock_for_their_whole_life():
    from types import SimpleNamespace

    from ridgefill.vllm_plugin.batch import PromptLogprobRequests

    requests = {
        "lp": SimpleNamespace(sampling_params=SimpleNamespace(prompt_logprobs=0)),
        "plain": SimpleNamespace(sampling_params=SimpleNamespace(prompt_logprobs=None)),
        "pooling": SimpleNamespace(sampling_params=None),
    }
    stock = PromptLogprobRequests(requests)
    assert "lp" in stock and "plain" not in stock and "pooling" not in stock and "gone" not in stock


def test_question_prompts_are_listed_in_every_step_and_earlier_chunks_protect_only_the_sink():
    """select "question": the share is left to the forward (edge rows only here). A prompt scheduled whole is
    listed once, as its last step; a chunked one in every step, its earlier chunks protecting only the sink
    (tail rows there too are bulk: the last step runs them again) with room kept for the forward, its last
    chunk the edge mask; its kept room goes when the request leaves; a prompt first seen past its start
    without kept rows runs exact, and is counted."""
    classifier = RowClassifier(RowPolicy(SINK, TAIL, SHARE, "question"), None)
    p = np.arange(300)
    rows = _step([("w", p, 0, 300), ("short", p[:20], 0, 20)], classifier)
    assert [(q.first, q.end, q.req_id, q.start, q.last) for q in rows.questions] == [(0, 300, "w", 0, True)]
    want = protected_mask(torch.from_numpy(p), SINK, TAIL, 0.0, None)
    assert rows.protected[:300].tolist() == want.tolist() and rows.protected[300:].all()
    assert classifier.kept == {}  # nothing to keep for a prompt scheduled whole
    first = _step([("c", p, 0, 128)], classifier)
    assert [(q.start, q.last) for q in first.questions] == [(0, False)] and ("c", 300) in classifier.kept
    assert first.protected.tolist() == [i < SINK for i in range(128)]
    middle = _step([("c", p, 128, 150)], classifier)  # rows 268..277 are tail rows, bulk here
    assert [(q.start, q.last) for q in middle.questions] == [(128, False)] and not middle.protected.any()
    _step([("other", p[:20], 0, 20)], classifier, held={"c", "other"})  # "c" not scheduled, still held
    assert ("c", 300) in classifier.kept
    last = _step([("c", p, 278, 22)], classifier, held={"c"})
    assert [(q.start, q.last) for q in last.questions] == [(278, True)]
    assert last.protected.tolist() == want[278:].tolist()
    _step([("d", p, 0, 64)], classifier, held={"d"})
    _step([("other", p[:20], 0, 20)], classifier, held={"other"})  # "d" ended mid-prompt: what it kept is freed
    assert ("d", 300) not in classifier.kept
    late = _step([("late", p, 128, 172)], classifier)  # past its start, nothing kept: exact, counted at its end
    assert late.questions == [] and late.protected.all() and classifier.exact_prompts == 1
    assert classifier.inert and "exactly" in classifier.inert
