"""The unix key transport: unix datagram sockets, one per instance, named by instance id in a
per-tenant directory that only the tenant's group may write to (so the kernel keeps tenants
apart, and a message's tenant field is checked on receipt).
"""

from __future__ import annotations

import os
import socket
from pathlib import Path

from lifl.keys.record import MESSAGE_BYTES, KeyMessage, stamped
from lifl.net.io import ready
from lifl.store import Tenant


class UnixEndpoint:
    """A unix datagram socket; sends go to ``directory/<dest>``. Messages are stamped with the
    endpoint's tenant, and messages of another tenant are refused on receipt."""

    def __init__(self, sock: socket.socket, directory: Path, tenant: int) -> None:
        self._sock = sock
        self._dir = directory
        self.tenant = tenant

    def send(self, message: KeyMessage) -> None:
        self._sock.sendto(stamped(message, self.tenant), str(self._dir / str(message.dest)))

    def try_send(self, message: KeyMessage) -> bool:
        try:
            self._sock.sendto(stamped(message, self.tenant), socket.MSG_DONTWAIT, str(self._dir / str(message.dest)))
            return True
        except BlockingIOError:
            return False

    def recv(self, timeout: float | None = None) -> KeyMessage | None:
        if timeout is not None:
            if not ready([self._sock], timeout):
                return None
        message = KeyMessage.unpack(self._sock.recv(MESSAGE_BYTES + 1))
        if message.tenant != self.tenant:
            raise ValueError(f"a key message of tenant {message.tenant} reached an endpoint of tenant {self.tenant}")
        return message

    def fileno(self) -> int:
        return self._sock.fileno()

    def close(self) -> None:
        self._sock.close()


class UnixTransport:
    """Endpoints in ``directory/<tenant>/<instance id>``: the tenant's directory is 0750 and its
    group the tenant's, so only the agent and the tenant's functions reach its sockets."""

    name = "unix"

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self._senders: dict[str, UnixEndpoint] = {}

    def _tenant_dir(self, tenant: Tenant) -> Path:
        directory = self.directory / tenant.name
        if not directory.exists():
            directory.mkdir(exist_ok=True)
            os.chmod(directory, 0o750)
            if tenant.gid is not None:
                os.chown(directory, -1, tenant.gid)
        return directory

    def provision(self, tenant: Tenant, instance: int) -> tuple[socket.socket, str]:
        directory = self._tenant_dir(tenant)
        path = directory / str(instance)
        path.unlink(missing_ok=True)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        sock.bind(str(path))
        os.chmod(path, 0o660)
        if tenant.gid is not None:
            os.chown(path, -1, tenant.gid)
        return sock, f"{self.name}:{tenant.id}:{directory}"

    def retire(self, tenant: Tenant, instance: int) -> None:
        (self.directory / tenant.name / str(instance)).unlink(missing_ok=True)

    def sender(self, tenant: Tenant) -> UnixEndpoint:
        endpoint = self._senders.get(tenant.name)
        if endpoint is None:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
            endpoint = self._senders.setdefault(tenant.name, UnixEndpoint(sock, self._tenant_dir(tenant), tenant.id))
        return endpoint

    def close(self) -> None:
        for endpoint in self._senders.values():
            endpoint.close()
        self._senders.clear()

    def collector(self) -> None:
        return None  # the kernel counts nothing of unix datagrams for us
