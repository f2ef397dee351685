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
    """Build the engine once, run the job's RULER and TTFT on it; a JSON-ready result."""
    from transformers import AutoTokenizer

    from ridgefill.vllm_plugin.offline import make_llm, served_model

    ruler = job.get("ruler")
    batch = ruler["samples"] - ruler.get("first", 0) if ruler else 1
    if job.get("promote") and ruler:
        batch = max(batch, job["promote"]["samples"] - ruler["samples"])
    llm = make_llm(
        job["model"], job.get("maps"), max_model_len=engine_length(job), dtype=job.get("dtype", "float32"),
        options=job.get("options"), max_num_seqs=max(8, min(256, batch)),
        gpu_memory_utilization=job.get("gpu_memory"), chunked_prefill=not whole_prompts(job),
    )  # fmt: skip
    state = getattr(served_model(llm), "ridgefill", None)
    if job.get("maps") and state is None:
        raise RuntimeError(f"the engine refused the map folder {job['maps']} (see its warning above)")
    out: dict = {"ridgefill_active": state is not None, "seconds": {}}
    if ruler:
        from ridgefill.evals.ruler import load_haystack
        from ridgefill.evals.ruler_vllm import run_ruler_vllm

        tok = AutoTokenizer.from_pretrained(job["model"])
        hay = load_haystack(ruler["haystack"])
        t = time.perf_counter()
        out["ruler"] = run_ruler_vllm(
            llm, tok, ruler["plans"], list(ruler["tasks"]), list(ruler["lengths"]), hay, ruler["samples"],
            ruler.get("seed", 0), margins=bool(ruler.get("margins")), first=ruler.get("first", 0),
        )  # fmt: skip
        out["seconds"]["ruler"] = time.perf_counter() - t
    from ridgefill.evals.paired import cannot_pass, fails, needs_speed

    if job.get("calibrate"):
        out["calibrate"] = _calibrate(llm, job["calibrate"])
    promote = job.get("promote") if ruler else None
    if job.get("speedup") is not None:  # predicted (`ridgefill.ttft_model`): nothing is timed on this engine
        if promote is not None and not _gate(job, out, cannot_pass):
            _promote(llm, tok, hay, ruler, promote, job["exact"], out, speedup=job["speedup"])
        return out
    if not job.get("ttft") or _gate(job, out, cannot_pass):
        return out
    speed_decides = promote is not None and needs_speed(promote["bar"])
    if promote is not None and not speed_decides:
        _promote(llm, tok, hay, ruler, promote, job["exact"], out, speedup=0.0)
    if not speed_decides and _gate(job, out, fails):  # fails on every sample it scored: not timed, as on transformers
        return out
    out["ttft"] = _ttft(llm, job["ttft"])
    out["seconds"]["ttft"] = sum(r["seconds"] for r in out["ttft"].values())
    if speed_decides:
        _promote(llm, tok, hay, ruler, promote, job["exact"], out)
    return out


def _trial_rows(out: dict, exact: list[dict]) -> list[dict]:
    return [r | {"plan": "trial"} for r in out["ruler"]["samples"] if r["plan"] == "p"] + exact


def _gate(job: dict, out: dict, test) -> bool:
    """The job's `gate` ({"max_drop", "seed"}) on the samples scored so far: `test` is `paired.cannot_pass` (the
    first samples) or `paired.fails` (all of them); True skips the TTFT, as on transformers (`tasks.trial`)."""
    gate = job.get("gate")
    if not gate or "ruler" not in out:
        return False
    return test(_trial_rows(out, job["exact"]), "trial", gate["max_drop"], gate.get("seed", 0))


def _promote(
    llm, tok, hay, ruler: dict, promote: dict, exact: list[dict], out: dict, speedup: float | None = None
) -> None:
    """Multi-fidelity on the same engine: when the first samples (paired against the exact rows given) and
    the speed-up (`speedup`, else the measured TTFT's) clear the bar, score the plan on samples up to
    `promote["samples"]` and add them."""
    from ridgefill.evals.paired import clears, mean_delta
    from ridgefill.evals.ruler_run import aggregate
    from ridgefill.evals.ruler_vllm import run_ruler_vllm
    from ridgefill.evals.ttft import speedup_over_lengths

    rows = out["ruler"]["samples"]
    mean = mean_delta(_trial_rows(out, exact), "trial")
    up = speedup_over_lengths(out["ttft"]) if speedup is None else speedup
    out["promoted"] = mean is not None and clears(promote["bar"], mean, up)
    if not out["promoted"]:
        return
    t = time.perf_counter()
    more = run_ruler_vllm(
        llm, tok, ruler["plans"], list(ruler["tasks"]), list(ruler["lengths"]), hay, promote["samples"],
        ruler.get("seed", 0), margins=bool(ruler.get("margins")), first=ruler["samples"],
    )  # fmt: skip
    out["ruler"]["samples"] = rows + more["samples"]
    out["ruler"]["scores"] = aggregate(out["ruler"]["samples"])
    out["seconds"]["promoted"] = time.perf_counter() - t


def _ttft(llm, t: dict) -> dict:
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
