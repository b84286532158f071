"""The cost in every answer, read with the clients themselves: each API's usage object carries
`cost_micro_usd`, whole and in the stream's usage event, and whole answers carry
`X-Darkbloom-Cost-Micro-USD` with the same figure. Over a mix of plain and streamed requests on
every API, what the answers say adds up to the usage rows and to what left the balance."""

from __future__ import annotations

from typing import Any

import anthropic
import pytest
from openai import OpenAI

from tests.clients.support import MESSAGES, MODEL, PROMPT, Stack
from tests.support.accounts import Account, create_account

pytestmark = pytest.mark.e2e

ASK = [{"role": "user", "content": PROMPT}]
COST_HEADER = "x-darkbloom-cost-micro-usd"


def _whole(raw: Any) -> tuple[str, int]:
    """A non-streamed answer's id and cost: the header and its usage object agree."""
    usage = raw.http_response.json()["usage"]
    assert isinstance(usage["cost_micro_usd"], int) and raw.headers[COST_HEADER] == str(usage["cost_micro_usd"])
    return raw.headers["x-request-id"], usage["cost_micro_usd"]


def test_answers_say_what_the_usage_rows_and_the_balance_say(stack: Stack) -> None:
    payer: Account = create_account(stack.coordinator, credit_micro_usd=10_000_000)
    openai_sdk = OpenAI(base_url=stack.api_url, api_key=payer.api_key, max_retries=0)
    anthropic_sdk = anthropic.Anthropic(base_url=stack.base_url, api_key=payer.api_key, max_retries=0)
    before = stack.balance(payer)
    said: dict[str, int] = {}  # request id → the cost its answer said

    # chat: whole (the SDK's raw response, then the parsed model keeps the extra field) and streamed
    raw = openai_sdk.chat.completions.with_raw_response.create(model=MODEL, messages=MESSAGES, max_tokens=8)
    request_id, cost = _whole(raw)
    assert raw.parse().usage.cost_micro_usd == cost > 0  # type: ignore[attr-defined]
    said[request_id] = cost
    chunks = list(openai_sdk.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=8, stream=True,
                                                     stream_options={"include_usage": True}))
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    said[chunks[-1].id] = chunks[-1].usage.cost_micro_usd  # type: ignore[attr-defined]

    # Responses: whole, and `response.completed` of a stream
    raw = openai_sdk.responses.with_raw_response.create(model=MODEL, input=PROMPT, max_output_tokens=8)
    request_id, cost = _whole(raw)
    assert raw.parse().usage.cost_micro_usd == cost  # type: ignore[union-attr]
    said[request_id] = cost
    with openai_sdk.responses.stream(model=MODEL, input=PROMPT, max_output_tokens=8) as stream:
        for _ in stream:
            pass
        final = stream.get_final_response()
    assert final.usage is not None
    said[final.id] = final.usage.cost_micro_usd  # type: ignore[attr-defined]

    # legacy completions: whole, and the include_usage chunk
    raw = openai_sdk.completions.with_raw_response.create(model=MODEL, prompt="Once upon a time", max_tokens=8)
    request_id, cost = _whole(raw)
    said[request_id] = cost
    pieces = list(openai_sdk.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=8, stream=True,
                                                stream_options={"include_usage": True}))
    assert pieces[-1].usage is not None
    said[pieces[-1].id] = pieces[-1].usage.cost_micro_usd  # type: ignore[attr-defined]

    # embeddings: whole only
    raw = openai_sdk.embeddings.with_raw_response.create(model=MODEL, input="red")
    request_id, cost = _whole(raw)
    assert raw.parse().usage.cost_micro_usd == cost  # type: ignore[attr-defined]
    said[request_id] = cost

    # Anthropic messages (another real client): whole, and `message_delta` of a stream
    raw = anthropic_sdk.messages.with_raw_response.create(model=MODEL, max_tokens=8, messages=ASK)
    request_id, cost = _whole(raw)
    message = raw.parse()
    assert message.usage.cost_micro_usd == cost  # type: ignore[attr-defined]
    said[message.id] = cost
    events = list(anthropic_sdk.messages.create(model=MODEL, max_tokens=8, messages=ASK, stream=True))
    start = next(e for e in events if e.type == "message_start")
    delta = next(e for e in events if e.type == "message_delta")
    said[start.message.id] = delta.usage.cost_micro_usd  # type: ignore[attr-defined, union-attr]

    assert len(said) == 9 and all(isinstance(cost, int) and cost > 0 for cost in said.values()), said
    rows = {request_id: stack.usage_row(payer, request_id)["cost_micro_usd"] for request_id in said}
    assert rows == said
    assert before - stack.balance(payer) == sum(said.values()) == sum(rows.values())


def test_a_self_routed_answer_says_it_cost_nothing(stack: Stack) -> None:
    """Exclusive self-route on the owner's machine: 0 in the header, the usage and the stream's usage chunk."""
    client = OpenAI(base_url=stack.api_url, api_key=stack.owner.api_key, max_retries=0,
                    default_headers={"X-Darkbloom-Route": "self"})
    before = stack.balance(stack.owner)
    raw = client.chat.completions.with_raw_response.create(model=MODEL, messages=MESSAGES, max_tokens=8)
    request_id, cost = _whole(raw)
    assert cost == 0 and raw.headers["x-darkbloom-billing"] == "free"
    chunks = list(client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=8, stream=True,
                                                 stream_options={"include_usage": True}))
    assert chunks[-1].usage.cost_micro_usd == 0  # type: ignore[union-attr]
    for answer in (request_id, chunks[-1].id):
        assert stack.usage_row(stack.owner, answer)["cost_micro_usd"] == 0
    assert stack.balance(stack.owner) == before
