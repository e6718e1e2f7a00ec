"""The gateway's HTTP/1.1 API (see docs/api.md).

A small server of its own rather than a framework: request bodies are received with
``recv_into`` straight into the shared-memory object (frameworks read them into buffers of
their own first), models are sent with ``sendfile`` from shared memory, and the server
decides exactly when a request is refused (before its body is read, when possible).
"""

from __future__ import annotations

import json
import re
import socket
import time
import traceback
import urllib.parse
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from lifl.errors import BadRequest, LiflError, NotFound, Overloaded
from lifl.gateway.service import GatewayService, Ingest, ModelView, PartialMeta, UpdateMeta
from lifl.gateway.stream import Stream, ThreadedServer, sendfile_all

MAX_HEAD = 64 << 10
MAX_JSON_BODY = 1 << 20
IDLE_TIMEOUT = 120.0
DRAIN_LIMIT = 1 << 20  # a refused body up to this size is read and dropped to keep the connection
LINGER_SECONDS = 2.0

REASONS = {
    100: "Continue", 200: "OK", 201: "Created", 202: "Accepted", 204: "No Content", 400: "Bad Request", 404: "Not Found",
    405: "Method Not Allowed", 409: "Conflict", 411: "Length Required", 413: "Payload Too Large",
    422: "Unprocessable Entity", 500: "Internal Server Error", 501: "Not Implemented", 503: "Service Unavailable",
}


class Body:
    """A request body, by Content-Length or chunked; reads go straight into the caller's memory."""

    def __init__(self, stream: Stream, length: int | None, chunked: bool) -> None:
        self._stream = stream
        self.length = length
        self._chunked = chunked
        self._left = length if not chunked else 0  # bytes left (of the body, or of the current chunk)
        self._ended = not chunked and not length

    @property
    def ended(self) -> bool:
        return self._ended

    @property
    def framed(self) -> bool:
        """Whether the body's end is known (Content-Length or chunked); blobs need it."""
        return self._chunked or self.length is not None

    def readinto(self, view: memoryview) -> int:
        if self._ended or not len(view):
            return 0
        if self._chunked and self._left == 0:
            self._next_chunk()
            if self._ended:
                return 0
        n = self._stream.readinto(view[: min(len(view), self._left)])
        if n == 0:
            raise BadRequest("connection closed in the middle of the request body", code="truncated")
        self._left -= n
        if self._left == 0:
            if self._chunked:
                if self._stream.read_exact(2) != b"\r\n":
                    raise BadRequest("chunk data is not followed by CRLF", code="bad_chunk")
            else:
                self._ended = True
        return n

    def _next_chunk(self) -> None:
        line = self._stream.read_until(b"\r\n", 1024)[:-2]
        size = line.split(b";", 1)[0].strip()
        if not size or not re.fullmatch(rb"[0-9a-fA-F]{1,15}", size):
            raise BadRequest(f"bad chunk size line {line[:32]!r}", code="bad_chunk")
        self._left = int(size, 16)
        if self._left == 0:
            while self._stream.read_until(b"\r\n", MAX_HEAD) != b"\r\n":  # trailers, ignored
                pass
            self._ended = True

    def read_all(self, limit: int) -> bytes:
        out = bytearray()
        chunk = bytearray(1 << 16)
        while not self._ended:
            n = self.readinto(memoryview(chunk))
            out += chunk[:n]
            if len(out) > limit:
                raise BadRequest(f"request body exceeds {limit} bytes", code="body_too_large")
        return bytes(out)

    def drain(self, limit: int) -> bool:
        """Read and drop the rest of a Content-Length body of at most ``limit`` bytes, so the
        connection stays usable; False (close the connection) for anything else."""
        if self._chunked or self._left > limit:
            return False
        scratch = memoryview(bytearray(1 << 16))
        try:
            while not self._ended:
                self.readinto(scratch)
        except (LiflError, OSError):
            return False
        return True


@dataclass
class Request:
    method: str
    path: str
    headers: dict[str, str]
    body: Body
    keep_alive: bool
    sock: socket.socket
    query: str = ""


@dataclass
class Response:
    status: int
    body: bytes = b""
    headers: dict[str, str] | None = None
    sendfile: Any = None  # (fd, size): sent from shared memory after the headers
    close: bool = False
    after_send: Callable[[], None] | None = None  # e.g. release the model's reference


def json_response(status: int, obj: Any, headers: dict[str, str] | None = None) -> Response:
    return Response(status, json.dumps(obj).encode() + b"\n", {"Content-Type": "application/json", **(headers or {})})


def error_response(e: LiflError) -> Response:
    headers = {}
    if e.retry_after is not None:
        headers["Retry-After"] = str(max(1, round(e.retry_after)))
    return json_response(e.status, e.body(), headers)


class HttpServer(ThreadedServer):
    def __init__(self, service: GatewayService, host: str, port: int) -> None:
        super().__init__(host, port)
        self.service = service
        self._routes: list[tuple[str, re.Pattern[str], Callable[..., Response]]] = [
            ("POST", re.compile(r"/v1/jobs"), self.create_job),
            ("GET", re.compile(r"/v1/jobs"), self.list_jobs),
            ("GET", re.compile(r"/v1/jobs/([^/]+)"), self.get_job),
            ("PUT", re.compile(r"/v1/jobs/([^/]+)/model"), self.put_model),
            ("GET", re.compile(r"/v1/jobs/([^/]+)/model"), self.get_model),
            ("POST", re.compile(r"/v1/jobs/([^/]+)/updates"), self.post_update),
            ("GET", re.compile(r"/v1/jobs/([^/]+)/rounds"), self.get_rounds),
            ("POST", re.compile(r"/v1/jobs/([^/]+)/leases"), self.take_lease),
            ("GET", re.compile(r"/v1/jobs/([^/]+)/assignment"), self.get_assignment),
            ("POST", re.compile(r"/v1/internal/jobs/([^/]+)/rounds/([0-9]{1,18})/partials"), self.post_partial),
            ("GET", re.compile(r"/v1/internal/jobs/([^/]+)/model"), self.get_local_model),
            ("PUT", re.compile(r"/v1/jobs/([^/]+)/leases/([^/]+)"), self.heartbeat),
            ("DELETE", re.compile(r"/v1/jobs/([^/]+)/leases/([^/]+)"), self.release_lease),
            ("GET", re.compile(r"/metrics"), self.metrics),
            ("GET", re.compile(r"/healthz"), lambda req: json_response(200, {"ok": True})),
        ]

    def refuse(self, sock: socket.socket) -> None:
        body = json.dumps(Overloaded("too many connections").body()).encode()
        sock.sendall(b"HTTP/1.1 503 Service Unavailable\r\nRetry-After: 1\r\nConnection: close\r\n"
                     b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))

    # -- connection ----------------------------------------------------------------------------
    def serve(self, sock: socket.socket) -> None:
        sock.settimeout(IDLE_TIMEOUT)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        stream = Stream(sock)
        try:
            while True:
                try:
                    head = stream.read_until(b"\r\n\r\n", MAX_HEAD)
                except (EOFError, OSError):
                    return
                try:
                    request = self._parse(head, stream)
                except LiflError as e:
                    self._send(sock, error_response(e), close=True)
                    return
                response = self._handle(request)
                close = response.close or not request.keep_alive
                if not request.body.ended:  # refused before reading it all
                    close = close or not request.body.drain(DRAIN_LIMIT)
                try:
                    self._send(sock, response, close=close)
                finally:
                    if response.after_send:
                        response.after_send()
                if close:
                    self._linger(sock)
                    return
        except (OSError, EOFError):
            return
        finally:
            self.service.close_thread()

    @staticmethod
    def _parse(head: bytes, stream: Stream) -> Request:
        try:
            text = head.decode("latin-1")
        except UnicodeDecodeError:  # pragma: no cover - latin-1 decodes every byte
            raise BadRequest("request head is not text") from None
        lines = text[:-4].split("\r\n")
        parts = lines[0].split(" ")
        if len(parts) != 3 or not parts[2].startswith("HTTP/1."):
            raise BadRequest(f"bad request line {lines[0][:80]!r}", code="bad_request_line")
        method, target, version = parts
        headers: dict[str, str] = {}
        for line in lines[1:]:
            name, sep, value = line.partition(":")
            if not sep or not name or name != name.strip():
                raise BadRequest(f"bad header line {line[:80]!r}", code="bad_header")
            key = name.lower()
            if key in headers and key in ("content-length", "transfer-encoding", "host"):
                raise BadRequest(f"header {name} appears twice", code="bad_header")
            headers[key] = f"{headers[key]}, {value.strip()}" if key in headers else value.strip()
        chunked = False
        length: int | None = None
        if "transfer-encoding" in headers:
            if headers["transfer-encoding"].lower() != "chunked":
                raise BadRequest(f"unsupported Transfer-Encoding {headers['transfer-encoding']!r}", code="bad_header")
            if "content-length" in headers:
                raise BadRequest("both Content-Length and Transfer-Encoding are set", code="bad_header")
            chunked = True
        elif "content-length" in headers:
            if not headers["content-length"].isdigit():
                raise BadRequest("Content-Length must be a non-negative integer", code="bad_header")
            length = int(headers["content-length"])
        connection = headers.get("connection", "").lower()
        keep_alive = "close" not in connection if version == "HTTP/1.1" else "keep-alive" in connection
        path, _, query = target.partition("?")
        return Request(method, path, headers, Body(stream, length, chunked), keep_alive, stream.sock, query)

    def _handle(self, request: Request) -> Response:
        allowed = []
        for method, pattern, handler in self._routes:
            match = pattern.fullmatch(request.path)
            if match:
                if method == request.method:
                    try:
                        return handler(request, *match.groups()) if match.groups() else handler(request)
                    except LiflError as e:
                        return error_response(e)
                    except Exception as e:  # a bug: report it, keep the server up
                        traceback.print_exc()
                        return error_response(LiflError(f"internal error: {type(e).__name__}: {e}", code="internal"))
                allowed.append(method)
        if allowed:
            r = json_response(405, BadRequest(f"{request.method} is not allowed on {request.path}", code="method_not_allowed").body())
            r.headers["Allow"] = ", ".join(allowed)
            return r
        return error_response(NotFound(f"no such endpoint {request.method} {request.path}"))

    @staticmethod
    def _send(sock: socket.socket, r: Response, *, close: bool) -> None:
        headers = dict(r.headers or {})
        if r.status != 204:  # a 204 has no body, and says nothing of its length
            headers["Content-Length"] = str(r.sendfile[1] if r.sendfile else len(r.body))
        if close:
            headers["Connection"] = "close"
        head = f"HTTP/1.1 {r.status} {REASONS.get(r.status, 'Unknown')}\r\n"
        head += "".join(f"{k}: {v}\r\n" for k, v in headers.items()) + "\r\n"
        if r.sendfile:
            sock.sendall(head.encode("latin-1"))
            sendfile_all(sock, *r.sendfile, IDLE_TIMEOUT)  # straight out of shared memory
        else:
            sock.sendall(head.encode("latin-1") + r.body)

    @staticmethod
    def _linger(sock: socket.socket) -> None:
        """Half-close and read what the client still sends, so it sees our response, not a reset."""
        try:
            sock.shutdown(socket.SHUT_WR)
            sock.settimeout(LINGER_SECONDS)
            deadline = time.monotonic() + LINGER_SECONDS
            while time.monotonic() < deadline and sock.recv(1 << 16):
                pass
        except OSError:
            pass

    # -- endpoints -----------------------------------------------------------------------------
    @staticmethod
    def _json_body(req: Request, what: str) -> Any:
        try:
            return json.loads(req.body.read_all(MAX_JSON_BODY) or b"null")
        except json.JSONDecodeError as e:
            raise BadRequest(f"{what} is not valid JSON: {e.msg} at position {e.pos}", code="bad_json") from None

    def create_job(self, req: Request) -> Response:
        return json_response(201, self.service.create_job(self._json_body(req, "job")))

    def get_rounds(self, req: Request, job: str) -> Response:
        limit = 100
        if req.query:
            params = urllib.parse.parse_qs(req.query)
            text = params.get("limit", ["100"])[0]
            if not text.isdigit() or not 1 <= int(text) <= 10000:
                raise BadRequest("limit must be an integer in [1, 10000]", code="bad_query")
            limit = int(text)
        return json_response(200, {"rounds": self.service.rounds(job, limit)})

    def get_assignment(self, req: Request, job: str) -> Response:
        params = urllib.parse.parse_qs(req.query, keep_blank_values=True)
        clients = params.get("client", [])
        if len(clients) != 1:
            raise BadRequest("give exactly one client: ?client=ID", code="bad_query")
        return json_response(200, self.service.assignment(job, clients[0]))

    def post_partial(self, req: Request, job: str, round_id: str) -> Response:
        """Another node's result of a round, for the top on this node (gateway to gateway)."""
        h = req.headers
        meta = PartialMeta.parse(round_id, h.get("x-lifl-epoch"), h.get("x-lifl-from-node"), h.get("x-lifl-samples"),
                                 h.get("x-lifl-updates"), h.get("x-lifl-partial"))
        _require_framing(req)
        ingest = self.service.begin_partial(job, meta, req.body.length)
        return json_response(202, self._receive(req, ingest))

    def get_local_model(self, req: Request, job: str) -> Response:
        """The model if this node holds it, never fetched from elsewhere (what peers ask for)."""
        return self._model_response(self.service.open_local_model(job))

    def take_lease(self, req: Request, job: str) -> Response:
        body = self._json_body(req, "lease request")
        client = body.get("client") if isinstance(body, dict) else None
        return json_response(201, self.service.take_lease(job, client))

    def heartbeat(self, req: Request, job: str, lease: str) -> Response:
        return json_response(200, self.service.heartbeat(job, lease))

    def release_lease(self, req: Request, job: str, lease: str) -> Response:
        self.service.release_lease(job, lease)
        return Response(204)

    def list_jobs(self, req: Request) -> Response:
        return json_response(200, {"jobs": self.service.state.job_names()})

    def get_job(self, req: Request, job: str) -> Response:
        return json_response(200, self.service.job_status(job))

    def put_model(self, req: Request, job: str) -> Response:
        _require_framing(req)
        ingest = self.service.begin_model(job, "http", req.body.length)
        return json_response(201, self._receive(req, ingest))

    def post_update(self, req: Request, job: str) -> Response:
        h = req.headers
        meta = UpdateMeta.parse(job, h.get("x-lifl-client"), h.get("x-lifl-samples"), h.get("x-lifl-base-version"),
                                h.get("x-lifl-lease", ""))
        _require_framing(req)
        ingest = self.service.begin_update(meta, "http", req.body.length)
        return json_response(202, self._receive(req, ingest))

    def _receive(self, req: Request, ingest: Ingest) -> dict[str, Any]:
        if req.headers.get("expect", "").lower() == "100-continue":
            req.sock.sendall(b"HTTP/1.1 100 Continue\r\n\r\n")
        sink = ingest.sink
        try:
            while not sink.done:
                n = req.body.readinto(sink.buffer())
                if n == 0:
                    sink.check_complete()
                sink.advance(n)
            if not req.body.ended and req.body.readinto(memoryview(bytearray(1))):
                raise BadRequest("the body continues after the end of the blob", code="trailing_bytes")
            return ingest.finish()
        except LiflError as e:
            ingest.abort(e)
            raise
        except BaseException:
            ingest.abort(None)
            raise

    def get_model(self, req: Request, job: str) -> Response:
        return self._model_response(self.service.open_model(job))

    def _model_response(self, view: ModelView) -> Response:
        self.service.metrics.bytes_out.labels("http").inc(view.size)
        return Response(
            200, headers={"Content-Type": "application/octet-stream", "X-Lifl-Version": str(view.version)},
            sendfile=(view.fd, view.size), after_send=view.release,
        )

    def metrics(self, req: Request) -> Response:
        return Response(200, self.service.metrics_text(), {"Content-Type": "text/plain; version=0.0.4; charset=utf-8"})


def _require_framing(req: Request) -> None:
    if not req.body.framed:
        raise BadRequest("a blob needs Content-Length or chunked Transfer-Encoding", code="length_required")
