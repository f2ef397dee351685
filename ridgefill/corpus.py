"""Calibration text: where it comes from, how it is cut into token windows, and its hash.

Sources: the embedded default (the stdlib's `pydoc_data.topics`, ~750 KB of English prose every Python
install has), local text files or folders, or a `datasets` dataset ("hf:name[:config]:split[:column]").
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

DEFAULT_SOURCE = "pydoc"


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


def load_corpus(source: str | list[str] = DEFAULT_SOURCE) -> Corpus:
    """Load calibration documents from `pydoc`, text files/folders, or `hf:name[:config]:split[:column]`."""
    if isinstance(source, str | Path) and str(source) == DEFAULT_SOURCE:
        from pydoc_data.topics import topics

        return Corpus(DEFAULT_SOURCE, [topics[k] for k in sorted(topics)])
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
