"""How aggregator instances come and go on a node: the ``Actuator`` seam.

The agent decides which task runs where and when an instance is let go (``lifl.node.tasks``); an
actuator carries out what touches the machine. ``LocalProcesses`` starts each instance as a
process on this machine (``lifl up``); ``ClusterPods`` starts none: the cluster runs a tenant's
function pods on the node (scaled by lifl's operator), and each one attaches to the agent's
function socket. Both give an instance its endpoint of the node's key transport, and both
retire it when its control connection closes, for whatever reason (the agent serves that
connection on its event loop).
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

from lifl.keys.transport import KeyTransport
from lifl.store import Tenant

RUNTIME_MODULE = "lifl.runtime"  # what an instance runs: its command line names it and its node


def instance_pids(node: str) -> list[int]:
    """The running instances the node started, found by their command lines: an agent killed
    with SIGKILL leaves its children to init, and nothing else knows them."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            args = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue  # exited meanwhile
        if RUNTIME_MODULE.encode() in args and b"--node" in args and args.index(b"--node") + 1 < len(args) \
                and args[args.index(b"--node") + 1] == node.encode():
            found.append(int(entry.name))
    return found

STOP_GRACE = 3.0  # seconds an instance has to exit once its control connection is closed
ACTUATORS = ("processes", "pods")  # what ``lifl up --functions`` takes


class Actuator(Protocol):
    starts_instances: bool  # False: instances are started elsewhere (pods) and only attach

    def spawn(self, tenant: Tenant, instance: int, preload: tuple[str, ...] = ()) -> tuple[socket.socket, Callable[[], None]]:
        """Instance ``instance`` of ``tenant`` (a cold start): its control connection's end, which
        exists at once (messages wait in it), and ``start``, which starts its process (it blocks:
        call it off the event loop). Its endpoint exists before it runs, so keys sent to it wait.
        ``preload``: modules it imports before it drops to the tenant's identity (torch, for
        inference queries: the tenant may not read the interpreter's files)."""

    def attach(self, tenant: Tenant, instance: int) -> tuple[socket.socket, str]:
        """An instance that connected by itself (its ``Attach`` was checked) becomes ``instance``:
        its endpoint's socket (to hand to it) and the spec it attaches to it with."""

    def retire(self, tenant: Tenant, instance: int, loop: Any) -> None:
        """The instance's connection closed: its endpoint goes, and its process (if the node
        started it) is reaped off ``loop``."""

    def stop_all(self) -> None:
        """Shutdown (every connection closed already): wait for the instances' processes."""


class LocalProcesses:
    """Instances as processes of ``python -m lifl.runtime`` started by the agent, each handed its
    control connection and its endpoint as inherited descriptors."""

    starts_instances = True

    def __init__(self, node: str, keys: KeyTransport, handler: str) -> None:
        self.node = node
        self.keys = keys
        self.handler = handler
        self._procs: dict[int, subprocess.Popen[bytes]] = {}
        self._retired: set[int] = set()  # instances retired before their process was started
        self._lock = threading.Lock()  # processes start on a pool thread, and are retired on the loop

    def spawn(self, tenant: Tenant, instance: int, preload: tuple[str, ...] = ()) -> tuple[socket.socket, Callable[[], None]]:
        chan, spec = self.keys.provision(tenant, instance)
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        cmd = [
            sys.executable, "-m", RUNTIME_MODULE, "--instance", str(instance), "--tenant", tenant.name,
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

        def start() -> None:
            try:
                proc = subprocess.Popen(cmd, pass_fds=(theirs.fileno(), chan.fileno()), cwd="/", env=env)
            finally:
                theirs.close()
                chan.close()
            with self._lock:
                retired = instance in self._retired
                self._retired.discard(instance)
                if not retired:
                    self._procs[instance] = proc
            if retired:  # its connection closed already: it exits at once
                _reap(proc)

        return ours, start

    def attach(self, tenant: Tenant, instance: int) -> tuple[socket.socket, str]:
        return self.keys.provision(tenant, instance)

    def retire(self, tenant: Tenant, instance: int, loop: Any) -> None:
        self.keys.retire(tenant, instance)
        with self._lock:
            proc = self._procs.pop(instance, None)
            if proc is None:
                self._retired.add(instance)
        if proc is not None:
            loop.offload(lambda: _reap(proc), lambda _, error: None)

    def stop_all(self) -> None:
        with self._lock:
            procs, self._procs = list(self._procs.values()), {}
        for proc in procs:
            _reap(proc)


class ClusterPods:
    """Instances are the tenant's function pods the cluster runs on this node (lifl's operator
    scales and places them by the plan): the agent starts none and lets none go while idle;
    each pod attaches to the function socket, and one whose connection the agent closes
    attaches again as a fresh instance."""

    starts_instances = False

    def __init__(self, node: str, keys: KeyTransport) -> None:
        self.node = node
        self.keys = keys

    def spawn(self, tenant: Tenant, instance: int, preload: tuple[str, ...] = ()) -> tuple[socket.socket, Callable[[], None]]:
        raise RuntimeError("the cluster starts a tenant's function pods, not the node")

    def attach(self, tenant: Tenant, instance: int) -> tuple[socket.socket, str]:
        return self.keys.provision(tenant, instance)

    def retire(self, tenant: Tenant, instance: int, loop: Any) -> None:
        self.keys.retire(tenant, instance)

    def stop_all(self) -> None:
        pass  # pods are not ours to reap


def _reap(proc: subprocess.Popen[bytes], grace: float = STOP_GRACE) -> None:
    """Wait for an instance whose connection is gone (it exits on EOF), so that it leaves no
    zombie and its CPU time is charged to the agent; kill it if it does not go."""
    try:
        proc.wait(grace)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
