"""A chat completion on llama.cpp: the request checked (event loop), prepared as an engine sequence
(worker thread), then streamed as OpenAI `chat.completion.chunk`s (the engine's thread).

The prompt is the model's own chat template over `chat_prompt.template_messages`, tokenized by
`llama_prompt` (message text never as special tokens; bounded by the context window). A body with
more messages than the window has tokens is refused before anything is rendered. Grammars come
from `tool_params`; the answer is streamed by `chunks`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from darkbloom.provider.backends.base import BackendError
from darkbloom.provider.backends.chat_prompt import template_messages
from darkbloom.provider.backends.chunks import ChatChunks
from darkbloom.provider.backends.llama_decode import check_grammar
from darkbloom.provider.backends.text_stream import ContextOverflow, TextStream
from darkbloom.provider.backends.base import Generation
from darkbloom.provider.backends.llama_engine import Sequence
from darkbloom.provider.backends.llama_model import LoadedModel
from darkbloom.provider.backends.llama_prompt import chat_prompt
from darkbloom.provider.backends.llama_sampler import SequenceSampler
from darkbloom.provider.backends.params import Sampling, chat_logprobs, sampling
from darkbloom.provider.backends.tool_params import (ToolPlan, call_schema, response_schema, schema_grammar,
                                                     tool_grammar, tool_plan)
from darkbloom.wire.openai.parameters import CHAT_SAMPLING_DEFAULTS


@dataclass
class ChatJob:
    messages: list[dict[str, str]]
    sampling: Sampling
    plan: ToolPlan
    grammar: str | None
    grammar_param: str
    hold_calls: bool  # auto with a structured alternative: an answer opening with `{` is held to the end


def chat_job(body: dict[str, Any], n_vocab: int | None, n_ctx: int) -> ChatJob:
    """The checked request (event loop: cheap, and a 400 before any instance is taken)."""
    messages = body.get("messages")
    if isinstance(messages, list) and len(messages) >= n_ctx:  # every message takes a token at least
        raise ContextOverflow(None, n_ctx, "messages")
    plan = tool_plan(body)
    schema = response_schema(body)
    settings = sampling(body, CHAT_SAMPLING_DEFAULTS, n_vocab)
    settings.top_logprobs = chat_logprobs(body)
    messages = template_messages(messages, plan, schema)
    grammar, param, hold = None, "response_format", False
    answer = schema_grammar(schema, "response_format") if schema is not None else None
    if plan.mode in ("named", "required") or (plan.mode == "auto" and schema is None):
        grammar, param = tool_grammar(plan), "functions" if plan.legacy else "tools"
    elif plan.mode == "auto":
        options = call_schema(plan.callable)
        union = {"anyOf": [*(options.get("anyOf") or [options]), schema]}
        grammar, param, hold = schema_grammar(union, "tools"), "tools", True
    else:
        grammar = answer
    return ChatJob(messages, settings, plan, grammar, param, hold)


def chat_sequence(model: LoadedModel, job: ChatJob, n_ctx: int, generation: Generation,
                  emit: Callable[[dict[str, Any]], None]) -> Sequence:
    """The engine's sequence for `job` (a worker thread: the prompt is rendered and tokenized here).
    Its first chunk, the assistant's role, is sent once the prompt is known to fit."""
    if job.grammar is not None and not check_grammar(model, job.grammar):
        raise BackendError(400, f"this model cannot follow the JSON schema in {job.grammar_param}",
                           param=job.grammar_param)
    tokens, stops = chat_prompt(model, job.messages, n_ctx, generation)
    if len(tokens) >= n_ctx:
        raise ContextOverflow(len(tokens), n_ctx, "messages")
    out = ChatChunks(job.plan, job.hold_calls, emit)
    stream = TextStream(model, job.sampling, room=n_ctx - len(tokens), extra_stops=stops)
    sequence = Sequence(tokens, SequenceSampler(model, job.sampling, job.grammar, job.sampling.seed_or_default()),
                        stream, out.take, generation, job.sampling.top_logprobs, job.grammar_param)
    out.send({"role": "assistant"})
    return sequence
