"""`openai` SDK clients that go direct first: `direct_first_openai()` / `async_direct_first_openai()`.

The coordinator defaults to `DARKBLOOM_COORDINATOR` and the key to `DARKBLOOM_API_KEY`; the local
endpoint to `$DARKBLOOM_HOME/local.json` unless `local_url` and `local_token` name one. The httpx
client ignores HTTP(S)_PROXY (`trust_env=False`): a proxy would bypass the transport.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx

from darkbloom.client.transport import AsyncDirectFirstTransport, DirectFirstTransport

if TYPE_CHECKING:
    from openai import AsyncOpenAI, OpenAI

_PLACEHOLDER_BASE = "http://direct-first.invalid/v1"  # never contacted: the transport re-targets every request


def _settings(coordinator_url: str | None, api_key: str | None, local_url: str | None) -> tuple[str | None, str | None, str]:
    coordinator_url = (coordinator_url or os.environ.get("DARKBLOOM_COORDINATOR") or "").rstrip("/") or None
    api_key = api_key or os.environ.get("DARKBLOOM_API_KEY") or None
    if coordinator_url:
        base = coordinator_url if coordinator_url.endswith("/v1") else coordinator_url + "/v1"
    elif local_url:
        base = local_url.rstrip("/") if local_url.rstrip("/").endswith("/v1") else local_url.rstrip("/") + "/v1"
    else:
        base = _PLACEHOLDER_BASE
    return coordinator_url, api_key, base


def direct_first_openai(coordinator_url: str | None = None, api_key: str | None = None, *,
                        local_url: str | None = None, local_token: str | None = None, home: Path | None = None,
                        timeout: float = 120.0, **openai_kwargs: Any) -> "OpenAI":
    """An `openai.OpenAI` whose requests go to the local endpoint first, the coordinator second."""
    from openai import OpenAI

    coordinator_url, api_key, base = _settings(coordinator_url, api_key, local_url)
    transport = DirectFirstTransport(coordinator_url, api_key, local_url=local_url, local_token=local_token,
                                     home=home)
    http_client = httpx.Client(transport=transport, timeout=timeout, trust_env=False)
    return OpenAI(base_url=base, api_key=api_key or "direct-first", http_client=http_client, **openai_kwargs)


def async_direct_first_openai(coordinator_url: str | None = None, api_key: str | None = None, *,
                              local_url: str | None = None, local_token: str | None = None,
                              home: Path | None = None, timeout: float = 120.0,
                              **openai_kwargs: Any) -> "AsyncOpenAI":
    """An `openai.AsyncOpenAI` with the same rule."""
    from openai import AsyncOpenAI

    coordinator_url, api_key, base = _settings(coordinator_url, api_key, local_url)
    transport = AsyncDirectFirstTransport(coordinator_url, api_key, local_url=local_url, local_token=local_token,
                                          home=home)
    http_client = httpx.AsyncClient(transport=transport, timeout=timeout, trust_env=False)
    return AsyncOpenAI(base_url=base, api_key=api_key or "direct-first", http_client=http_client, **openai_kwargs)
