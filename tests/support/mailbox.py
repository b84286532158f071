"""A real SMTP server (aiosmtpd) in the test process, and what it received: the coordinator's mail
settings (--smtp-url) point at it."""

from __future__ import annotations

import re
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from email import message_from_bytes
from email.message import Message
from typing import Any

from aiosmtpd.controller import Controller

from tests.support.processes import free_port, wait_until

CODE = re.compile(r"Your code is ([A-Z2-9]{4}-[A-Z2-9]{4})")


class Mailbox:
    """What the SMTP server received, by recipient."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.messages: list[tuple[list[str], Message]] = []

    async def handle_DATA(self, server: Any, session: Any, envelope: Any) -> str:
        with self._lock:
            self.messages.append((list(envelope.rcpt_tos), message_from_bytes(envelope.content)))
        return "250 OK"

    def to(self, address: str) -> list[Message]:
        with self._lock:
            return [m for rcpts, m in self.messages if address in rcpts]

    def code_for(self, address: str, after: int = 0) -> str:
        messages = wait_until(lambda: self.to(address)[after:] or None, timeout=30, interval=0.05,
                              what=f"a mail to {address}")
        match = CODE.search(messages[-1].get_payload())
        assert match, messages[-1].get_payload()
        return match.group(1)


@contextmanager
def smtp_server() -> Iterator[tuple[Mailbox, int]]:
    """The mailbox and the port its server listens on (127.0.0.1), until the block ends."""
    box = Mailbox()
    port = free_port()
    controller = Controller(box, hostname="127.0.0.1", port=port)
    controller.start()
    try:
        yield box, port
    finally:
        controller.stop()
