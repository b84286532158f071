"""The long-lived parts of a running coordinator, shared by every route."""

from __future__ import annotations

from dataclasses import dataclass

from fastapi import Request
from sqlalchemy.ext.asyncio import AsyncEngine

from darkbloom.coordinator.config import CoordinatorSettings
from darkbloom.coordinator.registry import Registry


@dataclass
class Services:
    settings: CoordinatorSettings
    engine: AsyncEngine
    registry: Registry


def get_services(request: Request) -> Services:
    services: Services = request.app.state.services
    return services
