"""RULER on a vLLM engine: all samples of a task x length go to the engine as one batch.

Same prompts, answers, scoring and rows as the transformers runtime (`ruler_run.run_ruler`); each
sample also carries the engine's per-step logprob margin (top-1 minus top-2), so that a prediction
that differs from another runtime's can be told apart from a near-tie.
"""

from __future__ import annotations

from ridgefill.evals.ruler_run import Cells, aggregate, sample_row
from ridgefill.runtime import FillPlan


def served_plan(llm) -> FillPlan:
    """The plan the engine serves with RidgeFill on (its verified maps and row policy); exact on a stock engine."""
    from ridgefill.vllm_plugin.offline import served_model

    state = getattr(served_model(llm), "ridgefill", None)
    if state is None:
        return FillPlan()
    return FillPlan(state.mode, state.split, state.maps, rows=state.classifier.policy)


def generate_batch(llm, prompts: list[list[int]], max_new_tokens: list[int], margins: bool) -> list[dict]:
    """Greedy-generate every prompt in one `generate` call: {"tokens", "margins"} per prompt, in order."""
    from vllm import SamplingParams, TokensPrompt

    params = [SamplingParams(temperature=0.0, max_tokens=m, logprobs=2 if margins else None) for m in max_new_tokens]
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
    results = []
    for o in outs:
        c = o.outputs[0]
        steps = c.logprobs or []
        gaps = [_margin(step) for step in steps] if margins else None
        results.append({"tokens": list(c.token_ids), "margins": gaps})
    return results


def _margin(step: dict) -> float:
    """top-1 minus top-2 logprob of one decode step (inf when only one token was returned)."""
    lps = sorted((float(lp.logprob) for lp in step.values()), reverse=True)
    return lps[0] - lps[1] if len(lps) > 1 else float("inf")


def run_ruler_vllm(llm, tokenizer, plans: dict[str, str], cells: Cells, margins: bool = False) -> dict:
    """`run_ruler`'s result on one engine (the same `cells`' prompts); `plans` maps a name to "exact" or
    "served" (the engine's maps).

    RidgeFill is switched on or off per plan between batches (never while a request is in flight).
    """
    from ridgefill.vllm_plugin.offline import served_model

    state = getattr(served_model(llm), "ridgefill", None)
    served = served_plan(llm)
    for name, kind in plans.items():
        if kind not in ("exact", "served"):
            raise ValueError(f"plan {name!r}: vLLM serves 'exact' or 'served' (the engine's maps), not {kind!r}")
        if kind == "served" and state is None:
            raise RuntimeError(f"plan {name!r}: the engine serves no RidgeFill maps (see its warning)")
    cells, skipped = cells.drawn(tokenizer)
    rows = []
    try:
        for task, length, batch in cells:
            for name, kind in plans.items():
                if state is not None:
                    state.enabled = kind == "served"
                plan = served if kind == "served" else FillPlan()
                outs = generate_batch(llm, [x.input_ids for x in batch], [x.max_new_tokens for x in batch], margins)
                for x, out in zip(batch, outs, strict=True):
                    row = sample_row(name, plan, task, length, x, out["tokens"], tokenizer)
                    if margins:
                        row["margins"] = out["margins"]
                    rows.append(row)
    finally:
        if state is not None:
            state.enabled = True
    return {"samples": rows, "scores": aggregate(rows), "skipped": skipped}
