"""One vLLM engine serves one trial (or the exact baseline): its RULER, then its paired TTFT.

The tuner runs this in its own process (vLLM keeps global state) and reads the result back as JSON:
    python -m ridgefill.evals.vllm_trial JOB.json OUT.json
A job names the model, its dtype, the map folder (none: stock vLLM, the exact baseline) with the
trial's row policy, and what to measure: `ruler` (a study's RULER settings and the plans to score,
each "exact" or "served") and/or `ttft` (lengths, repeats, warm-up).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path

from ridgefill.runtime import FillPlan


def engine_length(job: dict) -> int:
    """The context the engine needs: RULER keeps prompt + generated tokens within each length."""
    need = list(job["ruler"]["lengths"]) if job.get("ruler") else []
    for timed in ("ttft", "calibrate"):
        if job.get(timed):
            need += [n + 16 for n in job[timed]["lengths"]]
    return max(need)


def whole_prompts(job: dict) -> bool:
    """With the question selector a trial's batches never split a prompt: each takes the one-step path (a split
    prompt takes the chunked path, which equals it but keeps buffers and re-runs chosen earlier rows; before
    that path existed a split prompt ran exact, and promoted batches measured exact prompts)."""
    return (job.get("options") or {}).get("select") == "question"


def run_job(job: dict) -> dict:
    """Build the engine once, run the job on it (with a `gate`, the trial's whole decision:
    `ridgefill.decision.decide`); a JSON-ready result."""
    from ridgefill.vllm_plugin.offline import LLMArgs, make_llm, served_model

    ruler, gate = job.get("ruler"), job.get("gate")
    batch = ruler["samples"] - ruler.get("first", 0) if ruler else 1
    if gate and gate.get("promote"):
        batch = max(batch, gate["promote"] - gate["samples"])
    args = LLMArgs(
        max_model_len=engine_length(job),
        max_num_seqs=max(8, min(256, batch)),
        gpu_memory_utilization=job.get("gpu_memory"),
        chunked_prefill=not whole_prompts(job),
    )
    dtype = job.get("dtype", "float32")
    llm = make_llm(job["model"], job.get("maps"), dtype=dtype, options=job.get("options"), args=args)
    state = getattr(served_model(llm), "ridgefill", None)
    if job.get("maps") and state is None:
        raise RuntimeError(f"the engine refused the map folder {job['maps']} (see its warning above)")
    out: dict = {"ridgefill_active": state is not None, "seconds": {}}
    if job.get("calibrate"):
        out["calibrate"] = _calibrate(llm, job["calibrate"])
    score = _scorer(llm, job, out) if ruler else None
    if score and gate:
        _decide(llm, job, score, out)
        return out
    if score:
        out["ruler"] = score(ruler.get("first", 0), ruler["samples"])
    if job.get("ttft"):
        out["ttft"] = _ttft(llm, job["ttft"], out)
    return out


@dataclass
class Timed:
    """One paired TTFT on this engine: its geometric-mean speed-up and the per-length results."""

    speedup: float
    results: dict


def _decide(llm, job: dict, score, out: dict) -> None:
    """The trial's decision on this engine, as on transformers: RULER, TTFT when it can matter, promotion."""
    from ridgefill.decision import Gate, decide
    from ridgefill.evals.ttft import speedup_over_lengths

    def time() -> Timed:
        res = _ttft(llm, job["ttft"], out)
        return Timed(speedup_over_lengths(res), res)

    predicted = job.get("speedup")
    if predicted is None and not job.get("ttft"):
        raise ValueError("a trial job times its trial (`ttft`) or carries a predicted `speedup`")
    d = decide(score, time, _merge, Gate(**job["gate"]), predicted)
    out["ruler"], out["promoted"], out["reachable"] = d.ruler, d.promoted, d.reachable
    if d.timing is not None:
        out["ttft"] = d.timing.results


def _scorer(llm, job: dict, out: dict):
    """score(first, last): the job's RULER plans on sample indices first..last-1, a batch per task x length."""
    from transformers import AutoTokenizer

    from ridgefill.evals.ruler import load_haystack
    from ridgefill.evals.ruler_run import Cells
    from ridgefill.evals.ruler_vllm import run_ruler_vllm

    r = job["ruler"]
    tok, hay = AutoTokenizer.from_pretrained(job["model"]), load_haystack(r["haystack"])

    def score(first: int, last: int) -> dict:
        t = time.perf_counter()
        cells = Cells(list(r["tasks"]), list(r["lengths"]), hay, last, r.get("seed", 0), first)
        res = run_ruler_vllm(llm, tok, r["plans"], cells, margins=bool(r.get("margins")))
        key = "ruler" if first == r.get("first", 0) else "promoted"
        out["seconds"][key] = time.perf_counter() - t
        return res

    return score


def _merge(a: dict, b: dict) -> dict:
    """Two `run_ruler_vllm` results on disjoint samples of the same plans as one."""
    from ridgefill.evals.ruler_run import aggregate

    samples = a["samples"] + b["samples"]
    return a | {"samples": samples, "scores": aggregate(samples)}


def _ttft(llm, t: dict, out: dict) -> dict:
    """Paired TTFT (exact vs the served maps) per length on the engine, as `eval ttft` measures it."""
    from ridgefill.evals.ruler_vllm import served_plan
    from ridgefill.evals.ttft import paired_ttft, random_prompt
    from ridgefill.vllm_plugin.offline import ttft_engine

    run, plan = ttft_engine(llm), served_plan(llm)  # ttft_engine raises on a stock engine
    vocab = llm.get_tokenizer().vocab_size
    res = {}
    for n in t["lengths"]:
        start = time.perf_counter()
        res[str(n)] = paired_ttft(run, random_prompt(vocab, n), plan, t.get("repeats", 3), t.get("warmup", 1))
        res[str(n)]["seconds"] = time.perf_counter() - start
    out["seconds"]["ttft"] = sum(r["seconds"] for r in res.values())
    return res


def _calibrate(llm, spec: dict) -> list[dict]:
    """Paired, alternating TTFT of exact and each row policy of `spec["policies"]` on this engine's split
    (`ridgefill.ttft_model.measure`): the measured ratios, JSON-ready."""
    from dataclasses import asdict

    from ridgefill.evals.ttft import random_prompt
    from ridgefill.rows import RowPolicy
    from ridgefill.ttft_model import Point, measure
    from ridgefill.vllm_plugin.offline import serve_rows, served_model, ttft_engine

    run, state = ttft_engine(llm), served_model(llm).ridgefill
    vocab = llm.get_tokenizer().vocab_size
    exact_plan, served = FillPlan(), FillPlan(state.mode, state.split, state.maps)
    prompts: dict[int, object] = {}

    def timer(point: Point, n: int) -> float:
        if point.split is not None:
            serve_rows(llm, point.rows)
        ids = prompts.setdefault(n, random_prompt(vocab, n))
        return run(ids, exact_plan if point.split is None else served)

    points = [Point(state.split, RowPolicy(**p)) for p in spec["policies"]]
    knobs = {k: spec[k] for k in ("min_rounds", "max_rounds", "target", "warmup") if k in spec}
    return [asdict(r) for r in measure(timer, points, spec["lengths"], **knobs)]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("job", type=Path)
    ap.add_argument("out", type=Path)
    a = ap.parse_args(argv)
    # an entry point: vLLM's own variable (served_model reads the in-process engine)
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    a.out.write_text(json.dumps(run_job(json.loads(a.job.read_text()))))


if __name__ == "__main__":
    main()
