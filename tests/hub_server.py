"""A Hugging Face hub on 127.0.0.1 for the pull tests: the slice of its HTTP API that
`huggingface_hub` uses to read a model's file list and download files (model info,
the file tree, HEAD and GET of `resolve` URLs with the commit and ETag headers, ranges
for resuming),
served from local files. The client and kvchat's use of it are the real ones; only the
far end is local.

`fail_after` makes the next GET of a file stop after that many bytes (a connection
lost mid-download), once; with `stay_down`, every request after it fails with 503
until `failing` is cleared (the network gone).
"""

from __future__ import annotations

import hashlib
import json
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlparse


@dataclass
class Repo:
    files: dict[str, Path]
    gguf_architecture: str | None = None
    sha: str = ""

    def __post_init__(self) -> None:
        digest = hashlib.sha1()
        for name in sorted(self.files):
            digest.update(name.encode())
        self.sha = digest.hexdigest()


@dataclass
class Hub:
    repos: dict[str, Repo] = field(default_factory=dict)
    fail_after: int | None = None
    stay_down: bool = False
    failing: bool = False
    ranges: list[str] = field(default_factory=list)  # the Range headers of file GETs
    downloads: list[str] = field(default_factory=list)  # "repo/file" of each file GET


class _Handler(BaseHTTPRequestHandler):
    hub: Hub

    def log_message(self, *args) -> None:  # quiet
        pass

    def _json(self, payload: dict | list, status: int = 200) -> None:
        body = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _not_found(self, what: str) -> None:
        body = json.dumps({"error": f"{what} not found"}).encode()
        self.send_response(404)
        self.send_header("X-Error-Code", "RepoNotFound")
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _route(self, head: bool) -> None:
        hub = self.hub
        if hub.failing:
            self.send_response(503)
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        path = unquote(urlparse(self.path).path)
        parts = path.strip("/").split("/")
        if parts[:2] == ["api", "models"] and len(parts) >= 4:
            repo_id = "/".join(parts[2:4])
            repo = hub.repos.get(repo_id)
            if repo is None:
                return self._not_found(repo_id)
            if len(parts) >= 6 and parts[4] == "tree":  # the file list snapshots walk
                tree = [
                    {"type": "file", "path": name, "size": f.stat().st_size, "oid": repo.sha}
                    for name, f in sorted(repo.files.items())
                ]
                return self._json(tree)
            info = {
                "id": repo_id,
                "modelId": repo_id,
                "sha": repo.sha,
                "siblings": [{"rfilename": name} for name in sorted(repo.files)],
            }
            if repo.gguf_architecture:
                info["gguf"] = {"architecture": repo.gguf_architecture, "total": 1}
            return self._json(info)
        if len(parts) >= 5 and parts[2] == "resolve":
            repo_id, filename = "/".join(parts[:2]), "/".join(parts[4:])
            repo = hub.repos.get(repo_id)
            if repo is None or filename not in repo.files:
                return self._not_found(f"{repo_id}/{filename}")
            return self._file(repo, repo_id, filename, head)
        self._not_found(path)

    def _file(self, repo: Repo, repo_id: str, filename: str, head: bool) -> None:
        data = repo.files[filename].read_bytes()
        start = 0
        requested = self.headers.get("Range")
        if requested and not head:
            self.hub.ranges.append(requested)
            start = int(requested.removeprefix("bytes=").split("-")[0])
        self.send_response(206 if start else 200)
        self.send_header("X-Repo-Commit", repo.sha)
        self.send_header("ETag", f'"{hashlib.sha256(data).hexdigest()}"')
        self.send_header("Accept-Ranges", "bytes")
        self.send_header("Content-Length", str(len(data) - start))
        if start:
            self.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
        self.end_headers()
        if head:
            return
        self.hub.downloads.append(f"{repo_id}/{filename}")
        body = data[start:]
        if self.hub.fail_after is not None:
            self.wfile.write(body[: self.hub.fail_after])
            self.wfile.flush()
            self.hub.fail_after = None
            self.hub.failing = self.hub.stay_down
            self.close_connection = True
            return
        self.wfile.write(body)

    def do_GET(self) -> None:
        self._route(head=False)

    def do_HEAD(self) -> None:
        self._route(head=True)


class HubServer:
    """The hub on a free port of 127.0.0.1; `url` is its HF_ENDPOINT."""

    def __init__(self, hub: Hub) -> None:
        handler = type("Handler", (_Handler,), {"hub": hub})
        self.hub = hub
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
