"""`ridgefill` command line: capture, fit, generate, inspect, demo (and eval, tune, results, publish, pull).

The composition root. Expected failures (bad input, a refused map folder, a bad study, a missing file, an
unreachable Hub) print one line naming the problem and the fix and exit with status 2; `-v` adds the
traceback and INFO logs.
"""

from __future__ import annotations

import json
import logging
import sys
import time
import traceback
from pathlib import Path
from typing import Annotated

import click
import typer
from typer.core import TyperGroup

from registry.cli import register as register_registry
from ridgefill import steps
from ridgefill.default_model import cache_root
from ridgefill.evals.cli import app as eval_app
from ridgefill.inputs import InputError, check_rows, check_sources, check_splits, model_config, num_layers
from ridgefill.results_cli import register as register_results
from ridgefill.rows import ROWS, RowPolicy

VERBOSE = ("-v", "--verbose")
FIXES = {  # for errors whose message names the problem but not always what to do
    "MapError": "re-fit the folder with `ridgefill fit`, or pull it again with `ridgefill pull`",
    "RegistryError": "check the repo id, the revision and the backend (`ridgefill maps list` shows what is published)",
    "OfflineModeIsEnabled": "unset HF_HUB_OFFLINE, or use a folder already on disk",
    "ConnectionError": "check the network and HF_ENDPOINT, or use a folder already on disk",
    "FileNotFoundError": "check the path",
    "PermissionError": "check the permissions of the path",
}


def expected_errors() -> tuple[type[BaseException], ...]:
    """What a user can cause and fix: everything else is a bug and keeps its traceback."""
    from huggingface_hub.errors import HfHubHTTPError

    from registry.base import RegistryError
    from ridgefill.maps import MapError
    from ridgefill.study import StudyError
    from ridgefill.ttft_model import CalibrationError

    errors = InputError, StudyError, MapError, RegistryError, HfHubHTTPError, CalibrationError
    return (*errors, OSError)  # OSError: files, network


def one_line(e: BaseException) -> str:
    """`error: <message>` on one line, with the fix for error types whose messages do not carry one."""
    msg = " ".join(str(e).split()) or type(e).__name__
    fix = next((FIXES[c.__name__] for c in type(e).__mro__ if c.__name__ in FIXES), None)
    return f"error: {msg}" + (f"; fix: {fix}" if fix and not isinstance(e, InputError) else "")


class PlainErrors(TyperGroup):
    """The root group: `-v` anywhere on the line, and expected errors as one line with exit status 2."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        verbose = [a for a in args if a in VERBOSE]
        return super().parse_args(ctx, verbose[:1] + [a for a in args if a not in VERBOSE])

    def invoke(self, ctx: click.Context):
        try:
            return super().invoke(ctx)
        except expected_errors() as e:
            if ctx.params.get("verbose"):
                traceback.print_exception(e, file=sys.stderr)
            typer.echo(one_line(e), err=True)
            raise typer.Exit(2) from None


app = typer.Typer(help="RidgeFill: shorter prefill with closed-form ridge maps.", no_args_is_help=True, cls=PlainErrors)
app.add_typer(eval_app, name="eval")
Model = Annotated[str, typer.Option(help="model directory or hub id; 'default' = embedded SmolLM2-135M")]
Source = Annotated[list[str], typer.Option(help="calibration text: pydoc, prose, files/folders or hf:name:split[:col]")]


class _Stderr(logging.StreamHandler):
    """Writes to whatever sys.stderr is when a record comes (as logging's last-resort handler does)."""

    @property
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, _value) -> None:
        pass


_HANDLER = _Stderr()
_HANDLER.setFormatter(logging.Formatter("%(levelname)s %(message)s"))


@app.callback()
def _main(
    verbose: Annotated[bool, typer.Option("--verbose", "-v", help="INFO logs, and tracebacks of errors")] = False,
) -> None:
    # the package's own loggers only (not the root): Prefect keeps its console format with task run names
    for name in ("ridgefill", "registry"):
        log = logging.getLogger(name)
        if _HANDLER not in log.handlers:
            log.addHandler(_HANDLER)
        log.setLevel(logging.INFO if verbose else logging.NOTSET)  # NOTSET: the root's level (WARNING)


def _source(source: list[str]) -> str | list[str]:
    return source[0] if len(source) == 1 else source


@app.command()
def capture(
    model: Model = "default",
    source: Source = ["pydoc"],  # noqa: B006
    splits: Annotated[list[int], typer.Option("--split")] = [10, 15, 18, 20],  # noqa: B006
    window: int = 512,
    max_windows: int = 128,
    heldout: int = 4,
    checkpoint_seconds: Annotated[float, typer.Option(help="seconds between checkpoints")] = 300.0,
    root: Path | None = None,
) -> None:
    """Stream calibration text through the model and save ridge statistics for each split."""
    check_splits(splits, num_layers(model_config(model)))
    check_sources(source)
    lm, tok = steps.load_model(model)
    cap = steps.run_capture(
        lm,
        tok,
        steps.CalibrationText(_source(source), window=window, max_windows=max_windows, heldout=heldout),
        splits,
        root,
        steps.CaptureOptions(checkpoint_seconds=checkpoint_seconds),
    )
    typer.echo(f"capture: {cap.path} ({cap.meta['windows_done']} windows, splits {cap.splits})")


@app.command()
def fit(
    capture_dir: Annotated[Path, typer.Argument(help="a capture folder from `ridgefill capture`")],
    split: Annotated[int, typer.Option()],
    out: Annotated[Path, typer.Option(help="map folder to write")],
    model: Model = "default",
    lam: Annotated[float, typer.Option("--lambda", help="ridge strength relative to the mean eigenvalue")] = 1e-3,
    identity: Annotated[bool, typer.Option(help="write identity fill (the baseline) instead")] = False,
    tail: int = ROWS.tail,
    sink: int = ROWS.sink,
    share: float = ROWS.share,
) -> None:
    """Fit ridge maps for one split, measure them on held-out windows, and write a map folder."""
    from ridgefill.capture import load_capture

    rows = check_rows(ROWS, tail=tail, sink=sink, share=share)
    cap = load_capture(capture_dir)
    if split not in cap.splits:
        raise InputError(f"--split {split} was not captured in {capture_dir}: choose one of {cap.splits}, or recapture")
    lm, tok = steps.load_model(model)
    path = steps.build_maps(
        steps.fit_report(lm, tok, cap, split, lam),
        out,
        kind="identity" if identity else "ridge",
        defaults={"tail": rows.tail, "sink": rows.sink, "share": rows.share},
    )
    typer.echo(f"maps: {path}")
    _print_table(json.loads((path / "ridgefill.json").read_text()))


@app.command()
def generate(
    prompt: Annotated[str, typer.Argument(help="prompt text, or @file to read it from a file")],
    model: Model = "default",
    maps: Annotated[Path | None, typer.Option(help="map folder (ridge or identity)")] = None,
    mode: Annotated[str, typer.Option(help="exact | plumb | identity | ridge")] = "ridge",
    split: Annotated[int | None, typer.Option(help="split for plumb/identity without maps")] = None,
    tail: int | None = None,
    sink: int | None = None,
    share: float | None = None,
    max_new_tokens: int = 64,
    chat: Annotated[bool, typer.Option(help="wrap the prompt in the chat template")] = True,
) -> None:
    """Generate greedily after a RidgeFill prefill."""
    from ridgefill.maps import load_maps, read_manifest
    from ridgefill.runtime import FillPlan
    from ridgefill.runtime import generate as gen

    if prompt.startswith("@") and not Path(prompt[1:]).is_file():
        raise InputError(f"prompt file {prompt[1:]} does not exist: give an existing file after @, or the text")
    text = Path(prompt[1:]).read_text() if prompt.startswith("@") else prompt
    manifest = read_manifest(maps) if maps else None  # not a map folder: refused before the model loads
    rows = check_rows(RowPolicy.of(manifest["defaults"]) if manifest else ROWS, sink=sink, tail=tail, share=share)
    lm, tok = steps.load_model(model)
    ms = load_maps(maps, lm, tok) if maps else None
    if ms is None and mode == "ridge":
        raise typer.BadParameter("ridge mode needs --maps", param_hint="--maps")
    plan = FillPlan(mode, split or (ms.split if ms else 0), ms, rows=rows)
    if chat and tok.chat_template:
        ids = tok.apply_chat_template(
            [{"role": "user", "content": text}], add_generation_prompt=True, return_tensors="pt", return_dict=True
        )["input_ids"]
    else:
        ids = tok(text, return_tensors="pt")["input_ids"]
    t = time.perf_counter()
    new = gen(lm, ids, plan, max_new_tokens)
    typer.echo(tok.decode(new[0], skip_special_tokens=True))
    typer.echo(f"[{ids.shape[1]} prompt tokens, {new.shape[1]} new, {time.perf_counter() - t:.2f} s]", err=True)


@app.command()
def inspect(path: Path) -> None:
    """Verify a map folder's files and print its manifest and held-out per-layer table."""
    from ridgefill.maps import read_manifest, verify_files

    manifest = read_manifest(path)
    verify_files(path, manifest)
    show = {k: v for k, v in manifest.items() if k not in ("fit", "files")}
    show["fit"] = {k: v for k, v in manifest["fit"].items() if k != "heldout"}
    typer.echo(json.dumps(show, indent=2))
    typer.echo(f"files: {len(manifest['files'])} verified")
    _print_table(manifest)


def _print_table(manifest: dict) -> None:
    rows = manifest["fit"].get("heldout", {})
    typer.echo(f"{'layer':>5} | {'h rel r/i':>13} | {'K rel r/i':>13} | {'V rel r/i':>13} | {'K cos r/i':>13}")
    for layer, m in sorted(rows.items(), key=lambda kv: int(kv[0])):
        r, i = m["ridge"], m["identity"]
        typer.echo(
            f"{layer:>5} | {r['h_rel']:.3f}/{i['h_rel']:.3f} | {r['k_rel']:.3f}/{i['k_rel']:.3f} | "
            f"{r['v_rel']:.3f}/{i['v_rel']:.3f} | {r['k_cos']:.3f}/{i['k_cos']:.3f}"
        )


@app.command()
def demo(
    out: Annotated[Path | None, typer.Option(help="where to write maps (default: the cache)")] = None,
    splits: Annotated[list[int], typer.Option("--split")] = [15, 18, 20],  # noqa: B006
    lam: Annotated[float, typer.Option("--lambda")] = 1e-3,
    max_windows: int = 64,
    window: int = 512,
    root: Annotated[Path | None, typer.Option(help="where captures go (default: the cache)")] = None,
) -> None:
    """A quick look at the method on the embedded default: capture SmolLM2 on pydoc text, fit ridge and
    identity maps for each split, print the held-out table."""
    check_splits(splits, num_layers(model_config("default")))
    out = out or cache_root() / "maps"
    lm, tok = steps.load_model()
    cap = steps.run_capture(
        lm, tok, steps.CalibrationText("pydoc", window=window, max_windows=max_windows), splits, root
    )
    typer.echo(f"capture: {cap.path}")
    for s in splits:
        ridge, identity = steps.build_map_pair(
            steps.fit_report(lm, tok, cap, s, lam), out / f"smollm2-S{s}-ridge", out / f"smollm2-S{s}-identity"
        )
        typer.echo(f"S={s}: {ridge} (identity baseline: {identity})")
        _print_table(json.loads((ridge / "ridgefill.json").read_text()))
    typer.echo(f"map folders under {out}")


register_registry(app)  # the layers above the core add their commands here, the one composition root
register_results(app)


if __name__ == "__main__":
    app()
