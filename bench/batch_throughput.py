"""A self-route batch on one owned machine beside the same lines sent live, and a person chatting
with that machine during the batch.

One coordinator (SQLite) and one node on the bundled SmolLM2-135M (llama.cpp, `--max-concurrency
4`), linked to the caller's account. The same N chat lines (short prompts, `max_tokens` 16,
temperature 0) are sent:

- **live**, `X-Darkbloom-Route: self`, at the concurrency a batch uses on that machine (its slots less
  the one `--batch-free-slots` keeps for live requests: 3), and at 4;
- as a **batch** (`POST /v1/files`, `POST /v1/batches` with `X-Darkbloom-Route: self`), from creation
  to `completed`.

Then the time to first token of an interactive (streamed) request, sent alone on the idle machine and
sent during a second batch, at intervals: its p50 during ÷ idle is what a person chatting with their
own machine during a batch notices. With `--profile DIR`, py-spy samples the coordinator during the
first batch (bench/profile_summary.py).

Run: .venv/bin/python bench/batch_throughput.py [--lines 1000] [--probes 8] [--profile DIR]
Prints tables; record them in bench/RESULTS.md.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import platform
import statistics
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench import profile_summary  # noqa: E402
from tests.support.accounts import create_account, login_node, start_node, wait_online  # noqa: E402
from tests.support.processes import start_coordinator, wait_until  # noqa: E402

MODEL = "smollm2-135m"
SELF = {"X-Darkbloom-Route": "self"}
PROFILE_SECONDS = 20


def lines(count: int, offset: int = 0) -> list[dict[str, Any]]:
    return [{"custom_id": f"line-{offset + i}", "method": "POST", "url": "/v1/chat/completions",
             "body": {"model": MODEL, "max_tokens": 16, "temperature": 0,
                      "messages": [{"role": "user", "content": f"Name one fact about the number {offset + i}."}]}}
            for i in range(count)]


def live(client: httpx.Client, url: str, headers: dict[str, str], batch: list[dict[str, Any]],
         concurrency: int) -> tuple[float, int]:
    """Seconds to answer every line live at ``concurrency``, and the completion tokens."""
    def one(line: dict[str, Any]) -> int:
        response = client.post(url + "/chat/completions", json=line["body"], headers=headers)
        assert response.status_code == 200, response.text
        return int(response.json()["usage"]["completion_tokens"])

    started = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        tokens = sum(pool.map(one, batch))
    return time.perf_counter() - started, tokens


def submit(client: httpx.Client, url: str, headers: dict[str, str], batch: list[dict[str, Any]]) -> str:
    content = "\n".join(json.dumps(line) for line in batch).encode()
    uploaded = client.post(url + "/files", headers=headers, data={"purpose": "batch"},
                           files={"file": ("lines.jsonl", io.BytesIO(content), "application/jsonl")})
    assert uploaded.status_code == 200, uploaded.text
    created = client.post(url + "/batches", headers={**headers, **SELF}, json={
        "input_file_id": uploaded.json()["id"], "endpoint": "/v1/chat/completions", "completion_window": "24h"})
    assert created.status_code == 200, created.text
    return str(created.json()["id"])


def batch_state(client: httpx.Client, url: str, headers: dict[str, str], batch_id: str) -> dict[str, Any]:
    response = client.get(f"{url}/batches/{batch_id}", headers=headers)
    assert response.status_code == 200, response.text
    return dict(response.json())


def ttft(client: httpx.Client, url: str, headers: dict[str, str], probe: int) -> float:
    body = {"model": MODEL, "max_tokens": 16, "temperature": 0, "stream": True,
            "messages": [{"role": "user", "content": f"Say hello to visitor {probe}."}]}
    started = time.perf_counter()
    with client.stream("POST", url + "/chat/completions", json=body, headers={**headers, **SELF}) as response:
        assert response.status_code == 200, response.read()
        for line in response.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                event = json.loads(line[6:])
                if any((c.get("delta") or {}).get("content") for c in event.get("choices") or ()):
                    return time.perf_counter() - started
    raise AssertionError("no content")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lines", type=int, default=1000)
    parser.add_argument("--probes", type=int, default=8)
    parser.add_argument("--profile", type=Path, default=None)
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="darkbloom-bench-batch-"))
    coord = start_coordinator(root / "coordinator", f"sqlite+aiosqlite:///{root / 'c.db'}",
                              env={"DARKBLOOM_BATCH_POLL_INTERVAL": "0.2"})
    node = None
    try:
        owner = create_account(coord)
        login_node(coord, root / "node", owner)
        node = start_node(coord, root / "node", "--max-concurrency", "4")
        wait_online(coord, owner)
        url, headers = coord.api_url, owner.headers()
        load_before = os.getloadavg()[0]
        with httpx.Client(timeout=600) as client:
            live(client, url, {**headers, **SELF}, lines(8, offset=10**6), 4)  # warm-up: the model loaded
            rows = []
            for concurrency in (3, 4):
                seconds, tokens = live(client, url, {**headers, **SELF}, lines(args.lines), concurrency)
                rows.append((f"live, {concurrency} at a time", seconds, tokens))
            batch_id = submit(client, url, headers, lines(args.lines))
            started = time.perf_counter()
            if args.profile is not None:  # 20 s of the batch, its CPU per thread over the same 20 s
                args.profile.mkdir(parents=True, exist_ok=True)
                pid = coord.process.proc.pid
                cpu_before = profile_summary.thread_cpu(pid)
                profile_summary.record(pid, PROFILE_SECONDS, args.profile / "coordinator-batch-gil.raw", "gil").wait()
                cpu_after = profile_summary.thread_cpu(pid)
            done = wait_until(lambda: (s := batch_state(client, url, headers, batch_id))["status"] == "completed" and s,
                              timeout=3600, interval=0.25, what="the batch completed")
            seconds = time.perf_counter() - started
            usage = client.get(url + "/payments/usage?limit=500", headers=headers).json()["data"]
            per_line = statistics.median(r["completion_tokens"] for r in usage if r.get("batch_id") == batch_id)
            rows.append(("batch (3 slots of 4, 1 kept free)", seconds, int(per_line * done["request_counts"]["completed"])))
            # interactive requests: alone, then during a second batch
            idle = [ttft(client, url, headers, probe) for probe in range(args.probes)]
            second = submit(client, url, headers, lines(args.lines, offset=10**5))
            wait_until(lambda: batch_state(client, url, headers, second)["request_counts"]["completed"] >= 10,
                       timeout=600, interval=0.2, what="the second batch running")
            during = []
            for probe in range(args.probes):
                during.append(ttft(client, url, headers, 100 + probe))
                time.sleep(1.0)
            still_running = batch_state(client, url, headers, second)["status"] == "in_progress"
            client.post(f"{url}/batches/{second}/cancel", headers=headers)
        print(f"bench/batch_throughput.py — {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, "
              f"{platform.machine()}, {os.cpu_count()} cores; {MODEL} on llama.cpp, --max-concurrency 4; "
              f"{args.lines} lines of max_tokens 16; load average {load_before:.2f} before, "
              f"{os.getloadavg()[0]:.2f} after")
        print()
        print("| the same lines, on one owned machine | seconds | lines/s | completion tokens/s | ÷ live at 3 |")
        print("|---|---|---|---|---|")
        base = args.lines / rows[0][1]
        for name, seconds, tokens in rows:
            print(f"| {name} | {seconds:.1f} | {args.lines / seconds:.2f} | {tokens / seconds:.1f} "
                  f"| {args.lines / seconds / base:.2f} |")
        idle_p50, during_p50 = statistics.median(idle), statistics.median(during)
        print()
        print("| an interactive request (streamed, max_tokens 16) | TTFT p50 ms | max ms |")
        print("|---|---|---|")
        print(f"| alone on the idle machine | {idle_p50 * 1e3:.0f} | {max(idle) * 1e3:.0f} |")
        print(f"| during a batch{'' if still_running else ' (it ended before the last probe)'} "
              f"| {during_p50 * 1e3:.0f} | {max(during) * 1e3:.0f} |")
        print(f"\nduring ÷ idle: {during_p50 / idle_p50:.2f}")
        if args.profile is not None:
            raw = (args.profile / "coordinator-batch-gil.raw").read_text()
            print("\ncoordinator during the batch (py-spy, GIL samples):\n")
            print(profile_summary.cpu_table(cpu_before, cpu_after, PROFILE_SECONDS, [raw]))
            print(profile_summary.summarise(raw, top=10))
    finally:
        if node is not None:
            node.stop()
        coord.stop()


if __name__ == "__main__":
    threading.current_thread().name = "bench"
    main()
