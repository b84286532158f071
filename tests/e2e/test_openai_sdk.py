"""The official openai SDK against a real coordinator and a real node on SmolLM2."""

from __future__ import annotations

import openai
import pytest
from openai import OpenAI

from tests.e2e.conftest import Stack

pytestmark = pytest.mark.e2e

MODEL = "smollm2-135m"
PROMPT = [{"role": "user", "content": "Name one colour."}]


def client(stack: Stack, key: str | None = None) -> OpenAI:
    return OpenAI(base_url=stack.coordinator.api_url, api_key=key or stack.owner.api_key, max_retries=0)


def test_non_streaming_answer_has_real_usage(stack: Stack) -> None:
    raw = client(stack).chat.completions.with_raw_response.create(model=MODEL, messages=PROMPT, max_tokens=16)
    reply = raw.parse()
    assert reply.model == MODEL
    assert reply.choices[0].message.role == "assistant"
    assert reply.choices[0].message.content.strip()
    assert reply.usage.prompt_tokens > 0 and reply.usage.completion_tokens > 0
    assert reply.usage.total_tokens == reply.usage.prompt_tokens + reply.usage.completion_tokens
    assert raw.headers["x-request-id"] == reply.id
    assert raw.headers["x-provider-id"].startswith("prov_")


def test_streaming_without_include_usage_has_choices_in_every_chunk(stack: Stack) -> None:
    """The classic loop ``c.choices[0].delta.content`` works: no final ``choices: []`` chunk unless asked."""
    stream = client(stack).chat.completions.create(model=MODEL, messages=PROMPT, max_tokens=16, stream=True)
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks).strip()
    assert all(c.usage is None for c in chunks)


def test_streaming_answer_assembles_from_chunks(stack: Stack) -> None:
    stream = client(stack).chat.completions.create(model=MODEL, messages=PROMPT, max_tokens=16, stream=True,
                                                   stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text.strip()
    assert len({c.id for c in chunks}) == 1
    assert all(c.model == MODEL for c in chunks)
    usage_chunks = [c for c in chunks if c.usage is not None]
    assert len(usage_chunks) == 1 and usage_chunks[0] is chunks[-1]
    assert usage_chunks[0].usage.completion_tokens > 0


def test_model_list(stack: Stack) -> None:
    models = client(stack).models.list()
    assert MODEL in [m.id for m in models.data]
    assert client(stack).models.retrieve(MODEL).id == MODEL


def test_bad_key_is_401(stack: Stack) -> None:
    with pytest.raises(openai.AuthenticationError) as caught:
        client(stack, key="dk-not-a-real-key").chat.completions.create(model=MODEL, messages=PROMPT)
    assert caught.value.status_code == 401
    assert caught.value.body["type"] == "invalid_api_key"


def test_unknown_model_is_404_model_not_found(stack: Stack) -> None:
    with pytest.raises(openai.NotFoundError) as caught:
        client(stack).chat.completions.create(model="no-such-model", messages=PROMPT)
    assert caught.value.code == "model_not_found"


def test_an_image_for_a_text_only_model_is_400_model_capability_unsupported(stack: Stack) -> None:
    """Not a 503 that SDKs retry: the bundled model serves text only, so no retry can succeed."""
    import openai

    image = {"role": "user", "content": [{"type": "text", "text": "What is this?"},
                                         {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}
    with pytest.raises(openai.BadRequestError) as refused:
        client(stack).with_options(max_retries=0).chat.completions.create(model=MODEL, messages=[image],
                                                                          max_tokens=8)
    assert refused.value.status_code == 400
    assert refused.value.code == "model_capability_unsupported"
    assert refused.value.response.headers["x-should-retry"] == "false"
