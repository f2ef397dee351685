"""Where a RidgeFill prefill's time goes on vLLM: torch's CPU profiler over one prompt, exact and RidgeFill on one
in-process engine (RidgeFill switched off for the exact side, as `ridgefill eval ttft` does), top ops by self time.

    VLLM_CPU_KVCACHE_SPACE=2 taskset -c 0 python bench/vllm_fill_profile.py --maps MAPS --share 0.08 --tail 128 \\
        --window 8 --reach 16 --length 4096
"""

from __future__ import annotations

import argparse
import os
import time

import torch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--maps", required=True)
    ap.add_argument("--share", type=float, default=0.08)
    ap.add_argument("--tail", type=int, default=128)
    ap.add_argument("--window", type=int, default=8)
    ap.add_argument("--reach", type=int, default=16)
    ap.add_argument("--length", type=int, default=4096)
    ap.add_argument("--rows", type=int, default=22, help="ops listed per side")
    args = ap.parse_args()
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # vLLM's own variable, for the in-process engine
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from ridgefill.evals.ttft import random_prompt
    from ridgefill.steps import model_path
    from ridgefill.vllm_plugin.offline import LLMArgs, make_llm, served_model

    options = {"share": args.share, "tail": args.tail, "select": "question", "window": args.window, "reach": args.reach}
    llm = make_llm(str(model_path("default")), args.maps, options=options, args=LLMArgs(max_model_len=args.length + 16))
    state = served_model(llm).ridgefill
    ids = random_prompt(llm.get_tokenizer().vocab_size, args.length)
    prompt = [TokensPrompt(prompt_token_ids=torch.as_tensor(ids).flatten().tolist())]

    def prefill(enabled: bool) -> float:
        state.enabled = enabled
        t0 = time.perf_counter()
        llm.generate(prompt, SamplingParams(max_tokens=1, temperature=0), use_tqdm=False)
        return time.perf_counter() - t0

    prefill(True), prefill(False)  # warm-up
    for enabled in (False, True):
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            seconds = prefill(enabled)
        print(f"{'RidgeFill' if enabled else 'exact'}: {seconds:.3f} s")
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.rows))


if __name__ == "__main__":
    main()
