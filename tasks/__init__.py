"""Thin Prefect tasks over ridgefill's plain functions, one module per kind of work: `model` (resolve the
weights), `capture` (corpus hash, capture), `trial` (fit, evaluate, TTFT, the trial itself, the exact
baseline), `record` (trials, baseline, the selection into DuckDB), `certify` and `publish`.

Tasks run inside the flow's process (thread task runner), so a model is loaded once per process
(`ridgefill.steps.shared_model`) and the DuckDB recorder is the single writer. Captures and exact baselines
are cached across processes (`CACHED`: INPUTS + TASK_SOURCE, persisted results) keyed by the weights
fingerprint, corpus hash and splits, so neither a re-run nor a new lambda recaptures; run_capture's own
on-disk reuse is the second guard.
"""

from prefect.cache_policies import INPUTS, TASK_SOURCE

CACHED = INPUTS + TASK_SOURCE
