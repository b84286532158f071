"""A conversation's second turn through the coordinator beside direct mode: does it find its cache?

One coordinator (SQLite) and three nodes on the bundled SmolLM2-135M, on this machine:

- node A, owned by the caller, with its local endpoint: **direct** mode, and **Self-Route**
  (`X-Darkbloom-Route: self`, one machine);
- nodes B and C, another account's: the **public** fleet (two machines), the caller paying.

Each round and path takes a new conversation with a ~1,400-token history (bench/node_engine.py's:
a long system prompt, three turns, a question), answers its first turn, then sends its second turn
(the answer and a new question appended): the second turn's time to first token, its
`usage.prompt_tokens_details.cached_tokens`, and (public) whether it landed on the machine that
served the first (`X-Provider-Id`). Paths alternate within a round so drift hits them alike; the
nodes serve one request at a time (`--max-concurrency 1`) so the public fleet's choice matters.

Run: .venv/bin/python bench/conversation_turns.py [--rounds 6]
Prints a table with each path's ratio to direct mode; record it in bench/RESULTS.md.
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
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.node_engine import Vocab, conversation  # noqa: E402
from darkbloom.provider.bundled_model import bundled_gguf_path  # noqa: E402
from tests.support.accounts import create_account, login_node, start_node, wait_online  # noqa: E402
from tests.support.processes import free_port, start_coordinator, wait_until  # noqa: E402

MODEL = "smollm2-135m"
NEXT = "Thank you. Now which team is busiest, by that list?"


def turn(client: httpx.Client, url: str, headers: dict[str, str], messages: list[dict[str, str]],
         max_tokens: int) -> dict[str, Any]:
    """One streamed chat: its text, time to first content, usage and the serving provider (if relayed)."""
    body = {"model": MODEL, "messages": messages, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    started = time.perf_counter()
    first: float | None = None
    text, usage = "", {}
    with client.stream("POST", url, json=body, headers=headers) as response:
        assert response.status_code == 200, response.read()
        provider = response.headers.get("x-provider-id", "")
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            assert "error" not in event, event
            for choice in event.get("choices") or ():
                content = (choice.get("delta") or {}).get("content")
                if content:
                    first = first or time.perf_counter() - started
                    text += content
            usage = event.get("usage") or usage
    assert first is not None, "no content"
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    return {"ttft": first, "text": text, "prompt": usage.get("prompt_tokens", 0), "cached": cached,
            "provider": provider}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=6)
    args = parser.parse_args()
    vocab = Vocab(bundled_gguf_path())
    root = Path(tempfile.mkdtemp(prefix="darkbloom-bench-turns-"))
    coord = start_coordinator(root / "coordinator", f"sqlite+aiosqlite:///{root / 'c.db'}")
    nodes = []
    try:
        caller = create_account(coord, credit_micro_usd=100_000_000)
        provider = create_account(coord)
        login_node(coord, root / "a", caller)
        nodes.append(start_node(coord, root / "a", "--local-endpoint", "--port", str(free_port()),
                                "--max-concurrency", "1"))
        for name in ("b", "c"):
            login_node(coord, root / name, provider)
            nodes.append(start_node(coord, root / name, "--max-concurrency", "1"))
        wait_online(coord, caller)
        wait_online(coord, provider, count=2)
        local = wait_until(lambda: (root / "a" / "local.json").exists()
                           and json.loads((root / "a" / "local.json").read_text()), what="local.json")
        paths = {
            "direct (node A)": (f"{local['base_url']}/chat/completions",
                                {"Authorization": f"Bearer {local['api_key']}"}),
            "Self-Route (node A)": (coord.api_url + "/chat/completions",
                                    {**caller.headers(), "X-Darkbloom-Route": "self"}),
            "public (nodes B, C)": (coord.api_url + "/chat/completions", caller.headers()),
        }
        rows: dict[str, list[dict[str, Any]]] = {name: [] for name in paths}
        same_machine: list[bool] = []
        load_before = os.getloadavg()[0]
        with httpx.Client(timeout=300) as client:
            for round_number in range(args.rounds):
                order = list(paths.items())
                order = order[round_number % len(order):] + order[:round_number % len(order)]
                for index, (name, (url, headers)) in enumerate(order):
                    history = conversation(1000 * round_number + index + 7, vocab)
                    first = turn(client, url, headers, history, 32)
                    history += [{"role": "assistant", "content": first["text"]}, {"role": "user", "content": NEXT}]
                    second = turn(client, url, headers, history, 16)
                    if round_number > 0:  # the first round warms every path up
                        rows[name].append(second)
                        if name.startswith("public"):
                            same_machine.append(second["provider"] == first["provider"])
        direct = statistics.median(r["ttft"] for r in rows["direct (node A)"])
        print(f"bench/conversation_turns.py — {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, "
              f"{platform.machine()}, {os.cpu_count()} cores; {MODEL}; {args.rounds - 1} measured rounds "
              f"(1 warm-up), --max-concurrency 1 per node; load average {load_before:.2f} before, "
              f"{os.getloadavg()[0]:.2f} after")
        print()
        print("| 2nd turn of a ~1,400-token conversation | TTFT p50 ms | max ms | ÷ direct | cached tokens p50 "
              "| prompt tokens p50 |")
        print("|---|---|---|---|---|---|")
        for name, measured in rows.items():
            ttft = statistics.median(r["ttft"] for r in measured)
            print(f"| {name} | {ttft * 1e3:.0f} | {max(r['ttft'] for r in measured) * 1e3:.0f} "
                  f"| {ttft / direct:.2f} | {statistics.median(r['cached'] for r in measured):.0f} "
                  f"| {statistics.median(r['prompt'] for r in measured):.0f} |")
        print(f"\npublic: the 2nd turn landed on the machine of the 1st in {sum(same_machine)} of "
              f"{len(same_machine)}")
    finally:
        for node in nodes:
            node.stop()
        coord.stop()


if __name__ == "__main__":
    main()
