"""TLS for the gateway's front ends, the client SDK and gateway-to-gateway traffic.

Contexts: a server's from its certificate, its key and (mutual TLS) the CAs its clients'
certificates must chain to, TLS 1.2 at least and one ALPN protocol (``h2`` for gRPC,
``http/1.1`` for HTTP); a client's verifying the server against the system's CAs or a CA
file, with the host name checked, optionally presenting a client certificate.

The kernel here has no kernel TLS, so records are encrypted and decrypted in user space.
Received records are still decrypted straight into the caller's buffer (``recv_into`` on the
shared-memory object: no copy beyond the decryption itself); what is sent with ``sendfile``
or ``sendmsg`` over plain TCP is encrypted from the same memory instead (lifl.net.io for
blocking sockets; the gateway's event loop drives its connections' non-blocking ssl sockets,
gateway/stream.py).
"""

from __future__ import annotations

import http.client
import os
import socket
import ssl
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ALPN_HTTP = "http/1.1"
ALPN_H2 = "h2"
MIN_VERSION = ssl.TLSVersion.TLSv1_2
MAX_WRITE = 256 << 10  # plaintext bytes per TLS write call: bounds how long one thread holds a connection's lock
HTTPS = "https://"

PathLike = str | os.PathLike[str]


# -- contexts ------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ServerTls:
    """A node's TLS files (``lifl up --tls-cert ...``, passed on to its gateway)."""

    cert: str  # PEM: the gateway's certificate chain
    key: str | None = None  # PEM: its private key; None: in the cert file
    client_ca: str | None = None  # PEM: CAs of client certificates (mutual TLS, optional per client)
    peer_ca: str | None = None  # PEM: CAs of other nodes' gateways; None: the cert file (see peer_context)

    def context(self, alpn: str) -> ssl.SSLContext:
        """The front end's context: TLS 1.2+, ``alpn`` advertised. With ``client_ca`` clients are
        asked for a certificate but need not send one (they may use a token instead); one that
        does not chain to ``client_ca`` fails the handshake."""
        ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH, cafile=self.client_ca)  # trusts nothing else
        ctx.minimum_version = MIN_VERSION
        ctx.options |= ssl.OP_NO_RENEGOTIATION  # a renegotiation would interleave reads and writes of one connection
        ctx.load_cert_chain(self.cert, self.key)
        ctx.set_alpn_protocols([alpn])
        if self.client_ca:
            ctx.verify_mode = ssl.CERT_OPTIONAL
        return ctx

    def peer_context(self) -> ssl.SSLContext:
        """How this node connects to the other nodes' gateways (which serve TLS too: a cluster's
        nodes are configured alike): their certificates must chain to ``peer_ca``, by default to
        a certificate of this node's own cert file (partial chains allowed: nodes that share one
        certificate, or whose chains carry a shared CA, trust each other without more files),
        and must name the address the peer registered. No client certificate is presented:
        peers authenticate like any client (their own credentials), and a node certificate is
        not a client's identity."""
        ctx = ssl.create_default_context(cafile=self.peer_ca or self.cert)
        ctx.minimum_version = MIN_VERSION
        ctx.verify_flags |= ssl.VERIFY_X509_PARTIAL_CHAIN
        ctx.set_alpn_protocols([ALPN_HTTP])
        return ctx


@dataclass(frozen=True)
class ClientTls:
    """TLS for the client SDK. By default the gateway's certificate must chain to one of the
    system's CAs and name the host of the address the client connects to."""

    ca: PathLike | None = None  # PEM: the CAs to trust instead of the system's
    cert: PathLike | None = None  # PEM: a client certificate chain (mutual TLS)
    key: PathLike | None = None  # PEM: its private key; None: in the cert file
    server_name: str | None = None  # the name the certificate must carry, if not the address's host

    def context(self, alpn: str) -> ssl.SSLContext:
        ctx = ssl.create_default_context(cafile=self.ca)
        ctx.minimum_version = MIN_VERSION
        if self.cert is not None:
            ctx.load_cert_chain(self.cert, self.key)
        ctx.set_alpn_protocols([alpn])
        return ctx

    def grpc_credentials(self) -> Any:
        """grpcio's credentials for the same trust: the CA file, else the system's bundle (else
        grpcio's own, if the system has none), and the client certificate if any."""
        import grpc

        system = ssl.get_default_verify_paths().cafile
        roots = Path(self.ca).read_bytes() if self.ca is not None else Path(system).read_bytes() if system else None
        chain = key = None
        if self.cert is not None:
            chain, key = Path(self.cert).read_bytes(), Path(self.key or self.cert).read_bytes()
        return grpc.ssl_channel_credentials(root_certificates=roots, private_key=key, certificate_chain=chain)


def client_settings(address: str, tls: ClientTls | bool | None) -> tuple[str, ClientTls | None]:
    """(host:port, TLS settings) of a gateway address: an ``https://`` address, ``tls=True`` or
    a ``ClientTls`` turns TLS on (an ``https://`` address with defaults unless ``tls`` says more)."""
    secure = address.startswith(HTTPS)
    address = address.removeprefix(HTTPS).removeprefix("http://")
    if isinstance(tls, ClientTls):
        return address, tls
    return address, ClientTls() if tls or secure else None


def server_name(address: str, tls: ClientTls) -> str:
    return tls.server_name or address.rpartition(":")[0].strip("[]")


def https_connection(address: str, tls: ClientTls, timeout: float) -> http.client.HTTPSConnection:
    """An http.client connection to ``address`` that verifies ``tls.server_name`` if given."""
    host, _, port = address.rpartition(":")
    return _HTTPSConnection(host, int(port), timeout=timeout, context=tls.context(ALPN_HTTP),
                            server_name=server_name(address, tls))


class _HTTPSConnection(http.client.HTTPSConnection):
    def __init__(self, host: str, port: int, *, timeout: float, context: ssl.SSLContext, server_name: str) -> None:
        super().__init__(host, port, timeout=timeout, context=context)
        self._server_name = server_name

    def connect(self) -> None:
        http.client.HTTPConnection.connect(self)
        self.sock = self._context.wrap_socket(self.sock, server_hostname=self._server_name)


def connection_closed(sock: ssl.SSLSocket) -> bool:
    """Whether the server closed a TLS connection that polls readable with no request
    outstanding: a record may have come that carries no data (a TLS 1.3 session ticket)."""
    timeout = sock.gettimeout()
    sock.setblocking(False)
    try:
        sock.recv(1)  # data nobody asked for, or the end: either way the connection is done
        return True
    except ssl.SSLWantReadError:
        return False  # only a record without data
    except OSError:
        return True
    finally:
        sock.settimeout(timeout)


# -- gateway to gateway ---------------------------------------------------------------------------------
_peer_context: ssl.SSLContext | None = None  # set once at the gateway's start; None: peers speak plain TCP


def configure_peers(context: ssl.SSLContext | None) -> None:
    global _peer_context
    _peer_context = context


def peer_connection(host: str, port: int, timeout: float) -> socket.socket:
    """A connection to another node's gateway (TLS if this one serves TLS)."""
    sock = socket.create_connection((host, port), timeout=timeout)
    if _peer_context is None:
        return sock
    try:
        return _peer_context.wrap_socket(sock, server_hostname=host)
    except BaseException:
        sock.close()
        raise


def peer_http_connection(host: str, port: int, timeout: float) -> http.client.HTTPConnection:
    if _peer_context is None:
        return http.client.HTTPConnection(host, port, timeout=timeout)
    return _HTTPSConnection(host, port, timeout=timeout, context=_peer_context, server_name=host)
