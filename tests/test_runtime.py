"""The runtime's oracle: with nothing approximated (plumb) it reproduces stock output exactly."""

from __future__ import annotations

import pytest
import torch

from ridgefill.fit import identity_maps
from ridgefill.maps import MapSet
from ridgefill.rows import RowPolicy
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
        plumb = prefill(model, ids, FillPlan("plumb", split=split, rows=RowPolicy(sink=4, tail=16)))
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
    got = generate(model, ids, FillPlan("plumb", split=3, rows=RowPolicy(tail=8)), 12)
    assert torch.equal(got, want)


@pytest.mark.parametrize("family", FAMILIES)
def test_identity_maps_equal_identity_mode(family, tiny_models, tokenizer, essay_text):
    """Explicit identity matrices go through the ridge code path and must equal identity fill."""
    model = tiny_models[family]
    ids = _ids(tokenizer, essay_text, 200)
    cfg = model.config
    maps = {l: (w.float(), b.float()) for l, (w, b) in identity_maps(2, cfg.num_hidden_layers, cfg.hidden_size).items()}
    ridge = prefill(model, ids, FillPlan("ridge", maps=_mapset(maps, 2), rows=RowPolicy(tail=8)))
    ident = prefill(model, ids, FillPlan("identity", split=2, rows=RowPolicy(tail=8)))
    exact = prefill(model, ids, FillPlan("exact"))
    torch.testing.assert_close(ridge.logits, ident.logits, rtol=1e-5, atol=1e-5)
    assert (ident.logits - exact.logits).abs().max() > 1e-3  # the approximation is real


def test_bulk_rows_skip_late_mlp_and_attention_output(tiny_models, tokenizer, essay_text):
    model = tiny_models["llama"]
    n, split, sink, tail, share = 240, 2, 4, 16, 0.1
    ids = _ids(tokenizer, essay_text, n)
    scores = torch.rand(len(tokenizer))
    maps = _mapset({l: (torch.eye(64), torch.zeros(64)) for l in range(split + 1, 6)}, split, scores)
    plan = FillPlan("ridge", maps=maps, rows=RowPolicy(sink=sink, tail=tail, share=share))
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
    plan = FillPlan("ridge", maps=_mapset({}, 1, scores), rows=RowPolicy(sink=2, tail=5, share=3 / 93))
    keep = protected_rows(ids, plan)
    assert keep[:2].all() and keep[-5:].all() and keep[[40, 41, 42]].all() and int(keep.sum()) == 10


def test_short_prompt_runs_stock(tiny_models, tokenizer, essay_text):
    model = tiny_models["qwen3"]
    ids = _ids(tokenizer, essay_text, 10)
    out = prefill(model, ids, FillPlan("identity", split=2, rows=RowPolicy(sink=4, tail=8)))
    assert bool(out.protected.all())
    torch.testing.assert_close(out.logits, prefill(model, ids, FillPlan("exact")).logits)


def test_bad_plans_are_refused():
    with pytest.raises(ValueError, match="mode"):
        FillPlan("fast")
    with pytest.raises(ValueError, match="map folder"):
        FillPlan("ridge")
    with pytest.raises(ValueError, match="share"):
        FillPlan("identity", split=2, rows=RowPolicy(share=1.5))


@pytest.mark.slow
def test_plumb_equals_exact_smollm2(smollm2, essay_text):
    model, tok = smollm2
    ids = _ids(tok, essay_text, 600)
    exact = prefill(model, ids, FillPlan("exact"))
    plumb = prefill(model, ids, FillPlan("plumb", split=15, rows=RowPolicy(tail=32)))
    torch.testing.assert_close(plumb.logits, exact.logits, rtol=1e-4, atol=1e-4)
    want = generate(model, ids, FillPlan("exact"), 16)
    assert torch.equal(generate(model, ids, FillPlan("plumb", split=15, rows=RowPolicy(tail=32)), 16), want)
    assert torch.equal(generate(model, ids, FillPlan("plumb", split=25, rows=RowPolicy(tail=8)), 16), want)


# --- the protected share chosen by the question (select="question") and at random -------------------


def test_pooled_keeps_a_whole_window_around_the_peak():
    from ridgefill.rows import edge_rows, pooled, protect_top

    attention = torch.full((100,), 0.01)
    attention[0] = 50.0  # a sink's attention must not spill onto its neighbours
    attention[50] = 1.0
    attention[97] = 9.0  # nor the question's attention to itself
    keep = edge_rows(100, sink=4, tail=5)
    scores = pooled(attention, keep, window=2)
    chosen = protect_top(keep, scores, share=5 / 91) & ~keep
    assert chosen.nonzero().squeeze(-1).tolist() == [48, 49, 50, 51, 52]


def test_reach_lends_a_peak_to_the_rows_after_it():
    """The question matches a fact's key; with `reach` the value after the key is kept too, not the rows before."""
    from ridgefill.rows import edge_rows, pooled, protect_top, question_mask

    attention = torch.full((100,), 0.01)
    attention[30] = 1.0  # the key the question matches
    attention[97] = 9.0
    keep = edge_rows(100, sink=4, tail=5)
    scores = pooled(attention, keep, window=2, reach=6)
    chosen = protect_top(keep, scores, share=11 / 91) & ~keep
    assert chosen.nonzero().squeeze(-1).tolist() == list(range(28, 39))  # 2 before the key, 2 + 6 after
    assert torch.equal(pooled(attention, keep, window=2, reach=0), pooled(attention, keep, window=2))
    mask = question_mask(attention, 4, 5, 11 / 91, window=2, reach=6)
    assert torch.equal(mask, chosen | keep)
    with pytest.raises(ValueError, match="reach"):
        FillPlan("identity", split=2, rows=RowPolicy(share=0.1, select="question", reach=-1))


def test_question_attention_equals_eager_attention(tokenizer, essay_text):
    """The q x n scores equal the last rows of transformers' own attention probabilities."""
    from conftest import tiny_model

    from ridgefill.adapters import adapter_for
    from ridgefill.runtime import _question_attention

    model = tiny_model("qwen3", len(tokenizer), seed=1)
    model.set_attn_implementation("eager")
    ids = _ids(tokenizer, essay_text, 64)
    out = model(input_ids=ids, use_cache=True, output_attentions=True, output_hidden_states=True)
    ad = adapter_for(model)
    pos = torch.arange(64)
    cos, sin = ad.rotary(out.hidden_states[0], pos)
    for layer in (0, 3):
        want = out.attentions[layer][0, :, -8:, :].sum(dim=(0, 1))
        got = _question_attention(
            ad,
            ad.layers[layer],
            out.hidden_states[layer][:, -8:],
            cos[:, -8:],
            sin[:, -8:],
            out.past_key_values.layers[layer].keys,
        )
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("select", ["question", "random"])
def test_selected_rows_plumb_equals_exact_and_are_deterministic(select, tiny_models, tokenizer, essay_text):
    model = tiny_models["llama"]
    ids = _ids(tokenizer, essay_text, 300)
    plan = FillPlan("plumb", split=3, rows=RowPolicy(sink=4, tail=16, share=0.2, select=select, window=2))
    a, b = prefill(model, ids, plan), prefill(model, ids, plan)
    assert torch.equal(a.protected, b.protected)
    assert int(a.protected.sum()) == 20 + round(0.2 * 280)
    exact = prefill(model, ids, FillPlan("exact"))
    torch.testing.assert_close(a.logits, exact.logits, rtol=1e-4, atol=1e-4)
    for layer in range(model.config.num_hidden_layers):
        torch.testing.assert_close(a.cache.layers[layer].keys, exact.cache.layers[layer].keys, rtol=1e-4, atol=1e-4)
    identity = prefill(
        model, ids, FillPlan("identity", split=3, rows=RowPolicy(sink=4, tail=16, share=0.2, select=select, window=2))
    )
    assert torch.equal(identity.protected, a.protected)  # the choice does not depend on the fill
    assert (identity.logits - exact.logits).abs().max() > 1e-4


def test_question_rows_need_the_early_pass(tokenizer):
    plan = FillPlan("identity", split=2, rows=RowPolicy(sink=2, tail=4, share=0.1, select="question"))
    with pytest.raises(ValueError, match="early layers"):
        protected_rows(torch.arange(100)[None], plan)
    with pytest.raises(ValueError, match="select"):
        FillPlan("identity", split=2, rows=RowPolicy(select="magic"))


@pytest.mark.slow
def test_question_protects_a_planted_needle_smollm2(smollm2):
    """RULER needles deep in the filled rows are kept exact by the question's attention, not by chance."""
    from ridgefill.evals.ruler import load_haystack, make_samples

    model, tok = smollm2
    samples = make_samples("niah_single_2", tok, 1024, load_haystack("pydoc"), n=6, seed=5)[3:]
    kept = {"question": [], "random": []}
    for x in samples:
        ids = torch.tensor([x.input_ids])
        ((start, end),) = x.needle_spans
        assert 4 <= start and end <= ids.shape[1] - 160  # the needle lies in filled rows
        for select, share in kept.items():
            plan = FillPlan(
                "identity", split=18, rows=RowPolicy(sink=4, tail=128, share=0.1, select=select, query=32, window=4)
            )
            share.append(prefill(model, ids, plan).protected[start:end].float().mean().item())
    assert min(kept["question"]) >= 0.75 and sum(kept["question"]) / len(samples) >= 0.9, kept
    assert max(kept["random"]) < 0.5, kept


def test_shared_early_pass_equals_its_own(tiny_models, tokenizer, essay_text):
    """Plans of one split prefilled from one `early_pass` equal each plan's own prefill, decode included."""
    from ridgefill.runtime import early_pass

    model = tiny_models["qwen2"]
    ids = _ids(tokenizer, essay_text, 200)
    early = early_pass(model, ids[:, :-1], split=3, query=16, score_layers=2)
    for select in ("question", "random"):
        plan = FillPlan(
            "identity", split=3, rows=RowPolicy(sink=4, tail=16, share=0.2, select=select, query=16, score_layers=2)
        )
        want = generate(model, ids, plan, 6)
        assert torch.equal(generate(model, ids, plan, 6, early=early), want)
        assert torch.equal(generate(model, ids, plan, 6, early=early), want)  # the shared pass is not altered
    with pytest.raises(ValueError, match="too few query rows"):
        generate(
            model,
            ids,
            FillPlan("identity", 3, None, rows=RowPolicy(sink=4, tail=16, share=0.2, select="question", query=32)),
            2,
            early=early,
        )
