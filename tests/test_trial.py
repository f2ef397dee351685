"""One trial passes its verified maps along: each file of the folder it writes is hashed once (as it is
written), never again by the trial's later steps, and the value passed along is what `load_maps` reads."""

from __future__ import annotations

from collections import Counter
from dataclasses import replace
from pathlib import Path

import optuna
import pytest
import torch

from ridgefill import maps as maps_mod
from ridgefill import objectives, steps
from ridgefill.rows import ROWS
from ridgefill.runtime import FillPlan
from ridgefill.search import Params, first_trials, suggest
from ridgefill.study import load_study
from tasks import trial as trial_tasks

STUDY = Path(__file__).resolve().parents[1] / "studies" / "smollm2-135m.yaml"
SMALL = {
    "search": {"splits": [2, 3], "tails": [16]},
    "objectives": {
        "ruler": {"tasks": ["niah_single_1"], "lengths": [512], "samples": 1, "promote": None},
        "nll": {"documents": 0},
        "ttft": {"lengths": [256], "repeats": 1, "warmup": 0},
    },
}


def test_one_trial_hashes_each_written_file_once(tokenizer, tiny_models, tmp_path, monkeypatch):
    model = tiny_models["llama"]
    text = tmp_path / "c.txt"
    text.write_text(" ".join(f"word{i % 97} and more text" for i in range(3000)))
    cap = steps.run_capture(
        model,
        tokenizer,
        steps.CalibrationText(str(text), window=64, max_windows=4, heldout=1),
        [2, 3],
        tmp_path,
        steps.CaptureOptions(progress=False),
    )
    cfg = load_study(STUDY, SMALL)
    exact = objectives.run_ruler_plan(model, tokenizer, FillPlan(), cfg.objectives.ruler)

    monkeypatch.setattr(trial_tasks, "shared_model", lambda *a: (model, tokenizer))
    for name in ("fit", "measure_ruler", "evaluate", "measure_ttft"):  # the nested tasks' plain functions
        monkeypatch.setattr(trial_tasks, name, getattr(trial_tasks, name).fn)
    passes, real = Counter(), maps_mod.sha256_file

    def counting(path):
        p = Path(path)
        passes[(p.parent.name.removesuffix(".partial"), p.name)] += 1
        return real(path)

    monkeypatch.setattr(maps_mod, "sha256_file", counting)
    vocab_reads, get_vocab = [], tokenizer.get_vocab
    monkeypatch.setattr(tokenizer, "get_vocab", lambda: vocab_reads.append(1) or get_vocab())

    ctx = trial_tasks.TrialContext(str(tmp_path / "model"), str(cap.path), str(tmp_path / "maps"))
    params = Params(2, 1e-2, ROWS.given(tail=16, share=0.0, sink=4))
    out = trial_tasks.run_trial.fn(0, params, ctx, exact, cfg)

    folder = Path(out.map_path)
    written = sorted(p.name for p in folder.iterdir() if p.name != maps_mod.MANIFEST)
    assert written and passes == Counter({(folder.name, name): 1 for name in written})  # one pass per folder
    assert len(vocab_reads) <= 1  # the tokenizer is hashed once per model (none: already hashed here)
    assert out.ruler_delta is not None and out.speedup > 0

    monkeypatch.setattr(maps_mod, "sha256_file", real)
    passed = steps.fit_trial(model, tokenizer, str(cap.path), params, tmp_path / "again")
    loaded = maps_mod.load_maps(passed.path, model, tokenizer)  # what a later process would read
    assert passed.manifest == loaded.manifest and passed.split == 2
    assert all(torch.equal(passed.layer(i)[k], loaded.layer(i)[k]) for i in loaded.weights for k in (0, 1))
    assert torch.equal(passed.scores, loaded.scores)


def test_the_studys_selector_reaches_the_plan_and_the_map_defaults(tokenizer, tiny_models, tmp_path):
    """`search.select: question`: each trial's plan protects its share by the question's attention, and the
    folder it writes says so in its defaults (the vLLM plugin and `ridgefill generate` serve from those)."""
    from ridgefill.study import StudyError

    model = tiny_models["llama"]
    text = tmp_path / "c.txt"
    text.write_text(" ".join(f"word{i % 97} and more text" for i in range(3000)))
    cap = steps.run_capture(
        model,
        tokenizer,
        steps.CalibrationText(str(text), window=64, max_windows=4, heldout=1),
        [2],
        tmp_path,
        steps.CaptureOptions(progress=False),
    )
    cfg = load_study(
        STUDY,
        SMALL
        | {"search": {"splits": [2], "tails": [16], "share": [0.1, 0.3], "select": "question", "windows": [2, 8],
                      "reach": 6}},
    )  # fmt: skip
    params = suggest(optuna.create_study().ask(), cfg.search)
    assert params.rows.select == "question" and 0.1 <= params.rows.share <= 0.3 and params.rows.window in (2, 8)
    assert first_trials(cfg.search, 3)[0]["window"] == 8  # a searched width starts at its middle
    ms = steps.fit_trial(model, tokenizer, str(cap.path), params, tmp_path / "q")
    assert ms.manifest["defaults"]["select"] == "question" and ms.manifest["defaults"]["window"] == params.rows.window
    assert params.rows.reach == 6 and ms.manifest["defaults"]["reach"] == 6
    plan = objectives.plan_for(params, ms, model, tokenizer)
    assert (
        plan.rows.select == "question"
        and plan.rows.share == params.rows.share
        and plan.rows.window == params.rows.window
    )
    assert plan.rows.reach == 6
    opts = objectives.VllmJob.of(model, "float32", replace(plan, rows=plan.rows.given(window=8, query=16))).options
    assert opts["select"] == "question" and (opts["window"], opts["query"], opts["reach"]) == (8, 16, 6)
    assert (
        "window"
        not in objectives.VllmJob.of(model, "float32", replace(plan, rows=plan.rows.given(select="rarity"))).options
    )
    try:
        load_study(STUDY, {"search": {"select": "attention"}})
    except StudyError as e:
        assert "select" in str(e)
    else:
        raise AssertionError("an unknown selector was accepted")


def test_a_trial_near_the_front_is_promoted_to_more_samples(tokenizer, tiny_models, tmp_path, monkeypatch):
    """Multi-fidelity: with no feasible trial yet (front None) a trial within the limit scores `promote`
    samples a task, paired against exact on all of them; one far below the front keeps `samples`."""
    model = tiny_models["llama"]
    text = tmp_path / "c.txt"
    text.write_text(" ".join(f"word{i % 97} and more text" for i in range(3000)))
    cap = steps.run_capture(
        model,
        tokenizer,
        steps.CalibrationText(str(text), window=64, max_windows=4, heldout=1),
        [3],
        tmp_path,
        steps.CaptureOptions(progress=False),
    )
    small = SMALL | {
        "objectives": SMALL["objectives"]
        | {"ruler": {"tasks": ["niah_single_1", "niah_single_2"], "lengths": [512], "samples": 1, "promote": 3}}
    }
    cfg = load_study(STUDY, small | {"constraints": {"max_ruler_drop": 100.0}})  # every mean is within the limit
    exact = objectives.exact_baseline(model, tokenizer, cfg.objectives.ruler)
    assert sorted({r["index"] for r in exact["samples"]}) == [0, 1, 2]  # the exact side covers a promoted trial
    monkeypatch.setattr(trial_tasks, "shared_model", lambda *a: (model, tokenizer))
    calls = []
    for name in ("fit", "measure_ruler", "evaluate", "measure_ttft"):
        fn = getattr(trial_tasks, name).fn
        wrapped = (lambda f: lambda *a: calls.append(a[-2:]) or f(*a))(fn) if name == "measure_ruler" else fn
        monkeypatch.setattr(trial_tasks, name, wrapped)
    params = Params(3, 1e-2, ROWS.given(tail=16, share=0.0, sink=4))

    ctx = trial_tasks.TrialContext(str(tmp_path / "model"), str(cap.path), str(tmp_path / "maps"), front=None)
    out = trial_tasks.run_trial.fn(0, params, ctx, exact, cfg)
    assert calls == [(0, 1), (1, 3)]  # the first sample, then the two more: none scored twice
    assert out.ruler_ci["n"] == 2 * 3 and out.ruler_ci["promoted"] is True

    calls.clear()
    far = trial_tasks.TrialContext(ctx.path, ctx.capture, ctx.maps, front=out.speedup * 100)  # far faster front
    out = trial_tasks.run_trial.fn(1, params, far, exact, cfg)
    assert calls == [(0, 1)] and out.ruler_ci["n"] == 2 * 1 and out.ruler_ci["promoted"] is False

    # no front yet: promotion needs no speed-up, so the promoted samples come first; against an exact side that
    # scores 100 on sample 1 only, the trial (which answers nothing) is promoted on sample 0 (delta 0) and then
    # fails on all 3 (mean -33 within a limit of 50, CI lower bound -100): it is not timed
    calls.clear()
    timed = []
    ttft = trial_tasks.measure_ttft  # the plain function (patched above)
    monkeypatch.setattr(trial_tasks, "measure_ttft", lambda *a: timed.append(1) or ttft(*a))
    one = {"scores": exact["scores"], "samples": [r | {"score": 100.0 * (r["index"] == 1)} for r in exact["samples"]]}
    strict = load_study(STUDY, small | {"constraints": {"max_ruler_drop": 50.0}})
    out = trial_tasks.run_trial.fn(2, params, ctx, one, strict)
    assert calls == [(0, 1), (1, 3)] and out.ruler_ci["promoted"] is True and out.ruler_ci["lo"] < -50
    assert timed == [] and out.speedup_measured is False and out.ruler_delta > -50


def test_promotion_rule():
    """Promoted: within the limit on the paired mean, and no feasible trial yet or within 2% of the best
    speed-up; the gate is what the vLLM job is given too."""
    from ridgefill.decision import Gate
    from ridgefill.study import Ruler

    r = Ruler(tasks=["niah_single_1", "fwe"], lengths=[512], samples=2, promote=6)
    exact = [{"task": t, "length": 512, "index": i, "region": "exact", "score": 100.0} for t in r.tasks for i in (0, 1)]
    lost = {"samples": [row | {"score": 0.0 if (row["task"], row["index"]) == ("fwe", 0) else 100.0} for row in exact]}
    same = {"samples": exact}

    def gate(max_drop, front, promote=r.promote):
        return Gate.of(exact, max_drop, r.seed, r.samples, promote, front)

    # one sample of four lost: fwe -50, niah 0 -> mean -25
    assert gate(30.0, None).promotes(lost, 1.10)  # none feasible yet
    assert not gate(20.0, None).promotes(lost, 9.9)  # -25 < -20
    assert gate(10.0, 1.32).promotes(same, 1.30)  # within 2% of the front
    assert not gate(10.0, 1.32).promotes(same, 1.20)  # dominated
    assert gate(10.0, None, promote=None).bar is None and not gate(10.0, None, None).promotes(same, 2.0)
    assert Gate(**gate(30.0, 1.3).as_dict()) == gate(30.0, 1.3)  # what the vLLM job reads back
    try:
        Ruler(tasks=["niah_single_1"], lengths=[512], samples=4, promote=4)
    except ValueError as e:
        assert "promote" in str(e)
    else:
        raise AssertionError("promote <= samples was accepted")


def test_one_trial_decision_for_every_engine():
    """`decision.decide`, which both engines run: a trial that cannot pass is neither timed nor promoted; with a
    front, it is timed before promotion and promoted only when fast enough; without one, promoted first and
    then timed unless it fails on all its samples; a predicted speed-up is never timed."""
    from types import SimpleNamespace

    from ridgefill.decision import Gate, decide

    exact = [{"task": t, "length": 512, "index": i, "region": "x", "score": 100.0} for t in "ab" for i in range(8)]

    def run(scores, max_drop, front, speedup=1.3, predicted=None):
        calls = []

        def score(first, last):
            calls.append(("score", first, last))
            return {"samples": [r | {"score": scores(r["task"], i)} for r in exact for i in [r["index"]]
                                if first <= r["index"] < last]}  # fmt: skip

        def time():
            calls.append(("time",))
            return SimpleNamespace(speedup=speedup)

        def merge(x, y):
            return {"samples": x["samples"] + y["samples"]}

        d = decide(score, time, merge, Gate.of(exact, max_drop, 0, 2, 8, front), predicted)
        return d, calls

    def keeps(task, i):
        return 100.0

    def loses(task, i):
        return 0.0

    def loses_later(task, i):
        return 100.0 if i < 2 else 0.0

    d, calls = run(loses, 10.0, None)
    assert calls == [("score", 0, 2)] and d.timing is None and not d.promoted and not d.reachable
    d, calls = run(keeps, 10.0, 1.3)  # a front: speed first, then promotion
    assert calls == [("score", 0, 2), ("time",), ("score", 2, 8)] and d.promoted and len(d.ruler["samples"]) == 16
    d, calls = run(keeps, 10.0, 2.0)  # too slow for the front: timed, not promoted
    assert calls == [("score", 0, 2), ("time",)] and not d.promoted and d.reachable
    d, calls = run(loses_later, 10.0, None)  # no front: promoted first, then it fails on all: not timed
    assert calls == [("score", 0, 2), ("score", 2, 8)] and d.promoted and d.timing is None and not d.reachable
    d, calls = run(keeps, 10.0, None)  # promoted, passes: timed after
    assert calls == [("score", 0, 2), ("score", 2, 8), ("time",)] and d.timing.speedup == 1.3
    d, calls = run(keeps, 10.0, 1.3, predicted=1.29)  # predicted: never timed, promoted on the prediction
    assert calls == [("score", 0, 2), ("score", 2, 8)] and d.timing is None and d.reachable
    d, calls = run(keeps, 10.0, 1.3, predicted=1.0)
    assert calls == [("score", 0, 2)] and not d.promoted


def test_trials_of_one_split_share_one_heldout_pass(tokenizer, tiny_models, tmp_path):
    """Across a study's trials only lambda changes: the held-out windows of a capture and split run through
    the model once, and the metrics of each lambda equal those of a fit that runs its own pass."""
    model = tiny_models["qwen3"]
    text = tmp_path / "c.txt"
    text.write_text(" ".join(f"word{i % 89} and other text" for i in range(3000)))
    cap = steps.run_capture(
        model,
        tokenizer,
        steps.CalibrationText(str(text), window=64, max_windows=4, heldout=2),
        [2],
        tmp_path,
        steps.CaptureOptions(progress=False),
    )
    passes = []
    hook = model.model.register_forward_pre_hook(lambda *_: passes.append(1))
    try:
        fits = [
            steps.fit_trial(
                model,
                tokenizer,
                str(cap.path),
                Params(2, lam, ROWS.given(tail=16, share=0.0, sink=4)),
                tmp_path / f"l{lam}",
            )
            for lam in (1e-3, 1e-1)
        ]
    finally:
        hook.remove()
    assert len(passes) == 2  # one held-out pass (two windows) for both lambdas
    for ms, lam in zip(fits, (1e-3, 1e-1), strict=True):
        solver = steps.solver_for(str(cap.path), 2)
        fresh = steps.fit_report(model, tokenizer, cap, 2, lam, solver).provenance  # its own pass
        assert ms.manifest["fit"]["heldout"] == fresh["heldout"] and ms.manifest["fit"]["heldout_windows"] == 2
    assert fits[0].manifest["fit"]["heldout"] != fits[1].manifest["fit"]["heldout"]


def test_the_gate_that_skips_ttft_judges_the_constraint_itself():
    """`cannot_pass`: true only when the first samples' mean *and* the CI lower bound the constraint judges are
    below the limit (such a trial is neither promoted nor feasible, whatever its speed)."""
    from ridgefill.evals.paired import cannot_pass

    exact = [
        {"plan": "exact", "task": t, "length": 512, "index": i, "score": 100.0} for t in ("a", "b") for i in (0, 1)
    ]
    one_lost = [r | {"plan": "trial", "score": 0.0 if (r["task"], r["index"]) == ("b", 0) else 100.0} for r in exact]
    assert cannot_pass(one_lost + exact, "trial", 20.0)  # mean -25 < -20: its bound is lower still
    assert not cannot_pass(one_lost + exact, "trial", 25.0)  # the mean on the limit: it could be promoted
    assert not cannot_pass(one_lost + exact, "trial", 30.0)
    same = [r | {"plan": "trial"} for r in exact]
    assert not cannot_pass(same + exact, "trial", 0.0)  # no loss passes a zero limit
    assert not cannot_pass(exact, "trial", 0.0)  # nothing paired: nothing decided


def test_a_trial_that_cannot_pass_is_not_timed(tokenizer, tiny_models, tmp_path, monkeypatch):
    """Multi-fidelity for TTFT: against an exact side that scores 100 on every sample, the tiny model's trial
    loses 100 points; with a limit of 50 its TTFT is never measured (the speed-up Optuna gets is the FLOP bound,
    recorded as not measured: None in DuckDB, "not timed" in its progress line), nor its dNLL; with a limit of
    100 it is."""
    from ridgefill import report, search
    from ridgefill.flops import speedup_bound

    model = tiny_models["llama"]
    text = tmp_path / "c.txt"
    text.write_text(" ".join(f"word{i % 97} and more text" for i in range(3000)))
    cap = steps.run_capture(
        model,
        tokenizer,
        steps.CalibrationText(str(text), window=64, max_windows=4, heldout=1),
        [3],
        tmp_path,
        steps.CaptureOptions(progress=False),
    )
    monkeypatch.setattr(trial_tasks, "shared_model", lambda *a: (model, tokenizer))
    timed = []
    for name in ("fit", "measure_ruler", "evaluate", "measure_ttft"):
        fn = getattr(trial_tasks, name).fn
        wrapped = (lambda f: lambda *a: timed.append(1) or f(*a))(fn) if name == "measure_ttft" else fn
        monkeypatch.setattr(trial_tasks, name, wrapped)
    params = Params(3, 1e-2, ROWS.given(tail=16, share=0.0, sink=4))
    ctx = trial_tasks.TrialContext(str(tmp_path / "model"), str(cap.path), str(tmp_path / "maps"))

    nll = {"lengths": [128], "documents": 1, "scored": 32}
    small = SMALL | {"objectives": SMALL["objectives"] | {"nll": nll}}
    cfg = load_study(STUDY, small | {"constraints": {"max_ruler_drop": 50.0}})
    exact = objectives.exact_baseline(model, tokenizer, cfg.objectives.ruler)
    perfect = {"scores": exact["scores"], "samples": [r | {"score": 100.0} for r in exact["samples"]]}
    trial_rows = objectives.run_ruler_plan(model, tokenizer, FillPlan(), cfg.objectives.ruler)["samples"]
    assert all(r["score"] == 0.0 for r in trial_rows)  # the random tiny model answers nothing
    out = trial_tasks.run_trial.fn(0, params, ctx, perfect, cfg)
    assert timed == [] and out.speedup_measured is False and out.ruler_delta == -100.0 and out.dnll is None
    assert out.speedup == pytest.approx(speedup_bound(model.config, 256, 3, 4 + 16))
    assert ("ttft", "trial", "speedup_bound", 256, "all", out.speedup, 0) in out.metrics

    study = optuna.create_study(directions=["maximize", "maximize"])
    trial = study.ask()
    trial.set_user_attr("params", params.as_dict())
    search.finish(study, trial, out, 50.0, 0.0)
    frozen = study.trials[0]
    assert search.record_of("s", frozen, 50.0).speedup is None and not search.feasible(frozen, 50.0)
    assert "| speed-up not timed |" in report.progress_line(frozen, 1, 1, 50.0)
    assert "| -100.00 | [-100.0, -100.0] (1) | - |" in report.table([frozen], None, 50.0)

    cfg = load_study(STUDY, small | {"constraints": {"max_ruler_drop": 100.0}})  # -100 is on the limit: timed
    out = trial_tasks.run_trial.fn(1, params, ctx, perfect, cfg)
    assert timed == [1] and out.speedup_measured is True and out.dnll is not None
