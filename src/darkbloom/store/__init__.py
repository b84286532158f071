"""Persistence: SQLAlchemy Core tables, queries and Alembic migrations."""

from darkbloom.store.db import create_engine, migrate, ping

__all__ = ["create_engine", "migrate", "ping"]
