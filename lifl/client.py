"""Talking to a lifl gateway from Python, over HTTP or gRPC (docs/api.md).

``Gateway`` wraps one connection. Blobs are sent without extra copies where the transport
allows: over HTTP the body is written straight from the caller's buffer; over gRPC each
chunk message is encoded by hand with one copy (grpcio only takes ``bytes``), instead of
the three a protobuf object would cost. Errors come back as the same ``LiflError``
subclasses the gateway raised, with their code, message and extras (``version``).
"""

from __future__ import annotations

import http.client
import json
import urllib.parse
from collections.abc import Iterator
from typing import Any

from lifl import errors

GRPC_CHUNK = 1 << 20
_BY_STATUS = {400: errors.BadRequest, 404: errors.NotFound, 409: errors.Conflict, 413: errors.PayloadTooLarge,
              422: errors.Unprocessable, 503: errors.Overloaded}
_BY_GRPC = {"INVALID_ARGUMENT": errors.BadRequest, "NOT_FOUND": errors.NotFound, "ALREADY_EXISTS": errors.Conflict,
            "ABORTED": errors.Conflict, "RESOURCE_EXHAUSTED": errors.Overloaded, "UNIMPLEMENTED": errors.BadRequest}


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        out.append(b | (0x80 if n else 0))
        if not n:
            return bytes(out)


def chunk_messages(meta: bytes, blob: bytes | memoryview, chunk: int = GRPC_CHUNK) -> Iterator[bytes]:
    """Serialized ``{meta = 1, data = 2}`` chunk messages (UpdateChunk / ModelChunk)."""
    yield b"\x0a" + _varint(len(meta)) + meta
    view = memoryview(blob).cast("B")
    for i in range(0, len(view), chunk):
        piece = view[i : i + chunk]
        yield b"".join((b"\x12" + _varint(len(piece)), piece))


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

    def close(self) -> None:
        if self.protocol == "http":
            self._http.close()
        else:
            self._channel.close()

    # -- HTTP -----------------------------------------------------------------------------------
    def _request(self, method: str, path: str, body: Any = None, headers: dict[str, str] | None = None) -> tuple[int, dict[str, str], bytes]:
        for attempt in (0, 1):  # one retry if a kept-alive connection was closed by the server
            try:
                self._http.request(method, path, body=body, headers=headers or {})
                r = self._http.getresponse()
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
    def _rpc(self, method: str, deserializer: Any, messages: Iterator[bytes] | bytes, stream: bool) -> Any:
        import grpc

        path = f"/lifl.v1.Gateway/{method}"
        try:
            if stream:
                return self._channel.stream_unary(path, response_deserializer=deserializer)(messages)
            return self._channel.unary_unary(path, response_deserializer=deserializer)(messages)
        except grpc.RpcError as e:
            raise self._grpc_error(e) from None

    @staticmethod
    def _grpc_error(e: Any) -> errors.LiflError:
        trailers = dict(e.trailing_metadata() or ())
        code, message = trailers.get("lifl-error-code", "grpc_error"), urllib.parse.unquote(e.details() or "")
        cls = _BY_GRPC.get(e.code().name, errors.Internal)
        if cls is errors.Overloaded:
            return errors.Overloaded(message, retry_after=int(trailers.get("grpc-retry-pushback-ms", 1000)) / 1000, code=code)
        extra = {"version": int(trailers["lifl-version"])} if "lifl-version" in trailers else {}
        return cls(message, code=code, extra=extra)

    # -- operations -----------------------------------------------------------------------------
    def create_job(self, job: str, goal: int, **options: Any) -> dict[str, Any]:
        if self.protocol == "http":
            return self._json("POST", "/v1/jobs", {"job": job, "goal": goal, **options})
        req = self._pb.CreateJobRequest(job=job, goal=goal, **options)
        self._rpc("CreateJob", self._pb.JobStatus.FromString, req.SerializeToString(), False)
        return self.job(job)

    def job(self, job: str) -> dict[str, Any]:
        if self.protocol == "http":
            return self._json("GET", f"/v1/jobs/{job}")
        from google.protobuf.json_format import MessageToDict

        status = self._rpc("GetJob", self._pb.JobStatus.FromString, self._pb.GetJobRequest(job=job).SerializeToString(), False)
        return MessageToDict(status, preserving_proto_field_name=True)

    def set_model(self, job: str, blob: bytes | memoryview) -> int:
        """Set the initial global model; returns its version (0)."""
        if self.protocol == "http":
            return json.loads(self._request("PUT", f"/v1/jobs/{job}/model", memoryview(blob))[2])["version"]
        meta = self._pb.ModelMeta(job=job, size=len(blob)).SerializeToString()
        return self._rpc("SetModel", self._pb.SetModelReply.FromString, chunk_messages(meta, blob), True).version

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

    def push(self, job: str, blob: bytes | memoryview, *, client: str, samples: int, base_version: int) -> dict[str, Any]:
        """Send one update; returns {"key", "version"}."""
        if self.protocol == "http":
            headers = {"X-Lifl-Client": client, "X-Lifl-Samples": str(samples), "X-Lifl-Base-Version": str(base_version)}
            return json.loads(self._request("POST", f"/v1/jobs/{job}/updates", memoryview(blob), headers)[2])
        meta = self._pb.UpdateMeta(job=job, client=client, samples=samples, base_version=base_version, size=len(blob))
        reply = self._rpc("PushUpdate", self._pb.PushUpdateReply.FromString, chunk_messages(meta.SerializeToString(), blob), True)
        return {"key": reply.key, "version": reply.version}
