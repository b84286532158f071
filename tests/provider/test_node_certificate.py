"""The node keeps the enrollment certificate a coordinator hands it and presents it at every later
registration, once it checked the certificate is for its own identity key (against a scripted fake
coordinator; the real one is in test_trust_nodes)."""

from __future__ import annotations

import asyncio
import logging
import stat
from pathlib import Path
from typing import AsyncIterator

import pytest

from darkbloom import paths
from darkbloom.coordinator.fleet.enrollment import EnrollmentCA
from darkbloom.wire import protocol
from darkbloom.wire.crypto import NodeIdentity
from darkbloom.provider.reconnect import ReconnectPolicy
from darkbloom.provider.state import read_state
from tests.provider.fake_coordinator import FakeCoordinator, running_node


async def trust_level_written(home: Path, level: str) -> None:
    """Until the node's state file says ``level``: the `trust_status` that set it is handled whole
    (a certificate it carries is saved, or refused, before the state is written)."""
    for _ in range(500):
        if (read_state(home) or {}).get("trust_level") == level:
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"the node's state never said trust level {level}")


@pytest.fixture
async def running(home: Path) -> AsyncIterator[tuple[FakeCoordinator, Path]]:
    async with FakeCoordinator() as fake, \
            running_node(fake.url, home, ReconnectPolicy(base=0.05, restart_window=0.05, lost_window=0.05)):
        yield fake, home


async def test_certificate_is_saved_and_presented_at_the_next_registration(
        running: tuple[FakeCoordinator, Path]) -> None:
    fake, home = running
    conn = await fake.accept()
    register = await conn.recv()
    assert isinstance(register, protocol.Register) and register.certificate is None
    await conn.send(protocol.Registered(provider_id="prov_1", trust_level="self_signed"))
    pem = EnrollmentCA.generate().issue(register.identity_key, "mach_1")
    await conn.send(protocol.TrustStatus(trust_level="hardware", reason="enrolled", certificate=pem))
    cert_file = paths.certificate_path(home)
    for _ in range(500):
        if cert_file.exists():
            break
        await asyncio.sleep(0.01)
    assert cert_file.read_text() == pem and stat.S_IMODE(cert_file.stat().st_mode) == 0o600

    await conn.ws.close()  # the coordinator goes away; the node reconnects and presents the certificate
    again = await fake.accept()
    register = await again.recv()
    assert isinstance(register, protocol.Register) and register.certificate == pem


async def test_trust_status_without_certificate_keeps_the_file(running: tuple[FakeCoordinator, Path]) -> None:
    fake, home = running
    paths.certificate_path(home).write_text("existing")
    conn = await fake.accept()
    register = await conn.recv()
    assert register.certificate == "existing"
    await conn.send(protocol.Registered(provider_id="prov_1", trust_level="hardware"))
    await conn.send(protocol.TrustStatus(trust_level="untrusted", reason="bad answer"))
    await trust_level_written(home, "untrusted")
    assert paths.certificate_path(home).read_text() == "existing"


@pytest.mark.parametrize("kind", ["junk", "another identity key"])
async def test_a_bad_certificate_is_not_saved_but_the_trust_level_applies(
        running: tuple[FakeCoordinator, Path], kind: str, caplog: pytest.LogCaptureFixture) -> None:
    fake, home = running
    conn = await fake.accept()
    await conn.recv()
    await conn.send(protocol.Registered(provider_id="prov_1", trust_level="self_signed"))
    pem = ("-----BEGIN CERTIFICATE-----\nMIIB...test...\n-----END CERTIFICATE-----\n" if kind == "junk"
           else EnrollmentCA.generate().issue(NodeIdentity.generate().identity_key_b64, "mach_1"))
    with caplog.at_level(logging.WARNING, logger="darkbloom.provider.registration"):
        await conn.send(protocol.TrustStatus(trust_level="hardware", reason="enrolled", certificate=pem))
        await trust_level_written(home, "hardware")
    assert not paths.certificate_path(home).exists()
    assert any("not saving the enrollment certificate" in r.getMessage() for r in caplog.records)

    await conn.ws.close()
    again = await fake.accept()
    register = await again.recv()
    assert isinstance(register, protocol.Register) and register.certificate is None
