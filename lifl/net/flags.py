"""The gateway's connection limits and TLS files as command-line flags: its own, and `lifl up`'s,
which passes them on to the gateway it starts."""

from __future__ import annotations

import argparse
import ipaddress
import os
import ssl

from lifl.net.limits import ConnectionLimits
from lifl.net.tls import ALPN_H2, ALPN_HTTP, ServerTls

# flag -> (ConnectionLimits field, type, help); the defaults are ConnectionLimits' (lifl.net.limits)
LIMIT_FLAGS: dict[str, tuple[str, type, str]] = {
    "--idle-timeout": ("idle_timeout", float, "seconds a connection may wait for its next request"),
    "--head-timeout": ("head_timeout", float, "seconds from a request's first byte to the end of its head"),
    "--min-body-rate": ("min_body_rate", float, "bytes/s a request body must keep up while it is awaited (0: no minimum)"),
    "--body-grace": ("body_grace", float, "seconds of awaiting a body before the minimum rate applies"),
    "--body-window": ("body_window", float, "seconds' worth of bytes a body may fall behind the minimum rate"),
    "--max-connections": ("max_connections", int, "connections served at once"),
    "--max-connections-per-peer": ("max_per_peer", int, "connections from one address"),
    "--reserved-connections": ("reserved", int, "connections beyond the limits that answer only health checks"),
    "--upload-idle": ("upload_idle", float, "seconds an incomplete resumable upload is kept without a PATCH"),
    "--max-uploads": ("max_uploads", int, "incomplete resumable uploads the gateway holds"),
    "--max-uploads-per-principal": ("max_uploads_per_principal", int, "incomplete resumable uploads of one caller"),
}


def add_limit_arguments(p: argparse.ArgumentParser) -> None:
    defaults = ConnectionLimits()
    for flag, (name, kind, text) in LIMIT_FLAGS.items():
        p.add_argument(flag, dest=name, type=kind, default=getattr(defaults, name), help=f"{text} (default %(default)s)")


def limits_from(args: argparse.Namespace) -> ConnectionLimits:
    try:
        return ConnectionLimits(**{name: getattr(args, name) for name, _, _ in LIMIT_FLAGS.values()})
    except ValueError as e:
        raise SystemExit(f"lifl: {e}") from None


def limit_argv(limits: ConnectionLimits) -> list[str]:
    """The gateway's flags for ``limits``."""
    return [arg for flag, (name, _, _) in LIMIT_FLAGS.items() for arg in (flag, str(getattr(limits, name)))]


# flag -> (ServerTls field, help)
TLS_FLAGS: dict[str, tuple[str, str]] = {
    "--tls-cert": ("cert", "serve HTTP and gRPC over TLS (1.2 or later) with this PEM certificate chain"),
    "--tls-key": ("key", "the certificate's PEM private key (default: in the --tls-cert file)"),
    "--tls-client-ca": ("client_ca", "ask clients for certificates and accept those signed by these PEM CAs (mutual "
                                      "TLS; clients without one may still use tokens)"),
    "--tls-peer-ca": ("peer_ca", "PEM CAs that other nodes' gateway certificates must chain to (default: the "
                                 "--tls-cert file, for nodes that share a certificate or a CA in their chain)"),
}


def add_tls_arguments(p: argparse.ArgumentParser) -> None:
    for flag, (name, text) in TLS_FLAGS.items():
        p.add_argument(flag, dest=f"tls_{name}", metavar="PEM", help=text)


def tls_from(args: argparse.Namespace) -> ServerTls | None:
    """The TLS files the flags name (None: no TLS), checked by loading them once."""
    files = {name: getattr(args, f"tls_{name}") for name, _ in TLS_FLAGS.values()}
    files = {name: os.path.abspath(path) if path else None for name, path in files.items()}  # the same from any directory
    if files["cert"] is None:
        if any(files.values()):
            raise SystemExit("lifl: --tls-key, --tls-client-ca and --tls-peer-ca need --tls-cert")
        return None
    tls = ServerTls(**files)
    try:
        tls.context(ALPN_HTTP)
        tls.peer_context()
    except (OSError, ssl.SSLError, ValueError) as e:
        raise SystemExit(f"lifl: cannot use the TLS files ({', '.join(f for f in files.values() if f)}): {e}") from None
    return tls


def server_contexts(tls: ServerTls) -> tuple[ssl.SSLContext, ssl.SSLContext]:
    """(HTTP, gRPC) front ends' contexts: the files are read now."""
    return tls.context(ALPN_HTTP), tls.context(ALPN_H2)


def tls_argv(tls: ServerTls | None) -> list[str]:
    """The gateway's (and `lifl up`'s) flags for ``tls``."""
    if tls is None:
        return []
    return [arg for flag, (name, _) in TLS_FLAGS.items() if getattr(tls, name) for arg in (flag, str(getattr(tls, name)))]


def plaintext_warning(*addresses: str) -> str:
    """The one log line of a node serving without TLS; it says so louder if other machines can reach it."""
    exposed = [a for a in addresses if not _is_loopback(a.rpartition(":")[0])]
    where = f"; {', '.join(exposed)} can be reached from other machines" if exposed else " (loopback only)"
    return f"lifl: TLS is off: HTTP and gRPC traffic, tokens included, is unencrypted{where}; --tls-cert and --tls-key turn TLS on"


def _is_loopback(host: str) -> bool:
    host = host.strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a host name: it may resolve to anything
