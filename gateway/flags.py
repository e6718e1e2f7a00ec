"""The gateway's connection limits as command-line flags: its own, and `lifl up`'s, which passes
them on to the gateway it starts."""

from __future__ import annotations

import argparse

from lifl.gateway.stream import ConnectionLimits

# flag -> (ConnectionLimits field, type, help); the defaults are ConnectionLimits' (gateway/stream.py)
LIMIT_FLAGS: dict[str, tuple[str, type, str]] = {
    "--idle-timeout": ("idle_timeout", float, "seconds a connection may wait for its next request"),
    "--head-timeout": ("head_timeout", float, "seconds from a request's first byte to the end of its head"),
    "--min-body-rate": ("min_body_rate", float, "bytes/s a request body must keep up while it is awaited (0: no minimum)"),
    "--body-grace": ("body_grace", float, "seconds of awaiting a body before the minimum rate applies"),
    "--body-window": ("body_window", float, "seconds' worth of bytes a body may fall behind the minimum rate"),
    "--max-connections": ("max_connections", int, "connections served at once"),
    "--max-connections-per-peer": ("max_per_peer", int, "connections from one address"),
    "--reserved-connections": ("reserved", int, "connections beyond the limits that answer only health checks"),
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
