"""RULER generators and scorers checked against RULER's own definitions (NVIDIA/RULER scripts/)."""

from __future__ import annotations

import importlib.metadata
import json
import math
import random
import re
import time
from pathlib import Path

import pytest

from ridgefill import corpus
from ridgefill.corpus import load_corpus
from ridgefill.evals import ruler
from ridgefill.evals.ruler_common import DEPTHS, split_sentences
from ridgefill.evals.ruler_other import zeta

# Copied verbatim from NVIDIA/RULER scripts/data/synthetic/constants.py (commit c3f5e3b).
RULER_TASKS = {
    "niah": {
        "tokens_to_generate": 128,
        "template": """Some special magic {type_needle_v} are hidden within the following text. Make sure to memorize it. I will quiz you about the {type_needle_v} afterwards.\n{context}\nWhat are all the special magic {type_needle_v} for {query} mentioned in the provided text?""",  # noqa: E501
        "answer_prefix": """ The special magic {type_needle_v} for {query} mentioned in the provided text are""",  # noqa: E501
    },
    "variable_tracking": {
        "tokens_to_generate": 30,
        "template": """Memorize and track the chain(s) of variable assignment hidden in the following text.\n\n{context}\nQuestion: Find all variables that are assigned the value {query} in the text above.""",  # noqa: E501
        "answer_prefix": """ Answer: According to the chain(s) of variable assignment in the text above, {num_v} variables are assigned the value {query}, they are: """,  # noqa: E501
    },
    "common_words_extraction": {
        "tokens_to_generate": 120,
        "template": """Below is a numbered list of words. In these words, some appear more often than others. Memorize the ones that appear most often.\n{context}\nQuestion: What are the 10 most common words in the above list?""",  # noqa: E501
        "answer_prefix": """ Answer: The top 10 words that appear most often in the list are:""",
    },
    "freq_words_extraction": {
        "tokens_to_generate": 50,
        "template": """Read the following coded text and track the frequency of each coded word. Find the three most frequently appeared coded words. {context}\nQuestion: Do not provide any explanation. Please ignore the dots '....'. What are the three most frequently appeared words in the above coded text?""",  # noqa: E501
        "answer_prefix": """ Answer: According to the coded text above, the three most frequently appeared words are:""",  # noqa: E501
    },
    "qa": {
        "tokens_to_generate": 32,
        "template": """Answer the question based on the given documents. Only give me the answer and do not output any other words.\n\nThe following are given documents.\n\n{context}\n\nAnswer the question based on the given documents. Only give me the answer and do not output any other words.\n\nQuestion: {query}""",  # noqa: E501
        "answer_prefix": """ Answer:""",
    },
}
# niah.py
RULER_NEEDLE = "One of the special magic {type_needle_v} for {key} is: {value}."
RULER_NOISE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
SYNTHETIC = [t for t in ruler.TASKS if not t.startswith("qa")]
# Largest gap below the budget: about one haystack unit (a uuid needle line is ~80 tokens of SmolLM2).
SLACK = {"niah_multikey_3": 100}


@pytest.fixture(scope="module")
def tok():
    from transformers import AutoTokenizer

    from ridgefill.default_model import default_model_dir

    return AutoTokenizer.from_pretrained(default_model_dir())


@pytest.fixture(scope="module")
def hay() -> ruler.Haystack:
    """Natural text every install has, not pydoc (the installed packages' README prose): no ../shared."""
    return ruler.load_haystack("prose")


@pytest.fixture(scope="module")
def made(tok, hay) -> dict[tuple[str, int], list[ruler.Sample]]:
    return {(t, n): ruler.make_samples(t, tok, n, hay, n=2, seed=7) for t in SYNTHETIC for n in (1024, 2048)}


def split_prompt(tok, prompt: str) -> tuple[str, str]:
    """(user turn, answer prefix) of a prompt built as chat template + answer prefix."""
    head, tail = tok.apply_chat_template(
        [{"role": "user", "content": "\x00"}], tokenize=False, add_generation_prompt=True
    ).split("\x00")
    assert prompt.startswith(head)
    cut = prompt.rindex(tail)
    return prompt[len(head) : cut], prompt[cut + len(tail) :]


def pattern(template: str, tag: str = "", **fixed: str) -> str:
    """Regex for a RULER template: fixed fields literal, other fields as named groups."""
    parts = re.split(r"\{(\w+)\}", template)
    out, seen = [], set()
    for i, part in enumerate(parts):
        if i % 2 == 0:
            out.append(re.escape(part))
        elif part in fixed:
            out.append(re.escape(fixed[part]))
        else:
            out.append(f"(?P={tag}{part})" if part in seen else f"(?P<{tag}{part}>.*?)")
            seen.add(part)
    return "".join(out)


def niah_ruler_template(task: str) -> tuple[str, str, str]:
    """niah.py's template handling, verbatim: singular replacements on template+prefix, rfind split."""
    args = ruler.SPECS[task].args
    base = RULER_TASKS["niah"]
    template, type_needle_v = base["template"] + base["answer_prefix"], args["type_needle_v"]
    if args["num_needle_q"] * args["num_needle_v"] == 1:
        template = template.replace("Some", "A")
        template = template.replace("are all", "is")
        template = template.replace("are", "is")
        template = template.replace("answers", "answer")
        type_needle_v = type_needle_v[:-1]
    cut = template.rfind(base["answer_prefix"][:10])
    return template[:cut], template[cut:], type_needle_v


def parse(tok, sample: ruler.Sample) -> re.Match:
    """Match a sample's user turn against RULER's pinned template (fails if any character differs)."""
    user, prefix = split_prompt(tok, sample.prompt)
    family = ruler.SPECS[sample.task].family
    base = RULER_TASKS[family]
    if family == "niah":
        template, ruler_prefix, type_v = niah_ruler_template(sample.task)
        m = re.fullmatch(pattern(template, type_needle_v=type_v), user, re.S)
        assert m, user[:300]
        assert prefix == ruler_prefix.format(type_needle_v=type_v, query=m["query"])
    elif family == "variable_tracking":
        shot = pattern(base["template"] + base["answer_prefix"], "s_", num_v="5")
        m = re.fullmatch(shot + r" [A-Z]{3}(?: [A-Z]{3}){4}\n" + "\n" + pattern(base["template"]), user, re.S)
        assert m, user[:300]
        assert prefix == base["answer_prefix"].format(num_v=5, query=m["query"])
    elif family == "common_words_extraction":
        shot = pattern(base["template"] + base["answer_prefix"], "s_", query="")
        top10 = r" 1\. .+?(?: \d+\. .+?){9}\n"  # the few-shot example's answer
        m = re.fullmatch(shot + top10 + pattern(base["template"], query=""), user, re.S)
        assert m, user[:300]
        assert prefix == base["answer_prefix"]
    else:
        m = re.fullmatch(pattern(base["template"]), user, re.S)
        assert m, user[:300]
        assert prefix == base["answer_prefix"]
    return m


def test_constants_match_ruler():
    import numpy as np

    assert list(DEPTHS) == list(np.round(np.linspace(0, 100, num=40, endpoint=True)).astype(int))
    assert math.isclose(zeta(2.0), math.pi**2 / 6, rel_tol=1e-12)
    assert math.isclose(zeta(3.0), 1.2020569031595942, rel_tol=1e-12)
    assert set(ruler.TASKS) == {
        *(f"niah_single_{i}" for i in (1, 2, 3)),
        *(f"niah_multikey_{i}" for i in (1, 2, 3)),
        *("niah_multivalue", "niah_multiquery", "vt", "cwe", "fwe", "qa_1", "qa_2"),
    }
    for task, spec in ruler.SPECS.items():
        assert spec.max_new_tokens == RULER_TASKS[spec.family]["tokens_to_generate"], task


@pytest.mark.parametrize("task", SYNTHETIC)
def test_template_length_and_answers(tok, made, task):
    for length in (1024, 2048):
        for s in made[task, length]:
            m = parse(tok, s)
            budget = length - s.max_new_tokens
            assert budget - SLACK.get(task, 64) <= len(s.input_ids) <= budget, (length, len(s.input_ids))
            assert s.input_ids == tok(s.prompt, add_special_tokens=False)["input_ids"]
            if ruler.SPECS[task].family == "niah":
                args = ruler.SPECS[task].args
                assert len(s.answers) == args["num_needle_v"] * args["num_needle_q"]
                assert m["query"].count(", ") + 1 == args["num_needle_q"]
            if task == "vt":
                assert m["query"] in s.prompt and len(s.answers) == 5
            if task == "cwe":
                counts = [len(re.findall(rf"\d+\. {re.escape(w)}(?= \d|$)", m["context"])) for w in s.answers]
                assert counts == [6] * 10  # RULER's short-context (< 4096) repeats: 6 common vs 1
            if task == "fwe":
                words = m["context"].split()
                top = sorted(set(words) - {"..."}, key=words.count, reverse=True)[:3]
                assert sorted(top) == sorted(s.answers)


@pytest.mark.parametrize("task", [t for t in SYNTHETIC if t not in ("cwe", "fwe")])
def test_needles_at_depth(tok, made, task):
    args = ruler.SPECS[task].args
    for s in made[task, 2048]:
        m = parse(tok, s)
        user_start = s.prompt.index(m.string)
        lo, hi = user_start + m.start("context"), user_start + m.end("context")
        tok_lo, tok_hi = (len(tok(s.prompt[:i], add_special_tokens=False)["input_ids"]) for i in (lo, hi))
        assert len(s.needle_spans) == len(s.depths) > 0
        inserted = sorted(s.needle_spans + s.distractor_spans)
        texts = [tok.decode(s.input_ids[a:b]).strip() for a, b in inserted]
        haystack_chars = hi - lo - sum(len(t) for t in texts)
        haystack_tokens = tok_hi - tok_lo - sum(b - a for a, b in inserted)
        for (a, b), depth in zip(s.needle_spans, s.depths, strict=True):
            text = tok.decode(s.input_ids[a:b]).strip()
            before = [i for i, span in enumerate(inserted) if span[0] < a]
            if task == "vt":
                assert re.fullmatch(r"VAR [A-Z]{5} = (VAR [A-Z]{5}|\d{5})", text)
            else:
                needle = re.fullmatch(pattern(RULER_NEEDLE, type_needle_v=args["type_needle_v"]), text)
                assert needle["key"] in m["query"] and needle["value"] in s.answers
            where = s.prompt.index(text)
            assert lo <= where < hi
            # Share of haystack (needles taken out) before the needle, in characters and in tokens.
            chars = (where - lo - sum(len(texts[i]) for i in before)) / haystack_chars
            tokens = (a - tok_lo - sum(inserted[i][1] - inserted[i][0] for i in before)) / haystack_tokens
            assert abs(chars - depth / 100) < 0.15, (depth, chars)
            assert abs(tokens - depth / 100) < 0.15, (depth, tokens)
            # Exactly RULER's rule: sentences (essay) or lines (noise, needle, vt) before the needle.
            prefix = s.prompt[lo:where]
            if args["type_haystack"] == "essay":
                context = m["context"]
                for other in texts:
                    prefix, context = prefix.replace(other, ""), context.replace(other, "")
                total = len(split_sentences(context))
                assert len(split_sentences(prefix)) == int(total * depth / 100)
            else:
                assert math.isclose(prefix.count("\n"), depth / 100 * (m["context"].count("\n") + 1))
        if args["type_haystack"] == "essay":
            assert set(s.depths) <= set(DEPTHS)
        lines = [line for line in m["context"].split("\n") if line.strip() not in texts]
        if args["type_haystack"] == "noise":
            assert set(lines) == {RULER_NOISE}
        if args["type_haystack"] == "needle":
            needle = pattern(RULER_NEEDLE, type_needle_v=args["type_needle_v"])
            assert all(re.fullmatch(needle, line) for line in lines)
    if task == "niah_multikey_1":
        assert all(len(s.distractor_spans) == 3 for s in made[task, 2048])


def test_determinism(tok, hay, made):
    random.seed(1234)  # global state must not matter
    again = ruler.make_samples("niah_multivalue", tok, 1024, hay, n=3, seed=7)
    assert [s.prompt for s in again[:2]] == [s.prompt for s in made["niah_multivalue", 1024]]
    assert again[0].input_ids == made["niah_multivalue", 1024][0].input_ids
    other = ruler.make_samples("niah_multivalue", tok, 1024, hay, n=1, seed=8)
    assert other[0].prompt != again[0].prompt
    for task in ("vt", "cwe", "fwe", "niah_multikey_3"):
        first = ruler.make_samples(task, tok, 1024, None, n=1, seed=7)[0]
        assert first.prompt == made[task, 1024][0].prompt and first.answers == made[task, 1024][0].answers


def test_without_chat_template(tok, hay, monkeypatch):
    monkeypatch.setattr(tok, "chat_template", None)
    s = ruler.make_samples("niah_single_2", tok, 1024, hay, n=1, seed=1)[0]
    assert s.prompt.startswith("A special magic number is hidden") and s.prompt.endswith("provided text is")
    assert 1024 - 128 - 64 <= len(s.input_ids) <= 1024 - 128


def test_bad_requests(tok):
    with pytest.raises(ValueError, match="haystack"):
        ruler.make_samples("niah_single_2", tok, 1024, None)
    with pytest.raises(ValueError, match="too short"):
        ruler.make_samples("vt", tok, 600)  # RULER's vt few-shot example alone takes ~500 tokens
    with pytest.raises(ValueError, match="unknown"):
        ruler.make_samples("niah_single_9", tok, 1024)


def test_scores():
    assert ruler.sample_score("niah_single_1", "The number is 1234567.", ["1234567"]) == 100.0
    assert ruler.sample_score("niah_single_1", "The number is 7654321.", ["1234567"]) == 0.0
    assert ruler.sample_score("niah_multivalue", " 1, 2 and THREE", ["1", "three", "5", "4"]) == 50.0
    assert ruler.sample_score("cwe", "alpha beta", ["Alpha", "gamma", "delta"]) == 33.33
    assert ruler.score("vt", ["A B C D E", "A"], [list("ABCDE"), list("VWXYZ")]) == 50.0
    # string_match_part (qa): any reference counts fully; the mean over samples gives partial scores.
    assert ruler.sample_score("qa_1", "Paris, France", ["Lyon", "paris"]) == 100.0
    assert ruler.sample_score("qa_1", "London", ["Lyon", "paris"]) == 0.0
    assert ruler.score("qa_2", ["paris", "no", "rome"], [["Paris"], ["yes"], ["Rome", "x"]]) == 66.67
    assert ruler.score("niah_single_1", ["\x00 1234567\t"], [["1234567"]]) == 100.0
    with pytest.raises(ValueError):
        ruler.score("niah_single_1", [], [])


def test_region_of():
    assert ruler.region_of([(0, 3)], 100, sink=4, tail=10) == "sink"
    assert ruler.region_of([(90, 100), (95, 97)], 100, sink=4, tail=10) == "tail"
    assert ruler.region_of([(3, 5)], 100, sink=4, tail=10) == "bulk"  # straddles into a filled row
    assert ruler.region_of([(0, 2), (89, 91)], 100, sink=4, tail=10) == "bulk"
    assert ruler.region_of([(0, 2), (92, 93)], 100, sink=4, tail=10) == "sink+tail"
    assert ruler.region_of([], 100, sink=4, tail=10) == "none"
    assert ruler.region_of([(3, 8)], 10, sink=6, tail=6) == "sink+tail"  # no filled rows at all
    assert ruler.region_of([(1, 5)], 10, sink=6, tail=6) == "sink"
    with pytest.raises(ValueError):
        ruler.region_of([(5, 120)], 100, sink=4, tail=10)


def test_region_of_samples(made):
    s = made["niah_single_2", 1024][0]
    n = len(s.input_ids)
    a, b = s.needle_spans[0]
    assert ruler.region_of(s.needle_spans, n, sink=4, tail=16) == "bulk"  # needles sit inside the context
    assert ruler.region_of(s.needle_spans, n, sink=b, tail=0) == "sink"
    assert ruler.region_of(s.needle_spans, n, sink=0, tail=n - a) == "tail"


def test_load_haystack_sources(hay, tmp_path, monkeypatch):
    import datasets

    folder = tmp_path / "hay"
    folder.mkdir()
    (folder / "b.txt").write_text("gamma delta.\n")
    (folder / "a.txt").write_text("alpha  beta.")
    (folder / "notes.md").write_text("not read")
    assert ruler.load_haystack(folder).words == ("alpha", "beta.", "gamma", "delta.")  # sorted by name
    given = ruler.load_haystack([folder / "b.txt", folder / "a.txt"])  # a list keeps its order
    assert given.words == ("gamma", "delta.", "alpha", "beta.") and given.source == "2 files"
    rows = datasets.Dataset.from_dict({"body": ["alpha beta.", "gamma  delta."]})
    monkeypatch.setattr(datasets, "load_dataset", lambda *a, **k: rows)
    loaded = ruler.load_haystack(ruler.DatasetSource("x", column="body"))
    assert loaded.words == ("alpha", "beta.", "gamma", "delta.")
    for name in ("pydoc", "prose"):  # no files needed
        embedded = ruler.load_haystack(name)
        assert embedded.source == name and len(embedded.words) > 10_000
    assert hay.words == tuple("\n".join(load_corpus("prose").documents).split())
    assert set(hay.words[:5000]) - set(ruler.load_haystack("pydoc").words)  # another text than pydoc


def _dist(root: Path, name: str, body: str, kind: str = "text/markdown") -> None:
    """An installed distribution's metadata, as pip writes it (METADATA with the README as its payload)."""
    info = root / f"{name}-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(
        f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0\nDescription-Content-Type: {kind}\n\n{body}"
    )


def test_prose_keeps_sentences_of_readmes(tmp_path, monkeypatch):
    sentence = "The river runs past the old mill and the children watch the boats go by in the evening light."
    readme = "\n\n".join(
        [
            "# A heading with enough words to pass the paragraph length test if it were a paragraph.",
            f"{sentence} See [the guide](https://example.org/guide) for more about the mill and its long history.",
            "```python\nprint('a code block with many words in it that are not prose at all, no.')\n```",
            "- a list item that is long enough to count as a paragraph if lists were kept as prose.",
            "Too short.",
            "A paragraph of fifteen words or more that does not end a sentence so it is dropped here",
            f"Visit https://example.org/x and www.example.com today. {sentence}",
        ]
    )
    assert corpus.prose_paragraphs(readme) == [
        f"{sentence} See the guide for more about the mill and its long history.",
        f"Visit and today. {sentence}",
    ]
    for name, kind in (("zeta", "text/markdown"), ("alpha", "text/markdown"), ("rst-only", "text/x-rst")):
        _dist(tmp_path, name, "\n\n".join([f"{name} {sentence}"] * 12), kind)
    _dist(tmp_path, "ridgefill", "\n\n".join([sentence] * 12))  # this checkout's own README: left out
    found = list(importlib.metadata.distributions(path=[str(tmp_path)]))
    monkeypatch.setattr(importlib.metadata, "distributions", lambda: found)
    monkeypatch.setattr(corpus, "PROSE_MIN_WORDS", 100)
    corpus._prose.cache_clear()
    try:
        docs = corpus.load_corpus("prose").documents
        assert [d.split()[0] for d in docs] == ["alpha", "zeta"]  # name order, markdown only
        monkeypatch.setattr(corpus, "PROSE_MIN_WORDS", 10_000)
        corpus._prose.cache_clear()
        with pytest.raises(ValueError, match="fewer than 10000: use pydoc, text files or a dataset"):
            corpus.load_corpus("prose")
    finally:
        corpus._prose.cache_clear()


def squad_file(path: Path) -> Path:
    """A tiny file in RULER's SQuAD (dev-v2.0.json) layout: 3 articles x 20 paragraphs."""
    rng = random.Random(0)
    data = []
    for a in range(3):
        paragraphs = []
        for p in range(20):
            text = " ".join(rng.choice(["river", "stone", "city", "wind", "tower"]) for _ in range(40))
            answer = {"text": f"zq{a}x{p}"}
            qas = [
                {"question": f"What is code {a}-{p}?", "is_impossible": False, "answers": [answer]},
                {"question": "Unanswerable?", "is_impossible": True, "answers": []},
            ]
            paragraphs.append({"context": f"Paragraph {a}-{p} has code zq{a}x{p}. {text}.", "qas": qas})
        data.append({"title": f"Article {a}", "paragraphs": paragraphs})
    path.write_text(json.dumps({"data": data}))
    return path


def test_qa_from_ruler_json(tok, tmp_path):
    data = ruler.load_qa("squad", squad_file(tmp_path / "squad.json"))
    assert len(data.questions) == 60 and len(data.docs) == 60
    for length in (1024, 2048):
        samples = ruler.make_samples("qa_1", tok, length, data, n=2, seed=3)
        for i, s in enumerate(samples):
            m = parse(tok, s)
            assert m["query"] == data.questions[i].query and s.answers == [f"zq0x{i}"]
            assert length - 32 - 100 <= len(s.input_ids) <= length - 32  # one document is ~60 tokens
            ((a, b),) = s.needle_spans
            assert f"code zq0x{i}." in tok.decode(s.input_ids[a:b])
            # qa.py: the question's own paragraph, then its article's, then other documents.
            docs = re.findall(r"Document \d+:\nParagraph (\d)-", m["context"])
            assert docs.count("0") == min(20, len(docs))
            assert (len(docs) > 20) == (length == 2048)
    assert ruler.sample_score("qa_1", "zq0x0", samples[0].answers) == 100.0


def hotpot_row(q: int) -> dict:
    """A HotpotQA (distractor) row in the Hub layout: 10 paragraphs, 2 of them supporting."""
    titles = [f"T{q}-{i}" for i in range(10)]
    sentences = [[f"{t} is about city{q}{i}.", " More words here."] for i, t in enumerate(titles)]
    return {
        "question": f"Which city is {q}?",
        "answer": f"city{q}",
        "context": {"title": titles, "sentences": sentences},
        "supporting_facts": {"title": [titles[3], titles[7]], "sent_id": [0, 0]},
    }


def test_qa_from_hub_layouts(tok, tmp_path, monkeypatch):
    import datasets

    raw = json.loads(squad_file(tmp_path / "squad.json").read_text())["data"]
    squad_rows = []  # the same questions in the rajpurkar/squad_v2 row layout
    for d in raw:
        for p in d["paragraphs"]:
            for q in p["qas"]:
                texts = [a["text"] for a in q["answers"]]
                answers = {"text": texts, "answer_start": [0] * len(texts)}
                row = {"title": d["title"], "context": p["context"], "question": q["question"]}
                squad_rows.append({**row, "answers": answers})
    tables = {"squad": squad_rows, "hotpot": [hotpot_row(q) for q in range(6)]}

    def load_dataset(name: str, *args: object, **kwargs: object) -> datasets.Dataset:
        return datasets.Dataset.from_list(tables[name])

    monkeypatch.setattr(datasets, "load_dataset", load_dataset)
    via_hub = ruler.load_qa("squad", ruler.DatasetSource("squad"))
    assert via_hub == ruler.load_qa("squad", tmp_path / "squad.json")
    hotpot = ruler.load_qa("hotpotqa", ruler.DatasetSource("hotpot"))
    assert len(hotpot.docs) == 60 and len(hotpot.questions) == 6
    s = ruler.make_samples("qa_2", tok, 1024, hotpot, n=1, seed=0)[0]
    parse(tok, s)
    assert s.answers == ["city0"] and len(s.needle_spans) == 2
    gold = [tok.decode(s.input_ids[a:b]) for a, b in s.needle_spans]
    assert sorted(re.fullmatch(r"Document \d+:\n(T0-\d)\n.*", g, re.S)[1] for g in gold) == ["T0-3", "T0-7"]


def test_qa_unavailable_is_fast():
    start = time.monotonic()
    with pytest.raises(ruler.TaskUnavailable):
        ruler.load_qa("squad", ruler.DatasetSource("ridgefill-test/no-such-dataset", split="validation"))
    with pytest.raises(ruler.TaskUnavailable):
        ruler.load_qa("hotpotqa", "/nonexistent/hotpot.json")
    assert time.monotonic() - start < 10


@pytest.mark.parametrize("task", ["qa_1", "qa_2"])
def test_qa_default_datasets(tok, task):
    try:
        samples = ruler.make_samples(task, tok, 2048, None, n=1, seed=0)
    except ruler.TaskUnavailable as exc:
        pytest.skip(f"{task}: {exc}")
    parse(tok, samples[0])
    assert samples[0].needle_spans and samples[0].answers
