"""`ridgefill results [--sql ...]` and `ridgefill tune --study ...`, registered on the main typer app."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

from ridgefill.results import default_db

DEFAULT_SQL = {
    "trials": "SELECT study, trial, state, split, lam, tail, share, ruler_delta, ruler_ci_lo, ruler_ci_hi, ruler_n, "
    "speedup, dnll, feasible FROM trials ORDER BY study, trial",
    "pareto": "SELECT study, trial, split, lam, tail, share, ruler_delta, speedup FROM pareto ORDER BY study, speedup",
    "certifications": "SELECT study, trial, passed, delta, ci_lo, ci_hi, n, tasks, lengths, samples, haystack "
    "FROM certifications ORDER BY study, trial",
    "best map": "SELECT model, study, trial, path, ruler_delta, speedup, published FROM best_map ORDER BY model",
}


def _flow():
    """The tune flow, imported when a study is run (the CLI is the composition root: it may import the flows)."""
    import flows.tune

    return flows.tune


def register(app: typer.Typer) -> None:
    """Add the `results` and `tune` commands to `app`."""

    @app.command()
    def results(
        sql: Annotated[str | None, typer.Option(help="read-only SQL; default: trials, Pareto front, best maps")] = None,
        db: Annotated[Path | None, typer.Option(help="results file (default: $RIDGEFILL_DB or the cache)")] = None,
    ) -> None:
        """Print tables from the tuning results (DuckDB, opened read-only)."""
        from ridgefill.results import markdown, query

        path = db or default_db()
        if not path.is_file():
            raise typer.BadParameter(f"no results file at {path}", param_hint="--db")
        queries = {"query": sql} if sql else DEFAULT_SQL
        for title, q in queries.items():
            if not sql:
                typer.echo(f"\n## {title}\n")
            typer.echo(markdown(*query(path, q)))

    @app.command()
    def tune(
        study: Annotated[str, typer.Option(help="study file or name under studies/")] = "studies/smollm2-135m.yaml",
        db: Annotated[Path | None, typer.Option(help="results file")] = None,
        work: Annotated[Path | None, typer.Option(help="captures, maps, Optuna journal and reports")] = None,
        storage: Annotated[str | None, typer.Option(help="Optuna storage: .journal path or postgresql:// URL")] = None,
        overrides: Annotated[str | None, typer.Option(help='JSON merged into the study ({"budget":...})')] = None,
        publish: Annotated[bool, typer.Option(help="publish the chosen map when registry is importable")] = True,
        as_json: Annotated[bool, typer.Option("--json", help="end with the flow's summary as JSON")] = False,
        evaluator: Annotated[str | None, typer.Option(hidden=True, help="test hook (flows/tune.py)")] = None,
        plan: Annotated[str | None, typer.Option(help="print this study's cost estimate; runs nothing")] = None,
        gpu: Annotated[str | None, typer.Option(help="GPU class for --plan: h100, h200, a100")] = None,
        force: Annotated[bool, typer.Option(help="start even if the estimate exceeds budget.hours")] = False,
    ) -> None:
        """Run the tune flow here (Prefect's ephemeral mode unless PREFECT_API_URL is set)."""
        from ridgefill.study import StudyError, find_study, preflight

        try:
            extra = json.loads(overrides) if overrides else None
        except json.JSONDecodeError as e:
            raise StudyError(f"--overrides is not valid JSON ({e}): give a JSON object") from None
        if plan:
            from ridgefill import cost
            from ridgefill.study import load_study

            typer.echo(cost.plan(load_study(find_study(plan), extra), gpu)[1])
            return
        preflight(find_study(study), extra)  # the whole study, before Prefect or any model starts
        flow = _flow()
        where = flow.Where(db=str(db) if db else None, work=str(work) if work else None, storage=storage)
        out = flow.tune(study, extra, where, publish, evaluator, force)
        typer.echo("\n" + out.pop("table"))
        typer.echo(
            f"\nstudy {out['study']}: {out['trials_run']} trials run here, Pareto front {out['front']}, "
            f"chosen {out['chosen']}\nresults: {out['results']} (`ridgefill results --db {out['results']}`)\n"
            f"best map: {out['best_map']}\nreport: {out['report']} (pareto.md, pareto.png)\n"
            f"published: {out['published'] or 'no'}"
        )
        if as_json:
            typer.echo(json.dumps(out, indent=2))
