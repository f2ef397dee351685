"""Two plans of `bench/ruler_suite.py` results paired on the same samples (the same prompts, so any two runs
of the suite with one seed, haystack and lengths pair), with the suite's own statistics: the mean delta over
tasks with a bootstrap 95% CI within tasks (`ridgefill.evals.paired`), and the filled-region score of both on
the needle samples whose needles lie in filled rows under both plans (mean over samples, bootstrap over samples).

    python bench/paired_plans.py bench/results/ruler_suite_reach_B_s18_q08_t128.json:ridge+question \\
        bench/results/ruler_suite_4k_identity.json:identity
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

from ridgefill.evals.paired import bootstrap_mean, paired_summary

NEEDLE_FREE = ("cwe", "fwe")


def samples(spec: str, name: str) -> list[dict]:
    """Rows of FILE:PLAN (a suite's OUT.json or OUT.jsonl), renamed to `name`."""
    path, _, plan = spec.rpartition(":")
    if not path or not Path(path).is_file():
        raise SystemExit(f"error: {spec} is not FILE:PLAN with an existing FILE (a ruler_suite OUT.json or .jsonl)")
    text = Path(path).read_text()
    rows = json.loads(text)["samples"] if path.endswith(".json") else [json.loads(line) for line in text.splitlines()]
    picked = [dict(r, plan=name) for r in rows if r["plan"] == plan]
    if not picked:
        raise SystemExit(f"error: {path} holds no rows of plan {plan!r}")
    return picked


def filled_region(a: list[dict], b: list[dict], length: int) -> dict:
    """Both plans' scores on the needle samples whose needles lie in filled rows under both, and a's delta."""
    key = lambda r: (r["task"], r["index"])  # noqa: E731
    bulk_b = {key(r): r["score"] for r in b if r["length"] == length and r["region"] == "bulk"}
    both = [(r, bulk_b[key(r)]) for r in a if r["length"] == length and r["region"] == "bulk" and key(r) in bulk_b]
    both = [(r, s) for r, s in both if r["task"] not in NEEDLE_FREE]
    return {
        "n": len(both),
        "a": float(np.mean([r["score"] for r, _ in both])) if both else float("nan"),
        "b": float(np.mean([s for _, s in both])) if both else float("nan"),
        "delta": bootstrap_mean(np.array([r["score"] - s for r, s in both])) if both else None,  # over samples
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("a", help="FILE:PLAN, the plan to judge")
    ap.add_argument("b", help="FILE:PLAN, the plan it is paired against")
    args = ap.parse_args()
    a, b = samples(args.a, "a"), samples(args.b, "b")
    overall = paired_summary(a + b, "a", "b")["overall"]
    print("| length | a - b [95% CI] (pairs) | filled region: a, b (needle samples filled in both) | a - b there |")
    print("|---|---|---|---|")
    for length, o in overall.items():
        f = filled_region(a, b, length)
        print(f"| {length} | {o['delta']} ({o['delta'].n}) | {f['a']:.1f}, {f['b']:.1f} ({f['n']}) | {f['delta']} |")


if __name__ == "__main__":
    main()
