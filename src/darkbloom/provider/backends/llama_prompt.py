"""Prompts as tokens, bounded by the context window and cancellable (worker thread).

Chat: the model's own chat template (its GGUF `tokenizer.chat_template`, rendered as
llama-cpp-python renders it, ChatML for a GGUF without one) is rendered once with a marker in place
of each message's content. The template's own text is tokenized with special tokens (its
`<|im_start|>` stays a control token), every content without them: text a caller sends can never
become a control token (a forged system turn). A template that drops or repeats a content (no marker
found exactly once, in order) gets its real rendering tokenized without special tokens at all.

Every prompt is bounded before and while it is tokenized: more bytes than the window could hold
(`n_ctx` × the model's longest token) is a 400 at once; text is tokenized in pieces of at most
PIECE_CHARS (cut before a word where it can be), the cancel flag checked between them, and the count
stops as soon as the window is full.
"""

from __future__ import annotations

import logging
from typing import Iterator

from llama_cpp import llama_chat_format

from darkbloom.provider.backends.text_stream import ContextOverflow
from darkbloom.provider.backends.base import Generation
from darkbloom.provider.backends.chat_prompt import Segment, marked_messages, template_segments
from darkbloom.provider.backends.llama_model import LoadedModel

log = logging.getLogger(__name__)
PIECE_CHARS = 8192
_LONGEST: dict[str, int] = {}  # model file → its longest token in bytes


def chat_prompt(model: LoadedModel, messages: list[dict[str, str]], n_ctx: int,
                generation: Generation | None = None) -> tuple[list[int], tuple[str, ...]]:
    """The templated prompt's tokens and the template's stop strings."""
    formatter = _formatter(model)
    marked = formatter(messages=marked_messages(messages))
    segments = template_segments(marked.prompt, messages)
    if segments is None:
        log.warning("this model's chat template reshapes message contents; its prompt is tokenized without "
                    "special tokens")
        segments = [(formatter(messages=messages).prompt, False)]
    stops = marked.stop if isinstance(marked.stop, list) else [marked.stop] if marked.stop else []
    tokens = bounded_tokens(model, segments, add_bos=not marked.added_special, most=n_ctx - 1, window=n_ctx,
                            param="messages", generation=generation)
    return tokens, tuple(stops)


def bounded_tokens(model: LoadedModel, segments: list[Segment], *, add_bos: bool, most: int, window: int,
                   param: str, generation: Generation | None = None) -> list[int]:
    """`segments` tokenized in order; ContextOverflow (naming `window`) as soon as they come to more
    than `most` tokens, or hold more bytes than `most` tokens could; Cancelled once `generation` is."""
    size = sum(len(text.encode("utf-8")) for text, _ in segments)
    if size > most and size > most * longest_token_bytes(model):
        raise ContextOverflow(None, window, param)
    tokens: list[int] = []
    first = add_bos
    for text, special in segments:
        for piece in _pieces(text):
            if generation is not None:
                generation.check()
            tokens += model.tokenize(piece.encode("utf-8"), add_bos=first, special=special)
            first = False
            if len(tokens) > most:
                raise ContextOverflow(len(tokens), window, param, at_least=True)
    if first:  # nothing at all to tokenize: still the BOS the model asks for
        tokens = model.tokenize(b"", add_bos=True, special=False)
    return tokens


def longest_token_bytes(model: LoadedModel) -> int:
    """The most bytes one token of this model's vocabulary stands for (computed once per model file)."""
    longest = _LONGEST.get(model.model_path)
    if longest is None:
        longest = max(1, max((len(model.detokenize([i], special=True)) for i in range(model.n_vocab())), default=1))
        _LONGEST[model.model_path] = longest
    return longest


def _formatter(model: LoadedModel) -> llama_chat_format.ChatFormatter:
    if model.formatter is None:
        template = model.metadata.get("tokenizer.chat_template")
        if template:
            eos, bos = model.token_eos(), model.token_bos()
            model.formatter = llama_chat_format.Jinja2ChatFormatter(
                template=template, eos_token=model.token_text(eos) if eos != -1 else "",
                bos_token=model.token_text(bos) if bos != -1 else "", stop_token_ids=[eos])
        else:
            model.formatter = llama_chat_format.format_chatml  # a GGUF without a template: ChatML
    return model.formatter  # type: ignore[no-any-return]


def _pieces(text: str) -> Iterator[str]:
    """`text` in pieces of at most PIECE_CHARS, each cut before a space that starts a word where
    there is one (where a byte-level BPE pre-tokenizer cuts anyway)."""
    start = 0
    while len(text) - start > PIECE_CHARS:
        cut = text.rfind(" ", start + 1, start + PIECE_CHARS)
        while cut > start and (text[cut - 1].isspace() or text[cut + 1].isspace()):
            cut = text.rfind(" ", start + 1, cut)
        if cut <= start:
            cut = start + PIECE_CHARS
        yield text[start:cut]
        start = cut
    yield text[start:]
