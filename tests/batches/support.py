"""A batch world: a coordinator (SQLite or Postgres) with a priced catalog, nodes on the `openai`
backend in front of bench/fixed_upstream.py (instant, identical answers), accounts made over HTTP,
and the `openai` SDK's `files` and `batches` calls as a user makes them."""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any

import openai

from tests.selfroute.support import Stack
from tests.support.billing import write_catalog
from tests.support.processes import start_coordinator, wait_until

MODEL = "fixed-model"
# prices high enough that a line's cost, and half of it, are above the minimum charge (100 µUSD)
PRICES = {"input_price": 10_000_000, "output_price": 40_000_000, "max_output_tokens": 64}
FAST = {"DARKBLOOM_BATCH_POLL_INTERVAL": "0.2", "DARKBLOOM_BATCH_RETRY_SECONDS": "1",
        "DARKBLOOM_BATCH_LEASE_SECONDS": "4", "DARKBLOOM_INSTANCE_STALE_AFTER": "3"}
ENDED = ("completed", "failed", "expired", "cancelled")


def priced_stack(root: Path, database_url: str, *args: str) -> Stack:
    catalog = write_catalog(root / "catalog.json", {"id": MODEL, **PRICES})
    coordinator = start_coordinator(root / "coordinator", database_url, "--catalog", str(catalog),
                                    "--min-trust", "none", *args, env=FAST)
    return Stack(root, coordinator)


def chat_line(custom_id: str, content: str = "Say something.", max_tokens: int = 16) -> dict[str, Any]:
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": max_tokens}}


def jsonl(lines: list[dict[str, Any]]) -> bytes:
    return ("\n".join(json.dumps(line) for line in lines) + "\n").encode()


def sdk(url: str, token: str, route: str | None = None) -> openai.OpenAI:
    headers = {"X-Darkbloom-Route": route} if route else None
    return openai.OpenAI(base_url=url, api_key=token, default_headers=headers, max_retries=0, timeout=60)


def run_batch(client: openai.OpenAI, lines: list[dict[str, Any]], endpoint: str = "/v1/chat/completions") -> Any:
    uploaded = client.files.create(file=("input.jsonl", io.BytesIO(jsonl(lines))), purpose="batch")
    return client.batches.create(input_file_id=uploaded.id, endpoint=endpoint,  # type: ignore[arg-type]
                                 completion_window="24h")


def wait_status(client: openai.OpenAI, batch_id: str, statuses: tuple[str, ...] = ENDED,
                timeout: float = 120) -> Any:
    def reached() -> Any:
        batch = client.batches.retrieve(batch_id)
        return batch if batch.status in statuses else None
    return wait_until(reached, timeout=timeout, interval=0.2, what=f"batch {batch_id} {'/'.join(statuses)}")


def file_lines(client: openai.OpenAI, file_id: str | None) -> list[dict[str, Any]]:
    if file_id is None:
        return []
    return [json.loads(line) for line in client.files.content(file_id).text.splitlines()]


def wait_counts(client: openai.OpenAI, batch_id: str, completed: int, timeout: float = 60) -> Any:
    return wait_until(lambda: (b := client.batches.retrieve(batch_id)).request_counts.completed >= completed and b,
                      timeout=timeout, interval=0.1, what=f"{completed} line(s) answered")
