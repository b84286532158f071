"""OpenAI's Responses API (`POST /v1/responses`), stateless: a Responses request as the
chat-completions body a node serves (the answer's way back is `responses.presenter`).

Nothing is stored: `store: true`, `previous_response_id`, `conversation`, `background` and stored
prompts are refused (400 naming the param). Fields the response only repeats (`metadata`,
`service_tier`, `safety_identifier`, …) are checked by `echo` and not forwarded; `include` and
`reasoning` are accepted and ignored. The sampling numbers are always sent, the node's defaults
filling the ones left out, so that the response reports what the node sampled with.
"""

from __future__ import annotations

import json
from typing import Any

from darkbloom.wire.openai.errors import ApiError, invalid_request
from darkbloom.wire.openai.parameters import chat_sampling, check_model
from darkbloom.wire.openai.responses import echo

_STORED = ("previous_response_id", "conversation", "prompt")
_ROLES = {"user": "user", "assistant": "assistant", "system": "system", "developer": "system"}


def _stored_unavailable(param: str) -> ApiError:
    return invalid_request(f"Stored responses are not available: '{param}' needs them. Send the whole "
                           "conversation in 'input' instead.", param=param)


def responses_to_chat(body: dict[str, Any]) -> dict[str, Any]:
    """The chat-completions body for a Responses request (400 naming the param for what cannot be
    translated); the chat validation then checks it like any chat request."""
    for param in _STORED:
        if body.get(param) is not None:
            raise _stored_unavailable(param)
    for param in ("store", "background"):
        if body.get(param) is True:
            raise _stored_unavailable(param)
    echo.check(body)
    chat: dict[str, Any] = {"model": check_model(body), "messages": _messages(body), **chat_sampling(body)}
    if body.get("tools") is not None:
        tools = _tools(body["tools"])
        if tools:
            chat["tools"] = tools
    if body.get("tool_choice") is not None:
        chat["tool_choice"] = _tool_choice(body["tool_choice"])
    if body.get("parallel_tool_calls") is not None:
        if not isinstance(body["parallel_tool_calls"], bool):
            raise invalid_request("'parallel_tool_calls' must be a boolean.", param="parallel_tool_calls")
        chat["parallel_tool_calls"] = body["parallel_tool_calls"]
    response_format = _response_format(body.get("text"))
    if response_format is not None:
        chat["response_format"] = response_format
    max_output = body.get("max_output_tokens")
    if max_output is not None:
        if not isinstance(max_output, int) or isinstance(max_output, bool) or max_output < 1:
            raise invalid_request("'max_output_tokens' must be a positive integer.", param="max_output_tokens")
        chat["max_tokens"] = max_output
    if body.get("stream") is not None:
        chat["stream"] = body["stream"]
    return chat


def _messages(body: dict[str, Any]) -> list[dict[str, Any]]:
    messages: list[dict[str, Any]] = []
    instructions = body.get("instructions")
    if instructions is not None:
        if not isinstance(instructions, str):
            raise invalid_request("'instructions' must be a string.", param="instructions")
        if instructions:
            messages.append({"role": "system", "content": instructions})
    items = body.get("input")
    if isinstance(items, str):
        messages.append({"role": "user", "content": items})
    elif isinstance(items, list) and items:
        for index, item in enumerate(items):
            _add_item(messages, item, f"input[{index}]")
    else:
        raise invalid_request("'input' must be a string or a non-empty array of input items.", param="input")
    if not messages:
        raise invalid_request("'input' holds no message to answer.", param="input")
    return messages


def _add_item(messages: list[dict[str, Any]], item: Any, where: str) -> None:
    if not isinstance(item, dict):
        raise invalid_request(f"'{where}' must be an object.", param=where)
    kind = item.get("type", "message" if "role" in item else None)
    if kind == "message":
        given = item.get("role")
        role = _ROLES.get(given) if isinstance(given, str) else None
        if role is None:
            raise invalid_request(f"'{where}.role' must be one of user, assistant, system or developer.",
                                  param=f"{where}.role")
        messages.append({"role": role, "content": _content(item.get("content"), f"{where}.content")})
    elif kind == "function_call":
        call_id, name, arguments = item.get("call_id"), item.get("name"), item.get("arguments", "")
        if not isinstance(call_id, str) or not isinstance(name, str) or not isinstance(arguments, str):
            raise invalid_request(f"'{where}' must have string 'call_id', 'name' and 'arguments'.", param=where)
        call = {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}
        last = messages[-1] if messages else None
        if last is not None and last["role"] == "assistant":
            last.setdefault("tool_calls", []).append(call)  # one assistant turn: its text and its calls
        else:
            messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
    elif kind == "function_call_output":
        call_id = item.get("call_id")
        if not isinstance(call_id, str):
            raise invalid_request(f"'{where}.call_id' must be a string.", param=f"{where}.call_id")
        messages.append({"role": "tool", "tool_call_id": call_id,
                         "content": _tool_output(item.get("output"), f"{where}.output")})
    elif kind == "reasoning":
        return  # a reasoning model's summary: nothing a chat model reads
    elif kind == "item_reference":
        raise _stored_unavailable(where)
    else:
        raise invalid_request(f"'{where}.type' {json.dumps(kind)} is not supported: use message, function_call "
                              "or function_call_output items.", param=f"{where}.type")


def _content(content: Any, where: str) -> str | list[dict[str, Any]]:
    """A message's content as chat content: one text stays a string, images become `image_url` parts."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise invalid_request(f"'{where}' must be a string or an array of content parts.", param=where)
    parts: list[dict[str, Any]] = []
    for index, part in enumerate(content):
        at = f"{where}[{index}]"
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in ("input_text", "output_text", "text"):
            if not isinstance(part.get("text"), str):
                raise invalid_request(f"'{at}.text' must be a string.", param=f"{at}.text")
            parts.append({"type": "text", "text": part["text"]})
        elif kind == "refusal":
            parts.append({"type": "text", "text": str(part.get("refusal") or "")})
        elif kind == "input_image":
            url = part.get("image_url")
            if not isinstance(url, str) or not url:
                raise invalid_request(f"'{at}.image_url' must be a URL or data URL: uploaded files are not "
                                      "available.", param=f"{at}.image_url")
            image = {"url": url, **({"detail": part["detail"]} if part.get("detail") else {})}
            parts.append({"type": "image_url", "image_url": image})
        else:
            raise invalid_request(f"'{at}' must be an input_text, output_text or input_image part.", param=at)
    if all(part["type"] == "text" for part in parts):
        return "".join(part["text"] for part in parts)
    return parts


def _tool_output(output: Any, where: str) -> str:
    if isinstance(output, str):
        return output
    if isinstance(output, list):
        texts = [part.get("text") for part in output if isinstance(part, dict)]
        if len(texts) == len(output) and all(isinstance(text, str) for text in texts):
            return "".join(texts)  # type: ignore[arg-type]
    raise invalid_request(f"'{where}' must be a string or an array of input_text parts.", param=where)


def _tools(tools: Any) -> list[dict[str, Any]]:
    if not isinstance(tools, list):
        raise invalid_request("'tools' must be an array of function tools.", param="tools")
    out = []
    for index, tool in enumerate(tools):
        kind = tool.get("type") if isinstance(tool, dict) else None
        if kind != "function":
            raise invalid_request(f"tools[{index}]: only function tools are supported here, not "
                                  f"{json.dumps(kind)} (hosted tools such as web_search are not available).",
                                  param="tools")
        spec = tool["function"] if isinstance(tool.get("function"), dict) else tool  # the chat shape, leniently
        if not isinstance(spec.get("name"), str) or not spec["name"]:
            raise invalid_request(f"tools[{index}].name must be a non-empty string.", param="tools")
        function = {"name": spec["name"]}
        for field in ("description", "parameters", "strict"):
            if spec.get(field) is not None:
                function[field] = spec[field]
        out.append({"type": "function", "function": function})
    return out


def _tool_choice(choice: Any) -> str | dict[str, Any]:
    if choice in ("auto", "none", "required"):
        return choice
    if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise invalid_request("'tool_choice' must be 'auto', 'none', 'required' or {\"type\": \"function\", "
                          "\"name\": …}.", param="tool_choice")


def _response_format(text: Any) -> dict[str, Any] | None:
    if text is None:
        return None
    if not isinstance(text, dict):
        raise invalid_request("'text' must be an object.", param="text")
    fmt = text.get("format")
    if fmt is None:
        return None
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "json_object"}
    if kind == "json_schema":
        if not isinstance(fmt.get("name"), str) or not isinstance(fmt.get("schema"), dict):
            raise invalid_request("'text.format' of type json_schema needs a string 'name' and an object "
                                  "'schema'.", param="text.format")
        schema = {key: fmt[key] for key in ("name", "schema", "strict", "description") if fmt.get(key) is not None}
        return {"type": "json_schema", "json_schema": schema}
    raise invalid_request("'text.format.type' must be text, json_object or json_schema.", param="text.format")
