"""Tools, tool choice and structured output of a chat body, checked, and the llama.cpp grammars
that enforce them.

A tool call is the JSON object `{"name": <tool>, "arguments": {…}}` (the form `chat_prompt` asks the
model for). A named or required choice is forced with a grammar built from the tools' parameter
schemas (for several tools: the union, each name with its own parameters); `auto` allows either such a
call or plain text that does not start with `{`; `none` adds no grammar. One call per answer:
`parallel_tool_calls` is accepted, and an answer holds at most one call.

Every schema is checked against `wire.schema_bounds` before the converter sees it (a bound of
tens of thousands kills llama.cpp's grammar parser with the whole process), and the converter's
string rule is replaced by upstream llama.cpp's, which admits no raw control character (a JSON
string may not hold one, so llama-cpp-python's rule let answers be invalid JSON).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any, Literal

from darkbloom.provider.backends.base import BackendError
from darkbloom.wire.schema_bounds import repetition_problem

ToolMode = Literal["none", "auto", "required", "named"]
NAME = re.compile(r"[A-Za-z0-9_.:-]{1,64}")  # a function's name, as OpenAI allows it
_TEXT_OR_CALL = "root ::= [ \\n]{0,2} (tool-call | [^{ \\t\\r\\n\\x00] [^\\x00]*)"
# upstream llama.cpp's rules: no raw control character inside a JSON string (nor DEL)
_JSON_SAFE_RULES = {
    "char": r'char ::= [^"\\\x7F\x00-\x1F] | [\\] (["\\/bfnrt] | "u" [0-9a-fA-F] [0-9a-fA-F] [0-9a-fA-F] [0-9a-fA-F])',
    "dot": r'dot ::= [^"\\\x7F\x00-\x1F]',
}
MAX_PARAM = 128  # the longest `param` a node's error carries


@dataclass(frozen=True)
class ToolSpec:
    name: str
    description: str = ""
    parameters: dict[str, Any] = field(default_factory=lambda: {"type": "object", "properties": {}})


@dataclass
class ToolPlan:
    mode: ToolMode = "none"
    tools: list[ToolSpec] = field(default_factory=list)  # what the request offers
    forced: ToolSpec | None = None  # a named choice
    legacy: bool = False  # `functions`: answered with `function_call`, not `tool_calls`

    @property
    def callable(self) -> list[ToolSpec]:
        return [self.forced] if self.forced is not None else self.tools


def tool_plan(body: dict[str, Any]) -> ToolPlan:
    """What the request allows: `tools`/`tool_choice`, else the legacy `functions`/`function_call`."""
    if body.get("tools") is not None:
        tools = [_tool(t, f"tools[{i}]") for i, t in enumerate(_list(body["tools"], "tools"))]
        choice, param = body.get("tool_choice"), "tool_choice"
        legacy = False
    elif body.get("functions") is not None:
        tools = [_function(f, f"functions[{i}]") for i, f in enumerate(_list(body["functions"], "functions"))]
        choice, param = body.get("function_call"), "function_call"
        legacy = True
    else:
        for name in ("tool_choice", "function_call"):
            if body.get(name) not in (None, "none"):
                raise BackendError(400, f"{name} needs tools to choose from", param=name)
        return ToolPlan()
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise BackendError(400, "parallel_tool_calls must be true or false", param="parallel_tool_calls")
    if len({t.name for t in tools}) != len(tools):
        raise BackendError(400, f"{'functions' if legacy else 'tools'} must have distinct names",
                           param="functions" if legacy else "tools")
    if choice is None or choice == "auto":
        return ToolPlan("auto" if tools else "none", tools, legacy=legacy)
    if choice == "none":
        return ToolPlan("none", tools, legacy=legacy)
    if choice == "required" and not legacy:
        if not tools:
            raise BackendError(400, "tool_choice required needs at least one tool", param=param)
        return ToolPlan("required", tools)
    name = _choice_name(choice, legacy, param)
    forced = next((t for t in tools if t.name == name), None)
    if forced is None:
        raise BackendError(400, f"{param} names a function that is not among the tools", param=param)
    return ToolPlan("named", tools, forced=forced, legacy=legacy)


def response_schema(body: dict[str, Any]) -> dict[str, Any] | None:
    """The JSON schema a structured answer must follow (`{"type": "object"}` for json_object); None for text."""
    fmt = body.get("response_format")
    if fmt is None:
        return None
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        schema, where = fmt.get("schema", {"type": "object"}), "response_format.schema"  # llama-cpp-python's own
    elif kind == "json_schema":
        spec = fmt.get("json_schema")
        if (not isinstance(spec, dict) or not isinstance(spec.get("name"), str) or not NAME.fullmatch(spec["name"])
                or not isinstance(spec.get("strict", False), (bool, type(None)))):
            raise BackendError(400, "response_format.json_schema needs a name (letters, digits, _ or -) and a "
                               "schema", param="response_format")
        schema, where = spec.get("schema", {"type": "object"}), "response_format.json_schema.schema"
    else:
        raise BackendError(400, 'response_format type must be "text", "json_object" or "json_schema"',
                           param="response_format")
    if not isinstance(schema, dict):
        raise BackendError(400, "response_format schema must be a JSON object", param="response_format")
    check_bounds(schema, where)
    return schema


def check_bounds(schema: Any, param: str, *, name_the_bound: bool = True) -> None:
    """400 when `schema` repeats more than a grammar can hold, naming the offending bound (or only
    `param`, for a schema that is not the request's own, such as the union of its tools)."""
    problem = repetition_problem(schema, param)
    if problem is None:
        return
    where, message = problem
    if not name_the_bound or len(where) > MAX_PARAM:
        where, message = param, f"the JSON schema in {param} has repetition bounds this node cannot follow"
    raise BackendError(400, message, param=where)


def schema_grammar(schema: dict[str, Any], param: str, rule: str = "") -> str:
    """GBNF for `schema` (its rule `root`, or `rule` when given); 400 naming `param` when llama.cpp's
    converter cannot turn it into a grammar."""
    from llama_cpp.llama_grammar import SchemaConverter

    check_bounds(schema, param, name_the_bound=False)  # each of the request's own schemas was checked already
    converter = SchemaConverter(prop_order={}, allow_fetch=False, dotall=False, raw_pattern=False)
    try:
        resolved = converter.resolve_refs(json.loads(json.dumps(schema)), "request")
        converter.visit(resolved, rule)
        return _json_safe(str(converter.format_grammar()))
    except Exception:  # the converter raises whatever it meets (KeyError, ValueError, AssertionError, …)
        raise BackendError(400, f"this model cannot follow the JSON schema in {param}", param=param) from None


def _json_safe(grammar: str) -> str:
    lines = grammar.split("\n")
    return "\n".join(_JSON_SAFE_RULES.get(line.split(" ::= ", 1)[0], line) for line in lines)


def call_schema(tools: list[ToolSpec]) -> dict[str, Any]:
    """`{"name": <one of tools>, "arguments": <that tool's parameters>}` as one JSON schema."""
    options = [{"type": "object", "properties": {"name": {"const": t.name}, "arguments": t.parameters},
                "required": ["name", "arguments"]} for t in tools]
    return options[0] if len(options) == 1 else {"anyOf": options}


def tool_grammar(plan: ToolPlan) -> str | None:
    """The grammar for the answer `plan` allows: a call (named, required), a call or text (auto)."""
    if plan.mode == "none":
        return None
    param = "functions" if plan.legacy else "tools"
    calls = schema_grammar(call_schema(plan.callable), param, rule="tool-call")
    if plan.mode == "auto":
        return f"{calls}\n{_TEXT_OR_CALL}"
    return f"{calls}\nroot ::= tool-call"


def _list(value: Any, param: str) -> list[Any]:
    if not isinstance(value, list) or len(value) > 128:
        raise BackendError(400, f"{param} must be a list of up to 128 functions", param=param)
    return value


def _tool(tool: Any, where: str) -> ToolSpec:
    if not isinstance(tool, dict) or tool.get("type", "function") != "function":
        raise BackendError(400, 'every tool must be {"type": "function", "function": {...}}', param="tools")
    return _function(tool.get("function"), f"{where}.function")


def _function(function: Any, where: str) -> ToolSpec:
    param = where.split("[", 1)[0]
    if not isinstance(function, dict) or not isinstance(function.get("name"), str) \
            or not NAME.fullmatch(function["name"]):
        raise BackendError(400, "every function needs a name of letters, digits, _ or -", param=param)
    description = function.get("description", "")
    parameters = function.get("parameters", {"type": "object", "properties": {}})
    if not isinstance(description, str) or not isinstance(parameters, dict):
        raise BackendError(400, "a function's description must be a string and its parameters a JSON schema",
                           param=param)
    check_bounds(parameters, f"{where}.parameters")
    return ToolSpec(function["name"], description, parameters)


def _choice_name(choice: Any, legacy: bool, param: str) -> str:
    if legacy and isinstance(choice, dict) and isinstance(choice.get("name"), str):
        return str(choice["name"])
    function = choice.get("function") if isinstance(choice, dict) and choice.get("type") == "function" else None
    if not legacy and isinstance(function, dict) and isinstance(function.get("name"), str):
        return str(function["name"])
    allowed = '"none", "auto" or {"name": …}' if legacy else \
        '"none", "auto", "required" or {"type": "function", "function": {"name": …}}'
    raise BackendError(400, f"{param} must be {allowed}", param=param)
