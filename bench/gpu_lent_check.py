"""The one prepared check for the lent GPU machine (issue 25): torch + transformers only, at most 8 minutes.

That machine has Python 3.12, torch 2.11, transformers 5.17, safetensors and numpy, but no vLLM, no
platformdirs or gguf, and no network; only 64 MiB travel to it. So this script imports nothing else
(tests/test_gpu_lent_check.py runs it with every other third-party import refused) and builds Qwen3-8B's
shapes from a hand-written config with random bf16 weights (`gpu_ttft.py`). Steps, each written to the
JSON as it ends (a step that fails records its error and the next one runs; past --budget-s the rest are
listed as skipped):

1. plumb check: the RidgeFill path with exact late inputs against exact prefill (logit difference);
2. capture: rows/s of the calibration forward and of the float64 statistics (X^T X, X^T Y_l) on the device;
3. fit: the eigendecomposition and the ridge solve of every late layer, per split, from those statistics;
4. question: the question selector's scoring cost (query rows x every key, scored layers, pooling) per length;
5. TTFT: exact vs RidgeFill (paired, alternating), per split and length, with the FLOP bound and measured/bound.

    PYTHONPATH=. python bench/gpu_lent_check.py --out $OUT/gpu_lent_check.json          # the lent H200
    PYTHONPATH=. python bench/gpu_lent_check.py --shape tiny --lengths 256 512 --splits 1 2 --window 128 \\
        --out /tmp/lent.json                                                               # CPU, seconds
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
import transformers
from gpu_ttft import SHAPES, build_model, plumb_check, random_maps

from ridgefill.capture import SplitStats, layer_inputs
from ridgefill.evals.ttft import paired_ttft, transformers_engine
from ridgefill.fit import RidgeSolver
from ridgefill.flops import speedup_bound
from ridgefill.rows import ROWS, RowPolicy, question_attention, question_mask
from ridgefill.runtime import FillPlan, protected_rows


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed(fn: Callable[[], object]) -> tuple[object, float]:
    """fn's result and its wall time, the device drained before and after."""
    sync()
    t = time.perf_counter()
    out = fn()
    sync()
    return out, time.perf_counter() - t


def capture_rate(model, splits: list[int], window: int, windows: int) -> tuple[dict, dict[int, SplitStats]]:
    """Rows/s of the capture forward (inputs of every layer from the first split on) and of the float64
    statistics for every split, on the model's device; the statistics are returned for the fit step."""
    cfg, device = model.config, next(model.parameters()).device
    stats = {s: SplitStats.zeros(s, cfg.num_hidden_layers, cfg.hidden_size, device) for s in splits}
    wanted = set(range(min(splits), cfg.num_hidden_layers))
    forward_s = stats_s = 0.0
    g = torch.Generator(device="cpu").manual_seed(1)
    for _ in range(windows):
        ids = torch.randint(0, cfg.vocab_size, (1, window), generator=g).to(device)
        with torch.no_grad():
            inputs, dt = timed(lambda ids=ids: layer_inputs(model, ids, wanted))
        forward_s += dt
        for s, st in stats.items():
            ys = {l: inputs[l] for l in st.xy}
            _, dt = timed(lambda x=inputs[s], ys=ys, st=st: st.add(x, ys))
            stats_s += dt
    rows = window * windows
    rate = {"rows": rows, "splits": splits, "forward_s": round(forward_s, 3), "stats_s": round(stats_s, 3)}
    rate |= {"forward_rows_per_s": round(rows / forward_s), "stats_rows_per_s": round(rows / stats_s)}
    rate["stats_device"] = str(device)
    return rate, stats


def fit_times(stats: dict[int, SplitStats], lam: float) -> dict:
    """Seconds for one split's eigendecomposition (with the rotation of every X^T Y_l) and for its solve."""
    out = {}
    for s, st in stats.items():
        solver, eig_s = timed(lambda st=st: RidgeSolver.from_stats(st))
        maps, solve_s = timed(lambda solver=solver: solver.solve(lam))
        out[str(s)] = {"late_layers": len(maps), "eigh_and_rotate_s": round(eig_s, 3), "solve_s": round(solve_s, 3)}
        out[str(s)]["finite"] = bool(all(torch.isfinite(w).all() for w, _ in maps.values()))
    return out


def question_cost(model, lengths: list[int], policy: RowPolicy, repeats: int) -> dict:
    """Median seconds to score one prompt for the question selector: per scored layer the last `query` rows'
    attention over every row, then the pooled top share (what the forward adds on top of its layers)."""
    cfg, p = model.config, next(model.parameters())
    hd = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    out = {}
    for n in lengths:
        queries = torch.randn(cfg.num_attention_heads, policy.query, hd, device=p.device, dtype=p.dtype)
        keys = torch.randn(cfg.num_key_value_heads, n, hd, device=p.device, dtype=p.dtype)

        def score(queries=queries, keys=keys):
            attention = sum(question_attention(queries, keys, hd**-0.5) for _ in range(policy.score_layers))
            return question_mask(attention, policy.sink, policy.tail, policy.share, policy.window, policy.reach)

        times = [timed(score)[1] for _ in range(repeats + 1)][1:]  # the first call warms the kernels
        out[str(n)] = {"median_s": round(statistics.median(times), 5), "repeats": repeats}
    return out


def ttft_rows(model, args, report: dict, write: Callable[[], None], start: float) -> None:
    """Paired exact vs RidgeFill TTFT per split and length, with the FLOP bound (rows written as they end)."""
    engine, device = transformers_engine(model), next(model.parameters()).device
    for split in args.splits:
        plan = FillPlan("ridge", maps=random_maps(model, split), rows=RowPolicy(tail=args.tail))
        for n in args.lengths:
            if time.perf_counter() - start > args.budget_s:
                report["skipped"].append(f"ttft split {split} tokens {n}")
                continue
            ids = torch.randint(0, model.config.vocab_size, (1, n), device=device)
            row = paired_ttft(engine, ids, plan, repeats=args.repeats) | {"split": split}
            row["flop_bound"] = speedup_bound(model.config, n, split, int(protected_rows(ids, plan).sum()))
            row["measured_over_bound"] = row["speedup"] / row["flop_bound"]
            report["ttft"].append(row)
            write()
        del plan
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", choices=sorted(SHAPES), default="qwen3-8b")
    ap.add_argument("--lengths", type=int, nargs="+", default=[8192, 16384, 32768])
    ap.add_argument("--splits", type=int, nargs=2, default=[18, 27])
    ap.add_argument("--tail", type=int, default=ROWS.tail)
    ap.add_argument("--repeats", type=int, default=3, help="paired TTFT repeats per split and length")
    ap.add_argument("--window", type=int, default=4096, help="capture window (tokens)")
    ap.add_argument("--windows", type=int, default=2, help="capture windows timed")
    ap.add_argument("--lam", type=float, default=1e-2)
    ap.add_argument("--budget-s", type=float, default=420.0, help="skip the steps left after this many seconds")
    ap.add_argument("--out", type=Path, default=Path("gpu_lent_check.json"))
    args = ap.parse_args(argv)
    start = time.perf_counter()
    cuda = torch.cuda.is_available()
    device, dtype = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float32)
    report: dict = {
        "device": torch.cuda.get_device_name() if cuda else platform.processor() or "cpu",
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "shape": args.shape,
        "dtype": str(dtype),
        "args": {k: v for k, v in vars(args).items() if k != "out"},
        "ttft": [],
        "skipped": [],
        "errors": {},
    }

    def write() -> None:
        report["elapsed_s"] = round(time.perf_counter() - start, 1)
        args.out.write_text(json.dumps(report, indent=1))

    def step(name: str, fn: Callable[[], object]) -> object:
        if time.perf_counter() - start > args.budget_s:
            report["skipped"].append(name)
            return write()
        try:
            result, dt = timed(fn)
            report[name] = result
            report[f"{name}_s"] = round(dt, 2)
            return result
        except Exception as e:  # noqa: BLE001  (recorded, and the next step runs: the machine time is scarce)
            report["errors"][name] = f"{type(e).__name__}: {e}"[:500]
            if cuda:
                torch.cuda.empty_cache()
        finally:
            write()

    model, report["build_s"] = timed(lambda: build_model(args.shape, device, dtype))
    write()
    step("plumb_check", lambda: plumb_check(model, args.splits[0], args.tail, min(2048, args.lengths[0])))
    stats: dict[int, SplitStats] = {}

    def capture() -> dict:
        rate, got = capture_rate(model, args.splits, args.window, args.windows)
        stats.update(got)
        return rate

    step("capture", capture)
    step("fit", lambda: fit_times(stats, args.lam))
    stats.clear()
    if cuda:
        torch.cuda.empty_cache()
    policy = RowPolicy(share=0.1, select="question")
    step("question", lambda: question_cost(model, args.lengths, policy, repeats=5))
    step("ttft_done", lambda: ttft_rows(model, args, report, write, start) or True)
    report["total_s"] = round(time.perf_counter() - start, 1)
    write()
    return report


if __name__ == "__main__":
    main()
