"""A Hugging Face Hub look-alike for tests: real files under repo names, answered the way
huggingface_hub's client reads the Hub (file_download.get_hf_file_metadata, http_get;
hf_api.model_info; utils/_http.hf_raise_for_status), with switches to break a download.

- `GET /api/models/{repo}` and `/api/models/{repo}/revision/{rev}`: `{id, sha, siblings}` (with
  `?blobs=true`, each sibling's size, blobId and lfs).
- `HEAD`/`GET /{repo}/resolve/{rev}/{file}`: for a `.gguf` or `.safetensors` (LFS files, as on the
  Hub) a 302 to the "CDN" — the same server reached as `localhost` rather than `127.0.0.1`, so
  another origin, like the Hub's signed CDN addresses — with `X-Repo-Commit`, `X-Linked-Etag` (the
  sha256) and `X-Linked-Size`; any other file is answered in place with its git `ETag` and
  `Content-Length`.
- `GET /cdn/{sha256}`: the bytes, with `Range` (206 and `Content-Range`).
- 404s carry the Hub's `X-Error-Code` (RepoNotFound, RevisionNotFound, EntryNotFound), so the
  client raises its own typed errors. No `X-Xet-*` header is ever sent: the client never uses xet.

Every request is recorded (`requests`) with its `Range`, whether it carried a token, and how many
bytes of a file went out."""

from __future__ import annotations

import functools
import hashlib
import json
import socket
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, quote, unquote, urlsplit

_PIECE = 1 << 20
LFS_SUFFIXES = (".gguf", ".safetensors")  # weights, kept in LFS as on the Hub; other files are in git
CORRUPT_AT = 4096  # with `corrupt`, the byte at this offset of every file goes out flipped


@functools.lru_cache(maxsize=None)
def _sha256_of_path(path: Path) -> str:
    with path.open("rb") as fh:
        return hashlib.file_digest(fh, "sha256").hexdigest()


@dataclass(frozen=True)
class HubFile:
    name: str
    data: Path | bytes

    @functools.cached_property
    def size(self) -> int:
        return self.data.stat().st_size if isinstance(self.data, Path) else len(self.data)

    @functools.cached_property
    def sha256(self) -> str:
        return _sha256_of_path(self.data) if isinstance(self.data, Path) else hashlib.sha256(self.data).hexdigest()

    @property
    def lfs(self) -> bool:
        return self.name.endswith(LFS_SUFFIXES)

    @property
    def git_oid(self) -> str:
        return hashlib.sha1(f"blob {self.name} {self.sha256}".encode()).hexdigest()

    def read(self, offset: int, length: int) -> bytes:
        if isinstance(self.data, bytes):
            return self.data[offset:offset + length]
        with self.data.open("rb") as fh:
            fh.seek(offset)
            return fh.read(length)


@dataclass
class Seen:
    """One request the hub answered."""
    method: str
    path: str
    range: str | None
    authorized: bool
    sent: int = 0  # bytes of a file's content


@dataclass
class HubServer:
    """`with HubServer({"owner/name": {"file.gguf": Path(...)}}) as hub:` then HF_ENDPOINT=hub.url."""
    repos: dict[str, dict[str, Path | bytes]]
    requests: list[Seen] = field(default_factory=list)
    cut_after: int | None = None  # the next file download is cut off after this many bytes of the file, once
    stall_after: int | None = None  # every file download stops after this offset until `release()`
    stalled: threading.Event = field(default_factory=threading.Event)  # set when a download stops there
    corrupt: bool = False  # files go out with one byte changed: what they are is not what the Hub announced
    rate: int | None = None  # bytes per second for file downloads
    _files: dict[str, dict[str, HubFile]] = field(default_factory=dict)
    _released: threading.Event = field(default_factory=threading.Event)
    _server: ThreadingHTTPServer | None = None

    def __post_init__(self) -> None:
        self._files = {repo: {name: HubFile(name, data) for name, data in files.items()}
                       for repo, files in self.repos.items()}

    @property
    def port(self) -> int:
        assert self._server is not None, "the hub is not started"
        return int(self._server.server_address[1])

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def commit(self, repo: str) -> str:
        return hashlib.sha1(repo.encode()).hexdigest()

    def file(self, repo: str, name: str) -> HubFile:
        return self._files[repo][name]

    def downloads(self) -> list[Seen]:
        """The GETs of file contents from the CDN, in order."""
        return [seen for seen in self.requests if seen.method == "GET" and seen.path.startswith("/cdn/")]

    def release(self) -> None:
        """Stalled downloads end (their connections close); later ones are no longer stalled."""
        self.stall_after = None
        self._released.set()

    def __enter__(self) -> "HubServer":
        hub = self

        class Handler(_HubHandler):
            server_hub = hub

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        threading.Thread(target=self._server.serve_forever, name="hub-server", daemon=True).start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._released.set()
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()


class _HubHandler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server_hub: HubServer

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def do_HEAD(self) -> None:
        self._answer(head=True)

    def do_GET(self) -> None:
        self._answer(head=False)

    def _answer(self, head: bool) -> None:
        hub = self.server_hub
        url = urlsplit(self.path)
        seen = Seen(self.command, url.path, self.headers.get("Range"), self.headers.get("Authorization") is not None)
        hub.requests.append(seen)
        parts = [unquote(part) for part in url.path.strip("/").split("/")]
        try:
            if parts[:2] == ["api", "models"] and len(parts) >= 4:
                self._model_info(parts[2] + "/" + parts[3], parts[5] if parts[4:5] == ["revision"] else None,
                                 "blobs" in parse_qs(url.query))
            elif len(parts) >= 5 and parts[2] == "resolve":
                self._resolve(parts[0] + "/" + parts[1], parts[3], "/".join(parts[4:]), head)
            elif parts[0] == "cdn" and len(parts) == 2:
                self._content(parts[1], head, seen)
            else:
                self._error(404, None, "Not found")
        except (BrokenPipeError, ConnectionResetError):
            self.close_connection = True

    def _model_info(self, repo: str, revision: str | None, blobs: bool) -> None:
        files = self._repo(repo, revision)
        if files is None:
            return
        siblings = []
        for hub_file in files.values():
            sibling: dict[str, Any] = {"rfilename": hub_file.name}
            if blobs:
                sibling.update(size=hub_file.size, blobId=hub_file.git_oid)
                if hub_file.lfs:
                    sibling["lfs"] = {"sha256": hub_file.sha256, "size": hub_file.size, "pointerSize": 134}
            siblings.append(sibling)
        self._json(200, {"_id": self.server_hub.commit(repo)[:24], "id": repo, "modelId": repo,
                         "sha": self.server_hub.commit(repo), "private": False, "disabled": False, "gated": False,
                         "tags": ["gguf"], "library_name": "gguf", "siblings": siblings})

    def _resolve(self, repo: str, revision: str, name: str, head: bool) -> None:
        files = self._repo(repo, revision)
        if files is None:
            return
        hub_file = files.get(name)
        commit = {"X-Repo-Commit": self.server_hub.commit(repo)}
        if hub_file is None:
            self._error(404, "EntryNotFound", f"{name} does not exist on \"{revision}\"", commit)
            return
        if hub_file.lfs:
            location = f"http://localhost:{self.server_hub.port}/cdn/{hub_file.sha256}"
            self._send(302, b"", {**commit, "Location": location, "ETag": f'"{hub_file.git_oid}"',
                                  "X-Linked-Etag": f'"{hub_file.sha256}"', "X-Linked-Size": str(hub_file.size)},
                       head)
            return
        self._send(200, b"" if head else hub_file.read(0, hub_file.size),
                   {**commit, "ETag": f'"{hub_file.git_oid}"', "Content-Length": str(hub_file.size)}, head,
                   content_length=hub_file.size)

    def _content(self, sha256: str, head: bool, seen: Seen) -> None:
        hub = self.server_hub
        hub_file = next((f for files in hub._files.values() for f in files.values() if f.sha256 == sha256), None)
        if hub_file is None:
            self._error(404, None, "No such object")
            return
        start, end = 0, hub_file.size - 1
        status, headers = 200, {"Accept-Ranges": "bytes", "ETag": f'"{sha256}"'}
        asked = self.headers.get("Range")
        if asked:
            first, _, last = asked.removeprefix("bytes=").partition("-")
            start = int(first)
            end = min(int(last), end) if last else end
            if start > end:
                self._send(416, b"", {"Content-Range": f"bytes */{hub_file.size}"}, head)
                return
            status = 206
            headers["Content-Range"] = f"bytes {start}-{end}/{hub_file.size}"
        self.send_response(status)
        for name, value in {**headers, "Content-Length": str(end - start + 1),
                            "Content-Type": "application/octet-stream"}.items():
            self.send_header(name, value)
        self.end_headers()
        if not head:
            self._stream(hub_file, start, end, seen)

    def _stream(self, hub_file: HubFile, start: int, end: int, seen: Seen) -> None:
        hub = self.server_hub
        position = start
        while position <= end:
            piece = bytearray(hub_file.read(position, min(_PIECE, end - position + 1)))
            if hub.corrupt and position <= CORRUPT_AT < position + len(piece):
                piece[CORRUPT_AT - position] ^= 0xFF
            stop = next((limit for limit in (hub.cut_after, hub.stall_after)
                         if limit is not None and position < limit <= position + len(piece)), None)
            if stop is not None:
                piece = piece[:stop - position]
            self.wfile.write(piece)
            self.wfile.flush()
            position += len(piece)
            seen.sent += len(piece)
            if stop is not None:
                if stop == hub.cut_after:
                    hub.cut_after = None
                else:
                    hub.stalled.set()
                    hub._released.wait(timeout=120)
                self._hang_up()
                return
            if hub.rate:
                time.sleep(len(piece) / hub.rate)

    def _hang_up(self) -> None:
        self.close_connection = True
        try:
            self.connection.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass

    def _repo(self, repo: str, revision: str | None) -> dict[str, HubFile] | None:
        files = self.server_hub._files.get(repo)
        if files is None:
            self._error(404, "RepoNotFound", "Repository not found")
            return None
        if revision is not None and revision not in ("main", self.server_hub.commit(repo)):
            self._error(404, "RevisionNotFound", "Invalid rev id: " + quote(revision))
            return None
        return files

    def _error(self, status: int, code: str | None, message: str, extra: dict[str, str] | None = None) -> None:
        headers = {"X-Error-Message": message, **(extra or {})}
        if code:
            headers["X-Error-Code"] = code
        self._json(status, {"error": message}, headers)

    def _json(self, status: int, body: object, headers: dict[str, str] | None = None) -> None:
        raw = json.dumps(body).encode()
        self._send(status, raw, {"Content-Type": "application/json", **(headers or {})}, self.command == "HEAD")

    def _send(self, status: int, body: bytes, headers: dict[str, str], head: bool,
              content_length: int | None = None) -> None:
        self.send_response(status)
        for name, value in headers.items():
            self.send_header(name, value)
        if "Content-Length" not in headers:
            self.send_header("Content-Length", str(content_length if content_length is not None else len(body)))
        self.end_headers()
        if not head:
            self.wfile.write(body)
