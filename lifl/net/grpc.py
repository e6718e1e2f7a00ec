"""gRPC's message framing over HTTP/2, as lifl's server and client SDK both speak it.

Every gRPC message is a 5-byte prefix (compressed flag, big-endian length) and its bytes. lifl
streams blobs as messages ``{meta = 1, data = 2}`` (UpdateChunk, ModelChunk): the client writes
them with ``chunk_messages`` straight from the blob, and the server parses them with
``MessageReader``, which receives each ``data`` field's bytes straight into the blob's
shared-memory object. Status travels in trailers (``status_trailers``).
"""

from __future__ import annotations

import re
import struct
import urllib.parse
from collections.abc import Callable, Iterator
from typing import Protocol

from lifl.errors import BadRequest, LiflError

GRPC_STATUS = {
    "OK": 0, "CANCELLED": 1, "UNKNOWN": 2, "INVALID_ARGUMENT": 3, "DEADLINE_EXCEEDED": 4, "NOT_FOUND": 5,
    "ALREADY_EXISTS": 6, "PERMISSION_DENIED": 7, "RESOURCE_EXHAUSTED": 8, "FAILED_PRECONDITION": 9, "ABORTED": 10,
    "OUT_OF_RANGE": 11, "UNIMPLEMENTED": 12, "INTERNAL": 13, "UNAVAILABLE": 14, "DATA_LOSS": 15, "UNAUTHENTICATED": 16,
}
STATUS_NAMES = {code: name for name, code in GRPC_STATUS.items()}
CONTENT_TYPE = "application/grpc"
MESSAGE_PREFIX_SIZE = 5
META_FIELD, DATA_FIELD = 1, 2  # UpdateChunk / ModelChunk
_PREFIX = struct.Struct(">BI")


def message_prefix(length: int) -> bytes:
    """The prefix of an uncompressed message of ``length`` bytes."""
    return _PREFIX.pack(0, length)


def parse_message_prefix(prefix: bytes | bytearray) -> tuple[int, int]:
    """(compressed flag, message length) of a 5-byte prefix."""
    return _PREFIX.unpack(prefix)


def varint(n: int) -> bytes:
    """A protobuf base-128 varint."""
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        out.append(b | (0x80 if n else 0))
        if not n:
            return bytes(out)


def _bytes_field(number: int, length: int) -> bytes:
    return bytes((number << 3 | 2,)) + varint(length)


def chunk_messages(meta: bytes, blob: bytes | bytearray | memoryview, chunk: int) -> Iterator[list[bytes | memoryview]]:
    """The messages of a blob stream, each a gather list whose data part is a view of ``blob``:
    first ``{meta}``, then ``{data}`` of at most ``chunk`` bytes each."""
    first = _bytes_field(META_FIELD, len(meta)) + meta
    yield [message_prefix(len(first)) + first]
    view = memoryview(blob).cast("B")
    for i in range(0, len(view), chunk):
        piece = view[i : i + chunk]
        field = _bytes_field(DATA_FIELD, len(piece))
        yield [message_prefix(len(field) + len(piece)) + field, piece]


class GrpcStatusError(Exception):
    """A call ended with a non-OK gRPC status; ``trailers`` holds lifl's details."""

    def __init__(self, status: int, message: str, trailers: dict[str, str]) -> None:
        super().__init__(f"{STATUS_NAMES.get(status, status)}: {message}")
        self.status, self.message, self.trailers = status, message, trailers


def status_trailers(error: LiflError) -> list[tuple[str, str]]:
    """The trailers that carry a lifl error: gRPC status and message, lifl's code, and the
    details a client acts on (the current version, a retry delay as gRPC's pushback)."""
    trailers = [("grpc-status", str(GRPC_STATUS.get(error.grpc_status, GRPC_STATUS["UNKNOWN"]))),
                ("grpc-message", urllib.parse.quote(error.message, safe=" ")), ("lifl-error-code", error.code)]
    if "version" in error.extra:
        trailers.append(("lifl-version", str(error.extra["version"])))
    if error.retry_after is not None:
        trailers.append(("grpc-retry-pushback-ms", str(int(error.retry_after * 1000))))
    return trailers


def call_result(trailers: dict[str, str], body: bytes | bytearray) -> bytes:
    """The reply message of a unary-reply call from its trailers and its DATA bytes, or
    GrpcStatusError for a failed call or a malformed reply."""
    status = int(trailers["grpc-status"]) if re.fullmatch(r"[0-9]{1,9}", trailers.get("grpc-status", "")) else GRPC_STATUS["UNKNOWN"]
    if status:
        raise GrpcStatusError(status, urllib.parse.unquote(trailers.get("grpc-message", "")), trailers)
    if len(body) < MESSAGE_PREFIX_SIZE:
        raise GrpcStatusError(GRPC_STATUS["INTERNAL"], "no reply message", trailers)
    compressed, length = parse_message_prefix(body[:MESSAGE_PREFIX_SIZE])
    if compressed or len(body) != MESSAGE_PREFIX_SIZE + length:
        raise GrpcStatusError(GRPC_STATUS["INTERNAL"], "malformed reply message", trailers)
    return bytes(body[MESSAGE_PREFIX_SIZE:])


class PayloadSource(Protocol):
    """The unread payload of one DATA frame."""

    left: int

    def take(self, limit: int) -> bytes:
        """At least one and at most ``limit`` of the remaining bytes."""

    def peek(self, limit: int) -> bytes:
        """At least one and at most ``limit`` of the remaining bytes, left unread (``take`` them)."""

    def readinto(self, view: memoryview) -> int:
        """Read at least one of the remaining bytes into ``view``; how many."""


class BlobTarget(Protocol):
    """Where a blob's bytes go (gateway.ingest.BlobSink)."""

    @property
    def ready(self) -> bool:
        """Whether it takes bytes now (not while the agent admits the blob)."""

    @property
    def done(self) -> bool: ...

    def buffer(self) -> memoryview: ...

    def advance(self, n: int) -> None: ...


class MessageReader:
    """Incremental parser of one request stream's messages.

    Unary mode (``open_blob`` None): collects the one message's bytes, at most ``max_unary``.
    Blob mode: each message is a chunk ``{meta, data}``; the first meta opens the blob
    (``open_blob``) and the bytes of every ``data`` field are received straight into it.
    Unknown fields are skipped, as protobuf requires. Malformed input raises LiflError.

    The blob may not take bytes at once: ``open_blob`` may return None (the caller opens it
    without waiting, then hands it over with ``opened``), and a blob may not be ``ready``. Then
    ``feed`` returns with the source not consumed (``waiting``), to be called again later.
    """

    PREFIX, TAG, LENGTH, SKIP_VARINT, BYTES = range(5)

    def __init__(self, open_blob: Callable[[bytes], BlobTarget | None] | None, *, max_unary: int, max_meta: int) -> None:
        self._open_blob = open_blob
        self._max_unary = max_unary
        self._max_meta = max_meta
        self._phase = self.PREFIX
        self._prefix = bytearray()
        self._msg_left = 0
        self._varint = bytearray()
        self._field = 0
        self._wire = 0
        self._field_left = 0
        self._meta = bytearray()
        self.opening = False  # the meta came, the blob is being opened
        self.sink: BlobTarget | None = None
        self.unary = bytearray()
        self.messages = 0

    @property
    def at_message_boundary(self) -> bool:
        """No message is partly received (a stream may end only here)."""
        return self._phase == self.PREFIX and not self._prefix

    @property
    def waiting(self) -> bool:
        """Whether the next bytes are a blob's that it cannot take yet."""
        if self._phase != self.BYTES or self._field != DATA_FIELD or self._wire != 2:
            return False
        return self.opening if self.sink is None else not self.sink.ready

    def opened(self, sink: BlobTarget) -> None:
        """The blob ``open_blob`` was opening, now open."""
        self.opening = False
        self.sink = sink

    def feed(self, src: PayloadSource) -> None:
        while src.left and not self.waiting:
            if self._phase == self.PREFIX:
                self._prefix += src.take(MESSAGE_PREFIX_SIZE - len(self._prefix))
                if len(self._prefix) == MESSAGE_PREFIX_SIZE:
                    self._start_message()
            elif self._open_blob is None:
                b = src.take(self._msg_left)
                self.unary += b
                self._msg_left -= len(b)
                self._end_message_if_done()
            elif self._phase == self.BYTES:
                self._feed_bytes(src)
            else:
                value = self._readvarint(src)
                if value is not None:
                    self._onvarint(value)

    def _start_message(self) -> None:
        compressed, self._msg_left = parse_message_prefix(self._prefix)
        if compressed:
            raise LiflError("compressed gRPC messages are not supported; use identity encoding",
                            code="unsupported_encoding", grpc_status="UNIMPLEMENTED")
        self._prefix.clear()
        self.messages += 1
        if self._open_blob is None and (self.messages > 1 or self._msg_left > self._max_unary):
            raise BadRequest(f"a unary request must be one message of at most {self._max_unary} bytes")
        self._phase = self.TAG
        self._end_message_if_done()

    def _end_message_if_done(self) -> None:
        if self._msg_left:
            return
        if self._phase != self.TAG or self._varint:
            raise BadRequest("a protobuf field runs past the end of its gRPC message")
        self._phase = self.PREFIX

    def _readvarint(self, src: PayloadSource) -> int | None:
        """The varint at hand once its last byte is in (None until then): its bytes are looked
        at together and only they are taken."""
        ahead = src.peek(min(10 - len(self._varint), self._msg_left))
        end = next((i + 1 for i, b in enumerate(ahead) if b < 0x80), len(ahead))
        src.take(end)
        self._msg_left -= end
        self._varint += ahead[:end]
        if self._varint[-1] >= 0x80:
            if len(self._varint) >= 10 or not self._msg_left:
                raise BadRequest("malformed protobuf varint")
            return None
        value = sum((x & 0x7F) << (7 * i) for i, x in enumerate(self._varint))
        self._varint.clear()
        return value

    def _onvarint(self, value: int) -> None:
        if self._phase == self.TAG:
            self._field, self._wire = value >> 3, value & 7
            if self._wire == 0:
                self._phase = self.SKIP_VARINT
            elif self._wire in (1, 5):
                self._begin_bytes(8 if self._wire == 1 else 4)
            elif self._wire == 2:
                self._phase = self.LENGTH
            else:
                raise BadRequest(f"unsupported protobuf wire type {self._wire}")
        elif self._phase == self.LENGTH:
            self._begin_bytes(value)
        else:  # SKIP_VARINT: a varint field's value, which we do not use
            self._phase = self.TAG
        self._end_message_if_done()

    def _begin_bytes(self, n: int) -> None:
        if n > self._msg_left:
            raise BadRequest("a protobuf field is longer than its gRPC message")
        self._field_left = n
        self._phase = self.BYTES
        if n == 0:
            self._end_field()

    def _feed_bytes(self, src: PayloadSource) -> None:
        want = min(self._field_left, src.left)
        length_delimited = self._wire == 2
        if self._field == DATA_FIELD and length_delimited:
            if self.sink is None:
                raise BadRequest("the first message of the stream must carry meta", code="missing_meta")
            if self.sink.done:
                raise BadRequest("data continues after the end of the blob", code="trailing_bytes")
            n = src.readinto(self.sink.buffer()[:want])
            self.sink.advance(n)
        else:
            chunk = src.take(want)
            n = len(chunk)
            if self._field == META_FIELD and length_delimited:
                self._meta += chunk
                if len(self._meta) > self._max_meta:
                    raise BadRequest(f"meta message is larger than {self._max_meta} bytes")
        self._field_left -= n
        self._msg_left -= n
        if not self._field_left:
            self._end_field()
            self._end_message_if_done()

    def _end_field(self) -> None:
        if self._field == META_FIELD and self._wire == 2:
            if self.sink is not None or self.opening:
                raise BadRequest("meta may only be sent in the first message", code="duplicate_meta")
            assert self._open_blob is not None
            self.opening = True
            sink = self._open_blob(bytes(self._meta))
            if sink is not None:
                self.opened(sink)
        self._phase = self.TAG
