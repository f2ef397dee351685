"""Study files: the shipped ones validate; bad ones are refused with the file and the field named."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from ridgefill.study import StudyError, load_study, merge

STUDIES = Path(__file__).resolve().parents[1] / "studies"


@pytest.mark.parametrize("name", ["smollm2-135m", "qwen3-8b", "llama-3.1-8b"])
def test_shipped_studies_validate(name):
    s = load_study(STUDIES / f"{name}.yaml")
    assert s.name == name
    assert s.budget.trials > 0 and s.search.splits and s.objectives.ruler.tasks


def test_smollm2_is_the_cpu_default():
    s = load_study(STUDIES / "smollm2-135m.yaml")
    assert (s.engine, s.hardware.device, s.model.local) == ("transformers", "cpu", "default")
    assert s.calibration.max_windows == s.calibration.tokens // s.calibration.window


@pytest.mark.parametrize(
    ("change", "field", "words"),
    [
        ({"search": {"lam": [1e-1, 1e-4]}}, "search.lam", "low <= high"),
        ({"search": {"share": [0.0, 1.5]}}, "search.share.1", "less than or equal to 1"),
        ({"budget": {"trials": 0}}, "budget.trials", "greater than 0"),
        ({"engine": "tensorrt"}, "engine", "'transformers' or 'vllm'"),
        ({"objectives": {"ruler": {"tasks": ["niah_single_9"]}}}, "objectives.ruler.tasks", "unknown RULER task"),
        ({"constraints": {"max_ruler_dorp": 3}}, "constraints.max_ruler_dorp", "Extra inputs"),
        ({"model": {"repo": ""}}, "model.repo", "at least 1 character"),
        ({"calibration": {"tokens": "lots"}}, "calibration.tokens", "valid integer"),
        ({"search": {"tails": [2048]}}, "search.tails", "no bulk rows"),
        ({"name": "bad name/with slash"}, "name", "match pattern"),
    ],
)
def test_bad_study_names_the_field(tmp_path, change, field, words):
    data = merge(yaml.safe_load((STUDIES / "smollm2-135m.yaml").read_text()), change)
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(data))
    with pytest.raises(StudyError) as e:
        load_study(path)
    msg = str(e.value)
    assert f"{path}: {field}" in msg and words in msg, msg


def test_missing_section_and_non_mapping(tmp_path):
    data = yaml.safe_load((STUDIES / "smollm2-135m.yaml").read_text())
    del data["constraints"]
    (tmp_path / "a.yaml").write_text(yaml.safe_dump(data))
    with pytest.raises(StudyError, match=r"a\.yaml: constraints: Field required"):
        load_study(tmp_path / "a.yaml")
    (tmp_path / "b.yaml").write_text("- just\n- a list\n")
    with pytest.raises(StudyError, match=r"b\.yaml: \(top level\)"):
        load_study(tmp_path / "b.yaml")
    (tmp_path / "c.yaml").write_text("name: [unclosed\n")
    with pytest.raises(StudyError, match="not valid YAML"):
        load_study(tmp_path / "c.yaml")


def test_overrides_deep_merge():
    s = load_study(STUDIES / "smollm2-135m.yaml", {"budget": {"trials": 2}, "objectives": {"ttft": {"repeats": 1}}})
    assert (s.budget.trials, s.objectives.ttft.repeats, s.budget.seed) == (2, 1, 0)
    assert s.objectives.ttft.lengths == [2048]


def test_smollm2_objective_covers_the_task_families_and_certifies():
    """Single needle, multikey, multivalue/multiquery and an aggregation or tracing task, in the objective and
    in the certification, which runs more samples than a trial does."""
    s = load_study(STUDIES / "smollm2-135m.yaml")
    for tasks in (s.objectives.ruler.tasks, s.certify.tasks):
        assert any(t.startswith("niah_single") for t in tasks)
        assert any(t.startswith("niah_multikey") for t in tasks)
        assert {"niah_multivalue", "niah_multiquery"} & set(tasks)
        assert {"cwe", "fwe", "vt"} & set(tasks)
    pairs = lambda r: len(r.tasks) * len(r.lengths) * r.samples  # noqa: E731
    assert pairs(s.certify) > pairs(s.objectives.ruler) and s.certify.seed != s.objectives.ruler.seed
    assert s.certify_drop == s.constraints.max_ruler_drop if s.certify.max_drop is None else s.certify.max_drop


@pytest.mark.parametrize(
    ("change", "field", "words"),
    [
        ({"certify": {"tasks": ["niah_single_9"]}}, "certify.tasks", "unknown RULER task"),
        ({"certify": {"samples": 0}}, "certify.samples", "greater than 0"),
        ({"certify": {"max_drop": -1}}, "certify.max_drop", "greater than or equal to 0"),
        ({"certify": {"lengths": [200]}}, "search.tails", "no bulk rows"),  # the certify lengths count too
    ],
)
def test_bad_certify_section_names_the_field(tmp_path, change, field, words):
    data = merge(yaml.safe_load((STUDIES / "smollm2-135m.yaml").read_text()), change)
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(data))
    with pytest.raises(StudyError) as e:
        load_study(path)
    assert f"{path}: {field}" in str(e.value) and words in str(e.value), str(e.value)


def test_certify_section_is_optional_and_defaults_to_the_tuning_limit():
    s = load_study(STUDIES / "smollm2-135m.yaml", {"certify": None})
    assert s.certify is None and s.certify_drop == s.constraints.max_ruler_drop
    s = load_study(STUDIES / "smollm2-135m.yaml", {"certify": {"max_drop": None}})
    assert s.certify_drop == s.constraints.max_ruler_drop
    assert s.certify.ruler().model_dump().keys() == s.objectives.ruler.model_dump().keys()
