"""One trial passes its verified maps along: each file of the folder it writes is hashed once (as it is
written), never again by the trial's later steps, and the value passed along is what `load_maps` reads."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import optuna
import torch

from ridgefill import maps as maps_mod
from ridgefill import objectives, steps
from ridgefill.runtime import FillPlan
from ridgefill.search import Params
from ridgefill.study import load_study
from tasks import trial as trial_tasks

STUDY = Path(__file__).resolve().parents[1] / "studies" / "smollm2-135m.yaml"
SMALL = {
    "search": {"splits": [2, 3], "tails": [16]},
    "objectives": {
        "ruler": {"tasks": ["niah_single_1"], "lengths": [512], "samples": 1},
        "nll": {"documents": 0},
        "ttft": {"lengths": [256], "repeats": 1, "warmup": 0},
    },
}


def test_one_trial_hashes_each_written_file_once(tokenizer, tiny_models, tmp_path, monkeypatch):
    model = tiny_models["llama"]
    text = tmp_path / "c.txt"
    text.write_text(" ".join(f"word{i % 97} and more text" for i in range(3000)))
    cap = steps.run_capture(model, tokenizer, str(text), [2, 3], window=64, max_windows=4, heldout=1,
                            root=tmp_path, progress=False)  # fmt: skip
    cfg = load_study(STUDY, SMALL)
    exact = objectives.run_ruler_plan(model, tokenizer, FillPlan(), cfg.objectives.ruler)

    monkeypatch.setattr(trial_tasks, "shared_model", lambda *a: (model, tokenizer))
    for name in ("fit", "evaluate", "measure_ttft"):  # the nested tasks' plain functions: no Prefect needed
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
    params = Params(split=2, lam=1e-2, tail=16, share=0.0, sink=4)
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
    from ridgefill.search import suggest
    from ridgefill.study import StudyError

    model = tiny_models["llama"]
    text = tmp_path / "c.txt"
    text.write_text(" ".join(f"word{i % 97} and more text" for i in range(3000)))
    cap = steps.run_capture(model, tokenizer, str(text), [2], window=64, max_windows=4, heldout=1,
                            root=tmp_path, progress=False)  # fmt: skip
    cfg = load_study(
        STUDY, SMALL | {"search": {"splits": [2], "tails": [16], "share": [0.1, 0.3], "select": "question"}}
    )
    params = suggest(optuna.create_study().ask(), cfg.search)
    assert params.select == "question" and 0.1 <= params.share <= 0.3
    ms = steps.fit_trial(model, tokenizer, str(cap.path), params, tmp_path / "q")
    assert ms.manifest["defaults"]["select"] == "question"
    plan = objectives.plan_for(params, ms, model, tokenizer)
    assert plan.select == "question" and plan.share == params.share
    assert objectives.vllm_job(model, "float32", plan)["options"]["select"] == "question"
    try:
        load_study(STUDY, {"search": {"select": "attention"}})
    except StudyError as e:
        assert "select" in str(e)
    else:
        raise AssertionError("an unknown selector was accepted")
