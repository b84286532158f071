"""The machine's GPU: how many of a model's layers llama.cpp offloads, and to which device
(docs/models.md "The GPU").

One decision, `decide_offload`, from what the owner asked (`--gpu-layers`, `[backend] gpu_layers`;
None: nothing asked) and what the llama.cpp build can do here (`GpuBuild`): every layer when the
build can offload, else none. `probe_build` asks llama-cpp-python once; tests pass a `GpuBuild` of
their own. The device is `metal` on macOS, `cuda` for a CUDA build, the name of another GPU backend
of ggml (`rocm`, `vulkan`, …) otherwise, and `cpu` whenever nothing is offloaded.
"""

from __future__ import annotations

import re
import sys
from dataclasses import dataclass

ALL_LAYERS = -1  # llama-cpp-python's n_gpu_layers for every layer of the model
MAX_GPU_LAYERS = 65_536  # far above any model's layer count, and within n_gpu_layers' int32
CPU, METAL, CUDA, GPU = "cpu", "metal", "cuda", "gpu"
DEVICE_NAMES = {CPU: "CPU", METAL: "Metal GPU", CUDA: "CUDA GPU", "rocm": "ROCm GPU", "vulkan": "Vulkan GPU",
                "sycl": "SYCL GPU", GPU: "GPU"}
NOT_GPUS = frozenset({"cpu", "blas", "rpc"})  # ggml backends llama.cpp names that are no GPU of this machine
_BACKEND_HEAD = re.compile(r"(?:^|\|)\s*([A-Za-z][A-Za-z0-9_-]*) : ")


@dataclass(frozen=True)
class GpuBuild:
    """What the llama.cpp build can do on this machine."""

    supports_offload: bool  # llama_supports_gpu_offload(): a GPU backend built in, and a device found for it
    backends: tuple[str, ...] = ()  # the ggml backends llama.cpp's system info names: "CPU", "CUDA", …
    platform: str = sys.platform


@dataclass(frozen=True)
class GpuPlan:
    layers: int  # llama.cpp's n_gpu_layers: 0, a number of layers, or ALL_LAYERS
    device: str  # where the offloaded layers run (CPU when none are)
    reason: str = ""  # why nothing is offloaded, for the log
    warning: str | None = None  # a GPU asked for that this build cannot use

    def describe(self) -> str:
        if self.layers == 0:
            return f"the CPU ({self.reason})" if self.reason else "the CPU"
        layers = "every layer" if self.layers == ALL_LAYERS else f"{self.layers} layers, the rest on the CPU"
        return f"the {DEVICE_NAMES.get(self.device, self.device)} ({layers})"


def decide_offload(requested: int | None, build: GpuBuild) -> GpuPlan:
    """`requested`: layers the owner asked for (ALL_LAYERS for every one, 0 for none), None when not asked."""
    if requested == 0:
        return GpuPlan(0, CPU, "gpu_layers 0")
    if not build.supports_offload:
        warning = None if requested is None else (
            f"gpu_layers {'all' if requested == ALL_LAYERS else requested} asks for a GPU, but this llama.cpp "
            "build offloads to none (a CPU build, or no GPU found): the node runs on the CPU. Install a Metal or "
            "CUDA build of llama-cpp-python (docs/models.md \"The GPU\"), or set gpu_layers to 0")
        return GpuPlan(0, CPU, "this llama.cpp build offloads to no GPU", warning)
    return GpuPlan(ALL_LAYERS if requested is None else requested, gpu_device(build))


def gpu_device(build: GpuBuild) -> str:
    """The device a build that can offload offloads to: Metal on macOS, CUDA when built in, else the
    first other GPU backend it names (lower-case), else `gpu`."""
    if build.platform == "darwin":
        return METAL
    names = [name.lower() for name in build.backends]
    if CUDA in names:
        return CUDA
    others = [name for name in names if name not in NOT_GPUS]
    return others[0][:32] if others else GPU


def system_info_backends(info: str) -> tuple[str, ...]:
    """The backends named in `llama_print_system_info()`: "CPU : SSE3 = 1 | … | CUDA : ARCHS = 890 | …"
    gives ("CPU", "CUDA") (each backend's name, then its features as KEY = VALUE)."""
    return tuple(_BACKEND_HEAD.findall(info))


def probe_build() -> GpuBuild:
    """This machine's llama.cpp build, from llama-cpp-python (which must be installed)."""
    import llama_cpp

    info = llama_cpp.llama_print_system_info()
    text = info.decode("utf-8", "replace") if isinstance(info, bytes) else str(info)
    return GpuBuild(bool(llama_cpp.llama_supports_gpu_offload()), system_info_backends(text))
