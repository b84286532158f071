"""The node's configuration: `$DARKBLOOM_HOME/provider.toml` plus command-line overrides (docs/cli.md
"provider.toml", "Node flags"), and `DARKBLOOM_LLAMA_EXTRA_BUFTS` from the environment."""

from __future__ import annotations

import math
import os
import re
import socket
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple
from urllib.parse import urlsplit, urlunsplit

from pydantic import BaseModel, ConfigDict, Field, ValidationError
from pydantic_core import ErrorDetails

from darkbloom.wire.catalog import BUNDLED_MODEL_ID
from darkbloom.wire.openai.body import DEFAULT_MAX_BODY_BYTES
from darkbloom.provider.bundled_model import BundledModelMissing, bundled_gguf_path
from darkbloom.provider.gpu_offload import ALL_LAYERS, MAX_GPU_LAYERS
from darkbloom.provider.model_store import InvalidModelId, ModelStore
from darkbloom.paths import provider_config_path
from darkbloom.wire.protocol import (CAPABILITIES, MAX_CONCURRENCY, MAX_CONTEXT_LENGTH, MAX_MEMORY_GB,
                                     PROVIDER_WS_PATH, model_id_problem)

DEFAULT_MAX_CONCURRENCY = 4  # upstream Darkbloom's, and llama-server's automatic slot count
BACKENDS = ("llama-cpp", "mlx", "openai")
IN_PROCESS_BACKENDS = ("llama-cpp", "mlx")  # models in this process: GGUF files, MLX directories
DEFAULT_COORDINATOR_URL = "http://127.0.0.1:8080"
DEFAULT_KEEP_ALIVE = 300.0  # seconds a llama-cpp model stays loaded with no request (docs/models.md)


class ConfigError(Exception):
    """A configuration the node cannot run with; the message says what to change."""


class ModelNotPulled(ConfigError):
    """Models named by id alone that are neither the bundled one nor in the model store. `config`
    is valid apart from them (their paths are still empty)."""

    def __init__(self, model_ids: list[str], config: "ProviderConfig", store: Path) -> None:
        self.model_ids = model_ids
        self.config = config
        super().__init__("; ".join(
            f"model {model_id!r} is not in the model store {store}: run `darkbloom models pull {model_id}` "
            f"(or serve with --pull), or serve a file with --model {model_id}=/path/to/model.gguf"
            for model_id in model_ids))


class ModelSpec(NamedTuple):
    id: str
    path: str = ""  # empty: the bundled file (llama-cpp), the model store's, or the upstream's model name (openai)
    # openai backend: what the upstream serves for this model beyond chat (None: the backend's default)
    capabilities: tuple[str, ...] | None = None


@dataclass
class ProviderConfig:
    coordinator_url: str = DEFAULT_COORDINATOR_URL
    private_only: bool = False
    heartbeat_interval_secs: float = 5.0
    backend: str = "llama-cpp"
    upstream_url: str = ""
    max_concurrency: int = DEFAULT_MAX_CONCURRENCY
    max_concurrency_chosen: bool = False  # by the owner; else fewer where memory needs (memory_fit.serving_concurrency)
    models: list[ModelSpec] = field(default_factory=lambda: [ModelSpec(BUNDLED_MODEL_ID, "")])
    local_endpoint: bool = False
    local_port: int = 8000
    local_bind: str = "127.0.0.1"
    name: str = field(default_factory=socket.gethostname)
    context_length: int = 2048  # llama-cpp n_ctx per sequence
    threads: int = 0  # llama-cpp threads per engine; 0 = every core
    extra_buffer_types: bool = False  # llama-cpp: llama.cpp's repacked-weight (AMX) kernels; off: plain CPU
    max_memory_gb: float | None = None  # the memory models may use; None: this machine's (memory_fit)
    keep_alive: float = DEFAULT_KEEP_ALIVE  # llama-cpp: idle seconds before a model unloads; 0 at once, <0 never
    gpu_layers: int | None = None  # llama-cpp: layers offloaded to the GPU; None: all when the build can; -1 all
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES  # direct mode: larger request bodies get 413

    @property
    def model_ids(self) -> list[str]:
        return [model.id for model in self.models]


def load_config(home: Path, overrides: dict[str, object]) -> ProviderConfig:
    """provider.toml (if present), then the environment, then `overrides` (keys as the CLI passes
    them), validated."""
    config = ProviderConfig()
    path = provider_config_path(home)
    data: dict[str, Any] = {}
    if path.exists():
        try:
            data = tomllib.loads(path.read_text())
        except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
            raise ConfigError(f"{path} is not valid TOML ({exc}); fix or delete it") from None
        _apply_toml(config, data, path)
    _apply_environment(config)
    _apply_overrides(config, overrides)
    _validate(config)
    _resolve_from_store(config, ModelStore(home))
    config.max_concurrency_chosen = _sets_concurrency(data, overrides)
    return config


def _sets_concurrency(data: dict[str, Any], overrides: dict[str, object]) -> bool:
    backend = data.get("backend")
    return overrides.get("max_concurrency") is not None or \
        (isinstance(backend, dict) and backend.get("max_concurrency") is not None)


def ws_url(config: ProviderConfig) -> str:
    """ws(s)://host[/prefix]/ws/provider from the coordinator's http(s) base URL."""
    parts = urlsplit(config.coordinator_url.rstrip("/"))
    scheme = {"http": "ws", "https": "wss"}.get(parts.scheme, parts.scheme)
    path = parts.path
    if not path.endswith(PROVIDER_WS_PATH):
        path += PROVIDER_WS_PATH
    return urlunsplit((scheme, parts.netloc, path, "", ""))


def resolve_model_path(spec: ModelSpec) -> Path:
    """A model's weights: its path (a GGUF file, an MLX directory), or the bundled file for the bundled id."""
    if spec.path:
        return Path(spec.path).expanduser()
    return bundled_gguf_path()


def parse_model_arg(text: str) -> ModelSpec:
    """`--model ID` or `--model ID=PATH`."""
    model_id, _, path = text.partition("=")
    model_id = model_id.strip()
    if not model_id:
        raise ConfigError(f"--model {text!r} has no model id; use --model ID or --model ID=PATH")
    return ModelSpec(model_id, path.strip())


def default_toml(coordinator_url: str) -> str:
    """A fresh provider.toml pointing at `coordinator_url` (written by `darkbloom login`)."""
    return (
        "[coordinator]\n"
        f"url = {_toml_string(coordinator_url)}\n"
        "private_only = false\n"
        "heartbeat_interval_secs = 5\n\n"
        "[backend]\n"
        'kind = "llama-cpp"        # or "mlx" (MLX models, in process), or "openai" (any OpenAI-compatible server)\n'
        'upstream_url = ""         # for kind = "openai"\n'
        "# max_concurrency = 4     # requests at once; default 4, fewer where the models would not fit\n\n"
        "[[models]]\n"
        f'id = "{BUNDLED_MODEL_ID}"\n'
        'path = ""                 # empty: the bundled file (or, for another id, the pulled one); else a GGUF path\n\n'
        "[local]\n"
        "port = 8000\n"
        'bind = "127.0.0.1"\n'
    )


def _toml_string(text: str) -> str:
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


class _Table(BaseModel):
    """A provider.toml table: values of the stated type only (no `true` for a number), unknown keys
    ignored, and a key left out (None) keeps the value it had."""

    model_config = ConfigDict(strict=True, extra="ignore", frozen=True)

    def settings(self) -> dict[str, Any]:
        return self.model_dump(exclude_none=True)


class _CoordinatorTable(_Table):
    coordinator_url: str | None = Field(None, validation_alias="url")
    private_only: bool | None = None
    heartbeat_interval_secs: float | None = None


class _BackendTable(_Table):
    backend: str | None = Field(None, validation_alias="kind")
    upstream_url: str | None = None
    max_concurrency: int | None = None
    context_length: int | None = None
    threads: int | None = None
    extra_buffer_types: bool | None = None
    max_memory_gb: float | None = None
    keep_alive: float | None = None
    gpu_layers: Any = None  # a number or "all": read by `gpu_layers`, which says what is wrong


class _LocalTable(_Table):
    local_port: int | None = Field(None, validation_alias="port")
    local_bind: str | None = Field(None, validation_alias="bind")
    local_endpoint: bool | None = Field(None, validation_alias="enabled")
    max_body_bytes: int | None = None


class _NodeTable(_Table):
    name: str | None = None


class _ModelTable(_Table):
    id: str = ""
    path: str = ""
    capabilities: list[str] | None = None


class _ProviderFile(_Table):
    coordinator: _CoordinatorTable = _CoordinatorTable()
    backend: _BackendTable = _BackendTable()
    local: _LocalTable = _LocalTable()
    node: _NodeTable = _NodeTable()
    models: list[_ModelTable] | None = None


_TYPE_NAMES = {"int_type": "int", "float_type": "int or float", "bool_type": "bool", "string_type": "str"}


def _apply_toml(config: ProviderConfig, data: dict[str, Any], path: Path) -> None:
    try:
        file = _ProviderFile.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(f"{path}: {_problem(exc.errors()[0])}") from None
    for table in (file.coordinator, file.backend, file.local, file.node):
        for name, value in table.settings().items():
            setattr(config, name, gpu_layers(value, f"{path}: [backend] gpu_layers") if name == "gpu_layers" else value)
    if file.models is not None:
        config.models = [ModelSpec(m.id.strip(), m.path.strip(), _capabilities(m, path)) for m in file.models]


def _capabilities(model: _ModelTable, path: Path) -> tuple[str, ...] | None:
    if model.capabilities is None:
        return None
    unknown = sorted(set(model.capabilities) - CAPABILITIES)
    if unknown:
        raise ConfigError(f"{path}: [[models]] {model.id!r} capabilities: unknown {', '.join(unknown)} "
                          f"(known: {', '.join(sorted(CAPABILITIES))})")
    return tuple(dict.fromkeys(model.capabilities))


def _problem(error: ErrorDetails) -> str:
    """One sentence for the first thing wrong in the file: which key, what it must be."""
    loc = error["loc"]
    if loc[0] == "models" and len(loc) <= 2:
        return "models must be [[models]] tables with id and path"
    if len(loc) == 1:
        return f"[{loc[0]}] must be a table"
    where = f"[[models]] #{int(loc[1]) + 1} {loc[2]}" if loc[0] == "models" else f"[{loc[0]}] {loc[1]}"
    expected = _TYPE_NAMES.get(error["type"])
    if expected is None:
        return f"{where}: {error['msg']}"
    return f"{where} must be of type {expected}, not {error['input']!r}"


EXTRA_BUFFER_TYPES_ENV = "DARKBLOOM_LLAMA_EXTRA_BUFTS"


def _apply_environment(config: ProviderConfig) -> None:
    """Settings the environment may give over provider.toml: `DARKBLOOM_LLAMA_EXTRA_BUFTS=1` (or 0)."""
    extra_buffer_types = os.environ.get(EXTRA_BUFFER_TYPES_ENV)
    if extra_buffer_types is not None:
        config.extra_buffer_types = extra_buffer_types == "1"


_OVERRIDE_FIELDS = {"coordinator_url", "backend", "upstream_url", "private_only", "max_concurrency",
                    "local_endpoint", "local_port", "local_bind", "max_memory_gb", "keep_alive"}


def _apply_overrides(config: ProviderConfig, overrides: dict[str, object]) -> None:
    for key, value in overrides.items():
        if value is None:
            continue
        if key == "models":
            if isinstance(value, str) or not isinstance(value, (list, tuple)):
                raise ConfigError("models override must be a list of 'ID' or 'ID=PATH' strings")
            if value:
                config.models = [parse_model_arg(str(item)) for item in value]
        elif key == "gpu_layers":
            config.gpu_layers = gpu_layers(value, "--gpu-layers")
        elif key in _OVERRIDE_FIELDS:
            setattr(config, key, value)
        else:
            raise ConfigError(f"unknown setting {key!r}")


def gpu_layers(value: object, where: str) -> int:
    """A gpu_layers setting as llama.cpp takes it: 0 (the CPU only), a number of layers, or ALL_LAYERS
    for -1 and "all"."""
    layers: int | None = None
    if isinstance(value, int) and not isinstance(value, bool):
        layers = value
    elif isinstance(value, str) and value.strip().lower() == "all":
        layers = ALL_LAYERS
    elif isinstance(value, str) and re.fullmatch(r"-?[0-9]{1,6}", value.strip()):
        layers = int(value.strip())
    if layers is None or not ALL_LAYERS <= layers <= MAX_GPU_LAYERS:
        raise ConfigError(f"{where} must be 0 (the CPU only), a number of layers up to {MAX_GPU_LAYERS} to put on "
                          f"the GPU, or -1 or \"all\" (every layer); got {value!r}")
    return layers


def _validate(config: ProviderConfig) -> None:
    config.coordinator_url = config.coordinator_url.strip().rstrip("/")
    scheme = urlsplit(config.coordinator_url).scheme
    if scheme not in ("http", "https", "ws", "wss") or not urlsplit(config.coordinator_url).netloc:
        raise ConfigError(f"coordinator url {config.coordinator_url!r} must look like http://host:port "
                          "(set --coordinator or [coordinator] url in provider.toml)")
    if config.backend not in BACKENDS:
        raise ConfigError(f"unknown backend {config.backend!r}; use one of: {', '.join(BACKENDS)}")
    if not isinstance(config.max_concurrency, int) or config.max_concurrency < 1:
        raise ConfigError(f"max_concurrency must be at least 1 (got {config.max_concurrency!r})")
    if config.max_concurrency > MAX_CONCURRENCY:
        raise ConfigError(f"max_concurrency must be at most {MAX_CONCURRENCY}, what a coordinator accepts "
                          f"(got {config.max_concurrency})")
    if config.heartbeat_interval_secs <= 0:
        raise ConfigError("heartbeat_interval_secs must be greater than 0")
    if config.context_length < 64:
        raise ConfigError("[backend] context_length must be at least 64")
    if config.context_length > MAX_CONTEXT_LENGTH:
        raise ConfigError(f"[backend] context_length must be at most {MAX_CONTEXT_LENGTH}, what a coordinator "
                          "accepts")
    if config.threads < 0:
        raise ConfigError("[backend] threads must be 0 (automatic) or more")
    if config.max_memory_gb is not None and not 0 < config.max_memory_gb <= MAX_MEMORY_GB:
        raise ConfigError(f"max_memory_gb must be a number of GB greater than 0 and at most {MAX_MEMORY_GB:.0f} "
                          f"(got {config.max_memory_gb!r})")
    if math.isnan(config.keep_alive):
        raise ConfigError("keep_alive must be a number of seconds (0: unload at once, negative: never)")
    if config.max_body_bytes < 1:
        raise ConfigError("[local] max_body_bytes must be at least 1")
    if not 0 <= config.local_port < 65536:  # 0: a port the system chooses (local.json names it)
        raise ConfigError(f"local port {config.local_port} is not a valid TCP port")
    if not config.models:
        raise ConfigError("no models configured; add --model ID[=PATH] or a [[models]] table")
    ids = [model.id for model in config.models]
    for model_id in ids:
        if not model_id:
            raise ConfigError("a model has an empty id; every [[models]] table needs an id")
        if ids.count(model_id) > 1:
            raise ConfigError(f"model id {model_id!r} is configured twice; give each model its own id")
        problem = model_id_problem(model_id)
        if problem is not None:
            remedy = ("with the openai backend the id is the upstream's model name: give the model such a name "
                      "upstream" if config.backend == "openai" else
                      "serve it under another id with --model ID=PATH (or [[models]] id in provider.toml), or "
                      "pull it again with `darkbloom models pull … --as ID`")
            raise ConfigError(f"model id {model_id[:80]!r} cannot be advertised ({problem}); {remedy}")
    if config.backend == "openai":
        upstream = config.upstream_url.strip().rstrip("/")
        if not upstream:
            raise ConfigError("the openai backend needs an upstream server: pass --upstream-url "
                              "http://host:port (or set [backend] upstream_url)")
        if urlsplit(upstream).scheme not in ("http", "https") or not urlsplit(upstream).netloc:
            raise ConfigError(f"upstream url {upstream!r} must look like http://host:port")
        config.upstream_url = upstream
        return
    for model in config.models:
        _check_model_file(model, config.backend)


def _check_model_file(model: ModelSpec, backend: str) -> None:
    if _from_store(model):
        return
    if backend == "mlx":
        if not model.path:
            raise ConfigError(f"{model.id!r} is the bundled GGUF model, which MLX does not read: convert it with "
                              f"`darkbloom models convert {model.id} --to mlx`, then serve --backend mlx --model "
                              f"{model.id}-mlx")
        path = Path(model.path).expanduser()
        if not path.is_dir():
            raise ConfigError(f"model directory for {model.id!r} not found: {path}; the mlx backend serves MLX model "
                              "directories (config.json and safetensors): check the path after '='")
        return
    try:
        path = resolve_model_path(model)
    except BundledModelMissing as exc:
        raise ConfigError(str(exc)) from None
    if not path.is_file():
        raise ConfigError(f"model file for {model.id!r} not found: {path}; check the path after '='")


def _from_store(model: ModelSpec) -> bool:
    return not model.path and model.id != BUNDLED_MODEL_ID


def _resolve_from_store(config: ProviderConfig, store: ModelStore) -> None:
    """llama-cpp, mlx: a model given by id alone (not the bundled one) is served from the model store, if
    its weights are the backend's format."""
    if config.backend not in IN_PROCESS_BACKENDS:
        return
    wanted = "mlx" if config.backend == "mlx" else "gguf"
    missing = []
    for index, model in enumerate(config.models):
        if not _from_store(model):
            continue
        try:
            stored = store.get(model.id)
        except InvalidModelId as exc:
            raise ConfigError(f"model {model.id!r} has no file and cannot come from the model store ({exc}); "
                              "serve a file with --model ID=/path/to/model.gguf, or pull a Hub repo with "
                              "`darkbloom models pull owner/name` and serve the id it prints") from None
        if stored is None:
            missing.append(model.id)
        elif stored.format != wanted:
            other = "mlx" if stored.format == "mlx" else "llama-cpp"
            kind = "an MLX" if stored.format == "mlx" else "a GGUF"
            raise ConfigError(f"model {model.id!r} in the model store is {kind} model, which the "
                              f"{config.backend} backend does not serve: serve it with --backend {other}"
                              + (f", or convert it: darkbloom models convert {model.id} --to mlx" if wanted == "mlx"
                                 else ""))
        else:
            config.models[index] = model._replace(path=str(stored.path))
    if missing:
        raise ModelNotPulled(missing, config, store.root)
