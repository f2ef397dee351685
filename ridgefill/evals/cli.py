"""`ridgefill eval ruler|nll|ttft`: each writes a JSON result with every sample and prints a table."""

from __future__ import annotations

import functools
import inspect
import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Annotated, Any

import torch
import typer

from ridgefill.engines import ENGINES
from ridgefill.inputs import check_rows
from ridgefill.rows import ROWS, RowPolicy
from ridgefill.runtime import FillPlan

app = typer.Typer(
    help="Evaluate map folders: RULER accuracy by region, paired dNLL, paired TTFT.", no_args_is_help=True
)
Model = Annotated[str, typer.Option(help="model directory or hub id; 'default' = embedded SmolLM2-135M")]
Maps = Annotated[Path | None, typer.Option(help="map folder; without it, --mode identity or plumb with --split")]
Lengths = Annotated[list[int], typer.Option("--length", help="prompt lengths in model tokens (repeatable)")]
Text = Annotated[list[str], typer.Option(help="text files/folders, 'pydoc' or 'prose' (offline)")]


ROW_PANEL = "Protected rows (an option left out: the map folder's, else the default row policy)"
ROW_OPTIONS = {  # RowPolicy field -> its option's help: every eval command takes these (`with_rows`)
    "sink": "first prompt rows always run exact",
    "tail": "last prompt rows always run exact",
    "share": "share of the other rows protected, chosen by --select",
    "select": "how the share is chosen: rarity | question (the question's attention) | random (not the folder's)",
    "query": "question: query rows at the prompt's end",
    "window": "question: max-pool half-width",
    "score_layers": "question: exact layers below the split whose attention is summed",
    "reach": "question: rows after a scored row kept with it",
}


@dataclass(frozen=True)
class RowOptions:
    """The row options one command line gave (`RowPolicy` fields; a field left out keeps the base's value)."""

    given: Mapping[str, Any]

    def over(self, base: RowPolicy) -> RowPolicy:
        """`base` (a map folder's defaults, else `ROWS`) with the options given; a bad value is one line
        (InputError)."""
        return check_rows(base, **self.given)


def with_rows(command: Callable[..., None]) -> Callable[..., None]:
    """`command` taking one option per `ROW_OPTIONS` field in place of its `rows` parameter, and that parameter
    as one `RowOptions`, checked before any model or engine loads: ruler, nll and ttft take the same options."""
    own = inspect.signature(command, eval_str=True)
    at = own.parameters["rows"]
    options = [
        inspect.Parameter(
            name,
            at.kind,
            default=ROWS.select if name == "select" else None,  # rarity unless asked, whatever the folder's
            annotation=Annotated[type(getattr(ROWS, name)) | None, typer.Option(help=text, rich_help_panel=ROW_PANEL)],
        )
        for name, text in ROW_OPTIONS.items()
    ]
    params = list(own.parameters.values())
    i = params.index(at)

    @functools.wraps(command)
    def run(**values: Any) -> None:
        rows = RowOptions({name: values.pop(name) for name in ROW_OPTIONS})
        rows.over(ROWS)  # before a model or engine loads
        command(**values, rows=rows)

    run.__signature__ = own.replace(parameters=[*params[:i], *options, *params[i + 1 :]])
    return run


def _load(model: str, maps: Path | None):
    from ridgefill.maps import load_maps
    from ridgefill.steps import load_model

    lm, tok = load_model(model)
    return lm, tok, (load_maps(maps, lm, tok) if maps else None)


def _plan(ms, mode: str | None, split: int | None, rows: RowOptions) -> FillPlan:
    """The plan the options ask for: the row options given over the folder's defaults (`ROWS` without a
    folder); a bad value is refused in one line (InputError)."""
    mode = mode or ("ridge" if ms else "identity")
    if ms is None and mode == "ridge":
        raise typer.BadParameter("ridge mode needs --maps", param_hint="--maps")
    if ms is None and mode != "exact" and split is None:
        raise typer.BadParameter("without --maps, give --split", param_hint="--split")
    base = RowPolicy.of(ms.manifest["defaults"]) if ms else ROWS
    return FillPlan(mode, split or (ms.split if ms else 0), ms, rows=rows.over(base))


def _text_tokens(tok, text: list[str]) -> torch.Tensor:
    from ridgefill.corpus import load_corpus, token_stream

    return token_stream(load_corpus(text[0] if len(text) == 1 else text), tok)


def _write(out: Path | None, result: dict) -> None:
    if out:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=2) + "\n")
        typer.echo(f"result: {out}")


@app.command()
@with_rows
def ruler(
    model: Model = "default",
    maps: Maps = None,
    mode: str | None = None,
    split: int | None = None,
    rows: RowOptions = RowOptions({}),
    length: Lengths = [2048],  # noqa: B006
    task: Annotated[list[str], typer.Option(help="RULER tasks (repeatable); default: all")] = [],  # noqa: B006
    haystack: Text = ["pydoc"],  # noqa: B006
    samples: int = 10,
    seed: int = 0,
    with_identity: Annotated[bool, typer.Option(help="also score identity fill at the same split")] = False,
    out: Path | None = None,
) -> None:
    """RULER tasks on exact and the plan (and identity fill), scored overall and by needle region."""
    from ridgefill.evals.ruler import TASKS, load_haystack
    from ridgefill.evals.ruler_run import Cells, run_ruler, table

    lm, tok, ms = _load(model, maps)
    plan = _plan(ms, mode, split, rows)
    plans = {"exact": FillPlan(), f"{plan.mode} S={plan.split}": plan}
    if with_identity and plan.mode != "identity":
        plans[f"identity S={plan.split}"] = FillPlan(
            "identity", plan.split, rows=ROWS.given(sink=plan.rows.sink, tail=plan.rows.tail)
        )
    hay = load_haystack(haystack[0] if len(haystack) == 1 else haystack)
    result = run_ruler(lm, tok, plans, Cells(task or list(TASKS), length, hay, samples, seed))
    result["config"] = {
        "model": model,
        "maps": str(maps) if maps else None,
        "plans": list(plans),
        **plan.rows.options(),  # the row settings that travel with a plan
        "seed": seed,
    }
    typer.echo(table(result["scores"]))
    _write(out, result)


@app.command()
@with_rows
def nll(
    model: Model = "default",
    maps: Maps = None,
    mode: str | None = None,
    split: int | None = None,
    rows: RowOptions = RowOptions({}),
    length: Lengths = [2048],  # noqa: B006
    text: Text = ["pydoc"],  # noqa: B006
    documents: int = 8,
    scored: int = 512,
    out: Path | None = None,
) -> None:
    """Paired dNLL on the last `scored` tokens of `length`-token documents, with a bootstrap CI."""
    from ridgefill.evals.nll import documents as docs_of
    from ridgefill.evals.nll import evaluate_nll

    lm, tok, ms = _load(model, maps)
    plan = _plan(ms, mode, split, rows)
    stream = _text_tokens(tok, text)
    result = {}
    typer.echo("| length | docs | NLL exact | NLL fill | dNLL | 95% CI | top-1 agree |\n|---|---|---|---|---|---|---|")
    for n in length:
        r = evaluate_nll(lm, docs_of(stream, n, documents), plan, scored)
        result[str(n)] = r
        typer.echo(
            f"| {n} | {r['documents']} | {r['nll_exact']:.4f} | {r['nll_fill']:.4f} | {r['dnll']:+.4f} | "
            f"[{r['dnll_ci95'][0]:+.4f}, {r['dnll_ci95'][1]:+.4f}] | {r['top1_agree']:.3f} |"
        )
    _write(
        out,
        {
            "config": {
                "model": model,
                "maps": str(maps) if maps else None,
                "mode": plan.mode,
                "split": plan.split,
                **plan.rows.options(),
            },
            "lengths": result,
        },
    )


@app.command()
@with_rows
def ttft(
    model: Model = "default",
    maps: Maps = None,
    mode: str | None = None,
    split: int | None = None,
    rows: RowOptions = RowOptions({}),
    length: Lengths = [2048, 4096],  # noqa: B006
    engine: Annotated[str, typer.Option(help="transformers | vllm (vLLM in-process, enforce_eager)")] = "transformers",
    chunk: Annotated[int | None, typer.Option(help="vllm: max tokens per step (chunked prefill)")] = None,
    dtype: Annotated[
        str | None, typer.Option(help="vllm: the engine's dtype (default: bf16 on CUDA, float32 on the CPU)")
    ] = None,
    gpu_memory: Annotated[float | None, typer.Option(help="vllm: gpu_memory_utilization (GPU share)")] = None,
    repeats: int = 5,
    warmup: int = 1,
    out: Path | None = None,
) -> None:
    """Paired TTFT, exact vs the plan on the same engine in this process: medians, ratio and its CI."""
    from ridgefill.evals.ttft import paired_ttft, random_prompt, transformers_engine

    kind = ENGINES.get(engine)
    if kind is None:
        raise typer.BadParameter(f"engine must be transformers or vllm, not {engine!r}", param_hint="--engine")
    if not kind.serving:
        lm, tok, ms = _load(model, maps)
        plan = _plan(ms, mode, split, rows)
        run = transformers_engine(lm)
    else:
        if maps is None:
            raise typer.BadParameter("the vllm engine serves a map folder: give --maps", param_hint="--maps")
        from ridgefill.steps import model_path
        from ridgefill.vllm_plugin.offline import LLMArgs, counters, make_llm, served_model, ttft_engine

        path = str(model_path(model))
        given = {**rows.given, "mode": mode}
        options = {k: v for k, v in given.items() if v is not None}  # the engine serves ridge or plumb
        args = LLMArgs(chunk=chunk, max_model_len=max(length) + 16, gpu_memory_utilization=gpu_memory)
        llm = make_llm(path, str(maps), dtype=dtype, options=options, args=args)
        run = ttft_engine(llm)  # raises if the engine refused the folder
        tok = llm.get_tokenizer()
        plan = _plan(served_model(llm).ridgefill.maps, mode or "ridge", None, rows)  # verified there
        q = served_model(llm).ridgefill.question
        plan = replace(plan, rows=plan.rows.given(**({"window": q.window, "reach": q.reach} if q else {})))
    result = {}
    count = (lambda: counters(llm)) if kind.serving else (lambda: None)
    typer.echo("| tokens | exact median s | fill median s | speed-up | 95% CI |\n|---|---|---|---|---|")
    for n in length:
        ids = random_prompt(tok.vocab_size, n)
        before = count()
        r = paired_ttft(run, ids, plan, repeats, warmup)
        if before is not None:  # what the RidgeFill side really filled over this length's requests
            r["counters"] = {k: v - before[k] for k, v in count().items()}
        result[str(n)] = r
        typer.echo(
            f"| {n} | {r['exact_median_s']:.3f} | {r['fill_median_s']:.3f} | {r['speedup']:.2f}x | "
            f"[{r['speedup_ci95'][0]:.2f}, {r['speedup_ci95'][1]:.2f}] |"
        )
    _write(
        out,
        {
            "config": {
                "model": model,
                "maps": str(maps) if maps else None,
                "engine": engine,
                "mode": plan.mode,
                "split": plan.split,
                **plan.rows.options(),
            },
            "lengths": result,
        },
    )
