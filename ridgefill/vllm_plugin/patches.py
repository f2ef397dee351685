"""Every change RidgeFill makes to vLLM, in one place (after ArcticInference's `patching.py`).

Each patch replaces one attribute of one vLLM class, once per process; `PATCHES` records what was
replaced (and keeps the original) and why patching stopped, if it did. Patching happens only for the
vLLM versions the plugin is tested with; anything else is refused by name and the model serves stock.

- `VllmConfig.use_v2_model_runner`: pin the V1 model runner, which RidgeFill hooks, when RidgeFill is
  switched on and the operator has not chosen a runner (VLLM_USE_V2_MODEL_RUNNER); an explicit V2 choice
  is respected, and the model then refuses its maps (`config.unsupported`).
- `VllmConfig.__post_init__` (before vLLM's own runs): on CUDA, with RidgeFill asked for, first every
  refusal knowable from the config (`config.refusal`: features, attention backend, dtype, the named map
  folder and its fingerprint); a refused engine is left exactly as asked, graphs included. Otherwise the
  attention backend is pinned to FLASH_ATTN when none is chosen, and, unless the operator chose
  --enforce-eager or a compilation setting, compile mode NONE with cudagraph_mode FULL_DECODE_ONLY:
  decode-only steps replay CUDA graphs, mixed and prefill steps run eager (`graph_policy`, logged once).
- `GPUModelRunner._model_forward` (V1; the CPU runner inherits it): classify each step's rows from the
  runner's host-side batch before the model runs (`batch.step_rows`). A decode-only step classifies to None
  and runs stock through vLLM's graph wrapper (a replay); a step with bulk or question rows calls the model
  past the wrapper (`eager_forward`), so no RidgeFill step ever replays a graph. Graph capture, warm-up and
  the memory-profiling run call `runner.model(...)` from `_dummy_run`, never `_model_forward`, so the model
  then sees no rows and runs stock: the captured graphs hold only the stock forward.
- `GPUModelRunner._on_request_state_removed`: a finished or aborted request's kept material is freed when
  the runner lets it go (`ServeState.release`), even when no model step follows.
- `EngineCore.__init__`, `EngineCore.preprocess_add_request`, `KVCacheManager.get_computed_blocks`,
  `KVCacheCoordinator.cache_blocks`: the prefix-cache rule of `prefix_cache.py`, one policy per engine.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass, field

from packaging.specifiers import SpecifierSet
from packaging.version import Version

from ridgefill import settings
from ridgefill.vllm_plugin.config import FLASH_ATTN, V2_VARIABLE, backend_names, on_cuda, refusal, requested

SUPPORTED_VLLM = SpecifierSet(">=0.32,<0.33")
# what the runner hook reads from a V1 model runner and its input batch
RUNNER_SURFACE = ("input_batch", "query_start_loc", "requests")
BATCH_SURFACE = ("req_ids", "num_reqs", "num_computed_tokens_cpu", "num_prompt_tokens", "token_ids_cpu")


class PatchError(RuntimeError):
    """vLLM lacks what a patch replaces: that patch, and RidgeFill, are off."""


@dataclass
class Patches:
    """What this process changed in vLLM: `applied` maps 'Class.attr' to the original attribute."""

    applied: dict[str, object] = field(default_factory=dict)
    refused: str | None = None  # why patching stopped (then RidgeFill serves stock)
    runner_refused: str | None = None  # a V1 runner lacked what the hook reads

    def why_not(self) -> str | None:
        """Why no engine in this process can serve maps, or None."""
        return self.refused or self.runner_refused

    def hooked(self, name: str) -> bool:
        return name in self.applied


PATCHES = Patches()


def _log():
    from vllm.logger import init_logger

    return init_logger("vllm.ridgefill")


def replace(cls: type, name: str, make: Callable[[object], object]) -> None:
    """Set cls.name to make(original), once; PatchError if vLLM has no such attribute."""
    key = f"{cls.__name__}.{name}"
    if key in PATCHES.applied:
        return
    original = inspect.getattr_static(cls, name, None)
    if original is None:
        raise PatchError(f"vLLM's {cls.__module__}.{cls.__qualname__} has no {name}")
    setattr(cls, name, make(original))
    PATCHES.applied[key] = original


def apply_all() -> None:
    """Apply every patch (idempotent). A vLLM outside SUPPORTED_VLLM, or a missing attribute, is refused
    with an error naming it; the model classes then serve stock."""
    if PATCHES.applied or PATCHES.refused:
        return
    import vllm

    version = Version(vllm.__version__.split("+")[0])
    if version not in SUPPORTED_VLLM:
        PATCHES.refused = f"vLLM {vllm.__version__} is outside the supported range {SUPPORTED_VLLM}"
        _log().error("RidgeFill: %s; not patching vLLM, every model serves stock", PATCHES.refused)
        return
    try:
        pin_v1_runner()
        graphs_for_decode()
        hook_runner()
        prefix_cache_rule()
    except PatchError as e:
        PATCHES.refused = str(e)
        _log().error("RidgeFill: %s; every model serves stock", e)


# --- runner choice -----------------------------------------------------------------------------


def _v2_needed(vllm_config) -> bool:
    """A feature vLLM serves only on Model Runner V2 (its own rule in `use_v2_model_runner`)."""
    attention = getattr(vllm_config, "attention_config", None)
    return getattr(attention, "hisparse_config", None) is not None or (
        getattr(vllm_config, "watermark_config", None) is not None
    )


def choose_runner(vllm_config, stock_choice: Callable[[], bool]) -> bool:
    """use_v2_model_runner with RidgeFill on: V1 unless the operator chose (VLLM_USE_V2_MODEL_RUNNER) or a
    feature needs V2 (then RidgeFill refuses; `config.unsupported`)."""
    from vllm import envs

    choice = stock_choice()
    if not choice or envs.VLLM_USE_V2_MODEL_RUNNER is not None or _v2_needed(vllm_config):
        return choice
    if not requested(getattr(vllm_config, "model_config", None)):
        return choice
    _log().info_once(
        f"RidgeFill: pinning vLLM's V1 model runner (the runner RidgeFill hooks); {V2_VARIABLE} was not set"
    )
    return False


def pin_v1_runner() -> None:
    from vllm.config import VllmConfig

    def make(prop):
        if not isinstance(prop, property):
            raise PatchError("VllmConfig.use_v2_model_runner is no longer a property")
        return property(lambda self: choose_runner(self, lambda: prop.fget(self)), doc=prop.__doc__)

    replace(VllmConfig, "use_v2_model_runner", make)


# --- CUDA graphs -------------------------------------------------------------------------------


@dataclass(frozen=True)
class GraphPolicy:
    """What the engine-config patch does for one engine (decided before vLLM derives anything from it).

    action: "stock" (RidgeFill not asked for, or not on CUDA: nothing touched), "refused" (a refusal known
    from the config: nothing touched, the engine keeps vLLM's graphs and the model serves stock), "operator"
    (an explicit --enforce-eager or compilation choice, kept), "decode_graphs" (compile mode NONE,
    cudagraph_mode FULL_DECODE_ONLY), "eager" (this vLLM lacks those names: enforce_eager, the old policy).
    """

    action: str
    why: str = ""
    pin_backend: bool = False  # no attention backend chosen: pin FlashAttention


def _decode_graph_names():
    """(CompilationMode.NONE, CUDAGraphMode.FULL_DECODE_ONLY), or None where this vLLM lacks either."""
    try:
        from vllm.config.compilation import CompilationMode, CUDAGraphMode

        return CompilationMode.NONE, CUDAGraphMode.FULL_DECODE_ONLY
    except (ImportError, AttributeError):
        return None


def graph_policy(vllm_config, cuda: bool) -> GraphPolicy:
    """The graph policy of an engine whose model_config and compilation_config the operator has set and vLLM's
    own __post_init__ has not yet read: every config-knowable refusal first (`config.refusal`), then the
    operator's explicit choice, then decode graphs (steps with bulk rows run eager; see `hook_runner`)."""
    mc = getattr(vllm_config, "model_config", None)
    if not cuda or mc is None or not requested(mc):
        return GraphPolicy("stock")
    why = refusal(vllm_config, cuda)
    if why:
        return GraphPolicy("refused", why)
    pin = not backend_names(getattr(vllm_config, "attention_config", None))
    cc = vllm_config.compilation_config
    if mc.enforce_eager:
        return GraphPolicy("operator", "--enforce-eager is set: no CUDA graphs, no torch.compile", pin)
    if cc.mode is not None or cc.cudagraph_mode is not None:
        return GraphPolicy("operator", f"compilation mode {cc.mode}, cudagraph_mode {cc.cudagraph_mode}", pin)
    if _decode_graph_names() is None:
        why = "this vLLM has no CompilationMode.NONE or CUDAGraphMode.FULL_DECODE_ONLY: running eager instead"
        return GraphPolicy("eager", why, pin)
    return GraphPolicy("decode_graphs", "", pin)


def apply_graph_policy(vllm_config, policy: GraphPolicy) -> None:
    """Set what the policy decided on the config, and say so once."""
    log = _log()
    if policy.action == "refused":
        log.warning_once(f"RidgeFill: {policy.why}; serving stock (vLLM's CUDA graphs and compile settings untouched)")
        return
    if policy.pin_backend:
        from vllm.v1.attention.backends.registry import AttentionBackendEnum

        vllm_config.attention_config.backend = AttentionBackendEnum[FLASH_ATTN]
        log.info_once(f"RidgeFill: attention backend pinned to {FLASH_ATTN} (the CUDA backend RidgeFill writes)")
    if policy.action == "operator":
        log.info_once(f"RidgeFill: graph policy left to the operator ({policy.why})")
    elif policy.action == "eager":
        log.warning_once(f"RidgeFill: {policy.why} (enforce_eager)")
        vllm_config.model_config.enforce_eager = True
    elif policy.action == "decode_graphs":
        mode, graphs = _decode_graph_names()
        vllm_config.compilation_config.mode, vllm_config.compilation_config.cudagraph_mode = mode, graphs
        log.info_once(
            "RidgeFill: graph policy: compilation mode NONE, cudagraph_mode FULL_DECODE_ONLY (decode-only steps "
            "replay CUDA graphs; steps with bulk rows run eager)"
        )


def check_graph_policy(vllm_config, policy: GraphPolicy) -> None:
    """After vLLM's own __post_init__: say so when vLLM changed the decode graphs the policy asked for."""
    if policy.action != "decode_graphs":
        return
    got = vllm_config.compilation_config.cudagraph_mode
    if got != _decode_graph_names()[1]:
        _log().warning_once(f"RidgeFill: vLLM set cudagraph_mode {got} over FULL_DECODE_ONLY; decode runs with it")


def graphs_for_decode() -> None:
    from vllm.config import VllmConfig

    def make(original):
        def __post_init__(self):
            policy = graph_policy(self, on_cuda())
            apply_graph_policy(self, policy)
            original(self)
            check_graph_policy(self, policy)

        return __post_init__

    replace(VllmConfig, "__post_init__", make)


# --- the runner hook ---------------------------------------------------------------------------


def runner_surface_missing(runner) -> list[str]:
    """What the hook reads that this runner lacks (empty when the V1 surface is there)."""
    missing = [n for n in RUNNER_SURFACE if not hasattr(runner, n)]
    batch = getattr(runner, "input_batch", None)
    missing += [f"input_batch.{n}" for n in BATCH_SURFACE if batch is not None and not hasattr(batch, n)]
    qsl = getattr(runner, "query_start_loc", None)
    if qsl is not None and not hasattr(qsl, "np"):
        missing.append("query_start_loc.np")
    return missing


def eager_forward(model, input_ids, positions, intermediate_tensors=None, inputs_embeds=None, **kwargs):
    """Call the model itself, past vLLM's CUDA-graph wrapper: a step with bulk rows or question rows never
    replays a graph (a step of one-token prefill chunks looks like a uniform decode to vLLM's dispatcher, and
    a replayed graph would run the stock kernels without the RidgeFill forward)."""
    return model(
        input_ids=input_ids,
        positions=positions,
        intermediate_tensors=intermediate_tensors,
        inputs_embeds=inputs_embeds,
        **kwargs,
    )


def hook_runner() -> None:
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    from ridgefill.vllm_plugin.batch import step_rows

    def make(original):
        if not callable(original):
            raise PatchError("GPUModelRunner._model_forward is not a method")

        def _model_forward(self, input_ids=None, positions=None, *args, **kwargs):
            state = getattr(self.get_model(), "ridgefill", None)
            if state is None or not state.enabled or positions is None:
                return original(self, input_ids, positions, *args, **kwargs)
            missing = runner_surface_missing(self)
            if missing:  # loud, once, and off for good: the log must never claim rows it did not fill
                PATCHES.runner_refused = f"vLLM's V1 model runner lacks {', '.join(missing)}"
                _log().error("RidgeFill: %s; RidgeFill is off, serving stock", PATCHES.runner_refused)
                state.refuse(PATCHES.runner_refused)
                return original(self, input_ids, positions, *args, **kwargs)
            state.rows = rows = step_rows(self, state.classifier)
            try:
                if rows is not None and (rows.any_bulk or rows.questions) and self.model is not self.get_model():
                    return eager_forward(self.get_model(), input_ids, positions, *args, **kwargs)
                return original(self, input_ids, positions, *args, **kwargs)
            finally:
                state.rows = None
                state.after_step()

        return _model_forward

    replace(GPUModelRunner, "_model_forward", make)

    def make_release(original):
        def _on_request_state_removed(self, req_id, req_state):
            original(self, req_id, req_state)
            state = getattr(getattr(self, "model", None), "ridgefill", None)
            if state is not None:  # finished or aborted: its kept material goes now, not at the next forward
                state.release(req_id)

        return _on_request_state_removed

    replace(GPUModelRunner, "_on_request_state_removed", make_release)


# --- prefix caching ----------------------------------------------------------------------------


def _in_process_model(executor):
    """The served model when it runs in this process (one device, no worker processes), else None."""
    worker = getattr(getattr(executor, "driver_worker", None), "worker", None)
    runner = getattr(worker, "model_runner", None)
    return getattr(runner, "model", None)


def prefix_cache_rule() -> None:
    from vllm.v1.core.kv_cache_coordinator import KVCacheCoordinator
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.engine.core import EngineCore

    from ridgefill.vllm_plugin import prefix_cache as pc

    def policy_of(core):
        """The engine's cache policy, made once: the model's word where it runs here, else the config's.
        Made on first use too, because EngineCore.__init__ itself loads the plugins: in a fresh engine
        process this patch lands after that first __init__ has begun, and its wrapper never runs."""
        scheduler = getattr(core, "scheduler", None)
        if scheduler is None:
            return None
        if not hasattr(scheduler, "ridgefill_cache"):
            model = _in_process_model(getattr(core, "model_executor", None))
            scheduler.ridgefill_cache = pc.engine_policy(core.vllm_config, model)
        return scheduler.ridgefill_cache

    def make_init(original):
        def __init__(self, vllm_config, *args, **kwargs):
            original(self, vllm_config, *args, **kwargs)
            policy_of(self)

        return __init__

    def make_preprocess(original):
        def preprocess_add_request(self, request):
            policy = policy_of(self)
            cap = pc.request_cap(policy, request)
            if cap is not None:  # salt before the block hashes are computed
                request.cache_salt = pc.salt(request.cache_salt, policy.tag)
            req, wave = original(self, request)
            setattr(req, pc.CAP, cap)
            return req, wave

        return preprocess_add_request

    def make_lookup(original):
        def get_computed_blocks(self, request):
            cap = getattr(request, pc.CAP, None)
            if cap is None:
                return original(self, request)
            if cap <= 0 or not self.prefix_cache_lookup_enabled(request):
                return self.empty_kv_cache_blocks, 0, 0
            limit = min(cap, request.num_tokens - 1)
            blocks, hit, _ = self.coordinator.find_longest_cache_hit(request.block_hashes, limit)
            if hit and self.enable_kv_cache_events and getattr(request, "kv_cache_report_mode", "") == "full":
                self.coordinator.emit_cached_block_events(request, blocks)  # as the stock lookup does
            return self.create_kv_cache_blocks(blocks), hit, 0

        return get_computed_blocks

    def make_store(original):
        def cache_blocks(self, request, num_computed_tokens: int) -> None:
            cap = getattr(request, pc.CAP, None)
            original(self, request, num_computed_tokens if cap is None else min(num_computed_tokens, cap))

        return cache_blocks

    replace(EngineCore, "__init__", make_init)
    replace(EngineCore, "preprocess_add_request", make_preprocess)
    replace(KVCacheManager, "get_computed_blocks", make_lookup)
    replace(KVCacheCoordinator, "cache_blocks", make_store)


def log_every() -> int:
    """RidgeFill logs its counters every this many steps with bulk rows (RIDGEFILL_LOG_EVERY, default 256)."""
    return settings.log_every()
