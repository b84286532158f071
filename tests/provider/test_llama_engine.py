"""The llama.cpp engine: one context, many conversations (batched steps, prefix reuse, one sequence's
end leaving the others alone). Under batching floating-point results may change: these tests assert
on structure and counts, never on the words."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import jsonschema
import pytest

from darkbloom.provider.backends.base import BackendError, request_priority
from darkbloom.provider.backends.chunks import ChatChunks
from darkbloom.provider.backends.llama_engine import Engine, _common_prefix, _reuse
from tests.support.recording_backend import RecordingLlamaCppBackend

MODEL = "smollm2-135m"
STORY = "Write a very long story about a dragon and a lighthouse."
PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                           "age": {"type": "integer"}},
          "required": ["name", "age"], "additionalProperties": False}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 24}}, "required": ["city"]}}}


pytestmark = pytest.mark.llama(max_concurrency=4, n_ctx=1024)  # the backend fixture's size (conftest)


def engine_of(backend: RecordingLlamaCppBackend) -> Engine:
    engine = backend._residency.engine(MODEL, "chat")
    assert isinstance(engine, Engine)
    return engine


async def answer(backend: RecordingLlamaCppBackend, body: dict[str, Any]) -> tuple[str, str, str, dict[str, Any]]:
    """(content, tool call arguments, finish_reason, usage) as an SDK merges the streamed deltas."""
    text, arguments, finish, usage = "", "", "", {}
    async for chunk in backend.stream_chat(MODEL, body):
        if not chunk["choices"]:
            usage = chunk["usage"]
            continue
        choice = chunk["choices"][0]
        text += choice["delta"].get("content") or ""
        for call in choice["delta"].get("tool_calls") or ():
            arguments += call["function"].get("arguments", "")
        finish = choice["finish_reason"] or finish
    return text, arguments, finish, usage


def story(n: int, max_tokens: int) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": f"{STORY} Start with the number {n}."}],
            "max_tokens": max_tokens, "temperature": 0}


async def test_four_conversations_are_decoded_together(backend: RecordingLlamaCppBackend) -> None:
    engine = engine_of(backend)
    before = engine.steps
    answers = await asyncio.gather(*(answer(backend, story(n, 24)) for n in range(4)))
    for text, _, finish, usage in answers:
        assert text.strip() and finish == "length" and usage["completion_tokens"] == 24
    assert len({text for text, *_ in answers}) > 1  # four conversations, not one answer copied
    # one after the other: at least 4 × (1 prompt step + 24) = 100; together, about one step per token for
    # all four (what a busy machine's late arrivals add is a few steps, not a request's worth)
    assert engine.steps - before <= 60
    assert len(backend.recent) == 4 and not any(g.cancelled for g in backend.recent)


async def test_cancelling_one_of_four_leaves_the_others_complete(backend: RecordingLlamaCppBackend) -> None:
    async def cancelled_early() -> None:
        stream = backend.stream_chat(MODEL, story(9, 200))
        for _ in range(4):  # the role and three pieces
            await stream.__anext__()
        await stream.aclose()

    others = [asyncio.create_task(answer(backend, story(n, 60))) for n in range(3)]
    await cancelled_early()
    for text, _, finish, usage in await asyncio.gather(*others):
        assert text.strip() and finish == "length" and usage["completion_tokens"] == 60
    while len(backend.recent) < 4:
        await asyncio.sleep(0.01)
    [stopped] = [g for g in backend.recent if g.cancelled]
    assert 3 <= stopped.completion_tokens < 200


async def test_tools_and_json_schema_under_concurrency_each_parse(backend: RecordingLlamaCppBackend) -> None:
    person = {"messages": [{"role": "user", "content": "Invent a person."}], "max_tokens": 120,
              "response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON}}}
    call = {"messages": [{"role": "user", "content": "What is the weather in Paris?"}], "max_tokens": 120,
            "tools": [WEATHER], "tool_choice": "required"}
    results = await asyncio.gather(answer(backend, person), answer(backend, call), answer(backend, person),
                                   answer(backend, call))
    for text, _, finish, _ in results[::2]:
        assert finish == "stop"
        jsonschema.validate(json.loads(text), PERSON)
    for _, arguments, finish, _ in results[1::2]:
        assert finish == "tool_calls"
        jsonschema.validate(json.loads(arguments), WEATHER["function"]["parameters"])


async def test_a_sequence_whose_grammar_cannot_go_on_ends_alone(backend: RecordingLlamaCppBackend) -> None:
    engine = engine_of(backend)
    opening = [t for t in range(engine.model.n_vocab()) if engine.model.detokenize([t]).startswith(b"{")]
    stuck = {"messages": [{"role": "user", "content": "Invent a person."}], "max_tokens": 40,
             "response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON}},
             "logit_bias": {str(t): -100 for t in opening}}  # the grammar's only way to begin, banned
    others = [asyncio.create_task(answer(backend, story(n, 30))) for n in range(3)]
    with pytest.raises(BackendError) as failed:
        await answer(backend, stuck)
    assert (failed.value.status_code, failed.value.param) == (400, "response_format")
    for text, _, finish, usage in await asyncio.gather(*others):
        assert text.strip() and finish == "length" and usage["completion_tokens"] == 30
    assert (await answer(backend, story(5, 3)))[2] == "length"  # the engine serves on


async def test_a_second_turn_reuses_the_first_and_reports_it(backend: RecordingLlamaCppBackend) -> None:
    first = [{"role": "user", "content": "Tell me about lighthouses."}]
    text, _, _, usage = await answer(backend, {"messages": first, "max_tokens": 30, "temperature": 0})
    assert usage["prompt_tokens_details"] == {"cached_tokens": 0}
    other = await answer(backend, story(3, 10))  # another conversation takes another slot
    assert other[3]["prompt_tokens_details"]["cached_tokens"] < other[3]["prompt_tokens"] // 2
    second = [*first, {"role": "assistant", "content": text}, {"role": "user", "content": "And who keeps them?"}]
    _, _, _, usage = await answer(backend, {"messages": second, "max_tokens": 10, "temperature": 0})
    cached = usage["prompt_tokens_details"]["cached_tokens"]
    assert backend.recent[0].prompt_tokens + 20 <= cached < usage["prompt_tokens"]  # the question and the answer
    assert backend.recent[-1].cached_tokens == cached


async def test_the_same_prompt_again_reads_only_its_last_token(backend: RecordingLlamaCppBackend) -> None:
    body = story(1, 4)
    await answer(backend, body)
    _, _, _, usage = await answer(backend, body)
    assert usage["prompt_tokens_details"]["cached_tokens"] == usage["prompt_tokens"] - 1  # its logits are needed


def test_slot_choice_prefers_the_conversation_then_an_empty_slot() -> None:
    system, history = [1, 2, 3], [1, 2, 3, 10, 11, 12, 13]
    assert _common_prefix(history, [1, 2, 3, 10, 11, 99]) == 5 and _common_prefix([], [1]) == 0
    assert _reuse(history, [*history, 20, 21]) == len(history)  # the next turn: all of it
    assert _reuse([], [*system, 40]) == 0  # an empty slot
    assert _reuse(history, [*system, 40]) < 0  # another conversation's slot: dropping it costs more than it gives


async def test_a_sequence_whose_callback_fails_ends_alone(backend: RecordingLlamaCppBackend,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    piece = ChatChunks.piece

    def failing(self: ChatChunks, item: Any) -> None:
        if any(tool.name == "boom" for tool in self.plan.tools):
            raise RuntimeError("a bug in one request's chunks")
        piece(self, item)
    monkeypatch.setattr(ChatChunks, "piece", failing)
    others = [asyncio.create_task(answer(backend, story(n, 20))) for n in range(3)]
    boom = {"type": "function", "function": {"name": "boom", "parameters": {"type": "object"}}}
    with pytest.raises(BackendError) as failed:
        await answer(backend, {"messages": [{"role": "user", "content": "BOOM"}], "max_tokens": 20,
                               "tools": [boom], "tool_choice": "none"})
    assert failed.value.status_code == 500 and "BOOM" not in failed.value.message
    for text, _, finish, usage in await asyncio.gather(*others):
        assert text.strip() and finish == "length" and usage["completion_tokens"] == 20


async def test_batch_lines_wait_while_a_live_prompt_is_read(backend: RecordingLlamaCppBackend,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """A coordinator's batch lines (request_priority "batch") step behind a live request: while its
    prompt is read, a step holds only live work, so its first token comes as on an idle engine."""
    engine = engine_of(backend)
    steps: list[tuple[int, bool]] = []  # (step number, a live prompt was being read in it)
    advanced: list[tuple[int, bool]] = []  # (step number, the sequence that sampled is a batch line)
    step, advance = engine._step, engine._advance

    def recording_step() -> None:
        reading = any(s.sequence is not None and s.sequence.next_token is None
                      and not s.sequence.generation.background for s in engine.slots)
        steps.append((engine.steps + 1, reading))
        step()

    def recording_advance(slot: Any, logits: Any) -> None:
        advanced.append((engine.steps, slot.sequence.generation.background))
        advance(slot, logits)

    monkeypatch.setattr(engine, "_step", recording_step)
    monkeypatch.setattr(engine, "_advance", recording_advance)

    async def batch_line(n: int) -> tuple[str, str, str, dict[str, Any]]:
        request_priority.set("batch")  # this task's, as the node's task serving a batch line sets it
        return await answer(backend, story(n, 80))

    lines = [asyncio.create_task(batch_line(n)) for n in range(3)]
    while sum(1 for _, background in advanced if background) < 6:  # the batch lines are generating
        await asyncio.sleep(0.01)
    long_prompt = {"messages": [{"role": "user", "content": "Read this carefully. " * 60 + "Now say hi."}],
                   "max_tokens": 4, "temperature": 0}
    text, _, _, usage = await answer(backend, long_prompt)
    assert usage["prompt_tokens"] > engine.prompt_step  # read over several steps
    for text, _, finish, _ in await asyncio.gather(*lines):
        assert text and finish == "length"
    reading = {number for number, live in steps if live}
    assert len(reading) >= 2
    assert not [number for number, background in advanced if background and number in reading]
    assert any(background for number, background in advanced if number not in reading)
