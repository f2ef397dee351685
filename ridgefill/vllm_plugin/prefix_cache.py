"""Prefix caching that never hands filled K/V to a row that must be exact.

With share 0 a prompt row's class depends only on its position (sink, bulk, or within `tail` of the
prompt's end), so the K/V of a row that was bulk or sink is a function of the tokens up to it, the maps
and the sink. RidgeFill therefore:
- salts the block hashes of every request that has bulk rows with what a filled block depends on, so
  stock requests (short prompts, RidgeFill off) and RidgeFill requests never share a block;
- caches a RidgeFill request's blocks only below its tail (`prompt_len - tail`), so a cached block holds
  bulk and sink rows only, never tail rows computed over filled K/V or decoded tokens;
- lets a RidgeFill request reuse blocks only below its own tail, so its protected rows are computed.
A request served from the cache thus gets the K/V it would have written itself. Requests asking for
prompt logprobs run stock (every row needs its logits) and cache like stock ones; a streamed (resumable)
prompt grows, so its rows' classes are not final and it neither stores nor reuses blocks. With a share above 0 a
row's class depends on the whole prompt, so RidgeFill requests then neither store nor reuse blocks.

The policy is registered by the model when it loads its maps, which the scheduler sees when the model
runs in its process (one device). When the model runs in other processes (tensor parallel), the
scheduler derives the same policy from the engine's config and the folder's manifest.
"""

from __future__ import annotations

import hashlib
import json
import secrets
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

CAP = "ridgefill_cache_cap"  # attribute set on vLLM Requests: tokens that may be cached and reused


@dataclass(frozen=True)
class CachePolicy:
    """What a filled block depends on (`tag`) and the row policy that bounds what may be cached."""

    tag: str
    sink: int
    tail: int
    share: float
    enabled: Callable[[], bool]

    def cap(self, prompt_len: int) -> int | None:
        """Tokens of this prompt that may be cached or reused; None for a request served stock."""
        if not self.enabled() or prompt_len <= self.sink + self.tail:
            return None
        return 0 if self.share > 0 else prompt_len - self.tail


def policy_for(manifest: dict, sink: int, tail: int, share: float, mode: str, enabled: Callable[[], bool]):
    """The policy of a map folder served with these options (the tag names what filled K/V depend on)."""
    digest = hashlib.sha256(json.dumps(manifest, sort_keys=True).encode()).hexdigest()[:16]
    nonce = secrets.token_hex(8)  # a stock request cannot pick this engine's salt as its own cache_salt
    return CachePolicy(f"ridgefill/{digest}/{mode}/sink{sink}/{nonce}", sink, tail, share, enabled)


def policy_from_config(vllm_config) -> CachePolicy | None:
    """The policy for an engine whose model runs in other processes; None if it serves no maps."""
    from ridgefill.maps import read_manifest
    from ridgefill.vllm_plugin.model import maps_path, serve_options, unsupported

    cfg = vllm_config.model_config.hf_config
    path = maps_path(cfg)
    if not path or not vllm_config.cache_config.enable_prefix_caching or unsupported(vllm_config):
        return None
    try:
        manifest = read_manifest(Path(path))
        sink, tail, share, mode = serve_options(cfg, manifest)
    except (OSError, ValueError):  # MapError too: the model refuses the folder as well, and serves stock
        return None
    return policy_for(manifest, sink, tail, share, mode, lambda: True)


_policy: CachePolicy | None = None
_model_here = False  # a RidgeFill model was built in this process: its word is the policy
_patched = False


def activate(policy: CachePolicy | None) -> None:
    """Register the served model's policy (None: every request is stock)."""
    global _policy
    _policy = policy


def model_built_here() -> None:
    global _model_here
    _model_here = True


def _salt(user_salt: str | None, tag: str) -> str:
    return f"{user_salt}|{tag}" if user_salt else tag


def patch_scheduler() -> None:
    """Patch request hashing, cache lookup and block caching (pass-throughs for stock requests), once."""
    global _patched
    if _patched:
        return
    from vllm.v1.core.kv_cache_coordinator import KVCacheCoordinator
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.request import Request

    make_request = Request.from_engine_core_request.__func__
    get_computed_blocks = KVCacheManager.get_computed_blocks
    cache_blocks = KVCacheCoordinator.cache_blocks
    scheduler_init = Scheduler.__init__

    def init_scheduler(self, vllm_config, *args, **kwargs):
        scheduler_init(self, vllm_config, *args, **kwargs)
        if not _model_here:  # the model runs in worker processes: derive its policy from the config
            activate(policy_from_config(vllm_config))

    def from_engine_core_request(cls, request, block_hasher):
        ids, params = request.prompt_token_ids, request.sampling_params
        stock = ids is None or _policy is None or (params is not None and params.prompt_logprobs is not None)
        if stock:
            cap = None
        elif getattr(request, "resumable", False):  # a streamed prompt grows: its rows' classes are not final
            cap = 0 if _policy.enabled() else None
        else:
            cap = _policy.cap(len(ids))
        if cap is not None:  # salt before the block hashes are computed
            request.cache_salt = _salt(request.cache_salt, _policy.tag)
        req = make_request(cls, request, block_hasher)
        setattr(req, CAP, cap)
        return req

    def capped_get_computed_blocks(self, request):
        cap = getattr(request, CAP, None)
        if cap is None:
            return get_computed_blocks(self, request)
        if cap <= 0 or not self.prefix_cache_lookup_enabled(request):
            return self.empty_kv_cache_blocks, 0, 0
        blocks, hit, _ = self.coordinator.find_longest_cache_hit(request.block_hashes, min(cap, request.num_tokens - 1))
        if hit and self.enable_kv_cache_events and getattr(request, "kv_cache_report_mode", "") == "full":
            self.coordinator.emit_cached_block_events(request, blocks)  # as the stock lookup does
        return self.create_kv_cache_blocks(blocks), hit, 0

    def capped_cache_blocks(self, request, num_computed_tokens: int) -> None:
        cap = getattr(request, CAP, None)
        cache_blocks(self, request, num_computed_tokens if cap is None else min(num_computed_tokens, cap))

    Request.from_engine_core_request = classmethod(from_engine_core_request)
    KVCacheManager.get_computed_blocks = capped_get_computed_blocks
    KVCacheCoordinator.cache_blocks = capped_cache_blocks
    Scheduler.__init__ = init_scheduler
    _patched = True
