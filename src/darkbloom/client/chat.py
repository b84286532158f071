"""`darkbloom chat`: one prompt, the answer streamed to stdout (docs/direct-mode.md "From the terminal")."""

from __future__ import annotations

import json
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

import httpx

from darkbloom.wire.catalog import BUNDLED_MODEL_ID
from darkbloom.client.transport import VIA_HEADER, DirectFirstTransport


class ChatError(Exception):
    """The chat failed; the message is what to show the user."""


@dataclass
class ChatSettings:
    prompt: str
    model: str
    coordinator_url: str | None
    api_key: str | None
    local_first: bool
    home: Path
    max_tokens: int | None = None


def provider_toml_defaults(home: Path) -> tuple[str | None, str | None]:
    """(coordinator url, first model id) from provider.toml, when it has them."""
    try:
        data = tomllib.loads((home / "provider.toml").read_text())
    except (OSError, tomllib.TOMLDecodeError, UnicodeDecodeError):
        return None, None
    coordinator = data.get("coordinator")
    url = coordinator.get("url") if isinstance(coordinator, dict) else None
    models = data.get("models")
    model = models[0].get("id") if isinstance(models, list) and models and isinstance(models[0], dict) else None
    return (url if isinstance(url, str) and url.strip() else None,
            model if isinstance(model, str) and model.strip() else None)


def default_model(home: Path) -> str:
    return provider_toml_defaults(home)[1] or BUNDLED_MODEL_ID


def run_chat(settings: ChatSettings, out: TextIO, err: TextIO) -> None:
    """Stream the answer to `out`; with `local_first`, say on `err` which path served. Raises ChatError."""
    coordinator = (settings.coordinator_url or "").rstrip("/") or None
    if not settings.local_first:
        if coordinator is None:
            raise ChatError("no coordinator: pass --coordinator URL or set DARKBLOOM_COORDINATOR "
                            "(or run `darkbloom login`, which writes it to provider.toml)")
        if not settings.api_key:
            raise ChatError("no API key: pass --api-key dk-… or set DARKBLOOM_API_KEY")
    transport = DirectFirstTransport(coordinator, settings.api_key, home=settings.home) if settings.local_first \
        else httpx.HTTPTransport()
    body: dict[str, Any] = {"model": settings.model, "stream": True,
                            "messages": [{"role": "user", "content": settings.prompt}]}
    if settings.max_tokens is not None:
        body["max_tokens"] = settings.max_tokens
    headers = {"Authorization": f"Bearer {settings.api_key}"} if settings.api_key else {}
    url = (_v1(coordinator) if coordinator else "http://direct-first.invalid/v1") + "/chat/completions"
    timeout = httpx.Timeout(connect=10.0, read=300.0, write=30.0, pool=10.0)
    try:
        with httpx.Client(transport=transport, timeout=timeout, trust_env=False) as client:
            with client.stream("POST", url, json=body, headers=headers) as response:
                if settings.local_first:
                    err.write(f"via {response.headers.get(VIA_HEADER, 'coordinator')}\n")
                    err.flush()
                if response.status_code >= 400:
                    raise ChatError(_error_message(response.status_code, response.read()))
                _print_stream(response, out)
    except httpx.TransportError as exc:
        raise ChatError(f"cannot reach the server: {exc}") from None


def _v1(url: str) -> str:
    return url if url.endswith("/v1") else url + "/v1"


def _print_stream(response: httpx.Response, out: TextIO) -> None:
    printed = False
    for line in response.iter_lines():
        if not line.startswith("data:"):
            continue
        data = line[5:].strip()
        if data == "[DONE]":
            if printed:
                out.write("\n")
                out.flush()
            return
        try:
            event = json.loads(data)
        except ValueError:
            raise ChatError("the server sent an event that is not JSON") from None
        if isinstance(event, dict) and "error" in event:
            if printed:
                out.write("\n")
            raise ChatError(_message_of(event) or "the answer failed while streaming")
        for choice in (event.get("choices") or []) if isinstance(event, dict) else []:
            content = (choice.get("delta") or {}).get("content")
            if content:
                out.write(content)
                out.flush()
                printed = True
    raise ChatError("the stream ended before it was complete")


def _error_message(status: int, raw: bytes) -> str:
    try:
        message = _message_of(json.loads(raw))
    except ValueError:
        message = None
    return f"{message} (HTTP {status})" if message else f"the server answered HTTP {status}"


def _message_of(data: Any) -> str | None:
    error = data.get("error") if isinstance(data, dict) else None
    message = error.get("message") if isinstance(error, dict) else None
    return message if isinstance(message, str) and message else None
