"""How aggregator instances come and go on a node: the ``Actuator`` seam.

The agent decides which task runs where and when an instance is started or let go; an
actuator carries it out. ``LocalProcesses`` runs each instance as a process on this machine
(``lifl up``); a Kubernetes actuator plugs in behind the same calls. An instance that goes
away, for whatever reason, is reported by its control connection closing.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from lifl.channel import KeyTransport
from lifl.protocol import Message
from lifl.rpc import Connection
from lifl.store import Tenant

STOP_GRACE = 3.0  # seconds an instance has to exit once its control connection is closed


class Actuator(Protocol):
    def spawn(self, tenant: Tenant) -> int:
        """Start an instance for ``tenant`` (a cold start); returns its id. Its endpoint exists
        before it runs, so keys sent to it wait for it."""

    def stop(self, instance: int) -> None:
        """Let an instance go (it finishes nothing more)."""

    def invoke(self, instance: int, message: Message) -> None:
        """Push a control message (an invocation, a cancellation) to the instance."""


@dataclass(eq=False)
class _Process:
    proc: subprocess.Popen
    conn: Connection
    tenant: Tenant


class LocalProcesses:
    """Instances as processes of ``python -m lifl.runtime``, each with a control connection
    (served by ``serve(instance id, connection)`` on a thread of its own, which returns when the
    process goes) and an endpoint of the node's key transport."""

    def __init__(self, node: str, keys: KeyTransport, handler: str, serve: Callable[[int, Connection], None]) -> None:
        self.node = node
        self.keys = keys
        self.handler = handler
        self._serve = serve
        self._procs: dict[int, _Process] = {}
        self._lock = threading.Lock()
        self._next_id = 0

    def spawn(self, tenant: Tenant) -> int:
        with self._lock:
            self._next_id += 1
            iid = self._next_id
        chan, spec = self.keys.provision(tenant, iid)
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        cmd = [
            sys.executable, "-m", "lifl.runtime", "--instance", str(iid), "--tenant", tenant.name,
            "--node", self.node, "--channel", spec,
            "--control-fd", str(theirs.fileno()), "--channel-fd", str(chan.fileno()), "--handler", self.handler,
        ]
        if tenant.uid is not None:
            cmd += ["--user", str(tenant.uid)]
        env = {k: v for k, v in os.environ.items() if k in ("PATH", "PYTHONPATH", "LANG", "LC_ALL")}
        env["HOME"] = "/"
        env["PYTHONDONTWRITEBYTECODE"] = "1"
        proc = subprocess.Popen(cmd, pass_fds=(theirs.fileno(), chan.fileno()), cwd="/", env=env)
        theirs.close()
        chan.close()
        conn = Connection(ours)
        with self._lock:
            self._procs[iid] = _Process(proc, conn, tenant)
        threading.Thread(target=self._run, args=(iid, conn), name=f"instance-{iid}", daemon=True).start()
        return iid

    def _run(self, iid: int, conn: Connection) -> None:
        try:
            self._serve(iid, conn)
        finally:
            with self._lock:
                p = self._procs.pop(iid, None)
            if p is not None:
                self.keys.retire(p.tenant, iid)
                _reap(p.proc)


    def stop(self, instance: int) -> None:
        with self._lock:
            p = self._procs.get(instance)
        if p is not None:
            p.conn.close()  # the runtime exits when its control connection closes

    def invoke(self, instance: int, message: Message) -> None:
        with self._lock:
            p = self._procs.get(instance)
        if p is None:
            raise ConnectionError(f"instance {instance} is gone")
        p.conn.send(message.encode())

    def stop_all(self) -> None:
        with self._lock:
            procs = list(self._procs.values())
        for p in procs:
            p.conn.close()
        for p in procs:
            _reap(p.proc)


def _reap(proc: subprocess.Popen, grace: float = STOP_GRACE) -> None:
    """Wait for an instance whose connection is gone (it exits on EOF), so that it leaves no
    zombie and its CPU time is charged to the agent; kill it if it does not go."""
    try:
        proc.wait(grace)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
