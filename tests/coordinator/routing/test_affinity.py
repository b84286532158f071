"""Conversation affinity (docs/routing.md "Conversations stay on their machine"): the map (bounded,
least recently used first out, keyed per process and per account), and first placement preferring the
session that served a conversation's turn before — only among sessions it may use and that are free,
else the usual choice — with its digests in no log line."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import pytest

from darkbloom.coordinator.fleet.registry import Registry
from darkbloom.coordinator.identity.caller import Caller
from darkbloom.coordinator.routing import route
from darkbloom.coordinator.routing.affinity import BLOCK_CHARS, Affinity, Conversation
from darkbloom.coordinator.routing.decision import Policy
from darkbloom.coordinator.routing.queue import RequestQueues
from darkbloom.coordinator.routing.scheduler import Claim, select_idle_or_free
from tests.coordinator.routing.sim import MODEL, NoLifecycle, SimProvider, chat, decision, fleet, services, settings

ACCOUNT = "acct_caller"
OWNER = "acct_owner"
SYSTEM = {"role": "system", "content": "You are terse."}


def turns(topic: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """A conversation's first request, and its second: the first's messages, the answer, a new message."""
    first = [SYSTEM, {"role": "user", "content": f"Tell me about {topic}."}]
    second = [*first, {"role": "assistant", "content": f"{topic} is a thing."}, {"role": "user", "content": "More."}]
    return {"messages": first}, {"messages": second}


def conversation(affinity: Affinity, body: dict[str, Any], account: str = ACCOUNT) -> Conversation:
    return affinity.conversation(account, MODEL.id, "chat", body)


async def serve_turn(q: RequestQueues, affinity: Affinity, body: dict[str, Any], **fields: Any) -> Claim:
    """What `serve` does around placement: recall, place, remember; the slot is released at once."""
    talk = conversation(affinity, body)
    claim = await q.place(decision(affinity=affinity.recall(talk), **fields))
    affinity.remember(talk, claim.session.id)
    claim.slot.release()
    return claim


# the map


def test_a_second_turn_recalls_the_session_of_the_first() -> None:
    affinity = Affinity()
    first, second = turns("owls")
    assert affinity.recall(conversation(affinity, first)) is None
    affinity.remember(conversation(affinity, first), "prov_a")
    assert affinity.recall(conversation(affinity, second)) == "prov_a"
    assert affinity.recall(conversation(affinity, first)) == "prov_a"  # the same request again
    third = {"messages": [*second["messages"], {"role": "assistant", "content": "Owls hoot."},
                          {"role": "user", "content": "Why?"}]}
    assert affinity.recall(conversation(affinity, third)) == "prov_a"


def test_the_longest_known_prefix_wins() -> None:
    affinity = Affinity()
    first, second = turns("owls")
    affinity.remember(conversation(affinity, first), "prov_a")
    affinity.remember(conversation(affinity, second), "prov_b")
    third = {"messages": [*second["messages"], {"role": "assistant", "content": "Yes."},
                          {"role": "user", "content": "And?"}]}
    assert affinity.recall(conversation(affinity, third)) == "prov_b"


def test_other_conversations_accounts_models_and_processes_recall_nothing() -> None:
    affinity = Affinity()
    owls, _ = turns("owls")
    affinity.remember(conversation(affinity, owls), "prov_a")
    _, cats = turns("cats")  # the same system message, another conversation
    assert affinity.recall(conversation(affinity, cats)) is None
    assert affinity.recall(conversation(affinity, owls, account="acct_someone_else")) is None
    assert affinity.recall(affinity.conversation(ACCOUNT, "another-model", "chat", owls)) is None
    another_process = Affinity()
    assert conversation(another_process, owls).prefixes != conversation(affinity, owls).prefixes
    assert another_process.recall(conversation(another_process, owls)) is None


def test_a_message_is_the_same_whatever_the_order_of_its_fields() -> None:
    affinity = Affinity()
    affinity.remember(conversation(affinity, {"messages": [{"role": "user", "content": "hi"}]}), "prov_a")
    reordered = {"messages": [{"content": "hi", "role": "user"}, {"role": "assistant", "content": "hello"},
                              {"role": "user", "content": "bye"}]}
    assert affinity.recall(conversation(affinity, reordered)) == "prov_a"


def test_the_map_is_bounded_and_forgets_the_least_recently_used_first() -> None:
    affinity = Affinity(capacity=3)
    talks = [conversation(affinity, turns(f"topic {n}")[0]) for n in range(4)]
    for n, talk in enumerate(talks[:3]):
        affinity.remember(talk, f"prov_{n}")
    assert affinity.recall(talks[0]) == "prov_0"  # used: now the most recent
    affinity.remember(talks[3], "prov_3")
    assert len(affinity) == 3
    assert affinity.recall(talks[1]) is None  # the least recently used went
    assert [affinity.recall(talks[n]) for n in (0, 2, 3)] == ["prov_0", "prov_2", "prov_3"]
    for n in range(100):
        affinity.remember(conversation(affinity, turns(f"more {n}")[0]), "prov_x")
    assert len(affinity) == 3


def test_a_completions_prompt_is_a_conversation_of_its_full_blocks() -> None:
    affinity = Affinity()
    prompt = "Once upon a time " * 100  # 1,700 characters: three full blocks
    talk = affinity.conversation(ACCOUNT, MODEL.id, "completions", {"prompt": prompt})
    assert len(talk.prefixes) == len(prompt) // BLOCK_CHARS
    affinity.remember(talk, "prov_a")
    longer = {"prompt": prompt + " there was an owl. It said hoo. " * 20}
    assert affinity.recall(affinity.conversation(ACCOUNT, MODEL.id, "completions", longer)) == "prov_a"
    assert not affinity.conversation(ACCOUNT, MODEL.id, "completions", {"prompt": "short"}).prefixes
    assert not affinity.conversation(ACCOUNT, MODEL.id, "completions", {"prompt": [prompt, prompt]}).prefixes
    assert not affinity.conversation(ACCOUNT, MODEL.id, "embeddings", {"input": prompt}).prefixes
    affinity.remember(Conversation(), "prov_b")  # nothing to remember
    assert len(affinity) == 1


def test_a_conversation_prints_no_digest() -> None:
    affinity = Affinity()
    talk = conversation(affinity, turns("owls")[1])
    shown = repr(talk) + str(talk)
    assert all(d.hex() not in shown and repr(d) not in shown for d in talk.prefixes)


# placement


async def test_a_second_turn_is_placed_on_the_session_that_served_the_first() -> None:
    for topic in ("owls", "cats", "bees", "ants", "moths", "crows"):  # each time against the usual order
        registry = Registry()
        a, b = fleet(registry, 2, max_concurrency=2)
        q = RequestQueues(registry, settings())
        affinity = Affinity()
        first, second = turns(topic)
        served = (await serve_turn(q, affinity, first)).session
        other = b if served is a.session else a
        other.session.report_speed(100.0)  # the other now ranks first: faster, and idle
        (a if served is a.session else b).set_active(1)  # the served one busier (one of two slots)
        assert (await serve_turn(q, affinity, second)).session is served


async def test_without_a_remembered_turn_the_usual_choice_stands() -> None:
    registry = Registry()
    slow, fast = fleet(registry, 2)
    fast.session.report_speed(100.0)
    q = RequestQueues(registry, settings())
    assert (await serve_turn(q, Affinity(), turns("owls")[1])).session is fast.session


@pytest.mark.parametrize("why", ["busy", "untrusted", "draining", "stale challenge", "excluded", "gone",
                                 "pinned elsewhere", "model unloaded", "model unloaded everywhere"])
async def test_it_falls_back_when_that_session_cannot_take_the_request(why: str) -> None:
    registry = Registry()
    owner = OWNER if why == "pinned elsewhere" else None
    remembered, other = fleet(registry, 2, account=owner, machine=None, loaded=(MODEL.id,))
    q = RequestQueues(registry, settings())
    affinity = Affinity()
    first, second = turns("owls")
    affinity.remember(conversation(affinity, first), remembered.id)
    fields: dict[str, Any] = {}
    session = remembered.session
    if why == "busy":
        remembered.set_active(1)
    elif why == "untrusted":
        session.distrust("a response chunk did not open")
    elif why == "draining":
        session.start_draining()
    elif why == "stale challenge":
        session.record_challenge_pass(None)
    elif why == "excluded":
        fields["excluded"] = {remembered.id}
    elif why == "gone":
        registry.remove(session)
    elif why == "pinned elsewhere":
        fields.update(owner_account_id=OWNER, owned_only=True, pinned=other.id)
    elif why == "model unloaded":
        session.report_loaded([])
    elif why == "model unloaded everywhere":  # no cache anywhere: the usual choice, here the faster
        session.report_loaded([])
        other.session.report_loaded([])
        other.session.report_speed(100.0)
    assert (await serve_turn(q, affinity, second, **fields)).session is other.session


async def test_an_owned_machine_still_comes_before_the_fleet_session_of_the_last_turn() -> None:
    """A prefer request is free on the caller's own machine: the fleet's cache does not outweigh it."""
    registry = Registry()
    fleet_session, = fleet(registry, 1)
    q = RequestQueues(registry, settings())
    affinity = Affinity()
    first, second = turns("owls")
    affinity.remember(conversation(affinity, first), fleet_session.id)
    own, = fleet(registry, 1, account=ACCOUNT)
    assert (await serve_turn(q, affinity, second, owner_account_id=ACCOUNT)).session is own.session
    own.set_active(1)  # its own machine busy: then the fleet, and the session that has the cache
    assert (await serve_turn(q, affinity, second, owner_account_id=ACCOUNT)).session is fleet_session.session


async def test_a_queued_second_turn_waits_for_whichever_frees_first() -> None:
    registry = Registry()
    remembered, other = fleet(registry, 2, active=1)
    q = RequestQueues(registry, settings())
    affinity = Affinity()
    first, second = turns("owls")
    affinity.remember(conversation(affinity, first), remembered.id)
    waiting = asyncio.ensure_future(q.place(decision(affinity=affinity.recall(conversation(affinity, second)))))
    await asyncio.sleep(0)
    other.held.pop().release()
    assert (await asyncio.wait_for(waiting, 2)).session is other.session


def test_retries_and_the_backup_never_look_at_it() -> None:
    registry = Registry()
    remembered, other = fleet(registry, 2)
    other.session.report_speed(100.0)
    chosen = select_idle_or_free(registry, decision(affinity=remembered.id), settings(), idle_only=False)
    assert chosen is other.session


async def test_the_digests_reach_no_log_line(caplog: pytest.LogCaptureFixture) -> None:
    registry = Registry()
    fleet(registry, 2)
    svc = services(registry)
    caplog.set_level(logging.DEBUG)
    first, second = turns("owls")
    talks = []
    public = Policy(mode="public", owner_account_id=None)
    for body in (first, second):
        made = await route.decide(svc, Caller(account_id=ACCOUNT, kind="api_key"), public, MODEL,
                                  chat(**body), context_needed=0, output_tokens=0)
        assert made.conversation is not None
        talks.append(made.conversation)
        logging.getLogger("darkbloom").debug("placing %r with %r", made, made.conversation)  # as any log would
        claim = await route.place(svc, made, public, NoLifecycle())
        route.remember(svc, made, claim.session)
        claim.slot.release()
    assert made.affinity == claim.session.id  # the second turn was placed by affinity
    digests = [d for talk in talks for d in talk.prefixes]
    assert digests and caplog.text
    for digest in digests:
        assert digest.hex() not in caplog.text and repr(digest) not in caplog.text
        assert digest.hex() not in repr(made)


def test_an_affinity_is_a_session_id_on_the_decision() -> None:
    provider = SimProvider()
    assert decision(affinity=provider.id).affinity == provider.id and decision().affinity is None
