"""Each routing case here runs twice (issue 14): on one coordinator, and across replicas — three
coordinator replicas on one Postgres, Redis and NATS, machines connected to the first and the third in
turn, every consumer request (chat, streams, model lists, pins, keys, usage) sent to the second. A
module's `world` asks for `replicated` and starts its `Stack` with it; a module that does not ask
(test_docs runs the docs' own commands against one coordinator URL; test_fallback_budget and
test_machine_insight run on SQLite and Postgres instead) runs once. tests/conftest.py hands a module's
runs across replicas to a worker as a unit of their own."""

from __future__ import annotations

import pytest

from tests.support.replicas import ACROSS_REPLICAS


@pytest.fixture(scope="module", params=[
    pytest.param(False, id="one_coordinator"),
    pytest.param(True, id=ACROSS_REPLICAS, marks=pytest.mark.postgres),
])
def replicated(request: pytest.FixtureRequest) -> bool:
    """Whether the module's Stack is three replicas of one coordinator instead of one coordinator."""
    return bool(request.param)
