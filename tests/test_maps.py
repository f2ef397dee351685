"""Map folders: written with hashes, refused by name when they do not belong or were altered."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer

from ridgefill.capture import capture
from ridgefill.corpus import Corpus, token_stream, windows
from ridgefill.fingerprint import fingerprint
from ridgefill.fit import RidgeSolver
from ridgefill.maps import MapError, load_maps, write_maps
from ridgefill.runtime import FillPlan, prefill
from ridgefill.scores import rarity
from tests.conftest import tiny_model


@pytest.fixture(scope="module")
def fitted(tmp_path_factory, tiny_models, tokenizer, essay_text):
    """A real capture + fit on the tiny Llama, written as a map folder."""
    model = tiny_models["llama"]
    root = tmp_path_factory.mktemp("maps")
    wins = windows(token_stream(Corpus("t", [essay_text[:40000]]), tokenizer), 128)[:12]
    cap = capture(model, wins, [2], root / "cap", progress=False)
    maps = RidgeSolver.from_stats(cap.stats(2)).solve(1e-3)
    path = write_maps(
        root / "maps",
        {l: (w.float(), b.float()) for l, (w, b) in maps.items()},
        fingerprint(model, tokenizer, 2),
        2,
        kind="ridge",
        lam=1e-3,
        fit={"tokens": 12 * 128},
        scores=rarity(cap.token_counts()),
    )
    return model, path


def _copy(src: Path, dst: Path) -> Path:
    dst.mkdir()
    for f in src.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    return dst


def test_round_trip_serves(fitted, tokenizer, essay_text):
    model, path = fitted
    ms = load_maps(path, model, tokenizer)
    assert ms.split == 2 and sorted(ms.weights) == [3, 4, 5] and ms.scores.shape == (len(tokenizer),)
    manifest = json.loads((path / "ridgefill.json").read_text())
    assert set(manifest["files"]) == {
        "layer_003.safetensors",
        "layer_004.safetensors",
        "layer_005.safetensors",
        "scores.safetensors",
    }
    ids = torch.tensor([tokenizer(essay_text[50000:52000])["input_ids"][:200]])
    exact, ridge = prefill(model, ids, FillPlan()), prefill(model, ids, FillPlan("ridge", maps=ms, tail=8))
    ident = prefill(model, ids, FillPlan("identity", split=2, tail=8))
    assert torch.isfinite(ridge.logits).all()
    # the fitted map beats identity fill on the first-token logits
    assert (ridge.logits - exact.logits).norm() < (ident.logits - exact.logits).norm()


def test_refuses_another_model(fitted, tokenizer):
    _, path = fitted
    other = tiny_model("qwen3", len(tokenizer))
    with pytest.raises(MapError, match="architecture: maps are for 'LlamaForCausalLM', model has 'Qwen3ForCausalLM'"):
        load_maps(path, other, tokenizer)
    deeper = tiny_model("llama", len(tokenizer), layers=8)
    with pytest.raises(MapError, match="num_layers"):
        load_maps(path, deeper, tokenizer)


def test_refuses_another_tokenizer(fitted, tokenizer, tmp_path):
    model, path = fitted
    tokenizer.save_pretrained(tmp_path / "tok")
    spec = json.loads((tmp_path / "tok" / "tokenizer.json").read_text())
    vocab = spec["model"]["vocab"]
    a, b = "hello", "world"
    vocab[a], vocab[b] = vocab[b], vocab[a]  # same size, different ids
    (tmp_path / "tok" / "tokenizer.json").write_text(json.dumps(spec))
    other = AutoTokenizer.from_pretrained(tmp_path / "tok")
    assert len(other) == len(tokenizer)
    with pytest.raises(MapError, match="tokenizer_sha256"):
        load_maps(path, model, other)


def test_refuses_flipped_byte_by_name(fitted, tmp_path):
    _, path = fitted
    bad = _copy(path, tmp_path / "bad")
    target = bad / "layer_004.safetensors"
    data = bytearray(target.read_bytes())
    data[len(data) // 2] ^= 0x01
    target.write_bytes(bytes(data))
    with pytest.raises(MapError, match=r"layer_004\.safetensors is corrupt"):
        load_maps(bad)


def test_refuses_missing_file_and_bad_manifest(fitted, tmp_path):
    _, path = fitted
    bad = _copy(path, tmp_path / "missing")
    (bad / "scores.safetensors").unlink()
    with pytest.raises(MapError, match="scores.safetensors is missing"):
        load_maps(bad)
    (bad / "ridgefill.json").write_text("{not json")
    with pytest.raises(MapError, match="not valid JSON"):
        load_maps(bad)
    with pytest.raises(MapError, match="not a map folder"):
        load_maps(tmp_path)


def test_anchor_mismatch_only_warns(fitted, tokenizer, caplog):
    model, path = fitted
    nudged = tiny_model("llama", len(tokenizer))
    with torch.no_grad():
        nudged.model.layers[2].input_layernorm.weight.add_(1e-3)
    with caplog.at_level(logging.WARNING):
        load_maps(path, nudged, tokenizer)
    assert "model.layers.2.input_layernorm.weight differs" in caplog.text


def test_map_pair_shares_one_fit(tiny_models, tokenizer, essay_text, tmp_path):
    """The ridge folder and its identity baseline come from one fit and one held-out run."""
    from ridgefill.steps import build_map_pair, run_capture

    (tmp_path / "cal.txt").write_text(essay_text[:40000])
    model = tiny_models["llama"]
    cap = run_capture(model, tokenizer, [str(tmp_path / "cal.txt")], [2], window=128, max_windows=8, heldout=2,
                      root=tmp_path, progress=False)  # fmt: skip
    ridge, ident = build_map_pair(model, tokenizer, cap, 2, 1e-2, tmp_path / "r", tmp_path / "i", heldout_windows=1)
    mr, mi = load_maps(ridge, model, tokenizer), load_maps(ident, model, tokenizer)
    assert mr.kind == "ridge" and sorted(mr.weights) == [3, 4, 5]
    assert mi.kind == "identity" and mi.weights == {} and mi.manifest["lambda"] is None
    assert mr.manifest["fit"] == mi.manifest["fit"]


def test_an_unlisted_scores_file_is_never_loaded(fitted, tmp_path):
    """Only files the manifest lists (with their sha256) are read."""
    _, path = fitted
    folder = _copy(path, tmp_path / "unlisted")
    manifest = json.loads((folder / "ridgefill.json").read_text())
    del manifest["files"]["scores.safetensors"]
    (folder / "ridgefill.json").write_text(json.dumps(manifest))
    assert (folder / "scores.safetensors").is_file() and load_maps(folder).scores is None
    assert load_maps(path).scores is not None
