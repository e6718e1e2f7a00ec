"""The gateway's operations, shared by its HTTP and gRPC front ends.

The gateway keeps no state of its own beyond caches: jobs, versions and rounds are in Redis,
objects belong to the node agent. Everything runs on one event loop (``lifl.net.loop``): what
reads Redis or waits on another node runs on the loop's small pools, and its completion
answers the request on the loop; the hot path (a client's update, a model download) runs on
the loop itself, from caches (``Tokens.cached``, ``JobCache``) and one multiplexed connection
to the agent (``AgentLink``), so that the agent batches the admissions of many clients.

Threads: the loop's, and its pools' (created at start, a fixed set): ``IO_POOL`` for Redis
(tokens, jobs, leases, rounds, the registration and the token cache's refresh),
``SLOW_POOL`` for queries and models fetched from other nodes, ``PEER_POOL`` for transfers to
other nodes' gateways (partials forwarded, a split query's parts); and one that follows the
rounds' events for clients waiting for a version (``lifl.gateway.versions``).

It is also the node's door to the other nodes (paper appendix A, inter-node routing): it
streams the agent's partial results to the gateway of the node hosting a round's top, takes
theirs into shared memory for the top here, and fetches a model installed on another node
once per version so that any node's gateway serves any job's model.
"""

from __future__ import annotations

import contextlib
import functools
import http.client
import json
import math
import os
import re
import socket
import sys
import threading
import time
from collections.abc import Callable, Mapping
from concurrent.futures import Future
from dataclasses import asdict, dataclass
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest

from lifl import format as fmt
from lifl import shards
from lifl.auth import (
    CLIENT, OPERATOR, REFRESH_SECONDS, TENANT, Action, Principal, TokenSpec, Tokens, acting_client, authorize, bearer,
    certificate_principal, job_tenant, may_issue,
)
from lifl.cluster_types import NO_MODEL, Job, SecureRound
from lifl.control.controller import DEFAULT_CAPACITY
from lifl.control.planner import BESTFIT, NodeLoad, plan_round
from lifl.errors import (
    BadRequest, Conflict, Forbidden, Internal, LiflError, NotFound, Overloaded, Unauthenticated, Unprocessable,
)
from lifl.fixedpoint import partial_spec
from lifl.flstore.retention import RetentionPolicy
from lifl.gateway.agentlink import AgentLink, Reply, agent_unavailable
from lifl.gateway.auth_backoff import AuthBackoff
from lifl.gateway.ingest import BlobSink, LayoutCache
from lifl.gateway.versions import StageWatch, VersionWatch
from lifl.jobs import MAX_SAMPLES, TENANT_NAME, JobSpec, stage_wait_params
from lifl.net.io import sendfile_all
from lifl.net.loop import IO_POOL, SLOW_POOL, Loop, Timer
from lifl.net.tls import peer_connection, peer_http_connection
from lifl.quotas import Quota
from lifl.secagg import PublicKeys
from lifl.secagg_round import ABANDONED, ADVERTISE, COLLECT, CONSISTENCY, SHARE, UNMASK, Settings as SecureSettings
from lifl.secure_state import SecureRounds
from lifl.protocol import (
    ROLES, Abort, Admit, AdmitModel, AdmitPartial, AdmitReplica, Forwarded, ForwardPartial, GetMetrics, InstallModel,
    InstallReplica, Message, ModelOpened, OpenModel, Query, Submit, SubmitPartial,
)
from lifl.protocol import Release as ReleaseRef
from lifl.state import CURRENT_ROUND, ClusterState, stale
from lifl.store import MappingCache

PEER_POOL = "peer"  # transfers to other nodes' gateways
POOLS = {IO_POOL: 4, SLOW_POOL: 4, PEER_POOL: 4}  # threads of the gateway loop's pools
JOB_CACHE_ENTRIES = 4096  # jobs the gateway remembers (the cache is emptied past it)
MAX_CLIENT_ID = 256
MAX_UPDATES_PER_PARTIAL = 1 << 30
NODE_NAME = re.compile(r"[a-z0-9]{1,16}")
REGISTER_EVERY = 1.0  # seconds between refreshes of the gateway's registration (it lapses after state.NODE_TTL)
PEER_TIMEOUT = 120.0  # seconds a peer gateway may stall a transfer before it is given up (and retried)
MAX_ERROR_BODY = 64 << 10
MAX_PEER_ANSWER = 16 << 20  # a node's part of a split query: per-client numbers, never tensors
ASSIGN_ATTEMPTS = 3
FETCH_ATTEMPTS = 3
PART_CHUNK = 4 << 20  # bytes of a part copied at a time while a split job's whole model is put together
# a model reference downloads share is given back once unused this long, so that the agent can
# spill an idle model (lifl.node.spill: it counts the model used until the reference comes back)
SHARED_MODEL_IDLE_S = 5.0
PRIVACY_LOOKBACK = 100  # rounds searched for the latest epsilon recorded (abandoned rounds record none)


class GatewayMetrics:
    """The gateway's Prometheus metrics; the hot path's label sets are looked up once
    (``labels`` takes a lock and builds a key on every call)."""

    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()
        self.arrivals = Counter("lifl_update_arrivals", "Updates accepted", ["job", "protocol"], registry=r)
        self.rejected = Counter("lifl_updates_rejected", "Updates refused, by error code", ["protocol", "code"], registry=r)
        self.bytes_in = Counter("lifl_bytes_received", "Update and model bytes received into shared memory", ["protocol"], registry=r)
        self.bytes_out = Counter("lifl_bytes_sent", "Model bytes served", ["protocol"], registry=r)
        self.ingest = Histogram(
            "lifl_ingest_seconds", "From an update's first byte until it is acknowledged in shared memory",
            ["protocol"], registry=r, buckets=(1e-3, 5e-3, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
        )
        self._children: dict[tuple[Any, ...], Any] = {}

    def child(self, metric: Any, *labels: str) -> Any:
        """``metric.labels(*labels)``, remembered (the loop's thread; a race only repeats a lookup)."""
        key = (id(metric), *labels)
        found = self._children.get(key)
        if found is None:
            found = self._children[key] = metric.labels(*labels)
        return found


@dataclass
class UpdateMeta:
    job: str
    client: str
    samples: int
    base_version: int
    lease: str = ""

    @classmethod
    def parse(cls, principal: Principal, job: str, client: Any, samples: Any, base_version: Any, lease: Any = "") -> UpdateMeta:
        """Validate the client-supplied fields, naming the HTTP header each comes from; the client
        is the caller's (an operator names the client it acts as)."""
        return cls(job, client_id(acting_client(principal, client or None)), _integer("X-Lifl-Samples", samples, 1, MAX_SAMPLES),
                   _integer("X-Lifl-Base-Version", base_version, 0, 1 << 62), lease_id(lease or ""))


def update_fields(headers: Mapping[str, str]) -> dict[str, Any]:
    """An update's metadata as an HTTP request sends it (X-Lifl-* headers, lower-case names):
    UpdateMeta.parse's fields, unchecked. An ordinary upload and a resumable one send the same."""
    return {"client": headers.get("x-lifl-client"), "samples": headers.get("x-lifl-samples"),
            "base_version": headers.get("x-lifl-base-version"), "lease": headers.get("x-lifl-lease", "")}


def client_id(value: Any) -> str:
    if not isinstance(value, str) or not value or len(value) > MAX_CLIENT_ID or not value.isprintable():
        raise BadRequest(f"X-Lifl-Client must be a printable client id of 1-{MAX_CLIENT_ID} characters", code="bad_client")
    return value


def _object(body: Any, what: str) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise BadRequest(f"{what} must be a JSON object", code="bad_json")
    return body


def _hex(obj: dict[str, Any], name: str, code: str) -> bytes:
    value = obj.get(name)
    try:
        if not isinstance(value, str):
            raise ValueError
        return bytes.fromhex(value)
    except ValueError:
        raise BadRequest(f"{name!r} must be a hex string", code=code) from None


def lease_id(value: Any) -> str:
    if not isinstance(value, str) or len(value) > 64 or any(c not in "0123456789abcdef" for c in value):
        raise BadRequest("a lease id is at most 64 lowercase hex digits", code="bad_lease")
    return value


ASCII_INTEGER = re.compile(r"[0-9]{1,19}")


def _integer(name: str, value: Any, low: int, high: int) -> int:
    if isinstance(value, str):
        text = value.strip()
        if not ASCII_INTEGER.fullmatch(text):  # str.isdigit() takes "²", which int() refuses
            raise BadRequest(f"{name} must be an integer in [{low}, {high}], got {value[:32]!r}", code="bad_header")
        value = int(text)
    if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
        raise BadRequest(f"{name} must be an integer in [{low}, {high}]", code="bad_header")
    return value


def _nothing() -> None:
    """A continuation with nothing to do."""


class Ingest:
    """One blob being received on the loop: ``sink`` takes the bytes, ``finish`` hands the
    object over (``done(result, error)`` once the agent answered), ``abort`` gives it back.

    ``kind`` is what the blob is: a client's ``update``, a job's initial ``model`` or another
    node's ``partial`` result for the top hosted here. The sink's admission goes to the agent
    without waiting: the front end stops reading the blob until ``on_ready(error)`` says the
    sink is ready for the rest (``error`` None) or was refused."""

    RECEIVING, FINISHING, DONE, ABORTED = "receiving", "finishing", "done", "aborted"

    def __init__(self, service: GatewayService, kind: str, job: str, protocol: str, spec: fmt.ModelSpec | None,
                 limit: int, expected_size: int | None, *, meta: UpdateMeta | None = None,
                 partial: PartialMeta | None = None, masked: bool = False) -> None:
        self.service, self.kind, self.job, self.protocol = service, kind, job, protocol
        self.meta, self.partial, self.version = meta, partial, NO_MODEL
        self.agent = service.agent
        self.started = time.perf_counter()
        self.on_ready: Callable[[LiflError | None], None] = _nothing_ready
        self.state = self.RECEIVING
        self._admitting = False
        self._epoch = 0  # the agent connection the object was admitted on
        self._abort_reason = ""
        self._then: Callable[[], None] = _nothing  # what waits for an abort that waits for the admission's answer
        self.sink = BlobSink(limit=limit, spec=spec, admit=self._admit, mappings=service.mappings, layouts=service.layouts,
                             expected_size=expected_size, partial=bool(partial and partial.partial) or masked)

    @property
    def lost(self) -> bool:
        """Whether its object went with the agent that admitted it (which restarted since): the
        blob cannot be handed over any more."""
        return self.sink.key is not None and self.agent.epoch != self._epoch

    def _admit(self, layout: fmt.Layout) -> None:
        size = layout.total_size
        if self.kind == "model":
            request: Message = AdmitModel(self.job, size)
        elif self.kind == "partial":
            assert self.partial is not None
            p = self.partial
            request = AdmitPartial(self.job, p.round, p.epoch, p.from_node, size)
        else:
            assert self.meta is not None
            request = Admit(self.job, self.meta.base_version, size, self.meta.lease, self.meta.client)
        self._admitting = True
        self._epoch = self.agent.epoch
        self.agent.request(request, done=self._admitted)
        return None  # under way: the sink waits for ``admitted``

    def _admitted(self, reply: Reply | None, error: BaseException | None) -> None:
        self._admitting = False
        if self.state == self.ABORTED:  # its client went away (or its request failed) meanwhile
            then, self._then = self._then, _nothing
            if reply is not None:
                for fd in reply[1]:
                    os.close(fd)
                self._give_back(reply[0].key, self._abort_reason, then)
            elif self.kind == "update":
                self.service.count_rejection(self.job, self.protocol, _error_code(error), counted_by_agent=False, then=then)
            else:
                then()
            return
        if error is not None:
            self.on_ready(_lifl_error(error))
            return
        assert reply is not None
        admitted, fds = reply
        self.version = admitted.version
        try:
            self.sink.admitted(admitted.key, fds[0])
        except LiflError as e:
            self.on_ready(e)
            return
        self.on_ready(None)

    def finish(self, done: Callable[[dict[str, Any] | None, BaseException | None], None]) -> None:
        """Hand the complete blob over to the agent; ``done(result, error)`` on the loop."""
        self.sink.check_complete()
        key = self.sink.key
        assert key is not None and self.sink.total is not None
        if self.agent.epoch != self._epoch:
            raise agent_unavailable("it restarted while the blob was received")
        self.state = self.FINISHING
        m = self.service.metrics
        m.child(m.bytes_in, self.protocol).inc(self.sink.total)

        def answered(result: dict[str, Any]) -> Callable[[Reply | None, BaseException | None], None]:
            def then(reply: Reply | None, error: BaseException | None) -> None:
                self.state = self.DONE
                if error is not None:
                    if self.kind == "update":  # the agent counted it in the round
                        m.rejected.labels(self.protocol, _error_code(error)).inc()
                    done(None, error)
                    return
                assert reply is not None
                if self.kind == "model":
                    done({"version": reply[0].version}, None)
                    return
                if self.kind == "update":
                    m.child(m.arrivals, self.job, self.protocol).inc()
                    m.child(m.ingest, self.protocol).observe(time.perf_counter() - self.started)
                done(result, None)

            return then

        if self.kind == "model":
            self.agent.request(InstallModel(key), done=answered({}))
        elif self.kind == "partial":
            assert self.partial is not None
            p = self.partial
            self.agent.request(SubmitPartial(key, p.samples, p.updates, p.partial), done=answered({"round": p.round}))
        else:
            assert self.meta is not None
            self.agent.request(Submit(key, self.meta.samples, self.meta.client), done=answered({"version": self.version}))

    def abort(self, error: LiflError | None, then: Callable[[], None] = _nothing) -> None:
        """Give the object back (if one was admitted, or once it is) and count the refusal, then
        ``then()`` on the loop, once the agent has the object back and Redis the count (so that
        a client told of the refusal finds its round slot free); nothing (but ``then()``) once
        the blob was handed over."""
        if self.state != self.RECEIVING:
            then()
            return
        self.state = self.ABORTED
        reason = self._abort_reason = error.code if error else "aborted"
        key = self.sink.key
        if key is not None:
            if self.kind == "update":
                self.service.count_rejection(self.job, self.protocol, reason, counted_by_agent=True)
            self._give_back(key, reason, then)  # the agent's abort counts it in the round
        elif self._admitting:
            self._then = then  # when the admission's answer comes (_admitted)
        elif self.kind == "update":
            self.service.count_rejection(self.job, self.protocol, reason, counted_by_agent=False, then=then)
        else:
            then()

    def _give_back(self, key: bytes, reason: str, then: Callable[[], None]) -> None:
        if self.agent.epoch != self._epoch:  # the agent released it when that connection closed
            then()
            return
        self.agent.request(Abort(key, reason), done=lambda reply, error: _close_then(reply, then))


def _close_then(reply: Reply | None, then: Callable[[], None]) -> None:
    if reply is not None:
        for fd in reply[1]:
            os.close(fd)
    then()


def _nothing_ready(error: LiflError | None) -> None:
    """An Ingest's ``on_ready`` until its front end sets one."""


def _lifl_error(error: BaseException) -> LiflError:
    if isinstance(error, LiflError):
        return error
    return Internal(f"{type(error).__name__}: {error}")


def _error_code(error: BaseException | None) -> str:
    return error.code if isinstance(error, LiflError) else "aborted"


@dataclass(frozen=True)
class PartialMeta:
    """Headers of a partial result sent by another node's gateway."""

    round: int
    epoch: int
    from_node: str
    samples: int
    updates: int
    partial: bool  # accumulator dtypes (a sum), or a single client update passed on whole

    @classmethod
    def parse(cls, round_id: Any, epoch: Any, from_node: Any, samples: Any, updates: Any, partial: Any) -> PartialMeta:
        if not isinstance(from_node, str) or not NODE_NAME.fullmatch(from_node):
            raise BadRequest("X-Lifl-From-Node must name a node", code="bad_header")
        if partial not in ("0", "1"):
            raise BadRequest("X-Lifl-Partial must be 0 or 1", code="bad_header")
        return cls(_integer("round", round_id, 0, 1 << 62), _integer("X-Lifl-Epoch", epoch, 0, 1 << 31), from_node,
                   _integer("X-Lifl-Samples", samples, 1, MAX_SAMPLES * MAX_UPDATES_PER_PARTIAL),
                   _integer("X-Lifl-Updates", updates, 1, MAX_UPDATES_PER_PARTIAL), partial == "1")


class ModelRef:
    """A read reference to a job's model, held from the agent, that downloads share while its
    version is the job's current one; given back once none of them uses it. On the loop."""

    def __init__(self, agent: AgentLink, reply: ModelOpened, fd: int) -> None:
        self.agent, self.fd = agent, fd
        self.key, self.version, self.size = reply.key, reply.version, reply.size
        self.epoch = agent.epoch  # the agent connection that holds it
        self.users = 0
        self.shared = True  # False: the next download opens another
        self.last_used = time.monotonic()

    def view(self) -> ModelView:
        self.users += 1
        self.last_used = time.monotonic()
        return ModelView(self)

    def retire(self) -> None:
        """Share it no more; give it back once its downloads are sent."""
        self.shared = False
        if not self.users:
            self._give_back()

    def done_with(self) -> None:
        self.users -= 1
        if not self.users and not self.shared:
            self._give_back()

    @property
    def held(self) -> bool:
        """Whether the agent still holds it for this gateway: once the connection it was opened on
        closed, the agent let it go (it may recycle the object, a new agent knows nothing of it)."""
        return self.agent.epoch == self.epoch

    def _give_back(self) -> None:
        os.close(self.fd)
        if self.held:
            self.agent.request(ReleaseRef(self.key))


class ModelView:
    """One download's use of a job's model; release it when sent (on the loop)."""

    def __init__(self, ref: ModelRef) -> None:
        self.fd, self.version, self.size = ref.fd, ref.version, ref.size
        self._ref: ModelRef | None = ref

    def release(self) -> None:
        if self._ref is not None:
            self._ref, ref = None, self._ref
            ref.done_with()


class _Recheck(Exception):
    """A cached job says no: read it again before saying so (its version may have moved on)."""


class JobCache:
    """Jobs as this gateway last read them, for the checks that come before an upload is
    admitted. A job's spec and its model's spec never change once set (its tenant, limits,
    strategy, tensors): what is decided from them holds. Its version and round do change: a
    check that fails on them is made again on a fresh read (``_Recheck``) before it refuses
    (an update trained from a version newer than the cached one goes on to the agent), and
    one that passes never accepts anything, since the agent's admission decides from Redis.
    The loop's alone: no lock."""

    def __init__(self, max_entries: int = JOB_CACHE_ENTRIES) -> None:
        self._jobs: dict[str, Job] = {}
        self._staleness: dict[str, int] = {}  # the strategy's max_staleness (its spec is parsed on every access)
        self._max = max_entries

    def get(self, name: str) -> Job | None:
        return self._jobs.get(name)

    def put(self, job: Job) -> None:
        name = job.spec.job
        if len(self._jobs) >= self._max and name not in self._jobs:
            self._jobs.clear()
            self._staleness.clear()
        self._jobs[name] = job
        self._staleness[name] = job.spec.strategy_spec.max_staleness

    def max_staleness(self, job: Job) -> int:
        """How many versions stale the job's updates may be (of a job read through the cache)."""
        return self._staleness[job.spec.job]


class SpecCache:
    """Job specs as this gateway read them, for calls made off the loop: a spec never changes
    once the job is created."""

    def __init__(self, max_entries: int = JOB_CACHE_ENTRIES) -> None:
        self._specs: dict[str, JobSpec] = {}
        self._lock = threading.Lock()
        self._max = max_entries

    def get(self, name: str) -> JobSpec | None:
        return self._specs.get(name)

    def put(self, spec: JobSpec) -> JobSpec:
        with self._lock:
            if len(self._specs) >= self._max:
                self._specs.clear()
            self._specs[spec.job] = spec
        return spec


class RefusalCounts:
    """Refusals of updates counted in their round's accounting in Redis, on the pool: one call
    per job at a time (counted in the round current then), with every refusal of that job that came
    meanwhile, as the agent batches its admissions: refusals come in bursts (a round fills up
    and every client that tries next is told so)."""

    def __init__(self, loop: Loop, state: ClusterState, log: Callable[[Any, BaseException | None], None]) -> None:
        self.loop, self.state, self._log = loop, state, log
        self._waiting: dict[str, list[tuple[str, Callable[[], None]]]] = {}
        self._counting: set[str] = set()  # jobs with a call on the pool

    def add(self, job: str, code: str, then: Callable[[], None]) -> None:
        """Count ``code`` in ``job``'s round, then ``then()`` on the loop."""
        self._waiting.setdefault(job, []).append((code, then))
        if job not in self._counting:
            self._count(job)

    def _count(self, job: str) -> None:
        items = self._waiting.pop(job, [])
        if not items:
            return
        self._counting.add(job)

        def count() -> None:  # one call: the script reads the round (a job that is gone counts nothing)
            self.state.run(self.state.count_call(job, [(CURRENT_ROUND, f"rejected.{code}", 1) for code, _ in items]))

        def counted(_: Any, error: BaseException | None) -> None:
            self._counting.discard(job)
            self._log(None, error)
            for _, then in items:
                then()
            self._count(job)  # what came meanwhile

        self.loop.offload(count, counted)


class GatewayService:
    """The operations of both front ends. Those that read Redis or wait on other nodes block:
    the front ends run them on the loop's pool (``IO_POOL``, or ``SLOW_POOL`` for queries). The
    hot path (uploads, model downloads, callers) runs on the loop, from the token and job caches
    and the agent's connection, and answers through callbacks ``done(result, error)``."""

    def __init__(self, node: str, state: ClusterState, agent_socket: str, placement: str = BESTFIT,
                 capacity: float = DEFAULT_CAPACITY, *, open_metrics: bool = False, loop: Loop | None = None) -> None:
        self.node = node
        self.state = state
        self.secure = SecureRounds(state)  # a secure job's stages
        self.loop = loop or Loop(f"lifl gateway {node}", pools=POOLS)
        self.tokens = Tokens(state.redis, outage=state.outage)
        self.open_metrics = open_metrics  # GET /metrics without a token (it names jobs of every tenant)
        self.agent = AgentLink(self.loop, agent_socket)
        self.placement = placement
        self.capacity = capacity
        self.mappings = MappingCache()
        self.layouts = LayoutCache()
        self.metrics = GatewayMetrics()
        self.jobs = JobCache()
        self.specs = SpecCache()  # for calls off the loop
        self.refusals = RefusalCounts(self.loop, state, self._logged("counting refusals"))
        self.versions = VersionWatch(self.loop, state)
        self._models: dict[str, ModelRef] = {}  # per job, the model reference its downloads share
        self.versions.on_change(lambda job: self._share(job, None))
        self.stages = StageWatch(self.loop, self.secure.round)  # clients between a secure round's stages
        self._secure_messages = {"keys": (ADVERTISE, self._secure_advertise), "shares": (SHARE, self._secure_share),
                                 "signature": (CONSISTENCY, self._secure_sign), "answer": (UNMASK, self._secure_answer)}
        self.versions.on_change(self.stages.changed)
        self._forwarder = AgentLink(self.loop, agent_socket, "forwarder", self._on_push)
        self._duties: list[Timer] = []
        self._token_refresh: Timer | None = None
        self._refreshing = False
        self._auth_backoff = AuthBackoff()  # failed authentications per client address (on the loop)
        self._fetching: dict[str, threading.Lock] = {}  # replica fetches, one per job at a time (pool threads)
        self._fetching_lock = threading.Lock()
        self._last_problem: dict[str, str] = {}  # the last failure of each periodic duty (logged once)

    # -- the node's presence and its partial results ---------------------------------------------
    def start(self, http: str, grpc: str) -> None:
        """Register where this gateway is reached (refreshed while it runs) and start forwarding
        the agent's partial results to other nodes."""
        addresses = {"http": http, "grpc": grpc}
        self.state.publish_gateway(self.node, addresses)
        self._on_loop(lambda: self._start_duties(addresses))

    def stop(self) -> None:
        """Stop the periodic duties and the agent's connections (the loop is its starter's to stop)."""
        self._on_loop(self._stop_duties)

    def _on_loop(self, fn: Callable[[], None]) -> None:
        if self.loop.running and not self.loop.in_loop():
            self.loop.call(fn)
        else:
            fn()

    def _start_duties(self, addresses: dict[str, str]) -> None:
        def register() -> None:
            self.loop.offload(lambda: self.state.publish_gateway(self.node, addresses), self._logged("registration"))

        self._duties.append(self.loop.every("gateway registration", REGISTER_EVERY, register))
        self._duties.append(self.loop.every("idle model references", SHARED_MODEL_IDLE_S, self._retire_idle_models))
        self.versions.start()
        self.stages.start()
        self._forwarder.connect()
        self.agent.connect()

    def _stop_duties(self) -> None:
        for timer in self._duties:
            timer.cancel()
        if self._token_refresh is not None:
            self._token_refresh.cancel()
        self.versions.stop()
        self.stages.stop()
        for job in list(self._models):
            self._share(job, None)
        self._forwarder.close()
        self.agent.close()

    def _logged(self, duty: str) -> Callable[[Any, BaseException | None], None]:
        """The completion of a periodic duty's work: a failure is logged once per kind in a row
        (Redis restarting: the next period tries again)."""

        def done(_: Any, error: BaseException | None) -> None:
            problem = f"{type(error).__name__}: {error}" if error is not None else ""
            if problem and problem != self._last_problem.get(duty):
                print(f"lifl gateway: {duty} failed: {problem}", file=sys.stderr)
            self._last_problem[duty] = problem

        return done

    def _on_push(self, message: Message, fds: list[int]) -> None:
        """A push on the forwarder's connection: a partial result to stream to another node."""
        if not isinstance(message, ForwardPartial) or not fds:
            for fd in fds:
                os.close(fd)
            return
        for extra in fds[1:]:
            os.close(extra)
        fd = fds[0]
        epoch = self._forwarder.epoch  # the answer is for this connection's agent: refs mean nothing to the next

        def forward() -> Forwarded:
            """Stream one object out of shared memory to another node's gateway (sendfile: the
            bytes are copied once, by the kernel, into the socket)."""
            try:
                status, error = send_partial(self.state, self.node, message, fd, self.tokens.internal_token())
                ok = status == 202
                # the receiver may not have learnt yet that it hosts the top: try again; a round
                # that is over there will be over here soon too
                return Forwarded(message.ref, ok, error, retry=not ok)
            except (OSError, LiflError, http.client.HTTPException) as e:
                return Forwarded(message.ref, False, f"{type(e).__name__}: {e}", retry=True)
            finally:
                os.close(fd)

        def forwarded(reply: Forwarded | None, error: BaseException | None) -> None:
            if reply is None:  # a bug: the agent is told, and retries
                reply = Forwarded(message.ref, False, f"{type(error).__name__}: {error}", retry=True)
            if self._forwarder.epoch == epoch:  # else it resends what it was forwarding, or is a new agent
                self._forwarder.push(reply)

        self.loop.offload(forward, forwarded, PEER_POOL)

    # -- callers ----------------------------------------------------------------------------------
    def identify(self, authorization: str | None, certificate: dict[str, Any] | None, peer: str,
                 done: Callable[[Principal | None, BaseException | None], None]) -> None:
        """The caller of a request from address ``peer`` (on the loop): its bearer token's
        (``Authorization`` header or gRPC metadata), from the token cache when it can answer,
        else from Redis on the pool (the request waits, not the loop); else its verified TLS
        client certificate's; Unauthenticated without either, or TooManyAuthFailures once
        ``peer`` has failed too often lately (gateway/auth_backoff.py). ``done`` may run before
        this returns."""
        if self._token_refresh is None:
            self._token_refresh = self.loop.every("token cache refresh", REFRESH_SECONDS, self._refresh_tokens)
        try:
            token = bearer(authorization)
            if token is None:
                principal = certificate_principal(certificate)
                if principal is None:
                    raise Unauthenticated("this call needs a token: send 'Authorization: Bearer <token>'", code="unauthenticated")
            else:
                principal = self.tokens.cached(token)
        except LiflError as e:
            done(None, self._auth_failure(peer, e))
            return
        if principal is not None:
            done(principal, None)
            return
        self.loop.offload(lambda: self.tokens.authenticate(token),
                          lambda caller, error: done(caller, None if error is None else self._auth_failure(peer, error)))

    def _auth_failure(self, peer: str, error: BaseException) -> BaseException:
        """What a failed identification answers: its error, or 429 while ``peer`` backs off. Only
        refused credentials count (a Redis outage is no guess)."""
        if not isinstance(error, Unauthenticated):
            return error
        return self._auth_backoff.failed(peer, time.monotonic()) or error

    def _refresh_tokens(self) -> None:
        if self._refreshing:
            return  # the last refresh has not come back (Redis is slow): entries go stale, not wrong

        def refreshed(count: Any, error: BaseException | None) -> None:
            self._refreshing = False
            self._logged("token cache refresh")(count, error)

        self._refreshing = True
        self.loop.offload(self.tokens.refresh, refreshed)

    def authenticate(self, authorization: str | None, certificate: dict[str, Any] | None = None) -> Principal:
        """``identify``, blocking (Redis is read when the cache cannot answer)."""
        token = bearer(authorization)
        if token is not None:
            return self.tokens.authenticate(token)
        principal = certificate_principal(certificate)
        if principal is None:
            raise Unauthenticated("this call needs a token: send 'Authorization: Bearer <token>'", code="unauthenticated")
        return principal

    def _with_job(self, name: str, check: Callable[[Job, bool], Any], done: Callable[[Any, BaseException | None], None]) -> None:
        """On the loop: ``done(check(job, fresh), None)`` with job ``name`` from the cache, or read
        from Redis on the pool (``fresh`` True) if it is not cached or ``check`` raises
        ``_Recheck``; ``check``'s errors go to ``done``, which may run before this returns."""
        job = self.jobs.get(name)
        if job is not None:
            try:
                result = check(job, False)
            except _Recheck:
                pass
            except Exception as e:
                done(None, e)
                return
            else:
                done(result, None)
                return

        def read(job: Job | None, error: BaseException | None) -> None:
            if error is not None:
                done(None, error)
                return
            assert job is not None
            self.jobs.put(job)
            try:
                result = check(job, True)
            except Exception as e:
                done(None, e)
                return
            done(result, None)

        self.loop.offload(lambda: self.state.job(name), read)

    def authorized_job(self, principal: Principal, action: Action, name: str) -> Job:
        """The job ``name`` if ``principal`` may do ``action`` on it (NotFound outside its scope)."""
        job = self.state.job(name)
        authorize(principal, action, tenant=job.spec.tenant, job=name)
        return job

    # -- tokens ----------------------------------------------------------------------------------
    def create_token(self, principal: Principal, body: Any) -> dict[str, Any]:
        """A new tenant or client token: its record and, this once, the token itself."""
        spec = TokenSpec.from_request(body)
        may_issue(principal, spec)
        if spec.role == CLIENT and self.state.job(spec.job).spec.tenant != spec.tenant:  # enrols in its tenant's jobs only
            raise NotFound(f"job {spec.job!r} does not exist", code="no_such_job")
        record, token = self.tokens.create(spec)
        return {**record.public(), "token": token}

    def list_tokens(self, principal: Principal) -> list[dict[str, Any]]:
        """Live tokens the caller manages, without their secrets."""
        authorize(principal, Action.MANAGE_TOKENS)
        tenant = None if principal.role == OPERATOR else principal.tenant
        return [r.public() for r in self.tokens.records(tenant)]

    def revoke_token(self, principal: Principal, token_id: str) -> None:
        """Revoke a token: the operator any issued one, a tenant its clients' tokens."""
        authorize(principal, Action.MANAGE_TOKENS)
        record = self.tokens.record(token_id)
        if record is None or (principal.role == TENANT and record.tenant != principal.tenant):
            raise NotFound(f"no live token {token_id!r}", code="no_such_token")
        if principal.role == TENANT and record.role != CLIENT:
            raise Forbidden("a tenant token revokes client tokens only", code="forbidden")
        self.tokens.revoke(token_id)

    # -- quotas --------------------------------------------------------------------------------
    def quota(self, principal: Principal, tenant: str) -> dict[str, Any]:
        """A tenant's quota and what it holds of it (a tenant reads its own; the operator any)."""
        self._quota_scope(principal, Action.READ_QUOTA, tenant)
        return {"tenant": tenant, "quota": asdict(self.state.quota(tenant)), "usage": self.state.tenant_usage(tenant)}

    def set_quota(self, principal: Principal, tenant: str, body: Any) -> dict[str, Any]:
        """Set a tenant's quota (fields left out take their defaults). Lowering one below what the
        tenant holds refuses more, and takes nothing away."""
        self._quota_scope(principal, Action.SET_QUOTA, tenant)
        self.state.set_quota(tenant, Quota.from_request(body))
        return self.quota(principal, tenant)

    def reset_quota(self, principal: Principal, tenant: str) -> dict[str, Any]:
        """The tenant's quota back to the defaults."""
        self._quota_scope(principal, Action.SET_QUOTA, tenant)
        self.state.set_quota(tenant, None)
        return self.quota(principal, tenant)

    @staticmethod
    def _quota_scope(principal: Principal, action: Action, tenant: str) -> None:
        authorize(principal, action)
        if not TENANT_NAME.fullmatch(tenant):
            raise BadRequest("a tenant is named by 1-31 characters of a-z, 0-9 and '-'", code="bad_tenant")
        if principal.role != OPERATOR and tenant != principal.tenant:
            raise NotFound(f"no tenant {tenant!r}", code="no_such_tenant")  # others' names do not leak

    # -- jobs ----------------------------------------------------------------------------------
    def create_job(self, principal: Principal, body: Any) -> dict[str, Any]:
        authorize(principal, Action.CREATE_JOB)
        if isinstance(body, dict):
            body = {**body, "tenant": job_tenant(principal, body.get("tenant"))}
        spec = JobSpec.from_request(body)
        self.state.create_job(spec)
        return self.job_status(principal, spec.job)

    def job_names(self, principal: Principal) -> list[str]:
        """The jobs in the caller's scope."""
        authorize(principal, Action.LIST_JOBS)
        if principal.role == OPERATOR:
            return self.state.job_names()
        names = self.state.job_names(principal.tenant)
        return names if principal.role == TENANT else [n for n in names if n == principal.job]

    def job_status(self, principal: Principal, name: str) -> dict[str, Any]:
        """The job as the whole cluster sees it: the round's progress on every node (a client sees
        its version and round only)."""
        view = self.state.job_view(name)
        job, shard = view.job, view.shard
        authorize(principal, Action.READ_JOB, tenant=job.spec.tenant, job=name)
        if principal.role == CLIENT:
            return client_view(job)
        has_model = job.version != NO_MODEL
        aggregators = dict.fromkeys(ROLES, 0)
        queued = 0
        nodes: dict[str, dict[str, Any]] = {}
        for node, status in self.state.nodes().items():
            activity = status.jobs.get(name)
            at_work = {role: activity.at_work(role) if activity else 0 for role in ROLES}
            for role in ROLES:
                aggregators[role] += at_work[role]
            node_queued = activity.queued if activity else 0
            queued += node_queued
            nodes[node] = {"updates": shard.counts.get(node, 0), "queued": node_queued, "aggregators": at_work}
        current = shard.round == job.round
        return {
            "job": name,
            "tenant": job.spec.tenant,
            "goal": job.spec.goal,
            "leaf_fan_in": job.leaf_fan_in,
            "max_update_bytes": job.spec.max_update_bytes,
            "max_inflight": job.spec.inflight_budget,
            "round_deadline_s": job.spec.round_deadline_s or None,
            "min_updates": job.spec.min_updates,
            "lease_ttl_s": job.spec.lease_ttl_s,
            "over_selection": job.spec.over_selection,
            "max_samples": job.spec.max_samples,
            "architecture": job.spec.architecture or None,
            "retention": view.retention.to_dict(),
            "strategy": self._strategy_status(job),
            "fixed_point": job.spec.fixed_point or None,
            "shards": job.spec.shards or "auto",
            "shard_alignment": job.spec.shard_alignment,
            "parts": [{"node": p.node, "shards": [p.first, p.stop], "data": [p.data_begin, p.data_end]}
                      for p in job.split[1]] if job.split else None,
            "accumulator": job.spec.accumulator,
            "version": job.version if has_model else None,
            "round": {
                "id": job.round if has_model else None,
                "version": job.version if has_model else None,
                "opened_at": job.round_opened if has_model else None,
                "closed": job.closed,
                "received": job.accepted,
                "in_progress": job.reserved - job.accepted,
                "aggregated": job.aggregated,
                "leases": view.leases,
                "rejected": job.rejected,
                "nodes": shard.counts if current else {},
                "top": shard.top if current else None,
                "lost": shard.lost if current else {},
            },
            "queued": queued,
            "aggregators": aggregators,
            "nodes": nodes,
            "last_round": job.last_round,
            "model": {"node": job.model_node, "checkpoint": job.checkpoint,
                      "checkpoint_error": job.checkpoint_error or None} if has_model else None,
        }

    def wait_for_version(self, principal: Principal, name: str, after: int, wait_s: float,
                         done: Callable[[dict[str, Any] | None, BaseException | None], None]) -> None:
        """(On the loop.) ``done(client_view)`` once the job's version passes ``after``, or after
        ``wait_s`` seconds with the version then (``lifl.gateway.versions``)."""
        def check(job: Job) -> None:
            authorize(principal, Action.READ_JOB, tenant=job.spec.tenant, job=name)

        def answer(job: Job | None, error: BaseException | None) -> None:
            done(client_view(job) if job is not None else None, error)

        self.versions.wait(name, after, wait_s, check, answer)

    # -- retention and queries (lifl.flstore) -----------------------------------------------------
    def query(self, principal: Principal, name: str, body: Any) -> dict[str, Any]:
        """A non-training workload over the job's retained data, run by this node's agent. Where
        the round's updates are spread over nodes and the workload decomposes, every node holding
        some computes its part where they are and this gateway combines the parts; if a node
        cannot answer, the agent reads its updates from the checkpoint store instead."""
        self.authorized_job(principal, Action.QUERY, name)
        if not isinstance(body, dict):
            raise BadRequest("a query must be a JSON object with a 'workload'", code="bad_query")
        if internal := sorted(set(body) & {"scope", "rounds"}):
            raise BadRequest(f"query field(s) {', '.join(internal)} are set between nodes only", code="bad_query")
        answer = self.agent.call(Query(name, body))[0].to_json()
        if "partial" not in answer:
            return answer
        from lifl.flstore import workloads  # numpy only, on the first split query

        try:
            parts = self._peer_parts(name, answer)
            result = workloads.combine(answer["workload"], [answer["partial"], *(p["partial"] for p in parts)],
                                       answer["params"])
        except (OSError, LiflError, http.client.HTTPException, ValueError) as e:
            print(f"lifl gateway: a split query of {name!r} reads every update here instead: {e}", file=sys.stderr)
            return self.agent.call(Query(name, {**body, "scope": "gather"}))[0].to_json()
        data = {k: sum(a["data"][k] for a in (answer, *parts)) for k in answer["data"]}
        data["bytes_between_nodes"] = sum(p.pop("_bytes") for p in parts)
        final = {k: v for k, v in answer.items() if k not in ("partial", "peers", "params", "rounds")}
        if answer["workload"] == "reputation":
            final["rounds"] = answer["rounds"]
        return {**final, "result": result, "data": data, "nodes": [answer["node"], *(p["node"] for p in parts)]}

    def _peer_parts(self, name: str, answer: dict[str, Any]) -> list[dict[str, Any]]:
        """(On the pool.) Every peer's part of a split query, computed where its updates are,
        asked at once (on the peer pool)."""
        body = {"workload": answer["workload"], "rounds": answer["rounds"], "scope": "node", **answer["params"]}
        asked = [self._on_pool(lambda node=node: peer_query(self, node, name, body), PEER_POOL) for node in answer["peers"]]
        return [future.result() for future in asked]

    def _on_pool(self, fn: Callable[[], Any], pool: str) -> Future[Any]:
        """``fn()`` on ``pool``, as a future (for work on another pool that waits for it)."""
        future: Future[Any] = Future()

        def done(result: Any, error: BaseException | None) -> None:
            if error is not None:
                future.set_exception(error)
            else:
                future.set_result(result)

        self.loop.offload(fn, done, pool)
        return future

    def peer_query(self, principal: Principal, name: str, body: Any) -> dict[str, Any]:
        """Another node's gateway asks for this node's part of a split query."""
        self.authorized_job(principal, Action.INTERNAL, name)
        if not isinstance(body, dict) or body.get("scope") != "node":
            raise BadRequest("a peer's query asks for this node's part (scope 'node')", code="bad_query")
        return self.agent.call(Query(name, body))[0].to_json()

    def retention(self, principal: Principal, name: str) -> dict[str, Any]:
        """The job's retention policy and, summed over the nodes, what it keeps and how queries fare."""
        self.authorized_job(principal, Action.RETENTION, name)
        return self._retention(name)

    def _retention(self, name: str) -> dict[str, Any]:
        totals = {"hits": 0, "misses": 0, "evictions": 0, "fetch_back_bytes": 0, "pending_writes": 0}
        retained = {"model": 0, "update": 0}
        for status in self.state.nodes().values():
            stats = status.retention.get(name)
            if not stats:
                continue
            for k in totals:
                totals[k] += stats.get(k, 0)
            for k in retained:
                retained[k] += stats.get("bytes_retained", {}).get(k, 0)
        looked = totals["hits"] + totals["misses"]
        return {"job": name, "policy": self.state.retention(name).to_dict(), "excluded_clients": self.state.excluded(name),
                "stats": {**totals, "hit_rate": totals["hits"] / looked if looked else None, "bytes_retained": retained}}

    def set_retention(self, principal: Principal, name: str, body: Any) -> dict[str, Any]:
        """Change the policy at run time; every node applies it within a second."""
        self.authorized_job(principal, Action.RETENTION, name)
        policy = RetentionPolicy.from_request(body)
        self.state.set_retention(name, self.state.job(name).spec.retention_floor(policy))
        return self._retention(name)

    def _strategy_status(self, job: Job) -> dict[str, Any]:
        """The job's strategy with every parameter, and for differential privacy the budget spent
        so far: the epsilon the agent recorded with the latest version (its accountant's library
        is the agent's to import, not the gateway's)."""
        strategy = job.spec.strategy_spec
        out: dict[str, Any] = strategy.to_json()
        if strategy.spends_privacy:
            recorded = (r.get("strategy", {}) for r in reversed(self.state.rounds(job.spec.job, PRIVACY_LOOKBACK)))
            spent = next((r["epsilon"] for r in recorded if "epsilon" in r), 0.0)
            out["privacy"] = {"epsilon": spent, "delta": strategy.param("delta")}
        return out

    def rounds(self, principal: Principal, name: str, limit: int) -> list[dict[str, Any]]:
        self.authorized_job(principal, Action.READ_ROUNDS, name)
        return self.state.rounds(name, limit)

    # -- leases and assignments ------------------------------------------------------------------
    def take_lease(self, principal: Principal, name: str, client: Any) -> dict[str, Any]:
        """The caller's place in the current round while it trains, kept by heartbeats: one per
        client (asking again renews and returns the one it holds)."""
        spec = self.authorized_job(principal, Action.LEASE, name).spec
        lease, version, round_id = self.state.take_lease(spec, client_id(acting_client(principal, client)))
        return {"lease": lease, "version": version, "round": round_id, "ttl_s": spec.lease_ttl_s}

    def heartbeat(self, principal: Principal, name: str, lease: str) -> dict[str, Any]:
        spec = self.authorized_job(principal, Action.LEASE, name).spec
        if not self.state.heartbeat(spec, lease_id(lease), principal.client):
            raise NotFound(f"lease {lease} of job {name!r} has lapsed or does not exist", code="no_such_lease")
        return {"lease": lease, "ttl_s": spec.lease_ttl_s}

    def release_lease(self, principal: Principal, name: str, lease: str) -> None:
        self.authorized_job(principal, Action.LEASE, name)
        if not self.state.release_lease(name, lease_id(lease), principal.client):
            raise NotFound(f"lease {lease} of job {name!r} has lapsed or does not exist", code="no_such_lease")

    # -- secure rounds (lifl.secure_state): the stages before and after a masked input ------------------
    def _secure_job(self, principal: Principal, name: str, client: Any) -> tuple[JobSpec, SecureSettings, str]:
        """The secure job ``name``'s spec and settings, and the client the call acts as."""
        spec = self.specs.get(name)
        if spec is None:  # a job's spec never changes: read once (the stages' calls come by the hundred)
            spec = self.specs.put(self.state.job(name).spec)
        authorize(principal, Action.LEASE, tenant=spec.tenant, job=name)
        settings = spec.secure
        if settings is None:
            raise Conflict(f"job {name!r} is not a secure job", code="not_secure")
        return spec, settings, client_id(acting_client(principal, client))

    def secure_status(self, principal: Principal, name: str, client: Any, after: tuple[int, str] | None, wait_s: float,
                      done: Callable[[dict[str, Any] | None, BaseException | None], None]) -> None:
        """(On the loop.) The secure round's stage, and what ``client`` needs at it: its
        neighbours' keys (share), the shares sent to it (collect), the unmask request (unmask);
        with ``after`` (the round and stage the client saw), once the round moved past it or
        ``wait_s`` ended (a long poll: one call per stage)."""
        def checked(found: tuple[JobSpec, str, SecureRound | None] | None, error: BaseException | None) -> None:
            if error is not None:
                done(None, error)
                return
            assert found is not None
            spec, acting, seen = found

            def view(r: SecureRound | None, error: BaseException | None) -> None:
                if error is not None:
                    done(None, error)
                else:
                    self.loop.offload(lambda: self._secure_view(r, acting, spec), done)

            if after is None:
                view(seen, None)
            else:
                self.stages.wait(name, after, seen, wait_s, view)

        def read() -> tuple[JobSpec, str, SecureRound | None]:
            spec, _, acting = self._secure_job(principal, name, client)
            return spec, acting, self.secure.round(name)

        self.loop.offload(read, checked)

    def secure_message(self, principal: Principal, name: str, call: str, read_body: Callable[[], Any],
                       done: Callable[[dict[str, Any] | None, BaseException | None], None]) -> None:
        """(On the loop.) A client's message for a stage of the job's secure round: ``call``
        "keys", "shares", "signature" or "answer", its JSON body read (off the loop) by
        ``read_body``. Answered with the round's view, or, if the body has ``wait_s``, once the
        round moved past the message's stage (or ``wait_s`` ended): the message and the wait for
        the next stage are one call."""
        if call not in self._secure_messages:
            raise BadRequest(f"a secure call is status, {', '.join(self._secure_messages)}, not {call!r}",
                             code="bad_secure_call")
        stage, act = self._secure_messages[call]

        def take() -> tuple[SecureRound, str, JobSpec, float]:
            body = _object(read_body(), f"a secure {call} message")
            _, wait_s = stage_wait_params(None, None, body.pop("wait_s", 0))
            return *act(principal, name, body), wait_s

        def acted(found: tuple[SecureRound, str, JobSpec, float] | None, error: BaseException | None) -> None:
            if error is not None:
                done(None, error)
                return
            assert found is not None
            r, client, spec, wait_s = found

            def view(now: SecureRound | None, error: BaseException | None) -> None:
                if error is not None:
                    done(None, error)
                else:
                    self.loop.offload(lambda: self._secure_view(now, client, spec), done)

            self.stages.wait(name, (r.round, stage), r, wait_s, view)

        self.loop.offload(take, acted)

    def _secure_advertise(self, principal: Principal, name: str, body: dict[str, Any]) -> tuple[SecureRound, str, JobSpec]:
        """A client's three public keys for the job's current secure round (the first starts it)."""
        spec, settings, client = self._secure_job(principal, name, body.get("client"))
        keys = PublicKeys(*(_hex(body, f"{kind}_key", "bad_key") for kind in PublicKeys._fields))
        return self.secure.advertise(name, settings, spec.goal, client, keys), client, spec

    def _secure_share(self, principal: Principal, name: str, body: dict[str, Any]) -> tuple[SecureRound, str, JobSpec]:
        spec, settings, client = self._secure_job(principal, name, body.get("client"))
        shares = body.get("shares")
        if not isinstance(shares, dict):
            raise BadRequest("'shares' must be an object: neighbour -> sealed shares (hex)", code="bad_shares")
        sealed = {str(peer): _hex(shares, peer, "bad_shares") for peer in shares}
        return self.secure.share(name, settings, client, sealed), client, spec

    def _secure_sign(self, principal: Principal, name: str, body: dict[str, Any]) -> tuple[SecureRound, str, JobSpec]:
        """A survivor's signature of the round's survivor list (the consistency stage)."""
        spec, settings, client = self._secure_job(principal, name, body.get("client"))
        return self.secure.sign(name, settings, client, _hex(body, "signature", "bad_signature")), client, spec

    def _secure_answer(self, principal: Principal, name: str, body: dict[str, Any]) -> tuple[SecureRound, str, JobSpec]:
        spec, _, client = self._secure_job(principal, name, body.get("client"))
        shares = body.get("shares")
        if not isinstance(shares, dict) or not all(isinstance(v, dict) for v in shares.values()):
            raise BadRequest("'shares' must be an object: client -> {\"kind\": \"self\" or \"key\", \"share\": hex}",
                             code="bad_answer")
        answer = {str(t): (str(v.get("kind")), _hex(v, "share", "bad_answer")) for t, v in shares.items()}
        return self.secure.answer(name, client, answer), client, spec

    def _secure_view(self, r: SecureRound | None, client: str, spec: JobSpec) -> dict[str, Any]:
        settings = spec.secure
        assert settings is not None
        if r is None:
            return {"job": spec.job, "client": client, "round": None, "stage": None}
        view: dict[str, Any] = {"job": r.job, "client": client, "round": r.round, "stage": r.stage, "seed": r.seed.hex(),
                                "clients": r.capacity, "k": r.k, "threshold": r.threshold, "deadline_ms": r.deadline_ms,
                                "stage_timeout_s": settings.stage_timeout_s, "fixed_point": spec.fixed_point}
        if spec.strategy_spec.clips_on_client:  # dp_fedavg: each client clips its change before masking it
            view["clip"] = {"norm": spec.strategy_spec.param("clipping_norm"), "weighted": spec.strategy_spec.param("weighted")}
        if r.stage == ABANDONED:
            view["why"] = r.why
        elif r.stage == SHARE:
            with contextlib.suppress(LiflError):  # a client not in the round sees the stage only
                _, peers = self.secure.peers(r.job, client, at=r)
                view["peers"] = {p: {"point": point, "mask_key": mask.hex(), "share_key": share.hex()}
                                 for p, (point, mask, share) in peers.items()}
        elif r.stage == COLLECT:
            with contextlib.suppress(LiflError):
                _, inbox = self.secure.inbox(r.job, client, at=r)
                view["inbox"] = {p: blob.hex() for p, blob in inbox.items()}
        elif r.stage == CONSISTENCY:
            _, request = self.secure.request(r.job, at=r)
            view["survivors"] = sorted(request.survivors)
        elif r.stage == UNMASK:
            _, request = self.secure.request(r.job, at=r)
            view["request"] = {"survivors": sorted(request.survivors), "dropped": sorted(request.dropped)}
            view["signatures"] = {c: {"key": key.hex(), "signature": signature.hex()}
                                  for c, (key, signature) in self.secure.signatures(r).items()}
            view["signatures_needed"] = r.signatures
        return view

    def assignment(self, principal: Principal, name: str, client: Any) -> dict[str, Any]:
        """The node whose gateway ``client`` should send this round's update to (paper §5.1):
        the round's placement plan, made once per round by whichever gateway is asked first."""
        self.authorized_job(principal, Action.ASSIGNMENT, name)
        client = client_id(acting_client(principal, client))
        for _ in range(ASSIGN_ATTEMPTS):  # the round may move on between reading it and assigning
            job = self.state.job(name)
            if job.version == NO_MODEL:
                raise Conflict(f"job {name!r} has no model yet", code="no_model")
            shard = self.state.shard(name)
            gateways = self.state.gateways()
            live = [n for n in gateways if n not in shard.dead]
            if not live:
                raise Overloaded("no node is up to take updates", code="no_nodes")
            if shard.plan is None and shard.round == job.round:
                self.state.set_plan(name, job.round, self._plan(job, live))
            node = self.state.assign(name, job.round, client, live)
            if node is not None:
                return {"job": name, "client": client, "round": job.round, "version": job.version, "node": node,
                        **gateways[node]}
        raise Overloaded(f"the rounds of job {name!r} move on too fast to assign a node; retry", code="assign_retry")

    def _plan(self, job: Job, live: list[str]) -> dict[str, Any]:
        capacities, loads = self.state.capacities(), self.state.loads()
        nodes = [NodeLoad(n, capacities.get(n, self.capacity), loads.get(n, 0.0)) for n in sorted(live)]
        expected = math.ceil(job.spec.goal * job.spec.over_selection)
        plan = plan_round(expected, nodes, policy=self.placement, fan_in=job.leaf_fan_in, reuse=True)
        return {"policy": plan.policy, "quotas": [[n, q] for n, q in plan.quotas.items()], "top": plan.top}

    # -- blobs ---------------------------------------------------------------------------------
    def begin_update(self, principal: Principal, job_name: str, fields: dict[str, Any], protocol: str,
                     expected_size: int | None, done: Callable[[Ingest | None, BaseException | None], None]) -> None:
        """Check what can be checked before the first byte of the blob, then ``done(ingest)``
        to receive it: ``fields`` are the update's metadata as sent (client, samples,
        base_version, lease). From the job cache when it has the job (see JobCache)."""

        authorized = False

        def check(job: Job, fresh: bool) -> Ingest:
            nonlocal authorized
            authorize(principal, Action.PUSH_UPDATE, tenant=job.spec.tenant, job=job_name)  # not the job's refusals
            authorized = True
            meta = UpdateMeta.parse(principal, job_name, **fields)
            if meta.samples > job.spec.sample_cap:
                raise Unprocessable(f"X-Lifl-Samples {meta.samples} exceeds the job's max_samples ({job.spec.sample_cap})",
                                    code="too_many_samples")
            if job.version == NO_MODEL or job.model_spec is None:
                if not fresh:
                    raise _Recheck(job_name)
                raise Conflict(f"job {meta.job!r} has no model yet", code="no_model")
            behind = job.version - meta.base_version
            allowed = self.jobs.max_staleness(job)
            if behind < 0 and not fresh:
                pass  # trained from a version the cache has not seen yet: the agent's admission decides
            elif not 0 <= behind <= allowed:
                if not fresh:
                    raise _Recheck(job_name)
                raise stale(meta.base_version, job.version, allowed)
            spec, fixed_point = job.blob_spec(self.node), job.spec.fixed_point_spec
            if job.spec.secure_aggregation and spec is not None and fixed_point is not None:
                # a masked input (lifl.secagg.plain_input): laid out as the round's fixed-point partial sums
                return Ingest(self, "update", meta.job, protocol, partial_spec(spec, fixed_point), job.spec.max_update_bytes,
                              expected_size, meta=meta, masked=True)
            return Ingest(self, "update", meta.job, protocol, spec, job.spec.max_update_bytes, expected_size, meta=meta)

        def checked(ingest: Ingest | None, error: BaseException | None) -> None:
            if authorized and isinstance(error, LiflError):  # the job's refusal: counted in its round first
                self.count_rejection(job_name, protocol, error.code, counted_by_agent=False, then=lambda: done(None, error))
            else:
                done(ingest, error)

        self._with_job(job_name, check, checked)

    def update_limit(self, principal: Principal, job_name: str, done: Callable[[int | None, BaseException | None], None]) -> None:
        """The most bytes an update of the job may have, for a caller that may push to it."""

        def check(job: Job, fresh: bool) -> int:
            authorize(principal, Action.PUSH_UPDATE, tenant=job.spec.tenant, job=job_name)
            return job.spec.max_update_bytes

        self._with_job(job_name, check, done)

    def begin_model(self, principal: Principal, job_name: str, protocol: str, expected_size: int | None,
                    done: Callable[[Ingest | None, BaseException | None], None]) -> None:
        """A job's first model (the agent refuses it if the job has one: the cache may not know)."""

        def check(job: Job, fresh: bool) -> Ingest:
            authorize(principal, Action.SET_MODEL, tenant=job.spec.tenant, job=job_name)
            if job.version != NO_MODEL:  # a model is never unset
                raise Conflict(f"job {job_name!r} already has a model", code="model_exists")
            return Ingest(self, "model", job_name, protocol, None, job.spec.max_update_bytes, expected_size)

        self._with_job(job_name, check, done)

    def begin_partial(self, principal: Principal, job_name: str, meta: PartialMeta, expected_size: int | None,
                      done: Callable[[Ingest | None, BaseException | None], None]) -> None:
        """Another node's result of a round, for the top aggregator on this node."""

        def check(job: Job, fresh: bool) -> Ingest:
            authorize(principal, Action.INTERNAL, tenant=job.spec.tenant, job=job_name)
            if job.model_spec is None:
                if not fresh:
                    raise _Recheck(job_name)
                raise Conflict(f"job {job_name!r} has no model yet", code="no_model")
            spec = partial_spec(job.model_spec, job.spec.fixed_point_spec, job.spec.float_accumulator) if meta.partial else job.model_spec
            limit = spec.data_bytes + fmt.MAX_HEADER_BYTES
            return Ingest(self, "partial", job_name, "internal", spec, limit, expected_size, partial=meta)

        self._with_job(job_name, check, done)

    def open_model(self, principal: Principal, job_name: str, done: Callable[[ModelView | None, BaseException | None], None]) -> None:
        """The job's current model, from this node's memory; a model installed on another node is
        fetched from its gateway once per version (one copy per hop, on the pool) and served from
        here after."""

        def authorized(_: Any, error: BaseException | None) -> None:
            if error is not None:
                done(None, error)
            else:
                self._open_anywhere(job_name, FETCH_ATTEMPTS, done)

        self._with_job(job_name, lambda job, fresh: authorize(principal, Action.READ_MODEL, tenant=job.spec.tenant,
                                                               job=job_name), authorized)

    def _open_anywhere(self, job_name: str, fetches: int, done: Callable[[ModelView | None, BaseException | None], None]) -> None:
        def opened(view: ModelView | None, error: BaseException | None) -> None:
            if not (isinstance(error, NotFound) and error.code in ("model_elsewhere", "model_split")):
                done(view, error)
                return
            if not fetches:
                done(None, Overloaded(f"the model of job {job_name!r} changes faster than it can be fetched; retry",
                                      code="model_moving"))
                return

            def fetched(_: Any, error: BaseException | None) -> None:
                if error is not None:
                    done(None, error)
                else:
                    self._open_anywhere(job_name, fetches - 1, done)

            if error.code == "model_split":
                copy = functools.partial(assemble_replica, self, job_name)
            else:
                copy = functools.partial(fetch_replica, self, job_name, error.extra["node"])
            self.loop.offload(lambda: self._replicate_once(job_name, error.code, copy), fetched, SLOW_POOL)

        self.open_local_model(job_name, opened)

    def open_part(self, principal: Principal, job_name: str, done: Callable[[ModelView | None, BaseException | None], None],
                  *, internal: bool = False) -> None:
        """This node's part of the current model of a job split across nodes (lifl.shards): what
        the SDK downloads from each node, and peers assemble the whole model from."""

        def authorized(_: Any, error: BaseException | None) -> None:
            if error is not None:
                done(None, error)
                return

            def opened(reply: Reply | None, error: BaseException | None) -> None:
                if error is not None or reply is None:
                    done(None, error)
                    return
                ref = ModelRef(self.agent, reply[0], reply[1][0])
                view = ref.view()
                ref.retire()  # given back once sent: parts are not shared between downloads
                done(view, None)

            self.agent.request(OpenModel(job_name, part=True), done=opened)

        action = Action.INTERNAL if internal else Action.READ_MODEL
        self._with_job(job_name, lambda job, fresh: authorize(principal, action, tenant=job.spec.tenant, job=job_name),
                       authorized)

    def parts(self, principal: Principal, job_name: str) -> dict[str, Any]:
        """(Blocking.) Where each part of a job split across nodes is: what the SDK sends each
        node of an update, and downloads from it."""
        job = self.state.job(job_name)
        authorize(principal, Action.READ_MODEL, tenant=job.spec.tenant, job=job_name)
        split = job.split
        if split is None or job.model_spec is None:
            raise NotFound(f"job {job_name!r} is not split across nodes" + ("" if job.model_spec else " (it has no model yet)"),
                           code="not_split")
        gateways = self.state.gateways()
        return {"job": job_name, "version": job.version, "model": job.model_spec.to_json(), "cut": list(shards.split_cut(job.parts)),
                "parts": [{"node": p.node, "gateway": gateways.get(p.node), "shards": [p.first, p.stop],
                           "data": [p.data_begin, p.data_end]} for p in split[1]]}

    def open_peer_model(self, principal: Principal, job_name: str,
                        done: Callable[[ModelView | None, BaseException | None], None]) -> None:
        """What a peer gateway fetches: the model if this node holds it (``model_elsewhere`` otherwise)."""

        def authorized(_: Any, error: BaseException | None) -> None:
            if error is not None:
                done(None, error)
            else:
                self.open_local_model(job_name, done)

        self._with_job(job_name, lambda job, fresh: authorize(principal, Action.INTERNAL, tenant=job.spec.tenant,
                                                               job=job_name), authorized)

    def open_local_model(self, job_name: str, done: Callable[[ModelView | None, BaseException | None], None]) -> None:
        """The model if this node holds it (``model_elsewhere`` otherwise). Downloads share one
        reference per job while Redis says its version is current and the agent still holds it
        (one read, not a call to the agent and its read); a round event of the job gives it back early."""
        if job_name not in self._models:
            self._open_from_agent(job_name, done)
            return

        def current(version: int | None, error: BaseException | None) -> None:
            shared = self._models.get(job_name)
            if error is None and shared is not None and shared.version == version and shared.held:
                done(shared.view(), None)
            else:
                self._open_from_agent(job_name, done)  # it has the answer (or the error) that counts

        self.loop.offload(lambda: self.state.version(job_name), current)

    def _open_from_agent(self, job_name: str, done: Callable[[ModelView | None, BaseException | None], None]) -> None:
        def opened(reply: Reply | None, error: BaseException | None) -> None:
            if error is not None:
                done(None, error)
                return
            assert reply is not None
            ref = ModelRef(self.agent, reply[0], reply[1][0])
            view = ref.view()
            shared = self._models.get(job_name)
            if shared is None or not shared.held or shared.version <= ref.version:
                self._share(job_name, ref)
            else:
                ref.retire()  # a newer version is shared already: this download only
            done(view, None)

        self.agent.request(OpenModel(job_name), done=opened)

    def _retire_idle_models(self) -> None:
        """Give back the shared model references no download used for ``SHARED_MODEL_IDLE_S``."""
        now = time.monotonic()
        for job in [job for job, ref in self._models.items() if not ref.users and now - ref.last_used >= SHARED_MODEL_IDLE_S]:
            self._share(job, None)

    def _share(self, job_name: str, ref: ModelRef | None) -> None:
        old = self._models.pop(job_name, None)
        if old is not None:
            old.retire()
        if ref is not None:
            self._models[job_name] = ref

    def _replicate_once(self, job_name: str, missing: str, copy: Callable[[], None]) -> None:
        """(On the pool.) ``copy()`` the model to this node (a fetch from the node holding it, or
        an assembly of a split job's parts), unless another copy did meanwhile: the agent no
        longer answers ``missing``. One copy per job at a time; the others then find it here."""
        with self._fetching_lock:
            lock = self._fetching.setdefault(job_name, threading.Lock())
        with lock:
            try:
                reply, fds = self.agent.call(OpenModel(job_name))
                ModelRef(self.agent, reply, fds[0]).retire()
                return
            except NotFound as e:
                if e.code != missing:
                    raise
            copy()

    def count_rejection(self, job: str, protocol: str, code: str, *, counted_by_agent: bool,
                        then: Callable[[], None] = _nothing) -> None:
        """Count an update refused here (on the loop), and in the round's accounting in Redis
        (RefusalCounts) unless the agent does; then ``then()`` on the loop."""
        self.metrics.rejected.labels(protocol, code).inc()
        if counted_by_agent:
            then()  # the agent's abort records it in the round's accounting
        else:
            self.refusals.add(job, code, then)

    def metrics_text(self, principal: Principal | None) -> bytes:
        """The gateway's and the agent's metrics; ``principal`` is None where metrics are open."""
        if principal is not None:
            authorize(principal, Action.METRICS)
        ours = generate_latest(self.metrics.registry)
        try:
            theirs = self.agent.call(GetMetrics())[0].text.encode()
        except (LiflError, OSError):
            theirs = b""
        return ours + theirs


def client_view(job: Job) -> dict[str, Any]:
    """What a client sees of its job: the version to train from and whether its round is open."""
    has_model = job.version != NO_MODEL
    return {"job": job.spec.job, "tenant": job.spec.tenant, "version": job.version if has_model else None,
            "round": {"id": job.round if has_model else None, "version": job.version if has_model else None,
                      "closed": job.closed}}


def send_partial(state: ClusterState, node: str, m: ForwardPartial, fd: int, token: str) -> tuple[int, str]:
    """POST a partial result to the gateway of ``m.node``: (HTTP status, error message)."""
    peer = state.gateway(m.node)
    if peer is None:
        raise ConnectionError(f"node {m.node} has no gateway registered")
    host, _, port = peer["http"].rpartition(":")
    with peer_connection(host, int(port), PEER_TIMEOUT) as sock:  # TLS if this node serves TLS
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        head = (f"POST /v1/internal/jobs/{m.job}/rounds/{m.round}/partials HTTP/1.1\r\nHost: {host}\r\n"
                f"X-Lifl-From-Node: {node}\r\nX-Lifl-Epoch: {m.epoch}\r\nX-Lifl-Samples: {m.samples}\r\n"
                f"X-Lifl-Updates: {m.updates}\r\nX-Lifl-Partial: {int(m.partial)}\r\nContent-Length: {m.size}\r\n"
                f"Authorization: Bearer {token}\r\n"
                f"Connection: close\r\n\r\n")
        sock.sendall(head.encode("latin-1"))
        sendfile_all(sock, fd, m.size, PEER_TIMEOUT)
        response = http.client.HTTPResponse(sock)
        response.begin()
        body = response.read(MAX_ERROR_BODY)
    return response.status, "" if response.status == 202 else _error_text(body)


def peer_query(service: GatewayService, node: str, job_name: str, body: dict[str, Any]) -> dict[str, Any]:
    """``node``'s part of a split query (its answer, with ``_bytes``: how many bytes crossed)."""
    peer = service.state.gateway(node)
    if peer is None:
        raise ConnectionError(f"node {node} has no gateway registered")
    host, _, port = peer["http"].rpartition(":")
    conn = peer_http_connection(host, int(port), PEER_TIMEOUT)  # TLS if this node serves TLS
    try:
        data = json.dumps(body).encode()
        conn.request("POST", f"/v1/internal/jobs/{job_name}/queries", body=data,
                     headers={"Authorization": f"Bearer {service.tokens.internal_token()}",
                              "Content-Type": "application/json"})
        response = conn.getresponse()
        raw = response.read(MAX_PEER_ANSWER + 1)
    finally:
        conn.close()
    if response.status != 200:
        raise ConnectionError(f"node {node} did not compute its part: {_error_text(raw)}")
    if len(raw) > MAX_PEER_ANSWER:
        raise ValueError(f"node {node}'s part exceeds {MAX_PEER_ANSWER} bytes")
    answer = json.loads(raw)
    if not isinstance(answer, dict) or not isinstance(answer.get("partial"), dict) or not isinstance(answer.get("data"), dict):
        raise ValueError(f"node {node} answered something that is not a query's part")
    answer["_bytes"] = len(data) + len(raw)
    return answer


def fetch_replica(service: GatewayService, job_name: str, node: str) -> None:
    """Copy a job's model from ``node``'s gateway into this node's shared memory."""
    peer = service.state.gateway(node)
    if peer is None:
        raise Overloaded(f"node {node}, which holds the model of {job_name!r}, is unreachable", code="model_unreachable")
    job = service.state.job(job_name)
    host, _, port = peer["http"].rpartition(":")
    conn = peer_http_connection(host, int(port), PEER_TIMEOUT)  # TLS if this node serves TLS
    try:
        conn.request("GET", f"/v1/internal/jobs/{job_name}/model",
                     headers={"Authorization": f"Bearer {service.tokens.internal_token()}"})
        response = conn.getresponse()
        if response.status != 200:
            raise Overloaded(f"node {node} did not serve the model of {job_name!r}: {_error_text(response.read(MAX_ERROR_BODY))}",
                             code="model_unreachable")
        version = int(response.getheader("X-Lifl-Version", "-1"))
        length = int(response.getheader("Content-Length", "0"))
        agent = service.agent

        def admit(layout: fmt.Layout) -> tuple[bytes, int]:
            reply, fds = agent.call(AdmitReplica(job_name, version, layout.total_size))
            return reply.key, fds[0]

        sink = BlobSink(limit=job.spec.max_update_bytes, spec=job.model_spec, admit=admit, mappings=service.mappings,
                        layouts=service.layouts, expected_size=length)
        try:
            while not sink.done:
                n = response.readinto(sink.buffer())
                if not n:
                    sink.check_complete()
                sink.advance(n)
            agent.call(InstallReplica(sink.key))  # type: ignore[arg-type]
        except BaseException as e:
            if sink.key is not None:  # given back at once: the agent's connection outlives this fetch
                agent.request(Abort(sink.key, e.code if isinstance(e, LiflError) else "aborted"))
            raise
    finally:
        conn.close()


def assemble_replica(service: GatewayService, job_name: str) -> None:
    """Put a split job's whole model together in this node's shared memory, as a replica: the
    model's header, then each part's data section where it lies (the parts are consecutive ranges
    of the canonical data section). Every part must be of the job's current version; a version
    that moves meanwhile makes the caller try again."""
    job = service.state.job(job_name)
    split = job.split
    if split is None or job.model_spec is None:
        raise NotFound(f"job {job_name!r} is not split across nodes", code="not_split")
    header = fmt.spec_header(job.model_spec)
    agent = service.agent
    reply, fds = agent.call(AdmitReplica(job_name, job.version, len(header) + job.model_spec.data_bytes))
    key = reply.key
    try:
        with os.fdopen(fds[0], "r+b", buffering=0) as replica:
            replica.write(header)
            for part in split[1]:
                replica.seek(len(header) + part.data_begin)
                if part.node == service.node:
                    _copy_own_part(service, job_name, job.version, part.nbytes, replica)
                else:
                    _copy_peer_part(service, job_name, job.version, part.node, part.nbytes, replica)
        agent.call(InstallReplica(key))
    except BaseException as e:
        agent.request(Abort(key, e.code if isinstance(e, LiflError) else "aborted"))
        raise


def _moved(job_name: str, version: int, got: int, node: str) -> Overloaded:
    return Overloaded(f"node {node} has version {got} of {job_name!r}'s part, not {version}: the model moved on; retry",
                      code="model_moving")


def _copy_own_part(service: GatewayService, job_name: str, version: int, nbytes: int, out: Any) -> None:
    reply, fds = service.agent.call(OpenModel(job_name, part=True))
    ref = ModelRef(service.agent, reply, fds[0])
    try:
        if ref.version != version:
            raise _moved(job_name, version, ref.version, service.node)
        prefix = os.pread(ref.fd, fmt.PREFIX_BYTES, 0)
        start = fmt.PREFIX_BYTES + fmt.header_length(prefix)
        if ref.size - start != nbytes:
            raise Internal(f"this node's part of {job_name!r} holds {ref.size - start} bytes, not {nbytes}")
        with os.fdopen(os.dup(ref.fd), "rb", buffering=0) as part:
            part.seek(start)
            _copy_exactly(part, nbytes, out, f"this node's part of {job_name!r}")
    finally:
        ref.retire()


def _copy_peer_part(service: GatewayService, job_name: str, version: int, node: str, nbytes: int, out: Any) -> None:
    peer = service.state.gateway(node)
    if peer is None:
        raise Overloaded(f"node {node}, which holds a part of {job_name!r}, is unreachable", code="model_unreachable")
    host, _, port = peer["http"].rpartition(":")
    conn = peer_http_connection(host, int(port), PEER_TIMEOUT)
    try:
        conn.request("GET", f"/v1/internal/jobs/{job_name}/part",
                     headers={"Authorization": f"Bearer {service.tokens.internal_token()}"})
        response = conn.getresponse()
        if response.status != 200:
            raise Overloaded(f"node {node} did not serve its part of {job_name!r}: "
                             f"{_error_text(response.read(MAX_ERROR_BODY))}", code="model_unreachable")
        got = int(response.getheader("X-Lifl-Version", "-1"))
        if got != version:
            raise _moved(job_name, version, got, node)
        prefix = response.read(fmt.PREFIX_BYTES)
        response.read(fmt.header_length(prefix))
        _copy_exactly(response, nbytes, out, f"node {node}'s part of {job_name!r}")
    finally:
        conn.close()


def _copy_exactly(source: Any, nbytes: int, out: Any, what: str) -> None:
    """``nbytes`` read from ``source`` written to ``out``, ``PART_CHUNK`` at a time."""
    done = 0
    while done < nbytes:
        chunk = source.read(min(PART_CHUNK, nbytes - done))
        if not chunk:
            raise Overloaded(f"{what} ended after {done} of {nbytes} bytes", code="model_unreachable")
        out.write(chunk)
        done += len(chunk)


def _error_text(body: bytes) -> str:
    try:
        return str(json.loads(body)["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return body[:200].decode("latin-1")
