"""Context length: a request that fits no session it may use is refused before admission with 400
``context_length_exceeded``, from the longest context the registry's views keep (never a pass over
the fleet); a session that does not say its context never refuses; placement takes only a session
that fits."""

from __future__ import annotations

import json

import pytest

from darkbloom.coordinator.fleet.registry import Registry
from darkbloom.coordinator.inference.calls import context_needed, output_token_bound, parse_call, prompt_token_bound
from darkbloom.coordinator.routing.route import check_context
from darkbloom.coordinator.routing.scheduler import longest_context, select, survey
from darkbloom.wire.catalog import CatalogModel
from darkbloom.wire.openai.edges import CHAT, EMBEDDINGS
from darkbloom.wire.openai.errors import ApiError
from tests.coordinator.routing.sim import MODEL, decision, fleet, services, settings

OWNER = "acct_owner"


def refusal(registry: Registry, **fields: object) -> ApiError | None:
    try:
        check_context(services(registry), decision(**fields))
    except ApiError as error:
        return error
    return None


def test_refused_only_when_no_session_it_may_use_fits() -> None:
    registry = Registry()
    fleet(registry, 2, context_length=2048)
    fleet(registry, 1, context_length=4096, runtime_verified=False)  # not one it may use
    error = refusal(registry, context_needed=3000)
    assert error is not None and (error.status, error.code, error.param) == (400, "context_length_exceeded", "messages")
    assert error.type == "invalid_request_error"
    assert "3000 tokens" in error.message and "2048 tokens" in error.message
    assert error.response().headers["x-should-retry"] == "false"
    assert refusal(registry, context_needed=2048) is None
    fleet(registry, 1, context_length=8192, active=1)  # busy still counts: it may serve it after the queue
    assert refusal(registry, context_needed=3000) is None


def test_a_session_that_does_not_say_never_refuses() -> None:
    registry = Registry()
    fleet(registry, 1, context_length=512)
    assert refusal(registry, context_needed=600) is not None
    fleet(registry, 1, context_length=0)  # e.g. an openai-backend node
    assert refusal(registry, context_needed=10 ** 9) is None


def test_nothing_to_serve_it_is_not_a_context_error() -> None:
    assert refusal(Registry(), context_needed=10 ** 6) is None  # placement says model_unavailable


def test_eligible_follows_the_policy() -> None:
    registry = Registry()
    fleet(registry, 1, context_length=1024, account=OWNER, machine="mach_small")
    fleet(registry, 1, context_length=8192, account=OWNER, machine="mach_big", private_only=True)
    fleet(registry, 1, context_length=4096)  # public
    assert longest_context(registry, decision(), settings()) == 4096  # the private one is not public
    assert refusal(registry, context_needed=5000) is not None
    assert refusal(registry, context_needed=5000, owner_account_id=OWNER) is None  # prefer: own ∪ public
    assert refusal(registry, context_needed=5000, owner_account_id=OWNER, owned_only=True) is None
    assert refusal(registry, context_needed=5000, owner_account_id=OWNER, owned_only=True,
                   pinned="mach_small") is not None  # a pinned machine alone
    assert refusal(registry, context_needed=2000, owner_account_id=OWNER, owned_only=True,
                   pinned="mach_big") is None
    assert refusal(registry, context_needed=9000, owner_account_id=OWNER) is not None


def test_placement_takes_only_a_session_that_fits() -> None:
    registry = Registry()
    small, = fleet(registry, 1, context_length=2048, max_concurrency=8, decode_tps=100.0)  # ranks first
    big, = fleet(registry, 1, context_length=8192)
    assert select(registry, decision(), settings()) is small.session
    assert select(registry, decision(context_needed=4000), settings()) is big.session
    big.set_active(1)
    assert select(registry, decision(context_needed=4000), settings()) is None  # busy: it waits for big
    assert survey(registry, decision(context_needed=4000), settings()).reasons == {"context_length": 1,
                                                                                 "no_free_slot": 1}


def test_the_views_keep_the_longest_context_as_sessions_come_and_go() -> None:
    registry = Registry()
    small, = fleet(registry, 1, context_length=2048)
    big, = fleet(registry, 1, context_length=8192)
    assert longest_context(registry, decision(), settings()) == 8192
    big.session.distrust("a chunk that does not open")
    assert longest_context(registry, decision(), settings()) == 2048
    unknown, = fleet(registry, 1, context_length=0)
    assert longest_context(registry, decision(), settings()) == float("inf")
    registry.remove(unknown.session)
    registry.remove(small.session)
    assert longest_context(registry, decision(), settings()) == 0


def _call(api_edge: object, **body: object) -> object:
    return parse_call(json.dumps({"model": MODEL.id, **body}).encode(), api_edge)  # type: ignore[arg-type]


@pytest.mark.parametrize("fields, answer", [({"max_tokens": 300}, 300), ({"max_completion_tokens": 40}, 40),
                                            ({"max_tokens": 10 ** 6}, 2048), ({}, 1)])
def test_what_a_request_needs(fields: dict[str, object], answer: int) -> None:
    """The prompt at four bytes a token (its bound counts one a byte), plus what it may answer."""
    model = CatalogModel(id=MODEL.id, input_price=1, output_price=1, max_output_tokens=2048)
    call = _call(CHAT, messages=[{"role": "user", "content": "hello " * 100}], **fields)
    bound = prompt_token_bound(call)  # type: ignore[arg-type]
    assert bound > 600
    needed = context_needed(call, bound, output_token_bound(call, model))  # type: ignore[arg-type]
    assert needed == -(-bound // 4) + answer


def test_embeddings_are_not_checked_here() -> None:
    call = _call(EMBEDDINGS, input=["x" * 5000, "y"])
    assert context_needed(call, prompt_token_bound(call), 0) == 0  # type: ignore[arg-type]
