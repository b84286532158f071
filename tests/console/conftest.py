"""Browser tests for the web console: Playwright's Python package driving Debian's Chromium
against a real coordinator and real provider nodes."""

from __future__ import annotations

import os
import re
import select
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from tests.support.processes import free_port, spawn, wait_until

pytestmark = pytest.mark.e2e

CHROMIUM = os.environ.get("DARKBLOOM_TEST_CHROMIUM", "/usr/bin/chromium")
# No first-run work and no background traffic: the test machine may have no internet.
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]
DESKTOP = {"width": 1280, "height": 800}
PHONE = {"width": 390, "height": 844}
# Screenshots go to docs/img/ only when asked (`make screenshots`); other runs keep them out of the tree
IMG_DIR = Path(os.environ.get("DARKBLOOM_SCREENSHOTS") or Path(__file__).with_name(".screenshots"))
HTML_UPSTREAM = Path(__file__).with_name("html_upstream.py")


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    from playwright.sync_api import expect

    expect.set_options(timeout=30_000)  # expect()'s own 5 s is too short on a busy machine (a failure bound)
    # module scope, not session: Playwright's sync API keeps an event loop running in this thread
    # while it is open, and later modules' asyncio.run() calls would fail
    if not Path(CHROMIUM).exists():
        pytest.fail(f"{CHROMIUM} is missing: run `make install` (it installs Debian's chromium) "
                    "or set DARKBLOOM_TEST_CHROMIUM")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        chromium = playwright.chromium.launch(executable_path=CHROMIUM, headless=True, args=CHROMIUM_ARGS)
        try:
            yield chromium
        finally:
            chromium.close()


@dataclass
class Tab:
    """One browser tab plus everything that went wrong in it (JS errors, failed console loads)."""

    page: Any
    errors: list[str] = field(default_factory=list)
    api_calls: list[tuple[str, str, dict[str, str], str | None]] = field(default_factory=list)

    def shoot(self, name: str) -> None:
        """Screenshots at desktop (1280) and phone (390) width into docs/img/."""
        IMG_DIR.mkdir(parents=True, exist_ok=True)
        page = self.page
        for label, size in (("desktop", DESKTOP), ("phone", PHONE)):
            # A window as tall as the page, so the sticky header and composer sit where a reader
            # of the whole page expects them (a full-page capture pins them to the first screen).
            page.set_viewport_size(size)
            height = page.evaluate("document.documentElement.scrollHeight")
            page.set_viewport_size({"width": size["width"], "height": max(size["height"], height)})
            page.evaluate("window.scrollTo(0, 0)")
            page.wait_for_timeout(150)
            page.screenshot(path=str(IMG_DIR / f"{name}-{label}.png"))
        page.set_viewport_size(DESKTOP)

    def session_token(self) -> str:
        return str(self.page.evaluate("sessionStorage.getItem('darkbloom.session')"))

    def calls(self, path: str) -> list[tuple[str, str, dict[str, str], str | None]]:
        return [c for c in self.api_calls if c[1].split("?")[0] == path]


def open_tab(browser: Any, base_url: str) -> tuple[Any, Tab]:
    context = browser.new_context(viewport=DESKTOP, base_url=base_url, reduced_motion="reduce")
    context.grant_permissions(["clipboard-read", "clipboard-write"], origin=base_url)
    page = context.new_page()
    page.set_default_timeout(60_000)  # bounds a failure only: a busy machine (xdist workers, nodes) is slow
    tab = Tab(page)
    page.on("pageerror", lambda exc: tab.errors.append(f"page error: {exc}"))
    page.on("console", lambda msg: tab.errors.append(f"console {msg.type}: {msg.text}")
            if msg.type == "error" and "Failed to load resource" not in msg.text else None)
    page.on("dialog", lambda dialog: (tab.errors.append(f"unexpected dialog: {dialog.message}"), dialog.dismiss()))

    def record(request: Any) -> None:
        url = request.url
        if url.startswith(base_url + "/v1/"):
            tab.api_calls.append((request.method, url[len(base_url):], dict(request.headers), request.post_data))

    page.on("request", record)
    return context, tab


@pytest.fixture(scope="module")
def html_upstream(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The fake upstream whose answers contain <script>; a node serves it as model `html-echo`."""
    home = tmp_path_factory.mktemp("html-upstream")
    port = free_port()
    process = spawn([sys.executable, str(HTML_UPSTREAM), str(port)], home, "upstream.log")
    try:
        import httpx

        def up() -> bool:
            try:
                httpx.get(f"http://127.0.0.1:{port}/", timeout=1)
                return True
            except httpx.HTTPError:
                assert process.proc.poll() is None, process.log()
                return False

        wait_until(up, timeout=30, what="the html upstream")
        yield f"http://127.0.0.1:{port}"
    finally:
        process.stop()


class LoginCommand:
    """`darkbloom login --no-browser` as a person runs it: prints the code, then polls."""

    def __init__(self, args: list[str], env: dict[str, str]) -> None:
        self.proc = subprocess.Popen(args, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.output: list[str] = []

    def user_code(self, timeout: float = 30) -> str:
        assert self.proc.stdout is not None
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            ready, _, _ = select.select([self.proc.stdout], [], [], 0.5)
            if ready:
                line = self.proc.stdout.readline()
                if not line:
                    break
                self.output.append(line)
                found = re.search(r"Your code:\s*([A-Z0-9]{4}-[A-Z0-9]{4})", line)
                if found:
                    return found.group(1)
        raise AssertionError("darkbloom login printed no code:\n" + "".join(self.output))

    def wait(self, timeout: float = 30) -> str:
        out, _ = self.proc.communicate(timeout=timeout)
        self.output.append(out)
        text = "".join(self.output)
        assert self.proc.returncode == 0, text
        return text


def signed_in_tab(browser: Any, base_url: str, token: str, email: str,
                  local: dict[str, str] | None = None) -> tuple[Any, Tab]:
    """A tab already holding a console session (as if the person had logged in in it)."""
    context, tab = open_tab(browser, base_url)
    script = (f"sessionStorage.setItem('darkbloom.session', {token!r});"
              f"sessionStorage.setItem('darkbloom.email', {email!r});")
    for key, value in (local or {}).items():
        script += f"localStorage.setItem({key!r}, {value!r});"
    context.add_init_script(script)
    return context, tab
