"""What one RULER sample costs per task: wall and process CPU seconds and generated tokens (exact plan).

Sizes a study's RULER objective and certification: a sample costs its prefill plus a share of one per
generated token, so tasks with long answers (uuids, value lists) cost more than number needles.

    python bench/ruler_cost.py niah_single_2,niah_single_3 1024 3
"""

from __future__ import annotations

import json
import sys
import time

import torch

from ridgefill.evals.ruler import load_haystack
from ridgefill.evals.ruler_run import Cells, run_ruler
from ridgefill.runtime import FillPlan
from ridgefill.steps import load_model


def main(tasks: list[str], length: int, n: int, threads: int = 2) -> None:
    torch.set_num_threads(threads)
    lm, tok = load_model("default")
    hay = load_haystack("pydoc")
    for task in tasks:
        t0, c0 = time.time(), time.process_time()
        out = run_ruler(lm, tok, {"exact": FillPlan()}, Cells([task], [length], hay, n, 0), False)
        wall, cpu = time.time() - t0, time.process_time() - c0
        new = [len(tok(r["prediction"])["input_ids"]) for r in out["samples"]]
        scores = [r["score"] for r in out["samples"]]
        row = {"task": task, "length": length, "n": n, "wall_per_sample": round(wall / n, 2)}
        print(json.dumps(row | {"cpu_per_sample": round(cpu / n, 2), "new_tokens": new, "scores": scores}), flush=True)


if __name__ == "__main__":
    main(sys.argv[1].split(","), int(sys.argv[2]), int(sys.argv[3]))
