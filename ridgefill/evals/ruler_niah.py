"""RULER needle-in-a-haystack (`niah.py`) and variable tracking (`variable_tracking.py`) generators.

Each `prepare_*` returns a factory of per-sample `Job`s. Random draws follow RULER, except that what a sample
asks (keys, values, queries) is drawn before the haystack, so it stays fixed while the size is being fitted.
"""

from __future__ import annotations

import random
import string
import uuid
from collections.abc import Callable, Mapping
from typing import Any

from ridgefill.evals.ruler_common import (
    DEPTHS,
    NEEDLE,
    NOISE,
    TEMPLATES,
    Draft,
    Job,
    Setup,
    count_tokens,
    largest_fitting,
    split_sentences,
    wonder_words,
)

Placed = list[tuple[float, int]]  # (depth %, needle number) in prompt order


def random_value(rng: random.Random, kind: str) -> str:
    """RULER's `generate_random`: 7-digit number, adjective-noun word, or uuid4."""
    if kind == "numbers":
        return str(rng.randint(10**6, 10**7 - 1))
    if kind == "words":
        # Uniform over RULER's sorted set of f"{adj}-{noun}" (6.2M strings) without building it.
        return f"{rng.choice(wonder_words('adjective'))}-{rng.choice(wonder_words('noun'))}"
    if kind == "uuids":
        return str(uuid.UUID(int=rng.getrandbits(128), version=4))
    raise ValueError(f"unknown needle type {kind!r}")


def random_needle(rng: random.Random, args: Mapping[str, Any]) -> str:
    """A haystack line of RULER's "needle" haystack: a needle with a random key and value."""
    key, value = random_value(rng, args["type_needle_k"]), random_value(rng, args["type_needle_v"])
    return NEEDLE.format(type_needle_v=args["type_needle_v"], key=key, value=value)


def niah_templates(args: Mapping[str, Any]) -> tuple[str, str, str]:
    """Task template, answer prefix and type word, singularised as niah.py does for one answer."""
    template, prefix = TEMPLATES["niah"]["template"], TEMPLATES["niah"]["answer_prefix"]
    type_v = args["type_needle_v"]
    if args["num_needle_q"] * args["num_needle_v"] == 1:
        for old, new in (("Some", "A"), ("are all", "is"), ("are", "is"), ("answers", "answer")):
            template, prefix = template.replace(old, new), prefix.replace(old, new)
        type_v = type_v[:-1]
    return template, prefix, type_v


def essay_context(words: tuple[str, ...], size: int, needles: list[str], depths: list[int]) -> str:
    """Insert needles at sentence boundaries int(n_sentences * depth / 100) of the first `size` words."""
    repeats = -(-size // len(words))
    sents = split_sentences(" ".join((words * repeats)[:size]))
    cuts = [0] + [int(len(sents) * d / 100) for d in depths] + [len(sents)]
    parts = []
    for i in range(1, len(cuts)):
        parts.append(" ".join(sents[cuts[i - 1] : cuts[i]]))
        if i - 1 < len(needles):
            parts.append(needles[i - 1])
    return " ".join(parts)


def line_context(rng: random.Random, lines: list[str], needles: list[str]) -> tuple[str, Placed]:
    """Insert needles between haystack lines at random indexes (niah.py); return (depth %, needle no.)."""
    n = len(lines)
    indexes = sorted(rng.sample(range(n), len(needles)), reverse=True)
    for index, needle in zip(indexes, needles, strict=True):
        lines.insert(index, needle)
    # A needle inserted at `index` moves down once for every later insertion at a smaller index.
    final = [(index + len(needles) - 1 - m, m) for m, index in enumerate(indexes)]
    return "\n".join(lines), sorted((100 * pos / len(lines), m) for pos, m in final)


def prepare_niah(setup: Setup) -> Callable[[int], Job]:
    """Job factory for niah_* tasks; `size` is words (essay) or lines (noise / needle haystack)."""
    args, haystack, seed = setup.args, setup.haystack, setup.seed
    kind = args["type_haystack"]
    if kind == "essay" and haystack is None:
        raise ValueError("this RULER task uses the essay haystack: pass `haystack=load_haystack(...)`")
    template, prefix, type_word = niah_templates(args)
    num_k = max(args["num_needle_k"], args["num_needle_q"])

    def job(index: int) -> Job:
        def build(size: int) -> Draft:
            rng = setup.rng(index)
            keys = [random_value(rng, args["type_needle_k"]) for _ in range(num_k)]
            per_key = range(args["num_needle_v"])
            values = [[random_value(rng, args["type_needle_v"]) for _ in per_key] for _ in keys]
            needles = [
                (NEEDLE.format(type_needle_v=args["type_needle_v"], key=k, value=v), i)
                for i, k in enumerate(keys)
                for v in values[i]
            ]
            random.Random(seed).shuffle(needles)
            asked = rng.sample(range(num_k), args["num_needle_q"])
            texts = [t for t, _ in needles]
            if kind == "essay":
                depths = sorted(rng.sample(DEPTHS, len(needles)))
                context = essay_context(haystack.words, size, texts, depths)
                placed = [(float(d), m) for m, d in enumerate(depths)]
            else:
                lines = [NOISE] * size if kind == "noise" else [random_needle(rng, args) for _ in range(size)]
                context, placed = line_context(rng, lines, texts)
            queries = [keys[i] for i in asked]
            query = ", ".join(queries[:-1]) + ", and " + queries[-1] if len(queries) > 1 else queries[0]
            fields = {"type_needle_v": type_word, "query": query}
            return Draft(
                user=template.format(context=context, **fields),
                answer_prefix=prefix.format(**fields),
                answers=[v for i in asked for v in values[i]],
                needles=[texts[m] for _, m in placed if needles[m][1] in asked],
                depths=[d for d, m in placed if needles[m][1] in asked],
                distractors=[texts[m] for _, m in placed if needles[m][1] not in asked],
            )

        floor = 1 if kind == "essay" else num_k * args["num_needle_v"]
        return Job(build, floor=floor, probe=500 if kind == "essay" else 25)

    return job


def vt_chain(rng: random.Random, num_hops: int, icl: bool) -> tuple[list[str], list[str]]:
    """One chain of `variable_tracking.generate_chains`: names and statements (the value first)."""
    k = 3 if icl else 5
    names: list[str] = []
    while len(names) < num_hops + 1:
        name = "".join(rng.choices(string.ascii_uppercase, k=k))
        if name not in names:
            names.append(name)
    value = "12345" if icl else str(rng.randrange(10000, 99999))
    chain = [f"VAR {names[0]} = {value}"] + [f"VAR {names[j + 1]} = VAR {names[j]} " for j in range(num_hops)]
    return names, chain


def vt_draft(rng: random.Random, size: int, num_hops: int, icl: bool) -> Draft:
    """RULER's variable tracking input on the noise haystack (`size` noise lines)."""
    names, chain = vt_chain(rng, num_hops, icl)
    lines = [NOISE] * size
    positions = sorted(rng.sample(range(len(lines)), len(chain)))
    for j, pos in enumerate(positions):
        lines.insert(pos + j, chain[j])
    total = len(lines)
    context = "\n".join(lines).replace(". \n", ".\n")
    value = chain[0].split("=")[-1].strip()
    fields = {"query": value, "num_v": num_hops + 1}
    spec = TEMPLATES["variable_tracking"]
    return Draft(
        user=spec["template"].format(context=context, **fields),
        answer_prefix=spec["answer_prefix"].format(**fields),
        answers=names,
        needles=[s.strip() for s in chain],
        depths=[100 * (pos + j) / total for j, pos in enumerate(positions)],
    )


def vt_icl_example(tokenizer: Any, seed: int, num_hops: int) -> str:
    """RULER's few-shot example: a 3-letter chain in <= 500 raw tokens, with its answer appended."""

    def fits(size: int) -> bool:
        draft = vt_draft(random.Random(f"ruler-vt-icl:{seed}"), size, num_hops, icl=True)
        return count_tokens(tokenizer, draft.user + draft.answer_prefix) <= 500

    size = largest_fitting(fits, start=5, floor=5)
    draft = vt_draft(random.Random(f"ruler-vt-icl:{seed}"), size, num_hops, icl=True)
    return draft.user + draft.answer_prefix + " " + " ".join(draft.answers) + "\n"


def randomize_icl(rng: random.Random, example: str, num_hops: int) -> str:
    """`variable_tracking.randomize_icl`: fresh names for the answer variables, fresh value for 12345."""
    for item in example.strip().split()[-num_hops - 1 :]:
        example = example.replace(item, "".join(rng.choices(string.ascii_uppercase, k=len(item))))
    return example.replace("12345", str(rng.randrange(10000, 99999)))


def prepare_vt(setup: Setup) -> Callable[[int], Job]:
    """Job factory for vt: RULER's few-shot example, then the task, both in the user turn."""
    args = setup.args
    if args.get("type_haystack", "noise") != "noise" or args["num_chains"] != 1:
        raise NotImplementedError("only RULER's vt configuration (noise haystack, one chain) is implemented")
    hops = args["num_hops"]
    example = vt_icl_example(setup.tokenizer, setup.seed, hops)

    def job(index: int) -> Job:
        def build(size: int) -> Draft:
            rng = setup.rng(index)
            shot = randomize_icl(rng, example, hops)
            draft = vt_draft(rng, size, hops, icl=False)
            draft.user = shot + "\n" + draft.user
            return draft

        return Job(build, floor=hops + 1, probe=10)

    return job
