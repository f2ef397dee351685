"""RidgeFill on vLLM: a `vllm.general_plugins` entry point.

Switch it on per model with
    LLM(model, hf_overrides={"architectures": ["RidgeFillLlamaForCausalLM"], "ridgefill_maps": "/path/maps"})
(Qwen2/Qwen3: `RidgeFillQwen2ForCausalLM` / `RidgeFillQwen3ForCausalLM`), or for any supported model by
setting `RIDGEFILL_MAPS=/path/maps` in the server's environment. Optional overrides: `ridgefill_tail`,
`ridgefill_sink`, `ridgefill_share`, `ridgefill_mode` ("ridge" | "plumb"). A folder that does not match
the served model is refused with a warning and the model serves stock. RidgeFill hooks vLLM's V1 model
runner and pins it unless VLLM_USE_V2_MODEL_RUNNER is set (`patches.py`).
"""

from __future__ import annotations

from ridgefill import settings
from ridgefill.vllm_plugin.config import ARCHS


def register() -> None:
    """Register the RidgeFill model classes (and, with RIDGEFILL_MAPS set, put them under stock names), and
    apply the vLLM patches (`patches.py`)."""
    from vllm import ModelRegistry

    from ridgefill.vllm_plugin.patches import apply_all

    for stock, ours in ARCHS.items():
        ModelRegistry.register_model(ours, f"ridgefill.vllm_plugin.model:{ours}")
        if settings.get("RIDGEFILL_MAPS"):
            ModelRegistry.register_model(stock, f"ridgefill.vllm_plugin.model:{ours}")
    apply_all()
