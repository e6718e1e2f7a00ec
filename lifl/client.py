"""The lifl client SDK (docs/client.md): talk to a gateway over HTTP or gRPC, convert models to
and from the update format, and take part in synchronous FL rounds.

- ``Gateway`` wraps one connection. Blobs are sent without extra copies: over HTTP the body
  is written straight from the caller's buffer, and over gRPC the HTTP/2 frames point into it
  too (``lifl.grpcwire``; other calls use grpcio). Errors come
  back as the ``LiflError`` subclasses the gateway raised, with code, message and ``version``.
- ``to_blob`` / ``from_blob`` convert torch ``state_dict``s and dicts of numpy arrays; tensors
  are read in place (CPU tensors are not copied before serialising) and come back as views
  of the received blob.
- ``Participant`` is one client's side of a round: lease, pull, train (heartbeats keep the
  lease meanwhile), push; it honours Retry-After and reports 409s as "retrain".
"""

from __future__ import annotations

import http.client
import json
import random
import threading
import time
import urllib.parse
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from lifl import errors
from lifl import format as fmt
from lifl.grpcwire import STATUS_NAMES, GrpcStatusError, UploadConnection, chunk_messages

GRPC_CHUNK = 1 << 20
_BY_STATUS = {400: errors.BadRequest, 404: errors.NotFound, 409: errors.Conflict, 413: errors.PayloadTooLarge,
              422: errors.Unprocessable, 503: errors.Overloaded}
_BY_GRPC = {"INVALID_ARGUMENT": errors.BadRequest, "NOT_FOUND": errors.NotFound, "ALREADY_EXISTS": errors.Conflict,
            "ABORTED": errors.Conflict, "RESOURCE_EXHAUSTED": errors.Overloaded, "UNIMPLEMENTED": errors.BadRequest}


def _error(status: int, body: bytes, retry_after: str | None) -> errors.LiflError:
    try:
        info = json.loads(body)["error"]
    except (ValueError, KeyError, TypeError):
        info = {"code": "http_error", "message": body[:200].decode("latin-1")}
    extra = {k: v for k, v in info.items() if k not in ("code", "message")}
    cls = _BY_STATUS.get(status, errors.Internal)
    if cls is errors.Overloaded:
        return errors.Overloaded(info["message"], retry_after=float(retry_after or 1), code=info["code"])
    return cls(info["message"], code=info["code"], extra=extra)


class Gateway:
    """One client connection to a gateway. ``address`` is ``host:port`` of its HTTP API, or of
    its gRPC API with ``protocol="grpc"``."""

    def __init__(self, address: str, protocol: str = "http", timeout: float = 300.0) -> None:
        if protocol not in ("http", "grpc"):
            raise ValueError(f"protocol must be 'http' or 'grpc', got {protocol!r}")
        self.protocol = protocol
        address = address.removeprefix("http://")
        if protocol == "http":
            host, _, port = address.rpartition(":")
            self._http = http.client.HTTPConnection(host, int(port), timeout=timeout)
        else:
            import grpc

            from lifl.gateway import lifl_pb2

            self._pb = lifl_pb2
            self._channel = grpc.insecure_channel(address, options=[("grpc.max_receive_message_length", 64 << 20)])
            self._address = address
            self._uploads: UploadConnection | None = None  # blob streams go over lifl's own framing

    def close(self) -> None:
        if self.protocol == "http":
            self._http.close()
        else:
            self._channel.close()
            if self._uploads is not None:
                self._uploads.close()

    # -- HTTP -----------------------------------------------------------------------------------
    def _request(self, method: str, path: str, body: Any = None, headers: dict[str, str] | None = None) -> tuple[int, dict[str, str], bytes]:
        for attempt in (0, 1):  # one retry if a kept-alive connection was closed by the server
            try:
                self._http.request(method, path, body=body, headers=headers or {})
                r = self._http.getresponse()
                length = r.getheader("Content-Length")
                if r.status < 400 and length and length.isdigit():  # into a writable buffer, in one go
                    data = bytearray(int(length))
                    view, got = memoryview(data), 0
                    while got < len(data) and (n := r.readinto(view[got:])):
                        got += n
                    if got != len(data):
                        raise http.client.IncompleteRead(bytes(data[:got]), len(data) - got)
                    r.read()
                else:
                    data = r.read()
                if r.status >= 400:
                    raise _error(r.status, data, r.getheader("Retry-After"))
                return r.status, dict(r.getheaders()), data
            except (http.client.RemoteDisconnected, BrokenPipeError, ConnectionResetError):
                self._http.close()
                if attempt:
                    raise
        raise AssertionError("unreachable")

    def _json(self, method: str, path: str, body: Any = None) -> Any:
        data = json.dumps(body).encode() if body is not None else None
        return json.loads(self._request(method, path, data, {"Content-Type": "application/json"})[2])

    # -- gRPC -----------------------------------------------------------------------------------
    def _rpc(self, method: str, deserializer: Any, request: bytes) -> Any:
        import grpc

        try:
            return self._channel.unary_unary(f"/lifl.v1.Gateway/{method}", response_deserializer=deserializer)(request)
        except grpc.RpcError as e:
            raise self._grpc_error(e) from None

    def _upload(self, method: str, meta: bytes, blob: bytes | bytearray | memoryview) -> bytes:
        """A blob stream, its bytes sent straight from ``blob`` (lifl.grpcwire)."""
        for attempt in (0, 1):  # one retry on a fresh connection if the kept one was closed
            try:
                if self._uploads is None:
                    self._uploads = UploadConnection(self._address)
                return self._uploads.call(f"/lifl.v1.Gateway/{method}", chunk_messages(meta, blob, GRPC_CHUNK))
            except GrpcStatusError as e:
                raise self._status_error(STATUS_NAMES.get(e.status, "UNKNOWN"), e.message, e.trailers) from None
            except (ConnectionError, BrokenPipeError):
                self._uploads.close()
                self._uploads = None
                if attempt:
                    raise
        raise AssertionError("unreachable")

    @classmethod
    def _grpc_error(cls, e: Any) -> errors.LiflError:
        return cls._status_error(e.code().name, urllib.parse.unquote(e.details() or ""), dict(e.trailing_metadata() or ()))

    @staticmethod
    def _status_error(status: str, message: str, trailers: dict[str, str]) -> errors.LiflError:
        code = trailers.get("lifl-error-code", "grpc_error")
        cls = _BY_GRPC.get(status, errors.Internal)
        if cls is errors.Overloaded:
            return errors.Overloaded(message, retry_after=int(trailers.get("grpc-retry-pushback-ms", 1000)) / 1000, code=code)
        extra = {"version": int(trailers["lifl-version"])} if "lifl-version" in trailers else {}
        return cls(message, code=code, extra=extra)

    # -- operations -----------------------------------------------------------------------------
    def create_job(self, job: str, goal: int, **options: Any) -> dict[str, Any]:
        if self.protocol == "http":
            return self._json("POST", "/v1/jobs", {"job": job, "goal": goal, **options})
        req = self._pb.CreateJobRequest(job=job, goal=goal, **options)
        self._rpc("CreateJob", self._pb.JobStatus.FromString, req.SerializeToString())
        return self.job(job)

    def job(self, job: str) -> dict[str, Any]:
        if self.protocol == "http":
            return self._json("GET", f"/v1/jobs/{job}")
        status = self._rpc("GetJob", self._pb.JobStatus.FromString, self._pb.GetJobRequest(job=job).SerializeToString())
        return _status_dict(status)

    def set_model(self, job: str, blob: bytes | memoryview) -> int:
        """Set the initial global model; returns its version (0)."""
        if self.protocol == "http":
            return json.loads(self._request("PUT", f"/v1/jobs/{job}/model", memoryview(blob))[2])["version"]
        meta = self._pb.ModelMeta(job=job, size=len(blob)).SerializeToString()
        return self._pb.SetModelReply.FromString(self._upload("SetModel", meta, blob)).version

    def model(self, job: str) -> tuple[int, bytes]:
        """(version, blob) of the current global model."""
        if self.protocol == "http":
            _, headers, data = self._request("GET", f"/v1/jobs/{job}/model")
            return int(headers["X-Lifl-Version"]), data
        import grpc

        try:
            parts = list(self._channel.unary_stream("/lifl.v1.Gateway/GetModel", response_deserializer=self._pb.ModelChunk.FromString)(
                self._pb.GetModelRequest(job=job).SerializeToString()))
        except grpc.RpcError as e:
            raise self._grpc_error(e) from None
        return parts[0].meta.version, b"".join(p.data for p in parts)

    def push(self, job: str, blob: bytes | memoryview, *, client: str, samples: int, base_version: int, lease: str = "") -> dict[str, Any]:
        """Send one update; returns {"key", "version"}."""
        if self.protocol == "http":
            headers = {"X-Lifl-Client": client, "X-Lifl-Samples": str(samples), "X-Lifl-Base-Version": str(base_version)}
            if lease:
                headers["X-Lifl-Lease"] = lease
            return json.loads(self._request("POST", f"/v1/jobs/{job}/updates", memoryview(blob), headers)[2])
        meta = self._pb.UpdateMeta(job=job, client=client, samples=samples, base_version=base_version, size=len(blob), lease=lease)
        reply = self._pb.PushUpdateReply.FromString(self._upload("PushUpdate", meta.SerializeToString(), blob))
        return {"key": reply.key, "version": reply.version}

    def metrics(self) -> str:
        """The gateway's Prometheus exposition (HTTP only)."""
        return self._request("GET", "/metrics")[2].decode()

    def take_lease(self, job: str, client: str) -> dict[str, Any]:
        """A place in the current round: {"lease", "version", "round", "ttl_s"}."""
        if self.protocol == "http":
            return self._json("POST", f"/v1/jobs/{job}/leases", {"client": client})
        return self._lease_rpc("TakeLease", self._pb.TakeLeaseRequest(job=job, client=client))

    def heartbeat(self, job: str, lease: str) -> dict[str, Any]:
        if self.protocol == "http":
            return self._json("PUT", f"/v1/jobs/{job}/leases/{lease}")
        return self._lease_rpc("Heartbeat", self._pb.LeaseRequest(job=job, lease=lease))

    def release_lease(self, job: str, lease: str) -> None:
        if self.protocol == "http":
            self._request("DELETE", f"/v1/jobs/{job}/leases/{lease}")
        else:
            self._lease_rpc("ReleaseLease", self._pb.LeaseRequest(job=job, lease=lease))

    def _lease_rpc(self, method: str, request: Any) -> dict[str, Any]:
        lease = self._rpc(method, self._pb.Lease.FromString, request.SerializeToString())
        return {"lease": lease.lease, "version": lease.version, "round": lease.round, "ttl_s": lease.ttl_s}

    def assignment(self, job: str, client: str) -> dict[str, Any]:
        """The node this client should send the current round's update to:
        {"node", "http", "grpc", "round", "version", ...}; any gateway answers."""
        if self.protocol == "http":
            return self._json("GET", f"/v1/jobs/{job}/assignment?client={urllib.parse.quote(client, safe='')}")
        reply = self._rpc("GetAssignment", self._pb.Assignment.FromString,
                          self._pb.AssignmentRequest(job=job, client=client).SerializeToString())
        return {**_dict(reply), "round": reply.round, "version": reply.version}

    def rounds(self, job: str, limit: int = 100) -> list[dict[str, Any]]:
        """The last ``limit`` finished rounds, oldest first."""
        if self.protocol == "http":
            return self._json("GET", f"/v1/jobs/{job}/rounds?limit={limit}")["rounds"]
        reply = self._rpc("GetRounds", self._pb.Rounds.FromString, self._pb.GetRoundsRequest(job=job, limit=limit).SerializeToString())
        return [_round_dict(r) for r in reply.rounds]


def _dict(message: Any) -> dict[str, Any]:
    from google.protobuf.json_format import MessageToDict

    return MessageToDict(message, preserving_proto_field_name=True, always_print_fields_with_no_presence=True)


def _round_dict(r: Any) -> dict[str, Any]:
    """A LastRound message shaped like the HTTP API's JSON (-1 there means none)."""
    out = _dict(r)
    out["new_version"] = None if r.new_version < 0 else r.new_version
    out["samples"] = int(out["samples"])
    out["top"] = r.top or None
    return out


def _status_dict(status: Any) -> dict[str, Any]:
    """A JobStatus message shaped like the HTTP API's JSON."""
    out = _dict(status)
    out["version"] = None if status.version < 0 else status.version
    rnd = out["round"]
    for key in ("id", "version"):
        rnd[key] = None if int(rnd[key]) < 0 else int(rnd[key])
    rnd["top"] = rnd["top"] or None
    out["last_round"] = _round_dict(status.last_round) if status.HasField("last_round") else None
    return out


# -- models <-> update format ----------------------------------------------------------------------


def to_blob(state: Mapping[str, Any], metadata: Mapping[str, str] | None = None) -> bytearray:
    """A torch ``state_dict`` (any device, bf16 included) or a dict of numpy arrays, as an update blob."""
    arrays: dict[str, np.ndarray] = {}
    dtypes: dict[str, str] = {}
    for name, value in state.items():
        if hasattr(value, "detach"):  # a torch tensor: read it in place when it is on the CPU
            import torch

            t = value.detach()
            t = (t.cpu() if t.device.type != "cpu" else t).contiguous()
            if t.dtype == torch.bfloat16:
                arrays[name], dtypes[name] = t.view(torch.int16).numpy().view(np.uint16), "BF16"
            else:
                arrays[name] = t.numpy()
        else:
            arrays[name] = np.asarray(value)
    return fmt.encode(arrays, metadata, dtypes=dtypes)


def from_blob(blob: bytes | bytearray | memoryview, *, as_torch: bool = False) -> dict[str, Any]:
    """The tensors of a blob, as numpy arrays (BF16 as uint16) or torch tensors, viewing the blob's
    bytes (a read-only blob is copied once so that torch may use it)."""
    layout = fmt.validate(blob)
    if not as_torch:
        return fmt.views(blob, layout)
    import torch

    buffer = blob if isinstance(blob, bytearray) else bytearray(blob)
    views = fmt.views(buffer, layout)
    out = {}
    for entry in layout.entries:
        view = views[entry.spec.name]
        if entry.spec.dtype is fmt.BF16:
            out[entry.spec.name] = torch.from_numpy(view.view(np.int16)).view(torch.bfloat16)
        else:
            out[entry.spec.name] = torch.from_numpy(view)
    return out


# -- taking part in rounds -------------------------------------------------------------------------


@dataclass
class RoundResult:
    outcome: str  # "accepted", "stale" (pull and retrain), or "no_slot" (the round is full or closed)
    version: int  # the version trained from (accepted), or the current one
    key: str = ""


class Participant:
    """One client's side of synchronous FL rounds.

    ``run_round(train)`` asks any gateway which node to use this round (the cluster's placement)
    and talks to that node's gateway: it takes a lease, pulls the current model, calls
    ``train(state, version)`` (which returns the trained state and its sample count) while a
    thread heartbeats the lease, and pushes the update; it retries on back-pressure, honouring
    Retry-After. ``address`` is the gateway it starts from (and falls back to).
    """

    def __init__(self, address: str, job: str, client: str, *, protocol: str = "http", as_torch: bool = False,
                 max_wait: float = 60.0) -> None:
        self.address, self.job, self.client, self.protocol = address, job, client, protocol
        self.as_torch = as_torch
        self.max_wait = max_wait
        self.bootstrap = Gateway(address, protocol)
        self.gateway = self.bootstrap
        self.gateway_address = address  # the assigned node's, once known

    def close(self) -> None:
        if self.gateway is not self.bootstrap:
            self.gateway.close()
        self.bootstrap.close()

    def _follow_assignment(self) -> None:
        """Use the gateway of the node assigned for this round (the one it had, if unchanged)."""
        try:
            assigned = self.bootstrap.assignment(self.job, self.client)[self.protocol]
        except (errors.LiflError, OSError):
            return  # an older gateway, or none reachable: keep the one in use
        if assigned != self.gateway_address:
            if self.gateway is not self.bootstrap:
                self.gateway.close()
            self.gateway = Gateway(assigned, self.protocol)
            self.gateway_address = assigned

    def run_round(self, train: Callable[[dict[str, Any], int], tuple[Mapping[str, Any], int]]) -> RoundResult:
        self._follow_assignment()
        try:
            lease = self.gateway.take_lease(self.job, self.client)
        except errors.Conflict as e:  # round full or closed: try again for the next one
            return RoundResult("no_slot", e.extra.get("version", -1))
        try:
            version, blob = self.gateway.model(self.job)
            state = from_blob(blob, as_torch=self.as_torch)
            with _Heartbeats(self.gateway_address, self.protocol, self.job, lease):
                trained, samples = train(state, version)
            return self._push(to_blob(trained), samples, version, lease["lease"])
        except errors.Conflict as e:
            return RoundResult("stale", e.extra.get("version", -1))

    def _push(self, blob: bytearray, samples: int, version: int, lease: str) -> RoundResult:
        deadline = time.monotonic() + self.max_wait
        while True:
            try:
                reply = self.gateway.push(self.job, blob, client=self.client, samples=samples, base_version=version, lease=lease)
                return RoundResult("accepted", version, reply["key"])
            except errors.Overloaded as e:
                wait = (e.retry_after or 1.0) * (1 + random.random() * 0.2)
                if time.monotonic() + wait > deadline:
                    raise
                time.sleep(wait)

    def wait_for_version(self, after: int, timeout: float) -> int:
        """Poll (with backoff) until the job's version passes ``after``; returns the version seen."""
        deadline, delay = time.monotonic() + timeout, 0.02
        while True:
            version = self.gateway.job(self.job)["version"]
            if version is not None and version > after or time.monotonic() >= deadline:
                return version
            time.sleep(delay)
            delay = min(delay * 1.5, 1.0)


class _Heartbeats:
    """Renews a lease every third of its lifetime, on a connection of its own, while training."""

    def __init__(self, address: str, protocol: str, job: str, lease: dict[str, Any]) -> None:
        self._args = (address, protocol, job, lease["lease"], max(0.05, lease["ttl_s"] / 3))
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        address, protocol, job, lease, every = self._args
        gateway = Gateway(address, protocol)
        try:
            while not self._stop.wait(every):
                try:
                    gateway.heartbeat(job, lease)
                except errors.NotFound:
                    return  # lapsed: the push will find out whether a slot is still free
        finally:
            gateway.close()

    def __enter__(self) -> _Heartbeats:
        self._thread.start()
        return self

    def __exit__(self, *_: Any) -> None:
        self._stop.set()
        self._thread.join()
