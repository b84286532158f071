"""What every client test shares: the stack (one coordinator, one node, four accounts), the cell
marker, and the schemas the tiny model answers under. Schemas use enums and integers so that an
answer forced by a grammar is short and always valid; tests assert on shapes, never on wording."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Literal, TypeVar

import httpx
import jsonschema
import pytest
from pydantic import BaseModel, ConfigDict

from tests.support.accounts import Account, balance
from tests.support.processes import Coordinator, Process, wait_until

HERE = Path(__file__).resolve().parent
RESULTS = HERE / ".results.json"
NODE_DIR = HERE / "node"
MODEL = "smollm2-135m"
PROMPT = "Name one colour."
MESSAGES = [{"role": "user", "content": PROMPT}]
SELF = {"X-Darkbloom-Route": "self"}
# the PyPI distributions whose versions docs/compatibility.md names (the test extra pins them)
CLIENT_PACKAGES = ("openai", "openai-agents", "langchain-openai", "instructor", "pydantic-ai-slim", "llm",
                   "litellm", "anthropic")

F = TypeVar("F", bound=Callable[..., Any])


def cell(client: str, *features: str) -> Callable[[F], F]:
    """Mark a test as deciding these cells of the table (client row, feature columns)."""
    def apply(test: F) -> F:
        for feature in features:
            test = pytest.mark.cell(client, feature)(test)
        return test
    return apply


def errors(client: str, cases: list[Any]) -> list[Any]:
    """Parameters of an error test, one per status, each deciding its own cell: a case is the status
    ("401", "404", "402" or "429") or a tuple that starts with it."""
    return [pytest.param(*(case if isinstance(case, tuple) else (case,)),
                         marks=pytest.mark.cell(client, case[0] if isinstance(case, tuple) else case),
                         id=case[0] if isinstance(case, tuple) else case) for case in cases]


# structured output: {"colour": one of three, "count": an integer}
class Colour(BaseModel):
    model_config = ConfigDict(extra="forbid")
    colour: Literal["red", "green", "blue"]
    count: int


COLOUR_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {"colour": {"type": "string", "enum": ["red", "green", "blue"]}, "count": {"type": "integer"}},
    "required": ["colour", "count"], "additionalProperties": False,
}
COLOUR_FORMAT = {"type": "json_schema", "json_schema": {"name": "colour", "schema": COLOUR_SCHEMA, "strict": True}}


# a forced tool call: get_weather(city)
class Weather(BaseModel):
    """The weather in a city."""
    model_config = ConfigDict(extra="forbid")
    city: Literal["Paris", "London", "Tokyo"]


WEATHER_SCHEMA: dict[str, Any] = {
    "type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "London", "Tokyo"]}},
    "required": ["city"], "additionalProperties": False,
}
WEATHER_TOOL = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city.",
                                                 "parameters": WEATHER_SCHEMA}}
FORCE_WEATHER = {"type": "function", "function": {"name": "get_weather"}}
WEATHER_PROMPT = "What is the weather in Paris?"


def valid(instance: Any, schema: dict[str, Any]) -> Any:
    """``instance`` (a JSON text or a decoded value), checked against ``schema``; returns the value."""
    value = json.loads(instance) if isinstance(instance, str) else instance
    jsonschema.validate(value, schema)
    return value


@dataclass
class Stack:
    coordinator: Coordinator
    owner: Account        # owns the node; self-route tests only
    consumer: Account     # funded; the matrix's paid path
    broke: Account        # no balance: 402
    node: Process
    root: Path
    device_token: str     # the node's dkp- token (its owner's)

    @property
    def api_url(self) -> str:
        return self.coordinator.api_url

    @property
    def base_url(self) -> str:
        return self.coordinator.base_url

    @property
    def key(self) -> str:
        return self.consumer.api_key

    bad_key = "dk-" + "0" * 43

    def new_key(self, account: Account | None = None, **fields: object) -> str:
        response = httpx.post(self.api_url + "/keys", json={"name": "matrix", **fields},
                              headers={"Authorization": f"Bearer {(account or self.consumer).session}"})
        assert response.status_code == 201, response.text
        return str(response.json()["key"])

    def limited_key(self) -> str:
        """A key with `rpm_limit: 1` whose one request this minute is already spent: its next is a 429."""
        key = self.new_key(rpm_limit=1)
        spent = httpx.post(self.api_url + "/chat/completions", headers={"Authorization": f"Bearer {key}"},
                           json={"model": MODEL, "messages": MESSAGES, "max_tokens": 1}, timeout=60)
        assert spent.status_code == 200, spent.text
        return key

    def balance(self, account: Account) -> int:
        return balance(self.coordinator, account)

    def usage_row(self, account: Account, request_id: str) -> dict[str, Any]:
        """The usage row of one request (waits for the ledger writer to commit it)."""
        def row() -> dict[str, Any] | None:
            response = httpx.get(self.api_url + "/payments/usage?limit=200",
                                 headers={"Authorization": f"Bearer {account.session}"}, timeout=30)
            assert response.status_code == 200, response.text
            return next((r for r in response.json()["data"] if r["request_id"] == request_id), None)
        return dict(wait_until(row, timeout=20, interval=0.1, what=f"usage row of {request_id}"))

