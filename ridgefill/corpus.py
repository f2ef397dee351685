"""Calibration text: where it comes from, how it is cut into token windows, and its hash.

Sources: the embedded default (the stdlib's `pydoc_data.topics`, ~750 KB of English prose every Python
install has), `prose` (the installed packages' README prose, also offline and not pydoc: a haystack or
calibration text from another domain than the default's), local text files or folders, or a `datasets`
dataset ("hf:name[:config]:split[:column]").
"""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

DEFAULT_SOURCE = "pydoc"
PROSE = "prose"
# prose: a paragraph is kept with at least this many words, a distribution with at least this many kept words,
# and the whole source must reach the last figure (a smaller install has too little text to be a haystack)
PROSE_PARAGRAPH_WORDS = 15
PROSE_DOC_WORDS = 150
PROSE_MIN_WORDS = 20_000
_KEPT, _BREAKS = ("text", "code_inline"), ("softbreak", "hardbreak")  # link marks, images and HTML give ""
_URL = re.compile(r"\S*(?:://|www\.)\S*")


@dataclass
class Corpus:
    source: str
    documents: list[str]

    @property
    def sha256(self) -> str:
        h = hashlib.sha256()
        for doc in self.documents:
            h.update(hashlib.sha256(doc.encode()).digest())
        return h.hexdigest()


def pydoc_documents() -> list[str]:
    """The stdlib's pydoc topics in key order: English prose, but Python's own documentation."""
    from pydoc_data.topics import topics

    return [topics[k] for k in sorted(topics)]


def prose_paragraphs(markdown: str) -> list[str]:
    """The top-level paragraphs of a markdown text as plain sentences: headings, lists, tables, quotes, HTML
    and code blocks dropped (they are not prose), link text kept and URLs dropped; a paragraph is kept only
    when it has `PROSE_PARAGRAPH_WORDS` words and ends a sentence."""
    from markdown_it import MarkdownIt

    tokens = MarkdownIt("commonmark").enable("table").parse(markdown)
    out = []
    for opening, inline in zip(tokens, tokens[1:], strict=False):
        if opening.type != "paragraph_open" or opening.level != 0 or not inline.children:
            continue
        parts = [c.content if c.type in _KEPT else " " if c.type in _BREAKS else "" for c in inline.children]
        words = _URL.sub(" ", "".join(parts)).split()
        if len(words) >= PROSE_PARAGRAPH_WORDS and words[-1][-1] in ".!?":
            out.append(" ".join(words))
    return out


def prose_documents() -> list[str]:
    """The installed distributions' markdown long descriptions (their READMEs) as plain prose, one document
    per distribution in name order; RidgeFill's own (it changes with this checkout) and repeats are left out.
    Offline on any install of this package; what it holds follows the installed packages (its words' sha256
    names it wherever it is used). Read once per process (about a second)."""
    return list(_prose())


@functools.cache
def _prose() -> tuple[str, ...]:
    seen, docs = set(), {}
    for dist in importlib.metadata.distributions():
        meta = dist.metadata
        name = re.sub(r"[-_.]+", "-", (meta["Name"] or "")).lower()
        if name in ("", "ridgefill") or name in docs or "markdown" not in (meta["Description-Content-Type"] or ""):
            continue
        text = "\n\n".join(prose_paragraphs(meta.get_payload() or meta["Description"] or ""))
        if len(text.split()) >= PROSE_DOC_WORDS and text not in seen:
            seen.add(text)
            docs[name] = text
    words = sum(len(d.split()) for d in docs.values())
    if words < PROSE_MIN_WORDS:
        raise ValueError(
            f"the installed packages' READMEs hold {words} words of prose, fewer than {PROSE_MIN_WORDS}: "
            "use pydoc, text files or a dataset instead"
        )
    return tuple(docs[k] for k in sorted(docs))


NAMED: dict[str, Callable[[], list[str]]] = {DEFAULT_SOURCE: pydoc_documents, PROSE: prose_documents}


def load_corpus(source: str | list[str] = DEFAULT_SOURCE) -> Corpus:
    """Load calibration documents from `pydoc`, `prose`, text files/folders, or `hf:name[:config]:split[:column]`."""
    if isinstance(source, str | Path) and str(source) in NAMED:
        return Corpus(str(source), NAMED[str(source)]())
    if isinstance(source, str) and source.startswith("hf:"):
        return _load_dataset(source)
    paths = [Path(p) for p in ([source] if isinstance(source, str | Path) else source)]
    files: list[Path] = []
    for p in paths:
        if p.is_dir():
            files += sorted(p.rglob("*.txt"))
        elif p.is_file():
            files.append(p)
        else:
            raise FileNotFoundError(f"calibration source {p} does not exist")
    if not files:
        raise ValueError(f"no .txt files found in {source}")
    return Corpus(",".join(str(p) for p in paths), [f.read_text(encoding="utf-8") for f in files])


def _load_dataset(source: str) -> Corpus:
    import datasets

    parts = source[3:].split(":")
    if len(parts) < 2:
        raise ValueError("a dataset source is hf:name[:config]:split[:column]")
    column = "text"
    if len(parts) == 4:
        name, config, split, column = parts
    elif len(parts) == 3:
        name, split, column = parts[0], parts[1], parts[2]
        config = None
    else:
        (name, split), config = parts, None
    ds = datasets.load_dataset(name, config, split=split)
    return Corpus(source, [row[column] for row in ds if row[column]])


def token_stream(corpus: Corpus, tokenizer) -> Tensor:
    """All documents tokenized and joined with the EOS token (no special tokens inside documents)."""
    sep = tokenizer.eos_token_id
    ids: list[int] = []
    for doc in corpus.documents:
        ids += tokenizer(doc, add_special_tokens=False)["input_ids"]
        if sep is not None:
            ids.append(sep)
    return torch.tensor(ids, dtype=torch.long)


def windows(stream: Tensor, length: int) -> Tensor:
    """Cut a token stream into [count, length] non-overlapping windows (the remainder is dropped)."""
    count = stream.numel() // length
    if count == 0:
        raise ValueError(f"the corpus has {stream.numel()} tokens, fewer than one window of {length}")
    return stream[: count * length].view(count, length)
