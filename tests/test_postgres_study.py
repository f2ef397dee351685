"""Several machines, one study: PostgreSQL on a private loopback port (initdb + pg_ctl) holds one Optuna
study; two worker processes run trials against it. Every trial is told once and recorded once.

Needs the PostgreSQL server binaries, which `scripts/ci_services.sh` installs (CI runs it); the test fails
with that fix when they are missing. Nothing is installed from inside a test.
"""

from __future__ import annotations

import glob
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import pytest
from optuna.trial import TrialState

from ridgefill import tuning
from ridgefill.results import Recorder, query
from ridgefill.study import load_study

STUDY = Path(__file__).resolve().parents[1] / "studies" / "smollm2-135m.yaml"
OVERRIDES = {"budget": {"trials": 8}, "search": {"lam": [1e-3, 1e-1]}}
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


WORKER = textwrap.dedent(
    """
    import sys, time
    sys.path.insert(0, {tests!r})
    from test_tuning import fake_outcome
    from ridgefill import tuning
    from ridgefill.results import Recorder
    from ridgefill.study import load_study
    cfg = load_study({study!r}, {overrides!r})
    DROP = cfg.constraints.max_ruler_drop
    s = tuning.open_study(cfg, tuning.storage({url!r}, {root!r}, cfg.name), seed_offset={seed})
    tuning.enqueue_first(s, cfg)

    def evaluate(batch):
        deadline = time.monotonic() + 120  # both workers hold a trial before either finishes its first
        while len({{t.user_attrs.get("owner") for t in s.get_trials(deepcopy=False)}} - {{None}}) < 2:
            assert time.monotonic() < deadline, "the other worker never asked for a trial"
            time.sleep(0.1)
        return [fake_outcome(p) for _, p in batch]

    with Recorder({db!r}) as rec:  # each machine keeps its own results file
        ran = tuning.optimize(s, cfg, evaluate, on_trial=lambda t: rec.trials([tuning.record_of(cfg.name, t, DROP)]))
    print("RAN", ran)
    """
)


def test_two_workers_share_one_postgres_study(postgres_url, tmp_path):
    tests = str(Path(__file__).parent)
    procs = []
    for i in range(2):
        code = WORKER.format(
            tests=tests, study=str(STUDY), overrides=OVERRIDES, url=postgres_url, root=str(tmp_path), seed=i,
            db=str(tmp_path / f"worker{i}.duckdb"),
        )  # fmt: skip
        env = os.environ | {"OMP_NUM_THREADS": "1"}
        procs.append(subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                      text=True, env=env))  # fmt: skip
    outs = [p.communicate(timeout=300) for p in procs]
    for p, (_, err) in zip(procs, outs, strict=True):
        assert p.returncode == 0, err[-3000:]
    ran = [int(out.split("RAN")[1]) for out, _ in outs]
    assert all(r > 0 for r in ran)

    cfg = load_study(STUDY, OVERRIDES)
    DROP = cfg.constraints.max_ruler_drop
    study = tuning.open_study(cfg, tuning.storage(postgres_url, tmp_path, cfg.name))
    trials = study.get_trials()
    numbers = [t.number for t in trials]
    assert numbers == list(range(len(trials))) and len(trials) == sum(ran)
    assert all(t.state == TrialState.COMPLETE for t in trials)
    assert len(trials) >= cfg.budget.trials
    assert len({t.user_attrs["owner"] for t in trials}) == 2

    per_worker = [query(tmp_path / f"worker{i}.duckdb", "SELECT trial FROM trials")[1] for i in range(2)]
    assert sorted(n for rows in per_worker for (n,) in rows) == numbers  # each trial recorded by one worker
    with Recorder(tmp_path / "all.duckdb") as rec:
        tuning.sync(rec, study, DROP)
        tuning.sync(rec, study, DROP)
    _, rows = query(tmp_path / "all.duckdb", "SELECT count(*), count(DISTINCT trial) FROM trials")
    assert rows == [(len(trials), len(trials))]
