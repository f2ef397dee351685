"""Study cost model: how long a study will take, estimated before it starts.

Every phase is a FLOP or byte count (`ridgefill.flops` for the layers) divided by a rate: prefill is
compute-bound (FLOPs / effective FLOP/s), a decode step memory-bound (weights plus the batch's K/V cache
read once per step / effective bandwidth), the capture's statistics are float64 GEMMs. Rates come from a
seconds-long warm-up of the study's model on this machine (CPU studies) or from `GPU_RATES` (GPU
studies: assumed fractions of the datasheet peaks; an estimate until measured on that GPU).

Upper bounds where the run's work depends on the outcome: every RULER sample decodes its full
`max_new_tokens` (real answers often stop earlier at EOS), trial prefill uses the cheapest-to-fill corner
of the search space (smallest split, largest tail and share).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

from ridgefill.capture import stats_bytes
from ridgefill.decision import decide
from ridgefill.engines import ENGINES, serving_engine
from ridgefill.evals.ruler import SPECS
from ridgefill.flops import layer_flops, speedup_bound
from ridgefill.study import Study

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
PROMOTED_SHARE = 0.5  # an assumed outcome, not a measurement: the share of trials near the front (promoted)
SHAPE_KEYS = (
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "vocab_size",
)


class CostError(ValueError):
    """The estimate cannot be made (no model shape offline) or exceeds the study's budget."""


@dataclass(frozen=True)
class Shape:
    """What the cost model needs of a config; attribute names as in transformers configs."""

    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int

    @classmethod
    def of(cls, cfg: dict) -> Shape:
        c = dict(cfg)
        c.setdefault("num_key_value_heads", c.get("num_attention_heads"))
        if not c.get("head_dim"):
            c["head_dim"] = c["hidden_size"] // c["num_attention_heads"]
        missing = [k for k in SHAPE_KEYS if c.get(k) is None]
        if missing:
            raise CostError(f"the model shape lacks {', '.join(missing)}")
        return cls(**{k: int(c[k]) for k in SHAPE_KEYS})

    @property
    def layer_params(self) -> int:
        d, h, kv, hd = self.hidden_size, self.num_attention_heads, self.num_key_value_heads, self.head_dim
        return 2 * d * h * hd + 2 * d * kv * hd + 3 * d * self.intermediate_size

    @property
    def params(self) -> int:
        """Weights read by a decode step: the layers and the lm head (embeddings are a row lookup)."""
        return self.num_hidden_layers * self.layer_params + self.vocab_size * self.hidden_size

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        return self.num_hidden_layers * 2 * self.num_key_value_heads * self.head_dim * dtype_bytes


@dataclass(frozen=True)
class Rates:
    """Effective rates of one machine; `source` says where they come from (measured, or table: estimate)."""

    name: str
    prefill: float  # FLOP/s of a prefill on the study's engine
    prefill_hf: float  # FLOP/s of a transformers-runtime prefill (dNLL, and RULER/TTFT with that engine)
    f64: float  # FLOP/s of float64 GEMMs where the capture's statistics accumulate
    host_f64: float  # FLOP/s of float64 on the host (the fit's eigendecomposition and solves)
    bandwidth: float  # bytes/s a decode step reads weights and K/V at
    step_floor: float = 0.0  # s per decode step regardless of size (launches, Python)
    engine_start: float = 0.0  # s to start one vLLM engine (load weights and maps, warm up)
    model_load: float = 0.0  # s to load the model into the flow's process
    disk: float = 1e9  # bytes/s for checkpoints and map files
    source: str = ""

    def rate(self, engine: str) -> float:
        """FLOP/s of a prefill on `engine`: a serving engine's, else the transformers runtime's."""
        return self.prefill if ENGINES[engine].serving else self.prefill_hf

    def start(self, engine: str) -> float:
        """Seconds to start `engine` for one job (0: it runs in the flow's process)."""
        return self.engine_start if ENGINES[engine].serving else 0.0


@dataclass(frozen=True)
class Assumed:
    """A gate whose outcomes are assumed, not measured: `decide` walked with it says what a trial scores and times
    (the trial neither fails early nor at the end; `promoted` says whether it clears the bar)."""

    samples: int
    promote: int | None
    promoted: bool
    bar: dict | None = None

    def cannot_pass(self, ruler: dict) -> bool:
        return False

    def fails(self, ruler: dict) -> bool:
        return False

    def promotes(self, ruler: dict, speedup: float) -> bool:
        return self.promoted


@dataclass(frozen=True)
class Walk:
    """What one walk of the trial decision ran: RULER samples per task in each `score` call, and TTFT timings."""

    scored: tuple[int, ...]
    timed: int


def walk(samples: int, promote: int | None, promoted: bool, predicted: bool) -> Walk:
    """The trial decision (`ridgefill.decision.decide`) walked with assumed outcomes instead of measurements."""
    scored, timed = [], []

    class Speed:
        speedup = 1.0

    bar = {"mean": 0.0, "speedup": 0.0} if promote else None
    gate = Assumed(samples, promote, promoted, bar)
    decide(lambda a, b: scored.append(b - a) or {}, lambda: timed.append(1) or Speed(), lambda a, b: a, gate,
           1.0 if predicted else None)  # fmt: skip
    return Walk(tuple(scored), len(timed))


# Datasheet peaks (dense, no sparsity): H100 SXM bf16 989 TFLOP/s, fp64 tensor core 67 TFLOP/s, HBM3
# 3.35 TB/s; H200: the same compute, HBM3e 4.8 TB/s; A100 SXM 312, 19.5, 2.04 TB/s. Assumed fractions:
# 35% of bf16 peak for a vLLM prefill at 4K-32K (FlashAttention; 8B prefill reaches 30-50% MFU), 25% for
# the transformers runtime (eager, sdpa), 60% of fp64 peak for DGEMM at d = 4096, 70% of HBM bandwidth
# for decode. Host: 16 cores at ~0.5 TFLOP/s float64. Engine start: 60 s (16 GB of weights, maps, CUDA
# graphs). None of this is measured here (no GPU): `ridgefill tune --plan` marks it as an estimate.
def _gpu(name: str, bf16: float, fp64: float, hbm: float) -> Rates:
    return Rates(
        name, prefill=0.35 * bf16, prefill_hf=0.25 * bf16, f64=0.60 * fp64, host_f64=0.5e12, bandwidth=0.70 * hbm,
        step_floor=2e-3, engine_start=60.0, model_load=30.0, disk=1e9,
        source=f"rate table for {name} (datasheet peaks x assumed efficiency; an estimate, not measured)",
    )  # fmt: skip


GPU_RATES = {
    "h100": _gpu("h100", 989e12, 67e12, 3.35e12),
    "h200": _gpu("h200", 989e12, 67e12, 4.8e12),
    "a100": _gpu("a100", 312e12, 19.5e12, 2.04e12),
}


def prefill_flops(shape: Shape, n: int) -> float:
    """FLOPs of an exact n-token prefill (every layer on every row, the lm head on the last row)."""
    full, _, _ = layer_flops(shape, ctx=n / 2)
    return 2 * (n * shape.num_hidden_layers * full + shape.vocab_size * shape.hidden_size)


def decode_step_s(shape: Shape, r: Rates, batch: int, ctx: int, dtype_bytes: int) -> float:
    """One decode step of `batch` sequences at context `ctx`: the weights and every sequence's K/V are
    read once (memory-bound), unless the batch's FLOPs take longer."""
    read = shape.params * dtype_bytes + batch * ctx * shape.kv_bytes_per_token(dtype_bytes)
    full, _, _ = layer_flops(shape, ctx=ctx)
    flops = 2 * batch * (shape.num_hidden_layers * full + shape.vocab_size * shape.hidden_size)
    return r.step_floor + max(read / r.bandwidth, flops / r.prefill)


@dataclass
class Estimate:
    """Seconds per phase; `lines` is the printed arithmetic."""

    phases: dict[str, float] = field(default_factory=dict)
    trial: dict[str, float] = field(default_factory=dict)
    trials: int = 0
    parallel: int = 1
    lines: list[str] = field(default_factory=list)

    @property
    def per_trial(self) -> float:
        return sum(self.trial.values())

    @property
    def total(self) -> float:
        return sum(self.phases.values()) + math.ceil(self.trials / self.parallel) * self.per_trial


def _ruler_s(
    study: Study,
    shape: Shape,
    r: Rates,
    speedup: float,
    samples: int | None = None,
    spec=None,
    engine: str | None = None,
) -> tuple[float, list[str]]:
    """RULER over the study's tasks x lengths, `samples` per task (default the study's); on vLLM a cell's
    samples are one batch, on transformers they run one at a time. `speedup` divides the prefill FLOPs (1 for
    exact). `spec`: another RULER spec (the certification's); default the study's objective. `engine`: where it
    runs (default the study's)."""
    ru, engine = spec or study.objectives.ruler, engine or study.engine
    n = ru.samples if samples is None else samples
    vllm = ENGINES[engine].serving
    rate = r.rate(engine)
    total, lines = 0.0, []
    for length in ru.lengths:
        pre = n * prefill_flops(shape, length) / speedup / rate
        new = sum(SPECS[t].max_new_tokens for t in ru.tasks)
        batch = n if vllm else 1
        steps = new * (1 if vllm else n)
        dec = steps * decode_step_s(shape, r, batch, length, DTYPE_BYTES[study.model.dtype])
        total += len(ru.tasks) * pre + dec
        lines.append(
            f"  {len(ru.tasks)} tasks x {n} samples @ {length}: prefill {len(ru.tasks) * pre:.1f} s, "
            f"decode {steps} steps x {'batch ' + str(batch) if vllm else 'one sample'} = {dec:.1f} s"
        )
    return total, lines


def estimate(study: Study, shape: Shape, r: Rates) -> Estimate:
    """The study's estimated wall time per phase, with the arithmetic as printable lines."""
    e = Estimate(trials=study.budget.trials, parallel=study.budget.parallel)
    L, d = shape.num_hidden_layers, shape.hidden_size
    cal, s, ru, tt = study.calibration, study.search, study.objectives.ruler, study.objectives.ttft
    say = e.lines.append
    say(f"rates: {r.source}")
    say(
        f"  prefill {r.prefill / 1e12:.3g} TFLOP/s ({study.engine}), transformers {r.prefill_hf / 1e12:.3g}, "
        f"float64 {r.f64 / 1e12:.3g} (host {r.host_f64 / 1e12:.3g}), decode {r.bandwidth / 1e9:.4g} GB/s"
    )
    say(f"model: {L} layers, d={d}, {shape.params / 1e9:.3g}B weights read per decode step, {study.model.dtype}")

    e.phases["load model"] = r.model_load
    # capture: one forward per window through every layer, float64 X^T X and X^T Y_l for every split
    wins, rows = cal.max_windows, cal.window - s.sink
    fwd = wins * prefill_flops(shape, cal.window) / r.prefill_hf
    mats = sum(L - sp for sp in s.splits)
    stat = wins * 2 * rows * d * d * mats / r.f64
    ckpt = stats_bytes(s.splits, L, d)
    writes = 1 + int((fwd + stat) // 300)
    e.phases["capture"] = fwd + stat + writes * ckpt / r.disk
    say(f"capture: {wins} windows x {cal.window} tokens: forward {fwd:.1f} s; statistics {mats} d x d float64 "
        f"products per window ({wins * 2 * rows * d * d * mats / 1e15:.3g} PFLOP) {stat:.1f} s; "
        f"{writes} checkpoint(s) of {ckpt / 1e9:.2g} GB {writes * ckpt / r.disk:.1f} s")  # fmt: skip

    eig = sum(9 * d**3 + (L - sp - 1) * 2 * d**3 for sp in s.splits) / r.host_f64
    e.phases["eigendecompositions"] = eig
    say(
        f"eigendecompositions: {len(s.splits)} splits x (eigh of d x d + rotate each late layer's X^T Y) "
        f"in float64 on the host: {eig:.1f} s (once per split, cached for every lambda)"
    )

    base_start = r.start(study.engine)
    exact, lines = _ruler_s(study, shape, r, 1.0, ru.most)
    e.phases["exact baseline"] = base_start + exact
    say(f"exact baseline (RULER, once per study): {base_start + exact:.1f} s")
    e.lines += lines

    # trial: the cheapest-to-fill corner of the search space bounds the trial's prefill from above
    cells = [(n, speedup_bound(shape, n, min(s.splits), s.sink + max(s.tails) + int(s.share[1] * n)))
             for n in ru.lengths]  # fmt: skip
    worst = min(sp for _, sp in cells)
    late = L - min(s.splits) - 1
    fit = (late * 2 * d**3) / r.host_f64 + late * d * d * 4 / r.disk
    held = min(4, cal.heldout)  # steps.fit_report checks at most 4 held-out windows
    heldout = held * prefill_flops(shape, cal.window) / r.prefill_hf
    e.trial["fit"] = fit + heldout
    say(
        f"trial fit: {late} late maps (solve + write {late * d * d * 4 / 1e9:.2g} GB) {fit:.1f} s, "
        f"held-out check ({held} windows) {heldout:.1f} s"
    )
    e.trial["engine start"] = base_start
    ruler, lines = _ruler_s(study, shape, r, worst)
    e.trial["RULER"] = ruler
    say(
        f"trial RULER at >= {worst:.2f}x fewer prefill FLOPs (S={min(s.splits)}, tail {max(s.tails)}, "
        f"share {s.share[1]}): {ruler:.1f} s"
    )
    e.lines += lines
    if ru.promote:  # multi-fidelity: the decision walked for a promoted trial (PROMOTED_SHARE of them)
        extra = walk(ru.samples, ru.promote, True, not tt.per_trial).scored[1:]
        more, lines = _ruler_s(study, shape, r, worst, sum(extra))
        e.trial["RULER promoted"] = PROMOTED_SHARE * more
        say(
            f"trial RULER, promoted (assumed: {PROMOTED_SHARE:.0%} of trials, those near the front; on the "
            f"trial's engine): {more:.1f} s each, {e.trial['RULER promoted']:.1f} s a trial"
        )
        e.lines += lines
    nl = study.objectives.nll
    e.trial["dNLL"] = sum(nl.documents * 2 * prefill_flops(shape, n) / r.prefill_hf for n in nl.lengths)
    say(
        f"trial dNLL: {nl.documents} documents x {nl.lengths} tokens x (exact + fill) on transformers: "
        f"{e.trial['dNLL']:.1f} s"
    )
    rate = r.rate(study.engine)
    if tt.per_trial:  # the decision walked: a trial that can join the front is timed once
        e.trial["TTFT"] = walk(ru.samples, ru.promote, False, False).timed * sum(
            (tt.warmup + tt.repeats) * prefill_flops(shape, n) * (1 + 1 / speedup_bound(shape, n, max(s.splits),
                                                                                         s.sink + min(s.tails)))
            / rate for n in tt.lengths
        )  # fmt: skip
        say(f"trial TTFT: ({tt.warmup} warm-up + {tt.repeats}) x (exact + fill) at {tt.lengths}: "
            f"{e.trial['TTFT']:.1f} s")  # fmt: skip
    else:
        _calibration(study, shape, r, e)
    if study.certify is not None:  # the exact side (once per weights) and the chosen map, at exact's cost (a bound)
        served = serving_engine(study)  # certified as it is served
        cert, lines = _ruler_s(study, shape, r, 1.0, spec=study.certify.ruler(), engine=served)
        e.phases["certification"] = 2 * (r.start(served) + cert)
        say(f"certification (exact + the chosen map, {served}): 2 x {r.start(served) + cert:.1f} s")
        e.lines += lines
        _certified_ttft(study, shape, r, e)
    say(
        f"trial: {e.per_trial:.1f} s; {e.trials} trials, {e.parallel} at a time: "
        f"{math.ceil(e.trials / e.parallel) * e.per_trial:.1f} s"
    )
    return e


def _timing_model(study: Study, shape: Shape, r: Rates, engine: str):
    """The TTFT model the estimate times with: `ttft_model.from_rate` at the engine's prefill rate."""
    from ridgefill.ttft_model import from_rate

    rate = r.rate(engine)
    return from_rate(shape, rate, engine, study.hardware.device, study.model.dtype)


def _rounds_s(model, points, lengths, rounds: int) -> float:
    """Seconds of `rounds` paired rounds (exact, then every point) at every length."""
    from ridgefill.ttft_model import EXACT

    return rounds * sum(model.seconds(n, EXACT) + sum(model.seconds(n, p) for p in points) for n in lengths)


def _calibration(study: Study, shape: Shape, r: Rates, e: Estimate) -> None:
    """The TTFT model's calibration before the trials: exact and the search space's corners and centre, paired,
    up to `max_repeats` rounds (+ warm-up) at the TTFT lengths, an engine per split on vLLM; trials time nothing."""
    from ridgefill.objectives import calibration_points

    tt, points = study.objectives.ttft, calibration_points(study)
    model = _timing_model(study, shape, r, study.engine)
    starts = len({p.split for p in points}) * r.start(study.engine)
    e.phases["TTFT calibration"] = starts + _rounds_s(model, points, tt.lengths, tt.warmup + tt.max_repeats)
    e.trial["TTFT"] = 0.0
    e.lines.append(
        f"TTFT calibration ({study.engine}): exact + {len(points)} points x ({tt.warmup} warm-up + {tt.repeats} to "
        f"{tt.max_repeats} rounds) at {tt.lengths}, at most {e.phases['TTFT calibration']:.1f} s; each trial's TTFT "
        "is then predicted (0 s)"
    )


def _certified_ttft(study: Study, shape: Shape, r: Rates, e: Estimate) -> None:
    """The chosen map's certified TTFT on the serving engine: up to `max_repeats` paired rounds (+ warm-up), the
    map's time from the same TTFT model at the search space's centre."""
    from ridgefill.objectives import calibration_points

    tt, engine = study.objectives.ttft, serving_engine(study)
    model = _timing_model(study, shape, r, engine)
    centre = calibration_points(study)[-1]
    start = r.start(engine)
    e.phases["certified TTFT"] = start + _rounds_s(model, [centre], tt.lengths, tt.warmup + tt.max_repeats)
    e.lines.append(
        f"certified TTFT ({engine}): exact + the chosen map ({centre.label()} as a stand-in) x up to "
        f"{tt.warmup + tt.max_repeats} rounds at {tt.lengths}: at most {e.phases['certified TTFT']:.1f} s"
    )


def report(study: Study, e: Estimate) -> str:
    """The plan as printed by `ridgefill tune --plan`: phases, each trial's parts, the total and the budget."""
    hours = study.budget.hours
    out = [f"plan for study {study.name} ({study.model.repo}, engine {study.engine}) -- ESTIMATE", *e.lines, ""]
    for k, v in e.phases.items():
        out.append(f"{k:>19}: {_hms(v)}")
    parts = ", ".join(f"{k} {_hms(v)}" for k, v in e.trial.items())
    out.append(f"{'each trial':>19}: {_hms(e.per_trial)} ({parts})")
    out.append(f"{'trials':>19}: {e.trials} x {_hms(e.per_trial)} / {e.parallel} at a time")
    out.append(f"{'total':>19}: {_hms(e.total)} ({e.total / 3600:.2f} h)")
    if hours is not None:
        verdict = "within" if e.total <= hours * 3600 else "OVER"
        out.append(f"{'budget':>19}: {hours} h -- {verdict}")
    return "\n".join(out)


def _hms(s: float) -> str:
    s = int(round(s))
    return f"{s // 3600}h{s % 3600 // 60:02d}m{s % 60:02d}s" if s >= 3600 else f"{s // 60}m{s % 60:02d}s"


def check_budget(study: Study, e: Estimate, force: bool = False) -> None:
    """Refuse a study whose estimate exceeds `budget.hours` (before any capture), unless forced."""
    hours = study.budget.hours
    if hours is not None and e.total > hours * 3600 and not force:
        raise CostError(
            f"study {study.name}: estimated {e.total / 3600:.2f} h exceeds budget.hours {hours}; shrink the study "
            f"(trials, RULER samples, calibration tokens), raise budget.hours, or pass --force "
            f"(`ridgefill tune --plan` shows the arithmetic)"
        )


def shape_of(study: Study, path: str | Path | None = None) -> Shape:
    """The model's shape offline: the study's `model.shape`, else a config.json in `path` or the HF cache."""
    import json

    if study.model.shape:
        return Shape.of(study.model.shape)
    candidates = [Path(path) / "config.json"] if path else []
    if study.model.local == "default":
        from ridgefill.default_model import default_model_dir

        candidates.append(default_model_dir() / "config.json")
    elif study.model.local:
        candidates.append(Path(study.model.local) / "config.json")
    try:
        from huggingface_hub import try_to_load_from_cache

        hit = try_to_load_from_cache(study.model.repo, "config.json", revision=study.model.revision)
        if isinstance(hit, str):
            candidates.append(Path(hit))
    except Exception:  # no hub library or a malformed repo id: fall through to the error below
        pass
    for c in candidates:
        if c.is_file():
            return Shape.of(json.loads(c.read_text()))
    raise CostError(
        f"study {study.name}: no shape for {study.model.repo} offline; add model.shape to the study "
        f"({', '.join(SHAPE_KEYS)}) or put the model's config.json in the HF cache"
    )


def has_shape(study: Study) -> bool:
    """Whether `shape_of` finds the study's shape without the weights."""
    try:
        shape_of(study)
    except CostError:
        return False
    return True


def measure_rates(model, dtype: str, engine: str, seconds: float = 3.0, n: int = 512) -> Rates:
    """Warm-up on this machine (a few seconds): an n-token prefill (the study's window: short prompts
    understate the rate), decode steps and a float64 GEMM of the model's width, each timed after one
    untimed run."""
    import torch

    shape = Shape.of(model.config.to_dict())
    dev = next(model.parameters()).device
    ids = torch.randint(100, shape.vocab_size, (1, n), generator=torch.Generator().manual_seed(0)).to(dev)

    def timed(fn, reps: int = 1) -> float:
        fn()
        t = time.perf_counter()
        for _ in range(reps):
            fn()
        return (time.perf_counter() - t) / reps

    with torch.inference_mode():
        t_pre = timed(lambda: model(ids, use_cache=False, logits_to_keep=1))
        out = model(ids, use_cache=True, logits_to_keep=1)
        nxt = ids[:, -1:]

        def step():
            model(nxt, past_key_values=out.past_key_values, use_cache=True)
            out.past_key_values.crop(-1)  # drop the step's token: every step sees the same context

        reps = max(2, min(16, int(seconds / 3 / max(t_pre / 8, 1e-3))))
        t_step = timed(step, reps)
        a = torch.randn(shape.hidden_size, 512, dtype=torch.float64, device=dev)
        t_f64 = timed(lambda: a @ a.T, 4)
    b = DTYPE_BYTES[dtype]
    read = shape.params * b + n * shape.kv_bytes_per_token(b)
    pre = prefill_flops(shape, n) / t_pre
    f64 = 2 * shape.hidden_size**2 * 512 / t_f64
    return Rates(
        "this machine", prefill=pre, prefill_hf=pre, f64=f64, host_f64=f64, bandwidth=read / t_step,
        engine_start=60.0 if ENGINES[engine].serving else 0.0, disk=1e9,
        source=f"measured on this machine ({torch.get_num_threads()} threads): prefill of {n} tokens "
        f"{t_pre * 1e3:.0f} ms, decode step {t_step * 1e3:.1f} ms, float64 GEMM {t_f64 * 1e3:.1f} ms",
    )  # fmt: skip


def gpu_class() -> str:
    """The rate-table key of this machine's GPU (h100 when there is none or it is not in the table)."""
    import torch

    name = torch.cuda.get_device_name().lower() if torch.cuda.is_available() else ""
    return next((k for k in GPU_RATES if k in name), "h100")


def plan(study: Study, gpu: str | None = None, model=None, path: str | Path | None = None) -> tuple[Estimate, str]:
    """(estimate, printed report). A CUDA study reads `GPU_RATES[gpu]` (default: this machine's class, else
    h100) and needs no weights; a CPU study warms up the study's model here (`model`, else loaded)."""
    if study.hardware.device == "cuda" or gpu:
        key = (gpu or gpu_class()).lower()
        if key not in GPU_RATES:
            raise CostError(f"unknown GPU class {gpu!r}; known: {', '.join(GPU_RATES)}")
        rates, shape = GPU_RATES[key], shape_of(study, path)
    else:
        if model is None:
            from ridgefill import steps

            t = time.perf_counter()
            import torch

            if study.hardware.threads:
                torch.set_num_threads(study.hardware.threads)
            src = path or steps.model_path(study.model.local or study.model.repo)
            model, _ = steps.load_model(src, dtype=getattr(torch, study.model.dtype))
            load = time.perf_counter() - t
        else:
            load = 0.0
        n = min(512, study.calibration.window)
        rates = replace(measure_rates(model, study.model.dtype, study.engine, n=n), model_load=load)
        shape = Shape.of(model.config.to_dict())
    e = estimate(study, shape, rates)
    return e, report(study, e)
