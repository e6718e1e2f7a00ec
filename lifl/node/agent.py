"""The node agent: owns the node's shared memory, runs its aggregator instances and routes keys.

It is a thin shell around pure parts: the round's shared state is in Redis (``lifl.state``),
the node's tree for each round is ``lifl.node.tree`` (events in, effects out), cluster-wide
round duties are ``lifl.control.rounds`` and the planner is ``lifl.control.planner``. The
shell applies effects, talks to Redis (never under its lock), and runs named periodic duties.

- The gateway asks it for objects to receive blobs into (``Admit`` reserves a slot of the
  job's global round in Redis, converting the client's lease if it holds one, enforces the
  job's in-flight budget, and reserves the shared memory that aggregating the update needs,
  within the job's fair share: ``lifl.ledger``), then hands the sealed update over (``Submit``), which counts
  it once for the whole round in Redis and feeds it to this node's tree.
- Tasks run on instances of the job's tenant: idle warm ones first (reuse, §5.3: an idle leaf
  becomes the middle, the middle's instance the top), new ones otherwise (a cold start), or
  wait; the planner may ask for instances to be warmed ahead of the load (§5.2).
- The middle's result goes to the round's top; if that is on another node, this node's
  gateway streams it there out of shared memory (``ForwardPartial``) and keeps it until the
  round ends, in case the top moves. The top's result is checkpointed in the background and
  installed as the next version once durable.
- Every object reference belongs to a holder (an upload, a task, a round, a job's model or
  replica, a gateway's read). A holder that disappears is released.
- A task's inputs are immutable and stay in shared memory until the task reports them folded
  into a new accumulator (``Folded``: every fold writes a fresh one, so the latest is always a
  complete sum). An instance that dies or fails mid-task loses only its scratch objects: the
  task runs again on another instance from its latest accumulator and the inputs it had not
  folded (up to ``MAX_TASK_ATTEMPTS`` runs), so an acknowledged update is never lost to a crash.
- A node that dies mid-round is declared lost by whoever notices (its registration in Redis
  lapses): what it acknowledged and had not delivered is recorded as lost, and the round
  completes on the others. A restarted node does this for itself before it serves.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import queue
import socket
import sys
import threading
import time
import traceback
from collections import deque
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

from lifl import checkpoints
from lifl import format as fmt
from lifl import kernels
from lifl.cluster_types import NO_MODEL, Job, Shard
from lifl.control import rounds as cluster_rounds
from lifl.control.controller import Controller, ControlConfig
from lifl.control.planner import InstanceView, expired, pick_warm
from lifl.errors import (
    BadRequest, Conflict, Forbidden, Internal, LiflError, NotFound, Overloaded, PayloadTooLarge, Unavailable, Unprocessable,
)
from lifl.jobs import TENANT_NAME, JobSpec
from lifl.keys.factory import CHANNELS, transport
from lifl.keys.record import KIND_CLOSE, KeyMessage, now_ns
from lifl.ledger import PARTIAL, UPDATE, JobSizes, RoundOf
from lifl.node import tree
from lifl.node.actuator import ACTUATORS, Actuator, ClusterPods, LocalProcesses
from lifl.node.dispatch import serve
from lifl.node.metrics import Metrics
from lifl.node.privilege import attach_refusal, current, peer_identity
from lifl.node.retention import Retainer, query_holder, update_blob
from lifl.flstore.retention import MODEL, Held, RetentionPolicy, checkpoints_kept, in_memory, round_queryable, version_queryable
from lifl.procs import die_with_parent, on_signals
from lifl.protocol import (
    PROTOCOL, QUERY_ROLE, ROLES, Abort, Admit, AdmitModel, AdmitPartial, AdmitReplica, Admitted, Alloc, Attach, Allocated,
    CancelTask, Document, Done, Failed, Folded, Forwarded, ForwardPartial, GetMetrics, GetRecent, GetStatus, Handoff, Hello,
    InstallModel, InstallReplica, InstallResult, Installed, Invoke, Message, ModelOpened, OpenModel, Query, Ready, Release,
    Route, StrategyInputs, Submit, SubmitPartial, Submitted, TakeQuery, Text, Welcome, decode,
)
from lifl.rpc import Connection, error_reply
from lifl.state import ACCEPT_CLOSED_ROUND, RESERVE_OK, ClusterState, accept_refusal, refusal
from lifl.store import SHM_DIR, ObjectStore, Segment, Tenant, remove_node_objects
from lifl.strategy import privacy, strategy_bytes

DEFAULT_HANDLER = "lifl.functions.aggregator.handler:handle"
STRATEGY_INPUTS_TIMEOUT_S = 60.0  # how long a top waits for other nodes' updates of its round to be readable
SETTLE_PASSES = 4  # duties that enable further duties (close, then place the top) within one settle
FORWARD_RETRY = (0.2, 0.5, 1.0, 2.0)  # seconds before resending a partial that did not arrive
OUTBOX_RETRY = 0.005  # seconds between attempts to deliver keys to an instance whose queue was full
CHECKPOINT_RETRY = (0.5, 1.0, 2.0, 5.0, 10.0)  # seconds before writing a failed checkpoint again; the last repeats
MAX_TASK_ATTEMPTS = 3  # runs of one task (the first and two re-runs) before its round is abandoned
INFERENCE_MODULES = ("torch", "torchvision", "lifl.workload")  # what an instance answering inference imports first
QUERY_FIELDS = ("workload", "round", "version", "rounds", "scope")  # a query's fields that are no workload parameter
GATHER, NODE_SCOPE = "gather", "node"  # read every update here; compute this node's part of a split query
QUERY_SCOPES = ("", GATHER, NODE_SCOPE)
QUERY_TIMEOUT_S = 300.0  # a query not answered by then is called off (its instance is stopped)
MAX_QUERY_ROUNDS = 100  # rounds one reputation query reads at most
HANDOFF_WAIT_S = 5.0  # how long a parent's report of folding a key sent ahead waits for that key's hand-off


def check_traversable(directory: Path) -> None:
    """Tenant functions run as other users: they must be able to reach the channel sockets."""
    for d in [directory.resolve(), *directory.resolve().parents]:
        if not os.stat(d).st_mode & 0o001:
            raise SystemExit(
                f"lifl agent: {d} is not searchable by other users, so tenant functions cannot reach "
                f"{directory}; choose a --run-dir whose parents are world-searchable (e.g. /run/lifl)"
            )


def public_reason(error: BaseException) -> str:
    """Why a checkpoint failed, as the job's status tells its tenant: the kind of failure without
    paths, URLs or names of the node (its log has the whole message)."""
    if isinstance(error, OSError) and error.strerror:
        return f"{type(error).__name__}: {error.strerror}"
    return f"{type(error).__name__} (the node's log has the details)"


@dataclass
class AgentConfig:
    node: str
    run_dir: Path
    redis_url: str
    shm_capacity: int
    pool_limit: int
    max_instances: int = 16
    keep_warm: float = 60.0
    checkpoints: str = ""  # store spelling (lifl.checkpoints.open_store); "" = a directory under data_dir
    data_dir: Path | None = None
    isolate: bool = field(default_factory=lambda: os.geteuid() == 0)
    handler: str = DEFAULT_HANDLER
    reuse: bool = True  # warm instances take any role (§5.3); False: one task per instance (a baseline)
    lazy: bool = False  # aggregate only once every input arrived (a baseline; lifl is eager, §5.4)
    control: ControlConfig = field(default_factory=ControlConfig)
    socket_group: int | None = None  # may connect too (the gateway's, when it runs as the service user)
    channel: str = "auto"  # the key transport (lifl.keys.factory.CHANNELS)
    functions: str = "processes"  # who starts function instances (lifl.node.actuator.ACTUATORS)
    retain_budget: int = 0  # shared-memory bytes each tenant may keep for queries; 0: half the capacity

    @property
    def socket_path(self) -> Path:
        return self.run_dir / "agent.sock"

    @property
    def chan_dir(self) -> Path:
        return self.run_dir / "chan"

    @property
    def functions_socket_path(self) -> Path:
        """Where function instances the node did not start (pods) attach: any local process may
        connect, the kernel's peer credentials decide whether it may attach (and as which tenant)."""
        return self.run_dir / "functions.sock"


@dataclass(eq=False)
class JobRun:
    """What this node keeps of a job; Redis holds the truth."""

    spec: JobSpec
    tenant: Tenant
    model_spec: fmt.ModelSpec | None
    model_key: bytes | None = None  # the model, if this node installed it
    model_version: int = NO_MODEL
    replica: tuple[bytes, int] | None = None  # (key, version): a copy fetched to serve it here
    strategy_state: tuple[bytes, int] | None = None  # (key, version): the strategy's state after that version, if made here
    inflight: int = 0  # updates admitted here and not yet aggregated
    model_upload: bool = False

    @cached_property
    def sizes(self) -> JobSizes:
        """What aggregating its updates allocates (computed once: it encodes the model's header)."""
        assert self.model_spec is not None
        strategy = self.spec.strategy_spec
        return JobSizes.of(self.model_spec, self.spec.leaf_fan_in, strategy_bytes(strategy, self.model_spec),
                           self.spec.fixed_point_spec)


@dataclass(eq=False)
class Upload:
    job: str
    kind: str  # "update", "model", "partial" or "replica"
    holder: Hashable
    version: int = NO_MODEL
    round: int = -1
    epoch: int = 0
    from_node: str = ""
    base: int = NO_MODEL  # an update's base version: older than ``version`` (the round's) in fedbuff jobs


@dataclass(eq=False)
class Instance:
    id: int
    tenant: Tenant
    task: int | None = None
    running: tree.Task | None = None  # the task itself: its round may end before the instance reports
    ready: bool = False  # its runtime has loaded the function (a warm instance, not one still starting)
    last_used: float = field(default_factory=time.monotonic)
    specs_sent: set[str] = field(default_factory=set)
    inference: bool = False  # it loaded torch before dropping privileges: it may answer inference queries


@dataclass(eq=False)
class TaskProgress:
    """What a task was given and what it folded so far: enough to run it again from there."""

    unfolded: list[KeyMessage] = field(default_factory=list)  # inputs delivered, not reported folded
    state: KeyMessage | None = None  # the accumulator summing up the inputs folded so far
    folded: int = 0  # task inputs summed up in ``state``
    attempts: int = 0  # runs started
    offset: int = 0  # inputs the current run does not see one by one (``state`` stands for them)

    def start(self) -> None:
        self.attempts += 1
        self.offset = self.folded - 1 if self.state is not None else 0

    def fan_in(self, fan_in: int) -> int:
        """The task's fan-in as the current run counts its inputs."""
        return fan_in if fan_in == tree.OPEN else fan_in - self.offset

    def inputs(self) -> list[KeyMessage]:
        """What a new run is given: the latest accumulator, then the inputs not folded into it."""
        return ([self.state] if self.state is not None else []) + self.unfolded

    def fold(self, key: bytes) -> KeyMessage | None:
        """``key`` was folded: the input it was (None if it is no input, e.g. the previous state)."""
        for i, msg in enumerate(self.unfolded):
            if msg.key == key:
                self.folded += 1
                return self.unfolded.pop(i)
        return None


@dataclass(eq=False)
class FailedCheckpoint:
    """A round's model whose checkpoint could not be written: it waits, unseen, to be written again."""

    install: tree.Install
    attempts: int
    next_try: float  # time.monotonic()


@dataclass(eq=False)
class OutgoingPartial:
    """This node's result of a round on its way to the top on another node."""

    ref: int
    job: str
    round: int
    node: str
    epoch: int
    input: tree.Input
    state: str = "sending"  # sending, failed, done
    attempts: int = 0
    next_try: float = 0.0


@dataclass(eq=False)
class QueryRun:
    """A query waiting for, or running on, a function instance of its tenant."""

    id: int
    job: str
    tenant: Tenant
    version: int
    doc: dict[str, Any]  # what the instance is given (TakeQuery)
    instance: int = 0
    answered: threading.Event = field(default_factory=threading.Event)
    stats: dict[str, Any] | None = None
    error: LiflError | None = None

    def finish(self, stats: dict[str, Any] | None, error: LiflError | None = None) -> None:
        self.stats, self.error = stats, error
        self.answered.set()


class Checkpointer:
    """Writes checkpoints one at a time on a thread of its own, off every aggregation path."""

    def __init__(self, store: checkpoints.CheckpointStore) -> None:
        self.store = store
        self._queue: queue.Queue[tuple[str, int, int, int, Callable[[float, Exception | None], None]] | None] = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="checkpointer", daemon=True)
        self._thread.start()
        self.keep: Callable[[str], int] = lambda job: checkpoints.KEEP  # versions kept per job

    def submit(self, job: str, version: int, fd: int, size: int, done: Callable[[float, Exception | None], None]) -> None:
        """Write ``size`` bytes of ``fd`` (closed afterwards) as ``version``; then ``done(seconds, error)``."""
        self._queue.put((job, version, fd, size, done))

    def write(self, job: str, version: int, fd: int, size: int) -> float:
        t0 = time.perf_counter()
        try:
            self.store.save(job, version, fd, size)
        finally:
            os.close(fd)
        checkpoints.prune(self.store, job, self.keep(job))
        return time.perf_counter() - t0

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            job, version, fd, size, done = item
            try:
                seconds, error = self.write(job, version, fd, size), None
            except Exception as e:  # the install still happens; the error is reported
                seconds, error = 0.0, e
            try:
                done(seconds, error)
            except Exception:  # Redis unreachable: the round's duties retry what is left
                traceback.print_exc()

    def stop(self) -> None:
        self._queue.put(None)
        self._thread.join(timeout=30)


IO = Callable[[], None]  # work an effect needs outside the lock (Redis, other processes)


class Agent:
    def __init__(self, config: AgentConfig, state: ClusterState) -> None:
        self.config = config
        self.node = config.node
        self.state = state
        self.lock = threading.RLock()
        self._delivered = threading.Condition(self.lock)  # a task was given an input (Deliver)
        self.store = ObjectStore(config.node, config.shm_capacity, config.pool_limit)
        self.metrics = Metrics()
        data_dir = config.data_dir or config.run_dir
        self.checkpointer = Checkpointer(checkpoints.open_store(config.checkpoints, data_dir=data_dir, redis_url=config.redis_url))
        self.trees = tree.Trees(config.node)
        self.transport, why = transport(config.channel, config.node, config.chan_dir)
        print(f"lifl agent: keys travel by {self.transport.name} ({why})", file=sys.stderr)
        if (collector := self.transport.collector()) is not None:
            self.metrics.registry.register(collector)
        self.actuator: Actuator
        if config.functions == "pods":
            self.actuator = ClusterPods(config.node, self.transport, self._serve_instance)
        elif config.functions == "processes":
            self.actuator = LocalProcesses(config.node, self.transport, config.handler, self._serve_instance)
        else:
            raise ValueError(f"unknown --functions {config.functions!r}: one of {', '.join(ACTUATORS)}")
        self.controller = Controller(state, config.node, config.control, reuse=config.reuse)
        self.jobs: dict[str, JobRun] = {}
        self.instances: dict[int, Instance] = {}
        self.uploads: dict[bytes, Upload] = {}
        self.waiting: deque[int] = deque()  # tasks with inputs, waiting for an instance
        self.pending: dict[int, list[KeyMessage]] = {}  # inputs of tasks not running yet
        self.placed: dict[int, Instance] = {}  # running tasks
        self.progress: dict[int, TaskProgress] = {}  # tasks without a result yet (to run them again)
        self.outbox: deque[tuple[Tenant, KeyMessage]] = deque()  # (tenant, message) for full queues
        self.outgoing: dict[int, OutgoingPartial] = {}
        self.failed_checkpoints: dict[str, FailedCheckpoint] = {}  # by job
        self.steps: dict[tuple[str, int], StrategyStep] = {}  # a top's strategy step, by (job, new version), until installed
        self.local_updates: dict[bytes, str] = {}  # client updates admitted here and not yet aggregated, by key
        self.store.on_free = self._update_done
        self.retainer = Retainer(config.node, self.store, state, self.checkpointer.store, self.metrics, self.lock,
                                 config.retain_budget or config.shm_capacity // 2)
        # the versions a query may read stay (read from Redis if this node has not seen the job yet)
        self.checkpointer.keep = lambda job: checkpoints_kept(self.retainer.policy(job), checkpoints.KEEP)
        self.queries: dict[int, QueryRun] = {}
        self.query_waiting: deque[int] = deque()  # queries waiting for an instance
        self.forwarder: Connection | None = None  # the gateway's connection taking ForwardPartial
        self.recent: deque[dict[str, Any]] = deque(maxlen=512)  # finished tasks' statistics
        self.started_at = time.time()
        self._tenants: dict[str, Tenant] = {}
        self._next_id = 0
        self._stopping = threading.Event()
        self._wake = threading.Event()  # the duty loop: stop, or keys wait in the outbox
        self._listener: socket.socket | None = None
        self._functions_listener: socket.socket | None = None
        self._duties: list[tuple[str, float, Callable[[], None]]] = [
            ("expire_idle_instances", 0.2, self.expire_idle_instances),
            ("round_duties", 0.2, self.round_duties),
            ("retry_forwards", 0.1, self.retry_forwards),
            ("retry_checkpoints", 0.2, self.retry_checkpoints),
            ("publish_status", 1.0, self.publish_status),
            ("trim_pool", 5.0, self.trim_pool),
            ("drop_stale_replicas", 1.0, self.drop_stale_replicas),
            ("control", config.control.period, self.control),
            ("warm_instances", 0.5, self.warm_instances),
            ("apply_retention", 1.0, self.apply_retention),
        ]

    # -- lifecycle --------------------------------------------------------------------------------
    def start(self) -> None:
        """Clean up what a killed predecessor left, give up its rounds, restore models, then listen."""
        stale = remove_node_objects(self.node)
        if stale:
            print(f"lifl agent: removed {stale} shared-memory objects left by a previous run", file=sys.stderr)
        self.config.run_dir.mkdir(parents=True, exist_ok=True)
        if self.config.isolate:
            check_traversable(self.config.run_dir)
        self.config.chan_dir.mkdir(exist_ok=True)
        os.chmod(self.config.run_dir, 0o755)
        os.chmod(self.config.chan_dir, 0o755)
        self._give_up_previous_rounds()
        self._restore_models()
        self.publish_status()
        path = self.config.socket_path
        path.unlink(missing_ok=True)
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind(str(path))
        if self.config.socket_group is not None:
            os.chown(path, -1, self.config.socket_group)
        os.chmod(path, 0o600 if self.config.socket_group is None else 0o660)
        listener.listen(64)
        self._listener = listener
        functions = self.config.functions_socket_path
        functions.unlink(missing_ok=True)
        self._functions_listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._functions_listener.bind(str(functions))
        os.chmod(functions, 0o666)  # pods run as their tenant's uid: peer credentials are the check
        self._functions_listener.listen(64)
        threading.Thread(target=self._accept_loop, args=(listener, self._serve_peer), name="agent-accept",
                         daemon=True).start()
        threading.Thread(target=self._accept_loop, args=(self._functions_listener, self._serve_function),
                         name="agent-accept-functions", daemon=True).start()
        threading.Thread(target=self._duty_loop, name="agent-duties", daemon=True).start()
        threading.Thread(target=self._event_loop, name="agent-events", daemon=True).start()

    def stop(self) -> None:
        """Clean shutdown: unlink every object first (mappings stay valid for whoever holds them,
        and a checkpoint being written has its own descriptor), then stop the instances."""
        self._stopping.set()
        self._wake.set()
        for listening in (self._listener, self._functions_listener):
            if listening is not None:
                with contextlib.suppress(OSError):
                    listening.shutdown(socket.SHUT_RDWR)  # wakes its accept(): closing alone leaves it accepting
                listening.close()
        self.retainer.stop()
        with self.lock:
            self.store.close()
            remove_node_objects(self.node)
        self.actuator.stop_all()
        self.transport.close()
        self.checkpointer.stop()
        self.config.socket_path.unlink(missing_ok=True)
        self.config.functions_socket_path.unlink(missing_ok=True)

    def _give_up_previous_rounds(self) -> None:
        """A previous run of this node may have taken part in open rounds; everything it held
        is gone, so it declares itself lost in them (their other nodes carry on)."""
        for name in self.state.job_names():
            shard = self.state.shard(name)
            if self.node in shard.dead:
                continue
            if shard.counts.get(self.node, 0) or shard.inflight.get(self.node, 0) or shard.top == self.node:
                self.state.node_lost(name, shard.round, self.node)
                print(f"lifl agent: gave up round {shard.round} of {name!r}: this node restarted", file=sys.stderr)
                self.settle(name)

    def _restore_models(self) -> None:
        """Bring back the model of every job that lived on this node, from its latest checkpoint.

        The version clients saw is never newer than the latest checkpoint (versions are made
        visible once durable), so resuming from it loses no version and repeats none; if Redis
        lost the newest version (it syncs its log every second), the checkpoint brings it back."""
        for name in self.state.job_names():
            j = self.state.job(name)
            if j.version == NO_MODEL or j.model_node != self.node:
                continue
            latest = checkpoints.latest(self.checkpointer.store, name)
            if latest is None or latest < j.version:
                print(f"lifl agent: job {name!r} is at version {j.version} but its newest checkpoint is {latest}; "
                      f"it cannot resume on this node", file=sys.stderr)
                continue
            blob = self.checkpointer.store.load(name, latest)
            self.tenant(j.spec.tenant)
            with self.lock:
                run = self._run(j)
                seg = self._blob_object(run, blob, ("model", name))
                run.model_key, run.model_version = seg.key, latest
            if latest > j.version:
                summary = self._summary(j, self.state.shard(name), None, "interrupted",
                                        reason=f"node {self.node} restarted with version {latest}, which Redis had lost")
                self.state.next_round(name, j.round, latest, key=seg.key.hex(), node=self.node, summary=summary)
            self.state.set_checkpoint(name, latest)
            self.metrics.version.labels(name).set(latest)
            print(f"lifl agent: job {name!r} resumed at version {latest} from its checkpoint", file=sys.stderr)

    def _blob_object(self, run: JobRun, blob: bytes, holder: Hashable, *, model: bool = True) -> Any:
        layout = kernels.validate(blob, run.model_spec if model else None)
        seg = self.store.create(run.tenant, layout.total_size, holder, affinity="gateway")
        os.pwrite(seg.fd, blob, 0)
        self.store.seal(seg.key)
        return seg

    def _accept_loop(self, listener: socket.socket, serve_connection: Callable[[Connection], None]) -> None:
        while not self._stopping.is_set():
            try:
                sock, _ = listener.accept()
            except OSError:
                return
            threading.Thread(target=serve_connection, args=(Connection(sock),), daemon=True).start()

    def _take_id(self) -> int:
        with self.lock:
            self._next_id += 1
            return self._next_id

    # -- connections ------------------------------------------------------------------------------
    def _serve_peer(self, conn: Connection) -> None:
        """A gateway's connection: it says hello first, as a requester or as the forwarder."""
        try:
            frame, fds = conn.recv()
        except (EOFError, LiflError, OSError):
            conn.close()
            return
        for fd in fds:
            os.close(fd)
        hello = frame.get("op") == Hello.op and frame.get("protocol") == PROTOCOL
        conn.send({"id": frame.get("id"), "ok": hello, **(Welcome(self.node, PROTOCOL).encode() if hello else {
            "error": {"type": "BadRequest", "code": "bad_hello", "message": f"expected hello with protocol {PROTOCOL}",
                      "retry_after": None, "extra": {}}})})
        if not hello:
            conn.close()
            return
        if frame.get("role") == "forwarder":
            with self.lock:
                self.forwarder = conn
            serve(conn, {Forwarded: self.forwarded}, lambda: self._forwarder_gone(conn), "forwarder")
            return
        holder = ("conn", self._take_id())
        handlers: dict[type[Message], Any] = {
            Admit: lambda m, f: self.admit(holder, m),
            AdmitModel: lambda m, f: self.admit_model(holder, m),
            AdmitPartial: lambda m, f: self.admit_partial(holder, m),
            AdmitReplica: lambda m, f: self.admit_replica(holder, m),
            Abort: lambda m, f: self.abort(holder, m),
            Submit: lambda m, f: self.submit(holder, m),
            SubmitPartial: lambda m, f: self.submit_partial(holder, m),
            InstallModel: lambda m, f: self.install_model(holder, m),
            InstallReplica: lambda m, f: self.install_replica(holder, m),
            OpenModel: lambda m, f: self.open_model(holder, m),
            Release: lambda m, f: self.release(holder, m),
            GetMetrics: lambda m, f: (Text(self.metrics_text()), []),
            GetStatus: lambda m, f: (Document(self.status()), []),
            GetRecent: lambda m, f: (Document({"tasks": list(self.recent)}), []),
            Query: lambda m, f: self.query(m),
        }
        serve(conn, handlers, lambda: self._gateway_gone(holder), "gateway")

    def _serve_function(self, conn: Connection) -> None:
        """A function instance the node did not start (a pod) attaching: its first message is
        ``Attach``; if the kernel says it runs as the tenant's user, it becomes one of the
        tenant's warm instances here, and the connection its control connection."""
        request_id = None
        try:
            frame, fds = conn.recv()
            for fd in fds:
                os.close(fd)
            request_id = frame.pop("id", None)
            m = decode(frame)
            if not isinstance(m, Attach):
                raise BadRequest(f"a function's first message must be attach, not {m.op}", code="bad_attach")
            if m.protocol != PROTOCOL:
                raise BadRequest(f"protocol {m.protocol} is not this node's ({PROTOCOL})", code="bad_protocol")
            if not TENANT_NAME.fullmatch(m.tenant):
                raise BadRequest(f"tenant {m.tenant!r} is not a tenant name", code="bad_tenant")
            if self.config.isolate and m.tenant not in self._tenants and not self.state.known_tenant(m.tenant):
                # any local process may connect: it must not make the cluster allocate tenant ids
                raise Forbidden(f"tenant {m.tenant!r} is unknown: its first job (or its pods' admission) makes it",
                                code="unknown_tenant")
            tenant = self.tenant(m.tenant)
            why = attach_refusal(tenant.uid, tenant.name, peer_identity(conn.sock), current())
            if why is not None:
                raise Forbidden(why, code="wrong_identity")
        except (EOFError, OSError):
            conn.close()
            return
        except LiflError as e:
            print(f"lifl agent: refused a function instance: {e.message}", file=sys.stderr)
            with contextlib.suppress(OSError):
                conn.send(error_reply(request_id, e))
            conn.close()
            return
        with self.lock:  # its Ready waits for the lock: the instance is known by then
            if self._stopping.is_set():
                conn.close()
                return
            try:
                iid = self.actuator.attach(tenant, request_id, conn)
            except OSError:
                conn.close()
                return
            self.instances[iid] = Instance(iid, tenant)
            self.metrics.spawned.labels("attached").inc()
            self._dispatch()

    def _serve_instance(self, iid: int, conn: Connection) -> None:
        handlers: dict[type[Message], Any] = {
            Ready: lambda m, f: self.ready(iid),
            Alloc: lambda m, f: self.alloc(iid, m),
            Folded: lambda m, f: self.folded(iid, m),
            Handoff: lambda m, f: self.handoff(iid, m),
            InstallResult: lambda m, f: self.install(iid, m),
            Done: lambda m, f: self.done(iid, m),
            Failed: lambda m, f: self.failed(iid, m),
            TakeQuery: lambda m, f: self.take_query(iid, m),
            StrategyInputs: lambda m, f: self.strategy_inputs(iid, m),
        }
        serve(conn, handlers, lambda: self._instance_gone(iid, "its process exited"), "function instance")

    # -- jobs -------------------------------------------------------------------------------------
    def tenant(self, name: str) -> Tenant:
        t = self._tenants.get(name)
        if t is None:
            tenant_id = self.state.tenant_id(name)
            uid = tenant_id if self.config.isolate else None
            t = Tenant(name, uid, uid, tenant_id)
            with self.lock:
                t = self._tenants.setdefault(name, t)
        return t

    def _run(self, j: Job) -> JobRun:
        """This node's record of a job (call with the lock held; ``j`` was read from Redis)."""
        run = self.jobs.get(j.spec.job)
        if run is None:
            run = self.jobs[j.spec.job] = JobRun(j.spec, self._tenants[j.spec.tenant], j.model_spec)
        if run.model_spec is None:
            run.model_spec = j.model_spec
        return run

    def _job(self, name: str) -> tuple[Job, JobRun]:
        """The job as Redis has it, and this node's record of it (reads Redis: no lock held)."""
        j = self.state.job(name)
        self.tenant(j.spec.tenant)
        with self.lock:
            return j, self._run(j)

    # -- uploads ----------------------------------------------------------------------------------
    def _cached_run(self, name: str) -> JobRun:
        """This node's record of a job, read from Redis only the first time (its spec is fixed)."""
        with self.lock:
            run = self.jobs.get(name)
        return run if run is not None and run.model_spec is not None else self._job(name)[1]

    def admit(self, holder: Hashable, m: Admit) -> tuple[Message, list[int]]:
        run = self._cached_run(m.job)
        status, current, round_id = self.state.reserve(m.job, m.version, self.node, m.lease, m.client)
        if status != RESERVE_OK:
            raise refusal(status, m.job, current, round_id, run.spec.goal)
        try:
            with self.lock:
                if run.inflight >= run.spec.inflight_budget:
                    raise Overloaded(f"job {m.job!r} has {run.inflight} updates in flight on node {self.node}, its budget",
                                     code="inflight_budget")
                seg = self._admit_input(run, holder, RoundOf(m.job, round_id), UPDATE, m.size)
                run.inflight += 1
                self.local_updates[seg.key] = m.job
                self.uploads[seg.key] = Upload(m.job, "update", holder, current, round_id, base=m.version)
                self._publish_gauges(m.job, run)
                return Admitted(seg.key, m.version, round_id), [os.dup(seg.fd)]
        except LiflError as e:
            if isinstance(e, Overloaded):
                self.metrics.refused(m.job, e.code)
            self.state.unreserve(m.job, round_id, self.node)
            raise

    def _admit_input(self, run: JobRun, holder: Hashable, owner: RoundOf, kind: str, size: int) -> Segment:
        """The object of a client update or a partial result, created once the memory to
        aggregate it is reserved (``lifl.ledger``); call with the lock held."""
        return self.store.admit(run.tenant, size, holder, owner, kind, run.sizes)

    def admit_model(self, holder: Hashable, m: AdmitModel) -> tuple[Message, list[int]]:
        j, run = self._job(m.job)
        if j.version != NO_MODEL:
            raise Conflict(f"job {m.job!r} already has a model", code="model_exists")
        if m.size > run.spec.max_update_bytes:
            raise PayloadTooLarge(f"model of {m.size} bytes exceeds the job's limit of {run.spec.max_update_bytes} bytes")
        with self.lock:
            if run.model_upload:
                raise Conflict(f"the model of job {m.job!r} is being uploaded already", code="model_upload_in_progress")
            seg = self.store.create(run.tenant, m.size, holder, affinity="gateway")
            run.model_upload = True
            self.uploads[seg.key] = Upload(m.job, "model", holder)
            return Admitted(seg.key), [os.dup(seg.fd)]

    def admit_partial(self, holder: Hashable, m: AdmitPartial) -> tuple[Message, list[int]]:
        run = self._cached_run(m.job)
        if not self._hosts_top(m.job, m.round, m.epoch):
            self.settle(m.job)  # the close may not have reached this node yet
            if not self._hosts_top(m.job, m.round, m.epoch):
                raise Conflict(f"node {self.node} does not host the top of round {m.round} (epoch {m.epoch}) of {m.job!r}",
                               code="not_the_top")
        with self.lock:
            try:
                seg = self._admit_input(run, holder, RoundOf(m.job, m.round), PARTIAL, m.size)
            except Overloaded as e:  # the sending node tries again later
                self.metrics.refused(m.job, e.code)
                raise
            self.uploads[seg.key] = Upload(m.job, "partial", holder, round=m.round, epoch=m.epoch, from_node=m.from_node)
            return Admitted(seg.key, round=m.round), [os.dup(seg.fd)]

    def _hosts_top(self, job: str, round_id: int, epoch: int) -> bool:
        with self.lock:
            r = self.trees.round_of(job)
            return r is not None and r.round == round_id and r.top is not None and r.epoch == epoch

    def admit_replica(self, holder: Hashable, m: AdmitReplica) -> tuple[Message, list[int]]:
        run = self._cached_run(m.job)
        with self.lock:
            seg = self.store.create(run.tenant, m.size, holder, affinity="gateway")
            self.uploads[seg.key] = Upload(m.job, "replica", holder, version=m.version)
            return Admitted(seg.key, version=m.version), [os.dup(seg.fd)]

    def _upload(self, holder: Hashable, key: bytes, kind: str) -> Upload:
        upload = self.uploads.get(key)
        if upload is None or upload.holder != holder:
            raise NotFound(f"no upload {key.hex()} on this connection", code="no_such_upload")
        if upload.kind != kind:
            raise BadRequest(f"upload {key.hex()} is a {upload.kind}, not a {kind}")
        return upload

    def abort(self, holder: Hashable, m: Abort) -> tuple[Message, list[int]]:
        with self.lock:
            upload = self.uploads.get(m.key)
            if upload is None or upload.holder != holder:
                raise NotFound(f"no upload {m.key.hex()} on this connection", code="no_such_upload")
            self._drop_upload(m.key, upload)
        if upload.kind == "update":
            self.state.unreserve(upload.job, upload.round, self.node)
            self.state.count(upload.job, upload.round, f"rejected.{m.reason}")
        return None, []

    def _drop_upload(self, key: bytes, upload: Upload) -> None:
        del self.uploads[key]
        self.store.release(key, upload.holder)  # an update's in-flight count goes with its object
        if upload.kind in (UPDATE, PARTIAL):  # its round will not aggregate it: what it reserved goes back
            self.store.withdraw(RoundOf(upload.job, upload.round), upload.kind)
        if upload.kind == "model":
            self.jobs[upload.job].model_upload = False

    def _update_done(self, key: bytes) -> bool:
        """A client update admitted here is no longer in flight (folded, installed, or let go);
        False if ``key`` is not one (a partial sum, another node's result)."""
        job = self.local_updates.pop(key, None)
        if job is None:
            return False
        run = self.jobs[job]
        run.inflight -= 1
        self._publish_gauges(job, run)
        return True

    def _gateway_gone(self, holder: Hashable) -> None:
        with self.lock:
            dropped = [(k, u) for k, u in self.uploads.items() if u.holder == holder]
            for key, upload in dropped:
                self._drop_upload(key, upload)
            self.store.release_holder(holder)
        for _, upload in dropped:
            if upload.kind == "update":
                try:
                    self.state.unreserve(upload.job, upload.round, self.node)
                    self.state.count(upload.job, upload.round, "rejected.connection_lost")
                except Exception:  # Redis away: the round's slot comes back when the round ends
                    traceback.print_exc()

    def submit(self, holder: Hashable, m: Submit) -> tuple[Message, list[int]]:
        if m.samples < 1:
            raise BadRequest(f"samples must be positive, got {m.samples}")
        with self.lock:
            upload = self._upload(holder, m.key, "update")
            run = self.jobs[upload.job]
            self.store.seal(m.key)
            del self.uploads[m.key]
        status, _ = self.state.accept(upload.job, upload.round, self.node, m.client)
        if status < 0:
            with self.lock:
                self.store.release(m.key, holder)
            error = accept_refusal(status, upload.job, upload.round, self.state.version(upload.job), self.node)
            self.state.count(upload.job, upload.round, f"rejected.{error.code}")
            raise error
        self.metrics.arrived(upload.job)
        if self.retainer.policy(upload.job).keeps_update(m.client or ""):
            self._retain_update(upload, run, m)
        with self.lock:
            effects = self.trees.accepted(upload.job, upload.round, upload.version, run.spec.leaf_fan_in,
                                          tree.Input(m.key, m.samples, 1, False))
            io = self._apply(effects)
            queued = run.inflight
        self._run_io(io)
        if status == ACCEPT_CLOSED_ROUND:
            self.settle(upload.job)
        return Submitted(upload.round, queued), []

    def _retain_update(self, upload: Upload, run: JobRun, m: Submit) -> None:
        """Keep an accepted update for queries: index it cluster-wide first (a query may come
        as soon as the round ends), then hold it here and write it behind."""
        client = m.client or f"anonymous-{m.key.hex()[:12]}"
        with self.lock:
            size = self.store.get(m.key).size
        self.state.record_retained(upload.job, upload.round, client, {
            "client": client, "samples": m.samples, "version": upload.base, "node": self.node,
            "blob": update_blob(upload.round, m.key), "size": size})
        with self.lock:
            self.retainer.keep_update(upload.job, run.tenant, m.key, upload.round, upload.base, client, m.samples)

    def submit_partial(self, holder: Hashable, m: SubmitPartial) -> tuple[Message, list[int]]:
        with self.lock:
            upload = self._upload(holder, m.key, "partial")
            self.store.seal(m.key)
            del self.uploads[m.key]
        delivered = self.state.delivered(upload.job, upload.round, upload.from_node, upload.epoch)
        with self.lock:
            try:
                if delivered < 0:
                    raise tree.NotTheTop(f"round {upload.round} (epoch {upload.epoch}) of {upload.job!r} has moved on")
                effects = self.trees.partial(upload.job, upload.round, upload.from_node, upload.epoch,
                                             tree.Input(m.key, m.samples, m.updates, m.partial))
            except tree.NotTheTop as e:
                self.store.release(m.key, holder)
                self.metrics.partials_received.labels("refused").inc()
                raise Conflict(str(e), code="not_the_top") from None
            self.metrics.partials_received.labels("duplicate" if delivered == 0 else "accepted").inc()
            io = self._apply(effects)
        self._run_io(io)
        return None, []

    def install_model(self, holder: Hashable, m: InstallModel) -> tuple[Message, list[int]]:
        """Make an uploaded blob version 0, once its checkpoint is durable."""
        with self.lock:
            upload = self._upload(holder, m.key, "model")
            run = self.jobs[upload.job]
            seg = self.store.seal(m.key)
            spec = self._read_layout(seg.fd).spec()
            del self.uploads[m.key]
            strategy = run.spec.strategy_spec
            if strategy.runs_step and any(t.dtype is fmt.BF16 for t in spec.tensors):
                self.store.release(m.key, holder)
                run.model_upload = False
                raise Unprocessable(f"strategy {strategy.name!r} computes in float64 from float16/32/64 tensors; this "
                                    "model has bfloat16 ones: send them as float32, or aggregate with fedavg",
                                    code="unsupported_dtype")
            self.store.move_ref(m.key, holder, ("pending", upload.job))
            fd, size = os.dup(seg.fd), seg.size
        try:
            seconds = self.checkpointer.write(upload.job, 0, fd, size)
        except OSError as e:
            with self.lock:
                run.model_upload = False
                self.store.release(m.key, ("pending", upload.job))
            self.metrics.checkpoint_failures.labels(upload.job).inc()
            raise Unavailable(f"cannot checkpoint the model of {upload.job!r}: {e}", code="checkpoint_failed",
                              retry_after=CHECKPOINT_RETRY[-1]) from None
        opened = self.state.next_round(upload.job, -1, 0, key=m.key.hex(), node=self.node, spec=spec)
        retain = self.retainer.policy(upload.job).active
        with self.lock:
            run.model_upload = False
            if opened < 0:
                self.store.release(m.key, ("pending", upload.job))
                raise Conflict(f"job {upload.job!r} already has a model", code="model_exists")
            self.store.move_ref(m.key, ("pending", upload.job), ("model", upload.job))
            run.model_key, run.model_spec, run.model_version = m.key, spec, 0
            if retain:
                self.retainer.keep_model(upload.job, run.tenant, m.key, 0)
        self.state.set_checkpoint(upload.job, 0)
        self.metrics.checkpoint_seconds.observe(seconds)
        self.metrics.version.labels(upload.job).set(0)
        return Installed(0), []

    def install_replica(self, holder: Hashable, m: InstallReplica) -> tuple[Message, list[int]]:
        with self.lock:
            upload = self._upload(holder, m.key, "replica")
            run = self.jobs[upload.job]
            self.store.seal(m.key)
            del self.uploads[m.key]
            self._set_replica(upload.job, run, m.key, upload.version, holder)
        self.metrics.replicas.labels("gateway").inc()
        return None, []

    def _set_replica(self, job: str, run: JobRun, key: bytes, version: int, holder: Hashable) -> None:
        if run.replica is not None:
            self.store.release(run.replica[0], ("replica", job))
        self.store.move_ref(key, holder, ("replica", job))
        run.replica = (key, version)

    @staticmethod
    def _read_layout(fd: int) -> fmt.Layout:
        prefix = os.pread(fd, fmt.PREFIX_BYTES, 0)
        n = fmt.header_length(prefix)
        return fmt.parse_header(os.pread(fd, n, fmt.PREFIX_BYTES), allow_partial=True)

    # -- models -----------------------------------------------------------------------------------
    def open_model(self, holder: Hashable, m: OpenModel) -> tuple[Message, list[int]]:
        """A read reference to the job's current model: the one installed here, a replica, or
        (when the node that has it is gone) one restored from the shared checkpoints; otherwise
        ``model_elsewhere`` tells the gateway which node to fetch it from."""
        j, run = self._job(m.job)
        if j.version == NO_MODEL:
            raise Conflict(f"job {m.job!r} has no model yet", code="no_model")
        with self.lock:
            opened = self._open_local(holder, run, j.version)
        if opened:
            return opened
        if j.model_node != self.node and self.state.gateway(j.model_node) is not None:
            raise NotFound(f"the model of job {m.job!r} is on node {j.model_node}", code="model_elsewhere",
                           extra={"node": j.model_node, "version": j.version})
        try:
            blob = self.checkpointer.store.load(m.job, j.version)
        except FileNotFoundError as e:  # a store of this node's own, not shared with the node that had it
            raise Overloaded(f"the model of job {m.job!r} (version {j.version}) is on node {j.model_node}, which is "
                             f"gone, and this node's checkpoint store does not have it: {e}", code="model_unreachable") from None
        with self.lock:
            seg = self._blob_object(run, blob, holder)
            self._set_replica(m.job, run, seg.key, j.version, holder)
            opened = self._open_local(holder, run, j.version)
        self.metrics.replicas.labels("checkpoint").inc()
        assert opened is not None
        return opened

    def _open_local(self, holder: Hashable, run: JobRun, version: int) -> tuple[Message, list[int]] | None:
        if run.model_key is not None and run.model_version == version:
            key = run.model_key
        elif run.replica is not None and run.replica[1] == version:
            key = run.replica[0]
        else:
            return None
        seg = self.store.add_ref(key, holder)
        fd = os.open(SHM_DIR / seg.name[1:], os.O_RDONLY)
        return ModelOpened(key, version, seg.size), [fd]

    def release(self, holder: Hashable, m: Release) -> tuple[Message, list[int]]:
        with self.lock:
            self.store.release(m.key, holder)
        return None, []

    # -- queries (lifl.flstore) --------------------------------------------------------------------
    def query(self, m: Query) -> tuple[Message, list[int]]:
        """Run a non-training workload where the job's retained data is: resolve what it reads
        (from memory, or fetched back from the checkpoint store), run it on one of the tenant's
        function instances, and answer with its result and where its data came from."""
        from lifl.flstore import workloads  # numpy-only; imported on the first query

        t0 = time.perf_counter()
        body = m.body
        workload = body.get("workload")
        if not isinstance(workload, str):
            raise BadRequest("a query names its 'workload': one of " + ", ".join(workloads.WORKLOADS), code="bad_query")
        scope = body.get("scope", "")
        if scope not in QUERY_SCOPES:
            raise BadRequest(f"query scope must be one of {', '.join(map(repr, QUERY_SCOPES))}", code="bad_query")
        params = workloads.check_params(workload, {k: v for k, v in body.items() if k not in QUERY_FIELDS})
        # decomposable workloads are computed where each node's updates are and combined by the
        # gateway; others read every update here (fetched back from the store if need be)
        split = scope != GATHER and workloads.decomposable(workload, params)
        j, run = self._job(m.job)
        if j.version == NO_MODEL:
            raise Conflict(f"job {m.job!r} has no model yet", code="no_model")
        policy = self.retainer.policies[m.job] = self.state.retention(m.job)
        qid = -self._take_id()
        holder = query_holder(m.job, qid)
        sources: list[str] = []
        try:
            if workload == "inference":
                doc = self._inference_inputs(j, run, policy, body, holder, sources)
            else:
                doc = self._round_inputs(j, run, policy, workload, body, holder, sources, split, scope == NODE_SCOPE)
            split = split and (scope == NODE_SCOPE or bool(doc.get("peers")))  # every update here: no need
            doc.update(workload=workload, params=params, job=m.job, mode="partial" if split else "run")
            fetched_s = time.perf_counter() - t0
            stats = self._run_query(QueryRun(qid, m.job, run.tenant, doc.get("version", j.version), doc))
        except LiflError as e:
            self.metrics.queries.labels(m.job, workload, "error").inc()
            raise e
        finally:
            with self.lock:
                self.store.release_holder(holder)
        if "error" in stats:
            self.metrics.queries.labels(m.job, workload, "error").inc()
            raise _query_error(stats["error"])
        result = stats.get("result", {})
        if workload == "filter" and params.get("exclude"):
            excluded = [s["client"] for s in result.get("suspects", [])]
            self.state.exclude(m.job, excluded)
            result["excluded"] = self.state.excluded(m.job)
        total = time.perf_counter() - t0
        self.metrics.queries.labels(m.job, workload, "ok").inc()
        self.metrics.query_seconds.labels(workload).observe(total)
        selected = {k: doc[k] for k in ("round", "rounds", "version") if k in doc}
        if split:  # the gateway combines this with the other nodes' partials (``peers``)
            selected.update(partial=result, peers=doc["peers"], params=params, rounds=doc["rounds_chosen"])
        else:
            selected["result"] = result
        return Document({
            "job": m.job, "workload": workload, **selected,
            "data": {"objects": len(sources), "memory": sources.count("memory"), "store": sources.count("store"),
                     "bytes_fetched": doc.pop("_fetched", 0)},
            "node": self.node,
            "seconds": {"total": round(total, 6), "fetch": round(fetched_s, 6), "compute": stats.get("compute_s")},
        }), []

    def _inference_inputs(self, j: Job, run: JobRun, policy: RetentionPolicy, body: dict[str, Any], holder: Hashable,
                          sources: list[str]) -> dict[str, Any]:
        if not run.spec.architecture:
            raise BadRequest(f"job {j.spec.job!r} names no architecture (job field 'architecture'): it cannot run "
                             "inference", code="no_architecture")
        version = _selector(body, "version", j.version)
        if version > j.version or (version != j.version and not version_queryable(policy, version, j.version)):
            raise NotFound(f"version {version} of job {j.spec.job!r} is not retained (current version {j.version}; "
                           f"its retention policy keeps models {policy.version_window} versions back)", code="not_retained")
        current = run.model_key if run.model_version == version else None
        keep = in_memory(policy, Held(MODEL, version), j.round - 1, j.version)
        key, source = self.retainer.acquire_model(j.spec.job, run.tenant, version, holder, keep, current)
        sources.append(source)
        return {"version": version, "architecture": run.spec.architecture, "model": key.hex()}

    def _round_inputs(self, j: Job, run: JobRun, policy: RetentionPolicy, workload: str, body: dict[str, Any],
                      holder: Hashable, sources: list[str], split: bool, node_only: bool) -> dict[str, Any]:
        """What a query over rounds reads. ``split``: this node's updates only, the other nodes
        holding some (``peers``) compute theirs; ``node_only``: the rounds are chosen already
        (a peer's part of a split query)."""
        newest = j.round - 1  # the latest finished round
        retained = [r for r in self.state.retained_rounds(j.spec.job) if r <= newest and round_queryable(policy, r, newest)]
        if not retained:
            raise NotFound(f"job {j.spec.job!r} has no retained round (its retention policy: {policy.to_json()})",
                           code="not_retained")
        if node_only:
            chosen = body.get("rounds")
            if not isinstance(chosen, list) or not chosen or any(r not in retained for r in chosen):
                raise NotFound(f"rounds {chosen} of job {j.spec.job!r} are not all retained", code="not_retained")
        elif workload == "reputation":
            chosen = retained[-MAX_QUERY_ROUNDS:]
            if "round" in body:
                raise BadRequest("reputation reads every retained round: give no 'round'", code="bad_query")
        else:
            round_id = _selector(body, "round", retained[-1])
            if round_id not in retained:
                raise NotFound(f"round {round_id} of job {j.spec.job!r} is not retained (retained: "
                               f"{', '.join(map(str, retained)) or 'none'})", code="not_retained")
            chosen = [round_id]
        # the chosen rounds are among the newest: their summaries are at the end of the history
        recent = self.state.rounds(j.spec.job, policy.update_rounds + 2)
        summaries = {r["round"]: r for r in recent if r.get("round") in chosen}
        fetched = 0
        rounds = []
        peers: set[str] = set()
        live: dict[str, bool] = {}  # other nodes holding updates: is their gateway up?
        for round_id in chosen:
            metas = self.state.retained(j.spec.job, round_id)
            if not metas:  # forgotten since it was listed
                raise NotFound(f"round {round_id} of job {j.spec.job!r} is no longer retained", code="not_retained")
            version = next(iter(metas.values()))["version"]
            if split:  # a live node computes its own part; a dead node's updates are read from the store here
                for other in {meta["node"] for meta in metas.values()} - {self.node} - set(live):
                    live[other] = self.state.gateway(other) is not None
                if not node_only:
                    peers |= {n for n, up in live.items() if up}
                metas = {c: meta for c, meta in metas.items()
                         if meta["node"] == self.node or (not node_only and not live[meta["node"]])}
            summary = summaries.get(round_id, {})
            new_version = summary.get("new_version")
            entry: dict[str, Any] = {"round": round_id, "version": version, "updates": []}
            for what, v in (("base", version), ("aggregate", new_version)):
                if v is None or not version_queryable(policy, v, j.version):
                    entry[what] = None
                    continue
                current = run.model_key if run.model_version == v else None
                keep = in_memory(policy, Held(MODEL, v), newest, j.version)
                key, source = self.retainer.acquire_model(j.spec.job, run.tenant, v, holder, keep, current)
                sources.append(source)
                entry[what] = key.hex()
            for client, meta in sorted(metas.items()):
                keep = in_memory(policy, Held(UPDATE, round_id, client), newest, j.version)
                key, source = self.retainer.acquire_update(j.spec.job, run.tenant, round_id, client, meta, holder, keep)
                sources.append(source)
                fetched += meta["size"] if source == "store" else 0
                entry["updates"].append({"client": client, "samples": meta["samples"], "key": key.hex()})
            rounds.append(entry)
        out: dict[str, Any] = {"rounds_data": rounds, "_fetched": fetched, "peers": sorted(peers), "rounds_chosen": chosen}
        if workload == "reputation":
            out["rounds"] = chosen
        else:
            out["round"], out["version"] = chosen[0], rounds[0]["version"]
        return out

    def _run_query(self, q: QueryRun) -> dict[str, Any]:
        doc = dict(q.doc)
        doc.pop("_fetched", None)
        q.doc = doc
        with self.lock:
            self.queries[q.id] = q
            self.query_waiting.append(q.id)
            self._dispatch()
        try:
            if not q.answered.wait(QUERY_TIMEOUT_S):
                with self.lock:
                    if q.id in self.query_waiting:
                        self.query_waiting.remove(q.id)
                    elif q.instance:
                        self.actuator.stop(q.instance)  # it computes for nobody: its slot goes to others
                raise Unavailable(f"the query found no instance or took over {QUERY_TIMEOUT_S:g} s",
                                  code="query_timeout", retry_after=1.0)
        finally:
            with self.lock:
                self.queries.pop(q.id, None)
        if q.error is not None:
            raise q.error
        assert q.stats is not None
        return q.stats

    def _query_over(self, iid: int, qid: int, stats: dict[str, Any] | None, error: LiflError | None = None) -> None:
        with self.lock:
            q = self.queries.get(qid)
            inst = self.instances.get(iid)
            if inst is not None and inst.task == qid:
                inst.task, inst.last_used = None, time.monotonic()
                self._free(inst)
        if q is not None and q.instance == iid:
            q.finish(stats, error)

    def take_query(self, iid: int, m: TakeQuery) -> tuple[Message, list[int]]:
        with self.lock:
            q = self.queries.get(m.task)
            if q is None or q.instance != iid:
                raise NotFound(f"query {m.task} is not running on instance {iid}", code="no_such_task")
            return Document(q.doc), []

    # -- function instances -------------------------------------------------------------------------
    def _task_of(self, iid: int, task_id: int) -> tree.Task:
        inst = self.placed.get(task_id)
        task = self.trees.tasks.get(task_id)
        if task is None or inst is None or inst.id != iid:
            raise NotFound(f"task {task_id} is not running on instance {iid}", code="no_such_task")
        return task

    def ready(self, iid: int) -> tuple[Message | None, list[int]]:
        with self.lock:
            inst = self.instances.get(iid)
            if inst is not None:
                inst.ready = True
        return None, []

    def alloc(self, iid: int, m: Alloc) -> tuple[Message, list[int]]:
        with self.lock:
            task = self._task_of(iid, m.task)  # its round reserved this when it admitted the inputs
            seg = self.store.create(self.instances[iid].tenant, m.size, _scratch_holder(m.task), affinity=iid,
                                    owner=RoundOf(task.job, task.round), scratch=True)
            return Allocated(seg.key), [os.dup(seg.fd)]

    def folded(self, iid: int, m: Folded) -> tuple[Message, list[int]]:
        """Inputs (and the previous accumulator) are summed up in a new accumulator, ``m.state``:
        it is what the task runs again from if its instance dies; what it sums up may go."""
        with self.lock:
            task = self._task_of(iid, m.task)
            progress = self.progress[task.id]
            # a leaf sends its result's key ahead of its hand-off (Invoke.parent_*): the parent may
            # fold it before the hand-off reaches us; it comes within moments
            self._delivered.wait_for(lambda: set(m.keys) <= {msg.key for msg in progress.inputs()}, timeout=HANDOFF_WAIT_S)
            previous = progress.state
            known = {msg.key for msg in progress.inputs()}
            if stray := [key.hex() for key in m.keys if key not in known]:  # checked before anything changes
                raise BadRequest(f"task {task.id} folded {', '.join(stray)}, none of its inputs")
            samples, updates_in = (previous.samples, previous.count) if previous is not None else (0, 0)
            self.store.move_ref(m.state, _scratch_holder(task.id), _state_holder(task.id))
            self.store.seal(m.state)
            updates = sum(self._update_done(key) for key in m.keys)
            for key in m.keys:
                if (msg := progress.fold(key)) is not None:
                    samples, updates_in = samples + msg.samples, updates_in + msg.count
                    self.store.release(key, _input_holder(task.id))
                else:  # the previous accumulator
                    self.store.release(key, _state_holder(task.id))
            progress.state = KeyMessage(dest=0, task=task.id, key=m.state, samples=samples, count=updates_in,
                                        partial=True, sent_ns=now_ns())
        self.metrics.aggregated(task.job, updates, m.seconds)
        if updates:
            self.state.count(task.job, task.round, "aggregated", updates)
        return None, []

    def handoff(self, iid: int, m: Handoff) -> tuple[Message, list[int]]:
        """A leaf's or middle's result: to its parent here (the instance sends the key itself when
        the parent runs), or to the top on another node."""
        route: list[tuple[int, int]] = []
        self._result(iid, m.task, tree.Input(m.key, m.samples, m.updates, m.partial), route)
        return (Route(*route[0]) if route else Route()), []

    def install(self, iid: int, m: InstallResult) -> tuple[Message, list[int]]:
        """The top has the round's model: checkpoint it in the background, then install it."""
        if m.state or m.report:
            self._stage_step(iid, m)
        task = self._result(iid, m.task, tree.Input(m.key, m.samples, m.updates, False))
        return Installed(task.version + 1), []

    # -- strategies (lifl.strategy) -------------------------------------------------------------------
    def strategy_inputs(self, iid: int, m: StrategyInputs) -> tuple[Message, list[int]]:
        """What a top's strategy step reads besides the round's sum, held for the task: the model
        the round started from, the strategy's state after it, and (a strategy that is not eager)
        every client update of the round, each with the model it was trained from."""
        with self.lock:
            task = self._task_of(iid, m.task)
        j, run = self._job(task.job)
        strategy = run.spec.strategy_spec
        holder = _scratch_holder(task.id)
        doc: dict[str, Any] = {"seed": self.state.strategy_seed(task.job), "updates": []}
        bases = {task.version: self._held_model(run, task.version, holder)}
        doc["current"] = bases[task.version].hex()
        doc["state"] = None if not strategy.stateful else self._held_state(run, task.version, holder)
        if strategy.needs_updates:
            for client, (key, base) in sorted(self._round_updates(run, task, m.updates, holder).items()):
                if base not in bases:
                    bases[base] = self._held_model(run, base, holder)
                samples = self._retained_samples(task.job, task.round, client)
                doc["updates"].append({"client": client, "key": key.hex(), "samples": samples,
                                       "staleness": task.version - base, "base": bases[base].hex()})
        return Document(doc), []

    def _held_model(self, run: JobRun, version: int, holder: Hashable) -> bytes:
        """Model ``version`` held by ``holder``: installed here, a replica, retained, or read back
        from its checkpoint."""
        with self.lock:
            for key, v in ((run.model_key, run.model_version), run.replica or (None, NO_MODEL)):
                if key is not None and v == version:
                    self.store.add_ref(key, holder)
                    return key
        key, _ = self.retainer.acquire_model(run.spec.job, run.tenant, version, holder, keep=False)
        return key

    def _held_state(self, run: JobRun, version: int, holder: Hashable) -> str | None:
        """The strategy's state after ``version``, held by ``holder``: kept here, or read back from
        the checkpoint store (a restart, or the top moved to this node). None: no step made one
        yet (the first step starts from zeros)."""
        with self.lock:
            if run.strategy_state is not None and run.strategy_state[1] == version:
                self.store.add_ref(run.strategy_state[0], holder)
                return run.strategy_state[0].hex()
        try:
            blob = self.checkpointer.store.load_blob(run.spec.job, strategy_state_blob(version))
        except FileNotFoundError:
            return None
        with self.lock:
            return str(self._blob_object(run, blob, holder, model=False).key.hex())

    def _round_updates(self, run: JobRun, task: tree.Task, expected: int, holder: Hashable) -> dict[str, tuple[bytes, int]]:
        """Every client update of the task's round, held by ``holder``: (object, base version) by
        client. Those accepted here are retained in memory already; other nodes' are indexed in
        Redis once their write-behind is durable, and read back from the checkpoint store."""
        job = run.spec.job
        deadline = time.monotonic() + STRATEGY_INPUTS_TIMEOUT_S
        while True:
            with self.lock:
                local = {item.client: item for item in self.retainer.items.values()
                         if (item.job, item.kind, item.index) == (job, UPDATE, task.round) and item.key is not None}
            indexed = self.state.retained(job, task.round)
            if len(set(local) | set(indexed)) >= expected:
                break
            if time.monotonic() > deadline:
                raise Unavailable(f"round {task.round} of job {job!r} aggregated {expected} updates but only "
                                  f"{len(set(local) | set(indexed))} are retained for its strategy after "
                                  f"{STRATEGY_INPUTS_TIMEOUT_S:g} s", code="updates_missing", retry_after=1.0)
            time.sleep(0.05)  # other nodes' write-behind: Redis offers nothing to wait on here
        out: dict[str, tuple[bytes, int]] = {}
        for client in sorted(set(local) | set(indexed)):
            item = local.get(client)
            meta = indexed.get(client) or {"size": item.size, "samples": item.samples, "version": item.version,
                                            "blob": item.blob}
            key, _ = self.retainer.acquire_update(job, run.tenant, task.round, client, meta, holder, keep=True)
            out[client] = (key, int(meta["version"]))
        return out

    def _retained_samples(self, job: str, round_id: int, client: str) -> int:
        with self.lock:
            for item in self.retainer.items.values():
                if (item.job, item.kind, item.index, item.client) == (job, UPDATE, round_id, client):
                    return item.samples
        return int(self.state.retained(job, round_id)[client]["samples"])

    def _stage_step(self, iid: int, m: InstallResult) -> None:
        """Keep the strategy's new state (durable before the model can be) and its report until
        the round's model is installed."""
        with self.lock:
            task = self._task_of(iid, m.task)
            step = StrategyStep(m.state or None, m.report)
            if step.state is not None:
                seg = self.store.seal(step.state)
                self.store.hand_over(step.state, ("strategy", task.job, task.version + 1))
                fd, size = os.dup(seg.fd), seg.size
        if step.state is not None:  # written here, before the model's checkpoint: a durable version has its state
            try:
                self.checkpointer.store.save_blob(task.job, strategy_state_blob(task.version + 1), fd, size)
            finally:
                os.close(fd)
            # a restart resumes from a version the model checkpoints keep: older states are of no use
            if task.version - checkpoints.KEEP >= 0:
                self.checkpointer.store.delete_blob(task.job, strategy_state_blob(task.version - checkpoints.KEEP))
        with self.lock:
            replaced = self.steps.pop((task.job, task.version + 1), None)
            if replaced is not None and replaced.state is not None:
                self.store.release(replaced.state, ("strategy", task.job, task.version + 1))
            self.steps[(task.job, task.version + 1)] = step

    def _install_step(self, run: JobRun, version: int, installed: bool) -> dict[str, Any]:
        """The staged step of ``version`` (lock held): its state becomes the job's if the version
        was installed, else goes; what the rounds history says of it."""
        step = self.steps.pop((run.spec.job, version), None)
        holder = ("strategy", run.spec.job, version)
        if step is None or step.state is None:
            return step.report if step is not None else {}
        if not installed:
            self.store.release(step.state, holder)
            return step.report
        if run.strategy_state is not None:
            self.store.release(run.strategy_state[0], ("strategy", run.spec.job, run.strategy_state[1]))
        run.strategy_state = (step.state, version)
        return step.report

    def _result(self, iid: int, task_id: int, output: tree.Input, route: list[tuple[int, int]] | None = None) -> tree.Task:
        """A task's result, sealed and kept by its round until the tree says where it goes."""
        with self.lock:
            task = self._task_of(iid, task_id)
            if not self.store.get(output.key).sealed:
                self.store.seal(output.key)
            self.store.hand_over(output.key, ("round", task.job, task.round))
            self._result_exists(task.id)
            io = self._apply(self.trees.result(task.id, output), route)
        self._run_io(io)
        return task

    def done(self, iid: int, m: Done) -> tuple[Message, list[int]]:
        """The instance finished a task (or acknowledged its cancellation) and is free again."""
        if m.task in self.queries:
            self._query_over(iid, m.task, m.stats)
            return None, []
        with self.lock:
            inst, task = self._through(iid, m.task)
            if task is not None and not m.stats.get("cancelled"):
                self._record_task(task, iid, m.stats)
            if inst is not None:
                self._free(inst)
        return None, []

    def _record_task(self, task: tree.Task, iid: int, stats: dict[str, Any]) -> None:
        role = stats.get("role", task.role)
        for step in ("recv", "agg", "send"):
            if isinstance(stats.get(f"{step}_s"), (int, float)):
                self.metrics.steps.labels(role, step).observe(stats[f"{step}_s"])
        for us in stats.get("handoff_us", []):
            if isinstance(us, (int, float)):
                self.metrics.handoff.observe(us / 1e6)
        self.recent.append({"task": task.id, "job": task.job, "round": task.round, "instance": iid, **stats})

    def failed(self, iid: int, m: Failed) -> tuple[Message, list[int]]:
        if m.task in self.queries:
            self._query_over(iid, m.task, None, Internal(f"the query failed on instance {iid}: {m.problem}"))
            return None, []
        with self.lock:
            inst = self.instances.get(iid)
            task = self.trees.tasks.get(m.task) if inst is not None and inst.task == m.task else None
            if task is not None:
                inst.task, inst.running, inst.last_used = None, None, time.monotonic()
        if task is not None:
            self._run_again(task, f"{task.role} failed on instance {iid}: {m.problem}")
        with self.lock:
            if inst is not None and inst.id in self.instances:
                self._free(inst)
        return None, []

    def _through(self, iid: int, task_id: int) -> tuple[Instance | None, tree.Task | None]:
        """The instance is through with the task (done, cancelled or failed): let the task's
        objects go; the instance is free again."""
        inst = self.instances.get(iid)
        task = self.trees.tasks.get(task_id)
        if inst is not None and inst.task == task_id:
            task = task or inst.running  # the top's round ends as it installs, before its Done
            self._finish(task_id)
            inst.task, inst.running = None, None
            inst.last_used = time.monotonic()
        return inst, task

    def _finish(self, task_id: int) -> None:
        self.placed.pop(task_id, None)
        self.pending.pop(task_id, None)
        self._release_task_objects(task_id)
        self.trees.finished(task_id)

    def _release_task_objects(self, task_id: int) -> None:
        self.store.release_holder(_scratch_holder(task_id))
        self._result_exists(task_id)

    def _result_exists(self, task_id: int) -> None:
        """The task's result is sealed and kept by its round (or the task is called off): what it
        would run again from is no longer needed."""
        self.progress.pop(task_id, None)
        self.store.release_holder(_input_holder(task_id))
        self.store.release_holder(_state_holder(task_id))

    def _instance_gone(self, iid: int, why: str) -> None:
        with self.lock:
            inst = self.instances.pop(iid, None)
            q = self.queries.get(inst.task) if inst is not None and inst.task is not None else None
            if q is not None:
                inst.task = None  # type: ignore[union-attr]
                q.finish(None, Unavailable(f"the query's function instance {iid} died ({why})", code="query_failed",
                                           retry_after=1.0))
            task = self.trees.tasks.get(inst.task) if inst and inst.task is not None else None
            if inst is not None and inst.task is not None and task is None:
                self._finish(inst.task)
            self._refresh_instance_gauges()
        if task is not None and not self._stopping.is_set():
            self._run_again(task, f"aggregator instance {iid} died ({why})")
        with self.lock:
            self._dispatch()

    def _run_again(self, task: tree.Task, why: str) -> None:
        """A task's run ended without Done: if its result exists there is nothing to redo;
        otherwise it runs again from its inputs (its scratch objects go), and after
        ``MAX_TASK_ATTEMPTS`` runs the round is abandoned (the inputs may be what fails)."""
        with self.lock:
            self.placed.pop(task.id, None)
            self.store.release_holder(_scratch_holder(task.id))
            progress = self.progress.get(task.id)
            if progress is None:  # it handed off its result before it went
                self.pending.pop(task.id, None)
                self.trees.finished(task.id)
                return
            if progress.attempts < MAX_TASK_ATTEMPTS:
                print(f"lifl agent: task {task.id} ({task.role} of {task.job} round {task.round}) runs again "
                      f"from {'its accumulator of ' + str(progress.folded) + ' inputs and ' if progress.state else ''}"
                      f"{len(progress.unfolded)} inputs: {why}", file=sys.stderr)
                self.metrics.reruns.labels(task.role).inc()
                self.pending[task.id] = progress.inputs()
                if task.id not in self.waiting:
                    self.waiting.append(task.id)
                self._dispatch()
                return
            self._finish(task.id)
        print(f"lifl agent: task {task.id} failed {progress.attempts} times", file=sys.stderr)
        self._abandon(task.job, task.round, f"{task.role} failed {progress.attempts} times, last: {why}")

    def _abandon(self, job: str, round_id: int, reason: str) -> None:
        """The node's tree for a round failed: the round starts over on the same version."""
        print(f"lifl agent: abandoning round {round_id} of {job}: {reason}", file=sys.stderr)
        with self.lock:
            r = self.trees.round_of(job)
            io = self._apply(self.trees.end(job, reason)) if r is not None and r.round == round_id else []
        self._run_io(io)
        self._perform(job, cluster_rounds.AbandonRound(round_id, "abandoned", reason))
        self.settle(job)

    # -- effects ----------------------------------------------------------------------------------
    def _apply(self, effects: Sequence[tree.Effect], route: list[tuple[int, int]] | None = None) -> list[IO]:
        """Apply the tree's effects (with the lock held); returns what must happen without it.
        With ``route``, one delivery to a running task is left to the caller to send."""
        io: list[IO] = []
        for e in effects:
            if isinstance(e, tree.Deliver):
                self.store.hand_over(e.input.key, _input_holder(e.task))
                msg = KeyMessage(dest=0, task=e.task, key=e.input.key, samples=e.input.samples, count=e.input.updates,
                                 partial=e.input.partial, sent_ns=now_ns())
                self.progress.setdefault(e.task, TaskProgress()).unfolded.append(msg)
                self._delivered.notify_all()
                inst = self.placed.get(e.task)
                if inst is not None and route is not None and not route:
                    route.append((inst.id, e.task))
                elif inst is not None:
                    self._send_key(inst, msg)
                else:
                    self.pending.setdefault(e.task, []).append(msg)
                    if e.task not in self.waiting:
                        self.waiting.append(e.task)
            elif isinstance(e, tree.Resize):
                inst = self.placed.get(e.task)
                if inst is not None:  # a task not started yet is invoked with its new fan-in
                    count = self.progress[e.task].fan_in(e.fan_in)
                    self._send_key(inst, KeyMessage(dest=inst.id, task=e.task, kind=KIND_CLOSE, count=count,
                                                    sent_ns=now_ns()))
            elif isinstance(e, tree.Forward):
                io.append(self._outgoing(e))
            elif isinstance(e, tree.Install):
                io.append(self._install_io(e))
            elif isinstance(e, tree.Cancel):
                self._cancel(e.task, e.reason)
            elif isinstance(e, tree.Drop):
                self.store.discard(e.key)
            elif isinstance(e, tree.Release):
                self.store.release_holder(("round", e.job, e.round))
                self.store.release_round(RoundOf(e.job, e.round))  # what it reserved and did not use
                for ref in [o.ref for o in self.outgoing.values() if (o.job, o.round) == (e.job, e.round)]:
                    del self.outgoing[ref]
            # tree.Start: a task runs once it has an input (Deliver queues it)
        self._dispatch()
        return io

    @staticmethod
    def _run_io(io: list[IO]) -> None:
        for action in io:
            action()

    def _send_key(self, inst: Instance, msg: KeyMessage) -> None:
        msg = KeyMessage(**{**msg.__dict__, "dest": inst.id})
        sender = self.transport.sender(inst.tenant)
        if self.outbox or not sender.try_send(msg):
            self.outbox.append((inst.tenant, msg))  # the instance's queue is full; the duty loop retries
            self._wake.set()

    def _cancel(self, task_id: int, reason: str) -> None:
        """A running task keeps its objects until its instance acknowledges (it may still be
        writing into them); one not started lets them go now."""
        inst = self.placed.get(task_id)
        if inst is not None:
            try:
                self.actuator.invoke(inst.id, CancelTask(task_id, reason))
            except ConnectionError:
                pass  # its instance is gone: reaping it releases the task
            return
        if task_id in self.waiting:
            self.waiting.remove(task_id)
        self.pending.pop(task_id, None)
        self._release_task_objects(task_id)

    def _install_io(self, e: tree.Install) -> IO:
        self._update_done(e.input.key)  # a lone client update is itself the model
        self.store.hand_over(e.input.key, ("pending", e.job, e.round))
        return self._checkpoint_io(e)

    def _checkpoint_io(self, e: tree.Install) -> IO:
        seg = self.store.get(e.input.key)
        fd, size = os.dup(seg.fd), seg.size

        def write() -> None:
            self.checkpointer.submit(e.job, e.version + 1, fd, size,
                                     lambda seconds, error: self._installed(e, seconds, error))
        return write

    def _installed(self, e: tree.Install, seconds: float, error: Exception | None) -> None:
        """The checkpoint of a round's model is durable: make it the next version. A version
        clients can see always has a durable checkpoint, so a failed write is tried again."""
        job, key, version = e.job, e.input.key, e.version + 1
        if error is not None:
            self._checkpoint_failed(e, error)
            return
        j, shard = self.state.job(job), self.state.shard(job)
        now = self.state.now()
        aggregated = now - seconds  # the checkpoint is written between aggregation and installation
        summary = self._summary(j, shard, version, "complete" if e.input.updates >= j.spec.goal else "partial",
                                updates=e.input.updates, samples=e.input.samples, checkpoint_s=round(seconds, 6),
                                seconds=round(aggregated - shard.first_update, 6) if shard.first_update else None)
        with self.lock:
            step = self.steps.get((job, version))
        if j.spec.strategy:
            strategy = j.spec.strategy_spec
            summary["strategy"] = {"name": strategy.name, **(step.report if step is not None else {})}
            if strategy.spends_privacy:  # the budget spent once this version is out
                summary["strategy"].update(privacy(strategy, version))
        opened = self.state.next_round(job, e.round, version, key=key.hex(), node=self.node, summary=summary)
        retain = self.retainer.policy(job).active
        with self.lock:
            run = self.jobs[job]
            self._install_step(run, version, installed=opened >= 0)
            if opened < 0:  # the round moved on meanwhile (abandoned): drop this model
                self.store.release(key, ("pending", job, e.round))
                return
            self.store.move_ref(key, ("pending", job, e.round), ("model", job))
            self.store.pin(key)  # from the round's working memory to the node's models
            if run.model_key is not None:
                self.store.release(run.model_key, ("model", job))
            run.model_key, run.model_version = key, version
            if retain:
                self.retainer.keep_model(job, run.tenant, key, version)
            self._count_round(job, summary)
            self.metrics.checkpoint_seconds.observe(seconds)
            self.metrics.version.labels(job).set(version)
            self.failed_checkpoints.pop(job, None)
        self.state.set_checkpoint(job, version)
        self.settle(job)

    def _checkpoint_failed(self, e: tree.Install, error: Exception) -> None:
        """Keep the model unseen and write it again after a back-off; say why everywhere."""
        version = e.version + 1
        with self.lock:
            before = self.failed_checkpoints.get(e.job)
            attempts = before.attempts + 1 if before is not None and before.install is e else 1
            delay = CHECKPOINT_RETRY[min(attempts, len(CHECKPOINT_RETRY)) - 1]
            self.failed_checkpoints[e.job] = FailedCheckpoint(e, attempts, time.monotonic() + delay)
        self.metrics.checkpoint_failures.labels(e.job).inc()
        print(f"lifl agent: checkpoint of {e.job} version {version} failed ({attempts} times), "
              f"trying again in {delay:g} s: {error}", file=sys.stderr)
        self.state.set_checkpoint_error(e.job, version, public_reason(error))

    def retry_checkpoints(self) -> None:
        """Write again the checkpoints whose back-off is over (the round's model waits meanwhile);
        a round that moved on without its model (abandoned past its deadline) lets it go."""
        now = time.monotonic()
        with self.lock:
            due = [f for f in self.failed_checkpoints.values() if f.next_try <= now]
        for failed in due:
            e = failed.install
            current = self.state.job(e.job).round == e.round
            with self.lock:
                if self.failed_checkpoints.get(e.job) is not failed:
                    continue
                if not current:
                    del self.failed_checkpoints[e.job]
                    self.store.release(e.input.key, ("pending", e.job, e.round))
                    continue
                failed.next_try = float("inf")  # in the writer's hands until it reports back
                write = self._checkpoint_io(e)
            write()

    def _summary(self, j: Job, shard: Shard, new_version: int | None, outcome: str, **extra: Any) -> dict[str, Any]:
        return {"round": j.round, "version": j.version, "new_version": new_version, "outcome": outcome,
                "updates": 0, "samples": 0, "seconds": None, "opened": j.round_opened, "closed": round(time.time(), 3),
                "nodes": shard.counts, "top": shard.top, "lost": shard.lost, **extra}

    def _count_round(self, job: str, summary: dict[str, Any]) -> None:
        self.metrics.rounds.labels(job, summary["outcome"]).inc()
        if summary["outcome"] in ("complete", "partial") and summary["seconds"] is not None:
            self.metrics.round_seconds.labels(job).observe(summary["seconds"])
            self.metrics.round_updates.labels(job).observe(summary["updates"])

    # -- scheduling tasks on instances ------------------------------------------------------------
    def _dispatch(self) -> None:
        """Give waiting tasks instances: a warm idle one of the tenant, else a new one while the
        node has room (a cold start); the rest wait for an instance to free up. Producers go
        first (leaves, then middles, then tops): a full node must not give its last instance to
        a task that waits for one still waiting."""
        for task_id in [t for t in self.waiting if t not in self.trees.tasks]:
            self.waiting.remove(task_id)
        for task_id in sorted(self.waiting, key=lambda t: ROLES.index(self.trees.tasks[t].role)):
            task = self.trees.tasks[task_id]
            tenant = self.jobs[task.job].tenant
            inst = self._idle_instance(tenant) if self.config.reuse else None
            if inst is not None:
                self.metrics.starts.labels("warm").inc()
            elif self.config.reuse and self._producer_running(task):
                continue  # its input's producer is about to be idle: it takes over (§5.3), no cold start
            elif len(self.instances) < self.config.max_instances and (inst := self._spawn(tenant, "cold_start")):
                self.metrics.starts.labels("cold").inc()
            else:
                continue
            self.waiting.remove(task_id)
            self._start(inst, task)
        self._dispatch_queries()

    def _dispatch_queries(self) -> None:
        """Queries run on the tenant's warm instances like aggregation tasks (which go first), and
        scale out with concurrent queries while the node has room."""
        for qid in list(self.query_waiting):
            q = self.queries[qid]
            inference = q.doc["workload"] == "inference"
            inst = self._idle_instance(q.tenant, inference)
            if inst is not None:
                self.metrics.starts.labels("warm").inc()
            elif (inst := self._spawn_for_query(q.tenant, inference)) is not None:
                self.metrics.starts.labels("cold").inc()
            else:
                continue
            self.query_waiting.remove(qid)
            inst.task, inst.running, q.instance = qid, None, inst.id
            self.actuator.invoke(inst.id, Invoke(qid, q.job, q.version, QUERY_ROLE, 0))

    def _producer_running(self, task: tree.Task) -> bool:
        """Whether an instance runs one of the task's producers. Only such an instance is sure to
        come free for it: any other busy one may hold a task that waits for this one (the top
        for its node's middle)."""
        producers = set(self.trees.producers(task.id))
        return any(i.task in producers for i in self.instances.values())

    def _spawn_for_query(self, tenant: Tenant, inference: bool) -> Instance | None:
        """A cold start for a query; one that needs torch may take the place of an idle instance
        without it."""
        if inference and len(self.instances) >= self.config.max_instances:
            idle = self._idle_instance(tenant) or next((i for i in self.instances.values() if i.task is None), None)
            if idle is None:
                return None
            self.actuator.stop(idle.id)
            self.instances.pop(idle.id, None)
        if len(self.instances) >= self.config.max_instances:
            return None
        return self._spawn(tenant, "query", INFERENCE_MODULES if inference else ())

    def _idle_instance(self, tenant: Tenant, inference: bool = False) -> Instance | None:
        views = [InstanceView(i.id, i.tenant.name, i.task is None, i.last_used) for i in self.instances.values()
                 if i.inference or not inference]
        chosen = pick_warm(views, tenant.name)
        return self.instances[chosen] if chosen is not None else None

    def _spawn(self, tenant: Tenant, reason: str, preload: tuple[str, ...] = ()) -> Instance | None:
        """A cold start, if this node starts its instances (pods are started by the cluster)."""
        iid = self.actuator.spawn(tenant, preload)
        if iid is None:
            return None
        inst = self.instances[iid] = Instance(iid, tenant, inference=bool(preload))
        self.metrics.spawned.labels(reason).inc()
        return inst

    def _start(self, inst: Instance, task: tree.Task) -> None:
        inst.task, inst.running = task.id, task
        self.placed[task.id] = inst
        progress = self.progress.setdefault(task.id, TaskProgress())
        progress.start()
        run = self.jobs[task.job]
        spec = options = None
        if task.job not in inst.specs_sent:
            assert run.model_spec is not None
            spec = run.model_spec.to_json()
            options = {"strategy": run.spec.strategy, "fixed_point": run.spec.fixed_point}
            inst.specs_sent.add(task.job)
        parent = self._parent_placement(task)
        self.actuator.invoke(inst.id, Invoke(task.id, task.job, task.version, task.role, progress.fan_in(task.fan_in),
                                             self.config.lazy, spec, options, *parent))
        for msg in self.pending.pop(task.id, []):
            self._send_key(inst, msg)
        self._refresh_instance_gauges()

    def _parent_placement(self, task: tree.Task) -> tuple[int, int]:
        """A leaf's middle, if it runs already: (instance, task), else (0, 0). The leaf sends its
        result's key there itself, first: the hand-off no longer waits for the agent's reply."""
        r = self.trees.rounds.get(task.job)
        if task.role != tree.LEAF or r is None or r.round != task.round:
            return 0, 0
        inst = self.placed.get(r.middle.id)
        return (inst.id, r.middle.id) if inst is not None else (0, 0)

    def _free(self, inst: Instance) -> None:
        """An instance finished its task: reuse it for a waiting task, or keep it warm (or, without
        reuse, let it go)."""
        if not self.config.reuse:
            self.actuator.stop(inst.id)
        self._dispatch()
        self._refresh_instance_gauges()

    # -- rounds across the cluster ----------------------------------------------------------------
    def settle(self, job: str, live: set[str] | None = None) -> None:
        """Carry out the round's cluster duties, then bring this node's tree in line with the
        round's shard (reads and writes Redis: no lock held)."""
        try:
            for _ in range(SETTLE_PASSES):
                j, shard = self.state.job(job), self.state.shard(job)
                todo = cluster_rounds.duties(j, shard, self.state.now(), live if live is not None else self._assume_live(shard))
                if not todo:
                    break
                for duty in todo:
                    self._perform(job, duty, j, shard)
            with self.lock:
                io = self._apply(self.trees.sync(job, shard))
        except NotFound:  # the job is gone
            with self.lock:
                io = self._apply(self.trees.end(job, "the job no longer exists"))
        self._run_io(io)

    @staticmethod
    def _assume_live(shard: Shard) -> set[str]:
        """Without a fresh list of live nodes, assume every node involved is alive."""
        return set(shard.counts) | set(shard.inflight) | ({shard.top} if shard.top else set())

    def _perform(self, job: str, duty: cluster_rounds.Duty, j: Job | None = None, shard: Shard | None = None) -> None:
        if isinstance(duty, cluster_rounds.CloseAtDeadline):
            self.state.close_round(job, duty.round, duty.min_updates)
        elif isinstance(duty, cluster_rounds.PlaceTop):
            self.state.set_top(job, duty.round, duty.epoch, duty.node)
        elif isinstance(duty, cluster_rounds.DeclareLost):
            loss = self.state.node_lost(job, duty.round, duty.node)
            if loss.handled:
                print(f"lifl agent: node {duty.node} is gone: round {duty.round} of {job!r} carries on with "
                      f"{loss.remaining} updates", file=sys.stderr)
        elif isinstance(duty, cluster_rounds.AbandonRound):
            j = j or self.state.job(job)
            shard = shard or self.state.shard(job)
            summary = self._summary(j, shard, None, duty.outcome, reason=duty.reason, updates=shard.total)
            if self.state.next_round(job, duty.round, j.version, summary=summary) >= 0:
                self._count_round(job, summary)

    def round_duties(self) -> None:
        """Deadlines, dead nodes and the top's placement for the jobs this node takes part in
        (the controller sweeps every job)."""
        with self.lock:
            jobs = list(self.trees.rounds) + [j for j, r in self.jobs.items() if r.spec.round_deadline_s]
        if not jobs:
            return
        live = set(self.state.nodes())
        for job in dict.fromkeys(jobs):
            self.settle(job, live)

    def _event_loop(self) -> None:
        """React at once when a round changes (the duties' timer covers missed messages)."""
        while not self._stopping.is_set():
            try:
                for job in self.state.events():
                    if self._stopping.is_set():
                        return
                    with self.lock:
                        involved = job in self.trees.rounds or job in self.jobs
                    if job is not None and involved:
                        self.settle(job)
            except Exception:  # Redis restarting: subscribe again
                if not self._stopping.wait(0.5):
                    traceback.print_exc()

    # -- partial results to other nodes -----------------------------------------------------------
    def _outgoing(self, e: tree.Forward) -> IO:
        out = OutgoingPartial(self._take_id(), e.job, e.round, e.node, e.epoch, e.input)
        for ref in [o.ref for o in self.outgoing.values() if (o.job, o.round) == (e.job, e.round)]:
            del self.outgoing[ref]  # superseded: the top moved
        self.outgoing[out.ref] = out
        return lambda: self._send_partial(out)

    def _send_partial(self, out: OutgoingPartial) -> None:
        """Ask the gateway to stream the partial to the top's node (no lock held)."""
        with self.lock:
            forwarder = self.forwarder
            try:
                seg = self.store.get(out.input.key)
            except NotFound:
                return  # the round ended meanwhile
            fd, size = os.dup(seg.fd), seg.size
            out.state, out.attempts = "sending", out.attempts + 1
        try:
            if forwarder is None:
                raise ConnectionError("no gateway is connected to forward through")
            forwarder.send(ForwardPartial(out.ref, out.job, out.round, out.epoch, out.node, out.input.samples,
                                          out.input.updates, out.input.partial, size).encode(), [fd])
        except (ConnectionError, OSError) as e:
            self._forward_failed(out, str(e), retry=True)
        finally:
            os.close(fd)

    def forwarded(self, m: Forwarded, fds: Sequence[int] = ()) -> tuple[Message | None, list[int]]:
        with self.lock:
            out = self.outgoing.get(m.ref)
            if out is None:
                return None, []
            if m.delivered:
                out.state = "done"
                self.metrics.forwarded.labels("delivered").inc()
                self.metrics.forwarded_bytes.inc(self.store.get(out.input.key).size)
                return None, []
        self._forward_failed(out, m.problem, m.retry)
        return None, []

    def _forward_failed(self, out: OutgoingPartial, error: str, retry: bool) -> None:
        with self.lock:
            out.state = "failed"
            out.next_try = time.monotonic() + FORWARD_RETRY[min(out.attempts, len(FORWARD_RETRY)) - 1]
            self.metrics.forwarded.labels("failed").inc()
        print(f"lifl agent: forwarding round {out.round} of {out.job!r} to {out.node} failed: {error}", file=sys.stderr)
        if not retry:  # the receiver says the round moved on there: learn where it is now
            self.settle(out.job)

    def _forwarder_gone(self, conn: Connection) -> None:
        with self.lock:
            if self.forwarder is conn:
                self.forwarder = None
            for out in self.outgoing.values():
                if out.state == "sending":
                    out.state, out.next_try = "failed", time.monotonic()

    def retry_forwards(self) -> None:
        """Send again what did not arrive, while it is still where the round's result should go."""
        now = time.monotonic()
        with self.lock:
            for ref in [ref for ref, o in self.outgoing.items() if not self._still_wanted(o)]:
                del self.outgoing[ref]  # the top moved (here, or to another epoch's node)
            due = [o for o in self.outgoing.values() if o.state == "failed" and o.next_try <= now]
        for out in due:
            self._send_partial(out)

    def _still_wanted(self, out: OutgoingPartial) -> bool:
        r = self.trees.round_of(out.job)
        return r is not None and r.round == out.round and r.top is None and r.sent == (out.node, out.epoch)

    # -- periodic duties --------------------------------------------------------------------------
    def _duty_loop(self) -> None:
        """Run each periodic duty on its period; flush the outbox at once while it holds keys."""
        last = {name: 0.0 for name, _, _ in self._duties}
        stalled: set[str] = set()  # duties waiting for Redis to come back
        while True:
            now = time.monotonic()
            wait = min(last[name] + every - now for name, every, _ in self._duties)
            if self.outbox:
                wait = min(wait, OUTBOX_RETRY)
            self._wake.wait(max(wait, 0.0))
            self._wake.clear()
            if self._stopping.is_set():
                return
            now = time.monotonic()
            if self.outbox:
                self.flush_outbox()
            for name, every, duty in self._duties:
                if now - last[name] < every:
                    continue
                last[name] = now
                try:
                    duty()
                except Unavailable as e:  # Redis restarting: said once per outage, the next tick retries
                    if name not in stalled:
                        print(f"lifl agent: {name} waits: {e.message}", file=sys.stderr)
                    stalled.add(name)
                    continue
                except Exception:  # a peer gone, a bug: the next tick retries
                    traceback.print_exc()
                stalled.discard(name)

    def flush_outbox(self) -> None:
        with self.lock:
            while self.outbox:
                tenant, msg = self.outbox[0]
                # keys for an instance that died are dropped: its task runs again with all of them
                if msg.dest in self.instances and not self.transport.sender(tenant).try_send(msg):
                    return
                self.outbox.popleft()

    def expire_idle_instances(self) -> None:
        """Scale to zero: warm instances idle past ``keep_warm`` are let go (beyond what the planner
        wants kept warm). Pods are the cluster's to scale down: the operator follows the plan."""
        if not self.actuator.starts_instances:
            return
        with self.lock:
            views = [InstanceView(i.id, i.tenant.name, i.task is None, i.last_used) for i in self.instances.values()]
            keep = self.controller.warm_for(self.node) if self.config.control.prewarm else {}
            for iid in expired(views, time.monotonic(), self.config.keep_warm):
                tenant = self.instances[iid].tenant.name
                if keep.get(tenant, 0) > 0:
                    keep[tenant] -= 1
                    continue
                self.actuator.stop(iid)

    def warm_instances(self) -> None:
        """Keep the instances the planner asked for ready ahead of the load (§5.2); pods are
        prewarmed by the operator, which scales them to the plan."""
        if not self.config.control.prewarm or not self.actuator.starts_instances:
            return
        wanted = self.controller.read_warm(self.node)
        for tenant_name, count in wanted.items():
            tenant = self.tenant(tenant_name)
            with self.lock:
                have = sum(1 for i in self.instances.values() if i.tenant == tenant)
                for _ in range(min(count - have, self.config.max_instances - len(self.instances))):
                    self._spawn(tenant, "prewarm")
                self._dispatch()

    def control(self) -> None:
        """The control plane's periodic re-plan, on the node that holds the controller lease."""
        if self.controller.tick():
            for job in self.state.job_names():
                self.settle(job, set(self.state.nodes()))

    def apply_retention(self) -> None:
        with self.lock:
            jobs = set(self.jobs)
        for job in jobs | self.retainer.jobs():
            self.retainer.apply(job)

    def publish_status(self) -> None:
        self.state.publish_node(self.node, self.status())

    def trim_pool(self) -> None:
        self.store.trim_pool(idle_seconds=max(self.config.keep_warm, 30.0))

    def drop_stale_replicas(self) -> None:
        """A replica of an older version serves nobody: let it go."""
        with self.lock:
            held = {name: run.replica[1] for name, run in self.jobs.items() if run.replica is not None}
        for name, version in held.items():
            if self.state.version(name) == version:
                continue
            with self.lock:
                run = self.jobs[name]
                if run.replica is not None and run.replica[1] == version:
                    self.store.release(run.replica[0], ("replica", name))
                    run.replica = None

    # -- status and metrics -------------------------------------------------------------------------
    def _publish_gauges(self, job: str, run: JobRun) -> None:
        self.metrics.queue.labels(job).set(run.inflight)
        self.metrics.publish_memory(self.store.ledger, self.store.pooled_bytes, [job])

    def _refresh_instance_gauges(self) -> None:
        counts = dict.fromkeys((*ROLES, QUERY_ROLE, "idle"), 0)
        for inst in self.instances.values():
            task = self.trees.tasks.get(inst.task) if inst.task is not None else None
            counts[task.role if task else QUERY_ROLE if inst.task in self.queries else "idle"] += 1
        for role, n in counts.items():
            self.metrics.instances.labels(role).set(n)

    def status(self) -> dict[str, Any]:
        with self.lock:
            jobs: dict[str, dict[str, Any]] = {}
            for name, run in self.jobs.items():
                r = self.trees.round_of(name)
                memory = self.store.ledger.usage(name)
                jobs[name] = {**dict.fromkeys(ROLES, 0), "queued": run.inflight, "round": r.round if r else None,
                              "tenant": run.tenant.name, "leaf_fan_in": run.spec.leaf_fan_in,
                              "shm": {"working": memory.working, "reserved": memory.reserved}}
            for inst in self.instances.values():  # instances at work, by the role of their current task
                task = self.trees.tasks.get(inst.task) if inst.task is not None else None
                if task is not None and task.job in jobs:
                    jobs[task.job][task.role] += 1
            return {
                "node": self.node,
                "time": time.time(),
                "started": self.started_at,
                "instances": {"total": len(self.instances), "idle": sum(i.task is None for i in self.instances.values()),
                              "ready": sum(i.ready for i in self.instances.values()),
                              "by_tenant": _count_by(i.tenant.name for i in self.instances.values())},
                "jobs": jobs,
                "counters": self.metrics.planner_counters(),
                "retention": self.retainer.status(),
                "shm": {
                    "used": self.store.used_bytes, "pooled": self.store.pooled_bytes, "capacity": self.store.capacity,
                    "pinned": self.store.ledger.pinned, "reserved": self.store.ledger.reserved,
                    "objects": self.store.object_count(), "created": self.store.created, "recycled": self.store.recycled,
                },
            }

    def metrics_text(self) -> str:
        with self.lock:
            for name, run in self.jobs.items():
                self._publish_gauges(name, run)
            self._refresh_instance_gauges()
        return self.metrics.exposition()


def _selector(body: dict[str, Any], name: str, default: int) -> int:
    value = body.get(name, default)
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise BadRequest(f"query field {name!r} must be a non-negative integer", code="bad_query")
    return value


def _query_error(error: Any) -> LiflError:
    """The error a query's function reported (a workload refusing its input), as the caller's error."""
    if not isinstance(error, dict):
        return Internal("the query's function reported a malformed error")
    message, code = str(error.get("message", "")), str(error.get("code", "bad_query"))
    kind = {c.__name__: c for c in (BadRequest, NotFound, Conflict)}.get(str(error.get("type")), Internal)
    return kind(message, code=code)


def _input_holder(task_id: int) -> tuple[str, int]:
    """Holds a task's inputs until it reports them folded."""
    return ("input", task_id)


@dataclass(frozen=True)
class StrategyStep:
    """What a top's strategy step made besides the model: its new state (an object) and report."""

    state: bytes | None
    report: dict[str, Any]


def strategy_state_blob(version: int) -> str:
    """The checkpoint store's name for the strategy's state after ``version``."""
    return f"strategy-state-{version:012d}"


def _scratch_holder(task_id: int) -> tuple[str, int]:
    """Holds what a run of a task allocates (its accumulator) until it reports it folded into."""
    return ("task", task_id)


def _state_holder(task_id: int) -> tuple[str, int]:
    """Holds a task's latest complete accumulator (a re-run starts from it)."""
    return ("state", task_id)


def _count_by(names: Any) -> dict[str, int]:
    out: dict[str, int] = {}
    for n in names:
        out[n] = out.get(n, 0) + 1
    return out


def add_agent_arguments(p: argparse.ArgumentParser) -> None:
    """The agent's tuning flags, shared by `lifl up` and the agent's own command line."""
    p.add_argument("--max-instances", type=int, default=16, help="aggregator processes at most (default 16)")
    p.add_argument("--keep-warm", type=float, default=60.0, help="seconds an idle aggregator stays warm (default 60)")
    p.add_argument("--no-reuse", action="store_true", help="baseline: one task per aggregator instance (no reuse, §5.3)")
    p.add_argument("--lazy", action="store_true", help="baseline: aggregate only once every input arrived (§5.4)")
    p.add_argument("--functions", choices=ACTUATORS, default="processes",
                   help="who starts aggregator instances: processes (the node, default) or pods (the cluster: a "
                        "tenant's function pods attach to RUN_DIR/functions.sock; lifl's operator scales them)")
    p.add_argument("--channel", choices=CHANNELS, default="auto",
                   help="how aggregators pass object keys to each other: ebpf (SK_MSG redirects in the kernel), "
                        "unix (datagram sockets), or auto (default: ebpf where the kernel and privileges allow)")
    p.add_argument("--retain-budget", type=int, default=0, metavar="BYTES",
                   help="shared memory each tenant may keep for queries on retained updates (least recently used "
                        "go first; default 0: half of --shm-limit)")
    ControlConfig.add_arguments(p)


def agent_options(args: argparse.Namespace) -> dict[str, Any]:
    return {"max_instances": args.max_instances, "keep_warm": args.keep_warm, "reuse": not args.no_reuse,
            "lazy": args.lazy, "control": ControlConfig.from_arguments(args), "channel": args.channel,
            "functions": args.functions, "retain_budget": args.retain_budget}


def agent_argv(options: dict[str, Any]) -> list[str]:
    """The command-line spelling of ``agent_options`` (for starting the agent as a process)."""
    argv = ["--max-instances", str(options["max_instances"]), "--keep-warm", str(options["keep_warm"])]
    argv += ["--no-reuse"] * (not options["reuse"]) + ["--lazy"] * options["lazy"] + ["--channel", options["channel"]]
    argv += ["--functions", options["functions"], "--retain-budget", str(options["retain_budget"])]
    return argv + options["control"].argv()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="lifl-agent", description="lifl node agent (started by `lifl up`)")
    p.add_argument("--node", required=True)
    p.add_argument("--run-dir", type=Path, required=True)
    p.add_argument("--data-dir", type=Path, required=True)
    p.add_argument("--redis", required=True)
    p.add_argument("--shm-capacity", type=int, required=True)
    p.add_argument("--pool-limit", type=int, required=True)
    p.add_argument("--checkpoints", default="")
    p.add_argument("--socket-group", type=int, metavar="GID", help="this group may connect to the agent's socket too")
    add_agent_arguments(p)
    args = p.parse_args(argv)
    die_with_parent()
    config = AgentConfig(args.node, args.run_dir, args.redis, args.shm_capacity, args.pool_limit,
                         checkpoints=args.checkpoints, data_dir=args.data_dir, socket_group=args.socket_group,
                         **agent_options(args))
    agent = Agent(config, ClusterState(args.redis))
    stop = threading.Event()
    on_signals(stop.set)
    agent.start()
    print("ready", flush=True)
    stop.wait()
    agent.stop()


if __name__ == "__main__":
    main()
