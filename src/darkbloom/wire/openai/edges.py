"""The inference APIs at the edge, one table for the coordinator and direct mode alike: each API's
path, the node API its body becomes, its answers' id prefix, its request translator and presenter."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from darkbloom.wire.openai import anthropic_messages, anthropic_request, chat_request, legacy
from darkbloom.wire.openai.responses.presenter import ResponsesPresenter
from darkbloom.wire.openai.responses.request import responses_to_chat
from darkbloom.wire.openai.presenters import ChatPresenter, CompletionsPresenter, EmbeddingsPresenter, Presenter
from darkbloom.wire.protocol import Api


@dataclass(frozen=True)
class Edge:
    path: str
    api: Api                                             # what the node is asked for
    id_prefix: str                                       # of the answer's id (and X-Request-Id)
    to_node: Callable[[dict[str, Any]], dict[str, Any]]  # the caller's body → the node's (400 on a bad one)
    presenter: Callable[[str, str, dict[str, Any]], Presenter]
    streams: bool = True
    # where the caller's body holds JSON schemas a node turns into grammars (`[*]`: each item of an array)
    schemas: tuple[str, ...] = ()


CHAT = Edge("/v1/chat/completions", "chat", "chatcmpl-", chat_request.checked, ChatPresenter,
            schemas=("response_format.json_schema.schema", "response_format.schema", "tools[*].function.parameters",
                     "functions[*].parameters"))
RESPONSES = Edge("/v1/responses", "chat", "resp_", responses_to_chat, ResponsesPresenter,
                 schemas=("text.format.schema", "tools[*].parameters", "tools[*].function.parameters"))
MESSAGES = Edge("/v1/messages", "chat", "msg_", anthropic_request.messages_to_chat,
                anthropic_messages.MessagesPresenter, schemas=("tools[*].input_schema",))
COMPLETIONS = Edge("/v1/completions", "completions", "cmpl-", legacy.completions_request, CompletionsPresenter)
EMBEDDINGS = Edge("/v1/embeddings", "embeddings", "embd-", legacy.embeddings_request, EmbeddingsPresenter,
                  streams=False)
EDGES = (CHAT, RESPONSES, MESSAGES, COMPLETIONS, EMBEDDINGS)
