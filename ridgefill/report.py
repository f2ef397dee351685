"""What a study shows: the Pareto front and the chosen trial (best speed-up inside the RULER-drop
constraint), the markdown table, one progress line per trial, and the Pareto plot."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from optuna.trial import FrozenTrial, TrialState

from ridgefill.results import Recorder
from ridgefill.search import feasible, params_of, ranked_speedup, speedup_source, usable
from ridgefill.study import Study

# --- the front and the choice --------------------------------------------------------------------------


def front(trials: Sequence[FrozenTrial], max_drop: float) -> list[FrozenTrial]:
    """Feasible complete trials not dominated on (RULER delta, speed-up), by trial number."""
    ok = [t for t in trials if feasible(t, max_drop) and usable(t)]

    def dominated(t: FrozenTrial) -> bool:
        a = t.values
        return any(u.values[0] >= a[0] and u.values[1] >= a[1] and tuple(u.values) != tuple(a) for u in ok)

    return sorted((t for t in ok if not dominated(t)), key=lambda t: t.number)


def choose(trials: Sequence[FrozenTrial], max_drop: float) -> FrozenTrial | None:
    """The best speed-up inside the constraint (ties: the smaller RULER drop, then the earlier trial); a trial
    whose timing broke its FLOP bound is never chosen."""
    ok = [t for t in trials if feasible(t, max_drop) and usable(t)]
    return max(ok, key=lambda t: (t.values[1], t.values[0], -t.number), default=None)


# --- reports -------------------------------------------------------------------------------------------


def table(trials: Sequence[FrozenTrial], chosen: FrozenTrial | None, max_drop: float) -> str:
    """Markdown: every complete trial, Pareto members and the chosen one marked."""
    on_front = {t.number for t in front(trials, max_drop)}
    lines = [
        f"Constraint: the 95% CI lower bound of the paired RULER delta >= -{max_drop:g} points. "
        "`*` Pareto front, `**` chosen, `+` promoted (scored on more samples: it could join the front); "
        "speed-up `p`: predicted by the study's calibrated TTFT model (else measured for the trial), `invalid`: "
        "measured above its FLOP bound (never used), `-`: not timed (it failed the constraint before its speed-up "
        "could matter).",
        "",
        "| trial | split | lambda | tail | share | RULER delta | 95% CI (n) | TTFT speed-up | FLOP bound | dNLL | "
        "feasible | |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for t in sorted((t for t in trials if t.state == TrialState.COMPLETE), key=lambda t: t.number):
        p, d, ci = params_of(t), t.user_attrs.get("dnll"), t.user_attrs.get("ruler_ci")
        mark = "**" if chosen is not None and t.number == chosen.number else ("*" if t.number in on_front else "")
        band = f"[{ci['lo']:+.1f}, {ci['hi']:+.1f}] ({ci['n']}{'+' if ci.get('promoted') else ''})" if ci else "-"
        lines.append(
            f"| {t.number} | {p.get('split')} | {p.get('lam', float('nan')):.3g} | {p.get('tail')} | "
            f"{p.get('share', 0.0):.3f} | {t.values[0]:+.2f} | {band} | {speed(t)} | {flop_bound(t)} | "
            f"{'-' if d is None else f'{d:+.4f}'} | {'yes' if feasible(t, max_drop) else 'no'} | {mark} |"
        )
    return "\n".join(lines)


def speed(t: FrozenTrial, missing: str = "-", long: bool = False) -> str:
    """A trial's speed-up as shown, saying where it comes from (`missing` when it was not timed)."""
    source = speedup_source(t)
    if source == "invalid":
        return "invalid (above its FLOP bound)"
    up = ranked_speedup(t)
    if up is None:
        return missing
    return f"{up:.3f}x" + ((" predicted" if long else " p") if source == "predicted" else "")


def flop_bound(t: FrozenTrial) -> str:
    b = t.user_attrs.get("speedup_bound")
    return "-" if b is None else f"{b:.3f}x"


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
        f"speed-up {speed(t, 'not timed', long=True)} | "
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
    timed = [t for t in done if ranked_speedup(t) is not None]  # not timed: no point on the speed axis
    ok = [t for t in timed if feasible(t, max_drop)]
    bad = [t for t in timed if not feasible(t, max_drop)]
    for group, colour, marker, label in ((ok, "tab:blue", "o", "feasible"), (bad, "tab:gray", "x", "infeasible")):
        if not group:
            continue
        lo, hi = _ruler_err(group)
        ax.errorbar([t.values[1] for t in group], [t.values[0] for t in group], yerr=[lo, hi], fmt=marker,
                    c=colour, ecolor=colour, elinewidth=0.8, capsize=2, label=f"{label} (RULER 95% CI)")  # fmt: skip
    bounded = [t for t in timed if t.user_attrs.get("speedup_bound") is not None]
    for t in bounded:  # each trial's physical limit beside its speed-up
        ax.plot([t.values[1], t.user_attrs["speedup_bound"]], [t.values[0]] * 2, ":", c="tab:green", lw=0.8)
    if bounded:
        ax.scatter([t.user_attrs["speedup_bound"] for t in bounded], [t.values[0] for t in bounded], marker="|",
                   c="tab:green", s=60, label="FLOP bound")  # fmt: skip
    ax.plot([t.values[1] for t in fr], [t.values[0] for t in fr], "o-", c="tab:orange", label="Pareto front")
    if chosen is not None:
        ax.scatter([chosen.values[1]], [chosen.values[0]], s=200, facecolors="none", edgecolors="red", label="chosen")
    ax.axhline(-max_drop, ls="--", c="red", lw=1, label=f"max drop {max_drop:g}")
    for t in timed:
        ax.annotate(str(t.number), (t.values[1], t.values[0]), fontsize=7, xytext=(3, 3), textcoords="offset points")
    predicted = any(speedup_source(t) == "predicted" for t in timed)
    ax.set_xlabel("TTFT speed-up vs exact (x, " + ("predicted by the calibrated model)" if predicted else "measured)"))
    ax.set_ylabel("RULER delta vs exact (points)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return path


def _ruler_err(trials: Sequence[FrozenTrial]) -> tuple[list[float], list[float]]:
    """Error-bar lengths below and above each trial's RULER delta: its paired 95% CI (0 without one)."""
    lo, hi = [], []
    for t in trials:
        ci = t.user_attrs.get("ruler_ci") or {}
        lo.append(max(0.0, t.values[0] - ci["lo"]) if ci.get("lo") is not None else 0.0)
        hi.append(max(0.0, ci["hi"] - t.values[0]) if ci.get("hi") is not None else 0.0)
    return lo, hi


def calibration_line(model) -> str:
    """What the study ranks trials by: the calibrated TTFT model (engine, points, worst error), or per-trial timing."""
    if model is None:
        return "TTFT: timed per trial (objectives.ttft.per_trial)"
    rows = model.table()
    worst = max(rows, key=lambda r: abs(r["error"]))
    capped = sum(r["rounds"] >= (model.conditions.get("max_rounds") or 10**9) for r in rows)
    return (
        f"TTFT model calibrated on {model.engine} ({model.device}, {model.dtype}): {len(rows)} points, paired against "
        f"exact, {min(r['rounds'] for r in rows)}-{max(r['rounds'] for r in rows)} rounds each; largest prediction "
        f"error {worst['error']:+.1%} ({worst['point']} at {worst['length']}); trials are ranked by its predicted "
        "speed-up" + (f"; {capped} points stopped at the round cap" if capped else "")
    )


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
