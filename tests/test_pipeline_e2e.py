"""End to end: a real Prefect server on loopback, a process worker, `prefect deploy --all`, then
`prefect deployment run tune/smollm2-135m --watch` with a tiny budget; a second run hits the caches.

The run must leave trials, a Pareto row and a chosen map in DuckDB, and the map folder on disk.
"""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import httpx
import pytest
from huggingface_hub import ModelCard

from registry import LocalBackend
from ridgefill.maps import MANIFEST, read_manifest, verify_files
from ridgefill.results import query
from tests.prefect_server import PREFECT, cli, prefect_server, stop  # noqa: F401  (prefect_server: the fixture)

ROOT = Path(__file__).resolve().parents[1]
TINY = {
    "calibration": {"tokens": 2048, "window": 256, "heldout": 1},
    "search": {"splits": [18, 20], "tails": [32, 64]},
    "objectives": {
        "ruler": {"tasks": ["niah_single_1"], "lengths": [512], "samples": 1, "promote": 2},
        "nll": {"documents": 0},
        "ttft": {"lengths": [256], "repeats": 1, "warmup": 0, "per_trial": True},  # orchestration, not timing
    },
    "budget": {"trials": 2},
    "hardware": {"threads": 1},
    "certify": {"tasks": ["niah_single_1"], "lengths": [512], "samples": 2, "max_drop": 100.0},
}
pytestmark = pytest.mark.slow


def _runs(env: dict) -> list[dict]:
    r = httpx.post(env["PREFECT_API_URL"] + "/flow_runs/filter", json={"sort": "EXPECTED_START_TIME_ASC"})
    return r.json()


def _task_states(env: dict, flow_run_id: str, name: str) -> list[str]:
    body = {"flow_runs": {"id": {"any_": [flow_run_id]}}, "task_runs": {"name": {"like_": name}}}
    r = httpx.post(env["PREFECT_API_URL"] + "/task_runs/filter", json=body)
    return [t["state"]["name"] for t in r.json()]


def test_deployment_run_end_to_end(prefect_server, tmp_path):  # noqa: F811 (the imported fixture)
    registry_dir = tmp_path / "registry"
    env = {**prefect_server, "RIDGEFILL_REGISTRY_BACKEND": "local", "RIDGEFILL_REGISTRY": str(registry_dir)}
    for pool in ("cpu-process", "gpu-process"):
        cli(env, "work-pool", "create", pool, "--type", "process")
    cli(env, "--no-prompt", "deploy", "--all", timeout=300)
    deps = {d["name"]: d for d in httpx.post(env["PREFECT_API_URL"] + "/deployments/filter", json={}).json()}
    assert {"smollm2-135m", "qwen3-8b", "llama-3.1-8b", "nightly"} <= set(deps)
    assert deps["nightly"]["schedules"][0]["schedule"]["cron"] == "0 3 * * *"
    step = {"prefect.deployments.steps.set_working_directory": {"directory": str(ROOT.resolve())}}
    assert deps["smollm2-135m"]["pull_steps"] == [step]  # the checkout, recorded at deploy time

    wlog = open(tmp_path / "worker.log", "w")
    worker = subprocess.Popen(
        [PREFECT, "worker", "start", "--pool", "cpu-process", "--type", "process"],
        cwd=tmp_path, env=env, stdout=wlog, stderr=subprocess.STDOUT, start_new_session=True,  # not the checkout
    )  # fmt: skip
    db = tmp_path / "results.duckdb"
    try:
        for attempt in (1, 2):  # the second run finds the budget spent and the capture cached
            params = json.dumps({"overrides": TINY, "where": {"db": str(db)}, "publish": attempt == 1})
            run = subprocess.run(
                [PREFECT, "deployment", "run", "tune/smollm2-135m", "--params", params, "--watch",
                 "--watch-timeout", "600"],
                cwd=ROOT, env=env, capture_output=True, text=True, timeout=660,
            )  # fmt: skip
            assert run.returncode == 0, (
                f"run {attempt} failed:\n{run.stdout[-3000:]}\n{(tmp_path / 'worker.log').read_text()[-6000:]}"
            )
    finally:
        stop(worker)
        wlog.close()

    runs = [r for r in _runs(env) if r["deployment_id"] == deps["smollm2-135m"]["id"]]
    assert [r["state"]["type"] for r in runs] == ["COMPLETED", "COMPLETED"]
    assert _task_states(env, runs[0]["id"], "capture") == ["Completed"]
    assert _task_states(env, runs[1]["id"], "capture") == ["Cached"]  # no recapture on a rerun
    assert _task_states(env, runs[1]["id"], "exact_ruler") == ["Cached", "Cached"]  # the objective's and certify's
    assert _task_states(env, runs[1]["id"], "run_trial") == []  # the budget was spent by the first run

    _, trials = query(
        db, "SELECT trial, state, split, lam, ruler_delta, speedup, speedup_source FROM trials ORDER BY trial"
    )
    assert [t[:2] for t in trials] == [(0, "COMPLETE"), (1, "COMPLETE")]
    # every trial's speed-up was measured and recorded; a 1-repeat timing at 256 tokens on a loaded machine may
    # land above its FLOP bound twice, and is then recorded invalid with no speed-up (never used), as it should
    assert all((t[5] > 0 and t[6] == "measured") or (t[5] is None and t[6] == "invalid") for t in trials)
    _, metrics = query(db, "SELECT count(*) FROM metrics WHERE kind = 'ruler' AND trial >= 0")
    assert metrics[0][0] >= 2
    _, pareto = query(db, "SELECT trial FROM pareto")
    assert pareto
    _, best = query(db, "SELECT model, trial, path, manifest_sha256 FROM best_map")
    assert len(best) == 1 and best[0][0] == "HuggingFaceTB/SmolLM2-135M-Instruct"
    folder = Path(best[0][2])
    verify_files(folder, read_manifest(folder))
    assert (folder / MANIFEST).is_file()
    _, studies = query(db, "SELECT study, spec, revision FROM studies")
    assert len(studies) == 1 and studies[0][1:] == ("smollm2-135m", "embedded")
    name = studies[0][0]  # the study of this spec on these weights
    assert re.fullmatch(r"smollm2-135m-[0-9a-f]{8}", name)
    report = Path(env["RIDGEFILL_WORK"]) / name
    assert (report / "pareto.png").stat().st_size > 1000 and "**" in (report / "pareto.md").read_text()
    arts = httpx.post(env["PREFECT_API_URL"] + "/artifacts/filter", json={}).json()
    assert {f"{name}-pareto", f"{name}-pareto-plot"} <= {a["key"] for a in arts}
    # the chosen map was certified (paired against exact on certify's samples) before it was published
    _, certs = query(db, "SELECT trial, passed, n, tasks FROM certifications")
    assert certs == [(best[0][1], True, 2, '["niah_single_1"]')]
    # the first run published the chosen map to the local registry, pulled it back and served it
    _, pubs = query(db, "SELECT repo_id, revision, commit_sha FROM publications")
    assert len(pubs) == 1 and pubs[0][1] == name
    card = ModelCard.load(LocalBackend(registry_dir).download(pubs[0][0], name) / "README.md").data.to_dict()
    results = card["model-index"][0]["results"]
    certified = {r["dataset"]["type"]: r for r in results if r["dataset"].get("config") == "certify"}
    assert set(certified) == {"ruler", "ttft"}  # accuracy and speed, both certified before publishing
    ttft = {m["name"]: m["value"] for m in certified["ttft"]["metrics"]}
    assert 0 < ttft["certified"] <= ttft["flop_bound"] or ttft["certified_ci95_low"] <= ttft["flop_bound"]
    certified = certified["ruler"]
    args = certified["dataset"]["args"]
    assert args["tasks"] == ["niah_single_1"] and args["lengths"] == [512] and args["samples"] == 2
    assert args["engine"] == "vllm"  # certified as served, whatever engine the trials used (transformers here)
    assert {m["name"]: m["value"] for m in certified["metrics"]}["n"] == 2
    wlog = (tmp_path / "worker.log").read_text()
    assert "pulled back and served" in wlog
    # progress: stage lines and one line per trial, in the flow run's log (the worker prints it)
    assert "[1/7] model: HuggingFaceTB/SmolLM2-135M-Instruct" in wlog and "[5/7] select:" in wlog
    assert "[6/7] certify:" in wlog
    assert len(re.findall(r"trial [12]/2 \(#[01]\): split (?:18|20), lambda \S+, tail (?:32|64), ", wlog)) == 2
