"""Generated text pieces → OpenAI chunks, the same for every in-process backend: `chat.completion.chunk`s
(content deltas with their logprobs, or a tool call: `tool_calls`, or a legacy `function_call`), and
legacy `text_completion` chunks.

How an answer that may be a tool call is streamed: with a named or required choice (and in `auto`
once the answer opens with `{`, which the grammar then holds to a call) the call's name is sent as
soon as it is generated and its arguments as they come; in `auto` with a structured answer as the
alternative, an answer opening with `{` is held to the end and then sent as the call or the content
it turns out to be. A forced call cut short (max_tokens) before its name is whole is still a call:
the one tool the name so far can be, else the name so far, with no arguments.
"""

from __future__ import annotations

import json
import re
import time
import uuid
from typing import Any, Callable

from darkbloom.provider.backends.text_stream import Finish, Piece, TokenLogprob
from darkbloom.provider.backends.tool_params import ToolPlan

_CALL_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"arguments"\s*:\s*')
_CALL_TAIL = re.compile(r"[\s}]*\Z")
_NAME_SO_FAR = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)')


class ChatChunks:
    """Pieces → chat chunks: content deltas, or a tool call (`tool_calls`, or legacy `function_call`)."""

    def __init__(self, plan: ToolPlan, hold_calls: bool, emit: Callable[[dict[str, Any]], None]) -> None:
        """`hold_calls`: auto with a structured alternative, an answer opening with `{` held to the end."""
        self.plan, self.hold_calls, self.emit = plan, hold_calls, emit
        self.created = int(time.time())
        self.mode = "text" if plan.mode == "none" else "undecided"
        self.buffer = ""  # undecided or call text not yet sent
        self.logprobs: list[TokenLogprob] = []  # of tokens whose text is not yet sent
        self.sent_args = ""  # call arguments sent so far
        self.call_name: str | None = None

    def send(self, delta: dict[str, Any], finish: str | None = None) -> None:
        logprobs = {"content": [lp.chat() for lp in self.logprobs]} if self.logprobs else None
        self.logprobs = []
        self.emit({"object": "chat.completion.chunk", "created": self.created,
                   "choices": [{"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish}]})

    def take(self, item: Piece | Finish) -> None:
        if isinstance(item, Piece):
            self.piece(item)
        else:
            self.finish(item)

    def piece(self, piece: Piece) -> None:
        self.logprobs += piece.logprobs
        if self.mode == "text":
            if piece.text or self.logprobs:
                self.send({"content": piece.text})
            return
        self.buffer += piece.text
        if self.mode == "undecided" and self.buffer.strip():
            forced = self.plan.mode in ("named", "required")
            self.mode = "call" if forced or self.buffer.lstrip().startswith("{") else "text"
            if self.mode == "text":
                text, self.buffer = self.buffer, ""
                self.send({"content": text})
                return
        if self.mode == "call" and not self.hold_calls:
            self._stream_call(final=False)

    def finish(self, finish: Finish) -> None:
        reason = finish.reason
        forced = self.plan.mode in ("named", "required")
        if forced:
            self.mode = "call"  # even with nothing but space generated
        if self.mode == "call" and self.hold_calls:
            call = _parse_call(self.buffer, {t.name for t in self.plan.callable})
            if call is None:
                self.mode = "text"
            else:
                self.call_name, self.buffer = call[0], ""
                self._head()
                self._args(call[1])
        elif self.mode == "call":
            self._stream_call(final=True)
            if self.call_name is None and forced:  # cut short before the name was whole
                self.call_name, self.buffer = self._name_so_far(), ""
                self._head()
        if self.buffer and (self.mode != "call" or self.call_name is None):
            text, self.buffer = self.buffer, ""
            self.send({"content": text})
            self.mode = "text"
        if self.mode == "call" and self.call_name is not None and reason == "stop":
            reason = "function_call" if self.plan.legacy else "tool_calls"
        self.send({}, reason)

    def _stream_call(self, final: bool) -> None:
        if self.call_name is None:
            head = _CALL_HEAD.match(self.buffer)
            if head is None:
                return
            self.call_name = json.loads(head[1])
            self.buffer = self.buffer[head.end():]
            self._head()
        if final:  # the call's closing brace (and the space after it) is not part of the arguments
            text = self.buffer.rstrip()
            self._args(text[:-1].rstrip() if text.endswith("}") else text)
        else:
            held = _CALL_TAIL.search(self.buffer)
            cut = held.start() if held else len(self.buffer)
            if cut:
                self._args(self.buffer[:cut])
                self.buffer = self.buffer[cut:]
        if final:
            self.buffer = ""

    def _name_so_far(self) -> str:
        start = _NAME_SO_FAR.match(self.buffer)
        partial = start[1] if start else ""
        try:
            partial = json.loads(f'"{partial}"')
        except ValueError:
            partial = partial.split("\\", 1)[0]  # cut inside an escape
        names = [t.name for t in self.plan.callable if t.name.startswith(partial)]
        return names[0] if len(names) == 1 else partial

    def _head(self) -> None:
        if self.plan.legacy:
            self.send({"content": None, "function_call": {"name": self.call_name, "arguments": ""}})
        else:
            call = {"index": 0, "id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                    "function": {"name": self.call_name, "arguments": ""}}
            self.send({"content": None, "tool_calls": [call]})

    def _args(self, fragment: str) -> None:
        if not self.sent_args:
            fragment = fragment.lstrip()  # the grammar's space after "arguments":
        if not fragment:
            return
        self.sent_args += fragment
        if self.plan.legacy:
            self.send({"function_call": {"arguments": fragment}})
        else:
            self.send({"tool_calls": [{"index": 0, "function": {"arguments": fragment}}]})


def _parse_call(text: str, names: set[str]) -> tuple[str, str] | None:
    """(name, arguments JSON) when `text` is one call of a known tool, else None."""
    try:
        value = json.loads(text)
    except ValueError:
        return None
    if (isinstance(value, dict) and set(value) == {"name", "arguments"} and value["name"] in names
            and isinstance(value["arguments"], dict)):
        return value["name"], json.dumps(value["arguments"], ensure_ascii=False)
    return None


def completion_chunks(top_logprobs: int | None, offset: int,
                      emit: Callable[[dict[str, Any]], None]) -> Callable[[Piece | Finish], None]:
    """Pieces → `text_completion` chunks; `offset`: the characters before the answer (its logprobs'
    `text_offset` counts from the prompt's start)."""
    created = int(time.time())

    def chunk(text: str, logprobs: dict[str, Any] | None, finish: str | None) -> dict[str, Any]:
        return {"object": "text_completion", "created": created,
                "choices": [{"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish}]}

    def take(item: Piece | Finish) -> None:
        nonlocal offset
        if isinstance(item, Finish):
            emit(chunk("", None, item.reason))
            return
        logprobs = None
        if top_logprobs is not None:
            offsets = []
            for lp in item.logprobs:
                offsets.append(offset)
                offset += len(lp.token)
            logprobs = {"tokens": [lp.token for lp in item.logprobs],
                        "token_logprobs": [lp.logprob for lp in item.logprobs],
                        "top_logprobs": [{t: v for t, v, _ in lp.top} for lp in item.logprobs],
                        "text_offset": offsets}
        emit(chunk(item.text, logprobs, None))

    return take
