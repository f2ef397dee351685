"""What an engine's config asks of RidgeFill, and whether RidgeFill can serve it (plain functions).

The model (in its worker) and the scheduler (in the engine process) both decide from these, so both
sides of an engine agree on whether RidgeFill serves and with which options, whichever process they run in.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path

from ridgefill import settings
from ridgefill.fingerprint import compare, fingerprint_from
from ridgefill.maps import MapError, read_manifest, verify_files
from ridgefill.rows import RowPolicy

ARCHS = {
    "LlamaForCausalLM": "RidgeFillLlamaForCausalLM",
    "Qwen2ForCausalLM": "RidgeFillQwen2ForCausalLM",
    "Qwen3ForCausalLM": "RidgeFillQwen3ForCausalLM",
}
PREFIX = "ridgefill_"  # how hf_overrides spell the row policy's settings
V2_VARIABLE = "VLLM_USE_V2_MODEL_RUNNER"  # vLLM's own variable: read here only to name it in a refusal
FLASH_ATTN = "FLASH_ATTN"  # vLLM's AttentionBackendEnum name of the one CUDA backend RidgeFill serves


def maps_path(cfg) -> str | None:
    """The map folder a RidgeFill class of this config serves: `ridgefill_maps` or RIDGEFILL_MAPS."""
    env = settings.get("RIDGEFILL_MAPS")
    if not any(a.startswith("RidgeFill") for a in cfg.architectures or []) and not env:
        return None
    return getattr(cfg, "ridgefill_maps", None) or env


def requested(model_config) -> bool:
    """RidgeFill is switched on for this model: a RidgeFill architecture, or RIDGEFILL_MAPS on a served family."""
    if model_config is None:
        return False
    archs = list(getattr(model_config, "architectures", None) or [])
    if any(a in ARCHS.values() for a in archs):
        return True
    return bool(settings.get("RIDGEFILL_MAPS")) and any(a in ARCHS for a in archs)


def on_cuda() -> bool:
    """vLLM's platform is CUDA (or ROCm): FlashAttention, CUDA graphs (vLLM is imported only here)."""
    from vllm.platforms import current_platform

    return bool(current_platform.is_cuda_alike())


def backend_names(attention) -> list[str]:
    """The attention backends an operator chose (`--attention-backend`, per-kind overrides), by enum name."""
    chosen = [getattr(attention, "backend", None), *(getattr(attention, "backend_per_kind", None) or {}).values()]
    return [getattr(b, "name", str(b)) for b in chosen if b is not None]


def device_refusal(vllm_config, cuda: bool) -> str | None:
    """On CUDA: an attention backend other than FlashAttention (the only CUDA backend `backend.py` writes), or a
    float32 model (FlashAttention serves none); None elsewhere or when the engine fits."""
    if not cuda:
        return None
    other = [b for b in backend_names(getattr(vllm_config, "attention_config", None)) if b != FLASH_ATTN]
    if other:
        return (
            f"attention backend {other[0]} is not supported on CUDA (RidgeFill writes FlashAttention's paged "
            f"cache); pass --attention-backend {FLASH_ATTN} or leave it unset"
        )
    dtype = getattr(getattr(vllm_config, "model_config", None), "dtype", None)
    if str(dtype).endswith("float32"):
        return "float32 is not supported on CUDA (FlashAttention serves fp16/bf16 only); serve with --dtype bfloat16"
    return None


def unsupported(vllm_config, cuda: bool | None = None) -> str | None:
    """Why this engine cannot serve maps (then it serves stock), or None. `cuda`: the platform (default: vLLM's)."""
    mc, par, cache = vllm_config.model_config, vllm_config.parallel_config, vllm_config.cache_config
    cfg = mc.hf_config
    why = device_refusal(vllm_config, on_cuda() if cuda is None else cuda)
    if why:
        return why
    if getattr(vllm_config, "use_v2_model_runner", False):
        return (
            f"Model Runner V2 is selected ({V2_VARIABLE}={os.environ.get(V2_VARIABLE, '<unset>')}, or a feature "
            f"that needs it) and RidgeFill hooks the V1 runner; unset {V2_VARIABLE} or set it to 0"
        )
    if getattr(par, "enable_dbo", False) or getattr(par, "ubatch_size", 0) > 1:
        return (
            "micro-batching (DBO / ubatch_size > 1) is not supported: the model runs once per micro-batch "
            "while rows are classified for the whole step; drop --enable-dbo / --ubatch-size"
        )
    if mc.quantization:
        return f"quantized checkpoints ({mc.quantization}) are not supported: bulk K/V come from raw k/v weights"
    if par.pipeline_parallel_size > 1:
        return "pipeline parallel serving is not supported"
    if getattr(par, "decode_context_parallel_size", 1) > 1:
        return "decode context parallel serving is not supported"
    if getattr(mc, "runner_type", "generate") != "generate":
        return f"the {mc.runner_type} runner is not supported"
    if getattr(vllm_config, "speculative_config", None) is not None:
        return "speculative decoding is not supported (drafts read every row's hidden state)"
    if getattr(vllm_config, "lora_config", None) is not None:
        return "LoRA is not supported (bulk K/V come from the base k/v weights)"
    if getattr(vllm_config, "kv_transfer_config", None) is not None:
        return "KV connectors are not supported (they would move filled blocks as exact ones)"
    if str(getattr(cache, "cache_dtype", "auto")) != "auto":
        return f"KV cache dtype {cache.cache_dtype} is not supported: serve with the model's dtype"
    if getattr(cfg, "use_sliding_window", False) and getattr(cfg, "sliding_window", None):
        return "sliding-window attention is not supported"
    return None


def folder_refusal(model_config) -> str | None:
    """Why the model would refuse its map folder, known from the config before any weights load: no folder,
    a manifest or file that fails its check (sha256, unlisted files), maps of another geometry or tokenizer,
    or invalid options. The model checks the same again in its worker (and the weight anchors there)."""
    cfg = model_config.hf_config
    path = maps_path(cfg)
    if not path:
        return "no map folder given (hf_overrides ridgefill_maps or RIDGEFILL_MAPS)"
    try:
        manifest = _verified_manifest(str(Path(path).resolve()), _stamp(Path(path)))
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(model_config.tokenizer, trust_remote_code=model_config.trust_remote_code)
        errors, _ = compare(manifest["model"], fingerprint_from(cfg, tok, {}, int(manifest["split"])))
        if errors:
            raise MapError("maps do not match this model: " + "; ".join(errors))
        serve_options(cfg, manifest)
    except (MapError, OSError, ValueError) as e:
        return f"refusing map folder {path}: {e}"
    return None


def _stamp(folder: Path) -> tuple:
    """What a folder's verdict depends on besides its path: its files' names, sizes and times."""
    if not folder.is_dir():
        return ()
    return tuple(sorted((f.name, f.stat().st_size, f.stat().st_mtime_ns) for f in folder.iterdir()))


@functools.lru_cache(maxsize=4)
def _verified_manifest(path: str, stamp: tuple) -> dict:
    """A folder's manifest once its files are verified; hashed once per folder state in a process."""
    manifest = read_manifest(Path(path))
    verify_files(Path(path), manifest)
    return manifest


def refusal(vllm_config, cuda: bool) -> str | None:
    """Every refusal knowable from an engine's config (features, device, folder), decided before the graph
    policy touches the config; None when RidgeFill can serve this engine."""
    return unsupported(vllm_config, cuda) or folder_refusal(vllm_config.model_config)


def serve_options(cfg, manifest: dict) -> tuple[RowPolicy, str]:
    """(row policy, mode): the hf_overrides `ridgefill_*` over the folder's defaults (`ridgefill_select`,
    `_query`, `_window`, `_score_layers`, `_reach` shape the question selector); ValueError if invalid."""
    folder = RowPolicy.typed(manifest["defaults"]).as_dict()  # every field, `ROWS`' where the folder names none
    rows = RowPolicy(**{k: _option(cfg, k, v) for k, v in folder.items()}).check(PREFIX)
    if rows.select not in ("rarity", "question") and rows.share > 0:
        raise ValueError(f"ridgefill_select must be 'rarity' or 'question' on vLLM (got {rows.select!r})")
    if rows.by_question:
        if rows.share >= 1.0:
            raise ValueError(f"ridgefill_select='question' needs ridgefill_share below 1 (got {rows.share})")
        if rows.score_layers > int(manifest["split"]):
            split = manifest["split"]
            raise ValueError(f"ridgefill_score_layers must not exceed the split {split} (got {rows.score_layers})")
    mode = _option(cfg, "mode", "ridge")
    if mode not in ("ridge", "plumb"):
        raise ValueError(f"ridgefill_mode must be 'ridge' or 'plumb' (got {mode!r})")
    return rows, mode


def _option(cfg, name: str, default):
    value = getattr(cfg, f"ridgefill_{name}", None)
    if value is None:
        return default
    try:
        return type(default)(value)
    except (TypeError, ValueError):
        raise ValueError(f"ridgefill_{name} must be a {type(default).__name__} (got {value!r})") from None


def serve_dtype(model_dir: str, cuda: bool) -> str:
    """The engine dtype the offline and TTFT helpers use when not told: the model's own half precision on
    CUDA (bf16 for a float32 checkpoint: FlashAttention serves fp16/bf16 only), float32 on the CPU (the
    reference runtime the CPU tests compare against runs in float32)."""
    if not cuda:
        return "float32"
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(model_dir)
    dtype = str(getattr(cfg, "dtype", None) or getattr(cfg, "torch_dtype", None) or "")
    return "float16" if dtype.endswith("float16") and "bfloat" not in dtype else "bfloat16"
