"""The gateway process (started by `lifl up`): HTTP and gRPC front ends of one node."""

from __future__ import annotations

import argparse
import json
import re
import resource
import signal
import threading

from lifl.control.controller import DEFAULT_CAPACITY
from lifl.control.planner import BESTFIT, POLICIES
from lifl.gateway.grpc_server import GrpcServer
from lifl.gateway.http import HttpServer
from lifl.gateway.service import GatewayService
from lifl.gateway.flags import add_limit_arguments, limits_from
from lifl.procs import die_with_parent
from lifl.state import ClusterState


def split_address(text: str) -> tuple[str, int]:
    host, _, port = text.rpartition(":")
    if not host or not re.fullmatch(r"[0-9]{1,5}", port):
        raise argparse.ArgumentTypeError(f"expected HOST:PORT, got {text!r}")
    return host, int(port)


def raise_descriptor_limit() -> None:
    """Every connection takes a descriptor, and one more for its thread's agent connection."""
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    except (ValueError, OSError):  # an unlimited hard limit is capped by the kernel: keep the soft one
        pass


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="lifl-gateway", description=__doc__)
    p.add_argument("--node", required=True)
    p.add_argument("--redis", required=True)
    p.add_argument("--agent-socket", required=True)
    p.add_argument("--http", type=split_address, required=True, metavar="HOST:PORT")
    p.add_argument("--grpc", type=split_address, required=True, metavar="HOST:PORT")
    p.add_argument("--placement", choices=POLICIES, default=BESTFIT)
    p.add_argument("--capacity", type=float, default=DEFAULT_CAPACITY)
    add_limit_arguments(p)
    args = p.parse_args(argv)
    limits = limits_from(args)
    die_with_parent()
    raise_descriptor_limit()
    service = GatewayService(args.node, ClusterState(args.redis), args.agent_socket, args.placement, args.capacity)
    http = HttpServer(service, *args.http, limits)
    grpc = GrpcServer(service, *args.grpc, limits)
    http.start()
    grpc.start()
    addresses = {"http": "{}:{}".format(*http.address), "grpc": "{}:{}".format(*grpc.address)}
    service.start(addresses["http"], addresses["grpc"])
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    print(json.dumps(addresses), flush=True)
    stop.wait()
    service.stop()
    http.stop()
    grpc.stop()


if __name__ == "__main__":
    main()
