"""Will it fit: the memory estimate on the bundled GGUF's real metadata and on synthetic numbers,
the detected budget (RAM, cgroup limit, --max-memory-gb) and the refusal's sentence."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from darkbloom.provider.config import ConfigError, load_config
from darkbloom.provider.memory_fit import (CHAT_BUFFERS, EMBEDDING_BUFFERS, GIB, MIB, MemoryBudget, MemoryNeed,
                                           ModelDoesNotFit, detected_memory, estimate, kv_cache_bytes,
                                           memory_budget, refuse_unfit, refuse_unfit_models, serving_concurrency,
                                           size_text)
from darkbloom.provider.models import read_gguf_metadata

LLAMA_7B = {"general.architecture": "llama", "llama.block_count": 32, "llama.embedding_length": 4096,
            "llama.attention.head_count": 32}


def test_kv_cache_of_the_bundled_model_is_what_llama_cpp_allocates(gguf: Path) -> None:
    metadata = read_gguf_metadata(gguf)
    # SmolLM2-135M: 30 layers, 3 KV heads of 576 / 9 = 64; llama.cpp logs "KV buffer size = 45.00 MiB"
    # for n_ctx 2048 (f16 K and V, 22.50 MiB each).
    assert kv_cache_bytes(metadata, 2048) == 30 * 2048 * 3 * (64 + 64) * 2 == 45 * MIB
    assert kv_cache_bytes(metadata, 1024) == 45 * MIB // 2


def test_kv_cache_fallbacks() -> None:
    # no head_count_kv: as many KV heads as heads; no key/value_length: embedding_length / head_count
    assert kv_cache_bytes(LLAMA_7B, 4096) == 32 * 4096 * 32 * (128 + 128) * 2 == 2 * GIB
    grouped = {**LLAMA_7B, "llama.attention.head_count_kv": 8}
    assert kv_cache_bytes(grouped, 4096) == 2 * GIB // 4
    # explicit head sizes win over the fallback (Gemma's are 256 with embedding_length / heads = 192)
    gemma = {"general.architecture": "gemma", "gemma.block_count": 28, "gemma.embedding_length": 3072,
             "gemma.attention.head_count": 16, "gemma.attention.head_count_kv": 16,
             "gemma.attention.key_length": 256, "gemma.attention.value_length": 256}
    assert kv_cache_bytes(gemma, 1000) == 28 * 1000 * 16 * (256 + 256) * 2
    # metadata that does not describe a transformer: nothing to estimate
    assert kv_cache_bytes({}, 2048) == 0
    assert kv_cache_bytes({"general.architecture": "llama", "llama.block_count": 30}, 2048) == 0
    assert kv_cache_bytes({**LLAMA_7B, "llama.attention.head_count": True}, 2048) == 0


def test_estimate_counts_the_file_and_one_context_for_every_sequence(gguf: Path) -> None:
    size = gguf.stat().st_size
    chat = estimate("smollm2-135m", gguf, 1024, 2)
    assert (chat.file_bytes, chat.sequences) == (size, 2)
    assert chat.context_bytes == 45 * MIB + CHAT_BUFFERS  # a KV cache of 2 × 1024 cells, one set of buffers
    assert chat.total == size + chat.context_bytes
    assert estimate("smollm2-135m", gguf, 1024, 4).context_bytes == 90 * MIB + CHAT_BUFFERS
    embedding = estimate("smollm2-135m", gguf, 1024, 2, "embedding")
    assert (embedding.context_bytes, embedding.sequences) == (45 * MIB // 4 + EMBEDDING_BUFFERS, 0)
    assert chat.describe() == "179 MB (94 MB file + 85 MB context for 2 requests)"
    assert embedding.describe() == "329 MB (94 MB file + 235 MB context)"
    assert estimate("x", gguf, 1024, 1).describe().endswith("context for 1 request)")


def test_need_and_budget_sentences() -> None:
    need = MemoryNeed("big", file_bytes=int(2.9 * GIB), context_bytes=int(0.3 * GIB), sequences=2)
    assert need.describe() == "3.2 GB (2.9 GB file + 0.3 GB context for 2 requests)"
    budget = memory_budget(2)
    assert (budget.total_bytes, budget.source, budget.gb) == (2 * GIB, "--max-memory-gb", 2.0)
    with pytest.raises(ModelDoesNotFit) as refused:
        refuse_unfit([MemoryNeed("small", GIB // 2, 0, 2), need], budget)
    assert str(refused.value) == ("model big needs 3.2 GB (2.9 GB file + 0.3 GB context for 2 requests); "
                                  "this machine has 2.0 GB (--max-memory-gb)")
    assert isinstance(refused.value, ConfigError)
    refuse_unfit([need], memory_budget(3.5))  # fits: nothing raised
    refuse_unfit([need], MemoryBudget(0, "RAM"))  # memory unknown: nothing refused
    assert (size_text(512 * MIB), size_text(GIB), size_text(int(23.54 * GIB))) == ("512 MB", "1.0 GB", "23.5 GB")


def test_detected_memory_is_ram_or_a_smaller_cgroup_limit(tmp_path: Path) -> None:
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    limit = tmp_path / "memory.max"
    limit.write_text("max\n")
    assert detected_memory((limit,)) == MemoryBudget(ram, "RAM")
    limit.write_text(f"{GIB}\n")
    assert detected_memory((limit,)) == MemoryBudget(GIB, "cgroup limit")
    limit.write_text(f"{ram * 2}\n")
    assert detected_memory((limit,)) == MemoryBudget(ram, "RAM")
    # cgroup v1's file, when v2's is absent
    v1 = tmp_path / "memory.limit_in_bytes"
    v1.write_text(f"{GIB}\n")
    assert detected_memory((tmp_path / "absent", v1)) == MemoryBudget(GIB, "cgroup limit")
    assert memory_budget(None).total_bytes == detected_memory().total_bytes > 0


def test_config_reads_max_memory_and_keep_alive(home: Path) -> None:
    (home / "provider.toml").write_text("[backend]\nmax_memory_gb = 6\nkeep_alive = -1\n")
    config = load_config(home, {})
    assert (config.max_memory_gb, config.keep_alive) == (6, -1)
    config = load_config(home, {"max_memory_gb": 0.5, "keep_alive": 0.0})
    assert (config.max_memory_gb, config.keep_alive) == (0.5, 0.0)
    assert load_config(home / "absent", {}).keep_alive == 300 and load_config(home / "absent", {}).max_memory_gb is None
    for bad in ({"max_memory_gb": 0}, {"max_memory_gb": -2.0}, {"max_memory_gb": float("inf")},
                {"keep_alive": float("nan")}):
        with pytest.raises(ConfigError):
            load_config(home, bad)
    (home / "provider.toml").write_text('[backend]\nkeep_alive = "5m"\n')
    with pytest.raises(ConfigError, match="keep_alive"):
        load_config(home, {})


def test_a_configuration_whose_model_cannot_fit_is_refused(home: Path) -> None:
    config = load_config(home, {"max_memory_gb": 0.1})
    refusal = r"^model smollm2-135m needs .* this machine has 102 MB \(--max-memory-gb\)$"
    with pytest.raises(ModelDoesNotFit, match=refusal):
        refuse_unfit_models(config)
    refuse_unfit_models(load_config(home, {"max_memory_gb": 1}))
    refuse_unfit_models(load_config(home, {"max_memory_gb": 0.1, "backend": "openai",
                                           "upstream_url": "http://127.0.0.1:1"}))  # the upstream's memory


def test_the_default_concurrency_is_what_memory_allows(home: Path) -> None:
    # the bundled model: 94 MB of file, 45 MB of KV cache per window, 40 MB of buffers
    assert serving_concurrency(load_config(home, {"max_memory_gb": 0.31})) == 4  # 314 MB
    assert serving_concurrency(load_config(home, {"max_memory_gb": 0.27})) == 3  # 269 MB
    assert serving_concurrency(load_config(home, {"max_memory_gb": 0.23})) == 2  # 224 MB
    assert serving_concurrency(load_config(home, {"max_memory_gb": 0.1})) == 1  # nothing fits: serve refuses it
    assert serving_concurrency(load_config(home, {"max_memory_gb": 0.1, "max_concurrency": 2})) == 2  # the owner's
    (home / "provider.toml").write_text("[backend]\nmax_concurrency = 4\nmax_memory_gb = 0.1\n")
    assert serving_concurrency(load_config(home, {})) == 4
    (home / "provider.toml").write_text("[backend]\nkind = \"openai\"\nupstream_url = \"http://127.0.0.1:1\"\n"
                                        "max_memory_gb = 0.1\n")
    assert serving_concurrency(load_config(home, {})) == 4  # an upstream keeps its own memory
