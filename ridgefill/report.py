"""What a study shows: the Pareto front and the chosen trial (best speed-up inside the RULER-drop
constraint), the markdown table, one progress line per trial, and the Pareto plot."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from optuna.trial import FrozenTrial, TrialState

from ridgefill.results import Recorder
from ridgefill.search import feasible, measured_speedup, params_of
from ridgefill.study import Study

# --- the front and the choice --------------------------------------------------------------------------


def front(trials: Sequence[FrozenTrial], max_drop: float) -> list[FrozenTrial]:
    """Feasible complete trials not dominated on (RULER delta, speed-up), by trial number."""
    ok = [t for t in trials if feasible(t, max_drop)]

    def dominated(t: FrozenTrial) -> bool:
        a = t.values
        return any(u.values[0] >= a[0] and u.values[1] >= a[1] and tuple(u.values) != tuple(a) for u in ok)

    return sorted((t for t in ok if not dominated(t)), key=lambda t: t.number)


def choose(trials: Sequence[FrozenTrial], max_drop: float) -> FrozenTrial | None:
    """The best speed-up inside the constraint (ties: the smaller RULER drop, then the earlier trial)."""
    ok = [t for t in trials if feasible(t, max_drop)]
    return max(ok, key=lambda t: (t.values[1], t.values[0], -t.number), default=None)


# --- reports -------------------------------------------------------------------------------------------


def table(trials: Sequence[FrozenTrial], chosen: FrozenTrial | None, max_drop: float) -> str:
    """Markdown: every complete trial, Pareto members and the chosen one marked."""
    on_front = {t.number for t in front(trials, max_drop)}
    lines = [
        f"Constraint: the 95% CI lower bound of the paired RULER delta >= -{max_drop:g} points. "
        "`*` Pareto front, `**` chosen, `+` promoted (scored on more samples: it could join the front); "
        "speed-up `-`: not timed (it failed the constraint before its speed-up could matter).",
        "",
        "| trial | split | lambda | tail | share | RULER delta | 95% CI (n) | TTFT speed-up | dNLL | feasible | |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for t in sorted((t for t in trials if t.state == TrialState.COMPLETE), key=lambda t: t.number):
        p, d, ci = params_of(t), t.user_attrs.get("dnll"), t.user_attrs.get("ruler_ci")
        mark = "**" if chosen is not None and t.number == chosen.number else ("*" if t.number in on_front else "")
        band = f"[{ci['lo']:+.1f}, {ci['hi']:+.1f}] ({ci['n']}{'+' if ci.get('promoted') else ''})" if ci else "-"
        lines.append(
            f"| {t.number} | {p.get('split')} | {p.get('lam', float('nan')):.3g} | {p.get('tail')} | "
            f"{p.get('share', 0.0):.3f} | {t.values[0]:+.2f} | {band} | {speed(t)} | "
            f"{'-' if d is None else f'{d:+.4f}'} | {'yes' if feasible(t, max_drop) else 'no'} | {mark} |"
        )
    return "\n".join(lines)


def speed(t: FrozenTrial, missing: str = "-") -> str:
    """A trial's measured speed-up as shown (`missing` when it was not timed)."""
    up = measured_speedup(t)
    return missing if up is None else f"{up:.3f}x"


def _pooling(p: dict) -> str:
    """How a question-selected trial pooled its rows (the reach only when it has one)."""
    return f", window {p['window']}" + (f", reach {p['reach']}" if p.get("reach") else "")


def progress_line(t: FrozenTrial, done: int, budget: int, max_drop: float) -> str:
    """One line per finished trial: where the search stands and what the trial gave."""
    p, secs = params_of(t), t.user_attrs.get("seconds") or 0.0
    knobs = (
        f"split {p.get('split')}, lambda {p.get('lam', float('nan')):.3g}, tail {p.get('tail')}, "
        f"share {p.get('share') or 0.0:.3f}" + (_pooling(p) if p.get("select") == "question" else "")
    )
    if t.state != TrialState.COMPLETE:
        why = t.user_attrs.get("error")
        return f"trial #{t.number} FAILED ({done}/{budget} complete): {knobs} | {secs:.1f} s | {why}"
    d, ci = t.user_attrs.get("dnll"), t.user_attrs.get("ruler_ci") or {}
    band = f" [{ci['lo']:+.1f}, {ci['hi']:+.1f}] n={ci['n']}{' promoted' if ci.get('promoted') else ''}" if ci else ""
    return (
        f"trial {done}/{budget} (#{t.number}): {knobs} | RULER {t.values[0]:+.2f}{band} | "
        f"speed-up {speed(t, 'not timed')} | "
        f"dNLL {'-' if d is None else f'{d:+.4f}'} | feasible {'yes' if feasible(t, max_drop) else 'no'} | {secs:.1f} s"
    )


def pareto_png(trials: Sequence[FrozenTrial], chosen: FrozenTrial | None, max_drop: float, path: Path) -> Path:
    """Scatter of RULER delta vs TTFT speed-up: trials, the front, the constraint line and the chosen map."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    done = [t for t in trials if t.state == TrialState.COMPLETE]
    fr = front(done, max_drop)
    fig, ax = plt.subplots(figsize=(6, 4), dpi=100)
    timed = [t for t in done if measured_speedup(t) is not None]  # not timed: no point on the speed axis
    ok = [t for t in timed if feasible(t, max_drop)]
    bad = [t for t in timed if not feasible(t, max_drop)]
    ax.scatter([t.values[1] for t in ok], [t.values[0] for t in ok], c="tab:blue", label="feasible")
    ax.scatter([t.values[1] for t in bad], [t.values[0] for t in bad], c="tab:gray", marker="x", label="infeasible")
    ax.plot([t.values[1] for t in fr], [t.values[0] for t in fr], "o-", c="tab:orange", label="Pareto front")
    if chosen is not None:
        ax.scatter([chosen.values[1]], [chosen.values[0]], s=200, facecolors="none", edgecolors="red", label="chosen")
    ax.axhline(-max_drop, ls="--", c="red", lw=1, label=f"max drop {max_drop:g}")
    for t in timed:
        ax.annotate(str(t.number), (t.values[1], t.values[0]), fontsize=7, xytext=(3, 3), textcoords="offset points")
    ax.set_xlabel("TTFT speed-up vs exact (x)")
    ax.set_ylabel("RULER delta vs exact (points)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return path


# --- the study's selection, recorded and written ------------------------------------------------------


@dataclass
class Selection:
    """The outcome of a study: Pareto front and chosen trial numbers, the chosen map folder, the markdown
    table and the plot's path."""

    front: list[int]
    chosen: int | None
    best_map: str | None
    table: str
    png: str


def select(recorder: Recorder, trials: Sequence[FrozenTrial], cfg: Study, report_dir: Path) -> Selection:
    """Pareto front and chosen map into DuckDB (judged against today's limit, also for trials run under
    another); markdown table and PNG written to `report_dir`."""
    from ridgefill.maps import MANIFEST, read_manifest

    max_drop = cfg.constraints.max_ruler_drop
    fr, best = front(trials, max_drop), choose(trials, max_drop)
    keep = {t.number: t for t in fr} | ({best.number: best} if best else {})
    rows = []
    for t in keep.values():
        mp = t.user_attrs.get("map_path")
        sha = read_manifest(Path(mp))["manifest_sha256"] if mp and Path(mp, MANIFEST).is_file() else None
        p = params_of(t)
        rows.append(
            (cfg.name, t.number, cfg.model.repo, mp, sha, p.get("split"), p.get("lam"), p.get("tail"),
             p.get("share"), t.values[0], t.values[1])
        )  # fmt: skip
    recorder.maps(rows, cfg.name, best.number if best else None)
    md = table(trials, best, max_drop)
    out = Path(report_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "pareto.md").write_text(md + "\n")
    png = pareto_png(trials, best, max_drop, out / "pareto.png")
    chosen = best.number if best else None
    return Selection([t.number for t in fr], chosen, best.user_attrs.get("map_path") if best else None, md, str(png))
