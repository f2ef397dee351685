"""The unattended re-tune, timed: `retune/nightly` sees a new revision of the smollm2 study's model on a
loopback Hub, triggers `tune/smollm2-135m`, and a process worker runs it to a published map that the flow
pulls back and serves. Everything is real except the Hub (`tests/hub_standin.py` serves the embedded
SmolLM2 weights as a Hub repo, so the worker downloads them with huggingface_hub as it would a release):
a Prefect server, `prefect deploy --all`, a worker, DuckDB, the local registry.

The study is the smollm2 study with its model on the Hub (no `local:`), and, so that the path reaches
publish, the RULER limits loosened (`--max-drop`, default 100: every trial is feasible and the chosen map
passes its certificate) and the trials cut (`--trials`, default 2): this times the path, not the search
(the README main job times the 8-trial search) and says nothing about quality.

    python bench/retune_path.py [--trials 2] [--max-drop 100] [--out DIR]

Prints the seconds from the nightly run's trigger to each stage line of the tune run, as a table.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path

import httpx
import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from ridgefill.default_model import default_model_dir  # noqa: E402
from tests.hub_standin import HubStandIn, serve  # noqa: E402
from tests.prefect_server import PREFECT, cli, running_server, stop  # noqa: E402

REPO = "HuggingFaceTB/SmolLM2-135M-Instruct"
MARKS = ("[1/", "[2/", "[3/", "[4/", "trial ", "[5/", "[6/", "certification ", "[7/", "pulled back and served")


def hub_study(out: Path, trials: int, max_drop: float) -> Path:
    """studies/smollm2-135m.yaml with its model on the Hub, the trials cut and the limits loosened."""
    cfg = yaml.safe_load((ROOT / "studies" / "smollm2-135m.yaml").read_text())
    cfg["model"].pop("local")
    cfg["budget"]["trials"] = trials
    cfg["constraints"]["max_ruler_drop"] = max_drop
    cfg["certify"]["max_drop"] = max_drop
    path = out / "studies" / "smollm2-135m.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return path


def api(env: dict, route: str, body: dict) -> list[dict]:
    return httpx.post(env["PREFECT_API_URL"] + route, json=body, timeout=30).raise_for_status().json()


def nightly(env: dict, study: Path, state: Path, endpoint: str) -> None:
    params = json.dumps({"studies": [str(study)], "state": str(state), "endpoint": endpoint})
    cli(env, "deployment", "run", "retune/nightly", "--params", params, "--watch", timeout=600)


def tune_run(env: dict, timeout: float) -> dict:
    """The tune/smollm2-135m flow run the nightly one triggered, once it has finished."""
    (dep,) = api(env, "/deployments/filter", {"deployments": {"name": {"any_": ["smollm2-135m"]}}})
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        runs = api(env, "/flow_runs/filter", {"flow_runs": {"deployment_id": {"any_": [dep["id"]]}}})
        if runs and runs[0]["state"]["type"] in ("COMPLETED", "FAILED", "CRASHED", "CANCELLED"):
            return runs[0]
        time.sleep(2)
    raise TimeoutError(f"tune/smollm2-135m did not finish in {timeout} s")


def stage_lines(env: dict, run_id: str) -> list[tuple[float, str]]:
    """(unix time, message) of the run's stage and trial lines, in order."""
    logs = api(env, "/logs/filter", {"logs": {"flow_run_id": {"any_": [run_id]}}, "sort": "TIMESTAMP_ASC"})
    out = []
    for rec in logs:
        msg = rec["message"]
        if msg.startswith(MARKS):
            out.append((datetime.fromisoformat(rec["timestamp"]).timestamp(), msg))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trials", type=int, default=2)
    ap.add_argument("--max-drop", type=float, default=100.0)
    ap.add_argument("--out", type=Path, default=None, help="work folder (default: a new temporary one)")
    ap.add_argument("--timeout", type=float, default=3600)
    a = ap.parse_args()
    out = a.out or Path(tempfile.mkdtemp(prefix="retune-path-"))
    out.mkdir(parents=True, exist_ok=True)
    study = hub_study(out, a.trials, a.max_drop)
    hub = HubStandIn({REPO: "a" * 40}, {REPO: default_model_dir()})
    server = serve(hub)
    hf_home = out / "hf"
    hf_home.mkdir(exist_ok=True)
    (hf_home / ".agent_harnesses.json").write_text('{"standardEnvVars": [], "harnesses": {}}')  # no hf.co lookup
    with running_server(out) as env:
        env = {k: v for k, v in env.items() if k not in ("OMP_NUM_THREADS", "HF_HUB_OFFLINE")}
        env |= {"HF_ENDPOINT": hub.url, "HF_HOME": str(hf_home), "HF_HUB_CACHE": str(out / "hf-cache")}
        env |= {"RIDGEFILL_REGISTRY_BACKEND": "local", "RIDGEFILL_REGISTRY": str(out / "registry")}
        for pool in ("cpu-process", "gpu-process"):
            cli(env, "work-pool", "create", pool, "--type", "process")
        cli(env, "--no-prompt", "deploy", "--all", timeout=300)
        log = open(out / "worker.log", "w")
        cmd = [PREFECT, "worker", "start", "--pool", "cpu-process", "--type", "process"]
        worker = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            state = out / "retune.json"
            nightly(env, study, state, hub.url)  # the first check remembers the commit
            assert json.loads(state.read_text()) == {f"{REPO}@main": "a" * 40}, state.read_text()
            hub.shas[REPO] = "c" * 40  # the fake new release
            t0 = time.time()
            nightly(env, study, state, hub.url)
            run = tune_run(env, a.timeout)
            t1 = time.time()
        finally:
            stop(worker)
            log.close()
        lines = stage_lines(env, run["id"])
    server.shutdown()
    published = out / "registry"
    print(f"tune run {run['name']}: {run['state']['type']}, {t1 - t0:.0f} s from the nightly trigger to its end")
    print("| s after trigger | stage |\n|---|---|")
    for t, msg in lines:
        print(f"| {t - t0:.0f} | {msg.splitlines()[0][:140]} |")
    files = sorted(str(p.relative_to(published)) for p in published.rglob("ridgefill.json"))
    print(f"registry: {files}")
    result = {"state": run["state"]["type"], "seconds": t1 - t0, "stages": [(t - t0, m) for t, m in lines]}
    (out / "retune_path.json").write_text(json.dumps(result, indent=2))
    if run["state"]["type"] != "COMPLETED" or not any("pulled back and served" in m for _, m in lines):
        sys.exit(f"the path did not reach a served map; see {out / 'worker.log'}")


if __name__ == "__main__":
    main()
