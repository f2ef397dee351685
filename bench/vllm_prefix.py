"""TTFT with prefix caching on: a question about a document the engine has already seen, stock vs RidgeFill.

One engine (prefix caching on) serves both sides; RidgeFill is switched off for stock requests. For each
repeat and side, a fresh random document is used twice: `cold` times document + question 1 (nothing
cached), `warm` then times document + question 2 (the document's blocks are cached; RidgeFill reuses
them only below its tail). Sides alternate.

    VLLM_ENABLE_V1_MULTIPROCESSING=0 VLLM_CPU_KVCACHE_SPACE=4 python bench/vllm_prefix.py \
        --maps /tmp/rf-bench/maps/S18-ridge --doc-tokens 4096 --question-tokens 300
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import numpy as np

from ridgefill.steps import model_path
from ridgefill.vllm_plugin.offline import LLMArgs, make_llm, served_model


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="default")
    ap.add_argument("--maps", type=Path, required=True)
    ap.add_argument("--doc-tokens", type=int, default=4096)
    ap.add_argument("--question-tokens", type=int, default=300)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    from vllm import SamplingParams, TokensPrompt

    n = args.doc_tokens + args.question_tokens
    llm = make_llm(str(model_path(args.model)), str(args.maps), args=LLMArgs(max_model_len=n + 16, prefix_caching=True))
    state = served_model(llm).ridgefill
    params = SamplingParams(temperature=0.0, max_tokens=1)
    rng = np.random.default_rng(0)

    def tokens(k: int) -> list[int]:
        return rng.integers(100, 40000, size=k).tolist()

    def ttft(ids: list[int]) -> tuple[float, int]:
        t = time.perf_counter()
        out = llm.generate([TokensPrompt(prompt_token_ids=ids)], params, use_tqdm=False)[0]
        return time.perf_counter() - t, out.num_cached_tokens

    times = {(side, kind): [] for side in ("stock", "ridgefill") for kind in ("cold", "warm")}
    cached = {}
    for rep in range(args.repeats + 1):  # the first round warms the engine up and is not kept
        for side in ("stock", "ridgefill"):
            state.enabled = side == "ridgefill"
            doc = tokens(args.doc_tokens)
            for kind in ("cold", "warm"):
                seconds, hit = ttft(doc + tokens(args.question_tokens))
                if rep:
                    times[side, kind].append(seconds)
                    cached[side, kind] = hit
    rows = []
    for side in ("stock", "ridgefill"):
        cold, warm = (statistics.median(times[side, k]) for k in ("cold", "warm"))
        rows.append({"side": side, "cold_s": cold, "warm_s": warm, "warm_cached_tokens": cached[side, "warm"]})
    stock_warm = rows[0]["warm_s"]
    print(f"{n}-token prompts ({args.doc_tokens} document + {args.question_tokens} question), median of {args.repeats}")
    print("| side | cold TTFT s | warm TTFT s | cached tokens (warm) | cold/warm | stock warm / this warm |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['side']} | {r['cold_s']:.3f} | {r['warm_s']:.3f} | {r['warm_cached_tokens']} | "
            f"{r['cold_s'] / r['warm_s']:.2f}x | {stock_warm / r['warm_s']:.2f}x |"
        )
    if args.out:
        args.out.write_text(json.dumps({"rows": rows, "times": {f"{a}/{b}": v for (a, b), v in times.items()}}))


if __name__ == "__main__":
    main()
