"""tests/selfroute again, across replicas (issue 14): every Stack is three coordinator replicas on
one Postgres, Redis and NATS; machines connect to the first and the third in turn, and every consumer
request — chat, streams, model lists, pins, keys, usage — goes to the second. The test modules here
re-export the routing cases of tests/selfroute unchanged (test_docs, which runs the docs' own
commands against one coordinator URL, is not one of them)."""

from __future__ import annotations

from typing import Iterator

import pytest

from tests.selfroute import support


@pytest.fixture(scope="package", autouse=True)
def across_replicas() -> Iterator[None]:
    support.REPLICATED = True
    try:
        yield
    finally:
        support.REPLICATED = False
