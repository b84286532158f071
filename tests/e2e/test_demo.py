"""`darkbloom demo`: one process, and the curl line it prints returns a real SmolLM2 answer."""

from __future__ import annotations

import json
import signal
import subprocess
import time
from pathlib import Path

import httpx
import pytest

from tests.support.processes import _env, darkbloom_cmd, free_port

pytestmark = pytest.mark.e2e


def _run_demo_until_banner(home: Path, port: int) -> tuple[subprocess.Popen[str], list[str]]:
    demo = subprocess.Popen(darkbloom_cmd("demo", "--port", str(port)), env=_env(home),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert demo.stdout is not None
    lines: list[str] = []
    deadline = time.monotonic() + 120
    for line in demo.stdout:
        lines.append(line.rstrip("\n"))
        if "Ctrl-C stops everything" in line or time.monotonic() > deadline:
            break
    return demo, lines


def _stop(demo: subprocess.Popen[str]) -> int:
    demo.send_signal(signal.SIGINT)
    try:
        return demo.wait(timeout=30)
    finally:
        if demo.poll() is None:
            demo.kill()


def test_demo_prints_a_working_curl_line_and_stops_cleanly(tmp_path: Path) -> None:
    home, port = tmp_path / "home", free_port()
    demo, lines = _run_demo_until_banner(home, port)
    try:
        curl = next(line for line in lines if line.startswith("curl "))
        key = next(line.split()[-1] for line in lines if line.startswith("API key"))
        assert key.startswith("dk-")
        assert any("from openai import OpenAI" in line for line in lines)
        console_url = next(line.split()[1] for line in lines if line.startswith("console "))
        assert httpx.get(console_url, follow_redirects=True, timeout=10).status_code == 200
        result = subprocess.run(curl, shell=True, capture_output=True, text=True, timeout=120)
        reply = json.loads(result.stdout)
        assert reply["model"] == "smollm2-135m"
        assert reply["choices"][0]["message"]["content"].strip()
        assert reply["usage"]["completion_tokens"] > 0
    finally:
        assert _stop(demo) == 0
    assert (home / "demo" / "coordinator.db").exists()

    again, lines_again = _run_demo_until_banner(home, port)
    try:
        key_again = next(line.split()[-1] for line in lines_again if line.startswith("API key"))
        assert key_again == key, "a second run reuses the demo account and key"
    finally:
        assert _stop(again) == 0
