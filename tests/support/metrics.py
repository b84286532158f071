"""Metrics of this process, as /metrics would show them (prometheus_client's default registry)."""

from __future__ import annotations

from prometheus_client import REGISTRY


def sample(name: str, **labels: str) -> float:
    """The sample ``name`` with these labels so far (0 before it is first counted)."""
    return REGISTRY.get_sample_value(name, labels) or 0.0
