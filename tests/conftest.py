"""Shared fixtures: the SmolLM2 tokenizer and model, and tiny random Llama/Qwen2/Qwen3 models."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers
from transformers import AutoTokenizer

from ridgefill.default_model import default_model_dir

ESSAYS = Path(__file__).resolve().parents[1] / ".." / "shared" / "data" / "essays"
FAMILIES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {"head_dim": 16}),
}


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    return default_model_dir()


@pytest.fixture(scope="session")
def tokenizer(smollm2_dir):
    return AutoTokenizer.from_pretrained(smollm2_dir)


@pytest.fixture(scope="session")
def smollm2(smollm2_dir, tokenizer):
    from ridgefill.steps import load_model

    model, _ = load_model(smollm2_dir)
    return model, tokenizer


def tiny_model(family: str, vocab_size: int, seed: int = 0, layers: int = 6, **config):
    """A random model of the family, small enough for CPU tests, with a real-size vocabulary; `config`
    overrides the shape (e.g. head_dim=32 for vLLM's CPU attention, num_key_value_heads=1)."""
    cfg_name, cls_name, extra = FAMILIES[family]
    shape = dict(
        hidden_size=64,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        **extra,
    )
    cfg = getattr(transformers, cfg_name)(
        vocab_size=vocab_size,
        num_hidden_layers=layers,
        architectures=[cls_name],
        tie_word_embeddings=False,
        attn_implementation="sdpa",
        **(shape | config),
    )
    torch.manual_seed(seed)
    model = getattr(transformers, cls_name)(cfg).eval()
    with torch.no_grad():  # larger-than-init weights so the random model is far from uniform attention
        for p in model.parameters():
            if p.dim() == 2:
                p.mul_(3.0)
    return model


@pytest.fixture(scope="session")
def tiny_models(tokenizer) -> dict:
    return {f: tiny_model(f, len(tokenizer)) for f in FAMILIES}


@pytest.fixture(scope="session")
def essay_text() -> str:
    files = sorted(ESSAYS.glob("*.txt"))
    if not files:
        pytest.skip("../shared/data/essays is not available")
    return "\n\n".join(f.read_text() for f in files[20:])
