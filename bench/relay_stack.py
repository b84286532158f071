"""The processes bench/relay_overhead.py measures: one fixed-response upstream (a benchmark fake that
answers at once, so the model costs nothing and what is left is the coordinator's own cost), and one
or more stacks of coordinator + provider node in front of it.

A stack runs the working tree, or a copy of ``src/`` given as ``LABEL=DIR`` (bench/variant.py makes
one: the working tree with some files reverted or patched), put first on the processes' PYTHONPATH,
so two versions of the code are measured side by side in the same run.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.profile_summary import cpu_table, record, summarise, thread_cpu  # noqa: E402
from bench.wrk_load import WrkTarget, run_wrk  # noqa: E402
from tests.support.accounts import create_account, login_node, wait_model_listed  # noqa: E402
from tests.support.processes import (Coordinator, Process, darkbloom_cmd, spawn, start_coordinator,  # noqa: E402
                                     start_fixed_upstream)

MODEL = "bench-fixed"
BODY: dict[str, object] = {"model": MODEL, "messages": [{"role": "user", "content": "benchmark"}], "max_tokens": 16}


# Where a relayed request's time goes, by the code its samples pass through (profile summaries).
BUCKETS = {
    "HTTP side: uvicorn httptools protocol + ASGI app": r"httptools_impl",
    "provider WebSocket side: uvicorn sansio protocol + provider_ws": r"websockets_sansio_impl",
    "`websockets` library (frame parsing/serialising)": r"\(websockets/",
    "FastAPI sync dependency in the thread pool (`run_in_threadpool`)": r"run_in_threadpool",
    "`inference/disconnect` (the request's disconnect watcher)": r"DisconnectWatch|until_disconnect|_wait_disconnect",
    "`wire/protocol.parse_provider_frame`": r"parse_provider_frame",
    "`inference/attempts.Attempt.on_chunk` (open + parse each chunk)": r"on_chunk",
    "NaCl (seal/open)": r"\(nacl/",
    "`json` (stdlib, anywhere)": r"\(json/",
    "pydantic (anywhere)": r"\(pydantic",
    "logging": r"\(logging/",
    "settlement (`RequestLifecycle._settle`)": r"_settle",
    "admission (`RequestLifecycle.admit`)": r"RequestLifecycle\.admit",
    "auth (`require_caller`)": r"require_caller",
    "placement / scheduler": r"placement\.py|scheduler\.py",
    "SQLAlchemy / aiosqlite": r"\(sqlalchemy/|\(aiosqlite/",
    "node: httpx/httpcore to the upstream": r"\(httpx/|\(httpcore/",
    "node: `provider/fleet_requests` (serving one request)": r"fleet_requests\.py",
    "asyncio / selectors as the innermost frame (the loop itself)": r"\((?:asyncio/|selectors\.py)[^;]*$",
}


@dataclass
class Stack:
    label: str  # "" for the working tree
    coord: Coordinator
    node: Process
    api_key: str

    def stop(self) -> None:
        self.node.stop()
        self.coord.stop()

    def targets(self, mode: str) -> dict[str, WrkTarget]:
        body = {**BODY, "stream": True} if mode == "stream" else BODY
        auth = {"Authorization": f"Bearer {self.api_key}"}
        url = self.coord.api_url + "/chat/completions"
        suffix = f"@{self.label}" if self.label else ""
        return {f"paid{suffix}": WrkTarget(f"paid{suffix}-{mode}", url, body, auth),
                f"self{suffix}": WrkTarget(f"self{suffix}-{mode}", url, body, {**auth, "X-Darkbloom-Route": "self"})}


def write_catalog(root: Path) -> Path:
    catalog = root / "catalog.json"
    catalog.write_text(json.dumps({"models": [{"id": MODEL, "input_price": 1, "output_price": 1}]}))
    return catalog


@contextmanager
def one_stack(root: Path, label: str, src: Path | None, path: str) -> Iterator[tuple[Stack, WrkTarget, Path]]:
    """The fixed upstream and one stack in front of it (running ``src``, or the working tree), with the
    wrk target and script of its ``path`` (paid or self, non-streamed); both stopped on the way out."""
    upstream, upstream_url = start_fixed_upstream(root / "upstream")
    try:
        stack = start_stack(root, label, src, upstream_url)
        try:
            target = stack.targets("plain")[f"{path}@{label}"]
            yield stack, target, target.script(root)
        finally:
            stack.stop()
    finally:
        upstream.stop()


def start_stack(root: Path, label: str, src: Path | None, upstream_url: str) -> Stack:
    home = root / (label or "tree")
    env = {"PYTHONPATH": str(src)} if src is not None else None
    coord = start_coordinator(home / "coordinator", f"sqlite+aiosqlite:///{home / 'c.db'}",
                              "--catalog", str(write_catalog(root)), env=env)
    account = create_account(coord, credit_micro_usd=1_000_000_000)
    login_node(coord, home / "node", account)
    node = spawn(darkbloom_cmd("serve", "--coordinator", coord.base_url, "--backend", "openai", "--upstream-url",
                               upstream_url, "--model", MODEL, "--max-concurrency", "128"),
                 home / "node", "node.log", env)
    stack = Stack(label, coord, node, account.api_key)
    try:
        wait_model_listed(coord, account, MODEL)
    except BaseException:
        stack.stop()
        raise
    return stack


def check(target: WrkTarget, expect_billing: str | None) -> None:
    """One request by hand: wrk counts non-2xx answers but never shows them."""
    response = httpx.post(target.url, json=target.body, headers=target.headers, timeout=30)
    if response.status_code != 200:
        raise SystemExit(f"{target.name}: HTTP {response.status_code}: {response.text[:500]}")
    billing = response.headers.get("x-darkbloom-billing")
    if expect_billing is not None and billing != expect_billing:
        raise SystemExit(f"{target.name}: expected X-Darkbloom-Billing {expect_billing}, got {billing}")


def profile(target: WrkTarget, scripts: Path, processes: dict[str, Process], seconds: float, out: Path,
            connections: int = 16) -> str:
    """While wrk keeps ``target`` at c=``connections``: per process, CPU per thread and a GIL pass (``seconds``),
    then a native pass (``seconds``); bench/profile_summary.py says why two passes. Returns markdown."""
    out.mkdir(parents=True, exist_ok=True)
    print(f"profiling {', '.join(processes)} for 2 × {seconds:g} s under {target.name} at c={connections}…",
          file=sys.stderr, flush=True)

    def passes(name: str, pid: int) -> str:
        before = thread_cpu(pid)
        _spy(record(pid, seconds, out / f"{name}-gil.raw", "gil"), name)
        cpu = (before, thread_cpu(pid))
        _spy(record(pid, seconds, out / f"{name}-native.raw", "native"), name)
        raws = [(out / f"{name}-{mode}.raw").read_text() for mode in ("gil", "native")]
        return (f"CPU per thread over the GIL pass:\n\n{cpu_table(*cpu, seconds, raws)}\n"
                f"GIL pass (Python holding the GIL):\n\n{summarise(raws[0], buckets=BUCKETS)}\n"
                f"Native pass (all threads py-spy calls active, C frames included):\n\n{summarise(raws[1], top=8)}")

    with ThreadPoolExecutor(1 + len(processes)) as pool:
        load = pool.submit(run_wrk, target, target.script(scripts), connections, 2 * seconds + 5)
        time.sleep(1.5)
        reports = {name: pool.submit(passes, name, p.proc.pid) for name, p in processes.items()}
        result = load.result()
    text = f"load during the profile: {result.rps:.0f} req/s, p50 {result.p50_ms:.1f} ms, errors {result.errors}\n\n"
    for name, report in reports.items():
        text += f"### py-spy: {name}, {target.name} at c={connections}\n\n{report.result()}\n"
    return text


def _spy(spy: subprocess.Popen[bytes], name: str) -> None:
    _, err = spy.communicate(timeout=120)
    if spy.returncode != 0:
        raise RuntimeError(f"py-spy on {name} failed: {err.decode(errors='replace')}")
