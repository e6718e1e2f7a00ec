"""The node agent: owns the node's shared memory, runs its aggregator instances and routes keys.

One thread owns everything the agent knows (``lifl.net.loop``): connections, Redis's answers,
timers and the instances' reports arrive as events on it, pure parts decide what to do, and
this shell does it. What blocks (Redis, checkpoints, starting processes) runs on small bounded
pools and comes back as an event; no lock guards the agent's state, because no other thread
touches it. The pure parts, each tested with tables:

- ``lifl.node.tree``: each round's tree on this node (leaves, middle, top; where results go);
- ``lifl.node.tasks``: which instance runs which task, what each task folded, reruns, cold
  starts and scale to zero (LIFL §5.3: warm instances take any role);
- ``lifl.node.uploads``: blobs being received and updates in flight;
- ``lifl.node.installs``: checkpoints written again after a failure, partial results sent again;
- ``lifl.ledger``: the memory that aggregating what was admitted needs;
- ``lifl.control.rounds`` and ``lifl.control.planner``: cluster-wide round duties, the plan.

The hot path works in batches: what arrives while a Redis call for a job is in flight goes in
its next call (``Batches``), so a burst of uploads costs a few scripts, not one each.

- The gateway asks for objects to receive blobs into (``Admit`` reserves a slot of the job's
  global round in Redis, converting the client's lease if it holds one, enforces the job's
  in-flight budget, and reserves the shared memory that aggregating the update needs, within
  the job's fair share), then hands the sealed update over (``Submit``), which counts it once
  for the whole round in Redis and feeds it to this node's tree.
- The middle's result goes to the round's top; if that is on another node, this node's gateway
  streams it there out of shared memory (``ForwardPartial``) and keeps it until the round ends,
  in case the top moves. The top's result is checkpointed in the background and installed as
  the next version once durable.
- Every object reference belongs to a holder (an upload, a task, a round, a job's model or
  replica, a gateway's read). A holder that disappears is released.
- A node that dies mid-round is declared lost by whoever notices (its registration in Redis
  lapses): what it acknowledged and had not delivered is recorded as lost, and the round
  completes on the others. A restarted node does this for itself before it serves.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import mmap
import os
import queue
import secrets
import socket
import sys
import threading
import time
import traceback
from collections import OrderedDict, deque
from concurrent.futures import Future
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field, replace
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np

from lifl import checkpoints
from lifl import format as fmt
from lifl import kernels
from lifl.cluster_types import NO_MODEL, Job, Shard
from lifl.control import rounds as cluster_rounds
from lifl.control.controller import Controller, ControlConfig
from lifl.errors import (
    BadRequest, Conflict, Forbidden, Internal, LiflError, NotFound, Overloaded, PayloadTooLarge, Unavailable, Unprocessable,
)
from lifl.flstore.retention import MODEL, Held, RetentionPolicy, checkpoints_kept, in_memory, round_queryable, version_queryable
from lifl.jobs import TENANT_NAME, JobSpec
from lifl.keys.factory import CHANNELS, transport
from lifl.keys.record import KeyMessage, now_ns
from lifl.ledger import PARTIAL, UPDATE, JobSizes, Pinned, RoundOf, round_fit
from lifl.net.loop import SLOW_POOL, Loop
from lifl.node import installs, spill, tasks, tree, uploads
from lifl.node.actuator import ACTUATORS, Actuator, ClusterPods, LocalProcesses
from lifl.node.metrics import Metrics
from lifl.node.privilege import attach_refusal, current, peer_identity
from lifl.node.retention import Retainer, query_holder, update_blob
from lifl.quotas import Quota
from lifl.secagg_round import ABANDONED, DONE, MaskedInputs, RoundSecrets
from lifl.secure_state import SecureRounds
from lifl import shards
from lifl.procs import die_with_parent, on_signals
from lifl.protocol import (
    PROTOCOL, QUERY_ROLE, Abort, Admit, AdmitModel, AdmitPartial, AdmitReplica, Admitted, Alloc, Allocated, Attach,
    Attached, CancelTask, Done, Failed, Finished, Folded, Forwarded, ForwardPartial, GetMetrics, GetRecent, GetStatus,
    Hello, InstallModel, InstallReplica, InstallResult, Installed, Invoke, Message, ModelOpened, NextModel, Ok, OpenModel,
    Query, Ready, Release, SecureSeeds, SecureStreams, StepPartials, StepSums, StrategyInputs, Submit, SubmitPartial, Submitted, TakeQuery, Text, Welcome, decode, input_record,
)
from lifl.protocol import (
    ROLES, TOP, InstanceCounts, JobActivity, NodeStatus, QueryAnswer, QueryData, QueryRound, QuerySeconds, QueryUpdate, QueryWork,
    RecentTasks, SharedMemory, StatusReply, StrategyUpdate, StrategyWork, TaskReport,
)
from lifl.rpc import MessageStream, error_reply, reply_frame
from lifl.net.resp import Resp
from lifl.state import (
    ACCEPT_CLOSED_ROUND, REDIS_RETRY_AFTER, RESERVE_OK, late, ClusterState, ScriptCall, accept_refusal, accepted, refusal, reserved,
    retained_index,
)
from lifl.store import SHM_DIR, ObjectStore, Segment, Tenant, remove_node_objects, retention_holder
from lifl.strategy import privacy, state_model_spec, strategy_bytes

DEFAULT_HANDLER = "lifl.functions.aggregator.handler:handle"
STRATEGY_INPUTS_TIMEOUT_S = 60.0  # how long a top waits for other nodes' updates of its round to be readable
SETTLE_PASSES = 4  # duties that enable further duties (close, then place the top) within one settle
# Periodic duties visit the jobs with something going on each turn and every job this rarely:
# a node with thousands of idle jobs must cost what its active ones do (issue 25)
IDLE_SWEEP_S = 60.0
ROUND_SWEEP_S = 1.0  # a round in progress here is settled at least this often (its events settle it at once)
RECENT_S = 10.0  # a job a gateway asked about counts as active this long (its retention follows reads)
OUTBOX_RETRY = 0.005  # seconds between attempts to deliver keys to an instance whose queue was full
INFERENCE_MODULES = ("torch", "torchvision", "lifl.workload")  # what an instance answering inference imports first
QUERY_FIELDS = ("workload", "round", "version", "rounds", "scope")  # a query's fields that are no workload parameter
GATHER, NODE_SCOPE = "gather", "node"  # read every update here; compute this node's part of a split query
QUERY_SCOPES = ("", GATHER, NODE_SCOPE)
QUERY_TIMEOUT_S = 300.0  # a query not answered by then is called off (its instance is stopped)
MAX_QUERY_ROUNDS = 100  # rounds one reputation query reads at most
HANDOFF_WAIT_S = 5.0  # how long a parent's report of folding a key sent ahead waits for that key's hand-off
MAX_BATCH = 256  # uploads admitted (or accepted) by one Redis call at most; the rest wait for the next
# How long after its first attempt a batch may be sent again while Redis cannot be reached; its
# uploads hear 503 within this plus one call's timeout (the default's: 2 s).
REDIS_RETRY_WINDOW_S = 0.5
REDIS_RETRY_S = (0.02, 0.05, 0.1, 0.2, 0.5)  # between those attempts; the last repeats
LISTEN_BACKLOG = 64


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
    model_idle_s: float = spill.DEFAULT_MODEL_IDLE_S  # a model unused this long leaves shared memory (lifl.node.spill)

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
    model_spec: fmt.ModelSpec | None  # the whole model's
    model_key: bytes | None = None  # the model (its part, for a split job), if this node installed it
    model_version: int = NO_MODEL
    replica: tuple[bytes, int] | None = None  # (key, version): a copy fetched to serve it here
    strategy_state: tuple[bytes, int] | None = None  # (key, version): the strategy's state after that version, if made here
    shm_capacity: int = 0  # the node's shared memory, from which "shards": "auto" sizes its shards
    parts: str = ""  # its shards split across nodes (lifl.shards.split_record); "" when on one node
    node: str = ""  # this node, whose part of a split job it is

    @property
    def part(self) -> shards.NodePart | None:
        """This node's part of a job split across nodes (None: the job is not split, or the node
        holds none of it)."""
        if not self.parts or self.model_spec is None:
            return None
        return next((p for p in shards.parts_of(self.model_spec, self.parts)[1] if p.node == self.node), None)

    @property
    def blob_spec(self) -> fmt.ModelSpec | None:
        """What this node's blobs of the job hold: its part of a split job's model, else the model."""
        part = self.part
        return part.spec if part is not None else self.model_spec

    @property
    def spilled(self) -> bool:
        """Its model is this node's, out of memory: it comes back from its checkpoint on demand."""
        return self.model_key is None and self.model_version != NO_MODEL

    @cached_property
    def leaf_fan_in(self) -> int:
        """Of the whole model's updates, on every node of a split job too: a part's accumulators
        are as many times its bytes as the whole model's are, so it refolds as the whole would."""
        return self.spec.fan_in_for(self.model_spec)

    @cached_property
    def sizes(self) -> JobSizes:
        """What aggregating its updates allocates (computed once: it encodes the model's header)."""
        spec = self.blob_spec
        assert spec is not None
        return job_sizes(self.spec, spec, self.shard_plan, self.leaf_fan_in)

    @cached_property
    def shard_plan(self) -> shards.ShardPlan | None:
        """How its model (its part, when split) is cut into tensor shards (None: it is not)."""
        assert self.model_spec is not None
        part = self.part
        if part is not None:
            return part.plan
        return shards.resolve(self.spec.shards, self.spec.shard_alignment, self.model_spec, self.shm_capacity)

    @property
    def lanes(self) -> int:
        """The trees of each of its rounds: one per shard."""
        return len(self.shard_plan) if self.shard_plan is not None else 1

    def accumulator_bytes(self, shard: int) -> int:
        """A partial sum of one task of ``shard``."""
        if self.shard_plan is None:
            return self.sizes.accumulator
        return shard_accumulator_bytes(self.shard_plan[shard], self.spec)


def shard_accumulator_bytes(shard: shards.TensorShard, spec: JobSpec) -> int:
    return JobSizes.of(shard.spec, 1, 0, spec.fixed_point_spec, spec.float_accumulator).accumulator


def job_sizes(spec: JobSpec, model_spec: fmt.ModelSpec, plan: shards.ShardPlan | None = None,
              fan_in: int | None = None) -> JobSizes:
    """What aggregating a job's updates allocates; with shards, one accumulator of each shard
    stands for one of the whole model (a task of each shard has one at a time). ``fan_in``:
    the leaf fan-in, when it is not ``model_spec``'s (a node's part of a split job: the whole
    model's)."""
    fan_in = fan_in or spec.fan_in_for(model_spec)
    sizes = JobSizes.of(model_spec, fan_in, strategy_bytes(spec.strategy_spec, model_spec),
                        spec.fixed_point_spec, spec.float_accumulator, spec.max_inflight, bool(spec.secure_aggregation))
    if plan is None:
        return sizes
    return replace(sizes, accumulator=sum(shard_accumulator_bytes(s, spec) for s in plan.shards))


def check_round_fits(spec: JobSpec, model_spec: fmt.ModelSpec, update_bytes: int, for_jobs: list[int],
                     fan_in: int | None = None) -> None:
    """Refuse a model whose job's round can never complete in the nodes' shared memory
    (``for_jobs``: what each live node has for rounds once the model is there): better now than
    after its first update was acknowledged. A round completes with its goal, or, with a
    deadline, with ``min_updates`` (it closes then with what arrived, all of it reserved).
    ``fan_in``: as ``job_sizes``'."""
    needed_updates = min(spec.goal, spec.min_updates) if spec.round_deadline_s else spec.goal
    fan_in = fan_in or spec.fan_in_for(model_spec)
    fits, needed = round_fit(job_sizes(spec, model_spec, fan_in=fan_in), update_bytes, needed_updates, for_jobs)
    if not fits:
        available = max(for_jobs, default=0)
        raise Unprocessable(
            f"a round of job {spec.job!r} can never complete: it needs {needed} bytes of shared memory at once on a "
            f"node ({needed_updates} updates of {update_bytes} bytes, leaf fan-in {fan_in}, "
            f"spread over up to {len(for_jobs)} node(s)) and the largest has {available} bytes for its tenant's rounds; "
            "raise --shm-limit (or the tenant's shm_bytes quota), lower the job's goal (or min_updates, with a deadline) "
            "or add nodes", code="round_too_large", extra={"needed": needed, "available": available})


def check_split(spec: JobSpec, parts: Sequence[shards.NodePart]) -> None:
    """Refuse to split across nodes a job whose strategy reads whole updates (Krum's distances,
    dp's norms): its shards' partial sums would have to meet on one node before the step."""
    if parts and spec.strategy_spec.reads_whole_updates:
        raise Unprocessable(
            f"job {spec.job!r} cuts its model into shards that this cluster's {len(parts)} nodes would hold apart, and "
            f"its strategy {spec.strategy_spec.name!r} reads whole updates (norms or distances): run it on one node, "
            "or create it without 'shards'", code="strategy_needs_one_node")


@dataclass(eq=False)
class QueryRun:
    """A query waiting for, or running on, a function instance of its tenant."""

    id: int
    job: str
    tenant: Tenant
    version: int
    doc: dict[str, Any]  # what the instance is given (TakeQuery)
    done: Callable[[dict[str, Any] | None, LiflError | None], None]  # its answer (on the loop)
    timer: Any = None


@dataclass(eq=False)
class StepPartialSums:
    """A sharded round's step partials summed as its shards' tops send them (a top run again
    sends the same values: counted once), and the shard whose top completed them."""

    total: np.ndarray
    lanes: set[int] = field(default_factory=set)
    stepper: int | None = None

    def add(self, lane: int, values: np.ndarray, lanes: int) -> bool:
        """Whether the top of ``lane`` is to step every shard (it completed the sums, maybe in an
        earlier run) once its values are in."""
        if lane not in self.lanes:
            self.lanes.add(lane)
            self.total += values
            if len(self.lanes) == lanes:
                self.stepper = lane
        return self.stepper == lane


@dataclass(frozen=True)
class StrategyStep:
    """What a top's strategy step made besides the model: its new state (an object) and report."""

    state: bytes | None
    report: dict[str, Any]


def strategy_state_blob(version: int, part: shards.NodePart | None = None) -> str:
    """The checkpoint store's name for the strategy's state after ``version`` (``part``: this
    node's part of it, for a job split across nodes: each node checkpoints its own)."""
    return f"strategy-state-{version:012d}" + (f"-part-{part.first:03d}-{part.stop:03d}" if part is not None else "")


def _input_holder(task_id: int) -> tuple[str, int]:
    """Holds a task's inputs until it reports them folded."""
    return ("input", task_id)


def _is_input_holder(holder: Hashable) -> bool:
    return isinstance(holder, tuple) and holder[:1] == ("input",)


def _accepting_holder(job: str) -> tuple[str, str]:
    """Holds client updates while Redis counts them (their gateway connection may close meanwhile)."""
    return ("accepting", job)


def _scratch_holder(task_id: int) -> tuple[str, int]:
    """Holds what a run of a task allocates (its accumulator) until it reports it folded into."""
    return ("task", task_id)


def _state_holder(task_id: int) -> tuple[str, int]:
    """Holds a task's latest complete accumulator (a re-run starts from it)."""
    return ("state", task_id)


class Checkpointer:
    """Writes checkpoints one at a time on a thread of its own, off every aggregation path."""

    def __init__(self, store: checkpoints.CheckpointStore) -> None:
        self.store = store
        self._queue: queue.Queue[tuple[str, int, int, int, shards.NodePart | None, Callable[[float, Exception | None], None]]
                                 | None] = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="checkpointer", daemon=True)
        self._thread.start()
        self.keep: Callable[[str], int] = lambda job: checkpoints.KEEP  # versions kept per job

    def submit(self, job: str, version: int, fd: int, size: int, done: Callable[[float, Exception | None], None],
               part: shards.NodePart | None = None) -> None:
        """Write ``size`` bytes of ``fd`` (closed afterwards) as ``version`` (``part``: as this
        node's part of it); then ``done(seconds, error)``."""
        self._queue.put((job, version, fd, size, part, done))

    def write(self, job: str, version: int, fd: int, size: int, part: shards.NodePart | None = None) -> float:
        t0 = time.perf_counter()
        try:
            if part is None:
                self.store.save(job, version, fd, size)
            else:
                self.store.save_blob(job, checkpoints.part_name(version, part.first, part.stop), fd, size)
        finally:
            os.close(fd)
        if part is None:
            checkpoints.prune(self.store, job, self.keep(job))
        elif version - self.keep(job) > 0:  # version 0 is whole, and stays
            self.store.delete_blob(job, checkpoints.part_name(version - self.keep(job), part.first, part.stop))
        return time.perf_counter() - t0

    def load(self, job: str, version: int, part: shards.NodePart | None = None) -> bytes:
        """A version's checkpoint, or this node's part of it (sliced from version 0, which is whole)."""
        if part is None:
            return self.store.load(job, version)
        if version == 0:
            return bytes(shards.part_blob(self.store.load(job, 0), part))
        return self.store.load_blob(job, checkpoints.part_name(version, part.first, part.stop))

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            job, version, fd, size, part, done = item
            try:
                seconds, error = self.write(job, version, fd, size, part), None
            except Exception as e:  # the install still happens; the error is reported
                seconds, error = 0.0, e
            done(seconds, error)

    def stop(self) -> None:
        self._queue.put(None)
        self._thread.join(timeout=30)


class Reply:
    """The answer to one request, sent once, now or later (nothing for a push)."""

    __slots__ = ("peer", "request_id", "sent")

    def __init__(self, peer: Peer, request_id: Any) -> None:
        self.peer, self.request_id, self.sent = peer, request_id, False

    def __call__(self, message: Message | None = None, fds: Sequence[int] = ()) -> None:
        """Send ``message`` (Ok if None) with ``fds``, which become the connection's to close."""
        if self.sent or self.request_id is None:
            for fd in fds:
                os.close(fd)
            return
        self.sent = True
        self.peer.stream.send(reply_frame(self.request_id, message or Ok()), fds)

    def error(self, e: LiflError) -> None:
        if self.sent or self.request_id is None:
            return
        self.sent = True
        self.peer.stream.send(error_reply(self.request_id, e))


Handler = Callable[[Any, list[int], Reply], None]


class Peer:
    """A connection served by the agent's loop: a gateway's, its forwarder's, or an instance's.
    Each message goes to the handler of its type; descriptors that came with it are closed once
    the handler returns (a handler keeps one by duplicating it)."""

    def __init__(self, loop: Loop, sock: socket.socket, handlers: dict[type[Message], Handler], who: str,
                 on_close: Callable[[], None], first: str = "") -> None:
        self.handlers = handlers
        self.who = who
        self.first = first  # the code of the refusal, and the connection's end, if its first message is another
        self._on_close = on_close
        self.stream = MessageStream(loop, sock, self._frame, self._closed)

    def _frame(self, frame: dict[str, Any], fds: list[int]) -> None:
        reply = Reply(self, frame.pop("id", None))
        try:
            message = decode(frame)
            handler = self.handlers.get(type(message))
            if handler is None and self.first:
                expected = "/".join(kind.op for kind in self.handlers)
                reply.error(BadRequest(f"a {self.who}'s first message must be {expected}, not {message.op}", code=self.first))
                self.stream.finish()
                return
            if handler is None:
                raise BadRequest(f"{message.op} is not served to a {self.who}", code="bad_message")
            handler(message, fds, reply)
        except LiflError as e:
            reply.error(e)
            if self.first:  # a first message that is not even well formed: nothing more is taken
                self.stream.finish()
        except Exception as e:  # report, keep serving: one bad request must not kill the node
            traceback.print_exc()
            reply.error(Internal(f"{type(e).__name__}: {e}"))
        finally:
            for fd in fds:
                with contextlib.suppress(OSError):
                    os.close(fd)

    def push(self, message: Message, fds: Sequence[int] = ()) -> None:
        self.stream.send(message.encode(), fds)

    def close(self) -> None:
        self.stream.close()

    def _closed(self) -> None:
        self._on_close()


class Batches:
    """One Redis call per job at a time, for everything of the job that arrived by then: items
    added in one turn of the loop go together (the call starts at the end of the turn), and items
    that arrive while a job's call is in flight go in its next call (up to ``MAX_BATCH`` a call).
    ``call(job, items, finished)`` starts a call; ``done(job, items, result, error)`` takes its answer.

    The calls are idempotent (each upload has a token), so a call whose answer was lost (the
    connection to Redis broke: the script may or may not have run) is sent again, with back-offs,
    for up to ``REDIS_RETRY_WINDOW_S``; only then does ``done`` hear of the error."""

    def __init__(self, loop: Loop, call: Callable[[str, list[Any], Callable[[Any, BaseException | None], None]], None],
                 done: Callable[[str, list[Any], Any, BaseException | None], None], sizes: Any) -> None:
        self.loop = loop
        self._call = call
        self._done = done
        self._sizes = sizes  # a histogram of batch sizes (the node's metrics)
        self._waiting: dict[str, list[Any]] = {}
        self._busy: set[str] = set()  # jobs whose call is in flight or about to start

    def add(self, job: str, item: Any) -> None:
        self._waiting.setdefault(job, []).append(item)
        if job not in self._busy:
            self._busy.add(job)
            self.loop.post(lambda: self._start(job))

    def _start(self, job: str) -> None:
        waiting = self._waiting.pop(job, [])
        if not waiting:
            self._busy.discard(job)
            return
        items, rest = waiting[:MAX_BATCH], waiting[MAX_BATCH:]
        if rest:
            self._waiting[job] = rest
        self._sizes.observe(len(items))
        self._send(job, items, time.monotonic() + REDIS_RETRY_WINDOW_S, 0)

    def _send(self, job: str, items: list[Any], deadline: float, attempt: int) -> None:
        def finished(result: Any, error: BaseException | None) -> None:
            if isinstance(error, ConnectionError) and time.monotonic() < deadline:
                delay = REDIS_RETRY_S[min(attempt, len(REDIS_RETRY_S) - 1)]
                self.loop.later(delay, lambda: self._send(job, items, deadline, attempt + 1))
                return
            try:
                self._done(job, items, result, error)
            finally:
                self._start(job)

        try:
            self._call(job, items, finished)
        except Exception as e:  # noqa: BLE001 - the job's calls must go on: its items hear of it
            self.loop.post(lambda error=e: finished(None, error))


def _unavailable(error: BaseException) -> LiflError:
    """What a caller is told when the Redis call its request needed failed."""
    if isinstance(error, LiflError):
        return error
    return Unavailable(f"the cluster state is unavailable: {type(error).__name__}: {error}", code="state_unavailable",
                       retry_after=2.0)


class Agent:
    def __init__(self, config: AgentConfig, state: ClusterState) -> None:
        self.config = config
        self.node = config.node
        self.state = state
        self.secure = SecureRounds(state)
        self.loop = Loop(f"lifl agent {config.node}")
        self.resp = Resp(self.loop, config.redis_url, state.timeout)  # the hot path's Redis calls, from the loop
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
            self.actuator = ClusterPods(config.node, self.transport)
        elif config.functions == "processes":
            self.actuator = LocalProcesses(config.node, self.transport, config.handler)
        else:
            raise ValueError(f"unknown --functions {config.functions!r}: one of {', '.join(ACTUATORS)}")
        self.board = tasks.Board(config.max_instances, reuse=config.reuse, starts_instances=self.actuator.starts_instances)
        self.uploads = uploads.Uploads()
        self.checkpoints = installs.Checkpoints()
        self.forwards = installs.Forwards()
        # a split job's part of a round's next version, durable, until every node's is (lifl.shards)
        self._split_installing: dict[str, tuple[tree.Install, dict[str, Any]]] = {}
        self.controller = Controller(state, config.node, config.control, reuse=config.reuse)
        self.jobs: dict[str, JobRun] = {}
        self.instances: dict[int, Peer] = {}  # control connections of live instances
        self.instance_tenants: dict[int, Tenant] = {}
        self.steps: dict[tuple[str, int], StrategyStep] = {}  # a top's strategy step, by (job, new version), until installed
        self.store.on_free = self._update_done
        self.retainer = Retainer(config.node, self.store, state, self.checkpointer.store, self.metrics, self.loop.call,
                                 config.retain_budget or config.shm_capacity // 2)
        self.store.spill = self._spill_for_room
        # the versions a query may read stay (read from Redis if this node has not seen the job yet)
        self.checkpointer.keep = lambda job: checkpoints_kept(self.retainer.policy(job), checkpoints.KEEP)
        self.queries: dict[int, QueryRun] = {}
        self.forwarder: Peer | None = None  # the gateway's connection taking ForwardPartial
        self.recent: deque[TaskReport] = deque(maxlen=512)  # finished tasks' statistics
        self.started_at = time.time()
        self._tenants: dict[str, Tenant] = {}
        self._next_id = 0
        self._outbox: deque[tuple[Tenant, KeyMessage]] = deque()  # keys for instances whose queue was full
        self._outbox_timer: Any = None
        self._parked_folds: dict[int, list[tuple[Callable[[], None], Callable[[LiflError], None], Any]]] = {}  # folds of keys not handed off yet
        self._settling: set[str] = set()  # jobs whose settle is in flight
        self._settle_again: set[str] = set()  # ...and asked for again meanwhile
        self._secure_waits: dict[str, list[tuple[int, frozenset[str], Reply]]] = {}  # (round, clients) waiting for mask streams
        self._masked: dict[tuple[str, int], MaskedInputs] = {}  # a secure round's inputs here, by (job, round)
        self._secrets: dict[str, RoundSecrets] = {}  # a done secure round's rebuilt secrets, by job (off the loop)
        self._secure_reading: set[str] = set()  # jobs whose secure round is being read for them
        self._deadline_at: dict[str, float] = {}  # a job's next round deadline to check (monotonic), from its last settle
        self._touched: dict[str, float] = {}  # when a gateway last asked about a job (monotonic): it is active a while
        # jobs whose model or replica is in memory here, by when it was last used, least recently first
        self._resident: OrderedDict[str, float] = OrderedDict()
        self._restoring: dict[str, list[Callable[[LiflError | None], None]]] = {}  # spilled models being read back
        self._swept: dict[str, float] = {}  # when a duty last visited every job (monotonic)
        self._settled_at: dict[str, float] = {}  # when a job with a round here was last settled (monotonic)
        self._settle_then: dict[str, list[Callable[[], None]]] = {}  # what waits for a job's settle
        self._aggregated: dict[tuple[str, int], int] = {}  # updates folded, not yet counted in Redis
        self._next_models: dict[tuple[str, int, bool], bytes] = {}  # what a sharded round's tops write into (True: state)
        self._step_partials: dict[tuple[str, int], StepPartialSums] = {}  # of a sharded round's tops, by (job, round)
        self._listeners: list[socket.socket] = []
        self._holders: set[Hashable] = set()  # gateway connections that are open
        self._stopping = False
        self._loop_thread: threading.Thread | None = None
        self._reserves = Batches(self.loop, self._reserve_call, self._reserved, self.metrics.batch_sizes.labels("reserve"))
        self._accepts = Batches(self.loop, self._accept_call, self._accepted, self.metrics.batch_sizes.labels("accept"))
        self._boot = secrets.token_hex(4)  # upload tokens start with it: unique across this node's restarts
        self._slots = uploads.Slots()  # the round slots this node holds in Redis
        self._tokens = 0
        self._gateway_handlers: dict[type[Message], Callable[[Hashable], Handler]] = {
            Admit: lambda h: lambda m, f, r: self.admit(h, m, r),
            AdmitModel: lambda h: lambda m, f, r: self.admit_model(h, m, r),
            AdmitPartial: lambda h: lambda m, f, r: self.admit_partial(h, m, r),
            AdmitReplica: lambda h: lambda m, f, r: self.admit_replica(h, m, r),
            Abort: lambda h: lambda m, f, r: self.abort(h, m, r),
            Submit: lambda h: lambda m, f, r: self.submit(h, m, r),
            SubmitPartial: lambda h: lambda m, f, r: self.submit_partial(h, m, r),
            InstallModel: lambda h: lambda m, f, r: self.install_model(h, m, r),
            InstallReplica: lambda h: lambda m, f, r: self.install_replica(h, m, r),
            OpenModel: lambda h: lambda m, f, r: self.open_model(h, m, r),
            Release: lambda h: lambda m, f, r: self.release(h, m, r),
            GetMetrics: lambda h: lambda m, f, r: r(Text(self.metrics_text())),
            GetStatus: lambda h: lambda m, f, r: r(StatusReply(self.status())),
            GetRecent: lambda h: lambda m, f, r: r(RecentTasks(list(self.recent))),
            Query: lambda h: lambda m, f, r: self.query(m, r),
        }

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
        self._loop_thread = self.loop.start()
        self._restore_models()  # first: a round whose version was checkpointed is complete, not given up
        self._give_up_previous_rounds()
        quotas = self.state.quotas()  # before the first admission: a tenant's shm_bytes holds from the start
        self.loop.call(lambda: self.store.ledger.set_quotas(quotas))
        self.state.publish_node(self.node, self.loop.call(self.status))
        path = self.config.socket_path
        path.unlink(missing_ok=True)
        gateways = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        gateways.bind(str(path))
        if self.config.socket_group is not None:
            os.chown(path, -1, self.config.socket_group)
        os.chmod(path, 0o600 if self.config.socket_group is None else 0o660)
        gateways.listen(LISTEN_BACKLOG)
        functions = self.config.functions_socket_path
        functions.unlink(missing_ok=True)
        attaching = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        attaching.bind(str(functions))
        # world-connectable: pods reach it through a hostPath as their tenant's uid, allocated as tenants
        # appear, so no fixed group or ACL names them; the check is the connection's kernel-recorded peer
        # credentials, which Attach (all it serves first) must match (privilege.attach_refusal)
        os.chmod(functions, 0o666)
        attaching.listen(LISTEN_BACKLOG)
        self._listeners = [gateways, attaching]

        def listen() -> None:
            for listener, serve in ((gateways, self._new_peer), (attaching, self._new_function)):
                listener.setblocking(False)
                self.loop.watch(listener, lambda listener=listener, serve=serve: self._accept(listener, serve))
            c = self.config
            for name, period, duty in (
                ("expire_idle_instances", 0.2, self.expire_idle_instances),
                ("round_duties", 0.2, self.round_duties),
                ("retry_forwards", 0.1, self.retry_forwards),
                ("retry_checkpoints", 0.2, self.retry_checkpoints),
                ("publish_status", 1.0, self.publish_status),
                ("trim_pool", 5.0, self.trim_pool),
                ("drop_stale_replicas", 1.0, self.drop_stale_replicas),
                ("spill_idle_models", min(1.0, c.model_idle_s / 2), self.spill_idle_models),
                ("control", c.control.period, self.control),
                ("warm_instances", 0.5, self.warm_instances),
                ("apply_retention", 1.0, self.apply_retention),
                ("count_aggregated", 0.05, self._count_aggregated),
                ("reconcile_slots", 1.0, self.reconcile_slots),
                ("refresh_quotas", 1.0, self.refresh_quotas),
            ):
                self.loop.every(name, period, duty)

        self.loop.call(listen)
        threading.Thread(target=self._round_events, name="agent-events", daemon=True).start()

    def stop(self) -> None:
        """Clean shutdown: unlink every object first (mappings stay valid for whoever holds them,
        and a checkpoint being written has its own descriptor), then stop the instances. Once."""
        if self._stopping:
            return
        self._stopping = True

        def shut() -> None:
            for listener in self._listeners:
                self.loop.unwatch(listener)
                listener.close()
            for peer in list(self.instances.values()):
                peer.close()

        self.loop.call(shut)
        self.retainer.stop()

        def close_store() -> None:
            self.store.close()
            remove_node_objects(self.node)

        self.loop.call(close_store)
        self.loop.stop()
        if self._loop_thread is not None:
            self._loop_thread.join(30)
        self.actuator.stop_all()
        self.transport.close()
        self.checkpointer.stop()
        self.loop.close()
        self.config.socket_path.unlink(missing_ok=True)
        self.config.functions_socket_path.unlink(missing_ok=True)

    def stop_instance(self, iid: int) -> None:
        """Let an instance go (from any thread): it takes no task from now on and its connection
        closes (a pod attaches again, as a new instance)."""
        self.loop.call(lambda: self._perform([self.board.stop(iid)]))

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
                self._settle_io(name, None)

    def _restore_models(self) -> None:
        """Resume every job whose model lived on this node at its latest checkpoint, spilled: its
        model comes back into memory when it is first used (``_bring_back``), as an idle model does.

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
            read = self._job_io(name)

            def resume(read: tuple[Job, Tenant, RetentionPolicy] = read, latest: int = latest) -> None:
                self._known(read).model_version = latest

            self.loop.call(resume)
            if latest > j.version:  # the round made it (its updates are in the checkpoint): one record, no loss
                summary = self._summary(j, self.state.shard(name), latest, "complete" if j.accepted >= j.spec.goal else "partial",
                                        updates=j.accepted, lost={},
                                        reason=f"node {self.node} restarted with version {latest} checkpointed, "
                                               "which Redis did not have yet")
                self.state.next_round(name, j.round, latest, key="", node=self.node, summary=summary)
            self.state.set_checkpoint(name, latest)
            self.metrics.version.labels(name).set(latest)
            print(f"lifl agent: job {name!r} resumed at version {latest} from its checkpoint", file=sys.stderr)

    def _blob_object(self, run: JobRun, blob: bytes, holder: Hashable, *, model: bool = True) -> Segment:
        layout = kernels.validate(blob, run.blob_spec if model else None)
        seg = self.store.create(run.tenant, layout.total_size, holder, affinity="gateway", owner=Pinned(run.spec.job))
        os.pwrite(seg.fd, blob, 0)
        self.store.seal(seg.key)
        return seg

    def _take_id(self) -> int:
        self._next_id += 1
        return self._next_id

    # -- connections ------------------------------------------------------------------------------
    def _accept(self, listener: socket.socket, serve: Callable[[socket.socket], None]) -> None:
        while True:
            try:
                sock, _ = listener.accept()
            except BlockingIOError:
                return
            except OSError as e:  # out of descriptors: the connections that end make room
                print(f"lifl agent: cannot accept a connection: {e}", file=sys.stderr)
                return
            serve(sock)

    def _new_peer(self, sock: socket.socket) -> None:
        """A gateway's connection: it says hello first, as a requester or as the forwarder."""
        holder = ("conn", self._take_id())
        peer: Peer

        def hello(m: Hello, fds: list[int], reply: Reply) -> None:
            if m.protocol != PROTOCOL:
                reply.error(BadRequest(f"expected hello with protocol {PROTOCOL}", code="bad_hello"))
                peer.stream.finish()
                return
            reply(Welcome(self.node, PROTOCOL))
            peer.first = ""
            if m.role == "forwarder":
                self.forwarder = peer
                peer.handlers = {Forwarded: lambda m, f, r: self.forwarded(m)}
                peer.who = "forwarder"
                return
            peer.handlers = {kind: make(holder) for kind, make in self._gateway_handlers.items()}
            self._holders.add(holder)

        def closed() -> None:
            if self.forwarder is peer:
                self.forwarder = None
                self.forwards.forwarder_gone(time.monotonic())
            else:
                self._gateway_gone(holder)

        peer = Peer(self.loop, sock, {Hello: hello}, "gateway", closed, first="bad_hello")

    def _new_function(self, sock: socket.socket) -> None:
        """A function instance the node did not start (a pod) attaching: its first message is
        ``Attach``; if the kernel says it runs as the tenant's user, it becomes one of the
        tenant's warm instances here, and the connection its control connection."""
        peer: Peer

        def attach(m: Attach, fds: list[int], reply: Reply) -> None:
            peer.handlers = {}  # nothing more until it is attached (or refused)
            try:
                if m.protocol != PROTOCOL:
                    raise BadRequest(f"protocol {m.protocol} is not this node's ({PROTOCOL})", code="bad_protocol")
                if not TENANT_NAME.fullmatch(m.tenant):
                    raise BadRequest(f"tenant {m.tenant!r} is not a tenant name", code="bad_tenant")
            except LiflError as e:
                refused(reply, e)
                return
            known = m.tenant in self._tenants

            def check() -> Tenant:
                if self.config.isolate and not known and not self.state.known_tenant(m.tenant):
                    # any local process may connect: it must not make the cluster allocate tenant ids
                    raise Forbidden(f"tenant {m.tenant!r} is unknown: its first job (or its pods' admission) makes it",
                                    code="unknown_tenant")
                return self._tenant_io(m.tenant)

            def checked(tenant: Tenant | None, error: BaseException | None) -> None:
                if error is not None or tenant is None:
                    refused(reply, error if isinstance(error, LiflError) else _unavailable(error or Internal("no tenant")))
                    return
                why = attach_refusal(tenant.uid, tenant.name, peer_identity(sock), current())
                if why is not None:
                    refused(reply, Forbidden(why, code="wrong_identity"))
                    return
                if self._stopping or peer.stream.closed:
                    peer.close()
                    return
                iid = self.board.new_instance_id()
                chan, spec = self.actuator.attach(tenant, iid)
                reply(Attached(iid, self.node, spec), [chan.detach()])
                self._adopt(iid, tenant, peer)
                self.board.attached(iid, tenant.name, time.monotonic())
                self.metrics.spawned.labels("attached").inc()
                self._dispatch()

            self.loop.offload(check, checked)

        def refused(reply: Reply, e: LiflError) -> None:
            print(f"lifl agent: refused a function instance: {e.message}", file=sys.stderr)
            reply.error(e)
            peer.stream.finish()

        peer = Peer(self.loop, sock, {Attach: attach}, "function", lambda: None, first="bad_attach")

    def _adopt(self, iid: int, tenant: Tenant, peer: Peer) -> None:
        """``peer`` is now instance ``iid``'s control connection."""
        self.instances[iid] = peer
        self.instance_tenants[iid] = tenant
        peer.who, peer.first = "function instance", ""
        peer.handlers = {
            Ready: lambda m, f, r: self.ready(iid, r),
            Alloc: lambda m, f, r: self.alloc(iid, m, r),
            NextModel: lambda m, f, r: self.next_model(iid, m, r),
            StepPartials: lambda m, f, r: self.step_partials(iid, m, r),
            SecureSeeds: lambda m, f, r: self.secure_seeds(iid, m, r),
            Folded: lambda m, f, r: self.folded(iid, m, r),
            Finished: lambda m, f, r: self.finished(iid, m),
            InstallResult: lambda m, f, r: self.install(iid, m, r),
            Done: lambda m, f, r: self.done(iid, m, r),
            Failed: lambda m, f, r: self.failed(iid, m, r),
            TakeQuery: lambda m, f, r: self.take_query(iid, m, r),
            StrategyInputs: lambda m, f, r: self.strategy_inputs(iid, m, r),
        }
        peer._on_close = lambda: self._instance_gone(iid, "its process exited")

    # -- jobs and tenants -------------------------------------------------------------------------
    def _tenant_io(self, name: str) -> Tenant:
        """The tenant (its id read from Redis the first time); call off the loop."""
        t = self._tenants.get(name)
        if t is not None:
            return t
        tenant_id = self.state.tenant_id(name)
        uid = tenant_id if self.config.isolate else None
        return self._tenants.setdefault(name, Tenant(name, uid, uid, tenant_id))

    def _run(self, j: Job, tenant: Tenant) -> JobRun:
        """This node's record of a job (``j`` was read from Redis)."""
        run = self.jobs.get(j.spec.job)
        if run is None:
            run = self.jobs[j.spec.job] = JobRun(j.spec, tenant, j.model_spec, shm_capacity=self.store.capacity,
                                                 parts=j.parts, node=self.node)
        if run.model_spec is None:
            run.model_spec, run.parts = j.model_spec, j.parts
        return run

    def _job_io(self, name: str) -> tuple[Job, Tenant, RetentionPolicy]:
        """The job as Redis has it, its tenant and its retention policy; call off the loop."""
        view = self.state.job_view(name)  # one call: the job and its retention policy
        return view.job, self._tenant_io(view.job.spec.tenant), view.retention

    def _known(self, read: tuple[Job, Tenant, RetentionPolicy]) -> JobRun:
        """This node's record of a job read by ``_job_io`` (on the loop)."""
        j, tenant, policy = read
        self.retainer.policies.setdefault(j.spec.job, policy)
        return self._run(j, tenant)

    def _with_job(self, name: str, then: Callable[[Job, JobRun], None], reply: Reply) -> None:
        """Read the job from Redis, then ``then(job, run)`` on the loop (errors answer ``reply``)."""
        self._touch(name)

        def got(result: tuple[Job, Tenant, RetentionPolicy] | None, error: BaseException | None) -> None:
            if error is not None or result is None:
                reply.error(_unavailable(error or Internal("no job")))
                return
            try:
                then(result[0], self._known(result))
            except LiflError as e:
                reply.error(e)

        self.loop.offload(lambda: self._job_io(name), got)

    def _with_run(self, name: str, then: Callable[[JobRun], None], reply: Reply) -> None:
        """This node's record of a job, read from Redis only the first time (its spec is fixed)."""
        self._touch(name)
        run = self.jobs.get(name)
        if run is not None and run.model_spec is not None:
            then(run)
        else:
            self._with_job(name, lambda j, run: then(run), reply)

    def _touch(self, name: str) -> None:
        """A gateway asked about the job, or its model was used: it is active, its model not idle."""
        self._touched[name] = time.monotonic()
        if name in self._resident:
            self._used(name)

    def tenant_of(self, job: str) -> str:
        return self.jobs[job].tenant.name

    # -- uploads ----------------------------------------------------------------------------------
    def admit(self, holder: Hashable, m: Admit, reply: Reply) -> None:
        """Reserve a slot of the round (with every other admission of the job that arrives
        meanwhile: one Redis call), then the memory to aggregate the update, then its object."""
        def reserve(run: JobRun) -> None:
            if run.spilled:  # its round begins: the model comes back meanwhile (a strategy's step reads it)
                self._bring_back(run, lambda error: None)
            self._reserves.add(m.job, (holder, m, self._token(), reply))

        self._with_run(m.job, reserve, reply)

    def _token(self) -> str:
        """An upload's token: unique across this node's restarts (see the admission scripts)."""
        self._tokens += 1
        return f"{self._boot}{self._tokens:x}"

    def _reserve_call(self, job: str, items: list[tuple[Hashable, Admit, str, Reply]],
                      done: Callable[[Any, BaseException | None], None]) -> None:
        call = self.state.reserve_call(job, self.node, [(token, m.version, m.lease, m.client) for _, m, token, _ in items])
        self._slots.taking(job, [token for _, _, token, _ in items])
        self._script(call, lambda raw, error: done(reserved(raw) if error is None else None, error))

    def _script(self, call: ScriptCall, done: Callable[[Any, BaseException | None], None]) -> None:
        """Run one of the state's scripts from the loop (``lifl.net.resp``: no thread, no waiting)."""

        def answered(reply: Any, error: BaseException | None) -> None:
            if error is None and late(reply):  # it did nothing: as if the connection had broken before it ran
                done(None, ConnectionError("the call reached Redis after the node stopped waiting"))
            else:
                done(reply, error)

        self.resp.script(call.script.sha, call.script.script, call.keys, call.args, answered)

    def _script_io(self, call: ScriptCall, what: str, then: Callable[[], None] = lambda: None) -> None:
        """A script whose answer nobody waits for (a failure is logged: duties repair it); then ``then()``."""

        def done(_: Any, error: BaseException | None) -> None:
            if error is not None:
                print(f"lifl agent: {what} failed: {error}", file=sys.stderr)
            then()

        self._script(call, done)

    def _reserved(self, job: str, items: list[tuple[Hashable, Admit, str, Reply]],
                  results: list[tuple[int, int, int]] | None, error: BaseException | None) -> None:
        if error is not None or results is None:
            for _, _, _, reply in items:
                reply.error(_unavailable(error or Internal("no answer")))
            tokens = [token for _, _, token, _ in items]
            self._slots.unknown(job, tokens)  # reserved or not: a late run of the call is found by reconcile_slots
            if isinstance(error, ConnectionError):  # they may have been reserved: their slots go back once Redis is back
                self._give_back_eventually(job, [(token, -1, "") for token in tokens])  # tokens name their round
            return
        run = self.jobs[job]
        give_back: list[tuple[str, int, Reply, LiflError]] = []
        for (holder, m, token, reply), (status, version, round_id) in zip(items, results):
            if status != RESERVE_OK:
                self._slots.released(job, [token])
                reply.error(refusal(status, job, version, round_id, run.spec.goal, base_version=m.version,
                                    max_staleness=run.spec.strategy_spec.max_staleness, tenant=run.spec.tenant))
                continue
            try:
                if holder not in self._holders:
                    raise Unavailable("the gateway's connection closed", code="connection_lost", retry_after=1.0)
                self.uploads.check_budget(job, run.spec.inflight_budget, self.node)
                seg = self.store.admit(run.tenant, m.size, holder, RoundOf(job, round_id), UPDATE, run.sizes)
            except LiflError as e:
                if isinstance(e, Overloaded):
                    self.metrics.refused(job, e.code)
                give_back.append((token, round_id, reply, e))
                continue
            self.uploads.add(seg.key, uploads.Upload(job, UPDATE, holder, version, round_id, base=m.version, slot=token))
            reply(Admitted(seg.key, m.version, round_id), [os.dup(seg.fd)])
        if give_back:  # refused after all: the slots go back before the refusals are answered
            self._slots.released(job, [token for token, _, _, _ in give_back])

            def answer() -> None:
                for _, _, reply, e in give_back:
                    reply.error(e)

            self._script_io(self.state.give_back_call(job, self.node, [(t, r, "") for t, r, _, _ in give_back]),
                            "giving back round slots", answer)

    def _give_back_eventually(self, job: str, slots: list[tuple[str, int, str]],
                              then: Callable[[int], None] = lambda given: None) -> None:
        """Slots that may have been taken by a call whose answer was lost: give them back (by token,
        so only those taken go back), trying again until Redis answers; then ``then(how many went back)``."""

        def given(count: Any, error: BaseException | None) -> None:
            if isinstance(error, ConnectionError):
                self.loop.later(REDIS_RETRY_S[-1], lambda: self._give_back_eventually(job, slots, then))
            elif error is None:
                then(int(count))

        self._script(self.state.give_back_call(job, self.node, slots), given)

    def reconcile_slots(self) -> None:
        """Give back the round slots Redis says this run of the node holds and it does not (uploads.Slots)."""
        for job in self._slots.check():

            def found(raw: Any, error: BaseException | None, job: str = job) -> None:
                if error is not None:
                    return  # Redis is away: the next check asks again
                orphans = self._slots.orphans(job, list(raw))
                if orphans:
                    print(f"lifl agent: giving back {len(orphans)} round slots of {job!r} taken by calls whose answer "
                          "was lost", file=sys.stderr)
                    self._give_back_eventually(job, [(token, -1, "") for token in orphans])

            self._script(self.state.held_slots_call(job, self.node, self._boot), found)

    def _io(self, call: Callable[[], Any], what: str = "") -> None:
        """A Redis write whose answer nobody waits for (a failure is logged; duties repair it)."""

        def done(_: Any, error: BaseException | None) -> None:
            if error is not None:
                print(f"lifl agent: {what or getattr(call, '__name__', 'a Redis call')} failed: {error}", file=sys.stderr)

        self.loop.offload(call, done)

    def admit_model(self, holder: Hashable, m: AdmitModel, reply: Reply) -> None:
        def then(j: Job, run: JobRun) -> None:
            if j.version != NO_MODEL:
                raise Conflict(f"job {m.job!r} already has a model", code="model_exists")
            if m.size > run.spec.max_update_bytes:
                raise PayloadTooLarge(f"model of {m.size} bytes exceeds the job's limit of {run.spec.max_update_bytes} bytes")
            self.uploads.begin_model(m.job)
            try:
                seg = self.store.admit_pinned(run.tenant, m.size, holder, m.job)
            except LiflError:
                self.uploads.model_uploads.discard(m.job)  # refused: its retry begins again
                raise
            self.uploads.add(seg.key, uploads.Upload(m.job, uploads.MODEL, holder))
            reply(Admitted(seg.key), [os.dup(seg.fd)])

        self._with_job(m.job, then, reply)

    def admit_partial(self, holder: Hashable, m: AdmitPartial, reply: Reply) -> None:
        def admit(run: JobRun) -> None:
            try:
                seg = self.store.admit(run.tenant, m.size, holder, RoundOf(m.job, m.round), PARTIAL, run.sizes)
            except Overloaded as e:  # the sending node tries again later
                self.metrics.refused(m.job, e.code)
                raise
            self.uploads.add(seg.key, uploads.Upload(m.job, uploads.PARTIAL, holder, round=m.round, epoch=m.epoch,
                                                     from_node=m.from_node))
            reply(Admitted(seg.key, round=m.round), [os.dup(seg.fd)])

        def check(run: JobRun) -> None:
            if self._hosts_top(m.job, m.round, m.epoch):
                admit(run)
                return

            def settled() -> None:  # the close may not have reached this node yet
                if not self._hosts_top(m.job, m.round, m.epoch):
                    reply.error(Conflict(f"node {self.node} does not host the top of round {m.round} (epoch {m.epoch}) "
                                         f"of {m.job!r}", code="not_the_top"))
                    return
                try:
                    admit(run)
                except LiflError as e:
                    reply.error(e)

            self.settle(m.job, then=settled)

        self._with_run(m.job, check, reply)

    def _hosts_top(self, job: str, round_id: int, epoch: int) -> bool:
        r = self.trees.round_of(job)
        return r is not None and r.round == round_id and r.top is not None and r.epoch == epoch

    def admit_replica(self, holder: Hashable, m: AdmitReplica, reply: Reply) -> None:
        def admit(run: JobRun) -> None:
            seg = self.store.create(run.tenant, m.size, holder, affinity="gateway", owner=Pinned(m.job))
            self.uploads.add(seg.key, uploads.Upload(m.job, uploads.REPLICA, holder, version=m.version))
            reply(Admitted(seg.key, version=m.version), [os.dup(seg.fd)])

        self._with_run(m.job, admit, reply)

    def abort(self, holder: Hashable, m: Abort, reply: Reply) -> None:
        self._apply_uploads(self.uploads.abort(holder, m.key, m.reason), lambda: reply())

    def _apply_uploads(self, effects: list[uploads.Effect], then: Callable[[], None] = lambda: None) -> None:
        """Release what the uploads held; give their round slots back in Redis, then ``then()``."""
        slots: dict[str, list[tuple[str, int, str]]] = {}
        for e in effects:
            if isinstance(e, uploads.ReleaseUpload):
                self.store.release(e.key, e.upload.holder)  # an update's in-flight count goes with its object
                if e.upload.kind in (UPDATE, PARTIAL):  # its round will not aggregate it: what it reserved goes back
                    self.store.withdraw(RoundOf(e.upload.job, e.upload.round), e.upload.kind)
            elif isinstance(e, uploads.GiveBackSlot):
                slots.setdefault(e.job, []).append((e.slot, e.round, e.reason))
                self._slots.released(e.job, [e.slot])
        if not slots:
            then()
            return
        left = [len(slots)]

        def given() -> None:  # Redis away: the slots come back when the round ends
            left[0] -= 1
            if not left[0]:
                then()

        for job, refused in slots.items():
            self._script_io(self.state.give_back_call(job, self.node, refused), "giving back round slots", given)

    def _gateway_gone(self, holder: Hashable) -> None:
        self._holders.discard(holder)
        self._apply_uploads(self.uploads.dropped_by(holder))
        self.store.release_holder(holder)

    def _update_done(self, key: bytes) -> None:
        """A client update admitted here is no longer in flight (folded, installed, or let go)."""
        self.uploads.update_done(key)

    def submit(self, holder: Hashable, m: Submit, reply: Reply) -> None:
        if m.samples < 1:
            raise BadRequest(f"samples must be positive, got {m.samples}")
        upload = self.uploads.take(holder, m.key, UPDATE)
        if self.jobs[upload.job].spec.secure_aggregation:
            self._masked.setdefault((upload.job, upload.round), MaskedInputs()).submitted(m.key, m.client)
        self.store.seal(m.key)
        self.store.move_ref(m.key, holder, _accepting_holder(upload.job))  # the connection may close meanwhile
        retained = None
        if self.retainer.policy(upload.job).keeps_update(m.client or ""):
            retained = self._retained_meta(m, upload)
        self._accepts.add(upload.job, (m, upload, retained, reply))

    def _accept_call(self, job: str, items: list[tuple[Submit, uploads.Upload, dict[str, Any] | None, Reply]],
                     done: Callable[[Any, BaseException | None], None]) -> None:
        """Count the updates in Redis (one script), then index the ones the job's policy retains
        (a query may come as soon as the round ends) before anyone hears of them."""
        call = self.state.accept_call(job, self.node, [(upload.slot, upload.round, m.client) for m, upload, _, _ in items])

        def counted(raw: Any, error: BaseException | None) -> None:
            if error is not None:
                done(None, error)
                return
            results = accepted(raw)
            index = retained_index(job, [(upload.round, meta) for (_, upload, meta, _), (status, _) in zip(items, results)
                                         if status >= 0 and meta])
            if not index:
                done(results, None)
                return
            left = [len(index)]

            def indexed(_: Any, error: BaseException | None) -> None:
                if error is not None:
                    print(f"lifl agent: indexing retained updates of {job!r} failed: {error}", file=sys.stderr)
                left[0] -= 1
                if not left[0]:
                    done(results, None)

            for command in index:
                self.resp.command(command, indexed)

        self._script(call, counted)

    def _retained_meta(self, m: Submit, upload: uploads.Upload) -> dict[str, Any]:
        """Where a retained client update lives, as Redis indexes it."""
        return {"client": m.client or f"anonymous-{m.key.hex()[:12]}", "samples": m.samples, "version": upload.base,
                "node": self.node, "blob": update_blob(upload.round, m.key), "size": self.store.get(m.key).size}

    def _accepted(self, job: str, items: list[tuple[Submit, uploads.Upload, dict[str, Any] | None, Reply]],
                  results: list[tuple[int, int]] | None, error: BaseException | None) -> None:
        holder = _accepting_holder(job)
        if error is not None or results is None:
            if isinstance(error, ConnectionError):
                for _, _, _, reply in items:  # what is true: it may have been counted
                    reply.error(Unavailable(f"the cluster state did not answer in time: {error}; the update may have "
                                            "been counted: send it again to find out (already_acknowledged if it was)",
                                            code="acknowledgement_unknown", retry_after=REDIS_RETRY_AFTER))
                self._settle_unknown_accepts(job, items)
                return
            for _, _, _, reply in items:
                reply.error(_unavailable(error or Internal("no answer")))
            self._slots.unknown(job, [upload.slot for _, upload, _, _ in items])  # their slots are Redis's to give back
            for m, _, _, _ in items:
                self.store.release(m.key, holder)
            return
        self._slots.released(job, [upload.slot for _, upload, _, _ in items])
        run = self.jobs[job]
        closed = False
        refused: list[tuple[int, str]] = []
        effects: list[tree.Effect] = []
        for (m, upload, retained, reply), (status, _) in zip(items, results):
            if status < 0:
                self.store.release(m.key, holder)
                e = accept_refusal(status, job, upload.round, upload.version, self.node)
                refused.append((upload.round, e.code))
                reply.error(e)
                continue
            closed = closed or status == ACCEPT_CLOSED_ROUND
            self.metrics.arrived(job)
            if retained is not None:
                self.retainer.keep_update(job, run.tenant, m.key, upload.round, upload.base, retained["client"], m.samples)
            effects += self.trees.accepted(job, upload.round, upload.version, run.leaf_fan_in,
                                           tree.Input(m.key, m.samples, 1, False), run.lanes)
            reply(Submitted(upload.round, self.uploads.counts.get(job, 0)))
        if refused:
            self._script_io(self.state.count_call(job, [(r, f"rejected.{code}", 1) for r, code in refused]), "counting refusals")
        self._apply(effects)
        if closed:
            self.settle(job)

    def _settle_unknown_accepts(self, job: str, items: list[tuple[Submit, uploads.Upload, dict[str, Any] | None, Reply]]
                                ) -> None:
        """Updates whose acceptance got no answer in its budget: their clients were told 503, and
        no try of it can act any more (each carried its not-after time, lifl.state._IN_TIME). Each
        was counted or not, and giving its slot back (by token) tells which: given back, it was
        not (released: the 503 was true); not there, it was (accepted again: the script finds its
        record and counts nothing twice, and the round aggregates it; its client, sending again,
        hears ``already_acknowledged``). Tried until Redis answers."""
        for item in items:
            m, upload, _, _ = item

            def settled(given: int, item: Any = item, m: Submit = m, upload: uploads.Upload = upload) -> None:
                if given:
                    self._slots.released(job, [upload.slot])
                    self.store.release(m.key, _accepting_holder(job))
                else:
                    self._accepts.add(job, item)

            self._give_back_eventually(job, [(upload.slot, upload.round, "")], settled)

    def submit_partial(self, holder: Hashable, m: SubmitPartial, reply: Reply) -> None:
        upload = self.uploads.take(holder, m.key, uploads.PARTIAL)
        self.store.seal(m.key)
        accepting = _accepting_holder(upload.job)
        self.store.move_ref(m.key, holder, accepting)  # the connection may close while Redis answers

        def delivered(status: int | None, error: BaseException | None) -> None:
            if error is not None or status is None:
                self.store.release(m.key, accepting)
                reply.error(_unavailable(error or Internal("no answer")))
                return
            try:
                if status < 0:
                    raise tree.NotTheTop(f"round {upload.round} (epoch {upload.epoch}) of {upload.job!r} has moved on")
                effects = self.trees.partial(upload.job, upload.round, upload.from_node, upload.epoch,
                                             tree.Input(m.key, m.samples, m.updates, m.partial))
            except tree.NotTheTop as e:
                self.store.release(m.key, accepting)
                self.metrics.partials_received.labels("refused").inc()
                reply.error(Conflict(str(e), code="not_the_top"))
                return
            self.metrics.partials_received.labels("duplicate" if status == 0 else "accepted").inc()
            self._apply(effects)
            reply()

        self.loop.offload(lambda: self.state.delivered(upload.job, upload.round, upload.from_node, upload.epoch), delivered)

    def install_model(self, holder: Hashable, m: InstallModel, reply: Reply) -> None:
        """Make an uploaded blob version 0, once its checkpoint is durable."""
        upload = self.uploads.take(holder, m.key, uploads.MODEL)
        run = self.jobs[upload.job]
        seg = self.store.seal(m.key)
        spec = self._read_layout(seg.fd).spec()
        strategy = run.spec.strategy_spec
        if strategy.runs_step and any(t.dtype is fmt.BF16 for t in spec.tensors):
            self.store.release(m.key, holder)
            raise Unprocessable(f"strategy {strategy.name!r} computes in float64 from float16/32/64 tensors; this "
                                "model has bfloat16 ones: send them as float32, or aggregate with fedavg",
                                code="unsupported_dtype")
        pending = ("pending", upload.job)
        self.store.move_ref(m.key, holder, pending)
        fd, size = os.dup(seg.fd), seg.size
        ledger = self.store.ledger
        spillable = self._spillable(run.tenant.name)  # the tenant's idle models make room for its rounds
        here = ledger.for_rounds(run.tenant.name) + spillable  # the model is pinned already
        quota = ledger.quota_room(run.tenant.name)  # the tenant's shm_bytes bound its rounds on every node
        if quota is not None:
            quota += spillable
            here = min(here, quota)

        def write() -> tuple[float, float, str, bytearray | None]:
            try:
                nodes = {n: s for n, s in self.state.nodes().items() if n != self.node}
                others = [min(s.shm.capacity - s.shm.pinned - size, quota if quota is not None else s.shm.capacity)
                          for s in nodes.values()]
                parts = shards.split_record(run.spec.shards, run.spec.shard_alignment, spec, self.store.capacity,
                                            [self.node, *nodes])
                split = shards.parts_of(spec, parts)[1] if parts else ()
                check_split(run.spec, split)
                largest = max(split, key=lambda p: p.nbytes, default=None)
                check_round_fits(run.spec, largest.spec if largest else spec,
                                 size - spec.data_bytes + largest.nbytes if largest else size, [here, *others],
                                 run.spec.fan_in_for(spec))
                mine = next((p for p in split if p.node == self.node), None)
                own = None
                if mine is not None:
                    with mmap.mmap(fd, size, prot=mmap.PROT_READ) as whole:
                        own = shards.part_blob(whole, mine)
            except BaseException:
                os.close(fd)  # the checkpoint's writer would have
                raise
            seconds = self.checkpointer.write(upload.job, 0, fd, size)
            return seconds, self.state.next_round(upload.job, -1, 0, key=m.key.hex(), node=self.node, spec=spec,
                                                  parts=parts), parts, own

        def written(result: tuple[float, float, str, bytearray | None] | None, error: BaseException | None) -> None:
            if error is not None or result is None:
                self.store.release(m.key, pending)
                if isinstance(error, OSError):
                    self.metrics.checkpoint_failures.labels(upload.job).inc()
                    reply.error(Unavailable(f"cannot checkpoint the model of {upload.job!r}: {error}",
                                            code="checkpoint_failed", retry_after=installs.CHECKPOINT_RETRY[-1]))
                else:
                    reply.error(_unavailable(error or Internal("no answer")))
                return
            seconds, opened, parts, own = result
            if opened < 0:
                self.store.release(m.key, pending)
                reply.error(Conflict(f"job {upload.job!r} already has a model", code="model_exists"))
                return
            run.model_spec, run.parts = spec, parts
            key = m.key
            if parts:  # split across nodes: this node keeps its part (the whole model is in the checkpoint)
                self.store.release(m.key, pending)
                key = self._blob_object(run, bytes(own), ("model", upload.job)).key if own is not None else None
            else:
                self.store.move_ref(m.key, pending, ("model", upload.job))
            if key is not None:  # else this node holds no part of the split job's model
                self._hold_model(run, key, 0)
                if self.retainer.policy(upload.job).active:
                    self.retainer.keep_model(upload.job, run.tenant, key, 0)
            self.metrics.checkpoint_seconds.observe(seconds)
            self.metrics.version.labels(upload.job).set(0)
            self._io(lambda: self.state.set_checkpoint(upload.job, 0), "recording the checkpoint")
            reply(Installed(0))

        self.loop.offload(write, written)

    def install_replica(self, holder: Hashable, m: InstallReplica, reply: Reply) -> None:
        upload = self.uploads.take(holder, m.key, uploads.REPLICA)
        self.store.seal(m.key)
        self._set_replica(upload.job, self.jobs[upload.job], m.key, upload.version, holder)
        self.metrics.replicas.labels("gateway").inc()
        reply()

    def _set_replica(self, job: str, run: JobRun, key: bytes, version: int, holder: Hashable) -> None:
        if run.replica is not None:
            self.store.release(run.replica[0], ("replica", job))
        self.store.move_ref(key, holder, ("replica", job))
        run.replica = (key, version)
        self._used(job)

    @staticmethod
    def _read_layout(fd: int) -> fmt.Layout:
        prefix = os.pread(fd, fmt.PREFIX_BYTES, 0)
        n = fmt.header_length(prefix)
        return fmt.parse_header(os.pread(fd, n, fmt.PREFIX_BYTES), allow_partial=True)

    # -- models -----------------------------------------------------------------------------------
    def open_model(self, holder: Hashable, m: OpenModel, reply: Reply) -> None:
        """A read reference to the job's current model: the one installed here (brought back from
        its checkpoint if it was spilled), a replica, or (when the node that has it is gone) one
        restored from the shared checkpoints; otherwise ``model_elsewhere`` tells the gateway
        which node to fetch it from."""

        def then(j: Job, run: JobRun) -> None:
            if j.version == NO_MODEL:
                raise Conflict(f"job {m.job!r} has no model yet", code="no_model")
            split = bool(run.parts)
            if m.part and not split:
                raise BadRequest(f"job {m.job!r} is not split across nodes: its model is whole", code="not_split")
            if split and m.part and run.part is None:
                raise Unprocessable(f"node {self.node} holds no part of job {m.job!r}", code="not_a_part_node")
            which = m.part if split else None  # a split job's own part, or its whole copy
            opened = self._open_local(holder, run, j.version, part=which)
            if opened:
                reply(*opened)
                return
            if split and not m.part:  # the whole model: the gateway assembles it from the parts (a replica)
                raise NotFound(f"the model of job {m.job!r} is split across nodes", code="model_split",
                               extra={"version": j.version})
            if run.spilled and run.model_version == j.version:

                def back(error: LiflError | None) -> None:
                    if error is not None:
                        reply.error(error)
                        return
                    again = self._open_local(holder, run, j.version, part=which)
                    if again is None:  # a newer version was installed meanwhile: read the job again
                        self.open_model(holder, m, reply)
                    else:
                        reply(*again)

                self._bring_back(run, back)
                return

            def fetch() -> bytes:
                if run.parts:  # split across nodes: each holds its own part, every checkpoint of which is shared
                    return self.checkpointer.load(m.job, j.version, run.part)
                if j.model_node != self.node and self.state.gateway(j.model_node) is not None:
                    raise NotFound(f"the model of job {m.job!r} is on node {j.model_node}", code="model_elsewhere",
                                   extra={"node": j.model_node, "version": j.version})
                try:
                    return self.checkpointer.store.load(m.job, j.version)
                except FileNotFoundError as e:  # a store of this node's own, not shared with the node that had it
                    raise Overloaded(f"the model of job {m.job!r} (version {j.version}) is on node {j.model_node}, which "
                                     f"is gone, and this node's checkpoint store does not have it: {e}",
                                     code="model_unreachable") from None

            def fetched(blob: bytes | None, error: BaseException | None) -> None:
                if error is not None or blob is None:
                    reply.error(_unavailable(error or Internal("no model")))
                    return
                try:
                    seg = self._blob_object(run, blob, holder)
                except LiflError as e:
                    reply.error(e)
                    return
                if split:  # this node's part, from its checkpoint: its model again
                    self.store.move_ref(seg.key, holder, ("model", m.job))
                    if run.model_key is not None:
                        self.store.release(run.model_key, ("model", m.job))
                    self._hold_model(run, seg.key, j.version)
                    self.metrics.models_moved.labels("restored").inc()
                else:
                    self._set_replica(m.job, run, seg.key, j.version, holder)
                    self.metrics.replicas.labels("checkpoint").inc()
                again = self._open_local(holder, run, j.version, part=which)
                assert again is not None
                reply(*again)

            self.loop.offload(fetch, fetched, SLOW_POOL)

        self._with_job(m.job, then, reply)

    def _hold_model(self, run: JobRun, key: bytes, version: int) -> None:
        """``key``, held by ``("model", job)``, is the job's model here from now on."""
        run.model_key, run.model_version = key, version
        self._used(run.spec.job)

    def _used(self, job: str) -> None:
        """The job's model or replica in memory here was just used: it is the last to spill."""
        self._resident[job] = time.monotonic()
        self._resident.move_to_end(job)

    def _bring_back(self, run: JobRun, then: Callable[[LiflError | None], None]) -> None:
        """Read a spilled model back from its checkpoint into memory (once, however many ask while
        it is read), with the version it had; then ``then(error)`` on the loop."""
        job, version = run.spec.job, run.model_version
        if not run.spilled:
            then(None)
            return
        if job in self._restoring:
            self._restoring[job].append(then)
            return
        self._restoring[job] = [then]

        def loaded(blob: bytes | None, error: BaseException | None) -> None:
            problem: LiflError | None = None
            if isinstance(error, FileNotFoundError):  # pruning keeps the current version: this is a bug
                problem = Internal(f"the checkpoint of version {version} of job {job!r} is missing: {error}")
            elif error is not None or blob is None:
                problem = _unavailable(error or Internal("no checkpoint"))
            elif run.spilled and run.model_version == version:  # no newer version was installed meanwhile
                try:
                    self._hold_model(run, self._blob_object(run, blob, ("model", job)).key, version)
                    self.metrics.models_moved.labels("restored").inc()
                except LiflError as e:
                    problem = e
            for waiter in self._restoring.pop(job):
                waiter(problem)

        self.loop.offload(lambda: self.checkpointer.load(job, version, run.part), loaded, SLOW_POOL)

    def _model_in_memory(self, run: JobRun, version: int) -> bytes | None:
        """(Off the loop.) The object of the job's model ``version`` if it is this node's current
        one, brought back first if it was spilled; None otherwise."""
        back: Future[LiflError | None] = Future()

        def bring_back() -> None:
            if run.spilled and run.model_version == version:
                self._bring_back(run, back.set_result)
            else:
                back.set_result(None)

        self.loop.call(bring_back)
        if (error := back.result()) is not None:
            raise error
        return self.loop.call(lambda: run.model_key if run.model_version == version else None)

    def spill_idle_models(self) -> None:
        """Spill the models (and drop the replicas) unused for ``model_idle_s``; only those unused
        that long are visited (the least recently used come first), so this costs nothing per
        model that is in use or already out."""
        now, idle_s = time.monotonic(), self.config.model_idle_s
        stale = []
        for job, last_used in self._resident.items():
            if now - last_used < idle_s:
                break
            stale.append(self._resident_of(job, last_used))
        for job in spill.expired(stale, now, idle_s):
            self._spill(job, "idle")
        for model in stale:
            if model.busy:  # looked at again once idle that long
                self._used(model.job)

    def _spill_for_room(self, code: str, tenant: str, size: int) -> bool:
        """The store's ``spill``: an admission of ``size`` bytes for ``tenant`` was refused with
        ``code``; spill idle models to make room (least recently used first), whether or not they
        were idle for ``model_idle_s``: any tenant's if memory is short, else the tenant's own.
        Returns whether any went."""
        models = [self._resident_of(job, last_used) for job, last_used in self._resident.items()]
        victims = spill.to_make_room(models, size, None if code == "shm_exhausted" else tenant,
                                     self.store.ledger.over_share(time.monotonic()))
        for job in victims:
            self._spill(job, "pressure")
        return bool(victims)

    def _spillable(self, tenant: str) -> int:
        """Bytes the tenant's idle models (and replicas) hold here: they leave to make room."""
        models = (self._resident_of(job, last_used) for job, last_used in self._resident.items())
        return sum(m.size for m in models if m.tenant == tenant and not m.busy)

    def _resident_of(self, job: str, last_used: float) -> spill.Resident:
        """The job's model and replica in memory, as ``lifl.node.spill`` weighs them."""
        run = self.jobs[job]
        segments = [(self.store.get(key), holder) for key, holder in _outside_rounds(run)]
        shared = any(h != holder and not retention_holder(h) for seg, holder in segments for h in seg.holders)
        usage = self.store.ledger.usage(job)
        busy = (shared or job in self.trees.rounds or bool(self.uploads.counts.get(job)) or bool(usage.working)
                or bool(usage.reserved))
        return spill.Resident(job, run.tenant.name, sum(seg.size for seg, _ in segments), last_used, busy)

    def _spill(self, job: str, reason: str) -> None:
        """Let the job's model (it comes back from its checkpoint), replica and strategy state (read
        back from its checkpoint by the next step) go from memory now."""
        run = self.jobs[job]
        for key, holder in _outside_rounds(run):
            self.store.release(key, holder, pool=False)
        run.model_key, run.replica, run.strategy_state = None, None, None  # the model's version stays: it comes back
        del self._resident[job]
        self.metrics.models_moved.labels(reason).inc()

    def _open_local(self, holder: Hashable, run: JobRun, version: int, *, part: bool | None = None
                    ) -> tuple[Message, list[int]] | None:
        """``version`` of the model if this node has it in memory (``part``, for a job split
        across nodes: its own part, True, or a whole copy, False)."""
        if part is not False and run.model_key is not None and run.model_version == version:
            key = run.model_key
        elif part is not True and run.replica is not None and run.replica[1] == version:
            key = run.replica[0]
        else:
            return None
        seg = self.store.add_ref(key, holder)
        self._used(run.spec.job)
        fd = os.open(SHM_DIR / seg.name[1:], os.O_RDONLY)
        return ModelOpened(key, version, seg.size), [fd]

    def release(self, holder: Hashable, m: Release, reply: Reply) -> None:
        owner = self.store.get(m.key).owner
        self.store.release(m.key, holder)
        if isinstance(owner, Pinned) and owner.job in self._resident:  # a download of its model: used until now
            self._used(owner.job)
        reply()

    # -- queries (lifl.flstore) --------------------------------------------------------------------
    def query(self, m: Query, reply: Reply) -> None:
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
        qid = -self._take_id()
        holder = query_holder(m.job, qid)
        sources: list[str] = []
        self._touch(m.job)

        def prepare() -> tuple[Job, JobRun, dict[str, Any], bool, float]:
            read = self._job_io(m.job)
            j = read[0]
            if j.version == NO_MODEL:
                raise Conflict(f"job {m.job!r} has no model yet", code="no_model")
            if j.parts:  # its nodes hold parts of every update and version: no node has a whole one to query
                raise Unprocessable(f"job {m.job!r} holds its model's shards on several nodes, and queries read whole "
                                    "updates and versions: they are not served for it", code="split_job")
            run = self.loop.call(lambda: self._known(read))
            policy = read[2]
            self.loop.call(lambda: self.retainer.policies.__setitem__(m.job, policy))
            if workload == "inference":
                doc = self._inference_inputs(j, run, policy, body, holder, sources)
            else:
                doc = self._round_inputs(j, run, policy, workload, body, holder, sources, split, scope == NODE_SCOPE)
            split_here = split and (scope == NODE_SCOPE or bool(doc.get("peers")))  # every update here: no need
            doc.update(workload=workload, params=params, job=m.job, mode="partial" if split_here else "run")
            return j, run, doc, split_here, time.perf_counter() - t0

        def failed(e: LiflError) -> None:
            self.store.release_holder(holder)
            self.metrics.queries.labels(m.job, workload, "error").inc()
            reply.error(e)

        def prepared(result: tuple[Job, JobRun, dict[str, Any], bool, float] | None, error: BaseException | None) -> None:
            if error is not None or result is None:
                failed(_unavailable(error or Internal("no inputs")))
                return
            j, run, doc, split_here, fetched_s = result
            fetched = doc.pop("_fetched", 0)

            def answered(stats: dict[str, Any] | None, error: LiflError | None) -> None:
                self.store.release_holder(holder)
                if error is not None or stats is None:
                    failed(error or Internal("the query's function answered nothing"))
                    return
                if "error" in stats:
                    failed(_query_error(stats["error"]))
                    return
                result = stats.get("result", {})
                excluded = [s["client"] for s in result.get("suspects", [])] if workload == "filter" and params.get("exclude") else None

                def exclude() -> list[str]:
                    self.state.exclude(m.job, excluded or [])
                    return self.state.excluded(m.job)

                def finish(now_excluded: list[str] | None, error: BaseException | None) -> None:
                    if error is not None:
                        failed(_unavailable(error))
                        return
                    if now_excluded is not None:
                        result["excluded"] = now_excluded
                    total = time.perf_counter() - t0
                    self.metrics.queries.labels(m.job, workload, "ok").inc()
                    self.metrics.query_seconds.labels(workload).observe(total)
                    reply(QueryAnswer(
                        m.job, workload, self.node,
                        QueryData(len(sources), sources.count("memory"), sources.count("store"), fetched),
                        QuerySeconds(round(total, 6), round(fetched_s, 6), stats.get("compute_s")),
                        doc.get("round"), doc["rounds_chosen"] if split_here else doc.get("rounds"), doc.get("version"),
                        None if split_here else result, result if split_here else None,
                        doc["peers"] if split_here else [], params if split_here else {},
                    ))

                if excluded is None:
                    finish(None, None)
                else:
                    self.loop.offload(exclude, finish)

            self._run_query(QueryRun(qid, m.job, run.tenant, doc.get("version", j.version), doc, answered))

        self.loop.offload(prepare, prepared, SLOW_POOL)

    def _inference_inputs(self, j: Job, run: JobRun, policy: RetentionPolicy, body: dict[str, Any], holder: Hashable,
                          sources: list[str]) -> dict[str, Any]:
        """(off the loop)"""
        if not run.spec.architecture:
            raise BadRequest(f"job {j.spec.job!r} names no architecture (job field 'architecture'): it cannot run "
                             "inference", code="no_architecture")
        version = _selector(body, "version", j.version)
        if version > j.version or (version != j.version and not version_queryable(policy, version, j.version)):
            raise NotFound(f"version {version} of job {j.spec.job!r} is not retained (current version {j.version}; "
                           f"its retention policy keeps models {policy.version_window} versions back)", code="not_retained")
        current = self._model_in_memory(run, version)
        keep = in_memory(policy, Held(MODEL, version), j.round - 1, j.version)
        key, source = self.retainer.acquire_model(j.spec.job, run.tenant, version, holder, keep, current)
        sources.append(source)
        return {"version": version, "architecture": run.spec.architecture, "model": key.hex()}

    def _round_inputs(self, j: Job, run: JobRun, policy: RetentionPolicy, workload: str, body: dict[str, Any],
                      holder: Hashable, sources: list[str], split: bool, node_only: bool) -> dict[str, Any]:
        """What a query over rounds reads (off the loop). ``split``: this node's updates only, the
        other nodes holding some (``peers``) compute theirs; ``node_only``: the rounds are chosen
        already (a peer's part of a split query)."""
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
                current = self._model_in_memory(run, v)
                keep = in_memory(policy, Held(MODEL, v), newest, j.version)
                key, source = self.retainer.acquire_model(j.spec.job, run.tenant, v, holder, keep, current)
                sources.append(source)
                entry[what] = key.hex()
            wanted = [(client, meta, in_memory(policy, Held(UPDATE, round_id, client), newest, j.version))
                      for client, meta in sorted(metas.items())]
            for (client, meta, _), (key, source) in zip(wanted, self.retainer.acquire_updates(
                    j.spec.job, run.tenant, round_id, wanted, holder)):
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

    def _run_query(self, q: QueryRun) -> None:
        """Run ``q`` on an instance of its tenant; its ``done`` hears the answer (or the timeout)."""
        self.queries[q.id] = q

        def timed_out() -> None:
            if self.queries.pop(q.id, None) is None:
                return
            self._perform(self.board.drop_query(q.id))
            q.done(None, Unavailable(f"the query found no instance or took over {QUERY_TIMEOUT_S:g} s",
                                     code="query_timeout", retry_after=1.0))

        q.timer = self.loop.later(QUERY_TIMEOUT_S, timed_out)
        inference = q.doc["workload"] == "inference"
        self._perform(self.board.query(q.id, q.tenant.name, inference, *self._board_context()))

    def _query_over(self, iid: int, qid: int, stats: dict[str, Any] | None, error: LiflError | None = None) -> None:
        q = self.queries.pop(qid, None)
        self.board.query_over(iid, qid, time.monotonic())
        if q is not None:
            q.timer.cancel()
            q.done(stats, error)
        self._dispatch()

    def take_query(self, iid: int, m: TakeQuery, reply: Reply) -> None:
        q = self.queries.get(m.task)
        wait = self.board.queries.get(m.task)
        if q is None or wait is None or wait.instance != iid:
            raise NotFound(f"query {m.task} is not running on instance {iid}", code="no_such_task")
        d = q.doc
        rounds = [QueryRound(r["round"], r["version"], bytes.fromhex(r["base"] or ""), bytes.fromhex(r["aggregate"] or ""),
                             [QueryUpdate(u["client"], u["samples"], bytes.fromhex(u["key"])) for u in r["updates"]])
                  for r in d.get("rounds_data", [])]
        reply(QueryWork(d["workload"], d["params"], d["job"], d["mode"], rounds, d.get("architecture", ""),
                        bytes.fromhex(d.get("model", ""))))

    # -- function instances -------------------------------------------------------------------------
    def _task_of(self, iid: int, task_id: int) -> tree.Task:
        task = self.board.running_on(iid, task_id)
        if task is None or task_id not in self.trees.tasks:
            raise NotFound(f"task {task_id} is not running on instance {iid}", code="no_such_task")
        return task

    def ready(self, iid: int, reply: Reply) -> None:
        self.board.ready(iid)
        reply()

    def alloc(self, iid: int, m: Alloc, reply: Reply) -> None:
        task = self._task_of(iid, m.task)  # its round reserved this when it admitted the inputs
        seg = self.store.create(self.instance_tenants[iid], m.size, _scratch_holder(m.task), affinity=iid,
                                owner=RoundOf(task.job, task.round), scratch=True)
        reply(Allocated(seg.key), [os.dup(seg.fd)])

    def next_model(self, iid: int, m: NextModel, reply: Reply) -> None:
        """The object a sharded round's tops write the next model (or the strategy's next state)
        into: made by the first that asks, its header written, kept by the round until installed."""
        task = self._task_of(iid, m.task)
        run = self.jobs[task.job]
        spec = run.blob_spec
        if m.state and spec is not None:
            spec = state_model_spec(run.spec.strategy_spec, spec)
        if task.role != TOP or run.shard_plan is None or spec is None:
            raise BadRequest(f"task {task.id} is not the top of a sharded round"
                             + (" of a strategy with a state" if m.state else ""), code="not_sharded")
        key = self._next_models.get((task.job, task.round, m.state))
        if key is None:
            header = fmt.spec_header(spec)
            seg = self.store.create(run.tenant, len(header) + spec.data_bytes, ("round", task.job, task.round),
                                    owner=RoundOf(task.job, task.round))
            os.pwrite(seg.fd, header, 0)
            key = self._next_models[(task.job, task.round, m.state)] = seg.key
        reply(Allocated(key), [os.dup(self.store.get(key).fd)])

    def step_partials(self, iid: int, m: StepPartials, reply: Reply) -> None:
        """A sharded round's top sends what its step reads of its slice and moves on. The top
        whose partials complete the round's set is told their sum, and steps every shard (so no
        top waits for another, whatever the instances); a run of it again is told again."""
        task = self._task_of(iid, m.task)
        run = self.jobs[task.job]
        if task.role != TOP or run.shard_plan is None or not run.spec.strategy_spec.reads_whole_updates:
            raise BadRequest(f"task {task.id} is not the top of a sharded round of a strategy that reads whole updates",
                             code="not_sharded")
        if not m.partials or len(m.partials) % 8:
            raise BadRequest(f"step partials of {len(m.partials)} bytes are not float64 values", code="bad_partials")
        values = np.frombuffer(m.partials, np.float64)
        sums = self._step_partials.setdefault((task.job, task.round), StepPartialSums(np.zeros_like(values)))
        if len(values) != len(sums.total):
            raise BadRequest(f"step partials of {len(values)} values, other shards' tops sent {len(sums.total)}",
                             code="bad_partials")
        reply(StepSums(sums.total.tobytes() if sums.add(task.shard, values, run.lanes) else b""))

    def secure_seeds(self, iid: int, m: SecureSeeds, reply: Reply) -> None:
        """A task of a secure round has its sum: it is told what takes off the masks of the
        clients whose inputs it summed up (its folds are all reported), once the round's secrets
        are rebuilt (the unmask stage is done), or that the round was abandoned."""
        task = self._task_of(iid, m.task)
        if not self.jobs[task.job].spec.secure_aggregation:
            raise BadRequest(f"task {task.id} is not of a secure round", code="not_secure")
        known = self.board.progress[task.id].known()
        strange = [key.hex() for key in m.held if key not in known]
        if strange:
            raise BadRequest(f"task {task.id} holds {strange[0]}, none of its inputs", code="bad_secure_input")
        clients = self._masked.get((task.job, task.round), MaskedInputs()).clients(task.id, m.held)
        self._secure_waits.setdefault(task.job, []).append((task.round, clients, reply))
        self._answer_secure(task.job)

    def _answer_secure(self, job: str) -> None:
        """Answer the tasks waiting for their mask streams, if the secure round's unmask stage
        ended (off the loop: its secrets are rebuilt from Redis once, and the pair streams of
        clients who dropped are agreed there); the others wait for the next round event."""
        waits = self._secure_waits.get(job)
        if not waits or job in self._secure_reading:
            return
        self._secure_reading.add(job)
        asked = list(waits)

        def read() -> tuple[Any, list[list[tuple[int, bytes]] | LiflError]]:
            r = self.secure.round(job)
            if r is None or r.stage != DONE:
                return r, []
            rebuilt = self._secrets.get(job)
            if rebuilt is None or rebuilt.round != r.round:
                _, self_seeds, dropped = self.secure.unmask_secrets(job)
                publics = {c: keys.mask for c, keys in self.secure.keys(job).items()}
                rebuilt = self._secrets[job] = RoundSecrets(r.round, self_seeds, dropped, self.secure.graph(r), publics,
                                                            r.context)
            answers: list[list[tuple[int, bytes]] | LiflError] = []
            for round_id, clients, _ in asked:
                try:
                    answers.append(rebuilt.streams_of(clients) if round_id == r.round else [])
                except LiflError as e:
                    answers.append(e)
            return r, answers

        def answered(got: tuple[Any, list[list[tuple[int, bytes]] | LiflError]] | None,
                     error: BaseException | None) -> None:
            self._secure_reading.discard(job)
            if error is not None or got is None:
                print(f"lifl agent: the secure round of {job!r} cannot be read yet: {error}", file=sys.stderr)
                return
            r, answers = got
            keep, later = [], self._secure_waits.pop(job, [])[len(asked):]  # later: asked while the round was read
            for wait, answer in itertools.zip_longest(asked, answers):
                round_id, _, reply = wait
                if r is not None and r.round == round_id and r.stage not in (DONE, ABANDONED):
                    keep.append(wait)  # until the stage ends
                elif r is None or r.round != round_id or r.stage == ABANDONED:
                    reply.error(Conflict(f"secure round {round_id} of {job!r} was abandoned: {r.why if r else 'no round'}",
                                         code="round_abandoned"))
                elif isinstance(answer, LiflError):
                    reply.error(answer)
                else:
                    reply(SecureStreams([[sign, seed.hex()] for sign, seed in answer]))
            if keep or later:
                self._secure_waits[job] = keep + later
            if later:
                self._answer_secure(job)

        self.loop.offload(read, answered)

    def folded(self, iid: int, m: Folded, reply: Reply) -> None:
        """Inputs (and the previous accumulator) are summed up in a new accumulator, ``m.state``:
        it is what the task runs again from if its instance dies; what it sums up may go. The
        answer brings the accumulator for the next fold if the instance asked for one."""
        task = self._task_of(iid, m.task)
        if not self._fold(task, m.keys, m.state, m.seconds):
            self._park(task.id, lambda: self.folded(iid, m, reply), reply.error, m.keys)
            return
        if not m.next_size:
            reply(Allocated(b""))
            return
        try:
            seg = self.store.create(self.instance_tenants[iid], m.next_size, _scratch_holder(task.id), affinity=iid,
                                    owner=RoundOf(task.job, task.round), scratch=True)
        except Overloaded:  # it asks again when it needs one (and is told then)
            reply(Allocated(b""))
            return
        reply(Allocated(seg.key), [os.dup(seg.fd)])

    def _fold(self, task: tree.Task, keys: list[bytes], state: bytes, seconds: float) -> bool:
        """Apply a fold the task reported; False if some of ``keys`` are not (yet) its inputs."""
        if not set(keys) <= self.board.progress[task.id].known():
            return False
        self.store.move_ref(state, _scratch_holder(task.id), _state_holder(task.id))
        self.store.seal(state)
        inputs, previous = self.board.folded(task.id, keys, state, now_ns())
        masked = self._masked.get((task.job, task.round))
        if masked is not None:
            masked.folded(task.id, [msg.key for msg in inputs if not msg.partial])
        updates = 0
        mine = _input_holder(task.id)
        for msg in inputs:
            # a leaf of each tensor shard folds an update: it is done with the last (before the
            # release, whose freeing would tell the uploads first and leave this fold uncounted)
            if not self.store.held_by_any(msg.key, lambda h: h != mine and _is_input_holder(h)):
                updates += self.uploads.update_done(msg.key) is not None
            self.store.release(msg.key, mine)
        if previous is not None:
            self.store.release(previous.key, _state_holder(task.id))
        self.metrics.aggregated(task.job, updates, seconds)
        if updates:
            round_key = (task.job, task.round)
            self._aggregated[round_key] = self._aggregated.get(round_key, 0) + updates
        return True

    def _park(self, task_id: int, again: Callable[[], None], refuse: Callable[[LiflError], None], keys: list[bytes]) -> None:
        """A leaf sends its result's key ahead of its hand-off (Invoke.parent_*): the parent may
        fold it before the hand-off reaches the agent; it comes within moments. ``again`` runs
        when an input is delivered to the task, ``refuse`` after ``HANDOFF_WAIT_S`` without it."""
        entry: list[Any] = []

        def too_late() -> None:
            parked = self._parked_folds.get(task_id, [])
            if entry[0] in parked:
                parked.remove(entry[0])
                known = self.board.progress[task_id].known() if task_id in self.board.progress else set()
                refuse(BadRequest(f"task {task_id} folded {', '.join(k.hex() for k in keys if k not in known)}, "
                                  "none of its inputs"))

        entry.append((again, refuse, self.loop.later(HANDOFF_WAIT_S, too_late)))
        self._parked_folds.setdefault(task_id, []).append(entry[0])

    def _unpark_folds(self, task_id: int) -> None:
        """An input was delivered to ``task_id``: folds that waited for it go on."""
        for again, refuse, timer in self._parked_folds.pop(task_id, []):
            timer.cancel()
            try:
                again()
            except LiflError as e:
                refuse(e)

    def _count_aggregated(self) -> None:
        """Tell Redis how many updates were aggregated (a periodic duty: one call for many folds)."""
        if not self._aggregated:
            return
        counts, self._aggregated = self._aggregated, {}
        by_job: dict[str, list[tuple[int, str, int]]] = {}
        for (job, round_id), n in counts.items():
            by_job.setdefault(job, []).append((round_id, "aggregated", n))
        for job, job_counts in by_job.items():
            self._script_io(self.state.count_call(job, job_counts), "counting aggregated updates")

    def finished(self, iid: int, m: Finished) -> None:
        """A leaf's or middle's end: its last fold, its result to its parent here (which the
        instance sent itself if the parent ran when it started) or to the top on another node,
        and its statistics; the instance is free."""
        task = self.board.running_on(iid, m.task)
        if task is not None and m.task in self.trees.tasks:
            if m.folded and not self._fold(task, m.folded, m.fold_state, m.fold_seconds):
                self._park(task.id, lambda: self.finished(iid, m), lambda e: self._failed_run(iid, m.task, e.message),
                           m.folded)
                return
            sent = (m.sent_to[0], m.sent_to[1]) if len(m.sent_to) == 2 else None
            agg_s = m.stats.get("agg_s")
            agg_us = round(agg_s * 1e6) if isinstance(agg_s, (int, float)) and 0 <= agg_s < 1e6 else 0
            self._result(iid, m.task, tree.Input(m.key, m.samples, m.updates, m.partial), sent, agg_us)
        self._through(iid, m.task, m.stats)

    def _failed_run(self, iid: int, task: int, problem: str) -> None:
        self._perform(self.board.failed(iid, task, problem, *self._board_context()))
        self._free(iid)

    def install(self, iid: int, m: InstallResult, reply: Reply) -> None:
        """The top has the round's model: checkpoint it in the background, then install it."""
        task = self._task_of(iid, m.task)
        if not (m.state or m.report) or self.trees.lanes_writing(task.id) > 1:
            # a sharded round's step is staged with its last top: the state is written by then;
            # the report of a top that stepped every shard (no state) is kept till then
            if m.report and not m.state:
                self.steps[(task.job, task.version + 1)] = StrategyStep(None, m.report)
            self._result(iid, m.task, tree.Input(m.key, m.samples, m.updates, False))
            reply(Installed(task.version + 1))
            return
        step = StrategyStep(m.state or None, m.report)
        part = self.jobs[task.job].part
        written: tuple[int, int] | None = None
        if step.state is not None:
            seg = self.store.seal(step.state)
            self.store.hand_over(step.state, ("strategy", task.job, task.version + 1))
            written = os.dup(seg.fd), seg.size

        def write() -> None:  # before the model's checkpoint: a durable version has its state
            if written is None:
                return
            fd, size = written
            try:
                self.checkpointer.store.save_blob(task.job, strategy_state_blob(task.version + 1, part), fd, size)
            finally:
                os.close(fd)
            # a restart resumes from a version the model checkpoints keep: older states are of no use
            if task.version - checkpoints.KEEP >= 0:
                self.checkpointer.store.delete_blob(task.job, strategy_state_blob(task.version - checkpoints.KEEP, part))

        def staged(_: None, error: BaseException | None) -> None:
            if error is not None:
                reply.error(_unavailable(error))
                return
            replaced = self.steps.pop((task.job, task.version + 1), None)
            if replaced is not None and replaced.state is not None:
                self.store.release(replaced.state, ("strategy", task.job, task.version + 1))
            self.steps[(task.job, task.version + 1)] = step
            try:
                self._result(iid, m.task, tree.Input(m.key, m.samples, m.updates, False))
            except LiflError as e:
                reply.error(e)
                return
            reply(Installed(task.version + 1))

        self.loop.offload(write, staged)

    def _install_step(self, run: JobRun, version: int, installed: bool) -> dict[str, Any]:
        """The staged step of ``version``: its state becomes the job's if the version was
        installed, else goes; what the rounds history says of it."""
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

    def _result(self, iid: int, task_id: int, output: tree.Input, sent: tuple[int, int] | None = None,
                agg_us: int = 0) -> tree.Task:
        """A task's result, sealed and kept by its round until the tree says where it goes
        (``sent``: the instance sent it to that (instance, task) itself; ``agg_us``: how long the
        task folded, which the key message reports on its behalf)."""
        task = self._task_of(iid, task_id)
        if not self.store.get(output.key).sealed:
            self.store.seal(output.key)
        self.store.pass_on(output.key, _input_holder(task.id), ("round", task.job, task.round))
        self._result_exists(task.id)
        self._apply(self.trees.result(task.id, output), sent, agg_us)
        return task

    def _result_exists(self, task_id: int) -> None:
        """The task's result is sealed and kept by its round (or the task is called off): what it
        would run again from is no longer needed."""
        self.board.result_exists(task_id)
        self.store.release_holder(_input_holder(task_id))
        self.store.release_holder(_state_holder(task_id))

    def _release_task_objects(self, task_id: int) -> None:
        self.store.release_holder(_scratch_holder(task_id))
        self._result_exists(task_id)
        self.trees.finished(task_id)
        for _, refuse, timer in self._parked_folds.pop(task_id, []):
            timer.cancel()
            refuse(NotFound(f"task {task_id} is over", code="no_such_task"))

    def done(self, iid: int, m: Done, reply: Reply) -> None:
        """The instance finished a task (or acknowledged its cancellation) and is free again."""
        reply()
        if m.task in self.queries:
            self._query_over(iid, m.task, m.stats)
            return
        self._through(iid, m.task, m.stats)

    def _through(self, iid: int, task_id: int, stats: dict[str, Any]) -> None:
        task = self.board.through(iid, task_id, time.monotonic())
        if task is not None:
            self._release_task_objects(task.id)
            if not stats.get("cancelled"):
                self._record_task(task, iid, stats)
        self._free(iid)

    def _record_task(self, task: tree.Task, iid: int, stats: dict[str, Any]) -> None:
        role = stats.get("role", task.role)
        for step in ("recv", "agg", "send"):
            if isinstance(stats.get(f"{step}_s"), (int, float)):
                self.metrics.steps.labels(role, step).observe(stats[f"{step}_s"])
        for us in stats.get("handoff_us", []):
            if isinstance(us, (int, float)):
                self.metrics.handoff.observe(us / 1e6)
        self.recent.append(TaskReport(task.id, task.job, task.round, iid, role, stats))

    def failed(self, iid: int, m: Failed, reply: Reply) -> None:
        reply()
        if m.task in self.queries:
            self._query_over(iid, m.task, None, Internal(f"the query failed on instance {iid}: {m.problem}"))
            return
        self._perform(self.board.failed(iid, m.task, m.problem, *self._board_context()))
        self._free(iid)

    def _instance_gone(self, iid: int, why: str) -> None:
        peer = self.instances.pop(iid, None)
        tenant = self.instance_tenants.pop(iid, None)
        if peer is None or tenant is None:
            return
        self.actuator.retire(tenant, iid, self.loop)
        if not self._stopping:
            self._perform(self.board.gone(iid, why, *self._board_context()))

    def _free(self, iid: int) -> None:
        """An instance finished its task: reuse it for a waiting task, or keep it warm (or, without
        reuse, let it go)."""
        if not self.config.reuse and iid in self.instances:
            self._perform([self.board.stop(iid)])
        self._dispatch()

    # -- strategies (lifl.strategy) -------------------------------------------------------------------
    def strategy_inputs(self, iid: int, m: StrategyInputs, reply: Reply) -> None:
        """What a top's strategy step reads besides the round's sum, held for the task: the model
        the round started from, the strategy's state after it, and (a strategy that is not eager)
        every client update of the round, with the model it was trained from."""
        task = self._task_of(iid, m.task)
        run = self.jobs[task.job]
        holder = _scratch_holder(task.id)

        def gather() -> StrategyWork:
            strategy = run.spec.strategy_spec
            bases = {task.version: self._held_model(run, task.version, holder)}
            state = b""
            if strategy.stateful:
                state = self._held_state(run, task.version, holder) or b""
            updates = []
            if strategy.needs_updates:
                for client, (key, base, samples) in sorted(self._round_updates(run, task, m.updates, holder).items()):
                    if base not in bases:
                        bases[base] = self._held_model(run, base, holder)
                    updates.append(StrategyUpdate(client, key, samples, task.version - base, bases[base]))
            return StrategyWork(self.state.strategy_seed(task.job), bases[task.version], state, updates)

        self.loop.offload(gather, lambda work, error: reply(work) if error is None else reply.error(_unavailable(error)),
                          SLOW_POOL)

    def _held_model(self, run: JobRun, version: int, holder: Hashable) -> bytes:
        """Model ``version`` held by ``holder`` (off the loop): installed here, a replica, retained,
        or read back from its checkpoint (a split job's: this node's part of it)."""

        def local() -> bytes | None:  # a split job's replica is the whole model: its part is the model
            for key, v in ((run.model_key, run.model_version), (None, NO_MODEL) if run.parts else run.replica or (None, NO_MODEL)):
                if key is not None and v == version:
                    self.store.add_ref(key, holder)
                    return key
            return None

        key = self.loop.call(local)
        if key is None and run.parts:  # split across nodes: this node's part, from its checkpoints
            blob = self.checkpointer.load(run.spec.job, version, run.part)
            key = self.loop.call(lambda: self._blob_object(run, blob, holder).key)
        elif key is None:
            key, _ = self.retainer.acquire_model(run.spec.job, run.tenant, version, holder, keep=False)
        return key

    def _held_state(self, run: JobRun, version: int, holder: Hashable) -> bytes | None:
        """The strategy's state after ``version``, held by ``holder`` (off the loop): kept here, or
        read back from the checkpoint store (a restart, or the top moved to this node). None: no
        step made one yet (the first step starts from zeros)."""

        def local() -> bytes | None:
            if run.strategy_state is not None and run.strategy_state[1] == version:
                self.store.add_ref(run.strategy_state[0], holder)
                return run.strategy_state[0]
            return None

        kept = self.loop.call(local)
        if kept is not None:
            return kept
        try:
            blob = self.checkpointer.store.load_blob(run.spec.job, strategy_state_blob(version, run.part))
        except FileNotFoundError:
            return None
        return self.loop.call(lambda: self._blob_object(run, blob, holder, model=False).key)

    def _round_updates(self, run: JobRun, task: tree.Task, expected: int, holder: Hashable
                       ) -> dict[str, tuple[bytes, int, int]]:
        """Every client update of the task's round, held by ``holder`` (off the loop): (object, base
        version, samples) by client. Those accepted here are retained in memory already; other
        nodes' are indexed in Redis once their write-behind is durable, and read back from the
        checkpoint store."""
        job = run.spec.job
        deadline = time.monotonic() + STRATEGY_INPUTS_TIMEOUT_S
        while True:
            local = self.loop.call(lambda: self.retainer.round_updates(job, task.round))
            indexed = self.state.retained(job, task.round)
            if len(set(local) | set(indexed)) >= expected:
                break
            if time.monotonic() > deadline:
                raise Unavailable(f"round {task.round} of job {job!r} aggregated {expected} updates but only "
                                  f"{len(set(local) | set(indexed))} are retained for its strategy after "
                                  f"{STRATEGY_INPUTS_TIMEOUT_S:g} s", code="updates_missing", retry_after=1.0)
            time.sleep(0.05)  # other nodes' write-behind: Redis offers nothing to wait on here
        wanted = [(client, indexed.get(client) or local[client], True) for client in sorted(set(local) | set(indexed))]
        lookups = self.retainer.acquire_updates(job, run.tenant, task.round, wanted, holder)
        return {client: (key, int(meta["version"]), int(meta["samples"])) for (client, meta, _), (key, _) in zip(wanted, lookups)}

    # -- effects ----------------------------------------------------------------------------------
    def _board_context(self) -> tuple[dict[int, tree.Task], Callable[[int], list[int]], Callable[[str], str], float]:
        """What the board's placement decisions read: the tree's tasks and producers, each job's tenant, the time."""
        return self.trees.tasks, self.trees.producers, self.tenant_of, time.monotonic()

    def _dispatch(self) -> None:
        self._perform(self.board.dispatch(*self._board_context()))

    def _apply(self, effects: Sequence[tree.Effect], sent: tuple[int, int] | None = None, agg_us: int = 0) -> None:
        """Apply the tree's effects; a delivery to the (instance, task) ``sent`` is not sent: the
        instance whose result it is sent it there itself."""
        for e in effects:
            if isinstance(e, tree.Deliver):
                task = self.trees.tasks[e.task]
                if e.shared:
                    self.store.add_ref(e.input.key, _input_holder(e.task))
                else:
                    self.store.pass_on(e.input.key, ("round", task.job, task.round), _input_holder(e.task))
                msg = KeyMessage(dest=0, task=e.task, key=e.input.key, samples=e.input.samples, count=e.input.updates,
                                 partial=e.input.partial, sent_ns=now_ns(), agg_us=agg_us)
                produced = self.board.deliver(task, msg)
                if sent is not None and produced and isinstance(produced[0], tasks.SendKeys) \
                        and (produced[0].instance, e.task) == sent:
                    produced = produced[1:]
                self._perform(produced)
                if e.task in self._parked_folds:
                    self._unpark_folds(e.task)
            elif isinstance(e, tree.Resize):
                self._perform(self.board.resize(e.task, e.fan_in))
            elif isinstance(e, tree.Forward):
                self._send_partial(self.forwards.new(e))
            elif isinstance(e, tree.Install):
                self._install(e)
            elif isinstance(e, tree.Cancel):
                self._perform(self.board.cancel(e.task, e.reason))
            elif isinstance(e, tree.Drop):
                self.store.discard(e.key)
            elif isinstance(e, tree.Release):
                self._forget_round_shared(e.job, e.round)
                self.store.release_holder(("round", e.job, e.round))
                self.store.release_round(RoundOf(e.job, e.round))  # what it reserved and did not use
                self.forwards.release_round(e.job, e.round)
            # tree.Start: a task runs once it has an input (Deliver queues it)
        self._dispatch()

    def _perform(self, effects: Sequence[tasks.Effect]) -> None:
        """Carry out the board's decisions."""
        for e in effects:
            if isinstance(e, tasks.SendKeys):
                tenant = self.instance_tenants.get(e.instance)
                if tenant is not None:
                    for msg in e.messages:
                        self._send_key(tenant, KeyMessage(**{**msg.__dict__, "dest": e.instance}))
            elif isinstance(e, tasks.Invoke):
                self._invoke(e)
            elif isinstance(e, tasks.InvokeQuery):
                q = self.queries[e.query]
                self.metrics.starts.labels("warm" if self.board.workers[e.instance].ready else "cold").inc()
                self._push(e.instance, Invoke(e.query, q.job, q.version, QUERY_ROLE, 0))
            elif isinstance(e, tasks.Spawn):
                self._spawn(e)
            elif isinstance(e, tasks.Stop):
                peer = self.instances.get(e.instance)
                if peer is not None:
                    peer.close()  # a runtime exits when its connection closes (a pod's attaches again, anew)
            elif isinstance(e, tasks.CancelRun):
                self._push(e.instance, CancelTask(e.task, e.reason))
            elif isinstance(e, tasks.ReleaseObjects):
                self._release_task_objects(e.task)
            elif isinstance(e, tasks.ReleaseScratch):
                self.store.release_holder(_scratch_holder(e.task))
            elif isinstance(e, tasks.Rerun):
                print(f"lifl agent: task {e.task.id} ({e.task.role} of {e.task.job} round {e.task.round}) runs again from "
                      f"{'its accumulator of ' + str(e.folded) + ' inputs and ' if e.folded else ''}{e.unfolded} inputs: "
                      f"{e.why}", file=sys.stderr)
                self.metrics.reruns.labels(e.task.role).inc()
            elif isinstance(e, tasks.Abandon):
                print(f"lifl agent: task {e.task.id} failed: {e.reason}", file=sys.stderr)
                self._abandon(e.task.job, e.task.round, e.reason)
            elif isinstance(e, tasks.QueryFailed):
                q = self.queries.pop(e.query, None)
                if q is not None:
                    q.timer.cancel()
                    q.done(None, Unavailable(e.why, code="query_failed", retry_after=1.0))

    def _invoke(self, e: tasks.Invoke) -> None:
        """Start a task on an instance: the inputs it has so far travel with the invocation, and
        so does an accumulator when it will fold at once (no request of its own for either)."""
        task = e.task
        run = self.jobs[task.job]
        spec = options = None
        if e.first_for_job:
            assert run.model_spec is not None
            spec = run.model_spec.to_json()
            options = {"strategy": run.spec.strategy, "fixed_point": run.spec.fixed_point}
            part = run.part
            if part is not None:  # how the whole model is cut, and which run of shards is this node's
                options["shards"] = list(shards.split_cut(run.parts))
                options["part"] = [part.first, part.stop]
            elif run.shard_plan is not None:
                options["shards"] = [len(run.shard_plan), run.spec.shard_alignment]
            if run.spec.accumulator != "float64":
                options["accumulator"] = run.spec.accumulator
            if run.spec.secure_aggregation:
                options["secure"] = True
        self.metrics.starts.labels("warm" if self.board.workers[e.instance].ready else "cold").inc()
        scratch, fds = b"", []
        if len(e.inputs) >= 2:
            with contextlib.suppress(Overloaded):  # it asks when it folds (and is told then)
                seg = self.store.create(self.instance_tenants[e.instance], run.accumulator_bytes(task.shard), _scratch_holder(task.id),
                                        affinity=e.instance, owner=RoundOf(task.job, task.round), scratch=True)
                scratch, fds = seg.key, [os.dup(seg.fd)]
        inputs = [input_record(m.key, m.samples, m.count, m.partial, m.sent_ns) for m in e.inputs]
        self._push(e.instance, Invoke(task.id, task.job, task.version, task.role, e.fan_in, self.config.lazy, spec, options,
                                      *e.parent, inputs, scratch, task.shard), fds)

    def _push(self, instance: int, message: Message, fds: Sequence[int] = ()) -> None:
        peer = self.instances.get(instance)
        if peer is not None:  # else it is gone: its task runs again with all its inputs
            peer.push(message, fds)
        else:
            for fd in fds:
                os.close(fd)

    def _spawn(self, e: tasks.Spawn) -> None:
        """A cold start: the instance's connection exists at once (messages wait in it), its
        process starts on the pool."""
        tenant = self._tenants[e.tenant]
        sock, start = self.actuator.spawn(tenant, e.instance, INFERENCE_MODULES if e.preload else ())
        peer = Peer(self.loop, sock, {}, "function instance", lambda: None)
        self._adopt(e.instance, tenant, peer)
        self.metrics.spawned.labels(e.reason).inc()

        def started(_: None, error: BaseException | None) -> None:
            if error is not None:
                print(f"lifl agent: cannot start instance {e.instance}: {error}", file=sys.stderr)
                peer.close()

        self.loop.offload(start, started)

    def _send_key(self, tenant: Tenant, msg: KeyMessage) -> None:
        if self._outbox or not self.transport.sender(tenant).try_send(msg):
            self._outbox.append((tenant, msg))  # the instance's queue is full: tried again shortly
            if self._outbox_timer is None:
                self._outbox_timer = self.loop.later(OUTBOX_RETRY, self._flush_outbox)

    def _flush_outbox(self) -> None:
        self._outbox_timer = None
        while self._outbox:
            tenant, msg = self._outbox[0]
            # keys for an instance that died are dropped: its task runs again with all of them
            if msg.dest in self.instances and not self.transport.sender(tenant).try_send(msg):
                self._outbox_timer = self.loop.later(OUTBOX_RETRY, self._flush_outbox)
                return
            self._outbox.popleft()

    def _abandon(self, job: str, round_id: int, reason: str) -> None:
        """The node's tree for a round failed: the round starts over on the same version."""
        print(f"lifl agent: abandoning round {round_id} of {job}: {reason}", file=sys.stderr)
        r = self.trees.round_of(job)
        if r is not None and r.round == round_id:
            self._apply(self.trees.end(job, reason))

        def abandon() -> None:
            self._perform_duty(job, cluster_rounds.AbandonRound(round_id, "abandoned", reason))

        self.loop.offload(abandon, lambda _, error: self.settle(job))

    # -- rounds across the cluster ----------------------------------------------------------------
    def settle(self, job: str, live: set[str] | None = None, then: Callable[[], None] | None = None) -> None:
        """Carry out the round's cluster duties (in Redis, off the loop), then bring this node's
        tree in line with the round's shard; then ``then()``. A settle asked for while one of the
        job runs goes once more after it."""
        if job in self._settling:
            self._settle_again.add(job)
            if then is not None:
                self._settle_then.setdefault(job, []).append(then)
            return
        self._settling.add(job)
        self._settled_at[job] = time.monotonic()
        if then is not None:
            self._settle_then.setdefault(job, []).append(then)

        def settled(view: tuple[Job, Shard] | None, error: BaseException | None) -> None:
            self._settling.discard(job)
            if isinstance(error, NotFound):
                self._apply(self.trees.end(job, "the job no longer exists"))
            elif error is not None:
                print(f"lifl agent: settling {job!r} waits: {error}", file=sys.stderr)
            elif view is not None:
                j, shard = view
                self._settle_split_install(j)
                self._answer_secure(job)
                try:
                    self._apply(self.trees.sync(job, shard, own_top=bool(j.parts)))
                except ValueError as e:  # Redis and this node disagree: the round cannot finish here
                    print(f"lifl agent: {e}", file=sys.stderr)
            for callback in self._settle_then.pop(job, []):
                callback()
            if job in self._settle_again:
                self._settle_again.discard(job)
                self.settle(job)

        self.loop.offload(lambda: self._settle_io(job, live), settled)

    def _settle_io(self, job: str, live: set[str] | None) -> tuple[Job, Shard]:
        """The round's duties, performed until there are none (off the loop); the job and its
        shard as they are then."""
        for _ in range(SETTLE_PASSES):
            view = self.state.job_view(job)
            j, shard = view.job, view.shard
            todo = cluster_rounds.duties(j, shard, view.now, live if live is not None else _assume_live(shard), view.secure)
            if not todo:
                deadline = j.spec.round_deadline_s
                wait = (j.round_opened + deadline - view.now if deadline and not j.closed and j.version != NO_MODEL
                        else IDLE_SWEEP_S)
                secure = view.secure
                if secure is not None and secure.round == j.round and secure.stage not in (DONE, ABANDONED):  # its stage ends then
                    wait = min(wait, max(0.0, secure.deadline_ms / 1000 - view.now))
                self.loop.post(lambda: self._deadline_at.__setitem__(job, time.monotonic() + wait))
                return j, shard
            for duty in todo:
                self._perform_duty(job, duty, j, shard)
        view = self.state.job_view(job)
        return view.job, view.shard

    def _perform_duty(self, job: str, duty: cluster_rounds.Duty, j: Job | None = None, shard: Shard | None = None) -> None:
        """(off the loop)"""
        if isinstance(duty, cluster_rounds.CloseAtDeadline):
            self.state.close_round(job, duty.round, duty.min_updates)
        elif isinstance(duty, cluster_rounds.AdvanceSecureStage):
            settings = (j or self.state.job(job)).spec.secure
            if settings is not None:
                self.secure.close_due(job, settings)
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
        (the controller sweeps every job). Round events settle a job as soon as its round
        changes; this visits a job once its deadline may have come, and a job with a round here
        ROUND_SWEEP_S after it was last settled, for the events it may have missed (a round
        waiting out a secure stage's deadline costs next to nothing)."""
        now = time.monotonic()
        due = [j for j, r in self.jobs.items()
               if (r.spec.round_deadline_s or r.spec.secure_aggregation) and self._deadline_at.get(j, 0.0) <= now]
        self._settled_at = {j: t for j, t in self._settled_at.items() if j in self.trees.rounds}
        swept = [j for j in self.trees.rounds if now - self._settled_at.get(j, -ROUND_SWEEP_S) >= ROUND_SWEEP_S]
        jobs = list(dict.fromkeys(swept + due + list(self._split_installing)))
        if not jobs:
            return

        def settle_all(live: list[str] | None, error: BaseException | None) -> None:
            if isinstance(error, Unavailable):
                return  # Redis is away: the next turn tries again (the node's other duties say so)
            if error is not None or live is None:
                raise _unavailable(error or Internal("no nodes"))
            for job in jobs:
                self.settle(job, set(live))

        self.loop.offload(lambda: list(self.state.nodes()), settle_all)

    def _round_events(self) -> None:
        """React at once when a round changes (the duties' timer covers missed messages)."""
        self.state.follow_events(
            lambda job: self.loop.post(lambda: self.settle(job) if job in self.trees.rounds or job in self.jobs else None),
            lambda: self._stopping, "lifl agent")

    # -- installing a round's model ---------------------------------------------------------------
    def _install(self, e: tree.Install) -> None:
        """The top's result: checkpoint it, then (once durable) make it the next version."""
        self._forget_round_shared(e.job, e.round)
        self.uploads.update_done(e.input.key)  # a lone client update is itself the model
        self.store.hand_over(e.input.key, ("pending", e.job, e.round))
        self._write_checkpoint(e)

    def _forget_round_shared(self, job: str, round_id: int) -> None:
        """What a round's tasks shared, given up when it installs or ends."""
        for state in (False, True):
            self._next_models.pop((job, round_id, state), None)
        self._step_partials.pop((job, round_id), None)
        self._masked.pop((job, round_id), None)
        if (rebuilt := self._secrets.get(job)) is not None and rebuilt.round == round_id:
            del self._secrets[job]

    def _write_checkpoint(self, e: tree.Install) -> None:
        seg = self.store.get(e.input.key)
        self.checkpointer.submit(e.job, e.version + 1, os.dup(seg.fd), seg.size,
                                 lambda seconds, error: self.loop.post(lambda: self._checkpointed(e, seconds, error)),
                                 self.jobs[e.job].part)

    def _checkpointed(self, e: tree.Install, seconds: float, error: Exception | None) -> None:
        """The checkpoint of a round's model is written (or failed): make it the next version. A
        version clients can see always has a durable checkpoint, so a failed write is tried again."""
        job, version = e.job, e.version + 1
        if error is not None:
            failed = self.checkpoints.write_failed(e, time.monotonic())
            self.metrics.checkpoint_failures.labels(job).inc()
            delay = failed.next_try - time.monotonic()
            print(f"lifl agent: checkpoint of {job} version {version} failed ({failed.attempts} times), "
                  f"trying again in {delay:.3g} s: {error}", file=sys.stderr)
            self._io(lambda: self.state.set_checkpoint_error(job, version, public_reason(error)), "recording a failure")
            return
        step = self.steps.get((job, version))
        report = step.report if step is not None else {}

        def next_round() -> tuple[float | None, dict[str, Any]]:
            view = self.state.job_view(job)
            j, shard = view.job, view.shard
            aggregated = view.now - seconds  # the checkpoint is written between aggregation and installation
            summary = self._summary(j, shard, version, "complete" if e.input.updates >= j.spec.goal else "partial",
                                    updates=e.input.updates, samples=e.input.samples, checkpoint_s=round(seconds, 6),
                                    seconds=round(aggregated - shard.first_update, 6) if shard.first_update else None)
            if j.spec.strategy:
                strategy = j.spec.strategy_spec
                summary["strategy"] = {"name": strategy.name, **report}
                if strategy.spends_privacy:  # the budget spent once this version is out
                    summary["strategy"].update(privacy(strategy, version))
            if j.split is not None:  # this node's part is durable; the node whose part completes them installs
                installed = self.state.part_installed(job, e.round, self.node)
                if installed < len(j.split[1]):
                    return (-1.0 if installed < 0 else None), summary
                return self.state.next_round(job, e.round, version, summary=summary), summary
            return self.state.next_round(job, e.round, version, key=e.input.key.hex(), node=self.node, summary=summary), summary

        def opened(result: tuple[float | None, dict[str, Any]] | None, error: BaseException | None) -> None:
            if error is not None or result is None:  # Redis away: written again (it is durable: cheap) later
                print(f"lifl agent: installing {job} version {version} waits: {error}", file=sys.stderr)
                failed = self.checkpoints.write_failed(e, time.monotonic())
                failed.next_try = time.monotonic() + installs.CHECKPOINT_RETRY[0]
                return
            opened_at, summary = result
            self.checkpoints.written(job)
            self.metrics.checkpoint_seconds.observe(seconds)
            if opened_at is None:  # the other nodes' parts of the version are not all durable yet
                self._split_installing[job] = (e, summary)
                self.settle(job)  # the version may have moved meanwhile
                return
            self._installed(e, summary, installed=opened_at >= 0)
            if opened_at >= 0:
                self.loop.offload(lambda: self.state.set_checkpoint(job, version), lambda _, err: self.settle(job))

        self.loop.offload(next_round, opened)

    def _installed(self, e: tree.Install, summary: dict[str, Any], *, installed: bool) -> None:
        """The round's model is the job's next version (``installed``), or the round moved on
        without it (it was abandoned): keep it as the node's model, or drop it."""
        job, version = e.job, e.version + 1
        run = self.jobs[job]
        self._install_step(run, version, installed=installed)
        pending = ("pending", job, e.round)
        if not installed:
            self.store.release(e.input.key, pending)
            return
        self.store.move_ref(e.input.key, pending, ("model", job))
        self.store.pin(e.input.key)  # from the round's working memory to the node's models
        if run.model_key is not None:
            self.store.release(run.model_key, ("model", job))
        self._hold_model(run, e.input.key, version)
        if self.retainer.policy(job).active:
            self.retainer.keep_model(job, run.tenant, e.input.key, version)
        self._count_round(job, summary)
        self.metrics.version.labels(job).set(version)

    def _settle_split_install(self, j: Job) -> None:
        """A split job's part of a round's next version waits here until the version moves (every
        node's part durable: it is the node's model now) or the round does without it (lost)."""
        waiting = self._split_installing.get(j.spec.job)
        if waiting is None:
            return
        e, summary = waiting
        if j.version > e.version:
            del self._split_installing[j.spec.job]
            self._installed(e, summary, installed=True)
        elif j.round > e.round:
            del self._split_installing[j.spec.job]
            self._installed(e, summary, installed=False)

    def retry_checkpoints(self) -> None:
        """Write again the checkpoints whose back-off is over (the round's model waits meanwhile);
        a round that moved on without its model (abandoned past its deadline) lets it go."""
        for failed in self.checkpoints.due(time.monotonic()):
            e = failed.install

            def checked(round_id: int | None, error: BaseException | None, failed: installs.FailedCheckpoint = failed,
                        e: tree.Install = e) -> None:
                if error is not None or round_id is None:
                    failed.next_try = time.monotonic() + installs.CHECKPOINT_RETRY[0]
                    return
                if round_id != e.round:
                    if self.checkpoints.give_up(failed):
                        self.store.release(e.input.key, ("pending", e.job, e.round))
                    return
                self._write_checkpoint(e)

            self.loop.offload(lambda e=e: self.state.job(e.job).round, checked)

    def _summary(self, j: Job, shard: Shard, new_version: int | None, outcome: str, **extra: Any) -> dict[str, Any]:
        """(Off the loop: a secure round's record is read from Redis.)"""
        secure = {"secure": self.secure.record(j.spec.job)} if j.spec.secure_aggregation else {}
        return {"round": j.round, "version": j.version, "new_version": new_version, "outcome": outcome,
                "updates": 0, "samples": 0, "seconds": None, "opened": j.round_opened, "closed": round(time.time(), 3),
                "nodes": shard.counts, "top": shard.top, "lost": shard.lost, **secure, **extra}

    def _count_round(self, job: str, summary: dict[str, Any]) -> None:
        self.metrics.rounds.labels(job, summary["outcome"]).inc()
        if summary["outcome"] in ("complete", "partial") and summary["seconds"] is not None:
            self.metrics.round_seconds.labels(job).observe(summary["seconds"])
            self.metrics.round_updates.labels(job).observe(summary["updates"])

    # -- partial results to other nodes -----------------------------------------------------------
    def _send_partial(self, out: installs.OutgoingPartial) -> None:
        """Ask the gateway to stream the partial to the top's node."""
        try:
            seg = self.store.get(out.input.key)
        except NotFound:
            return  # the round ended meanwhile
        self.forwards.sending(out)
        if self.forwarder is None or self.forwarder.stream.closed:
            self._forward_failed(out, "no gateway is connected to forward through", retry=True)
            return
        self.forwarder.push(ForwardPartial(out.ref, out.job, out.round, out.epoch, out.node, out.input.samples,
                                           out.input.updates, out.input.partial, seg.size), [os.dup(seg.fd)])

    def forwarded(self, m: Forwarded) -> None:
        out = self.forwards.answered(m.ref, m.delivered, time.monotonic())
        if out is None:
            return
        if m.delivered:
            self.metrics.forwarded.labels("delivered").inc()
            with contextlib.suppress(NotFound):
                self.metrics.forwarded_bytes.inc(self.store.get(out.input.key).size)
            return
        self._forward_failed(out, m.problem, m.retry)

    def _forward_failed(self, out: installs.OutgoingPartial, error: str, retry: bool) -> None:
        self.forwards.failed(out, time.monotonic())
        self.metrics.forwarded.labels("failed").inc()
        print(f"lifl agent: forwarding round {out.round} of {out.job!r} to {out.node} failed: {error}", file=sys.stderr)
        if not retry:  # the receiver says the round moved on there: learn where it is now
            self.settle(out.job)

    def retry_forwards(self) -> None:
        """Send again what did not arrive, while it is still where the round's result should go."""
        wanted = {(job, r.round): r.sent for job, r in self.trees.rounds.items() if r.top is None}
        for out in self.forwards.due(time.monotonic(), wanted):
            self._send_partial(out)

    # -- periodic duties --------------------------------------------------------------------------
    def expire_idle_instances(self) -> None:
        """Scale to zero: warm instances idle past ``keep_warm`` are let go (beyond what the planner
        wants kept warm). Pods are the cluster's to scale down: the operator follows the plan."""
        keep = self.controller.warm_for(self.node) if self.config.control.prewarm else {}
        self._perform(self.board.expire(time.monotonic(), self.config.keep_warm, keep))

    def warm_instances(self) -> None:
        """Keep the instances the planner asked for ready ahead of the load (§5.2); pods are
        prewarmed by the operator, which scales them to the plan."""
        if not self.config.control.prewarm or not self.actuator.starts_instances:
            return

        def read() -> dict[str, int]:
            wanted = self.controller.read_warm(self.node)
            for tenant in wanted:
                self._tenant_io(tenant)
            return wanted

        def warm(wanted: dict[str, int] | None, error: BaseException | None) -> None:
            if error is None and wanted:
                self._perform(self.board.warm(wanted, *self._board_context()))

        self.loop.offload(read, warm)

    def refresh_quotas(self) -> None:
        """Hand the ledger the tenants' quotas as the operator last set them (one Redis call)."""

        def got(quotas: dict[str, Quota] | None, error: BaseException | None) -> None:
            if error is None and quotas is not None:  # Redis is away: the quotas last read hold
                self.store.ledger.set_quotas(quotas)

        self.loop.offload(self.state.quotas, got)

    def control(self) -> None:
        """The control plane's periodic re-plan, on the node that holds the controller lease."""

        sweep = self._sweep_due("control")

        def tick() -> list[str]:
            """The jobs to settle: those with a round under way, and every job once a sweep."""
            jobs = self.state.job_names() if sweep else self.state.active_job_names()
            return jobs if self.controller.tick(None if sweep else jobs) else []

        def replanned(jobs: list[str] | None, error: BaseException | None) -> None:
            if error is not None:
                print(f"lifl agent: control waits: {error}", file=sys.stderr)
                return
            if jobs:
                self.loop.offload(lambda: set(self.state.nodes()),
                                  lambda live, err: [self.settle(job, live) for job in jobs] if err is None else None)

        self.loop.offload(tick, replanned)

    def apply_retention(self) -> None:
        """Level what is retained for the active jobs; every job's (a narrowed policy) once a sweep."""
        jobs = self._active_jobs() | (set(self.jobs) | self.retainer.jobs() if self._sweep_due("apply_retention") else set())

        def apply() -> None:
            for job in jobs:
                self.retainer.apply(job)

        self.loop.offload(apply, lambda _, error: None if error is None else print(
            f"lifl agent: retention waits: {error}", file=sys.stderr), SLOW_POOL)

    def _sweep_due(self, duty: str) -> bool:
        """Whether ``duty`` should visit every job this turn (and then not for IDLE_SWEEP_S)."""
        now = time.monotonic()
        if now - self._swept.get(duty, -IDLE_SWEEP_S) < IDLE_SWEEP_S:
            return False
        self._swept[duty] = now
        return True

    def _active_jobs(self) -> set[str]:
        """The jobs with something going on here: a round, queued uploads, retained objects in
        memory, a replica, or a gateway's request in the last RECENT_S."""
        now = time.monotonic()
        for name in [n for n, at in self._touched.items() if now - at > RECENT_S]:
            del self._touched[name]
        return (set(self.trees.rounds) | {n for n, c in self.uploads.counts.items() if c}
                | {item.job for item in self.retainer.items.values()}
                | {n for n in self._resident if self.jobs[n].replica is not None} | set(self._touched))

    def publish_status(self) -> None:
        status = self.status()
        self.loop.offload(lambda: self.state.publish_node(self.node, status),
                          lambda _, error: None if error is None else print(
                              f"lifl agent: cannot publish the node's status: {error}", file=sys.stderr))

    def trim_pool(self) -> None:
        self.store.trim_pool(idle_seconds=max(self.config.keep_warm, 30.0))

    def drop_stale_replicas(self) -> None:
        """A replica of an older version serves nobody: let it go (replicas are in memory: idle
        ones are dropped by ``spill_idle_models``, so this visits only those in use lately)."""
        held = {name: run.replica[1] for name in self._resident if (run := self.jobs[name]).replica is not None}
        if not held:
            return

        def drop(versions: dict[str, int] | None, error: BaseException | None) -> None:
            for name, version in (versions or {}).items():
                run = self.jobs[name]
                if version != held[name] and run.replica is not None and run.replica[1] == held[name]:
                    self.store.release(run.replica[0], ("replica", name))
                    run.replica = None
                    if run.model_key is None:
                        del self._resident[name]

        self.loop.offload(lambda: {name: self.state.version(name) for name in held}, drop)

    # -- status and metrics -------------------------------------------------------------------------
    def _refresh_instance_gauges(self) -> None:
        for role, n in self.board.counts().items():
            self.metrics.instances.labels(role).set(n)

    def status(self) -> NodeStatus:
        """What the node reports of itself (on the loop)."""
        at_work: dict[tuple[str, str], int] = {}  # instances at work, by job and the role of their current task
        for w in self.board.workers.values():
            task = self.board.running.get(w.task) if w.task is not None else None
            if task is not None:
                at_work[task.job, task.role] = at_work.get((task.job, task.role), 0) + 1
        # only jobs with something going on here: an idle job's activity is all zeros (readers take a
        # missing job as such), and the status is published every second whatever the number of jobs
        ledger = self.store.ledger
        busy = (set(self.trees.rounds) | {n for n, c in self.uploads.counts.items() if c} | {job for job, _ in at_work}
                | {job for t in ledger.tenants.values() for job in t.in_rounds})
        jobs: dict[str, JobActivity] = {}
        for name in sorted(busy & self.jobs.keys()):
            run = self.jobs[name]
            r = self.trees.round_of(name)
            memory = ledger.usage(name)
            jobs[name] = JobActivity(run.tenant.name, run.leaf_fan_in, r.round if r else None,
                                     self.uploads.counts.get(name, 0), *(at_work.get((name, role), 0) for role in ROLES),
                                     memory.working, memory.reserved)
        workers = self.board.workers.values()
        store = self.store
        return NodeStatus(
            self.node, time.time(), self.started_at,
            InstanceCounts(len(self.board.workers), sum(w.task is None for w in workers), sum(w.ready for w in workers),
                           _count_by(w.tenant for w in workers)),
            jobs, self.metrics.planner_counters(), self.retainer.status(),
            SharedMemory(store.used_bytes, store.pooled_bytes, store.capacity, store.ledger.pinned, store.ledger.reserved,
                         store.object_count(), store.created, store.recycled),
        )

    def metrics_text(self) -> str:
        for name in self.jobs:
            self.metrics.queue.labels(name).set(self.uploads.counts.get(name, 0))
        self.metrics.publish_memory(self.store.ledger, self.store.pooled_bytes, self.jobs)
        self._refresh_instance_gauges()
        return self.metrics.exposition()


def _outside_rounds(run: JobRun) -> list[tuple[bytes, Hashable]]:
    """(object, holder) of what the job keeps in memory here between rounds: its model, its
    replica and its strategy's state (each with a durable copy to come back from)."""
    job = run.spec.job
    held = [(run.model_key, ("model", job)), (run.replica[0] if run.replica else None, ("replica", job))]
    if run.strategy_state is not None:
        held.append((run.strategy_state[0], ("strategy", job, run.strategy_state[1])))
    return [(key, holder) for key, holder in held if key is not None]


def _assume_live(shard: Shard) -> set[str]:
    """Without a fresh list of live nodes, assume every node involved is alive."""
    return set(shard.counts) | set(shard.inflight) | ({shard.top} if shard.top else set())


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
    p.add_argument("--model-idle", type=float, default=spill.DEFAULT_MODEL_IDLE_S, metavar="SECONDS",
                   help="a job's model unused this long (no update, round, read or query) leaves shared memory and "
                        f"comes back from its checkpoint when next used (default {spill.DEFAULT_MODEL_IDLE_S:g})")
    ControlConfig.add_arguments(p)


def agent_options(args: argparse.Namespace) -> dict[str, Any]:
    return {"max_instances": args.max_instances, "keep_warm": args.keep_warm, "reuse": not args.no_reuse,
            "lazy": args.lazy, "control": ControlConfig.from_arguments(args), "channel": args.channel,
            "functions": args.functions, "retain_budget": args.retain_budget, "model_idle_s": args.model_idle}


def agent_argv(options: dict[str, Any]) -> list[str]:
    """The command-line spelling of ``agent_options`` (for starting the agent as a process)."""
    argv = ["--max-instances", str(options["max_instances"]), "--keep-warm", str(options["keep_warm"])]
    argv += ["--no-reuse"] * (not options["reuse"]) + ["--lazy"] * options["lazy"] + ["--channel", options["channel"]]
    argv += ["--functions", options["functions"], "--retain-budget", str(options["retain_budget"])]
    argv += ["--model-idle", str(options["model_idle_s"])]
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
