"""Every change RidgeFill makes to vLLM, in one place (after ArcticInference's `patching.py`).

Each patch replaces one attribute of one vLLM class, once per process; `PATCHES` records what was
replaced (and keeps the original) and why patching stopped, if it did. Patching happens only for the
vLLM versions the plugin is tested with; anything else is refused by name and the model serves stock.

- `VllmConfig.use_v2_model_runner`: pin the V1 model runner, which RidgeFill hooks, when RidgeFill is
  switched on and the operator has not chosen a runner (VLLM_USE_V2_MODEL_RUNNER); an explicit V2 choice
  is respected, and the model then refuses its maps (`config.unsupported`).
- `VllmConfig.__post_init__`: on CUDA, an engine serving RidgeFill runs eager (no CUDA graphs, no
  torch.compile), said in the log: a captured graph replays one fixed kernel sequence, and RidgeFill's
  steps change shape with the row classes.
- `GPUModelRunner._model_forward` (V1; the CPU runner inherits it): classify each step's rows from the
  runner's host-side batch before the model runs (`batch.step_rows`).
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
from ridgefill.vllm_plugin.config import V2_VARIABLE, requested

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
        eager_on_cuda()
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


def graphs_off_reason(model_config, cuda: bool) -> str | None:
    """Why this engine must run eager (the graph policy), or None: RidgeFill on, on CUDA, not yet eager,
    and not refused for an explicit V2 choice."""
    from vllm import envs

    if not cuda or model_config is None or getattr(model_config, "enforce_eager", True):
        return None
    if not requested(model_config) or envs.VLLM_USE_V2_MODEL_RUNNER:
        return None
    return (
        "CUDA graphs and torch.compile are switched off (enforce_eager): steps with bulk rows change "
        "kernel shapes with the row classes, which a captured graph cannot replay"
    )


def eager_on_cuda() -> None:
    from vllm.config import VllmConfig
    from vllm.platforms import current_platform

    def make(original):
        def __post_init__(self):
            why = graphs_off_reason(getattr(self, "model_config", None), current_platform.is_cuda_alike())
            if why:
                _log().warning("RidgeFill: %s", why)
                self.model_config.enforce_eager = True
            original(self)

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
            state.rows = step_rows(self, state.classifier)
            try:
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
