"""`retune`: the nightly check against a loopback stand-in for the Hub's model_info API (the real
huggingface_hub client), and the flow itself against a real Prefect server: a moved model triggers its
`tune/<study>` deployment (`run_deployment`), a dry run triggers and saves nothing."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from flows.retune import changed, hub_commit, retune
from ridgefill.study import load_study
from tests.hub_standin import HubStandIn, serve
from tests.prefect_server import prefect_server  # noqa: F401  (the fixture)

STUDIES = Path(__file__).resolve().parents[1] / "studies"
NAMES = ("smollm2-135m", "qwen3-8b", "llama-3.1-8b")
QWEN, LLAMA = "Qwen/Qwen3-8B", "meta-llama/Llama-3.1-8B-Instruct"


@pytest.fixture
def hub(hub_online):
    """The Hub's `model_info` on loopback (`tests.hub_standin`); `hub.shas` is what it answers (online mode
    only for this stand-in: `hub_online`)."""
    hub = HubStandIn({QWEN: "a" * 40, LLAMA: "b" * 40})
    server = serve(hub)
    yield hub
    server.shutdown()


def test_retune_sees_a_new_hub_revision_offline(hub):
    studies = [load_study(STUDIES / f"{n}.yaml") for n in NAMES]
    commit = lambda r, v: hub_commit(r, v, hub.url)  # noqa: E731
    moved, seen = changed(studies, {}, commit)
    assert moved == []
    assert seen == {f"{QWEN}@main": "a" * 40, f"{LLAMA}@main": "b" * 40}
    assert ("HuggingFaceTB/SmolLM2-135M-Instruct", "main") not in hub.asked  # pinned to the embedded weights
    hub.shas[QWEN] = "c" * 40  # a new release
    moved, seen2 = changed(studies, seen, commit)
    assert [(s.name, old, new) for s, old, new in moved] == [("qwen3-8b", "a" * 40, "c" * 40)]
    assert changed(studies, seen2, commit)[0] == []
    first = changed(studies, {}, commit, first_is_new=True)[0]
    assert [s.name for s, _, _ in first] == ["qwen3-8b", "llama-3.1-8b"]


@pytest.mark.slow
def test_retune_triggers_the_deployment_and_a_dry_run_saves_nothing(prefect_server, hub, tmp_path):  # noqa: F811
    from prefect.client.orchestration import get_client
    from prefect.settings import PREFECT_API_URL, temporary_settings

    from flows.tune import tune

    studies = [str(STUDIES / f"{n}.yaml") for n in NAMES]
    state = tmp_path / "retune.json"
    with temporary_settings(updates={PREFECT_API_URL: prefect_server["PREFECT_API_URL"]}):
        deployments = {n: tune.to_deployment(name=n).apply() for n in ("qwen3-8b", "llama-3.1-8b")}

        def tune_runs() -> list:
            with get_client(sync_client=True) as client:
                runs = client.read_flow_runs()
            return [r for r in runs if r.deployment_id in deployments.values()]

        assert retune(studies, str(state), hub.url, trigger=False) == [] and not state.exists()  # dry: no file
        assert retune(studies, str(state), hub.url) == []  # the first real check remembers the commits
        seen = state.read_bytes()
        assert json.loads(seen) == {f"{QWEN}@main": "a" * 40, f"{LLAMA}@main": "b" * 40}

        hub.shas[QWEN] = "c" * 40  # a new Qwen3 release
        dry = retune(studies, str(state), hub.url, trigger=False)
        assert [(r["study"], r["old"], r["new"], r["flow_run"]) for r in dry] == [
            ("qwen3-8b", "a" * 40, "c" * 40, None)
        ]
        assert state.read_bytes() == seen and tune_runs() == []  # a dry run saves no state and starts nothing

        runs = retune(studies, str(state), hub.url)
        assert [(r["study"], r["new"]) for r in runs] == [("qwen3-8b", "c" * 40)]
        (triggered,) = tune_runs()
        assert str(triggered.id) == runs[0]["flow_run"] and triggered.deployment_id == deployments["qwen3-8b"]
        assert triggered.parameters == {"study": studies[1]} and triggered.state.type.value == "SCHEDULED"
        assert json.loads(state.read_text())[f"{QWEN}@main"] == "c" * 40
        assert retune(studies, str(state), hub.url) == [] and len(tune_runs()) == 1  # seen: not triggered again


def test_a_hub_study_downloads_its_release_with_its_chat_template(hub_online, tokenizer, tmp_path):
    """`steps.hub_snapshot`, in a fresh process pointed at the stand-in as a user's would be: the commit the
    revision names now, the files byte for byte (the chat template included), a new release in a new folder."""
    from tests.conftest import tiny_model

    repo, folder = "ridge-org/tiny-llama", tmp_path / "release"
    tiny_model("llama", len(tokenizer)).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    assert (folder / "chat_template.jinja").is_file()
    hub = HubStandIn({repo: "d" * 40}, {repo: folder})
    server = serve(hub)
    env = {k: v for k, v in os.environ.items() if not k.startswith("HF_")}
    env |= {"HF_ENDPOINT": hub.url, "HF_HUB_CACHE": str(tmp_path / "cache"), "HF_HUB_OFFLINE": "0"}
    env |= {"HF_HOME": str(tmp_path / "hf"), "OMP_NUM_THREADS": "1"}
    code = f"from ridgefill.steps import hub_snapshot; print(*hub_snapshot({repo!r}, 'main'))"

    def download() -> tuple[Path, str]:
        done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-3000:]
        path, sha = done.stdout.split()
        return Path(path), sha

    try:
        path, sha = download()
        assert sha == "d" * 40 and path.name == sha
        for name in ("config.json", "model.safetensors", "tokenizer.json", "chat_template.jinja"):
            assert (path / name).read_bytes() == (folder / name).read_bytes(), name
        hub.shas[repo] = "e" * 40  # a new release (the same files under a new commit)
        path2, sha2 = download()
        assert sha2 == "e" * 40 and path2 != path and (path2 / "chat_template.jinja").is_file()
    finally:
        server.shutdown()
