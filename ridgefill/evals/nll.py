"""Paired dNLL: how much a RidgeFill cache hurts the model's prediction of what follows.

Each document is cut to `length` tokens; its context (all but the last `scored` tokens) is prefilled
once exactly and once with the plan; the stock model then scores the last `scored` tokens over each
cache. dNLL = mean NLL(RidgeFill) - mean NLL(exact) per document, with a bootstrap 95% CI over
documents, plus top-1 agreement of the two next-token predictions.
"""

from __future__ import annotations

import random
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ridgefill.runtime import FillPlan, prefill


@dataclass
class DocNLL:
    index: int
    nll_exact: float
    nll_fill: float
    top1_agree: float

    @property
    def dnll(self) -> float:
        return self.nll_fill - self.nll_exact


def documents(stream: Tensor, length: int, count: int) -> list[Tensor]:
    """Non-overlapping `length`-token documents from a token stream."""
    n = min(count, stream.numel() // length)
    if n == 0:
        raise ValueError(f"the text has {stream.numel()} tokens, fewer than one document of {length}")
    return [stream[i * length : (i + 1) * length] for i in range(n)]


@torch.inference_mode()
def continuation_logits(model: nn.Module, ids: Tensor, plan: FillPlan, scored: int) -> Tensor:
    """Logits [scored, vocab] predicting the last `scored` tokens of ids [n], over a plan's cache."""
    ctx, cont = ids[None, :-scored], ids[None, -scored:]
    pre = prefill(model, ctx, plan)
    n = ctx.shape[1]
    out = model(
        input_ids=cont[:, :-1],
        past_key_values=pre.cache,
        use_cache=True,
        position_ids=torch.arange(n, n + scored - 1)[None],
    )
    return torch.cat([pre.logits[None], out.logits[0]], dim=0)


def doc_nll(model: nn.Module, ids: Tensor, plan: FillPlan, scored: int, index: int = 0) -> DocNLL:
    target = ids[-scored:]
    exact = continuation_logits(model, ids, FillPlan(), scored).float()
    fill = continuation_logits(model, ids, plan, scored).float()
    return DocNLL(
        index,
        float(F.cross_entropy(exact, target)),
        float(F.cross_entropy(fill, target)),
        float((exact.argmax(-1) == fill.argmax(-1)).float().mean()),
    )


def bootstrap_ci(values: list[float], reps: int = 2000, seed: int = 0) -> tuple[float, float]:
    """Percentile 95% CI of the mean."""
    rng = random.Random(seed)
    means = sorted(sum(rng.choices(values, k=len(values))) / len(values) for _ in range(reps))
    return means[int(0.025 * reps)], means[int(0.975 * reps) - 1]


def summarize(docs: list[DocNLL]) -> dict:
    d = [x.dnll for x in docs]
    lo, hi = bootstrap_ci(d)
    return {
        "documents": len(docs),
        "nll_exact": sum(x.nll_exact for x in docs) / len(docs),
        "nll_fill": sum(x.nll_fill for x in docs) / len(docs),
        "dnll": sum(d) / len(d),
        "dnll_ci95": [lo, hi],
        "top1_agree": sum(x.top1_agree for x in docs) / len(docs),
        "per_document": [asdict(x) | {"dnll": x.dnll} for x in docs],
    }


def evaluate_nll(model: nn.Module, docs: list[Tensor], plan: FillPlan, scored: int = 512) -> dict:
    if any(doc.numel() <= scored + 1 for doc in docs):
        raise ValueError(f"documents must be longer than the {scored} scored tokens")
    return summarize([doc_nll(model, doc, plan, scored, i) for i, doc in enumerate(docs)])
