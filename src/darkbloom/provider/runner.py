"""Running the node: foreground (`serve`), background (`start` / `stop`) and `status`."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

from darkbloom import paths
from darkbloom.logs import configure_logging
from darkbloom.provider.backends import Backend, BackendError
from darkbloom.provider.config import ConfigError, ModelNotPulled, ProviderConfig, load_config
from darkbloom.provider.direct.endpoint import LocalEndpointError
from darkbloom.provider.memory_fit import refuse_unfit_models
from darkbloom.provider.state import read_state

log = logging.getLogger(__name__)

LOG_NAME = "node.log"


class StartError(Exception):
    """The background node could not be started; the message says why and what to do."""


def serve_forever(config: ProviderConfig, home: Path, local_only: bool = False, *, backend: Backend | None = None,
                  direct_backend: Backend | None = None) -> None:
    """Run the node in the foreground until SIGINT / SIGTERM; `local_only`: direct mode, no coordinator.
    `backend` (default: the one `config` names) and `direct_backend` go to `ProviderNode`."""
    configure_logging()
    try:
        with asyncio.Runner(loop_factory=_loop_factory()) as runner:
            runner.run(_serve(config, home, local_only, backend, direct_backend))
    except KeyboardInterrupt:
        pass
    except (BackendError, ConfigError, LocalEndpointError, OSError) as exc:
        log.error("the node cannot run: %s", exc)
        raise SystemExit(1) from None


def _loop_factory() -> Callable[[], asyncio.AbstractEventLoop] | None:
    """uvloop's event loop where it is built (not on Windows), as the coordinator's uvicorn runs: a
    relayed request crosses the node's loop several times, and asyncio's own loop cost the node
    about a fifth of its CPU per request (bench/RESULTS.md)."""
    try:
        import uvloop
    except ImportError:
        return None
    return uvloop.new_event_loop


async def _serve(config: ProviderConfig, home: Path, local_only: bool, backend: Backend | None,
                 direct_backend: Backend | None) -> None:
    from darkbloom.provider.node import ProviderNode

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGINT, signal.SIGTERM):
        try:
            loop.add_signal_handler(signum, stop.set)
        except (NotImplementedError, RuntimeError):  # not the main thread, or no signals here
            pass
    await ProviderNode(config, home, backend, local_only=local_only, direct_backend=direct_backend).run(stop)


def start_background(config: ProviderConfig, home: Path, local_only: bool) -> int:
    """Spawn `python -m darkbloom serve …` detached, output to $DARKBLOOM_HOME/node.log; its pid.
    `local_only` (start --local) runs direct mode only and never contacts a coordinator."""
    running = running_pid(home)
    if running is not None:
        raise StartError(f"a Darkbloom node is already running (pid {running}); stop it with `darkbloom stop`")
    refuse_unfit_models(config)  # what `serve` would refuse, said here rather than in node.log
    log_path = home / LOG_NAME
    args = [sys.executable, "-m", "darkbloom", "serve", *_serve_args(config, local_only)]
    with log_path.open("ab") as log_file:
        process = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=log_file, stderr=subprocess.STDOUT,
                                   start_new_session=True, env={**os.environ, "DARKBLOOM_HOME": str(home)})
    paths.pid_path(home).write_text(f"{process.pid}\n")
    try:
        code = process.wait(timeout=1.0)
    except subprocess.TimeoutExpired:
        return process.pid
    paths.pid_path(home).unlink(missing_ok=True)
    raise StartError(f"the node exited at once (exit code {code}); see {log_path}")


def _serve_args(config: ProviderConfig, local_only: bool = False) -> list[str]:
    args = ["--coordinator", config.coordinator_url, "--backend", config.backend,
            *(("--max-concurrency", str(config.max_concurrency)) if config.max_concurrency_chosen else ()),
            "--private-only" if config.private_only else "--public",
            "--port", str(config.local_port), "--bind", config.local_bind]
    if local_only:
        args.append("--local-only")
    elif config.local_endpoint:
        args.append("--local-endpoint")
    for model in config.models:
        args += ["--model", f"{model.id}={Path(model.path).expanduser().resolve()}" if model.path else model.id]
    if config.upstream_url:
        args += ["--upstream-url", config.upstream_url]
    if config.max_memory_gb is not None:
        args += ["--max-memory-gb", repr(config.max_memory_gb)]
    if config.gpu_layers is not None:
        args += ["--gpu-layers", str(config.gpu_layers)]
    return args + ["--keep-alive", repr(config.keep_alive)]


def stop_background(home: Path, timeout: float = 20.0) -> bool:
    """SIGTERM the background node and wait for it; False when none was running."""
    pid_file = paths.pid_path(home)
    pid = _read_pid(pid_file)
    if pid is None or not _is_node(pid):
        pid_file.unlink(missing_ok=True)
        return False
    os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    if _alive(pid):
        log.warning("node %d did not stop within %.0f s; killing it", pid, timeout)
        os.kill(pid, signal.SIGKILL)
    pid_file.unlink(missing_ok=True)
    return True


def running_pid(home: Path) -> int | None:
    """The pid of this home's node: the background one, or a foreground `serve` from its state file."""
    pid = _read_pid(paths.pid_path(home))
    if pid is not None and _is_node(pid):
        return pid
    state_pid = (read_state(home) or {}).get("pid")
    if isinstance(state_pid, int) and state_pid != os.getpid() and _is_node(state_pid):
        return state_pid
    return None


def node_status(home: Path) -> dict[str, object]:
    state = read_state(home) or {}
    try:
        config: ProviderConfig | None = load_config(home, {})
    except ModelNotPulled as missing:
        config = missing.config
    except ConfigError:
        config = None
    running = running_pid(home) is not None
    live = state if running else {}
    if not running:
        connection = "not running"
    elif live.get("local_only"):
        connection = "direct mode only (no coordinator)"
    elif live.get("connected") and live.get("provider_id"):
        connection = "connected"
    elif live.get("connected"):
        connection = "connecting"
    else:
        connection = "disconnected (retrying)"
    if state.get("account_id"):
        account: object = state["account_id"]
    elif paths.auth_token_path(home).exists():
        account = "linked (account shown once the node connects)"
    else:
        account = "not linked (run `darkbloom login --coordinator URL`)"
    models = live.get("models") or (config.model_ids if config else state.get("models") or [])
    return {
        "coordinator": None if live.get("local_only") else
        live.get("coordinator_url") or (config.coordinator_url if config else None),
        "account": account,
        "connection": connection,
        "provider_id": live.get("provider_id"),
        "models": ", ".join(models) if models else None,
        "trust_level": live.get("trust_level"),
        "private_only": live.get("private_only") if running else (config.private_only if config else None),
        "backend": live.get("backend") or (config.backend if config else None),
        "device": live.get("device"),  # known once the node runs: where its engine runs (cpu, metal, cuda, …)
        "direct_mode_url": live.get("local_url"),
    }


def _read_pid(pid_file: Path) -> int | None:
    try:
        return int(pid_file.read_text().strip())
    except (OSError, ValueError):
        return None


def _alive(pid: int) -> bool:
    """Running, and not a zombie (an exited child its parent has not reaped yet) where /proc tells."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return True


def _is_node(pid: int) -> bool:
    """Alive and (where /proc tells) a darkbloom process, so a recycled pid is never signalled."""
    if pid <= 0 or not _alive(pid):
        return False
    try:
        return b"darkbloom" in Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return True
