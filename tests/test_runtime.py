"""The runtime's oracle: with nothing approximated (plumb) it reproduces stock output exactly."""

from __future__ import annotations

import pytest
import torch

from ridgefill.fit import identity_maps
from ridgefill.maps import MapSet
from ridgefill.runtime import FillPlan, generate, prefill, protected_rows

FAMILIES = ["llama", "qwen2", "qwen3"]


def _ids(tokenizer, text: str, n: int) -> torch.Tensor:
    ids = tokenizer(text * (1 + 4 * n // max(1, len(text))), add_special_tokens=False)["input_ids"][:n]
    assert len(ids) == n
    return torch.tensor([ids])


def _mapset(weights, split: int, scores=None) -> MapSet:
    return MapSet({"split": split, "kind": "ridge"}, weights, scores)


@pytest.mark.parametrize("family", FAMILIES)
def test_plumb_equals_exact_tiny(family, tiny_models, tokenizer, essay_text):
    model = tiny_models[family]
    ids = _ids(tokenizer, essay_text, 300)
    exact = prefill(model, ids, FillPlan("exact"))
    for split in (1, 3, 5):
        plumb = prefill(model, ids, FillPlan("plumb", split=split, sink=4, tail=16))
        assert plumb.protected.sum() == 20
        torch.testing.assert_close(plumb.logits, exact.logits, rtol=1e-4, atol=1e-4)
        for layer in range(model.config.num_hidden_layers):
            torch.testing.assert_close(
                plumb.cache.layers[layer].keys, exact.cache.layers[layer].keys, rtol=1e-4, atol=1e-4
            )
            torch.testing.assert_close(
                plumb.cache.layers[layer].values, exact.cache.layers[layer].values, rtol=1e-4, atol=1e-4
            )
    want = generate(model, ids, FillPlan("exact"), 12)
    got = generate(model, ids, FillPlan("plumb", split=3, tail=8), 12)
    assert torch.equal(got, want)


@pytest.mark.parametrize("family", FAMILIES)
def test_identity_maps_equal_identity_mode(family, tiny_models, tokenizer, essay_text):
    """Explicit identity matrices go through the ridge code path and must equal identity fill."""
    model = tiny_models[family]
    ids = _ids(tokenizer, essay_text, 200)
    cfg = model.config
    maps = {l: (w.float(), b.float()) for l, (w, b) in identity_maps(2, cfg.num_hidden_layers, cfg.hidden_size).items()}
    ridge = prefill(model, ids, FillPlan("ridge", maps=_mapset(maps, 2), tail=8))
    ident = prefill(model, ids, FillPlan("identity", split=2, tail=8))
    exact = prefill(model, ids, FillPlan("exact"))
    torch.testing.assert_close(ridge.logits, ident.logits, rtol=1e-5, atol=1e-5)
    assert (ident.logits - exact.logits).abs().max() > 1e-3  # the approximation is real


def test_bulk_rows_skip_late_mlp_and_attention_output(tiny_models, tokenizer, essay_text):
    model = tiny_models["llama"]
    n, split, sink, tail, share = 240, 2, 4, 16, 0.1
    ids = _ids(tokenizer, essay_text, n)
    scores = torch.rand(len(tokenizer))
    maps = _mapset({l: (torch.eye(64), torch.zeros(64)) for l in range(split + 1, 6)}, split, scores)
    plan = FillPlan("ridge", maps=maps, sink=sink, tail=tail, share=share)
    expected = sink + tail + round(share * (n - sink - tail))
    assert int(protected_rows(ids, plan).sum()) == expected
    rows: dict[str, list[int]] = {}

    def count(name):
        return lambda _m, args: rows.setdefault(name, []).append(args[0].shape[-2])

    handles = []
    for i, layer in enumerate(model.model.layers):
        handles.append(layer.mlp.register_forward_pre_hook(count(f"mlp{i}")))
        handles.append(layer.self_attn.o_proj.register_forward_pre_hook(count(f"o{i}")))
    try:
        prefill(model, ids, plan)
    finally:
        for h in handles:
            h.remove()
    for i in range(6):
        want = n if i < split else expected
        assert sum(rows[f"mlp{i}"]) == want, (i, rows[f"mlp{i}"])
        assert sum(rows[f"o{i}"]) == want


def test_share_picks_highest_scores(tokenizer):
    ids = torch.arange(100)[None]
    scores = torch.zeros(len(tokenizer))
    scores[[40, 41, 42]] = 5.0
    plan = FillPlan("ridge", maps=_mapset({}, 1, scores), sink=2, tail=5, share=3 / 93)
    keep = protected_rows(ids, plan)
    assert keep[:2].all() and keep[-5:].all() and keep[[40, 41, 42]].all() and int(keep.sum()) == 10


def test_short_prompt_runs_stock(tiny_models, tokenizer, essay_text):
    model = tiny_models["qwen3"]
    ids = _ids(tokenizer, essay_text, 10)
    out = prefill(model, ids, FillPlan("identity", split=2, sink=4, tail=8))
    assert bool(out.protected.all())
    torch.testing.assert_close(out.logits, prefill(model, ids, FillPlan("exact")).logits)


def test_bad_plans_are_refused():
    with pytest.raises(ValueError, match="mode"):
        FillPlan("fast")
    with pytest.raises(ValueError, match="map folder"):
        FillPlan("ridge")
    with pytest.raises(ValueError, match="share"):
        FillPlan("identity", split=2, share=1.5)


@pytest.mark.slow
def test_plumb_equals_exact_smollm2(smollm2, essay_text):
    model, tok = smollm2
    ids = _ids(tok, essay_text, 600)
    exact = prefill(model, ids, FillPlan("exact"))
    plumb = prefill(model, ids, FillPlan("plumb", split=15, tail=32))
    torch.testing.assert_close(plumb.logits, exact.logits, rtol=1e-4, atol=1e-4)
    want = generate(model, ids, FillPlan("exact"), 16)
    assert torch.equal(generate(model, ids, FillPlan("plumb", split=15, tail=32), 16), want)
    assert torch.equal(generate(model, ids, FillPlan("plumb", split=25, tail=8), 16), want)
