"""`ridgefill` command line: capture, fit, generate, inspect, demo."""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Annotated

import typer

from ridgefill import steps
from ridgefill.default_model import cache_root
from ridgefill.evals.cli import app as eval_app

app = typer.Typer(help="RidgeFill: shorter prefill with closed-form ridge maps.", no_args_is_help=True)
app.add_typer(eval_app, name="eval")
Model = Annotated[str, typer.Option(help="model directory or hub id; 'default' = embedded SmolLM2-135M")]
Source = Annotated[list[str], typer.Option(help="calibration text: 'pydoc', files/folders, or hf:name:split[:col]")]


@app.callback()
def _main(verbose: Annotated[bool, typer.Option("--verbose", "-v")] = False) -> None:
    logging.basicConfig(level=logging.INFO if verbose else logging.WARNING, format="%(levelname)s %(message)s")


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
    lm, tok = steps.load_model(model)
    cap = steps.run_capture(
        lm,
        tok,
        _source(source),
        splits,
        window=window,
        max_windows=max_windows,
        heldout=heldout,
        root=root,
        checkpoint_seconds=checkpoint_seconds,
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
    tail: int = 256,
    sink: int = 4,
    share: float = 0.0,
) -> None:
    """Fit ridge maps for one split, measure them on held-out windows, and write a map folder."""
    from ridgefill.capture import load_capture

    lm, tok = steps.load_model(model)
    path = steps.build_maps(
        lm,
        tok,
        load_capture(capture_dir),
        split,
        lam,
        out,
        kind="identity" if identity else "ridge",
        defaults={"tail": tail, "sink": sink, "share": share},
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
    from ridgefill.maps import load_maps
    from ridgefill.runtime import FillPlan
    from ridgefill.runtime import generate as gen

    text = Path(prompt[1:]).read_text() if prompt.startswith("@") else prompt
    lm, tok = steps.load_model(model)
    ms = load_maps(maps, lm, tok) if maps else None
    if ms is None and mode == "ridge":
        raise typer.BadParameter("ridge mode needs --maps", param_hint="--maps")
    d = ms.manifest["defaults"] if ms else {"tail": 256, "sink": 4, "share": 0.0}
    plan = FillPlan(
        mode,
        split or (ms.split if ms else 0),
        ms,
        sink if sink is not None else d["sink"],
        tail or d["tail"],
        share if share is not None else d["share"],
    )
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
) -> None:
    """The main job on the embedded default: capture SmolLM2 on pydoc text, fit maps, compare to identity."""
    out = out or cache_root() / "maps"
    lm, tok = steps.load_model()
    cap = steps.run_capture(lm, tok, "pydoc", splits, max_windows=max_windows)
    typer.echo(f"capture: {cap.path}")
    for s in splits:
        ridge, identity = steps.build_map_pair(
            lm, tok, cap, s, lam, out / f"smollm2-S{s}-ridge", out / f"smollm2-S{s}-identity"
        )
        typer.echo(f"S={s}: {ridge} (identity baseline: {identity})")
        _print_table(json.loads((ridge / "ridgefill.json").read_text()))
    typer.echo(f"map folders under {out}")


from registry.cli import register as _register_registry  # noqa: E402

_register_registry(app)

from ridgefill.results_cli import register as _register_results  # noqa: E402

_register_results(app)


if __name__ == "__main__":
    app()
