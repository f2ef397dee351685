"""Shared pieces of the RULER generators: RULER's constants, haystacks, word lists, prompt fitting, spans.

Constants are copied from NVIDIA/RULER `scripts/data/synthetic/constants.py`, `niah.py` and
`variable_tracking.py`; see `ridgefill/evals/ruler.py` for the public API.
"""

from __future__ import annotations

import contextlib
import functools
import os
import random
import re
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# RULER `scripts/data/synthetic/constants.py` TASKS: task template, answer prefix and tokens_to_generate
# per generator script. The answer prefix is appended after the (chat) template, leading space included.
_FWE_PREFIX = " Answer: According to the coded text above, the three most frequently appeared words are:"
TEMPLATES: dict[str, dict[str, Any]] = {
    "niah": {
        "tokens_to_generate": 128,
        "template": "Some special magic {type_needle_v} are hidden within the following text. "
        "Make sure to memorize it. I will quiz you about the {type_needle_v} afterwards.\n{context}\n"
        "What are all the special magic {type_needle_v} for {query} mentioned in the provided text?",
        "answer_prefix": " The special magic {type_needle_v} for {query} mentioned in the provided text are",
    },
    "variable_tracking": {
        "tokens_to_generate": 30,
        "template": "Memorize and track the chain(s) of variable assignment hidden in the following text.\n\n"
        "{context}\nQuestion: Find all variables that are assigned the value {query} in the text above.",
        "answer_prefix": " Answer: According to the chain(s) of variable assignment in the text above, "
        "{num_v} variables are assigned the value {query}, they are: ",
    },
    "common_words_extraction": {
        "tokens_to_generate": 120,
        "template": "Below is a numbered list of words. In these words, some appear more often than others. "
        "Memorize the ones that appear most often.\n{context}\n"
        "Question: What are the 10 most common words in the above list?",
        "answer_prefix": " Answer: The top 10 words that appear most often in the list are:",
    },
    "freq_words_extraction": {
        "tokens_to_generate": 50,
        "template": "Read the following coded text and track the frequency of each coded word. "
        "Find the three most frequently appeared coded words. {context}\n"
        "Question: Do not provide any explanation. Please ignore the dots '....'. "
        "What are the three most frequently appeared words in the above coded text?",
        "answer_prefix": _FWE_PREFIX,
    },
    "qa": {
        "tokens_to_generate": 32,
        "template": "Answer the question based on the given documents. Only give me the answer and do not "
        "output any other words.\n\nThe following are given documents.\n\n{context}\n\nAnswer the question "
        "based on the given documents. Only give me the answer and do not output any other words.\n\n"
        "Question: {query}",
        "answer_prefix": " Answer:",
    },
}

# RULER's "noise" haystack sentence (niah.py, variable_tracking.py) and needle format (niah.py).
NOISE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
NEEDLE = "One of the special magic {type_needle_v} for {key} is: {value}."
# np.round(np.linspace(0, 100, num=40)).astype(int): no value of 100*i/39 is a .5 tie, so round() agrees.
DEPTHS: tuple[int, ...] = tuple(round(100 * i / 39) for i in range(40))


class TaskUnavailable(RuntimeError):
    """A task's data (e.g. SQuAD / HotpotQA for qa_1 / qa_2) is not available offline; callers skip it."""


@dataclass(frozen=True)
class DatasetSource:
    """A `datasets` dataset whose text column is the haystack (rows joined by newlines).

    `name` is a Hub id or a packaged builder ("text", "json", "parquet") used with `data_files`.
    """

    name: str
    split: str = "train"
    column: str = "text"
    config: str | None = None
    data_files: str | tuple[str, ...] | None = None


@dataclass(frozen=True)
class Haystack:
    """Natural text for RULER's "essay" haystack, as RULER keeps it: whitespace-split words."""

    words: tuple[str, ...]
    source: str = ""


@dataclass
class Draft:
    """One generated RULER input before the chat template: user turn, answer prefix, answers, needle texts."""

    user: str
    answer_prefix: str
    answers: list[str]
    needles: list[str] = field(default_factory=list)  # answer-bearing needles, in prompt order
    depths: list[float] = field(default_factory=list)  # RULER depth (percent) of each needle
    distractors: list[str] = field(default_factory=list)  # inserted needles that carry no answer


@dataclass
class Job:
    """How to build one sample: `build(size)` is deterministic; `size` counts haystack units."""

    build: Callable[[int], Draft]
    floor: int  # smallest valid size
    probe: int  # a size to estimate tokens per unit from


@dataclass(frozen=True)
class Setup:
    """What a generator is asked for: task and synthetic.yaml args, tokenizer, target length, data, seed."""

    task: str
    args: Mapping[str, Any]
    tokenizer: Any
    length: int
    haystack: Any
    seed: int

    def rng(self, index: int) -> random.Random:
        """Per-sample generator: sample i depends only on (task, seed, i); str seeds hash stably (sha512)."""
        return random.Random(f"ruler:{self.task}:{self.seed}:{index}")


@functools.lru_cache(maxsize=4)
def wonder_words(kind: str) -> tuple[str, ...]:
    """Sorted unique words from wonderwords' `nounlist.txt`, `adjectivelist.txt` or `verblist.txt`."""
    try:
        from wonderwords import random_word
    except ImportError as exc:  # pragma: no cover - dependency missing
        raise RuntimeError("RULER word lists need `pip install wonderwords` (as RULER itself uses).") from exc
    return tuple(sorted(set(random_word._get_words_from_text_file(f"{kind}list.txt"))))


_SENT_END = re.compile(r"(?<=[.!?])\s+|(?<=[.!?][\"')\]\u2019\u201d])\s+")


def split_sentences(text: str) -> list[str]:
    """Sentence split standing in for nltk's punkt `sent_tokenize` (needs a download); boundaries only."""
    return [s for s in _SENT_END.split(text.strip()) if s]


PathLike = str | os.PathLike[str]


def load_haystack(source: PathLike | Sequence[PathLike] | DatasetSource) -> Haystack:
    """Read essay-style haystack text from a folder of .txt files, a file, a list of files, or a dataset.

    Files are concatenated in sorted (folder) or given order, like RULER's PaulGrahamEssays.json.
    `"pydoc"` (Python's own documentation) and `"prose"` (the installed packages' README prose) are named
    sources every install has (`ridgefill.corpus.NAMED`), for use with no files at all.
    """
    from ridgefill.corpus import NAMED, load_corpus

    if isinstance(source, str) and source in NAMED:
        return _haystack("\n".join(load_corpus(source).documents), source)
    if isinstance(source, DatasetSource):
        rows = load_rows(source)
        return _haystack("\n".join(rows[source.column]), f"{source.name}:{source.split}")
    if isinstance(source, (str, os.PathLike)):
        path = Path(source)
        files = sorted(path.glob("*.txt")) if path.is_dir() else [path]
    else:
        files = [Path(p) for p in source]
    if not files:
        raise ValueError(f"no .txt haystack files in {source}")
    origin = str(source) if isinstance(source, (str, os.PathLike)) else f"{len(files)} files"
    return _haystack("\n".join(f.read_text(encoding="utf-8") for f in files), origin)


def load_rows(source: DatasetSource) -> Any:
    """The `datasets` split that `source` names (imported lazily: only dataset sources need it)."""
    import datasets

    s = source
    return datasets.load_dataset(s.name, s.config, split=s.split, data_files=s.data_files)


def _haystack(text: str, origin: str) -> Haystack:
    words = tuple(text.split())
    if not words:
        raise ValueError(f"haystack {origin} is empty")
    return Haystack(words, origin)


@contextlib.contextmanager
def hub_offline() -> Iterator[None]:
    """Make `datasets` / `huggingface_hub` use only the local cache (no 20 s of retries without network)."""
    import datasets.config
    import huggingface_hub.constants as hub

    saved = datasets.config.HF_HUB_OFFLINE, hub.HF_HUB_OFFLINE
    datasets.config.HF_HUB_OFFLINE = hub.HF_HUB_OFFLINE = True
    try:
        yield
    finally:
        datasets.config.HF_HUB_OFFLINE, hub.HF_HUB_OFFLINE = saved


def render(tokenizer: Any, user: str, answer_prefix: str) -> str:
    """Final prompt: chat template with `user` as the only user turn, generation prompt, answer prefix."""
    if getattr(tokenizer, "chat_template", None):
        messages = [{"role": "user", "content": user}]
        head = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    else:
        head = user
    return head + answer_prefix


def encode(tokenizer: Any, prompt: str, offsets: bool = False) -> dict[str, Any]:
    """Tokenize a rendered prompt; special tokens are added only when no chat template supplied them."""
    add_special = not getattr(tokenizer, "chat_template", None)
    return tokenizer(prompt, add_special_tokens=add_special, return_offsets_mapping=offsets)


def count_tokens(tokenizer: Any, text: str) -> int:
    """Token count of raw text, like RULER's `text_to_tokens` (no special tokens)."""
    return len(tokenizer(text, add_special_tokens=False)["input_ids"])


def largest_fitting(fits: Callable[[int], bool], start: int, floor: int) -> int:
    """Largest size >= floor with fits(size): gallop from `start`, then bisect (sizes ~monotone in tokens)."""
    lo = hi = max(start, floor)
    step = 1
    if fits(lo):
        hi = lo + step
        while fits(hi):
            lo, step = hi, step * 2
            hi = lo + step
    else:
        while True:
            lo = max(floor, hi - step)
            if fits(lo):
                break
            if lo == floor:
                raise ValueError("the target length is too short for this task's fixed text")
            hi, step = lo, step * 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo


def char_spans(prompt: str, needles: Sequence[str]) -> list[tuple[int, int]]:
    """Character spans of needles given in prompt order, each searched after the previous one."""
    spans, cursor = [], 0
    for needle in needles:
        start = prompt.find(needle, cursor)
        if start < 0:
            raise AssertionError(f"needle not found in prompt: {needle[:60]!r}")
        spans.append((start, start + len(needle)))
        cursor = start + len(needle)
    return spans


def token_span(offsets: Sequence[tuple[int, int]], start: int, end: int) -> tuple[int, int]:
    """[first, last+1) of the tokens whose character offsets overlap [start, end)."""
    hits = [i for i, (s, e) in enumerate(offsets) if s < end and e > start]
    if not hits:
        raise AssertionError(f"no token covers characters [{start}, {end})")
    return hits[0], hits[-1] + 1
