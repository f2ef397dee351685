"""One trial's RULER on the study's task set: vLLM (a batch per task x length) against the transformers runtime.

Fits one map for the study's model (pydoc calibration, split `--split`, the study's middle lambda), then
times, one after the other in this order: the transformers runtime's RULER of the trial plan (one
`generate` per sample, as `objectives.run_ruler_plan`), and the tuner's vLLM trial job (`objectives.VllmJob` +
`run_vllm_job`: engine start, the RULER batches, no TTFT). Prints both wall times, vLLM's RULER alone
(without the engine start), their ratios and whether the per-sample predictions agree.

    python bench/ruler_engines.py studies/smollm2-135m.yaml --split 18
"""

from __future__ import annotations

import argparse
import json
import math
import tempfile
import time
from pathlib import Path

from ridgefill import objectives
from ridgefill.capture import CaptureOptions
from ridgefill.evals.ruler import load_haystack
from ridgefill.evals.ruler_run import Cells, run_ruler
from ridgefill.maps import load_maps
from ridgefill.rows import RowPolicy
from ridgefill.runtime import FillPlan
from ridgefill.steps import CalibrationText, build_maps, fit_report, load_model, model_path, run_capture
from ridgefill.study import load_study


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("study", type=Path)
    ap.add_argument("--split", type=int, default=18)
    ap.add_argument("--windows", type=int, default=32)
    ap.add_argument("--out", type=Path)
    a = ap.parse_args()
    cfg = load_study(a.study)
    lm, tok = load_model(model_path(cfg.model.local or cfg.model.repo))
    r, s = cfg.objectives.ruler, cfg.search
    lam, tail = math.sqrt(s.lam[0] * s.lam[1]), max(s.tails)
    with tempfile.TemporaryDirectory() as tmp:
        cap = run_capture(
            lm,
            tok,
            CalibrationText("pydoc", window=512, max_windows=a.windows, heldout=2),
            [a.split],
            Path(tmp),
            CaptureOptions(progress=False),
        )
        defaults = {"tail": tail, "sink": s.sink, "share": 0.0}
        folder = build_maps(fit_report(lm, tok, cap, a.split, lam), Path(tmp) / "maps", defaults=defaults)
        plan = FillPlan("ridge", maps=load_maps(folder, lm, tok), rows=RowPolicy(sink=s.sink, tail=tail))
        hay = load_haystack(r.haystack)

        t = time.perf_counter()
        ref = run_ruler(lm, tok, {"p": plan}, Cells(list(r.tasks), list(r.lengths), hay, r.samples, r.seed), False)
        tf_s = time.perf_counter() - t

        t = time.perf_counter()
        out = objectives.run_vllm_job(objectives.VllmJob.of(lm, cfg.model.dtype, plan).scoring(r))
        vllm_s = time.perf_counter() - t
    key = lambda row: (row["task"], row["length"], row["index"])  # noqa: E731
    want = {key(row): row["prediction"] for row in ref["samples"]}
    same = sum(want[key(row)] == row["prediction"] for row in out["ruler"]["samples"])
    result = {
        "study": cfg.name,
        "split": a.split,
        "samples": len(want),
        "transformers_s": tf_s,
        "vllm_job_s": vllm_s,
        "vllm_ruler_s": out["seconds"]["ruler"],
        "ratio_job": tf_s / vllm_s,
        "ratio_ruler": tf_s / out["seconds"]["ruler"],
        "same_predictions": same,
        "scores_transformers": ref["scores"]["p"],
        "scores_vllm": out["ruler"]["scores"]["p"],
    }
    print(json.dumps(result, indent=2))
    if a.out:
        a.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
