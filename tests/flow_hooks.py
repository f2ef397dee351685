"""Trial evaluators for the tune flow's test hook (`evaluator="tests.flow_hooks:<name>"`, flows/tune.py).

They have `tasks.trial.run_trial`'s signature and run as the flow's `run_trial` task.
"""

from __future__ import annotations

import functools
import os
import time

import optuna

from ridgefill import search
from tasks.trial import TrialContext, run_trial


@functools.cache
def _storage(url: str) -> optuna.storages.BaseStorage:
    return search.storage(url, None, "")


def after_two_workers(number: int, params: search.Params, ctx: TrialContext, exact: dict, cfg) -> search.Outcome:
    """Wait until two workers hold a trial of the shared study, then run the real trial (fit, RULER, TTFT):
    both workers take part whichever starts first."""
    store = _storage(os.environ["RIDGEFILL_OPTUNA_STORAGE"])
    deadline = time.monotonic() + 420
    while True:
        trials = optuna.load_study(study_name=cfg.name, storage=store).get_trials(deepcopy=False)
        if len({t.user_attrs.get("owner") for t in trials} - {None}) >= 2:
            break
        if time.monotonic() > deadline:
            raise TimeoutError("the other worker never asked for a trial")
        time.sleep(0.5)
    return run_trial.fn(number, params, ctx, exact, cfg)
