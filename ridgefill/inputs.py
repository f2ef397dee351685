"""What a user names, checked before any weights load: the model's `config.json`, its splits, input files.

Long work (a model load, a capture, a Prefect run) should never start on input that cannot work, so
these checks read only small files. Their errors name the problem and the fix in one line.
"""

from __future__ import annotations

import json
from pathlib import Path

from ridgefill.rows import RowPolicy


class InputError(ValueError):
    """Bad input found before any long work starts; the message names the problem and the fix."""


def model_config(model: str | Path, revision: str | None = None) -> dict:
    """A model's `config.json` without its weights: 'default' (the embedded SmolLM2), a folder, or a Hub id."""
    from ridgefill.default_model import default_model_dir

    if str(model) == "default":
        path = default_model_dir() / "config.json"
    elif Path(model).expanduser().is_dir():
        path = Path(model).expanduser() / "config.json"
        if not path.is_file():
            raise InputError(f"{model} has no config.json: give a model folder saved by transformers, or a Hub id")
    elif _looks_like_path(str(model)):
        raise InputError(f"model folder {model} does not exist: give an existing folder, 'default', or a Hub id")
    else:
        path = _hub_config(str(model), revision)
    try:
        return json.loads(Path(path).read_text())
    except json.JSONDecodeError as e:
        raise InputError(f"{path} is not valid JSON ({e}): restore the model's config.json") from None


def _looks_like_path(name: str) -> bool:
    return name.startswith((".", "/", "~")) or name.count("/") > 1


def _hub_config(repo: str, revision: str | None) -> str:
    from huggingface_hub import hf_hub_download

    try:
        return hf_hub_download(repo, "config.json", revision=revision)
    except Exception as e:  # offline, unreachable, gated or unknown: all stop here, before any download
        why = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise InputError(
            f"cannot read {repo}'s config.json from the Hub ({type(e).__name__}: {why}): check the network, "
            "HF_ENDPOINT and HF_TOKEN, or give a local model folder"
        ) from e


def num_layers(config: dict) -> int:
    """Decoder layers of a model config (multimodal configs nest the language model's)."""
    for cfg in (config, config.get("text_config") or {}):
        if isinstance(cfg.get("num_hidden_layers"), int):
            return cfg["num_hidden_layers"]
    raise InputError("the model's config.json has no num_hidden_layers: RidgeFill supports Llama, Qwen2 and Qwen3")


def split_range(layers: int) -> tuple[int, int]:
    """Splits a capture can hold: at least one exact layer below and two late layers to fill above."""
    return 1, layers - 2


def check_splits(splits: list[int], layers: int, where: str = "--split") -> None:
    lo, hi = split_range(layers)
    bad = sorted({s for s in splits if not lo <= s <= hi})
    if bad:
        raise InputError(
            f"{where}: split(s) {bad} outside {lo}..{hi} for this {layers}-layer model: choose splits there"
        )


NAMED_SOURCES = ("pydoc", "prose")  # the text every install has: `ridgefill.corpus.NAMED` (torch-free here)


def check_sources(source: str | list[str], what: str = "--source") -> None:
    """Text files and folders must exist ('pydoc', 'prose' and hf:... datasets are not files)."""
    for s in [source] if isinstance(source, str) else source:
        if s not in NAMED_SOURCES and not str(s).startswith("hf:") and not Path(s).expanduser().exists():
            raise InputError(f"{what}: {s} does not exist: give existing .txt files or folders, 'pydoc' or 'prose'")


def check_rows(base: RowPolicy, **given) -> RowPolicy:
    """`base` with the command-line row options given (None: keep), checked before any model loads."""
    try:
        return base.given(**given).check("--")
    except ValueError as e:
        raise InputError(f"{e}: choose another value") from None
