"""Qwen2: Llama-shaped, with biases on q/k/v (held by the nn.Linear layers themselves)."""

from ridgefill.adapters.base import LlamaAdapter


class Qwen2Adapter(LlamaAdapter):
    architectures = ("Qwen2ForCausalLM",)
