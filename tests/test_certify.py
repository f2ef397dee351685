"""Certification before publishing: the certificate on known rows, the gate (a failing map is recorded and
never published; a passing one is published with certified numbers, n, CI and what was run in its card's
model-index), the registry's own refusal, and one real small run on SmolLM2."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
from huggingface_hub import ModelCard

import registry
from registry import LocalBackend, RegistryError, pull
from ridgefill import certify, objectives
from ridgefill.results import Recorder, StudyRun, TrialRecord, query
from ridgefill.study import Certify
from tests.test_registry import make_maps

SPEC = Certify(tasks=["niah_single_1", "niah_multikey_1"], lengths=[2048], samples=10, haystack="pydoc", seed=3)
BASE = "HuggingFaceTB/SmolLM2-135M-Instruct"
STUDIES = Path(__file__).resolve().parents[1] / "studies"


def rows(scores: dict[str, list[float]], length: int = 2048, region: str = "bulk") -> list[dict]:
    """Per-sample rows as `objectives.run_ruler_plan` gives them."""
    return [
        {"plan": "p", "task": t, "length": length, "index": i, "region": region, "score": s}
        for t, ss in scores.items()
        for i, s in enumerate(ss)
    ]


EXACT = rows({"niah_single_1": [100.0] * 10, "niah_multikey_1": [100.0] * 5 + [0.0] * 5})
GOOD = rows({"niah_single_1": [100.0] * 10, "niah_multikey_1": [100.0] * 5 + [0.0] * 4 + [100.0]})  # one gain
BAD = rows({"niah_single_1": [100.0] * 6 + [0.0] * 4, "niah_multikey_1": [0.0] * 10})  # loses 9 of 15 solved


def cert_of(map_rows, max_drop=5.0, trial=0):
    return certify.certificate("smol", trial, SPEC, max_drop, map_rows, EXACT, "pydoc (test)") | {"key": "k"}


def test_certificate_on_known_rows():
    good, bad = cert_of(GOOD), cert_of(BAD)
    assert good["passed"] and not bad["passed"]
    assert good["n"] == bad["n"] == 20 and good["tasks"] == ["niah_multikey_1", "niah_single_1"]
    assert good["delta"] == pytest.approx(5.0)  # (0 + 10) / 2: tasks weigh the same
    assert bad["delta"] == pytest.approx((-40.0 - 50.0) / 2)
    assert bad["ci_lo"] <= bad["delta"] <= bad["ci_hi"] and bad["ci_lo"] < -5.0
    assert good["ci_lo"] >= -5.0  # one gain, no loss: the interval never goes below 0
    by_task = {c["task"]: c for c in bad["per_task"]}
    assert by_task["niah_single_1"]["delta"] == pytest.approx(-40.0) and by_task["niah_single_1"]["n"] == 10
    assert by_task["niah_multikey_1"]["p"] == pytest.approx(2 * 0.5**5)  # 5 worse, 0 better: exact McNemar
    assert bad["regions"]["bulk"]["n"] == 20 and bad["score"] == pytest.approx(30.0)
    assert bad["exact"] == pytest.approx(75.0) and bad["samples"] == 10 and bad["haystack"] == "pydoc (test)"
    assert "-5" in bad["rule"] and "FAILED" in certify.summary_line(bad)
    # the limit decides: the same rows pass a loose rule
    assert cert_of(BAD, max_drop=100.0)["passed"]
    with pytest.raises(ValueError, match="no sample of the map has an exact partner"):
        certify.certificate("s", 0, SPEC, 5.0, rows({"vt": [0.0]}), EXACT, "x")


def test_haystack_label_never_names_a_local_path():
    label = certify.haystack_label(["/home/someone/essays/a.txt", "/home/someone/essays/b.txt"], "ab" * 32)
    assert label.startswith("a.txt, b.txt") and "/home" not in label and "abababababab" in label
    assert certify.haystack_label("pydoc", "0" * 64).startswith("pydoc")


@pytest.fixture
def chosen(tiny_models, tokenizer, tmp_path, monkeypatch):
    """A results file with a study whose chosen map (a real map folder) awaits certification."""
    monkeypatch.setenv("RIDGEFILL_REGISTRY", str(tmp_path / "reg"))
    monkeypatch.delenv("RIDGEFILL_REPO", raising=False)
    folder = make_maps(tiny_models["llama"], tokenizer, tmp_path / "maps")
    db = tmp_path / "ridgefill.duckdb"
    with Recorder(db) as rec:
        rec.study(StudyRun("smol", BASE, "embedded", "fp", "transformers", 5.0, {}))
        metrics = [("ruler", "trial", "niah_single_1", 1024, "all", 100.0, 6)]
        ci = {"lo": 0.0, "hi": 0.0, "n": 6}
        rec.trials([TrialRecord("smol", 2, "COMPLETE", {"split": 2}, 0.0, 1.3, None, True, str(folder), 1.0,
                                metrics, ci)])  # fmt: skip
        rec.maps([("smol", 2, BASE, str(folder), "sha", 2, 1e-3, 8, 0.0, 0.0, 1.3)], "smol", 2)
    return db, folder


def _publish(db, folder):
    return lambda: registry.publish_best(db=db, study="smol", map_path=str(folder))


def test_gate_refuses_a_failing_map(chosen, caplog):
    db, folder = chosen
    asked = []

    def publish():
        asked.append(True)
        return _publish(db, folder)()

    with Recorder(db) as rec, caplog.at_level(logging.ERROR, logger="ridgefill.certify"):
        assert certify.gate(rec, cert_of(BAD, trial=2), publish) is None
        assert rec.certified("smol", 2)["passed"] is False
    assert asked == []  # the upload was never attempted
    assert "certification FAILED: smol trial 2" in caplog.text and "not published" in caplog.text
    assert query(db, "SELECT passed, n, ci_lo < -5 FROM certifications")[1] == [(False, 20, True)]
    assert query(db, "SELECT count(*) FROM metrics WHERE kind = 'certify' AND plan = 'delta'")[1] == [(4 * 2,)]
    assert query(db, "SELECT count(*) FROM best_map")[1] == [(0,)]  # a failed map is never the one to serve
    assert LocalBackend().list() == []
    # nor can it be published by hand: the registry reads the record and refuses before any upload
    with pytest.raises(RegistryError, match="failed its certification"):
        _publish(db, folder)()
    assert LocalBackend().list() == []
    with Recorder(db) as rec:  # a replay of the trial (a resumed study's sync) keeps the certificate's rows
        rec.trials([TrialRecord("smol", 2, "COMPLETE", {"split": 2}, 0.0, 1.3, map_path=str(folder))])
    assert query(db, "SELECT count(*) FROM metrics WHERE kind = 'certify' AND plan = 'delta'")[1] == [(4 * 2,)]


def test_gate_publishes_a_passing_map_with_certified_numbers(chosen, tiny_models, tokenizer):
    db, folder = chosen
    with Recorder(db) as rec:
        pub = certify.gate(rec, cert_of(GOOD, trial=2), _publish(db, folder))
    assert pub is not None and pub.revision == "smol"
    assert query(db, "SELECT passed FROM certifications")[1] == [(True,)]
    assert query(db, "SELECT trial FROM best_map")[1] == [(2,)]
    card = ModelCard.load(pull(pub.repo_id, "smol", tiny_models["llama"], tokenizer).path / "README.md")
    index = card.data.to_dict()["model-index"][0]["results"]
    [entry] = [r for r in index if r["dataset"].get("config") == "certify"]
    assert entry["dataset"]["args"] == {
        "tasks": ["niah_multikey_1", "niah_single_1"], "lengths": [2048], "samples": 10, "haystack": "pydoc (test)",
        "seed": 3, "engine": "transformers",
    }  # fmt: skip
    m = {x["name"]: x for x in entry["metrics"]}
    assert m["delta"]["value"] == pytest.approx(5.0) and m["n"]["value"] == 20
    assert m["delta"]["args"]["n"] == 20 and m["delta"]["args"]["ci95"] == [m["delta_ci95_low"]["value"],
                                                                             m["delta_ci95_high"]["value"]]  # fmt: skip
    assert m["niah_multikey_1/2048/delta"]["args"]["n"] == 10 and "mcnemar_p" in m["niah_multikey_1/2048/delta"]["args"]
    assert "Certified before publishing on RULER niah_multikey_1, niah_single_1 at 2048" in card.text
    assert "n = 20" in card.text and "| niah_single_1 | 2048 |" in card.text and "Small n" in card.text


@pytest.mark.slow
def test_real_small_certification_on_smollm2(smollm2):
    """Real generations: plumb mode reproduces exact, so it certifies at delta 0 with a zero-width CI; identity
    fill from a low split is judged on its own paired rows, by the same rule."""
    from ridgefill.rows import RowPolicy
    from ridgefill.runtime import FillPlan

    model, tok = smollm2
    spec = Certify(tasks=["niah_single_1"], lengths=[512], samples=2, haystack="pydoc", seed=0)
    exact = objectives.run_ruler_plan(model, tok, FillPlan(), spec.ruler())["samples"]
    assert len(exact) == 2
    for plan in (
        FillPlan("plumb", split=10, rows=RowPolicy(tail=16)),
        FillPlan("identity", split=4, rows=RowPolicy(tail=16)),
    ):
        got = objectives.run_ruler_plan(model, tok, plan, spec.ruler())["samples"]
        cert = certify.certificate("s", 0, spec, 10.0, got, exact, "pydoc")
        by_hand = sum(g["score"] - e["score"] for g, e in zip(got, exact, strict=True)) / 2
        assert cert["n"] == 2 and cert["delta"] == pytest.approx(by_hand)
        assert cert["passed"] == (cert["ci_lo"] >= -10.0)
        if plan.mode == "plumb":
            assert cert["delta"] == cert["ci_lo"] == cert["ci_hi"] == 0.0 and cert["passed"]


def ttft_block(speedup: float, bound: float, lo: float | None = None, hi: float | None = None) -> dict:
    """A certified TTFT as `objectives.certified_ttft` gives it (vLLM, 2K)."""
    lo, hi = lo or speedup * 0.98, hi or speedup * 1.02
    per = [{"length": 2048, "speedup": speedup, "lo": lo, "hi": hi, "rounds": 9, "bound": bound, "exact_s": 3.1}]
    return {
        "engine": "vllm", "dtype": "float32", "device": "cpu", "lengths": [2048], "speedup": speedup, "lo": lo,
        "hi": hi, "bound": bound, "rounds": 9, "target": 0.03, "max_rounds": 12, "predicted": 1.28,
        "per_length": per, "conditions": {"threads": 2, "load_1m": 0.4}, "valid": lo <= bound, "note": None,
    }  # fmt: skip


def test_a_certified_ttft_above_its_flop_bound_fails_the_certificate(chosen, caplog):
    """1.405x measured against a 1.21x bound is a wrong timing: the certificate fails, says why, and the map is
    not published; a timing under its bound leaves the RULER verdict as it was."""
    db, folder = chosen
    ok = certify.with_ttft(cert_of(GOOD, trial=2), ttft_block(1.20, 1.36))
    assert ok["passed"] and ok["ttft"]["valid"]
    with caplog.at_level(logging.ERROR, logger="ridgefill.certify"):
        bad = certify.with_ttft(cert_of(GOOD, trial=2), ttft_block(1.405, 1.214))
    assert not bad["passed"] and "FLOP bound" in bad["rule"]
    assert "certified TTFT INVALID" in caplog.text and "1.405x" in caplog.text and "bound 1.214x" in caplog.text
    with Recorder(db) as rec:
        assert certify.gate(rec, bad, _publish(db, folder)) is None
    assert LocalBackend().list() == []


def test_the_card_carries_only_the_certified_ttft(chosen, tiny_models, tokenizer):
    """The card's speed is the certificate's: engine, n (rounds), CI and the FLOP bound beside it, in the
    model-index and the body; the search-time speed-up of the trial (1.3 in its rows) appears nowhere."""
    db, folder = chosen
    with Recorder(db) as rec:
        pub = certify.gate(rec, certify.with_ttft(cert_of(GOOD, trial=2), ttft_block(1.25, 1.36)), _publish(db, folder))
    card = ModelCard.load(pull(pub.repo_id, "smol", tiny_models["llama"], tokenizer).path / "README.md")
    index = card.data.to_dict()["model-index"][0]["results"]
    [entry] = [r for r in index if r["dataset"]["type"] == "ttft"]
    assert entry["dataset"]["config"] == "certify" and entry["dataset"]["args"]["engine"] == "vllm"
    assert entry["dataset"]["args"]["rounds"] == 9 and entry["dataset"]["args"]["lengths"] == [2048]
    m = {x["name"]: x for x in entry["metrics"]}
    assert m["certified"]["value"] == pytest.approx(1.25) and m["certified"]["args"]["n"] == 9
    assert m["certified"]["args"]["ci95"] == [pytest.approx(1.225), pytest.approx(1.275)]
    assert m["flop_bound"]["value"] == pytest.approx(1.36) and m["certified"]["value"] <= m["flop_bound"]["value"]
    assert "**1.250x** [1.225, 1.275]" in card.text and "measured on **vllm**" in card.text
    assert "FLOP bound of\n1.360x" in card.text and "predicted 1.280x" in card.text
    assert all(x["value"] != pytest.approx(1.3) for r in index for x in r["metrics"] if r["dataset"]["type"] == "ttft")


def test_the_card_never_claims_a_speed_up_above_its_flop_bound(chosen, tiny_models, tokenizer):
    """An estimate above the bound whose CI still reaches it (1.38x [1.30, 1.45] against 1.36x) passes the
    certificate, but the card claims the bound, its CI stops there, and the raw measurement is shown as such;
    mutation: cards that print the estimate put 1.38x above the bound on the model-index."""
    db, folder = chosen
    block = ttft_block(1.38, 1.36, lo=1.30, hi=1.45)
    cert = certify.with_ttft(cert_of(GOOD, trial=2), block)
    assert cert["passed"] and cert["ttft"]["valid"]
    with Recorder(db) as rec:
        pub = certify.gate(rec, cert, _publish(db, folder))
    card = ModelCard.load(pull(pub.repo_id, "smol", tiny_models["llama"], tokenizer).path / "README.md")
    [entry] = [r for r in card.data.to_dict()["model-index"][0]["results"] if r["dataset"]["type"] == "ttft"]
    m = {x["name"]: x for x in entry["metrics"]}
    assert m["certified"]["value"] == pytest.approx(1.36) and m["certified"]["value"] <= m["flop_bound"]["value"]
    assert m["certified"]["args"]["ci95"] == [pytest.approx(1.30), pytest.approx(1.36)]
    assert m["certified_ci95_high"]["value"] <= m["flop_bound"]["value"]
    assert entry["dataset"]["args"]["capped_at_flop_bound"] and entry["dataset"]["args"]["measured"] == 1.38
    assert "**1.360x** [1.300, 1.360]" in card.text and "1.380x [1.300, 1.450], lies above the FLOP bound" in card.text
    assert "| 2048 | 1.360x [1.300, 1.360] (measured 1.380x [1.300, 1.450]) | 9 | 1.360x |" in card.text


def test_certified_ttft_times_the_map_paired_on_an_engine(tiny_models, tokenizer, tmp_path, monkeypatch):
    """A real paired timing of a map folder on the transformers runtime (vLLM stands aside here): rounds between
    the study's repeats and cap, a CI around the ratio, the FLOP bound and the prediction beside it."""
    from ridgefill.rows import ROWS
    from ridgefill.search import Params
    from ridgefill.study import load_study
    from tests.test_tuning import STUDY

    model = tiny_models["llama"]
    folder = make_maps(model, tokenizer, tmp_path / "maps")
    cfg = load_study(STUDY, {"objectives": {"ttft": {"lengths": [512], "repeats": 2, "max_repeats": 3, "warmup": 0}}})
    monkeypatch.setattr(objectives, "serving_engine", lambda cfg: "transformers")
    params = Params(2, 1e-3, ROWS.given(tail=8, share=0.0, sink=4))
    t = objectives.certified_ttft(model, tokenizer, params, str(folder), cfg, 1.1)
    assert t["engine"] == "transformers" and "vLLM is not installed" in t["note"]
    cap = 6 if t["remeasured"] else 3  # a point estimate above the bound is timed again with twice the rounds
    assert 2 <= t["rounds"] <= cap and t["lo"] <= t["speedup"] <= t["hi"] and t["predicted"] == 1.1
    assert t["bound"] > 1.0 and t["valid"] == (t["lo"] <= t["bound"])
    assert certify.ttft_line(t).startswith("certified TTFT ") and "transformers" in certify.ttft_line(t)


# ---------------------------------------------------------------- the certificate's domain (issue 27)


def _study(tmp_path, calibration, haystack):
    """The shipped smollm2 study with another calibration source and certification haystack."""
    import yaml

    from ridgefill.study import load_study

    data = yaml.safe_load((STUDIES / "smollm2-135m.yaml").read_text())
    data["calibration"]["source"], data["certify"]["haystack"] = calibration, haystack
    path = tmp_path / "s.yaml"
    path.write_text(yaml.safe_dump(data))
    return lambda: load_study(path)


def test_a_study_certified_on_its_calibration_text_is_refused(tmp_path):
    from ridgefill.study import StudyError, load_study

    essays = tmp_path / "essays"
    essays.mkdir()
    first, second = [essays / f"{c}.txt" for c in "ab"]
    same = [
        ("pydoc", "pydoc"),
        (["pydoc", str(first)], ["prose", "pydoc"]),  # one shared source is enough
        (str(essays), [str(second)]),  # a file inside a calibration folder
        ([str(first)], str(essays)),  # a folder holding a calibration file
        (str(first), str(tmp_path / "essays" / ".." / "essays" / "a.txt")),  # the same file, spelled otherwise
    ]
    for calibration, haystack in same:
        with pytest.raises(StudyError) as e:
            _study(tmp_path, calibration, haystack)()
        msg = str(e.value)
        assert "s.yaml: certify.haystack:" in msg and "is calibration text too" in msg and "haystack: prose" in msg
        assert "\n" not in msg
    for calibration, haystack in [("pydoc", "prose"), ([str(first)], [str(second)]), ("hf:wikitext:train", "pydoc")]:
        assert _study(tmp_path, calibration, haystack)().certify.haystack == haystack
    shipped = load_study(STUDIES / "smollm2-135m.yaml")  # the CPU default certifies out of domain
    assert (shipped.calibration.source, shipped.certify.haystack) == ("pydoc", "prose")
    for name in ("qwen3-8b", "llama-3.1-8b"):
        assert load_study(STUDIES / f"{name}.yaml").name == name
    assert Certify(tasks=["vt"], lengths=[2048]).haystack == "prose"  # the default is not the calibration's


def test_card_names_calibration_and_certification_text(tiny_models, tokenizer, tmp_path):
    from registry.card import make_card
    from ridgefill.maps import read_manifest

    manifest = read_manifest(make_maps(tiny_models["llama"], tokenizer, tmp_path / "maps"))
    fitted = manifest | {"fit": {"source": ["pydoc"], "tokens": 32768, "window": 512}}
    cert = cert_of(GOOD) | {"haystack": "prose (the installed packages' README prose), words sha256 0123456789ab"}
    card = ModelCard(str(make_card(fitted, {"certified": cert}, "org/maps")))
    meta = card.data.to_dict()["ridgefill"]
    assert meta["calibration"] == {"sources": ["pydoc"], "tokens": 32768, "window": 512}
    assert meta["certify_haystack"].startswith("prose (")
    assert "Calibration text (the ridge fit): pydoc; 32,768 tokens in windows of 512." in card.text
    assert (
        "Certification haystack: prose (the installed packages' README prose), words sha256 0123456789ab; " in card.text
    )
    assert f"n = 20 pairs, mean paired delta +5.0 [{cert['ci_lo']:+.1f}, {cert['ci_hi']:+.1f}] (95% CI)" in card.text
    bare = ModelCard(str(make_card(manifest, {}, "org/maps")))  # a manifest without provenance says so
    assert bare.data.to_dict()["ridgefill"]["calibration"] is None
    assert "Calibration text: not recorded" in bare.text and "Certification haystack: none (not certified)" in bare.text
