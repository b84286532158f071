"""The machine's GPU (docs/models.md "The GPU"): the offload decision from what the owner asked and a
substituted llama.cpp build; the build of this machine (a CPU build, no GPU); the instances a backend
loads get the decided `n_gpu_layers`; registration says where the models run."""

from __future__ import annotations

import logging
import subprocess
from pathlib import Path

import llama_cpp
import pytest

from darkbloom.provider.backends import BackendError, create_backend
from darkbloom.provider.backends import llama_engine
from darkbloom.provider.backends.llama_cpp import LlamaCppBackend
from darkbloom.provider.config import load_config
from darkbloom.provider.memory_fit import MemoryBudget
from darkbloom.provider.gpu_offload import (ALL_LAYERS, CPU, CUDA, METAL, GpuBuild, GpuPlan, decide_offload,
                                            probe_build, system_info_backends)
from darkbloom.provider.registration import register_frame
from darkbloom.wire import crypto
from darkbloom.wire.protocol import ModelInfo
from tests.support.processes import _env, darkbloom_cmd

MODEL = "smollm2-135m"
MAC = GpuBuild(supports_offload=True, backends=("CPU",), platform="darwin")
CUDA_BUILD = GpuBuild(supports_offload=True, backends=("CPU", "CUDA"), platform="linux")
CPU_BUILD = GpuBuild(supports_offload=False, backends=("CPU",), platform="linux")
CUDA_INFO = ("CPU : SSE3 = 1 | AVX2 = 1 | LLAMAFILE = 1 | OPENMP = 1 | REPACK = 1 | "
             "CUDA : ARCHS = 500,610,700,750,800,860,890 | USE_GRAPHS = 1 | PEER_MAX_BATCH_SIZE = 128 | ")


@pytest.mark.parametrize("requested, build, layers, device", [
    (None, MAC, ALL_LAYERS, METAL),  # a Metal build offloads every layer by default
    (None, CUDA_BUILD, ALL_LAYERS, CUDA),
    (None, CPU_BUILD, 0, CPU),  # nothing to offload to
    (12, CUDA_BUILD, 12, CUDA),  # asked for: wins over every layer
    (ALL_LAYERS, MAC, ALL_LAYERS, METAL),
    (0, MAC, 0, CPU),  # 0 on a GPU build: the CPU, and said so
    (0, CUDA_BUILD, 0, CPU),
    (None, GpuBuild(True, ("CPU", "ROCm"), "linux"), ALL_LAYERS, "rocm"),
    (None, GpuBuild(True, ("CPU", "Vulkan"), "win32"), ALL_LAYERS, "vulkan"),
    (None, GpuBuild(True, ("CPU", "BLAS"), "linux"), ALL_LAYERS, "gpu"),  # a GPU llama.cpp does not name
])
def test_the_decision_offloads_every_layer_where_the_build_can(requested: int | None, build: GpuBuild,
                                                               layers: int, device: str) -> None:
    plan = decide_offload(requested, build)
    assert (plan.layers, plan.device, plan.warning) == (layers, device, None)


def test_a_gpu_asked_of_a_cpu_build_runs_on_the_cpu_and_says_why() -> None:
    plan = decide_offload(20, CPU_BUILD)
    assert (plan.layers, plan.device) == (0, CPU)
    assert plan.warning is not None and plan.warning.startswith("gpu_layers 20 asks for a GPU, but this llama.cpp")
    assert "docs/models.md" in plan.warning
    assert "gpu_layers all asks" in str(decide_offload(ALL_LAYERS, CPU_BUILD).warning)
    assert plan.describe() == "the CPU (this llama.cpp build offloads to no GPU)"
    assert decide_offload(0, CUDA_BUILD).describe() == "the CPU (gpu_layers 0)"
    assert decide_offload(None, MAC).describe() == "the Metal GPU (every layer)"
    assert decide_offload(8, CUDA_BUILD).describe() == "the CUDA GPU (8 layers, the rest on the CPU)"


def test_the_backends_are_read_from_llama_cpp_system_info() -> None:
    assert system_info_backends(CUDA_INFO) == ("CPU", "CUDA")
    assert system_info_backends("CPU : NEON = 1 | ARM_FMA = 1 | ROCm : NO_VMM = 1 | ") == ("CPU", "ROCm")
    assert system_info_backends("") == ()


def test_this_machine_has_a_cpu_build() -> None:
    build = probe_build()
    assert build.supports_offload is False and build.backends == ("CPU",)
    assert llama_cpp.llama_supports_gpu_offload() is False
    assert decide_offload(None, build) == GpuPlan(0, CPU, "this llama.cpp build offloads to no GPU")


async def test_every_engine_is_loaded_with_the_decided_layers(gguf: Path) -> None:
    # a CPU build takes any n_gpu_layers and offloads nothing: the engines load, and keep what they were given
    backend = LlamaCppBackend({MODEL: gguf}, max_concurrency=1, n_ctx=512, gpu=GpuPlan(7, CUDA))
    await backend.start()
    try:
        assert backend.device == CUDA
        chat = backend._residency.engine(MODEL, "chat")
        assert chat is not None and chat.model.params.n_gpu_layers == 7
        async for _ in backend.stream_embeddings(MODEL, {"input": "hi"}):
            pass
        embedding = backend._residency.engine(MODEL, "embedding")
        assert embedding is not None and embedding.model.params.n_gpu_layers == 7
    finally:
        await backend.close()


def test_every_layer_is_what_llama_cpp_python_calls_all(gguf: Path) -> None:
    engine = LlamaCppBackend({MODEL: gguf}, n_ctx=256, gpu=GpuPlan(ALL_LAYERS, METAL))._load(MODEL, "chat")
    try:
        assert engine.model.params.n_gpu_layers == 0x7FFFFFFF  # llama-cpp-python's -1
    finally:
        engine.close()


def test_the_configured_backend_asks_this_build(home: Path, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING):
        backend = create_backend(load_config(home, {"gpu_layers": "all"}))
    assert isinstance(backend, LlamaCppBackend) and (backend.gpu.layers, backend.device) == (0, CPU)
    assert "gpu_layers all asks for a GPU" in caplog.text
    caplog.clear()
    assert create_backend(load_config(home, {"gpu_layers": "0"})).device == CPU  # type: ignore[attr-defined]
    assert "asks for a GPU" not in caplog.text


async def test_a_load_that_fails_on_a_gpu_says_what_to_try(gguf: Path, tmp_path: Path) -> None:
    hint = LlamaCppBackend({MODEL: gguf}, gpu=GpuPlan(ALL_LAYERS, CUDA))._load_hint()
    assert "fewer --gpu-layers" in hint
    assert LlamaCppBackend({MODEL: gguf}, gpu=GpuPlan(ALL_LAYERS, METAL))._load_hint() == ""  # the RAM it shares
    broken = tmp_path / "broken.gguf"  # GGUF metadata, no tensors: llama.cpp refuses to load it
    broken.write_bytes(gguf.read_bytes()[:2_000_000])
    backend = LlamaCppBackend({MODEL: broken}, memory=MemoryBudget(0, "unknown"), gpu=GpuPlan(ALL_LAYERS, CUDA))
    with pytest.raises(BackendError) as failed:
        await backend._open_engine(MODEL, "chat")
    assert failed.value.message.endswith(f"Failed to load model from file: {broken}{hint}")


def test_registration_says_where_the_models_run(home: Path, gguf: Path) -> None:
    config = load_config(home, {})
    identity = crypto.NodeIdentity.generate()
    backend = LlamaCppBackend({MODEL: gguf}, gpu=GpuPlan(ALL_LAYERS, METAL))
    frame = register_frame(config, home, identity, [ModelInfo(id=MODEL)], "rh", backend=backend)
    assert (frame.hardware.device, frame.hardware.backend) == (METAL, "llama-cpp")
    unknown = register_frame(config, home, identity, [ModelInfo(id=MODEL)], "rh")
    assert (unknown.hardware.device, unknown.hardware.backend) == (None, "llama-cpp")


def test_serve_and_start_refuse_a_gpu_layers_they_cannot_use(home: Path) -> None:
    served = subprocess.run(darkbloom_cmd("serve", "--gpu-layers", "-2"), env=_env(home), capture_output=True,
                            text=True, timeout=120)
    assert served.returncode == 2 and served.stderr.strip().splitlines() == [
        "error: --gpu-layers must be 0 (the CPU only), a number of layers up to 65536 to put on the GPU, or -1 or "
        "\"all\" (every layer); got '-2'"], served.stderr
    (home / "provider.toml").write_text("[backend]\ngpu_layers = 1.5\n")
    started = subprocess.run(darkbloom_cmd("start"), env=_env(home), capture_output=True, text=True, timeout=120)
    assert started.returncode == 1 and "provider.toml: [backend] gpu_layers must be 0" in started.stderr
    assert "got 1.5" in started.stderr


def test_prompts_go_in_larger_steps_on_a_gpu(gguf: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cpu = llama_engine.Engine(MODEL, gguf, slots=1, n_ctx=256, n_threads=1, gpu_layers=0)
    cpu.close()
    monkeypatch.setattr(llama_cpp, "llama_supports_gpu_offload", lambda: True)  # this build, as a GPU one says
    gpu = llama_engine.Engine(MODEL, gguf, slots=1, n_ctx=256, n_threads=1, gpu_layers=ALL_LAYERS)
    gpu.close()
    assert (cpu.prompt_step, gpu.prompt_step) == (llama_engine.PROMPT_STEP_CPU, llama_engine.PROMPT_STEP_GPU)
