"""``OutboxLink``: the link of a session whose node a test plays (``fleet/link.py``'s ``Link``): every
frame the coordinator sends waits in ``outbox`` for the test to read, and a close puts ``None`` there."""

from __future__ import annotations

import asyncio

from darkbloom.wire.protocol import Cancel, dump


class OutboxLink:
    only_proven_chunks = False  # the registration says whether its chunks are sealed with its key

    def __init__(self) -> None:
        self.outbox: asyncio.Queue[str | None] = asyncio.Queue()
        self.close_code: int | None = None

    @property
    def closing(self) -> bool:
        return self.close_code is not None

    def send(self, frame_json: str) -> None:
        self.outbox.put_nowait(frame_json)

    def send_request(self, request_id: str, ticket: str | None, frame_json: str) -> None:
        self.outbox.put_nowait(frame_json)

    def cancel(self, request_id: str, ticket: str | None) -> None:
        self.outbox.put_nowait(dump(Cancel(request_id=request_id)))

    def claimed(self) -> None:
        return None

    async def confirm(self, ticket: str | None) -> bool:
        return True

    def released(self, ticket: str | None) -> None:
        pass

    def report_speed(self, decode_tps: float) -> None:
        pass

    def retire(self) -> None:
        self.close()

    def close(self, code: int = 1000) -> None:
        if self.close_code is None:
            self.close_code = code
            self.outbox.put_nowait(None)
