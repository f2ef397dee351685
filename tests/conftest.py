"""Shared fixtures: the SmolLM2 tokenizer and model, tiny random Llama/Qwen2/Qwen3 models, prose to run
them on, and no Hub: every test runs with HF_HUB_OFFLINE=1 unless it asks for `hub_online` (a mock or
loopback Hub)."""

from __future__ import annotations

import functools
import json
import os
from pathlib import Path

os.environ["HF_HUB_OFFLINE"] = "1"  # before huggingface_hub is imported (it reads the variable once)

import pytest  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402
from huggingface_hub import constants as hub_constants  # noqa: E402
from transformers import AutoTokenizer  # noqa: E402

from ridgefill.corpus import load_corpus  # noqa: E402
from ridgefill.default_model import default_model_dir  # noqa: E402

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


@functools.cache
def prose_text() -> str:
    """English prose every Python install has: the stdlib's pydoc topics (~465k characters), the same
    text as `load_haystack("pydoc")`. Tests never need ../shared for text."""
    return "\n".join(load_corpus("pydoc").documents)


@pytest.fixture(scope="session")
def essay_text() -> str:
    """Prose for tests that need text (the embedded pydoc text; see `prose_text`). Never skips."""
    return prose_text()


def shared_essays() -> list[Path]:
    """The essays of ../shared/data/essays, for the few tests that are about them; fails (never skips)
    with the fix when they are missing."""
    files = sorted(ESSAYS.glob("*.txt"))
    if not files:
        pytest.fail(f"{ESSAYS.resolve()} has no essays: check out the shared test data beside the repo")
    return files


@pytest.fixture(autouse=True)
def hub_offline(monkeypatch):
    """No test reaches the real Hub: huggingface_hub (and every subprocess a test starts) runs offline."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(hub_constants, "HF_HUB_OFFLINE", True)


@pytest.fixture
def hub_online(monkeypatch, tmp_path):
    """Online mode for a test whose Hub is a mock transport or a loopback server. huggingface_hub's own
    once-a-day agent-registry lookup (sent to huggingface.co) is answered from a fresh empty cache file."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    monkeypatch.setattr(hub_constants, "HF_HUB_OFFLINE", False)
    registry = tmp_path / "agent_harnesses.json"
    registry.write_text(json.dumps({"standardEnvVars": [], "harnesses": {}}))
    monkeypatch.setattr(hub_constants, "AGENT_HARNESSES_PATH", str(registry))
