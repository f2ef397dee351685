"""Closed-form fit levers, held out: which change to the ridge fit brings filled K/V closer to exact.

Every lever is a ridge fit on the same calibration windows, scored on the same held-out windows:
  - `features`: the split stream h_S alone, or h_S with h_{S-1} and h_{S-2} beside it (a wider input);
  - `target`: the late layer's input h_l (today: K/V then come from the layer's own norm and projections),
    or the layer's K and V directly (pre-RoPE; RoPE is a rotation, so K error is the same after it);
  - `shrink`: direct K/V rescaled per channel so the predictions' variance matches the true one
    (ridge shrinks predictions towards the mean; attention logits are sensitive to the keys' spread);
  - `tokens`: the first half of the calibration windows against all of them.
Scores per late layer, averaged over layers and held-out windows: K and V relative error on bulk rows,
and the relative error of the attention output of the last `query` rows (true queries, exact sink and
tail K/V, filled bulk K/V) -- the quantity a decoded answer actually reads. Identity fill is the floor.

One pass collects float64 sums for the widest features and both targets; every lever is a slice of them.

    python bench/fit_levers.py --source $(ls ../shared/data/essays/*.txt | sort | head -20) \
        --splits 15 18 --window 2048 --heldout 3 --out bench/results/fit_levers
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor

from ridgefill.adapters import adapter_for
from ridgefill.adapters.base import rope
from ridgefill.capture import layer_inputs
from ridgefill.steps import calibration_windows, load_model

DEPTH = 3  # source layers S, S-1, S-2 for the wide input


@dataclass
class Sums:
    """Float64 sums over calibration rows: x = [h_S, h_S-1, h_S-2], y_l = [h_l, K_l, V_l]."""

    n: int = 0
    x: Tensor | None = None
    xx: Tensor | None = None
    y: dict[int, Tensor] = field(default_factory=dict)
    xy: dict[int, Tensor] = field(default_factory=dict)
    yy_diag: dict[int, Tensor] = field(default_factory=dict)

    def add(self, x: Tensor, ys: dict[int, Tensor]) -> None:
        x = x.double()
        if self.x is None:
            self.x, self.xx = torch.zeros(x.shape[1], dtype=x.dtype), torch.zeros(x.shape[1], x.shape[1], dtype=x.dtype)
        self.n += x.shape[0]
        self.x += x.sum(0)
        self.xx += x.T @ x
        for l, y in ys.items():
            y = y.double()
            if l not in self.y:
                self.y[l], self.xy[l] = (
                    torch.zeros(y.shape[1], dtype=y.dtype),
                    torch.zeros(x.shape[1], y.shape[1], dtype=y.dtype),
                )
                self.yy_diag[l] = torch.zeros(y.shape[1], dtype=y.dtype)
            self.y[l] += y.sum(0)
            self.xy[l] += x.T @ y
            self.yy_diag[l] += (y * y).sum(0)

    def copy(self) -> Sums:
        c = lambda d: {k: v.clone() for k, v in d.items()}  # noqa: E731
        return Sums(self.n, self.x.clone(), self.xx.clone(), c(self.y), c(self.xy), c(self.yy_diag))


def kv_rows(ad, layer, h: Tensor) -> tuple[Tensor, Tensor]:
    """Pre-RoPE K and V of rows h [n, d], each flattened to [n, kv_heads * head_dim]."""
    ones, zeros = torch.ones(1, h.shape[0], ad.head_dim), torch.zeros(1, h.shape[0], ad.head_dim)
    k, v = ad.write_kv(layer, h[None], ones.to(h), zeros.to(h))
    flat = lambda t: t[0].transpose(0, 1).reshape(h.shape[0], -1)  # noqa: E731
    return flat(k), flat(v)


def window_rows(ad, model, ids: Tensor, split: int) -> tuple[Tensor, dict[int, Tensor]]:
    """(x [n, DEPTH*d], {l: [h_l, K_l, V_l] [n, d + 2 kvd]}) for every row of one window."""
    inputs = layer_inputs(model, ids[None], set(range(split - DEPTH + 1, ad.num_layers)))
    x = torch.cat([inputs[split - i] for i in range(DEPTH)], dim=1)
    ys = {}
    for l in range(split + 1, ad.num_layers):
        h = inputs[l]
        ys[l] = torch.cat([h, *kv_rows(ad, ad.layers[l], h)], dim=1)
    return x, ys


def solve(s: Sums, cols: slice, l: int, tcols: slice, lam: float) -> tuple[Tensor, Tensor]:
    """Centred ridge on feature columns `cols` for target columns `tcols` of layer l, λ relative to mean eig."""
    n, xm = s.n, s.x[cols] / s.n
    cxx = s.xx[cols, cols] - n * torch.outer(xm, xm)
    ym = s.y[l][tcols] / n
    cxy = s.xy[l][cols, tcols] - n * torch.outer(xm, ym)
    ev, q = torch.linalg.eigh((cxx + cxx.T) / 2)
    ev = ev.clamp_min(0)
    w = q @ ((q.T @ cxy) / (ev + lam * ev.mean())[:, None])
    return w, ym - xm @ w


def shrink_scale(s: Sums, cols: slice, l: int, tcols: slice, w: Tensor) -> Tensor:
    """Per-channel factor sqrt(var true / var predicted) on calibration rows, from the sums alone."""
    n, xm = s.n, s.x[cols] / s.n
    cxx = s.xx[cols, cols] - n * torch.outer(xm, xm)
    ym = s.y[l][tcols] / n
    var_true = s.yy_diag[l][tcols] / n - ym * ym
    var_pred = ((cxx @ w) * w).sum(0) / n
    return (var_true / var_pred.clamp_min(1e-12)).clamp_min(0).sqrt()


def attention(q, cos, sin, mask, scale, gqa, heads, k: Tensor, v: Tensor) -> Tensor:
    """The last rows' attention output over all K/V rows (flattened, pre-RoPE)."""
    kr = rope(heads(k), cos, sin)
    return F.scaled_dot_product_attention(q, kr, heads(v), attn_mask=mask, scale=scale, enable_gqa=gqa)


def rel(a: Tensor, b: Tensor) -> float:
    return float((a - b).norm() / b.norm())


def score_window(ad, model, ids: Tensor, split: int, sink: int, tail: int, query: int, levers: dict) -> dict:
    """{lever: {l: (k_rel, v_rel, attn_rel)}} on one held-out window: bulk rows filled, the rest exact."""
    n, d = ids.shape[0], ad.config.hidden_size
    kvd = ad.num_kv_heads * ad.head_dim
    x, ys = window_rows(ad, model, ids, split)
    bulk = slice(sink, n - tail)
    cos, sin = ad.rotary(x[None], torch.arange(n))
    heads = lambda t: t.reshape(1, n, -1, ad.head_dim).transpose(1, 2)  # noqa: E731
    mask = torch.ones(query, n, dtype=torch.bool).tril(n - query)
    gqa = ad.num_heads != ad.num_kv_heads
    out: dict[str, dict[int, tuple[float, float, float]]] = {}
    for l, y in ys.items():
        layer = ad.layers[l]
        k_true, v_true = y[:, d : d + kvd], y[:, d + kvd :]
        q = ad.queries(layer, layer.input_layernorm(y[-query:, :d][None])).transpose(1, 2)
        q = rope(q, cos[:, -query:], sin[:, -query:])

        attend = partial(attention, q, cos, sin, mask, layer.self_attn.scaling, gqa, heads)
        a_true = attend(k_true, v_true)
        for name, fill in levers.items():
            k_pred, v_pred = fill(l, x[bulk])
            k, v = k_true.clone(), v_true.clone()
            k[bulk], v[bulk] = k_pred.to(k), v_pred.to(v)
            out.setdefault(name, {})[l] = (
                rel(k[bulk], k_true[bulk]),
                rel(v[bulk], v_true[bulk]),
                rel(attend(k, v), a_true),
            )
    return out


def h_lever(ad, maps: dict, d: int):
    """Today's path: predict h_l, then the layer's own norm and K/V projections."""

    def fill(l: int, x: Tensor) -> tuple[Tensor, Tensor]:
        w, b = maps[l]
        h = (x[:, : w.shape[0]].double() @ w + b).float()
        return kv_rows(ad, ad.layers[l], h)

    return fill


def kv_lever(maps: dict, kvd: int, shrink: dict | None = None):
    """Predict pre-RoPE K and V directly; `shrink` {l: (mean, scale)} rescales deviations per channel."""

    def fill(l: int, x: Tensor) -> tuple[Tensor, Tensor]:
        w, b = maps[l]
        y = x[:, : w.shape[0]].double() @ w + b
        if shrink is not None:
            mean, scale = shrink[l]
            y = mean + (y - mean) * scale
        y = y.float()
        return y[:, :kvd], y[:, kvd:]

    return fill


def identity_lever(ad, d: int):
    def fill(l: int, x: Tensor) -> tuple[Tensor, Tensor]:
        return kv_rows(ad, ad.layers[l], x[:, :d].float())

    return fill


def build_levers(ad, sums: dict[str, Sums], lam: float) -> tuple[dict, dict]:
    """{name: fill} and {name: multiply-adds per filled row per late layer}."""
    d, kvd = ad.config.hidden_size, ad.num_kv_heads * ad.head_dim
    full, half = sums["all"], sums["half"]
    late = sorted(full.y)
    hcols, kvcols = slice(0, d), slice(d, d + 2 * kvd)
    levers, cost = {"identity": identity_lever(ad, d)}, {"identity": d * 2 * kvd}
    for depth in (1, DEPTH):
        cols = slice(0, depth * d)
        tag = "h_S" if depth == 1 else f"h_S..S-{depth - 1}"
        hm = {l: solve(full, cols, l, hcols, lam) for l in late}
        levers[f"h <- {tag}"], cost[f"h <- {tag}"] = h_lever(ad, hm, d), depth * d * d + d * 2 * kvd
        km = {l: solve(full, cols, l, kvcols, lam) for l in late}
        levers[f"kv <- {tag}"], cost[f"kv <- {tag}"] = kv_lever(km, kvd), depth * d * 2 * kvd
        if depth == 1:
            xm = full.x[cols] / full.n
            shrink = {l: (xm @ km[l][0] + km[l][1], shrink_scale(full, cols, l, kvcols, km[l][0])) for l in late}
            name = "kv <- h_S, var-matched"
            levers[name], cost[name] = kv_lever(km, kvd, shrink), d * 2 * kvd
            hh = {l: solve(half, cols, l, hcols, lam) for l in late}
            levers["h <- h_S, half tokens"], cost["h <- h_S, half tokens"] = h_lever(ad, hh, d), d * d + d * 2 * kvd
    return levers, cost


def mean_over(rows: list[dict]) -> dict[str, tuple[float, float, float]]:
    """Average (k, v, attn) over windows and late layers, per lever."""
    out = {}
    for name in rows[0]:
        vals = [v for r in rows for v in r[name].values()]
        out[name] = tuple(sum(v[i] for v in vals) / len(vals) for i in range(3))
    return out


@torch.inference_mode()
def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="default")
    ap.add_argument("--source", nargs="+", required=True)
    ap.add_argument("--splits", type=int, nargs="+", default=[18])
    ap.add_argument("--window", type=int, default=2048)
    ap.add_argument("--max-windows", type=int, default=1000)
    ap.add_argument("--heldout", type=int, default=3)
    ap.add_argument("--lambdas", type=float, nargs="+", default=[3e-3])
    ap.add_argument("--sink", type=int, default=4)
    ap.add_argument("--tail", type=int, default=256)
    ap.add_argument("--query", type=int, default=32)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    model, tok = load_model(args.model)
    ad = adapter_for(model)
    cal, held, corpus_sha = calibration_windows(tok, args.source, args.window, args.max_windows, args.heldout)
    report = {
        "corpus_sha256": corpus_sha,
        "windows": int(cal.shape[0]),
        "heldout": int(held.shape[0]),
        "window": args.window,
        "sink": args.sink,
        "tail": args.tail,
        "query": args.query,
        "splits": {},
    }
    lines = []
    for split in args.splits:
        sums, half = Sums(), None
        for i in range(cal.shape[0]):
            x, ys = window_rows(ad, model, cal[i], split)
            sums.add(x[args.sink :], {l: y[args.sink :] for l, y in ys.items()})
            if i + 1 == cal.shape[0] // 2:
                half = sums.copy()
            print(f"split {split}: calibration window {i + 1}/{cal.shape[0]}", flush=True)
        for lam in args.lambdas:
            levers, cost = build_levers(ad, {"all": sums, "half": half}, lam)
            rows = [
                score_window(ad, model, held[i], split, args.sink, args.tail, args.query, levers)
                for i in range(held.shape[0])
            ]
            means = mean_over(rows)
            report["splits"].setdefault(str(split), {})[f"{lam:g}"] = {
                "rows": sums.n,
                "half_rows": half.n,
                "levers": {
                    k: {"k_rel": v[0], "v_rel": v[1], "attn_rel": v[2], "madds_per_row_layer": cost[k]}
                    for k, v in means.items()
                },
                "per_layer": {k: {str(l): list(v) for l, v in rows[0][k].items()} for k in rows[0]},
            }
            lines += [
                f"### S = {split}, lambda {lam:g} ({sums.n} calibration rows; half: {half.n})",
                "",
                "| lever | K rel err | V rel err | attention-output rel err (last "
                f"{args.query} rows) | multiply-adds per filled row per late layer |",
                "|---|---|---|---|---|",
            ]
            lines += [
                f"| {k} | {v[0]:.3f} | {v[1]:.3f} | {v[2]:.3f} | {cost[k] / 1e3:.0f}K |" for k, v in means.items()
            ]
            lines.append("")
            print("\n".join(lines[-len(means) - 4 :]), flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(report, indent=1))
    args.out.with_suffix(".md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
