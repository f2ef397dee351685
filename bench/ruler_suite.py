"""The RULER suite, paired against exact prefill on the same samples.

Every synthetic RULER task (qa_1 / qa_2 too when their data is available offline) at each length, on
exact, identity fill, the ridge map, and the ridge map with a protected share chosen by token rarity,
by the question's attention, or at random. Per task and overall: the paired delta with a bootstrap
95% CI, McNemar's exact p per task, the filled-region score (samples whose needle lies in bulk rows),
how often a needle was protected whole, and the FLOP-bound speed-up (`ridgefill/flops.py`).

Exact outputs are cached by prompt (`--exact-cache`), so a plan added later reuses them. Rows are
appended to `--out`.jsonl as they are scored, in sample-major order (every plan scores sample i of
every task before sample i+1), so a run stopped early is still paired and resumes where it stopped.

    python bench/ruler_suite.py --maps maps/s18 --haystack ../shared/data/essays \
        --length 2048 --samples 20 --length 4096 --samples 10 --out bench/results/ruler_suite
"""

from __future__ import annotations

import argparse
import hashlib
import json
import time
from dataclasses import replace
from pathlib import Path

import torch

from ridgefill.adapters import adapter_for
from ridgefill.corpus import NAMED  # offline sources by name; any other --haystack is a folder
from ridgefill.evals.paired import paired_summary, region_breakdown
from ridgefill.evals.ruler import TASKS, TaskUnavailable, load_haystack, make_samples, region_of, sample_score
from ridgefill.flops import speedup_bound
from ridgefill.maps import load_maps
from ridgefill.rows import ROWS, RowPolicy
from ridgefill.runtime import (
    EarlyPass,
    FillPlan,
    Prefill,
    early_pass,
    generate,
    protected_rows,
    question_scores,
)
from ridgefill.steps import load_model

PLANS = ("exact", "identity", "ridge", "ridge+rarity", "ridge+question", "ridge+random")
NEEDLE_FREE = ("cwe", "fwe")  # no needle: no filled-region score


def haystack_files(folder: Path, half: str = "evaluation") -> list[Path]:
    """One half of a folder by name: the second ("evaluation", the default; the first is for fits) or the first
    ("calibration": a report set for a map fitted on other text, when the second half chose settings)."""
    files = sorted(folder.glob("*.txt"))
    if len(files) < 2:
        raise SystemExit(f"error: {folder} holds fewer than two .txt files; give a folder of essays or omit it")
    return files[len(files) // 2 :] if half == "evaluation" else files[: len(files) // 2]


def haystack_source(args) -> str | list[str]:
    """What `--haystack` names: a named offline source (pydoc, the default, or prose) or one half of a folder."""
    if args.haystack in NAMED:
        return args.haystack
    return [str(f) for f in haystack_files(Path(args.haystack), args.half)]


def make_plans(args, model, tok) -> dict[str, FillPlan]:
    maps = load_maps(args.maps, model, tok)
    base = FillPlan("ridge", maps=maps, rows=RowPolicy(sink=args.sink, tail=args.tail))
    share = dict(
        share=args.share, query=args.query, window=args.window, score_layers=args.score_layers, reach=args.reach
    )
    plans = {
        "exact": FillPlan(),
        "identity": FillPlan("identity", split=maps.split, rows=RowPolicy(sink=args.sink, tail=args.tail)),
        "ridge": base,
        "ridge+rarity": replace(base, rows=base.rows.given(select="rarity", **share)),
        "ridge+question": replace(base, rows=base.rows.given(select="question", **share)),
        "ridge+random": replace(base, rows=base.rows.given(select="random", **share)),
    }
    return {name: plans[name] for name in args.plans}


def plan_config(plan: FillPlan, engine: str = "transformers") -> dict:
    """What identifies a plan's rows in OUT.jsonl (vLLM rows are paired only with vLLM's exact rows)."""
    r = plan.rows
    cfg = {"mode": plan.mode, "split": plan.split, "sink": r.sink, "tail": r.tail, "share": r.share, "select": r.select,
           "query": r.query, "window": r.window, "score_layers": r.score_layers}  # fmt: skip
    reach = {"reach": r.reach} if r.reach else {}  # rows scored before reach existed stay paired
    return cfg | reach | ({"engine": engine} if engine != "transformers" else {})


def out_file(stem: Path, ext: str) -> Path:
    """OUT + ext (`--out r/c4k_0.15` writes r/c4k_0.15.jsonl: a dot in the stem is not a suffix to replace)."""
    return stem.with_name(stem.name + ext)


def prompt_key(ids: list[int]) -> str:
    return hashlib.sha1(json.dumps(ids).encode()).hexdigest()[:16]


def fraction_protected(keep: torch.Tensor, spans: list[tuple[int, int]]) -> float | None:
    """Share of needle rows that ran the whole model (None without needles)."""
    rows = [i for s, e in spans for i in range(s, e) if i < keep.numel()]
    return float(keep[rows].float().mean()) if rows else None


def score_one(model, tok, x, plan: FillPlan, early: EarlyPass | None = None) -> dict:
    kept: list[Prefill] = []
    t0 = time.perf_counter()
    ids = torch.tensor([x.input_ids])
    new = generate(model, ids, plan, x.max_new_tokens, on_prefill=kept.append, early=early)
    seconds = time.perf_counter() - t0
    text = tok.decode(new[0], skip_special_tokens=True)
    keep = kept[0].protected
    return {
        "score": sample_score(x.task, text, x.answers),
        "prediction": text,
        "seconds": round(seconds, 2),
        "protected": int(keep.sum()) + 1,  # + the last prompt row, run by the stock model
        "needle_protected": None if plan.mode == "exact" else fraction_protected(keep, x.needle_spans),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="default")
    ap.add_argument("--maps", type=Path, required=True, help="ridge map folder (its split is used for identity)")
    ap.add_argument(
        "--haystack", default="pydoc", help="pydoc (default), prose, or a folder of essays (one half: --half)"
    )
    ap.add_argument(
        "--half", choices=("evaluation", "calibration"), default="evaluation",
        help="which half of a --haystack folder by file name: the second (evaluation) or the first (calibration)",
    )  # fmt: skip
    ap.add_argument("--length", type=int, action="append", help="repeatable, with --samples in the same order")
    ap.add_argument("--samples", type=int, action="append", help="samples per task at each --length")
    ap.add_argument("--tasks", nargs="+", default=[t for t in TASKS if not t.startswith("qa")])
    ap.add_argument("--plans", nargs="+", default=list(PLANS), choices=PLANS)
    ap.add_argument("--sink", type=int, default=ROWS.sink)
    ap.add_argument("--tail", type=int, default=ROWS.tail)
    ap.add_argument("--share", type=float, default=0.15)
    ap.add_argument("--query", type=int, default=32)
    ap.add_argument("--window", type=int, default=4)
    ap.add_argument("--score-layers", type=int, default=3)
    ap.add_argument(
        "--reach", type=int, default=0, help="question selector: rows after a scored row that share its score"
    )
    ap.add_argument("--grid", nargs="*", default=[], metavar="Q:W:L:R", help="--coverage: question settings to compare")
    ap.add_argument(
        "--cap", nargs="*", default=[], metavar="PLAN=N",
        help="score PLAN on the first N samples of each task only (e.g. identity=10: the costliest plan, since a "
        "wrong answer decodes the whole budget); it is still paired with exact on those samples",
    )  # fmt: skip
    ap.add_argument(
        "--start", type=int, default=0,
        help="first sample index to score (split one suite over processes: the same prompts, other --out)",
    )  # fmt: skip
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument(
        "--engine", choices=("transformers", "vllm"), default="transformers",
        help="vllm: every task x length of a plan in one batch on one engine per plan (exact on stock vLLM), with "
        "the plan's paired TTFT at each length measured on the same engine; identity needs transformers",
    )  # fmt: skip
    ap.add_argument("--ttft-repeats", type=int, default=3, help="vllm: paired TTFT repeats per length")
    ap.add_argument("--exact-cache", type=Path, default=Path("bench/results/ruler_exact_cache.json"))
    ap.add_argument("--out", type=Path, required=True, help="stem: writes OUT.jsonl, OUT.json and OUT.md")
    ap.add_argument("--report-only", action="store_true", help="summarise OUT.jsonl without scoring more")
    ap.add_argument("--merge", nargs="*", type=Path, default=[], help="more .jsonl rows to report with OUT's")
    ap.add_argument(
        "--coverage", action="store_true",
        help="no decoding: how much of each needle each selector protects, for several query/window/layers",
    )  # fmt: skip
    args = ap.parse_args()
    try:
        args.cap = {name: int(n) for name, n in (c.split("=") for c in args.cap)}
    except ValueError:
        raise SystemExit("error: --cap takes PLAN=N pairs, e.g. --cap identity=10") from None
    lengths, counts = args.length or [2048], args.samples or [10]
    if len(counts) == 1:
        counts = counts * len(lengths)
    if len(counts) != len(lengths):
        raise SystemExit("error: give one --samples per --length (or a single --samples for all)")
    unknown = sorted(set(args.tasks) - set(TASKS))
    if unknown:
        raise SystemExit(f"error: unknown RULER task(s) {', '.join(unknown)}; known: {', '.join(TASKS)}")
    args.grid = selector_grid(args.grid)  # a bad --grid is refused before the model loads
    if not args.maps.is_dir():
        raise SystemExit(f"error: --maps {args.maps} is not a map folder; write one with `ridgefill fit`")
    if args.haystack not in NAMED and not Path(args.haystack).is_dir():
        raise SystemExit(f"error: --haystack {args.haystack} is neither pydoc, prose nor a folder of .txt files")

    model, tok = load_model(args.model)
    if args.coverage:
        return coverage(args, model, tok, lengths, counts)
    plans = make_plans(args, model, tok)
    rows_path = out_file(args.out, ".jsonl")
    rows_path.parent.mkdir(parents=True, exist_ok=True)
    rows = [json.loads(line) for line in rows_path.read_text().splitlines()] if rows_path.exists() else []
    for extra in args.merge:  # rows other processes scored (--start), reported together
        rows += [json.loads(line) for line in extra.read_text().splitlines()]
    if args.engine == "vllm" and "identity" in plans:
        raise SystemExit("error: identity fill has no map folder for vLLM; score it with --engine transformers")
    if not args.report_only:
        hay = load_haystack(haystack_source(args))
        if args.engine == "vllm":
            run_vllm(args, model, tok, plans, hay, lengths, counts, rows, rows_path)
        else:
            run(args, model, tok, plans, hay, lengths, counts, rows, rows_path)
    report(args, model.config, plans, rows, lengths)


def task_batches(args, tok, hay, length: int, n: int) -> dict:
    """{task: its n samples at this length}; a task whose data is missing offline is skipped, and said so."""
    batches = {}
    for task in args.tasks:
        try:
            batches[task] = make_samples(task, tok, length, hay, n, args.seed)
        except TaskUnavailable as e:
            print(f"skip {task}@{length}: {e}", flush=True)
    return batches


def run(args, model, tok, plans, hay, lengths, counts, rows, rows_path) -> None:
    cache = json.loads(args.exact_cache.read_text()) if args.exact_cache.exists() else {}
    done = {(r["plan"], r["task"], r["length"], r["index"], json.dumps(r["config"])) for r in rows}
    for length, n in zip(lengths, counts, strict=True):
        batches = task_batches(args, tok, hay, length, n)
        for index in range(args.start, n):
            for task, batch in batches.items():
                x = batch[index]
                region = region_of(x.needle_spans, len(x.input_ids), args.sink, args.tail)
                early = None  # layers 0..S-1 of the prompt's head, run once for every non-exact plan
                for name, plan in plans.items():
                    cfg = plan_config(plan)
                    if (name, task, length, index, json.dumps(cfg)) in done or index >= args.cap.get(name, n):
                        continue
                    key = f"{args.model}:{prompt_key(x.input_ids)}:{x.max_new_tokens}"
                    if name == "exact" and key in cache:
                        out = cache[key]
                    else:
                        if name != "exact" and early is None:
                            head = torch.tensor([x.input_ids[:-1]])
                            early = early_pass(model, head, plan.split, args.query, args.score_layers)
                        out = score_one(model, tok, x, plan, None if name == "exact" else early)
                        if name == "exact":
                            cache[key] = out
                            args.exact_cache.parent.mkdir(parents=True, exist_ok=True)
                            args.exact_cache.write_text(json.dumps(cache) + "\n")
                    row = {"plan": name, "task": task, "length": length, "index": index, "config": cfg,
                           "region": "exact" if name == "exact" else region, "answers": x.answers,
                           "depths": x.depths, "n_tokens": len(x.input_ids), **out}  # fmt: skip
                    rows.append(row)
                    with rows_path.open("a") as f:
                        f.write(json.dumps(row) + "\n")
                    print(f"{length} #{index} {task} {name}: {out['score']:.0f} ({out['seconds']}s)", flush=True)


def run_vllm(args, model, tok, plans, hay, lengths, counts, rows, rows_path) -> None:
    """One vLLM engine per plan and length (exact: stock vLLM) scores every task's samples in one batch per task,
    then the plan's paired TTFT at that length on the same engine (OUT.ttft.jsonl). Rows carry the engine in
    their config, so they pair only with vLLM's own exact rows; `protected` is the policy's row count."""
    from types import SimpleNamespace

    from ridgefill.objectives import VllmJob, run_vllm_job
    from ridgefill.study import Ruler

    files = haystack_source(args)
    ttft_path = out_file(args.out, ".ttft.jsonl")
    for length, n in zip(lengths, counts, strict=True):
        batches = task_batches(args, tok, hay, length, n)
        for name, plan in plans.items():
            cfg = plan_config(plan, "vllm")
            done = {(r["task"], r["index"]) for r in rows if r["plan"] == name and r["length"] == length
                    and r["config"] == cfg}  # fmt: skip
            cap = min(n, args.cap.get(name, n))
            if all((t, i) in done for t in batches for i in range(args.start, cap)):
                continue
            ruler = Ruler(tasks=list(batches), lengths=[length], samples=cap, haystack=files, seed=args.seed)
            ttft = None if name == "exact" else SimpleNamespace(lengths=[length], repeats=args.ttft_repeats, warmup=1)
            t0 = time.perf_counter()
            job = VllmJob.of(model, "float32", None if name == "exact" else plan).scoring(ruler, range(args.start, cap))
            out = run_vllm_job(job if ttft is None else job.timing(ttft))
            seconds = time.perf_counter() - t0
            for r in [r for r in out["ruler"]["samples"] if r["plan"] == "p"]:
                x = batches[r["task"]][r["index"]]
                n_tok = len(x.input_ids)
                row = {**r, "plan": name, "config": cfg, "n_tokens": n_tok, "seconds": None,
                       "protected": n_tok if plan.mode == "exact" else plan.rows.protected(n_tok),
                       "needle_protected": None}  # fmt: skip
                row.pop("tokens", None)
                rows.append(row)
                with rows_path.open("a") as f:
                    f.write(json.dumps(row) + "\n")
            if ttft is not None:
                res = {"plan": name, "length": length, "config": cfg, **out["ttft"][str(length)]}
                with ttft_path.open("a") as f:
                    f.write(json.dumps(res) + "\n")
            speed = f", TTFT {out['ttft'][str(length)]['speedup']:.2f}x" if ttft is not None else ""
            print(f"{length} {name} on vLLM: {seconds:.0f}s{speed}", flush=True)


SELECTOR_GRID = [("rarity", 0, 0, 0, 0), ("random", 0, 0, 0, 0)] + [
    ("question", q, w, layers, 0) for q in (32, 64) for w in (2, 4, 8) for layers in (3, 6)
]


def selector_grid(specs: list[str]) -> list[tuple]:
    """The coverage grid: SELECTOR_GRID, or rarity, random and the question settings given as Q:W:LAYERS:REACH."""
    if not specs:
        return SELECTOR_GRID
    try:
        question = [("question", *(int(v) for v in spec.split(":"))) for spec in specs]
        if any(len(g) != 5 for g in question):
            raise ValueError(specs)
    except ValueError:
        raise SystemExit("error: --grid takes QUERY:WINDOW:LAYERS:REACH, e.g. 32:4:3:16") from None
    return SELECTOR_GRID[:2] + question


def coverage(args, model, tok, lengths, counts) -> None:
    """Share of needle rows each selector protects at `--share` (one early pass per prompt, no decoding)."""
    maps, ad = load_maps(args.maps, model, tok), adapter_for(model)
    hay = load_haystack(haystack_source(args))
    tasks = [t for t in args.tasks if t not in NEEDLE_FREE]
    grid = args.grid
    rows_path = out_file(args.out, ".coverage.jsonl")
    rows_path.parent.mkdir(parents=True, exist_ok=True)
    for length, n in zip(lengths, counts, strict=True):
        batches = {t: make_samples(t, tok, length, hay, n, args.seed) for t in tasks}
        for index in range(n):
            for task, batch in batches.items():
                x = batch[index]
                if region_of(x.needle_spans, len(x.input_ids), args.sink, args.tail) != "bulk":
                    continue
                ids = torch.tensor([x.input_ids[:-1]])
                early = early_pass(model, ids, maps.split, 64, 6)
                for select, q, w, layers, reach in grid:
                    knobs = dict(query=q, window=w, score_layers=layers, reach=reach) if select == "question" else {}
                    rows = RowPolicy(args.sink, args.tail - 1, args.share, select, **knobs)
                    plan = FillPlan("ridge", maps=maps, rows=rows)
                    attention = question_scores(ad, early, plan) if select == "question" else None
                    keep = protected_rows(ids, plan, attention)
                    spans = [(s, e) for s, e in x.needle_spans if s < ids.shape[1] - plan.rows.tail]
                    row = {"task": task, "length": length, "index": index, "select": select, "query": q,
                           "window": w, "score_layers": layers, "reach": reach, "share": args.share,
                           "tail": args.tail,
                           "needle_rows": fraction_protected(keep, spans),
                           "whole": [bool(keep[s:e].all()) for s, e in spans]}  # fmt: skip
                    with rows_path.open("a") as f:
                        f.write(json.dumps(row) + "\n")
                print(f"{length} #{index} {task}: done", flush=True)
    rows = [json.loads(line) for line in rows_path.read_text().splitlines()]
    lines = [
        f"share {args.share}, sink {args.sink}, tail {args.tail}; needles in filled rows only",
        "",
        "| length | selector | query | window | layers | reach | prompts | needle rows protected "
        "| needles kept whole |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for length in lengths:
        for select, q, w, layers, reach in grid:
            at = [r for r in rows if r["length"] == length and r["share"] == args.share and r.get("tail") == args.tail
                  and (r["select"], r["query"], r["window"], r["score_layers"], r.get("reach", 0))
                  == (select, q, w, layers, reach)]  # fmt: skip
            if not at:
                continue
            whole = [b for r in at for b in r["whole"]]
            frac = sum(r["needle_rows"] for r in at) / len(at) * 100
            label = (select, q, w, layers, reach) if select == "question" else (select, "-", "-", "-", "-")
            lines.append(
                f"| {length} | "
                + "{} | {} | {} | {} | {} | ".format(*label)
                + f"{len(at)} | {frac:.0f}% | {sum(whole)}/{len(whole)} |"
            )
    md = "\n".join(lines)
    print(md)
    out_file(args.out, ".coverage.md").write_text(md + "\n")


def report(args, cfg, plans: dict[str, FillPlan], rows: list[dict], lengths: list[int]) -> None:
    """Write OUT.json (every sample and the summaries) and OUT.md (the tables), and print the tables."""
    current = {name: json.dumps(plan_config(p, args.engine)) for name, p in plans.items()}
    ttft = measured_ttft(args, current)
    rows = [r for r in rows if current.get(r["plan"]) == json.dumps(r["config"])]
    needle_tasks = [t for t in args.tasks if t not in NEEDLE_FREE]
    summary, lines = {}, []
    lines.append(
        "| plan | length | tasks | n | mean score | paired delta [95% CI] | filled-region score (exact) [n] "
        "| needle rows protected | FLOP bound | measured TTFT |"
    )
    lines.append("|---|---|---|---|---|---|---|---|---|---|")
    for name, plan in plans.items():
        if name == "exact":
            continue
        s = paired_summary(rows, name)
        summary[name] = {"tasks": {f"{t}@{n}": _jsonable(v) for (t, n), v in s["tasks"].items()}, "overall": {}}
        for length, o in s["overall"].items():
            at = [r for r in rows if r["plan"] == name and r["length"] == length]
            region = region_breakdown([r for r in rows if r["length"] == length], name, tasks=needle_tasks)
            bulk = region.get("bulk", {"n": 0, "score": float("nan"), "reference": float("nan")})
            fracs = [r["needle_protected"] for r in at if r["needle_protected"] is not None and r["region"] == "bulk"]
            protected = sum(r["protected"] for r in at) / len(at)
            bound = speedup_bound(cfg, length, plan.split, round(protected)) if plan.mode != "exact" else 1.0
            whole = sum(f == 1.0 for f in fracs)
            summary[name]["overall"][str(length)] = {
                **_jsonable(o), "regions": region, "needles_whole": whole, "needles_in_bulk": len(fracs),
                "needle_rows_protected": sum(fracs) / len(fracs) if fracs else None, "flop_bound": bound,
            }  # fmt: skip
            n_tasks = len({k for k in s["tasks"] if k[1] == length})
            lines.append(
                f"| {name} | {length} | {n_tasks} | {o['delta'].n} | {o['score']:.1f} (exact {o['reference']:.1f}) | "
                f"{o['delta']} | {bulk['score']:.1f} ({bulk['reference']:.1f}) [{bulk['n']}] | "
                f"{(sum(fracs) / len(fracs) * 100) if fracs else float('nan'):.0f}% ({whole}/{len(fracs)} whole) | "
                f"{bound:.2f}x | {ttft.get((name, length), '-')} |"
            )
    lines += ["", _task_table(plans, summary, rows)]
    md = "\n".join(lines)
    print(md)
    result = {
        "config": {
            k: [str(x) for x in v] if k == "merge" else (str(v) if isinstance(v, Path) else v)
            for k, v in vars(args).items()
        },  # fmt: skip
        "plans": {name: plan_config(p) for name, p in plans.items()},
        "summary": summary,
        "samples": rows,
    }
    result["config"]["maps"] = args.maps.name
    out_file(args.out, ".json").write_text(json.dumps(result, indent=1) + "\n")
    out_file(args.out, ".md").write_text(md + "\n")


def measured_ttft(args, current: dict[str, str]) -> dict[tuple[str, int], str]:
    """{(plan, length): "1.23x [lo, hi]"} from OUT.ttft.jsonl (vLLM runs), the latest row of each current plan."""
    path = out_file(args.out, ".ttft.jsonl")
    rows = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
    out = {}
    for r in rows:
        if current.get(r["plan"]) == json.dumps(r["config"]):
            lo, hi = r["speedup_ci95"]
            out[(r["plan"], r["length"])] = f"{r['speedup']:.2f}x [{lo:.2f}, {hi:.2f}]"
    return out


def _jsonable(cell: dict) -> dict:
    return {k: (v.as_dict() if hasattr(v, "as_dict") else v) for k, v in cell.items()}


def _task_table(plans, summary, rows) -> str:
    names = [p for p in plans if p != "exact"]
    head = "| task@length | n | exact | " + " | ".join(f"{p} delta (p)" for p in names) + " |"
    lines = [head, "|---|---|---|" + "---|" * len(names)]
    keys = sorted({k for p in names for k in summary[p]["tasks"]}, key=lambda k: (int(k.split("@")[1]), k))
    for key in keys:
        cells, n, ref = [], "-", "-"
        for p in names:
            c = summary[p]["tasks"].get(key)
            if c is None:
                cells.append("-")
                continue
            n, ref = c["delta"]["n"], f"{c['reference']:.1f}"
            d = c["delta"]
            cells.append(f"{d['mean']:+.1f} [{d['lo']:+.0f}, {d['hi']:+.0f}] (p={c['p']:.2g})")
        lines.append(f"| {key} | {n} | {ref} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
