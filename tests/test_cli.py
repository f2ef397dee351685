"""The CLI end to end on a tiny model saved to disk: capture -> fit -> inspect -> generate -> eval."""

from __future__ import annotations

import json
import re

import pytest
from typer.testing import CliRunner

from ridgefill.cli import app
from tests.conftest import ESSAYS

runner = CliRunner()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, tiny_models, tokenizer):
    path = tmp_path_factory.mktemp("tiny-qwen3")
    tiny_models["qwen3"].save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def _ok(args: list[str]) -> str:
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output + repr(result.exception)
    return result.output


def test_capture_fit_inspect_generate(model_dir, tmp_path):
    calib = sorted(ESSAYS.glob("*.txt"))[:3]
    if not calib:
        pytest.skip("no essays")
    src = [a for f in calib for a in ("--source", str(f))]
    out = _ok(
        [
            "capture",
            "--model",
            str(model_dir),
            *src,
            "--split",
            "2",
            "--split",
            "3",
            "--window",
            "128",
            "--max-windows",
            "10",
            "--heldout",
            "2",
            "--root",
            str(tmp_path),
        ]
    )
    cap_dir = re.search(r"capture: (\S+) \(\d+ windows", out).group(1)
    assert "10 windows" in out
    out = _ok(
        [
            "fit",
            cap_dir,
            "--split",
            "2",
            "--out",
            str(tmp_path / "maps"),
            "--model",
            str(model_dir),
            "--lambda",
            "0.01",
            "--tail",
            "32",
        ]
    )
    assert "maps:" in out and "| " in out
    manifest = json.loads((tmp_path / "maps" / "ridgefill.json").read_text())
    assert manifest["defaults"]["tail"] == 32 and manifest["late_layers"] == [3, 4, 5]
    assert "files: 4 verified" in _ok(["inspect", str(tmp_path / "maps")])
    out = _ok(
        [
            "generate",
            "word " * 100,
            "--model",
            str(model_dir),
            "--maps",
            str(tmp_path / "maps"),
            "--max-new-tokens",
            "4",
        ]
    )
    assert out.strip()
    out = _ok(
        [
            "eval",
            "ttft",
            "--model",
            str(model_dir),
            "--maps",
            str(tmp_path / "maps"),
            "--length",
            "96",
            "--repeats",
            "2",
            "--out",
            str(tmp_path / "ttft.json"),
        ]
    )
    assert "| 96 |" in out and json.loads((tmp_path / "ttft.json").read_text())["lengths"]["96"]["repeats"] == 2


def test_generate_refuses_ridge_without_maps(model_dir):
    result = runner.invoke(app, ["generate", "hello there", "--model", str(model_dir), "--mode", "ridge"])
    assert result.exit_code != 0 and "--maps" in result.output
