"""The gateway's HTTP/1.1 API (see docs/api.md).

A small server of its own rather than a framework: request bodies are received with
``recv_into`` straight into the shared-memory object (frameworks read them into buffers of
their own first), models are sent with ``sendfile`` from shared memory, and the server
decides exactly when a request is refused (before its body is read, when possible).

Parsing is strict (RFC 9110/9112) and never crashes: ``parse_head``, ``parse_chunk_size`` and
the body's framing (``Body``) are pure functions of the bytes received, every malformed input is
refused with a documented 4xx (and its connection closed), and an unexpected exception answers
500 and is logged while the server goes on.

Resumable uploads (tus 1.0) are gateway/tus.py's: a PATCH's body is read as an upload's, into
the resumable upload's sink. Model downloads serve one HTTP range (lifl.net.ranges).

Every connection is a state machine on the gateway's event loop (``HttpConnection``): waiting
for a head, reading a body (into memory for a JSON request, into shared memory for a blob),
waiting for the service (whatever blocks runs on the loop's pool; an upload's admission and
hand-over are messages to the agent), writing the response. Timeouts, rates and connection
counts are the ``Conn``'s and the ``LoopServer``'s (gateway/stream.py).
"""

from __future__ import annotations

import json
import re
import socket
import traceback
import urllib.parse
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from lifl.auth import Action, Principal, authorize
from lifl.errors import (
    BadRequest, Internal, LiflError, NotFound, Overloaded, PayloadTooLarge, RangeNotSatisfiable, Unauthenticated,
)
from lifl.gateway.auth_backoff import TooManyAuthFailures
from lifl.gateway.resumable import Resumable
from lifl.gateway.service import GatewayService, Ingest, ModelView, PartialMeta, update_fields
from lifl.gateway.stream import BODY, BUSY, HEAD, IDLE, READ_AHEAD, Conn, ConnectionProtocol, LoopServer, PeerGone, Wait
from lifl.gateway.tus import PatchWriter, ResumableUploads
from lifl.jobs import stage_wait_query, version_wait_query
from lifl.net import tus
from lifl.net.limits import ConnectionLimits
from lifl.net.loop import IO_POOL, SLOW_POOL
from lifl.net.ranges import requested_range

MAX_HEAD = 64 << 10  # bytes of a request head: request line, fields, CRLFs and the empty line
MAX_HEADER_FIELDS = 100  # fields in a head (and in a chunked body's trailer)
MAX_HEADER_LINE = 8 << 10  # bytes of one line of a head, the request line included, without its CRLF
MAX_CHUNK_LINE = 1024  # bytes of a chunk-size line with its extensions, without its CRLF
MAX_JSON_BODY = 1 << 20
MAX_QUERY_BODY = 8 << 20  # a query's JSON (inference inputs travel in it)
DRAIN_LIMIT = 1 << 20  # a refused body up to this size is read and dropped to keep the connection
DRAIN_READ = 1 << 16  # bytes read at a time of a body that is dropped
HEALTH_CHECK = ("GET", "/healthz")  # the one request answered on a reserved connection

REASONS = {
    100: "Continue", 200: "OK", 201: "Created", 202: "Accepted", 204: "No Content", 206: "Partial Content",
    400: "Bad Request", 401: "Unauthorized", 403: "Forbidden", 404: "Not Found",
    405: "Method Not Allowed", 408: "Request Timeout", 409: "Conflict", 412: "Precondition Failed", 413: "Payload Too Large",
    415: "Unsupported Media Type", 416: "Range Not Satisfiable",
    422: "Unprocessable Entity", 429: "Too Many Requests", 431: "Request Header Fields Too Large",
    500: "Internal Server Error", 503: "Service Unavailable",
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
# Every field line of a head at once (each with its CRLF): what parse_field_line checks line by
# line, so that the usual head takes one match; a head it does not match gets the lines' own errors.
_FIELD_LINES = re.compile(f"(?:[{_TCHAR}]+:[\\t\\x20-\\x7e\\x80-\\xff]*\\r\\n)*")
_SINGLETONS = ("content-length", "transfer-encoding", "host")  # fields that must not repeat


class RequestHead(NamedTuple):
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
    fields_start = text.find("\r\n", start) + 2
    well_formed = _FIELD_LINES.fullmatch(text, fields_start, len(text) - 2) is not None
    lines = text[start:-4].split("\r\n")
    if len(lines) - 1 > MAX_HEADER_FIELDS:
        raise HeadTooLarge(f"the request has more than {MAX_HEADER_FIELDS} header fields", code="too_many_headers")
    if len(text) > MAX_HEADER_LINE and any(len(line) > MAX_HEADER_LINE for line in lines):
        raise HeadTooLarge(f"a line of the request head exceeds {MAX_HEADER_LINE} bytes", code="header_line_too_long")
    parts = lines[0].split(" ")
    if len(parts) != 3 or not (_TOKEN.fullmatch(parts[0]) and _TARGET.fullmatch(parts[1]) and _VERSION.fullmatch(parts[2])):
        raise BadRequest(f"bad request line {lines[0][:80]!r}", code="bad_request_line")
    method, target, version = parts
    headers: dict[str, str] = {}
    for line in lines[1:]:
        if well_formed:
            name, _, value = line.partition(":")
            value = value.strip(_OWS)
        else:
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
    connection = headers.get("connection")
    options = {token.strip(_OWS).lower() for token in connection.split(",")} if connection else set()
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


def _truncated() -> BadRequest:
    return BadRequest("connection closed in the middle of the request body", code="truncated")


class Body:
    """A request body's framing, by Content-Length or chunked, without I/O: ``next_data``
    consumes the framing at the front of a buffer (the connection's read-ahead) and says how
    many data bytes come next; the caller reads them where it wants them (a blob's shared
    memory, or ``feed``'s buffer) and says so (``consumed``). Malformed framing is refused with
    BadRequest (``bad_chunk``) or HeadTooLarge (a trailer over a head's limits)."""

    def __init__(self, length: int | None, chunked: bool) -> None:
        self.length = length
        self._chunked = chunked
        self._left = length if not chunked and length else 0  # data bytes left (of the body, or of the current chunk)
        self._ended = not chunked and not length
        self._after_chunk = False  # a chunk's data is in: its CRLF comes next
        self._in_trailer = False
        self._trailer_bytes = self._trailer_fields = 0

    @property
    def ended(self) -> bool:
        return self._ended

    @property
    def framed(self) -> bool:
        """Whether the body's end is known (Content-Length or chunked); blobs need it."""
        return self._chunked or self.length is not None

    def drainable(self, limit: int) -> bool:
        """Whether the rest can be read and dropped to keep the connection: a Content-Length body
        with at most ``limit`` bytes left."""
        return not self._chunked and self._left <= limit

    def next_data(self, buf: bytearray) -> int | None:
        """Consume the framing at the front of ``buf``; then how many data bytes come next at most
        (0: the body ended), or None if more bytes must come into ``buf`` to tell."""
        while not self._ended:
            if self._left:
                return self._left
            if self._after_chunk:
                if len(buf) < 2:
                    return None
                if buf[:2] != b"\r\n":
                    raise BadRequest("chunk data is not followed by CRLF", code="bad_chunk")
                del buf[:2]
                self._after_chunk = False
            elif self._in_trailer:
                line = _line(buf, MAX_HEADER_LINE)
                if line is None:
                    return None
                self._trailer_line(line)
            else:
                line = _line(buf, MAX_CHUNK_LINE)
                if line is None:
                    return None
                self._left = parse_chunk_size(line)
                self._in_trailer = self._left == 0
        return 0

    def _trailer_line(self, line: bytes) -> None:
        """One line of the trailer (its fields are read within the limits of a head, and dropped)."""
        if not line:
            self._ended = True
            return
        self._trailer_bytes, self._trailer_fields = self._trailer_bytes + len(line) + 2, self._trailer_fields + 1
        if self._trailer_fields > MAX_HEADER_FIELDS:
            raise HeadTooLarge(f"the trailer has more than {MAX_HEADER_FIELDS} fields", code="too_many_headers")
        if self._trailer_bytes > MAX_HEAD:
            raise HeadTooLarge(f"the trailer exceeds {MAX_HEAD} bytes")
        parse_field_line(line.decode("latin-1"))

    def consumed(self, n: int) -> None:
        """``n`` data bytes (at most what ``next_data`` said) were taken."""
        self._left -= n
        if not self._left:
            if self._chunked:
                self._after_chunk = True
            else:
                self._ended = True

    def check_size(self, limit: int) -> None:
        """PayloadTooLarge now if the body is announced larger than ``limit``."""
        if self.length is not None and self.length > limit:
            raise PayloadTooLarge(f"request body of {self.length} bytes exceeds {limit} bytes", code="body_too_large")

    def feed(self, buf: bytearray, out: bytearray, limit: int) -> bool:
        """Move the body's data at the front of ``buf`` to ``out`` (at most ``limit`` bytes in
        all: PayloadTooLarge past it); whether the body ended."""
        while (n := self.next_data(buf)) is not None:
            if n == 0:
                return True
            take = min(n, len(buf))
            if not take:
                return False
            out += memoryview(buf)[:take]
            del buf[:take]
            self.consumed(take)
            if len(out) > limit:
                raise PayloadTooLarge(f"request body exceeds {limit} bytes", code="body_too_large")
        return False

    @staticmethod
    def end_of_stream() -> BadRequest:
        """What a body that the peer's end cut short is refused with."""
        return _truncated()


def _line(buf: bytearray, limit: int) -> bytes | None:
    """The line at the front of ``buf`` without its CRLF (taken out of ``buf``), if it has come
    within ``limit`` bytes; None until it has; BadRequest or HeadTooLarge past the limit."""
    end = buf.find(b"\r\n", 0, limit + 2)
    if end < 0:
        if len(buf) < limit + 2:
            return None
        if limit == MAX_CHUNK_LINE:
            raise BadRequest(f"a chunk size line exceeds {MAX_CHUNK_LINE} bytes", code="bad_chunk")
        raise HeadTooLarge(f"a trailer line exceeds {MAX_HEADER_LINE} bytes", code="header_line_too_long")
    line = bytes(buf[:end])
    del buf[: end + 2]
    return line


@dataclass
class Request:
    method: str
    path: str
    query: str
    headers: dict[str, str]
    body: Body
    keep_alive: bool
    peer_certificate: dict[str, Any] | None = None  # the connection's verified TLS client certificate
    data: bytearray = field(default_factory=bytearray)  # a JSON body, once read


@dataclass
class Response:
    status: int
    body: bytes = b""
    headers: dict[str, str] | None = None
    sendfile: tuple[int, int, int] | None = None  # (fd, offset, count): sent from shared memory after the headers
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
    if isinstance(e, RangeNotSatisfiable):
        headers["Content-Range"] = f"bytes */{e.extra['size']}"  # RFC 9110, 15.5.17
    response = json_response(e.status, e.body(), headers)
    # the client stalled mid-request (nothing more to read), or keeps failing to authenticate
    # (each further guess costs it a connection)
    response.close = isinstance(e, (RequestTimeout, TooManyAuthFailures))
    return response


def internal_error_response(e: BaseException) -> Response:
    """A bug: log it, answer 500 and close the connection (its state is unknown); the server goes on."""
    traceback.print_exception(e)
    response = error_response(Internal(f"internal error ({type(e).__name__}); the gateway's log has the details"))
    response.close = True
    return response


def response_head(r: Response, *, close: bool, common: Mapping[str, str] | None = None) -> bytes:
    """The status line and fields of ``r``, after ``common`` ones (its route's)."""
    headers = {**(common or {}), **(r.headers or {})}
    if r.status != 204:  # a 204 has no body, and says nothing of its length
        headers["Content-Length"] = str(r.sendfile[2] if r.sendfile else len(r.body))
    if close:
        headers["Connection"] = "close"
    head = f"HTTP/1.1 {r.status} {REASONS.get(r.status, 'Unknown')}\r\n"
    return (head + "".join(f"{k}: {v}\r\n" for k, v in headers.items()) + "\r\n").encode("latin-1")


def _too_many_connections() -> Overloaded:
    return Overloaded("too many connections; retry later", code="too_many_connections")


_REFUSED = error_response(_too_many_connections())
_REFUSAL = response_head(_REFUSED, close=True) + _REFUSED.body  # sent from the accept handler, built once
CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"
TUS_HEADERS = {"Tus-Resumable": tus.VERSION, "Tus-Version": tus.VERSION}  # on every answer of a resumable upload

# What a route's handler is and where it runs:
LOCAL = "local"  # handler(req) -> Response, on the loop (cheap: health checks)
BLOCKING = "blocking"  # handler(req, caller, *groups) -> Response, on the pool (Redis, other nodes)
UPLOAD = "upload"  # handler(req, caller, *groups, done): an Ingest to receive the body into, on the loop
DOWNLOAD = "download"  # handler(req, caller, *groups, done): a ModelView to send, on the loop
DEFERRED = "deferred"  # handler(req, caller, *groups, done): done(Response, error) on the loop when it is ready


@dataclass(frozen=True)
class Route:
    method: str
    pattern: re.Pattern[str]
    kind: str
    handler: Callable[..., Any]
    body_limit: int = 0  # BLOCKING, DEFERRED: the JSON body read before the handler runs, at most this long (0: none)
    status: int = 200  # UPLOAD: the status of the answer once the blob is handed over
    pool: str = IO_POOL  # BLOCKING: where it runs
    internal: bool = False  # gateway to gateway: the caller's role is checked before anything of the request is read
    headers: Mapping[str, str] | None = None  # fields of every answer, errors included (tus: its version)
    answer: Callable[[Any, Any], Response] | None = None  # UPLOAD: answer(ingest, result); default: status, result as JSON


class HttpServer(LoopServer):
    def __init__(self, service: GatewayService, host: str, port: int, limits: ConnectionLimits | None = None) -> None:
        limits = limits or ConnectionLimits()
        super().__init__(service.loop, host, port, limits, reserve=limits.reserved)
        self.service = service
        self.resumable = ResumableUploads(service, limits)
        # Every route but the health check needs a caller (metrics too, unless they are open);
        # the service authorizes each operation (an internal route's caller is checked first, here).
        self.routes: list[Route] = [
            Route("POST", re.compile(r"/v1/tokens"), BLOCKING, self.create_token, MAX_JSON_BODY),
            Route("GET", re.compile(r"/v1/tokens"), BLOCKING, self.list_tokens),
            Route("DELETE", re.compile(r"/v1/tokens/([^/]+)"), BLOCKING, self.revoke_token),
            Route("GET", re.compile(r"/v1/tenants/([^/]+)/quota"), BLOCKING, self.get_quota),
            Route("PUT", re.compile(r"/v1/tenants/([^/]+)/quota"), BLOCKING, self.put_quota, MAX_JSON_BODY),
            Route("DELETE", re.compile(r"/v1/tenants/([^/]+)/quota"), BLOCKING, self.delete_quota),
            Route("POST", re.compile(r"/v1/jobs"), BLOCKING, self.create_job, MAX_JSON_BODY),
            Route("GET", re.compile(r"/v1/jobs"), BLOCKING, self.list_jobs),
            Route("GET", re.compile(r"/v1/jobs/([^/]+)"), BLOCKING, self.get_job),
            Route("PUT", re.compile(r"/v1/jobs/([^/]+)/model"), UPLOAD, self.put_model, status=201),
            Route("GET", re.compile(r"/v1/jobs/([^/]+)/model"), DOWNLOAD, self.get_model),
            Route("GET", re.compile(r"/v1/jobs/([^/]+)/parts"), BLOCKING, self.get_parts),
            Route("GET", re.compile(r"/v1/jobs/([^/]+)/part"), DOWNLOAD, self.get_part),
            Route("GET", re.compile(r"/v1/jobs/([^/]+)/version"), DEFERRED, self.get_version),
            Route("POST", re.compile(r"/v1/jobs/([^/]+)/updates"), UPLOAD, self.post_update, status=202),
            Route("POST", re.compile(r"/v1/jobs/([^/]+)/uploads"), DEFERRED, self.create_upload, headers=TUS_HEADERS),
            Route("OPTIONS", re.compile(r"/v1/jobs/([^/]+)/uploads"), DEFERRED, self.upload_options, headers=TUS_HEADERS),
            Route("HEAD", re.compile(r"/v1/jobs/([^/]+)/uploads/([^/]+)"), DEFERRED, self.upload_status, headers=TUS_HEADERS),
            Route("PATCH", re.compile(r"/v1/jobs/([^/]+)/uploads/([^/]+)"), UPLOAD, self.patch_upload, headers=TUS_HEADERS,
                  answer=self.patch_answer),
            Route("DELETE", re.compile(r"/v1/jobs/([^/]+)/uploads/([^/]+)"), DEFERRED, self.cancel_upload, headers=TUS_HEADERS),
            Route("POST", re.compile(r"/v1/jobs/([^/]+)/queries"), BLOCKING, self.post_query, MAX_QUERY_BODY, pool=SLOW_POOL),
            Route("GET", re.compile(r"/v1/jobs/([^/]+)/retention"), BLOCKING, self.get_retention),
            Route("PUT", re.compile(r"/v1/jobs/([^/]+)/retention"), BLOCKING, self.put_retention, MAX_JSON_BODY),
            Route("GET", re.compile(r"/v1/jobs/([^/]+)/rounds"), BLOCKING, self.get_rounds),
            Route("POST", re.compile(r"/v1/jobs/([^/]+)/leases"), BLOCKING, self.take_lease, MAX_JSON_BODY),
            Route("GET", re.compile(r"/v1/jobs/([^/]+)/secure"), DEFERRED, self.get_secure),
            Route("POST", re.compile(r"/v1/jobs/([^/]+)/secure/(keys|shares|signature|answer)"), DEFERRED, self.post_secure,
                  MAX_JSON_BODY),
            Route("GET", re.compile(r"/v1/jobs/([^/]+)/assignment"), BLOCKING, self.get_assignment),
            Route("POST", re.compile(r"/v1/internal/jobs/([^/]+)/rounds/([0-9]{1,18})/partials"), UPLOAD, self.post_partial,
                  status=202, internal=True),
            Route("GET", re.compile(r"/v1/internal/jobs/([^/]+)/model"), DOWNLOAD, self.get_local_model, internal=True),
            Route("GET", re.compile(r"/v1/internal/jobs/([^/]+)/part"), DOWNLOAD, self.get_peer_part, internal=True),
            Route("POST", re.compile(r"/v1/internal/jobs/([^/]+)/queries"), BLOCKING, self.post_peer_query, MAX_QUERY_BODY,
                  pool=SLOW_POOL, internal=True),
            Route("PUT", re.compile(r"/v1/jobs/([^/]+)/leases/([^/]+)"), BLOCKING, self.heartbeat),
            Route("DELETE", re.compile(r"/v1/jobs/([^/]+)/leases/([^/]+)"), BLOCKING, self.release_lease),
            Route("GET", re.compile(r"/metrics"), BLOCKING, self.metrics),
            Route("GET", re.compile(r"/healthz"), LOCAL, lambda req: json_response(200, {"ok": True})),
        ]

    def protocol(self, conn: Conn) -> HttpConnection:
        return HttpConnection(self, conn)

    def refuse(self, sock: socket.socket) -> None:
        sock.send(_REFUSAL)  # non-blocking: what does not fit in the socket's buffer is not sent

    def route(self, method: str, path: str) -> tuple[Route | None, tuple[str, ...], list[str]]:
        """The route of a request, its path's groups, and (if none) the methods the path allows."""
        allowed = []
        for route in self.routes:
            match = route.pattern.fullmatch(path)
            if match:
                if route.method == method:
                    return route, match.groups(), []
                allowed.append(route.method)
        return None, (), allowed

    def needs_caller(self, path: str) -> bool:
        """Whether a request must say who it is (not for health, nor open metrics)."""
        return not (path == HEALTH_CHECK[1] or (path == "/metrics" and self.service.open_metrics))

    # -- endpoints: BLOCKING ones run on the pool, with the body (if any) read -------------------
    @staticmethod
    def _json_body(req: Request, what: str) -> Any:
        data = bytes(req.data) or b"null"
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

    def get_quota(self, req: Request, caller: Principal, tenant: str) -> Response:
        return json_response(200, self.service.quota(caller, tenant))

    def put_quota(self, req: Request, caller: Principal, tenant: str) -> Response:
        return json_response(200, self.service.set_quota(caller, tenant, self._json_body(req, "quota")))

    def delete_quota(self, req: Request, caller: Principal, tenant: str) -> Response:
        return json_response(200, self.service.reset_quota(caller, tenant))

    def create_job(self, req: Request, caller: Principal) -> Response:
        return json_response(201, self.service.create_job(caller, self._json_body(req, "job")))

    def post_query(self, req: Request, caller: Principal, job: str) -> Response:
        return json_response(200, self.service.query(caller, job, self._json_body(req, "query")))

    def post_peer_query(self, req: Request, caller: Principal, job: str) -> Response:
        """A peer gateway asks for this node's part of a split query."""
        return json_response(200, self.service.peer_query(caller, job, self._json_body(req, "query")))

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

    def take_lease(self, req: Request, caller: Principal, job: str) -> Response:
        body = self._json_body(req, "lease request")
        client = body.get("client") if isinstance(body, dict) else None
        return json_response(201, self.service.take_lease(caller, job, client))

    def get_secure(self, req: Request, caller: Principal, job: str, done: Callable[..., None]) -> None:
        """The secure round's stage and what the client needs at it; with ``round`` and ``after``,
        once the round moved past that stage (or when ``wait_s`` ends): a long poll."""
        client, after, wait_s = stage_wait_query(req.query)

        def answered(view: dict[str, Any] | None, error: BaseException | None) -> None:
            done(json_response(200, view) if view is not None else None, error)

        self.service.secure_status(caller, job, client, after, wait_s, answered)

    def post_secure(self, req: Request, caller: Principal, job: str, call: str, done: Callable[..., None]) -> None:
        """A client's message for a stage of the secure round (its JSON body may hold ``wait_s``:
        the answer waits for the round to move past the message's stage)."""
        def answered(view: dict[str, Any] | None, error: BaseException | None) -> None:
            done(json_response(201 if call == "keys" else 200, view) if view is not None else None, error)

        self.service.secure_message(caller, job, call, lambda: self._json_body(req, f"a secure {call} message"), answered)

    def heartbeat(self, req: Request, caller: Principal, job: str, lease: str) -> Response:
        return json_response(200, self.service.heartbeat(caller, job, lease))

    def release_lease(self, req: Request, caller: Principal, job: str, lease: str) -> Response:
        self.service.release_lease(caller, job, lease)
        return Response(204)

    def list_jobs(self, req: Request, caller: Principal) -> Response:
        return json_response(200, {"jobs": self.service.job_names(caller)})

    def get_job(self, req: Request, caller: Principal, job: str) -> Response:
        return json_response(200, self.service.job_status(caller, job))

    def metrics(self, req: Request, caller: Principal | None) -> Response:
        return Response(200, self.service.metrics_text(caller), {"Content-Type": "text/plain; version=0.0.4; charset=utf-8"})

    # -- endpoints: blobs, on the loop ----------------------------------------------------------
    def put_model(self, req: Request, caller: Principal, job: str, done: Callable[..., None]) -> None:
        _require_framing(req)
        self.service.begin_model(caller, job, "http", req.body.length, done)

    def post_update(self, req: Request, caller: Principal, job: str, done: Callable[..., None]) -> None:
        _require_framing(req)
        self.service.begin_update(caller, job, update_fields(req.headers), "http", req.body.length, done)

    def post_partial(self, req: Request, caller: Principal, job: str, round_id: str, done: Callable[..., None]) -> None:
        """Another node's result of a round, for the top on this node (gateway to gateway)."""
        h = req.headers
        meta = PartialMeta.parse(round_id, h.get("x-lifl-epoch"), h.get("x-lifl-from-node"), h.get("x-lifl-samples"),
                                 h.get("x-lifl-updates"), h.get("x-lifl-partial"))
        _require_framing(req)
        self.service.begin_partial(caller, job, meta, req.body.length, done)

    # -- endpoints: resumable uploads (tus 1.0, gateway/tus.py), on the loop ------------------------
    def create_upload(self, req: Request, caller: Principal, job: str, done: Callable[..., None]) -> None:
        """A resumable upload of an update (POST with Upload-Length and the update's X-Lifl-* headers)."""
        if not req.body.ended:
            raise BadRequest("an upload is created by an empty POST (creation-with-upload is not supported): send its "
                             "bytes with PATCH", code="unexpected_body")

        def created(upload: Resumable | None, error: BaseException | None) -> None:
            if error is not None:
                done(None, error)
                return
            assert upload is not None
            location = f"/v1/jobs/{job}/uploads/{upload.id}"
            done(json_response(201, {"upload": upload.id, "location": location},
                               {"Location": location, **self.resumable.headers(upload)}), None)

        self.resumable.create(caller, job, req.headers, update_fields(req.headers), created)

    def upload_options(self, req: Request, caller: Principal, job: str, done: Callable[..., None]) -> None:
        """What the uploads of the job support (OPTIONS): the tus version, extensions and largest size."""

        def answer(size: int | None, error: BaseException | None) -> None:
            done(None if error else Response(204, headers={"Tus-Extension": tus.EXTENSIONS, "Tus-Max-Size": str(size)}),
                 error)

        self.service.update_limit(caller, job, answer)

    def upload_status(self, req: Request, caller: Principal, job: str, upload_id: str, done: Callable[..., None]) -> None:
        """HEAD: the upload's offset (the bytes the gateway holds), length and expiry."""
        done(Response(200, headers=self.resumable.status(caller, job, upload_id, req.headers)), None)

    def patch_upload(self, req: Request, caller: Principal, job: str, upload_id: str, done: Callable[..., None]) -> None:
        done(self.resumable.open_patch(caller, job, upload_id, req.headers, req.body.length), None)

    def patch_answer(self, writer: PatchWriter, result: dict[str, Any] | None) -> Response:
        """A PATCH's answer: 204 with the new offset, or the update's (202) if it completed the blob."""
        headers = self.resumable.headers(writer.upload)
        return Response(204, headers=headers) if result is None else json_response(202, result, headers)

    def cancel_upload(self, req: Request, caller: Principal, job: str, upload_id: str, done: Callable[..., None]) -> None:
        self.resumable.cancel(caller, job, upload_id, req.headers,
                              lambda _, error: done(None if error else Response(204), error))

    def get_model(self, req: Request, caller: Principal, job: str, done: Callable[..., None]) -> None:
        self.service.open_model(caller, job, done)

    def get_parts(self, req: Request, caller: Principal, job: str) -> Response:
        """Where each node's part of a job split across nodes is (docs/sharding.md)."""
        return json_response(200, self.service.parts(caller, job))

    def get_part(self, req: Request, caller: Principal, job: str, done: Callable[..., None]) -> None:
        """This node's part of the model of a job split across nodes."""
        self.service.open_part(caller, job, done)

    def get_peer_part(self, req: Request, caller: Principal, job: str, done: Callable[..., None]) -> None:
        self.service.open_part(caller, job, done, internal=True)

    def get_version(self, req: Request, caller: Principal, job: str, done: Callable[..., None]) -> None:
        """The job's version once it passes ``after`` (or when ``wait_s`` ends): a long poll."""
        after, wait_s = version_wait_query(req.query)

        def answered(view: dict[str, Any] | None, error: BaseException | None) -> None:
            done(json_response(200, view) if view is not None else None, error)

        self.service.wait_for_version(caller, job, after, wait_s, answered)

    def get_local_model(self, req: Request, caller: Principal, job: str, done: Callable[..., None]) -> None:
        """The model if this node holds it, never fetched from elsewhere (what peers ask for)."""
        self.service.open_peer_model(caller, job, done)


def _require_framing(req: Request) -> None:
    if not req.body.framed:
        raise BadRequest("a blob needs Content-Length or chunked Transfer-Encoding", code="length_required")


class HttpConnection(ConnectionProtocol):
    """One HTTP/1.1 connection's state machine, on the loop. ``_step`` is what ``readable`` does
    now: read a head, a JSON body, a blob, or a refused body that is dropped; between those the
    connection reads nothing (its request is with the service, or its answer being written)."""

    def __init__(self, server: HttpServer, conn: Conn) -> None:
        self.server = server
        self.service = server.service
        self.conn = conn
        self.request: Request | None = None
        self.route: Route | None = None
        self.groups: tuple[str, ...] = ()
        self.caller: Principal | None = None
        self.ingest: Ingest | None = None  # an upload in progress
        self._step: Callable[[], None] | None = None
        self._scan = 0  # where the search for the end of the head goes on
        self._decided: Response | None = None  # the answer, sent once the refused body is dropped
        self._unsent: Callable[[], None] | None = None  # what the answer being written holds (a model)
        self._await_head()

    # -- the connection's events ------------------------------------------------------------------
    def readable(self) -> None:
        step = self._step
        if step is None:
            return
        try:
            step()
        except Wait:
            pass
        except PeerGone as e:
            self._peer_gone(e)
        except LiflError as e:
            self._refuse(e)
        except Exception as e:  # a bug
            self._bug(e)

    def expired(self, phase: str) -> None:
        code = "head_timeout" if phase == HEAD else "body_timeout"
        self._refuse(RequestTimeout(self.conn.stall_message(), code=code))

    def closed(self) -> None:
        self._step = None
        if self.ingest is not None:
            ingest, self.ingest = self.ingest, None
            ingest.abort(None)  # the client went away: its round slot is given back
        if self._unsent is not None:
            release, self._unsent = self._unsent, None
            release()

    # -- a request ---------------------------------------------------------------------------------
    def _await_head(self) -> None:
        self.request, self.route, self.caller, self._decided = None, None, None, None
        self._scan = 0
        self.conn.set_phase(HEAD if self.conn.inbuf else IDLE)
        self._step = self._read_head
        self.conn.start_reading()

    def _read_head(self) -> None:
        conn = self.conn
        buf = conn.inbuf
        while (end := buf.find(b"\r\n\r\n", max(0, self._scan - 3), MAX_HEAD)) < 0:
            if len(buf) >= MAX_HEAD:
                raise HeadTooLarge(f"the request head exceeds {MAX_HEAD} bytes")
            self._scan = len(buf)
            conn.fill(min(READ_AHEAD, MAX_HEAD - len(buf)))
            if conn.phase == IDLE:
                conn.set_phase(HEAD)  # its first byte: the head's deadline starts
        self._serving()
        h = parse_head(conn.take(end + 4))
        self.request = Request(h.method, h.path, h.query, h.headers, Body(h.length, h.chunked), h.keep_alive,
                               conn.peer_certificate)
        self._dispatch()

    def _serving(self) -> None:
        """The request is with the gateway: nothing is read, nothing is charged to the peer."""
        self._step = None
        self.conn.pause_reading()
        self.conn.set_phase(BUSY)

    def _dispatch(self) -> None:
        req = self.request
        assert req is not None
        if self.conn.reserved and (req.method, req.path) != HEALTH_CHECK:
            self._respond(error_response(_too_many_connections()))
            return
        route, self.groups, allowed = self.server.route(req.method, req.path)
        if route is None:
            if allowed:
                r = json_response(405, BadRequest(f"{req.method} is not allowed on {req.path}", code="method_not_allowed").body())
                r.headers["Allow"] = ", ".join(allowed)  # type: ignore[index]
                self._respond(r)
            else:
                self._respond(error_response(NotFound(f"no such endpoint {req.method} {req.path}")))
            return
        self.route = route
        if route.kind == LOCAL:
            self._respond(route.handler(req))
        elif not self.server.needs_caller(req.path):
            self._authenticated(None, None)
        else:
            self.service.identify(req.headers.get("authorization"), req.peer_certificate, self.conn.peer, self._authenticated)

    def _authenticated(self, caller: Principal | None, error: BaseException | None) -> None:
        if self.conn.closed:
            return
        if error is not None:
            self._fail(error)
            return
        self.caller = caller
        route, req = self.route, self.request
        assert route is not None and req is not None
        try:
            if route.internal:
                assert caller is not None  # internal routes need one
                authorize(caller, Action.INTERNAL)  # the service checks the job too, once the request is read
            if route.kind == BLOCKING:
                if route.body_limit:
                    req.body.check_size(route.body_limit)
                    self._read_body(self._read_json)
                else:
                    self._run()
            elif route.kind == UPLOAD:
                route.handler(req, caller, *self.groups, done=self._ingest_opened)
            elif route.kind == DEFERRED and route.body_limit:  # a small JSON body, read before the handler runs
                req.body.check_size(route.body_limit)
                self._read_body(self._read_json)
            elif route.kind == DEFERRED:
                self._defer()
            else:
                route.handler(req, caller, *self.groups, done=self._model_opened)
        except LiflError as e:
            self._refuse(e)

    def _read_body(self, step: Callable[[], None]) -> None:
        """Read the body with ``step``, starting now (its bytes may be in, or it may have none).
        An exchange is sequential: whatever called this is done with the connection's state."""
        self.conn.set_phase(BODY)
        self._step = step
        self.conn.read_now()

    def _read_json(self) -> None:
        req, route = self.request, self.route
        assert req is not None and route is not None
        while not req.body.feed(self.conn.inbuf, req.data, route.body_limit):
            self.conn.fill()
        self._serving()
        if route.kind == DEFERRED:
            self._defer()
        else:
            self._run()

    def _defer(self) -> None:
        """The route's handler, on the loop: it answers through ``_answered`` when it is ready."""
        route, req = self.route, self.request
        assert route is not None and req is not None
        try:
            route.handler(req, self.caller, *self.groups, done=self._answered)
        except LiflError as e:
            self._refuse(e)

    def _run(self) -> None:
        """The route's handler, on the pool."""
        route, req, caller, groups = self.route, self.request, self.caller, self.groups
        assert route is not None
        self.server.loop.offload(lambda: route.handler(req, caller, *groups), self._answered, route.pool)

    def _answered(self, response: Response | None, error: BaseException | None) -> None:
        if self.conn.closed:
            if response is not None and response.after_send is not None:
                response.after_send()
            return
        if error is not None:
            self._fail(error)
        else:
            assert response is not None
            self._respond(response)

    # -- uploads -------------------------------------------------------------------------------------
    def _ingest_opened(self, ingest: Ingest | None, error: BaseException | None) -> None:
        if error is not None:
            if not self.conn.closed:
                self._fail(error)
            return
        assert ingest is not None and self.request is not None
        if self.conn.closed:
            ingest.abort(None)
            return
        self.ingest = ingest
        ingest.on_ready = lambda error: self._ingest_ready(ingest, error)
        if self.request.headers.get("expect", "").lower() == "100-continue":
            self.conn.write([CONTINUE])
        self._read_body(self._receive_blob)

    def _ingest_ready(self, ingest: Ingest, error: LiflError | None) -> None:
        """The agent answered the blob's admission: go on reading it, or refuse it."""
        if self.ingest is not ingest or self.conn.closed:
            return
        if error is not None:
            self._refuse(error)
        else:
            self.conn.read_now()  # the rest of the blob may be all in already

    def _receive_blob(self) -> None:
        """The body, straight into the blob's shared memory (its header first, into the sink's
        own buffer: the agent admits the blob from it, and this pauses until it has). When the
        body ends, ``finish`` decides: an update's body must have been the whole blob, a PATCH's
        may be a part of it; a body whose last bytes completed the header is answered only once
        the agent has answered its admission."""
        conn, req, ingest = self.conn, self.request, self.ingest
        assert req is not None and ingest is not None
        body, sink = req.body, ingest.sink
        while (n := body.next_data(conn.inbuf)) != 0:
            if not sink.ready:
                conn.pause_reading()  # the admission's answer starts reading again (_ingest_ready)
                return
            if n is None:
                conn.fill()
                continue
            view = sink.buffer()
            if not view:
                raise BadRequest("the body continues after the end of the blob", code="trailing_bytes")
            got = conn.read_into(view[:n])
            body.consumed(got)
            sink.advance(got)
        if not sink.ready:
            conn.pause_reading()
            return
        self._serving()
        ingest.finish(lambda result, error: self._ingest_finished(ingest, result, error))

    def _ingest_finished(self, ingest: Ingest, result: dict[str, Any] | None, error: BaseException | None) -> None:
        if self.ingest is not ingest or self.conn.closed:
            return
        self.ingest = None  # handed over: nothing to abort any more
        if error is not None:
            self._fail(error)
            return
        route = self.route
        assert route is not None
        self._respond(route.answer(ingest, result) if route.answer else json_response(route.status, result))

    # -- downloads -----------------------------------------------------------------------------------
    def _model_opened(self, view: ModelView | None, error: BaseException | None) -> None:
        if error is not None:
            if not self.conn.closed:
                self._fail(error)
            return
        assert view is not None
        if self.conn.closed:
            view.release()
            return
        req = self.request
        assert req is not None
        etag = f'"{view.version}"'  # a version's bytes never change: it tells a resumed download the same model
        try:
            part = requested_range(req.headers.get("range"), req.headers.get("if-range"), view.size, etag)
        except LiflError as e:
            view.release()
            self._refuse(e)
            return
        headers = {"Content-Type": "application/octet-stream", "X-Lifl-Version": str(view.version), "ETag": etag,
                   "Accept-Ranges": "bytes"}
        status, offset, count = 200, 0, view.size
        if part is not None:
            status, offset, count = 206, part.first, part.length
            headers["Content-Range"] = part.content_range()
        self.service.metrics.bytes_out.labels("http").inc(count)
        self._respond(Response(status, headers=headers, sendfile=(view.fd, offset, count), after_send=view.release))

    # -- answers ---------------------------------------------------------------------------------------
    def _fail(self, error: BaseException) -> None:
        if isinstance(error, LiflError):
            self._refuse(error)
        else:
            self._bug(error)

    def _refuse(self, error: LiflError) -> None:
        """The request fails with ``error``: give back what it held, then say so."""
        if self._decided is not None:  # the answer is decided; its body could not be dropped
            self._send(self._decided, close=True)
            return
        self._give_back(error, lambda: self._respond(error_response(error)))

    def _bug(self, error: BaseException) -> None:
        self._decided = None
        response = internal_error_response(error)
        self._give_back(None, lambda: self._respond(response))

    def _give_back(self, error: LiflError | None, then: Callable[[], None]) -> None:
        """Abort the upload in progress (if any), then ``then()``: a client told of a refusal
        finds its round slot free."""
        self._serving()
        ingest, self.ingest = self.ingest, None
        if ingest is None:
            then()
            return
        ingest.abort(error, then=lambda: None if self.conn.closed else then())

    def _peer_gone(self, e: PeerGone) -> None:
        if self.request is None:  # between requests, or inside a head
            if e.eof and self.conn.inbuf:
                self._refuse(BadRequest("connection closed in the middle of the request head", code="truncated"))
            else:
                self.conn.close()
        else:
            self._refuse(Body.end_of_stream())

    def _respond(self, response: Response) -> None:
        """Answer; a body that was not read is dropped first if it is small, so that the
        connection can serve the next request, else the connection closes after the answer."""
        req = self.request
        close = response.close or self.conn.reserved or req is None or not req.keep_alive
        if req is not None and not req.body.ended and not close:
            if req.body.drainable(DRAIN_LIMIT):
                self._decided = response
                self._read_body(self._drain)
                return
            close = True
        self._send(response, close=close)

    def _drain(self) -> None:
        req = self.request
        assert req is not None and self._decided is not None
        conn, body = self.conn, req.body
        while (n := body.next_data(conn.inbuf)) != 0:
            assert n is not None  # a Content-Length body has no framing
            take = min(n, len(conn.inbuf))
            if take:
                del conn.inbuf[:take]
                body.consumed(take)
            else:
                conn.fill(min(n, DRAIN_READ))
        response, self._decided = self._decided, None
        self._serving()
        self._send(response, close=False)

    def _send(self, response: Response, *, close: bool) -> None:
        self._serving()
        self._decided = None
        head = response_head(response, close=close, common=self.route.headers if self.route is not None else None)
        self._unsent = response.after_send

        def sent() -> None:
            if self._unsent is not None:
                release, self._unsent = self._unsent, None
                release()
            if close:
                self.conn.linger()
            else:
                self._await_head()

        if self.request is not None and self.request.method == "HEAD":  # the fields a GET would have, no body
            self.conn.write([head], then=sent)
        elif response.sendfile:
            fd, offset, count = response.sendfile
            self.conn.write([head])
            self.conn.sendfile(fd, count, then=sent, offset=offset)  # straight out of shared memory
        else:
            self.conn.write([head, response.body], then=sent)
