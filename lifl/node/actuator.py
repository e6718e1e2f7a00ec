"""How aggregator instances come and go on a node: the ``Actuator`` seam.

The agent decides which task runs where and when an instance is let go; an actuator carries it
out. ``LocalProcesses`` starts each instance as a process on this machine (``lifl up``);
``ClusterPods`` starts none: the cluster runs a tenant's function pods on the node (scaled by
lifl's operator), and each one attaches to the agent's function socket. Both accept attached
instances, and both report an instance that goes away, for whatever reason, by its control
connection closing.
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

from lifl.keys.transport import KeyTransport
from lifl.protocol import Attached, Message
from lifl.rpc import Connection, reply_frame
from lifl.store import Tenant

STOP_GRACE = 3.0  # seconds an instance has to exit once its control connection is closed
ACTUATORS = ("processes", "pods")  # what ``lifl up --functions`` takes


class Actuator(Protocol):
    starts_instances: bool  # False: instances are started elsewhere (pods) and only attach

    def spawn(self, tenant: Tenant, preload: tuple[str, ...] = ()) -> int | None:
        """Start an instance for ``tenant`` (a cold start); returns its id, or None if this
        actuator starts none. Its endpoint exists before it runs, so keys sent to it wait.
        ``preload``: modules it imports before it drops to the tenant's identity (torch, for
        inference queries: the tenant may not read the interpreter's files)."""

    def attach(self, tenant: Tenant, request_id: object, conn: Connection) -> int:
        """Take an instance that connected by itself (its ``Attach`` was checked): provision its
        endpoint, answer ``request_id`` with ``Attached`` and the endpoint, and serve it."""

    def stop(self, instance: int) -> None:
        """Let an instance go (it finishes nothing more)."""

    def invoke(self, instance: int, message: Message) -> None:
        """Push a control message (an invocation, a cancellation) to the instance."""

    def stop_all(self) -> None:
        """Shutdown: let every instance go."""


@dataclass(eq=False)
class _Instance:
    conn: Connection
    tenant: Tenant
    proc: subprocess.Popen | None = None  # None: attached, not ours to reap
    serving: threading.Thread | None = None


class _Instances:
    """What both actuators share: each instance's control connection (served by ``serve(instance
    id, connection)`` on a thread of its own, which returns when the instance goes) and its
    endpoint of the node's key transport."""

    def __init__(self, node: str, keys: KeyTransport, serve: Callable[[int, Connection], None]) -> None:
        self.node = node
        self.keys = keys
        self._serve = serve
        self._instances: dict[int, _Instance] = {}
        self._lock = threading.Lock()
        self._next_id = 0

    def _new_id(self) -> int:
        with self._lock:
            self._next_id += 1
            return self._next_id

    def _track(self, iid: int, instance: _Instance) -> None:
        instance.serving = threading.Thread(target=self._run, args=(iid, instance.conn), name=f"instance-{iid}", daemon=True)
        with self._lock:
            self._instances[iid] = instance
        instance.serving.start()

    def attach(self, tenant: Tenant, request_id: object, conn: Connection) -> int:
        iid = self._new_id()
        chan, spec = self.keys.provision(tenant, iid)
        try:
            conn.send(reply_frame(request_id, Attached(iid, self.node, spec)), [chan.fileno()])
        except OSError:
            self.keys.retire(tenant, iid)
            raise
        finally:
            chan.close()
        self._track(iid, _Instance(conn, tenant))
        return iid

    def _run(self, iid: int, conn: Connection) -> None:
        try:
            self._serve(iid, conn)
        finally:
            with self._lock:
                instance = self._instances.pop(iid, None)
            if instance is not None:
                self.keys.retire(instance.tenant, iid)
                if instance.proc is not None:
                    _reap(instance.proc)

    def stop(self, instance: int) -> None:
        with self._lock:
            i = self._instances.get(instance)
        if i is not None:
            i.conn.close()  # a runtime exits (a pod's attaches again, as a new instance) when it closes

    def invoke(self, instance: int, message: Message) -> None:
        with self._lock:
            i = self._instances.get(instance)
        if i is None:
            raise ConnectionError(f"instance {instance} is gone")
        i.conn.send(message.encode())

    def stop_all(self) -> None:
        with self._lock:
            instances = list(self._instances.values())
        for i in instances:
            i.conn.close()
        for i in instances:
            if i.proc is not None:
                _reap(i.proc)
        for i in instances:  # each retires its endpoint as it ends: before the transport closes
            if i.serving is not None:
                i.serving.join(STOP_GRACE)


class LocalProcesses(_Instances):
    """Instances as processes of ``python -m lifl.runtime`` started by the agent, each handed its
    control connection and its endpoint as inherited descriptors."""

    starts_instances = True

    def __init__(self, node: str, keys: KeyTransport, handler: str, serve: Callable[[int, Connection], None]) -> None:
        super().__init__(node, keys, serve)
        self.handler = handler

    def spawn(self, tenant: Tenant, preload: tuple[str, ...] = ()) -> int:
        iid = self._new_id()
        chan, spec = self.keys.provision(tenant, iid)
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        cmd = [
            sys.executable, "-m", "lifl.runtime", "--instance", str(iid), "--tenant", tenant.name,
            "--node", self.node, "--channel", spec,
            "--control-fd", str(theirs.fileno()), "--channel-fd", str(chan.fileno()), "--handler", self.handler,
        ]
        for module in preload:
            cmd += ["--preload", module]
        if tenant.uid is not None:
            cmd += ["--user", str(tenant.uid)]
        env = {k: v for k, v in os.environ.items() if k in ("PATH", "PYTHONPATH", "LANG", "LC_ALL")}
        env["HOME"] = "/"
        env["PYTHONDONTWRITEBYTECODE"] = "1"
        proc = subprocess.Popen(cmd, pass_fds=(theirs.fileno(), chan.fileno()), cwd="/", env=env)
        theirs.close()
        chan.close()
        self._track(iid, _Instance(Connection(ours), tenant, proc))
        return iid


class ClusterPods(_Instances):
    """Instances are the tenant's function pods the cluster runs on this node (lifl's operator
    scales and places them by the plan): the agent starts none and lets none go while idle;
    each pod attaches to the function socket, and one whose connection the agent closes
    attaches again as a fresh instance."""

    starts_instances = False

    def spawn(self, tenant: Tenant, preload: tuple[str, ...] = ()) -> None:
        return None


def _reap(proc: subprocess.Popen, grace: float = STOP_GRACE) -> None:
    """Wait for an instance whose connection is gone (it exits on EOF), so that it leaves no
    zombie and its CPU time is charged to the agent; kill it if it does not go."""
    try:
        proc.wait(grace)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
