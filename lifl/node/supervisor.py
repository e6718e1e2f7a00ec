"""`lifl up`: one worker node on this machine, supervised in the foreground.

The supervisor starts a redis-server of its own (unless one is given), the node agent and
the gateway, prints the gateway's addresses, and stops everything cleanly on Ctrl-C or
SIGTERM. Its children die with it (parent-death signal). Whichever of them exits is restarted,
after a back-off that grows with its restarts (RESTART_BACKOFF).

An agent that dies takes the node's shared memory with it: before a new one starts, the
instances it left to init are killed and its objects and key channel removed (as a stop
does), so nothing of the old run writes into the new one's. The gateway keeps running: its
requests fail with 503 ``agent_unavailable`` until it reconnects (gateway.agentlink), and
what it still maps of the old objects is its own to finish with. The new agent gives up the
rounds the old one took part in, recording the updates it held as lost (their clients send
them again).

As root, only what needs root keeps it (see lifl.node.privilege): the supervisor (it restarts
the gateway, which starts as root to bind its ports) and the agent (it creates every tenant's
objects, chowns them and starts functions as the tenants' uids) stay root; the gateway drops
to the service user once its sockets are bound, and the embedded redis runs as that user.

Before the gateway starts, the operator's token (lifl.node.operator_token) is registered in Redis.
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import shutil
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any
from urllib.parse import urlsplit

import redis

from lifl import procstat
from lifl.control.controller import ControlConfig
from lifl.net.flags import limit_argv, plaintext_warning, tls_argv
from lifl.net.limits import ConnectionLimits
from lifl.net.tls import ServerTls
from lifl.node import operator_token
from lifl.node.actuator import instance_pids
from lifl.node.spill import DEFAULT_MODEL_IDLE_S
from lifl.node.agent import agent_argv
from lifl.node.privilege import (
    Identity, can_connect, current, make_private_tree, popen_as, prepare_data_dir, require_reachable, secure_checkpoints,
    service_identity,
)
from lifl.procs import die_with_parent, on_signals, stop_process, wait_exited
from lifl.keys.ebpf import remove_node_channel
from lifl.store import SHM_DIR, remove_node_objects

RESTART_BACKOFF = (0.2, 0.5, 1.0, 2.0, 5.0)
# How long a Redis may take to answer: it only bounds one that is alive but never answers (one
# that exits fails at once). Generous: an embedded one opens its append-only file first, which a
# loaded machine's busy disk has held up past 15 s.
REDIS_START_TIMEOUT_S = 120.0
# A restarted Redis is waited for no longer than this: the supervisor's loop also restarts the
# other children; one that answers later is simply used.
REDIS_RESTART_WAIT_S = 15.0
REDIS_DIR = "redis"  # an embedded redis's directory: DATA_DIR/redis holds its data, RUN_DIR/redis its socket


def default_run_dir(node: str) -> Path:
    if os.geteuid() == 0:
        return Path("/run/lifl") / node
    return Path(os.environ.get("XDG_RUNTIME_DIR", f"/tmp/lifl-{os.getuid()}")) / "lifl" / node


def default_data_dir(node: str) -> Path:
    if os.geteuid() == 0:
        return Path("/var/lib/lifl") / node
    return Path.home() / ".local/share/lifl" / node


def default_shm_capacity() -> int:
    """Half the machine's memory, and no more than /dev/shm can hold."""
    pages = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    st = os.statvfs(SHM_DIR)
    return min(pages // 2, st.f_bavail * st.f_frsize)


@dataclass
class NodeConfig:
    node: str = "n0"
    http: str = "127.0.0.1:8080"
    grpc: str = "127.0.0.1:50051"
    redis: str | None = None  # None: start an embedded redis-server
    run_dir: Path | None = None
    data_dir: Path | None = None
    shm_capacity: int | None = None
    pool_limit: int | None = None
    max_instances: int = 16
    keep_warm: float = 60.0
    checkpoints: str = ""  # "" = a directory under data_dir; see lifl.checkpoints
    reuse: bool = True  # see lifl.node.agent.AgentConfig
    lazy: bool = False
    channel: str = "auto"  # the key transport (lifl.keys.factory.CHANNELS)
    functions: str = "processes"  # who starts function instances (lifl.node.actuator.ACTUATORS)
    retain_budget: int = 0  # shared-memory bytes a tenant may keep for queries (0: half the capacity)
    model_idle_s: float = DEFAULT_MODEL_IDLE_S  # a model unused this long leaves shared memory (lifl.node.spill)
    control: ControlConfig = field(default_factory=ControlConfig)
    gateway_limits: ConnectionLimits = field(default_factory=ConnectionLimits)
    open_metrics: bool = False  # GET /metrics without a token
    tls: ServerTls | None = None  # None: plain TCP (see lifl.net.flags.plaintext_warning)
    service_user: str | None = None  # who the gateway and embedded redis run as (see privilege.service_identity)
    operator_token: str | None = None  # None: $LIFL_OPERATOR_TOKEN, operator_token_file or DATA_DIR's (operator_token.resolve)
    operator_token_file: Path | None = None

    def agent_options(self) -> dict[str, object]:
        return {"max_instances": self.max_instances, "keep_warm": self.keep_warm, "reuse": self.reuse, "lazy": self.lazy,
                "control": self.control, "channel": self.channel, "functions": self.functions,
                "retain_budget": self.retain_budget, "model_idle_s": self.model_idle_s}

    def __post_init__(self) -> None:
        if not re.fullmatch(r"[a-z0-9]{1,16}", self.node):  # no '-': it separates name parts in /dev/shm
            raise ValueError(f"node id must be 1-16 lowercase letters or digits, got {self.node!r}")
        self.run_dir = self.run_dir or default_run_dir(self.node)
        self.data_dir = self.data_dir or default_data_dir(self.node)
        self.shm_capacity = self.shm_capacity or default_shm_capacity()
        self.pool_limit = self.pool_limit if self.pool_limit is not None else self.shm_capacity // 4


def embedded_redis_argv(data_dir: Path, listen: list[str], owner: Identity) -> list[str]:
    """The redis-server `lifl up` starts when none is given, as ``owner`` (privilege.popen_as):
    ``listen`` says where; its data lives in DATA_DIR/redis, ``owner``'s alone, logged to an
    append-only file synced every second. Refuses (SystemExit) a DATA_DIR ``owner`` cannot get to."""
    exe = shutil.which("redis-server")
    if exe is None:
        raise SystemExit("lifl: redis-server is not installed (run `make install`, or pass --redis URL)")
    directory = data_dir / REDIS_DIR
    require_reachable(owner, {directory: "redis-server's directory"})
    make_private_tree(directory, owner)
    return [exe, *listen, "--dir", str(directory), "--appendonly", "yes", "--appendfsync", "everysec", "--save", "",
            "--logfile", str(embedded_redis_log(data_dir))]


def embedded_redis_log(data_dir: Path) -> Path:
    return data_dir / REDIS_DIR / "redis.log"


@dataclass
class Addresses:
    http: str
    grpc: str
    redis: str


class Child:
    def __init__(self, name: str, argv: list[str], ready: str | None, log: IO[str], pdeathsig: bool = False,
                 popen_options: dict[str, Any] | None = None) -> None:
        self.name, self.argv, self.ready_prefix, self.log, self.pdeathsig = name, argv, ready, log, pdeathsig
        self.popen_options = popen_options or {}  # e.g. the user to run as (privilege.popen_as)
        self.proc: subprocess.Popen | None = None
        self.ready_line = ""
        self.restarts = 0

    def start(self, timeout: float = 30.0) -> None:
        self.proc = subprocess.Popen(
            self.argv, stdout=subprocess.PIPE, text=True, start_new_session=True,
            preexec_fn=die_with_parent if self.pdeathsig else None, **self.popen_options,
        )
        if self.ready_prefix is None:
            threading.Thread(target=_forward, args=(self.proc.stdout, self.log), daemon=True).start()
            return
        deadline = time.monotonic() + timeout
        assert self.proc.stdout is not None
        while True:
            line = self.proc.stdout.readline()
            if line.startswith(self.ready_prefix):
                self.ready_line = line.strip()
                threading.Thread(target=_forward, args=(self.proc.stdout, self.log), daemon=True).start()
                return
            if not line or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"{self.name} did not start (exit status {self.proc.poll()})")
            self.log.write(line)

    def stop(self, timeout: float = 10.0) -> None:
        if self.proc is not None:
            stop_process(self.proc, timeout)


def _forward(stream: IO[str] | None, log: IO[str]) -> None:
    if stream is None:
        return
    for line in stream:
        log.write(line)
        log.flush()


class Node:
    def __init__(self, config: NodeConfig, log: IO[str] = sys.stdout) -> None:
        self.config = config
        self.log = log  # where the node's processes' output goes
        self.children: dict[str, Child] = {}
        self.addresses: Addresses | None = None
        self._stop = threading.Event()
        self._lock_file: IO[str] | None = None
        self.service = current()  # who the gateway and embedded redis run as, once started
        self.operator_token = ""  # once started
        self.operator_token_source = ""  # where it came from (operator_token.OperatorToken.source)

    @property
    def run_dir(self) -> Path:
        assert self.config.run_dir is not None
        return self.config.run_dir

    @property
    def drops_privileges(self) -> bool:
        """Whether the gateway runs as another user than the supervisor (the service user)."""
        return self.service != current()

    def start(self) -> Addresses:
        c = self.config
        assert c.data_dir is not None
        try:
            self.service = service_identity(c.service_user)
        except ValueError as e:
            raise SystemExit(f"lifl: {e}") from None
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self._take_lock()
        prepare_data_dir(c.data_dir, self.service, hosts_redis=c.redis is None)
        require_reachable(self.service, self._run_directories())
        secure_checkpoints(c.checkpoints, c.data_dir)
        try:
            token = operator_token.resolve(c.data_dir, given=c.operator_token, token_file=c.operator_token_file)
        except ValueError as e:
            raise SystemExit(f"lifl: {e}") from None
        stale = remove_node_objects(c.node)
        if stale:
            print(f"lifl: removed {stale} shared-memory objects left by a previous run of node {c.node}", file=sys.stderr)
        redis_url = c.redis or self._start_redis()
        self._wait_redis(redis_url, self.children.get("redis"))
        if urlsplit(redis_url).scheme == "unix":
            self._check_gateway_reaches(Path(urlsplit(redis_url).path), "Redis's socket")
        operator_token.register(redis_url, token)
        self.operator_token, self.operator_token_source = token.token, token.source
        py = sys.executable
        socket_group = ["--socket-group", str(self.service.gid)] if self.drops_privileges else []
        self.children["agent"] = agent = Child("agent", [
            py, "-m", "lifl.node.agent", "--node", c.node, "--run-dir", str(self.run_dir), "--data-dir", str(c.data_dir),
            "--redis", redis_url, "--checkpoints", c.checkpoints,
            "--shm-capacity", str(c.shm_capacity), "--pool-limit", str(c.pool_limit), *socket_group,
            *agent_argv(c.agent_options()),
        ], ready="ready", log=self.log)
        agent.start()
        self._check_gateway_reaches(self.run_dir / "agent.sock", "the agent's socket")
        user = ["--user", self.service.spec] if self.drops_privileges else []
        self.children["gateway"] = gateway = Child("gateway", [
            py, "-m", "lifl.gateway", "--node", c.node, "--redis", redis_url,
            "--agent-socket", str(self.run_dir / "agent.sock"), "--http", c.http, "--grpc", c.grpc,
            "--placement", c.control.placement, "--capacity", str(c.control.capacity), *limit_argv(c.gateway_limits), *tls_argv(c.tls), *user,
            *(["--open-metrics"] if c.open_metrics else []),
        ], ready="{", log=self.log)
        gateway.start()
        addresses = json.loads(gateway.ready_line)
        self.addresses = Addresses(addresses["http"], addresses["grpc"], redis_url)
        # a restarted gateway must come back on the same ports
        gateway.argv[gateway.argv.index("--http") + 1] = self.addresses.http
        gateway.argv[gateway.argv.index("--grpc") + 1] = self.addresses.grpc
        return self.addresses

    def _take_lock(self) -> None:
        self._lock_file = open(self.run_dir / "node.lock", "a+")
        try:
            fcntl.flock(self._lock_file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise SystemExit(f"lifl: node {self.config.node} is already running (lock {self.run_dir / 'node.lock'})") from None

    def _run_directories(self) -> dict[Path, str]:
        """The service user's directories in RUN_DIR (privilege.require_reachable): the agent's
        socket's, and an embedded redis's socket's; the gateway connects to both. (Its data
        directory is embedded_redis_argv's to check.)"""
        directories = {self.run_dir: "the directory of the agent's socket"}
        if self.config.redis is None:
            directories[self.run_dir / REDIS_DIR] = "the directory of Redis's socket"
        return directories

    def _check_gateway_reaches(self, socket_path: Path, what: str) -> None:
        if self.drops_privileges and not can_connect(socket_path, self.service):
            raise SystemExit(f"lifl: the gateway runs as {self.service} and cannot connect to {what} {socket_path}: "
                             "make it and its directories reachable by that user, or choose another with --service-user")

    def _start_redis(self) -> str:
        assert self.config.data_dir is not None
        sock_dir = self.run_dir / REDIS_DIR  # the service user's: redis makes its socket there
        make_private_tree(sock_dir, self.service)
        sock = sock_dir / "redis.sock"
        argv = embedded_redis_argv(self.config.data_dir, ["--port", "0", "--unixsocket", str(sock), "--unixsocketperm", "700"],
                                   self.service)
        self.children["redis"] = child = Child("redis", argv, ready=None, log=self.log, pdeathsig=True,
                                               popen_options=popen_as(self.service))
        child.start()
        return f"unix://{sock}"

    def _wait_redis(self, url: str, child: Child | None, timeout: float = REDIS_START_TIMEOUT_S) -> None:
        """Until the Redis at ``url`` answers; ``child``, the embedded one, must stay alive meanwhile."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                redis.Redis.from_url(url).ping()
                return
            except redis.RedisError:
                if child is not None and child.proc is not None and child.proc.poll() is not None:
                    assert self.config.data_dir is not None  # an embedded one lives there
                    raise SystemExit(f"lifl: the embedded redis-server exited ({child.proc.returncode}) before it answered; "
                                     f"its log: {embedded_redis_log(self.config.data_dir)}") from None
                if time.monotonic() > deadline:
                    raise SystemExit(f"lifl: redis at {url} does not answer after {timeout:g} s") from None
                time.sleep(0.05)

    def supervise(self) -> None:
        """Run until stopped, restarting whichever child exits (redis first: the others need it)."""
        while not self._stop.wait(0.1):
            for name in ("redis", "agent", "gateway"):
                child = self.children.get(name)
                if child and child.proc and child.proc.poll() is not None:
                    self._restart(name, child)

    def _restart(self, name: str, child: Child) -> None:
        """Start ``child`` again after its back-off; one that fails to start is tried again by
        the next turn of ``supervise`` (it has exited), after a longer back-off."""
        assert child.proc is not None
        delay = RESTART_BACKOFF[min(child.restarts, len(RESTART_BACKOFF) - 1)]
        print(f"lifl: {name} of node {self.config.node} exited ({child.proc.returncode}); restarting in {delay}s",
              file=sys.stderr)
        if self._stop.wait(delay):
            return  # stopping: no restart
        child.restarts += 1
        if name == "agent":
            self._remove_agent_leftovers()
        try:
            child.start()
        except RuntimeError as e:
            print(f"lifl: {e}", file=sys.stderr)
            return
        if name == "redis":
            try:
                self._wait_redis(self.addresses.redis if self.addresses else "", child, REDIS_RESTART_WAIT_S)
            except SystemExit as e:  # it died again while starting: the next turn restarts it
                print(e, file=sys.stderr)

    def _remove_agent_leftovers(self) -> None:
        """What a killed agent leaves: its instances (left to init; none may write an object
        after this), its shared-memory objects and its key channel (a clean agent unloads it)."""
        wait_exited(instance_pids(self.config.node), timeout=0)
        remove_node_objects(self.config.node)
        remove_node_channel(self.config.node)

    def pids(self) -> dict[str, list[int]]:
        """The node's processes by role (aggregators are the agent's children)."""
        agent = self.children["agent"].proc
        gateway = self.children["gateway"].proc
        assert agent is not None and gateway is not None
        return {"agent": [agent.pid], "gateway": [gateway.pid], "aggregators": procstat.children(agent.pid)}

    def request_stop(self) -> None:
        self._stop.set()

    def stop(self) -> None:
        """Stop gateway, agent and redis, in that order, and leave nothing in /dev/shm."""
        self._stop.set()
        for name in ("gateway", "agent", "redis"):
            child = self.children.get(name)
            if child:
                child.stop()
        self._remove_agent_leftovers()  # if it was killed
        for name in ("agent.sock", f"{REDIS_DIR}/redis.sock"):
            (self.run_dir / name).unlink(missing_ok=True)
        if self._lock_file:
            self._lock_file.close()
            self._lock_file = None


def run(config: NodeConfig) -> int:
    """`lifl up`: start, print the addresses, supervise until Ctrl-C or SIGTERM."""
    node = Node(config)
    on_signals(node.request_stop)
    try:
        a = node.start()
    except (RuntimeError, SystemExit):
        node.stop()
        raise
    if config.tls is None:
        print(plaintext_warning(a.http, a.grpc), file=sys.stderr, flush=True)
    print(f"lifl node {config.node} is up\n  http: {'https' if config.tls else 'http'}://{a.http}\n  grpc: {a.grpc}\n  redis: {a.redis}\n"
          f"  operator token: {node.operator_token_source}", flush=True)
    node.supervise()
    node.stop()
    print(f"lifl node {config.node} stopped", flush=True)
    return 0
