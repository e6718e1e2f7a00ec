"""The gateway process (started by `lifl up`): HTTP and gRPC front ends of one node."""

from __future__ import annotations

import argparse
import json
import signal
import threading

from lifl.control.controller import DEFAULT_CAPACITY
from lifl.control.planner import BESTFIT, POLICIES
from lifl.gateway.grpc_server import GrpcServer
from lifl.gateway.http import HttpServer
from lifl.gateway.service import GatewayService
from lifl.procs import die_with_parent
from lifl.state import ClusterState


def split_address(text: str) -> tuple[str, int]:
    host, _, port = text.rpartition(":")
    if not host or not port.isdigit():
        raise argparse.ArgumentTypeError(f"expected HOST:PORT, got {text!r}")
    return host, int(port)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="lifl-gateway", description=__doc__)
    p.add_argument("--node", required=True)
    p.add_argument("--redis", required=True)
    p.add_argument("--agent-socket", required=True)
    p.add_argument("--http", type=split_address, required=True, metavar="HOST:PORT")
    p.add_argument("--grpc", type=split_address, required=True, metavar="HOST:PORT")
    p.add_argument("--placement", choices=POLICIES, default=BESTFIT)
    p.add_argument("--capacity", type=float, default=DEFAULT_CAPACITY)
    args = p.parse_args(argv)
    die_with_parent()
    service = GatewayService(args.node, ClusterState(args.redis), args.agent_socket, args.placement, args.capacity)
    http = HttpServer(service, *args.http)
    grpc = GrpcServer(service, *args.grpc)
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
