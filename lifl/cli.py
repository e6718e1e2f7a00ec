"""The `lifl` command."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

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
    from lifl.net.flags import limits_from, tls_from
    from lifl.node import cluster
    from lifl.node.agent import agent_options

    if args.system != "lifl":
        return _up_baseline(args)
    for option in ("fan_in", "kpa_scale"):
        if getattr(args, option) is not None:
            raise SystemExit(f"lifl: --{option.replace('_', '-')} is about the sl baseline: it needs --system sl")
    if not 1 <= args.nodes <= cluster.MAX_NODES:
        raise SystemExit(f"lifl: --nodes must be between 1 and {cluster.MAX_NODES}, got {args.nodes}")
    if args.nodes > 1:
        if args.http or args.grpc:
            raise SystemExit("lifl: --http and --grpc are for one node; with --nodes each node listens on its own address")
        try:
            config = cluster.ClusterConfig(
                nodes=args.nodes, node_stem=args.node or "n", prefix=args.cluster_prefix or cluster.ClusterConfig.prefix,
                subnet=args.subnet or cluster.ClusterConfig.subnet,
                redis=args.redis, run_dir=args.run_dir, data_dir=args.data_dir, checkpoints=args.checkpoints,
                shm_capacity=args.shm_limit, pool_limit=args.pool_limit, netem=args.netem,
                gateway_limits=limits_from(args), service_user=args.service_user, open_metrics=args.open_metrics,
                operator_token_file=args.operator_token_file, tls=tls_from(args), **agent_options(args),
            )
        except ValueError as e:
            raise SystemExit(f"lifl: {e}") from None
        return cluster.run(config)
    for option in ("netem", "cluster_prefix", "subnet"):
        if getattr(args, option) is not None:
            raise SystemExit(f"lifl: --{option.replace('_', '-')} is about the links between emulated nodes: it needs --nodes N with N > 1")
    from lifl.node.supervisor import NodeConfig, run

    config = NodeConfig(
        node=args.node or "n0", http=args.http or "127.0.0.1:8080", grpc=args.grpc or "127.0.0.1:50051", redis=args.redis,
        run_dir=args.run_dir, data_dir=args.data_dir,
        shm_capacity=args.shm_limit, pool_limit=args.pool_limit, checkpoints=args.checkpoints,
        gateway_limits=limits_from(args), service_user=args.service_user, operator_token_file=args.operator_token_file,
        open_metrics=args.open_metrics,
        tls=tls_from(args), **agent_options(args),
    )
    return run(config)


def _up_baseline(args: argparse.Namespace) -> int:
    """`lifl up --system sf|sf-micro|sl`: a comparison baseline (lifl.baselines.system)."""
    from lifl.baselines import system

    if args.nodes != 1:
        raise SystemExit("lifl: a baseline system runs as one node; --nodes is lifl's")
    if args.grpc:
        raise SystemExit("lifl: a baseline system serves HTTP only (no gRPC API)")
    if args.system != "sl" and (args.fan_in is not None or args.kpa_scale is not None):
        raise SystemExit("lifl: --fan-in and --kpa-scale are about the sl baseline")
    options = {k: v for k, v in (("fan_in", args.fan_in), ("kpa_scale", args.kpa_scale)) if v is not None}
    try:
        config = system.BaselineConfig(args.system, http=args.http or "127.0.0.1:8080", **options)
    except ValueError as e:
        raise SystemExit(f"lifl: {e}") from None
    return system.run(config)


def cmd_token(args: argparse.Namespace) -> int:
    """`lifl token create|list|revoke`: manage tokens through a gateway, as the caller's token."""
    import json

    def act(gateway: Any) -> None:
        if args.action == "create":
            print(json.dumps(gateway.create_token(args.role, args.tenant, job=args.job or "", client=args.client or "",
                                                  ttl_s=args.ttl)))
        elif args.action == "list":
            for record in gateway.tokens():
                print(json.dumps(record))
        else:
            gateway.revoke_token(args.id)
    return _through_gateway(args, "token", act)


def cmd_quota(args: argparse.Namespace) -> int:
    """`lifl quota show|set|reset TENANT`: a tenant's quota through a gateway (set and reset: the
    operator's token); ``set`` changes the limits given and keeps the others."""
    import json

    from lifl.quotas import BYTES, COUNTS, parse_limit

    def act(gateway: Any) -> None:
        if args.action == "set":
            quota = gateway.quota(args.tenant)["quota"]
            for name in COUNTS + BYTES:
                text = getattr(args, name)
                if text is not None:
                    quota[name] = parse_limit(name, text, f"--{name.replace('_', '-')}")
            print(json.dumps(gateway.set_quota(args.tenant, quota)))
        else:
            print(json.dumps(gateway.set_quota(args.tenant, None) if args.action == "reset" else gateway.quota(args.tenant)))
    return _through_gateway(args, "quota", act)


def _through_gateway(args: argparse.Namespace, command: str, act: Callable[[Any], None]) -> int:
    """Run ``act`` with a client of the gateway ``args`` name, as the caller's token; a refusal
    exits with its code and message."""
    import os

    from lifl.client import TOKEN_ENV, Gateway
    from lifl.errors import LiflError

    token = args.token_file.read_text().strip() if args.token_file else os.environ.get(TOKEN_ENV)
    if not token:
        raise SystemExit(f"lifl {command}: give the caller's token with --token-file PATH or ${TOKEN_ENV}")
    gateway = Gateway(args.gateway, args.protocol, token=token)
    try:
        act(gateway)
    except LiflError as e:
        raise SystemExit(f"lifl {command} {args.action}: {e.code}: {e.message}") from None
    finally:
        gateway.close()
    return 0


def cmd_calibrate(args: argparse.Namespace) -> int:
    from lifl.control import calibrate

    return calibrate.main(args)


def cmd_demo(args: argparse.Namespace) -> int:
    from lifl import demo

    return demo.main(args)


def cmd_deploy(args: argparse.Namespace) -> int:
    from lifl import openfaas

    return openfaas.main(args)


def cmd_bench(args: argparse.Namespace) -> int:
    from lifl.bench import (channel, compare, dataplane, flowermem, flstore, knative, large, orchestration, secagg,
                            throughput)

    return {"dataplane": dataplane.main, "orchestration": orchestration.main, "channel": channel.main,
            "knative": knative.main, "compare": compare.main, "flstore": flstore.main,
            "flower-memory": flowermem.main, "throughput": throughput.main, "large": large.main,
            "secagg": secagg.main}[args.bench](args)


def build_parser() -> argparse.ArgumentParser:
    from lifl.net.flags import add_limit_arguments, add_tls_arguments
    from lifl.node.agent import add_agent_arguments

    p = argparse.ArgumentParser(prog="lifl", description="Elastic serverless aggregation for federated learning.")
    sub = p.add_subparsers(dest="command", required=True)

    up = sub.add_parser("up", help="run a worker node (agent, gateway, redis) in the foreground, or N of them (--nodes)")
    up.add_argument("--node", help="node id: 1-16 lowercase letters or digits (default n0); with --nodes N, "
                    "the ids' stem (default n: nodes n1..nN)")
    up.add_argument("--http", metavar="HOST:PORT", help="HTTP API address (default 127.0.0.1:8080; port 0: any free port)")
    up.add_argument("--grpc", metavar="HOST:PORT", help="gRPC API address (default 127.0.0.1:50051)")
    up.add_argument("--redis", metavar="URL", help="use this Redis instead of starting one (redis:// or unix://)")
    up.add_argument("--run-dir", type=Path, help="sockets and lock (default /run/lifl/NODE as root; with --nodes /run/lifl/cluster)")
    up.add_argument("--data-dir", type=Path, help="persistent state: the embedded redis, checkpoints and the operator token "
                    "(default /var/lib/lifl/NODE as root; with --nodes /var/lib/lifl/cluster)")
    up.add_argument("--checkpoints", default="", metavar="STORE",
                    help="where model checkpoints go: dir:PATH (default DATA_DIR/checkpoints), redis, redis://..., s3://BUCKET/PREFIX?endpoint=URL")
    up.add_argument("--shm-limit", type=parse_size, help="shared memory for objects (default: half the RAM; with --nodes, shared among them)")
    up.add_argument("--pool-limit", type=parse_size, help="of which recycled buffers may keep (default: a quarter)")
    up.add_argument("--service-user", metavar="NAME|UID",
                    help="as root, the user the gateway (once its ports are bound) and the embedded redis run as "
                         "(default: the user lifl if there is one, else uid and gid 609999; root keeps them root). "
                         "The agent stays root: it runs tenants' functions as their own uids")
    up.add_argument("--operator-token-file", type=Path, metavar="PATH",
                    help="the operator's token (32-256 printable characters; around them whitespace is ignored); "
                         "or set LIFL_OPERATOR_TOKEN (not both). Without either, DATA_DIR/operator-token, made "
                         "(mode 0600) on the first start; its path is printed")
    up.add_argument("--open-metrics", action="store_true",
                    help="serve GET /metrics without a token (by default it needs the operator's: it names every tenant's jobs)")
    add_agent_arguments(up)
    add_limit_arguments(up)
    add_tls_arguments(up)
    up.add_argument("--nodes", type=int, default=1, metavar="N",
                    help="emulate a cluster: N nodes on this machine, each in a network namespace of its own, on one "
                         "bridge and one shared Redis (needs root; 1-200; default 1: one node in this namespace)")
    up.add_argument("--netem", metavar="SPEC",
                    help="with --nodes: shape every node's link both ways, in netem syntax, e.g. 'rate 10gbit delay 0.1ms' "
                         "(without the kernel's netem only 'rate' works, emulated with tbf)")
    up.add_argument("--cluster-prefix", metavar="NAME",
                    help="with --nodes, advanced: names the bridge (NAMEbr0), namespaces and links (NAME-NODE...); "
                         "for tests and for running two clusters side by side (default lifl)")
    up.add_argument("--subnet", metavar="CIDR",
                    help="with --nodes, advanced: the bridge's subnet; node k gets its (10+k)th address (default 10.77.0.0/24)")
    up.add_argument("--system", choices=("lifl", "sf", "sf-micro", "sl"), default="lifl",
                    help="run a comparison baseline instead of lifl (`lifl bench compare`, docs/compare.md): sf "
                         "(serverful, updates queued in the aggregator), sf-micro (serverful, a message broker), sl "
                         "(stock serverless: functions behind sidecars, a broker, Knative's KPA)")
    up.add_argument("--fan-in", type=int, metavar="K", help="with --system sl: updates per leaf invocation (default 5)")
    up.add_argument("--kpa-scale", type=float, metavar="F",
                    help="with --system sl: KPA's windows and tick times F (default 0.1: a 6 s stable window)")
    up.set_defaults(func=cmd_up)

    tok = sub.add_parser("token", help="create, list and revoke tenant and client tokens (docs/security.md)")
    _add_gateway_arguments(tok)
    tok_sub = tok.add_subparsers(dest="action", required=True)
    create = tok_sub.add_parser("create", help="issue a token; prints it as JSON, the secret this once")
    create.add_argument("--role", choices=("tenant", "client"), required=True)
    create.add_argument("--tenant", required=True)
    create.add_argument("--job", help="client tokens: the job the client is enrolled in")
    create.add_argument("--client", help="client tokens: the client's identity (default: the token's id)")
    create.add_argument("--ttl", type=float, metavar="SECONDS", help="lifetime (default one day)")
    tok_sub.add_parser("list", help="live tokens the caller manages, one JSON object per line, without secrets")
    revoke = tok_sub.add_parser("revoke", help="revoke a token by its id")
    revoke.add_argument("id")
    tok.set_defaults(func=cmd_token)

    quota = sub.add_parser("quota", help="show, set and reset a tenant's quota (docs/api.md#quotas)")
    _add_gateway_arguments(quota)
    quota_sub = quota.add_subparsers(dest="action", required=True)
    quota_sub.add_parser("show", help="the tenant's quota and what it holds of it, as JSON").add_argument("tenant")
    quota_set = quota_sub.add_parser("set", help="change the limits given (a number, bytes like 512Mi, or none)")
    quota_set.add_argument("tenant")
    for name in ("jobs", "tokens", "rounds", "shm_bytes", "retained_bytes"):
        quota_set.add_argument(f"--{name.replace('_', '-')}", dest=name, metavar="LIMIT")
    quota_sub.add_parser("reset", help="back to the default quota").add_argument("tenant")
    quota.set_defaults(func=cmd_quota)

    cal = sub.add_parser("calibrate", help="measure each node's maximum service capacity MC (LIFL appendix E) for placement")
    from lifl.control.calibrate import add_arguments as calibrate_arguments

    calibrate_arguments(cal)
    cal.set_defaults(func=cmd_calibrate)

    demo = sub.add_parser("demo", help="train a model with federated learning through a local node, to a target accuracy")
    from lifl.demo import add_arguments as demo_arguments

    demo_arguments(demo)
    demo.set_defaults(func=cmd_demo)

    dep = sub.add_parser("deploy", help="deploy a stack file's functions through an OpenFaaS gateway, as faas-cli deploy -f "
                         "does (docs/openfaas.md)")
    from lifl.openfaas import add_arguments as deploy_arguments

    deploy_arguments(dep)
    dep.set_defaults(func=cmd_deploy)

    bench = sub.add_parser("bench", help="benchmarks")
    bench_sub = bench.add_subparsers(dest="bench", required=True)
    from lifl.bench import (channel, compare, dataplane, flowermem, flstore, knative, large, orchestration, secagg,
                            throughput)

    compare.add_arguments(bench_sub.add_parser(
        "compare", help="lifl against serverful (SF, SF-micro), stock-serverless (SL) and Flower: transfer, queuing, "
                        "time to accuracy (LIFL Fig. 7, 9, 10, 13)"))
    flstore.add_arguments(bench_sub.add_parser(
        "flstore", help="non-training workloads (filter, cosine, cluster, reputation, provenance, inference) on lifl "
                        "against ObjStore-Agg (s3proxy) and Cache-Agg (redis), and a retention-policy trace (FLStore §5)"))
    channel.add_arguments(bench_sub.add_parser(
        "channel", help="key hand-off between two processes: eBPF (SK_MSG), unix and TCP sockets (needs root)"))
    dataplane.add_arguments(bench_sub.add_parser("dataplane", help="ingest, hand-off, aggregation and memory of the data plane"))
    orchestration.add_arguments(bench_sub.add_parser(
        "orchestration", help="the control plane on emulated nodes: SL-H, +1, +123, +1234 (LIFL Fig. 8)"))
    knative.add_arguments(bench_sub.add_parser(
        "knative", help="lifl's autoscaler class against Knative's KPA on the Kubernetes test bed (needs root)"))
    flowermem.add_arguments(bench_sub.add_parser(
        "flower-memory", help="the Flower server's peak memory aggregating a round: Flower's FedAvg against the lifl bridge"))
    throughput.add_arguments(bench_sub.add_parser(
        "throughput", help="CPU per update and updates per second with many small updates: lifl against SF and the "
                           "smallest server that answers them"))
    large.add_arguments(bench_sub.add_parser(
        "large", help="a round of updates larger than one aggregator should hold (1B bf16 parameters): unsharded "
                      "against tensor shards and float32 accumulators"))
    secagg.add_arguments(bench_sub.add_parser(
        "secagg", help="a secure round (SecAgg+) on lifl against Flower's SecAggPlusWorkflow, and lifl's plain "
                       "fixed-point round: server CPU, round time, client CPU and bytes, unmasking"))
    bench.set_defaults(func=cmd_bench)
    return p


def _add_gateway_arguments(parser: argparse.ArgumentParser) -> None:
    """How a command that calls a gateway finds it, and whose token it presents."""
    parser.add_argument("--gateway", default="127.0.0.1:8080", metavar="HOST:PORT",
                        help="a gateway's address (default 127.0.0.1:8080)")
    parser.add_argument("--protocol", choices=("http", "grpc"), default="http")
    parser.add_argument("--token-file", type=Path, metavar="PATH", help="the caller's token (default: $LIFL_TOKEN)")


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    sys.exit(args.func(args))


if __name__ == "__main__":
    main()
