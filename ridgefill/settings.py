"""Every environment variable RidgeFill reads, in one place, each with its default and what it does.

Values are read when asked for (`get` and the named helpers below), so a test or a caller that sets a
variable sees it take effect; an empty value counts as unset. Library code never writes `os.environ`: the
entry points (`flows/tune.py` for Prefect's own settings, `ridgefill.evals.vllm_trial`) and the environment
dicts of subprocesses may set the variables of the tools they start (Prefect, vLLM), never these.

Variables that other libraries read themselves (RidgeFill only names them in messages): `HF_TOKEN`
(huggingface_hub: Hub access, never logged), `HF_HUB_OFFLINE` (huggingface_hub and datasets),
`VLLM_USE_V2_MODEL_RUNNER`, `VLLM_ENABLE_V1_MULTIPROCESSING` and `VLLM_CPU_KVCACHE_SPACE` (vLLM).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Variable:
    name: str
    default: str | None
    doc: str


VARIABLES = {
    v.name: v
    for v in (
        Variable("RIDGEFILL_CACHE", None, "root of converted models, captures, maps and the local registry "
                 "(default: the platform's user cache folder for `ridgefill`)"),
        Variable("RIDGEFILL_WORK", None, "where the tune flow keeps captures, maps, the Optuna journal and "
                 "reports (default: <cache>/tune)"),
        Variable("RIDGEFILL_DB", None, "the DuckDB results file (default: <work>/ridgefill.duckdb)"),
        Variable("RIDGEFILL_OPTUNA_STORAGE", None, "Optuna storage of the tune flow: a .journal path or an RDB "
                 "URL such as postgresql://... shared by several workers (default: a journal under <work>)"),
        Variable("RIDGEFILL_RETUNE_STATE", None, "the nightly retune's seen-commits file "
                 "(default: <cache>/retune.json)"),
        Variable("RIDGEFILL_REGISTRY", None, "the local registry folder (default: <cache>/registry)"),
        Variable("RIDGEFILL_REGISTRY_BACKEND", "auto", "registry backend: auto (the Hub when HF_ENDPOINT or "
                 "a Hub token is set, else local), local or hub"),
        Variable("RIDGEFILL_REPO", None, "the map repo to publish to (default: <owner>/<base model>-ridgefill)"),
        Variable("RIDGEFILL_MAPS", None, "vLLM plugin: a map folder to serve with the stock architecture "
                 "names (instead of hf_overrides ridgefill_maps)"),
        Variable("RIDGEFILL_LOG_EVERY", "256", "vLLM plugin: log the RidgeFill counters every this many "
                 "steps with bulk rows"),
        Variable("RIDGEFILL_MAX_KEPT", "4", "vLLM plugin: how many chunked prompts of the question selector may "
                 "keep their split stream and scored keys at once (about 0.45 GB each for a 32K Qwen3-8B prompt); "
                 "prompts past the cap run exact, counted"),
        Variable("HF_ENDPOINT", None, "the Hugging Face Hub endpoint (a mirror or a test server); also "
                 "read by huggingface_hub itself"),
    )
}  # fmt: skip


def get(name: str) -> str | None:
    """The variable's value now, else its default (`name` must be one of VARIABLES)."""
    return os.environ.get(name) or VARIABLES[name].default


def cache_dir() -> Path | None:
    return Path(p) if (p := get("RIDGEFILL_CACHE")) else None


def work_dir() -> Path | None:
    return Path(p) if (p := get("RIDGEFILL_WORK")) else None


def db_file() -> Path | None:
    return Path(p) if (p := get("RIDGEFILL_DB")) else None


def retune_state() -> Path | None:
    return Path(p) if (p := get("RIDGEFILL_RETUNE_STATE")) else None


def registry_dir() -> Path | None:
    return Path(p) if (p := get("RIDGEFILL_REGISTRY")) else None


def log_every() -> int:
    try:
        return max(1, int(get("RIDGEFILL_LOG_EVERY")))
    except ValueError:
        return int(VARIABLES["RIDGEFILL_LOG_EVERY"].default)


def max_kept() -> int:
    """How many chunked question prompts may keep material at once (RIDGEFILL_MAX_KEPT, at least 0)."""
    try:
        return max(0, int(get("RIDGEFILL_MAX_KEPT")))
    except ValueError:
        return int(VARIABLES["RIDGEFILL_MAX_KEPT"].default)


def describe() -> str:
    """One line per variable: name, default and what it does."""
    return "\n".join(f"{v.name} (default {v.default or '-'}): {v.doc}" for v in VARIABLES.values())
