"""The gateway process (started by `lifl up`): HTTP and gRPC front ends of one node, served by
one event loop (lifl.net.loop) on one thread. One loop rather than one per front end: the
process has one interpreter lock, so a second loop would add a thread switch per request and
no parallelism, and sharing the loop shares its caches and its one connection to the agent."""

from __future__ import annotations

import argparse
import importlib
import json
import os
import re
import resource
import threading

from lifl.control.controller import DEFAULT_CAPACITY
from lifl.control.planner import BESTFIT, POLICIES
from lifl.gateway.grpc_server import GrpcServer
from lifl.gateway.http import HttpServer
from lifl.gateway.service import GatewayService
from lifl.net.flags import add_limit_arguments, add_tls_arguments, limits_from, server_contexts, tls_from
from lifl.node.privilege import Identity, drop_to, parse_user
from lifl.net.tls import configure_peers
from lifl.procs import die_with_parent, on_signals
from lifl.state import ClusterState


def split_address(text: str) -> tuple[str, int]:
    host, _, port = text.rpartition(":")
    if not host or not re.fullmatch(r"[0-9]{1,5}", port):
        raise argparse.ArgumentTypeError(f"expected HOST:PORT, got {text!r}")
    return host, int(port)


def raise_descriptor_limit() -> None:
    """Every connection takes a descriptor (and a model being sent, another)."""
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    except (ValueError, OSError):  # an unlimited hard limit is capped by the kernel: keep the soft one
        pass


# Modules imported on first use, which may come after the drop, when the interpreter's own files
# may be out of the service user's reach (a Python under /root): imported before it.
IMPORTED_BEFORE_DROPPING = ("encodings.idna",)  # socket: host names go through the idna codec


def user_argument(text: str) -> Identity:
    try:
        return parse_user(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def become(user: Identity, parent: int) -> None:
    """Drop to ``user`` for good, once the sockets are bound and the keys read (as nginx and
    redis do); the kernel forgets the parent-death signal on the change: set it again."""
    for name in IMPORTED_BEFORE_DROPPING:
        importlib.import_module(name)
    drop_to(user)
    die_with_parent()
    if os.getppid() != parent:  # the parent died before the signal was set again
        raise SystemExit(0)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="lifl-gateway", description=__doc__)
    p.add_argument("--node", required=True)
    p.add_argument("--redis", required=True)
    p.add_argument("--agent-socket", required=True)
    p.add_argument("--http", type=split_address, required=True, metavar="HOST:PORT")
    p.add_argument("--grpc", type=split_address, required=True, metavar="HOST:PORT")
    p.add_argument("--placement", choices=POLICIES, default=BESTFIT)
    p.add_argument("--capacity", type=float, default=DEFAULT_CAPACITY)
    p.add_argument("--open-metrics", action="store_true", help="serve GET /metrics without a token (it names every tenant's jobs)")
    p.add_argument("--user", type=user_argument, metavar="UID:GID",
                   help="run as this user (no other groups) once the listening sockets are bound")
    add_limit_arguments(p)
    add_tls_arguments(p)
    args = p.parse_args(argv)
    limits = limits_from(args)
    tls = tls_from(args)
    die_with_parent()
    parent = os.getppid()
    raise_descriptor_limit()
    contexts = server_contexts(tls) if tls is not None else None  # key files are read here, before privileges go
    configure_peers(tls.peer_context() if tls is not None else None)  # this node serves TLS: so do its peers
    service = GatewayService(args.node, ClusterState(args.redis), args.agent_socket, args.placement, args.capacity,
                             open_metrics=args.open_metrics)
    http = HttpServer(service, *args.http, limits)
    grpc = GrpcServer(service, *args.grpc, limits)
    if contexts is not None:
        http.use_tls(contexts[0])
        grpc.use_tls(contexts[1])
    if args.user is not None:
        become(args.user, parent)
    http.start()  # starts the service's loop, and its pools' threads
    grpc.start()
    addresses = {"http": "{}:{}".format(*http.address), "grpc": "{}:{}".format(*grpc.address)}
    service.start(addresses["http"], addresses["grpc"])
    stop = threading.Event()
    on_signals(stop.set)
    print(json.dumps(addresses), flush=True)
    stop.wait()
    grpc.stop()
    service.stop()
    http.stop()  # the loop's starter: it ends the loop last


if __name__ == "__main__":
    main()
