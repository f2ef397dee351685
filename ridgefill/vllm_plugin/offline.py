"""Run vLLM offline, in-process, with or without a RidgeFill map folder (tests, TTFT benchmark).

One engine per process: vLLM keeps global state, so callers that compare configurations run each
in its own process (`python -m ridgefill.vllm_plugin.offline --case case.json --out out.json`).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ridgefill.vllm_plugin.config import ARCHS, serve_dtype


@dataclass(frozen=True)
class LLMArgs:
    """The `vllm.LLM` arguments an in-process engine is built with, passed whole (defaults: a small, eager,
    single-device engine for tests and TTFT). `chunk` None: one step may hold `max_model_len` tokens;
    `gpu_memory_utilization` None: vLLM's own; `chunked_prefill=False`: a prompt waits for a step with room for
    all of it instead of being split (the tuner's question-selector trials: every prompt on the one-step path);
    `engine_args`: more of vLLM's own engine arguments (e.g. num_gpu_blocks_override, to force preemption)."""

    chunk: int | None = None
    max_model_len: int = 4096
    kv_space_gib: int = 2
    prefix_caching: bool = False
    max_num_seqs: int = 8
    block_size: int | None = None
    tensor_parallel_size: int = 1
    gpu_memory_utilization: float | None = None
    enforce_eager: bool = True
    chunked_prefill: bool = True
    engine_args: Mapping[str, Any] = field(default_factory=dict)


def make_llm(
    model: str,
    maps: str | None = None,
    *,
    dtype: str | None = None,
    options: dict | None = None,
    args: LLMArgs | None = None,
):
    """An in-process vLLM engine built with `args` (None: `LLMArgs()`); with `maps`, the RidgeFill class of the
    model's family serves them with the row `options`. `dtype` None: `serve_dtype` (bf16 on CUDA unless the model
    is fp16, float32 on the CPU)."""
    import torch

    a = args or LLMArgs()
    # vLLM's own variables (vLLM reads them only from the environment), for the in-process engine this makes;
    # no RidgeFill setting is ever written (ridgefill/settings.py)
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(a.kv_space_gib))
    from transformers import AutoConfig
    from vllm import LLM

    overrides = {}
    if maps is not None:
        overrides = {
            "architectures": [ARCHS[AutoConfig.from_pretrained(model).architectures[0]]],
            "ridgefill_maps": str(maps),
            **{f"ridgefill_{k}": v for k, v in (options or {}).items()},
        }
    return LLM(
        model=model,
        dtype=dtype or serve_dtype(model, torch.cuda.is_available()),
        enforce_eager=a.enforce_eager,
        max_model_len=a.max_model_len,
        seed=0,
        enable_prefix_caching=a.prefix_caching,
        enable_chunked_prefill=a.chunked_prefill,
        max_num_batched_tokens=a.chunk or a.max_model_len,
        max_num_seqs=a.max_num_seqs,
        block_size=a.block_size,
        tensor_parallel_size=a.tensor_parallel_size,
        **({} if a.gpu_memory_utilization is None else {"gpu_memory_utilization": a.gpu_memory_utilization}),
        hf_overrides=overrides or None,
        **a.engine_args,
    )


def runner_of(llm):
    """The model runner of an in-process engine (VLLM_ENABLE_V1_MULTIPROCESSING=0)."""
    return llm.llm_engine.model_executor.driver_worker.worker.model_runner


def hooked_runner(llm) -> bool:
    """The engine's model runner is vLLM's V1 runner, whose `_model_forward` RidgeFill hooks."""
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    from ridgefill.vllm_plugin.patches import PATCHES

    return isinstance(runner_of(llm), GPUModelRunner) and PATCHES.hooked("GPUModelRunner._model_forward")


def served_model(llm):
    """The model object of an in-process engine (VLLM_ENABLE_V1_MULTIPROCESSING=0)."""
    return runner_of(llm).model


def counters(llm) -> dict[str, int] | None:
    """The RidgeFill counters of an in-process engine (None if it serves no maps): steps with bulk rows,
    bulk rows filled, protected rows run."""
    state = getattr(served_model(llm), "ridgefill", None)
    return None if state is None else state.counters.as_dict()


def ttft_engine(llm):
    """TTFT on one vLLM engine: RidgeFill is switched off for `exact` plans, so A and B share everything."""
    from vllm import SamplingParams, TokensPrompt

    state = served_model(llm).ridgefill
    if state is None:
        raise RuntimeError("the engine serves no RidgeFill maps (see its warning)")
    if llm.llm_engine.vllm_config.cache_config.enable_prefix_caching:
        raise ValueError("TTFT needs prefix caching off: repeats of one prompt would be served from the cache")
    params = SamplingParams(temperature=0.0, max_tokens=1)

    def run(ids, plan) -> float:
        if plan.mode not in ("exact", state.mode):
            raise ValueError(f"this engine serves {state.mode!r} (or exact), not {plan.mode!r}")
        state.enabled = plan.mode != "exact"
        before = state.counters.bulk_steps
        t = time.perf_counter()
        llm.generate([TokensPrompt(prompt_token_ids=ids[0].tolist())], params, use_tqdm=False)
        took = time.perf_counter() - t
        if state.enabled and state.counters.bulk_steps == before and ids.shape[1] > tail_of(state):
            raise RuntimeError(f"RidgeFill is inert: a {ids.shape[1]}-token prompt filled no bulk rows")
        if not state.enabled and state.counters.bulk_steps != before:
            raise RuntimeError("an exact TTFT request filled bulk rows")
        return took

    return run


def serve_rows(llm, rows) -> None:
    """Serve another row policy (`ridgefill.rows.RowPolicy`) on the same engine and maps, so a calibration times
    several policies of one split paired against exact; only between requests (the classifier holds per-request
    state)."""
    from ridgefill.vllm_plugin.batch import RowClassifier

    state = served_model(llm).ridgefill
    state.classifier = RowClassifier(rows.check("ridgefill_"), state.maps.scores)


def tail_of(state) -> int:
    """Prompt tokens always run exact (sink + tail): a prompt no longer than this has no bulk rows."""
    return state.classifier.policy.sink + state.classifier.policy.tail


def run_case(case: dict) -> dict:
    """Greedy-generate for the prompts (token id lists); return tokens, top logprobs of the first token."""
    from vllm import SamplingParams, TokensPrompt

    llm = make_llm(
        case["model"],
        case.get("maps"),
        dtype=case.get("dtype"),
        options=case.get("options"),
        args=LLMArgs(
            chunk=case.get("chunk"),
            max_model_len=case.get("max_model_len", 4096),
            prefix_caching=case.get("prefix_caching", False),
            block_size=case.get("block_size"),
            tensor_parallel_size=case.get("tp", 1),
            enforce_eager=case.get("enforce_eager", True),
        ),
    )
    params = SamplingParams(
        temperature=0.0,
        max_tokens=case.get("max_tokens", 8),
        logprobs=case.get("logprobs", 5),
        prompt_logprobs=case.get("prompt_logprobs"),
    )
    prompts = [TokensPrompt(prompt_token_ids=p) for p in case["prompts"]]
    t = time.perf_counter()
    if case.get("sequential"):  # one request at a time (prefix-cache reuse across requests)
        outs = [llm.generate([p], params, use_tqdm=False)[0] for p in prompts]
    else:
        outs = llm.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - t
    try:
        state = getattr(served_model(llm), "ridgefill", None)
        active, count = state is not None, counters(llm)
    except AttributeError:  # the model runs in worker processes (tensor parallel): see the log
        state = active = count = None
    # vLLM runs a request as "<its id>-<8 random chars>" inside the engine
    record = {} if state is None else state.classifier.selector.chosen
    question_rows = {k.rsplit("-", 1)[0]: v for k, v in record.items()}
    results = []
    for o in outs:
        c = o.outputs[0]
        first = {int(t): float(lp.logprob) for t, lp in c.logprobs[0].items()} if c.logprobs else {}
        chosen = [float(d[t].logprob) for t, d in zip(c.token_ids, c.logprobs or [], strict=False)]
        result = {
            "tokens": list(c.token_ids),
            "first_logprobs": first,
            "token_logprobs": chosen,  # each generated token's own logprob
            "cached_tokens": o.num_cached_tokens,
            "question_rows": question_rows.get(o.request_id),  # positions the question protected (select "question")
        }
        if o.prompt_logprobs is not None:  # each prompt token's own logprob (none for the first)
            ids = o.prompt_token_ids
            result["prompt_logprobs"] = [float(d[ids[i]].logprob) for i, d in enumerate(o.prompt_logprobs) if d]
        results.append(result)
    core = getattr(llm.llm_engine, "engine_core", None)
    scheduler = getattr(getattr(core, "engine_core", None), "scheduler", None)
    caching = getattr(getattr(scheduler, "kv_cache_manager", None), "enable_caching", None)
    return {
        "results": results,
        "wall_s": wall,
        "ridgefill_active": active,
        "counters": count,
        "prefix_caching": caching,
        "runner_v1": hooked_runner(llm) if active is not None else None,
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--case", type=Path, required=True)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    args.out.write_text(json.dumps(run_case(json.loads(args.case.read_text()))))


if __name__ == "__main__":
    main()
