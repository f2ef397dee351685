"""Where a RULER suite run loses against exact, and whether the lost needles were kept whole (issue 27).

Reads a `bench/ruler_suite.py` run (OUT.json: its paired samples) and its `--coverage` run on the same prompts
(OUT.coverage.jsonl: the same haystack, seed and lengths), and prints per length:
- the paired delta over the tasks whose prompts come from the haystack (RULER's essay tasks; the noise, needle
  and synthetic tasks are the same prompts whatever the haystack), with its CI;
- per task: needles in filled rows, needles kept whole, needle rows kept, and each loss split by whether every
  needle of that prompt was whole.

    python bench/ruler_losses.py bench/results/ruler27/report_prose --window 8 --reach 16
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path

from ridgefill.evals.paired import paired_summary

HAYSTACK_TASKS = ("niah_single_2", "niah_single_3", "niah_multikey_1", "niah_multivalue", "niah_multiquery")


def essay_delta(samples: list[dict], plan: str) -> dict:
    """{length: overall paired summary} over the haystack's own tasks."""
    return paired_summary([r for r in samples if r["task"] in HAYSTACK_TASKS], plan)["overall"]


def losses(samples: list[dict], coverage: list[dict], plan: str, length: int) -> dict[str, dict]:
    """Per task: prompts, needles in filled rows and kept whole, and losses split by whether every needle was whole."""
    ref = {(r["task"], r["index"]): r["score"] for r in samples if r["plan"] == "exact" and r["length"] == length}
    cov = {(r["task"], r["index"]): r for r in coverage if r["length"] == length}
    out: dict[str, dict] = defaultdict(lambda: defaultdict(float))
    for r in samples:
        if r["plan"] != plan or r["length"] != length or (r["task"], r["index"]) not in ref:
            continue
        o, c = out[r["task"]], cov.get((r["task"], r["index"]))
        d = r["score"] - ref[(r["task"], r["index"])]
        o["n"] += 1
        o["delta"] += d
        if c is None:  # no needle, or every needle in the sink or tail
            o["lost, needle not filled"] += d < 0
            continue
        whole = all(c["whole"])
        o["prompts"] += 1
        o["all whole"] += whole
        o["needles"] += len(c["whole"])
        o["needles whole"] += sum(c["whole"])
        o["rows"] += c["needle_rows"]
        o["lost, all whole" if whole else "lost, not all whole"] += d < 0
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path, help="the suite's OUT stem (OUT.json and OUT.coverage.jsonl)")
    ap.add_argument("--plan", default="ridge+question")
    ap.add_argument("--window", type=int, default=8, help="the coverage grid row to read (the run's own settings)")
    ap.add_argument("--reach", type=int, default=16)
    a = ap.parse_args()
    samples = json.loads(a.out.with_name(a.out.name + ".json").read_text())["samples"]
    coverage = [
        r for r in map(json.loads, a.out.with_name(a.out.name + ".coverage.jsonl").read_text().splitlines())
        if r["select"] == "question" and (r["window"], r.get("reach", 0)) == (a.window, a.reach)
    ]  # fmt: skip
    for length, o in essay_delta(samples, a.plan).items():
        d = o["delta"]
        print(f"{length}: haystack tasks {o['score']:.1f} (exact {o['reference']:.1f}), delta {d}, n={d.n}")
    print("| length | task | n | mean delta | needle in filled rows | all whole | needles whole | needle rows kept "
          "| lost, not all whole | lost, all whole | lost, needle not filled |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for length in sorted({r["length"] for r in samples}):
        for task, o in sorted(losses(samples, coverage, a.plan, length).items()):
            p = int(o["prompts"])
            rows = f"{o['rows'] / p * 100:.0f}%" if p else "-"
            head = f"| {length} | {task} | {int(o['n'])} | {o['delta'] / o['n']:+.1f} | {p} | {int(o['all whole'])}/{p}"
            print(f"{head} | "
                  f"{int(o['needles whole'])}/{int(o['needles'])} | {rows} | {int(o['lost, not all whole'])} | "
                  f"{int(o['lost, all whole'])} | {int(o['lost, needle not filled'])} |")  # fmt: skip


if __name__ == "__main__":
    main()
