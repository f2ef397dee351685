"""Several machines, one study: PostgreSQL on a private loopback port (initdb + pg_ctl) holds one Optuna
study; two real `ridgefill tune` runs (the tune flow, each in its own process with its own Prefect home,
work folder and DuckDB file, on a tiny model) share it. Every trial is told once, each run prints a line per
trial it ran, and after the final sync both DuckDB files hold the whole study.

Needs the PostgreSQL server binaries, which `scripts/ci_services.sh` installs (CI runs it); the test fails
with that fix when they are missing. Nothing is installed from inside a test.
"""

from __future__ import annotations

import glob
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from optuna.trial import TrialState

from ridgefill import report, search
from ridgefill.results import query
from ridgefill.study import load_study

ROOT = Path(__file__).resolve().parents[1]
BUDGET = 4
TINY_STUDY = {
    "name": "tiny-shared",
    "model": {"repo": "test/tiny-qwen3", "local": None},
    "calibration": {"tokens": 2048, "window": 128, "heldout": 1},
    "search": {"splits": [2, 3], "lam": [1e-3, 1e-1], "tails": [16, 32], "share": [0.0, 0.1]},
    "objectives": {
        "ruler": {"tasks": ["niah_single_1"], "lengths": [512], "samples": 1, "promote": 2},
        "ttft": {"lengths": [256], "repeats": 1, "warmup": 0, "per_trial": True},  # orchestration, not timing
    },
    "constraints": {"max_ruler_drop": 10},
    "budget": {"trials": BUDGET},
    "hardware": {"threads": 1},
}
TRIAL_LINE = re.compile(
    r"trial (\d+)/(\d+) \(#(\d+)\): split (\d+), lambda (\S+), tail (\d+), share ([\d.]+)(?:, window \d+)?"
    r"(?:, reach \d+)? \| RULER ([+-][\d.]+)"
    r"(?: \[[-+\d., ]+\] n=\d+(?: promoted)?)? \| "
    r"speed-up (?:([\d.]+)x|invalid \(above its FLOP bound\)) \| dNLL (\S+) \| feasible (yes|no) \| ([\d.]+) s"
)
pytestmark = pytest.mark.slow


def _pg_bin() -> Path | None:
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/pg_ctl"))
    return Path(found[-1]).parent if found else None


def _ensure_postgres() -> Path:
    if (found := _pg_bin()) is None:
        pytest.fail("PostgreSQL server binaries (initdb, pg_ctl) are missing: run `bash scripts/ci_services.sh`")
    return found


def _as_postgres(cmd: list[str]) -> list[str]:
    """initdb refuses root; run the server as the `postgres` user when we are root."""
    return ["runuser", "-u", "postgres", "--", *cmd] if os.geteuid() == 0 else cmd


@pytest.fixture
def postgres_url():
    bin_dir = _ensure_postgres()
    base = Path(tempfile.mkdtemp(prefix="ridgefill-pg-"))
    data, sock = base / "data", base / "sock"
    sock.mkdir()
    if os.geteuid() == 0:
        shutil.chown(base, "postgres")
        shutil.chown(sock, "postgres")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    run = dict(check=True, capture_output=True, text=True, timeout=120)
    subprocess.run(_as_postgres([str(bin_dir / "initdb"), "-D", str(data), "-U", "ridgefill", "--auth=trust"]), **run)
    opts = f"-p {port} -k {sock} -c listen_addresses=127.0.0.1 -c fsync=off"
    pg_ctl = [str(bin_dir / "pg_ctl"), "-D", str(data), "-o", opts, "-l", str(base / "log"), "-w", "-t", "90"]
    subprocess.run(_as_postgres([*pg_ctl, "start"]), **run)
    try:
        subprocess.run(
            [str(bin_dir / "createdb"), "-h", "127.0.0.1", "-p", str(port), "-U", "ridgefill", "optuna"], **run
        )
        yield f"postgresql+psycopg://ridgefill@127.0.0.1:{port}/optuna"
    finally:
        subprocess.run(_as_postgres([*pg_ctl, "stop", "-m", "fast"]), capture_output=True, timeout=120)
        shutil.rmtree(base, ignore_errors=True)


@pytest.fixture
def tiny_study(tmp_path, tiny_models, tokenizer) -> Path:
    model_dir = tmp_path / "tiny-qwen3"
    tiny_models["qwen3"].save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    spec = TINY_STUDY | {"model": TINY_STUDY["model"] | {"local": str(model_dir)}}
    path = tmp_path / "tiny-shared.yaml"
    path.write_text(json.dumps(spec))  # JSON is YAML
    return path


def test_two_tune_runs_share_one_postgres_study(postgres_url, tiny_study, tmp_path):
    """The flow's shared-storage branch end to end: both runs take trials, each trial is told once and drawn
    once, each run logs its own trials, and the final sync leaves the whole study in both files."""
    procs = []
    for i in range(2):
        env = {k: v for k, v in os.environ.items() if k != "PREFECT_API_URL"} | {
            "RIDGEFILL_OPTUNA_STORAGE": postgres_url,  # as on the workers of README's several-machines setup
            "PREFECT_HOME": str(tmp_path / f"prefect{i}"),
            "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
            "HF_HUB_OFFLINE": "1",
            "OMP_NUM_THREADS": "1",
            "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
        }
        cmd = [
            sys.executable, "-m", "ridgefill.cli", "tune", "--study", str(tiny_study),
            "--db", str(tmp_path / f"worker{i}.duckdb"), "--work", str(tmp_path / f"work{i}"), "--no-publish",
            "--evaluator", "tests.flow_hooks:after_two_workers",  # both take part, whichever starts first
        ]  # fmt: skip
        procs.append(subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                      text=True, start_new_session=True))  # fmt: skip
    try:
        outs = [p.communicate(timeout=600)[0] for p in procs]
    finally:
        for p in procs:  # each run's own group: its temporary Prefect server too
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
    for p, out in zip(procs, outs, strict=True):
        assert p.returncode == 0, out[-6000:]

    cfg = load_study(tiny_study)
    study = optuna_study(postgres_url)
    trials = study.get_trials()
    assert [t.number for t in trials] == list(range(len(trials))) and len(trials) >= BUDGET
    assert all(t.state == TrialState.COMPLETE for t in trials)
    owners = {t.user_attrs["owner"] for t in trials}
    assert len(owners) == 2  # both runs took trials
    lams = [t.params["lam"] for t in trials if "fixed_params" not in t.system_attrs]  # drawn, not enqueued
    assert lams and len(set(lams)) == len(lams)  # no point drawn twice (the workers' samplers are seeded apart)

    for p, out in zip(procs, outs, strict=True):
        # stage lines, Prefect's task names, one line per trial this run finished, then the table and paths
        assert all(f"[{k}/7]" in out for k in range(1, 8)), out[-4000:]
        assert "Task run 'run_trial-" in out and "Task run 'capture-" in out
        mine = sorted(t.number for t in trials if t.user_attrs["owner"].endswith(f":{p.pid}"))
        lines = TRIAL_LINE.findall(out)
        assert sorted(int(m[2]) for m in lines) == mine and mine
        for m in lines:
            t = trials[int(m[2])]
            assert int(m[1]) == BUDGET and (int(m[3]), int(m[5])) == (t.params["split"], t.params["tail"])
            assert float(m[4]) == pytest.approx(t.params["lam"], rel=1e-2)
            assert float(m[7]) == pytest.approx(t.values[0], abs=0.01) and m[10] == "yes"
            # a 1-repeat timing on a loaded machine may land above its FLOP bound twice: recorded invalid, unranked
            up = search.ranked_speedup(t)
            assert (float(m[8]) == pytest.approx(up, abs=1e-3)) if m[8] else search.speedup_source(t) == "invalid"
        assert "| trial | split | lambda |" in out and "synced the whole shared study" in out

    def speedup(t):  # as DuckDB holds it: None for an invalid timing
        up = search.ranked_speedup(t)
        return None if up is None else round(up, 6)

    expected = sorted((t.number, t.params["split"], round(t.values[0], 6), speedup(t)) for t in trials)
    chosen = report.choose(trials, cfg.constraints.max_ruler_drop)  # None only if every timing was invalid
    for i in range(2):  # after the final sync each run's DuckDB file holds the whole study, whoever ran a trial
        db = tmp_path / f"worker{i}.duckdb"
        _, rows = query(db, "SELECT trial, split, round(ruler_delta, 6), round(speedup, 6) FROM trials ORDER BY 1")
        assert rows == expected
        _, ttft = query(db, "SELECT count(DISTINCT trial) FROM metrics WHERE kind = 'ttft' AND trial >= 0")
        assert ttft == [(len(trials),)]  # metric rows of the other run's trials too
        assert query(db, "SELECT trial FROM maps WHERE chosen")[1] == ([(chosen.number,)] if chosen else [])


def optuna_study(url: str):
    import optuna

    name = optuna.study.get_all_study_names(storage=search.storage(url, None, ""))
    assert len(name) == 1  # one run name: both runs saw the same weights
    return optuna.load_study(study_name=name[0], storage=search.storage(url, None, ""))
