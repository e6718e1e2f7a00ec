"""The client SDK's own gRPC upload path, on lifl's HTTP/2 codec (``lifl.net.h2``) and gRPC
framing (``lifl.net.grpc``), which lifl's gRPC server (gateway/grpc_server.py) uses too.

Why lifl has its own client for uploads: grpcio takes each message as ``bytes`` and copies it
into its own buffers, so an update is copied twice in user space before the kernel copies it.
``UploadConnection`` hands the kernel gather lists that point into the caller's blob
(``sendmsg``), as the HTTP client does. It speaks standard gRPC (client streaming, identity
encoding), within the server's flow-control windows; tests check it against grpcio's server.
Over TLS (ALPN ``h2``) the frames go through ``sendall`` instead (lifl.net.io).
"""

from __future__ import annotations

import socket
import ssl
from collections import deque
from collections.abc import Iterator, Sequence

from lifl.net import h2
from lifl.net.grpc import CONTENT_TYPE, GRPC_STATUS, STATUS_NAMES, GrpcStatusError, call_result, chunk_messages
from lifl.net.io import MAX_FRAMES_PER_WRITE, sendmsg_all, take_views
from lifl.net.tls import ALPN_H2, ClientTls, server_name

__all__ = ["GRPC_STATUS", "STATUS_NAMES", "GrpcStatusError", "UploadConnection", "chunk_messages"]

# The client receives small replies only: frames of the default size, and windows large enough
# that the server never waits for our WINDOW_UPDATEs.
CLIENT_LIMITS = h2.Limits(max_frame_size=h2.DEFAULT_MAX_FRAME_SIZE, stream_window=1 << 24)
RECEIVE_CHUNK = 1 << 16
MAX_REPLY_BYTES = 1 << 20  # a reply is a small protobuf (PushUpdateReply, SetModelReply)


class _Call:
    def __init__(self, stream_id: int) -> None:
        self.stream_id = stream_id
        self.body = bytearray()
        self.trailers: dict[str, str] | None = None  # set when the server ended the stream


class UploadConnection:
    """One HTTP/2 connection for client-streaming gRPC calls, one call at a time. A connection
    the server has closed between calls (GOAWAY after its idle timeout) is replaced before the
    next call is sent; failures during a call raise ConnectionError. With ``tls`` the
    connection is TLS (ssl.SSLCertVerificationError if the server's certificate is not trusted)."""

    def __init__(self, address: str, timeout: float = 300.0, tls: ClientTls | None = None) -> None:
        host, _, port = address.rpartition(":")
        self._address = (host, int(port))
        self._authority = address
        self._timeout = timeout
        self._tls = (tls.context(ALPN_H2), server_name(address, tls)) if tls is not None else None
        self._connect()

    def close(self) -> None:
        self.sock.close()

    def call(self, method: str, messages: Iterator[list[bytes | memoryview]],
             metadata: Sequence[tuple[str, str]] = ()) -> bytes:
        """Send a client stream (with ``metadata``: custom headers, e.g. authorization); returns the
        reply message, or raises GrpcStatusError."""
        if self._server_gone():
            self.close()
            self._connect()
        call = self._call = _Call(self._h2.new_stream_id())
        self._h2.send_headers(call.stream_id, [
            (":method", "POST"), (":scheme", "https" if self._tls else "http"), (":path", method), (":authority", self._authority),
            ("content-type", CONTENT_TYPE), ("te", "trailers"), *metadata])
        self._flush()
        for parts in messages:
            if call.trailers is not None:  # the server answered (refused) before the end: stop sending
                break
            self._send_message(call, parts)
        if call.trailers is None:
            try:
                sendmsg_all(self.sock, [self._h2.send_data(call.stream_id, 0, end_stream=True)])
            except h2.StreamClosedError:
                pass  # answered meanwhile
        while call.trailers is None:
            self._receive()
        self._h2.reset_stream(call.stream_id, h2.CANCEL)  # answered before we finished sending: we stop (else a no-op)
        self._flush()
        return call_result(call.trailers, call.body)

    # -- the connection ------------------------------------------------------------------------------
    def _connect(self) -> None:
        self.sock = socket.create_connection(self._address, timeout=self._timeout)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if self._tls is not None:
            context, name = self._tls
            try:
                self.sock = context.wrap_socket(self.sock, server_hostname=name)
            except BaseException:
                self.sock.close()
                raise
        self._h2 = h2.Connection(h2.Side.CLIENT, CLIENT_LIMITS)
        self._h2.initiate()
        self._call: _Call | None = None
        self._settings_seen = False
        self._goaway = False
        self._flush()
        while not self._settings_seen:  # learn the server's frame size and windows before sending
            self._receive()

    def _server_gone(self) -> bool:
        """Whether the server said GOAWAY or closed since the last call (read without waiting)."""
        if self._goaway:
            return True
        self.sock.setblocking(False)
        try:
            while not self._goaway:
                data = self.sock.recv(RECEIVE_CHUNK)
                if not data:
                    return True
                self._handle(self._h2.receive_bytes(data))
        except (BlockingIOError, ssl.SSLWantReadError):
            pass  # nothing more to read (over TLS: perhaps a record without data, a session ticket)
        except (OSError, h2.H2ConnectionError):
            return True
        finally:
            self.sock.settimeout(self._timeout)
        if not self._goaway:
            self._flush()  # ACKs of what came meanwhile
        return self._goaway

    def _send_message(self, call: _Call, parts: list[bytes | memoryview]) -> None:
        """One message, as DATA frames within the server's windows; the frames the windows allow
        at once go out in one system call."""
        views = deque(memoryview(p).cast("B") for p in parts)
        remaining = sum(len(v) for v in views)
        while remaining:
            try:
                window = self._h2.send_window(call.stream_id)
            except h2.StreamClosedError:
                return  # the server ended the call; its answer follows
            if window <= 0:
                self._receive()  # a WINDOW_UPDATE (or an early answer)
                if call.trailers is not None:
                    return
                continue
            gather: list[bytes | memoryview] = []
            budget = min(remaining, window, MAX_FRAMES_PER_WRITE * self._h2.peer_max_frame_size)
            remaining -= budget
            while budget:
                n = min(budget, self._h2.peer_max_frame_size)
                gather.append(self._h2.send_data(call.stream_id, n))
                gather += take_views(views, n)
                budget -= n
            sendmsg_all(self.sock, gather)

    def _receive(self) -> None:
        data = self.sock.recv(RECEIVE_CHUNK)
        if not data:
            raise ConnectionError("the gRPC server closed the connection")
        try:
            events = self._h2.receive_bytes(data)
        except h2.H2ConnectionError as e:
            sendmsg_all(self.sock, [self._h2.goaway(e.code, str(e))])
            raise ConnectionError(f"the gRPC server broke HTTP/2: {e}") from None
        self._handle(events)
        self._flush()

    def _handle(self, events: list[h2.Event]) -> None:
        for ev in events:
            call = self._call
            in_call = call is not None and call.trailers is None
            if isinstance(ev, h2.SettingsReceived):
                self._settings_seen = True
            elif isinstance(ev, h2.GoAwayReceived):
                self._goaway = True
                if in_call:
                    raise ConnectionError(f"the gRPC server sent GOAWAY: {ev.debug.decode(errors='replace')}")
            elif in_call and getattr(ev, "stream_id", None) == call.stream_id:
                self._on_call_event(call, ev)

    @staticmethod
    def _on_call_event(call: _Call, ev: h2.Event) -> None:
        if isinstance(ev, h2.DataReceived):
            call.body += ev.data
            if len(call.body) > MAX_REPLY_BYTES:
                raise ConnectionError(f"the gRPC server's reply exceeds {MAX_REPLY_BYTES} bytes")
        elif isinstance(ev, h2.HeadersReceived) and ev.end_stream:
            call.trailers = dict(ev.headers)
        elif isinstance(ev, h2.StreamReset):
            raise ConnectionError(f"the gRPC server reset the call (error {ev.error_code})")

    def _flush(self) -> None:
        if self._h2.has_data_to_send:
            sendmsg_all(self.sock, [self._h2.data_to_send()])
