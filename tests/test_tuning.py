"""The search without Prefect: DuckDB records and views, Pareto selection, reports, crash + resume, caches."""

from __future__ import annotations

import re
import subprocess
import sys
import textwrap
import threading
from dataclasses import replace
from pathlib import Path

import pytest
from optuna.trial import TrialState

from ridgefill import objectives, report, search
from ridgefill.results import Recorder, StudyRun, TrialRecord, connect, insert_rows, query
from ridgefill.study import load_study

STUDY = Path(__file__).resolve().parents[1] / "studies" / "smollm2-135m.yaml"
DROP = load_study(STUDY).constraints.max_ruler_drop


def fake_outcome(p: search.Params) -> search.Outcome:
    """A cheap deterministic stand-in for fit + RULER + TTFT: a larger lambda costs RULER points."""
    delta = -40.0 * p.lam - (20 - p.split)
    rows = [("ruler", "trial", "niah_single_1", 1024, "all", 100 + delta, 3)]
    return search.Outcome(delta, 1.0 + (30 - p.split) / 10 + p.lam, None, f"maps/{p.split}-{p.lam:.4g}", rows)


def test_recorder_upserts_and_views(tmp_path):
    db = tmp_path / "r.duckdb"
    recs = [
        TrialRecord("s", 0, "COMPLETE", {"split": 18, "lam": 1e-3}, -1.0, 1.2, feasible=True,
                    metrics=[("ruler", "trial", "t", 512, "all", 99.0, 2)]),
        TrialRecord("s", 1, "COMPLETE", {"split": 15, "lam": 1e-2}, -3.0, 1.5, feasible=True),
        TrialRecord("s", 2, "COMPLETE", {"split": 16, "lam": 1e-2}, -4.0, 1.4, feasible=True),  # dominated by 1
        TrialRecord("s", 3, "COMPLETE", {"split": 10, "lam": 1e-1}, -20.0, 2.0, feasible=False),
    ]  # fmt: skip
    with Recorder(db) as rec:
        rec.trials(recs)
        rec.trials(recs[:1])  # a replay after a crash must not duplicate
        rec.maps([("s", 1, "m/x", "maps/1", "abc", 15, 1e-2, 64, 0.0, -3.0, 1.5),
                  ("s", 0, "m/x", "maps/0", "def", 18, 1e-3, 64, 0.0, -1.0, 1.2)], "s", 1)  # fmt: skip
        rec.maps([], "s", 1)
    assert query(db, "SELECT count(*) FROM trials")[1] == [(4,)]
    assert query(db, "SELECT count(*) FROM metrics")[1] == [(1,)]
    assert query(db, "SELECT trial FROM pareto ORDER BY trial")[1] == [(0,), (1,)]
    assert query(db, "SELECT model, trial, path FROM best_map")[1] == [("m/x", 1, "maps/1")]
    with Recorder(db) as rec:  # a newer run of the model (new weights) chooses a slower map: it is what to serve
        rec.study(StudyRun("s-new", "m/x", "rev2", "fp2", "transformers", 2.0, {}, "s"))
        rec.maps([("s-new", 0, "m/x", "maps/new", "ghi", 18, 1e-3, 64, 0.0, -1.0, 1.1)], "s-new", 0)
    assert query(db, "SELECT study, path FROM best_map")[1] == [("s-new", "maps/new")]
    with Recorder(db) as rec:  # nothing feasible in a rerun: no chosen map is left behind
        rec.maps([], "s-new", None)
    assert query(db, "SELECT study FROM maps WHERE chosen")[1] == [("s",)]
    with pytest.raises(Exception, match="read-only"):
        query(db, "DELETE FROM trials")


def _study(tmp_path, trials=4) -> tuple:
    cfg = load_study(STUDY, {"budget": {"trials": trials}, "search": {"lam": [1e-3, 1e-1]}})
    return cfg, search.open_study(cfg, search.storage(None, tmp_path, cfg.name))


def test_front_choose_and_reports(tmp_path):
    cfg, study = _study(tmp_path, trials=6)
    assert search.enqueue_first(study, cfg) == 3 and search.enqueue_first(study, cfg) == 0
    ran = search.optimize(study, cfg, lambda batch: [fake_outcome(p) for _, p in batch])
    assert ran == 6 and search.completed(study) == 6
    first = [t.params for t in study.trials[:3]]
    # enqueued: the split range bracketed, the safest first (largest, smallest, the middle)
    assert [p["split"] for p in first] == [22, 15, 18] and all(p["tail"] == 256 for p in first)
    trials = study.trials
    fr, best = (
        report.front(trials, cfg.constraints.max_ruler_drop),
        report.choose(trials, cfg.constraints.max_ruler_drop),
    )
    assert all(search.feasible(t, DROP) for t in fr) and best in fr
    assert all(t.values[1] <= best.values[1] for t in trials if search.feasible(t, DROP))
    assert not any(search.feasible(t, DROP) for t in trials if t.values[0] < -cfg.constraints.max_ruler_drop)
    md = report.table(trials, best, cfg.constraints.max_ruler_drop)
    assert md.count("\n| ") == 6 + 1 and "**" in md
    png = report.pareto_png(trials, best, cfg.constraints.max_ruler_drop, tmp_path / "p.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def _trial(number: int, delta: float | None, speedup: float | None, state=TrialState.COMPLETE):
    """A finished trial as Optuna stores it: values (RULER delta, speed-up), parameters in user_attrs."""
    from optuna.trial import create_trial

    values = None if state != TrialState.COMPLETE else [delta, speedup]
    t = create_trial(
        state=state,
        values=values,
        user_attrs={"params": {"split": 10 + number, "lam": 1e-2, "tail": 64, "share": 0.0, "sink": 4}},
    )
    t.number = number
    return t


def test_choice_keeps_to_the_constraint_when_an_infeasible_trial_is_fastest():
    """The fastest trials break the RULER-drop limit: the chosen map is the fastest feasible one, and the
    front holds feasible trials only. (Mutation check: choosing the best unconstrained trial fails here.)"""
    trials = [
        _trial(0, -1.0, 1.20),
        _trial(1, -25.0, 3.00),  # fastest of all, far outside the limit
        _trial(2, -5.0, 1.80),  # fastest feasible
        _trial(3, -10.5, 2.50),  # just outside
        _trial(4, None, None, TrialState.FAIL),
        _trial(5, -3.0, 1.50),
    ]
    drop = 10.0
    assert [search.feasible(t, drop) for t in trials] == [True, False, True, False, False, True]
    best = report.choose(trials, drop)
    assert best.number == 2
    assert [t.number for t in report.front(trials, drop)] == [0, 2, 5]
    assert report.choose(trials, 30.0).number == 1  # a looser limit admits the fastest one
    assert report.choose(trials, 0.5) is None  # nothing inside the limit: no map is chosen
    md = report.table(trials, best, drop)
    chosen_row = next(line for line in md.splitlines() if line.startswith("| 2 |"))
    assert chosen_row.endswith("| yes | ** |")
    assert next(line for line in md.splitlines() if line.startswith("| 1 |")).endswith("| no |  |")
    rec = search.record_of("s", trials[1], drop)
    assert rec.feasible is False and search.record_of("s", trials[2], drop).feasible is True


def test_choice_tie_break_and_the_limit_itself():
    """Ties on speed-up go to the smaller RULER drop, then to the earlier trial; a drop equal to the limit
    is inside it."""
    drop = 10.0
    trials = [_trial(0, -4.0, 2.0), _trial(1, -2.0, 2.0), _trial(2, -6.0, 2.0), _trial(3, -9.0, 1.0)]
    assert report.choose(trials, drop).number == 1  # equal speed-up: the smaller drop
    same = [_trial(4, -2.0, 2.0), _trial(1, -2.0, 2.0), _trial(7, -2.0, 2.0)]
    assert report.choose(same, drop).number == 1  # equal on both: the earliest trial, whatever the order
    assert [t.number for t in report.front(same, drop)] == [1, 4, 7]  # equal trials do not dominate each other
    edge = [_trial(0, -10.0, 1.5), _trial(1, -10.0 - 1e-9, 1.6)]
    assert report.choose(edge, drop).number == 0 and [t.number for t in report.front(edge, drop)] == [0]


def test_one_progress_line_per_trial(tmp_path):
    """What the tune flow logs for each finished trial: n of budget, the knobs, both objectives, dNLL,
    feasibility and seconds; a failed trial says so with its error."""
    cfg, study = _study(tmp_path, trials=3)
    lines = []

    def evaluate(batch):
        return [RuntimeError("out of memory") if n == 1 else outcome(p, n) for n, p in batch]

    def outcome(p, n):  # trial 2 was promoted to 24 pairs (multi-fidelity): its line says so
        ci = {"lo": -40.0 * p.lam - (20 - p.split) - 3, "hi": 0.0, "n": 24, "promoted": True} if n == 2 else None
        return replace(fake_outcome(p), ruler_ci=ci)

    def on_trial(t):
        lines.append(report.progress_line(t, search.completed(study), cfg.budget.trials, DROP))

    search.optimize(study, cfg, evaluate, on_trial=on_trial)
    assert len(lines) == 4  # three complete and one failed
    line = re.compile(
        r"trial (\d)/3 \(#(\d)\): split (\d+), lambda (\S+), tail (\d+), share ([\d.]+), window 8, reach 16 \| "
        r"RULER ([+-][\d.]+)"
        r"(?: \[[-+\d., ]+\] n=\d+(?: promoted)?)? \| "
        r"speed-up ([\d.]+)x \| dNLL - \| feasible (yes|no) \| [\d.]+ s$"
    )
    done = [line.fullmatch(x) for x in lines if "FAILED" not in x]
    assert all(done) and [(m[1], m[2]) for m in done] == [("1", "0"), ("2", "2"), ("3", "3")]
    assert "] n=24 promoted |" in lines[2] and "] n=" not in lines[0]
    for m in done:
        t = study.trials[int(m[2])]
        assert (int(m[3]), int(m[5])) == (t.params["split"], t.params["tail"])
        assert float(m[4]) == pytest.approx(t.params["lam"], rel=1e-2)
        assert float(m[7]) == pytest.approx(t.values[0], abs=0.006)
        assert float(m[8]) == pytest.approx(t.values[1], abs=1e-3) and m[9] == ("yes" if t.values[0] >= -DROP else "no")
    assert re.fullmatch(r"trial #1 FAILED \(1/3 complete\): split \d+, .* \| RuntimeError: out of memory", lines[1])


def test_settle_waits_for_trials_other_workers_still_run(tmp_path):
    cfg, study = _study(tmp_path, trials=2)
    running = study.ask()  # another worker's trial
    assert search.settle(study, timeout=0.3, poll=0.1) == 1  # bounded: it gives up and says how many run
    threading.Timer(0.5, lambda: study.tell(running, [-1.0, 1.5])).start()
    assert search.settle(study, timeout=30, poll=0.1) == 0


def test_failed_trial_is_recorded_and_the_study_goes_on(tmp_path):
    cfg, study = _study(tmp_path, trials=3)

    def evaluate(batch):
        return [RuntimeError("boom") if n == 1 else fake_outcome(p) for n, p in batch]

    with Recorder(tmp_path / "r.duckdb") as rec:
        search.optimize(
            study,
            cfg,
            evaluate,
            on_trial=lambda t: rec.trials([search.record_of(cfg.name, t, DROP)]),
        )
    states = [t.state for t in study.trials]
    assert states.count(TrialState.COMPLETE) == 3 and states[1] == TrialState.FAIL
    assert "boom" in study.trials[1].user_attrs["error"]
    assert query(tmp_path / "r.duckdb", "SELECT trial, state FROM trials WHERE state = 'FAIL'")[1] == [(1, "FAIL")]


def test_selection_uses_todays_limit_and_fixed_params_are_recorded(tmp_path):
    """A limit tightened after trials ran applies to them too; parameters with a fixed range (share 0,
    not suggested to Optuna) still reach DuckDB."""
    cfg = load_study(STUDY, {"budget": {"trials": 6}, "search": {"lam": [1e-3, 1e-1], "share": [0.0, 0.0]}})
    study = search.open_study(cfg, search.storage(None, tmp_path, cfg.name))
    search.optimize(study, cfg, lambda batch: [fake_outcome(p) for _, p in batch])
    trials = study.trials
    assert all("share" not in t.params for t in trials)  # never suggested
    deltas = sorted({t.values[0] for t in trials}, reverse=True)
    tight = -deltas[1] - 1e-9 if len(deltas) > 1 else 0.0  # excludes all but the best RULER delta
    best = report.choose(trials, tight)
    assert best is not None and best.values[0] >= -tight
    assert all(t.values[0] >= -tight for t in report.front(trials, tight))
    assert len(report.front(trials, tight)) <= len(report.front(trials, DROP))
    with Recorder(tmp_path / "r.duckdb") as rec:
        search.sync(rec, study, DROP)
    rows = query(tmp_path / "r.duckdb", "SELECT share, sink, lam FROM trials")[1]
    assert len(rows) == 6 and all(share == 0.0 and sink is not None and lam is not None for share, sink, lam in rows)


def test_a_retry_that_dies_again_is_not_retried(tmp_path):
    import socket

    cfg, study = _study(tmp_path, trials=2)
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    owner = f"{socket.gethostname()}:{int(dead.stdout)}"
    first = study.ask()
    first.set_user_attr("owner", owner)
    assert search.recover(study) == [first.number]
    retry = study.ask()  # the re-enqueued parameters
    assert retry.user_attrs["retry_of"] == first.number
    retry.set_user_attr("owner", owner)
    assert search.recover(study) == [retry.number]
    assert not study.get_trials(states=(TrialState.WAITING,))  # no third attempt
    assert "died again" in study.trials[retry.number].user_attrs["error"]


KILLED = textwrap.dedent(
    """
    import os, signal, sys
    sys.path.insert(0, {tests!r})
    from test_tuning import fake_outcome
    from ridgefill import objectives, report, search
    from ridgefill.results import Recorder
    from ridgefill.study import load_study
    cfg = load_study({study!r}, {{"budget": {{"trials": 4}}, "search": {{"lam": [1e-3, 1e-1]}}}})
    DROP = cfg.constraints.max_ruler_drop
    s = search.open_study(cfg, search.storage(None, {root!r}, cfg.name))
    search.enqueue_first(s, cfg)
    def evaluate(batch):
        if batch[0][0] == 2:
            os.kill(os.getpid(), signal.SIGKILL)  # dies mid-trial, DuckDB and the journal open
        return [fake_outcome(p) for _, p in batch]
    rec = Recorder({db!r})
    search.optimize(s, cfg, evaluate, on_trial=lambda t: rec.trials([search.record_of(cfg.name, t, DROP)]))
    """
)


def test_killed_trial_resumes_without_duplicates(tmp_path):
    db = tmp_path / "r.duckdb"
    code = KILLED.format(tests=str(Path(__file__).parent), study=str(STUDY), root=str(tmp_path), db=str(db))
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == -9, proc.stderr[-3000:]

    cfg, study = _study(tmp_path, trials=4)
    running = study.get_trials(states=(TrialState.RUNNING,))
    assert [t.number for t in running] == [2]
    killed_params = running[0].params
    with Recorder(db) as rec:  # the killed writer's file opens whole
        assert search.sync(rec, study, DROP) == 2
        search.optimize(study, cfg, lambda b: [fake_outcome(p) for _, p in b],
                        on_trial=lambda t: rec.trials([search.record_of(cfg.name, t, DROP)]))  # fmt: skip
        search.sync(rec, study, DROP)  # a second sync replays everything: still no duplicates
    trials = study.trials
    assert [t.state for t in trials].count(TrialState.COMPLETE) == 4
    assert trials[2].state == TrialState.FAIL and trials[3].params == killed_params  # retried first
    assert trials[3].user_attrs["retry_of"] == 2
    _, rows = query(db, "SELECT trial, state FROM trials ORDER BY trial")
    assert rows == [(0, "COMPLETE"), (1, "COMPLETE"), (2, "FAIL"), (3, "COMPLETE"), (4, "COMPLETE")]
    _, n = query(db, "SELECT count(*), count(DISTINCT (trial, task, length, region)) FROM metrics")
    assert n == [(4, 4)]


def test_engine_names_are_checked_early(monkeypatch):
    with pytest.raises(RuntimeError, match="engine 'tensorrt' is unknown"):
        objectives.check_engine("tensorrt")
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "vllm" else real(name, *a))
    with pytest.raises(RuntimeError, match="engine 'vllm' needs vLLM installed"):
        objectives.check_engine("vllm")


def test_ruler_delta_and_ttft_pieces():
    exact = {"a": {"512": {"all": 100.0}}, "b": {"512": {"all": 50.0}}}
    trial = {"a": {"512": {"all": 90.0, "bulk": 80.0, "tail": 100.0, "sink": None, "n": 3, "n_bulk": 2,
                           "n_tail": 1, "n_sink": 0}}, "b": {"512": {"all": 50.0, "n": 1}}}  # fmt: skip
    assert objectives.ruler_delta(trial, exact) == -5.0
    assert {r[4] for r in objectives.ruler_rows("trial", trial)} == {"all", "bulk", "tail"}
    assert objectives.ttft_speedup({"1": {"speedup": 2.0}, "2": {"speedup": 0.5}}) == pytest.approx(1.0)


def test_capture_is_reused_not_recaptured(tokenizer, tiny_models, tmp_path, monkeypatch):
    from ridgefill import steps

    model = tiny_models["llama"]
    text = tmp_path / "c.txt"
    text.write_text(" ".join(f"word{i % 97} and more text" for i in range(3000)))
    text = steps.CalibrationText(str(text), window=64, max_windows=4, heldout=1)
    kw = dict(root=tmp_path, how=steps.CaptureOptions(progress=False))
    first = steps.run_capture(model, tokenizer, text, [2, 4], **kw)

    def boom(*a, **k):
        raise AssertionError("recaptured")

    monkeypatch.setattr(steps, "capture", boom)
    again = steps.run_capture(model, tokenizer, text, [4, 2], **kw)
    assert again.path == first.path and again.meta["windows_done"] == 4
    assert steps.run_capture(model, tokenizer, text, [2], **kw).path == first.path  # a subset of splits


def test_study_storage_choices(tmp_path):
    from optuna.storages import RDBStorage
    from optuna.storages.journal import JournalStorage

    assert isinstance(search.storage(None, tmp_path, "x"), JournalStorage)
    assert (tmp_path / "optuna" / "x.journal").parent.is_dir()
    assert isinstance(search.storage(f"sqlite:///{tmp_path}/o.db", tmp_path, "x"), RDBStorage)


def test_two_processes_record_into_one_file_in_turns(tmp_path):
    """A Recorder holds the file only per transaction: a second study process and a reader take turns."""
    db = tmp_path / "r.duckdb"
    writer = textwrap.dedent(
        f"""
        from ridgefill.results import Recorder, TrialRecord
        rec = Recorder({str(db)!r})
        for i in range(30):
            rec.trials([TrialRecord("other", i, "COMPLETE", {{"split": 2}}, -1.0, 1.1, feasible=True)])
        """
    )
    proc = subprocess.Popen([sys.executable, "-c", writer])
    with Recorder(db) as rec:
        for i in range(30):
            rec.trials([TrialRecord("mine", i, "COMPLETE", {"split": 3}, -1.0, 1.2, feasible=True)])
            query(db, "SELECT count(*) FROM trials")  # a reader in between
    assert proc.wait(timeout=120) == 0
    counts = dict(query(db, "SELECT study, count(*) FROM trials GROUP BY study")[1])
    assert counts == {"mine": 30, "other": 30}


def test_constraint_is_the_paired_ci_lower_bound(tmp_path):
    """A trial whose mean loss is small but whose CI reaches past the limit is infeasible; the CI (lo, hi, n)
    is kept in the trial's user attrs and in DuckDB."""
    cfg, study = _study(tmp_path, trials=3)
    cis = {0: (-2.0, -DROP - 5, 1.0), 1: (-5.0, -DROP + 2, 0.0), 2: (0.0, 0.0, 0.0)}  # mean, lo, hi

    def evaluate(batch):
        outs = []
        for n, _ in batch:
            mean, lo, hi = cis[n]
            outs.append(search.Outcome(mean, 1.0 + n / 10, None, f"maps/{n}", [], {"lo": lo, "hi": hi, "n": 24}))
        return outs

    db = tmp_path / "r.duckdb"
    with Recorder(db) as rec:
        search.optimize(study, cfg, evaluate, on_trial=lambda t: rec.trials([search.record_of(cfg.name, t, DROP)]))
    trials = study.trials
    assert [search.feasible(t, DROP) for t in trials] == [False, True, True]
    assert trials[0].constraints == {"ruler_drop": pytest.approx(5.0)}  # > 0: violated
    assert trials[1].user_attrs["ruler_ci"] == {"lo": -DROP + 2, "hi": 0.0, "n": 24}
    assert report.choose(trials, DROP).number == 2 and 0 not in [t.number for t in report.front(trials, DROP)]
    rows = query(db, "SELECT trial, ruler_delta, ruler_ci_lo, ruler_ci_hi, ruler_n, feasible FROM trials ORDER BY 1")
    lo0, lo1 = -DROP - 5, -DROP + 2
    assert rows[1] == [(0, -2.0, lo0, 1.0, 24, False), (1, -5.0, lo1, 0.0, 24, True), (2, 0.0, 0.0, 0.0, 24, True)]
    md = report.table(trials, None, DROP)
    assert "95% CI lower bound" in md and f"[{lo0:+.1f}, +1.0] (24)" in md


def test_paired_delta_pairs_sample_by_sample():
    def rows(plan_scores):
        return [
            {"plan": "x", "task": t, "length": 1024, "index": i, "region": "bulk", "score": s, "prediction": "..."}
            for t, ss in plan_scores.items()
            for i, s in enumerate(ss)
        ]

    exact = rows({"a": [100.0, 100.0, 0.0, 100.0], "b": [100.0, 0.0]})
    trial = rows({"a": [100.0, 0.0, 100.0], "b": [0.0, 0.0, 100.0]})  # a: 3 of exact's 4; b: one unpaired extra
    d = objectives.paired_delta(trial, exact)
    assert d["n"] == 5 and d["cells"] == 2
    assert d["mean"] == pytest.approx(((0 - 100 + 100) / 3 + (-100 + 0) / 2) / 2)
    assert d["lo"] <= d["mean"] <= d["hi"]
    assert objectives.paired_delta(exact, exact) == {"mean": 0.0, "lo": 0.0, "hi": 0.0, "n": 6, "cells": 2}
    with pytest.raises(ValueError, match="no RULER sample of the trial has an exact partner"):
        objectives.paired_delta(rows({"c": [1.0]}), exact)
    assert "prediction" not in objectives.sample_rows("trial", trial)[0]  # what Optuna and DuckDB keep stays small


def _old_file(path: Path, *sql: str) -> Path:
    """A results file as an older RidgeFill left it: these statements only."""
    import duckdb

    with duckdb.connect(str(path)) as con:
        for q in sql:
            con.execute(q)
    return path


def test_an_older_results_file_gains_the_new_columns(tmp_path):
    """A results file written before the CI columns and the certifications table opens and takes new rows."""
    db = _old_file(
        tmp_path / "old.duckdb",
        "CREATE TABLE trials (study TEXT, trial INTEGER, state TEXT, split INTEGER, lam DOUBLE, tail INTEGER, "
        "share DOUBLE, sink INTEGER, ruler_delta DOUBLE, speedup DOUBLE, dnll DOUBLE, feasible BOOLEAN, "
        "map_path TEXT, params JSON, seconds DOUBLE, finished TIMESTAMP DEFAULT current_timestamp, "
        "PRIMARY KEY (study, trial))",
        "INSERT INTO trials (study, trial, state, ruler_delta) VALUES ('s', 0, 'COMPLETE', -1.0)",
    )
    with Recorder(db) as rec:
        rec.trials([TrialRecord("s", 1, "COMPLETE", {"split": 3}, -2.0, 1.1, ruler_ci={"lo": -9.0, "hi": 1.0, "n": 8})])
    rows = query(db, "SELECT trial, ruler_delta, ruler_ci_lo, ruler_n FROM trials ORDER BY trial")[1]
    assert rows == [(0, -1.0, None, None), (1, -2.0, -9.0, 8)]
    assert query(db, "SELECT count(*) FROM certifications")[1] == [(0,)]


def test_an_older_results_file_drops_maps_published(tmp_path):
    """Files from when publications were also written into `maps.published`: the column goes, and `best_map`
    reads the publication from `publications` alone."""
    db = _old_file(
        tmp_path / "old.duckdb",
        "CREATE TABLE maps (study TEXT, trial INTEGER, model TEXT, path TEXT, manifest_sha256 TEXT, "
        "split INTEGER, lam DOUBLE, tail INTEGER, share DOUBLE, ruler_delta DOUBLE, speedup DOUBLE, "
        "chosen BOOLEAN DEFAULT false, published TEXT, created TIMESTAMP DEFAULT current_timestamp, "
        "PRIMARY KEY (study, trial))",
    )
    with Recorder(db) as rec:
        rec.maps([("s", 0, "m", "/maps/0", "sha", 2, 1e-2, 32, 0.0, -1.0, 1.4)], "s", 0)
    assert "published" not in [c for c, *_ in query(db, "DESCRIBE maps")[1]]
    assert query(db, "SELECT trial, published FROM best_map")[1] == [(0, None)]
    with connect(db) as con:
        insert_rows(con, "publications", ("study", "repo_id", "revision", "commit_sha", "backend", "map_path"),
                    [("s", "o/r", "s", "c0ffee", "local", "/maps/0")])  # fmt: skip
    assert query(db, "SELECT published FROM best_map")[1] == [("local:o/r@s#c0ffee",)]
