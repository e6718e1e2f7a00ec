"""One client connection to a gateway (``Gateway``), over HTTP or gRPC, and how its calls are
retried (``RetryPolicy``): errors come back as the ``LiflError`` subclasses the gateway raised;
what is safe to retry is retried with bounded exponential back-off, never sooner than the
gateway's Retry-After (docs/client.md, "Faults").

Blob streams over gRPC go through ``lifl.client.grpcwire``, other gRPC calls through grpcio:
both are imported only when a gateway speaks gRPC (the SDK's ``grpc`` extra).
"""

from __future__ import annotations

import http.client
import json
import math
import os
import random
import select
import socket
import ssl
import time
import urllib.parse
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from email.utils import parsedate_to_datetime
from typing import TYPE_CHECKING, Any, TypeVar

from lifl import errors
from lifl.net import tus
from lifl.net.grpc import GrpcStatusError, chunk_messages
from lifl.net.io import ready, sendfile_all
from lifl.net.ranges import parse_content_range
from lifl.net.tls import ClientTls, client_settings, connection_closed, https_connection, server_name

if TYPE_CHECKING:
    from lifl.client.grpcwire import UploadConnection

T = TypeVar("T")

GRPC_CHUNK = 1 << 20
GRPC_MAX_RECEIVE = 64 << 20  # a model downloaded over grpcio arrives in messages of at most this
DEFAULT_RETRY_AFTER_S = 1.0  # when a 503 / RESOURCE_EXHAUSTED / UNAVAILABLE names no (readable) delay
RETRY_AFTER_SPREAD = 0.2  # clients told the same Retry-After come back spread over this fraction of it
BACKOFF_JITTER = 0.5  # the share of each back-off delay that is random ("equal jitter")
SEND_CHUNK = 1 << 20  # bytes of a file sent at a time, between two looks for an early answer (a refusal)
RECEIVE_CHUNK = 1 << 20  # bytes of a download written to its file at a time
# A PATCH that met another of the same upload (its own earlier one, cut short, whose end the
# gateway has not seen yet) or an offset that moved since HEAD: ask HEAD again, after a back-off.
_PATCH_RETRIES = frozenset({"upload_busy", "offset_mismatch", "no_such_upload"})

_BY_STATUS = {400: errors.BadRequest, 401: errors.Unauthenticated, 403: errors.Forbidden, 404: errors.NotFound,
              409: errors.Conflict, 412: errors.PreconditionFailed, 413: errors.PayloadTooLarge,
              415: errors.UnsupportedMediaType, 416: errors.RangeNotSatisfiable, 422: errors.Unprocessable,
              429: errors.Overloaded, 503: errors.Overloaded}
_BY_GRPC = {"INVALID_ARGUMENT": errors.BadRequest, "NOT_FOUND": errors.NotFound, "ALREADY_EXISTS": errors.Conflict,
            "UNAUTHENTICATED": errors.Unauthenticated, "PERMISSION_DENIED": errors.Forbidden,
            "ABORTED": errors.Conflict, "RESOURCE_EXHAUSTED": errors.Overloaded, "UNAVAILABLE": errors.Unavailable,
            "UNIMPLEMENTED": errors.BadRequest}
# HTTP 503 serves both Overloaded and Unavailable: these codes are Unavailable's (the gateway's
# raisers of it), any other is back-pressure. Either way the call is retried alike.
_UNAVAILABLE_CODES = frozenset({errors.Unavailable.default_code, "state_unavailable", "agent_unavailable", "checkpoint_failed"})
# The gateway answered and did nothing: any call may be sent again once its Retry-After has passed.
_BACK_PRESSURE = (errors.Overloaded, errors.Unavailable)
# What lifl.client.grpcwire raises when its connection fails (ConnectionError and TimeoutError are OSErrors).
_UPLOAD_CONNECTION_FAILURES = (OSError, EOFError)
# grpcio's own statuses (no trailers: no server answered) for a connection that failed or a call
# that timed out: it cannot say whether the call reached the gateway.
_GRPCIO_CONNECTION_FAILURES = ("UNAVAILABLE", "DEADLINE_EXCEEDED")


class ConnectionLost(ConnectionError):
    """The connection to the gateway failed during a call, where the client cannot tell whether
    the gateway got the request: it may or may not have acted on it. Reads and lease calls are
    retried; a push or another call that changes state is not, since sending it again could
    apply it twice."""


@dataclass(frozen=True)
class RetryPolicy:
    """How a ``Gateway`` retries a call that failed for a reason that may pass: the gateway was
    unreachable, answered 503 / 429 / RESOURCE_EXHAUSTED / UNAVAILABLE, or (reads and lease calls
    only) the connection broke mid-call. Delays grow exponentially from ``base_delay_s`` up to
    ``max_delay_s``, each with a random part, and are never shorter than the gateway's Retry-After."""

    max_attempts: int = 8  # tries of one call, the first included
    max_elapsed_s: float = 60.0  # no retry starts later than this after the first try
    base_delay_s: float = 0.1  # the delay before the first retry (at most)
    max_delay_s: float = 5.0  # the largest back-off delay

    def __post_init__(self) -> None:
        if self.max_attempts < 1:
            raise ValueError(f"max_attempts must be at least 1, got {self.max_attempts}")
        if not 0 < self.base_delay_s <= self.max_delay_s:
            raise ValueError(f"need 0 < base_delay_s <= max_delay_s, got {self.base_delay_s} and {self.max_delay_s}")
        if not self.max_elapsed_s >= 0:
            raise ValueError(f"max_elapsed_s must be at least 0, got {self.max_elapsed_s}")

    def delay(self, tries: int, draw: float, retry_after: float | None = None) -> float:
        """Seconds to wait after ``tries`` failed tries. ``draw`` in [0, 1) picks the random part:
        the back-off lies in (ceiling / 2, ceiling], and a Retry-After is stretched by up to
        RETRY_AFTER_SPREAD so that clients refused together do not return together."""
        doublings = min(tries - 1, math.ceil(math.log2(self.max_delay_s / self.base_delay_s)))  # past it, the cap rules
        ceiling = min(self.max_delay_s, self.base_delay_s * 2**doublings)
        backoff = ceiling * (1 - BACKOFF_JITTER * draw)
        if retry_after is None:
            return backoff
        return max(backoff, retry_after * (1 + RETRY_AFTER_SPREAD * draw))

    def next_delay(self, tries: int, elapsed: float, draw: float, retry_after: float | None = None) -> float | None:
        """The wait before trying again after ``tries`` failed tries and ``elapsed`` seconds, or
        None to give up: no tries left, or the wait would end past ``max_elapsed_s``."""
        if tries >= self.max_attempts:
            return None
        wait = self.delay(tries, draw, retry_after)
        return wait if elapsed + wait <= self.max_elapsed_s else None


DEFAULT_RETRY = RetryPolicy()
NO_RETRY = RetryPolicy(max_attempts=1)  # every failure at once, e.g. to measure how often a node refuses


def _retry_after_seconds(value: str | None) -> float:
    """An HTTP Retry-After: delta-seconds or an HTTP-date (RFC 9110, 10.2.3)."""
    if value is None:
        return DEFAULT_RETRY_AFTER_S
    try:
        seconds = float(value)
    except ValueError:
        try:
            return max(0.0, parsedate_to_datetime(value).timestamp() - time.time())  # a date just past: now
        except (TypeError, ValueError):
            return DEFAULT_RETRY_AFTER_S
    return seconds if 0 <= seconds < math.inf else DEFAULT_RETRY_AFTER_S


def _pushback_seconds(value: str | None) -> float:
    """A gRPC ``grpc-retry-pushback-ms`` trailer: whole milliseconds."""
    return int(value) / 1000 if value is not None and value.isascii() and value.isdecimal() else DEFAULT_RETRY_AFTER_S


def _lifl_error(cls: type[errors.LiflError], message: str, code: str, extra: dict[str, Any],
                retry_after: float) -> errors.LiflError:
    if issubclass(cls, _BACK_PRESSURE):
        return cls(message, code=code, retry_after=retry_after, extra=extra)
    return cls(message, code=code, extra=extra)


def _http_error(status: int, body: bytes, retry_after: str | None) -> errors.LiflError:
    try:
        info = json.loads(body)["error"]
        code, message = str(info["code"]), str(info["message"])
    except (ValueError, KeyError, TypeError):  # not the gateway's JSON (a proxy's page, say)
        info, code, message = {}, "http_error", body[:200].decode("latin-1")
    extra = {k: v for k, v in info.items() if k not in ("code", "message")}
    return _lifl_error(_by_code(_BY_STATUS.get(status, errors.Internal), code), message, code, extra,
                       _retry_after_seconds(retry_after))


def _by_code(cls: type[errors.LiflError], code: str) -> type[errors.LiflError]:
    """The error a code names more narrowly than its status does."""
    if cls is errors.Overloaded and code in _UNAVAILABLE_CODES:
        return errors.Unavailable
    if code == errors.QuotaExceeded.default_code:
        return errors.QuotaBusy if issubclass(cls, errors.Overloaded) else errors.QuotaExceeded
    return cls


def _grpc_status_error(status: str, message: str, trailers: dict[str, str]) -> errors.LiflError:
    extra = {"version": int(trailers["lifl-version"])} if "lifl-version" in trailers else {}
    code = trailers.get("lifl-error-code", "grpc_error")
    return _lifl_error(_by_code(_BY_GRPC.get(status, errors.Internal), code), message, code,
                       extra, _pushback_seconds(trailers.get("grpc-retry-pushback-ms")))


def _grpc_status_name(status: int) -> str:
    import grpc

    return next((code.name for code in grpc.StatusCode if code.value[0] == status), "UNKNOWN")


def _unreachable(address: str, cause: BaseException) -> errors.Unavailable:
    """Nothing was sent: safe to send again. Retry-After 0: the client's own back-off paces it."""
    return errors.Unavailable(f"cannot connect to the gateway at {address}: {cause}", code="unreachable", retry_after=0.0)


def _connection_lost(address: str, what: str, reason: str) -> ConnectionLost:
    return ConnectionLost(f"{what}: the connection to the gateway at {address} failed during the call ({reason}); "
                          "the gateway may or may not have acted on it")


def _closed_by_peer(sock: socket.socket) -> bool:
    """Whether the gateway closed a kept-alive connection: with no request outstanding, anything
    readable is an end of file or an error."""
    poller = select.poll()
    poller.register(sock, select.POLLIN)
    if not poller.poll(0):
        return False
    return connection_closed(sock) if isinstance(sock, ssl.SSLSocket) else True


def _read_body(response: http.client.HTTPResponse) -> bytes | bytearray:
    length = response.getheader("Content-Length")
    if response.status >= 400 or not (length and length.isascii() and length.isdecimal()):
        return response.read()
    data = bytearray(int(length))  # into a writable buffer, in one go
    view, got = memoryview(data), 0
    while got < len(data) and (n := response.readinto(view[got:])):
        got += n
    if got != len(data):
        raise http.client.IncompleteRead(bytes(data[:got]), len(data) - got)
    response.read()
    return data


TOKEN_ENV = "LIFL_TOKEN"  # the token a Gateway presents when it is given none
NO_VERSION = -1  # wait_for_version's ``after`` for any version
MAX_VERSION_WAIT_S = 60.0  # the longest a gateway holds a version wait (lifl.jobs.MAX_VERSION_WAIT_S)


class Gateway:
    """One client connection to a gateway. ``address`` is ``host:port`` of its HTTP API, or of
    its gRPC API with ``protocol="grpc"``. ``token`` is the caller's bearer token (default: the
    LIFL_TOKEN environment variable). ``retry`` says how calls are retried (docs/client.md,
    "Faults"); ``timeout`` bounds each try. An ``https://`` address, ``tls=True`` or a
    ``ClientTls`` (CA file, client certificate, server name) connects over TLS, verifying the
    gateway's certificate (against the system's CAs unless ``ClientTls.ca`` says otherwise)."""

    def __init__(self, address: str, protocol: str = "http", timeout: float = 300.0,
                 retry: RetryPolicy = DEFAULT_RETRY, token: str | None = None,
                 tls: ClientTls | bool | None = None) -> None:
        if protocol not in ("http", "grpc"):
            raise ValueError(f"protocol must be 'http' or 'grpc', got {protocol!r}")
        self.protocol, self.timeout, self.retry = protocol, timeout, retry
        self.token = token if token is not None else os.environ.get(TOKEN_ENV)
        self._authorization = [("authorization", f"Bearer {self.token}")] if self.token else []
        self.address, self.tls = client_settings(address, tls)
        if protocol == "http":
            host, _, port = self.address.rpartition(":")
            self._http = (https_connection(self.address, self.tls, timeout) if self.tls is not None
                          else http.client.HTTPConnection(host, int(port), timeout=timeout))
        else:
            import grpc

            from lifl.net import lifl_pb2

            self._pb = lifl_pb2
            # grpcio reconnects on a schedule of its own (attempts up to 2 minutes apart) and fails
            # calls at once meanwhile: align it with the retries, so a restarted gateway is found soon
            options = [
                ("grpc.max_receive_message_length", GRPC_MAX_RECEIVE),
                ("grpc.initial_reconnect_backoff_ms", int(retry.base_delay_s * 1000)),
                ("grpc.max_reconnect_backoff_ms", int(retry.max_delay_s * 1000)),
            ]
            if self.tls is None:
                self._channel = grpc.insecure_channel(self.address, options=options)
            else:
                options.append(("grpc.ssl_target_name_override", server_name(self.address, self.tls)))
                self._channel = grpc.secure_channel(self.address, self.tls.grpc_credentials(), options=options)
            # Blob streams go over lifl's own framing. The connection replaces itself if the gateway
            # closed it between calls, before anything is sent.
            self._uploads: UploadConnection | None = None

    def close(self) -> None:
        if self.protocol == "http":
            self._http.close()
        else:
            self._channel.close()
            self._drop_uploads()

    def _retrying(self, call: Callable[[], T], *, idempotent: bool,
                  also: Callable[[errors.LiflError], bool] = lambda error: False) -> T:
        """``call()`` until it succeeds or the policy gives up, retrying only what is safe: any call
        the gateway certainly did not act on (unreachable, or refused with back-pressure), a call
        whose connection broke mid-way only if it is ``idempotent``, and the errors ``also`` names."""
        started, tries = time.monotonic(), 0
        while True:
            tries += 1
            try:
                return call()
            except _BACK_PRESSURE as e:
                failure, retry_after = e, e.retry_after
            except ConnectionLost as e:
                if not idempotent:
                    raise  # it may have been applied: only the caller can know whether to send it again
                failure, retry_after = e, None
            except errors.LiflError as e:
                if not also(e):
                    raise
                failure, retry_after = e, None
            wait = self.retry.next_delay(tries, time.monotonic() - started, random.random(), retry_after)
            if wait is None:
                raise failure
            time.sleep(wait)

    # -- HTTP -----------------------------------------------------------------------------------
    # Unless a call says it is idempotent, it is taken to change state: the safe assumption.
    def _request(self, method: str, path: str, body: Any = None, headers: dict[str, str] | None = None, *,
                 idempotent: bool = False) -> tuple[int, dict[str, str], bytes | bytearray]:
        return self._retrying(lambda: self._exchange(method, path, body, headers or {}), idempotent=idempotent)

    def _exchange(self, method: str, path: str, body: Any, headers: dict[str, str], *,
                  send: Callable[[socket.socket], None] | None = None,
                  receive: Callable[[http.client.HTTPResponse], bytes | bytearray] = _read_body,
                  ) -> tuple[int, dict[str, str], bytes | bytearray]:
        """One request and its answer. ``send(socket)`` writes the body itself, after the head (its
        Content-Length among ``headers``); ``receive`` reads a successful answer's body."""
        self._connect_http()
        try:
            if send is None:
                self._http.request(method, path, body=body, headers={**headers, **dict(self._authorization)})
            else:
                self._http.putrequest(method, path, skip_accept_encoding=True)
                for name, value in {**headers, **dict(self._authorization)}.items():
                    self._http.putheader(name, value)
                self._http.endheaders()
                send(self._http.sock)
            response = self._http.getresponse()
            data = receive(response) if response.status < 300 else _read_body(response)
        except (OSError, http.client.HTTPException) as e:
            self._http.close()  # never reused: its state is unknown (http.client would refuse it: CannotSendRequest)
            raise _connection_lost(self.address, f"{method} {path}", repr(e)) from e
        if response.status >= 400:
            raise _http_error(response.status, data, response.getheader("Retry-After"))
        return response.status, dict(response.getheaders()), data

    def _connect_http(self) -> None:
        """A connection to send on: the kept one unless the gateway closed it, else a new one."""
        if self._http.sock is not None and _closed_by_peer(self._http.sock):
            self._http.close()  # found before sending, so the request can still go on a new one
        if self._http.sock is None:
            try:
                self._http.connect()
            except ssl.SSLCertVerificationError:
                raise  # not the kind of failure a retry mends
            except OSError as e:
                raise _unreachable(self.address, e) from e

    def _json(self, method: str, path: str, body: Any = None, *, idempotent: bool = False) -> Any:
        data = json.dumps(body).encode() if body is not None else None
        return json.loads(self._request(method, path, data, {"Content-Type": "application/json"}, idempotent=idempotent)[2])

    # -- gRPC -----------------------------------------------------------------------------------
    def _grpc(self, method: str, call: Callable[[], T], *, idempotent: bool) -> T:
        """A grpcio call, its failures as lifl errors (grpcio reconnects the channel by itself)."""
        import grpc

        def once() -> T:
            try:
                return call()
            except grpc.RpcError as e:
                raise self._grpc_error(method, e) from None

        return self._retrying(once, idempotent=idempotent)

    def _rpc(self, method: str, deserializer: Any, request: bytes, *, idempotent: bool) -> Any:
        stub = self._channel.unary_unary(f"/lifl.v1.Gateway/{method}", response_deserializer=deserializer)
        return self._grpc(method, lambda: stub(request, timeout=self.timeout, metadata=self._authorization),
                          idempotent=idempotent)

    def _grpc_error(self, method: str, e: Any) -> Exception:
        trailers = dict(e.trailing_metadata() or ())
        if e.code().name in _GRPCIO_CONNECTION_FAILURES and not trailers:
            return _connection_lost(self.address, method, e.details())
        return _grpc_status_error(e.code().name, urllib.parse.unquote(e.details() or ""), trailers)

    def _upload(self, method: str, meta: bytes, blob: bytes | bytearray | memoryview) -> bytes:
        """A blob stream, its bytes sent straight from ``blob`` (lifl.client.grpcwire). An upload changes
        state, so it is retried only when it certainly was not taken."""
        return self._retrying(lambda: self._upload_once(method, meta, blob), idempotent=False)

    def _upload_once(self, method: str, meta: bytes, blob: bytes | bytearray | memoryview) -> bytes:
        uploads = self._upload_connection()
        try:
            return uploads.call(f"/lifl.v1.Gateway/{method}", chunk_messages(meta, blob, GRPC_CHUNK), self._authorization)
        except GrpcStatusError as e:
            raise _grpc_status_error(_grpc_status_name(e.status), e.message, e.trailers) from None
        except _UPLOAD_CONNECTION_FAILURES as e:
            self._drop_uploads()
            raise _connection_lost(self.address, method, repr(e)) from e

    def _upload_connection(self) -> UploadConnection:
        if self._uploads is None:
            from lifl.client.grpcwire import UploadConnection  # the grpc extra's: lifl's HTTP/2 codec needs hpack

            try:
                self._uploads = UploadConnection(self.address, timeout=self.timeout, tls=self.tls)
            except ssl.SSLCertVerificationError:
                raise  # not the kind of failure a retry mends
            except _UPLOAD_CONNECTION_FAILURES as e:  # before any call was sent
                raise _unreachable(self.address, e) from e
        return self._uploads

    def _drop_uploads(self) -> None:
        if self._uploads is not None:
            self._uploads.close()
            self._uploads = None

    # -- operations -----------------------------------------------------------------------------
    def create_job(self, job: str, goal: int, **options: Any) -> dict[str, Any]:
        if self.protocol == "http":
            return self._json("POST", "/v1/jobs", {"job": job, "goal": goal, **options}, idempotent=False)
        for field in ("retention", "strategy", "fixed_point", "secure_aggregation"):  # JSON-valued job fields
            if field in options:
                options[f"{field}_json"] = json.dumps(options.pop(field))
        req = self._pb.CreateJobRequest(job=job, goal=goal, **options)
        self._rpc("CreateJob", self._pb.JobStatus.FromString, req.SerializeToString(), idempotent=False)
        return self.job(job)

    def job(self, job: str) -> dict[str, Any]:
        if self.protocol == "http":
            return self._json("GET", f"/v1/jobs/{job}", idempotent=True)
        status = self._rpc("GetJob", self._pb.JobStatus.FromString, self._pb.GetJobRequest(job=job).SerializeToString(),
                           idempotent=True)
        return _status_dict(status)

    def wait_for_version(self, job: str, after: int = NO_VERSION, wait_s: float = 0.0) -> dict[str, Any]:
        """What a client sees of its job ({"job", "tenant", "version", "round": {"id", "version",
        "closed"}}) once its version passes ``after`` (-1: any), or when ``wait_s`` seconds (at
        most MAX_VERSION_WAIT_S, and half this connection's timeout) end without one: the gateway
        holds the call meanwhile, so a client between rounds asks once per version, not polling."""
        wait_s = min(wait_s, MAX_VERSION_WAIT_S, self.timeout / 2)
        if self.protocol == "http":
            return self._json("GET", f"/v1/jobs/{job}/version?after={after}&wait_s={wait_s:.3f}", idempotent=True)
        v = self._rpc("WaitForVersion", self._pb.JobVersion.FromString,
                      self._pb.WaitForVersionRequest(job=job, after=after, wait_s=wait_s).SerializeToString(), idempotent=True)
        version = None if v.version < 0 else v.version
        return {"job": v.job, "tenant": v.tenant, "version": version,
                "round": {"id": None if v.round < 0 else v.round, "version": version, "closed": v.closed}}

    # -- non-training workloads (docs/flstore.md) --------------------------------------------------
    def query(self, job: str, body: Mapping[str, Any]) -> dict[str, Any]:
        """Run a workload over the job's retained updates and models: ``{"workload": ..., "round"
        or "version": ..., parameters}``; the answer has the result and where its data came from.
        Queries only read, so they are retried like reads."""
        if self.protocol == "http":
            return self._json("POST", f"/v1/jobs/{job}/queries", dict(body), idempotent=True)
        req = self._pb.QueryRequest(job=job, query_json=json.dumps(dict(body)))
        return json.loads(self._rpc("Query", self._pb.JsonReply.FromString, req.SerializeToString(), idempotent=True).json)

    def retention(self, job: str) -> dict[str, Any]:
        """The job's retention policy, with what the nodes keep and how queries found their data."""
        if self.protocol == "http":
            return self._json("GET", f"/v1/jobs/{job}/retention", idempotent=True)
        req = self._pb.GetRetentionRequest(job=job)
        return json.loads(self._rpc("GetRetention", self._pb.JsonReply.FromString, req.SerializeToString(),
                                    idempotent=True).json)

    def set_retention(self, job: str, policy: Mapping[str, Any]) -> dict[str, Any]:
        """Change the job's retention policy at run time (setting the same policy twice is harmless)."""
        if self.protocol == "http":
            return self._json("PUT", f"/v1/jobs/{job}/retention", dict(policy), idempotent=True)
        req = self._pb.SetRetentionRequest(job=job, policy_json=json.dumps(dict(policy)))
        return json.loads(self._rpc("SetRetention", self._pb.JsonReply.FromString, req.SerializeToString(),
                                    idempotent=True).json)

    def quota(self, tenant: str) -> dict[str, Any]:
        """The tenant's quota and what it holds of it (lifl.quotas)."""
        if self.protocol == "http":
            return self._json("GET", f"/v1/tenants/{tenant}/quota", idempotent=True)
        req = self._pb.GetQuotaRequest(tenant=tenant)
        return json.loads(self._rpc("GetQuota", self._pb.JsonReply.FromString, req.SerializeToString(), idempotent=True).json)

    def set_quota(self, tenant: str, quota: Mapping[str, Any] | None) -> dict[str, Any]:
        """Set the tenant's quota (the operator only; fields left out take their defaults; None:
        back to the defaults)."""
        body = None if quota is None else dict(quota)
        if self.protocol == "http":
            return self._json("PUT" if body is not None else "DELETE", f"/v1/tenants/{tenant}/quota", body, idempotent=True)
        req = self._pb.SetQuotaRequest(tenant=tenant, quota_json=json.dumps(body))
        return json.loads(self._rpc("SetQuota", self._pb.JsonReply.FromString, req.SerializeToString(), idempotent=True).json)

    def set_model(self, job: str, blob: bytes | memoryview) -> int:
        """Set the initial global model; returns its version (0)."""
        if self.protocol == "http":
            return json.loads(self._request("PUT", f"/v1/jobs/{job}/model", memoryview(blob), idempotent=False)[2])["version"]
        meta = self._pb.ModelMeta(job=job, size=len(blob)).SerializeToString()
        return self._pb.SetModelReply.FromString(self._upload("SetModel", meta, blob)).version

    def model(self, job: str) -> tuple[int, bytes]:
        """(version, blob) of the current global model."""
        if self.protocol == "http":
            _, headers, data = self._request("GET", f"/v1/jobs/{job}/model", idempotent=True)
            return int(headers["X-Lifl-Version"]), data
        stream = self._channel.unary_stream("/lifl.v1.Gateway/GetModel", response_deserializer=self._pb.ModelChunk.FromString)
        request = self._pb.GetModelRequest(job=job).SerializeToString()
        parts = self._grpc("GetModel", lambda: list(stream(request, timeout=self.timeout, metadata=self._authorization)),
                           idempotent=True)
        return parts[0].meta.version, b"".join(p.data for p in parts)

    def parts(self, job: str) -> dict[str, Any]:
        """Where each part of a job split across nodes is (docs/sharding.md): {"version", "model"
        (its tensors), "cut" (the shard plan's count and alignment), "parts": [{"node", "gateway"
        (its addresses), "shards" [first, stop), "data" [begin, end) of the data section}]}. HTTP only."""
        self._http_only("parts")
        return self._json("GET", f"/v1/jobs/{job}/parts", idempotent=True)

    def part(self, job: str) -> tuple[int, bytes]:
        """(version, blob) of this gateway's node's part of the current model of a split job. HTTP only."""
        self._http_only("part")
        _, headers, data = self._request("GET", f"/v1/jobs/{job}/part", idempotent=True)
        return int(headers["X-Lifl-Version"]), data

    def _http_only(self, call: str) -> None:
        if self.protocol != "http":
            raise ValueError(f"{call} needs protocol='http'")

    def push(self, job: str, blob: bytes | memoryview, *, samples: int, base_version: int, lease: str = "",
             client: str | None = None) -> dict[str, Any]:
        """Send one update; returns {"version"}: the version it counts towards. ``client`` is the
        token's own with a client token (leave it out), and names the client an operator acts as.
        Unlike other calls that change state, a push whose answer was lost (or answered 503: the
        cluster state did not answer in time, and may still count it) is sent again: a round
        takes one update per client, so if the first try was taken the retry is answered
        ``already_acknowledged``, and this returns {"version": base_version, "acknowledged_earlier": True}."""
        sent = False

        def once() -> dict[str, Any]:
            nonlocal sent
            try:
                return self._push_once(job, blob, client, samples, base_version, lease)
            except (ConnectionLost, errors.Unavailable):  # the node may have counted it after all (docs/state.md)
                sent = True
                raise
            except errors.Conflict as e:
                if sent and e.code == "already_acknowledged":
                    return {"version": base_version, "acknowledged_earlier": True}
                raise

        return self._retrying(once, idempotent=True)

    def _push_once(self, job: str, blob: bytes | memoryview, client: str | None, samples: int, base_version: int,
                   lease: str) -> dict[str, Any]:
        if self.protocol == "http":
            headers = _update_headers(samples, base_version, client, lease)
            return json.loads(self._exchange("POST", f"/v1/jobs/{job}/updates", memoryview(blob), headers)[2])
        meta = self._pb.UpdateMeta(job=job, client=client or "", samples=samples, base_version=base_version, size=len(blob),
                                   lease=lease)
        reply = self._pb.PushUpdateReply.FromString(self._upload_once("PushUpdate", meta.SerializeToString(), blob))
        return {"version": reply.version}

    def push_file(self, job: str, path: str | os.PathLike[str], *, samples: int, base_version: int, lease: str = "",
                  client: str | None = None) -> dict[str, Any]:
        """``push`` of the update in a safetensors file, sent from the file (sendfile: never read
        into memory) through a resumable upload (HTTP only: docs/api.md, "Resumable uploads").

        The blob's header goes first, in a PATCH of its own whose answer says whether the gateway
        admitted the update (a refusal costs the header's bytes, not the file's); then the rest.
        A broken connection is resumed where the gateway's bytes end (HEAD), sending only the
        rest; an upload the gateway no longer has (it expired, or went with a restarted agent)
        is begun again. Tries are bounded by ``retry``, as a push's, and a lost answer is found
        again as a push's is. Returns push's answer with ``sent_bytes`` (the file's bytes written
        to the gateway over all tries) and ``resumes`` (tries that went on from an offset)."""
        if self.protocol != "http":
            raise ValueError("push_file needs protocol='http': gRPC has no resumable uploads (use push)")
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size < 8:
                raise errors.BadRequest(f"{path} has {size} bytes: an update starts with its 8-byte header length",
                                        code="truncated")
            header_end = min(size, 8 + int.from_bytes(os.pread(f.fileno(), 8, 0), "little"))
            return self.push_segments(job, [(f.fileno(), 0, size)], header_end, samples=samples,
                                      base_version=base_version, lease=lease, client=client)

    def push_segments(self, job: str, segments: list[Segment], header_end: int, *, samples: int, base_version: int,
                      lease: str = "", client: str | None = None) -> dict[str, Any]:
        """``push_file`` of an update made of ``segments``, in order: bytes in memory, or
        (file descriptor, offset, length) ranges of open files, sent with sendfile; its header
        ends at ``header_end``. What ``SplitJob.push_file`` sends each node (its part's header,
        then the part's ranges of the update's file)."""
        self._http_only("push_segments")
        upload = _ResumableUpload(self, job, segments, header_end, base_version,
                                  _update_headers(samples, base_version, client, lease))
        return self._retrying(upload.once, idempotent=True, also=upload.retryable)

    def download_model(self, job: str, path: str | os.PathLike[str]) -> int:
        """Write the job's current model into ``path`` as it arrives, never holding it whole in
        memory; returns its version. Over HTTP a broken connection is resumed with a Range from
        the bytes written, as long as the model stays the same (If-Range: its version's ETag); if a
        new version came meanwhile, the file is written again from its start. Over gRPC, which has
        no ranges, it writes ``model``'s bytes."""
        with open(path, "wb") as f:
            if self.protocol != "http":
                version, blob = self.model(job)
                f.write(blob)
                return version
            download = _Download(f.fileno())
            self._retrying(lambda: self._exchange("GET", f"/v1/jobs/{job}/model", None, download.headers(),
                                                  receive=download.receive), idempotent=True)
            return download.version

    def metrics(self) -> str:
        """The gateway's Prometheus exposition (HTTP only)."""
        return self._request("GET", "/metrics", idempotent=True)[2].decode()

    def jobs(self) -> list[str]:
        """The names of the jobs the caller sees."""
        if self.protocol == "http":
            return self._json("GET", "/v1/jobs", idempotent=True)["jobs"]
        reply = self._rpc("ListJobs", self._pb.JobList.FromString, self._pb.ListJobsRequest().SerializeToString(),
                          idempotent=True)
        return list(reply.jobs)

    # -- tokens (docs/security.md) ----------------------------------------------------------------
    def create_token(self, role: str, tenant: str, *, job: str = "", client: str = "", ttl_s: float | None = None) -> dict[str, Any]:
        """A new tenant or client token: {"id", "token", "role", "tenant", "job", "client", "created",
        "expires"}; the token itself is shown this once."""
        body: dict[str, Any] = {"role": role, "tenant": tenant}
        body.update({k: v for k, v in (("job", job), ("client", client), ("ttl_s", ttl_s)) if v})
        if self.protocol == "http":
            return self._json("POST", "/v1/tokens", body, idempotent=False)
        return _dict(self._rpc("CreateToken", self._pb.Token.FromString,
                               self._pb.CreateTokenRequest(**body).SerializeToString(), idempotent=False))

    def tokens(self) -> list[dict[str, Any]]:
        """The live tokens the caller manages, without their secrets."""
        if self.protocol == "http":
            return self._json("GET", "/v1/tokens", idempotent=True)["tokens"]
        reply = self._rpc("ListTokens", self._pb.TokenList.FromString, self._pb.ListTokensRequest().SerializeToString(),
                          idempotent=True)
        return [{k: v for k, v in _dict(t).items() if k != "token"} for t in reply.tokens]

    def revoke_token(self, token_id: str) -> None:
        if self.protocol == "http":
            self._request("DELETE", f"/v1/tokens/{urllib.parse.quote(token_id, safe='')}", idempotent=True)
        else:
            self._rpc("RevokeToken", self._pb.RevokeTokenReply.FromString,
                      self._pb.RevokeTokenRequest(id=token_id).SerializeToString(), idempotent=True)

    # Lease calls are retried like reads: a client holds one lease, so taking it again returns the
    # same one; renewing or releasing twice changes nothing.
    def take_lease(self, job: str, client: str | None = None) -> dict[str, Any]:
        """A place in the current round: {"lease", "version", "round", "ttl_s"} (the client's one
        lease: asking again renews it). ``client`` as in ``push``."""
        if self.protocol == "http":
            return self._json("POST", f"/v1/jobs/{job}/leases", {"client": client} if client else {}, idempotent=True)
        return self._lease_rpc("TakeLease", self._pb.TakeLeaseRequest(job=job, client=client or ""))

    def heartbeat(self, job: str, lease: str) -> dict[str, Any]:
        if self.protocol == "http":
            return self._json("PUT", f"/v1/jobs/{job}/leases/{lease}", idempotent=True)
        return self._lease_rpc("Heartbeat", self._pb.LeaseRequest(job=job, lease=lease))

    def release_lease(self, job: str, lease: str) -> None:
        if self.protocol == "http":
            self._request("DELETE", f"/v1/jobs/{job}/leases/{lease}", idempotent=True)
        else:
            self._lease_rpc("ReleaseLease", self._pb.LeaseRequest(job=job, lease=lease))

    def _lease_rpc(self, method: str, request: Any) -> dict[str, Any]:
        lease = self._rpc(method, self._pb.Lease.FromString, request.SerializeToString(), idempotent=True)
        return {"lease": lease.lease, "version": lease.version, "round": lease.round, "ttl_s": lease.ttl_s}

    # -- secure rounds (docs/secure-aggregation.md) ---------------------------------------------------
    def secure(self, job: str, client: str | None = None, after: tuple[int, str] | None = None,
               wait_s: float = 0.0) -> dict[str, Any]:
        """The job's secure round: its stage, and what ``client`` needs at it. With ``after`` (the
        round and stage a view showed), once the round moved past it, or when ``wait_s`` seconds
        (at most MAX_VERSION_WAIT_S, and half this connection's timeout) end: the gateway holds
        the call meanwhile, so a client between stages asks once per stage, not polling."""
        wait = {} if after is None else {"round": after[0], "after": after[1],
                                         "wait_s": round(min(wait_s, MAX_VERSION_WAIT_S, self.timeout / 2), 3)}
        if self.protocol == "http":
            query = urllib.parse.urlencode({**({"client": client} if client else {}), **wait})
            return self._json("GET", f"/v1/jobs/{job}/secure" + (f"?{query}" if query else ""), idempotent=True)
        return self._secure_rpc(job, "status", client, wait or None)

    def secure_keys(self, job: str, mask_key: bytes, share_key: bytes, signing_key: bytes, client: str | None = None,
                    wait_s: float = 0.0) -> dict[str, Any]:
        return self._secure_call(job, "keys", client, {"mask_key": mask_key.hex(), "share_key": share_key.hex(),
                                                       "signing_key": signing_key.hex()}, wait_s)

    def secure_shares(self, job: str, shares: Mapping[str, bytes], client: str | None = None,
                      wait_s: float = 0.0) -> dict[str, Any]:
        return self._secure_call(job, "shares", client, {"shares": {p: blob.hex() for p, blob in shares.items()}}, wait_s)

    def secure_signature(self, job: str, signature: bytes, client: str | None = None, wait_s: float = 0.0) -> dict[str, Any]:
        return self._secure_call(job, "signature", client, {"signature": signature.hex()}, wait_s)

    def secure_answer(self, job: str, shares: Mapping[str, tuple[str, bytes]], client: str | None = None) -> dict[str, Any]:
        return self._secure_call(job, "answer", client, {
            "shares": {t: {"kind": kind, "share": share.hex()} for t, (kind, share) in shares.items()}})

    def _secure_call(self, job: str, call: str, client: str | None, body: dict[str, Any], wait_s: float = 0.0) -> dict[str, Any]:
        """A stage's message (not retried: a second one is a replay, refused). With ``wait_s``,
        answered once the round moved past the message's stage, or when ``wait_s`` (bounded as
        ``secure``'s) ends: the message and the wait for the next stage in one call."""
        if wait_s > 0:
            body = {**body, "wait_s": round(min(wait_s, MAX_VERSION_WAIT_S, self.timeout / 2), 3)}
        if self.protocol == "http":
            return self._json("POST", f"/v1/jobs/{job}/secure/{call}", {**body, **({"client": client} if client else {})})
        return self._secure_rpc(job, call, client, body)

    def _secure_rpc(self, job: str, call: str, client: str | None, body: dict[str, Any] | None) -> dict[str, Any]:
        request = self._pb.SecureRequest(job=job, call=call, client=client or "", body_json=json.dumps(body) if body else "")
        return json.loads(self._rpc("Secure", self._pb.JsonReply.FromString, request.SerializeToString(),
                                    idempotent=call == "status").json)

    def assignment(self, job: str, client: str | None = None) -> dict[str, Any]:
        """The node this client should send the current round's update to:
        {"node", "http", "grpc", "round", "version", ...}; any gateway answers. ``client`` as in ``push``."""
        if self.protocol == "http":
            query = f"?client={urllib.parse.quote(client, safe='')}" if client else ""
            return self._json("GET", f"/v1/jobs/{job}/assignment{query}", idempotent=True)
        reply = self._rpc("GetAssignment", self._pb.Assignment.FromString,
                          self._pb.AssignmentRequest(job=job, client=client or "").SerializeToString(), idempotent=True)
        return {**_dict(reply), "round": reply.round, "version": reply.version}

    def rounds(self, job: str, limit: int = 100) -> list[dict[str, Any]]:
        """The last ``limit`` finished rounds, oldest first."""
        if self.protocol == "http":
            return self._json("GET", f"/v1/jobs/{job}/rounds?limit={limit}", idempotent=True)["rounds"]
        reply = self._rpc("GetRounds", self._pb.Rounds.FromString,
                          self._pb.GetRoundsRequest(job=job, limit=limit).SerializeToString(), idempotent=True)
        return [_round_dict(r) for r in reply.rounds]


def _update_headers(samples: int, base_version: int, client: str | None, lease: str) -> dict[str, str]:
    """An update's metadata as HTTP headers (docs/api.md, "Update"): a POST's, or a resumable upload's."""
    headers = {"X-Lifl-Samples": str(samples), "X-Lifl-Base-Version": str(base_version)}
    if client:
        headers["X-Lifl-Client"] = client
    if lease:
        headers["X-Lifl-Lease"] = lease
    return headers


Segment = bytes | tuple[int, int, int]  # bytes in memory, or (file descriptor, offset, length) of a file


class _ResumableUpload:
    """An update pushed through a resumable upload from ``segments`` (its bytes in order: in
    memory, or ranges of a file, sent with sendfile), its header ending at ``header_end``:
    ``once`` is a try, which goes on where the gateway's bytes end."""

    def __init__(self, gateway: Gateway, job: str, segments: list[Segment], header_end: int, base_version: int,
                 headers: dict[str, str]) -> None:
        self.gateway, self.job, self.segments, self.header_end = gateway, job, segments, header_end
        self.size = sum(len(s) if isinstance(s, bytes) else s[2] for s in segments)
        self.base_version, self.headers = base_version, headers
        self.location: str | None = None  # the upload's, once created
        self.sent_bytes = 0
        self.resumes = 0
        self.sent_all = False  # every byte went out once: a lost answer may have been an acknowledgement

    def once(self) -> dict[str, Any]:
        offset = self._resume() if self.location is not None else None
        try:
            if offset is None:
                self.location, offset = self._create(), 0
            if offset < self.header_end:
                offset = self._patch(offset, self.header_end)[0]  # answered once the gateway admitted the update
            result = self._patch(offset, self.size)[1]  # no bytes if all are in: what completed it, again
        except errors.NotFound as e:
            if e.code == "no_such_upload":
                self.location = None  # it expired between two requests: the next try begins again
            raise
        except errors.Conflict as e:
            if self.sent_all and e.code == "already_acknowledged":  # a new upload, after the answer to the last was lost
                return {"version": self.base_version, "acknowledged_earlier": True, "sent_bytes": self.sent_bytes,
                        "resumes": self.resumes}
            raise
        assert result is not None
        return {**result, "sent_bytes": self.sent_bytes, "resumes": self.resumes}

    @staticmethod
    def retryable(error: errors.LiflError) -> bool:
        return error.code in _PATCH_RETRIES

    def _create(self) -> str:
        headers = {"Tus-Resumable": tus.VERSION, "Upload-Length": str(self.size), **self.headers}
        return self.gateway._exchange("POST", f"/v1/jobs/{self.job}/uploads", None, headers)[1]["Location"]

    def _resume(self) -> int | None:
        """Where the upload goes on (HEAD), or None if the gateway no longer has it."""
        assert self.location is not None
        try:
            headers = self.gateway._exchange("HEAD", self.location, None, {"Tus-Resumable": tus.VERSION})[1]
        except errors.NotFound:
            self.location = None
            return None
        self.resumes += 1
        return int(headers["Upload-Offset"])

    def _patch(self, offset: int, stop: int) -> tuple[int, dict[str, Any] | None]:
        """Send bytes ``offset`` to ``stop``: the upload's new offset, and the update's answer if it is complete."""
        assert self.location is not None
        headers = {"Tus-Resumable": tus.VERSION, "Upload-Offset": str(offset), "Content-Type": tus.OFFSET_STREAM,
                   "Content-Length": str(stop - offset)}
        status, answer, data = self.gateway._exchange("PATCH", self.location, None, headers,
                                                      send=lambda sock: self._send(sock, offset, stop))
        return int(answer["Upload-Offset"]), json.loads(data) if status == 202 else None

    def _send(self, sock: socket.socket, offset: int, stop: int) -> None:
        """The update's bytes ``offset`` to ``stop``, unless the gateway answers first (it refused them:
        its answer is read next, instead of sending bytes it drops)."""
        begin = 0  # where the segment starts in the update
        for segment in self.segments:
            length = len(segment) if isinstance(segment, bytes) else segment[2]
            while offset < stop and begin <= offset < begin + length:
                if ready([sock], 0):
                    return
                count = min(SEND_CHUNK, stop - offset, begin + length - offset)
                if isinstance(segment, bytes):
                    sock.sendall(memoryview(segment)[offset - begin : offset - begin + count])
                    self._count(count)
                else:
                    fd, start, _ = segment
                    sendfile_all(sock, fd, count, self.gateway.timeout, start=start + offset - begin, on_sent=self._count)
                offset += count
            begin += length
        self.sent_all = self.sent_all or stop == self.size

    def _count(self, sent: int) -> None:
        self.sent_bytes += sent  # as the socket takes them: a try cut off halfway counts what it sent


class _Download:
    """A model written into a file (``fd``) as it arrives; ``headers`` ask for what is still missing."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.have = 0  # bytes written
        self.etag = ""
        self.version = -1

    def headers(self) -> dict[str, str]:
        return {"Range": f"bytes={self.have}-", "If-Range": self.etag} if self.have else {}

    def receive(self, response: http.client.HTTPResponse) -> bytes:
        if response.status == 206:
            part = parse_content_range(response.getheader("Content-Range"))
            if part.first != self.have:
                raise errors.BadRequest(f"asked for the model from byte {self.have}, got {part.content_range()}",
                                        code="bad_content_range")
            end = part.size
        else:  # the whole model: the first try, or a new version came since the last
            self.have = 0
            os.ftruncate(self.fd, 0)
            self.etag, self.version = response.getheader("ETag", ""), int(response.getheader("X-Lifl-Version", "-1"))
            end = int(response.getheader("Content-Length", "0"))
        view = memoryview(bytearray(min(RECEIVE_CHUNK, end - self.have)))
        while self.have < end:
            n = response.readinto(view[: end - self.have])
            if not n:
                raise http.client.IncompleteRead(b"", end - self.have)
            os.pwrite(self.fd, view[:n], self.have)
            self.have += n
        return b""


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
    if text := out.pop("strategy_json", ""):  # a client's view has none
        out["strategy"] = json.loads(text)
    return out
