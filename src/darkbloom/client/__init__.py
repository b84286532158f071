"""Direct-first client (docs/direct-mode.md "The direct-first client"): your own node's local endpoint first,
the coordinator's Self-Route (`X-Darkbloom-Route: self`) only when the local endpoint cannot be reached.

    from darkbloom.client import direct_first_openai
    client = direct_first_openai("http://127.0.0.1:8080", "dk-…")   # local endpoint from local.json
    raw = client.chat.completions.with_raw_response.create(model="smollm2-135m", messages=[…])
    raw.headers["X-Darkbloom-Via"]   # "local" or "coordinator"
"""

from darkbloom.client.endpoints import Endpoint, discover_local_endpoint
from darkbloom.client.sdk import async_direct_first_openai, direct_first_openai
from darkbloom.client.transport import (FALLBACK_ERRORS, VIA_HEADER, AsyncDirectFirstTransport,
                                        DirectFirstTransport)

__all__ = ["AsyncDirectFirstTransport", "DirectFirstTransport", "Endpoint", "FALLBACK_ERRORS", "VIA_HEADER",
           "async_direct_first_openai", "direct_first_openai", "discover_local_endpoint"]
