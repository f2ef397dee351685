"""The offline `prose` source (installed packages' README prose) against the essays, pydoc beside it (issue 27).

For each text: its SmolLM2 token count, SmolLM2's mean per-token NLL on `--windows` evenly spaced windows of
`--length` tokens (a ratio against the essays' evaluation half, measured in the same run, with a 95% bootstrap
CI over windows), and how its token unigram distribution compares with the essays' evaluation half and with
pydoc (Jensen-Shannon divergence, bits; coverage: the share of the other text's tokens whose type it has).

    python bench/prose_haystack.py --essays ../shared/data/essays --out bench/results/prose_haystack.json

Each window's NLL is written to --out as soon as it is measured; run it again with the same --out
(and --length/--windows) to go on where it stopped (a busy two-core machine may not finish in one command).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from ridgefill.corpus import load_corpus, token_stream, windows
from ridgefill.evals.paired import bootstrap_mean
from ridgefill.steps import load_model

BASELINE = "essays (evaluation half)"


def texts(essays: Path) -> dict[str, str | list[str]]:
    """The sources compared: essays split by file name as shared/data/README.md says (first half calibrates)."""
    files = sorted(str(f) for f in essays.glob("*.txt"))
    if len(files) < 2:
        raise SystemExit(f"error: --essays {essays} has no essays (.txt files): give ../shared/data/essays")
    half = len(files) // 2
    return {"prose": "prose", "pydoc": "pydoc", "essays (calibration half)": files[:half], BASELINE: files[half:]}


@torch.inference_mode()
def window_nll(model, stream: torch.Tensor, length: int, count: int, have: list[float], keep) -> list[float]:
    """Mean next-token NLL (nats) of each of `count` windows spread evenly over the stream; `have` holds those
    already measured, and `keep` is called after each new one (so a stopped run goes on where it was)."""
    wins = windows(stream, length)
    picks = np.unique(np.linspace(0, wins.shape[0] - 1, min(count, wins.shape[0])).round().astype(int))
    out = list(have)
    for i in picks[len(out) :]:
        ids = wins[int(i)][None]
        logits = model(input_ids=ids).logits[0, :-1].float()
        out.append(float(F.cross_entropy(logits, ids[0, 1:])))
        keep(out)
    return out


def ratio_ci(a: list[float], b: list[float], resamples: int = 4000, seed: int = 0) -> tuple[float, float, float]:
    """mean(a) / mean(b) with a 95% percentile bootstrap CI, windows resampled within each text."""
    rng = np.random.default_rng(seed)
    x, y = np.asarray(a), np.asarray(b)
    boot = x[rng.integers(0, x.size, (resamples, x.size))].mean(1) / y[
        rng.integers(0, y.size, (resamples, y.size))
    ].mean(1)
    lo, hi = np.percentile(boot, [2.5, 97.5])
    return float(x.mean() / y.mean()), float(lo), float(hi)


def unigram(stream: torch.Tensor, vocab: int) -> np.ndarray:
    return np.bincount(stream.numpy(), minlength=vocab).astype(np.float64)


def js_bits(p: np.ndarray, q: np.ndarray) -> float:
    """Jensen-Shannon divergence (bits, 0..1) of two count vectors."""
    p, q = p / p.sum(), q / q.sum()
    m = (p + q) / 2

    def kl(a: np.ndarray) -> float:
        keep = a > 0
        return float((a[keep] * np.log2(a[keep] / m[keep])).sum())

    return (kl(p) + kl(q)) / 2


def coverage(source: np.ndarray, other: np.ndarray) -> float:
    """Share of `other`'s token occurrences whose token type occurs in `source`."""
    return float(other[source > 0].sum() / other.sum())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--essays", type=Path, default=Path("../shared/data/essays"))
    ap.add_argument("--length", type=int, default=1024)
    ap.add_argument("--windows", type=int, default=8)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    if args.length < 2 or args.windows < 2:
        raise SystemExit("error: --length and --windows must be at least 2")
    sources = texts(args.essays)
    torch.set_num_threads(args.threads)
    t0 = time.time()
    done = measured(args.out, args.length, args.windows)
    model, tok = load_model("default")
    vocab = len(tok)
    rows: dict[str, dict] = {}
    for name, source in sources.items():
        corpus = load_corpus(source)
        stream = token_stream(corpus, tok)

        def keep(nll: list[float], name: str = name) -> None:
            done[name] = nll
            if args.out:
                save(args.out, {"length": args.length, "windows": args.windows, "partial": done})

        nll = window_nll(model, stream, args.length, args.windows, done.get(name, []), keep)
        rows[name] = {"documents": len(corpus.documents), "words": sum(len(d.split()) for d in corpus.documents),
                      "tokens": int(stream.numel()), "sha256": corpus.sha256, "nll": nll,
                      "counts": unigram(stream, vocab)}  # fmt: skip
        print(f"{name}: {rows[name]['tokens']} tokens, NLL {np.mean(nll):.3f}", file=sys.stderr)
    base, pydoc = rows[BASELINE], rows["pydoc"]
    out = {"command": " ".join(sys.argv), "length": args.length, "windows": args.windows, "texts": {}}
    print(f"| text | documents | words | SmolLM2 tokens | NLL nats/token (n windows of {args.length}) | "
          "NLL ratio vs essays eval half [95% CI] | JS vs essays eval (bits) | covers essays eval tokens | "
          "JS vs pydoc (bits) |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|")
    for name, r in rows.items():
        est = bootstrap_mean(r["nll"])
        ratio, lo, hi = ratio_ci(r["nll"], base["nll"])
        js_e, js_p = js_bits(r["counts"], base["counts"]), js_bits(r["counts"], pydoc["counts"])
        cov = coverage(r["counts"], base["counts"])
        nll = f"{est.mean:.3f} [{est.lo:.3f}, {est.hi:.3f}] (n={est.n})"
        print(f"| {name} | {r['documents']} | {r['words']} | {r['tokens']} | {nll} | {ratio:.3f} [{lo:.3f}, {hi:.3f}] "
              f"| {js_e:.3f} | {cov:.1%} | {js_p:.3f} |")  # fmt: skip
        out["texts"][name] = {k: v for k, v in r.items() if k != "counts"} | {
            "nll_mean": est.mean, "nll_ci95": [est.lo, est.hi], "nll_ratio": [ratio, lo, hi],
            "js_essays_eval_bits": js_e, "covers_essays_eval": cov, "js_pydoc_bits": js_p,
        }  # fmt: skip
    out["seconds"] = time.time() - t0
    if args.out:
        save(args.out, out)


def measured(path: Path | None, length: int, windows: int) -> dict[str, list[float]]:
    """Window NLLs already in `path` from a run with the same length and window count (text name -> NLLs)."""
    if path is None or not path.is_file():
        return {}
    old = json.loads(path.read_text())
    if (old.get("length"), old.get("windows")) != (length, windows):
        return {}
    return old.get("partial") or {name: t["nll"] for name, t in old.get("texts", {}).items()}


def save(path: Path, data: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=1))


if __name__ == "__main__":
    main()
