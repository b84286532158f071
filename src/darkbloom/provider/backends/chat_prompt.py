"""Chat messages → the messages a model's own chat template renders.

Many chat templates (the bundled SmolLM2's among them) know only system, user and assistant, so the
rest is rendered as text: an assistant turn's `tool_calls` (or legacy `function_call`) become the JSON
objects the model is asked to answer with when it calls a tool, a `tool` (or legacy `function`)
result becomes a user turn that says which call it answers, `developer` becomes `system`. The tools
a request offers, and the JSON schema of a structured answer, are described in the system message.
"""

from __future__ import annotations

import json
from typing import Any

from darkbloom.provider.backends.base import BackendError
from darkbloom.provider.backends.tool_params import NAME, ToolPlan

ROLES = ("system", "developer", "user", "assistant", "tool", "function")
_MARK = "\ue000{}\ue001"  # private-use characters: in no template
Segment = tuple[str, bool]  # text, and whether its special-token text is parsed as special tokens


def template_messages(messages: Any, plan: ToolPlan | None = None,
                      schema: dict[str, Any] | None = None) -> list[dict[str, str]]:
    """Checked messages as `{"role", "content"}` strings for the chat template."""
    if not isinstance(messages, list) or not messages:
        raise BackendError(400, "messages must be a non-empty list", param="messages")
    call_names: dict[str, str] = {}  # tool_call_id → function name, from earlier assistant turns
    out: list[dict[str, str]] = []
    for index, message in enumerate(messages):
        where = f"messages[{index}]"
        if not isinstance(message, dict) or message.get("role") not in ROLES:
            raise BackendError(400, f"{where} must be an object with a role of {', '.join(ROLES)}", param=where)
        role = message["role"]
        content = _text_content(message.get("content"), where)
        if role == "developer":
            role = "system"
        elif role == "assistant":
            calls = _assistant_calls(message, where)
            for call in calls:
                call_names[call["id"]] = call["name"]
            content = "\n".join([content] * bool(content) + [_call_text(c["name"], c["arguments"]) for c in calls])
        elif role in ("tool", "function"):
            name = message.get("name") if role == "function" else call_names.get(str(message.get("tool_call_id")))
            if role == "tool" and not isinstance(message.get("tool_call_id"), str):
                raise BackendError(400, f"{where}.tool_call_id must be a string", param=f"{where}.tool_call_id")
            label = f"the tool call {name!r}" if isinstance(name, str) else "a tool call"
            role, content = "user", f"Result of {label}:\n{content}"
        out.append({"role": role, "content": content})
    instructions = _instructions(plan, schema)
    if instructions:
        if out[0]["role"] == "system":
            out[0] = {"role": "system", "content": f"{out[0]['content']}\n\n{instructions}".strip()}
        else:
            out.insert(0, {"role": "system", "content": instructions})
    return out


def _call_text(name: str, arguments: str) -> str:
    """The call as the model is told to write one. The caller's arguments go in as they were sent
    (when they are JSON), never parsed and re-dumped: the coordinator's prompt bound counts the bytes
    the caller sent, and a re-dump can be longer (`1E15` → `1000000000000000.0`)."""
    try:
        json.loads(arguments)
    except ValueError:
        arguments = json.dumps(arguments, ensure_ascii=False)
    return '{"name":' + json.dumps(name, ensure_ascii=False) + ',"arguments":' + arguments + "}"


def _assistant_calls(message: dict[str, Any], where: str) -> list[dict[str, Any]]:
    """An assistant turn's tool calls (or legacy function call) as `{"id", "name", "arguments"}`."""
    raw = message.get("tool_calls")
    legacy = message.get("function_call")
    if raw is None and legacy is None:
        return []
    if raw is None:
        raw, param = [{"id": "", "type": "function", "function": legacy}], f"{where}.function_call"
    else:
        param = f"{where}.tool_calls"
    if not isinstance(raw, list):
        raise BackendError(400, f"{param} must be a list of tool calls", param=param)
    calls = []
    for call in raw:
        function = call.get("function") if isinstance(call, dict) else None
        if (not isinstance(function, dict) or not isinstance(function.get("name"), str)
                or not NAME.fullmatch(function["name"])
                or not isinstance(function.get("arguments", ""), str) or call.get("type", "function") != "function"):
            raise BackendError(400, f"{param}: each call needs a function with a name (letters, digits, _ . : -, "
                                    "at most 64) and string arguments", param=param)
        calls.append({"id": str(call.get("id") or ""), "name": function["name"],
                      "arguments": function.get("arguments") or "{}"})
    return calls


def _instructions(plan: ToolPlan | None, schema: dict[str, Any] | None) -> str:
    parts: list[str] = []
    if plan is not None and plan.mode != "none" and plan.tools:
        described = [{"name": t.name, "description": t.description, "parameters": t.parameters} for t in plan.tools]
        parts.append("You can call these tools:\n" + _compact(described) + "\n"
                     'To call a tool, answer with only a JSON object {"name": <tool name>, "arguments": '
                     "<the arguments as a JSON object>}.")
        if plan.forced is not None:
            parts.append(f"Call the tool {plan.forced.name!r} now.")
        elif plan.mode == "required":
            parts.append("Answer with a tool call.")
    if schema is not None:
        parts.append("Answer with a JSON object that follows this JSON schema:\n" + _compact(schema))
    return "\n\n".join(parts)


def _compact(value: Any) -> str:
    """JSON as the coordinator measures the request (no spaces after separators), so the prompt
    never outgrows its bound."""
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


def _text_content(content: Any, where: str) -> str:
    """Plain text; OpenAI content-part lists are joined when every part is text."""
    if content is None or isinstance(content, str):
        return content or ""
    if isinstance(content, list):
        texts = []
        for part in content:
            if (not isinstance(part, dict) or part.get("type") not in ("text", "input_text", "output_text")
                    or not isinstance(part.get("text"), str)):
                raise BackendError(400, f"{where}.content: only text parts are supported by this model",
                                   param=f"{where}.content")
            texts.append(part["text"])
        return "".join(texts)
    raise BackendError(400, f"{where}.content must be a string or a list of text parts", param=f"{where}.content")


def marked_messages(messages: list[dict[str, str]]) -> list[dict[str, str]]:
    """The messages with a marker in place of each content, for a rendering `template_segments` cuts:
    text a caller sends can then never become a control token (a forged system turn)."""
    return [dict(m, content=_MARK.format(i)) for i, m in enumerate(messages)]


def template_segments(rendered: str, messages: list[dict[str, str]]) -> list[Segment] | None:
    """A rendering of `marked_messages(messages)` cut at its markers: the template's own text (its
    special-token text parsed as special tokens) and each message's content (never), in order; None
    when the template dropped, repeated or reordered a content."""
    segments: list[Segment] = []
    position = 0
    for index, message in enumerate(messages):
        mark = _MARK.format(index)
        at = rendered.find(mark, position)
        if at < 0 or rendered.find(mark, at + len(mark)) >= 0:
            return None
        segments += [(rendered[position:at], True), (message["content"], False)]
        position = at + len(mark)
    if "\ue000" in rendered[position:]:
        return None
    segments.append((rendered[position:], True))
    return [segment for segment in segments if segment[0]]
