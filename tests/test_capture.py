"""Capture: streamed statistics equal a direct computation, and a resumed capture equals an
uninterrupted one, bit for bit."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from ridgefill.capture import capture, layer_inputs, load_capture, split_file
from ridgefill.corpus import Corpus, token_stream, windows


@pytest.fixture(scope="module")
def wins(tokenizer, essay_text):
    return windows(token_stream(Corpus("t", [essay_text[:30000]]), tokenizer), 96)[:7]


def test_stats_equal_direct_computation(tiny_models, wins, tmp_path):
    model = tiny_models["qwen3"]
    cap = capture(model, wins, [2, 3], tmp_path / "c", sink_skip=4, stride=2, progress=False)
    xs, ys = [], []
    for w in wins:
        inputs = layer_inputs(model, w[None], {2, 5})
        xs.append(inputs[2][4::2].double())
        ys.append(inputs[5][4::2].double())
    x, y = torch.cat(xs), torch.cat(ys)
    st = cap.stats(2)
    assert st.count == x.shape[0] == 7 * 46
    torch.testing.assert_close(st.xx, x.T @ x)
    torch.testing.assert_close(st.xy[5], x.T @ y)
    torch.testing.assert_close(st.y_sum[5], y.sum(0))
    assert int(cap.token_counts().sum()) == wins.numel()


def testlayer_inputs_match_hidden_states(tiny_models, wins):
    model = tiny_models["llama"]
    out = model(wins[:1], output_hidden_states=True)
    inputs = layer_inputs(model, wins[:1], {1, 4})
    torch.testing.assert_close(inputs[1], out.hidden_states[1][0])
    torch.testing.assert_close(inputs[4], out.hidden_states[4][0])


def test_resume_after_interruption_is_identical(tiny_models, wins, tmp_path):
    model = tiny_models["llama"]
    full = capture(model, wins, [1, 3], tmp_path / "full", checkpoint_every=2, progress=False)
    calls = []

    def crash(_module, _args):
        calls.append(1)
        if len(calls) == 6:
            raise RuntimeError("simulated crash in window 6")

    handle = model.model.embed_tokens.register_forward_pre_hook(crash)
    try:
        with pytest.raises(RuntimeError, match="simulated crash"):
            capture(model, wins, [1, 3], tmp_path / "part", checkpoint_every=2, progress=False)
    finally:
        handle.remove()
    assert load_capture(tmp_path / "part").meta["windows_done"] == 4  # the last checkpoint
    resumed = capture(model, wins, [1, 3], tmp_path / "part", checkpoint_every=2, progress=False)
    assert resumed.meta["windows_done"] == full.meta["windows_done"] == 7
    for s in (1, 3):
        a, b = load_file(full.path / split_file(s)), load_file(resumed.path / split_file(s))
        assert a.keys() == b.keys()
        for k in a:
            assert torch.equal(a[k], b[k]), k
    assert torch.equal(load_capture(tmp_path / "part").token_counts(), full.token_counts())


def test_resume_refuses_other_settings(tiny_models, wins, tmp_path):
    model = tiny_models["llama"]
    capture(model, wins[:2], [1], tmp_path / "c", progress=False)
    with pytest.raises(ValueError, match="other settings"):
        capture(model, wins[:2], [1], tmp_path / "c", stride=2, progress=False)
