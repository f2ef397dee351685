"""Needle retrieval at one length, exact vs identity vs ridge fill, with and without a protected share.

Uses RULER's niah_single_2 (essay haystack, word key, 7-digit value) from `ridgefill.evals.ruler`, on
a haystack held out from calibration, and reports accuracy overall and for needles in bulk rows.

    python bench/niah.py --maps /tmp/rf-bench/maps --haystack ../shared/data/essays --length 2048 \
        --splits 15 18 20 --shares 0 0.1 0.25 --samples 10
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from ridgefill.evals.ruler import load_haystack, make_samples, region_of, sample_score
from ridgefill.maps import load_maps
from ridgefill.rows import ROWS, RowPolicy
from ridgefill.runtime import FillPlan, generate
from ridgefill.steps import load_model


def haystack_files(folder: Path) -> list[Path]:
    """The second half of the folder by name: the first half is calibration text."""
    files = sorted(folder.glob("*.txt"))
    return files[len(files) // 2 :]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="default")
    ap.add_argument("--maps", type=Path, required=True)
    ap.add_argument("--haystack", type=Path, required=True)
    ap.add_argument("--task", default="niah_single_2")
    ap.add_argument("--length", type=int, default=2048)
    ap.add_argument("--splits", type=int, nargs="+", default=[15, 18, 20])
    ap.add_argument("--shares", type=float, nargs="+", default=[0.0, 0.1, 0.25])
    ap.add_argument("--samples", type=int, default=10)
    ap.add_argument("--sink", type=int, default=ROWS.sink)
    ap.add_argument("--tail", type=int, default=ROWS.tail)
    args = ap.parse_args()
    model, tok = load_model(args.model)
    samples = make_samples(args.task, tok, args.length, load_haystack(haystack_files(args.haystack)), args.samples)
    plans = {"exact": FillPlan()}
    for s in args.splits:
        plans[f"identity S={s}"] = FillPlan("identity", split=s, rows=RowPolicy(sink=args.sink, tail=args.tail))
        maps = load_maps(args.maps / f"S{s}-ridge", model, tok)
        for share in args.shares:
            plans[f"ridge S={s} share={share:g}"] = FillPlan(
                "ridge", maps=maps, rows=RowPolicy(sink=args.sink, tail=args.tail, share=share)
            )
    regions = [region_of(x.needle_spans, len(x.input_ids), args.sink, args.tail) for x in samples]
    print(
        f"{args.task} at {args.length} tokens, {len(samples)} samples, sink {args.sink}, tail {args.tail}; "
        f"needle regions: {', '.join(f'{r}={regions.count(r)}' for r in sorted(set(regions)))}\n"
    )
    print("| config | accuracy (all) | accuracy (needle in bulk rows) |")
    print("|---|---|---|")
    for name, plan in plans.items():
        scores = []
        for x in samples:
            new = generate(model, torch.tensor([x.input_ids]), plan, x.max_new_tokens)
            scores.append(sample_score(args.task, tok.decode(new[0], skip_special_tokens=True), x.answers))
        bulk = [s for s, r in zip(scores, regions, strict=True) if r == "bulk"]
        print(
            f"| {name} | {sum(scores) / len(scores):.1f} | "
            f"{(sum(bulk) / len(bulk)) if bulk else float('nan'):.1f} (n={len(bulk)}) |",
            flush=True,
        )


if __name__ == "__main__":
    main()
