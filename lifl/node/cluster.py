"""`lifl up --nodes N`: N worker nodes on one machine, each in its own network namespace.

An emulation of a cluster, not a cluster manager: every node is the same `lifl up` that runs
on a machine of its own (as a Kubernetes DaemonSet pod would), started in a namespace of its own
(see lifl.node.netns) so that traffic between nodes crosses the kernel's TCP stack and a
veth/bridge path. The nodes share one Redis (an embedded redis-server on the bridge address,
unless one is given) and one checkpoint directory, so any node can serve and resume any job.

The cluster supervisor reports a node that exits and does not restart it (whoever killed it
meant to). Its children die with it (parent-death signal, which survives ip netns exec's execve);
what a killed supervisor leaves behind (namespaces, links, processes, shared memory) is removed
by the next start with the same prefix.

The cluster's redis runs as the service user, as a node's embedded one does (lifl.node.privilege);
the operator's token is resolved once, here, registered, and given to every node.
"""

from __future__ import annotations

import dataclasses
import fcntl
import ipaddress
import os
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO
from urllib.parse import urlsplit

import redis

from lifl.control.controller import ControlConfig
from lifl.net.flags import limit_argv, tls_argv
from lifl.net.limits import ConnectionLimits
from lifl.net.tls import ServerTls
from lifl.node import netns, operator_token
from lifl.node.agent import agent_argv
from lifl.node.privilege import current, popen_as, prepare_data_dir, secure_checkpoints, service_identity
from lifl.node.spill import DEFAULT_MODEL_IDLE_S
from lifl.node.supervisor import NodeConfig, default_data_dir, default_run_dir, default_shm_capacity, embedded_redis_argv
from lifl.procs import die_with_parent, on_signals
from lifl.keys.ebpf import remove_node_channel
from lifl.store import remove_node_objects

MAX_NODES = 200
LOCK_DIR = Path("/run/lifl")  # one lock per prefix, machine-wide: namespace names are machine-wide


def _check_redis_url(url: str) -> None:
    """Refuse a Redis the nodes cannot reach from their namespaces."""
    parts = urlsplit(url)
    if parts.scheme == "unix":
        return  # a socket path reaches across network namespaces
    if parts.scheme not in ("redis", "rediss"):
        raise ValueError(f"--redis {url!r}: expected a redis://, rediss:// or unix:// URL")
    host = parts.hostname or "localhost"
    try:
        loopback = host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = False  # a host name: the node reports it if it cannot reach it
    if loopback:
        raise ValueError(f"--redis {url!r}: each node has a loopback of its own in its network namespace, so "
                         f"{host} is not this machine's Redis there; give a unix:// socket path or an address "
                         "the namespaces can reach (e.g. one on the cluster's bridge)")


@dataclass
class ClusterConfig:
    nodes: int = 2
    node_stem: str = "n"  # node ids are n1..nN
    prefix: str = "lifl"  # names the bridge, namespaces and links (see netns); one cluster per prefix
    subnet: str = "10.77.0.0/24"  # the bridge takes the first address, node k the (10+k)th
    redis: str | None = None  # None: an embedded redis-server on the bridge address
    run_dir: Path | None = None  # node k's run dir is RUN_DIR/nk
    data_dir: Path | None = None  # node k's data dir is DATA_DIR/nk; also the embedded redis's
    checkpoints: str = ""  # "": dir:DATA_DIR/checkpoints, shared, so any node can restore any job
    shm_capacity: int | None = None  # per node; None: a node's default, shared among the nodes
    pool_limit: int | None = None  # per node; None: a quarter of shm_capacity
    max_instances: int = 16
    keep_warm: float = 60.0
    reuse: bool = True  # see lifl.node.agent.AgentConfig
    lazy: bool = False
    channel: str = "auto"  # every node's key transport
    functions: str = "processes"  # who starts every node's function instances (lifl.node.actuator.ACTUATORS)
    retain_budget: int = 0  # every node's, per tenant (see lifl.node.agent.AgentConfig)
    model_idle_s: float = DEFAULT_MODEL_IDLE_S  # every node's (lifl.node.spill)
    control: ControlConfig = field(default_factory=ControlConfig)
    gateway_limits: ConnectionLimits = field(default_factory=ConnectionLimits)
    open_metrics: bool = False  # every node's GET /metrics without a token
    tls: ServerTls | None = None  # every node's: nodes that share a certificate (or CA) trust each other (ServerTls.peer_context)
    netem: str | None = None  # shaping of every node's link, netem syntax (see netns)
    internode_rate: str | None = None  # a tc rate for traffic between nodes only (clients' is not shaped)
    http_port: int = 8080
    grpc_port: int = 50051
    start_timeout: float = 120.0
    service_user: str | None = None  # who gateways and redis run as (see privilege.service_identity)
    operator_token_file: Path | None = None  # None: $LIFL_OPERATOR_TOKEN, else DATA_DIR/operator-token
    network: netns.Network = field(init=False, repr=False)
    netem_spec: netns.NetemSpec | None = field(init=False, repr=False)
    node_configs: dict[str, NodeConfig] = field(init=False, repr=False)  # their redis is set at start

    def __post_init__(self) -> None:
        """Validate everything that can be checked without touching the system."""
        if not 1 <= self.nodes <= MAX_NODES:
            raise ValueError(f"--nodes must be between 1 and {MAX_NODES}, got {self.nodes}")
        self.network = netns.Network(self.prefix, self.subnet)
        if self.nodes > self.network.capacity:
            raise ValueError(f"subnet {self.subnet} has room for {self.network.capacity} nodes, not {self.nodes}")
        self.netem_spec = netns.parse_netem(self.netem) if self.netem is not None else None
        if self.internode_rate is not None:
            if self.netem is not None:
                raise ValueError("shape either every link (netem) or the traffic between nodes (internode rate), not both")
            netns.parse_rate(self.internode_rate)
        if self.redis is not None:
            _check_redis_url(self.redis)
        self.run_dir = self.run_dir or default_run_dir("cluster")
        self.data_dir = self.data_dir or default_data_dir("cluster")
        self.checkpoints = self.checkpoints or f"dir:{self.data_dir / 'checkpoints'}"
        self.shm_capacity = self.shm_capacity or default_shm_capacity() // self.nodes
        self.node_configs = {}
        for k in range(1, self.nodes + 1):
            c = self._node_config(k)  # NodeConfig checks the node id
            self.network.host_end(c.node)  # and the interface names must fit
            self.node_configs[c.node] = c

    def _node_config(self, k: int) -> NodeConfig:
        node, ip = f"{self.node_stem}{k}", self.network.address(k)
        assert self.run_dir is not None and self.data_dir is not None
        return NodeConfig(
            node=node, http=f"{ip}:{self.http_port}", grpc=f"{ip}:{self.grpc_port}", redis=self.redis,
            run_dir=self.run_dir / node, data_dir=self.data_dir / node, checkpoints=self.checkpoints,
            shm_capacity=self.shm_capacity, pool_limit=self.pool_limit, max_instances=self.max_instances,
            keep_warm=self.keep_warm, reuse=self.reuse, lazy=self.lazy, channel=self.channel, functions=self.functions,
            retain_budget=self.retain_budget, model_idle_s=self.model_idle_s, control=self.control,
            gateway_limits=self.gateway_limits, service_user=self.service_user, tls=self.tls, open_metrics=self.open_metrics,
        )


@dataclass(frozen=True)
class NodeAddresses:
    node: str
    namespace: str
    host_end: str  # the veth end on the bridge: its counters are the node's traffic
    http: str  # "10.77.0.11:8080"
    grpc: str  # "10.77.0.11:50051"


@dataclass(frozen=True)
class ClusterAddresses:
    nodes: dict[str, NodeAddresses]
    redis: str
    shaping: str  # the qdisc on every link ("" when not shaped)
    operator_token_source: str = ""  # operator_token.OperatorToken.source
    tls: bool = False  # the gateways serve TLS

    def summary(self) -> str:
        lines = [f"lifl cluster is up: {len(self.nodes)} nodes, redis {self.redis}"]
        scheme = "https" if self.tls else "http"
        lines += [f"  {a.node}  {scheme}://{a.http}  grpc {a.grpc}" for a in self.nodes.values()]
        lines.append(f"  operator token: {self.operator_token_source}")
        if self.shaping.startswith("tbf"):
            lines.append(f"  links shaped both ways: {self.shaping} (the kernel has no netem: its rate, with tbf)")
        elif self.shaping:
            lines.append(f"  links shaped both ways: {self.shaping}")
        return "\n".join(lines)


def node_argv(c: NodeConfig, operator_token_file: Path | None = None) -> list[str]:
    """The `lifl up` of one node (a token from the environment reaches it through its environment)."""
    assert c.redis is not None
    return [
        sys.executable, "-m", "lifl", "up", "--node", c.node, "--http", c.http, "--grpc", c.grpc, "--redis", c.redis,
        "--run-dir", str(c.run_dir), "--data-dir", str(c.data_dir), "--checkpoints", c.checkpoints,
        "--shm-limit", str(c.shm_capacity), "--pool-limit", str(c.pool_limit), *agent_argv(c.agent_options()),
        *(["--service-user", c.service_user] if c.service_user is not None else []), *tls_argv(c.tls),
        *limit_argv(c.gateway_limits), *(["--open-metrics"] if c.open_metrics else []),
        *(["--operator-token-file", str(operator_token_file)] if operator_token_file is not None else []),
    ]


class NodeProcess:
    """One node's `lifl up` in its namespace. Its stdout is read for the addresses it prints,
    then forwarded to the cluster's log, each line marked with the node's id."""

    BANNER = ("  http:", "  grpc:", "  redis:", "  operator token:")  # supervisor.run's, replaced by the cluster's summary

    def __init__(self, node: str, argv: list[str], log: IO[str]) -> None:
        self.node, self.log = node, log
        self.http: str | None = None
        self.grpc: str | None = None
        self.ready = threading.Event()  # set once both addresses are known, or at exit
        self.reported = False  # its exit has been reported
        self.proc = subprocess.Popen(
            argv, stdout=subprocess.PIPE, text=True, start_new_session=True, preexec_fn=die_with_parent,
        )
        threading.Thread(target=self._read, name=f"lifl-{node}-out", daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith("  http:"):
                self.http = line.split()[1].removeprefix("http://").removeprefix("https://")
            elif line.startswith("  grpc:"):
                self.grpc = line.split()[1]
                self.ready.set()
            if not (line.startswith(self.BANNER) or line == f"lifl node {self.node} is up\n"):
                self.log.write(f"[{self.node}] {line}")
                self.log.flush()
        self.ready.set()

    def wait_ready(self, timeout: float) -> tuple[str, str]:
        """(http, grpc) once the node is up; RuntimeError if it exits or times out first."""
        self.ready.wait(max(timeout, 0.0))
        if self.http is None or self.grpc is None:
            status = self.proc.poll()
            why = f"exit status {status}" if status is not None else f"not up within {timeout:.0f} s"
            raise RuntimeError(f"node {self.node} did not start ({why}; its output is above)")
        return self.http, self.grpc

    def terminate(self) -> None:
        """SIGTERM: the node stops its gateway and agent and removes its shared memory."""
        if self.proc.poll() is None:
            self.proc.terminate()

    def wait(self, timeout: float = 30.0) -> None:
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


class Cluster:
    """Start, supervise and stop the nodes of one ClusterConfig. Call start() and check() from a
    thread that lives as long as the cluster: a child's parent-death signal follows the thread
    that started it."""

    def __init__(self, config: ClusterConfig, log: IO[str] | None = None) -> None:
        self.config = config
        self.log = log or sys.stdout  # where the nodes' output goes
        self.nodes: dict[str, NodeProcess] = {}
        self.addresses: ClusterAddresses | None = None
        self._redis: subprocess.Popen | None = None
        self._redis_argv: list[str] = []
        self._lock_file: IO[str] | None = None
        self._stop = threading.Event()
        self.service = current()  # who the redis and the nodes' gateways run as, once started
        self.operator_token = ""  # once started

    @property
    def network(self) -> netns.Network:
        return self.config.network

    def start(self) -> ClusterAddresses:
        """Remove a previous run's leftovers, create the network, start redis and the nodes."""
        if os.geteuid() != 0:
            raise PermissionError("--nodes needs root (it creates network namespaces, veth links and a bridge)")
        self._take_lock()
        try:
            self.addresses = self._start()
        except BaseException:
            self.stop()
            raise
        return self.addresses

    def _take_lock(self) -> None:
        LOCK_DIR.mkdir(parents=True, exist_ok=True)
        path = LOCK_DIR / f"cluster-{self.config.prefix}.lock"
        self._lock_file = open(path, "a+")
        try:
            fcntl.flock(self._lock_file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self._lock_file.close()
            self._lock_file = None
            raise RuntimeError(f"a cluster with prefix {self.config.prefix!r} is already running (lock {path})") from None

    def _start(self) -> ClusterAddresses:
        c = self.config
        assert c.data_dir is not None
        self.service = service_identity(c.service_user)
        prepare_data_dir(c.data_dir, self.service, hosts_redis=c.redis is None)
        secure_checkpoints(c.checkpoints, c.data_dir)
        token = operator_token.resolve(c.data_dir, token_file=c.operator_token_file)
        self._remove_leftovers()
        qdisc = c.netem_spec.qdisc(netns.netem_available(c.prefix)) if c.netem_spec else []  # refuses before building
        netns.create_bridge(self.network)
        for k, node in enumerate(c.node_configs, 1):
            netns.add_node(self.network, node, k)
            if qdisc:
                netns.shape(self.network, node, qdisc)
        if c.internode_rate is not None:
            addresses = [self.network.address(k) for k in range(1, len(c.node_configs) + 1)]
            for k, node in enumerate(c.node_configs, 1):
                peers = [a for j, a in enumerate(addresses, 1) if j != k]
                netns.shape_between_nodes(self.network, node, peers, netns.parse_rate(c.internode_rate))
            qdisc = ["htb", "between nodes", c.internode_rate]
        redis_url = c.redis or self._start_redis()
        operator_token.register(redis_url, token)
        self.operator_token = token.token
        for node, nc in c.node_configs.items():
            argv = netns.exec_argv(self.network.namespace(node), node_argv(dataclasses.replace(nc, redis=redis_url), token.path))
            self.nodes[node] = NodeProcess(node, argv, self.log)
        deadline = time.monotonic() + c.start_timeout
        addresses = {}
        for node, proc in self.nodes.items():
            http, grpc = proc.wait_ready(deadline - time.monotonic())
            addresses[node] = NodeAddresses(node, self.network.namespace(node), self.network.host_end(node), http, grpc)
        return ClusterAddresses(addresses, redis_url, " ".join(qdisc), token.source, tls=c.tls is not None)

    def _remove_leftovers(self) -> None:
        """What a killed run with this prefix left: namespaces, links, processes, shared memory."""
        left = netns.cleanup(self.config.prefix)
        stale_nodes = {ns.removeprefix(self.config.prefix + "-") for ns in left.namespaces} | set(self.config.node_configs)
        objects = sum(remove_node_objects(node) for node in stale_nodes)
        if left or objects:
            print(f"lifl: removed what a previous cluster {self.config.prefix!r} left behind: {left}, "
                  f"{objects} shared-memory objects", file=sys.stderr)

    def _start_redis(self) -> str:
        """A redis-server on the bridge address, reachable from every namespace and only there."""
        assert self.config.data_dir is not None
        host = str(self.network.bridge_address)
        port = _free_port(host)
        self._redis_argv = embedded_redis_argv(self.config.data_dir, ["--bind", host, "--port", str(port), "--protected-mode", "no"],
                                               self.service)
        url = f"redis://{host}:{port}"
        self._start_redis_process(url)
        return url

    def _start_redis_process(self, url: str, timeout: float = 30.0) -> None:
        self._redis = subprocess.Popen(self._redis_argv, stdout=subprocess.DEVNULL, start_new_session=True,
                                       preexec_fn=die_with_parent, **popen_as(self.service))
        deadline = time.monotonic() + timeout
        with redis.Redis.from_url(url, socket_timeout=5) as client:
            while True:
                try:
                    client.ping()
                    return
                except redis.RedisError:
                    if self._redis.poll() is not None or time.monotonic() > deadline:
                        raise RuntimeError(f"redis-server at {url} did not start (its log: {self._redis_argv[-1]})") from None
                    time.sleep(0.05)

    def check(self) -> list[str]:
        """One round of supervision: report on stderr each node that has exited since the last
        round (returns their ids; they are not restarted) and restart the embedded redis if it exited."""
        gone = [p for p in self.nodes.values() if not p.reported and p.proc.poll() is not None]
        for p in gone:
            p.reported = True
            print(f"lifl: node {p.node} exited (status {p.proc.returncode}); it is not restarted, "
                  "the other nodes keep running", file=sys.stderr)
        if self._redis is not None and self._redis.poll() is not None and self.addresses is not None:
            print(f"lifl: redis-server exited ({self._redis.returncode}); restarting it", file=sys.stderr)
            self._start_redis_process(self.addresses.redis)
        return [p.node for p in gone]

    def supervise(self) -> int:
        """Run check() until request_stop()."""
        while not self._stop.wait(0.2):
            self.check()
        return 0

    def kill_node(self, node: str) -> None:
        """SIGKILL every process in the node's namespace: a node failure, for tests."""
        netns.kill_namespace(self.network.namespace(node))
        self.nodes[node].proc.wait()

    def request_stop(self) -> None:
        self._stop.set()

    def stop(self) -> None:
        """Stop the nodes, remove namespaces, links, bridge and shared memory; redis last. Idempotent."""
        self._stop.set()
        if self._lock_file is None:
            return  # never started, or already stopped
        for p in self.nodes.values():  # all at once: they stop in parallel
            p.terminate()
        for p in self.nodes.values():
            p.wait()
        netns.cleanup(self.config.prefix)
        for node in self.config.node_configs:
            remove_node_objects(node)
            remove_node_channel(node)
        if self._redis is not None:
            self._redis.terminate()
            self._redis.wait()
            self._redis = None
        self._lock_file.close()
        self._lock_file = None


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def run(config: ClusterConfig) -> int:
    """`lifl up --nodes N`: start, print the addresses, supervise until Ctrl-C or SIGTERM."""
    cluster = Cluster(config)
    on_signals(cluster.request_stop)
    try:
        addresses = cluster.start()
    except (ValueError, PermissionError, RuntimeError) as e:  # netns.NetError is a RuntimeError
        print(f"lifl: {e}", file=sys.stderr)
        return 1
    print(addresses.summary(), flush=True)
    try:
        return cluster.supervise()
    finally:
        cluster.stop()
        print("lifl cluster stopped", flush=True)
