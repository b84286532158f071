"""The prompt-token upper bound both sides compute from the same body, without the model's tokenizer.

Byte-level BPE tokenizers (SmolLM2, Llama, GPT-style) never produce more tokens than the UTF-8 bytes
they encode, and a chat template adds fewer tokens per message than the JSON punctuation around it
(`{"role":"user","content":""}` is 29 bytes). So the byte length of the JSON-encoded messages (plus
tools), or of a legacy prompt, plus a small constant for the assistant header (and one for the
node's own words around a tool list or an output schema), bounds the prompt's token count from
above. The coordinator reserves and rate-limits with it and distrusts a node reporting more; the
node clamps what its backend reports to it, so an upstream's nonsense is never the node's lie.
"""

from __future__ import annotations

import json
from typing import Any

TEMPLATE_ALLOWANCE = 16
# a node describes tools or an output schema in the prompt, with sentences of its own around their JSON
INSTRUCTIONS_ALLOWANCE = 128
TOOL_RESULT_ALLOWANCE = 64


def prompt_token_bound(api: str, body: dict[str, Any]) -> int:
    """The most prompt tokens the node's body `body` for `api` can take (its model id, stream and
    max_tokens play no part)."""
    if api == "embeddings":
        inputs = body["input"]
        many = isinstance(inputs, list) and bool(inputs) and not isinstance(inputs[0], int)
        # each input its own sequence: token ids count one each, text one per byte, plus BOS/EOS
        return sum(_input_bound(item) + 4 for item in (inputs if many else [inputs])) + TEMPLATE_ALLOWANCE
    if api == "completions":
        parts: Any = [body.get("prompt"), body.get("suffix")]
    else:
        parts = {name: body[name] for name in ("messages", "tools", "functions", "tool_choice", "response_format")
                 if name in body}
    instructed = body.get("tools") or body.get("functions") or body.get("response_format")
    allowance = TEMPLATE_ALLOWANCE + (INSTRUCTIONS_ALLOWANCE if instructed else 0)
    # a tool result is rendered with the name of the call it answers (at most 64 characters)
    messages = body.get("messages")
    results = sum(1 for m in messages if isinstance(m, dict) and m.get("role") in ("tool", "function")) \
        if isinstance(messages, list) else 0
    allowance += TOOL_RESULT_ALLOWANCE * results
    return len(json.dumps(parts, ensure_ascii=False, separators=(",", ":")).encode()) + allowance


def _input_bound(item: Any) -> int:
    return len(item) if isinstance(item, list) else len(str(item).encode())
