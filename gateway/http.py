"""The gateway's HTTP/1.1 API (see docs/api.md).

A small server of its own rather than a framework: request bodies are received with
``recv_into`` straight into the shared-memory object (frameworks read them into buffers of
their own first), models are sent with ``sendfile`` from shared memory, and the server
decides exactly when a request is refused (before its body is read, when possible).

Parsing is strict (RFC 9110/9112) and never crashes: ``parse_head`` and ``parse_chunk_size``
are pure functions of the bytes received, every malformed input is refused with a documented
4xx (and its connection closed), and an unexpected exception answers 500 and is logged while
the server goes on. Timeouts, rates and connection counts are the ``Stream``'s and the
``ThreadedServer``'s (gateway/stream.py).
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

from lifl.auth import Principal
from lifl.errors import BadRequest, Internal, LiflError, NotFound, Overloaded, PayloadTooLarge, Unauthenticated
from lifl.gateway.service import GatewayService, Ingest, ModelView, PartialMeta
from lifl.gateway.stream import Stream, ThreadedServer, sendfile_all
from lifl.net.limits import ConnectionLimits

MAX_HEAD = 64 << 10  # bytes of a request head: request line, fields, CRLFs and the empty line
MAX_HEADER_FIELDS = 100  # fields in a head (and in a chunked body's trailer)
MAX_HEADER_LINE = 8 << 10  # bytes of one line of a head, the request line included, without its CRLF
MAX_CHUNK_LINE = 1024  # bytes of a chunk-size line with its extensions, without its CRLF
MAX_JSON_BODY = 1 << 20
MAX_QUERY_BODY = 8 << 20  # a query's JSON (inference inputs travel in it)
DRAIN_LIMIT = 1 << 20  # a refused body up to this size is read and dropped to keep the connection
LINGER_SECONDS = 2.0
HEALTH_CHECK = ("GET", "/healthz")  # the one request answered on a reserved connection

REASONS = {
    100: "Continue", 200: "OK", 201: "Created", 202: "Accepted", 204: "No Content", 400: "Bad Request",
    401: "Unauthorized", 403: "Forbidden", 404: "Not Found",
    405: "Method Not Allowed", 408: "Request Timeout", 409: "Conflict", 413: "Payload Too Large",
    422: "Unprocessable Entity", 431: "Request Header Fields Too Large", 500: "Internal Server Error",
    503: "Service Unavailable",
}


class HeadTooLarge(LiflError):
    """A request head (or trailer) over one of its limits (HTTP 431)."""

    status = 431
    default_code = "head_too_large"


class RequestTimeout(LiflError):
    """The client stalled: its head was late, or its body too slow (HTTP 408; the connection closes)."""

    status = 408
    grpc_status = "DEADLINE_EXCEEDED"
    default_code = "request_timeout"


# -- parsing: pure functions of the bytes received --------------------------------------------------
_TCHAR = r"!#$%&'*+\-.^_`|~0-9A-Za-z"
_TOKEN = re.compile(f"[{_TCHAR}]+")
_FIELD_VALUE = re.compile(r"[\t\x20-\x7e\x80-\xff]*")  # visible characters, spaces and obs-text; no controls
_TARGET = re.compile(r"/[\x21-\x7e]*")  # origin-form
_VERSION = re.compile(r"HTTP/1\.[01]")
_CONTENT_LENGTH = re.compile(r"[0-9]{1,18}")  # ASCII digits: str.isdigit() also takes "²" and "٣"
_OWS = " \t"
_QUOTED = rb'"(?:[\t \x21\x23-\x5b\x5d-\x7e\x80-\xff]|\\[\t \x21-\x7e\x80-\xff])*"'
_TOKEN_BYTES = _TCHAR.encode()
_CHUNK_SIZE_LINE = re.compile(
    rb"([0-9A-Fa-f]{1,16})(?:[ \t]*;[ \t]*[" + _TOKEN_BYTES + rb"]+(?:[ \t]*=[ \t]*(?:[" + _TOKEN_BYTES + rb"]+|" + _QUOTED + rb"))?)*"
)
_QUERY_LIMIT = re.compile(r"[0-9]{1,5}")
_SINGLETONS = ("content-length", "transfer-encoding", "host")  # fields that must not repeat


@dataclass(frozen=True)
class RequestHead:
    method: str
    path: str
    query: str
    version: str
    headers: dict[str, str]  # by lower-case name; a repeated field's values joined with ", "
    length: int | None  # Content-Length
    chunked: bool
    keep_alive: bool


def parse_head(head: bytes) -> RequestHead:
    """Parse a request head ending in an empty line; BadRequest or HeadTooLarge if it is not
    exactly what RFC 9112 allows (no obs-fold, no controls in values, tokens for names, one
    framing: ASCII-digit Content-Length or ``Transfer-Encoding: chunked``)."""
    if len(head) > MAX_HEAD:
        raise HeadTooLarge(f"the request head exceeds {MAX_HEAD} bytes")
    if not head.endswith(b"\r\n\r\n"):
        raise BadRequest("a request head ends with an empty line", code="bad_request_line")
    text = head.decode("latin-1")
    start = 0
    while text.startswith("\r\n", start):  # empty lines before a request line are ignored (RFC 9112, 2.2)
        start += 2
    lines = text[start:-4].split("\r\n")
    if len(lines) - 1 > MAX_HEADER_FIELDS:
        raise HeadTooLarge(f"the request has more than {MAX_HEADER_FIELDS} header fields", code="too_many_headers")
    if any(len(line) > MAX_HEADER_LINE for line in lines):
        raise HeadTooLarge(f"a line of the request head exceeds {MAX_HEADER_LINE} bytes", code="header_line_too_long")
    parts = lines[0].split(" ")
    if len(parts) != 3 or not (_TOKEN.fullmatch(parts[0]) and _TARGET.fullmatch(parts[1]) and _VERSION.fullmatch(parts[2])):
        raise BadRequest(f"bad request line {lines[0][:80]!r}", code="bad_request_line")
    method, target, version = parts
    headers: dict[str, str] = {}
    for line in lines[1:]:
        name, value = parse_field_line(line)
        key = name.lower()
        if key not in headers:
            headers[key] = value
        elif key in _SINGLETONS:
            raise BadRequest(f"header {name} appears twice", code="bad_header")
        else:
            headers[key] = f"{headers[key]}, {value}"
    length: int | None = None
    chunked = "transfer-encoding" in headers
    if chunked:
        encoding = headers["transfer-encoding"]
        if not (encoding.isascii() and encoding.lower() == "chunked"):
            raise BadRequest(f"unsupported Transfer-Encoding {encoding[:32]!r}: only chunked", code="bad_header")
        if "content-length" in headers:
            raise BadRequest("both Content-Length and Transfer-Encoding are set", code="bad_header")
        if version == "HTTP/1.0":
            raise BadRequest("HTTP/1.0 has no Transfer-Encoding", code="bad_header")
    elif "content-length" in headers:
        if not _CONTENT_LENGTH.fullmatch(headers["content-length"]):
            raise BadRequest("Content-Length must be 1-18 ASCII digits", code="bad_header")
        length = int(headers["content-length"])
    options = {token.strip(_OWS).lower() for token in headers.get("connection", "").split(",")}
    keep_alive = "close" not in options if version == "HTTP/1.1" else "keep-alive" in options
    path, _, query = target.partition("?")
    return RequestHead(method, path, query, version, headers, length, chunked, keep_alive)


def parse_field_line(line: str) -> tuple[str, str]:
    """``name: value`` of a head or trailer (latin-1 text); BadRequest unless the name is a
    token right before the colon and the value, without surrounding spaces and tabs, has no
    control characters (a line starting with whitespace, obs-fold, is refused too)."""
    name, sep, value = line.partition(":")
    if not sep or not _TOKEN.fullmatch(name):
        raise BadRequest(f"bad header line {line[:80]!r}", code="bad_header")
    value = value.strip(_OWS)  # only SP and HTAB: str.strip() would also drop \x0b, \x1c-\x1f, \x85...
    if not _FIELD_VALUE.fullmatch(value):
        raise BadRequest(f"header {name[:80]} has control characters in its value", code="bad_header")
    return name, value


def parse_chunk_size(line: bytes) -> int:
    """The size of a chunk from its size line (without CRLF): hex digits and well-formed
    extensions, which are ignored; BadRequest for anything else."""
    match = _CHUNK_SIZE_LINE.fullmatch(line)
    if match is None:
        raise BadRequest(f"bad chunk size line {line[:32]!r}", code="bad_chunk")
    return int(match.group(1), 16)


class Body:
    """A request body, by Content-Length or chunked; reads go straight into the caller's memory.
    A peer that stalls gets RequestTimeout, one that goes away BadRequest ``truncated``."""

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
        try:
            return self._readinto(view)
        except TimeoutError as e:
            raise RequestTimeout(str(e), code="body_timeout") from None
        except (EOFError, ConnectionError):
            raise BadRequest("connection closed in the middle of the request body", code="truncated") from None

    def _readinto(self, view: memoryview) -> int:
        if self._ended or not len(view):
            return 0
        if self._chunked and self._left == 0:
            self._next_chunk()
            if self._ended:
                return 0
        n = self._stream.readinto(view[: min(len(view), self._left)])
        if n == 0:
            raise EOFError("connection closed")
        self._left -= n
        if self._left == 0:
            if self._chunked:
                if self._stream.read_exact(2) != b"\r\n":
                    raise BadRequest("chunk data is not followed by CRLF", code="bad_chunk")
            else:
                self._ended = True
        return n

    def _next_chunk(self) -> None:
        line = self._stream.read_until(b"\r\n", MAX_CHUNK_LINE + 2)
        if line is None:
            raise BadRequest(f"a chunk size line exceeds {MAX_CHUNK_LINE} bytes", code="bad_chunk")
        self._left = parse_chunk_size(line[:-2])
        if self._left == 0:
            self._skip_trailer()
            self._ended = True

    def _skip_trailer(self) -> None:
        """Read the trailer's fields, within the limits of a head, and drop them."""
        size = fields = 0
        while (line := self._stream.read_until(b"\r\n", MAX_HEADER_LINE + 2)) != b"\r\n":
            if line is None:
                raise HeadTooLarge(f"a trailer line exceeds {MAX_HEADER_LINE} bytes", code="header_line_too_long")
            size, fields = size + len(line), fields + 1
            if fields > MAX_HEADER_FIELDS:
                raise HeadTooLarge(f"the trailer has more than {MAX_HEADER_FIELDS} fields", code="too_many_headers")
            if size > MAX_HEAD:
                raise HeadTooLarge(f"the trailer exceeds {MAX_HEAD} bytes")
            parse_field_line(line[:-2].decode("latin-1"))

    def read_all(self, limit: int) -> bytes:
        if self.length is not None and self.length > limit:
            raise PayloadTooLarge(f"request body of {self.length} bytes exceeds {limit} bytes", code="body_too_large")
        out = bytearray()
        chunk = bytearray(1 << 16)
        while not self._ended:
            n = self.readinto(memoryview(chunk))
            out += chunk[:n]
            if len(out) > limit:
                raise PayloadTooLarge(f"request body exceeds {limit} bytes", code="body_too_large")
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
    query: str
    headers: dict[str, str]
    body: Body
    keep_alive: bool
    stream: Stream


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
    if isinstance(e, Unauthenticated):
        headers["WWW-Authenticate"] = 'Bearer realm="lifl"'  # RFC 6750
    response = json_response(e.status, e.body(), headers)
    response.close = isinstance(e, RequestTimeout)  # the client stalled mid-request: nothing more to read
    return response


def internal_error_response(e: Exception) -> Response:
    """A bug: log it, answer 500 and close the connection (its state is unknown); the server goes on."""
    traceback.print_exc()
    response = error_response(Internal(f"internal error ({type(e).__name__}); the gateway's log has the details"))
    response.close = True
    return response


def response_head(r: Response, *, close: bool) -> bytes:
    headers = dict(r.headers or {})
    if r.status != 204:  # a 204 has no body, and says nothing of its length
        headers["Content-Length"] = str(r.sendfile[1] if r.sendfile else len(r.body))
    if close:
        headers["Connection"] = "close"
    head = f"HTTP/1.1 {r.status} {REASONS.get(r.status, 'Unknown')}\r\n"
    return (head + "".join(f"{k}: {v}\r\n" for k, v in headers.items()) + "\r\n").encode("latin-1")


def _too_many_connections() -> Overloaded:
    return Overloaded("too many connections; retry later", code="too_many_connections")


_REFUSED = error_response(_too_many_connections())
_REFUSAL = response_head(_REFUSED, close=True) + _REFUSED.body  # sent from the accept loop, built once


class HttpServer(ThreadedServer):
    def __init__(self, service: GatewayService, host: str, port: int, limits: ConnectionLimits | None = None) -> None:
        limits = limits or ConnectionLimits()
        super().__init__(host, port, limits, reserve=limits.reserved)
        self.service = service
        # Every route but the health check needs a caller (metrics too, unless they are open);
        # the service authorizes each operation.
        self._routes: list[tuple[str, re.Pattern[str], Callable[..., Response]]] = [
            ("POST", re.compile(r"/v1/tokens"), self.create_token),
            ("GET", re.compile(r"/v1/tokens"), self.list_tokens),
            ("DELETE", re.compile(r"/v1/tokens/([^/]+)"), self.revoke_token),
            ("POST", re.compile(r"/v1/jobs"), self.create_job),
            ("GET", re.compile(r"/v1/jobs"), self.list_jobs),
            ("GET", re.compile(r"/v1/jobs/([^/]+)"), self.get_job),
            ("PUT", re.compile(r"/v1/jobs/([^/]+)/model"), self.put_model),
            ("GET", re.compile(r"/v1/jobs/([^/]+)/model"), self.get_model),
            ("POST", re.compile(r"/v1/jobs/([^/]+)/updates"), self.post_update),
            ("POST", re.compile(r"/v1/jobs/([^/]+)/queries"), self.post_query),
            ("GET", re.compile(r"/v1/jobs/([^/]+)/retention"), self.get_retention),
            ("PUT", re.compile(r"/v1/jobs/([^/]+)/retention"), self.put_retention),
            ("GET", re.compile(r"/v1/jobs/([^/]+)/rounds"), self.get_rounds),
            ("POST", re.compile(r"/v1/jobs/([^/]+)/leases"), self.take_lease),
            ("GET", re.compile(r"/v1/jobs/([^/]+)/assignment"), self.get_assignment),
            ("POST", re.compile(r"/v1/internal/jobs/([^/]+)/rounds/([0-9]{1,18})/partials"), self.post_partial),
            ("GET", re.compile(r"/v1/internal/jobs/([^/]+)/model"), self.get_local_model),
            ("POST", re.compile(r"/v1/internal/jobs/([^/]+)/queries"), self.post_peer_query),
            ("PUT", re.compile(r"/v1/jobs/([^/]+)/leases/([^/]+)"), self.heartbeat),
            ("DELETE", re.compile(r"/v1/jobs/([^/]+)/leases/([^/]+)"), self.release_lease),
            ("GET", re.compile(r"/metrics"), self.metrics),
            ("GET", re.compile(r"/healthz"), lambda req, principal: json_response(200, {"ok": True})),
        ]

    def refuse(self, sock: socket.socket) -> None:
        sock.send(_REFUSAL)  # non-blocking: what does not fit in the socket's buffer is not sent

    # -- connection ----------------------------------------------------------------------------
    def serve(self, sock: socket.socket) -> None:
        conn = self.connection(sock)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        try:
            while self._exchange(conn.stream, reserved=conn.reserved):
                pass
        except (OSError, EOFError):
            pass  # the peer went away, stayed idle too long, or the connection was evicted
        finally:
            self.service.close_thread()

    def _exchange(self, stream: Stream, *, reserved: bool) -> bool:
        """Read one request and answer it; whether the connection stays open for another."""
        if not stream.expect_request():
            return False
        request: Request | None = None
        try:
            request = self._read_request(stream)
            response = self._handle(request, reserved=reserved)
        except LiflError as e:  # the head is refused: what follows it cannot be framed
            response = error_response(e)
        except (OSError, EOFError):
            raise
        except Exception as e:
            response = internal_error_response(e)
        close = response.close or reserved or request is None or not request.keep_alive
        if request is not None and not request.body.ended:  # refused before reading it all
            close = close or not request.body.drain(DRAIN_LIMIT)
        try:
            self._send(stream, response, close=close)
        finally:
            if response.after_send:
                response.after_send()
        if close:
            stream.closing()
            self._linger(stream.sock)
        return not close

    @staticmethod
    def _read_request(stream: Stream) -> Request:
        try:
            head = stream.read_until(b"\r\n\r\n", MAX_HEAD)
        except TimeoutError as e:
            raise RequestTimeout(str(e), code="head_timeout") from None
        except EOFError:
            raise BadRequest("connection closed in the middle of the request head", code="truncated") from None
        if head is None:
            raise HeadTooLarge(f"the request head exceeds {MAX_HEAD} bytes")
        h = parse_head(head)
        stream.expect_body()
        return Request(h.method, h.path, h.query, h.headers, Body(stream, h.length, h.chunked), h.keep_alive, stream)

    def _handle(self, request: Request, *, reserved: bool) -> Response:
        if reserved and (request.method, request.path) != HEALTH_CHECK:
            return error_response(_too_many_connections())
        allowed = []
        for method, pattern, handler in self._routes:
            match = pattern.fullmatch(request.path)
            if match:
                if method == request.method:
                    try:
                        return handler(request, self._caller(request), *match.groups())
                    except LiflError as e:
                        return error_response(e)
                    except Exception as e:
                        return internal_error_response(e)
                allowed.append(method)
        if allowed:
            r = json_response(405, BadRequest(f"{request.method} is not allowed on {request.path}", code="method_not_allowed").body())
            r.headers["Allow"] = ", ".join(allowed)
            return r
        return error_response(NotFound(f"no such endpoint {request.method} {request.path}"))

    def _caller(self, request: Request) -> Principal | None:
        """Who sent ``request``; None for what anyone may ask (health, and open metrics)."""
        if request.path == HEALTH_CHECK[1] or (request.path == "/metrics" and self.service.open_metrics):
            return None
        return self.service.authenticate(request.headers.get("authorization"), request.stream.peer_certificate)

    def _send(self, stream: Stream, r: Response, *, close: bool) -> None:
        head = response_head(r, close=close)
        if r.sendfile:
            stream.send_all(head)
            sendfile_all(stream.sock, *r.sendfile, self.limits.idle_timeout)  # straight out of shared memory
        else:
            stream.send_all(head + r.body)

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
    def _json_body(req: Request, what: str, limit: int = MAX_JSON_BODY) -> Any:
        data = req.body.read_all(limit) or b"null"
        try:
            return json.loads(data)
        except json.JSONDecodeError as e:
            raise BadRequest(f"{what} is not valid JSON: {e.msg} at position {e.pos}", code="bad_json") from None
        except (ValueError, RecursionError):  # not UTF-8, a number of thousands of digits, nesting too deep
            raise BadRequest(f"{what} is not acceptable JSON (encoding, number length or nesting)", code="bad_json") from None

    def create_token(self, req: Request, caller: Principal) -> Response:
        return json_response(201, self.service.create_token(caller, self._json_body(req, "token request")))

    def list_tokens(self, req: Request, caller: Principal) -> Response:
        return json_response(200, {"tokens": self.service.list_tokens(caller)})

    def revoke_token(self, req: Request, caller: Principal, token_id: str) -> Response:
        self.service.revoke_token(caller, token_id)
        return Response(204)

    def create_job(self, req: Request, caller: Principal) -> Response:
        return json_response(201, self.service.create_job(caller, self._json_body(req, "job")))

    def post_query(self, req: Request, caller: Principal, job: str) -> Response:
        return json_response(200, self.service.query(caller, job, self._json_body(req, "query", MAX_QUERY_BODY)))

    def post_peer_query(self, req: Request, caller: Principal, job: str) -> Response:
        """A peer gateway asks for this node's part of a split query."""
        return json_response(200, self.service.peer_query(caller, job, self._json_body(req, "query", MAX_QUERY_BODY)))

    def get_retention(self, req: Request, caller: Principal, job: str) -> Response:
        return json_response(200, self.service.retention(caller, job))

    def put_retention(self, req: Request, caller: Principal, job: str) -> Response:
        return json_response(200, self.service.set_retention(caller, job, self._json_body(req, "retention policy")))

    def get_rounds(self, req: Request, caller: Principal, job: str) -> Response:
        limit = 100
        if req.query:
            params = urllib.parse.parse_qs(req.query)
            text = params.get("limit", ["100"])[0]
            if not _QUERY_LIMIT.fullmatch(text) or not 1 <= int(text) <= 10000:
                raise BadRequest("limit must be an integer in [1, 10000]", code="bad_query")
            limit = int(text)
        return json_response(200, {"rounds": self.service.rounds(caller, job, limit)})

    def get_assignment(self, req: Request, caller: Principal, job: str) -> Response:
        params = urllib.parse.parse_qs(req.query, keep_blank_values=True)
        clients = params.get("client", [])
        if len(clients) > 1:
            raise BadRequest("give at most one client: ?client=ID", code="bad_query")
        return json_response(200, self.service.assignment(caller, job, clients[0] if clients else None))

    def post_partial(self, req: Request, caller: Principal, job: str, round_id: str) -> Response:
        """Another node's result of a round, for the top on this node (gateway to gateway)."""
        h = req.headers
        meta = PartialMeta.parse(round_id, h.get("x-lifl-epoch"), h.get("x-lifl-from-node"), h.get("x-lifl-samples"),
                                 h.get("x-lifl-updates"), h.get("x-lifl-partial"))
        _require_framing(req)
        ingest = self.service.begin_partial(caller, job, meta, req.body.length)
        return json_response(202, self._receive(req, ingest))

    def get_local_model(self, req: Request, caller: Principal, job: str) -> Response:
        """The model if this node holds it, never fetched from elsewhere (what peers ask for)."""
        return self._model_response(self.service.open_peer_model(caller, job))

    def take_lease(self, req: Request, caller: Principal, job: str) -> Response:
        body = self._json_body(req, "lease request")
        client = body.get("client") if isinstance(body, dict) else None
        return json_response(201, self.service.take_lease(caller, job, client))

    def heartbeat(self, req: Request, caller: Principal, job: str, lease: str) -> Response:
        return json_response(200, self.service.heartbeat(caller, job, lease))

    def release_lease(self, req: Request, caller: Principal, job: str, lease: str) -> Response:
        self.service.release_lease(caller, job, lease)
        return Response(204)

    def list_jobs(self, req: Request, caller: Principal) -> Response:
        return json_response(200, {"jobs": self.service.job_names(caller)})

    def get_job(self, req: Request, caller: Principal, job: str) -> Response:
        return json_response(200, self.service.job_status(caller, job))

    def put_model(self, req: Request, caller: Principal, job: str) -> Response:
        _require_framing(req)
        ingest = self.service.begin_model(caller, job, "http", req.body.length)
        return json_response(201, self._receive(req, ingest))

    def post_update(self, req: Request, caller: Principal, job: str) -> Response:
        h = req.headers
        _require_framing(req)
        fields = {"client": h.get("x-lifl-client"), "samples": h.get("x-lifl-samples"),
                  "base_version": h.get("x-lifl-base-version"), "lease": h.get("x-lifl-lease", "")}
        ingest = self.service.begin_update(caller, job, fields, "http", req.body.length)
        return json_response(202, self._receive(req, ingest))

    def _receive(self, req: Request, ingest: Ingest) -> dict[str, Any]:
        if req.headers.get("expect", "").lower() == "100-continue":
            req.stream.send_all(b"HTTP/1.1 100 Continue\r\n\r\n")
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

    def get_model(self, req: Request, caller: Principal, job: str) -> Response:
        return self._model_response(self.service.open_model(caller, job))

    def _model_response(self, view: ModelView) -> Response:
        self.service.metrics.bytes_out.labels("http").inc(view.size)
        return Response(
            200, headers={"Content-Type": "application/octet-stream", "X-Lifl-Version": str(view.version)},
            sendfile=(view.fd, view.size), after_send=view.release,
        )

    def metrics(self, req: Request, caller: Principal | None) -> Response:
        return Response(200, self.service.metrics_text(caller), {"Content-Type": "text/plain; version=0.0.4; charset=utf-8"})


def _require_framing(req: Request) -> None:
    if not req.body.framed:
        raise BadRequest("a blob needs Content-Length or chunked Transfer-Encoding", code="length_required")
