"""Legacy prompt completions and embeddings on llama.cpp: checked on the event loop, tokenized on a
worker thread, run by the model's engines.

Completions: the raw prompt, no chat template, tokenized as text (BOS when the model asks for one;
unlike `create_completion`, text such as `<|im_start|>` never becomes a control token: OpenAI's API
takes a prompt as text) and bounded as every prompt is (`llama_prompt`); token-id prompts are used as
they are. `echo` and `suffix` are refused (400 naming them). `logprobs` (0–5) in the legacy shape:
`tokens`, `token_logprobs`, `top_logprobs` ({token: logprob}), `text_offset` (from the start of the
prompt).

Embeddings: each input as tokens, at most one embeddings batch long (`llama_embeddings` decodes
and pools them). Each vector goes as soon as it is made, in a chunk of its own: `{"object": "list",
"data": [one embedding object with its "index"]}` (the shape of the whole answer with part of its
data), so no answer is ever one frame too large for the socket. Usage: every token embedded is a
prompt token.
"""

from __future__ import annotations

from typing import Any, Callable

from darkbloom.provider.backends.base import Generation
from darkbloom.provider.backends.chunks import completion_chunks
from darkbloom.provider.backends.llama_embeddings import BATCH as EMBEDDING_BATCH
from darkbloom.provider.backends.llama_engine import Sequence
from darkbloom.provider.backends.llama_model import LoadedModel
from darkbloom.provider.backends.llama_prompt import bounded_tokens
from darkbloom.provider.backends.llama_sampler import SequenceSampler
from darkbloom.provider.backends.params import CompletionJob, check_token_ids, embedding_inputs, require_object
from darkbloom.provider.backends.text_stream import ContextOverflow, TextStream


def completion_sequence(model: LoadedModel, job: CompletionJob, n_ctx: int, generation: Generation,
                        emit: Callable[[dict[str, Any]], None]) -> Sequence:
    """The engine's sequence for `job` (a worker thread: the prompt is tokenized here)."""
    if isinstance(job.prompt, list):
        check_token_ids(job.prompt, model.n_vocab(), "prompt")
        tokens, offset = job.prompt, len(model.detokenize(job.prompt).decode("utf-8", "replace"))
    else:
        tokens = bounded_tokens(model, [(job.prompt, False)], add_bos=True, most=n_ctx - 1, window=n_ctx,
                                param="prompt", generation=generation) or [model.token_bos()]
        offset = len(job.prompt)
    if len(tokens) >= n_ctx:
        raise ContextOverflow(len(tokens), n_ctx, "prompt")
    stream = TextStream(model, job.sampling, room=n_ctx - len(tokens))
    take = completion_chunks(job.sampling.top_logprobs, offset, emit)
    return Sequence(tokens, SequenceSampler(model, job.sampling, None, job.sampling.seed_or_default()), stream, take,
                    generation, job.sampling.top_logprobs)


def embedding_job(body: Any) -> list[str | list[int]]:
    return embedding_inputs(require_object(body))


def embedding_tokens(model: LoadedModel, inputs: list[str | list[int]], generation: Generation) -> list[list[int]]:
    """Each input as tokens (a worker thread), none longer than one embeddings batch."""
    n_vocab, most = model.n_vocab(), EMBEDDING_BATCH
    token_lists = []
    for item in inputs:
        if isinstance(item, str):
            tokens = bounded_tokens(model, [(item, False)], add_bos=True, most=most, window=most, param="input",
                                    generation=generation)
        else:
            check_token_ids(item, n_vocab, "input")
            tokens = item
        if len(tokens) > most:
            raise ContextOverflow(len(tokens), most, "input")
        token_lists.append(tokens)
    return token_lists
