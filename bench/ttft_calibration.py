"""The study's TTFT model on one engine: its calibration table, and its error at held-out configs timed apart.

Runs what the tune flow runs before its trials (`objectives.calibrate`: maps fitted at the corner splits, exact
and the search space's corners and centre timed paired and alternating until each ratio's 95% CI half-width is
within `ttft.target` or `ttft.max_repeats`, an NNLS fit, the check against its own points), then times
`--heldout` configs drawn from the search space (seeded) in a separate paired run, and compares them with the
model's prediction. Prints a markdown table and writes JSON with every point.

    python bench/ttft_calibration.py studies/smollm2-135m.yaml --engine transformers --length 2048 --length 4096
    python bench/ttft_calibration.py studies/smollm2-135m.yaml --engine vllm --length 2048 --out r/cal_vllm
    python bench/ttft_calibration.py studies/smollm2-135m.yaml --refit r/cal_vllm.json   # the same timings, refitted

`--refit` times nothing: it fits the current TTFT model to the timings an earlier run wrote (its calibration
points), and predicts its held-out points again, so a change to the model is judged on the same measurements.
"""

from __future__ import annotations

import argparse
import json
import random
import re
import sys
import time
from pathlib import Path

from ridgefill import objectives
from ridgefill.capture import CaptureOptions
from ridgefill.cost import Shape
from ridgefill.steps import CalibrationText, load_model, model_path, run_capture
from ridgefill.study import load_study
from ridgefill.ttft_model import CalibrationError, Point, Ratio, checked, conditions, fit


def heldout_points(cfg, k: int, seed: int) -> list[Point]:
    """k configs drawn from the study's search space (split, tail, share), none of them a calibration point."""
    rng, s = random.Random(seed), cfg.search
    rows = objectives.search_rows(cfg)
    taken = set(objectives.calibration_points(cfg))
    out: list[Point] = []
    while len(out) < k:
        p = Point(rng.choice(s.splits), rows.given(tail=rng.choice(s.tails), share=round(rng.uniform(*s.share), 3)))
        if p not in taken and p not in out:
            out.append(p)
    return out


def parsed(row: dict, rows) -> tuple[Ratio, bool]:
    """A timed point of an earlier run's JSON (its label, `Point.label`) as a Ratio; True for a held-out one."""
    m = re.search(r"S=(\d+) tail (\d+) share ([\d.]+)", row["point"])
    point = Point(int(m[1]), rows.given(tail=int(m[2]), share=float(m[3])))
    r = row["measured"]
    return Ratio(point, row["length"], r, row["lo"], row["hi"], row["rounds"], row["exact_s"], row["exact_s"] / r), (
        row["point"].startswith("held-out")
    )


def refit(cfg, path: Path) -> None:
    """The current model fitted to an earlier run's calibration points; its error there and at the held-out ones."""
    try:
        blob = json.loads(path.read_text())
        timed = [parsed(r, objectives.search_rows(cfg)) for r in blob["rows"]]
        shape = Shape(**blob["shape"])
    except (OSError, ValueError, KeyError, TypeError) as e:  # one line, exit 2: a bad input, not a crash
        print(f"error: --refit {path}: not a JSON this script wrote with --out ({e!r})", file=sys.stderr)
        raise SystemExit(2) from None
    model = fit(shape, [r for r, held in timed if not held], blob["engine"], blob["device"], blob["dtype"])
    print(f"refit of {path.name} ({blob['engine']}); coefficients (s per unit): {coefficients(model)}")
    table([model.row(r, "held-out" if held else "") for r, held in timed])


def coefficients(model) -> str:
    """The fitted coefficients, one "feature value" per row class, for the printed header."""
    return ", ".join(f"{k} {v:.3g}" for k, v in zip(model.as_dict()["features"], model.coef, strict=True))


def table(rows: list[dict]) -> None:
    print("| point | tokens | measured [95% CI] | rounds | predicted | error | FLOP bound | exact s |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['point']} | {r['length']} | {r['measured']:.3f} [{r['lo']:.3f}, {r['hi']:.3f}] | {r['rounds']} | "
              f"{r['predicted']:.3f} | {r['error']:+.1%} | {r['bound']:.3f} | {r['exact_s']:.2f} |")  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("study", type=Path)
    ap.add_argument("--engine", default=None, help="transformers | vllm (default: the study's)")
    ap.add_argument("--length", type=int, action="append", help="TTFT lengths (default: the study's)")
    ap.add_argument("--max-repeats", type=int, default=None)
    ap.add_argument("--heldout", type=int, default=3)
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--work", type=Path, default=Path("/tmp/ridgefill-ttft-calibration"))
    ap.add_argument("--out", type=Path)
    ap.add_argument("--refit", type=Path, help="an earlier run's JSON: refit its timings, time nothing")
    a = ap.parse_args()
    ttft = {"lengths": a.length} if a.length else {}
    if a.max_repeats:
        ttft["max_repeats"] = a.max_repeats
    over = {"objectives": {"ttft": ttft}} | ({"engine": a.engine} if a.engine else {})
    cfg = load_study(a.study, over)
    if a.refit:
        return refit(cfg, a.refit)
    if cfg.hardware.threads:
        import torch

        torch.set_num_threads(cfg.hardware.threads)
    lm, tok = load_model(model_path(cfg.model.local or cfg.model.repo))
    cal = cfg.calibration
    cap = run_capture(
        lm,
        tok,
        CalibrationText(cal.source, window=cal.window, max_windows=cal.max_windows, heldout=cal.heldout),
        sorted(cfg.search.splits),
        a.work,
        CaptureOptions(progress=False),
    )
    t0 = time.perf_counter()
    points = objectives.calibration_points(cfg)
    maps = objectives.calibration_maps(lm, tok, str(cap.path), cfg, sorted(cfg.search.splits), a.work / "maps")
    before = conditions()
    ratios = objectives.time_points(lm, maps, points, cfg, cfg.engine)
    shape = Shape.of(lm.config.to_dict())
    model = fit(shape, ratios, cfg.engine, cfg.hardware.device, cfg.model.dtype, before)
    cal_s = time.perf_counter() - t0
    try:
        checked(model)
        verdict = "model explains every calibration point within its CI"
    except CalibrationError as e:
        verdict = f"REFUSED: {e}"
    held = heldout_points(cfg, a.heldout, a.seed)
    t1 = time.perf_counter()
    measured = objectives.time_points(lm, maps, held, cfg, cfg.engine)
    held_s = time.perf_counter() - t1
    rows = model.table() + [model.row(m, "held-out") for m in measured]
    print(f"engine {cfg.engine}, lengths {cfg.objectives.ttft.lengths}, conditions {before}; {verdict}")
    print(f"calibration {cal_s:.0f} s, held-out run {held_s:.0f} s; coefficients (s per unit): {coefficients(model)}")
    table(rows)
    if a.out:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        blob = model.as_dict() | {"rows": rows, "verdict": verdict, "calibration_s": cal_s, "heldout_s": held_s}
        Path(str(a.out) + ".json").write_text(json.dumps(blob, indent=1, default=str))


if __name__ == "__main__":
    main()
