"""Score RULER tasks with a fill plan: every sample's outcome, and per-task scores by needle region.

The filled-region score of a task is its score over samples whose needle(s) lie in bulk rows, the
rows RidgeFill approximates; this is where a fitted map is compared with identity fill.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

import torch
from torch import nn
from tqdm import tqdm

from ridgefill.evals.ruler import TaskUnavailable, make_samples, region_of, sample_score
from ridgefill.runtime import FillPlan, generate


@dataclass(frozen=True)
class Cells:
    """Which RULER prompts a run scores, the same on every engine: `tasks` x `lengths` on `haystack`, sample indices
    `first`..`samples`-1 drawn with `seed` (a promoted trial adds samples to those it scored)."""

    tasks: list[str]
    lengths: list[int]
    haystack: object
    samples: int = 10
    seed: int = 0
    first: int = 0

    def drawn(self, tokenizer):
        """`sample_cells` of these prompts: ([(task, length, samples)], skipped)."""
        return sample_cells(tokenizer, self.tasks, self.lengths, self.haystack, self.samples, self.seed, self.first)


def run_ruler(model: nn.Module, tokenizer, plans: dict[str, FillPlan], cells: Cells, progress: bool = True) -> dict:
    """{"samples": [...], "scores": {plan: {task: {length: {"all", "bulk", "tail", "sink", "n_*"}}}}} over the
    `cells`' prompts."""
    device = next(model.parameters()).device
    cells, skipped = cells.drawn(tokenizer)
    rows = []
    for task, length, batch in cells:
        for name, plan in plans.items():
            for x in tqdm(batch, desc=f"{task}@{length} {name}", disable=not progress, leave=False):
                ids = torch.tensor([x.input_ids], device=device)
                new = generate(model, ids, plan, x.max_new_tokens)[0].tolist()
                rows.append(sample_row(name, plan, task, length, x, new, tokenizer))
    return {"samples": rows, "scores": aggregate(rows), "skipped": skipped}


def sample_cells(tokenizer, tasks: list[str], lengths: list[int], haystack, samples: int, seed: int, first: int = 0):
    """([(task, length, samples first..samples-1)], skipped): every engine scores the same prompts, task by
    length (sample i does not depend on how many are drawn)."""
    cells, skipped = [], []
    for task in tasks:
        for length in lengths:
            try:
                cells.append((task, length, make_samples(task, tokenizer, length, haystack, samples, seed)[first:]))
            except TaskUnavailable as e:
                skipped.append({"task": task, "length": length, "why": str(e)})
    return cells, skipped


def sample_row(name: str, plan: FillPlan, task: str, length: int, x, new: list[int], tokenizer) -> dict:
    """One sample's outcome under `plan`: its generated tokens, decoded prediction, score and needle region."""
    text = tokenizer.decode(new, skip_special_tokens=True)
    region = (
        region_of(x.needle_spans, len(x.input_ids), plan.rows.sink, plan.rows.tail) if plan.mode != "exact" else "exact"
    )
    return {
        "plan": name,
        "task": task,
        "length": length,
        "index": x.index,
        "region": region,
        "score": sample_score(task, text, x.answers),
        "prediction": text,
        "tokens": new,
        "answers": x.answers,
        "depths": x.depths,
    }


def aggregate(rows: list[dict]) -> dict:
    """Mean score per plan, task and length: overall and per needle region."""
    groups: dict[tuple, list[dict]] = defaultdict(list)
    for r in rows:
        groups[(r["plan"], r["task"], r["length"])].append(r)
    out: dict = {}
    for (plan, task, length), rs in groups.items():
        cell = {"all": sum(r["score"] for r in rs) / len(rs), "n": len(rs)}
        for region in ("sink", "bulk", "tail"):
            sel = [r["score"] for r in rs if r["region"] == region]
            cell[region] = sum(sel) / len(sel) if sel else None
            cell[f"n_{region}"] = len(sel)
        out.setdefault(plan, {}).setdefault(task, {})[str(length)] = cell
    return out


def table(scores: dict) -> str:
    """A compact markdown table: one row per plan x task x length."""
    lines = [
        "| plan | task | length | score | filled-region (bulk) | tail | n (bulk/tail) |",
        "|---|---|---|---|---|---|---|",
    ]
    fmt = lambda v: "-" if v is None else f"{v:.1f}"  # noqa: E731
    for plan, tasks in scores.items():
        for task, lengths in tasks.items():
            for length, c in lengths.items():
                lines.append(
                    f"| {plan} | {task} | {length} | {c['all']:.1f} | {fmt(c['bulk'])} | {fmt(c['tail'])} | "
                    f"{c['n_bulk']}/{c['n_tail']} |"
                )
    return "\n".join(lines)
