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

Each engine gets its own policy when it starts (`engine_policy`, applied by `patches.py`): from the
model when it runs in the engine's process (one device), else (tensor parallel) from the engine's config
and the folder's manifest, which give the same policy.
"""

from __future__ import annotations

import hashlib
import json
import secrets
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from ridgefill.rows import RowPolicy

CAP = "ridgefill_cache_cap"  # attribute set on vLLM Requests: tokens that may be cached and reused


@dataclass(frozen=True)
class CachePolicy:
    """What a filled block depends on (`tag`) and the row policy that bounds what may be cached."""

    tag: str
    rows: RowPolicy
    enabled: Callable[[], bool]

    def cap(self, prompt_len: int) -> int | None:
        """Tokens of this prompt that may be cached or reused; None for a request served stock."""
        r = self.rows
        if not self.enabled() or prompt_len <= r.sink + r.tail:
            return None
        return 0 if r.share > 0 else prompt_len - r.tail


def policy_for(manifest: dict, rows: RowPolicy, mode: str, enabled: Callable[[], bool]) -> CachePolicy:
    """The policy of a map folder served with this row policy and mode (the tag names what filled K/V depend
    on)."""
    digest = hashlib.sha256(json.dumps(manifest, sort_keys=True).encode()).hexdigest()[:16]
    nonce = secrets.token_hex(8)  # a stock request cannot pick this engine's salt as its own cache_salt
    return CachePolicy(f"ridgefill/{digest}/{mode}/sink{rows.sink}/{nonce}", rows, enabled)


def policy_from_config(vllm_config) -> CachePolicy | None:
    """The policy an engine's config and its folder's manifest imply; None if it serves no maps."""
    from ridgefill.maps import read_manifest
    from ridgefill.vllm_plugin.config import maps_path, requested, serve_options, unsupported

    mc = vllm_config.model_config
    if not requested(mc) or not vllm_config.cache_config.enable_prefix_caching or unsupported(vllm_config):
        return None
    path = maps_path(mc.hf_config)
    if not path:
        return None
    try:
        manifest = read_manifest(Path(path))
        rows, mode = serve_options(mc.hf_config, manifest)
    except (OSError, ValueError):  # MapError too: the model refuses the folder as well, and serves stock
        return None
    return policy_for(manifest, rows, mode, lambda: True)


def engine_policy(vllm_config, model=None) -> CachePolicy | None:
    """The policy of one engine. Where the model runs in the engine's process its word holds (it may have
    refused its folder, and it may be switched off per request batch); else the config's."""
    if model is None:
        return policy_from_config(vllm_config)
    state = getattr(model, "ridgefill", None)
    if state is None or not vllm_config.cache_config.enable_prefix_caching:
        return None
    return policy_for(state.maps.manifest, state.classifier.policy, state.mode, lambda: state.enabled)


def request_cap(policy: CachePolicy | None, request) -> int | None:
    """Tokens of an incoming request (vLLM's EngineCoreRequest) that may be cached or reused; None: stock."""
    ids, params = request.prompt_token_ids, request.sampling_params
    if ids is None or policy is None or (params is not None and params.prompt_logprobs is not None):
        return None
    if getattr(request, "resumable", False):  # a streamed prompt grows: its rows' classes are not final
        return 0 if policy.enabled() else None
    return policy.cap(len(ids))


def salt(user_salt: str | None, tag: str) -> str:
    return f"{user_salt}|{tag}" if user_salt else tag
