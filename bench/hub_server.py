"""A local server that speaks as much of the Hugging Face Hub's HTTP API as `huggingface_hub`
uses to download a model (`HF_ENDPOINT` pointed at it), for the cold-start bench and the tests:

    GET  /api/models/{org}/{name}[/revision/{rev}]   model info: `sha` and `siblings` (size, LFS sha256)
    HEAD /{org}/{name}/resolve/{rev}/{file}          X-Repo-Commit, ETag, Content-Length
    GET  /{org}/{name}/resolve/{rev}/{file}          the bytes (counted per file in `gets`)

Errors as the Hub answers them: 404 with X-Error-Code RepoNotFound / RevisionNotFound /
EntryNotFound; 401 for a private repo asked without its token. A repo can also misbehave on
purpose: serve a file cut short (`truncate`), or claim a size larger than any disk (`claim_size`).
"""

from __future__ import annotations

import collections
import hashlib
import json
import shutil
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlparse

LFS_SUFFIXES = (".safetensors", ".gguf", ".bin")  # stored in LFS on the Hub: the model info gives their sha256


@dataclass
class HubRepo:
    files: dict[str, Path]  # name in the repo -> the local file served for it
    commit: str  # the one commit (40 hex); branches "main" and any in `branches` point at it
    branches: tuple[str, ...] = ("main",)
    token: str | None = None  # private: requests must carry "Authorization: Bearer <token>"
    truncate: dict[str, int] = field(default_factory=dict)  # file -> bytes served (fewer than it has)
    claim_size: dict[str, int] = field(default_factory=dict)  # file -> size the model info claims
    sha256: dict[str, str] = field(default_factory=dict)  # filled by HubServer.add


class HubServer:
    """The server on 127.0.0.1, in a thread of this process; `url` is the HF_ENDPOINT to use."""

    def __init__(self) -> None:
        self.repos: dict[str, HubRepo] = {}
        self.gets: collections.Counter[tuple[str, str]] = collections.Counter()  # (repo, file) -> GETs served
        self._lock = threading.Lock()
        self._http = ThreadingHTTPServer(("127.0.0.1", 0), _handler(self))
        self._http.daemon_threads = True
        self.url = f"http://127.0.0.1:{self._http.server_address[1]}"
        self._thread = threading.Thread(target=self._http.serve_forever, name="hub-server", daemon=True)

    def add(self, repo_id: str, directory: Path, **options) -> HubRepo:
        """Serve every file of `directory` as the repo `repo_id` at one commit (derived from the contents)."""
        files = {p.name: p for p in sorted(Path(directory).iterdir()) if p.is_file()}
        digest = hashlib.sha1(repo_id.encode())
        sha256 = {}
        for name, path in files.items():
            sha256[name] = hashlib.sha256(path.read_bytes()).hexdigest()
            digest.update(f"{name} {sha256[name]}\n".encode())
        repo = HubRepo(files, digest.hexdigest(), sha256=sha256, **options)
        self.repos[repo_id] = repo
        return repo

    def count_gets(self, repo_id: str) -> int:
        with self._lock:
            return sum(n for (repo, _), n in self.gets.items() if repo == repo_id)

    def __enter__(self) -> HubServer:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._http.shutdown()
        self._http.server_close()


def _handler(server: HubServer):
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args) -> None:  # quiet
            pass

        def do_GET(self) -> None:
            self._serve(body=True)

        def do_HEAD(self) -> None:
            self._serve(body=False)

        def _serve(self, body: bool) -> None:
            parts = [unquote(p) for p in urlparse(self.path).path.strip("/").split("/")]
            if parts[:2] == ["api", "models"]:
                repo_id, rest = "/".join(parts[2:4]), parts[4:]
                revision = rest[1] if rest[:1] == ["revision"] and len(rest) == 2 else "main"
                self._info(repo_id, revision)
            elif len(parts) >= 5 and parts[2] == "resolve":
                self._file("/".join(parts[:2]), parts[3], "/".join(parts[4:]), body)
            else:
                self._error(404, "RepoNotFound")

        def _repo(self, repo_id: str, revision: str) -> HubRepo | None:
            repo = server.repos.get(repo_id)
            if repo is None:
                return self._error(404, "RepoNotFound")
            if repo.token is not None and self.headers.get("Authorization") != f"Bearer {repo.token}":
                return self._error(401, "RepoNotFound")
            if revision not in (repo.commit, *repo.branches):
                return self._error(404, "RevisionNotFound")
            return repo

        def _info(self, repo_id: str, revision: str) -> None:
            repo = self._repo(repo_id, revision)
            if repo is None:
                return
            siblings = []
            for name, path in repo.files.items():
                size = repo.claim_size.get(name, path.stat().st_size)
                sibling = {"rfilename": name, "size": size, "blobId": repo.sha256[name][:40]}
                if name.endswith(LFS_SUFFIXES):
                    sibling["lfs"] = {"size": size, "sha256": repo.sha256[name], "pointerSize": 134}
                siblings.append(sibling)
            data = json.dumps({"id": repo_id, "modelId": repo_id, "sha": repo.commit, "private": repo.token is not None,
                               "siblings": siblings}).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def _file(self, repo_id: str, revision: str, name: str, body: bool) -> None:
            repo = self._repo(repo_id, revision)
            if repo is None:
                return
            if name not in repo.files:
                return self._error(404, "EntryNotFound", repo.commit)
            path = repo.files[name]
            size = repo.truncate.get(name, path.stat().st_size)
            self.send_response(200)
            self.send_header("X-Repo-Commit", repo.commit)
            self.send_header("ETag", f'"{repo.sha256[name]}"')
            self.send_header("Content-Length", str(size))
            self.end_headers()
            if body:
                with server._lock:
                    server.gets[(repo_id, name)] += 1
                with path.open("rb") as f:
                    shutil.copyfileobj(_Limited(f, size), self.wfile, 1 << 20)

        def _error(self, status: int, code: str, commit: str | None = None) -> None:
            data = json.dumps({"error": code}).encode()
            self.send_response(status)
            self.send_header("X-Error-Code", code)
            if commit:
                self.send_header("X-Repo-Commit", commit)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(data)

    return Handler


class _Limited:
    """A file read up to `left` bytes."""

    def __init__(self, f, left: int) -> None:
        self.f, self.left = f, left

    def read(self, n: int) -> bytes:
        chunk = self.f.read(min(n, self.left))
        self.left -= len(chunk)
        return chunk
