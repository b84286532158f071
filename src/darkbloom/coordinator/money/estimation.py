"""Upper bounds the coordinator can compute without the model's tokenizer.

Prompt tokens: byte-level BPE tokenizers (SmolLM2, Llama, GPT-style) never produce more tokens
than the UTF-8 bytes they encode, and a chat template adds fewer tokens per message than the JSON
punctuation around it (`{"role":"user","content":""}` is 29 bytes). So the byte length of the
JSON-encoded messages (plus tools), plus a small constant for the assistant header, bounds the
prompt's token count from above.
"""

from __future__ import annotations

import json

from darkbloom.wire.catalog import CatalogModel
from darkbloom.coordinator.inference.chat_request import ChatRequest

TEMPLATE_ALLOWANCE = 16


def prompt_token_bound(chat: ChatRequest) -> int:
    parts = {name: chat.body[name] for name in ("messages", "tools", "functions", "tool_choice")
             if name in chat.body}
    return len(json.dumps(parts, ensure_ascii=False, separators=(",", ":")).encode()) + TEMPLATE_ALLOWANCE


def output_token_bound(chat: ChatRequest, model: CatalogModel) -> int:
    """The request's output bound: max_completion_tokens / max_tokens, at most the catalog's maximum."""
    for field in ("max_completion_tokens", "max_tokens"):
        value = chat.body.get(field)
        if isinstance(value, int) and not isinstance(value, bool):
            return min(value, model.max_output_tokens)
    return model.max_output_tokens
