"""`darkbloom` command line (docs/cli.md "Commands"). Each command is a thin call into the packages."""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, NoReturn, Optional

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from darkbloom.coordinator.config import CoordinatorSettings, env_var, flag_name
from darkbloom.paths import darkbloom_home

if TYPE_CHECKING:
    from darkbloom.provider.config import ProviderConfig

app = typer.Typer(add_completion=False, no_args_is_help=True,
                  help="Darkbloom: private inference on machines people own.")
models_app = typer.Typer(no_args_is_help=True, help="Models this node can serve.")
app.add_typer(models_app, name="models")
console = Console()
err_console = Console(stderr=True)


def _setting(field: str, **option: Any) -> Any:
    """An option of `darkbloom coordinator` as the settings model describes it: flag, help, default, env var."""
    info = CoordinatorSettings.model_fields[field]
    default = None if info.default_factory is not None else info.default
    if isinstance(default, float) and default.is_integer():
        default = int(default)  # shown as "120", not "120.0"; only options given on the command line are used
    return typer.Option(default, flag_name(field), help=f"{info.description} \\[env var: {env_var(field)}]",
                        **option)


def _typed_options(ctx: typer.Context) -> dict[str, Any]:
    """The options typed on the command line; the settings read DARKBLOOM_* or their defaults for the rest.

    Compared by name: typer may ship its own copy of click, with its own ParameterSource."""
    return {name: value for name, value in ctx.params.items()
            if getattr(ctx.get_parameter_source(name), "name", None) == "COMMANDLINE"}


def _fail(message: object, code: int) -> NoReturn:
    """An error line on stderr (the message as one line, however wide the terminal), then exit `code`."""
    err_console.print(f"[red]error:[/red] {escape(str(message))}", highlight=False, soft_wrap=True)
    raise typer.Exit(code)


@app.command()
def coordinator(
    ctx: typer.Context,
    host: str = _setting("host"),
    port: int = _setting("port"),
    public_url: Optional[str] = _setting("public_url"),
    database_url: Optional[str] = _setting("database_url"),
    redis_url: Optional[str] = _setting("redis_url"),
    nats_url: Optional[str] = _setting("nats_url"),
    nats_creds: Optional[Path] = _setting("nats_creds", metavar="FILE"),
    nats_nkey: Optional[Path] = _setting("nats_nkey", metavar="FILE"),
    nats_tls_ca: Optional[Path] = _setting("nats_tls_ca", metavar="FILE"),
    nats_tls_cert: Optional[Path] = _setting("nats_tls_cert", metavar="FILE"),
    nats_tls_key: Optional[Path] = _setting("nats_tls_key", metavar="FILE"),
    nats_subject_prefix: str = _setting("nats_subject_prefix"),
    replica_heartbeat: float = _setting("replica_heartbeat"),
    replica_timeout: float = _setting("replica_timeout"),
    cors_origins: Optional[str] = _setting("cors_origins"),
    admin_token: Optional[str] = _setting("admin_token"),
    min_trust: str = _setting("min_trust"),
    platform_fee_bps: int = _setting("platform_fee_bps"),
    queue_max_wait: float = _setting("queue_max_wait"),
    queue_depth: int = _setting("queue_depth"),
    catalog: Optional[Path] = _setting("catalog", exists=True, dir_okay=False),
    smtp_url: Optional[str] = _setting("smtp_url"),
    mail_from: str = _setting("mail_from"),
    heartbeat_timeout: float = _setting("heartbeat_timeout"),
    first_content_timeout: float = _setting("first_content_timeout"),
    idle_timeout: float = _setting("idle_timeout"),
    request_timeout: float = _setting("request_timeout"),
    device_code_ttl: int = _setting("device_code_ttl"),
    cancel_grace: float = _setting("cancel_grace"),
    instance_stale_after: float = _setting("instance_stale_after"),
    min_charge_micro_usd: int = _setting("min_charge_micro_usd"),
    account_rpm: Optional[int] = _setting("account_rpm"),
    account_itpm: Optional[int] = _setting("account_itpm"),
    account_otpm: Optional[int] = _setting("account_otpm"),
    batch_discount: float = _setting("batch_discount"),
    batch_free_slots: int = _setting("batch_free_slots"),
    runtime_allow: Optional[list[str]] = _setting("runtime_allow"),
    challenge_interval: float = _setting("challenge_interval"),
    challenge_deadline: float = _setting("challenge_deadline"),
    challenge_freshness: float = _setting("challenge_freshness"),
) -> None:
    """Run the coordinator."""
    from darkbloom.coordinator.server import run

    try:
        settings = CoordinatorSettings(**_typed_options(ctx))
    except ValueError as exc:
        err_console.print(f"[red]error:[/red] {escape(str(exc))}", soft_wrap=True)
        raise typer.Exit(2) from None
    run(settings)


@app.command()
def login(
    coordinator: Annotated[str, typer.Option("--coordinator", envvar="DARKBLOOM_COORDINATOR",
                                             help="Coordinator base URL.")],
    no_browser: Annotated[bool, typer.Option("--no-browser", help="Do not open a browser.")] = False,
) -> None:
    """Link this machine to your account (device-code login)."""
    from darkbloom.provider.login import LoginError, device_login

    try:
        result = device_login(coordinator, darkbloom_home(), open_browser=not no_browser,
                              api_key=os.environ.get("DARKBLOOM_API_KEY"), out=console)
    except LoginError as exc:
        err_console.print(f"[red]login failed:[/red] {exc}")
        raise typer.Exit(1) from None
    console.print(f"Linked to account {result.account_id}. Token saved to {result.token_path}.")


def _node_overrides(coordinator: str | None, model: list[str] | None, backend: str | None,
                    upstream_url: str | None, private_only: bool | None, max_concurrency: int | None,
                    local_endpoint: bool | None, port: int | None, bind: str | None,
                    max_memory_gb: float | None = None, keep_alive: float | None = None,
                    gpu_layers: str | None = None) -> dict[str, object]:
    overrides = {"coordinator_url": coordinator, "models": model or None, "backend": backend,
                 "upstream_url": upstream_url, "private_only": private_only,
                 "max_concurrency": max_concurrency, "local_endpoint": local_endpoint,
                 "local_port": port, "local_bind": bind, "max_memory_gb": max_memory_gb, "keep_alive": keep_alive,
                 "gpu_layers": gpu_layers}
    return {key: value for key, value in overrides.items() if value is not None}


CoordinatorOpt = Annotated[Optional[str], typer.Option("--coordinator", help="Coordinator base URL.")]
ModelOpt = Annotated[Optional[list[str]], typer.Option("--model", help="ID or ID=PATH; may repeat.")]
BackendOpt = Annotated[Optional[str], typer.Option("--backend", help="llama-cpp (GGUF), mlx (MLX models) or openai (an OpenAI-compatible server).")]
UpstreamOpt = Annotated[Optional[str], typer.Option("--upstream-url", help="OpenAI-compatible upstream.")]
PrivateOpt = Annotated[Optional[bool], typer.Option("--private-only/--public",
                                                    help="Serve only your own self-route requests.")]
ConcurrencyOpt = Annotated[Optional[int], typer.Option("--max-concurrency", min=1)]
LocalEndpointOpt = Annotated[Optional[bool], typer.Option(
    "--local-endpoint", help="Also serve direct mode (an OpenAI-compatible endpoint on this machine).")]
PortOpt = Annotated[Optional[int], typer.Option("--port", help="Direct-mode port (default 8000).")]
BindOpt = Annotated[Optional[str], typer.Option("--bind", help="Direct-mode bind address (default 127.0.0.1).")]
PullOpt = Annotated[bool, typer.Option("--pull", help="Pull catalog models missing from the model store first.")]
MaxMemoryOpt = Annotated[Optional[float], typer.Option(
    "--max-memory-gb", help="Memory models may use, GB (default: this machine's RAM or cgroup limit).")]
KeepAliveOpt = Annotated[Optional[float], typer.Option(
    "--keep-alive", help="Seconds an idle model stays loaded (default 300; 0: unload at once; <0: never).")]
GpuLayersOpt = Annotated[Optional[str], typer.Option(
    "--gpu-layers", metavar="N|all",
    help="Model layers llama.cpp puts on the GPU (default: all when the build can offload; 0: CPU only; -1 or all).")]


def _node_config(home: Path, overrides: dict[str, object], pull: bool) -> ProviderConfig:
    """The node's config; with `pull`, the catalog models it names that the store lacks are pulled
    first (progress on stderr). Raises ConfigError (ModelNotPulled without `pull`) or PullError."""
    from darkbloom.provider.config import ModelNotPulled, load_config
    from darkbloom.provider.model_store import ModelStore
    from darkbloom.provider.pull import pull_missing

    try:
        return load_config(home, overrides)
    except ModelNotPulled as missing:
        if not pull:
            raise
        pull_missing(missing.model_ids, missing.config.coordinator_url, ModelStore(home))
        return load_config(home, overrides)


@app.command()
def serve(coordinator: CoordinatorOpt = None, model: ModelOpt = None, backend: BackendOpt = None,
          upstream_url: UpstreamOpt = None, private_only: PrivateOpt = None,
          max_concurrency: ConcurrencyOpt = None, local_endpoint: LocalEndpointOpt = None,
          port: PortOpt = None, bind: BindOpt = None, max_memory_gb: MaxMemoryOpt = None,
          keep_alive: KeepAliveOpt = None, gpu_layers: GpuLayersOpt = None, pull: PullOpt = False,
          local_only: Annotated[bool, typer.Option("--local-only", hidden=True,
                                                   help="Direct mode only (what `start --local` runs).")] = False,
          ) -> None:
    """Run a provider node in the foreground."""
    from darkbloom.provider.config import ConfigError, ModelNotPulled
    from darkbloom.provider.hub_transfer import PullError
    from darkbloom.provider.runner import serve_forever

    home = darkbloom_home()
    try:
        config = _node_config(home, _node_overrides(coordinator, model, backend, upstream_url, private_only,
                                                    max_concurrency, local_endpoint, port, bind, max_memory_gb,
                                                    keep_alive, gpu_layers), pull)
    except ModelNotPulled as exc:
        _fail(exc, 1)
    except PullError as exc:
        _fail(exc, exc.exit_code)
    except ConfigError as exc:
        _fail(exc, 2)
    serve_forever(config, home, local_only=local_only)


@app.command()
def start(local: Annotated[bool, typer.Option("--local", help="Direct mode only; no coordinator.")] = False,
          coordinator: CoordinatorOpt = None, model: ModelOpt = None, backend: BackendOpt = None,
          upstream_url: UpstreamOpt = None, private_only: PrivateOpt = None,
          max_concurrency: ConcurrencyOpt = None, local_endpoint: LocalEndpointOpt = None,
          port: PortOpt = None, bind: BindOpt = None, max_memory_gb: MaxMemoryOpt = None,
          keep_alive: KeepAliveOpt = None, gpu_layers: GpuLayersOpt = None, pull: PullOpt = False) -> None:
    """Run the node as a background process."""
    from darkbloom.provider.config import ConfigError, ModelNotPulled
    from darkbloom.provider.hub_transfer import PullError
    from darkbloom.provider.runner import StartError, start_background

    if local and local_endpoint:
        err_console.print("[red]error:[/red] --local and --local-endpoint cannot be used together")
        raise typer.Exit(1)
    home = darkbloom_home()
    overrides = _node_overrides(coordinator, model, backend, upstream_url, private_only, max_concurrency,
                                local_endpoint, port, bind, max_memory_gb, keep_alive, gpu_layers)
    try:
        config = _node_config(home, overrides, pull)
        pid = start_background(config, home, local_only=local)
    except ModelNotPulled as exc:
        _fail(exc, 1)
    except PullError as exc:
        _fail(exc, exc.exit_code)
    except (ConfigError, StartError) as exc:
        _fail(exc, 1)
    console.print(f"Darkbloom node started (pid {pid}).")
    if local:
        host = {"0.0.0.0": "127.0.0.1", "": "127.0.0.1", "::": "::1"}.get(config.local_bind, config.local_bind)
        host = f"[{host}]" if ":" in host else host
        port = config.local_port or "PORT"  # 0: the system chooses; local.json and `darkbloom status` name it
        console.print(f"Direct mode: http://{host}:{port}/v1 — token in {home / 'local_token'}; "
                      "`darkbloom status` shows it once it is up.", soft_wrap=True)


@app.command()
def stop() -> None:
    """Stop the background node."""
    from darkbloom.provider.runner import stop_background

    if stop_background(darkbloom_home()):
        console.print("Darkbloom node stopped.")
    else:
        console.print("No Darkbloom node is running.")


@app.command()
def status() -> None:
    """Show this node's state."""
    from darkbloom.provider.runner import node_status

    table = Table(show_header=False)
    for key, value in node_status(darkbloom_home()).items():
        table.add_row(key, "—" if value is None else str(value))
    console.print(table)


@app.command()
def chat(
    prompt: Annotated[str, typer.Argument(help="What to ask.")],
    local_first: Annotated[bool, typer.Option(
        "--local-first", help="Use this machine's direct-mode endpoint (local.json) when reachable, else the "
                              "coordinator with X-Darkbloom-Route: self.")] = False,
    model: Annotated[Optional[str], typer.Option(
        "--model", help="Model id (default: the first model in provider.toml, else smollm2-135m).")] = None,
    coordinator: Annotated[Optional[str], typer.Option(
        "--coordinator", envvar="DARKBLOOM_COORDINATOR",
        help="Coordinator base URL (default: DARKBLOOM_COORDINATOR, then provider.toml).")] = None,
    api_key: Annotated[Optional[str], typer.Option(
        "--api-key", envvar="DARKBLOOM_API_KEY", help="Coordinator API key (default: DARKBLOOM_API_KEY).")] = None,
    max_tokens: Annotated[Optional[int], typer.Option("--max-tokens", min=1, help="Longest answer, in tokens.")] = None,
) -> None:
    """One-shot chat, streamed to stdout."""
    import sys

    from darkbloom.client.chat import ChatError, ChatSettings, default_model, provider_toml_defaults, run_chat

    home = darkbloom_home(create=False)
    settings = ChatSettings(prompt=prompt, model=model or default_model(home),
                            coordinator_url=coordinator or provider_toml_defaults(home)[0], api_key=api_key,
                            local_first=local_first, home=home, max_tokens=max_tokens)
    try:
        run_chat(settings, sys.stdout, sys.stderr)
    except ChatError as exc:
        err_console.print(f"[red]error:[/red] {exc}", highlight=False, soft_wrap=True)
        raise typer.Exit(1) from None


@models_app.command("list")
def models_list(model: ModelOpt = None, backend: BackendOpt = None, upstream_url: UpstreamOpt = None,
                as_json: Annotated[bool, typer.Option("--json", help="One JSON list on stdout.")] = False) -> None:
    """List the models this node can serve: bundled, pulled and configured."""
    import json

    from darkbloom.client.chat import provider_toml_defaults
    from darkbloom.provider.config import ConfigError, ModelNotPulled, load_config
    from darkbloom.provider.model_store import ModelStore
    from darkbloom.provider.hub_transfer import PullError
    from darkbloom.provider.pull import fetch_catalog
    from darkbloom.provider.servable import servable_models

    home = darkbloom_home()
    overrides = _node_overrides(None, model, backend, upstream_url, None, None, None, None, None)
    try:
        config = load_config(home, overrides)
    except ModelNotPulled as missing:
        config = missing.config
    except ConfigError as exc:
        _fail(exc, 1)
    coordinator_url = os.environ.get("DARKBLOOM_COORDINATOR") or provider_toml_defaults(home)[0]
    try:
        catalog = fetch_catalog(coordinator_url, timeout=3.0) if coordinator_url else None
    except PullError:
        catalog = None
    models = servable_models(config, ModelStore(home), catalog)
    if as_json:
        print(json.dumps([m.as_json() for m in models], indent=2))
        return
    table = Table("id", "source", "file", "size", "weight hash", "in catalog")
    for m in models:
        file = str(m.file) if m.file else ("upstream" if m.source == "upstream" else
                                           f"not pulled: darkbloom models pull {m.id}")
        table.add_row(m.id + (" *" if m.configured else ""), m.source, file,
                      f"{m.size_bytes / 1e6:.1f} MB" if m.size_bytes else "—", m.weight_hash or "—",
                      {True: "yes", False: "no", None: "unknown"}[m.in_catalog])
    console.print(table)
    console.print("* served by `darkbloom serve` without --model", style="dim")


@models_app.command("pull")
def models_pull(
    name: Annotated[str, typer.Argument(
        metavar="NAME", help="A catalog id of the coordinator, or a Hub repo owner/name[:file.gguf].")],
    coordinator: Annotated[Optional[str], typer.Option(
        "--coordinator", envvar="DARKBLOOM_COORDINATOR",
        help="Coordinator whose catalog names the model (default: DARKBLOOM_COORDINATOR, then provider.toml).")] = None,
    file: Annotated[Optional[str], typer.Option(
        "--file", help="The GGUF file of a Hub repo with several (none: its one GGUF file, else its MLX model).")] = None,
    revision: Annotated[Optional[str], typer.Option(
        "--revision", help="Hub branch, tag or commit (default main).")] = None,
    as_id: Annotated[Optional[str], typer.Option(
        "--as", help="The model id to store a Hub model under (default: the GGUF file's name, or the MLX repo's "
                     "name, lower-cased).")] = None,
) -> None:
    """Download a model into the model store; prints `ID PATH`."""
    from darkbloom.client.chat import provider_toml_defaults
    from darkbloom.provider.model_store import ModelStore
    from darkbloom.provider.hub_transfer import PullError
    from darkbloom.provider.pull import pull_model

    home = darkbloom_home()
    try:
        stored = pull_model(name, ModelStore(home), coordinator_url=coordinator or provider_toml_defaults(home)[0],
                            file=file, revision=revision, as_id=as_id)
    except PullError as exc:
        _fail(exc, exc.exit_code)
    print(f"{stored.id} {stored.path}")


@models_app.command("convert")
def models_convert(
    model_id: Annotated[str, typer.Argument(
        metavar="ID", help="A GGUF model of the model store, or smollm2-135m (the bundled model).")],
    to: Annotated[str, typer.Option("--to", metavar="FORMAT", help="The format to convert to: mlx.")],
    as_id: Annotated[Optional[str], typer.Option(
        "--as", help="The model id to store the conversion under (default: ID-mlx).")] = None,
    dtype: Annotated[str, typer.Option(
        "--dtype", metavar="float32|float16|bfloat16", help="The weights' type.")] = "bfloat16",
) -> None:
    """Convert a GGUF model into an MLX model directory in the model store; prints `NEWID PATH`."""
    from darkbloom.provider.convert import FORMATS, ConvertError, convert_into_store
    from darkbloom.provider.model_store import ModelStore

    if to not in FORMATS:
        _fail(f"--to must be {' or '.join(FORMATS)} (the only format a GGUF model converts to); got {to!r}", 2)
    try:
        stored = convert_into_store(model_id, ModelStore(darkbloom_home()), as_id=as_id, dtype=dtype)
    except ConvertError as exc:
        _fail(exc, exc.exit_code)
    print(f"{stored.id} {stored.path}")


@models_app.command("rm")
def models_rm(model_id: Annotated[str, typer.Argument(metavar="ID", help="A pulled model's id.")]) -> None:
    """Remove a pulled model from the model store."""
    from darkbloom.provider.model_store import InvalidModelId, ModelStore, NotInStore
    from darkbloom.wire.catalog import BUNDLED_MODEL_ID

    store = ModelStore(darkbloom_home())
    if model_id == BUNDLED_MODEL_ID:
        _fail(f"{model_id!r} is the bundled model, part of the installed package; only pulled models can be removed",
              1)
    try:
        stored = store.remove(model_id)
    except (InvalidModelId, NotInStore):
        _fail(f"model {model_id!r} is not in the model store {store.root}; `darkbloom models list` shows what is", 1)
    console.print(f"removed {stored.id} ({stored.path.parent})", highlight=False, soft_wrap=True)


@app.command()
def demo(port: Annotated[int, typer.Option(help="Coordinator port.")] = 8080) -> None:
    """Coordinator on SQLite + a linked node on the bundled model, in one process."""
    from darkbloom.demo import run_demo

    run_demo(darkbloom_home() / "demo", port, out=console)


if __name__ == "__main__":
    app()
