"""Maps in bf16 against float32 (issue 25): what casting the maps to the serving dtype costs in K/V and dNLL.

The vLLM plugin casts a map folder's float32 weights to the serving dtype (bf16 on a GPU) and predicts bulk rows
with `addmm` in that dtype; this measures what that costs, on held-out windows the maps were never fitted on
(default: the offline `prose` source; the maps are fitted on the study's calibration text). Per late layer, the
predicted K and V against the exact ones (relative error, cosine per row), ridge and identity fill (h_l = h_S):

    f32         float32 model, float32 maps
    bf16-maps   float32 model activations; the split stream and the maps cast to bf16 and the prediction made in
                bf16 (`addmm`, as model.py does), then cast back for the float32 cache writer: the maps' cast alone
    bf16-model  the whole model in bf16 with bf16 maps, against that bf16 model's own exact K/V (what vLLM serves)

plus the bf16 model's exact K/V against the float32 model's (the floor a bf16 server starts from). Then dNLL
(RidgeFill plan vs exact, `evals.nll.doc_nll`) per window in float32 and in bf16, paired per window: the mean
difference with a t 95% CI (scipy) and the ratio of means with a paired bootstrap CI.

    python bench/maps_dtype.py studies/smollm2-135m.yaml --windows 8 --length 1024 --out /tmp/maps_dtype
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import numpy as np
import torch
from torch import Tensor, nn

from ridgefill import objectives
from ridgefill.adapters import adapter_for
from ridgefill.capture import CaptureOptions
from ridgefill.corpus import load_corpus, token_stream
from ridgefill.evals.nll import doc_nll, documents
from ridgefill.heldout import heldout_activations, mean_cosine, rel_error
from ridgefill.maps import MapSet
from ridgefill.params import Params
from ridgefill.rows import ROWS, RowPolicy
from ridgefill.runtime import FillPlan
from ridgefill.steps import CalibrationText, fit_trial, load_model, model_path, run_capture
from ridgefill.study import load_study

BF16 = torch.bfloat16
CONDITIONS = ("f32", "bf16-maps", "bf16-model")
FILLS = ("ridge", "identity")
METRICS = ("k_rel", "k_cos", "v_rel", "v_cos")
Quality = dict[str, dict[int, dict[str, dict[str, float]]]]  # condition -> layer -> fill -> metric


def fit_map_set(model: nn.Module, tokenizer, text: CalibrationText, split: int, lam: float, work: Path) -> MapSet:
    """The study's fit of one split (`steps.fit_trial` on the study's capture): a verified float32 map folder,
    the form the plugin loads and casts."""
    cap = run_capture(model, tokenizer, text, [split], work, CaptureOptions(progress=False))
    return fit_trial(model, tokenizer, str(cap.path), Params(split, lam, ROWS), work / f"maps-S{split}")


def _kv(model: nn.Module, layer: int, h: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
    """The layer's cache writer on rows h [n, d]: K and V as [n, kv_heads, head_dim]."""
    ad = adapter_for(model)
    k, v = ad.write_kv(ad.layers[layer], h[None], cos, sin)
    return k.transpose(1, 2)[0], v.transpose(1, 2)[0]


def _metrics(pred: tuple[Tensor, Tensor], true: tuple[Tensor, Tensor]) -> dict[str, float]:
    """Relative error and mean per-row cosine of K and V (`heldout`'s), computed in float32 whatever the dtype
    of either side (a bf16 reduction would add its own error to what is measured)."""
    out = {}
    for name, p, t in (("k", pred[0], true[0]), ("v", pred[1], true[1])):
        out[f"{name}_rel"], out[f"{name}_cos"] = rel_error(p.float(), t.float()), mean_cosine(p.float(), t.float())
    return out


@torch.inference_mode()
def window_quality(
    model32: nn.Module, model16: nn.Module, ids: Tensor, maps: dict[int, tuple[Tensor, Tensor]]
) -> tuple[Quality, dict[int, dict[str, float]]]:
    """One window [1, n] in every condition (module docstring), and the bf16 model's exact K/V against the float32
    model's per layer. Rows past the sink, as `heldout.score_maps` scores them; maps are float32 {layer: (w, b)}."""
    split = min(maps) - 1
    a32 = heldout_activations(model32, ids, split)[0]
    a16 = heldout_activations(model16, ids, split)[0]
    x32, x16 = a32.stream, a16.stream
    out: Quality = {c: {} for c in CONDITIONS}
    floor = {}
    for l, (w, b) in sorted(maps.items()):
        w16, b16 = w.to(BF16), b.to(BF16)
        true32 = _kv(model32, l, a32.inputs[l], a32.cos, a32.sin)
        true16 = _kv(model16, l, a16.inputs[l], a16.cos, a16.sin)
        preds = {
            "f32": (model32, a32, true32, torch.addmm(b.to(x32), x32, w.to(x32)), x32),
            "bf16-maps": (model32, a32, true32, torch.addmm(b16, x32.to(BF16), w16).to(x32), x32.to(BF16).to(x32)),
            "bf16-model": (model16, a16, true16, torch.addmm(b16, x16, w16), x16),
        }
        for cond, (m, a, true, ridge, ident) in preds.items():
            out[cond][l] = {
                f: _metrics(_kv(m, l, h, a.cos, a.sin), true) for f, h in zip(FILLS, (ridge, ident), strict=True)
            }
        floor[l] = _metrics(true16, true32)
    return out, floor


def mean_quality(per_window: list[Quality]) -> Quality:
    """Each condition, layer, fill and metric averaged over windows."""
    first = per_window[0]
    return {
        c: {
            l: {f: {k: sum(q[c][l][f][k] for q in per_window) / len(per_window) for k in METRICS} for f in FILLS}
            for l in first[c]
        }
        for c in first
    }


def overall(q: Quality) -> dict[str, dict[str, dict[str, float]]]:
    """Condition -> fill -> metric, the mean over late layers."""
    return {
        c: {f: {k: sum(m[f][k] for m in layers.values()) / len(layers) for k in METRICS} for f in FILLS}
        for c, layers in q.items()
    }


def mean_ci(values: list[float]) -> dict:
    """n, the mean and its t 95% CI (scipy); the CI collapses to the mean when the values do not vary."""
    from scipy import stats

    v = np.asarray(values, float)
    ci = [float(v.mean())] * 2
    if len(v) >= 2 and float(v.std(ddof=1)) > 0:
        t = stats.ttest_1samp(v, 0.0).confidence_interval(0.95)
        ci = [float(t.low), float(t.high)]
    return {"n": len(v), "mean": float(v.mean()), "ci95": ci}


def paired_difference(a: list[float], b: list[float], seed: int = 0) -> dict:
    """b against a, paired per window: the mean difference b - a with its t 95% CI, and mean(b) / mean(a) with a
    paired percentile-bootstrap 95% CI (scipy; None below 3 pairs or when mean(a) is 0)."""
    from scipy import stats

    x, y = np.asarray(a, float), np.asarray(b, float)
    diff = mean_ci(list(y - x))
    out = {"n": diff["n"], "mean_a": float(x.mean()), "mean_b": float(y.mean()), "diff": diff["mean"],
           "diff_ci95": diff["ci95"], "ratio": float(y.mean() / x.mean()) if x.mean() != 0 else None,
           "ratio_ci95": None}  # fmt: skip
    if len(x) >= 3 and x.mean() != 0:
        res = stats.bootstrap(
            (x, y), lambda u, v, axis=-1: v.mean(axis) / u.mean(axis), paired=True, vectorized=True,
            n_resamples=4000, method="percentile", random_state=np.random.default_rng(seed),
        )  # fmt: skip
        lo, hi = res.confidence_interval
        out["ratio_ci95"] = [float(lo), float(hi)] if math.isfinite(lo) and math.isfinite(hi) else None
    return out


def measure(
    model32: nn.Module, model16: nn.Module, maps: MapSet, windows: list[Tensor], rows: RowPolicy, scored: int
) -> dict:
    """K/V quality in every condition and paired dNLL (float32 and bf16) on each window [n] of `windows`."""
    per_window, floors, nll = [], [], {"f32": [], "bf16": []}
    bf16_maps = maps.to("cpu", BF16)  # what model.py serves: the folder's float32 maps cast to the serving dtype
    plans = {"f32": FillPlan("ridge", maps=maps, rows=rows), "bf16": FillPlan("ridge", maps=bf16_maps, rows=rows)}
    t0 = time.perf_counter()
    for i, ids in enumerate(windows):
        q, floor = window_quality(model32, model16, ids[None], maps.weights)
        per_window.append(q)
        floors.append(floor)
        for name, m in (("f32", model32), ("bf16", model16)):
            nll[name].append(doc_nll(m, ids, plans[name], scored, len(nll[name])))
        print(f"window {i + 1}/{len(windows)} done, {time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)
    quality = mean_quality(per_window)
    layers = sorted(floors[0])
    floor = {l: {k: sum(f[l][k] for f in floors) / len(floors) for k in METRICS} for l in layers}
    win_overall = [overall(q) for q in per_window]
    ridge = {c: {k: [w[c]["ridge"][k] for w in win_overall] for k in ("k_rel", "v_rel")} for c in CONDITIONS}
    kv_pairs = {
        f"{c}:{k}": paired_difference(ridge["f32"][k], ridge[c][k]) for c in CONDITIONS[1:] for k in ("k_rel", "v_rel")
    }
    dnll = {name: [d.dnll for d in docs] for name, docs in nll.items()}
    return {
        "split": maps.split,
        "layers": layers,
        "windows": len(windows),
        "tokens": int(windows[0].numel()),
        "scored": scored,
        "rows": rows.options(),
        "quality": {c: {str(l): v for l, v in layers_.items()} for c, layers_ in quality.items()},
        "overall": overall(quality),
        "bf16_exact_vs_f32": {"layers": {str(l): v for l, v in floor.items()},
                              "overall": {k: sum(v[k] for v in floor.values()) / len(floor) for k in METRICS}},
        "kv_ratio_vs_f32": kv_pairs,
        "dnll": {name: [{"window": d.index, "nll_exact": d.nll_exact, "nll_fill": d.nll_fill, "dnll": d.dnll,
                         "top1_agree": d.top1_agree} for d in docs] for name, docs in nll.items()},
        "dnll_paired": paired_difference(dnll["f32"], dnll["bf16"]),
        "dnll_mean": {name: mean_ci(values) for name, values in dnll.items()},
    }  # fmt: skip


def _ci(lo_hi: list[float] | None, fmt: str = "{:+.4f}") -> str:
    return "n/a" if lo_hi is None else "[" + ", ".join(fmt.format(v) for v in lo_hi) + "]"


def _rc(m: dict[str, float], kv: str) -> str:
    return f"{m[kv + '_rel']:.4f} / {m[kv + '_cos']:.4f}"


def table(report: dict) -> str:
    """The report as markdown: overall K/V quality, per-layer K and V, dNLL per window and paired."""
    lines = [f"Split {report['split']}, {report['windows']} windows of {report['tokens']} tokens, "
             f"late layers {report['layers'][0]}..{report['layers'][-1]} (mean over layers and windows).", "",
             "| condition | fill | K rel err | K cos | V rel err | V cos |", "|---|---|---|---|---|---|"]  # fmt: skip
    for c in CONDITIONS:
        for f in FILLS:
            m = report["overall"][c][f]
            lines.append(f"| {c} | {f} | {m['k_rel']:.4f} | {m['k_cos']:.4f} | {m['v_rel']:.4f} | {m['v_cos']:.4f} |")
    m = report["bf16_exact_vs_f32"]["overall"]
    lines.append(f"| bf16 model exact vs f32 exact | - | {m['k_rel']:.4f} | {m['k_cos']:.4f} | {m['v_rel']:.4f} | "
                 f"{m['v_cos']:.4f} |")  # fmt: skip
    for kv in ("k", "v"):
        lines += ["", f"{kv.upper()} per late layer, rel err / cos (ridge; identity in brackets):", "",
                  "| layer | f32 | bf16-maps | bf16-model | bf16 exact vs f32 |", "|---|---|---|---|---|"]  # fmt: skip
        for l in report["layers"]:
            cells = []
            for c in CONDITIONS:
                r, i = report["quality"][c][str(l)]["ridge"], report["quality"][c][str(l)]["identity"]
                cells.append(f"{_rc(r, kv)} ({_rc(i, kv)})")
            fl = report["bf16_exact_vs_f32"]["layers"][str(l)]
            lines.append(f"| {l} | " + " | ".join(cells) + f" | {_rc(fl, kv)} |")
    lines += ["", "Ridge K/V rel err against f32 (paired per window, ratio of means, paired bootstrap 95% CI):", "",
              "| condition | K rel err ratio [95% CI] | V rel err ratio [95% CI] |", "|---|---|---|"]  # fmt: skip
    for c in ("bf16-maps", "bf16-model"):
        k, v = report["kv_ratio_vs_f32"][f"{c}:k_rel"], report["kv_ratio_vs_f32"][f"{c}:v_rel"]
        lines.append(f"| {c} | {k['ratio']:.4f} {_ci(k['ratio_ci95'], '{:.4f}')} | "
                     f"{v['ratio']:.4f} {_ci(v['ratio_ci95'], '{:.4f}')} |")  # fmt: skip
    rows = report["rows"]
    lines += ["", f"dNLL (RidgeFill vs exact, nats/token, last {report['scored']} tokens; tail {rows['tail']}, "
              f"share {rows['share']}, select {rows['select']}):", "",
              "| window | f32 dNLL | bf16 dNLL | bf16 - f32 | f32 top-1 agree | bf16 top-1 agree |",
              "|---|---|---|---|---|---|"]  # fmt: skip
    for a, b in zip(report["dnll"]["f32"], report["dnll"]["bf16"], strict=True):
        lines.append(f"| {a['window']} | {a['dnll']:+.4f} | {b['dnll']:+.4f} | {b['dnll'] - a['dnll']:+.4f} | "
                     f"{a['top1_agree']:.3f} | {b['top1_agree']:.3f} |")  # fmt: skip
    p, f32, b16 = report["dnll_paired"], report["dnll_mean"]["f32"], report["dnll_mean"]["bf16"]
    lines += [
        "",
        f"n = {p['n']} windows. f32 dNLL {f32['mean']:+.4f} {_ci(f32['ci95'])}; bf16 dNLL "
        f"{b16['mean']:+.4f} {_ci(b16['ci95'])}; bf16 - f32 {p['diff']:+.4f} {_ci(p['diff_ci95'])} "
        f"(t 95% CI); bf16 / f32 {p['ratio']:.3f} {_ci(p['ratio_ci95'], '{:.3f}')} (paired bootstrap).",
    ]
    return "\n".join(lines)


def heldout_windows(tokenizer, source: str, length: int, count: int) -> list[Tensor]:
    """The first `count` non-overlapping `length`-token windows of `source` (as `eval nll` cuts documents)."""
    return documents(token_stream(load_corpus(source), tokenizer), length, count)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("study", type=Path)
    ap.add_argument("--split", type=int, default=18, help="the study's chosen split (docs/BENCHMARKS.md 12)")
    ap.add_argument("--lam", type=float, default=0.00316, help="the study's chosen relative lambda")
    ap.add_argument("--tail", type=int, default=256, help="dNLL plan's protected tail (the chosen trial's)")
    ap.add_argument("--share", type=float, default=0.15, help="dNLL plan's protected share (the chosen trial's)")
    ap.add_argument("--source", default="prose", help="held-out text; never the calibration source")
    ap.add_argument("--windows", type=int, default=8)
    ap.add_argument("--length", type=int, default=1024)
    ap.add_argument("--scored", type=int, default=None, help="dNLL's scored tokens (default: the study's)")
    ap.add_argument("--work", type=Path, default=Path("/tmp/ridgefill-maps-dtype"))
    ap.add_argument("--out", type=Path)
    a = ap.parse_args(argv)
    cfg = load_study(a.study)
    if a.source == cfg.calibration.source:
        ap.error(f"--source {a.source} is the study's calibration text; the maps were fitted on it")
    if cfg.hardware.threads:
        torch.set_num_threads(cfg.hardware.threads)
    t0 = time.perf_counter()
    path = model_path(cfg.model.local or cfg.model.repo)
    model32, tok = load_model(path, torch.float32)
    model16, _ = load_model(path, BF16)
    maps = fit_map_set(model32, tok, CalibrationText.of(cfg.calibration), a.split, a.lam, a.work)
    fit_s = time.perf_counter() - t0
    rows = objectives.search_rows(cfg).given(tail=a.tail, share=a.share)
    wins = heldout_windows(tok, a.source, a.length, a.windows)
    report = measure(model32, model16, maps, wins, rows, a.scored or cfg.objectives.nll.scored)
    report |= {"study": cfg.name, "lam": a.lam, "source": a.source, "calibration": cfg.calibration.source,
               "fit_s": fit_s, "total_s": time.perf_counter() - t0, "threads": torch.get_num_threads()}  # fmt: skip
    print(table(report))
    print(f"\nfit {report['fit_s']:.0f} s, total {report['total_s']:.0f} s on {report['threads']} threads")
    if a.out:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        Path(str(a.out) + ".json").write_text(json.dumps(report, indent=1))
    return report


if __name__ == "__main__":
    main()
