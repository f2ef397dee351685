"""Map folders: written with hashes, refused by name when they do not belong or were altered."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer

from ridgefill.capture import CaptureOptions, capture
from ridgefill.corpus import Corpus, token_stream, windows
from ridgefill.fingerprint import fingerprint
from ridgefill.fit import RidgeSolver
from ridgefill.maps import MapError, MapInfo, load_maps, manifest_digest, read_manifest, write_maps
from ridgefill.rows import RowPolicy
from ridgefill.runtime import FillPlan, prefill
from ridgefill.scores import rarity
from tests.conftest import prose_text, tiny_model


@pytest.fixture(scope="module")
def fitted(tmp_path_factory, tiny_models, tokenizer, essay_text):
    """A real capture + fit on the tiny Llama, written as a map folder."""
    model = tiny_models["llama"]
    root = tmp_path_factory.mktemp("maps")
    wins = windows(token_stream(Corpus("t", [essay_text[:40000]]), tokenizer), 128)[:12]
    cap = capture(model, wins, [2], root / "cap", CaptureOptions(progress=False))
    maps = RidgeSolver.from_stats(cap.stats(2)).solve(1e-3)
    path = write_maps(
        root / "maps",
        {l: (w.float(), b.float()) for l, (w, b) in maps.items()},
        fingerprint(model, tokenizer, 2),
        MapInfo(2, "ridge", 1e-3, {"tokens": 12 * 128}),
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
    # the fitted map beats identity fill, summed over four held-out prompts (one prompt is small-n: at
    # offset 50000 ridge loses on the first-token logits), on the late layers' K/V and the first-token logits
    err = {"ridge": [0.0, 0.0], "identity": [0.0, 0.0]}
    for start in (50000, 100000, 200000, 300000):
        ids = torch.tensor([tokenizer(essay_text[start : start + 2000])["input_ids"][:200]])
        exact = prefill(model, ids, FillPlan())
        for kind, plan in (
            ("ridge", FillPlan("ridge", maps=ms, rows=RowPolicy(tail=8))),
            ("identity", FillPlan("identity", split=2, rows=RowPolicy(tail=8))),
        ):
            out = prefill(model, ids, plan)
            assert torch.isfinite(out.logits).all()
            got, ref = out.cache.layers[3:], exact.cache.layers[3:]  # the late layers' K/V
            sq = sum(
                (g.keys - r.keys).norm() ** 2 + (g.values - r.values).norm() ** 2 for g, r in zip(got, ref, strict=True)
            )
            err[kind][0] += sq.sqrt().item()
            err[kind][1] += (out.logits - exact.logits).norm().item()
    assert err["ridge"][0] < 0.95 * err["identity"][0] and err["ridge"][1] < 0.95 * err["identity"][1], err


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
    from ridgefill.steps import CalibrationText, build_map_pair, fit_report, run_capture

    (tmp_path / "cal.txt").write_text(essay_text[:40000])
    model = tiny_models["llama"]
    cap = run_capture(
        model,
        tokenizer,
        CalibrationText([str(tmp_path / "cal.txt")], window=128, max_windows=8, heldout=2),
        [2],
        tmp_path,
        CaptureOptions(progress=False),
    )
    ridge, ident = build_map_pair(fit_report(model, tokenizer, cap, 2, 1e-2, held=1), tmp_path / "r", tmp_path / "i")
    mr, mi = load_maps(ridge, model, tokenizer), load_maps(ident, model, tokenizer)
    assert mr.kind == "ridge" and sorted(mr.weights) == [3, 4, 5]
    assert mi.kind == "identity" and mi.weights == {} and mi.manifest["lambda"] is None
    assert mr.manifest["fit"] == mi.manifest["fit"]


def test_an_unlisted_file_is_refused_by_name(fitted, tmp_path):
    """Only files the manifest lists (with their sha256) may sit in a map folder: an unlisted scores file, or an
    `evil.pkl` beside the layers, is refused by name by `load_maps` and `ridgefill inspect` (one line, exit 2), as
    `pull` refuses it; the folder without it loads."""
    from typer.testing import CliRunner

    from ridgefill.cli import app

    _, path = fitted
    folder = _sealed(path, tmp_path / "unlisted", lambda m: m["files"].pop("scores.safetensors"))
    with pytest.raises(MapError, match="files not listed in the manifest: scores.safetensors"):
        load_maps(folder)
    (folder / "scores.safetensors").unlink()
    assert load_maps(folder).scores is None and load_maps(path).scores is not None
    evil = _copy(path, tmp_path / "evil")
    (evil / "evil.pkl").write_bytes(b"\x80\x04K\x01.")
    with pytest.raises(MapError, match=r"files not listed in the manifest: evil\.pkl; remove them"):
        load_maps(evil)
    out = CliRunner().invoke(app, ["inspect", str(evil)])
    assert out.exit_code == 2 and "evil.pkl" in out.output and "Traceback" not in out.output


def _edited(src: Path, dst: Path, edit) -> Path:
    """A copy whose manifest was edited by hand (its data files untouched)."""
    folder = _copy(src, dst)
    manifest = json.loads((folder / "ridgefill.json").read_text())
    edit(manifest)
    (folder / "ridgefill.json").write_text(json.dumps(manifest, indent=2))
    return folder


@pytest.mark.parametrize(
    "edit",
    [
        lambda m: m.update(kind="identity"),
        lambda m: m.update(split=3),
        lambda m: m.update(late_layers=[3, 4]),
        lambda m: m["defaults"].update(tail=8),
        lambda m: m["defaults"].update(share=0.5),
        lambda m: m.update({"lambda": 1.0}),
    ],
    ids=["kind", "split", "late_layers", "defaults.tail", "defaults.share", "lambda"],
)
def test_an_edited_manifest_is_refused_by_name(fitted, tmp_path, edit):
    _, path = fitted
    bad = _edited(path, tmp_path / "edited", edit)
    with pytest.raises(MapError, match=r"ridgefill\.json was edited \(manifest_sha256 differs"):
        load_maps(bad)
    with pytest.raises(MapError, match="was edited"):
        read_manifest(bad)  # every reader (inspect, publish, pull, the vLLM cache policy) goes through it


def test_a_reformatted_manifest_still_reads(fitted, tmp_path):
    """The digest covers the content, not the layout: re-indented or re-ordered JSON is the same manifest."""
    _, path = fitted
    folder = _copy(path, tmp_path / "reformatted")
    manifest = json.loads((folder / "ridgefill.json").read_text())
    (folder / "ridgefill.json").write_text(json.dumps(dict(reversed(manifest.items()))))
    assert load_maps(folder).manifest == manifest


def _sealed(src: Path, dst: Path, edit) -> Path:
    """A copy whose edited manifest carries a recomputed digest (as a careless tool would write it)."""
    folder = _edited(src, dst, edit)
    manifest = json.loads((folder / "ridgefill.json").read_text())
    manifest["manifest_sha256"] = manifest_digest(manifest)
    (folder / "ridgefill.json").write_text(json.dumps(manifest))
    return folder


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda m: m.update(kind="identity", late_layers=[], **{"lambda": None}), "need layer files for"),
        (lambda m: m.update(kind="linear"), "kind 'linear' is not one of ridge, identity"),
        (lambda m: m.update(late_layers=[3, 4]), r"have late_layers \[3, 4, 5\], the manifest says \[3, 4\]"),
        (lambda m: m.update(split=3, late_layers=[4, 5]), "need layer files for"),
        (lambda m: m.update(split=9), "split 9 does not lie in 1..4"),
        (lambda m: m["model"].update(anchors={"model.layers.0.input_layernorm.weight": "0"}), "anchors"),
    ],
    ids=["identity-with-layers", "kind", "late_layers", "split-vs-files", "split-range", "split-vs-anchors"],
)
def test_an_inconsistent_manifest_is_refused(fitted, tmp_path, edit, message):
    _, path = fitted
    with pytest.raises(MapError, match=message):
        load_maps(_sealed(path, tmp_path / "inconsistent", edit))


def test_maps_of_the_previous_format_are_refused_with_the_fix(fitted, tmp_path):
    """Format 1 manifests carried no digest; they are refused (never silently re-sealed) with the fix."""
    _, path = fitted

    def old(m: dict) -> None:
        m["format_version"] = 1
        del m["manifest_sha256"]

    with pytest.raises(MapError, match=r"map format 1, this RidgeFill reads format 2; refit it with this RidgeFill"):
        load_maps(_edited(path, tmp_path / "v1", old))
    with pytest.raises(MapError, match="has no manifest_sha256"):
        load_maps(_edited(path, tmp_path / "nodigest", lambda m: m.pop("manifest_sha256")))


def test_a_writer_cannot_produce_an_inconsistent_folder(tiny_models, tokenizer, tmp_path):
    model = tiny_models["llama"]
    fp = fingerprint(model, tokenizer, 2)
    d = model.config.hidden_size
    partial = {3: (torch.eye(d), torch.zeros(d))}  # layers 4 and 5 missing
    with pytest.raises(ValueError, match=r"refusing to write maps to .*late_layers \[3, 4, 5\]"):
        write_maps(tmp_path / "m", partial, fp, MapInfo(2, "ridge", 1e-3, {}))
    assert not (tmp_path / "m").exists() and not (tmp_path / "m.partial").exists()


def test_no_local_path_in_the_manifest_or_card(tiny_models, tokenizer, tmp_path):
    """A model loaded from a local folder and calibrated on a local file: the manifest records names only."""
    from registry.card import make_card
    from ridgefill.steps import CalibrationText, build_maps, fit_report, load_model, run_capture

    folder = tmp_path / "models" / "tiny-llama"
    tiny_models["llama"].save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    model, tok = load_model(folder)
    assert model.config.name_or_path == str(folder)  # what transformers records: an absolute path
    (tmp_path / "cal.txt").write_text(prose_text()[:40000])
    cap = run_capture(
        model,
        tok,
        CalibrationText([str(tmp_path / "cal.txt")], window=128, max_windows=6, heldout=2),
        [2],
        tmp_path,
        CaptureOptions(progress=False),
    )
    maps = build_maps(fit_report(model, tok, cap, 2, 1e-2, held=1), tmp_path / "maps")
    text = (maps / "ridgefill.json").read_text()
    manifest = json.loads(text)
    assert manifest["model"]["name_or_path"] == "tiny-llama" and manifest["fit"]["source"] == ["cal.txt"]
    card = str(make_card(manifest, {}, "org/tiny-llama-maps"))
    for published in (text, card):
        assert str(tmp_path) not in published and '"/' not in published and "file:" not in published
    with pytest.raises(ValueError, match=r"fit\.corpus holds a local absolute path"):
        write_maps(tmp_path / "leak", {}, fingerprint(model, tok, 2),
                   MapInfo(2, "identity", None, {"corpus": str(tmp_path / "cal.txt")}))  # fmt: skip


def test_bulk_rows_cache_what_the_map_predicts(fitted, tokenizer):
    """A late layer's bulk K/V rows are its own cache writer applied to h_S W + b (h_S: the exact split stream)
    and its protected rows are exact: a wrong sign, transpose or layer index in the prediction fails here."""
    from ridgefill.adapters import adapter_for
    from ridgefill.capture import layer_inputs

    model, path = fitted
    ms = load_maps(path, model, tokenizer)
    ids = torch.tensor([tokenizer(prose_text()[100000:102000])["input_ids"][:120]])
    out = prefill(model, ids, FillPlan("ridge", maps=ms, rows=RowPolicy(sink=4, tail=8)))
    bulk, prot = (~out.protected).nonzero().squeeze(-1), out.protected.nonzero().squeeze(-1)
    assert bulk.numel() == 120 - 4 - 8
    ad, pos = adapter_for(model), torch.arange(ids.shape[1])
    h = layer_inputs(model, ids, {2, 3, 4, 5})
    cos, sin = ad.rotary(h[2][None], pos)
    for idx in (3, 4, 5):
        weight, bias = ms.layer(idx)
        want_k, want_v = ad.write_kv(ad.layers[idx], (h[2] @ weight + bias)[None], cos, sin)
        exact_k, exact_v = ad.write_kv(ad.layers[idx], h[idx][None], cos, sin)
        got = out.cache.layers[idx]
        torch.testing.assert_close(got.keys[:, :, bulk], want_k[:, :, bulk], rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(got.values[:, :, bulk], want_v[:, :, bulk], rtol=1e-4, atol=1e-4)
        # protected rows attend over the filled cache from layer 3 on, so only layer 3's are exact
        if idx == 3:
            torch.testing.assert_close(got.keys[:, :, prot], exact_k[:, :, prot], rtol=1e-4, atol=1e-4)
