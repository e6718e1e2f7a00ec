"""The gateway's operations, shared by its HTTP and gRPC front ends.

The gateway keeps no state of its own beyond caches: jobs, versions and rounds are in Redis,
objects belong to the node agent. It talks to the agent over per-thread connections, so an
upload in progress belongs to its connection and is released if the gateway dies.
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest

from lifl.gateway.ingest import BlobSink, LayoutCache
from lifl import format as fmt
from lifl.errors import BadRequest, Conflict, LiflError, NotFound
from lifl.jobs import JobSpec
from lifl.control.planner import ROLES
from lifl.rpc import Client
from lifl.state import NO_MODEL, ClusterState
from lifl.store import MappingCache

MAX_CLIENT_ID = 256
MAX_SAMPLES = 1 << 53


class GatewayMetrics:
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


@dataclass
class UpdateMeta:
    job: str
    client: str
    samples: int
    base_version: int
    lease: str = ""

    @classmethod
    def parse(cls, job: str, client: Any, samples: Any, base_version: Any, lease: Any = "") -> UpdateMeta:
        """Validate the client-supplied fields, naming the HTTP header each comes from."""
        return cls(job, client_id(client), _integer("X-Lifl-Samples", samples, 1, MAX_SAMPLES),
                   _integer("X-Lifl-Base-Version", base_version, 0, 1 << 62), lease_id(lease or ""))


def client_id(value: Any) -> str:
    if not isinstance(value, str) or not value or len(value) > MAX_CLIENT_ID or not value.isprintable():
        raise BadRequest(f"X-Lifl-Client must be a printable client id of 1-{MAX_CLIENT_ID} characters", code="bad_client")
    return value


def lease_id(value: Any) -> str:
    if not isinstance(value, str) or len(value) > 64 or any(c not in "0123456789abcdef" for c in value):
        raise BadRequest("a lease id is at most 64 lowercase hex digits", code="bad_lease")
    return value


def _integer(name: str, value: Any, low: int, high: int) -> int:
    if isinstance(value, str):
        text = value.strip()
        if not text.isdigit():
            raise BadRequest(f"{name} must be an integer in [{low}, {high}], got {value[:32]!r}", code="bad_header")
        value = int(text)
    if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
        raise BadRequest(f"{name} must be an integer in [{low}, {high}]", code="bad_header")
    return value


class Ingest:
    """One blob being received: ``sink`` takes the bytes, ``finish`` hands the object over."""

    def __init__(self, service: GatewayService, kind: str, job: str, protocol: str, meta: UpdateMeta | None,
                 spec: fmt.ModelSpec | None, limit: int, expected_size: int | None) -> None:
        self.service, self.kind, self.job, self.protocol, self.meta = service, kind, job, protocol, meta
        self.agent = service.agent()
        self.started = time.perf_counter()
        self.version: int | None = None
        self.sink = BlobSink(limit=limit, spec=spec, admit=self._admit, mappings=service.mappings,
                             layouts=service.layouts, expected_size=expected_size)

    def _admit(self, layout: fmt.Layout) -> tuple[bytes, int]:
        if self.kind == "model":
            reply, fds = self.agent.call("admit_model", job=self.job, size=layout.total_size)
        else:
            assert self.meta is not None
            reply, fds = self.agent.call("admit", job=self.job, version=self.meta.base_version, size=layout.total_size,
                                         lease=self.meta.lease)
            self.version = reply["version"]
        return bytes.fromhex(reply["key"]), fds[0]

    def finish(self) -> dict[str, Any]:
        self.sink.check_complete()
        key = self.sink.key
        assert key is not None and self.sink.total is not None
        m = self.service.metrics
        m.bytes_in.labels(self.protocol).inc(self.sink.total)
        if self.kind == "model":
            reply, _ = self.agent.call("install_model", key=key.hex())
            return {"version": reply["version"]}
        assert self.meta is not None
        self.agent.call("submit", key=key.hex(), samples=self.meta.samples, client=self.meta.client)
        m.arrivals.labels(self.job, self.protocol).inc()
        m.ingest.labels(self.protocol).observe(time.perf_counter() - self.started)
        return {"key": key.hex(), "version": self.version}

    def abort(self, error: LiflError | None) -> None:
        """Give the object back (if one was admitted) and count the refusal."""
        reason = error.code if error else "aborted"
        if self.sink.key is not None:
            try:
                self.agent.call("abort", key=self.sink.key.hex(), reason=reason)
            except (LiflError, OSError, EOFError):
                pass
        if self.kind == "update":
            self.service.count_rejection(self.job, self.protocol, reason, counted_by_agent=self.sink.key is not None)


class ModelView:
    """A read reference to a job's current model; release it when sent."""

    def __init__(self, agent: Client, reply: dict[str, Any], fd: int) -> None:
        self.agent, self.fd = agent, fd
        self.key, self.version, self.size = reply["key"], reply["version"], reply["size"]

    def release(self) -> None:
        os.close(self.fd)
        self.agent.call("release", key=self.key)


class GatewayService:
    def __init__(self, node: str, state: ClusterState, agent_socket: str) -> None:
        self.node = node
        self.state = state
        self.agent_socket = agent_socket
        self.mappings = MappingCache()
        self.layouts = LayoutCache()
        self.metrics = GatewayMetrics()
        self._local = threading.local()

    def agent(self) -> Client:
        client = getattr(self._local, "agent", None)
        if client is None:
            client = self._local.agent = Client.connect(self.agent_socket, {"role": "gateway"})
        return client

    def close_thread(self) -> None:
        """Close the calling thread's agent connection (its connection handler is ending)."""
        client = getattr(self._local, "agent", None)
        if client is not None:
            client.close()
            self._local.agent = None

    # -- jobs ----------------------------------------------------------------------------------
    def create_job(self, body: Any) -> dict[str, Any]:
        spec = JobSpec.from_request(body)
        self.state.create_job(spec)
        return self.job_status(spec.job)

    def job_status(self, name: str) -> dict[str, Any]:
        job = self.state.job(name)
        has_model = job.version != NO_MODEL
        aggregators = dict.fromkeys(ROLES, 0)
        queued = 0
        for status in self.state.nodes().values():
            counts = status.get("jobs", {}).get(name, {})
            for role in ROLES:
                aggregators[role] += counts.get(role, 0)
            queued += counts.get("queued", 0)
        return {
            "job": name,
            "tenant": job.spec.tenant,
            "goal": job.spec.goal,
            "leaf_fan_in": job.spec.leaf_fan_in,
            "max_update_bytes": job.spec.max_update_bytes,
            "max_inflight": job.spec.inflight_budget,
            "round_deadline_s": job.spec.round_deadline_s or None,
            "min_updates": job.spec.min_updates,
            "lease_ttl_s": job.spec.lease_ttl_s,
            "over_selection": job.spec.over_selection,
            "version": job.version if has_model else None,
            "round": {
                "id": job.round if has_model else None,
                "version": job.version if has_model else None,
                "opened_at": job.round_opened if has_model else None,
                "closed": job.closed,
                "received": job.accepted,
                "in_progress": job.reserved - job.accepted,
                "aggregated": job.aggregated,
                "leases": self.state.active_leases(name),
                "rejected": job.rejected,
            },
            "queued": queued,
            "aggregators": aggregators,
            "last_round": job.last_round,
            "model": {"node": job.model_node, "key": job.model_key, "checkpoint": job.checkpoint} if has_model else None,
        }

    def rounds(self, name: str, limit: int) -> list[dict[str, Any]]:
        return self.state.rounds(name, limit)

    # -- leases --------------------------------------------------------------------------------
    def take_lease(self, name: str, client: Any) -> dict[str, Any]:
        """A place in the current round for a client about to train, kept by heartbeats."""
        client_id(client)
        spec = self.state.job(name).spec
        lease, version, round_id = self.state.take_lease(spec)
        return {"lease": lease, "version": version, "round": round_id, "ttl_s": spec.lease_ttl_s}

    def heartbeat(self, name: str, lease: str) -> dict[str, Any]:
        spec = self.state.job(name).spec
        if not self.state.heartbeat(spec, lease_id(lease)):
            raise NotFound(f"lease {lease} of job {name!r} has lapsed or does not exist", code="no_such_lease")
        return {"lease": lease, "ttl_s": spec.lease_ttl_s}

    def release_lease(self, name: str, lease: str) -> None:
        self.state.job(name)
        if not self.state.release_lease(name, lease_id(lease)):
            raise NotFound(f"lease {lease} of job {name!r} has lapsed or does not exist", code="no_such_lease")

    # -- blobs ---------------------------------------------------------------------------------
    def begin_update(self, meta: UpdateMeta, protocol: str, expected_size: int | None) -> Ingest:
        """Check what can be checked before the first byte of the blob, then receive it."""
        try:
            job = self.state.job(meta.job)
            if job.version == NO_MODEL or job.model_spec is None:
                raise Conflict(f"job {meta.job!r} has no model yet", code="no_model")
            if meta.base_version != job.version:
                raise Conflict(
                    f"update was trained from version {meta.base_version}, the current version is {job.version}",
                    code="version_conflict", extra={"version": job.version},
                )
            return Ingest(self, "update", meta.job, protocol, meta, job.model_spec, job.spec.max_update_bytes, expected_size)
        except LiflError as e:
            self.count_rejection(meta.job, protocol, e.code, counted_by_agent=False)
            raise

    def begin_model(self, job_name: str, protocol: str, expected_size: int | None) -> Ingest:
        job = self.state.job(job_name)
        if job.version != NO_MODEL:
            raise Conflict(f"job {job_name!r} already has a model", code="model_exists")
        return Ingest(self, "model", job_name, protocol, None, None, job.spec.max_update_bytes, expected_size)

    def open_model(self, job_name: str) -> ModelView:
        agent = self.agent()
        reply, fds = agent.call("open_model", job=job_name)
        return ModelView(agent, reply, fds[0])

    def count_rejection(self, job: str, protocol: str, code: str, *, counted_by_agent: bool) -> None:
        self.metrics.rejected.labels(protocol, code).inc()
        if counted_by_agent:
            return  # the agent's abort recorded it in the round's accounting
        try:
            self.state.count(job, self.state.job(job).round, f"rejected.{code}")
        except LiflError:
            pass  # no such job: nothing to account it to

    def metrics_text(self) -> bytes:
        ours = generate_latest(self.metrics.registry)
        try:
            theirs = self.agent().call("metrics")[0]["text"].encode()
        except (LiflError, OSError, EOFError):
            theirs = b""
        return ours + theirs
