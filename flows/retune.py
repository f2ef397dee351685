"""`retune()`: the nightly check. For each study whose model lives on the Hub, compare the revision's
current commit (huggingface_hub `model_info`) with the one seen last time, and trigger the study's
`tune/<name>` deployment when it changed. Seen commits live in a small JSON file, so the check is
testable offline against any Hub endpoint (`HF_ENDPOINT`).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

from prefect import flow, get_run_logger, task
from prefect.cache_policies import NO_CACHE

from ridgefill import settings
from ridgefill.default_model import cache_root
from ridgefill.study import Study, load_study

ROOT = Path(__file__).resolve().parents[1]  # the checkout (studies/ lives there)


def hub_commit(repo: str, revision: str, endpoint: str | None = None) -> str:
    """The commit a Hub revision points at now (HF_TOKEN is read by huggingface_hub, never logged)."""
    from huggingface_hub import HfApi

    return HfApi(endpoint=endpoint or settings.get("HF_ENDPOINT")).model_info(repo, revision=revision).sha


def hub_hosted(studies: list[Study]) -> list[Study]:
    """The studies whose model lives on the Hub (one pinned to local weights cannot move under it)."""
    return [s for s in studies if not s.model.local]


def changed(
    studies: list[Study], seen: dict[str, str], commit: Callable[[str, str], str], first_is_new: bool = False
) -> tuple[list[tuple[Study, str | None, str]], dict[str, str]]:
    """Studies whose Hub model moved since `seen` ({repo@revision: sha}); returns them and the updated map."""
    out, now = [], dict(seen)
    for s in hub_hosted(studies):
        key = f"{s.model.repo}@{s.model.revision}"
        sha = commit(s.model.repo, s.model.revision)
        old = seen.get(key)
        if (old is None and first_is_new) or (old is not None and old != sha):
            out.append((s, old, sha))
        now[key] = sha
    return out, now


@task(retries=3, retry_delay_seconds=[10, 60, 300], cache_policy=NO_CACHE)
def check(studies: list[Study], seen: dict[str, str], endpoint: str | None, first_is_new: bool):
    """The Hub check (retried: network errors are transient)."""
    return changed(studies, seen, lambda r, v: hub_commit(r, v, endpoint), first_is_new)


@flow(name="retune", log_prints=True)
def retune(
    studies: list[str] | None = None,
    state: str | None = None,
    endpoint: str | None = None,
    first_is_new: bool = False,
    trigger: bool = True,
) -> list[dict]:
    """Trigger `tune/<study>` for every study whose model has a new Hub revision since the last check."""
    from prefect.deployments import run_deployment

    log = get_run_logger()
    paths = [Path(p) for p in studies] if studies else sorted((ROOT / "studies").glob("*.yaml"))
    cfgs = [load_study(p if p.is_absolute() or p.is_file() else ROOT / p) for p in paths]
    state_file = Path(state) if state else settings.retune_state() or cache_root() / "retune.json"
    seen = json.loads(state_file.read_text()) if state_file.is_file() else {}
    hosted = [c.name for c in hub_hosted(cfgs)]
    log.info("checking %d Hub-hosted studies (%s) against %s", len(hosted), ", ".join(hosted) or "none", state_file)
    moved, now = check(cfgs, seen, endpoint, first_is_new)
    runs = []
    for cfg, old, sha in moved:
        path = next(str(p) for p, c in zip(paths, cfgs, strict=True) if c is cfg)
        log.info("%s: %s moved %s -> %s", cfg.name, cfg.model.repo, old, sha)
        run_id = None
        if trigger:
            run = run_deployment(f"tune/{cfg.name}", parameters={"study": path}, timeout=0)
            run_id = str(run.id)
            log.info("%s: triggered tune/%s (flow run %s, %s)", cfg.name, cfg.name, run.name, run_id)
        runs.append({"study": cfg.name, "repo": cfg.model.repo, "old": old, "new": sha, "flow_run": run_id})
    if not moved:
        log.info("no study's model moved: nothing to tune")
    if trigger:  # a dry run reports and remembers nothing, so the real run still sees the change
        state_file.parent.mkdir(parents=True, exist_ok=True)
        state_file.write_text(json.dumps(now, indent=2, sort_keys=True) + "\n")
        log.info("remembered %d commits in %s", len(now), state_file)
    return runs


if __name__ == "__main__":
    print(json.dumps(retune(), indent=2))
