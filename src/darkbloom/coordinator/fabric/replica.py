"""This coordinator process as one replica of several, joined over NATS (``--nats-url``).

``Fabric`` wires the parts: the connection, the announcer of this replica's sessions, the view of
the others' (stand-ins in the registry), the holding side (requests other replicas place here) and
the admitting side (requests placed on other replicas). Without ``--nats-url`` none of it exists
and this package is never imported.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Awaitable, Callable

from nats.aio.client import Client
from nats.aio.msg import Msg

from darkbloom.coordinator.fabric.advertiser import Advertiser
from darkbloom.coordinator.fabric.authentication import Authenticator, Opened, ReplicaKey, Roster
from darkbloom.coordinator.fabric.connection import Connection
from darkbloom.coordinator.fabric.holder import Holder
from darkbloom.coordinator.fabric.nats_auth import connect_options
from darkbloom.coordinator.fabric.remote_link import Outbound
from darkbloom.coordinator.fabric.subjects import Subjects
from darkbloom.coordinator.fabric.view import FleetView
from darkbloom.coordinator.services import Services

log = logging.getLogger("darkbloom.fabric")


class Fabric:
    def __init__(self, services: Services) -> None:
        settings = services.settings
        assert settings.nats_url is not None
        self.services = services
        self.subjects = Subjects(settings.nats_subject_prefix, services.instance_id)
        self.roster = Roster(ReplicaKey(services.instance_id), services.engine, settings.instance_stale_after)
        authenticator = Authenticator(self.roster)
        self.connection = Connection(settings.nats_url, f"darkbloom coordinator {services.instance_id}",
                                     authenticator, connect_options(settings))
        self.outbound = Outbound(self.connection, self.subjects, services.registry)
        self.holder = Holder(services, self.connection, self.subjects)
        self.view = FleetView(services, self.outbound, self.holder.admitter_gone)
        self.outbound.on_session_gone = self.view.drop
        self.advertiser = Advertiser(services.registry, self.connection, self.subjects, settings.replica_heartbeat,
                                     settings.challenge_freshness)
        self.view.on_sync_asked = self.advertiser.asked
        self.view.on_forget = self.advertiser.forget
        self.connection.on_up(self.view.ask_everyone)
        self.connection.on_up(self.advertiser.alive)  # heard at once, not a heartbeat later
        self._tasks: list[asyncio.Task[Any]] = []

    @property
    def connected(self) -> bool:
        return self.connection.connected

    def status(self) -> dict[str, Any]:
        """For /readyz: the NATS connection, how many replicas this one hears (itself included), and
        whether it sees all of their sessions: ``fabric`` is ``in_sync`` when NATS is connected and
        every replica heard is in step, else ``out_of_sync`` with the ones that are not."""
        unsynced = self.view.unsynced
        return {"nats": "connected" if self.connected else "disconnected", "replicas": len(self.view.heard) + 1,
                "fabric": "in_sync" if self.connected and not unsynced else "out_of_sync",
                "unsynced_replicas": unsynced}

    async def _subscribe(self, client: Client) -> None:
        subjects = self.subjects
        await client.subscribe(subjects.fleet, cb=self._proven(self.view.on_message))
        await client.subscribe(subjects.my_views, cb=self._proven(self.view.on_direct))
        await client.subscribe(subjects.my_claims, cb=self._proven(self.holder.on_claim))
        await client.subscribe(subjects.my_holds, cb=self._proven(self.holder.on_hold))
        await client.subscribe(subjects.my_backs, cb=self._proven(self.outbound.on_back))

    def _proven(self, handle: Callable[[Opened, Msg], Awaitable[None]]) -> Callable[[Msg], Awaitable[None]]:
        """Only what a live replica of this coordinator sent, to this one, once, reaches ``handle``."""
        async def on_message(msg: Msg) -> None:
            opened = await self.connection.open(msg)
            if opened is not None:
                await handle(opened, msg)
        return on_message

    async def start(self) -> None:
        """Register this replica's key (the others read it from the database), then join."""
        await self.roster.publish()
        await self.roster.refresh()
        self._tasks = [asyncio.create_task(self.connection.run(self._subscribe)),
                       asyncio.create_task(self.advertiser.heartbeat_forever()),
                       asyncio.create_task(self.view.watch_forever()),
                       asyncio.create_task(self.holder.reap_forever()),
                       asyncio.create_task(self.roster.refresh_forever())]
        log.info("replica %s joining the fabric at %s (subjects %s.*)", self.subjects.replica,
                 self.connection.url, self.subjects.prefix)

    async def stop(self) -> None:
        """Tell the other replicas at once (they drop this one's sessions), then disconnect."""
        if self.connection.client is not None:
            self.connection.post(self.subjects.fleet, self.advertiser.leaving())
            await self.connection.flush_pending()
        for task in self._tasks:
            task.cancel()
        await self.connection.close()
