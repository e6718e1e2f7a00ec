"""The key transport's interface, which every implementation (``lifl.keys.unix``,
``lifl.keys.ebpf``) provides.

A ``KeyTransport`` is the agent's side (``provision`` an endpoint for each instance before it
starts, ``retire`` it, a ``sender`` per tenant for the agent's own keys); an instance attaches
to its endpoint from the descriptor and the spec it was given (``lifl.keys.factory.attach``),
and sends and receives through the ``KeyEndpoint`` it gets.
"""

from __future__ import annotations

import socket
from typing import Protocol

from prometheus_client.registry import Collector

from lifl.keys.record import KeyMessage
from lifl.store import Tenant


class KeyEndpoint(Protocol):
    """One endpoint: tx routes by ``message.dest``; rx takes what was sent to this one."""

    def send(self, message: KeyMessage) -> None:
        """tx. Blocks while the destination's queue is full; raises ConnectionRefusedError if
        the destination does not exist."""

    def try_send(self, message: KeyMessage) -> bool:
        """tx without blocking: False if the destination's queue is full."""

    def recv(self, timeout: float | None = None) -> KeyMessage | None:
        """rx: the next message, or None after ``timeout`` seconds."""

    def fileno(self) -> int:
        """For select(); readable when a message is waiting."""

    def close(self) -> None:
        """exit."""


class KeyTransport(Protocol):
    """A node's key transport, the agent's side."""

    name: str

    def provision(self, tenant: Tenant, instance: int) -> tuple[socket.socket, str]:
        """The endpoint of a new instance, made before it starts so that keys sent to a
        cold-starting instance wait for it: its socket (handed to the instance, which attaches
        to it) and the spec ``attach`` takes with it."""

    def retire(self, tenant: Tenant, instance: int) -> None:
        """The instance is gone: its endpoint goes too."""

    def sender(self, tenant: Tenant) -> KeyEndpoint:
        """The agent's endpoint for sending keys to ``tenant``'s instances."""

    def close(self) -> None:
        """Shutdown: everything the transport set up goes."""

    def collector(self) -> Collector | None:
        """Its own metrics, read when Prometheus scrapes (None: it has none)."""
