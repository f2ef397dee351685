"""Prefill time, exact vs RidgeFill (transformers runtime), as ratios from the same run.

Each repeat runs exact, then every split, after a warm-up. Reports medians, the ratio exact/ridge
and the FLOP-model bound.

    python bench/prefill_time.py --maps /tmp/rf-bench/maps --lengths 2048 4096 --splits 10 15 18 20
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from ridgefill.evals.ttft import random_prompt
from ridgefill.flops import speedup_bound
from ridgefill.maps import load_maps
from ridgefill.rows import ROWS, RowPolicy
from ridgefill.runtime import FillPlan, prefill, protected_rows
from ridgefill.steps import load_model


def timed(model, ids, plan) -> float:
    t = time.perf_counter()
    prefill(model, ids, plan)
    return time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="default")
    ap.add_argument("--maps", type=Path, required=True, help="folder holding S{split}-ridge map folders")
    ap.add_argument("--lengths", type=int, nargs="+", default=[2048, 4096])
    ap.add_argument("--splits", type=int, nargs="+", default=[10, 15, 18, 20])
    ap.add_argument("--tail", type=int, default=ROWS.tail)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    model, tok = load_model(args.model)
    threads = torch.get_num_threads()
    print(f"torch {torch.__version__}, {threads} threads, float32, tail {args.tail}, sink {ROWS.sink}\n")
    print("| tokens | S | exact s (median) | ridge s (median) | speed-up exact/ridge | FLOP bound |")
    print("|---|---|---|---|---|---|")
    plans = {
        s: FillPlan("ridge", maps=load_maps(args.maps / f"S{s}-ridge", model, tok), rows=RowPolicy(tail=args.tail))
        for s in args.splits
    }
    for n in args.lengths:
        ids = random_prompt(tok.vocab_size, n)
        for plan in [FillPlan(), *plans.values()]:  # warm-up
            timed(model, ids, plan)
        exact, ridge = [], {s: [] for s in plans}
        for _ in range(args.repeats):  # each repeat: exact, then every split, so drift hits all alike
            exact.append(timed(model, ids, FillPlan()))
            for s, plan in plans.items():
                ridge[s].append(timed(model, ids, plan))
        ea = statistics.median(exact)
        for s, plan in plans.items():
            eb = statistics.median(ridge[s])
            bound = speedup_bound(model.config, n, s, int(protected_rows(ids, plan).sum()))
            print(f"| {n} | {s} | {ea:.3f} | {eb:.3f} | {ea / eb:.2f}x | {bound:.2f}x |", flush=True)


if __name__ == "__main__":
    main()
