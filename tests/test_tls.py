"""TLS on the gateway's front ends and in the SDK: handshakes on the event loop within the head
timeout, client certificates (trusted, untrusted, none), protocol versions, ALPN, plain
text on a TLS port, and the data paths (uploads decrypted into shared memory, models sent from
it) on a real node, over both protocols."""

from __future__ import annotations

import datetime
import ipaddress
import socket
import ssl
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

import conftest
from conftest import OPERATOR_TOKEN, wait_for
from lifl import errors
from lifl import format as fmt
from lifl.client import NO_RETRY, ClientTls, ConnectionLost, Gateway
from lifl.gateway.stream import Conn, ConnectionProtocol, LoopServer, PeerGone, Wait
from lifl.net.io import sendmsg_all
from lifl.net.limits import ConnectionLimits
from lifl.net.loop import Loop
from lifl.net.tls import ALPN_H2, ALPN_HTTP, ServerTls

TENANT, JOB, CLIENT = "acme", "tlsjob", "alice"
MAX_LINE = 1 << 20  # of the echo server


# -- certificates ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class Pki:
    ca: Path  # the CA clients and servers trust
    server_cert: Path  # 127.0.0.1 and localhost, signed by ca
    server_key: Path
    client_cert: Path  # CN alice, O acme, OU tlsjob, signed by ca
    client_key: Path
    rogue_ca: Path  # a CA nobody trusts, and what it signed:
    rogue_server_cert: Path
    rogue_server_key: Path
    rogue_client_cert: Path  # the same subject as client_cert
    rogue_client_key: Path

    def server(self, *, client_ca: bool = True) -> ServerTls:
        return ServerTls(str(self.server_cert), str(self.server_key), str(self.ca) if client_ca else None)

    def client(self, *, cert: bool = False, rogue_cert: bool = False, ca: Path | None = None) -> ClientTls:
        if rogue_cert:
            return ClientTls(ca=ca or self.ca, cert=self.rogue_client_cert, key=self.rogue_client_key)
        if cert:
            return ClientTls(ca=ca or self.ca, cert=self.client_cert, key=self.client_key)
        return ClientTls(ca=ca or self.ca)


def _name(**attributes: str) -> x509.Name:
    oids = {"cn": NameOID.COMMON_NAME, "o": NameOID.ORGANIZATION_NAME, "ou": NameOID.ORGANIZATIONAL_UNIT_NAME}
    return x509.Name([x509.NameAttribute(oids[k], v) for k, v in attributes.items()])


def _issue(directory: Path, stem: str, subject: x509.Name, issuer: tuple[x509.Name, Any] | None, *,
           ca: bool = False, sans: list[x509.GeneralName] | None = None, usage: Any = None) -> tuple[Path, Any]:
    """A key and a certificate for ``subject``, signed by ``issuer`` (name, key), or self-signed."""
    key = ec.generate_private_key(ec.SECP256R1())
    issuer_name, issuer_key = issuer or (subject, key)
    now = datetime.datetime.now(datetime.timezone.utc)
    builder = (x509.CertificateBuilder().subject_name(subject).issuer_name(issuer_name).public_key(key.public_key())
               .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
               .not_valid_after(now + datetime.timedelta(days=1))
               .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
    if ca:
        builder = builder.add_extension(x509.KeyUsage(
            digital_signature=True, content_commitment=False, key_encipherment=False, data_encipherment=False,
            key_agreement=False, key_cert_sign=True, crl_sign=True, encipher_only=False, decipher_only=False), critical=True)
    if sans:
        builder = builder.add_extension(x509.SubjectAlternativeName(sans), critical=False)
    if usage:
        builder = builder.add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
    cert = builder.sign(issuer_key, hashes.SHA256())
    (directory / f"{stem}.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    (directory / f"{stem}.key").write_bytes(key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()))
    return directory / f"{stem}.pem", key


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    d = tmp_path_factory.mktemp("pki")
    server_sans = [x509.IPAddress(ipaddress.ip_address("127.0.0.1")), x509.DNSName("localhost")]
    ca_name, rogue_name = _name(cn="lifl test CA"), _name(cn="rogue CA")
    ca, ca_key = _issue(d, "ca", ca_name, None, ca=True)
    rogue, rogue_key = _issue(d, "rogue-ca", rogue_name, None, ca=True)
    server, _ = _issue(d, "server", _name(cn="gateway"), (ca_name, ca_key), sans=server_sans,
                       usage=ExtendedKeyUsageOID.SERVER_AUTH)
    client, _ = _issue(d, "client", _name(cn=CLIENT, o=TENANT, ou=JOB), (ca_name, ca_key), usage=ExtendedKeyUsageOID.CLIENT_AUTH)
    rogue_server, _ = _issue(d, "rogue-server", _name(cn="gateway"), (rogue_name, rogue_key), sans=server_sans,
                             usage=ExtendedKeyUsageOID.SERVER_AUTH)
    rogue_client, _ = _issue(d, "rogue-client", _name(cn=CLIENT, o=TENANT, ou=JOB), (rogue_name, rogue_key),
                             usage=ExtendedKeyUsageOID.CLIENT_AUTH)
    return Pki(ca, server, d / "server.key", client, d / "client.key", rogue, rogue_server, d / "rogue-server.key",
               rogue_client, d / "rogue-client.key")


# -- the loop server's handshake, unit level -----------------------------------------------------------
class EchoServer(LoopServer):
    """Answers each line with what the connection's TLS looks like from the server, then the line."""

    def protocol(self, conn: Conn) -> Echo:
        return Echo(conn)


class Echo(ConnectionProtocol):
    def __init__(self, conn: Conn) -> None:
        self.conn = conn
        conn.start_reading()

    def readable(self) -> None:
        conn = self.conn
        try:
            while True:
                end = conn.inbuf.find(b"\n")
                if end < 0:
                    if len(conn.inbuf) > MAX_LINE:
                        conn.close()
                        return
                    conn.fill(1 << 16)
                    continue
                cert = conn.peer_certificate
                subject = dict(rdn[0] for rdn in cert["subject"]) if cert else {}
                info = f"{conn.sock.version()} {conn.sock.selected_alpn_protocol()} cn={subject.get('commonName', '-')}\n"
                conn.write([info.encode(), conn.take(end + 1)])
        except Wait:
            pass
        except PeerGone:
            conn.close()


@pytest.fixture
def echo(pki: Pki) -> Iterator[EchoServer]:
    loop = Loop("echo")
    server = EchoServer(loop, "127.0.0.1", 0, ConnectionLimits(head_timeout=1.0, idle_timeout=30.0))
    server.use_tls(pki.server().context(ALPN_HTTP))
    server.start()  # runs the loop, until stop()
    yield server
    server.stop()


def _tls_client(server: LoopServer, tls: ClientTls, *, alpn: str = ALPN_HTTP,
                context: ssl.SSLContext | None = None) -> ssl.SSLSocket:
    raw = socket.create_connection(server.address, timeout=30)
    return (context or tls.context(alpn)).wrap_socket(raw, server_hostname="127.0.0.1")


def _echo(sock: ssl.SSLSocket, line: bytes = b"ping\n", parts: list[Any] | None = None) -> str:
    """Send ``line`` (as ``parts`` with sendmsg_all, if given); what the server said of the connection."""
    if parts is None:
        sock.sendall(line)
    else:
        sendmsg_all(sock, parts)
    data = b""
    while data.count(b"\n") < 2:
        chunk = sock.recv(4096)
        if not chunk:
            raise EOFError(f"closed after {data!r}")
        data += chunk
    info, echoed, _ = data.split(b"\n", 2)
    assert echoed + b"\n" == line
    return info.decode()


def test_trusted_client_certificate_is_exposed_to_the_front_end(echo: EchoServer, pki: Pki) -> None:
    with _tls_client(echo, pki.client(cert=True)) as sock:
        version, alpn, cn = _echo(sock).split()
    assert version in ("TLSv1.2", "TLSv1.3") and alpn == ALPN_HTTP and cn == f"cn={CLIENT}"


def test_no_client_certificate_is_accepted_without_an_identity(echo: EchoServer, pki: Pki) -> None:
    with _tls_client(echo, pki.client()) as sock:
        assert _echo(sock).endswith("cn=-")


def test_untrusted_client_certificate_fails_the_handshake_and_only_that_connection(echo: EchoServer, pki: Pki) -> None:
    with pytest.raises((ssl.SSLError, ConnectionError, EOFError)):  # TLS 1.3: the server's alert comes after the client's Finished
        with _tls_client(echo, pki.client(rogue_cert=True)) as sock:
            _echo(sock)
    with _tls_client(echo, pki.client(cert=True)) as sock:  # the server goes on
        assert _echo(sock).endswith(f"cn={CLIENT}")


def test_old_protocol_version_is_refused(echo: EchoServer, pki: Pki) -> None:
    old = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    old.load_verify_locations(pki.ca)
    old.minimum_version = old.maximum_version = ssl.TLSVersion.TLSv1_1
    old.set_ciphers("DEFAULT:@SECLEVEL=0")  # so that this client offers TLS 1.1 at all; the server must say no
    with pytest.raises(ssl.SSLError, match="(?i)alert protocol version"):  # the server's alert, not a local refusal
        _tls_client(echo, pki.client(), context=old).close()
    with _tls_client(echo, pki.client()) as sock:
        assert _echo(sock).startswith(("TLSv1.2", "TLSv1.3"))


def test_tls12_is_accepted(echo: EchoServer, pki: Pki) -> None:
    context = pki.client().context(ALPN_HTTP)
    context.maximum_version = ssl.TLSVersion.TLSv1_2
    with _tls_client(echo, pki.client(), context=context) as sock:
        assert _echo(sock).startswith("TLSv1.2 http/1.1")


def test_plain_text_on_a_tls_port_ends_that_connection(echo: EchoServer, pki: Pki) -> None:
    with socket.create_connection(echo.address, timeout=30) as plain:
        plain.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
        received = b""
        try:
            while chunk := plain.recv(4096):
                received += chunk
        except ConnectionResetError:
            pass
        assert b"HTTP/1.1" not in received  # at most a TLS alert, then the end
    with _tls_client(echo, pki.client()) as sock:
        assert _echo(sock)


def test_a_stalled_handshake_is_dropped_after_the_head_timeout(echo: EchoServer) -> None:
    with socket.create_connection(echo.address, timeout=30) as silent:
        started = time.monotonic()
        silent.sendall(b"\x16\x03\x01")  # the start of a ClientHello, and then nothing
        assert silent.recv(4096) == b""  # closed by the server, long before this client's timeout
        assert time.monotonic() - started >= echo.limits.head_timeout * 0.9  # by the deadline, not at once


def test_a_stalled_handshake_holds_up_no_other(echo: EchoServer, pki: Pki) -> None:
    """A peer stalling its handshake does not hold up anyone else's."""
    with socket.create_connection(echo.address, timeout=30):
        with _tls_client(echo, pki.client(cert=True)) as sock:
            assert _echo(sock).endswith(f"cn={CLIENT}")


def test_tls_socket_writes_gather_lists_and_large_buffers(echo: EchoServer, pki: Pki) -> None:
    """sendmsg_all over TLS (no sendmsg there): small parts joined, large ones sent as they are."""
    line = b"x" * 200_000 + b"\n"
    parts = [line[:9], memoryview(line)[9:100_009], line[100_009:100_010], line[100_010:]]
    with _tls_client(echo, pki.client()) as sock:
        assert _echo(sock, line, parts)


# -- a real node ----------------------------------------------------------------------------------------
@dataclass
class TlsNode:
    http: str
    grpc: str
    node: Any


def _start_node(redis_url: str, name: str, tls: ServerTls) -> tuple[Any, Path]:
    from lifl.node.supervisor import Node, NodeConfig

    base = Path(tempfile.mkdtemp(prefix="lifl-tls-", dir="/tmp"))
    base.chmod(0o755)
    node = Node(NodeConfig(node=name, http="127.0.0.1:0", grpc="127.0.0.1:0", redis=redis_url, run_dir=base / "run",
                           data_dir=base / "data", shm_capacity=1 << 30, keep_warm=30, operator_token=OPERATOR_TOKEN,
                           tls=tls))
    node.start()
    return node, base


@pytest.fixture(scope="module")
def tls_node(pki: Pki, redis_server: str) -> Iterator[TlsNode]:
    import shutil

    url = f"{redis_server}?db={next(conftest._db_counter)}"
    import redis

    redis.Redis.from_url(url).flushdb()
    node, base = _start_node(url, "tls1", pki.server())
    assert node.addresses is not None
    yield TlsNode(node.addresses.http, node.addresses.grpc, node)
    node.stop()
    shutil.rmtree(base, ignore_errors=True)


def _blob(n: int, seed: int = 0) -> bytes:
    return fmt.encode({"w": np.random.default_rng(seed).standard_normal(n).astype(np.float32)})


@pytest.mark.slow
@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_sdk_round_trip_over_tls(tls_node: TlsNode, pki: Pki, protocol: str) -> None:
    address = tls_node.http if protocol == "http" else tls_node.grpc
    gw = Gateway(address, protocol, tls=pki.client())
    job = f"rt{protocol}"
    try:
        gw.create_job(job, 2, tenant=TENANT)
        model = _blob(1000)
        assert gw.set_model(job, model) == 0
        version, got = gw.model(job)
        assert version == 0 and bytes(got) == model
        reply = gw.push(job, _blob(1000, 1), client="c1", samples=3, base_version=0)
        assert reply["version"] == 0
        assert gw.job(job)["round"]["received"] >= 1
    finally:
        gw.close()


@pytest.mark.slow
def test_https_address_turns_tls_on_and_checks_the_system_cas(tls_node: TlsNode) -> None:
    """Verification is on by default: the test CA is not among the system's."""
    gw = Gateway(f"https://{tls_node.http}", retry=NO_RETRY)
    try:
        with pytest.raises(ssl.SSLCertVerificationError):
            gw.job("anything")
    finally:
        gw.close()


@pytest.mark.slow
@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_sdk_refuses_a_gateway_signed_by_another_ca(tls_node: TlsNode, pki: Pki, protocol: str) -> None:
    address = tls_node.http if protocol == "http" else tls_node.grpc
    gw = Gateway(address, protocol, tls=pki.client(ca=pki.rogue_ca), retry=NO_RETRY)
    try:
        if protocol == "http":
            with pytest.raises(ssl.SSLCertVerificationError):
                gw.job("anything")
        else:
            with pytest.raises(ConnectionLost, match="(?i)certificate|handshake|ssl"):
                gw.job("anything")
            with pytest.raises(ssl.SSLCertVerificationError):
                gw.set_model("anything", _blob(10))
    finally:
        gw.close()


@pytest.mark.slow
@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_alpn(tls_node: TlsNode, pki: Pki, protocol: str) -> None:
    address, offered = (tls_node.http, ALPN_HTTP) if protocol == "http" else (tls_node.grpc, ALPN_H2)
    host, port = address.rsplit(":", 1)
    context = pki.client().context(offered)
    context.set_alpn_protocols([ALPN_H2, ALPN_HTTP])  # offer both: the server picks its own
    with context.wrap_socket(socket.create_connection((host, int(port)), timeout=30), server_hostname=host) as sock:
        assert sock.selected_alpn_protocol() == offered


@pytest.mark.slow
def test_plain_http_on_the_tls_port_fails_and_the_node_goes_on(tls_node: TlsNode, pki: Pki) -> None:
    host, port = tls_node.http.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=30) as plain:
        plain.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
        try:
            assert b"HTTP/1.1" not in plain.recv(4096)
        except ConnectionResetError:
            pass
    gw = Gateway(tls_node.http, tls=pki.client())
    try:
        gw.create_job("afterplain", 2, tenant=TENANT)
    finally:
        gw.close()


@pytest.mark.slow
@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_mutual_tls_client_certificate_stands_for_the_client(tls_node: TlsNode, pki: Pki, protocol: str) -> None:
    operator = Gateway(tls_node.http, tls=pki.client())
    try:
        try:
            operator.create_job(JOB, 2, tenant=TENANT)
            operator.set_model(JOB, _blob(10))
        except errors.Conflict:
            pass  # the other protocol's run created it
    finally:
        operator.close()
    address = tls_node.http if protocol == "http" else tls_node.grpc
    with_cert = Gateway(address, protocol, token="", tls=pki.client(cert=True), retry=NO_RETRY)
    without = Gateway(address, protocol, token="", tls=pki.client(), retry=NO_RETRY)
    try:
        lease = with_cert.take_lease(JOB, CLIENT)  # no token: the certificate authenticates
        assert lease["lease"]
        with_cert.release_lease(JOB, lease["lease"])
        with pytest.raises(errors.Unauthenticated):
            without.job(JOB)  # no certificate, no token
    finally:
        with_cert.close()
        without.close()


@pytest.mark.slow
def test_untrusted_client_certificate_is_rejected_by_the_node(tls_node: TlsNode, pki: Pki) -> None:
    host, port = tls_node.http.rsplit(":", 1)
    context = pki.client(rogue_cert=True).context(ALPN_HTTP)
    with pytest.raises((ssl.SSLError, ConnectionError)):
        with context.wrap_socket(socket.create_connection((host, int(port)), timeout=30), server_hostname=host) as sock:
            sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
            if not sock.recv(4096):
                raise ConnectionError("closed")
    gw = Gateway(tls_node.http, tls=pki.client(rogue_cert=True), retry=NO_RETRY)
    try:
        with pytest.raises((ConnectionLost, ssl.SSLError)):
            gw.job(JOB)
    finally:
        gw.close()


@pytest.mark.slow
def test_large_model_downloads_over_tls_on_both_protocols(tls_node: TlsNode, pki: Pki) -> None:
    """64 MiB sent from shared memory: encrypted from a mapping (HTTP), in flow-controlled frames (gRPC)."""
    http = Gateway(tls_node.http, tls=pki.client())
    grpc = Gateway(tls_node.grpc, "grpc", tls=pki.client())
    try:
        http.create_job("big", 2, tenant=TENANT)
        model = _blob(16 << 20, seed=7)  # 64 MiB of float32
        grpc.set_model("big", model)  # uploaded over TLS, decrypted into shared memory
        for gw in (http, grpc):
            version, got = gw.model("big")
            assert version == 0 and len(got) == len(model) and bytes(got) == model
    finally:
        http.close()
        grpc.close()


@pytest.mark.slow
@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_participant_keeps_tls_for_the_gateway_it_is_assigned(tls_node: TlsNode, pki: Pki, protocol: str) -> None:
    from lifl.client import Participant

    job = f"part{protocol}"
    operator = Gateway(tls_node.http, tls=pki.client())
    try:
        operator.create_job(job, 1, tenant=TENANT)
        operator.set_model(job, _blob(100))
    finally:
        operator.close()
    address = tls_node.http if protocol == "http" else tls_node.grpc
    participant = Participant(address, job, "p1", protocol=protocol, tls=pki.client())

    def train(state: dict[str, Any], version: int) -> tuple[dict[str, Any], int]:
        return state, 5

    try:
        assert participant.run_round(train).outcome == "accepted"
        assert participant.wait_for_version(0, timeout=60) == 1
    finally:
        participant.close()


@pytest.mark.slow
def test_peers_fetch_models_over_tls(tls_node: TlsNode, pki: Pki) -> None:
    """A second node serving TLS fetches a model it does not hold from the first, over TLS."""
    import shutil

    other, base = _start_node(tls_node.node.addresses.redis, "tls2", pki.server())
    try:
        first = Gateway(tls_node.http, tls=pki.client())
        second = Gateway(other.addresses.http, tls=pki.client())
        try:
            first.create_job("shared", 2, tenant=TENANT)
            model = _blob(1 << 20, seed=3)
            first.set_model("shared", model)
            version, got = wait_for(lambda: _model_or_none(second, "shared"), what="the replica on the second node")
            assert version == 0 and bytes(got) == model
        finally:
            first.close()
            second.close()
    finally:
        other.stop()
        shutil.rmtree(base, ignore_errors=True)


def _model_or_none(gw: Gateway, job: str) -> tuple[int, bytes] | None:
    try:
        return gw.model(job)
    except errors.Overloaded:  # the replica is being fetched
        return None


# -- flags ----------------------------------------------------------------------------------------------
def test_tls_flags_pass_from_lifl_up_to_the_gateway(pki: Pki) -> None:
    import argparse

    from lifl.net.flags import add_tls_arguments, tls_argv, tls_from

    parser = argparse.ArgumentParser()
    add_tls_arguments(parser)
    tls = tls_from(parser.parse_args(["--tls-cert", str(pki.server_cert), "--tls-key", str(pki.server_key),
                                      "--tls-client-ca", str(pki.ca)]))
    assert tls == pki.server()
    assert tls_from(parser.parse_args(tls_argv(tls))) == tls  # what the gateway is given
    assert tls_from(parser.parse_args([])) is None and tls_argv(None) == []
    with pytest.raises(SystemExit, match="need --tls-cert"):
        tls_from(parser.parse_args(["--tls-key", str(pki.server_key)]))
    with pytest.raises(SystemExit, match="cannot use the TLS files"):
        tls_from(parser.parse_args(["--tls-cert", str(pki.server_cert), "--tls-key", str(pki.client_key)]))  # not its key


def test_without_tls_one_line_says_traffic_is_unencrypted() -> None:
    from lifl.net.flags import plaintext_warning

    assert "unencrypted (loopback only)" in plaintext_warning("127.0.0.1:8080", "[::1]:50051")
    exposed = plaintext_warning("0.0.0.0:8080", "127.0.0.1:50051")
    assert "unencrypted" in exposed and "0.0.0.0:8080 can be reached from other machines" in exposed
    assert "\n" not in exposed
