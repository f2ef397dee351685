"""The GPU serving policy, decided on the CPU (issue 25): decode keeps its CUDA graphs, every refusal known
from the config comes before the graph policy, FlashAttention is pinned, no RidgeFill step replays a graph,
and the question selector's kept material is capped.

The configs are vLLM's own (`ModelConfig` of a tiny saved Llama, `VllmConfig`, `CompilationConfig`,
`AttentionConfig`); CUDA is simulated by monkeypatching vLLM's `current_platform`. Where a test must see
the config exactly as vLLM's own `__post_init__` receives it, that method is swapped for a recorder under
the RidgeFill patch (as the real one is wrapped); one test runs vLLM's whole `__post_init__` instead.
"""

from __future__ import annotations

import logging
from types import SimpleNamespace

import numpy as np
import pytest
import torch

pytest.importorskip("vllm")

import vllm.logger  # noqa: E402
from vllm.config import AttentionConfig, CacheConfig, CompilationConfig, ModelConfig, VllmConfig  # noqa: E402
from vllm.config.compilation import CompilationMode, CUDAGraphMode  # noqa: E402
from vllm.platforms import current_platform  # noqa: E402
from vllm.v1.worker.gpu_model_runner import GPUModelRunner  # noqa: E402

from ridgefill.fingerprint import fingerprint  # noqa: E402
from ridgefill.maps import MapInfo, write_maps  # noqa: E402
from ridgefill.rows import RowPolicy  # noqa: E402
from ridgefill.vllm_plugin import patches, register  # noqa: E402
from ridgefill.vllm_plugin.batch import RowClassifier  # noqa: E402
from ridgefill.vllm_plugin.patches import PATCHES  # noqa: E402
from tests.conftest import tiny_model  # noqa: E402
from tests.test_vllm_runner import _Model, _state  # noqa: E402  (the hooked runner's fake model)

SPLIT = 3
POLICY_LINE = "cudagraph_mode FULL_DECODE_ONLY"


@pytest.fixture(scope="module")
def served(tmp_path_factory, tokenizer):
    """A tiny Llama saved for vLLM, identity maps fitted for it, and maps of another model (a Qwen3)."""
    root = tmp_path_factory.mktemp("gpu-policy")
    model = tiny_model("llama", len(tokenizer), head_dim=32, num_attention_heads=2, num_key_value_heads=1)
    model.save_pretrained(root / "model")
    tokenizer.save_pretrained(root / "model")
    write_maps(root / "maps", {}, fingerprint(model, tokenizer, SPLIT), MapInfo(SPLIT, kind="identity"))
    other = tiny_model("qwen3", len(tokenizer), head_dim=32, num_attention_heads=2, num_key_value_heads=1)
    write_maps(root / "other", {}, fingerprint(other, tokenizer, SPLIT), MapInfo(SPLIT, kind="identity"))
    register()
    return root


@pytest.fixture(autouse=True)
def _clean(monkeypatch):
    patches.apply_all()
    assert PATCHES.refused is None, PATCHES.refused
    for name in ("VLLM_USE_V2_MODEL_RUNNER", "RIDGEFILL_MAPS", "RIDGEFILL_MAX_KEPT"):
        monkeypatch.delenv(name, raising=False)


@pytest.fixture
def log():
    """vllm.ridgefill's log, with vLLM's once-only memory cleared (its loggers do not reach caplog)."""
    for once in (vllm.logger._print_info_once, vllm.logger._print_warning_once):
        once.cache_clear()
    records: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda r: records.append(r.getMessage())
    logger = logging.getLogger("vllm.ridgefill")
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    yield records
    logger.removeHandler(handler)
    logger.setLevel(level)


@pytest.fixture
def cuda(monkeypatch):
    """vLLM's platform says CUDA (and graphs), as on a GPU machine."""
    monkeypatch.setattr(current_platform, "is_cuda_alike", lambda: True)
    monkeypatch.setattr(current_platform, "support_static_graph_mode", lambda: True)


@pytest.fixture
def vllm_sees(monkeypatch):
    """Swap vLLM's own VllmConfig.__post_init__ for a recorder of what it would receive (RidgeFill's patch
    wraps the recorder as it wraps the real one)."""
    seen: dict = {}

    def record(self):
        cc, mc = self.compilation_config, self.model_config
        seen.update(mode=cc.mode, graphs=cc.cudagraph_mode, eager=mc.enforce_eager)
        seen.update(backend=self.attention_config.backend)

    monkeypatch.setattr(VllmConfig, "__post_init__", record)
    monkeypatch.delitem(PATCHES.applied, "VllmConfig.__post_init__")
    patches.graphs_for_decode()
    return seen


def model_config(root, maps="maps", arch="RidgeFillLlamaForCausalLM", **kw) -> ModelConfig:
    overrides = {"architectures": [arch], "ridgefill_maps": str(root / maps)} if maps else {"architectures": [arch]}
    return ModelConfig(model=str(root / "model"), dtype=kw.pop("dtype", "bfloat16"), hf_overrides=overrides, **kw)


UNTOUCHED = {"mode": None, "graphs": None, "eager": False}


def test_decode_graphs_and_the_flash_attention_pin_on_cuda(served, cuda, vllm_sees, log):
    VllmConfig(model_config=model_config(served))
    assert vllm_sees == {
        "mode": CompilationMode.NONE,
        "graphs": CUDAGraphMode.FULL_DECODE_ONLY,
        "eager": False,
        "backend": current_backend("FLASH_ATTN"),
    }
    assert sum(POLICY_LINE in m for m in log) == 1 and any("pinned to FLASH_ATTN" in m for m in log)
    VllmConfig(model_config=model_config(served))
    assert sum(POLICY_LINE in m for m in log) == 1  # logged once per process


def current_backend(name: str):
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    return AttentionBackendEnum[name]


def test_vllm_keeps_decode_graphs_through_its_own_post_init(served, cuda):
    """vLLM's whole __post_init__ (simulated CUDA) keeps mode NONE with FULL_DECODE_ONLY and runs no eager:
    `_normalize_piecewise_cudagraph_mode` demotes only piecewise modes."""
    cfg = VllmConfig(model_config=model_config(served))
    cc = cfg.compilation_config
    assert (cc.mode, cc.cudagraph_mode, cfg.model_config.enforce_eager) == (
        CompilationMode.NONE,
        CUDAGraphMode.FULL_DECODE_ONLY,
        False,
    )
    assert cfg.attention_config.backend == current_backend("FLASH_ATTN")
    # a refused engine (an explicit FlashInfer) comes out exactly as the same engine without RidgeFill
    refused = VllmConfig(model_config=model_config(served), attention_config=AttentionConfig(backend="FLASHINFER"))
    stock = VllmConfig(model_config=model_config(served, maps=None, arch="LlamaForCausalLM"))
    got, want = refused.compilation_config, stock.compilation_config
    assert (got.mode, got.cudagraph_mode) == (want.mode, want.cudagraph_mode)
    assert got.mode != CompilationMode.NONE  # the platform's torch.compile kept (here the CPU platform's defaults)
    assert refused.attention_config.backend == current_backend("FLASHINFER")


def test_an_operators_explicit_choice_is_respected(served, cuda, vllm_sees, log):
    VllmConfig(model_config=model_config(served, enforce_eager=True))
    assert vllm_sees == {"mode": None, "graphs": None, "eager": True, "backend": current_backend("FLASH_ATTN")}
    assert any("left to the operator (--enforce-eager" in m for m in log)
    cc = CompilationConfig(mode=CompilationMode.VLLM_COMPILE, cudagraph_mode=CUDAGraphMode.FULL_AND_PIECEWISE)
    VllmConfig(model_config=model_config(served), compilation_config=cc)
    assert (vllm_sees["mode"], vllm_sees["graphs"]) == (CompilationMode.VLLM_COMPILE, CUDAGraphMode.FULL_AND_PIECEWISE)
    VllmConfig(model_config=model_config(served), compilation_config=CompilationConfig(cudagraph_mode="PIECEWISE"))
    assert (vllm_sees["mode"], vllm_sees["graphs"]) == (None, CUDAGraphMode.PIECEWISE)
    explicit = AttentionConfig(backend="FLASH_ATTN")  # FlashAttention named: served, graphs for decode
    VllmConfig(model_config=model_config(served), attention_config=explicit)
    assert vllm_sees["graphs"] == CUDAGraphMode.FULL_DECODE_ONLY


@pytest.mark.parametrize(
    ("case", "words"),
    [
        ({"attention_config": AttentionConfig(backend="FLASHINFER")}, "attention backend FLASHINFER"),
        ({"attention_config": AttentionConfig(backend_per_kind={"full_attention": "TRITON_ATTN"})}, "TRITON_ATTN"),
        ({"dtype": "float32"}, "float32 is not supported on CUDA"),
        ({"maps": "other"}, "architecture: maps are for 'Qwen3ForCausalLM'"),
        ({"maps": "missing"}, "is not a map folder"),
        ({"maps": "stray"}, "files not listed in the manifest: evil.pkl"),
        ({"maps": None}, "no map folder given"),
        ({"cache_config": CacheConfig(cache_dtype="fp8")}, "KV cache dtype fp8"),
        ({"v2": True}, "Model Runner V2 is selected"),
    ],
    ids=["flashinfer", "per-kind", "float32", "fingerprint", "no-folder", "unlisted-file", "no-maps", "fp8", "v2"],
)
def test_every_config_refusal_comes_first_and_leaves_the_graphs(served, cuda, vllm_sees, log, monkeypatch, case, words):
    """A refused engine reaches vLLM exactly as asked: no compile or graph setting, no eager, no pin."""
    case = dict(case)
    if case.pop("v2", False):
        monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "1")
    if case.get("maps") == "stray":
        (served / "stray").mkdir(exist_ok=True)
        for f in (served / "maps").iterdir():
            (served / "stray" / f.name).write_bytes(f.read_bytes())
        (served / "stray" / "evil.pkl").write_bytes(b"x")
    mc_kw = {k: case.pop(k) for k in ("maps", "dtype") if k in case}
    attention = case.get("attention_config")
    VllmConfig(model_config=model_config(served, **mc_kw), **case)
    want_backend = attention.backend if attention is not None else None
    assert vllm_sees == UNTOUCHED | {"backend": want_backend}
    assert any(words in m and "serving stock" in m and "untouched" in m for m in log), log


def test_no_policy_off_cuda_or_without_ridgefill(served, monkeypatch, vllm_sees, log):
    VllmConfig(model_config=model_config(served))  # the CPU: vLLM's own defaults (torch.compile, tested)
    assert vllm_sees == UNTOUCHED | {"backend": None}
    monkeypatch.setattr(current_platform, "is_cuda_alike", lambda: True)
    VllmConfig(model_config=model_config(served, maps=None, arch="LlamaForCausalLM"))  # stock model
    assert vllm_sees == UNTOUCHED | {"backend": None} and not log


def test_a_vllm_without_the_names_falls_back_to_eager(served, cuda, vllm_sees, log, monkeypatch):
    monkeypatch.setattr(patches, "_decode_graph_names", lambda: None)
    VllmConfig(model_config=model_config(served))
    assert vllm_sees == {"mode": None, "graphs": None, "eager": True, "backend": current_backend("FLASH_ATTN")}
    assert any("FULL_DECODE_ONLY: running eager instead (enforce_eager)" in m for m in log)


# --- no RidgeFill step replays a graph ---------------------------------------------------------------

SINK, TAIL = 4, 16


def _runner(reqs, raw, wrapper):
    """A V1 runner's host-side state whose `model` is a graph wrapper around `raw` (what get_model returns).
    reqs: (id, prompt, computed, scheduled)."""
    n = len(reqs)
    token_ids = np.zeros((n, max(len(p) for _, p, _, _ in reqs) + 8), dtype=np.int32)
    for r, (_, p, _, _) in enumerate(reqs):
        token_ids[r, : len(p)] = p
    qsl = np.zeros(n + 1, dtype=np.int32)
    qsl[1:] = np.cumsum([s for *_, s in reqs])
    batch = SimpleNamespace(
        req_ids=[r[0] for r in reqs],
        num_reqs=n,
        num_computed_tokens_cpu=np.array([c for _, _, c, _ in reqs], dtype=np.int32),
        num_prompt_tokens=np.array([len(p) for _, p, _, _ in reqs], dtype=np.int32),
        token_ids_cpu=token_ids,
    )
    requests = {r[0]: SimpleNamespace(sampling_params=SimpleNamespace(prompt_logprobs=None)) for r in reqs}
    runner = SimpleNamespace(input_batch=batch, query_start_loc=SimpleNamespace(np=qsl), requests=requests)
    runner.model, runner.get_model = wrapper, lambda: raw
    return runner


def test_decode_steps_replay_graphs_and_ridgefill_steps_run_past_the_wrapper():
    """Decode-only: the classifier returns None, the graph wrapper runs (a replay). A step with bulk rows, even
    one of one-token chunks that vLLM's dispatcher takes for a uniform decode, calls the model itself."""
    classifier = RowClassifier(RowPolicy(SINK, TAIL, 0.0), None)
    state = _state(classifier)
    raw, wrapper = _Model(state), _Model(state)
    prompt = np.arange(100, 300)
    decodes = _runner([("a", prompt, 200, 1), ("b", prompt[:50], 60, 1)], raw, wrapper)
    GPUModelRunner._model_forward(decodes, torch.zeros(2), torch.arange(2))
    assert wrapper.seen == [None] and raw.seen == []
    one_token_chunks = _runner([("c", prompt, 40, 1), ("d", prompt[:50], 60, 1)], raw, wrapper)  # c: bulk row 40
    GPUModelRunner._model_forward(one_token_chunks, torch.zeros(2), torch.arange(2))
    assert len(raw.seen) == 1 and raw.seen[0].any_bulk and len(wrapper.seen) == 1
    tail_only = _runner([("e", prompt, 190, 10)], raw, wrapper)  # tail rows only: stock, graphs allowed
    GPUModelRunner._model_forward(tail_only, torch.zeros(10), torch.arange(10))
    assert len(wrapper.seen) == 2 and not wrapper.seen[1].any_bulk and len(raw.seen) == 1
    assert state.rows is None  # only for the step


def test_graph_capture_never_calls_the_hooked_forward():
    """Capture, warm-up and memory profiling go through `_dummy_run`, which calls `self.model(...)` directly:
    the model then sees no rows and runs stock, so a captured graph holds only the stock forward."""
    import inspect

    dummy = inspect.getsource(GPUModelRunner._dummy_run)
    assert "self.model(" in dummy and "_model_forward" not in dummy
    assert "_warmup_and_capture" in inspect.getsource(GPUModelRunner._capture_cudagraphs)
    assert "_dummy_run" in inspect.getsource(GPUModelRunner._warmup_and_capture)
    assert "_dummy_run" in inspect.getsource(GPUModelRunner.profile_run)


# --- the kept-material cap ------------------------------------------------------------------------


def _question_step(classifier, reqs):
    """Classify one step: reqs (id, prompt, computed, scheduled), all held by the runner."""
    ids = [r[0] for r in reqs]
    qsl = np.concatenate([[0], np.cumsum([s for *_, s in reqs])])
    prompts = [p for _, p, _, _ in reqs]
    return classifier.classify(
        ids,
        qsl,
        np.array([c for _, _, c, _ in reqs]),
        np.array([len(p) for p in prompts]),
        lambda r, plen: prompts[r][:plen],
        held=set(ids),
    )


def test_chunked_question_prompts_past_the_cap_run_exact_and_are_counted(monkeypatch):
    policy = RowPolicy(SINK, TAIL, 0.2, "question", 8, 4, 2, 0)
    monkeypatch.setenv("RIDGEFILL_MAX_KEPT", "1")
    classifier = RowClassifier(policy, None)
    assert classifier.max_kept == 1
    p = np.arange(100, 300)
    rows = _question_step(classifier, [("a", p, 0, 64), ("b", p, 0, 64)])  # two first chunks
    assert [q.req_id for q in rows.questions] == ["a"] and list(classifier.kept) == [("a", 200)]
    assert not rows.protected[:64].all() and rows.protected[64:].all()  # b: every row exact, nothing kept
    assert classifier.capped_prompts == 1
    rows = _question_step(classifier, [("a", p, 64, 136), ("b", p, 64, 136)])  # both last chunks
    assert [q.req_id for q in rows.questions] == ["a"] and rows.protected[136:].all()
    assert classifier.exact_prompts == 1 and classifier.capped_prompts == 1
    state = _state(classifier)
    state.after_step()
    assert state.counters.as_dict()["question_capped"] == 1
    # a not yet started prompt keeps material again once the cap frees (a's kept material goes with its end)
    classifier.kept.clear()
    rows = _question_step(classifier, [("c", p, 0, 64)])
    assert [q.req_id for q in rows.questions] == ["c"] and classifier.capped_prompts == 1
    # prompts scheduled whole keep nothing across steps: never capped
    whole = RowClassifier(policy, None, max_kept=0)
    rows = _question_step(whole, [("d", p, 0, 200)])
    assert [q.req_id for q in rows.questions] == ["d"] and whole.capped_prompts == 0
