"""Decode cost of the plugin on vLLM: a batch of short prompts decoding, RidgeFill switched on vs off.

Decode rows always run the stock model, so anything the plugin adds per step (classifying the step's
rows) shows up here as a ratio below 1. One engine serves both sides (RidgeFill toggled per batch),
A and B alternate after a warm-up.

    VLLM_ENABLE_V1_MULTIPROCESSING=0 VLLM_CPU_KVCACHE_SPACE=4 python bench/vllm_decode.py \
        --maps /tmp/rf-bench/maps/S18-ridge --batch 8 --new-tokens 128
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from ridgefill.evals.ttft import ratio_ci
from ridgefill.steps import model_path
from ridgefill.vllm_plugin.offline import LLMArgs, make_llm, served_model


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="default")
    ap.add_argument("--maps", type=Path, required=True)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--prompt-tokens", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    from vllm import SamplingParams, TokensPrompt

    engine = LLMArgs(max_model_len=1024, max_num_seqs=args.batch)
    llm = make_llm(str(model_path(args.model)), str(args.maps), args=engine)
    state = served_model(llm).ridgefill
    prompts = [
        TokensPrompt(prompt_token_ids=[100 + 7 * i + j for j in range(args.prompt_tokens)]) for i in range(args.batch)
    ]
    params = SamplingParams(temperature=0.0, max_tokens=args.new_tokens, ignore_eos=True)

    def run(enabled: bool) -> float:
        state.enabled = enabled
        t = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        return time.perf_counter() - t

    run(False), run(True)
    stock, plugin = [], []
    for _ in range(args.repeats):
        stock.append(run(False))
        plugin.append(run(True))
    lo, hi = ratio_ci(stock, plugin)
    tokens = args.batch * args.new_tokens
    result = {
        "batch": args.batch,
        "new_tokens": args.new_tokens,
        "stock_tok_s": tokens / statistics.median(stock),
        "plugin_tok_s": tokens / statistics.median(plugin),
        "ratio_stock_over_plugin_time": statistics.median(stock) / statistics.median(plugin),
        "ratio_ci95": [lo, hi],
        "stock_s": stock,
        "plugin_s": plugin,
    }
    print(json.dumps({k: v for k, v in result.items() if not isinstance(v, list) or k == "ratio_ci95"}, indent=1))
    if args.out:
        args.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
