"""A pull on a terminal draws a live progress bar on stderr: bytes so far, rate, time left."""

from __future__ import annotations

import fcntl
import os
import pty
import re
import select
import struct
import subprocess
import termios
import time

from tests.provider.models.conftest import ONE, Node
from tests.support.hub_server import HubServer
from tests.support.processes import REPO_ROOT, darkbloom_cmd

# tqdm's line: `name:  43%|████▎     | 42.0M/98.4M [00:01<00:01, 41.9MB/s]`
_BAR = re.compile(r"(\d+)%\|[^|]*\| ([\d.]+)M/98\.4M \[\d\d:\d\d<\d\d:\d\d, +[\d.]+MB/s\]")


def test_a_pull_on_a_terminal_shows_bytes_rate_and_time_left(node: Node, hub: HubServer) -> None:
    hub.rate = 40_000_000  # about 2.5 s for the file: several redraws
    primary, secondary = pty.openpty()
    fcntl.ioctl(secondary, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 120, 0, 0))  # a new pty is 0 columns wide
    process = subprocess.Popen(darkbloom_cmd("models", "pull", ONE), env=node.env,
                               cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=secondary, stdin=subprocess.DEVNULL)
    os.close(secondary)
    screen = b""
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        ready, _, _ = select.select([primary], [], [], 1.0)
        if not ready:
            if process.poll() is not None:
                break
            continue
        try:
            chunk = os.read(primary, 65536)
        except OSError:  # the child closed the terminal
            break
        if not chunk:
            break
        screen += chunk
    os.close(primary)
    stdout, _ = process.communicate(timeout=60)
    assert process.returncode == 0, screen.decode(errors="replace")
    assert stdout.decode().startswith("smollm2-135m-instruct.q4_1 ")

    frames = [(int(percent), float(done)) for percent, done in _BAR.findall(screen.decode(errors="replace"))]
    assert len(frames) >= 3, screen.decode(errors="replace")
    assert frames[-1] == (100, 98.4)
    assert any(0 < percent < 100 for percent, _ in frames)  # drawn while the bytes came, not only at the end
    assert b"\r" in screen  # redrawn in place
