"""Where a RULER suite run loses against exact, and whether the lost needles were kept whole (issue 27).

Reads a `bench/ruler_suite.py` run (OUT.json: its paired samples) and its `--coverage` run on the same prompts
(OUT.coverage.jsonl: the same haystack, seed and lengths), and prints per length:
- the paired delta over the tasks whose prompts come from the haystack (RULER's essay tasks; the noise, needle
  and synthetic tasks are the same prompts whatever the haystack), with its CI;
- per task: needles in filled rows, needles kept whole, needle rows kept, and each loss split by whether every
  needle of that prompt was whole.

    python bench/ruler_losses.py bench/results/ruler27/report_prose

The coverage rows read are those of the plan's own selector settings (share, tail, query, window, layers,
reach), taken from its samples, so a coverage file holding several settings is read at the run's.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path

from ridgefill.evals.paired import paired_summary
from ridgefill.evals.ruler import SPECS

HAYSTACK_TASKS = tuple(t for t, spec in SPECS.items() if spec.args.get("type_haystack") == "essay")
SELECTOR = ("select", "query", "window", "score_layers", "reach", "share", "tail")  # what picks the rows


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


def selector(row: dict) -> tuple:
    """The settings that chose a row's protected rows (a coverage row, or a sample's plan config)."""
    return tuple(row.get(k, 0) for k in SELECTOR)  # reach is left out of configs scored before it existed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path, help="the suite's OUT stem (OUT.json and OUT.coverage.jsonl)")
    ap.add_argument("--plan", default="ridge+question")
    a = ap.parse_args()
    try:
        samples = json.loads(a.out.with_name(a.out.name + ".json").read_text())["samples"]
        lines = a.out.with_name(a.out.name + ".coverage.jsonl").read_text().splitlines()
        settings = selector(next(r["config"] for r in samples if r["plan"] == a.plan))
    except (OSError, ValueError, KeyError, StopIteration) as e:  # one line, exit 2: a bad input, not a crash
        print(f"error: {a.out}: needs the suite's OUT.json with {a.plan} samples and its --coverage run's "
              f"OUT.coverage.jsonl ({e!r})", file=sys.stderr)  # fmt: skip
        raise SystemExit(2) from None
    coverage = [r for r in map(json.loads, lines) if selector(r) == settings]
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
