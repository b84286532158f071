"""Alembic environment: runs on the connection handed over by ``darkbloom.store.db.migrate``."""

from alembic import context

from darkbloom.store.schema import metadata

connection = context.config.attributes["connection"]
context.configure(connection=connection, target_metadata=metadata, render_as_batch=True)
with context.begin_transaction():
    context.run_migrations()
