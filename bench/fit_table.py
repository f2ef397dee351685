"""Held-out per-layer fit quality, ridge vs identity fill, for several splits of one model.

Captures (or reuses) statistics on the calibration half of a text folder, fits each split, writes
ridge and identity map folders under --out, and prints a markdown table per split.

    python bench/fit_table.py --calib ../shared/data/essays --out /tmp/rf-bench/maps
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from ridgefill.steps import CalibrationText, build_map_pair, fit_report, load_model, run_capture


def calibration_files(folder: Path) -> list[str]:
    """The first half of the folder's .txt files by name: the other half is the evaluation haystack."""
    files = sorted(folder.glob("*.txt"))
    return [str(f) for f in files[: len(files) // 2]]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="default")
    ap.add_argument("--calib", type=Path, required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--splits", type=int, nargs="+", default=[10, 15, 18, 20])
    ap.add_argument("--lam", type=float, default=1e-2)
    ap.add_argument("--root", type=Path, default=None)
    args = ap.parse_args()
    model, tok = load_model(args.model)
    cap = run_capture(
        model, tok, CalibrationText(calibration_files(args.calib), max_windows=1000), args.splits, args.root
    )
    print(f"capture {cap.path}: {cap.meta['windows_done']} windows x {cap.meta['window']} tokens\n")
    for s in args.splits:
        path, _ = build_map_pair(
            fit_report(model, tok, cap, s, args.lam), args.out / f"S{s}-ridge", args.out / f"S{s}-identity"
        )
        fit = json.loads((path / "ridgefill.json").read_text())["fit"]
        held = fit["heldout"]
        print(f"### S = {s} (lambda {args.lam:g}, {fit['rows']} rows)\n")
        keys = ("h_rel", "k_rel", "v_rel", "k_cos")
        print("| layer | " + " | ".join(f"{k} ridge | {k} identity" for k in keys) + " |")
        print("|---" * (1 + 2 * len(keys)) + "|")
        for layer, m in sorted(held.items(), key=lambda kv: int(kv[0])):
            print(f"| {layer} | " + " | ".join(f"{m['ridge'][k]:.3f} | {m['identity'][k]:.3f}" for k in keys) + " |")
        means = [statistics.mean(m[kind][k] for m in held.values()) for k in keys for kind in ("ridge", "identity")]
        print("| **mean** | " + " | ".join(f"{v:.3f}" for v in means) + " |\n")


if __name__ == "__main__":
    main()
