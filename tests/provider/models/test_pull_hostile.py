"""`darkbloom models pull` against what it must not trust: symlinks planted in the model store, a Hub
that streams more than it announced, and Hub file names the store cannot hold."""

from __future__ import annotations

import hashlib
import subprocess
import time
from pathlib import Path

import pytest

from tests.provider.models.conftest import BACKSLASH, BACKSLASH_UP, BUNDLED_NAME, ONE, Node, failed
from tests.support.hub_server import HubServer

DEFAULT_ID = "smollm2-135m-instruct.q4_1"
ANNOUNCED = 1 << 20


def partial_name(hub: HubServer) -> str:
    """The name a pull of ONE gives its partial file (pull_gguf._download_key: repo, file and Hub ETag)."""
    key = f"{ONE}\n{BUNDLED_NAME}\n{hub.file(ONE, BUNDLED_NAME).sha256}"
    return hashlib.sha256(key.encode()).hexdigest()[:32] + ".incomplete"


@pytest.mark.parametrize("planted", [
    ".partial", f".partial/{DEFAULT_ID}", f".partial/{DEFAULT_ID}/stale.incomplete", f".partial/{DEFAULT_ID}/KEY",
    ".partial/pull.lock", DEFAULT_ID,
])
def test_a_symlink_planted_in_the_store_is_refused_and_never_followed(node: Node, hub: HubServer, tmp_path: Path,
                                                                       planted: str) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "stale.incomplete").write_bytes(b"precious")
    (outside / "notes.txt").write_bytes(b"precious")
    link = node.store / planted.replace("KEY", partial_name(hub))
    link.parent.mkdir(parents=True, exist_ok=True)
    link.symlink_to(outside / "stale.incomplete" if link.name.endswith((".incomplete", ".lock")) else outside)

    line = failed(node.run("models", "pull", ONE))
    assert f"{link} is a symlink" in line
    assert sorted(p.name for p in outside.iterdir()) == ["notes.txt", "stale.incomplete"]
    assert all(p.read_bytes() == b"precious" for p in outside.iterdir())
    assert link.is_symlink() and hub.downloads() == []


def announce_size(hub: HubServer, size: int | None) -> None:
    """From now on the Hub announces every GGUF (X-Linked-Size) as `size` bytes, or with None no
    size at all, and its CDN still serves the whole file."""
    assert hub._server is not None
    served = hub._server.RequestHandlerClass

    class Understating(served):  # type: ignore[valid-type,misc]
        def _send(self, status: int, body: bytes, headers: dict[str, str], head: bool,
                  content_length: int | None = None) -> None:
            if "X-Linked-Size" in headers:
                headers = {name: value for name, value in headers.items() if name != "X-Linked-Size"}
                if size is not None:
                    headers["X-Linked-Size"] = str(size)
            super()._send(status, body, headers, head, content_length)

    hub._server.RequestHandlerClass = Understating


def test_a_hub_that_streams_past_the_announced_size_is_stopped_there(node: Node, hub: HubServer) -> None:
    announce_size(hub, ANNOUNCED)
    hub.stall_after = 16 << 20  # a pull that wrote on would hold 16 MiB on disk here
    process = node.popen("models", "pull", ONE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    largest = 0
    try:
        deadline = time.monotonic() + 60
        while process.poll() is None and time.monotonic() < deadline and largest <= ANNOUNCED:
            largest = max([largest, *(p.stat().st_size for p in node.partials() if p.exists())])
            time.sleep(0.01)
        assert largest <= ANNOUNCED, f"{largest} bytes written of a file announced as {ANNOUNCED}"
        stdout, stderr = process.communicate(timeout=30)
    finally:
        hub.release()
        process.kill()
        process.wait()
    line = failed(subprocess.CompletedProcess(process.args, process.returncode, stdout, stderr))
    assert f"more than the {ANNOUNCED} bytes" in line and "deleted" in line
    assert node.partials() == [] and node.entries() == []


def test_a_hub_that_announces_no_size_is_not_downloaded_from(node: Node, hub: HubServer) -> None:
    announce_size(hub, None)
    assert "announces no size for" in failed(node.run("models", "pull", ONE))
    assert hub.downloads() == [] and node.partials() == [] and node.entries() == []


@pytest.mark.parametrize("args", [[BACKSLASH], [BACKSLASH, "--as", "mine"], [BACKSLASH_UP],
                                  [BACKSLASH_UP, "--as", "mine"], [f"{ONE}:a\\b.gguf", "--as", "mine"]])
def test_a_hub_file_name_with_a_backslash_exits_1_in_one_line(node: Node, hub: HubServer, args: list[str]) -> None:
    assert "cannot be stored: its name must not contain '\\'" in failed(node.run("models", "pull", *args))
    assert hub.downloads() == [] and node.entries() == []
