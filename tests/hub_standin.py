"""A loopback stand-in for the Hub's read API, for `huggingface_hub`'s real client in any process
(`HF_ENDPOINT=<url>`): `model_info` (`/api/models/{repo}/revision/{rev}`), the file tree
(`/api/models/{repo}/tree/{rev}`) and file downloads (`/{repo}/resolve/{rev}/{file}`), so
`snapshot_download` works against it. Each repo serves one commit, `hub.shas[repo]`; a repo given a folder
serves that folder's files under every commit (a "new release" is a new sha over the same files).
"""

from __future__ import annotations

import hashlib
import json
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path


def git_blob_id(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


@dataclass(frozen=True)
class File:
    data: bytes
    blob_id: str  # git's id of the bytes: the tree's `oid`
    sha256: str | None  # LFS files (safetensors) only: the Hub names them by it

    @property
    def etag(self) -> str:
        return self.sha256 or self.blob_id


@dataclass
class HubStandIn:
    shas: dict[str, str]
    folders: dict[str, Path] = field(default_factory=dict)
    asked: list[tuple[str, str]] = field(default_factory=list)
    url: str = ""
    _read: dict[str, dict[str, File]] = field(default_factory=dict)

    def files(self, repo: str) -> dict[str, File]:
        """The repo folder's files, read and hashed once (a download asks for a model's weights several times)."""
        if repo not in self._read:
            folder = self.folders.get(repo)
            paths = sorted(p for p in folder.iterdir() if p.is_file()) if folder else []
            self._read[repo] = {p.name: _file(p.read_bytes(), p.suffix == ".safetensors") for p in paths}
        return self._read[repo]

    def tree(self, repo: str) -> list[dict]:
        out = []
        for name, f in self.files(repo).items():
            entry = {"type": "file", "path": name, "size": len(f.data), "oid": f.blob_id}
            if f.sha256:
                entry["lfs"] = {"oid": f.sha256, "size": len(f.data), "pointerSize": 134}
            out.append(entry)
        return out


def _file(data: bytes, lfs: bool) -> File:
    return File(data, git_blob_id(data), hashlib.sha256(data).hexdigest() if lfs else None)


def _handler(hub: HubStandIn):
    class Hub(BaseHTTPRequestHandler):
        def _send(self, code: int, body: bytes, headers: dict[str, str] | None = None, head: bool = False):
            self.send_response(code)
            for k, v in (headers or {"Content-Type": "application/json"}).items():
                self.send_header(k, v)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            if not head:
                self.wfile.write(body)

        def _answer(self, head: bool) -> None:
            parts = self.path.split("?")[0].strip("/").split("/")
            if parts[:2] == ["api", "models"] and len(parts) >= 6:
                repo, what, rev = "/".join(parts[2:4]), parts[4], parts[5]
                hub.asked.append((repo, rev))
                if repo not in hub.shas:
                    return self._send(404, b'{"error": "Repository not found"}')
                if what == "revision":
                    siblings = [{"rfilename": n} for n in hub.files(repo)]
                    info = {"id": repo, "modelId": repo, "sha": hub.shas[repo], "siblings": siblings}
                    return self._send(200, json.dumps(info).encode())
                if what == "tree":
                    return self._send(200, json.dumps(hub.tree(repo)).encode())
            if len(parts) >= 5 and parts[2] == "resolve":
                repo, name = "/".join(parts[:2]), "/".join(parts[4:])
                f = hub.files(repo).get(name)
                if f is None:
                    return self._send(404, b'{"error": "Entry not found"}')
                headers = {
                    "Content-Type": "application/octet-stream",
                    "ETag": f'"{f.etag}"',
                    "X-Repo-Commit": hub.shas[repo],
                }
                return self._send(200, f.data, headers, head)
            self._send(404, json.dumps({"error": f"unexpected {self.path}"}).encode())

        def do_GET(self):
            self._answer(head=False)

        def do_HEAD(self):
            self._answer(head=True)

        def log_message(self, *a):
            pass

    return Hub


def serve(hub: HubStandIn) -> ThreadingHTTPServer:
    """Serve `hub` on a free loopback port in a daemon thread; sets `hub.url`. Stop with `.shutdown()`."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(hub))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    hub.url = f"http://127.0.0.1:{server.server_port}"
    return server
