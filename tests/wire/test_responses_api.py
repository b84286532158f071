"""The Responses API edge: request translation (and each 400 with its param), the request echo, and
the presenter's `response` object and event stream, checked with the openai SDK's own models and
stream accumulator and against the Open Responses specification's schemas."""

from __future__ import annotations

from typing import Any

import pytest
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter

from darkbloom.wire.openai.errors import ApiError
from darkbloom.wire.openai.parameters import CHAT_SAMPLING_DEFAULTS
from darkbloom.wire.openai.responses.presenter import ResponsesPresenter
from darkbloom.wire.openai.responses.request import responses_to_chat
from tests.support.open_responses import check_event, check_response
from tests.wire.node_chunks import chat, run_collect, run_stream, sse_events, text_chunks, tool_chunks

MODEL = "smollm2-135m"
EVENTS: TypeAdapter[Any] = TypeAdapter(ResponseStreamEvent)
WEATHER = {"type": "function", "name": "get_weather", "description": "Weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
           "strict": True}


def translate(**body: Any) -> dict[str, Any]:
    return responses_to_chat({"model": MODEL, **body})


def test_string_input_and_instructions() -> None:
    assert translate(input="Hi", instructions="Be brief.", max_output_tokens=16, temperature=0.2, top_p=0.9,
                     stream=True, store=False, metadata={"a": "b"}, truncation="disabled") == {
        "model": MODEL, "max_tokens": 16, "temperature": 0.2, "top_p": 0.9, "presence_penalty": 0.0,
        "frequency_penalty": 0.0, "stream": True,
        "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]}


def test_the_node_is_sent_every_sampling_number_its_defaults_filling_the_gaps() -> None:
    sent = translate(input="Hi", presence_penalty=0.5, frequency_penalty=-1)
    assert {key: sent[key] for key in ("temperature", "top_p", "presence_penalty", "frequency_penalty")} == {
        "temperature": CHAT_SAMPLING_DEFAULTS["temperature"], "top_p": CHAT_SAMPLING_DEFAULTS["top_p"],
        "presence_penalty": 0.5, "frequency_penalty": -1.0}


def test_echo_only_fields_are_not_forwarded() -> None:
    sent = translate(input="Hi", service_tier="flex", safety_identifier="user-1", prompt_cache_key="k",
                     max_tool_calls=2, top_logprobs=3, background=False, truncation="auto", metadata={"a": "b"})
    assert set(sent) == {"model", "messages", "temperature", "top_p", "presence_penalty", "frequency_penalty"}


def test_message_items_and_parts() -> None:
    chat_body = translate(input=[
        {"role": "developer", "content": "Rules."},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "What is "},
                                                         {"type": "input_text", "text": "this?"}]},
        {"role": "user", "content": [{"type": "input_text", "text": "See"},
                                     {"type": "input_image", "image_url": "data:image/png;base64,AAAA",
                                      "detail": "low"}]},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "A cat.",
                                                              "annotations": []}]},
        {"type": "reasoning", "id": "rs_1", "summary": []},
    ])
    assert chat_body["messages"] == [
        {"role": "system", "content": "Rules."},
        {"role": "user", "content": "What is this?"},
        {"role": "user", "content": [{"type": "text", "text": "See"},
                                     {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA",
                                                                         "detail": "low"}}]},
        {"role": "assistant", "content": "A cat."},
    ]


def test_function_calls_round_trip_into_chat_messages() -> None:
    chat_body = translate(input=[
        {"role": "user", "content": "Weather in Paris and Rome?"},
        {"type": "function_call", "id": "fc_1", "call_id": "call_1", "name": "get_weather",
         "arguments": '{"city": "Paris"}', "status": "completed"},
        {"type": "function_call", "call_id": "call_2", "name": "get_weather", "arguments": '{"city": "Rome"}'},
        {"type": "function_call_output", "call_id": "call_1", "output": "18C"},
        {"type": "function_call_output", "call_id": "call_2", "output": [{"type": "input_text", "text": "21C"}]},
    ], tools=[WEATHER], tool_choice="auto", parallel_tool_calls=False)
    assert chat_body["messages"][1:] == [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
            {"id": "call_2", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'}},
        ]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18C"},
        {"role": "tool", "tool_call_id": "call_2", "content": "21C"},
    ]
    assert chat_body["tools"] == [{"type": "function", "function": {
        "name": "get_weather", "description": "Weather in a city", "parameters": WEATHER["parameters"],
        "strict": True}}]
    assert chat_body["tool_choice"] == "auto" and chat_body["parallel_tool_calls"] is False


@pytest.mark.parametrize("given, sent", [
    ("none", "none"), ("required", "required"),
    ({"type": "function", "name": "get_weather"}, {"type": "function", "function": {"name": "get_weather"}}),
])
def test_tool_choice(given: Any, sent: Any) -> None:
    assert translate(input="Hi", tools=[WEATHER], tool_choice=given)["tool_choice"] == sent


@pytest.mark.parametrize("text, sent", [
    ({"format": {"type": "text"}}, None),
    ({"format": {"type": "json_object"}}, {"type": "json_object"}),
    ({"format": {"type": "json_schema", "name": "city", "schema": {"type": "object"}, "strict": True}},
     {"type": "json_schema", "json_schema": {"name": "city", "schema": {"type": "object"}, "strict": True}}),
    ({"verbosity": "low"}, None),
])
def test_text_format_becomes_response_format(text: dict[str, Any], sent: Any) -> None:
    assert translate(input="Hi", text=text).get("response_format") == sent


@pytest.mark.parametrize("change, param", [
    ({"store": True}, "store"),
    ({"previous_response_id": "resp_1"}, "previous_response_id"),
    ({"conversation": "conv_1"}, "conversation"),
    ({"background": True}, "background"),
    ({"input": None}, "input"),
    ({"input": []}, "input"),
    ({"input": 3}, "input"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input[0]"),
    ({"input": [{"type": "file_search_call"}]}, "input[0].type"),
    ({"input": [{"role": "tool", "content": "x"}]}, "input[0].role"),
    ({"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]}, "input[0].content[0]"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "file_id": "f"}]}]},
     "input[0].content[0].image_url"),
    ({"input": [{"type": "function_call", "call_id": "c"}]}, "input[0]"),
    ({"input": [{"type": "function_call_output", "output": "x"}]}, "input[0].call_id"),
    ({"instructions": ["x"]}, "instructions"),
    ({"tools": [{"type": "web_search"}]}, "tools"),
    ({"tools": [{"type": "function"}]}, "tools"),
    ({"tools": {"type": "function"}}, "tools"),
    ({"tool_choice": {"type": "web_search_preview"}}, "tool_choice"),
    ({"tool_choice": "always"}, "tool_choice"),
    ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format"),
    ({"text": {"format": {"type": "grammar"}}}, "text.format"),
    ({"text": "json"}, "text"),
    ({"max_output_tokens": 0}, "max_output_tokens"),
    ({"parallel_tool_calls": "yes"}, "parallel_tool_calls"),
    ({"model": ""}, "model"),
    ({"temperature": 2.5}, "temperature"),
    ({"top_p": "high"}, "top_p"),
    ({"presence_penalty": -3}, "presence_penalty"),
    ({"frequency_penalty": True}, "frequency_penalty"),
    ({"store": "no"}, "store"),
    ({"background": 1}, "background"),
    ({"service_tier": "gold"}, "service_tier"),
    ({"truncation": "middle"}, "truncation"),
    ({"safety_identifier": "x" * 65}, "safety_identifier"),
    ({"safety_identifier": 7}, "safety_identifier"),
    ({"prompt_cache_key": "k" * 65}, "prompt_cache_key"),
    ({"max_tool_calls": 0}, "max_tool_calls"),
    ({"max_tool_calls": "2"}, "max_tool_calls"),
    ({"top_logprobs": 21}, "top_logprobs"),
    ({"top_logprobs": -1}, "top_logprobs"),
    ({"metadata": {"a": 1}}, "metadata"),
    ({"metadata": {"k" * 65: "v"}}, "metadata"),
    ({"metadata": {f"k{i}": "v" for i in range(17)}}, "metadata"),
    ({"metadata": {"a": "v" * 513}}, "metadata"),
    ({"metadata": ["a"]}, "metadata"),
])
def test_refusals_name_their_param(change: dict[str, Any], param: str) -> None:
    with pytest.raises(ApiError) as caught:
        responses_to_chat({"model": MODEL, "input": "Hi", **change})
    assert (caught.value.status, caught.value.type, caught.value.param) == (400, "invalid_request_error", param)


def test_stored_responses_say_so() -> None:
    with pytest.raises(ApiError) as caught:
        translate(input="Hi", store=True)
    assert "Stored responses are not available" in caught.value.message


REQUEST = {"model": MODEL, "input": "Hi", "instructions": "Be brief.", "tools": [WEATHER],
           "max_output_tokens": 64}


def test_response_object_with_text() -> None:
    body = check_response(run_collect(ResponsesPresenter("resp_abc", MODEL, REQUEST), text_chunks("Hel", "lo")))
    response = Response.model_validate(body)
    assert response.id == "resp_abc" and response.object == "response" and response.status == "completed"
    assert response.output_text == "Hello" and response.model == MODEL and response.instructions == "Be brief."
    message = body["output"][0]
    assert message["type"] == "message" and message["id"].startswith("msg_") and message["status"] == "completed"
    assert message["content"] == [{"type": "output_text", "text": "Hello", "annotations": [], "logprobs": []}]
    assert body["usage"] == {"input_tokens": 7, "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
                             "output_tokens": 5,
                             "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": 12}
    assert body["tools"] == [WEATHER] and body["max_output_tokens"] == 64


def test_response_object_with_function_calls() -> None:
    chunks = tool_chunks(finish=None) + tool_chunks("get_time", ('{}',), "call_2", 1, role=False)
    response = Response.model_validate(check_response(run_collect(ResponsesPresenter("resp_abc", MODEL, REQUEST),
                                                                   chunks)))
    calls = [item for item in response.output if item.type == "function_call"]
    assert [(c.call_id, c.name, c.arguments, c.status) for c in calls] == [
        ("call_abc123", "get_weather", '{"city": "Paris"}', "completed"), ("call_2", "get_time", "{}", "completed")]
    assert all(c.id and c.id.startswith("fc_") for c in calls) and response.output_text == ""


def test_length_makes_the_response_incomplete() -> None:
    body = check_response(run_collect(ResponsesPresenter("resp_abc", MODEL, REQUEST),
                                      text_chunks("Hel", finish="length")))
    response = Response.model_validate(body)
    assert response.status == "incomplete" and response.incomplete_details is not None
    assert body["completed_at"] is None
    assert response.incomplete_details.reason == "max_output_tokens" and response.output_text == "Hel"


def stream(chunks: list[dict[str, Any]], request: dict[str, Any] = REQUEST) -> list[tuple[str | None, Any]]:
    events = sse_events(run_stream(ResponsesPresenter("resp_abc", MODEL, request), chunks))
    for name, data in events:
        assert name == data["type"]
        EVENTS.validate_python(data)  # every event is one the SDK knows, in its shape
        check_event(data)  # and one of the specification's, in its shape
    assert [data["sequence_number"] for _, data in events] == list(range(len(events)))
    return events


def test_streamed_text_event_sequence() -> None:
    events = stream(text_chunks("Hel", "lo"))
    assert [name for name, _ in events] == [
        "response.created", "response.in_progress", "response.output_item.added", "response.content_part.added",
        "response.output_text.delta", "response.output_text.delta", "response.output_text.done",
        "response.content_part.done", "response.output_item.done", "response.completed"]
    assert events[0][1]["response"]["status"] == "in_progress" and events[0][1]["response"]["output"] == []
    assert events[6][1]["text"] == "Hello"
    final = Response.model_validate(events[-1][1]["response"])
    assert final.output_text == "Hello" and final.usage is not None and final.usage.total_tokens == 12
    assert "[DONE]" not in [data for _, data in events]


def test_streamed_function_calls() -> None:
    chunks = text_chunks("Let me check.")[:-1] + tool_chunks(finish=None, role=False) + tool_chunks(
        "get_time", ('{}',), "call_2", 1, role=False)
    events = stream(chunks)
    names = [name for name, _ in events]
    assert names[2:] == [
        "response.output_item.added", "response.content_part.added", "response.output_text.delta",
        "response.output_text.done", "response.content_part.done", "response.output_item.done",
        "response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.delta", "response.function_call_arguments.done",
        "response.output_item.done",
        "response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.done", "response.output_item.done", "response.completed"]
    added = events[8][1]
    assert added["output_index"] == 1 and added["item"]["type"] == "function_call"
    assert added["item"]["call_id"] == "call_abc123" and added["item"]["arguments"] == ""
    assert events[11][1]["arguments"] == '{"city": "Paris"}' and events[11][1]["name"] == "get_weather"
    final = Response.model_validate(events[-1][1]["response"])
    assert [item.type for item in final.output] == ["message", "function_call", "function_call"]


def test_a_streamed_incomplete_response_still_ends_with_response_completed() -> None:
    events = stream(text_chunks("Hel", finish="length"))
    assert events[-1][0] == "response.completed" and events[-1][1]["response"]["status"] == "incomplete"
    assert events[-1][1]["response"]["incomplete_details"] == {"reason": "max_output_tokens"}
    assert events[-2][1]["item"]["status"] == "incomplete"  # the message item, cut short


def test_a_stream_failure_is_an_error_event_then_response_failed() -> None:
    presenter = ResponsesPresenter("resp_abc", MODEL, REQUEST)
    parts = presenter.stream_start() + presenter.stream_chunk(chat({"content": "Hi"}))
    parts += presenter.stream_error(ApiError(502, "provider_error", "The provider failed.", code="provider_error"))
    events = sse_events(parts)
    for _, data in events:
        EVENTS.validate_python(data)
        check_event(data)
    assert [name for name, _ in events][-2:] == ["error", "response.failed"]
    error = events[-2][1]
    assert error["error"] == {"type": "provider_error", "code": "provider_error", "message": "The provider failed.",
                              "param": None}
    assert error["message"] == "The provider failed." and error["code"] == "provider_error"  # OpenAI's flat copy
    failed = Response.model_validate(events[-1][1]["response"])
    assert failed.status == "failed" and failed.error is not None and failed.error.code == "server_error"
    assert events[-1][1]["response"]["completed_at"] is None


def test_the_sdk_accumulates_our_stream() -> None:
    from openai import NOT_GIVEN
    from openai.lib.streaming.responses._responses import ResponseStreamState

    state: Any = ResponseStreamState(input_tools=[], text_format=NOT_GIVEN)
    events = stream(text_chunks("Hel", "lo"))
    for _, data in events:
        state.handle_event(EVENTS.validate_python(data))
    assert state._completed_response is not None and state._completed_response.output_text == "Hello"


def test_error_body_is_openai_envelope() -> None:
    error = ApiError(404, "model_not_found", "No such model.", param="model")
    assert ResponsesPresenter("resp_abc", MODEL, REQUEST).error_body(error)["error"]["param"] == "model"


def test_a_bare_request_echoes_every_field_with_what_was_used() -> None:
    body = check_response(run_collect(ResponsesPresenter("resp_abc", MODEL, {"model": MODEL, "input": "Hi"}),
                                      text_chunks("Hi")))
    assert isinstance(body["completed_at"], int) and body["completed_at"] >= body["created_at"]
    assert {key: body[key] for key in (
        "temperature", "top_p", "presence_penalty", "frequency_penalty", "top_logprobs", "max_tool_calls",
        "max_output_tokens", "background", "store", "service_tier", "truncation", "safety_identifier",
        "prompt_cache_key", "previous_response_id", "instructions", "tools", "tool_choice", "text", "metadata",
        "parallel_tool_calls")} == {
        "temperature": CHAT_SAMPLING_DEFAULTS["temperature"], "top_p": CHAT_SAMPLING_DEFAULTS["top_p"],
        "presence_penalty": 0.0, "frequency_penalty": 0.0, "top_logprobs": 0, "max_tool_calls": None,
        "max_output_tokens": None, "background": False, "store": False, "service_tier": "default",
        "truncation": "disabled", "safety_identifier": None, "prompt_cache_key": None, "previous_response_id": None,
        "instructions": None, "tools": [], "tool_choice": "auto", "text": {"format": {"type": "text"}},
        "metadata": {}, "parallel_tool_calls": True}


def test_given_fields_are_echoed_as_given() -> None:
    request = {"model": MODEL, "input": "Hi", "temperature": 0, "top_p": 0.5, "presence_penalty": 1,
               "frequency_penalty": -0.5, "top_logprobs": 4, "max_tool_calls": 3, "service_tier": "auto",
               "safety_identifier": "user-7", "prompt_cache_key": "cache-1", "background": False, "store": False,
               "metadata": {"run": "1"}, "parallel_tool_calls": False, "tools": [WEATHER], "tool_choice": "required",
               "text": {"verbosity": "low"}, "truncation": "auto"}
    body = check_response(run_collect(ResponsesPresenter("resp_abc", MODEL, request), text_chunks("Hi")))
    assert {key: body[key] for key in request if key not in ("model", "input")} == {
        **{key: value for key, value in request.items() if key not in ("model", "input")},
        "temperature": 0.0, "presence_penalty": 1.0, "service_tier": "default", "truncation": "disabled",
        "text": {"format": {"type": "text"}, "verbosity": "low"}}


def test_the_echoed_sampling_is_what_the_node_was_sent() -> None:
    request = {"model": MODEL, "input": "Hi", "top_p": 0.7}
    sent = responses_to_chat(request)
    body = run_collect(ResponsesPresenter("resp_abc", MODEL, request), text_chunks("Hi"))
    for key in ("temperature", "top_p", "presence_penalty", "frequency_penalty"):
        assert body[key] == sent[key], key


def test_every_snapshot_of_a_stream_conforms_and_only_the_completed_one_has_completed_at() -> None:
    events = stream(text_chunks("Hel", "lo"))
    snapshots = [data["response"] for _, data in events if "response" in data]
    assert [s["completed_at"] is None for s in snapshots] == [True, True, False]
    for snapshot in snapshots:
        check_response(snapshot)


def test_a_json_schema_format_is_echoed_whole() -> None:
    fmt = {"type": "json_schema", "name": "city", "schema": {"type": "object"}}
    body = run_collect(ResponsesPresenter("resp_abc", MODEL, {"model": MODEL, "input": "Hi", "text": {"format": fmt}}),
                       text_chunks("{}"))
    assert body["text"] == {"format": {**fmt, "description": None, "strict": False}}


def test_a_null_field_is_echoed_as_its_default() -> None:
    request = {"model": MODEL, "input": "Hi", "parallel_tool_calls": None, "tool_choice": None, "metadata": None,
               "temperature": None, "top_logprobs": None, "text": None}
    body = check_response(run_collect(ResponsesPresenter("resp_abc", MODEL, request), text_chunks("Hi")))
    assert (body["parallel_tool_calls"], body["tool_choice"], body["metadata"], body["temperature"],
            body["top_logprobs"], body["text"]) == (True, "auto", {}, CHAT_SAMPLING_DEFAULTS["temperature"], 0,
                                                    {"format": {"type": "text"}})
