"""Capture: streamed statistics equal a direct computation; a capture killed at any step of a checkpoint
write resumes to the same bits as an uninterrupted one; the device and CPU statistics paths agree."""

from __future__ import annotations

import json
import logging

import pytest
import torch

from ridgefill import capture as capture_mod
from ridgefill.capture import CaptureOptions, capture, layer_inputs, load_capture, stats_device
from ridgefill.corpus import Corpus, load_corpus, token_stream, windows


@pytest.fixture(scope="module")
def wins(tokenizer):
    """Seven 96-token windows of the embedded pydoc text (no test data needed)."""
    text = "\n\n".join(load_corpus("pydoc").documents)[:30000]
    return windows(token_stream(Corpus("t", [text]), tokenizer), 96)[:7]


def _tensors(cap) -> dict[str, torch.Tensor]:
    out = {"tokens": cap.token_counts()}
    for s in cap.splits:
        out |= {f"{s}.{k}": v for k, v in cap.stats(s).tensors().items()}
    return out


def assert_same_bits(a, b) -> None:
    assert a.meta["windows_done"] == b.meta["windows_done"]
    ta, tb = _tensors(a), _tensors(b)
    assert ta.keys() == tb.keys()
    for k in ta:
        assert torch.equal(ta[k], tb[k]), k


def test_stats_equal_direct_computation(tiny_models, wins, tmp_path):
    model = tiny_models["qwen3"]
    cap = capture(model, wins, [2, 3], tmp_path / "c", CaptureOptions(sink_skip=4, stride=2, progress=False))
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
    full = capture(model, wins, [1, 3], tmp_path / "full", CaptureOptions(checkpoint_seconds=0, progress=False))
    calls = []

    def crash(_module, _args):
        calls.append(1)
        if len(calls) == 6:
            raise RuntimeError("simulated crash in window 6")

    handle = model.model.embed_tokens.register_forward_pre_hook(crash)
    try:
        with pytest.raises(RuntimeError, match="simulated crash"):
            capture(model, wins, [1, 3], tmp_path / "part", CaptureOptions(checkpoint_seconds=0, progress=False))
    finally:
        handle.remove()
    assert load_capture(tmp_path / "part").meta["windows_done"] == 5  # the last checkpoint
    resumed = capture(model, wins, [1, 3], tmp_path / "part", CaptureOptions(checkpoint_seconds=0, progress=False))
    assert resumed.meta["windows_done"] == full.meta["windows_done"] == 7
    assert_same_bits(full, resumed)


class Killed(BaseException):
    """A kill: not an Exception, so nothing on the way can swallow it."""


def _steps(monkeypatch, kill_at: int | None) -> list[str]:
    """Count every file step of every checkpoint (a write or a removal); raise Killed at step `kill_at`.
    A killed write leaves its temporary file behind, as a kill before the rename would."""
    seen: list[str] = []
    write, remove = capture_mod._write, capture_mod._remove

    def step(name: str) -> None:
        if len(seen) == kill_at:
            raise Killed(name)
        seen.append(name)

    def killable_write(path, fn):
        if len(seen) == kill_at:
            fn(path.with_name(path.name + ".tmp"))
        step(f"write {path.name}")
        write(path, fn)

    def killable_remove(path):
        step(f"remove {path.name}")
        remove(path)

    monkeypatch.setattr(capture_mod, "_write", killable_write)
    monkeypatch.setattr(capture_mod, "_remove", killable_remove)
    return seen


def test_kill_at_every_checkpoint_step_resumes_identically(tiny_models, wins, tmp_path, monkeypatch):
    """Kill the capture before each file step of every checkpoint write; the resume equals an uninterrupted
    run bit for bit and leaves only the committed files."""
    model, w = tiny_models["llama"], wins[:3]  # a first, a middle and a final checkpoint
    forward, memo = capture_mod.layer_inputs, {}

    def once_a_window(m, ids, wanted):  # the forward pass is not under test here: run it once a window
        key = ids.numpy().tobytes()
        if key not in memo:
            memo[key] = forward(m, ids, wanted)
        return memo[key]

    monkeypatch.setattr(capture_mod, "layer_inputs", once_a_window)
    with monkeypatch.context() as m:
        steps = _steps(m, None)
        full = capture(model, w, [1, 3], tmp_path / "full", CaptureOptions(checkpoint_seconds=0, progress=False))
    assert len(steps) == 3 * 4 + 2 * 3  # 3 checkpoints of 2 splits + tokens + capture.json; 2 prunes of 3
    for k in range(len(steps)):
        out = tmp_path / f"kill{k:02d}"
        with monkeypatch.context() as m:
            _steps(m, k)
            with pytest.raises(Killed):
                capture(model, w, [1, 3], out, CaptureOptions(checkpoint_seconds=0, progress=False))
        resumed = capture(model, w, [1, 3], out, CaptureOptions(checkpoint_seconds=0, progress=False))
        assert_same_bits(full, resumed)
        names = {f.name for f in out.iterdir()}
        assert names == {"capture.json", *resumed.files["splits"].values(), resumed.files["tokens"]}, (k, steps[k])


def test_resume_refuses_counts_that_disagree(tiny_models, wins, tmp_path):
    model = tiny_models["llama"]
    cap = capture(model, wins[:4], [1], tmp_path / "c", CaptureOptions(checkpoint_seconds=0, progress=False))
    meta = json.loads((cap.path / "capture.json").read_text())
    meta["windows_done"] = 3  # statistics of 4 windows under a meta that says 3 (the old non-atomic crash)
    (cap.path / "capture.json").write_text(json.dumps(meta))
    with pytest.raises(ValueError, match=r"holds 368 rows but capture.json says 3 windows \(276 rows\)"):
        capture(model, wins[:4], [1], tmp_path / "c", CaptureOptions(progress=False))


def test_resume_refuses_other_settings(tiny_models, wins, tmp_path):
    model = tiny_models["llama"]
    capture(model, wins[:2], [1], tmp_path / "c", CaptureOptions(progress=False))
    with pytest.raises(ValueError, match="other settings"):
        capture(model, wins[:2], [1], tmp_path / "c", CaptureOptions(stride=2, progress=False))


def test_device_and_cpu_paths_give_the_same_numbers(tiny_models, wins, tmp_path, caplog):
    model, wins = tiny_models["qwen2"], wins[:4]
    with caplog.at_level(logging.INFO, logger="ridgefill.capture"):
        on_device = capture(model, wins, [2, 3], tmp_path / "dev", CaptureOptions(stats_on="device", progress=False))
        on_cpu = capture(model, wins, [2, 3], tmp_path / "cpu", CaptureOptions(stats_on="cpu", progress=False))
    assert "statistics (float64) on cpu (the model's device)" in caplog.text
    assert "statistics (float64) on cpu (asked)" in caplog.text
    assert_same_bits(on_device, on_cpu)
    # a capture begun on one path resumes on the other
    part = capture(model, wins[:2], [2, 3], tmp_path / "mix", CaptureOptions(stats_on="device", progress=False))
    meta = json.loads((part.path / "capture.json").read_text())
    meta["windows_total"] = 4
    (part.path / "capture.json").write_text(json.dumps(meta))
    assert_same_bits(
        on_cpu, capture(model, wins, [2, 3], tmp_path / "mix", CaptureOptions(stats_on="cpu", progress=False))
    )


def test_stats_device_falls_back_to_the_cpu(monkeypatch):
    gpu, cpu, need = torch.device("cuda:0"), torch.device("cpu"), 6 * 2**30
    monkeypatch.setattr(capture_mod, "_has_float64", lambda d: True)
    monkeypatch.setattr(capture_mod, "_free_bytes", lambda d: 40 * 2**30)
    assert stats_device(gpu, need) == (gpu, "cuda:0 (the model's device)")
    monkeypatch.setattr(capture_mod, "_free_bytes", lambda d: 8 * 2**30)  # 6 GiB + half for activations > 8
    assert stats_device(gpu, need) == (cpu, "cpu: the statistics need 6.0 GiB, cuda:0 has 8.0 GiB free")
    assert stats_device(gpu, need, "device")[0] == gpu  # forced
    monkeypatch.setattr(capture_mod, "_has_float64", lambda d: False)
    assert stats_device(torch.device("mps"), need) == (cpu, "cpu: mps has no float64")
    assert stats_device(cpu, need) == (cpu, "cpu (the model's device)")
    with pytest.raises(ValueError, match="auto, device or cpu"):
        stats_device(cpu, need, "gpu")


def test_stats_bytes_of_the_qwen3_8b_study():
    # d = 4096, 36 layers, splits 18/22/26/30: 18+14+10+6 = 48 d x d float64 matrices, about 6 GiB
    assert capture_mod.stats_bytes([18, 22, 26, 30], 36, 4096) == 48 * (4096 * 4096 + 4096) * 8
