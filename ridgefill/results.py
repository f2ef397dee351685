"""Tuning results in one DuckDB file: studies, trials, metrics (task x length x region), maps, certifications
and publications (written by `registry`, the one record of where a map went; `best_map` shows it).

DuckDB allows one process at a time to open a file for writing, so a `Recorder` opens it for each
transaction only (one finished trial = one transaction of batched VALUES) and waits while another
process holds it: two flows on one host, or `ridgefill results` during a study, take turns.
Rows are keyed by (study, trial) and upserted, so replaying trials after a crash never duplicates.
The file is created with `storage_compatibility_version='v1.5.0'` so the duckdb 1.5 CLI can read it.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import duckdb

from ridgefill import settings

COMPAT = "v1.5.0"
SCHEMA = """
CREATE TABLE IF NOT EXISTS studies (
    study TEXT PRIMARY KEY, model TEXT, revision TEXT, fingerprint TEXT, engine TEXT,
    max_ruler_drop DOUBLE, config JSON, updated TIMESTAMP DEFAULT current_timestamp, spec TEXT
);
ALTER TABLE studies ADD COLUMN IF NOT EXISTS spec TEXT;
CREATE TABLE IF NOT EXISTS trials (
    study TEXT, trial INTEGER, state TEXT, split INTEGER, lam DOUBLE, tail INTEGER, share DOUBLE, sink INTEGER,
    ruler_delta DOUBLE, speedup DOUBLE, dnll DOUBLE, feasible BOOLEAN, map_path TEXT, params JSON,
    seconds DOUBLE, finished TIMESTAMP DEFAULT current_timestamp, PRIMARY KEY (study, trial)
);
ALTER TABLE trials ADD COLUMN IF NOT EXISTS ruler_ci_lo DOUBLE;
ALTER TABLE trials ADD COLUMN IF NOT EXISTS ruler_ci_hi DOUBLE;
ALTER TABLE trials ADD COLUMN IF NOT EXISTS ruler_n INTEGER;
ALTER TABLE trials ADD COLUMN IF NOT EXISTS speedup_predicted DOUBLE;
ALTER TABLE trials ADD COLUMN IF NOT EXISTS speedup_bound DOUBLE;
ALTER TABLE trials ADD COLUMN IF NOT EXISTS speedup_source TEXT;
CREATE TABLE IF NOT EXISTS ttft_calibrations (  -- the TTFT model each study run ranked its trials by
    study TEXT, engine TEXT, device TEXT, dtype TEXT, point TEXT, length INTEGER, measured DOUBLE, lo DOUBLE,
    hi DOUBLE, rounds INTEGER, predicted DOUBLE, error DOUBLE, bound DOUBLE, exact_s DOUBLE, model JSON,
    calibrated TIMESTAMP DEFAULT current_timestamp, PRIMARY KEY (study, point, length)
);
CREATE TABLE IF NOT EXISTS metrics (
    study TEXT, trial INTEGER, kind TEXT, plan TEXT, task TEXT, length INTEGER, region TEXT,
    value DOUBLE, n INTEGER, PRIMARY KEY (study, trial, kind, plan, task, length, region)
);
CREATE TABLE IF NOT EXISTS maps (
    study TEXT, trial INTEGER, model TEXT, path TEXT, manifest_sha256 TEXT, split INTEGER, lam DOUBLE,
    tail INTEGER, share DOUBLE, ruler_delta DOUBLE, speedup DOUBLE, chosen BOOLEAN DEFAULT false,
    created TIMESTAMP DEFAULT current_timestamp, PRIMARY KEY (study, trial)
);
ALTER TABLE maps DROP COLUMN IF EXISTS published;  -- files from before: publications are the one record
CREATE TABLE IF NOT EXISTS publications (
    study VARCHAR, repo_id VARCHAR, revision VARCHAR, commit_sha VARCHAR, backend VARCHAR,
    url VARCHAR, map_path VARCHAR, published_at TIMESTAMPTZ, manifest_sha256 VARCHAR, PRIMARY KEY (repo_id, revision)
);
ALTER TABLE publications ADD COLUMN IF NOT EXISTS manifest_sha256 VARCHAR;
CREATE TABLE IF NOT EXISTS certifications (
    study TEXT, trial INTEGER, passed BOOLEAN, rule TEXT, delta DOUBLE, ci_lo DOUBLE, ci_hi DOUBLE, n INTEGER,
    score DOUBLE, exact DOUBLE, tasks JSON, lengths JSON, samples INTEGER, haystack TEXT, seed INTEGER,
    detail JSON, seconds DOUBLE, certified TIMESTAMP DEFAULT current_timestamp, PRIMARY KEY (study, trial)
);
CREATE OR REPLACE VIEW pareto AS
SELECT t.* FROM trials t
WHERE t.state = 'COMPLETE' AND t.feasible AND NOT EXISTS (
    SELECT 1 FROM trials u
    WHERE u.study = t.study AND u.state = 'COMPLETE' AND u.feasible
      AND u.ruler_delta >= t.ruler_delta AND u.speedup >= t.speedup
      AND (u.ruler_delta > t.ruler_delta OR u.speedup > t.speedup)
);
CREATE OR REPLACE VIEW best_map AS
SELECT m.*, p.published FROM maps m LEFT JOIN studies s ON s.study = m.study
LEFT JOIN certifications c ON c.study = m.study AND c.trial = m.trial
LEFT JOIN (  -- the map's latest publication, as `backend:repo@revision#commit` (`registry.Publication`)
    SELECT study, map_path, arg_max(backend || ':' || repo_id || '@' || revision || '#' || commit_sha,
        coalesce(published_at, '-infinity'::TIMESTAMPTZ)) AS published
    FROM publications GROUP BY study, map_path
) p ON p.study = m.study AND p.map_path = m.path
WHERE m.chosen AND c.passed IS NOT false  -- a map that failed its certification is never the one to serve
QUALIFY row_number() OVER (PARTITION BY m.model ORDER BY s.updated DESC NULLS LAST, m.speedup DESC, m.created DESC) = 1;
"""
TRIAL_COLS = (
    "study", "trial", "state", "split", "lam", "tail", "share", "sink", "ruler_delta", "speedup", "dnll",
    "feasible", "map_path", "params", "seconds", "ruler_ci_lo", "ruler_ci_hi", "ruler_n", "speedup_predicted",
    "speedup_bound", "speedup_source",
)  # fmt: skip
CALIBRATION_COLS = (
    "study", "engine", "device", "dtype", "point", "length", "measured", "lo", "hi", "rounds", "predicted", "error",
    "bound", "exact_s", "model",
)  # fmt: skip
METRIC_COLS = ("study", "trial", "kind", "plan", "task", "length", "region", "value", "n")
MAP_COLS = (
    "study", "trial", "model", "path", "manifest_sha256", "split", "lam", "tail", "share", "ruler_delta", "speedup",
)  # fmt: skip
CERT_COLS = (
    "study", "trial", "passed", "rule", "delta", "ci_lo", "ci_hi", "n", "score", "exact", "tasks", "lengths",
    "samples", "haystack", "seed", "detail", "seconds",
)  # fmt: skip
BASELINE = -1  # the trial number under which a study's exact baselines are recorded


LOCK_WAIT_S = 300.0  # how long a writer or reader waits for another process to let go of the file


def connect(
    path: str | Path, read_only: bool = False, wait_s: float = LOCK_WAIT_S, schema: bool = True
) -> duckdb.DuckDBPyConnection:
    """Open (creating with the v1.5.0 storage format and, with `schema`, the tables) or read a results file,
    waiting up to `wait_s` while another process holds it."""
    path = Path(path)
    deadline = time.monotonic() + wait_s
    while True:
        try:
            if read_only:
                return duckdb.connect(str(path), read_only=True)
            path.parent.mkdir(parents=True, exist_ok=True)
            con = duckdb.connect(str(path), config={"storage_compatibility_version": COMPAT})
            if schema:
                con.execute(SCHEMA)
            return con
        except duckdb.IOException as e:
            if "lock" not in str(e).lower() or time.monotonic() > deadline:
                raise
            time.sleep(0.25)


def insert_rows(con: duckdb.DuckDBPyConnection, table: str, cols: Sequence[str], rows: Sequence[Sequence]) -> None:
    """One INSERT OR REPLACE with all rows as VALUES (executemany is slow on DuckDB)."""
    if not rows:
        return
    one = "(" + ", ".join("?" * len(cols)) + ")"
    sql = f"INSERT OR REPLACE INTO {table} ({', '.join(cols)}) VALUES " + ", ".join([one] * len(rows))
    con.execute(sql, [v for r in rows for v in r])


@dataclass
class TrialRecord:
    """One finished trial as the recorder stores it; `metrics` rows follow METRIC_COLS[2:]."""

    study: str
    trial: int
    state: str
    params: dict[str, Any]
    ruler_delta: float | None = None
    speedup: float | None = None  # what ranked the trial (`speedup_source`); None: not timed, or invalid
    dnll: float | None = None
    feasible: bool | None = None
    map_path: str | None = None
    seconds: float | None = None
    metrics: list[tuple] = field(default_factory=list)
    ruler_ci: dict | None = None  # {"lo", "hi", "n"}: the paired delta's 95% CI
    speedup_predicted: float | None = None  # the calibrated TTFT model's speed-up
    speedup_bound: float | None = None  # the FLOP bound at the TTFT lengths
    speedup_source: str | None = None  # what ranked the trial: predicted | measured | invalid | None (not timed)

    def row(self) -> tuple:
        p, ci = self.params, self.ruler_ci or {}
        return (
            self.study, self.trial, self.state, p.get("split"), p.get("lam"), p.get("tail"), p.get("share"),
            p.get("sink"), self.ruler_delta, self.speedup, self.dnll, self.feasible, self.map_path,
            json.dumps(p), self.seconds, ci.get("lo"), ci.get("hi"), ci.get("n"), self.speedup_predicted,
            self.speedup_bound, self.speedup_source,
        )  # fmt: skip


@dataclass(frozen=True)
class StudyRun:
    """One study run as `studies` records it: `name` is per weights (`spec`, the study file's name, plus the
    weights hash), the model, its revision and fingerprint, the engine, the RULER limit and the whole config."""

    name: str
    model: str
    revision: str
    fingerprint: str
    engine: str
    max_drop: float
    config: dict
    spec: str | None = None


class Recorder:
    """Writes a results file; thread-safe, one transaction (and one short-lived connection) per call."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        connect(self.path).close()  # create the file and schema now: fail early on a bad path
        self._lock = threading.Lock()

    def close(self) -> None:
        """Nothing is held between calls; kept for `with Recorder(...)`."""

    def __enter__(self) -> Recorder:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _tx(self, writes: list[tuple[str, Sequence[str], Sequence[Sequence]]], before: list, after=()) -> None:
        """Statements `before`, batched inserts, statements `after`: all or nothing."""
        with self._lock, connect(self.path, schema=False) as con:  # __init__ made the schema
            con.execute("BEGIN TRANSACTION")
            try:
                for q, args in before:
                    con.execute(q, args)
                for table, cols, rows in writes:
                    insert_rows(con, table, cols, rows)
                for q, args in after:
                    con.execute(q, args)
                con.execute("COMMIT")
            except Exception:
                con.execute("ROLLBACK")
                raise

    def study(self, run: StudyRun) -> None:
        """One study run (its `studies` row)."""
        cols = ("study", "model", "revision", "fingerprint", "engine", "max_ruler_drop", "config", "spec")
        r = run
        row = (r.name, r.model, r.revision, r.fingerprint, r.engine, r.max_drop, json.dumps(r.config), r.spec or r.name)
        self._tx([("studies", cols, [row])], [])

    def trials(self, records: Sequence[TrialRecord]) -> None:
        """Upsert trials with their metrics (a trial's old metric rows are replaced, never duplicated; its
        certification's rows stay)."""
        metrics = [(r.study, r.trial, *m) for r in records for m in r.metrics]
        q = "DELETE FROM metrics WHERE study = ? AND trial = ? AND kind <> 'certify'"
        clear = [(q, [r.study, r.trial]) for r in records]
        self._tx([("trials", TRIAL_COLS, [r.row() for r in records]), ("metrics", METRIC_COLS, metrics)], clear)

    def baseline(self, study: str, metrics: list[tuple]) -> None:
        """The exact baselines (trial BASELINE) of a study: RULER and TTFT rows of the exact plan."""
        self._tx(
            [("metrics", METRIC_COLS, [(study, BASELINE, *m) for m in metrics])],
            [("DELETE FROM metrics WHERE study = ? AND trial = ?", [study, BASELINE])],
        )

    def maps(self, rows: Sequence[tuple], study: str, chosen: int | None) -> None:
        """Upsert map rows (MAP_COLS) and mark the study's chosen map (one per study; none when nothing is feasible)."""
        after = [("UPDATE maps SET chosen = false WHERE study = ?", [study])]
        if chosen is not None:
            after.append(("UPDATE maps SET chosen = true WHERE study = ? AND trial = ?", [study, chosen]))
        self._tx([("maps", MAP_COLS, rows)], [], after)

    def certification(self, cert: dict, metrics: Sequence[tuple] = ()) -> None:
        """Upsert a map's certification (`ridgefill.certify.certificate`) and its metric rows (kind 'certify')."""
        row = (
            cert["study"], cert["trial"], cert["passed"], cert["rule"], cert["delta"], cert["ci_lo"], cert["ci_hi"],
            cert["n"], cert["score"], cert["exact"], json.dumps(cert["tasks"]), json.dumps(cert["lengths"]),
            cert["samples"], cert["haystack"], cert["seed"], json.dumps(cert), cert.get("seconds"),
        )  # fmt: skip
        key = [cert["study"], cert["trial"]]
        clear = [("DELETE FROM metrics WHERE study = ? AND trial = ? AND kind = 'certify'", key)]
        rows = [(cert["study"], cert["trial"], *m) for m in metrics]
        self._tx([("certifications", CERT_COLS, [row]), ("metrics", METRIC_COLS, rows)], clear)

    def calibration(self, study: str, model: dict) -> None:
        """The TTFT model a study run ranks its trials by (`TTFTModel.as_dict`): one row per calibration point."""
        m = {k: model[k] for k in ("engine", "device", "dtype")}
        blob = json.dumps(model)
        rows = [
            (study, m["engine"], m["device"], m["dtype"], r["point"], r["length"], r["measured"], r["lo"], r["hi"],
             r["rounds"], r["predicted"], r["error"], r["bound"], r["exact_s"], blob)
            for r in model["points"]
        ]  # fmt: skip
        clear = [("DELETE FROM ttft_calibrations WHERE study = ?", [study])]
        self._tx([("ttft_calibrations", CALIBRATION_COLS, rows)], clear)

    def certified(self, study: str, trial: int) -> dict | None:
        """The recorded certificate of a study's trial, or None."""
        with self._lock, connect(self.path, schema=False) as con:
            q = "SELECT detail FROM certifications WHERE study = ? AND trial = ?"
            row = con.execute(q, [study, trial]).fetchone()
        return json.loads(row[0]) if row else None


def default_work() -> Path:
    """Where the tune flow keeps captures, maps and reports: $RIDGEFILL_WORK or <cache>/tune."""
    from ridgefill.default_model import cache_root

    return settings.work_dir() or cache_root() / "tune"


def default_db(work: Path | None = None) -> Path:
    """The results file: $RIDGEFILL_DB or <work>/ridgefill.duckdb."""
    return settings.db_file() or (work or default_work()) / "ridgefill.duckdb"


def query(path: str | Path, sql: str) -> tuple[list[str], list[tuple]]:
    """Run read-only SQL against a results file: (column names, rows)."""
    con = connect(path, read_only=True)
    try:
        cur = con.execute(sql)
        return [d[0] for d in cur.description or []], cur.fetchall()
    finally:
        con.close()


def markdown(cols: Sequence[str], rows: Sequence[Sequence]) -> str:
    """A markdown table; floats to 4 significant digits."""

    def cell(v: Any) -> str:
        if isinstance(v, float):
            return f"{v:.4g}"
        return "" if v is None else str(v).replace("|", "\\|")

    head = "| " + " | ".join(cols) + " |\n|" + "---|" * len(cols)
    return "\n".join([head, *("| " + " | ".join(cell(v) for v in r) + " |" for r in rows)])
