"""docs/self-route.md's examples run as written against a live stack, so the docs cannot rot.

Every ```bash block (curl) runs under `bash -euo pipefail` and every ```python block (the `openai`
SDK) under this interpreter, with `DARKBLOOM_API_KEY` set to a real key and the docs' base URL
`http://127.0.0.1:8080` replaced by the live coordinator's. ```sh and ```toml blocks are
illustrations (shell set-up, config files) and are not run.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import pytest

from tests.selfroute.support import FIXED_ANSWER, Node, Stack, start_upstream
from tests.support.accounts import Account

pytestmark = pytest.mark.e2e

DOC = Path(__file__).resolve().parents[2] / "docs" / "self-route.md"
DOC_BASE_URL = "http://127.0.0.1:8080"
CREDIT = 10_000_000


def blocks(language: str) -> list[str]:
    return re.findall(rf"^```{language}\n(.*?)^```$", DOC.read_text(), flags=re.S | re.M)


@dataclass
class World:
    stack: Stack
    owner: Account
    node: Node


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[World]:
    root = tmp_path_factory.mktemp("docs")
    stack = Stack.start(root)
    try:
        upstream, url = start_upstream(root / "upstream")
        stack.processes.append(upstream)
        owner = stack.account(credit=CREDIT)
        node = stack.node("node", owner, upstream=url)
        yield World(stack, owner, node)
    finally:
        stack.close()


def _run(world: World, argv: list[str], code: str) -> str:
    assert DOC_BASE_URL in code, code
    code = code.replace(DOC_BASE_URL, world.stack.coordinator.base_url)
    env = {**os.environ, "DARKBLOOM_API_KEY": world.owner.api_key}
    result = subprocess.run([*argv, code], env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, f"{code}\n--- stdout\n{result.stdout}\n--- stderr\n{result.stderr}"
    assert '"error"' not in result.stdout, result.stdout
    return result.stdout


def _json_values(output: str) -> list[dict[str, object]]:
    """Consecutive JSON documents (curl prints each response without a newline after it)."""
    decoder, values, at = json.JSONDecoder(), [], 0
    while at < len(output.rstrip()):
        value, at = decoder.raw_decode(output, at)
        values.append(value)
        while at < len(output) and output[at].isspace():
            at += 1
    return values


def test_the_docs_have_the_examples_this_test_runs() -> None:
    assert len(blocks("bash")) == 6
    assert len(blocks("python")) == 2
    assert all("curl" in block for block in blocks("bash"))
    assert all("X-Darkbloom-Route" in block for block in blocks("python"))


def test_curl_examples(world: World) -> None:
    s = world.stack
    exclusive, prefer, streaming, key, listing, pinned = (_run(world, ["bash", "-euo", "pipefail", "-c"], b)
                                                         for b in blocks("bash"))
    body = json.loads(exclusive)
    assert body["object"] == "chat.completion" and body["choices"][0]["message"]["content"] == FIXED_ANSWER

    head, _, rest = prefer.partition("\n\n")  # (text mode has turned CRLF into LF)
    assert re.search(r"^x-darkbloom-routed: owned$", head, flags=re.M | re.I), head
    assert re.search(r"^x-darkbloom-billing: free$", head, flags=re.M | re.I), head
    assert json.loads(rest)["choices"][0]["message"]["content"] == FIXED_ANSWER

    assert streaming.count("data: [DONE]") == 1
    assert "chat.completion.chunk" in streaming

    made = json.loads(key)
    assert made["self_route_only"] is True and made["key"].startswith("dk-")
    # the key made by the example is exclusive: served free on the owner's machine without a header
    served = s.chat(made["key"])
    assert served.status_code == 200 and served.headers["x-darkbloom-billing"] == "free"

    self_route_models, models = _json_values(listing)
    assert self_route_models == {"models": ["smollm2-135m"]}
    assert [m["id"] for m in models["data"]] == ["smollm2-135m"]  # type: ignore[index]

    assert json.loads(pinned)["choices"][0]["message"]["content"] == FIXED_ANSWER
    assert s.balance(world.owner) == CREDIT  # every example was free
    assert len(world.node.accepted()) == 5


def test_python_examples(world: World) -> None:
    plain, prefer = (_run(world, [sys.executable, "-c"], b) for b in blocks("python"))
    assert plain.splitlines() == [FIXED_ANSWER, FIXED_ANSWER]
    assert prefer.splitlines() == ["routed: owned billing: free", FIXED_ANSWER]
    assert world.stack.balance(world.owner) == CREDIT
