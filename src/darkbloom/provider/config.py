"""The node's configuration: `$DARKBLOOM_HOME/provider.toml` plus command-line overrides (CONTRACT §2)."""

from __future__ import annotations

import os
import socket
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple
from urllib.parse import urlsplit, urlunsplit

from darkbloom.catalog import BUNDLED_MODEL_ID
from darkbloom.models_bundled import BundledModelMissing, bundled_gguf_path
from darkbloom.paths import provider_config_path
from darkbloom.protocol import PROVIDER_WS_PATH

BACKENDS = ("llama-cpp", "openai")
DEFAULT_COORDINATOR_URL = "http://127.0.0.1:8080"


class ConfigError(Exception):
    """A configuration the node cannot run with; the message says what to change."""


class ModelSpec(NamedTuple):
    id: str
    path: str = ""  # empty: the bundled file (llama-cpp) or the upstream's model name (openai)


@dataclass
class ProviderConfig:
    coordinator_url: str = DEFAULT_COORDINATOR_URL
    private_only: bool = False
    heartbeat_interval_secs: float = 5.0
    backend: str = "llama-cpp"
    upstream_url: str = ""
    max_concurrency: int = 2
    models: list[ModelSpec] = field(default_factory=lambda: [ModelSpec(BUNDLED_MODEL_ID, "")])
    local_endpoint: bool = False
    local_port: int = 8000
    local_bind: str = "127.0.0.1"
    name: str = field(default_factory=socket.gethostname)
    context_length: int = 2048  # llama-cpp n_ctx per instance
    threads: int = 0  # llama-cpp threads per instance; 0 = cores / max_concurrency
    # TEST HOOK (backends/test_hooks.py), from DARKBLOOM_TEST_FIRST_TOKEN_DELAY only; 0 = off
    test_first_token_delay: float = 0.0

    @property
    def model_ids(self) -> list[str]:
        return [model.id for model in self.models]


def load_config(home: Path, overrides: dict[str, object]) -> ProviderConfig:
    """provider.toml (if present), then `overrides` (keys as the CLI passes them), validated."""
    config = ProviderConfig()
    path = provider_config_path(home)
    if path.exists():
        try:
            data = tomllib.loads(path.read_text())
        except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
            raise ConfigError(f"{path} is not valid TOML ({exc}); fix or delete it") from None
        _apply_toml(config, data, path)
    _apply_overrides(config, overrides)
    _validate(config)
    config.test_first_token_delay = _test_first_token_delay()
    return config


def _test_first_token_delay() -> float:
    from darkbloom.provider.backends.test_hooks import FIRST_TOKEN_DELAY_ENV, parse_first_token_delay

    try:
        return parse_first_token_delay(os.environ.get(FIRST_TOKEN_DELAY_ENV))
    except ValueError as exc:
        raise ConfigError(str(exc)) from None


def ws_url(config: ProviderConfig) -> str:
    """ws(s)://host[/prefix]/ws/provider from the coordinator's http(s) base URL."""
    parts = urlsplit(config.coordinator_url.rstrip("/"))
    scheme = {"http": "ws", "https": "wss"}.get(parts.scheme, parts.scheme)
    path = parts.path
    if not path.endswith(PROVIDER_WS_PATH):
        path += PROVIDER_WS_PATH
    return urlunsplit((scheme, parts.netloc, path, "", ""))


def resolve_model_path(spec: ModelSpec) -> Path:
    """The GGUF file for a llama-cpp model: its path, or the bundled file for the bundled id."""
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
        'kind = "llama-cpp"        # or "openai" (any OpenAI-compatible server)\n'
        'upstream_url = ""         # for kind = "openai"\n'
        "max_concurrency = 2\n\n"
        "[[models]]\n"
        f'id = "{BUNDLED_MODEL_ID}"\n'
        'path = ""                 # empty: the bundled file; else any GGUF path\n\n'
        "[local]\n"
        "port = 8000\n"
        'bind = "127.0.0.1"\n'
    )


def _toml_string(text: str) -> str:
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


def _apply_toml(config: ProviderConfig, data: dict[str, Any], path: Path) -> None:
    coordinator = _table(data, "coordinator", path)
    backend = _table(data, "backend", path)
    local = _table(data, "local", path)
    node = _table(data, "node", path)
    where = f"{path}"
    config.coordinator_url = _get(coordinator, "url", str, config.coordinator_url, where)
    config.private_only = _get(coordinator, "private_only", bool, config.private_only, where)
    config.heartbeat_interval_secs = float(_get(coordinator, "heartbeat_interval_secs", (int, float),
                                                config.heartbeat_interval_secs, where))
    config.backend = _get(backend, "kind", str, config.backend, where)
    config.upstream_url = _get(backend, "upstream_url", str, config.upstream_url, where)
    config.max_concurrency = _get(backend, "max_concurrency", int, config.max_concurrency, where)
    config.context_length = _get(backend, "context_length", int, config.context_length, where)
    config.threads = _get(backend, "threads", int, config.threads, where)
    config.local_port = _get(local, "port", int, config.local_port, where)
    config.local_bind = _get(local, "bind", str, config.local_bind, where)
    config.local_endpoint = _get(local, "enabled", bool, config.local_endpoint, where)
    config.name = _get(node, "name", str, config.name, where)
    if "models" in data:
        models = data["models"]
        if not isinstance(models, list) or not all(isinstance(m, dict) for m in models):
            raise ConfigError(f"{path}: models must be [[models]] tables with id and path")
        config.models = [ModelSpec(_get(m, "id", str, "", where).strip(), _get(m, "path", str, "", where).strip())
                         for m in models]


def _table(data: dict[str, Any], name: str, path: Path) -> dict[str, Any]:
    value = data.get(name, {})
    if not isinstance(value, dict):
        raise ConfigError(f"{path}: [{name}] must be a table")
    return value


def _get(table: dict[str, Any], key: str, kind: type | tuple[type, ...], default: Any, where: str) -> Any:
    if key not in table:
        return default
    value = table[key]
    # bool is an int in Python; do not let `max_concurrency = true` through.
    if not isinstance(value, kind) or (isinstance(value, bool) and kind is not bool):
        names = kind.__name__ if isinstance(kind, type) else " or ".join(k.__name__ for k in kind)
        raise ConfigError(f"{where}: {key} must be of type {names}, not {value!r}")
    return value


_OVERRIDE_FIELDS = {"coordinator_url", "backend", "upstream_url", "private_only", "max_concurrency",
                    "local_endpoint", "local_port", "local_bind"}


def _apply_overrides(config: ProviderConfig, overrides: dict[str, object]) -> None:
    for key, value in overrides.items():
        if value is None:
            continue
        if key == "models":
            if isinstance(value, str) or not isinstance(value, (list, tuple)):
                raise ConfigError("models override must be a list of 'ID' or 'ID=PATH' strings")
            if value:
                config.models = [parse_model_arg(str(item)) for item in value]
        elif key in _OVERRIDE_FIELDS:
            setattr(config, key, value)
        else:
            raise ConfigError(f"unknown setting {key!r}")


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
    if config.heartbeat_interval_secs <= 0:
        raise ConfigError("heartbeat_interval_secs must be greater than 0")
    if config.context_length < 64:
        raise ConfigError("[backend] context_length must be at least 64")
    if config.threads < 0:
        raise ConfigError("[backend] threads must be 0 (automatic) or more")
    if not 0 < config.local_port < 65536:
        raise ConfigError(f"local port {config.local_port} is not a valid TCP port")
    if not config.models:
        raise ConfigError("no models configured; add --model ID[=PATH] or a [[models]] table")
    ids = [model.id for model in config.models]
    for model_id in ids:
        if not model_id:
            raise ConfigError("a model has an empty id; every [[models]] table needs an id")
        if ids.count(model_id) > 1:
            raise ConfigError(f"model id {model_id!r} is configured twice; give each model its own id")
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
        _check_model_file(model)


def _check_model_file(model: ModelSpec) -> None:
    if not model.path and model.id != BUNDLED_MODEL_ID:
        raise ConfigError(f"model {model.id!r} has no file; use --model {model.id}=/path/to/model.gguf "
                          f"(only {BUNDLED_MODEL_ID!r} is bundled)")
    try:
        path = resolve_model_path(model)
    except BundledModelMissing as exc:
        raise ConfigError(str(exc)) from None
    if not path.is_file():
        raise ConfigError(f"model file for {model.id!r} not found: {path}; check the path after '='")
