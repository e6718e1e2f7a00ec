"""The `lifl` command."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

SIZE_UNITS = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


def parse_size(text: str) -> int:
    """Bytes from '512m', '2g', '1048576'."""
    t = text.strip().lower().removesuffix("b").removesuffix("i")
    try:
        if t and t[-1] in SIZE_UNITS:
            return int(float(t[:-1]) * SIZE_UNITS[t[-1]])
        return int(t)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a size like 512m or 2g, got {text!r}") from None


def cmd_up(args: argparse.Namespace) -> int:
    from lifl.node.supervisor import NodeConfig, run

    config = NodeConfig(
        node=args.node, http=args.http, grpc=args.grpc, redis=args.redis, run_dir=args.run_dir, data_dir=args.data_dir,
        shm_capacity=args.shm_limit, pool_limit=args.pool_limit, max_instances=args.max_instances, keep_warm=args.keep_warm,
        checkpoints=args.checkpoints,
    )
    return run(config)


def cmd_demo(args: argparse.Namespace) -> int:
    from lifl import demo

    return demo.main(args)


def cmd_bench(args: argparse.Namespace) -> int:
    from lifl.bench import dataplane

    return dataplane.main(args)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="lifl", description="Elastic serverless aggregation for federated learning.")
    sub = p.add_subparsers(dest="command", required=True)

    up = sub.add_parser("up", help="run a worker node (agent, gateway, redis) in the foreground")
    up.add_argument("--node", default="n0", help="node id: 1-16 lowercase letters or digits (default n0)")
    up.add_argument("--http", default="127.0.0.1:8080", metavar="HOST:PORT", help="HTTP API address (port 0: any free port)")
    up.add_argument("--grpc", default="127.0.0.1:50051", metavar="HOST:PORT", help="gRPC API address")
    up.add_argument("--redis", metavar="URL", help="use this Redis instead of starting one (redis:// or unix://)")
    up.add_argument("--run-dir", type=Path, help="sockets and lock (default /run/lifl/NODE as root)")
    up.add_argument("--data-dir", type=Path, help="persistent state: the embedded redis and checkpoints (default /var/lib/lifl/NODE as root)")
    up.add_argument("--checkpoints", default="", metavar="STORE",
                    help="where model checkpoints go: dir:PATH (default DATA_DIR/checkpoints), redis, redis://..., s3://BUCKET/PREFIX?endpoint=URL")
    up.add_argument("--shm-limit", type=parse_size, help="shared memory for objects (default: half the RAM)")
    up.add_argument("--pool-limit", type=parse_size, help="of which recycled buffers may keep (default: a quarter)")
    up.add_argument("--max-instances", type=int, default=16, help="aggregator processes at most (default 16)")
    up.add_argument("--keep-warm", type=float, default=60.0, help="seconds an idle aggregator stays warm (default 60)")
    up.set_defaults(func=cmd_up)

    demo = sub.add_parser("demo", help="train a model with federated learning through a local node, to a target accuracy")
    from lifl.demo import add_arguments as demo_arguments

    demo_arguments(demo)
    demo.set_defaults(func=cmd_demo)

    bench = sub.add_parser("bench", help="benchmarks")
    bench_sub = bench.add_subparsers(dest="bench", required=True)
    from lifl.bench.dataplane import add_arguments

    add_arguments(bench_sub.add_parser("dataplane", help="ingest, hand-off, aggregation and memory of the data plane"))
    bench.set_defaults(func=cmd_bench)
    return p


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    sys.exit(args.func(args))


if __name__ == "__main__":
    main()
