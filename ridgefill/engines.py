"""The engines a study can run its RULER and TTFT on, as one table instead of branches on an engine's name.

`transformers` runs in the flow's process, one sample at a time, each step of a trial's decision a task of its
own; `vllm` is a serving engine: started once per job (in its own process: vLLM keeps global state), a cell's
samples in one batch, and a trial's whole decision (`ridgefill.decision.decide`) on that one engine."""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True)
class Engine:
    """What the rest of the code needs to know of an engine (its name, whether it is a serving engine, the package
    it needs)."""

    name: str
    serving: bool  # an engine per job in its own process: a start per job, batched cells, the decision in the job
    package: str  # the package it needs installed

    @property
    def installed(self) -> bool:
        return importlib.util.find_spec(self.package) is not None


ENGINES = {"transformers": Engine("transformers", False, "transformers"), "vllm": Engine("vllm", True, "vllm")}
SERVING = ENGINES["vllm"]  # the engine users serve on, where a chosen map is certified when installed


class Named(Protocol):
    engine: str  # a study's engine


def serving_engine(study: Named) -> str:
    """Where a chosen map is certified (RULER and TTFT): vLLM, the engine users serve on, when it is installed;
    else the study's own. What ships is judged as it is served, whatever engine the trials used."""
    return SERVING.name if SERVING.installed else study.engine


def engine(name: str) -> Engine:
    """The engine a study names; a one-line error for an unknown one."""
    if name not in ENGINES:
        raise RuntimeError(f"engine {name!r} is unknown; use `transformers` or `vllm`")
    return ENGINES[name]
