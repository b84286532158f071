"""The NATS subjects of one coordinator's replicas, all under ``--nats-subject-prefix``.

- ``<prefix>.fleet``: every replica's announcements of the sessions it holds — deltas, heartbeats,
  a joining replica's ask for everyone's view, goodbyes (all replicas listen);
- ``<prefix>.view.<replica>``: to one replica: an ask for its full view, or the parts of a view it asked for;
- ``<prefix>.claim.<replica>``: request/reply, claim a slot on one of that replica's sessions;
- ``<prefix>.hold.<replica>``: to the replica holding a session: a sealed request, cancel, release,
  distrust, enrollment, unlink;
- ``<prefix>.back.<replica>.<ticket>``: one subject per attempt, the provider's frames back to the
  replica that admitted the request.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Subjects:
    prefix: str
    replica: str  # this process (the coordinator instance id)

    @property
    def fleet(self) -> str:
        return f"{self.prefix}.fleet"

    def view(self, replica: str) -> str:
        return f"{self.prefix}.view.{replica}"

    def claim(self, replica: str) -> str:
        return f"{self.prefix}.claim.{replica}"

    def hold(self, replica: str) -> str:
        return f"{self.prefix}.hold.{replica}"

    def back(self, replica: str, ticket: str) -> str:
        return f"{self.prefix}.back.{replica}.{ticket}"

    @property
    def my_views(self) -> str:
        return self.view(self.replica)

    @property
    def my_claims(self) -> str:
        return self.claim(self.replica)

    @property
    def my_holds(self) -> str:
        return self.hold(self.replica)

    @property
    def my_backs(self) -> str:
        return f"{self.prefix}.back.{self.replica}.*"

    def ticket_of(self, back_subject: str) -> str:
        return back_subject.rsplit(".", 1)[1]
