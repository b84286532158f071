"""An MLX model's tokenizer as the node uses it (mlx-lm's wrapper over a Hugging Face tokenizer):
prompts as tokens, each token's bytes, and the tokens that end a generation.

Chat: the model's own chat template is rendered once with a marker in place of each message's
content (`chat_prompt.template_segments`); the template's own text is tokenized with special tokens,
every content without them, so text a caller sends never becomes a control token. A template that
drops or repeats a content gets its real rendering tokenized without special tokens at all.
Completions: the prompt as text (no special tokens), or token ids as they are.

Every prompt is bounded before it is tokenized (more bytes than the window could hold is a 400 at
once) and after (more tokens than the window).

A token's bytes come from the vocabulary itself — byte-level BPE (GPT-2's byte alphabet) or
SentencePiece (`▁` for a space, `<0xNN>` byte tokens) — so a stream can release whole UTF-8
characters as llama.cpp's does; special tokens stand for no text.
"""

from __future__ import annotations

import functools
import json
import re
from typing import Any

from darkbloom.provider.backends.base import BackendError
from darkbloom.provider.backends.chat_prompt import Segment, marked_messages, template_segments
from darkbloom.provider.backends.text_stream import ContextOverflow

_BYTE_TOKEN = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")
_TEMPLATE_REJECTED = "this model's chat template rejected the messages (check the roles and their order)"


class MlxVocabulary:
    def __init__(self, wrapper: Any) -> None:
        """`wrapper`: mlx-lm's TokenizerWrapper (`mlx_lm.tokenizer_utils.load`)."""
        self.tokenizer = wrapper._tokenizer  # the Hugging Face tokenizer itself
        self.eog = frozenset(int(token) for token in wrapper.eos_token_ids)
        self.n_vocab = len(self.tokenizer)
        self._bytes = _token_bytes(self.tokenizer, self.n_vocab)
        self.longest_token_bytes = max(1, max((len(b) for b in self._bytes), default=1))

    # text_stream.Vocabulary

    def is_eog(self, token: int) -> bool:
        return token in self.eog

    def detokenize(self, tokens: list[int]) -> bytes:
        return b"".join(self._bytes[token] if 0 <= token < self.n_vocab else b"" for token in tokens)

    # prompts

    def chat_prompt(self, messages: list[dict[str, str]], n_ctx: int) -> list[int]:
        """The templated prompt's tokens (raises BackendError 400, ContextOverflow)."""
        import jinja2

        most = n_ctx - 1
        self._check_size(sum(len(m["content"].encode()) for m in messages), most, n_ctx, "messages")
        try:
            rendered = self._render(marked_messages(messages))
            segments = template_segments(rendered, messages)
            if segments is None:
                segments = [(self._render(messages), False)]
        except jinja2.TemplateError:
            raise BackendError(400, _TEMPLATE_REJECTED, param="messages") from None
        return self._bounded(segments, most, n_ctx, "messages")

    def completion_prompt(self, prompt: str, n_ctx: int) -> list[int]:
        most = n_ctx - 1
        self._check_size(len(prompt.encode()), most, n_ctx, "prompt")
        tokens = self._bounded([(prompt, False)], most, n_ctx, "prompt")
        if not tokens:  # an empty prompt: the model's BOS, else its first end token, to start from
            bos = self.tokenizer.bos_token_id
            tokens = [int(bos) if bos is not None else min(self.eog, default=0)]
        return tokens

    def _render(self, messages: list[dict[str, str]]) -> str:
        if self.tokenizer.chat_template is None:
            raise BackendError(400, "this model has no chat template: use the completions API with a prompt",
                               param="messages")
        text = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return str(text)

    def _check_size(self, size: int, most: int, n_ctx: int, param: str) -> None:
        if size > most and size > most * self.longest_token_bytes:
            raise ContextOverflow(None, n_ctx, param)

    def _bounded(self, segments: list[Segment], most: int, n_ctx: int, param: str) -> list[int]:
        tokens: list[int] = []
        for text, special in segments:
            tokens += self.tokenizer.encode(text, add_special_tokens=False, split_special_tokens=not special)
            if len(tokens) > most:
                raise ContextOverflow(len(tokens), n_ctx, param, at_least=True)
        return tokens


def _token_bytes(tokenizer: Any, n_vocab: int) -> list[bytes]:
    """Every token's bytes, by the kind of decoder the tokenizer has; special tokens none."""
    pieces = tokenizer.convert_ids_to_tokens(list(range(n_vocab)))
    special = set(tokenizer.all_special_ids) | {
        int(index) for index, added in tokenizer.added_tokens_decoder.items() if added.special}
    decoder = json.loads(tokenizer.backend_tokenizer.to_str()).get("decoder") or {}
    kinds = {decoder.get("type")} | {d.get("type") for d in decoder.get("decoders") or [] if isinstance(d, dict)}
    out = []
    for index, piece in enumerate(pieces):
        if index in special or piece is None:
            out.append(b"")
        elif "ByteLevel" in kinds:
            out.append(bytes(_BYTE_DECODER.get(char, 0x3F) for char in piece))
        elif "ByteFallback" in kinds or "Replace" in kinds:
            byte = _BYTE_TOKEN.match(piece)
            out.append(bytes([int(byte[1], 16)]) if byte else piece.replace("\u2581", " ").encode())
        else:
            out.append(tokenizer.decode([index]).encode())
    return out


@functools.cache
def _byte_alphabet() -> dict[str, int]:
    """GPT-2's byte-level alphabet: the printable character standing for each byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars = list(printable)
    n = 0
    for byte in range(256):
        if byte not in printable:
            printable.append(byte)
            chars.append(256 + n)
            n += 1
    return {chr(char): byte for byte, char in zip(printable, chars)}


_BYTE_DECODER = _byte_alphabet()
