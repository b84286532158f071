"""Drive one HTTP endpoint with wrk (Debian package `wrk`) and read its numbers back.

wrk needs a Lua script for a POST body and headers; ``WrkTarget.script`` writes one into a
directory of the caller's choosing, whose ``done`` hook prints one JSON line that ``run_wrk``
parses. Used by bench/relay_overhead.py; 127.0.0.1 only, every run bounded by ``duration``.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

_DONE = r"""
done = function(summary, latency, requests)
  local e = summary.errors
  io.write(string.format(
    'WRKJSON {"requests":%d,"duration_us":%d,"p50_us":%d,"p99_us":%d,"mean_us":%.1f,' ..
    '"connect":%d,"read":%d,"write":%d,"status":%d,"timeout":%d}\n',
    summary.requests, summary.duration, latency:percentile(50), latency:percentile(99), latency.mean,
    e.connect, e.read, e.write, e.status, e.timeout))
end
"""


@dataclass(frozen=True)
class WrkTarget:
    name: str
    url: str
    body: dict[str, object]
    headers: dict[str, str]
    authorizations: tuple[str, ...] = ()  # Authorization values taken in turn, one per request (several callers)

    def script(self, directory: Path) -> Path:
        path = directory / f"{self.name}.lua"
        headers = {"Content-Type": "application/json", **self.headers}
        lines = ['wrk.method = "POST"', f"wrk.body = {_lua_string(json.dumps(self.body))}"]
        lines += [f"wrk.headers[{_lua_string(k)}] = {_lua_string(v)}" for k, v in headers.items()]
        if self.authorizations:
            lines += [f"local authorizations = {{{', '.join(map(_lua_string, self.authorizations))}}}",
                      "local turn = 0",
                      "request = function()",
                      "  turn = turn % #authorizations + 1",
                      '  wrk.headers["Authorization"] = authorizations[turn]',
                      "  return wrk.format()",
                      "end"]
        path.write_text("\n".join(lines) + "\n" + _DONE)
        return path


@dataclass(frozen=True)
class WrkResult:
    requests: int
    seconds: float
    p50_ms: float
    p99_ms: float
    errors: int

    @property
    def rps(self) -> float:
        return self.requests / self.seconds if self.seconds else 0.0


def wrk_binary() -> str:
    found = shutil.which("wrk")
    if found is None:
        raise SystemExit("wrk is missing: `make wrk` (or `apt-get install -y wrk`) installs Debian's package")
    return found


def run_wrk(target: WrkTarget, script: Path, connections: int, duration: float,
            timeout: float = 30.0) -> WrkResult:
    host = urlsplit(target.url).hostname
    if host not in ("127.0.0.1", "localhost"):
        raise ValueError(f"wrk targets stay on this machine, not {host}")
    args = [wrk_binary(), "-t1", f"-c{connections}", f"-d{max(1, round(duration))}s",
            f"--timeout={timeout:g}s", "-s", str(script), target.url]
    done = subprocess.run(args, capture_output=True, text=True, timeout=duration + timeout + 30)
    line = next((x for x in done.stdout.splitlines() if x.startswith("WRKJSON ")), None)
    if done.returncode != 0 or line is None:
        raise RuntimeError(f"wrk failed ({done.returncode}):\n{done.stdout}\n{done.stderr}")
    data = json.loads(line.removeprefix("WRKJSON "))
    errors = sum(data[k] for k in ("connect", "read", "write", "status", "timeout"))
    return WrkResult(data["requests"], data["duration_us"] / 1e6, data["p50_us"] / 1e3, data["p99_us"] / 1e3,
                     errors)


def _lua_string(text: str) -> str:
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'
