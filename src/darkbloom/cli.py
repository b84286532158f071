"""`darkbloom` command line (CONTRACT §1). Each command is a thin call into the packages."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.console import Console
from rich.table import Table

from darkbloom.paths import darkbloom_home

app = typer.Typer(add_completion=False, no_args_is_help=True,
                  help="Darkbloom: private inference on machines people own.")
models_app = typer.Typer(no_args_is_help=True, help="Models this node can serve.")
app.add_typer(models_app, name="models")
console = Console()
err_console = Console(stderr=True)


def _env(flag: str) -> str:
    return "DARKBLOOM_" + flag.upper().replace("-", "_")


@app.command()
def coordinator(
    host: Annotated[str, typer.Option(envvar=_env("host"), help="Address to bind.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(envvar=_env("port"), help="Port to bind.")] = 8080,
    database_url: Annotated[Optional[str], typer.Option(
        envvar=_env("database_url"),
        help="SQLAlchemy URL; default sqlite+aiosqlite:///$DARKBLOOM_HOME/coordinator.db; "
             "postgresql+asyncpg://… selects Postgres.")] = None,
    redis_url: Annotated[Optional[str], typer.Option(
        envvar=_env("redis_url"), help="Redis for rate limits shared across replicas (default: in memory).")] = None,
    admin_token: Annotated[Optional[str], typer.Option(
        envvar=_env("admin_token"), help="Bearer token for /v1/admin/*; admin API disabled when unset.")] = None,
    min_trust: Annotated[str, typer.Option(
        envvar=_env("min_trust"),
        help="Trust floor for public routing: none|self_signed|hardware (relaxed only for your own machines).")] = "hardware",
    platform_fee_bps: Annotated[int, typer.Option(
        envvar=_env("platform_fee_bps"), help="Platform fee in basis points of each paid request's cost.")] = 500,
    queue_max_wait: Annotated[float, typer.Option(
        envvar=_env("queue_max_wait"), help="Seconds a request may wait in a busy model's queue.")] = 120,
    queue_depth: Annotated[int, typer.Option(
        envvar=_env("queue_depth"), help="Waiting requests per model queue.")] = 32,
    catalog: Annotated[Optional[Path], typer.Option(
        envvar=_env("catalog"), help="Model catalog file (JSON or TOML).", exists=True, dir_okay=False)] = None,
    heartbeat_timeout: Annotated[float, typer.Option(
        envvar=_env("heartbeat_timeout"), help="Evict a provider silent this many seconds.")] = 30,
    first_content_timeout: Annotated[float, typer.Option(
        envvar=_env("first_content_timeout"), help="Seconds a provider may take to its first content.")] = 30,
    device_code_ttl: Annotated[int, typer.Option(
        envvar=_env("device_code_ttl"), help="Lifetime of a device login code in seconds.")] = 900,
    cancel_grace: Annotated[float, typer.Option(
        envvar=_env("cancel_grace"), help="Seconds to wait for a cancelled provider's usage report.")] = 5,
    instance_stale_after: Annotated[float, typer.Option(
        envvar=_env("instance_stale_after"),
        help="A coordinator instance silent this long is dead; its open reservations are refunded.")] = 30,
    min_charge: Annotated[int, typer.Option(
        envvar=_env("min_charge"), help="Minimum charge of a paid request, µUSD.")] = 100,
    account_rpm: Annotated[Optional[int], typer.Option(
        envvar=_env("account_rpm"), help="Default requests per minute per account (unset: no limit).")] = None,
    account_itpm: Annotated[Optional[int], typer.Option(
        envvar=_env("account_itpm"), help="Default input tokens per minute per account.")] = None,
    account_otpm: Annotated[Optional[int], typer.Option(
        envvar=_env("account_otpm"), help="Default output tokens per minute per account.")] = None,
    runtime_allow: Annotated[Optional[list[str]], typer.Option(
        "--runtime-allow", envvar=_env("runtime_allow"),
        help="A provider runtime hash to accept as verified, besides this release's own; may repeat.")] = None,
    challenge_interval: Annotated[float, typer.Option(
        envvar=_env("challenge_interval"), help="Seconds between attestation challenges to each provider.")] = 300,
    challenge_deadline: Annotated[float, typer.Option(
        envvar=_env("challenge_deadline"),
        help="Seconds a provider has to answer a challenge before it is untrusted.")] = 30,
    challenge_freshness: Annotated[float, typer.Option(
        envvar=_env("challenge_freshness"),
        help="A provider is routable while its last passed challenge is at most this many seconds old.")] = 960,
) -> None:
    """Run the coordinator."""
    from darkbloom.coordinator.config import CoordinatorSettings, default_database_url
    from darkbloom.coordinator.server import run
    from darkbloom.runtime import runtime_hash

    try:
        settings = CoordinatorSettings(
            host=host, port=port, database_url=database_url or default_database_url(), redis_url=redis_url,
            admin_token=admin_token, min_trust=min_trust, platform_fee_bps=platform_fee_bps,
            queue_max_wait=queue_max_wait, queue_depth=queue_depth,
            catalog=CoordinatorSettings.load_catalog(catalog), heartbeat_timeout=heartbeat_timeout,
            first_content_timeout=first_content_timeout, device_code_ttl=device_code_ttl,
            catalog_from_file=catalog is not None, cancel_grace=cancel_grace,
            instance_stale_after=instance_stale_after, min_charge_micro_usd=min_charge,
            account_rpm=account_rpm, account_itpm=account_itpm, account_otpm=account_otpm,
            runtime_allow_list=frozenset({runtime_hash(), *(runtime_allow or [])}),
            challenge_interval=challenge_interval, challenge_deadline=challenge_deadline,
            challenge_freshness=challenge_freshness)
    except ValueError as exc:
        err_console.print(f"[red]error:[/red] {exc}")
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
                    local_endpoint: bool | None, port: int | None, bind: str | None) -> dict[str, object]:
    overrides = {"coordinator_url": coordinator, "models": model or None, "backend": backend,
                 "upstream_url": upstream_url, "private_only": private_only,
                 "max_concurrency": max_concurrency, "local_endpoint": local_endpoint,
                 "local_port": port, "local_bind": bind}
    return {key: value for key, value in overrides.items() if value is not None}


CoordinatorOpt = Annotated[Optional[str], typer.Option("--coordinator", help="Coordinator base URL.")]
ModelOpt = Annotated[Optional[list[str]], typer.Option("--model", help="ID or ID=PATH; may repeat.")]
BackendOpt = Annotated[Optional[str], typer.Option("--backend", help="llama-cpp or openai.")]
UpstreamOpt = Annotated[Optional[str], typer.Option("--upstream-url", help="OpenAI-compatible upstream.")]
PrivateOpt = Annotated[Optional[bool], typer.Option("--private-only/--public",
                                                    help="Serve only your own self-route requests.")]
ConcurrencyOpt = Annotated[Optional[int], typer.Option("--max-concurrency", min=1)]
LocalEndpointOpt = Annotated[Optional[bool], typer.Option(
    "--local-endpoint", help="Also serve direct mode (an OpenAI-compatible endpoint on this machine).")]
PortOpt = Annotated[Optional[int], typer.Option("--port", help="Direct-mode port (default 8000).")]
BindOpt = Annotated[Optional[str], typer.Option("--bind", help="Direct-mode bind address (default 127.0.0.1).")]


@app.command()
def serve(coordinator: CoordinatorOpt = None, model: ModelOpt = None, backend: BackendOpt = None,
          upstream_url: UpstreamOpt = None, private_only: PrivateOpt = None,
          max_concurrency: ConcurrencyOpt = None, local_endpoint: LocalEndpointOpt = None,
          port: PortOpt = None, bind: BindOpt = None,
          local_only: Annotated[bool, typer.Option("--local-only", hidden=True,
                                                   help="Direct mode only (what `start --local` runs).")] = False,
          ) -> None:
    """Run a provider node in the foreground."""
    from darkbloom.provider.config import ConfigError, load_config
    from darkbloom.provider.runner import serve_forever

    home = darkbloom_home()
    try:
        config = load_config(home, _node_overrides(coordinator, model, backend, upstream_url, private_only,
                                                    max_concurrency, local_endpoint, port, bind))
    except ConfigError as exc:
        err_console.print(f"[red]error:[/red] {exc}")
        raise typer.Exit(2) from None
    serve_forever(config, home, local_only=local_only)


@app.command()
def start(local: Annotated[bool, typer.Option("--local", help="Direct mode only; no coordinator.")] = False,
          coordinator: CoordinatorOpt = None, model: ModelOpt = None, backend: BackendOpt = None,
          upstream_url: UpstreamOpt = None, private_only: PrivateOpt = None,
          max_concurrency: ConcurrencyOpt = None, local_endpoint: LocalEndpointOpt = None,
          port: PortOpt = None, bind: BindOpt = None) -> None:
    """Run the node as a background process."""
    from darkbloom.provider.config import ConfigError, load_config
    from darkbloom.provider.runner import StartError, start_background

    if local and local_endpoint:
        err_console.print("[red]error:[/red] --local and --local-endpoint cannot be used together")
        raise typer.Exit(1)
    home = darkbloom_home()
    overrides = _node_overrides(coordinator, model, backend, upstream_url, private_only, max_concurrency,
                                local_endpoint, port, bind)
    try:
        config = load_config(home, overrides)
        pid = start_background(config, home, local_only=local)
    except (ConfigError, StartError) as exc:
        err_console.print(f"[red]error:[/red] {exc}")
        raise typer.Exit(1) from None
    console.print(f"Darkbloom node started (pid {pid}).")
    if local:
        host = {"0.0.0.0": "127.0.0.1", "": "127.0.0.1", "::": "::1"}.get(config.local_bind, config.local_bind)
        host = f"[{host}]" if ":" in host else host
        console.print(f"Direct mode: http://{host}:{config.local_port}/v1 — token in {home / 'local_token'}; "
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
    from darkbloom.client.endpoints import darkbloom_home_path

    home = darkbloom_home_path()
    settings = ChatSettings(prompt=prompt, model=model or default_model(home),
                            coordinator_url=coordinator or provider_toml_defaults(home)[0], api_key=api_key,
                            local_first=local_first, home=home, max_tokens=max_tokens)
    try:
        run_chat(settings, sys.stdout, sys.stderr)
    except ChatError as exc:
        err_console.print(f"[red]error:[/red] {exc}", highlight=False, soft_wrap=True)
        raise typer.Exit(1) from None


@models_app.command("list")
def models_list(model: ModelOpt = None, backend: BackendOpt = None, upstream_url: UpstreamOpt = None) -> None:
    """List the models this node can serve."""
    from darkbloom.provider.config import ConfigError, load_config
    from darkbloom.provider.models import describe_models

    try:
        config = load_config(darkbloom_home(), _node_overrides(None, model, backend, upstream_url,
                                                               None, None, None, None, None))
        models = describe_models(config)
    except (ConfigError, OSError) as exc:
        err_console.print(f"[red]error:[/red] {exc}")
        raise typer.Exit(1) from None
    table = Table("id", "file", "size", "weight hash")
    for info, path in models:
        table.add_row(info.id, str(path or "—"), f"{info.size_bytes / 1e6:.1f} MB" if info.size_bytes else "—",
                      info.weight_hash or "—")
    console.print(table)


@app.command()
def demo(port: Annotated[int, typer.Option(help="Coordinator port.")] = 8080) -> None:
    """Coordinator on SQLite + a linked node on the bundled model, in one process."""
    from darkbloom.demo import run_demo

    run_demo(darkbloom_home() / "demo", port, out=console)


if __name__ == "__main__":
    app()
