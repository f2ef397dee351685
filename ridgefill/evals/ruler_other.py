"""RULER aggregation and QA generators: `common_words_extraction.py`, `freq_words_extraction.py`, `qa.py`."""

from __future__ import annotations

import contextlib
import functools
import json
import math
import random
import string
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ridgefill.evals.ruler_common import (
    TEMPLATES,
    DatasetSource,
    Draft,
    Job,
    PathLike,
    Setup,
    TaskUnavailable,
    hub_offline,
    load_rows,
    wonder_words,
)

# --- common words extraction -------------------------------------------------------------------------


def cwe_vocabulary(seed: int) -> list[str]:
    """Nouns, adjectives and verbs of wonderwords, sorted then shuffled by the seed (as RULER does)."""
    words = sorted(set(wonder_words("noun") + wonder_words("adjective") + wonder_words("verb")))
    random.Random(seed).shuffle(words)
    return words


def distinct_words(rng: random.Random, words: list[str], k: int) -> list[str]:
    """k distinct words; past the vocabulary, adjective-noun compounds stand in for RULER's 8.5 MB list."""
    if k <= len(words):
        return rng.sample(words, k)
    adjs, nouns = wonder_words("adjective"), wonder_words("noun")
    picks = rng.sample(range(len(adjs) * len(nouns)), k)
    return [f"{adjs[i // len(nouns)]}-{nouns[i % len(nouns)]}" for i in picks]


def numbered(words: Iterable[str]) -> str:
    """RULER's "1. w1 2. w2 ..." list format."""
    return " ".join(f"{i + 1}. {w}" for i, w in enumerate(words))


def cwe_example(
    rng: random.Random, words: list[str], seed: int, num_words: int, common: int, uncommon: int, num_cw: int
) -> tuple[str, list[str]]:
    """`get_example`: num_cw words repeated `common` times, the rest `uncommon` times, fixed-seed shuffle."""
    chosen = distinct_words(rng, words, num_words)
    top = chosen[:num_cw]
    listing = top * common + chosen[num_cw:] * uncommon
    random.Random(seed).shuffle(listing)
    return numbered(listing), top


def prepare_cwe(setup: Setup) -> Callable[[int], Job]:
    """Job factory for cwe; `size` is the number of distinct words. Below 4096 tokens RULER uses 6x / 1x."""
    args, length, seed = setup.args, setup.length, setup.seed
    words = cwe_vocabulary(seed)
    spec = TEMPLATES["common_words_extraction"]
    num_cw = args["num_cw"]
    short = length < 4096
    shot_shape = (20, 3, 1) if short else (40, 10, 3)
    repeats = (6, 1) if short else (args["freq_cw"], args["freq_ucw"])

    def job(index: int) -> Job:
        def build(size: int) -> Draft:
            rng = setup.rng(index)
            shot, shot_answer = cwe_example(rng, words, seed, *shot_shape, num_cw)
            context, answer = cwe_example(rng, words, seed, size, *repeats, num_cw)
            full = spec["template"] + spec["answer_prefix"]
            shot_text = full.format(context=shot, query="", num_cw=num_cw) + " " + numbered(shot_answer)
            task = spec["template"].format(context=context, query="", num_cw=num_cw)
            return Draft(user=shot_text + "\n" + task, answer_prefix=spec["answer_prefix"], answers=answer)

        return Job(build, floor=num_cw + 1, probe=64)

    return job


# --- frequent words extraction -----------------------------------------------------------------------


def zeta(s: float) -> float:
    """Riemann zeta for s > 1 (Euler-Maclaurin, to ~1e-15), replacing scipy.special.zeta."""
    n = 20
    total = sum(k**-s for k in range(1, n)) + n ** (1 - s) / (s - 1) + n**-s / 2
    for k, bernoulli in ((1, 1 / 6), (2, -1 / 30), (3, 1 / 42), (4, -1 / 30), (5, 5 / 66)):
        rising = math.prod(s + j for j in range(2 * k - 1))
        total += bernoulli / math.factorial(2 * k) * rising * n ** (-s - 2 * k + 1)
    return total


def coded_vocabulary(rng: random.Random, seed: int, size: int, word_len: int = 6) -> list[str]:
    """`freq_words_extraction`: random 6-letter words, sorted, fixed-seed shuffle, rank 0 becomes '...'."""
    vocab = ["".join(rng.choices(string.ascii_lowercase, k=word_len)) for _ in range(size)]
    while len(set(vocab)) < size:
        vocab.append("".join(rng.choices(string.ascii_lowercase, k=word_len)))
    vocab = sorted(set(vocab))
    random.Random(seed).shuffle(vocab)
    vocab[0] = "..."
    return vocab


def prepare_fwe(setup: Setup) -> Callable[[int], Job]:
    """Job factory for fwe; `size` is RULER's num_words (zeta-distributed counts, rank 1 is noise)."""
    spec, seed = TEMPLATES["freq_words_extraction"], setup.seed
    budget = setup.length - spec["tokens_to_generate"]
    vocab_size = budget // 50
    if vocab_size < 4:
        raise ValueError("fwe needs a target length of at least 250 tokens")
    alpha = setup.args["alpha"]
    norm = zeta(alpha)

    def job(index: int) -> Job:
        def build(size: int) -> Draft:
            rng = setup.rng(index)
            vocab = coded_vocabulary(rng, seed, vocab_size)
            text = [w for k, w in enumerate(vocab, 1) for _ in range(int(size * k**-alpha / norm))]
            random.Random(seed).shuffle(text)
            return Draft(
                user=spec["template"].format(context=" ".join(text), query=""),
                answer_prefix=spec["answer_prefix"],
                answers=vocab[1:4],
            )

        return Job(build, floor=1, probe=max(1, budget // 6))

    return job


# --- QA ----------------------------------------------------------------------------------------------

DOCUMENT_PROMPT = "Document {i}:\n{document}"
QA_SOURCES = {
    "squad": DatasetSource("rajpurkar/squad_v2", split="validation"),
    "hotpotqa": DatasetSource("hotpotqa/hotpot_qa", split="validation", config="distractor"),
}


@dataclass(frozen=True)
class QAItem:
    """One RULER QA question: answers, its own documents, same-article documents, gold (answer) documents."""

    query: str
    outputs: tuple[str, ...]
    context: tuple[int, ...]
    more: tuple[int, ...]
    gold: tuple[int, ...]


@dataclass(frozen=True)
class QAData:
    """RULER's (QAS, DOCS) pair: questions in file order and the sorted unique documents."""

    name: str
    questions: tuple[QAItem, ...]
    docs: tuple[str, ...]


def squad_data(rows: Iterable[tuple[str, str, str, list[str]]]) -> QAData:
    """`read_squad` on (title, context, question, answers) rows; unanswerable rows are dropped."""
    rows = list(rows)
    docs = sorted({r[1] for r in rows})
    ids = {d: i for i, d in enumerate(docs)}
    article: dict[str, list[int]] = {}
    for title, ctx, _, _ in rows:
        article.setdefault(title, [])
        if ids[ctx] not in article[title]:
            article[title].append(ids[ctx])
    items = tuple(
        QAItem(q, tuple(ans), (ids[ctx],), tuple(i for i in article[title] if i != ids[ctx]), (ids[ctx],))
        for title, ctx, q, ans in rows
        if ans
    )
    return QAData("squad", items, tuple(docs))


def hotpot_data(rows: Iterable[tuple[str, str, list[tuple[str, list[str]]], set[str]]]) -> QAData:
    """`read_hotpotqa` on (question, answer, [(title, sentences)], supporting titles) rows."""
    rows = list(rows)
    docs = sorted({f"{t}\n{''.join(p)}" for r in rows for t, p in r[2]})
    ids = {d: i for i, d in enumerate(docs)}
    items = []
    for q, a, ctx, support in rows:
        own = tuple(ids[f"{t}\n{''.join(p)}"] for t, p in ctx)
        gold = tuple(ids[f"{t}\n{''.join(p)}"] for t, p in ctx if t in support)
        items.append(QAItem(q, (a,), own, (), gold))
    return QAData("hotpotqa", tuple(items), tuple(docs))


def ruler_json_rows(dataset: str, path: Path) -> list[tuple]:
    """Rows from RULER's own downloads: SQuAD dev-v2.0.json or hotpot_dev_distractor_v1.json."""
    data = json.loads(path.read_text(encoding="utf-8"))
    if dataset == "squad":
        return [
            (
                d["title"],
                p["context"],
                qa["question"],
                [] if qa["is_impossible"] else [a["text"] for a in qa["answers"]],
            )
            for d in data["data"]
            for p in d["paragraphs"]
            for qa in p["qas"]
        ]
    return [
        (d["question"], d["answer"], [(t, s) for t, s in d["context"]], {t for t, _ in d["supporting_facts"]})
        for d in data
    ]


def hf_rows(dataset: str, ds: Any) -> list[tuple]:
    """Rows from the Hub layouts of rajpurkar/squad_v2 and hotpotqa/hotpot_qa."""
    if dataset == "squad":
        return [(r["title"], r["context"], r["question"], list(r["answers"]["text"])) for r in ds]
    rows = []
    for r in ds:
        docs = list(zip(r["context"]["title"], r["context"]["sentences"], strict=True))
        rows.append((r["question"], r["answer"], docs, set(r["supporting_facts"]["title"])))
    return rows


def load_qa(dataset: str, source: PathLike | DatasetSource | None = None, offline: bool = True) -> QAData:
    """SQuAD ("squad") or HotpotQA ("hotpotqa") from a RULER json file or a cached `datasets` dataset.

    Raises TaskUnavailable when the data cannot be read, so qa_1 / qa_2 can be skipped cleanly.
    """
    if dataset not in QA_SOURCES:
        raise ValueError(f"unknown QA dataset {dataset!r}")
    source = QA_SOURCES[dataset] if source is None else source
    try:
        if isinstance(source, DatasetSource):
            with hub_offline() if offline else contextlib.nullcontext():
                rows = hf_rows(dataset, load_rows(source))
        else:
            rows = ruler_json_rows(dataset, Path(source))
    except Exception as exc:  # noqa: BLE001 - any failure means "not available here"
        raise TaskUnavailable(f"{dataset} data is not available from {source}: {exc}") from exc
    return squad_data(rows) if dataset == "squad" else hotpot_data(rows)


@functools.lru_cache(maxsize=2)
def default_qa(dataset: str) -> QAData:
    """`load_qa` of the default Hub dataset, kept: parsing HotpotQA takes seconds."""
    return load_qa(dataset)


def qa_documents(rng: random.Random, item: QAItem, size: int, total: int) -> list[int]:
    """`qa.generate_input_output`'s document choice: own, same-article, then random other documents."""
    own, more = list(item.context), list(item.more)
    if size >= total:
        return (list(range(total)) * -(-size // total))[:size]
    if size - len(own) > len(more):
        taken = set(own + more)
        others = [i for i in range(total) if i not in taken]
        return own + more + rng.sample(others, max(0, size - len(own) - len(more)))
    return own + rng.sample(more, size - len(own))


def prepare_qa(setup: Setup) -> Callable[[int], Job]:
    """Job factory for qa_1 / qa_2; sample i asks question i (as RULER does); `size` counts documents."""
    seed, haystack = setup.seed, setup.haystack
    data = haystack if isinstance(haystack, QAData) else default_qa(setup.args["dataset"])
    spec = TEMPLATES["qa"]

    def job(index: int) -> Job:
        item = data.questions[index % len(data.questions)]

        def build(size: int) -> Draft:
            order = qa_documents(setup.rng(index), item, size, len(data.docs))
            random.Random(seed).shuffle(order)
            docs = [DOCUMENT_PROMPT.format(i=i + 1, document=data.docs[d]) for i, d in enumerate(order)]
            gold = [i for i, d in enumerate(order) if d in item.gold]
            return Draft(
                user=spec["template"].format(context="\n\n".join(docs), query=item.query),
                answer_prefix=spec["answer_prefix"],
                answers=list(item.outputs),
                needles=[docs[i] for i in gold],
                depths=[100 * i / len(order) for i in gold],
            )

        return Job(build, floor=len(item.context), probe=10)

    return job
