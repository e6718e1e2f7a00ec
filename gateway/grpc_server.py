"""The gateway's gRPC API (lifl.proto) over a minimal HTTP/2 server of its own.

Why not grpcio's server: it assembles every message into a bytes object before the handler
sees it, so an update would be copied twice more on its way to shared memory, which
measured at 2.3-2.5x a raw socket's time here. This server parses HTTP/2 frames, gRPC
message prefixes and the protobuf field tags itself, and receives the bytes of each
``data`` field with ``recv_into`` straight into the update's shared-memory object.
HPACK is the ``hpack`` package's. Models are streamed back with ``sendmsg`` from shared
memory, within the client's flow-control windows.

Scope: gRPC over cleartext HTTP/2 with prior knowledge (what gRPC clients do for
``insecure_channel``), identity encoding only, the RPCs of lifl.v1.Gateway.
"""

from __future__ import annotations

import socket
import struct
import threading
import traceback
import urllib.parse
from collections.abc import Callable
from typing import Any

import hpack

from lifl.errors import BadRequest, Internal, LiflError
from lifl.grpcwire import (
    ACK, COMPRESSION_ERROR, CONTINUATION, DATA, END_HEADERS, END_STREAM, FLOW_CONTROL_ERROR, FRAME_SIZE_ERROR, GOAWAY,
    GRPC_STATUS, HEADERS, NO_ERROR, PADDED, PING, PREFACE, PRIORITY_FLAG, PROTOCOL_ERROR, PUSH_PROMISE, RST_STREAM,
    S_HEADER_TABLE_SIZE, S_INITIAL_WINDOW_SIZE, S_MAX_CONCURRENT_STREAMS, S_MAX_FRAME_SIZE, S_MAX_HEADER_LIST_SIZE,
    SETTINGS, WINDOW_UPDATE, frame_header, sendmsg_all, varint,
)
from lifl.gateway import lifl_pb2 as pb
from lifl.gateway.ingest import BlobSink
from lifl.gateway.service import GatewayService, Ingest, ModelView, UpdateMeta
from lifl.gateway.stream import Stream, ThreadedServer

MAX_FRAME = (1 << 24) - 1  # frames we accept: the largest HTTP/2 allows, fewer frames per update
STREAM_WINDOW = 4 << 20  # per-stream receive window; replenished as the bytes are consumed
CONN_WINDOW = 1 << 30
MAX_STREAMS = 128
MAX_HEADER_BLOCK = 64 << 10
MAX_UNARY = 1 << 20
MAX_META = 64 << 10
MODEL_CHUNK = 1 << 20
IDLE_TIMEOUT = 300.0
SERVICE = "/lifl.v1.Gateway/"
UNARY = ("CreateJob", "GetJob", "GetModel", "TakeLease", "Heartbeat", "ReleaseLease", "GetRounds", "GetAssignment")


class ConnectionError_(Exception):
    """An HTTP/2 connection error: send GOAWAY and close."""

    def __init__(self, code: int, message: str) -> None:
        super().__init__(message)
        self.code = code


class FrameSource:
    """The unread payload of the current DATA frame."""

    def __init__(self, stream: Stream, length: int) -> None:
        self._stream = stream
        self.left = length

    def take(self, limit: int) -> bytes:
        b = self._stream.read_some(min(limit, self.left))
        self.left -= len(b)
        return b

    def readinto(self, view: memoryview) -> int:
        n = self._stream.readinto(view[: self.left])
        if n == 0:
            raise EOFError("connection closed inside a DATA frame")
        self.left -= n
        return n

    def skip(self) -> None:
        while self.left:
            self.take(self.left)


class MessageReader:
    """Incremental parser of one request stream's gRPC messages (5-byte prefix + protobuf).

    In *unary* mode it collects the single message's bytes. In *upload* mode each message is
    a chunk ``{1: meta, 2: data}``: the first meta opens the blob (``open_blob``), and the
    bytes of every ``data`` field are received straight into that blob's sink. Unknown
    fields are skipped, as protobuf requires.
    """

    PREFIX, TAG, LENGTH, SKIP_VARINT, BYTES = range(5)

    def __init__(self, open_blob: Callable[[bytes], BlobSink] | None) -> None:
        self._open_blob = open_blob
        self._phase = self.PREFIX
        self._prefix = bytearray()
        self._msg_left = 0
        self._varint = bytearray()
        self._field = 0
        self._wire = 0
        self._field_left = 0
        self._meta = bytearray()
        self.sink: BlobSink | None = None
        self.unary = bytearray()
        self.messages = 0

    def feed(self, src: FrameSource) -> None:
        while src.left:
            if self._phase == self.PREFIX:
                self._prefix += src.take(5 - len(self._prefix))
                if len(self._prefix) == 5:
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
        if self._prefix[0] != 0:
            raise LiflError("compressed gRPC messages are not supported; use identity encoding",
                            code="unsupported_encoding", grpc_status="UNIMPLEMENTED")
        self._msg_left = struct.unpack_from(">I", self._prefix, 1)[0]
        self._prefix.clear()
        self.messages += 1
        if self._open_blob is None and (self.messages > 1 or self._msg_left > MAX_UNARY):
            raise BadRequest("a unary request must be one message of at most 1 MiB")
        self._phase = self.TAG
        self._end_message_if_done()

    def _end_message_if_done(self) -> None:
        if self._msg_left:
            return
        if self._phase != self.TAG or self._varint:
            raise BadRequest("a protobuf field runs past the end of its gRPC message")
        self._phase = self.PREFIX

    def _readvarint(self, src: FrameSource) -> int | None:
        b = src.take(1)[0]
        self._msg_left -= 1
        self._varint.append(b)
        if b >= 0x80:
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

    def _feed_bytes(self, src: FrameSource) -> None:
        want = min(self._field_left, src.left)
        length_delimited = self._wire == 2
        if self._field == 2 and length_delimited:
            if self.sink is None:
                raise BadRequest("the first message of the stream must carry meta", code="missing_meta")
            if self.sink.done:
                raise BadRequest("data continues after the end of the blob", code="trailing_bytes")
            n = src.readinto(self.sink.buffer()[:want])
            self.sink.advance(n)
        else:
            chunk = src.take(want)
            n = len(chunk)
            if self._field == 1 and length_delimited:
                self._meta += chunk
                if len(self._meta) > MAX_META:
                    raise BadRequest("meta message is too large")
        self._field_left -= n
        self._msg_left -= n
        if not self._field_left:
            self._end_field()
            self._end_message_if_done()

    def _end_field(self) -> None:
        if self._field == 1 and self._wire == 2:
            if self.sink is not None:
                raise BadRequest("meta may only be sent in the first message", code="duplicate_meta")
            assert self._open_blob is not None
            self.sink = self._open_blob(bytes(self._meta))
        self._phase = self.TAG


class H2Stream:
    def __init__(self, sid: int, method: str, send_window: int) -> None:
        self.sid = sid
        self.method = method
        self.send_window = send_window
        self.reader: MessageReader | None = None
        self.ingest: Ingest | None = None
        self.unacked = 0
        self.failed = False  # answered with an error; its further DATA is dropped
        self.reset = False  # the client reset it
        self.sender: threading.Thread | None = None


class H2Connection:
    def __init__(self, sock: socket.socket, service: GatewayService) -> None:
        self.sock = sock
        self.service = service
        self.stream = Stream(sock)
        self.streams: dict[int, H2Stream] = {}
        self.last_sid = 0
        self._write = threading.Lock()
        self._window = threading.Condition()
        self._encoder = hpack.Encoder()
        self._decoder = hpack.Decoder(max_header_list_size=MAX_HEADER_BLOCK)
        self._peer_initial = 65535
        self._peer_max_frame = 16384
        self._conn_send_window = 65535
        self._conn_unacked = 0
        self._closed = False

    # -- writing ---------------------------------------------------------------------------------
    def _frame(self, ftype: int, flags: int, sid: int, *payload: bytes | memoryview) -> None:
        with self._write:
            sendmsg_all(self.sock, [frame_header(sum(len(p) for p in payload), ftype, flags, sid), *payload])

    def _headers(self, sid: int, headers: list[tuple[str, str]], end_stream: bool) -> None:
        with self._write:  # the encoder's table must see header blocks in the order they are sent
            block = self._encoder.encode(headers)
            sendmsg_all(self.sock, [frame_header(len(block), HEADERS, END_HEADERS | (END_STREAM if end_stream else 0), sid), block])

    def _reply(self, st: H2Stream, message: bytes) -> None:
        """Answer a call with one message. Its DATA counts against the client's flow-control
        windows like any other; if a model download has spent them, the reply waits for the
        client's WINDOW_UPDATE on a thread of its own (this reader thread must go on reading)."""
        self._headers(st.sid, [(":status", "200"), ("content-type", "application/grpc"), ("grpc-accept-encoding", "identity")], False)
        data = b"\x00" + struct.pack(">I", len(message)) + message
        if len(data) <= self._peer_max_frame and self._take_window(st, len(data)):
            self._frame(DATA, 0, st.sid, data)
            self._headers(st.sid, [("grpc-status", "0")], True)
            return
        st.sender = threading.Thread(target=self._reply_later, args=(st, data), daemon=True)
        st.sender.start()

    def _take_window(self, st: H2Stream, n: int) -> bool:
        with self._window:
            if min(self._conn_send_window, st.send_window) < n:
                return False
            self._conn_send_window -= n
            st.send_window -= n
            return True

    def _reply_later(self, st: H2Stream, data: bytes) -> None:
        try:
            self._send_data(st, [memoryview(data)])
            self._headers(st.sid, [("grpc-status", "0")], True)
        except (OSError, EOFError):
            pass

    def _fail(self, st: H2Stream, e: LiflError, headers_sent: bool = False) -> None:
        """Answer with an error status (trailers-only) and tell the client to stop sending."""
        trailers = [("grpc-status", str(GRPC_STATUS.get(e.grpc_status, 2))),
                    ("grpc-message", urllib.parse.quote(e.message, safe=" ")), ("lifl-error-code", e.code)]
        if "version" in e.extra:
            trailers.append(("lifl-version", str(e.extra["version"])))
        if e.retry_after is not None:
            trailers.append(("grpc-retry-pushback-ms", str(int(e.retry_after * 1000))))
        head = [] if headers_sent else [(":status", "200"), ("content-type", "application/grpc")]
        self._headers(st.sid, head + trailers, True)
        if not st.reset:
            self._frame(RST_STREAM, 0, st.sid, struct.pack(">I", NO_ERROR))
        st.failed = True

    # -- the connection ----------------------------------------------------------------------------
    def run(self) -> None:
        self.sock.settimeout(IDLE_TIMEOUT)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        try:
            if self.stream.read_exact(len(PREFACE)) != PREFACE:
                return
            settings = struct.pack(">HIHIHIHI", S_MAX_CONCURRENT_STREAMS, MAX_STREAMS, S_INITIAL_WINDOW_SIZE, STREAM_WINDOW,
                                   S_MAX_FRAME_SIZE, MAX_FRAME, S_MAX_HEADER_LIST_SIZE, MAX_HEADER_BLOCK)
            self._frame(SETTINGS, 0, 0, settings)
            self._frame(WINDOW_UPDATE, 0, 0, struct.pack(">I", CONN_WINDOW - 65535))
            while True:
                self._read_frame()
        except ConnectionError_ as e:
            try:
                self._frame(GOAWAY, 0, 0, struct.pack(">II", self.last_sid, e.code), str(e).encode()[:256])
            except OSError:
                pass
        except (EOFError, OSError):
            pass
        finally:
            self._shutdown()

    def _shutdown(self) -> None:
        with self._window:
            self._closed = True
            self._window.notify_all()
        for st in self.streams.values():
            if st.ingest is not None and not st.failed:
                st.ingest.abort(None)
            if st.sender is not None:
                st.sender.join()
        self.service.close_thread()
        self.sock.close()

    def _read_frame(self) -> None:
        head = self.stream.read_exact(9)
        length = int.from_bytes(head[:3], "big")
        ftype, flags = head[3], head[4]
        sid = int.from_bytes(head[5:9], "big") & 0x7FFFFFFF
        if length > MAX_FRAME:
            raise ConnectionError_(FRAME_SIZE_ERROR, f"frame of {length} bytes exceeds our maximum")
        if ftype == DATA:
            self._on_data(sid, flags, length)
            return
        payload = self.stream.read_exact(length)
        if ftype == HEADERS:
            self._on_headers(sid, flags, payload)
        elif ftype == SETTINGS:
            self._on_settings(flags, payload)
        elif ftype == WINDOW_UPDATE:
            self._on_window_update(sid, payload)
        elif ftype == PING:
            if not flags & ACK:
                self._frame(PING, ACK, 0, payload)
        elif ftype == RST_STREAM:
            self._on_reset(sid)
        elif ftype == GOAWAY:
            raise EOFError("client sent GOAWAY")
        elif ftype == PUSH_PROMISE:
            raise ConnectionError_(PROTOCOL_ERROR, "clients may not push")
        elif ftype == CONTINUATION:
            raise ConnectionError_(PROTOCOL_ERROR, "CONTINUATION without HEADERS")
        # PRIORITY and unknown frame types are ignored, as HTTP/2 requires

    def _on_settings(self, flags: int, payload: bytes) -> None:
        if flags & ACK:
            return
        if len(payload) % 6:
            raise ConnectionError_(FRAME_SIZE_ERROR, "SETTINGS payload is not a multiple of 6")
        with self._window:
            for i in range(0, len(payload), 6):
                ident, value = struct.unpack_from(">HI", payload, i)
                if ident == S_INITIAL_WINDOW_SIZE:
                    if value > 0x7FFFFFFF:
                        raise ConnectionError_(FLOW_CONTROL_ERROR, "initial window too large")
                    for st in self.streams.values():
                        st.send_window += value - self._peer_initial
                    self._peer_initial = value
                elif ident == S_MAX_FRAME_SIZE:
                    if not 16384 <= value <= MAX_FRAME:
                        raise ConnectionError_(PROTOCOL_ERROR, "bad SETTINGS_MAX_FRAME_SIZE")
                    self._peer_max_frame = value
                elif ident == S_HEADER_TABLE_SIZE:
                    with self._write:
                        self._encoder.header_table_size = value
            self._window.notify_all()
        self._frame(SETTINGS, ACK, 0)

    def _on_window_update(self, sid: int, payload: bytes) -> None:
        if len(payload) != 4:
            raise ConnectionError_(FRAME_SIZE_ERROR, "WINDOW_UPDATE must be 4 bytes")
        increment = struct.unpack(">I", payload)[0] & 0x7FFFFFFF
        with self._window:
            if sid == 0:
                self._conn_send_window += increment
            elif sid in self.streams:
                self.streams[sid].send_window += increment
            self._window.notify_all()

    def _on_reset(self, sid: int) -> None:
        st = self.streams.get(sid)
        if st is None:
            return
        st.reset = True
        if st.ingest is not None and not st.failed:
            st.ingest.abort(None)
            st.failed = True
        with self._window:
            self._window.notify_all()

    def _on_headers(self, sid: int, flags: int, payload: bytes) -> None:
        block = self._strip(flags, payload, priority=True)
        while not flags & END_HEADERS:
            head = self.stream.read_exact(9)
            length = int.from_bytes(head[:3], "big")
            if head[3] != CONTINUATION or int.from_bytes(head[5:9], "big") & 0x7FFFFFFF != sid:
                raise ConnectionError_(PROTOCOL_ERROR, "expected CONTINUATION")
            flags = (flags & ~END_HEADERS) | (head[4] & END_HEADERS)
            block += self.stream.read_exact(length)
            if len(block) > MAX_HEADER_BLOCK:
                raise ConnectionError_(PROTOCOL_ERROR, "header block too large")
        try:
            headers = dict(self._decoder.decode(block, raw=False))
        except hpack.HPACKError as e:
            raise ConnectionError_(COMPRESSION_ERROR, f"bad header block: {e}") from None
        if sid in self.streams:
            return  # trailers from the client; nothing we use
        if sid % 2 == 0 or sid <= self.last_sid:
            raise ConnectionError_(PROTOCOL_ERROR, f"bad stream id {sid}")
        self.last_sid = sid
        method = headers.get(":path", "")
        st = H2Stream(sid, method[len(SERVICE):] if method.startswith(SERVICE) else "", self._peer_initial)
        self.streams[sid] = st
        self._forget_finished()
        try:
            if len(self.streams) > MAX_STREAMS:
                raise LiflError("too many concurrent streams", code="too_many_streams", grpc_status="RESOURCE_EXHAUSTED")
            if headers.get(":method") != "POST" or not headers.get("content-type", "").startswith("application/grpc"):
                raise BadRequest("gRPC requests are POSTs with content-type application/grpc")
            if headers.get("grpc-encoding", "identity") != "identity":
                raise LiflError("only identity encoding is supported", code="unsupported_encoding", grpc_status="UNIMPLEMENTED")
            if st.method in ("SetModel", "PushUpdate"):
                st.reader = MessageReader(lambda meta, st=st: self._open_blob(st, meta))
            elif st.method in UNARY:
                st.reader = MessageReader(None)
            else:
                raise LiflError(f"unknown method {method}", code="unimplemented", grpc_status="UNIMPLEMENTED")
            if flags & END_STREAM:
                self._complete(st)
        except LiflError as e:
            self._fail(st, e)

    @staticmethod
    def _strip(flags: int, payload: bytes, *, priority: bool = False) -> bytes:
        start, end = 0, len(payload)
        if flags & PADDED:
            if not payload:
                raise ConnectionError_(PROTOCOL_ERROR, "padded frame without pad length")
            start, end = 1, len(payload) - payload[0]
        if priority and flags & PRIORITY_FLAG:
            start += 5
        if end < start:
            raise ConnectionError_(PROTOCOL_ERROR, "padding exceeds the frame")
        return payload[start:end]

    def _forget_finished(self) -> None:
        for sid in [s for s, st in self.streams.items() if st.failed and (st.sender is None or not st.sender.is_alive())]:
            del self.streams[sid]

    def _on_data(self, sid: int, flags: int, length: int) -> None:
        pad = 0
        if flags & PADDED:
            if length < 1:
                raise ConnectionError_(PROTOCOL_ERROR, "padded DATA without pad length")
            pad = self.stream.read_exact(1)[0]
            if pad >= length:
                raise ConnectionError_(PROTOCOL_ERROR, "padding exceeds the frame")
        src = FrameSource(self.stream, length - (1 if flags & PADDED else 0) - pad)
        st = self.streams.get(sid)
        try:
            if st is None or st.failed or st.reader is None:
                src.skip()
            else:
                try:
                    st.reader.feed(src)
                    if flags & END_STREAM:
                        self._complete(st)
                except LiflError as e:
                    if st.ingest is not None:
                        st.ingest.abort(e)
                    self._fail(st, e)
                    src.skip()
        finally:
            if pad:
                self.stream.read_exact(pad)
        self._ack_data(st, length)

    def _ack_data(self, st: H2Stream | None, length: int) -> None:
        """Replenish the receive windows as bytes are consumed (never for refused streams)."""
        self._conn_unacked += length
        if self._conn_unacked >= CONN_WINDOW // 2:
            self._frame(WINDOW_UPDATE, 0, 0, struct.pack(">I", self._conn_unacked))
            self._conn_unacked = 0
        if st is not None and not st.failed:
            st.unacked += length
            if st.unacked >= STREAM_WINDOW // 4:
                self._frame(WINDOW_UPDATE, 0, st.sid, struct.pack(">I", st.unacked))
                st.unacked = 0

    # -- RPCs ------------------------------------------------------------------------------------
    def _open_blob(self, st: H2Stream, meta_bytes: bytes) -> BlobSink:
        try:
            if st.method == "PushUpdate":
                m = pb.UpdateMeta.FromString(meta_bytes)
                meta = UpdateMeta.parse(m.job, m.client, m.samples, m.base_version, m.lease)
                st.ingest = self.service.begin_update(meta, "grpc", m.size or None)
            else:
                mm = pb.ModelMeta.FromString(meta_bytes)
                st.ingest = self.service.begin_model(mm.job, "grpc", mm.size or None)
        except LiflError:
            raise
        except Exception as e:  # protobuf decode errors
            raise BadRequest(f"bad meta message: {e}") from None
        return st.ingest.sink

    def _complete(self, st: H2Stream) -> None:
        """The client finished sending: run the call and answer."""
        reader = st.reader
        assert reader is not None
        if st.method in ("SetModel", "PushUpdate"):
            if reader.sink is None or st.ingest is None:
                raise BadRequest("the stream ended before any meta was sent", code="missing_meta")
            result = st.ingest.finish()
            if st.method == "PushUpdate":
                self._reply(st, pb.PushUpdateReply(key=result["key"], version=result["version"]).SerializeToString())
            else:
                self._reply(st, pb.SetModelReply(version=result["version"]).SerializeToString())
            st.failed = True  # finished: forget it
            return
        if reader.messages != 1:
            raise BadRequest("a unary request must be exactly one message")
        try:
            request = bytes(reader.unary)
            if st.method == "GetModel":
                req = pb.GetModelRequest.FromString(request)
                view = self.service.open_model(req.job)
                st.sender = threading.Thread(target=self._send_model, args=(st, req.job, view), daemon=True)
                st.sender.start()
                return
            self._reply(st, self._unary(st.method, request).SerializeToString())
        except LiflError:
            raise
        except Exception as e:
            if "DecodeError" in type(e).__name__:
                raise BadRequest(f"bad request message: {e}") from None
            raise
        st.failed = True

    def _unary(self, method: str, request: bytes) -> Any:
        service = self.service
        if method == "CreateJob":
            req = pb.CreateJobRequest.FromString(request)
            body: dict[str, Any] = {"job": req.job, "goal": req.goal}
            for name in ("tenant", "leaf_fan_in", "max_update_bytes", "max_inflight", "round_deadline_s", "min_updates",
                         "lease_ttl_s", "over_selection"):
                if getattr(req, name):  # proto3: 0 or "" means "use the default"
                    body[name] = getattr(req, name)
            return _job_status(service.create_job(body))
        if method == "GetJob":
            return _job_status(service.job_status(pb.GetJobRequest.FromString(request).job))
        if method == "TakeLease":
            req = pb.TakeLeaseRequest.FromString(request)
            return pb.Lease(**service.take_lease(req.job, req.client))
        if method == "Heartbeat":
            req = pb.LeaseRequest.FromString(request)
            return pb.Lease(**service.heartbeat(req.job, req.lease))
        if method == "ReleaseLease":
            req = pb.LeaseRequest.FromString(request)
            service.release_lease(req.job, req.lease)
            return pb.Lease(lease=req.lease)
        if method == "GetAssignment":
            req = pb.AssignmentRequest.FromString(request)
            return pb.Assignment(**service.assignment(req.job, req.client))
        req = pb.GetRoundsRequest.FromString(request)
        return pb.Rounds(rounds=[_last_round(r) for r in service.rounds(req.job, req.limit or 100)])

    def _send_model(self, st: H2Stream, job: str, view: ModelView) -> None:
        headers_sent = False
        try:
            mm = self.service.mappings.map_fd(view.fd, writable=False)
            data = memoryview(mm)[: view.size]
            self._headers(st.sid, [(":status", "200"), ("content-type", "application/grpc")], False)
            headers_sent = True
            meta = pb.ModelMeta(job=job, version=view.version, size=view.size).SerializeToString()
            offset = 0
            while offset < view.size or offset == 0:
                n = min(MODEL_CHUNK, view.size - offset)
                fields = (b"\x0a" + varint(len(meta)) + meta if offset == 0 else b"") + b"\x12" + varint(n)
                prefix = b"\x00" + struct.pack(">I", len(fields) + n) + fields
                self._send_data(st, [memoryview(prefix), data[offset : offset + n]])
                offset += n
                if n == 0:
                    break
            del data
            self._headers(st.sid, [("grpc-status", "0")], True)
            self.service.metrics.bytes_out.labels("grpc").inc(view.size)
        except LiflError as e:
            self._fail(st, e, headers_sent)
        except (OSError, EOFError):
            pass
        except Exception as e:
            traceback.print_exc()
            self._fail(st, Internal(str(e)), headers_sent)
        finally:
            view.release()
            st.failed = True

    def _send_data(self, st: H2Stream, parts: list[memoryview]) -> None:
        """Send bytes as DATA frames within the peer's frame size and flow-control windows."""
        remaining = sum(len(p) for p in parts)
        while remaining:
            with self._window:
                while not (self._closed or st.reset) and min(self._conn_send_window, st.send_window) <= 0:
                    self._window.wait()
                if self._closed or st.reset:
                    raise EOFError("stream closed while sending")
                n = min(remaining, self._peer_max_frame, self._conn_send_window, st.send_window)
                self._conn_send_window -= n
                st.send_window -= n
            frame_parts, need = [], n
            while need:
                p = parts[0]
                take = min(len(p), need)
                frame_parts.append(p[:take])
                need -= take
                if take == len(p):
                    parts.pop(0)
                else:
                    parts[0] = p[take:]
            self._frame(DATA, 0, st.sid, *frame_parts)
            remaining -= n


def _optional(value: Any) -> int:
    return -1 if value is None else value


def _last_round(r: dict[str, Any]) -> pb.LastRound:
    return pb.LastRound(
        version=r["version"], updates=r["updates"], samples=r["samples"], seconds=r["seconds"] or 0.0,
        outcome=r["outcome"], round=r["round"], new_version=_optional(r["new_version"]), reason=r.get("reason", ""),
        nodes=r.get("nodes", {}), top=r.get("top") or "", lost=r.get("lost", {}),
    )


def _job_status(status: dict[str, Any]) -> pb.JobStatus:
    rnd = status["round"]
    out = pb.JobStatus(
        job=status["job"], tenant=status["tenant"], goal=status["goal"], leaf_fan_in=status["leaf_fan_in"],
        version=_optional(status["version"]), queued=status["queued"],
        round=pb.RoundStatus(
            version=_optional(rnd["version"]), received=rnd["received"], in_progress=rnd["in_progress"],
            aggregated=rnd["aggregated"], rejected=rnd["rejected"], id=_optional(rnd["id"]),
            opened_at=rnd["opened_at"] or 0.0, closed=rnd["closed"], leases=rnd["leases"],
            nodes=rnd["nodes"], top=rnd["top"] or "", lost=rnd["lost"],
        ),
        aggregators=status["aggregators"],
    )
    if status.get("last_round"):
        out.last_round.CopyFrom(_last_round(status["last_round"]))
    return out


class GrpcServer(ThreadedServer):
    def __init__(self, service: GatewayService, host: str, port: int) -> None:
        super().__init__(host, port)
        self.service = service

    def serve(self, sock: socket.socket) -> None:
        H2Connection(sock, self.service).run()
