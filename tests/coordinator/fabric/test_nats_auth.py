"""NATS as people deploy it: the replicas authenticate (a password in the URL, an nkey seed file or a
.creds file) and check the server's TLS certificate against --nats-tls-ca (optionally presenting a
client certificate); a real nats-server that requires both lets them in and refuses a client
without credentials or without the CA; no log line carries a password."""

from __future__ import annotations

import asyncio
import datetime
import ipaddress
import logging
import os
import shutil
import socket
import ssl
import subprocess
import time
from pathlib import Path
from typing import Any, Callable, Iterator, NamedTuple

import nats
import nats.errors
import nkeys
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
from nats.aio.client import Client
from typer.testing import CliRunner

from darkbloom.cli import app
from darkbloom.coordinator.config import CoordinatorSettings
from darkbloom.coordinator.fabric.authentication import Authenticator, ReplicaKey, Roster
from darkbloom.coordinator.fabric.connection import Connection
from darkbloom.coordinator.fabric.nats_auth import connect_options, redacted

NATS_SERVER = shutil.which("nats-server") or "/usr/sbin/nats-server"
PASSWORD = "s3cret-Pa55"


# --- redacted ---------------------------------------------------------------------------------

@pytest.mark.parametrize(("url", "shown"), [
    ("nats://alice:s3cret@host:4222", "nats://alice:***@host:4222"),
    ("nats://tok@host", "nats://***@host"),
    ("nats://host:4222", "nats://host:4222"),
    ("tls://alice:s3cret@10.0.0.1:4222/", "tls://alice:***@10.0.0.1:4222/"),
    ("alice:s3cret@host:4222", "alice:***@host:4222"),
    ("nats://alice:p@ss@host", "nats://alice:***@host"),
    ("nats://host:4222/a@b", "nats://host:4222/a@b"),
    ("nats://a:x@h1:4222,nats://tok@h2:4222,h3:4222", "nats://a:***@h1:4222,nats://***@h2:4222,h3:4222"),
    ("nats://a:x@h1:4222, b:y@h2:4222", "nats://a:***@h1:4222, b:***@h2:4222"),
    ("redis://user:pass@localhost:6379/0", "redis://user:***@localhost:6379/0"),
    ("redis://:pass@localhost:6379/0", "redis://:***@localhost:6379/0"),
    ("redis://localhost:6379/0", "redis://localhost:6379/0"),
])
def test_redacted_hides_passwords_and_tokens(url: str, shown: str) -> None:
    assert redacted(url) == shown
    assert redacted(shown) == shown


# --- settings and connect_options ---------------------------------------------------------------

class Pki(NamedTuple):
    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path
    other_ca: Path  # a CA that signed nothing here


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def _ca(name: str) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(subject).issuer_name(subject).public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(hours=1)).not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=False, content_commitment=False, key_encipherment=False,
                                         data_encipherment=False, key_agreement=False, key_cert_sign=True,
                                         crl_sign=True, encipher_only=False, decipher_only=False), critical=True)
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
            .sign(key, hashes.SHA256()))
    return cert, key


def _leaf(ca: tuple[x509.Certificate, ec.EllipticCurvePrivateKey], name: str,
          usage: x509.ObjectIdentifier) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    ca_cert, ca_key = ca
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)]))
            .issuer_name(ca_cert.subject).public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(hours=1)).not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName([x509.DNSName("localhost"),
                                                        x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
                           critical=False)
            .add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
            .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False)
            .sign(ca_key, hashes.SHA256()))
    return cert, key


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    root = tmp_path_factory.mktemp("pki")
    ca, other = _ca("test NATS CA"), _ca("another CA")
    files: dict[str, bytes] = {"ca.pem": ca[0].public_bytes(serialization.Encoding.PEM),
                               "other-ca.pem": other[0].public_bytes(serialization.Encoding.PEM)}
    for name, usage in (("server", ExtendedKeyUsageOID.SERVER_AUTH), ("client", ExtendedKeyUsageOID.CLIENT_AUTH)):
        cert, key = _leaf(ca, name, usage)
        files[f"{name}.pem"] = cert.public_bytes(serialization.Encoding.PEM)
        files[f"{name}-key.pem"] = _key_pem(key)
    for name, data in files.items():
        (root / name).write_bytes(data)
    return Pki(root / "ca.pem", root / "server.pem", root / "server-key.pem", root / "client.pem",
               root / "client-key.pem", root / "other-ca.pem")


class NKey(NamedTuple):
    seed_file: Path
    public: str


@pytest.fixture(scope="module")
def nkey(tmp_path_factory: pytest.TempPathFactory) -> NKey:
    seed = nkeys.encode_seed(os.urandom(32), nkeys.PREFIX_BYTE_USER)
    path = tmp_path_factory.mktemp("nkey") / "replica.nk"
    path.write_bytes(seed + b"\n")
    return NKey(path, nkeys.from_seed(bytearray(seed)).public_key.decode())


def settings(**values: Any) -> CoordinatorSettings:
    return CoordinatorSettings(nats_url="nats://127.0.0.1:4222", **values)


def test_without_files_there_are_no_options() -> None:
    assert connect_options(settings()) == {}


def test_files_become_nats_connect_options(pki: Pki, nkey: NKey, tmp_path: Path) -> None:
    creds = tmp_path / "replica.creds"
    creds.write_text("-----BEGIN NATS USER JWT-----\n…\n------END NATS USER JWT------\n")
    assert connect_options(settings(nats_creds=creds)) == {"user_credentials": str(creds)}
    options = connect_options(settings(nats_nkey=nkey.seed_file, nats_tls_ca=pki.ca))
    assert options["nkeys_seed"] == str(nkey.seed_file)
    context = options["tls"]
    assert isinstance(context, ssl.SSLContext)
    assert context.verify_mode == ssl.CERT_REQUIRED and context.check_hostname
    assert [cert["subject"] for cert in context.get_ca_certs()] == [((("commonName", "test NATS CA"),),)]
    with_client_cert = connect_options(settings(nats_tls_cert=pki.client_cert, nats_tls_key=pki.client_key))
    assert set(with_client_cert) == {"tls"}  # the system's CAs, and this client certificate


def test_the_settings_are_read_from_their_env_vars(pki: Pki, nkey: NKey, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DARKBLOOM_NATS_NKEY", str(nkey.seed_file))
    monkeypatch.setenv("DARKBLOOM_NATS_TLS_CA", str(pki.ca))
    loaded = settings()
    assert (loaded.nats_nkey, loaded.nats_tls_ca) == (nkey.seed_file, pki.ca)


@pytest.mark.parametrize(("values", "message"), [
    ({"nats_tls_ca": "/nonexistent/ca.pem"}, "--nats-tls-ca: no such file: /nonexistent/ca.pem"),
    ({"nats_nkey": "/nonexistent/replica.nk"}, "--nats-nkey: no such file: /nonexistent/replica.nk"),
    ({"nats_tls_cert": "CERT"}, "--nats-tls-cert and --nats-tls-key go together"),
    ({"nats_tls_key": "KEY"}, "--nats-tls-cert and --nats-tls-key go together"),
    ({"nats_creds": "NKEY", "nats_nkey": "NKEY"}, "give --nats-creds or --nats-nkey, not both"),
])
def test_a_missing_file_or_half_a_pair_is_a_clear_error(values: dict[str, str], message: str, pki: Pki,
                                                         nkey: NKey) -> None:
    files = {"CERT": str(pki.client_cert), "KEY": str(pki.client_key), "NKEY": str(nkey.seed_file)}
    with pytest.raises(ValueError, match="^" + message):
        settings(**{name: files.get(value, value) for name, value in values.items()})


def test_nats_files_need_a_nats_url(nkey: NKey) -> None:
    with pytest.raises(ValueError, match="^--nats-nkey needs --nats-url$"):
        CoordinatorSettings(nats_nkey=nkey.seed_file)


def test_a_file_that_is_not_a_certificate_is_a_clear_error(tmp_path: Path, pki: Pki) -> None:
    junk = tmp_path / "junk.pem"
    junk.write_text("not a certificate\n")
    with pytest.raises(ValueError, match="^--nats-tls-ca: cannot load"):
        connect_options(settings(nats_tls_ca=junk))
    with pytest.raises(ValueError, match="^--nats-tls-cert/--nats-tls-key: cannot load"):
        connect_options(settings(nats_tls_cert=pki.client_cert, nats_tls_key=pki.server_key))


def test_the_coordinator_command_refuses_half_a_pair(pki: Pki) -> None:
    result = CliRunner().invoke(app, ["coordinator", "--nats-url", "nats://127.0.0.1:4222",
                                      "--nats-tls-cert", str(pki.client_cert)])
    assert result.exit_code == 2
    assert "--nats-tls-cert and --nats-tls-key go together" in result.output


# --- a real nats-server requiring TLS and credentials --------------------------------------------

def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _listening(port: int) -> bool:
    with socket.socket() as sock:
        return sock.connect_ex(("127.0.0.1", port)) == 0


def _nats_server(tmp: Path, config: str) -> Iterator[str]:
    port = _free_port()
    (tmp / "nats.conf").write_text(f"listen: 127.0.0.1:{port}\n{config}")
    process = subprocess.Popen([NATS_SERVER, "-c", str(tmp / "nats.conf")], stdout=subprocess.DEVNULL,
                               stderr=subprocess.PIPE)
    try:
        for _ in range(500):
            if _listening(port):
                break
            assert process.poll() is None, process.stderr.read().decode() if process.stderr else ""
            time.sleep(0.01)
        yield f"nats://127.0.0.1:{port}"
    finally:
        process.terminate()
        process.wait(10)


@pytest.fixture(scope="module")
def secured_nats(tmp_path_factory: pytest.TempPathFactory, pki: Pki, nkey: NKey) -> Iterator[str]:
    """TLS required; users: alice with a password, and the nkey."""
    yield from _nats_server(tmp_path_factory.mktemp("nats"), f"""
tls {{ cert_file: "{pki.server_cert}", key_file: "{pki.server_key}", timeout: 2 }}
authorization {{ users = [ {{user: alice, password: "{PASSWORD}"}}, {{nkey: "{nkey.public}"}} ] }}
""")


@pytest.fixture(scope="module")
def mutual_tls_nats(tmp_path_factory: pytest.TempPathFactory, pki: Pki) -> Iterator[str]:
    """A client certificate signed by the CA required."""
    yield from _nats_server(tmp_path_factory.mktemp("nats-mtls"), f"""
tls {{ cert_file: "{pki.server_cert}", key_file: "{pki.server_key}", ca_file: "{pki.ca}", verify: true,
      timeout: 2 }}
""")


async def _ignore(_exc: Exception) -> None:
    return None


async def _connect(url: str, options: dict[str, Any]) -> Client:
    return await nats.connect(url, allow_reconnect=False, max_reconnect_attempts=0, connect_timeout=2,
                              error_cb=_ignore, **options)


async def _round_trip(client: Client) -> bytes:
    subscription = await client.subscribe("t.echo")
    await client.publish("t.echo", b"hello")
    message = await subscription.next_msg(timeout=5)
    await client.close()
    return bytes(message.data)


def _with_password(url: str) -> str:
    return url.replace("nats://", f"nats://alice:{PASSWORD}@")


async def test_a_password_in_the_url_and_the_ca_get_in(secured_nats: str, pki: Pki) -> None:
    client = await _connect(_with_password(secured_nats), connect_options(settings(nats_tls_ca=pki.ca)))
    assert await _round_trip(client) == b"hello"


async def test_an_nkey_and_the_ca_get_in(secured_nats: str, pki: Pki, nkey: NKey) -> None:
    client = await _connect(secured_nats, connect_options(settings(nats_nkey=nkey.seed_file, nats_tls_ca=pki.ca)))
    assert await _round_trip(client) == b"hello"


async def test_without_credentials_the_server_refuses(secured_nats: str, pki: Pki) -> None:
    with pytest.raises(nats.errors.Error, match="Authorization Violation"):
        await _connect(secured_nats, connect_options(settings(nats_tls_ca=pki.ca)))


async def test_without_the_ca_the_certificate_does_not_verify(secured_nats: str, pki: Pki, nkey: NKey) -> None:
    with pytest.raises(ssl.SSLCertVerificationError):
        await _connect(_with_password(secured_nats), connect_options(settings(nats_tls_ca=pki.other_ca)))
    with pytest.raises(ssl.SSLCertVerificationError):  # the system's CAs do not know it either
        await _connect(secured_nats, connect_options(settings(nats_nkey=nkey.seed_file)))


async def test_a_client_certificate_gets_in_where_one_is_required(mutual_tls_nats: str, pki: Pki) -> None:
    both = connect_options(settings(nats_tls_ca=pki.ca, nats_tls_cert=pki.client_cert,
                                    nats_tls_key=pki.client_key))
    assert await _round_trip(await _connect(mutual_tls_nats, both)) == b"hello"
    with pytest.raises((OSError, nats.errors.Error)):  # the server drops it: a reset, or an EOF
        await _connect(mutual_tls_nats, connect_options(settings(nats_tls_ca=pki.ca)))


# --- the logs ----------------------------------------------------------------------------------

def _connection(url: str, options: dict[str, Any]) -> Connection:
    roster = Roster(ReplicaKey("inst_test"), engine=None, stale_after=30)  # type: ignore[arg-type]
    return Connection(url, "test", Authenticator(roster), options)


async def _until(condition: Callable[[], bool]) -> None:
    while not condition():
        await asyncio.sleep(0.01)


def _messages(caplog: pytest.LogCaptureFixture, part: str) -> list[str]:
    return [record.getMessage() for record in caplog.records if part in record.getMessage()]


async def test_the_logs_of_a_connection_hide_its_password(secured_nats: str, pki: Pki,
                                                         caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    connection = _connection(_with_password(secured_nats), connect_options(settings(nats_tls_ca=pki.ca)))
    task = asyncio.create_task(connection.run(lambda _client: asyncio.sleep(0)))
    try:
        await _until(lambda: connection.connected)
    finally:
        await connection.close()
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    assert _messages(caplog, "connected to NATS at") == [f"connected to NATS at {redacted(_with_password(secured_nats))}"]
    assert "nats://alice:***@127.0.0.1:" in caplog.text
    assert PASSWORD not in caplog.text and PASSWORD not in connection.url


async def test_the_warning_of_a_connection_that_cannot_start_hides_its_password(
        nkey: NKey, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    seed = tmp_path / "gone.nk"
    seed.write_bytes(nkey.seed_file.read_bytes())
    options = connect_options(settings(nats_nkey=seed))
    seed.unlink()  # e.g. a secret no longer mounted: nats-py cannot even start connecting
    caplog.set_level(logging.DEBUG)
    connection = _connection(f"nats://alice:{PASSWORD}@127.0.0.1:{_free_port()}", options)
    task = asyncio.create_task(connection.run(lambda _client: asyncio.sleep(0)))
    try:
        await _until(lambda: bool(_messages(caplog, "unreachable")))
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    assert _messages(caplog, "unreachable")[0].startswith("NATS at nats://alice:***@127.0.0.1:")
    assert PASSWORD not in caplog.text
