"""TTFT exact vs RidgeFill on a GPU, transformers runtime, at a real model's shapes with random weights.

The GPU machine has torch and transformers but no vLLM and no hub, so the model is built from a
hand-written copy of Qwen3-8B's config with random bf16 weights, and the maps are random matrices of
the right shape (timing does not depend on their values). Before timing, plumb mode (nothing
approximated) is compared with exact prefill on this device (logit difference reported; a random model's
top logits are near-tied, so its first token can flip in bf16). Results are written after every
measurement so that a run cut short still leaves its rows.

    PYTHONPATH=. python bench/gpu_ttft.py --out $OUT/gpu_ttft.json            # H200: 8K/16K/32K, S=18 and 27
    PYTHONPATH=. python bench/gpu_ttft.py --shape tiny --lengths 1024 --splits 2 --repeats 2   # CPU smoke run
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

import torch
import transformers
from transformers import Qwen3Config, Qwen3ForCausalLM

from ridgefill.evals.ttft import paired_ttft, transformers_engine
from ridgefill.flops import speedup_bound
from ridgefill.maps import MapSet
from ridgefill.rows import ROWS, RowPolicy
from ridgefill.runtime import FillPlan, prefill, protected_rows

# Qwen/Qwen3-8B config.json (the fields that set shapes and numerics)
QWEN3_8B = dict(
    vocab_size=151936,
    hidden_size=4096,
    intermediate_size=12288,
    num_hidden_layers=36,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=128,
    max_position_embeddings=40960,
    rope_theta=1000000.0,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
)
TINY = dict(QWEN3_8B, vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=4)
TINY.update(num_attention_heads=4, num_key_value_heads=2, head_dim=16)
SHAPES = {"qwen3-8b": QWEN3_8B, "tiny": TINY}


def build_model(shape: str, device: str, dtype: torch.dtype) -> Qwen3ForCausalLM:
    """Random weights at the config's shapes, initialised directly on the device."""
    config = Qwen3Config(**SHAPES[shape], architectures=["Qwen3ForCausalLM"], attn_implementation="sdpa")
    torch.manual_seed(0)
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # no float32 copy of an 8B model on the way
    try:
        with torch.device(device):
            model = Qwen3ForCausalLM(config)
    finally:
        torch.set_default_dtype(default)
    return model.eval()


def random_maps(model, split: int, seed: int = 0) -> MapSet:
    """Ridge maps of the right shape: near-identity W (keeps the stream's scale) and a small bias."""
    d, layers = model.config.hidden_size, model.config.num_hidden_layers
    p = next(model.parameters())
    g = torch.Generator(device=p.device).manual_seed(seed)
    weights = {}
    for idx in range(split + 1, layers):
        w = torch.eye(d, device=p.device) + 0.01 * torch.randn(d, d, generator=g, device=p.device)
        weights[idx] = (w.to(p.dtype), (0.01 * torch.randn(d, generator=g, device=p.device)).to(p.dtype))
    return MapSet({"split": split, "kind": "ridge"}, weights)


def plumb_check(model, split: int, tail: int, n: int) -> dict:
    """Plumb mode (exact bulk stream through the RidgeFill path) vs stock prefill on this device."""
    ids = torch.randint(0, model.config.vocab_size, (1, n), device=next(model.parameters()).device)
    exact = prefill(model, ids, FillPlan()).logits.float()
    plumb = prefill(model, ids, FillPlan("plumb", split=split, rows=RowPolicy(tail=tail))).logits.float()
    return {
        "tokens": n,
        "split": split,
        "same_first_token": bool(exact.argmax() == plumb.argmax()),
        "max_abs_logit_diff": float((exact - plumb).abs().max()),
        "logit_scale": float(exact.abs().max()),
    }


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", choices=sorted(SHAPES), default="qwen3-8b")
    ap.add_argument("--lengths", type=int, nargs="+", default=[8192, 16384, 32768])
    ap.add_argument("--splits", type=int, nargs="+", default=[18, 27])
    ap.add_argument("--tail", type=int, default=ROWS.tail)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--budget-s", type=float, default=480.0, help="skip what is left after this many seconds")
    ap.add_argument("--out", type=Path, default=Path("gpu_ttft.json"))
    args = ap.parse_args(argv)
    start = time.perf_counter()
    cuda = torch.cuda.is_available()
    device, dtype = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float32)
    model = build_model(args.shape, device, dtype)
    report = {
        "device": torch.cuda.get_device_name() if cuda else platform.processor() or "cpu",
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "shape": args.shape,
        "dtype": str(dtype),
        "tail": args.tail,
        "sink": ROWS.sink,
        "build_s": round(time.perf_counter() - start, 1),
        "plumb_check": plumb_check(model, args.splits[0], args.tail, min(2048, args.lengths[0])),
        "rows": [],
        "skipped": [],
    }
    args.out.write_text(json.dumps(report, indent=1))
    engine = transformers_engine(model)
    for split in args.splits:
        plan = FillPlan("ridge", maps=random_maps(model, split), rows=RowPolicy(tail=args.tail))
        for n in args.lengths:
            if time.perf_counter() - start > args.budget_s:
                report["skipped"].append({"split": split, "tokens": n})
                continue
            ids = torch.randint(0, model.config.vocab_size, (1, n), device=device)
            row = paired_ttft(engine, ids, plan, repeats=args.repeats)
            row["split"] = split
            row["flop_bound"] = speedup_bound(model.config, n, split, int(protected_rows(ids, plan).sum()))
            report["rows"].append(row)
            args.out.write_text(json.dumps(report, indent=1))
            print(
                f"| {n} | {split} | {row['exact_median_s']:.3f} | {row['fill_median_s']:.3f} | "
                f"{row['speedup']:.2f}x [{row['speedup_ci95'][0]:.2f}, {row['speedup_ci95'][1]:.2f}] | "
                f"{row['flop_bound']:.2f}x |",
                flush=True,
            )
        del plan
        if cuda:
            torch.cuda.empty_cache()
    report["total_s"] = round(time.perf_counter() - start, 1)
    args.out.write_text(json.dumps(report, indent=1))
    return report


if __name__ == "__main__":
    main()
