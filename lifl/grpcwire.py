"""gRPC over HTTP/2 on the wire: what lifl's own gRPC server (gateway/grpc_server.py) and its
client upload path share, and that client.

Why lifl has its own client for uploads: grpcio takes each message as ``bytes`` and copies it
into its own buffers, so an update is copied twice in user space before the kernel copies it.
``UploadConnection`` writes the HTTP/2 frames itself and hands the kernel gather lists that
point into the caller's blob (``sendmsg``), as the HTTP client does. It speaks standard gRPC
(client streaming, identity encoding), within the server's flow-control windows; tests check it
against grpcio's own server.
"""

from __future__ import annotations

import socket
import struct
import urllib.parse
from collections.abc import Iterator, Sequence

import hpack

from lifl.gateway.stream import Stream

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
DATA, HEADERS, PRIORITY, RST_STREAM, SETTINGS, PUSH_PROMISE, PING, GOAWAY, WINDOW_UPDATE, CONTINUATION = range(10)
END_STREAM, ACK, END_HEADERS, PADDED, PRIORITY_FLAG = 0x1, 0x1, 0x4, 0x8, 0x20
S_HEADER_TABLE_SIZE, S_ENABLE_PUSH, S_MAX_CONCURRENT_STREAMS, S_INITIAL_WINDOW_SIZE, S_MAX_FRAME_SIZE, S_MAX_HEADER_LIST_SIZE = range(1, 7)
NO_ERROR, PROTOCOL_ERROR, INTERNAL_ERROR, FLOW_CONTROL_ERROR, STREAM_CLOSED, FRAME_SIZE_ERROR = 0, 1, 2, 3, 5, 6
CANCEL, COMPRESSION_ERROR = 8, 9
DEFAULT_WINDOW = 65535
DEFAULT_MAX_FRAME = 16384

GRPC_STATUS = {
    "OK": 0, "CANCELLED": 1, "UNKNOWN": 2, "INVALID_ARGUMENT": 3, "DEADLINE_EXCEEDED": 4, "NOT_FOUND": 5,
    "ALREADY_EXISTS": 6, "PERMISSION_DENIED": 7, "RESOURCE_EXHAUSTED": 8, "FAILED_PRECONDITION": 9, "ABORTED": 10,
    "OUT_OF_RANGE": 11, "UNIMPLEMENTED": 12, "INTERNAL": 13, "UNAVAILABLE": 14,
}
STATUS_NAMES = {code: name for name, code in GRPC_STATUS.items()}


def varint(n: int) -> bytes:
    """A protobuf base-128 varint."""
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        out.append(b | (0x80 if n else 0))
        if not n:
            return bytes(out)


def frame_header(length: int, ftype: int, flags: int, sid: int) -> bytes:
    return struct.pack(">I", length)[1:] + bytes((ftype, flags)) + struct.pack(">I", sid)


def sendmsg_all(sock: socket.socket, parts: Sequence[bytes | memoryview]) -> None:
    """Write every byte of a gather list (sendmsg may write part of it)."""
    views = [memoryview(p).cast("B") for p in parts if len(p)]
    while views:
        sent = sock.sendmsg(views)
        while sent and views:
            if sent >= len(views[0]):
                sent -= len(views[0])
                views.pop(0)
            else:
                views[0] = views[0][sent:]
                sent = 0


def chunk_messages(meta: bytes, blob: bytes | bytearray | memoryview, chunk: int) -> Iterator[list[bytes | memoryview]]:
    """The gRPC messages ``{meta = 1, data = 2}`` of a blob stream (UpdateChunk, ModelChunk), each
    a gather list whose data part is a view of ``blob``."""
    first = b"\x0a" + varint(len(meta)) + meta
    yield [b"\x00" + struct.pack(">I", len(first)) + first]
    view = memoryview(blob).cast("B")
    for i in range(0, len(view), chunk):
        piece = view[i : i + chunk]
        field = b"\x12" + varint(len(piece))
        yield [b"\x00" + struct.pack(">I", len(field) + len(piece)) + field, piece]


class GrpcStatusError(Exception):
    def __init__(self, status: int, message: str, trailers: dict[str, str]) -> None:
        super().__init__(f"{STATUS_NAMES.get(status, status)}: {message}")
        self.status, self.message, self.trailers = status, message, trailers


class UploadConnection:
    """One HTTP/2 connection for client-streaming gRPC calls, one call at a time."""

    def __init__(self, address: str, timeout: float = 300.0) -> None:
        host, _, port = address.rpartition(":")
        self.sock = socket.create_connection((host, int(port)), timeout=timeout)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._stream = Stream(self.sock)
        self._encoder, self._decoder = hpack.Encoder(), hpack.Decoder()
        self._conn_window = DEFAULT_WINDOW
        self._initial_window = DEFAULT_WINDOW
        self._max_frame = DEFAULT_MAX_FRAME
        self._next_sid = 1
        self._authority = address
        self._reply, self._trailers = bytearray(), None
        self._stream_window = DEFAULT_WINDOW
        self._settings_seen = False
        settings = struct.pack(">HIHI", S_ENABLE_PUSH, 0, S_INITIAL_WINDOW_SIZE, 1 << 24)
        sendmsg_all(self.sock, [PREFACE, frame_header(len(settings), SETTINGS, 0, 0), settings,
                                frame_header(4, WINDOW_UPDATE, 0, 0), struct.pack(">I", (1 << 30) - DEFAULT_WINDOW)])
        while not self._settings_seen:  # learn the server's frame size and windows before sending
            self._read_frame(0)

    def close(self) -> None:
        self.sock.close()

    def call(self, method: str, messages: Iterator[list[bytes | memoryview]]) -> bytes:
        """Send a client stream; returns the reply message, or raises GrpcStatusError."""
        sid, self._next_sid = self._next_sid, self._next_sid + 2
        self._stream_window = self._initial_window
        self._reply, self._trailers = bytearray(), None
        headers = [(":method", "POST"), (":scheme", "http"), (":path", method), (":authority", self._authority),
                   ("content-type", "application/grpc"), ("te", "trailers")]
        block = self._encoder.encode(headers)
        sendmsg_all(self.sock, [frame_header(len(block), HEADERS, END_HEADERS, sid), block])
        for parts in messages:
            if self._trailers is not None:  # the server answered (refused) before the end: stop sending
                break
            self._send_data(sid, parts)
        if self._trailers is None:
            sendmsg_all(self.sock, [frame_header(0, DATA, END_STREAM, sid)])
        return self._response(sid)

    def _send_data(self, sid: int, parts: list[bytes | memoryview]) -> None:
        parts = [memoryview(p).cast("B") for p in parts]
        remaining = sum(len(p) for p in parts)
        while remaining:
            while min(self._conn_window, self._stream_window) <= 0:
                self._read_frame(sid)  # wait for WINDOW_UPDATE (or for an early answer)
                if self._trailers is not None:
                    return
            n = min(remaining, self._max_frame, self._conn_window, self._stream_window)
            frame, need = [frame_header(n, DATA, 0, sid)], n
            while need:
                take = min(len(parts[0]), need)
                frame.append(parts[0][:take])
                parts[0] = parts[0][take:]
                need -= take
                if not len(parts[0]):
                    parts.pop(0)
            sendmsg_all(self.sock, frame)
            self._conn_window -= n
            self._stream_window -= n
            remaining -= n

    def _response(self, sid: int) -> bytes:
        while self._trailers is None:
            self._read_frame(sid)
        status = int(self._trailers.get("grpc-status", "2"))
        if status:
            raise GrpcStatusError(status, urllib.parse.unquote(self._trailers.get("grpc-message", "")), self._trailers)
        if len(self._reply) < 5:
            raise GrpcStatusError(GRPC_STATUS["INTERNAL"], "no reply message", self._trailers)
        (length,) = struct.unpack_from(">I", self._reply, 1)
        return bytes(self._reply[5 : 5 + length])

    def _read_exact(self, n: int) -> bytes:
        try:
            return self._stream.read_exact(n)
        except EOFError:
            raise ConnectionError("the gRPC server closed the connection") from None

    def _read_frame(self, sid: int) -> None:
        head = self._read_exact(9)
        length, ftype, flags = int.from_bytes(head[:3], "big"), head[3], head[4]
        stream = int.from_bytes(head[5:9], "big") & 0x7FFFFFFF
        payload = self._read_exact(length)
        if ftype == SETTINGS and not flags & ACK:
            for i in range(0, len(payload), 6):
                ident, value = struct.unpack_from(">HI", payload, i)
                if ident == S_INITIAL_WINDOW_SIZE:
                    self._stream_window += value - self._initial_window
                    self._initial_window = value
                elif ident == S_MAX_FRAME_SIZE:
                    self._max_frame = value
            self._settings_seen = True
            sendmsg_all(self.sock, [frame_header(0, SETTINGS, ACK, 0)])
        elif ftype == WINDOW_UPDATE:
            increment = struct.unpack(">I", payload)[0] & 0x7FFFFFFF
            if stream == 0:
                self._conn_window += increment
            elif stream == sid:
                self._stream_window += increment
        elif ftype == PING and not flags & ACK:
            sendmsg_all(self.sock, [frame_header(8, PING, ACK, 0), payload])
        elif ftype == GOAWAY:
            raise ConnectionError(f"the gRPC server sent GOAWAY: {payload[8:].decode(errors='replace')}")
        elif ftype == RST_STREAM and stream == sid and self._trailers is None:
            raise ConnectionError(f"the gRPC server reset the call (error {struct.unpack('>I', payload)[0]})")
        elif ftype == DATA and stream == sid:
            start, end = (1, len(payload) - payload[0]) if flags & PADDED else (0, len(payload))
            self._reply += payload[start:end]
            if length:  # give the window back: replies are small
                sendmsg_all(self.sock, [frame_header(4, WINDOW_UPDATE, 0, 0), struct.pack(">I", length)])
        elif ftype == HEADERS and stream == sid:
            block = payload[1 : len(payload) - payload[0]] if flags & PADDED else payload
            if flags & PRIORITY_FLAG:
                block = block[5:]
            while not flags & END_HEADERS:
                head = self._read_exact(9)
                flags |= head[4] & END_HEADERS
                block += self._read_exact(int.from_bytes(head[:3], "big"))
            headers = dict(self._decoder.decode(block, raw=False))
            if flags & END_STREAM:
                self._trailers = headers
