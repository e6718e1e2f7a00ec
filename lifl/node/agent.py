"""The node agent: owns the node's shared memory, runs its aggregator instances and routes keys.

- The gateway asks it for objects to receive updates into (``admit``), which also reserves
  a slot of the job's round in Redis (converting the client's lease if it holds one) and
  enforces the job's in-flight budget, then hands the sealed update over (``submit``).
- For each round the agent plans the node's hierarchy (``lifl.planner``): one middle, a top
  that reuses the middle's instance once the middle is done (§5.3), and leaves created as
  updates arrive. Tasks go to idle warm instances of the tenant, or to new ones (a cold
  start is a process spawn); instances idle longer than ``keep_warm`` are stopped.
- Keys move between aggregators over the key channel; the agent provisions every
  instance's endpoint before starting it, so keys can wait for a cold-starting instance.
- When the top has aggregated a round, its model is checkpointed in the background and
  installed as the next version once durable. A round still short of its goal at its
  deadline closes with what arrived, or is abandoned if that is under the job's minimum.
- Every object reference belongs to a holder (an upload, a task, a job's model, a
  gateway's read). A holder that disappears is released; if an aggregator dies mid-round,
  the node's work on that round is dropped and the next round opens on the same version.
- On start it restores every job whose model lived on this node from its latest checkpoint.
"""

from __future__ import annotations

import argparse
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from lifl import checkpoints
from lifl import format as fmt
from lifl.channel import KIND_CLOSE, KeyMessage, UnixKeyChannel, now_ns
from lifl.errors import BadRequest, Conflict, Internal, LiflError, NotFound, Overloaded, PayloadTooLarge
from lifl.jobs import JobSpec
from lifl.control.planner import LEAF, MIDDLE, ROLES, TOP, InstanceView, RoundPlan, expired, pick_warm
from lifl.procs import die_with_parent
from lifl.rpc import Connection, error_reply
from lifl.state import NO_MODEL, RESERVE_OK, ClusterState, refusal
from lifl.store import SHM_DIR, ObjectStore, Tenant, remove_node_objects

DEFAULT_HANDLER = "lifl.functions.aggregator.handler:handle"


def check_traversable(directory: Path) -> None:
    """Tenant functions run as other users: they must be able to reach the channel sockets."""
    for d in [directory.resolve(), *directory.resolve().parents]:
        if not os.stat(d).st_mode & 0o001:
            raise SystemExit(
                f"lifl agent: {d} is not searchable by other users, so tenant functions cannot reach "
                f"{directory}; choose a --run-dir whose parents are world-searchable (e.g. /run/lifl)"
            )


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

    @property
    def socket_path(self) -> Path:
        return self.run_dir / "agent.sock"

    @property
    def chan_dir(self) -> Path:
        return self.run_dir / "chan"


@dataclass(eq=False)
class Task:
    id: int
    job: str
    version: int  # the global version whose updates it aggregates
    round: int
    role: str
    fan_in: int
    parent: Task | None
    instance: Instance | None = None
    running: bool = False
    routed: int = 0  # inputs sent to it so far (leaves)
    pending: list[KeyMessage] = field(default_factory=list)  # keys waiting for an instance

    @property
    def holder(self) -> tuple[str, int]:
        return ("task", self.id)


@dataclass(eq=False)
class Instance:
    id: int
    tenant: Tenant
    proc: subprocess.Popen
    conn: Connection
    task: Task | None = None
    next_task: Task | None = None  # planned: the top after this middle (reuse)
    last_used: float = field(default_factory=time.monotonic)
    specs_sent: set[str] = field(default_factory=set)

    @property
    def idle(self) -> bool:
        return self.task is None and self.next_task is None


@dataclass(eq=False)
class Round:
    """This node's hierarchy for one round of a job."""

    id: int
    version: int
    plan: RoundPlan
    middle: Task
    top: Task
    leaves: list[Task] = field(default_factory=list)
    submitted: int = 0
    samples: int = 0
    aggregated: int = 0
    first_update: float = field(default_factory=time.time)

    @property
    def tasks(self) -> list[Task]:
        return [*self.leaves, self.middle, self.top]


@dataclass(eq=False)
class JobRun:
    """What this node knows of a job; Redis holds the truth."""

    spec: JobSpec
    tenant: Tenant
    model_spec: fmt.ModelSpec | None
    version: int
    round_id: int
    round_opened: float
    model_key: bytes | None = None
    inflight: int = 0  # admitted or submitted updates not yet folded
    round: Round | None = None
    closing: bool = False  # the deadline closed the round; it finishes with what arrived
    installing: bool = False  # the round is aggregated; its checkpoint is being written
    model_upload: bool = False


@dataclass(eq=False)
class Upload:
    job: str
    version: int  # NO_MODEL for an initial-model upload
    round: int
    holder: tuple[str, int]


class Metrics:
    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()
        self.steps = Histogram(
            "lifl_aggregator_step_seconds", "Time per aggregator step (recv waits for keys, agg folds, send hands off)",
            ["role", "step"], registry=r, buckets=(1e-4, 1e-3, 5e-3, 0.01, 0.05, 0.1, 0.5, 1, 5, 30, 120),
        )
        self.handoff = Histogram(
            "lifl_key_handoff_seconds", "Key delivery until the receiver holds a readable view",
            registry=r, buckets=(25e-6, 50e-6, 100e-6, 250e-6, 500e-6, 1e-3, 5e-3, 0.05, 1),
        )
        self.queue = Gauge("lifl_queue_length", "Updates received but not yet aggregated", ["job"], registry=r)
        self.instances = Gauge("lifl_aggregator_instances", "Aggregator instances by role (idle: warm, unassigned)", ["role"], registry=r)
        self.starts = Counter("lifl_aggregator_starts", "Task starts by instance temperature", ["kind"], registry=r)
        self.rounds = Counter("lifl_rounds", "Rounds finished, by outcome (complete, partial, abandoned, interrupted)",
                              ["job", "outcome"], registry=r)
        self.round_seconds = Histogram(
            "lifl_round_aggregation_seconds", "Aggregation completion time: a round's first update to its aggregated model",
            ["job"], registry=r, buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300),
        )
        self.round_updates = Histogram("lifl_round_updates", "Client updates aggregated per round", ["job"], registry=r,
                                       buckets=(1, 2, 5, 10, 20, 50, 100, 200, 500, 1000))
        self.version = Gauge("lifl_job_version", "Current global model version", ["job"], registry=r)
        self.checkpoint_seconds = Histogram("lifl_checkpoint_seconds", "Time to write a checkpoint durably", registry=r,
                                            buckets=(1e-3, 0.01, 0.05, 0.1, 0.5, 1, 5, 30))
        self.shm = Gauge("lifl_shm_bytes", "Shared memory held by objects (used) and by the recycling pool", ["state"], registry=r)


class Checkpointer:
    """Writes checkpoints one at a time on a thread of its own, off every aggregation path."""

    def __init__(self, store: checkpoints.CheckpointStore) -> None:
        self.store = store
        self._queue: queue.Queue[tuple[str, int, int, int, Callable[[float, Exception | None], None]] | None] = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="checkpointer", daemon=True)
        self._thread.start()

    def submit(self, job: str, version: int, fd: int, size: int, done: Callable[[float, Exception | None], None]) -> None:
        """Write ``size`` bytes of ``fd`` (closed afterwards) as ``version``; then ``done(seconds, error)``."""
        self._queue.put((job, version, fd, size, done))

    def write(self, job: str, version: int, fd: int, size: int) -> float:
        t0 = time.perf_counter()
        try:
            self.store.save(job, version, fd, size)
        finally:
            os.close(fd)
        checkpoints.prune(self.store, job)
        return time.perf_counter() - t0

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            job, version, fd, size, done = item
            try:
                seconds, error = self.write(job, version, fd, size), None
            except Exception as e:  # the install still happens; the error is reported
                seconds, error = 0.0, e
            done(seconds, error)

    def stop(self) -> None:
        self._queue.put(None)
        self._thread.join(timeout=30)


class Agent:
    def __init__(self, config: AgentConfig, state: ClusterState) -> None:
        self.config = config
        self.state = state
        self.lock = threading.RLock()
        self.store = ObjectStore(config.node, config.shm_capacity, config.pool_limit)
        self.metrics = Metrics()
        data_dir = config.data_dir or config.run_dir
        self.checkpointer = Checkpointer(checkpoints.open_store(config.checkpoints, data_dir=data_dir, redis_url=config.redis_url))
        self.jobs: dict[str, JobRun] = {}
        self.instances: dict[int, Instance] = {}
        self.tasks: dict[int, Task] = {}
        self.uploads: dict[bytes, Upload] = {}
        self.waiting: deque[Task] = deque()
        self.outbox: deque[tuple[Tenant, KeyMessage]] = deque()
        self.recent: deque[dict[str, Any]] = deque(maxlen=512)  # finished tasks' statistics
        self._senders: dict[str, UnixKeyChannel] = {}
        self._tenants: dict[str, Tenant] = {}
        self._next_id = 0
        self._stopping = threading.Event()
        self._listener: socket.socket | None = None

    # -- lifecycle ------------------------------------------------------------------------------
    def start(self) -> None:
        """Clean up what a killed predecessor left, restore jobs from checkpoints, then listen."""
        stale = remove_node_objects(self.config.node)
        if stale:
            print(f"lifl agent: removed {stale} shared-memory objects left by a previous run", file=sys.stderr)
        self.config.run_dir.mkdir(parents=True, exist_ok=True)
        if self.config.isolate:
            check_traversable(self.config.run_dir)
        self.config.chan_dir.mkdir(exist_ok=True)
        os.chmod(self.config.run_dir, 0o755)
        os.chmod(self.config.chan_dir, 0o755)
        with self.lock:
            self._restore_jobs()
        path = self.config.socket_path
        path.unlink(missing_ok=True)
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind(str(path))
        os.chmod(path, 0o600)
        listener.listen(64)
        self._listener = listener
        threading.Thread(target=self._accept_loop, name="agent-accept", daemon=True).start()
        threading.Thread(target=self._monitor_loop, name="agent-monitor", daemon=True).start()

    def stop(self) -> None:
        """Clean shutdown: unlink every object first (mappings stay valid for whoever holds them,
        and a checkpoint being written has its own descriptor), then stop the instances."""
        self._stopping.set()
        if self._listener:
            self._listener.close()
        with self.lock:
            self.store.close()
            remove_node_objects(self.config.node)
            instances = list(self.instances.values())
            for inst in instances:
                inst.conn.close()
        deadline = time.monotonic() + 3
        for inst in instances:
            try:
                inst.proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                inst.proc.kill()
                inst.proc.wait()
        self.checkpointer.stop()
        self.config.socket_path.unlink(missing_ok=True)

    def _restore_jobs(self) -> None:
        """Bring back the model of every job that lived on this node, from its latest checkpoint.

        The version clients saw is never newer than the latest checkpoint (versions are made
        visible once durable), so resuming from it loses no version and repeats none."""
        for name in self.state.job_names():
            j = self.state.job(name)
            if j.version == NO_MODEL or j.model_node != self.config.node:
                continue
            latest = checkpoints.latest(self.checkpointer.store, name)
            if latest is None or latest < j.version:
                print(f"lifl agent: job {name!r} is at version {j.version} but its newest checkpoint is {latest}; "
                      f"it cannot resume on this node", file=sys.stderr)
                continue
            blob = self.checkpointer.store.load(name, latest)
            layout = fmt.validate(blob, j.model_spec)
            tenant = self.tenant(j.spec.tenant)
            seg = self.store.create(tenant, layout.total_size, ("model", name), affinity="gateway")
            os.pwrite(seg.fd, blob, 0)
            self.store.seal(seg.key)
            summary = self._summary(j.round, j.version, None, "interrupted", reason=f"node {self.config.node} restarted")
            opened = self.state.next_round(name, j.round, latest, key=seg.key.hex(), node=self.config.node, summary=summary)
            self.state.set_checkpoint(name, latest)
            self.jobs[name] = JobRun(j.spec, tenant, j.model_spec, latest, j.round + 1, opened, model_key=seg.key)
            self.metrics.rounds.labels(name, "interrupted").inc()
            self.metrics.version.labels(name).set(latest)
            print(f"lifl agent: job {name!r} resumed at version {latest} from its checkpoint", file=sys.stderr)

    def _accept_loop(self) -> None:
        assert self._listener is not None
        while not self._stopping.is_set():
            try:
                sock, _ = self._listener.accept()
            except OSError:
                return
            conn_id = self._new_id()
            threading.Thread(target=self._serve_gateway, args=(Connection(sock), conn_id), daemon=True).start()

    def _new_id(self) -> int:
        with self.lock:
            self._next_id += 1
            return self._next_id

    # -- request dispatch -----------------------------------------------------------------------
    def _serve(self, conn: Connection, handlers: dict[str, Any], on_close: Any, unlocked: frozenset[str] = frozenset()) -> None:
        try:
            while True:
                message, fds = conn.recv()
                request_id, op = message.pop("id", None), message.pop("op", "")
                handler = handlers.get(op)
                reply_fds: list[int] = []
                try:
                    if handler is None:
                        raise BadRequest(f"unknown operation {op!r}")
                    if op in unlocked:  # it takes the lock itself, around its critical parts
                        result, reply_fds = handler(message, fds)
                    else:
                        with self.lock:
                            result, reply_fds = handler(message, fds)
                    reply = {"id": request_id, "ok": True, **result}
                except LiflError as e:
                    reply = error_reply(request_id, e)
                except Exception as e:  # report, keep serving: one bad request must not kill the node
                    traceback.print_exc()
                    reply = error_reply(request_id, Internal(f"{type(e).__name__}: {e}"))
                try:
                    conn.send(reply, reply_fds)
                finally:
                    for fd in reply_fds:
                        os.close(fd)
        except (EOFError, ConnectionError, OSError):
            pass
        finally:
            with self.lock:
                on_close()

    def _serve_gateway(self, conn: Connection, conn_id: int) -> None:
        holder = ("conn", conn_id)
        handlers = {
            "hello": lambda m, f: ({"node": self.config.node}, []),
            "admit": lambda m, f: self.admit(holder, m["job"], int(m["version"]), int(m["size"]), m.get("lease", "")),
            "admit_model": lambda m, f: self.admit_model(holder, m["job"], int(m["size"])),
            "abort": lambda m, f: self.abort(holder, bytes.fromhex(m["key"]), m.get("reason", "aborted")),
            "submit": lambda m, f: self.submit(holder, bytes.fromhex(m["key"]), int(m["samples"])),
            "install_model": lambda m, f: self.install_model(holder, bytes.fromhex(m["key"])),
            "open_model": lambda m, f: self.open_model(holder, m["job"]),
            "release": lambda m, f: self.release(holder, bytes.fromhex(m["key"])),
            "metrics": lambda m, f: ({"text": self.metrics_text()}, []),
            "status": lambda m, f: (self.status(), []),
            "recent": lambda m, f: ({"tasks": list(self.recent)}, []),
        }
        self._serve(conn, handlers, lambda: self._gateway_gone(holder), unlocked=frozenset({"install_model"}))

    # -- jobs -----------------------------------------------------------------------------------
    def tenant(self, name: str) -> Tenant:
        t = self._tenants.get(name)
        if t is None:
            if self.config.isolate:
                uid = self.state.tenant_id(name)
                t = Tenant(name, uid, uid)
            else:
                t = Tenant(name)
            directory = self.config.chan_dir / name
            directory.mkdir(exist_ok=True)
            os.chmod(directory, 0o750)
            if t.gid is not None:
                os.chown(directory, -1, t.gid)
            self._tenants[name] = t
            self._senders[name] = UnixKeyChannel.sender(directory)
        return t

    def job(self, name: str) -> JobRun:
        run = self.jobs.get(name)
        if run is None:
            j = self.state.job(name)
            run = JobRun(j.spec, self.tenant(j.spec.tenant), j.model_spec, j.version, j.round, j.round_opened)
            self.jobs[name] = run
        return run

    def admit(self, holder: tuple[str, int], job: str, version: int, size: int, lease: str) -> tuple[dict[str, Any], list[int]]:
        run = self.job(job)
        status, current, round_id = self.state.reserve(job, version, lease)
        if status != RESERVE_OK:
            raise refusal(status, job, current, round_id, run.spec.goal)
        try:
            if run.inflight >= run.spec.inflight_budget:
                raise Overloaded(f"job {job!r} has {run.inflight} updates in flight, its budget", code="inflight_budget")
            seg = self.store.create(run.tenant, size, holder, affinity="gateway")
        except LiflError:
            self.state.count(job, round_id, "reserved", -1)
            raise
        run.inflight += 1
        self.uploads[seg.key] = Upload(job, version, round_id, holder)
        self._publish_gauges(run, job)
        return {"key": seg.key.hex(), "version": version, "round": round_id}, [os.dup(seg.fd)]

    def admit_model(self, holder: tuple[str, int], job: str, size: int) -> tuple[dict[str, Any], list[int]]:
        run = self.job(job)
        if self.state.version(job) != NO_MODEL:
            raise Conflict(f"job {job!r} already has a model", code="model_exists")
        if run.model_upload:
            raise Conflict(f"the model of job {job!r} is being uploaded already", code="model_upload_in_progress")
        if size > run.spec.max_update_bytes:
            raise PayloadTooLarge(f"model of {size} bytes exceeds the job's limit of {run.spec.max_update_bytes} bytes")
        seg = self.store.create(run.tenant, size, holder, affinity="gateway")
        run.model_upload = True
        self.uploads[seg.key] = Upload(job, NO_MODEL, -1, holder)
        return {"key": seg.key.hex()}, [os.dup(seg.fd)]

    def abort(self, holder: tuple[str, int], key: bytes, reason: str) -> tuple[dict[str, Any], list[int]]:
        upload = self._upload(holder, key)
        self._drop_upload(key, upload, reason)
        return {}, []

    def _upload(self, holder: tuple[str, int], key: bytes) -> Upload:
        upload = self.uploads.get(key)
        if upload is None or upload.holder != holder:
            raise NotFound(f"no upload {key.hex()} on this connection", code="no_such_upload")
        return upload

    def _drop_upload(self, key: bytes, upload: Upload, reason: str) -> None:
        del self.uploads[key]
        self.store.release(key, upload.holder)
        run = self.jobs[upload.job]
        if upload.version == NO_MODEL:
            run.model_upload = False
            return
        run.inflight -= 1
        self.state.count(upload.job, upload.round, "reserved", -1)
        self.state.count(upload.job, upload.round, f"rejected.{reason}")
        self._publish_gauges(run, upload.job)

    def install_model(self, holder: tuple[str, int], key: bytes) -> tuple[dict[str, Any], list[int]]:
        """Make an uploaded blob version 0, once its checkpoint is durable (runs without the lock
        while the checkpoint is written)."""
        with self.lock:
            upload = self._upload(holder, key)
            if upload.version != NO_MODEL:
                raise BadRequest("this upload is an update, not a model")
            run = self.jobs[upload.job]
            seg = self.store.seal(key)
            spec = self._read_layout(seg.fd).spec()
            del self.uploads[key]
            self.store.move_ref(key, holder, ("pending", upload.job))
            fd, size = os.dup(seg.fd), seg.size
        try:
            seconds = self.checkpointer.write(upload.job, 0, fd, size)
        except OSError as e:
            with self.lock:
                run.model_upload = False
                self.store.release(key, ("pending", upload.job))
            raise Internal(f"cannot checkpoint the model of {upload.job!r}: {e}") from None
        with self.lock:
            run.model_upload = False
            opened = self.state.next_round(upload.job, -1, 0, key=key.hex(), node=self.config.node, spec=spec)
            if opened < 0:
                self.store.release(key, ("pending", upload.job))
                raise Conflict(f"job {upload.job!r} already has a model", code="model_exists")
            self.state.set_checkpoint(upload.job, 0)
            self.store.move_ref(key, ("pending", upload.job), ("model", upload.job))
            run.model_key, run.model_spec, run.version, run.round_id, run.round_opened = key, spec, 0, 0, opened
            self.metrics.checkpoint_seconds.observe(seconds)
            self.metrics.version.labels(upload.job).set(0)
        return {"version": 0}, []

    @staticmethod
    def _read_layout(fd: int) -> fmt.Layout:
        prefix = os.pread(fd, fmt.PREFIX_BYTES, 0)
        n = fmt.header_length(prefix)
        return fmt.parse_header(os.pread(fd, n, fmt.PREFIX_BYTES))

    def open_model(self, holder: tuple[str, int], job: str) -> tuple[dict[str, Any], list[int]]:
        run = self.job(job)
        if run.model_key is None:
            version = self.state.version(job)
            if version == NO_MODEL:
                raise Conflict(f"job {job!r} has no model yet", code="no_model")
            raise NotFound(f"the model of job {job!r} is not on node {self.config.node}", code="model_elsewhere")
        seg = self.store.add_ref(run.model_key, holder)
        fd = os.open(SHM_DIR / seg.name[1:], os.O_RDONLY)
        return {"key": run.model_key.hex(), "version": run.version, "size": seg.size}, [fd]

    def release(self, holder: tuple[str, int], key: bytes) -> tuple[dict[str, Any], list[int]]:
        self.store.release(key, holder)
        return {}, []

    def _gateway_gone(self, holder: tuple[str, int]) -> None:
        for key, upload in list(self.uploads.items()):
            if upload.holder == holder:
                self._drop_upload(key, upload, "connection_lost")
        self.store.release_holder(holder)

    # -- rounds ---------------------------------------------------------------------------------
    def submit(self, holder: tuple[str, int], key: bytes, samples: int) -> tuple[dict[str, Any], list[int]]:
        upload = self._upload(holder, key)
        if upload.version == NO_MODEL:
            raise BadRequest("this upload is a model, not an update")
        if samples < 1:
            raise BadRequest(f"samples must be positive, got {samples}")
        run = self.jobs[upload.job]
        if upload.round != run.round_id or run.closing or run.installing:
            raise Conflict(f"round {upload.round} closed while the update was arriving; pull version {run.version}",
                           code="round_closed", extra={"version": run.version})
        self.store.seal(key)
        del self.uploads[key]
        self.state.count(upload.job, upload.round, "accepted")
        rnd = run.round
        if rnd is None or rnd.id != upload.round:
            rnd = run.round = self._new_round(upload.job, run)
        index, fan_in = rnd.plan.leaf_of(rnd.submitted)
        if index == len(rnd.leaves):
            leaf = self._new_task(upload.job, rnd, LEAF, fan_in, rnd.middle)
            rnd.leaves.append(leaf)
            self._assign(leaf)
        leaf = rnd.leaves[index]
        rnd.submitted += 1
        rnd.samples += samples
        leaf.routed += 1
        self.store.move_ref(key, holder, leaf.holder)
        self._deliver(leaf, KeyMessage(dest=0, task=leaf.id, key=key, samples=samples, count=1, sent_ns=now_ns()))
        return {"queued": run.inflight, "round": rnd.id}, []

    def _new_round(self, job: str, run: JobRun) -> Round:
        plan = RoundPlan(run.spec.goal, run.spec.leaf_fan_in)
        top = Task(self._take_id(), job, run.version, run.round_id, TOP, 1, None)
        middle = Task(self._take_id(), job, run.version, run.round_id, MIDDLE, plan.middle_fan_in, top)
        for t in (top, middle):
            self.tasks[t.id] = t
        rnd = Round(run.round_id, run.version, plan, middle, top)
        self._assign(middle)
        return rnd

    def _take_id(self) -> int:
        self._next_id += 1
        return self._next_id

    def _new_task(self, job: str, rnd: Round, role: str, fan_in: int, parent: Task | None) -> Task:
        task = Task(self._take_id(), job, rnd.version, rnd.id, role, fan_in, parent)
        self.tasks[task.id] = task
        return task

    def _check_deadlines(self) -> None:
        now = time.time()
        for name, run in self.jobs.items():
            deadline = run.spec.round_deadline_s
            if not deadline or run.version == NO_MODEL or run.closing or run.installing or now < run.round_opened + deadline:
                continue
            if self.state.close_round(name, run.round_id) < 0:
                continue  # not this round any more (another node moved it on)
            rnd = run.round if run.round and run.round.id == run.round_id else None
            arrived = rnd.submitted if rnd else 0
            if arrived >= run.spec.min_updates:
                self._finish_with_what_arrived(run, rnd)
            else:
                self._abandon_round(name, run.round_id, f"deadline passed with {arrived} of the {run.spec.min_updates} updates needed")

    def _finish_with_what_arrived(self, run: JobRun, rnd: Round) -> None:
        """Shrink the hierarchy to the updates that arrived: the last leaf and the middle learn
        their final fan-in, and the round completes as usual ("partial")."""
        run.closing = True
        last = rnd.leaves[-1]
        for task, fan_in in ((last, last.routed), (rnd.middle, len(rnd.leaves))):
            if fan_in < task.fan_in:
                task.fan_in = fan_in
                self._deliver(task, KeyMessage(dest=0, task=task.id, kind=KIND_CLOSE, count=fan_in, sent_ns=now_ns()))

    def _assign(self, task: Task) -> None:
        """Start a task on a warm instance, a new one, or queue it until one frees up."""
        run = self.jobs[task.job]
        if not self._startable(task):
            self.waiting.append(task)
            return
        views = [InstanceView(i.id, i.tenant.name, i.idle, i.last_used) for i in self.instances.values()]
        chosen = pick_warm(views, run.tenant.name)
        if chosen is not None:
            self.metrics.starts.labels("warm").inc()
            inst = self.instances[chosen]
        elif len(self.instances) < self.config.max_instances:
            self.metrics.starts.labels("cold").inc()
            inst = self._spawn(run.tenant)
        else:
            self.waiting.append(task)
            return
        self._start(inst, task)

    @staticmethod
    def _startable(task: Task) -> bool:
        """A task can start once its parent has an instance to send its result to (a middle's
        parent, the top, takes over the middle's own instance)."""
        return task.parent is None or task.role == MIDDLE or task.parent.instance is not None

    def _start(self, inst: Instance, task: Task) -> None:
        if task.role == MIDDLE:  # the top reuses the middle's instance once the middle is done (§5.3)
            assert task.parent is not None
            inst.next_task, task.parent.instance = task.parent, inst
        inst.task, task.instance, task.running = task, inst, True
        parent = task.parent
        push = {
            "op": "invoke", "task": task.id, "job": task.job, "version": task.version, "role": task.role,
            "fan_in": task.fan_in, "parent_instance": parent.instance.id if parent and parent.instance else 0,
            "parent_task": parent.id if parent else 0,
        }
        if task.job not in inst.specs_sent:
            push["spec"] = self.jobs[task.job].model_spec.to_json()
            inst.specs_sent.add(task.job)
        inst.conn.send(push)
        for msg in task.pending:
            self._deliver(task, msg)
        task.pending.clear()
        self._refresh_instance_gauges()

    def _deliver(self, task: Task, msg: KeyMessage) -> None:
        if task.instance is None:
            task.pending.append(msg)
            return
        msg = KeyMessage(**{**msg.__dict__, "dest": task.instance.id})
        tenant = task.instance.tenant
        if self.outbox or not self._senders[tenant.name].try_send(msg):
            self.outbox.append((tenant, msg))  # the instance's queue is full; the monitor retries

    # -- instances --------------------------------------------------------------------------------
    def _spawn(self, tenant: Tenant) -> Instance:
        iid = self._take_id()
        chan = UnixKeyChannel.provision(self.config.chan_dir / tenant.name, iid, tenant.gid)
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        cmd = [
            sys.executable, "-m", "lifl.runtime", "--instance", str(iid), "--tenant", tenant.name,
            "--node", self.config.node, "--chan-dir", str(self.config.chan_dir / tenant.name),
            "--control-fd", str(theirs.fileno()), "--channel-fd", str(chan.fileno()), "--handler", self.config.handler,
        ]
        if tenant.uid is not None:
            cmd += ["--user", str(tenant.uid)]
        env = {k: v for k, v in os.environ.items() if k in ("PATH", "PYTHONPATH", "LANG", "LC_ALL")}
        env["HOME"] = "/"
        env["PYTHONDONTWRITEBYTECODE"] = "1"
        proc = subprocess.Popen(cmd, pass_fds=(theirs.fileno(), chan.fileno()), cwd="/", env=env)
        theirs.close()
        chan.close()
        inst = Instance(iid, tenant, proc, Connection(ours))
        self.instances[iid] = inst
        threading.Thread(target=self._serve_instance, args=(inst,), name=f"instance-{iid}", daemon=True).start()
        return inst

    def _serve_instance(self, inst: Instance) -> None:
        handlers = {
            "alloc": lambda m, f: self.alloc(inst, self._task_of(inst, m), int(m["size"])),
            "folded": lambda m, f: self.folded(self._task_of(inst, m), m["keys"], int(m["updates"])),
            "handoff": lambda m, f: self.handoff(self._task_of(inst, m), bytes.fromhex(m["key"])),
            "install": lambda m, f: self.install(self._task_of(inst, m), bytes.fromhex(m["key"]), int(m["samples"]), int(m["updates"])),
            "done": lambda m, f: self.done(inst, int(m["task"]), m.get("stats") or {}),
            "failed": lambda m, f: self.failed(inst, int(m["task"]), m.get("error", "")),
        }
        self._serve(inst.conn, handlers, lambda: self._instance_gone(inst, "its process exited"))

    def _task_of(self, inst: Instance, message: dict[str, Any]) -> Task:
        task = self.tasks.get(int(message.get("task", 0)))
        if task is None or task.instance is not inst or not task.running:
            raise NotFound(f"task {message.get('task')} is not running on instance {inst.id}", code="no_such_task")
        return task

    def alloc(self, inst: Instance, task: Task, size: int) -> tuple[dict[str, Any], list[int]]:
        seg = self.store.create(inst.tenant, size, task.holder, affinity=inst.id)
        return {"key": seg.key.hex()}, [os.dup(seg.fd)]

    def folded(self, task: Task, keys: list[str], updates: int) -> tuple[dict[str, Any], list[int]]:
        for key in keys:
            self.store.release(bytes.fromhex(key), task.holder)
        run = self.jobs[task.job]
        run.inflight -= updates
        if run.round is not None and run.round.id == task.round:
            run.round.aggregated += updates
        self.state.count(task.job, task.round, "aggregated", updates)
        self._publish_gauges(run, task.job)
        return {}, []

    def handoff(self, task: Task, key: bytes) -> tuple[dict[str, Any], list[int]]:
        if task.parent is None:
            raise BadRequest("the top of the hierarchy installs its result, it has no parent")
        seg = self.store.get(key)
        if not seg.sealed:
            self.store.seal(key)
        self.store.move_ref(key, task.holder, task.parent.holder)
        return {}, []

    def install(self, task: Task, key: bytes, samples: int, updates: int) -> tuple[dict[str, Any], list[int]]:
        """The top has the round's model: checkpoint it in the background, then install it."""
        run = self.jobs[task.job]
        rnd = run.round
        if task.role != TOP or rnd is None or rnd.top is not task:
            raise BadRequest(f"task {task.id} is not the top of a running round")
        seg = self.store.get(key)
        if not seg.sealed:
            self.store.seal(key)
        run.installing = True
        run.inflight -= rnd.submitted - rnd.aggregated  # updates forwarded whole, never folded
        outcome = "partial" if run.closing else "complete"
        summary = self._summary(rnd.id, rnd.version, rnd.version + 1, outcome, updates=updates, samples=samples,
                                seconds=round(time.time() - rnd.first_update, 6), opened=run.round_opened)
        self.store.move_ref(key, task.holder, ("pending", task.job))
        self.checkpointer.submit(task.job, rnd.version + 1, os.dup(seg.fd), seg.size,
                                 lambda seconds, error: self._installed(task.job, rnd, key, summary, seconds, error))
        return {"version": rnd.version + 1}, []

    def _installed(self, job: str, rnd: Round, key: bytes, summary: dict[str, Any], seconds: float, error: Exception | None) -> None:
        """The checkpoint of a round's model is durable (or failed): make it the next version."""
        with self.lock:
            run = self.jobs[job]
            if error is not None:
                print(f"lifl agent: checkpoint of {job} version {rnd.version + 1} failed: {error}", file=sys.stderr)
                summary["checkpoint_error"] = str(error)
            summary["checkpoint_s"] = round(seconds, 6)
            opened = self.state.next_round(job, rnd.id, rnd.version + 1, key=key.hex(), node=self.config.node, summary=summary)
            if opened < 0:  # the round moved on meanwhile (abandoned): drop this model
                self.store.release(key, ("pending", job))
                return
            if error is None:
                self.state.set_checkpoint(job, rnd.version + 1)
            self.store.move_ref(key, ("pending", job), ("model", job))
            if run.model_key is not None:
                self.store.release(run.model_key, ("model", job))
            run.model_key, run.version, run.round_id, run.round_opened = key, rnd.version + 1, rnd.id + 1, opened
            run.round, run.closing, run.installing = None, False, False
            self._count_round(job, summary)
            self.metrics.checkpoint_seconds.observe(seconds)
            self.metrics.version.labels(job).set(run.version)
            self._publish_gauges(run, job)
            self._publish_status()

    def _summary(self, round_id: int, version: int, new_version: int | None, outcome: str, **extra: Any) -> dict[str, Any]:
        return {"round": round_id, "version": version, "new_version": new_version, "outcome": outcome,
                "updates": 0, "samples": 0, "seconds": None, "closed": round(time.time(), 3), **extra}

    def _count_round(self, job: str, summary: dict[str, Any]) -> None:
        self.metrics.rounds.labels(job, summary["outcome"]).inc()
        if summary["outcome"] in ("complete", "partial"):
            self.metrics.round_seconds.labels(job).observe(summary["seconds"])
            self.metrics.round_updates.labels(job).observe(summary["updates"])

    def done(self, inst: Instance, task_id: int, stats: dict[str, Any]) -> tuple[dict[str, Any], list[int]]:
        """The instance finished a task (or acknowledged its cancellation) and is free again."""
        task = self.tasks.get(task_id)
        if task is not None and task.instance is inst:
            self._finish(task)
        if task is not None and not stats.get("cancelled"):
            role = stats.get("role", task.role)
            for step in ("recv", "agg", "send"):
                if f"{step}_s" in stats:
                    self.metrics.steps.labels(role, step).observe(stats[f"{step}_s"])
            for us in stats.get("handoff_us", []):
                self.metrics.handoff.observe(us / 1e6)
            self.recent.append({"task": task.id, "job": task.job, "instance": inst.id, **stats})
        inst.task = None
        inst.last_used = time.monotonic()
        self._next_for(inst)
        return {}, []

    def failed(self, inst: Instance, task_id: int, error: str) -> tuple[dict[str, Any], list[int]]:
        task = self.tasks.get(task_id)
        inst.task = None
        if task is not None:
            print(f"lifl agent: task {task.id} ({task.role} of {task.job}) failed: {error}", file=sys.stderr)
            self._abandon_round(task.job, task.round, f"{task.role} failed: {error}")
        self._next_for(inst)
        return {}, []

    def _finish(self, task: Task) -> None:
        task.running = False
        self.store.release_holder(task.holder)
        self.tasks.pop(task.id, None)

    def _next_for(self, inst: Instance) -> None:
        """Give a freed instance its planned next task, or the oldest waiting one of its tenant."""
        if inst.next_task is not None:
            task, inst.next_task = inst.next_task, None
            self._start(inst, task)
            return
        for task in list(self.waiting):
            if self.jobs[task.job].tenant == inst.tenant and self._startable(task):
                self.waiting.remove(task)
                self.metrics.starts.labels("warm").inc()
                self._start(inst, task)
                if task.role == MIDDLE:  # its leaves can start now
                    for leaf in [t for t in self.waiting if t.parent is task]:
                        self.waiting.remove(leaf)
                        self._assign(leaf)
                return
        self._refresh_instance_gauges()

    def _instance_gone(self, inst: Instance, why: str) -> None:
        if self.instances.pop(inst.id, None) is None:
            return
        inst.conn.close()
        UnixKeyChannel.retire(self.config.chan_dir / inst.tenant.name, inst.id)
        for task in (inst.task, inst.next_task):
            if task is not None and not self._stopping.is_set():
                self._abandon_round(task.job, task.round, f"aggregator instance {inst.id} died ({why})")
        self._refresh_instance_gauges()

    def _abandon_round(self, job: str, round_id: int, reason: str) -> None:
        """Drop the node's work on a round and open the next one on the same version."""
        run = self.jobs.get(job)
        if run is None or run.round_id != round_id or run.installing:
            return
        print(f"lifl agent: abandoning round {round_id} of {job}: {reason}", file=sys.stderr)
        rnd = run.round if run.round and run.round.id == round_id else None
        if rnd is not None:
            for task in rnd.tasks:
                self.store.release_holder(task.holder)
                if task in self.waiting:
                    self.waiting.remove(task)
                inst = task.instance
                if inst is not None and inst.id in self.instances:
                    if inst.next_task is task:
                        inst.next_task = None
                    if inst.task is task:
                        inst.conn.send({"op": "cancel", "task": task.id, "reason": reason})
                self.tasks.pop(task.id, None)
            run.inflight -= rnd.submitted - rnd.aggregated
        summary = self._summary(round_id, run.version, None, "abandoned", reason=reason, opened=run.round_opened,
                                updates=rnd.submitted if rnd else 0, samples=rnd.samples if rnd else 0)
        opened = self.state.next_round(job, round_id, run.version, summary=summary)
        run.round, run.closing = None, False
        if opened >= 0:
            run.round_id, run.round_opened = round_id + 1, opened
        self._count_round(job, summary)
        self._publish_gauges(run, job)
        self._publish_status()

    # -- monitoring -------------------------------------------------------------------------------
    def _monitor_loop(self) -> None:
        last_publish = 0.0
        while not self._stopping.wait(0.005 if self.outbox else 0.1):
            with self.lock:
                self._flush_outbox()
                for inst in list(self.instances.values()):
                    if inst.proc.poll() is not None:
                        self._instance_gone(inst, f"exit status {inst.proc.returncode}")
                views = [InstanceView(i.id, i.tenant.name, i.idle, i.last_used) for i in self.instances.values()]
                for iid in expired(views, time.monotonic(), self.config.keep_warm):
                    self.instances[iid].conn.close()  # it exits on EOF; the reader thread cleans up
                try:
                    self._check_deadlines()
                except Exception:  # Redis restarting: the next tick retries
                    traceback.print_exc()
                if time.monotonic() - last_publish >= 1.0:
                    last_publish = time.monotonic()
                    self.store.trim_pool(idle_seconds=max(self.config.keep_warm, 30.0))
                    self._publish_status()

    def _flush_outbox(self) -> None:
        while self.outbox:
            tenant, msg = self.outbox[0]
            if not self._senders[tenant.name].try_send(msg):
                return
            self.outbox.popleft()

    def _publish_gauges(self, run: JobRun, job: str) -> None:
        self.metrics.queue.labels(job).set(run.inflight)
        self.metrics.shm.labels("used").set(self.store.used_bytes)
        self.metrics.shm.labels("pooled").set(self.store.pooled_bytes)

    def _publish_status(self) -> None:
        try:
            self.state.publish_node(self.config.node, self.status())
        except Exception as e:  # Redis restarting: the monitor publishes again within a second
            print(f"lifl agent: cannot publish status: {e}", file=sys.stderr)

    def _refresh_instance_gauges(self) -> None:
        self._publish_status()
        counts = dict.fromkeys((*ROLES, "idle"), 0)
        for inst in self.instances.values():
            counts[inst.task.role if inst.task else ("idle" if inst.idle else TOP)] += 1
        for role, n in counts.items():
            self.metrics.instances.labels(role).set(n)

    def status(self) -> dict[str, Any]:
        jobs: dict[str, dict[str, Any]] = {}
        for name, run in self.jobs.items():
            jobs[name] = {**dict.fromkeys(ROLES, 0), "queued": run.inflight, "closing": run.closing, "installing": run.installing}
        for inst in self.instances.values():  # instances at work, by the role of their current task
            if inst.task is not None and inst.task.job in jobs:
                jobs[inst.task.job][inst.task.role] += 1
        return {
            "node": self.config.node,
            "time": time.time(),
            "instances": {"total": len(self.instances), "idle": sum(i.idle for i in self.instances.values())},
            "jobs": jobs,
            "shm": {
                "used": self.store.used_bytes, "pooled": self.store.pooled_bytes, "capacity": self.store.capacity,
                "objects": self.store.object_count(), "created": self.store.created, "recycled": self.store.recycled,
            },
        }

    def metrics_text(self) -> str:
        for name, run in self.jobs.items():
            self._publish_gauges(run, name)
        self._refresh_instance_gauges()
        return generate_latest(self.metrics.registry).decode()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="lifl-agent", description="lifl node agent (started by `lifl up`)")
    p.add_argument("--node", required=True)
    p.add_argument("--run-dir", type=Path, required=True)
    p.add_argument("--data-dir", type=Path, required=True)
    p.add_argument("--redis", required=True)
    p.add_argument("--shm-capacity", type=int, required=True)
    p.add_argument("--pool-limit", type=int, required=True)
    p.add_argument("--max-instances", type=int, default=16)
    p.add_argument("--keep-warm", type=float, default=60.0)
    p.add_argument("--checkpoints", default="")
    args = p.parse_args(argv)
    die_with_parent()
    config = AgentConfig(
        args.node, args.run_dir, args.redis, args.shm_capacity, args.pool_limit, args.max_instances, args.keep_warm,
        checkpoints=args.checkpoints, data_dir=args.data_dir,
    )
    agent = Agent(config, ClusterState(args.redis))
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    agent.start()
    print("ready", flush=True)
    stop.wait()
    agent.stop()


if __name__ == "__main__":
    main()
