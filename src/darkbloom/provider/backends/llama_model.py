"""One GGUF's weights and vocabulary in memory (llama.cpp's `llama_model`), and what prompts need of them.

An engine (`llama_engine`, `llama_embeddings`) loads one and makes its context over it. Tokenizing
and detokenizing read only the vocabulary, so any thread may do them while the engine's thread
decodes.

`extra_buffer_types` is llama.cpp's `use_extra_bufts`: weights repacked for special kernels (AMX
among them). Some VMs advertise AMX in cpuinfo without enabling it, and the AMX matmul then kills
the process with SIGSEGV on the first decode, so the node's default is off (plain CPU kernels).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import llama_cpp
from llama_cpp import _internals as llama_internals
from llama_cpp._logger import set_verbose


class LoadedModel:
    def __init__(self, path: Path, *, gpu_layers: int = 0, extra_buffer_types: bool = False,
                 vocab_only: bool = False) -> None:
        """Raises ValueError when the file cannot be loaded."""
        set_verbose(False)  # llama.cpp's own log: errors only (as `Llama(verbose=False)` has it)
        params = llama_cpp.llama_model_default_params()
        params.n_gpu_layers = 0x7FFFFFFF if gpu_layers < 0 else gpu_layers  # every layer, as `Llama` has it
        params.vocab_only = vocab_only
        if hasattr(params, "use_extra_bufts"):
            params.use_extra_bufts = extra_buffer_types
        self.params = params
        self.model_path = str(path)
        self._model = llama_internals.LlamaModel(path_model=str(path), params=params, verbose=False)
        self.vocab = self._model.vocab
        self.metadata: dict[str, str] = self._model.metadata()
        self._n_vocab = self._model.n_vocab()
        self.formatter: Any = None  # the chat template's renderer, made once (`llama_prompt`)

    @property
    def pointer(self) -> Any:
        """The `llama_model *` for llama.cpp's functions."""
        return self._model.model

    def n_vocab(self) -> int:
        return self._n_vocab

    def n_embd(self) -> int:
        return self._model.n_embd()

    def token_bos(self) -> int:
        return self._model.token_bos()

    def token_eos(self) -> int:
        return self._model.token_eos()

    def token_text(self, token: int) -> str:
        return self._model.token_get_text(token)

    def is_eog(self, token: int) -> bool:
        return bool(llama_cpp.llama_vocab_is_eog(self.vocab, token))

    def tokenize(self, text: bytes, add_bos: bool = True, special: bool = False) -> list[int]:
        return self._model.tokenize(text, add_bos, special)  # type: ignore[no-any-return]

    def detokenize(self, tokens: list[int], special: bool = False) -> bytes:
        return self._model.detokenize(tokens, special=special)  # type: ignore[no-any-return]

    def new_context(self, params: Any) -> Any:
        """A llama.cpp context (`llama_context *`) over this model; ValueError, this model closed, when
        llama.cpp cannot make one."""
        context = llama_cpp.llama_init_from_model(self.pointer, params)
        if not context:
            self.close()
            raise ValueError("llama.cpp could not make a context for this model")
        return context

    def close(self) -> None:
        self._model.close()
