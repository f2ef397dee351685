"""Every verb README shows, run once through the command line with its output checked: capture -> fit ->
inspect -> generate -> eval ruler|nll|ttft -> publish (folder and --db) -> pull -> maps list -> results on a
tiny model saved to disk and pydoc text; demo and maps demo on the embedded SmolLM2. `tune` runs in
tests/test_postgres_study.py (two real runs). Then the plain errors: one line, exit status 2, the
traceback only with -v, found before any model loads.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from ridgefill.cli import app
from ridgefill.maps import read_manifest
from ridgefill.results import Recorder, StudyRun, TrialRecord, query

ROOT = Path(__file__).resolve().parents[1]
runner = CliRunner()
ROW = re.compile(r"^\s*(\d+)" + r" \| ([\d.]+)/([\d.]+)" * 4 + "$", re.M)  # layer | h, K, V rel | K cos: r/i


def _run(args: list, code: int = 0):
    result = runner.invoke(app, [str(a) for a in args])
    assert result.exit_code == code, result.output + repr(result.exception)
    return result


def _layers(text: str) -> list[int]:
    """Layers of the held-out table (`layer | h rel r/i | ...`), every cell a number."""
    return [int(m[0]) for m in ROW.findall(text)]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, tiny_models, tokenizer):
    path = tmp_path_factory.mktemp("tiny-qwen3")
    tiny_models["qwen3"].save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def built(model_dir, tmp_path_factory) -> dict:
    """`capture` on pydoc text and `fit` of split 2, once for the module: their output and folders."""
    root = tmp_path_factory.mktemp("cli")
    cap = _run(["capture", "--model", model_dir, "--source", "pydoc", "--split", 2, "--split", 3, "--window", 128,
                "--max-windows", 10, "--heldout", 2, "--root", root]).stdout  # fmt: skip
    cap_dir = Path(re.search(r"capture: (\S+) \(10 windows, splits \[2, 3\]\)", cap).group(1))
    fit = _run(["fit", cap_dir, "--split", 2, "--out", root / "maps", "--model", model_dir, "--lambda", 0.01,
                "--tail", 32]).stdout  # fmt: skip
    return {"root": root, "cap_dir": cap_dir, "fit": fit, "maps": root / "maps"}


def test_capture_and_fit_print_what_they_wrote(built):
    assert json.loads((built["cap_dir"] / "capture.json").read_text())["windows_done"] == 10
    assert f"maps: {built['maps']}" in built["fit"]
    manifest = read_manifest(built["maps"])
    assert manifest["split"] == 2 and manifest["defaults"]["tail"] == 32 and manifest["late_layers"] == [3, 4, 5]
    assert "layer | " in built["fit"] and _layers(built["fit"]) == [3, 4, 5]


def test_inspect_prints_the_verified_manifest(built):
    out = _run(["inspect", built["maps"]]).stdout
    shown = json.loads(out[: out.index("\nfiles:")])
    assert shown["split"] == 2 and shown["late_layers"] == [3, 4, 5] and shown["defaults"]["tail"] == 32
    assert "files: 4 verified" in out and _layers(out) == [3, 4, 5]


def test_generate_with_the_maps(built, model_dir):
    result = _run(["generate", "word " * 100, "--model", model_dir, "--maps", built["maps"], "--max-new-tokens", 4])
    assert result.stdout.strip()
    assert re.search(r"\[\d{3} prompt tokens, 4 new, [\d.]+ s\]", result.stderr)


def test_eval_ruler_nll_ttft(built, model_dir, tmp_path):
    m = ["--model", model_dir, "--maps", built["maps"]]
    out = _run(["eval", "ruler", *m, "--with-identity", "--task", "niah_single_1", "--length", 512, "--samples", 1,
                "--out", tmp_path / "ruler.json"]).stdout  # fmt: skip
    plans = ["exact", "ridge S=2", "identity S=2"]
    assert all(re.search(rf"^\| {p} \| niah_single_1 \| 512 \| [\d.]+ \|", out, re.M) for p in plans), out
    assert list(json.loads((tmp_path / "ruler.json").read_text())["scores"]) == plans

    out = _run(["eval", "nll", *m, "--length", 160, "--documents", 2, "--scored", 32,
                "--out", tmp_path / "nll.json"]).stdout  # fmt: skip
    row = re.search(r"^\| 160 \| 2 \| ([\d.]+) \| ([\d.]+) \| ([+-][\d.]+) \| \[[+-][\d.]+, [+-][\d.]+\] \|", out, re.M)
    r = json.loads((tmp_path / "nll.json").read_text())["lengths"]["160"]
    assert row and float(row[3]) == pytest.approx(r["dnll"], abs=1e-4) and r["documents"] == 2

    out = _run(["eval", "ttft", *m, "--length", 96, "--repeats", 2, "--out", tmp_path / "ttft.json"]).stdout
    assert re.search(r"^\| 96 \| [\d.]+ \| [\d.]+ \| [\d.]+x \|", out, re.M)
    assert json.loads((tmp_path / "ttft.json").read_text())["lengths"]["96"]["repeats"] == 2


def test_publish_pull_and_list(built, model_dir, tmp_path):
    reg = ["--backend", "local", "--registry", tmp_path / "registry"]
    (tmp_path / "res.json").write_text(json.dumps({"dnll": {"mean": 0.01}, "ttft": {"speedup/96": 1.2}}))
    out = _run(["publish", built["maps"], "--repo", "me/tiny-ridgefill", "--study", "s1", "--results",
                tmp_path / "res.json", *reg]).stdout  # fmt: skip
    pub = json.loads(out)
    assert pub["repo_id"] == "me/tiny-ridgefill" and pub["revision"] == "s1"
    assert re.fullmatch(r"[0-9a-f]{40}", pub["commit_sha"])
    path = Path(_run(["pull", "me/tiny-ridgefill", "--revision", "s1", "--model", model_dir, *reg]).stdout.strip())
    assert read_manifest(path)["files"] == read_manifest(built["maps"])["files"]
    listed = _run(["maps", "list", *reg]).stdout
    assert "me/tiny-ridgefill" in listed and re.search(r"^\s+s1\s+[0-9a-f]{40}$", listed, re.M)


def test_results_and_publish_from_the_db(built, tmp_path):
    db, maps = tmp_path / "results.duckdb", str(built["maps"])
    with Recorder(db) as rec:
        rec.study(StudyRun("tiny-1", "test/tiny-qwen3", "main", "fp", "transformers", 10.0, {}, "tiny"))
        rec.trials([
            TrialRecord("tiny-1", 0, "COMPLETE", {"split": 2, "lam": 1e-2, "tail": 32}, -1.0, 1.4, None, True, maps,
                        2.0, [("ttft", "trial", "speedup", 256, "all", 1.4, 1)]),
            TrialRecord("tiny-1", 1, "COMPLETE", {"split": 3, "lam": 1e-2, "tail": 32}, -30.0, 2.0, None, False),
        ])  # fmt: skip
        rec.maps([("tiny-1", 0, "test/tiny-qwen3", maps, "sha", 2, 1e-2, 32, 0.0, -1.0, 1.4)], "tiny-1", 0)
    out = _run(["results", "--db", db]).stdout
    assert all(f"## {t}" in out for t in ("trials", "pareto", "best map"))
    assert re.search(r"\| tiny-1 \| 1 \| COMPLETE \| 3 \|.*\| False \|", out) and maps in out
    out = _run(["results", "--db", db, "--sql", "SELECT count(*) AS n FROM trials WHERE feasible"]).stdout
    assert re.search(r"^\| 1 \|$", out, re.M) and "| n |" in out
    reg = ["--backend", "local", "--registry", tmp_path / "registry"]
    pub = json.loads(_run(["publish", "--db", db, "--study", "tiny-1", "--repo", "me/tiny-ridgefill", *reg]).stdout)
    assert pub["revision"] == "tiny-1"
    assert query(db, "SELECT study, repo_id, revision FROM publications")[1] == [("tiny-1", "me/tiny-ridgefill",
                                                                                    "tiny-1")]  # fmt: skip
    # `ridgefill results` shows it from `publications`, the one record of a publication
    assert f"local:me/tiny-ridgefill@tiny-1#{pub['commit_sha']}" in _run(["results", "--db", db]).stdout


@pytest.mark.slow
def test_demo_and_maps_demo_on_the_default_model(tmp_path):
    out = _run(["demo", "--split", 18, "--max-windows", 2, "--window", 256, "--out", tmp_path / "maps",
                "--root", tmp_path]).stdout  # fmt: skip
    ridge, identity = tmp_path / "maps" / "smollm2-S18-ridge", tmp_path / "maps" / "smollm2-S18-identity"
    assert f"S=18: {ridge} (identity baseline: {identity})" in out and f"map folders under {tmp_path / 'maps'}" in out
    assert _layers(out) == list(range(19, 30))
    assert read_manifest(ridge)["kind"] == "ridge" and read_manifest(identity)["kind"] == "identity"
    result = _run(["maps", "demo", "--maps", ridge, "--registry", tmp_path / "registry", "--max-new-tokens", 4])
    published = r"published local/smollm2-ridgefill@demo \([0-9a-f]{40}\); pulled and verified: \S+"
    assert re.search(published, result.stdout)
    assert re.search(r"\[\d+ prompt tokens: \d+ filled from the pulled maps above layer 18\]", result.stderr)


# --- plain errors -------------------------------------------------------------------------------------------


def _one_line_error(result, *words: str) -> str:
    """Exit status 2, one `error:` line on stderr naming the problem, no traceback, nothing on stdout."""
    assert result.exit_code == 2, result.output + repr(result.exception)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in result.output, result.output
    assert all(w in lines[0] for w in words), lines[0]
    assert not result.stdout.strip()
    return lines[0]


@pytest.fixture
def corrupt(built, tmp_path) -> Path:
    folder = tmp_path / "corrupt"
    shutil.copytree(built["maps"], folder)
    f = folder / "layer_003.safetensors"
    data = bytearray(f.read_bytes())
    data[-1] ^= 0x01
    f.write_bytes(bytes(data))
    return folder


def test_a_refused_map_folder_is_one_line_and_the_traceback_needs_v(corrupt):
    line = _one_line_error(runner.invoke(app, ["inspect", str(corrupt)]), "layer_003.safetensors", "corrupt", "fix:")
    for args in (["-v", "inspect", str(corrupt)], ["inspect", str(corrupt), "-v"]):
        result = runner.invoke(app, args)
        assert result.exit_code == 2 and "Traceback (most recent call last)" in result.stderr
        assert result.stderr.strip().splitlines()[-1] == line


def test_bad_row_options_of_eval_are_one_line(built, model_dir):
    """`eval ttft` checks its row options (the question's window and reach too) on either engine: one line, exit 2;
    on vLLM before the engine starts."""
    for engine in ("transformers", "vllm"):
        args = ["eval", "ttft", "--engine", engine, "--maps", str(built["maps"]), "--model", str(model_dir),
                "--select", "question", "--share", "0.1", "--length", "64", "--repeats", "1"]  # fmt: skip
        _one_line_error(runner.invoke(app, [*args, "--reach", "-1"]), "--reach >= 0", "-1")
        _one_line_error(runner.invoke(app, [*args, "--share", "2"]), "--share must lie in [0, 1]")


def test_every_eval_command_takes_the_row_options_of_the_row_policy():
    """ruler, nll and ttft take one option per `RowPolicy` field, from one place, checked before a model loads."""
    from dataclasses import fields

    import typer

    from ridgefill.evals.cli import app as eval_app
    from ridgefill.rows import RowPolicy

    commands = typer.main.get_command(eval_app).commands
    for name in ("ruler", "nll", "ttft"):
        assert {f.name for f in fields(RowPolicy)} <= {p.name for p in commands[name].params}, name
        args = ["eval", name, "--model", "/no/model", "--select", "question", "--window", "-1"]
        _one_line_error(runner.invoke(app, args), "--window >= 0", "-1")


def test_bad_splits_and_missing_files_stop_before_the_model_loads(built, model_dir, monkeypatch):
    from ridgefill import steps

    def never(*a, **k):
        raise AssertionError("the model was loaded before the input was checked")

    monkeypatch.setattr(steps, "load_model", never)
    cap = ["capture", "--model", str(model_dir), "--root", str(built["root"])]
    _one_line_error(runner.invoke(app, [*cap, "--split", "2", "--split", "5"]), "[5]", "1..4", "6-layer")
    _one_line_error(runner.invoke(app, [*cap, "--split", "2", "--source", "/no/such.txt"]), "/no/such.txt")
    _one_line_error(runner.invoke(app, ["capture", "--model", "/no/model", "--split", "2"]), "/no/model")
    fit = ["fit", str(built["cap_dir"]), "--split", "4", "--out", "x", "--model", str(model_dir)]
    _one_line_error(runner.invoke(app, fit), "--split 4 was not captured", "[2, 3]")
    _one_line_error(runner.invoke(app, ["fit", "/no/capture", "--split", "2", "--out", "x"]), "/no/capture")
    _one_line_error(runner.invoke(app, ["generate", "@/no/prompt.txt"]), "/no/prompt.txt")
    _one_line_error(runner.invoke(app, ["generate", "hi", "--maps", str(built["root"])]), "not a map folder")


def test_pull_from_an_empty_registry_or_an_unreachable_hub_is_one_line(tmp_path, monkeypatch):
    import huggingface_hub.constants

    pull = ["pull", "me/nothing", "--model", "none", "--backend", "local", "--registry", str(tmp_path)]
    _one_line_error(runner.invoke(app, pull), "me/nothing")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)  # no network, nothing cached
    pull = ["pull", "me/nothing", "--model", "none", "--backend", "hub"]
    _one_line_error(runner.invoke(app, pull), "me/nothing", "not cached and the Hub is unreachable")


TINY_STUDY = {
    "name": "tiny",
    "model": {"repo": "test/tiny-qwen3"},
    "search": {"splits": [2, 3], "tails": [16]},
    "objectives": {"ruler": {"tasks": ["niah_single_1"], "lengths": [512]}, "ttft": {"lengths": [256]}},
    "constraints": {"max_ruler_drop": 10},
    "budget": {"trials": 2},
}


@pytest.mark.parametrize(
    "change, words",
    [
        ({"constraints": {"max_ruler_drop": -5}}, ["constraints.max_ruler_drop", "-5 is not a drop"]),
        ({"search": {"splits": [2, 40]}}, ["search.splits", "[40]", "1..4", "6-layer"]),
        ({"objectives": {"ttft": {"lengths": [8192]}}}, ["objectives.ttft.lengths", "8192", "4096 positions"]),
        ({"objectives": {"ruler": {"haystack": "/no/essays"}}}, ["objectives.ruler.haystack", "/no/essays"]),
        ({"model": {"local": "/no/model"}}, ["model:", "/no/model does not exist"]),
        ({"model": {"local": None, "repo": "nobody/nothing"}}, ["model:", "nobody/nothing", "Hub", "HF_ENDPOINT"]),
        ({"objectives": {"nll": {"documents": 2, "lengths": [128], "scored": 256}}}, ["objectives.nll", "exceed"]),
        ({"budget": {"trials": 0}}, ["budget.trials"]),
    ],
)
def test_a_bad_study_stops_before_prefect_starts(change, words, model_dir, tmp_path, monkeypatch):
    import huggingface_hub.constants

    import ridgefill.results_cli as results_cli
    from ridgefill.study import merge

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)  # an unreachable Hub, at once

    def never():
        raise AssertionError("the tune flow started on a bad study")

    monkeypatch.setattr(results_cli, "_flow", never)
    study = tmp_path / "tiny.yaml"
    study.write_text(json.dumps(merge(merge(TINY_STUDY, {"model": {"local": str(model_dir)}}), change)))
    line = _one_line_error(runner.invoke(app, ["tune", "--study", str(study)]), str(study), *words)
    assert line.count(str(study)) == 1  # one problem, one line


def test_the_installed_command_prints_one_line_and_exits_2(corrupt):
    """The real process: nothing else on stderr (no import-time warnings), status 2, traceback only with -v."""
    cmd = [sys.executable, "-m", "ridgefill.cli", "inspect", str(corrupt)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.count("\n") == 1 and proc.stderr.startswith("error: ") and "corrupt" in proc.stderr


def test_generate_refuses_ridge_without_maps(model_dir):
    result = runner.invoke(app, ["generate", "hello there", "--model", str(model_dir), "--mode", "ridge"])
    assert result.exit_code == 2 and "--maps" in result.output
