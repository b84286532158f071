"""Direct mode vs the relayed Self-Route: the same prompt and max_tokens on the same node and real
model (the bundled SmolLM2-135M), once straight to the node's local endpoint and once through the
coordinator with `X-Darkbloom-Route: self`. Time to first token (first content chunk) and total
time of a streamed completion; runs alternate between the two paths so drift hits both alike.

Run: .venv/bin/python bench/direct_vs_relay.py [--runs 20] [--max-tokens 32]
Prints a table; record it in bench/RESULTS.md with the date and machine.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.support.accounts import create_account, login_node, start_node, wait_online  # noqa: E402
from tests.support.processes import free_port, start_coordinator, wait_until  # noqa: E402

MODEL = "smollm2-135m"
PROMPT = "Write a short poem about the sea."


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


def one(client: httpx.Client, url: str, headers: dict[str, str], max_tokens: int) -> tuple[float, float, int]:
    """(time to first token, total time, completion tokens) of one streamed completion."""
    body = {"model": MODEL, "stream": True, "max_tokens": max_tokens, "temperature": 0,
            "messages": [{"role": "user", "content": PROMPT}]}
    started = time.perf_counter()
    first: float | None = None
    tokens = -1
    with client.stream("POST", url, json=body, headers=headers) as response:
        assert response.status_code == 200, response.read()
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            assert "error" not in event, event
            if first is None and any((c.get("delta") or {}).get("content") for c in event.get("choices") or ()):
                first = time.perf_counter() - started
            if event.get("usage"):
                tokens = event["usage"]["completion_tokens"]
    total = time.perf_counter() - started
    assert first is not None, "no content"
    return first, total, tokens


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=20, help="measured runs per path")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--warmup", type=int, default=3, help="unmeasured runs per path first")
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="darkbloom-bench-direct-"))
    coord = start_coordinator(root / "coordinator", f"sqlite+aiosqlite:///{root / 'c.db'}")
    node = None
    try:
        owner = create_account(coord)  # no credit: Self-Route is free
        login_node(coord, root / "node", owner)
        node = start_node(coord, root / "node", "--local-endpoint", "--port", str(free_port()),
                          "--max-concurrency", "1")
        wait_online(coord, owner)
        local = wait_until(lambda: (root / "node" / "local.json").exists()
                           and json.loads((root / "node" / "local.json").read_text()), what="local.json")
        paths = {
            "direct (local endpoint)": (f"{local['base_url']}/chat/completions",
                                        {"Authorization": f"Bearer {local['api_key']}"}),
            "relayed self-route": (coord.api_url + "/chat/completions",
                                   {**owner.headers(), "X-Darkbloom-Route": "self"}),
        }
        results: dict[str, list[tuple[float, float, int]]] = {name: [] for name in paths}
        load_start = os.getloadavg()
        with httpx.Client(timeout=120) as client:
            for _ in range(args.warmup):
                for url, headers in paths.values():
                    one(client, url, headers, args.max_tokens)
            for _ in range(args.runs):
                for name, (url, headers) in paths.items():
                    results[name].append(one(client, url, headers, args.max_tokens))
        print(f"# direct vs relayed self-route — {time.strftime('%Y-%m-%d')} — {platform.node()} "
              f"({platform.machine()}, {os.cpu_count()} cores), {MODEL}, max_tokens {args.max_tokens}, "
              f"temperature 0, {args.runs} streamed runs per path (alternating), {args.warmup} warm-up each")
        print("| path | runs | TTFT min ms | TTFT p50 ms | TTFT p90 ms | total min ms | total p50 ms | total p90 ms "
              "| completion tokens |")
        print("|---|---|---|---|---|---|---|---|---|")
        medians: dict[str, tuple[float, float]] = {}
        for name, rows in results.items():
            ttft = [r[0] * 1e3 for r in rows]
            total = [r[1] * 1e3 for r in rows]
            tokens = sorted({r[2] for r in rows})
            medians[name] = (statistics.median(ttft), statistics.median(total))
            print(f"| {name} | {len(rows)} | {min(ttft):.1f} | {statistics.median(ttft):.1f} "
                  f"| {percentile(ttft, 0.9):.1f} | {min(total):.1f} | {statistics.median(total):.1f} "
                  f"| {percentile(total, 0.9):.1f} | {', '.join(map(str, tokens))} |")
        (direct_ttft, direct_total), (relay_ttft, relay_total) = medians.values()
        print(f"\nrelay adds (medians): {relay_ttft - direct_ttft:+.1f} ms to the first token, "
              f"{relay_total - direct_total:+.1f} ms in total; 1-min load average {load_start[0]:.2f} before "
              f"the runs, {os.getloadavg()[0]:.2f} after (other work on the machine inflates the totals)")
    finally:
        if node is not None:
            node.stop()
        coord.stop()


if __name__ == "__main__":
    main()
